//! What operators and graceful shutdown need: counts, listings, requeueing dead letters, and
//! handing lanes back.
//!
//! Filters reach queries only as strings, dates and numbers: a value taken from an admin request
//! cannot become a query operator such as `{ "$ne": ... }`.

use std::collections::{HashMap, HashSet};

use futures::TryStreamExt;
use mongodb::{
    ClientSession,
    bson::{Bson, DateTime, Document, doc, oid::ObjectId},
    options::Hint,
};

use super::{
    MongoEventStore, bson_date,
    lane::{ids_of, int, int32, object_ids, string},
    schema,
    schema::{field, index, path, status},
    timestamp,
    transaction::documents_in,
};
use crate::error::Result;
use crate::store::checks::{self, check_owner};
use crate::store::{
    AttemptError, Buried, DeliveryQuery, DeliveryRecord, DeliveryStatus, Discarded,
    HandlerStatistics, PendingState, Requeued, Statistics,
};

/// The handler and ordering key of a delivery document, if it is held to its key's order: a
/// delivery marked `unordered` keeps its key for operators only.
fn ordered_key_of(doc: &Document) -> Option<(String, String)> {
    if doc.get_bool(field::UNORDERED) == Ok(true) {
        return None;
    }
    Some((string(doc, field::HANDLER)?, string(doc, field::KEY)?))
}

/// The distinct ObjectIds among `ids`, and the ids that are not ObjectIds (which never reach a
/// query); refuses more than 10,000 ids, naming what `verb` does.
fn parse_ids<S: AsRef<str>>(ids: &[S], verb: &str) -> Result<(Vec<ObjectId>, Vec<String>)> {
    checks::parse_ids(ids, verb, parse_id)
}

/// A delivery id, when it is one this store can have made.
fn parse_id(id: &str) -> Option<ObjectId> {
    ObjectId::parse_str(id).ok()
}

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

/// What a requeue did, with the ids as the database holds them.
#[derive(Debug, Default)]
struct RequeueOutcome {
    requeued: Vec<ObjectId>,
    blocked: Vec<ObjectId>,
    not_found: Vec<String>,
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

    /// Makes dead deliveries pending again, due at `now`, with their attempts counted from 0:
    /// an operator action for dead letters whose cause was fixed.
    ///
    /// A requeued keyed delivery goes before the later deliveries of its key that have not been
    /// claimed yet (they wait for it), even if some later ones already ran. It cannot start
    /// while a later delivery of its key runs: such ids come back in [`Requeued::blocked`].
    /// Ids are taken as text and compared as ObjectIds; anything else is reported in
    /// [`Requeued::not_found`] and never reaches a query.
    ///
    /// The requeue writes the lanes of the keys it requeues, so a claim running at the same time
    /// either sees the requeued delivery or does not record what it read from that lane.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`](crate::Error::InvalidArgument) for more than 10,000 ids;
    /// [`Error::Database`](crate::Error::Database).
    ///
    /// # Cancel safety
    ///
    /// Dropping the future may or may not have requeued the deliveries (it is one transaction).
    pub async fn requeue<S: AsRef<str>>(&self, ids: &[S], now: DateTime) -> Result<Requeued> {
        let (parsed, not_found) = parse_ids(ids, "requeue")?;
        if parsed.is_empty() {
            return Ok(Requeued {
                not_found,
                ..Requeued::default()
            });
        }
        let mut outcome = self
            .own_transaction((self, &parsed, now), |session, (store, ids, now)| {
                Box::pin(store.requeue_in(session, ids, *now))
            })
            .await?;
        outcome.not_found.extend(not_found);
        Ok(Requeued {
            requeued: outcome.requeued.iter().map(|id| id.to_hex()).collect(),
            blocked: outcome.blocked.iter().map(|id| id.to_hex()).collect(),
            not_found: outcome.not_found,
        })
    }

    async fn requeue_in(
        &self,
        session: &mut ClientSession,
        ids: &[ObjectId],
        now: DateTime,
    ) -> Result<RequeueOutcome> {
        let inner = &self.inner;
        let dead: Vec<Document> = inner
            .deliveries
            .find(doc! { field::ID: { "$in": ids }, field::STATUS: status::DEAD })
            .projection(doc! {
                field::HANDLER: 1, field::KEY: 1, field::SEQUENCE: 1, field::UNORDERED: 1,
                field::LANE_ID: 1,
            })
            .session(&mut *session)
            .await?
            .stream(&mut *session)
            .try_collect()
            .await?;
        let found: HashSet<ObjectId> = dead
            .iter()
            .filter_map(|doc| doc.get_object_id(field::ID).ok())
            .collect();
        let mut outcome = RequeueOutcome {
            not_found: ids
                .iter()
                .filter(|id| !found.contains(id))
                .map(|id| id.to_hex())
                .collect(),
            ..RequeueOutcome::default()
        };

        // What runs in the lanes of the ones held to their key's order (an unordered one is
        // requeued as an unkeyed one is).
        let mut lane_ids: Vec<i32> = dead
            .iter()
            .filter(|doc| ordered_key_of(doc).is_some())
            .filter_map(|doc| int32(doc, field::LANE_ID))
            .collect();
        lane_ids.sort_unstable();
        lane_ids.dedup();
        let mut running: HashMap<(String, String), Vec<i64>> = HashMap::new();
        if !lane_ids.is_empty() {
            let lanes: Vec<Document> = inner
                .lanes
                .find(doc! { field::ID: { "$in": &lane_ids } })
                .projection(doc! { field::IN_FLIGHT: 1 })
                .session(&mut *session)
                .await?
                .stream(&mut *session)
                .try_collect()
                .await?;
            let listed: Vec<ObjectId> = lanes
                .iter()
                .flat_map(|lane| object_ids(lane, field::IN_FLIGHT))
                .collect();
            if !listed.is_empty() {
                let docs: Vec<Document> = inner
                    .deliveries
                    .find(doc! { field::ID: { "$in": listed }, field::STATUS: status::PENDING })
                    .projection(doc! {
                        field::HANDLER: 1, field::KEY: 1, field::SEQUENCE: 1, field::UNORDERED: 1,
                    })
                    .session(&mut *session)
                    .await?
                    .stream(&mut *session)
                    .try_collect()
                    .await?;
                for doc in &docs {
                    if let (Some(key_of), Some(sequence)) =
                        (ordered_key_of(doc), int(doc, field::SEQUENCE))
                    {
                        running.entry(key_of).or_default().push(sequence);
                    }
                }
            }
        }
        for doc in &dead {
            let Ok(id) = doc.get_object_id(field::ID) else {
                continue;
            };
            let later_runs = match ordered_key_of(doc) {
                Some(key_of) => {
                    let sequence = int(doc, field::SEQUENCE).unwrap_or(i64::MIN);
                    running
                        .get(&key_of)
                        .is_some_and(|runs| runs.iter().any(|&s| s > sequence))
                }
                None => false,
            };
            if later_runs {
                outcome.blocked.push(id);
            } else {
                outcome.requeued.push(id);
            }
        }
        if outcome.requeued.is_empty() {
            return Ok(outcome);
        }
        inner
            .deliveries
            .update_many(
                doc! { field::ID: { "$in": &outcome.requeued }, field::STATUS: status::DEAD },
                doc! {
                    "$set": {
                        field::STATUS: status::PENDING,
                        field::LANE: schema::lane::READY,
                        field::ATTEMPTS: 0,
                        field::DUE_AT: now,
                        field::UPDATED_AT: now,
                    },
                    // `lastError` and `errors` stay: the history goes on across the requeue.
                    "$inc": { field::CLAIMS: 1_i64, field::REQUEUED: 1_i64 },
                },
            )
            .session(&mut *session)
            .await?;
        // A claim that read one of these lanes before this commits no longer matches it when it
        // records, and one that records first makes this transaction conflict.
        self.move_requeue_counts(session, &lane_ids).await?;
        Ok(outcome)
    }

    /// Deletes dead deliveries for good, in one transaction: the dead letters an operator gave
    /// up on. An event with no delivery left gets its completion time, `now`, so that it stays
    /// as a deduplication record until the completed events' retention purges it. Pending
    /// deliveries are never touched: their ids come back in [`Discarded::not_found`], as do
    /// ids that are not ObjectIds (which never reach a query).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`](crate::Error::InvalidArgument) for more than 10,000 ids;
    /// [`Error::Database`](crate::Error::Database).
    pub async fn discard<S: AsRef<str>>(&self, ids: &[S], now: DateTime) -> Result<Discarded> {
        let (parsed, mut not_found) = parse_ids(ids, "discard")?;
        if parsed.is_empty() {
            return Ok(Discarded {
                not_found,
                ..Discarded::default()
            });
        }
        let discarded = self
            .own_transaction((self, &parsed, now), |session, (store, ids, now)| {
                Box::pin(store.discard_in(session, ids, *now))
            })
            .await?;
        let found: HashSet<&ObjectId> = discarded.iter().collect();
        not_found.extend(
            parsed
                .iter()
                .filter(|id| !found.contains(id))
                .map(|id| id.to_hex()),
        );
        Ok(Discarded {
            discarded: discarded.iter().map(|id| id.to_hex()).collect(),
            not_found,
        })
    }

    async fn discard_in(
        &self,
        session: &mut ClientSession,
        ids: &[ObjectId],
        now: DateTime,
    ) -> Result<Vec<ObjectId>> {
        let inner = &self.inner;
        let dead = documents_in(
            session,
            &inner.deliveries,
            doc! { field::ID: { "$in": ids }, field::STATUS: status::DEAD },
            doc! { field::ID: 1, field::EVENT_ID: 1 },
        )
        .await?;
        if dead.is_empty() {
            return Ok(Vec::new());
        }
        let found = ids_of(&dead);
        inner
            .deliveries
            .delete_many(doc! { field::ID: { "$in": &found }, field::STATUS: status::DEAD })
            .session(&mut *session)
            .await?;
        let mut events: Vec<String> = dead
            .iter()
            .filter_map(|doc| string(doc, field::EVENT_ID))
            .collect();
        events.sort_unstable();
        events.dedup();
        let still_referenced: Vec<String> = inner
            .deliveries
            .distinct(
                field::EVENT_ID,
                doc! { field::EVENT_ID: { "$in": &events } },
            )
            .session(&mut *session)
            .await?
            .into_iter()
            .filter_map(|id| id.as_str().map(str::to_owned))
            .collect();
        let finished: Vec<&String> = events
            .iter()
            .filter(|id| !still_referenced.contains(id))
            .collect();
        if !finished.is_empty() {
            inner
                .events
                .update_many(
                    doc! { field::ID: { "$in": finished } },
                    doc! { "$max": { field::COMPLETED_AT: now } },
                )
                .session(&mut *session)
                .await?;
        }
        Ok(found)
    }

    /// Buries pending deliveries by id, in one transaction, with `reason` as their error (cut
    /// to 8 KiB; it joins their error history, not counted as an attempt). A delivery a lane
    /// lists as running is left to its worker and reported in [`Buried::running`]; ids that are
    /// not ObjectIds never reach a query. The claim generation moves on, so a lease of an
    /// earlier claim can no longer settle a buried delivery, and so does the requeue count of
    /// the buried deliveries' lanes, so a claim that read one of them as pending before cannot
    /// record it after.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`](crate::Error::InvalidArgument) for more than 10,000 ids or an
    /// empty reason; [`Error::Database`](crate::Error::Database).
    pub async fn bury_by_id<S: AsRef<str>>(
        &self,
        ids: &[S],
        reason: &str,
        now: DateTime,
    ) -> Result<Buried> {
        let (parsed, mut not_found) = parse_ids(ids, "bury")?;
        checks::check_reason(reason)?;
        if parsed.is_empty() {
            return Ok(Buried {
                not_found,
                ..Buried::default()
            });
        }
        let (buried, running) = self
            .own_transaction(
                (self, &parsed, reason, now),
                |session, (store, ids, reason, now)| {
                    Box::pin(store.bury_by_id_in(session, ids, reason, *now))
                },
            )
            .await?;
        let known: HashSet<&ObjectId> = buried.iter().chain(running.iter()).collect();
        not_found.extend(
            parsed
                .iter()
                .filter(|id| !known.contains(id))
                .map(|id| id.to_hex()),
        );
        Ok(Buried {
            buried: buried.iter().map(|id| id.to_hex()).collect(),
            running: running.iter().map(|id| id.to_hex()).collect(),
            not_found,
        })
    }

    async fn bury_by_id_in(
        &self,
        session: &mut ClientSession,
        ids: &[ObjectId],
        reason: &str,
        now: DateTime,
    ) -> Result<(Vec<ObjectId>, Vec<ObjectId>)> {
        let inner = &self.inner;
        let pending = documents_in(
            session,
            &inner.deliveries,
            doc! { field::ID: { "$in": ids }, field::STATUS: status::PENDING },
            doc! { field::ID: 1, field::LANE_ID: 1 },
        )
        .await?;
        if pending.is_empty() {
            return Ok((Vec::new(), Vec::new()));
        }
        let found = ids_of(&pending);
        // Read in the transaction: a claim that lists one of them later conflicts with it.
        let listed = documents_in(
            session,
            &inner.lanes,
            doc! { field::IN_FLIGHT: { "$in": &found } },
            doc! { field::IN_FLIGHT: 1 },
        )
        .await?;
        let running: HashSet<ObjectId> = listed
            .iter()
            .filter_map(|lane| lane.get_array(field::IN_FLIGHT).ok())
            .flatten()
            .filter_map(|id| id.as_object_id())
            .filter(|id| found.contains(id))
            .collect();
        let buried: Vec<ObjectId> = found
            .iter()
            .filter(|id| !running.contains(id))
            .copied()
            .collect();
        if !buried.is_empty() {
            let error = format!("buried by an operator: {reason}");
            inner
                .deliveries
                .update_many(
                    doc! { field::ID: { "$in": &buried }, field::STATUS: status::PENDING },
                    vec![doc! { "$set": {
                        field::STATUS: status::DEAD,
                        field::LANE: schema::lane::READY,
                        field::LAST_ERROR: { "$literal": super::lane::clip_error(&error) },
                        field::ERRORS: super::lane::push_error(&error, now),
                        field::CLAIMS: { "$add": [{ "$ifNull": [path::CLAIMS, 0_i64] }, 1_i64] },
                        field::UPDATED_AT: now,
                    } }],
                )
                .session(&mut *session)
                .await?;
            let mut lane_ids: Vec<i32> = pending
                .iter()
                .filter(|doc| {
                    doc.get_object_id(field::ID)
                        .is_ok_and(|id| buried.contains(&id))
                })
                .filter_map(|doc| super::lane::int(doc, field::LANE_ID))
                .filter_map(|lane| i32::try_from(lane).ok())
                .collect();
            lane_ids.sort_unstable();
            lane_ids.dedup();
            // A claim that read one of these deliveries as pending before this commits, and
            // records it after, must not hand it out dead: its record is conditioned on the
            // requeue count it read, which moves on here. One that records first makes this
            // transaction conflict, and the delivery is then found running.
            self.move_requeue_counts(session, &lane_ids).await?;
        }
        Ok((buried, running.into_iter().collect()))
    }

    /// Increments, in `session`'s transaction, the requeue count of the lanes `lane_ids`, on
    /// which every record of a claim is conditioned.
    async fn move_requeue_counts(
        &self,
        session: &mut ClientSession,
        lane_ids: &[i32],
    ) -> Result<()> {
        if !lane_ids.is_empty() {
            self.inner
                .lanes
                .update_many(
                    doc! { field::ID: { "$in": lane_ids } },
                    doc! { "$inc": { field::REQUEUES: 1_i64 } },
                )
                .session(&mut *session)
                .await?;
        }
        Ok(())
    }

    /// Hands back every lane `owner` holds on this store instance, for a worker that stops.
    /// Returns how many lanes it handed back. The instance's other owners stop counting `owner`
    /// among the claimers they share free lanes with.
    ///
    /// Release or complete the deliveries still running first: whatever the lanes still list
    /// counts as a lost attempt for whoever takes them next. Their leases are honoured until
    /// then.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`](crate::Error::InvalidArgument) for a malformed owner (nothing
    /// is sent); [`Error::Database`](crate::Error::Database).
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: the lanes are handed back or not, and calling again finishes the job.
    pub async fn relinquish(&self, owner: &str) -> Result<u64> {
        check_owner(owner)?;
        let lock = self.inner.claims.owner(owner);
        let _claims = lock.lock().await;
        let result = self
            .inner
            .lanes
            .update_many(
                doc! { field::OWNER: owner, field::INSTANCE: self.inner.claims.instance },
                doc! { "$set": {
                    field::OWNER: Bson::Null,
                    field::INSTANCE: Bson::Null,
                    field::LEASE_EXPIRES_AT: Bson::Null,
                } },
            )
            .await?;
        // A stopped worker no longer ranks free lanes: the others share its slot's lanes.
        self.inner.members.forget(owner);
        Ok(result.modified_count)
    }
}
