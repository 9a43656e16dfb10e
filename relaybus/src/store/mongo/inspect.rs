//! What the operator page reads besides counts and listings: one event with all its
//! deliveries, the lanes with the keys held back in them, and the dead letters grouped by
//! error. Every value from a request reaches a query as a string.

use futures::TryStreamExt;
use mongodb::bson::{Bson, Document, RawDocumentBuf, doc};

use super::{
    MongoEventStore,
    claim::hand_out::envelope,
    lane::{Lane, int, string, strings},
    operator::{aggregate_hinted, in_flight, record_from_document},
    purge::unstamped_by,
    schema::{self, field, index, status},
    timestamp,
};
use crate::error::Result;
use crate::store::{
    BlockedKey, DeadLetterGroup, DeliveryRecord, DeliveryStatus, EventDetail, LaneReport,
    LaneStatus, MAX_BLOCKED_KEYS, MAX_DEAD_LETTER_GROUPS,
};

/// When an event completed: its `completedAt`, or, once no pending or dead delivery of it is
/// left, the `completingAt` mark that completions of earlier releases wrote before the
/// deliveries went (it stands for a stamp they wrote after the delete and lost in a failover),
/// or for a fresh event whose quick completions stamped nothing, the latest they can have come
/// ([`unstamped_by`]).
fn completed_at(event: &Document, deliveries: &[DeliveryRecord]) -> Option<crate::Timestamp> {
    let unfinished = deliveries
        .iter()
        .any(|d| matches!(d.status, DeliveryStatus::Pending | DeliveryStatus::Dead));
    let stamp = |name: &str| event.get_datetime(name).ok().map(|at| timestamp(*at));
    match stamp(field::COMPLETED_AT) {
        Some(at) => Some(at),
        None if !unfinished => {
            stamp(field::COMPLETING_AT).or_else(|| unstamped_by(event).flatten().map(timestamp))
        }
        None => None,
    }
}

fn count(doc: &Document, name: &str) -> u64 {
    int(doc, name).map_or(0, |n| n.max(0) as u64)
}

impl MongoEventStore {
    /// The event `event_id` with all its deliveries: pending and dead ones, and completion
    /// records with completion history on. `None` when no event has this id.
    ///
    /// # Errors
    ///
    /// [`Error::Database`](crate::Error::Database).
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it only reads.
    pub async fn event_detail(&self, event_id: &str) -> Result<Option<EventDetail>> {
        let inner = &self.inner;
        let raw = inner
            .events
            .clone_with_type::<RawDocumentBuf>()
            .find_one(doc! { field::ID: event_id })
            .await?;
        let Some(raw) = raw else {
            return Ok(None);
        };
        let event = envelope(event_id, &raw);
        let doc: Document = raw.to_document().unwrap_or_default();
        let by_event = doc! { field::EVENT_ID: event_id };
        let running = in_flight(&inner.lanes).await?;
        let mut deliveries: Vec<DeliveryRecord> = inner
            .deliveries
            .find(by_event.clone())
            .await?
            .try_collect::<Vec<Document>>()
            .await?
            .iter()
            .filter_map(|doc| {
                let mut record = record_from_document(doc)?;
                record.running = record.status == DeliveryStatus::Pending
                    && doc
                        .get_object_id(field::ID)
                        .is_ok_and(|id| running.contains(&id));
                Some(record)
            })
            .collect();
        if inner.completion_history {
            let history: Vec<Document> =
                inner.completed.find(by_event).await?.try_collect().await?;
            deliveries.extend(history.iter().filter_map(record_from_document));
        }
        deliveries.sort_by(|a, b| a.handler.cmp(&b.handler).then(a.id.cmp(&b.id)));
        Ok(Some(EventDetail {
            event,
            sequence: int(&doc, field::SEQUENCE),
            completed_at: completed_at(&doc, &deliveries),
            handlers: strings(&doc, field::HANDLERS),
            deliveries,
        }))
    }

    /// Every lane with its holder, and the keys with parked deliveries (the most parked first,
    /// at most 100) with what they wait for: their key's lowest pending delivery that is not
    /// parked.
    ///
    /// # Errors
    ///
    /// [`Error::Database`](crate::Error::Database).
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it only reads.
    pub async fn lanes(&self) -> Result<LaneReport> {
        let inner = &self.inner;
        let lane_docs: Vec<Document> = inner
            .lanes
            .find(doc! {})
            .sort(doc! { field::ID: 1 })
            .await?
            .try_collect()
            .await?;
        let lanes = lane_docs
            .iter()
            .filter_map(|doc| {
                let lane = Lane::from_document(doc)?;
                let mut status = LaneStatus::new(u32::try_from(lane.id).ok()?);
                status.owner = string(doc, field::OWNER);
                status.lease_expires_at = lane.lease_expires_at.map(timestamp);
                status.in_flight = u32::try_from(lane.in_flight.len()).unwrap_or(u32::MAX);
                status.lost = u32::try_from(lane.lost.len()).unwrap_or(u32::MAX);
                status.epoch = lane.epoch;
                Some(status)
            })
            .collect();
        let groups = aggregate_hinted(
            &inner.deliveries,
            vec![
                doc! { "$match": { field::LANE: schema::lane::PARKED } },
                doc! { "$group": {
                    field::ID: {
                        "h": format!("${}", field::HANDLER),
                        "k": format!("${}", field::KEY),
                    },
                    "n": { "$sum": 1 },
                    "first": { "$min": format!("${}", field::SEQUENCE) },
                } },
                doc! { "$sort": { "n": -1, "_id.h": 1, "_id.k": 1 } },
                doc! { "$limit": MAX_BLOCKED_KEYS as i64 },
            ],
            index::PARKED,
        )
        .await?;
        let running = in_flight(&inner.lanes).await?;
        let heads = groups.iter().map(|group| async move {
            let id = group.get_document(field::ID).ok()?;
            let handler = id.get_str("h").ok()?.to_owned();
            let key = id.get_str("k").ok()?.to_owned();
            let head = inner
                .deliveries
                .find_one(doc! {
                    field::STATUS: status::PENDING,
                    field::HANDLER: &handler,
                    field::KEY: &key,
                    field::LANE: { "$ne": schema::lane::PARKED },
                    field::UNORDERED: { "$ne": true },
                })
                .sort(index::ordering_keys())
                .await;
            Some((group, handler, key, head))
        });
        let mut blocked = Vec::new();
        for found in futures::future::join_all(heads).await.into_iter().flatten() {
            let (group, handler, key, head) = found;
            let waiting_for = head?.as_ref().and_then(|doc| {
                let mut record = record_from_document(doc)?;
                record.running = doc
                    .get_object_id(field::ID)
                    .is_ok_and(|id| running.contains(&id));
                Some(record)
            });
            blocked.push(BlockedKey {
                handler,
                key,
                parked: count(group, "n"),
                first_parked_sequence: int(group, "first"),
                waiting_for,
            });
        }
        Ok(LaneReport { lanes, blocked })
    }

    /// Dead letters grouped by handler and last error, the largest groups first, at most 200;
    /// only `handler`'s when given.
    ///
    /// # Errors
    ///
    /// [`Error::Database`](crate::Error::Database).
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it only reads.
    pub async fn dead_letter_groups(&self, handler: Option<&str>) -> Result<Vec<DeadLetterGroup>> {
        let mut matched = doc! { field::STATUS: status::DEAD };
        if let Some(handler) = handler {
            matched.insert(field::HANDLER, Bson::String(handler.to_owned()));
        }
        let groups = aggregate_hinted(
            &self.inner.deliveries,
            vec![
                doc! { "$match": matched },
                doc! { "$group": {
                    field::ID: {
                        "h": format!("${}", field::HANDLER),
                        "e": format!("${}", field::LAST_ERROR),
                    },
                    "n": { "$sum": 1 },
                    "first": { "$min": format!("${}", field::CREATED_AT) },
                    "last": { "$max": format!("${}", field::UPDATED_AT) },
                    "sample": { "$min": "$_id" },
                } },
                doc! { "$sort": { "n": -1, "_id.h": 1, "_id.e": 1 } },
                doc! { "$limit": MAX_DEAD_LETTER_GROUPS as i64 },
            ],
            index::STATUS_CREATED,
        )
        .await?;
        Ok(groups
            .iter()
            .filter_map(|group| {
                let id = group.get_document(field::ID).ok()?;
                Some(DeadLetterGroup {
                    handler: id.get_str("h").ok()?.to_owned(),
                    error: id.get_str("e").ok().map(str::to_owned),
                    count: count(group, "n"),
                    first_created_at: group.get_datetime("first").ok().map(|at| timestamp(*at)),
                    last_updated_at: group.get_datetime("last").ok().map(|at| timestamp(*at)),
                    sample_id: group.get_object_id("sample").ok()?.to_hex(),
                })
            })
            .collect())
    }
}
