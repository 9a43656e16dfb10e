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
    MongoEventStore,
    lane::{check_owner, int, object_ids, string},
};
use crate::error::{InvalidArgumentError, Result};

/// The most records one listing returns.
pub(crate) const MAX_LIST_LIMIT: u32 = 1_000;
/// The most ids one requeue takes.
pub(crate) const MAX_REQUEUE: usize = 10_000;

/// Counts of deliveries by state, from [`MongoEventStore::statistics`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Statistics {
    /// Deliveries waiting or running (running ones are pending documents listed by their lane),
    /// parked ones included.
    pub pending: u64,
    /// Pending deliveries a worker currently runs.
    pub running: u64,
    /// Pending deliveries parked behind an unfinished predecessor of their key.
    pub parked: u64,
    /// Dead letters.
    pub dead: u64,
    /// Completion records (with completion history), plus `completed` documents an earlier
    /// version left.
    pub completed: u64,
    /// The due time of the oldest pending delivery, parked ones included: how far behind the
    /// workers are.
    pub oldest_due_at: Option<DateTime>,
}

/// The state of a listed delivery.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum DeliveryStatus {
    /// Waiting, running, or parked.
    Pending,
    /// Buried after its last attempt failed; see [`MongoEventStore::requeue`].
    Dead,
    /// Completed: a completion-history record.
    Completed,
}

impl DeliveryStatus {
    /// The stored name: `pending`, `dead` or `completed`.
    pub fn as_str(&self) -> &'static str {
        match self {
            DeliveryStatus::Pending => "pending",
            DeliveryStatus::Dead => "dead",
            DeliveryStatus::Completed => "completed",
        }
    }

    fn from_stored(name: &str) -> Option<Self> {
        match name {
            "pending" => Some(DeliveryStatus::Pending),
            "dead" => Some(DeliveryStatus::Dead),
            "completed" => Some(DeliveryStatus::Completed),
            _ => None,
        }
    }
}

/// What [`MongoEventStore::list_deliveries`] returns: one delivery or completion record, oldest
/// first.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct DeliveryRecord {
    /// The delivery id.
    pub id: ObjectId,
    /// The event id.
    pub event_id: String,
    /// The handler id.
    pub handler: String,
    /// The event type name.
    pub event_type: String,
    /// The ordering key, if any.
    pub key: Option<String>,
    /// The sequence within the key, if keyed.
    pub sequence: Option<i64>,
    /// The state.
    pub status: DeliveryStatus,
    /// Whether a pending delivery is parked behind an unfinished predecessor.
    pub parked: bool,
    /// Attempts that ended (for a completion record: including the one that completed).
    pub attempts: u32,
    /// When a pending delivery is due.
    pub due_at: Option<DateTime>,
    /// When the delivery was created.
    pub created_at: Option<DateTime>,
    /// When it last changed state, if ever.
    pub updated_at: Option<DateTime>,
    /// When it completed, for completion records.
    pub completed_at: Option<DateTime>,
    /// The error of the last failed attempt.
    pub last_error: Option<String>,
}

impl DeliveryRecord {
    fn from_document(doc: &Document) -> Option<Self> {
        Some(DeliveryRecord {
            id: doc.get_object_id("_id").ok()?,
            event_id: string(doc, "eventId").unwrap_or_default(),
            handler: string(doc, "handler").unwrap_or_default(),
            event_type: string(doc, "eventType").unwrap_or_default(),
            key: string(doc, "key"),
            sequence: int(doc, "sequence"),
            status: doc
                .get_str("status")
                .ok()
                .and_then(DeliveryStatus::from_stored)?,
            parked: doc.get_str("lane") == Ok("parked"),
            attempts: int(doc, "attempts")
                .map_or(0, |a| u32::try_from(a.max(0)).unwrap_or(u32::MAX)),
            due_at: doc.get_datetime("dueAt").ok().copied(),
            created_at: doc.get_datetime("createdAt").ok().copied(),
            updated_at: doc.get_datetime("updatedAt").ok().copied(),
            completed_at: doc.get_datetime("completedAt").ok().copied(),
            last_error: string(doc, "lastError"),
        })
    }
}

/// Which deliveries [`MongoEventStore::list_deliveries`] returns; every filter is optional and
/// they combine with "and". Ordered by creation time, then id.
///
/// # Example
///
/// ```
/// use relaybus::{DeliveryQuery, DeliveryStatus};
///
/// let query = DeliveryQuery::new()
///     .status(DeliveryStatus::Dead)
///     .handler("send-confirmation")
///     .limit(50);
/// # let _ = query;
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[must_use]
pub struct DeliveryQuery {
    status: Option<DeliveryStatus>,
    handler: Option<String>,
    event_type: Option<String>,
    created_from: Option<DateTime>,
    created_before: Option<DateTime>,
    skip: u64,
    limit: u32,
}

impl Default for DeliveryQuery {
    fn default() -> Self {
        DeliveryQuery::new()
    }
}

impl DeliveryQuery {
    /// Everything, the first 100 records.
    pub fn new() -> Self {
        DeliveryQuery {
            status: None,
            handler: None,
            event_type: None,
            created_from: None,
            created_before: None,
            skip: 0,
            limit: 100,
        }
    }

    /// Only deliveries in this state. [`DeliveryStatus::Completed`] lists completion records,
    /// which exist only with completion history.
    pub fn status(mut self, status: DeliveryStatus) -> Self {
        self.status = Some(status);
        self
    }

    /// Only deliveries of this handler.
    pub fn handler(mut self, handler: impl Into<String>) -> Self {
        self.handler = Some(handler.into());
        self
    }

    /// Only deliveries of events of this type.
    pub fn event_type(mut self, event_type: impl Into<String>) -> Self {
        self.event_type = Some(event_type.into());
        self
    }

    /// Only deliveries created at or after `from`.
    pub fn created_from(mut self, from: DateTime) -> Self {
        self.created_from = Some(from);
        self
    }

    /// Only deliveries created before `before`.
    pub fn created_before(mut self, before: DateTime) -> Self {
        self.created_before = Some(before);
        self
    }

    /// Leave out the first `skip` records, for paging.
    pub fn skip(mut self, skip: u64) -> Self {
        self.skip = skip;
        self
    }

    /// Return at most `limit` records, 1 to 1000 (100 by default).
    pub fn limit(mut self, limit: u32) -> Self {
        self.limit = limit;
        self
    }

    fn filter(&self) -> Document {
        let mut filter = Document::new();
        if let Some(handler) = &self.handler {
            filter.insert("handler", Bson::String(handler.clone()));
        }
        if let Some(event_type) = &self.event_type {
            filter.insert("eventType", Bson::String(event_type.clone()));
        }
        let mut created = Document::new();
        if let Some(from) = self.created_from {
            created.insert("$gte", from);
        }
        if let Some(before) = self.created_before {
            created.insert("$lt", before);
        }
        if !created.is_empty() {
            filter.insert("createdAt", created);
        }
        filter
    }
}

/// What [`MongoEventStore::requeue`] did with each id.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Requeued {
    /// Dead deliveries made pending again.
    pub requeued: Vec<ObjectId>,
    /// Dead deliveries left dead because a later delivery of their key is running; try again
    /// once it finished.
    pub blocked: Vec<ObjectId>,
    /// Ids that name no dead delivery (unknown, not dead, or not an id at all).
    pub not_found: Vec<String>,
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
        let count = |filter: Document, hint: &'static str| async move {
            inner
                .deliveries
                .count_documents(filter)
                .hint(Hint::Name(hint.to_owned()))
                .await
        };
        let (pending, dead, legacy, parked) = futures::try_join!(
            count(doc! { "status": "pending" }, "status_created"),
            count(doc! { "status": "dead" }, "status_created"),
            count(doc! { "status": "completed" }, "status_created"),
            count(doc! { "lane": "parked" }, "parked"),
        )?;
        let history = if inner.completion_history {
            inner.completed.count_documents(doc! {}).await?
        } else {
            0
        };
        let oldest = inner
            .deliveries
            .find_one(doc! { "status": "pending" })
            .sort(doc! { "dueAt": 1 })
            .projection(doc! { "dueAt": 1 })
            .hint(Hint::Name("due".to_owned()))
            .await?;
        let running: Vec<Document> = inner
            .lanes
            .aggregate([
                doc! { "$match": { "inFlight.0": { "$exists": true } } },
                doc! { "$project": { "inFlight": 1 } },
                doc! { "$unwind": "$inFlight" },
                doc! { "$lookup": {
                    "from": inner.deliveries.name(),
                    "localField": "inFlight",
                    "foreignField": "_id",
                    "pipeline": [{ "$match": { "status": "pending" } }, { "$project": { "_id": 1 } }],
                    "as": "delivery",
                } },
                doc! { "$match": { "delivery.0": { "$exists": true } } },
                doc! { "$count": "running" },
            ])
            .await?
            .try_collect()
            .await?;
        Ok(Statistics {
            pending,
            running: running
                .first()
                .and_then(|doc| int(doc, "running"))
                .map_or(0, |n| n.max(0) as u64),
            parked,
            dead,
            completed: history + legacy,
            oldest_due_at: oldest.and_then(|doc| doc.get_datetime("dueAt").ok().copied()),
        })
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
        if !(1..=MAX_LIST_LIMIT).contains(&query.limit) {
            return Err(InvalidArgumentError::new(
                "limit",
                format!(
                    "{} is out of range; list 1 to 1000 records at a time",
                    query.limit
                ),
            )
            .into());
        }
        let inner = &self.inner;
        let base = query.filter();
        let sort = doc! { "createdAt": 1, "_id": 1 };
        let wanted = query.skip.saturating_add(u64::from(query.limit));
        let wanted = i64::try_from(wanted).unwrap_or(i64::MAX);

        // Deliveries of the wanted states, then (for completed) the history.
        let mut delivery_filter = base.clone();
        match query.status {
            Some(status) => {
                delivery_filter.insert("status", status.as_str());
            }
            None => {
                delivery_filter.insert("status", doc! { "$in": ["pending", "dead"] });
            }
        }
        let mut records: Vec<DeliveryRecord> = inner
            .deliveries
            .find(delivery_filter)
            .sort(sort.clone())
            .limit(wanted)
            .await?
            .try_collect::<Vec<Document>>()
            .await?
            .iter()
            .filter_map(DeliveryRecord::from_document)
            .collect();
        let completed_wanted = matches!(query.status, None | Some(DeliveryStatus::Completed))
            && inner.completion_history;
        if completed_wanted {
            let history: Vec<DeliveryRecord> = inner
                .completed
                .find(base)
                .sort(sort)
                .limit(wanted)
                .await?
                .try_collect::<Vec<Document>>()
                .await?
                .iter()
                .filter_map(DeliveryRecord::from_document)
                .collect();
            if query.status.is_some() {
                // Legacy `completed` documents and history records, in one order.
                records.extend(history);
                records.sort_by_key(|r| (r.created_at, r.id));
            } else {
                records.extend(history);
            }
        }
        Ok(records
            .into_iter()
            .skip(usize::try_from(query.skip).unwrap_or(usize::MAX))
            .take(query.limit as usize)
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
        if ids.len() > MAX_REQUEUE {
            return Err(InvalidArgumentError::new(
                "ids",
                format!("{} ids given; requeue at most 10000 at a time", ids.len()),
            )
            .into());
        }
        let mut parsed = Vec::new();
        let mut not_found = Vec::new();
        for id in ids {
            let id = id.as_ref();
            match ObjectId::parse_str(id) {
                Ok(oid) if !parsed.contains(&oid) => parsed.push(oid),
                Ok(_) => {}
                Err(_) => not_found.push(id.to_owned()),
            }
        }
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
        Ok(outcome)
    }

    async fn requeue_in(
        &self,
        session: &mut ClientSession,
        ids: &[ObjectId],
        now: DateTime,
    ) -> Result<Requeued> {
        let inner = &self.inner;
        let dead: Vec<Document> = inner
            .deliveries
            .find(doc! { "_id": { "$in": ids }, "status": "dead" })
            .projection(doc! { "handler": 1, "key": 1, "sequence": 1, "laneId": 1 })
            .session(&mut *session)
            .await?
            .stream(&mut *session)
            .try_collect()
            .await?;
        let found: HashSet<ObjectId> = dead
            .iter()
            .filter_map(|doc| doc.get_object_id("_id").ok())
            .collect();
        let mut outcome = Requeued {
            not_found: ids
                .iter()
                .filter(|id| !found.contains(id))
                .map(|id| id.to_hex())
                .collect(),
            ..Requeued::default()
        };

        // What runs in the lanes of the keyed ones.
        let mut lane_ids: Vec<i32> = dead
            .iter()
            .filter(|doc| doc.contains_key("key"))
            .filter_map(|doc| int(doc, "laneId").and_then(|l| i32::try_from(l).ok()))
            .collect();
        lane_ids.sort_unstable();
        lane_ids.dedup();
        let mut running: HashMap<(String, String), Vec<i64>> = HashMap::new();
        if !lane_ids.is_empty() {
            let lanes: Vec<Document> = inner
                .lanes
                .find(doc! { "_id": { "$in": &lane_ids } })
                .projection(doc! { "inFlight": 1 })
                .session(&mut *session)
                .await?
                .stream(&mut *session)
                .try_collect()
                .await?;
            let listed: Vec<ObjectId> = lanes
                .iter()
                .flat_map(|lane| object_ids(lane, "inFlight"))
                .collect();
            if !listed.is_empty() {
                let docs: Vec<Document> = inner
                    .deliveries
                    .find(doc! { "_id": { "$in": listed }, "status": "pending" })
                    .projection(doc! { "handler": 1, "key": 1, "sequence": 1 })
                    .session(&mut *session)
                    .await?
                    .stream(&mut *session)
                    .try_collect()
                    .await?;
                for doc in &docs {
                    if let (Some(handler), Some(key), Some(sequence)) = (
                        string(doc, "handler"),
                        string(doc, "key"),
                        int(doc, "sequence"),
                    ) {
                        running.entry((handler, key)).or_default().push(sequence);
                    }
                }
            }
        }
        for doc in &dead {
            let Ok(id) = doc.get_object_id("_id") else {
                continue;
            };
            let later_runs = match (string(doc, "handler"), string(doc, "key")) {
                (Some(handler), Some(key)) => {
                    let sequence = int(doc, "sequence").unwrap_or(i64::MIN);
                    running
                        .get(&(handler, key))
                        .is_some_and(|runs| runs.iter().any(|&s| s > sequence))
                }
                _ => false,
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
                doc! { "_id": { "$in": &outcome.requeued }, "status": "dead" },
                doc! {
                    "$set": {
                        "status": "pending",
                        "lane": "ready",
                        "attempts": 0,
                        "dueAt": now,
                        "updatedAt": now,
                    },
                    "$inc": { "claims": 1_i64 },
                },
            )
            .session(&mut *session)
            .await?;
        if !lane_ids.is_empty() {
            // A claim that read one of these lanes before this commits no longer matches it
            // when it records, and one that records first makes this transaction conflict.
            inner
                .lanes
                .update_many(
                    doc! { "_id": { "$in": &lane_ids } },
                    doc! { "$inc": { "requeues": 1_i64 } },
                )
                .session(&mut *session)
                .await?;
        }
        Ok(outcome)
    }

    /// Hands back every lane `owner` holds on this store instance, for a worker that stops.
    /// Returns how many lanes it handed back.
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
                doc! { "owner": owner, "instance": self.inner.claims.instance },
                doc! { "$set": {
                    "owner": Bson::Null,
                    "instance": Bson::Null,
                    "leaseExpiresAt": Bson::Null,
                } },
            )
            .await?;
        Ok(result.modified_count)
    }
}
