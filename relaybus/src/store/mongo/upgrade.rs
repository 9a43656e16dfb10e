//! The upgrade of a 0.1.0 database, run by `setup()` while the lane documents do not exist yet:
//! they are seeded last, and mark the upgrade as done.
//!
//! Every step selects only documents it has not changed yet and works through them in batches
//! of [`BATCH`], so the upgrade is idempotent and resumes where a crash left it: the next
//! `setup()` finds no lane documents and runs it again, redoing nothing that was done.
//!
//! What it assumes of 0.1.0 beyond what the specification names (the `processing` status, the
//! `running` and `claim` indexes, and that deliveries lacked `laneId` and events `handlers` and
//! `createdAt`): deliveries had the fields of today's (`eventId`, `handler`, `key`, `status`,
//! `attempts`, `dueAt`, `createdAt`), no `lane` field, and a per-delivery lease in some of the
//! fields [`LEASE_FIELDS`]; a claim counted its attempt when it made the delivery `processing`.

use futures::TryStreamExt;
use mongodb::{
    IndexModel,
    bson::{Bson, DateTime, Document, doc, oid::ObjectId},
};

use super::{
    MongoEventStore, error_code,
    lane::{ids_of, reply_count, string},
    schema::{field, index, lane, status},
};
use crate::{error::Result, event::lane_of};

/// Documents per batch.
pub(crate) const BATCH: i64 = 1_000;
/// The status 0.1.0 gave a claimed delivery.
pub(super) const PROCESSING: &str = "processing";
/// The 0.1.0 index of claimed deliveries, dropped.
const RUNNING_INDEX: &str = "running";
/// The per-delivery lease fields of 0.1.0, removed (lanes lease deliveries now).
pub(crate) const LEASE_FIELDS: [&str; 5] = [
    "leaseOwner",
    "leaseToken",
    "leaseExpiresAt",
    "lockedBy",
    "lockedUntil",
];
/// `IndexNotFound`.
const INDEX_NOT_FOUND: i32 = 27;

/// Whether `model` is an index of deliveries that 0.1.0 made and today's setup replaces: the
/// `running` index, or a `claim` index with other keys or another filter than today's.
pub(super) fn is_0_1_index(model: &IndexModel) -> bool {
    let options = model.options.as_ref();
    match options.and_then(|o| o.name.as_deref()) {
        Some(RUNNING_INDEX) => true,
        Some(index::CLAIM) => {
            let partial = options.and_then(|o| o.partial_filter_expression.as_ref());
            index::of_deliveries()
                .into_iter()
                .find(|i| i.name == index::CLAIM)
                .is_some_and(|claim| model.keys != claim.keys || partial != claim.partial.as_ref())
        }
        _ => false,
    }
}

/// What an upgrade changed.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Upgraded {
    pub(crate) processing: u64,
    pub(crate) leases: u64,
    pub(crate) lanes: u64,
    pub(crate) lane_ids: u64,
    pub(crate) events: u64,
    pub(crate) indexes: u64,
}

impl Upgraded {
    fn any(&self) -> bool {
        *self != Upgraded::default()
    }
}

impl MongoEventStore {
    /// Upgrades what a 0.1.0 version left, in batches; does nothing on a database without such
    /// documents. Runs before the indexes are created and the lanes seeded.
    pub(crate) async fn upgrade_from_0_1(&self) -> Result<()> {
        let mut done = Upgraded::default();
        let now = DateTime::now();

        // Claimed deliveries: pending again and due at once; the attempt the claim counted
        // stays counted, as a lost lease counts it today.
        done.processing = self
            .in_batches(doc! { field::STATUS: PROCESSING }, |ids| {
                (
                    doc! { field::ID: { "$in": ids }, field::STATUS: PROCESSING },
                    doc! {
                        "$set": {
                            field::STATUS: status::PENDING,
                            field::LANE: lane::READY,
                            field::DUE_AT: now,
                            field::UPDATED_AT: now,
                        },
                        "$unset": lease_unset(),
                    },
                )
            })
            .await?;

        // Lease fields left on deliveries of any other state.
        let any_lease: Vec<Document> = LEASE_FIELDS
            .iter()
            .map(|name| doc! { *name: { "$exists": true } })
            .collect();
        done.leases = self
            .in_batches(doc! { "$or": any_lease }, |ids| {
                (
                    doc! { field::ID: { "$in": ids } },
                    doc! { "$unset": lease_unset() },
                )
            })
            .await?;

        // Pending deliveries outside the claim index, which takes `lane: ready` only.
        let unlaned = doc! { field::STATUS: status::PENDING, field::LANE: { "$exists": false } };
        done.lanes = self
            .in_batches(unlaned, |ids| {
                (
                    doc! { field::ID: { "$in": ids }, field::LANE: { "$exists": false } },
                    doc! { "$set": { field::LANE: lane::READY } },
                )
            })
            .await?;

        done.lane_ids = self.add_lane_ids().await?;
        done.events = self.complete_events(now).await?;
        done.indexes = self.drop_0_1_indexes().await?;

        if done.any() {
            tracing::info!(
                processing = done.processing,
                lease_fields = done.leases,
                made_claimable = done.lanes,
                lane_ids = done.lane_ids,
                events = done.events,
                indexes_dropped = done.indexes,
                "upgraded a 0.1.0 database"
            );
        }
        Ok(())
    }

    /// Runs `update` on the ids of the deliveries `filter` matches, [`BATCH`] at a time, until
    /// none is left; returns how many it changed. `update` must make a document stop matching.
    async fn in_batches<F>(&self, filter: Document, update: F) -> Result<u64>
    where
        F: Fn(Vec<ObjectId>) -> (Document, Document),
    {
        let deliveries = &self.inner.deliveries;
        let mut changed = 0;
        loop {
            let found: Vec<Document> = deliveries
                .find(filter.clone())
                .projection(doc! { field::ID: 1 })
                .limit(BATCH)
                .await?
                .try_collect()
                .await?;
            let ids = ids_of(&found);
            if ids.is_empty() {
                return Ok(changed);
            }
            // A concurrent setup may change some first: the next find moves past them.
            let (query, change) = update(ids);
            changed += deliveries.update_many(query, change).await?.modified_count;
        }
    }

    /// Gives every delivery without a `laneId` the lane of its key, or of its event id, as
    /// appends do: one `update` command of up to [`BATCH`] statements per batch.
    async fn add_lane_ids(&self) -> Result<u64> {
        let inner = &self.inner;
        let mut changed = 0;
        loop {
            let docs: Vec<Document> = inner
                .deliveries
                .find(doc! { field::LANE_ID: { "$exists": false } })
                .projection(doc! { field::EVENT_ID: 1, field::KEY: 1 })
                .limit(BATCH)
                .await?
                .try_collect()
                .await?;
            if docs.is_empty() {
                return Ok(changed);
            }
            let updates: Vec<Document> = docs
                .iter()
                .filter_map(|doc| {
                    let id = doc.get_object_id(field::ID).ok()?;
                    let event_id = string(doc, field::EVENT_ID).unwrap_or_default();
                    let lane = lane_of(string(doc, field::KEY).as_deref(), &event_id) as i32;
                    Some(doc! {
                        "q": { field::ID: id, field::LANE_ID: { "$exists": false } },
                        "u": { "$set": { field::LANE_ID: lane } },
                    })
                })
                .collect();
            let reply = inner
                .db
                .run_command(doc! {
                    "update": inner.deliveries.name(),
                    "updates": updates,
                    "ordered": false,
                })
                .await?;
            super::append::check_write_reply(&reply)?;
            changed += reply_count(&reply);
        }
    }

    /// Gives every event without `handlers` the handlers of its deliveries, and every event
    /// without `createdAt` the creation time of its oldest delivery (`now` when it has none).
    async fn complete_events(&self, now: DateTime) -> Result<u64> {
        let inner = &self.inner;
        let incomplete = doc! { "$or": [
            { field::HANDLERS: { "$exists": false } },
            { field::CREATED_AT: { "$exists": false } },
        ] };
        let mut changed = 0;
        loop {
            let events: Vec<Document> = inner
                .events
                .find(incomplete.clone())
                .projection(doc! { field::HANDLERS: 1, field::CREATED_AT: 1 })
                .limit(BATCH)
                .await?
                .try_collect()
                .await?;
            if events.is_empty() {
                return Ok(changed);
            }
            let ids: Vec<Bson> = events
                .iter()
                .filter_map(|e| e.get(field::ID).cloned())
                .collect();
            let grouped: Vec<Document> = inner
                .deliveries
                .aggregate([
                    doc! { "$match": { field::EVENT_ID: { "$in": ids } } },
                    doc! { "$group": {
                        field::ID: format!("${}", field::EVENT_ID),
                        "handlers": { "$addToSet": format!("${}", field::HANDLER) },
                        "createdAt": { "$min": format!("${}", field::CREATED_AT) },
                    } },
                ])
                .await?
                .try_collect()
                .await?;
            let of: std::collections::HashMap<String, &Document> = grouped
                .iter()
                .filter_map(|g| Some((g.get_str(field::ID).ok()?.to_owned(), g)))
                .collect();
            let mut updates = Vec::new();
            for event in &events {
                let Some(id) = event.get(field::ID) else {
                    continue;
                };
                let group = id.as_str().and_then(|id| of.get(id));
                if !event.contains_key(field::HANDLERS) {
                    let handlers = group
                        .and_then(|g| g.get_array("handlers").ok())
                        .cloned()
                        .unwrap_or_default();
                    updates.push(doc! {
                        "q": { field::ID: id.clone(), field::HANDLERS: { "$exists": false } },
                        "u": { "$set": { field::HANDLERS: handlers } },
                    });
                }
                if !event.contains_key(field::CREATED_AT) {
                    let created = group
                        .and_then(|g| g.get_datetime("createdAt").ok())
                        .copied()
                        .unwrap_or(now);
                    updates.push(doc! {
                        "q": { field::ID: id.clone(), field::CREATED_AT: { "$exists": false } },
                        "u": { "$set": { field::CREATED_AT: created } },
                    });
                }
            }
            let reply = inner
                .db
                .run_command(doc! {
                    "update": inner.events.name(),
                    "updates": updates,
                    "ordered": false,
                })
                .await?;
            super::append::check_write_reply(&reply)?;
            changed += events.len() as u64;
        }
    }

    /// Drops the `running` index and a `claim` index with other keys or another filter than
    /// today's; `setup()` then creates today's.
    async fn drop_0_1_indexes(&self) -> Result<u64> {
        let deliveries = &self.inner.deliveries;
        let existing: Vec<IndexModel> = deliveries.list_indexes().await?.try_collect().await?;
        let mut dropped = 0;
        for model in existing.iter().filter(|model| is_0_1_index(model)) {
            let name = model
                .options
                .as_ref()
                .and_then(|o| o.name.as_deref())
                .unwrap_or_default();
            match deliveries.drop_index(name).await {
                Ok(()) => dropped += 1,
                Err(e) if error_code(&e) == Some(INDEX_NOT_FOUND) => {}
                Err(e) => return Err(e.into()),
            }
        }
        Ok(dropped)
    }
}

/// The `$unset` of every 0.1.0 lease field.
fn lease_unset() -> Document {
    LEASE_FIELDS
        .iter()
        .map(|name| ((*name).to_owned(), Bson::from("")))
        .collect()
}
