//! Completing deliveries: the delivery document goes, the event records when it was last
//! completed, and (with completion history) a record of the completion is kept.
//!
//! A completion never writes a lane document, so completions of one lane never conflict with
//! each other. It relies on the takeover instead: a worker that takes a lane over charges every
//! delivery the previous holder still ran (which moves their claim generation on) before it reads
//! anything, so a completion and a takeover can never both succeed.

use std::collections::{HashMap, HashSet};

use futures::TryStreamExt;
use mongodb::{
    ClientSession,
    bson::{Bson, DateTime, Document, doc, oid::ObjectId},
};

use super::{
    MongoEventStore,
    lane::{add, int, int32, object_ids},
    lease::{Facts, Lease, generation_filter},
    schema::{QUICK_COMPLETION, field, path, status},
};
use crate::{error::Result, store::checks};

/// The epoch of each lane and which of the leased deliveries it lists.
type Listings = HashMap<i32, (i64, HashSet<ObjectId>)>;

/// What the fence check knows about one delivery.
#[derive(Debug)]
struct Found {
    claims: i64,
    lane: Option<i64>,
    event_id: Option<String>,
    document: Document,
}

impl MongoEventStore {
    /// Completes one delivery: [`complete_many`](Self::complete_many) with one lease.
    ///
    /// Returns `true` when the delivery was completed under this lease, `false` when the lease
    /// no longer holds (the lane changed hands, or the claim ended otherwise) or completion
    /// could not be proven; then nothing of this call remains.
    ///
    /// # Errors
    ///
    /// [`Error::Database`](crate::Error::Database).
    ///
    /// # Cancel safety
    ///
    /// Dropping the future may or may not have completed the delivery; completing it again with
    /// the same lease then returns `false` if it was.
    pub async fn complete(&self, lease: &Lease, now: DateTime) -> Result<bool> {
        let outcome = self.complete_many(std::slice::from_ref(lease), now).await?;
        Ok(outcome.first().copied().unwrap_or(false))
    }

    /// Completes a batch of deliveries from any number of lanes, returning for each lease, in
    /// order, whether its delivery was completed under it.
    ///
    /// A lease counts only while its lane still has the lease's epoch and lists the delivery,
    /// and the delivery still has the lease's claim generation; a worker that lost its lane
    /// changes nothing. Without completion history this needs no transaction and costs three
    /// commands for any batch: read the deliveries' claim generations and the lanes (one
    /// aggregation), stamp the events' completion time (majority), and delete the
    /// deliveries that still have their lease's generation. When every lease is a claim this
    /// store instance handed out and has not seen settled, the read is of the lanes alone:
    /// the claim noted the generation and what the stamp needs. A delivery appended with its new
    /// event, created just before, and completed within a minute, never requeued, leaves its
    /// event unstamped (see the crate documentation); a batch of only such deliveries costs
    /// two commands. When fewer deliveries were deleted
    /// than passed the checks (a claim ended or changed hands meanwhile), no lease is reported
    /// completed: a missing document cannot be told from one completed by the newer claim, so
    /// success is reported only when proven. The events keep their stamp: their handlers did
    /// finish then, and the deliveries not deleted run again.
    ///
    /// With [`completion_history`](crate::MongoEventStoreBuilder::completion_history) the
    /// batch runs in one transaction that also inserts the completion records.
    ///
    /// `now` is the completion time: what the events are stamped with, and what tells whether
    /// a completion is quick.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`](crate::Error::InvalidArgument) for more than 10,000 leases;
    /// [`Error::Database`](crate::Error::Database).
    ///
    /// # Cancel safety
    ///
    /// As for [`complete`](Self::complete).
    pub async fn complete_many(&self, leases: &[Lease], now: DateTime) -> Result<Vec<bool>> {
        if leases.is_empty() {
            return Ok(Vec::new());
        }
        checks::check_batch(leases.len(), "complete")?;
        let outcome = if self.inner.completion_history {
            self.own_transaction((self, leases, now), |session, (store, leases, now)| {
                Box::pin(store.complete_in(session, leases, *now))
            })
            .await
        } else {
            self.complete_without_transaction(leases, now).await
        };
        let outcome = outcome.inspect_err(|_| {
            // It may have applied: the next claim reads the lanes to know.
            for lease in leases {
                self.inner.claims.completing(lease);
            }
        })?;
        for lease in leases {
            self.inner.claims.settled(lease);
        }
        Ok(outcome)
    }

    /// Completes a delivery inside the caller's transaction, for handlers whose writes must
    /// commit together with the completion: either both commit or neither does.
    ///
    /// The completion reads the lane and deletes the delivery in `session`'s transaction. A
    /// takeover charging the delivery meanwhile writes the same document, so whichever commits
    /// second conflicts: the caller's transaction fails with a transient error and, run again,
    /// sees the new state and returns `false`.
    ///
    /// # Errors
    ///
    /// [`ConfigurationError::NoTransaction`](crate::ConfigurationError::NoTransaction) when
    /// `session` has no started transaction; [`Error::Database`](crate::Error::Database), for
    /// example a write conflict labelled `TransientTransactionError`.
    ///
    /// # Example
    ///
    /// ```no_run
    /// # async fn example(store: relaybus::MongoEventStore, delivery: relaybus::ClaimedDelivery, projections: mongodb::Collection<mongodb::bson::Document>) -> Result<(), relaybus::Error> {
    /// use relaybus::mongodb::bson::{DateTime, doc};
    ///
    /// let completed = store
    ///     .transaction(async |session| {
    ///         projections.insert_one(doc! { "event": delivery.event_id() }).session(&mut *session).await?;
    ///         store.complete_in_transaction(session, delivery.lease(), DateTime::now()).await
    ///     })
    ///     .await?;
    /// # let _ = completed;
    /// # Ok(())
    /// # }
    /// ```
    pub async fn complete_in_transaction(
        &self,
        session: &mut ClientSession,
        lease: &Lease,
        now: DateTime,
    ) -> Result<bool> {
        self.ensure_in_transaction(session, "MongoEventStore.complete_in_transaction")
            .await?;
        // Whether it commits is the caller's: the next claim reads the lane to know.
        self.inner.claims.completing(lease);
        self.complete_one_in(session, lease, now).await
    }

    /// Completes deliveries inside the caller's transaction, as `complete_many` does inside
    /// the store's own: one read of the deliveries with their lanes, then the writes of all of
    /// them, instead of a round trip per step of each delivery.
    pub(crate) async fn complete_many_in_transaction(
        &self,
        session: &mut ClientSession,
        leases: &[Lease],
        now: DateTime,
    ) -> Result<Vec<bool>> {
        self.ensure_in_transaction(session, "MongoEventStore.complete_many_in_transaction")
            .await?;
        if leases.is_empty() {
            return Ok(Vec::new());
        }
        self.complete_in(session, leases, now).await
    }

    /// The completion of one delivery inside a transaction, each step a lookup by `_id`: the
    /// lane must still list the delivery in the lease's epoch, the delivery is deleted only
    /// while it has the lease's claim generation (the delete returns the document, for the
    /// event's stamp and the completion history), then the event is stamped, unless the
    /// completion is quick ([`completes_quickly`]) and there is no completion history.
    async fn complete_one_in(
        &self,
        session: &mut ClientSession,
        lease: &Lease,
        now: DateTime,
    ) -> Result<bool> {
        let inner = &self.inner;
        let id = lease.delivery_id();
        let listed = inner
            .lanes
            .find_one(doc! {
                field::ID: lease.lane_i32(),
                field::EPOCH: generation_filter(lease.epoch()),
                field::IN_FLIGHT: id,
            })
            .projection(doc! { field::ID: 1 })
            .session(&mut *session)
            .await?;
        if listed.is_none() {
            return Ok(false);
        }
        let Some(deleted) = inner
            .deliveries
            .find_one_and_delete(doc! {
                field::ID: id,
                field::LANE_ID: lease.lane_i32(),
                field::CLAIMS: lease.generation_filter(),
            })
            .session(&mut *session)
            .await?
        else {
            return Ok(false);
        };
        if inner.completion_history {
            inner
                .completed
                .insert_one(history_record(&deleted, now))
                .session(&mut *session)
                .await?;
        }
        // As without a transaction, a quick completion of a fresh delivery stamps nothing.
        let quick = !inner.completion_history && completes_quickly(&deleted, now);
        if !quick && let Ok(event_id) = deleted.get_str(field::EVENT_ID) {
            inner
                .events
                .update_one(
                    doc! { field::ID: event_id },
                    doc! { "$max": { field::COMPLETED_AT: now } },
                )
                .session(&mut *session)
                .await?;
        }
        Ok(true)
    }

    /// The completion without a transaction: one read, then two writes.
    async fn complete_without_transaction(
        &self,
        leases: &[Lease],
        now: DateTime,
    ) -> Result<Vec<bool>> {
        let inner = &self.inner;
        if let Some(facts) = inner.claims.facts_of(leases) {
            return self.complete_issued(leases, &facts, now).await;
        }
        let ids = unique_ids(leases);
        let (found, lanes) = self.read_fence(leases, &ids).await?;
        let fenced = still_held(leases, &found, &lanes);
        if fenced.is_empty() {
            return Ok(vec![false; leases.len()]);
        }
        // 1. The events are stamped before the deliveries go, with the store's write concern
        //    (majority): a purge never finds one of them without deliveries and without its
        //    completion time, and no failover can roll the stamp back under an acknowledged
        //    delete. The handler has finished its work by now; if the delete then finds the
        //    claim ended (the lease changed hands meanwhile), the stamp still says when a handler
        //    last completed the event, and the delivery runs again. A fresh event completed
        //    quickly is not stamped: purge and the event detail take it as completed by its
        //    creation plus `UNSTAMPED_BY` (see `field::FRESH`).
        // 2. Then the deliveries that still have their lease's claim generation go.
        let event_ids = event_ids(&fenced, &found, Some(now));
        self.stamp_and_delete(leases, &fenced, &event_ids, now)
            .await
    }

    /// A completion's writes once its leases are fenced: the events of `event_ids` stamped
    /// (majority), then the `fenced` deliveries that still have their lease's claim generation
    /// deleted; the outcome of each of `leases`.
    async fn stamp_and_delete<E: AsRef<str>>(
        &self,
        leases: &[Lease],
        fenced: &[Lease],
        event_ids: &[E],
        now: DateTime,
    ) -> Result<Vec<bool>> {
        let inner = &self.inner;
        if !event_ids.is_empty() {
            let ids: Vec<&str> = event_ids.iter().map(AsRef::as_ref).collect();
            inner
                .events
                .update_many(
                    doc! { field::ID: { "$in": ids } },
                    doc! { "$max": { field::COMPLETED_AT: now } },
                )
                .await?;
        }
        let deleted = inner
            .deliveries
            .delete_many(delete_filter(fenced))
            .await?
            .deleted_count;
        Ok(outcome(leases, fenced, deleted))
    }

    /// The completion inside a transaction: the store's own (completion history) or the
    /// caller's.
    async fn complete_in(
        &self,
        session: &mut ClientSession,
        leases: &[Lease],
        now: DateTime,
    ) -> Result<Vec<bool>> {
        let inner = &self.inner;
        let ids = unique_ids(leases);
        // The deliveries with their lanes, in one read: the lane of each comes along with only
        // the leased ids of its in-flight list. A `$lookup`, not the `$unionWith` of the read
        // outside a transaction: the server refuses `$unionWith` in a transaction.
        let docs: Vec<Document> = inner
            .deliveries
            .aggregate([
                doc! { "$match": { field::ID: { "$in": &ids } } },
                doc! { "$lookup": {
                    "from": inner.lanes.name(),
                    "localField": field::LANE_ID,
                    "foreignField": field::ID,
                    "pipeline": [{ "$project": listing_projection(&ids) }],
                    "as": LANE_OF_DELIVERY,
                } },
            ])
            .session(&mut *session)
            .await?
            .stream(&mut *session)
            .try_collect()
            .await?;
        let mut lane_docs = Vec::new();
        let docs: Vec<Document> = docs
            .into_iter()
            .map(|mut doc| {
                if let Some(Bson::Array(lanes)) = doc.remove(LANE_OF_DELIVERY) {
                    lane_docs.extend(lanes.into_iter().filter_map(|lane| match lane {
                        Bson::Document(lane) => Some(lane),
                        _ => None,
                    }));
                }
                doc
            })
            .collect();
        let found = found(docs);
        let fenced = still_held(leases, &found, &listings_of(&lane_docs));
        if fenced.is_empty() {
            return Ok(vec![false; leases.len()]);
        }
        let deleted = inner
            .deliveries
            .delete_many(delete_filter(&fenced))
            .session(&mut *session)
            .await?
            .deleted_count;
        if inner.completion_history && deleted == fenced.len() as u64 {
            let records: Vec<Document> = fenced
                .iter()
                .filter_map(|lease| found.get(&lease.delivery_id()))
                .map(|found| history_record(&found.document, now))
                .collect();
            if !records.is_empty() {
                inner
                    .completed
                    .insert_many(records)
                    .session(&mut *session)
                    .await?;
            }
        }
        let event_ids = event_ids(&fenced, &found, None);
        inner
            .events
            .update_many(
                doc! { field::ID: { "$in": event_ids } },
                doc! { "$max": { field::COMPLETED_AT: now } },
            )
            .session(&mut *session)
            .await?;
        Ok(outcome(leases, &fenced, deleted))
    }

    /// The completion of claims this instance issued and has not seen settled, whose
    /// deliveries' facts (`facts`, one per lease) the claims noted: their documents are not
    /// read. The lanes fence the leases as in [`complete_without_transaction`]; the delete is
    /// conditional on each lease's claim generation, which only a takeover of the lane (that
    /// the fence catches) or a settlement of the claim (which would have been seen) moves on.
    ///
    /// [`complete_without_transaction`]: Self::complete_without_transaction
    async fn complete_issued(
        &self,
        leases: &[Lease],
        facts: &[Facts],
        now: DateTime,
    ) -> Result<Vec<bool>> {
        let inner = &self.inner;
        let ids = unique_ids(leases);
        let lane_ids = unique_lanes(leases);
        let docs: Vec<Document> = inner
            .lanes
            .find(doc! { field::ID: { "$in": &lane_ids } })
            // Only the leased ids of each in-flight list come back, not the whole list.
            .projection(listing_projection(&ids))
            // One more than can come: the first batch then ends the cursor.
            .batch_size(u32::try_from(lane_ids.len() + 1).unwrap_or(u32::MAX))
            .await?
            .try_collect()
            .await?;
        let all: Vec<&Lease> = leases.iter().collect();
        let fenced = fence(&all, &listings_of(&docs));
        if fenced.is_empty() {
            return Ok(vec![false; leases.len()]);
        }
        // As in the read one: the events first, unless the completion is quick.
        let fenced_ids: HashSet<ObjectId> = fenced.iter().map(Lease::delivery_id).collect();
        let mut event_ids: Vec<&str> = leases
            .iter()
            .zip(facts)
            .filter(|(lease, facts)| {
                fenced_ids.contains(&lease.delivery_id())
                    && !facts
                        .quick_since
                        .is_some_and(|created| quick_at(created, now))
            })
            .map(|(_, facts)| facts.event_id.as_str())
            .collect();
        event_ids.sort_unstable();
        event_ids.dedup();
        self.stamp_and_delete(leases, &fenced, &event_ids, now)
            .await
    }

    /// The claim generations of the leased deliveries and the listings of their lanes, in one
    /// aggregation: the deliveries, then the lanes' documents joined on with `$unionWith` (one
    /// read of each collection, told apart by the type of their `_id`). Neither read is a proof
    /// on its own: the lanes fence the leases, and the delete that follows is conditional on the
    /// generation.
    async fn read_fence(
        &self,
        leases: &[Lease],
        ids: &[ObjectId],
    ) -> Result<(HashMap<ObjectId, Found>, Listings)> {
        let inner = &self.inner;
        let lane_ids = unique_lanes(leases);
        let pipeline = [
            doc! { "$match": { field::ID: { "$in": ids } } },
            doc! { "$project": {
                field::CLAIMS: 1, field::LANE_ID: 1, field::EVENT_ID: 1, field::CREATED_AT: 1,
                field::FRESH: 1, field::REQUEUED: 1,
            } },
            doc! { "$unionWith": {
                "coll": inner.lanes.name(),
                "pipeline": [
                    { "$match": { field::ID: { "$in": &lane_ids } } },
                    // Only the leased ids of each in-flight list come back, not the whole list.
                    { "$project": listing_projection(ids) },
                ],
            } },
        ];
        let docs: Vec<Document> = inner
            .deliveries
            .aggregate(pipeline)
            // One more than can come: the first batch then ends the cursor, without a getMore.
            .batch_size(u32::try_from(ids.len() + lane_ids.len() + 1).unwrap_or(u32::MAX))
            .await?
            .try_collect()
            .await?;
        let (deliveries, lanes): (Vec<Document>, Vec<Document>) = docs
            .into_iter()
            .partition(|doc| matches!(doc.get(field::ID), Some(Bson::ObjectId(_))));
        Ok((found(deliveries), listings_of(&lanes)))
    }
}

/// The field a transactional completion's read puts each delivery's lane in.
const LANE_OF_DELIVERY: &str = "__relaybusLane";

/// A lane's epoch and, of its in-flight list, only the ids among `ids`.
fn listing_projection(ids: &[ObjectId]) -> Document {
    doc! {
        field::EPOCH: 1,
        field::IN_FLIGHT: { "$filter": {
            "input": { "$ifNull": [path::IN_FLIGHT, []] },
            "cond": { "$in": ["$$this", { "$literal": ids }] },
        } },
    }
}

/// The epoch of each lane document and the ids its in-flight list holds.
fn listings_of(docs: &[Document]) -> Listings {
    docs.iter()
        .filter_map(|doc| {
            let id = int32(doc, field::ID)?;
            let epoch = int(doc, field::EPOCH).unwrap_or(0);
            Some((
                id,
                (
                    epoch,
                    object_ids(doc, field::IN_FLIGHT).into_iter().collect(),
                ),
            ))
        })
        .collect()
}

fn unique_ids(leases: &[Lease]) -> Vec<ObjectId> {
    let mut ids: Vec<ObjectId> = leases.iter().map(Lease::delivery_id).collect();
    ids.sort_unstable();
    ids.dedup();
    ids
}

/// The lanes of the leases, each once, in order.
fn unique_lanes(leases: &[Lease]) -> Vec<i32> {
    let mut lanes: Vec<i32> = leases.iter().map(Lease::lane_i32).collect();
    lanes.sort_unstable();
    lanes.dedup();
    lanes
}

fn found(docs: Vec<Document>) -> HashMap<ObjectId, Found> {
    docs.into_iter()
        .filter_map(|doc| {
            let id = doc.get_object_id(field::ID).ok()?;
            Some((
                id,
                Found {
                    claims: int(&doc, field::CLAIMS).unwrap_or(0),
                    lane: int(&doc, field::LANE_ID),
                    event_id: doc.get_str(field::EVENT_ID).ok().map(str::to_owned),
                    document: doc,
                },
            ))
        })
        .collect()
}

/// The leases that still hold their delivery: its claim generation and lane unchanged
/// ([`generation_holds`]) and its lane's epoch and listing too ([`fence`]).
fn still_held(leases: &[Lease], found: &HashMap<ObjectId, Found>, lanes: &Listings) -> Vec<Lease> {
    let current: Vec<&Lease> = leases
        .iter()
        .filter(|lease| generation_holds(lease, found))
        .collect();
    if current.is_empty() {
        return Vec::new();
    }
    fence(&current, lanes)
}

/// Whether the delivery still exists, in the lease's lane, with the lease's claim generation.
fn generation_holds(lease: &Lease, found: &HashMap<ObjectId, Found>) -> bool {
    found.get(&lease.delivery_id()).is_some_and(|found| {
        found.claims == lease.claims() && found.lane == Some(i64::from(lease.lane()))
    })
}

/// The leases whose lane still has their epoch and lists their delivery, one per delivery.
fn fence(leases: &[&Lease], lanes: &Listings) -> Vec<Lease> {
    let mut seen = HashSet::new();
    leases
        .iter()
        .filter(|lease| {
            lanes.get(&lease.lane_i32()).is_some_and(|(epoch, listed)| {
                *epoch == lease.epoch() && listed.contains(&lease.delivery_id())
            })
        })
        .filter(|lease| seen.insert(lease.delivery_id()))
        .map(|lease| **lease)
        .collect()
}

/// Deletes each fenced delivery only while it still has its lease's claim generation.
fn delete_filter(fenced: &[Lease]) -> Document {
    let mut by_generation: HashMap<i64, Vec<ObjectId>> = HashMap::new();
    for lease in fenced {
        by_generation
            .entry(lease.claims())
            .or_default()
            .push(lease.delivery_id());
    }
    let branches: Vec<Document> = by_generation
        .into_iter()
        .map(|(claims, ids)| doc! { field::ID: { "$in": ids }, field::CLAIMS: generation_filter(claims) })
        .collect();
    doc! { "$or": branches }
}

/// The events a completion of `fenced` stamps, each once; with `quick_at` (the completion
/// time), not those whose deliveries all complete quickly ([`completes_quickly`]).
fn event_ids(
    fenced: &[Lease],
    found: &HashMap<ObjectId, Found>,
    quick_at: Option<DateTime>,
) -> Vec<String> {
    let mut ids: Vec<String> = fenced
        .iter()
        .filter_map(|lease| found.get(&lease.delivery_id()))
        .filter(|found| quick_at.is_none_or(|now| !completes_quickly(&found.document, now)))
        .filter_map(|found| found.event_id.clone())
        .collect();
    ids.sort_unstable();
    ids.dedup();
    ids
}

/// Whether the completion of `delivery` at `now` leaves its event unstamped: the delivery is
/// fresh (appended with its new event, created just before), was never requeued, and was
/// created less than [`QUICK_COMPLETION`] before `now`.
fn completes_quickly(delivery: &Document, now: DateTime) -> bool {
    delivery.get_bool(field::FRESH) == Ok(true)
        && int(delivery, field::REQUEUED).unwrap_or(0) == 0
        && delivery
            .get_datetime(field::CREATED_AT)
            .is_ok_and(|created| quick_at(*created, now))
}

/// Whether a completion at `now` of a delivery a completion may leave unstamped, created at
/// `created`, is quick: less than [`QUICK_COMPLETION`] after its creation.
fn quick_at(created: DateTime, now: DateTime) -> bool {
    created <= now && add(created, QUICK_COMPLETION).is_ok_and(|end| now < end)
}

/// One entry per lease: completed only when every fenced delivery was deleted. Linear in the
/// batch: the fenced leases are looked up in a set.
fn outcome(leases: &[Lease], fenced: &[Lease], deleted: u64) -> Vec<bool> {
    if deleted < fenced.len() as u64 {
        return vec![false; leases.len()];
    }
    let fenced: HashSet<&Lease> = fenced.iter().collect();
    leases.iter().map(|lease| fenced.contains(lease)).collect()
}

/// The record a completion leaves with completion history on.
fn history_record(delivery: &Document, now: DateTime) -> Document {
    let mut record = Document::new();
    for field in [
        field::ID,
        field::EVENT_ID,
        field::HANDLER,
        field::EVENT_TYPE,
        field::KEY,
        field::SEQUENCE,
        field::UNORDERED,
        field::LANE_ID,
        field::CREATED_AT,
        field::LAST_ERROR,
        field::ERRORS,
        field::REQUEUED,
    ] {
        if let Some(value) = delivery.get(field) {
            record.insert(field, value.clone());
        }
    }
    let attempts = int(delivery, field::ATTEMPTS)
        .unwrap_or(0)
        .saturating_add(1);
    record.insert(field::ATTEMPTS, Bson::Int64(attempts));
    record.insert(field::STATUS, status::COMPLETED);
    record.insert(field::COMPLETED_AT, now);
    record
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lease(n: u32) -> Lease {
        Lease::new(ObjectId::new(), n % 256, 1, 0)
    }

    #[test]
    fn the_outcome_names_the_fenced_leases_and_fails_all_on_a_short_delete() {
        let leases: Vec<Lease> = (0..4).map(lease).collect();
        let fenced = [leases[1], leases[3]];
        assert_eq!(outcome(&leases, &fenced, 2), [false, true, false, true]);
        assert_eq!(outcome(&leases, &fenced, 1), [false; 4]);
    }

    #[test]
    fn the_outcome_of_a_full_batch_is_linear() {
        // 10,000 leases, the most one completion takes: a lookup per lease in a list of
        // 10,000 would make 10^8 comparisons; the set makes 10^4 lookups.
        let leases: Vec<Lease> = (0..10_000).map(lease).collect();
        let started = std::time::Instant::now();
        let completed = outcome(&leases, &leases, 10_000);
        assert!(completed.iter().all(|c| *c));
        assert!(
            started.elapsed() < std::time::Duration::from_millis(500),
            "outcome of 10,000 leases took {:?}",
            started.elapsed()
        );
    }
}
