//! What operators and graceful shutdown need: counts and listings here, requeueing dead
//! letters, burying and handing lanes back in [`repair`].
//!
//! Filters reach queries only as strings, dates and numbers: a value taken from an admin request
//! cannot become a query operator such as `{ "$ne": ... }`.

use std::collections::HashSet;

use futures::TryStreamExt;
use mongodb::{
    bson::{Bson, Document, doc, oid::ObjectId},
    options::Hint,
};

use super::{
    MongoEventStore, bson_date,
    lane::{int, object_ids, string},
    schema,
    schema::{field, index, path, status},
    timestamp,
};
mod repair;

use repair::parse_id;

use crate::error::Result;
use crate::store::checks;
use crate::store::{
    AttemptError, DeliveryQuery, DeliveryRecord, DeliveryStatus, HandlerStatistics, PendingState,
    Statistics,
};

/// Whether the server refused a query because its hinted index does not exist.
pub(crate) fn is_missing_index(error: &mongodb::error::Error) -> bool {
    super::error_code(error) == Some(BAD_VALUE) && error.to_string().contains("hint")
}

/// Runs `pipeline` on `collection` with the index `hint`, or without it when a deployment
/// dropped that index (the specification lets it drop the listing indexes).
pub(crate) async fn aggregate_hinted(
    collection: &mongodb::Collection<Document>,
    pipeline: Vec<Document>,
    hint: &str,
) -> Result<Vec<Document>> {
    let hinted = collection
        .aggregate(pipeline.clone())
        .hint(Hint::Name(hint.to_owned()))
        .await;
    let cursor = match hinted {
        Err(error) if is_missing_index(&error) => collection.aggregate(pipeline).await?,
        cursor => cursor?,
    };
    Ok(cursor.try_collect().await?)
}

/// `BadValue`, which a hint naming no index gets.
const BAD_VALUE: i32 = 2;

/// The pipeline over the lanes that groups the deliveries they list as running (those still
/// pending in `deliveries`, seen as `$delivery` with the fields of `projection`) by `group`:
/// how many (`n`), and how many of them run from the parked lane (`parked`).
fn running_grouped(deliveries: &str, projection: Document, group: Bson) -> Vec<Document> {
    vec![
        doc! { "$match": { "inFlight.0": { "$exists": true } } },
        doc! { "$project": { field::IN_FLIGHT: 1 } },
        doc! { "$unwind": path::IN_FLIGHT },
        doc! { "$lookup": {
            "from": deliveries,
            "localField": field::IN_FLIGHT,
            "foreignField": field::ID,
            "pipeline": [
                { "$match": { field::STATUS: status::PENDING } },
                { "$project": projection },
            ],
            "as": "delivery",
        } },
        doc! { "$unwind": "$delivery" },
        doc! { "$group": {
            field::ID: group,
            "n": { "$sum": 1 },
            "parked": running_parked(),
        } },
    ]
}

/// Of the running deliveries a grouping sees as `$delivery`, the count of those in the parked
/// lane: a key's delivery run straight from its parked backlog (see `claim_next_of_key`), which
/// the counts give as running, not as parked.
fn running_parked() -> Document {
    doc! { "$sum": {
        "$cond": [{ "$eq": [format!("$delivery.{}", field::LANE), schema::lane::PARKED] }, 1, 0],
    } }
}

/// A listed delivery or completion record, from its stored document.
pub(crate) fn record_from_document(doc: &Document) -> Option<DeliveryRecord> {
    Some(DeliveryRecord {
        id: doc.get_object_id(field::ID).ok()?.to_hex(),
        event_id: string(doc, field::EVENT_ID).unwrap_or_default(),
        handler: string(doc, field::HANDLER).unwrap_or_default(),
        event_type: string(doc, field::EVENT_TYPE).unwrap_or_default(),
        key: string(doc, field::KEY),
        sequence: int(doc, field::SEQUENCE),
        unordered: doc.get_bool(field::UNORDERED) == Ok(true),
        status: doc
            .get_str(field::STATUS)
            .ok()
            .and_then(DeliveryStatus::from_stored)?,
        parked: doc.get_str(field::LANE) == Ok(schema::lane::PARKED),
        running: false,
        attempts: int(doc, field::ATTEMPTS)
            .map_or(0, |a| u32::try_from(a.max(0)).unwrap_or(u32::MAX)),
        due_at: doc
            .get_datetime(field::DUE_AT)
            .ok()
            .map(|at| timestamp(*at)),
        created_at: doc
            .get_datetime(field::CREATED_AT)
            .ok()
            .map(|at| timestamp(*at)),
        updated_at: doc
            .get_datetime(field::UPDATED_AT)
            .ok()
            .map(|at| timestamp(*at)),
        completed_at: doc
            .get_datetime(field::COMPLETED_AT)
            .ok()
            .map(|at| timestamp(*at)),
        last_error: string(doc, field::LAST_ERROR),
        errors: doc
            .get_array(field::ERRORS)
            .map(|errors| errors.iter().filter_map(attempt_error).collect())
            .unwrap_or_default(),
        requeues: int(doc, field::REQUEUED)
            .map_or(0, |n| u32::try_from(n.max(0)).unwrap_or(u32::MAX)),
    })
}

/// An entry of a delivery's error history.
fn attempt_error(entry: &Bson) -> Option<AttemptError> {
    let entry = entry.as_document()?;
    Some(AttemptError::new(
        timestamp(*entry.get_datetime(field::ERROR_AT).ok()?),
        int(entry, field::ERROR_ATTEMPT).and_then(|n| u32::try_from(n).ok()),
        entry.get_str(field::ERROR_TEXT).ok()?,
    ))
}

/// A listed record with its id as stored, for ordering.
fn record_with_id(doc: &Document) -> Option<(ObjectId, DeliveryRecord)> {
    Some((
        doc.get_object_id(field::ID).ok()?,
        record_from_document(doc)?,
    ))
}

/// The filter of a listing's fields other than the state.
pub(crate) fn query_filter(query: &DeliveryQuery) -> Document {
    let mut filter = Document::new();
    if let Some(key) = &query.key {
        filter.insert(field::KEY, Bson::String(key.clone()));
    }
    if let Some(event_id) = &query.event_id {
        filter.insert(field::EVENT_ID, Bson::String(event_id.clone()));
    }
    match (&query.last_error, &query.error_contains) {
        (Some(exact), _) => {
            filter.insert(field::LAST_ERROR, Bson::String(exact.clone()));
        }
        (None, Some(text)) => {
            filter.insert(
                field::LAST_ERROR,
                Bson::RegularExpression(mongodb::bson::Regex {
                    pattern: regex_escape(text),
                    options: "i".to_owned(),
                }),
            );
        }
        (None, None) => {}
    }
    if let Some(handler) = &query.handler {
        filter.insert(field::HANDLER, Bson::String(handler.clone()));
    }
    if let Some(event_type) = &query.event_type {
        filter.insert(field::EVENT_TYPE, Bson::String(event_type.clone()));
    }
    let mut created = Document::new();
    if let Some(from) = query.created_from {
        created.insert("$gte", bson_date(from));
    }
    if let Some(before) = query.created_before {
        created.insert("$lt", bson_date(before));
    }
    if !created.is_empty() {
        filter.insert(field::CREATED_AT, created);
    }
    filter
}

/// `text` as a regular expression that matches exactly it: every character with a meaning in
/// a pattern escaped.
fn regex_escape(text: &str) -> String {
    let mut escaped = String::with_capacity(text.len() * 2);
    for c in text.chars() {
        if "\\^$.|?*+()[]{}/-#&~ ".contains(c) {
            escaped.push('\\');
        }
        escaped.push(c);
    }
    escaped
}

/// The ids of the deliveries the lanes list in flight: the running ones (at most a lane's
/// in-flight list per lane, 256 small documents).
pub(crate) async fn in_flight(lanes: &mongodb::Collection<Document>) -> Result<HashSet<ObjectId>> {
    let docs: Vec<Document> = lanes
        .find(doc! { "inFlight.0": { "$exists": true } })
        .projection(doc! { field::IN_FLIGHT: 1 })
        .await?
        .try_collect()
        .await?;
    Ok(docs
        .iter()
        .flat_map(|doc| object_ids(doc, field::IN_FLIGHT))
        .collect())
}

impl MongoEventStore {
    /// Counts deliveries by state and finds the oldest due one.
    ///
    /// # Errors
    ///
    /// [`Error::Database`](crate::Error::Database).
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it only reads.
    pub async fn statistics(&self) -> Result<Statistics> {
        let inner = &self.inner;
        // The specification lets the listing indexes be dropped: a count whose index is gone
        // runs on what the planner finds.
        let count = |filter: Document, hint: &'static str| async move {
            let hinted = inner
                .deliveries
                .count_documents(filter.clone())
                .hint(Hint::Name(hint.to_owned()))
                .await;
            match hinted {
                Err(error) if is_missing_index(&error) => {
                    inner.deliveries.count_documents(filter).await
                }
                counted => counted,
            }
        };
        let (pending, dead, legacy, parked) = futures::try_join!(
            count(
                doc! { field::STATUS: status::PENDING },
                index::STATUS_CREATED
            ),
            count(doc! { field::STATUS: status::DEAD }, index::STATUS_CREATED),
            count(
                doc! { field::STATUS: status::COMPLETED },
                index::STATUS_CREATED
            ),
            count(doc! { field::LANE: schema::lane::PARKED }, index::PARKED),
        )?;
        let history = if inner.completion_history {
            inner.completed.count_documents(doc! {}).await?
        } else {
            0
        };
        let oldest = inner
            .deliveries
            .find_one(doc! { field::STATUS: status::PENDING })
            .sort(doc! { field::DUE_AT: 1 })
            .projection(doc! { field::DUE_AT: 1 })
            .hint(index::hint(index::DUE))
            .await?;
        let running: Vec<Document> = inner
            .lanes
            .aggregate(running_grouped(
                inner.deliveries.name(),
                doc! { field::LANE: 1 },
                Bson::Null,
            ))
            .await?
            .try_collect()
            .await?;
        let count_of = |name: &str| {
            running
                .first()
                .and_then(|doc| int(doc, name))
                .map_or(0, |n| n.max(0) as u64)
        };
        Ok(Statistics {
            pending,
            running: count_of("n"),
            // A key's delivery that runs straight from its parked backlog runs, it does not wait.
            parked: parked.saturating_sub(count_of("parked")),
            dead,
            completed: history + legacy,
            completion_history: inner.completion_history,
            oldest_due_at: oldest.and_then(|doc| {
                doc.get_datetime(field::DUE_AT)
                    .ok()
                    .map(|at| timestamp(*at))
            }),
        })
    }

    /// Counts deliveries by handler and state: one grouping of the pending and dead
    /// deliveries, and one of what the lanes list as running. Every handler with a pending or
    /// dead delivery is listed once, in handler order.
    ///
    /// The grouping reads every pending and dead delivery: sample it every few seconds at
    /// most, as the bus does for its gauges, from one process.
    ///
    /// # Errors
    ///
    /// [`Error::Database`](crate::Error::Database).
    pub async fn handler_statistics(&self) -> Result<Vec<HandlerStatistics>> {
        let inner = &self.inner;
        let grouped = aggregate_hinted(
            &inner.deliveries,
            vec![
                doc! { "$match": {
                    field::STATUS: { "$in": [status::PENDING, status::DEAD] },
                } },
                doc! { "$group": {
                    field::ID: {
                        "h": format!("${}", field::HANDLER),
                        "s": format!("${}", field::STATUS),
                        "l": format!("${}", field::LANE),
                    },
                    "n": { "$sum": 1 },
                    "oldest": { "$min": format!("${}", field::DUE_AT) },
                } },
            ],
            index::STATUS_CREATED,
        );
        let running = async {
            inner
                .lanes
                .aggregate(running_grouped(
                    inner.deliveries.name(),
                    doc! { field::HANDLER: 1, field::LANE: 1 },
                    Bson::String(format!("$delivery.{}", field::HANDLER)),
                ))
                .await?
                .try_collect::<Vec<Document>>()
                .await
                .map_err(crate::Error::from)
        };
        let (grouped, running) = futures::try_join!(grouped, running)?;
        let mut by_handler: std::collections::BTreeMap<String, HandlerStatistics> =
            std::collections::BTreeMap::new();
        for group in &grouped {
            let Ok(id) = group.get_document(field::ID) else {
                continue;
            };
            let Ok(handler) = id.get_str("h") else {
                continue;
            };
            let entry = by_handler
                .entry(handler.to_owned())
                .or_insert_with(|| HandlerStatistics::new(handler));
            let n = int(group, "n").map_or(0, |n| n.max(0) as u64);
            if id.get_str("s") == Ok(status::DEAD) {
                entry.dead += n;
                continue;
            }
            entry.pending += n;
            if id.get_str("l") == Ok(schema::lane::PARKED) {
                entry.parked += n;
            }
            if let Ok(oldest) = group.get_datetime("oldest") {
                let oldest = timestamp(*oldest);
                entry.oldest_due_at = Some(match entry.oldest_due_at {
                    Some(at) if at < oldest => at,
                    _ => oldest,
                });
            }
        }
        for group in &running {
            if let (Ok(handler), Some(n)) = (group.get_str(field::ID), int(group, "n"))
                && let Some(entry) = by_handler.get_mut(handler)
            {
                entry.running = n.max(0) as u64;
                let parked = int(group, "parked").map_or(0, |n| n.max(0) as u64);
                entry.parked = entry.parked.saturating_sub(parked);
            }
        }
        Ok(by_handler.into_values().collect())
    }

    /// Lists deliveries and completion records, oldest first, filtered by `query`.
    ///
    /// Without a status filter, pending and dead deliveries come first, then completion
    /// records.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`](crate::Error::InvalidArgument) for a limit outside 1 to 1000
    /// (nothing is sent); [`Error::Database`](crate::Error::Database).
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it only reads.
    pub async fn list_deliveries(&self, query: &DeliveryQuery) -> Result<Vec<DeliveryRecord>> {
        checks::check_list_limit(query.limit)?;
        let inner = &self.inner;
        let base = query_filter(query);
        let mut base = base;
        let mut after_id = None;
        if let Some(after) = &query.after {
            let after = checks::parse_after(after, parse_id)?;
            after_id = Some(after);
            base.insert(field::ID, doc! { "$gt": after });
        }
        // Ids grow with creation time, so the id order is the creation order, and the last id
        // of a page is where the next one starts: each page reads at most `limit` documents of
        // each collection, however deep it is.
        let sort = doc! { field::ID: 1 };
        let wanted = i64::from(query.limit);

        // Deliveries of the wanted states, then (for completed) the history.
        let mut delivery_filter = base.clone();
        let running = if matches!(query.status, None | Some(DeliveryStatus::Pending)) {
            in_flight(&inner.lanes).await?
        } else {
            HashSet::new()
        };
        match (query.status, query.pending_state) {
            (Some(status), None) => {
                delivery_filter.insert(field::STATUS, status.as_str());
            }
            (None, None) => {
                delivery_filter.insert(
                    field::STATUS,
                    doc! { "$in": [status::PENDING, status::DEAD] },
                );
            }
            (Some(status), Some(_)) if status != DeliveryStatus::Pending => return Ok(Vec::new()),
            (_, Some(state)) => {
                delivery_filter.insert(field::STATUS, status::PENDING);
                let ids: Vec<ObjectId> = running.iter().copied().collect();
                match state {
                    PendingState::Running => {
                        let ids: Vec<ObjectId> = ids
                            .into_iter()
                            .filter(|id| after_id.is_none_or(|after| *id > after))
                            .collect();
                        delivery_filter.insert(field::ID, doc! { "$in": ids });
                    }
                    PendingState::Parked => {
                        // A key's delivery that runs straight from its parked backlog (see
                        // `claim_next_of_key`) runs, it does not wait.
                        delivery_filter.insert(field::LANE, schema::lane::PARKED);
                        delivery_filter.insert("$nor", vec![doc! { field::ID: { "$in": ids } }]);
                    }
                    PendingState::Waiting => {
                        delivery_filter.insert(field::LANE, doc! { "$ne": schema::lane::PARKED });
                        delivery_filter.insert("$nor", vec![doc! { field::ID: { "$in": ids } }]);
                    }
                }
            }
        }
        let mut records: Vec<(ObjectId, DeliveryRecord)> = inner
            .deliveries
            .find(delivery_filter)
            .sort(sort.clone())
            .limit(wanted)
            .await?
            .try_collect::<Vec<Document>>()
            .await?
            .iter()
            .filter_map(record_with_id)
            .collect();
        for (id, record) in &mut records {
            record.running = record.status == DeliveryStatus::Pending && running.contains(id);
            record.parked &= !record.running;
        }
        let completed_wanted = matches!(query.status, None | Some(DeliveryStatus::Completed))
            && query.pending_state.is_none()
            && inner.completion_history;
        if completed_wanted {
            let history = inner
                .completed
                .find(base)
                .sort(sort)
                .limit(wanted)
                .await?
                .try_collect::<Vec<Document>>()
                .await?;
            records.extend(history.iter().filter_map(record_with_id));
            records.sort_by_key(|(id, _)| *id);
        }
        Ok(records
            .into_iter()
            .take(query.limit as usize)
            .map(|(_, record)| record)
            .collect())
    }
}
