//! Claiming what the change stream reported, without looking for it.
//!
//! After an idle wait, the wake-ups that woke the owner carry the new deliveries' documents
//! ([`Arrival`]s). When every one of them is unkeyed (or unordered), due, and of the claim's
//! handlers, the claim records them on their lanes at once and reads them back at the same
//! time, in two commands sent together:
//!
//! - per lane, one conditional `findAndModify` that appends the deliveries to the lane's
//!   in-flight list, on one condition: the owner holds the lane on this instance, or the lane is
//!   free and clean (no holder or an expired lease, nothing in flight, no lost claim). A free
//!   lane is taken (its epoch grows by one). The write returns the lane as it was before.
//! - one aggregation that reads the lanes, then each lane's reported deliveries, then their
//!   events.
//!
//! The read tells whether the deliveries were still free to run when the write took them. Taking
//! a lane moves its epoch, and only a holder records on a lane; so when the read saw the lane
//! free and clean, or held by this owner without the deliveries, in the epoch and requeue count
//! the write found, nobody recorded on it between the read and the write, and the read's
//! deliveries were pending and unclaimed all along (an operator's bury moves the requeue count
//! of the lanes of what it buries). When the read saw the lane after the write (held by this
//! owner, the write's epoch, the deliveries listed), the lane was this owner's from the moment
//! the read found the deliveries. A lane where neither holds, or whose deliveries the read did
//! not find ready and due, gets them taken off its list again (nothing else was written: an
//! unkeyed claim writes no delivery) and the claim goes the usual way.

use std::collections::{BTreeMap, HashMap, HashSet};

use futures::{TryStreamExt, future};
use mongodb::{
    bson::{Bson, DateTime, Document, RawDocument, RawDocumentBuf, doc, oid::ObjectId},
    options::ReturnDocument,
};

use super::{Batch, ClaimedDelivery, Request, hand_out::envelope, scan::Candidate};
use crate::{
    error::Result,
    store::{
        Arrival,
        mongo::{
            MongoEventStore,
            lane::{int, int32, object_ids},
            lease::Lease,
            schema::{field, lane, path, status},
        },
    },
};

/// The most lanes a claim of arrivals writes to; more go the usual way.
const MAX_LANES: usize = 8;

/// The delivery document fields a wake-up carries (see
/// [`Queue::watch`](crate::store::Queue::watch)).
pub(crate) fn arrival_fields() -> Document {
    let mut fields = Document::new();
    for name in [
        field::ID,
        field::EVENT_ID,
        field::HANDLER,
        field::KEY,
        field::SEQUENCE,
        field::UNORDERED,
        field::LANE_ID,
        field::STATUS,
        field::LANE,
        field::ATTEMPTS,
        field::CLAIMS,
        field::DUE_AT,
    ] {
        fields.insert(format!("fullDocument.{name}"), 1);
    }
    fields
}

/// The delivery a wake-up told of, if the document it carries is one of a pending delivery in
/// the ready lane.
pub(super) fn candidate_of(arrival: &Arrival) -> Option<Candidate> {
    RawDocument::from_bytes(arrival.as_bytes())
        .ok()
        .filter(|doc| {
            doc.get_str(field::STATUS) == Ok(status::PENDING)
                && doc.get_str(field::LANE) == Ok(lane::READY)
        })
        .and_then(Candidate::from_raw)
}

/// What a claim of arrivals did.
#[derive(Debug)]
pub(super) enum Arrived {
    /// It handed these out, and whether it took every arrival: nothing else was reported.
    Claimed { batch: Batch, all: bool },
    /// It claimed nothing: the claim goes the usual way.
    Declined,
}

/// One lane's part of a claim of arrivals.
#[derive(Debug)]
struct LanePicks {
    lane: i32,
    ids: Vec<ObjectId>,
}

/// The lane as the write found it.
#[derive(Debug)]
struct Before {
    held: bool,
    epoch: i64,
    /// Its requeue count (`null` when it has none): a requeue, or an operator's bury, moves it.
    requeues: Bson,
    lease_expires_at: Option<DateTime>,
}

impl MongoEventStore {
    /// Claims the `arrivals` of an idle owner directly (see the module documentation), or
    /// declines when they are not all unkeyed, due deliveries of the claim's handlers in a few
    /// lanes, or a lane's condition fails.
    pub(super) async fn claim_arrivals(
        &self,
        request: &Request<'_>,
        arrivals: &[Arrival],
        limit: usize,
    ) -> Result<Arrived> {
        let Request {
            owner,
            handlers,
            expires_at,
            now,
        } = *request;
        let mut by_lane: BTreeMap<i32, Vec<ObjectId>> = BTreeMap::new();
        let mut seen = HashSet::new();
        for arrival in arrivals {
            let Some(candidate) = candidate_of(arrival) else {
                return Ok(Arrived::Declined);
            };
            if candidate.key.is_some()
                || candidate.due_at > now
                || !handlers.contains(&candidate.handler.as_str())
            {
                return Ok(Arrived::Declined);
            }
            // Reported again, or already claimed by an earlier claim of this instance.
            if !seen.insert(candidate.id) || self.inner.claims.issued(&candidate.id).is_some() {
                continue;
            }
            by_lane
                .entry(candidate.lane)
                .or_default()
                .push(candidate.id);
        }
        if seen.len() > limit || by_lane.len() > MAX_LANES {
            return Ok(Arrived::Declined);
        }
        if by_lane.is_empty() {
            return Ok(Arrived::Declined);
        }
        let picks: Vec<LanePicks> = by_lane
            .into_iter()
            .map(|(lane, ids)| LanePicks { lane, ids })
            .collect();

        let (written, read) = futures::join!(
            future::try_join_all(
                picks
                    .iter()
                    .map(|picks| self.record_arrivals(picks, owner, expires_at, now))
            ),
            self.read_arrivals(&picks),
        );
        let written = written?;
        let read = read?;

        let instance = self.inner.claims.instance;
        let mut claimed = Vec::new();
        let mut taken_back = Vec::new();
        let mut all = true;
        // Lanes whose condition failed because another live owner holds them: theirs to run.
        let mut elsewhere = 0;
        for (picks, before) in picks.iter().zip(written) {
            let seen = read.get(&picks.lane);
            let Some(before) = before else {
                // The lane is held by another owner, or has something to settle first.
                all = false;
                if seen.is_some_and(|seen| seen.held_elsewhere(owner, instance, now)) {
                    elsewhere += 1;
                }
                continue;
            };
            let epoch = if before.held {
                before.epoch
            } else {
                before.epoch.saturating_add(1)
            };
            let in_time = seen.is_some_and(|seen| {
                seen.proves_in_time(&before, epoch, &picks.ids, owner, instance, now)
            });
            let lane_expiry = if before.held {
                before
                    .lease_expires_at
                    .map_or(expires_at, |at| at.max(expires_at))
            } else {
                expires_at
            };
            let mut handed: Vec<ClaimedDelivery> = Vec::new();
            if let Some(seen) = seen.filter(|_| in_time) {
                for id in &picks.ids {
                    let Some(Found {
                        candidate, event, ..
                    }) = seen.deliveries.get(id)
                    else {
                        break;
                    };
                    if candidate.key.is_some()
                        || candidate.due_at > now
                        || candidate.lane != picks.lane
                        || !handlers.contains(&candidate.handler.as_str())
                    {
                        break;
                    }
                    handed.push(ClaimedDelivery {
                        lease: Lease::new(*id, picks.lane as u32, epoch, candidate.claims),
                        lease_expires_at: lane_expiry,
                        handler: candidate.handler.clone(),
                        attempt: u32::try_from(candidate.attempts.max(0).saturating_add(1))
                            .unwrap_or(u32::MAX),
                        sequence: candidate.sequence,
                        ordered: false,
                        event: envelope(&candidate.event_id, event),
                    });
                }
            }
            if handed.len() == picks.ids.len() {
                claimed.extend(handed);
            } else {
                all = false;
                taken_back.push((picks, epoch));
            }
        }
        self.inner.claims.issue(claimed.iter().map(|c| c.lease));
        if !taken_back.is_empty() {
            // Nothing of these lanes is handed out: their picks come off the lists again.
            let statements: Vec<Document> = taken_back
                .iter()
                .map(|(picks, epoch)| {
                    doc! {
                        "q": { field::ID: picks.lane, field::OWNER: owner,
                               field::INSTANCE: instance, field::EPOCH: *epoch },
                        "u": { "$pull": { field::IN_FLIGHT: { "$in": &picks.ids } } },
                    }
                })
                .collect();
            self.update_lanes(&statements).await?;
        }
        if claimed.is_empty() {
            if elsewhere == picks.len() {
                // Every reported delivery is in a lane another live owner holds: the usual
                // claim, which reads only the reported lanes after an idle wait, would find
                // nothing either.
                return Ok(Arrived::Claimed {
                    batch: Batch::default(),
                    all: false,
                });
            }
            return Ok(Arrived::Declined);
        }
        Ok(Arrived::Claimed {
            batch: Batch {
                claimed,
                raced: false,
                again: false,
            },
            all,
        })
    }

    /// Appends `picks` to their lane's in-flight list, if the owner holds the lane on this
    /// instance or it is free and clean (then it is taken). The lane as it was, or `None` when
    /// the condition failed.
    async fn record_arrivals(
        &self,
        picks: &LanePicks,
        owner: &str,
        expires_at: DateTime,
        now: DateTime,
    ) -> Result<Option<Before>> {
        let instance = self.inner.claims.instance;
        let held = doc! { "$and": [
            { "$eq": [path::OWNER, { "$literal": owner }] },
            { "$eq": [path::INSTANCE, { "$literal": instance }] },
        ] };
        let before = self
            .inner
            .lanes
            .find_one_and_update(
                doc! {
                    field::ID: picks.lane,
                    field::IN_FLIGHT: { "$nin": &picks.ids },
                    field::LOST: { "$in": [Bson::Null, []] },
                    "$or": [
                        { field::OWNER: owner, field::INSTANCE: instance },
                        {
                            field::IN_FLIGHT: { "$in": [Bson::Null, []] },
                            "$or": [
                                { field::OWNER: Bson::Null },
                                { field::LEASE_EXPIRES_AT: { "$lte": now } },
                            ],
                        },
                    ],
                },
                vec![doc! { "$set": {
                    field::EPOCH: { "$cond": [
                        &held,
                        path::EPOCH,
                        { "$add": [{ "$ifNull": [path::EPOCH, 0_i64] }, 1_i64] },
                    ] },
                    field::LEASE_EXPIRES_AT: { "$cond": [
                        &held,
                        { "$max": [path::LEASE_EXPIRES_AT, expires_at] },
                        expires_at,
                    ] },
                    field::IN_FLIGHT: { "$concatArrays": [
                        { "$cond": [&held, { "$ifNull": [path::IN_FLIGHT, []] }, []] },
                        { "$literal": &picks.ids },
                    ] },
                    field::OWNER: { "$literal": owner },
                    field::INSTANCE: { "$literal": instance },
                    field::LOST: { "$literal": [] },
                } }],
            )
            .projection(doc! {
                field::OWNER: 1, field::INSTANCE: 1, field::EPOCH: 1, field::REQUEUES: 1,
                field::LEASE_EXPIRES_AT: 1,
            })
            .return_document(ReturnDocument::Before)
            .await?;
        Ok(before.map(|lane| Before {
            held: held_by(&lane, owner, instance),
            epoch: int(&lane, field::EPOCH).unwrap_or(0),
            requeues: lane.get(field::REQUEUES).cloned().unwrap_or(Bson::Null),
            lease_expires_at: lane.get_datetime(field::LEASE_EXPIRES_AT).ok().copied(),
        }))
    }

    /// Reads the lanes of `picks`, then (later in the same command) each lane's picks that are
    /// still pending and ready, with their events.
    async fn read_arrivals(&self, picks: &[LanePicks]) -> Result<HashMap<i32, Seen>> {
        let lanes: Vec<i32> = picks.iter().map(|picks| picks.lane).collect();
        let ids: Vec<ObjectId> = picks
            .iter()
            .flat_map(|picks| picks.ids.iter().copied())
            .collect();
        self.read_reported(&lanes, &ids, None).await
    }

    /// Reads `lanes`, then (later in the same command, correlated, so that it runs for each
    /// lane after the lane was read) each lane's deliveries among `ids` that are still pending
    /// and ready, with their events and the result of `lookup` (a `$lookup` stage into
    /// [`Found::lowest`], if given).
    pub(super) async fn read_reported(
        &self,
        lanes: &[i32],
        ids: &[ObjectId],
        lookup: Option<Document>,
    ) -> Result<HashMap<i32, Seen>> {
        let mut deliveries = vec![
            doc! { "$match": {
                field::ID: { "$in": ids },
                field::STATUS: status::PENDING,
                field::LANE: lane::READY,
                "$expr": { "$eq": [path::LANE_ID, "$$lane"] },
            } },
            super::scan::event_lookup(self.inner.events.name()),
        ];
        deliveries.extend(lookup);
        let pipeline = vec![
            doc! { "$match": { field::ID: { "$in": lanes } } },
            doc! { "$project": {
                field::OWNER: 1, field::INSTANCE: 1, field::EPOCH: 1, field::REQUEUES: 1,
                field::LEASE_EXPIRES_AT: 1, field::IN_FLIGHT: 1, field::LOST: 1,
            } },
            doc! { "$lookup": {
                "from": self.inner.deliveries.name(),
                "let": { "lane": path::ID },
                "pipeline": deliveries,
                "as": "d",
            } },
        ];
        let docs: Vec<Document> = self
            .inner
            .lanes
            .aggregate(pipeline)
            .await?
            .try_collect()
            .await?;
        let mut seen = HashMap::with_capacity(docs.len());
        for doc in docs {
            let Some(id) = int32(&doc, field::ID) else {
                continue;
            };
            let mut deliveries = HashMap::new();
            if let Ok(found) = doc.get_array("d") {
                for delivery in found.iter().filter_map(Bson::as_document) {
                    let Some(candidate) = Candidate::from_document(delivery) else {
                        continue;
                    };
                    let first = |name: &str| {
                        delivery
                            .get_array(name)
                            .ok()
                            .and_then(|found| found.first())
                            .and_then(Bson::as_document)
                    };
                    let event =
                        first("event").and_then(|event| RawDocumentBuf::from_document(event).ok());
                    let lowest =
                        first(LOWEST).and_then(|lowest| lowest.get_object_id(field::ID).ok());
                    if let Some(event) = event {
                        deliveries.insert(
                            candidate.id,
                            Found {
                                candidate,
                                event,
                                lowest,
                            },
                        );
                    }
                }
            }
            seen.insert(
                id,
                Seen {
                    lane: doc,
                    deliveries,
                },
            );
        }
        Ok(seen)
    }
}

/// Where [`MongoEventStore::read_reported`] expects the result of its extra lookup.
pub(super) const LOWEST: &str = "lowest";

/// A reported delivery as the read found it.
#[derive(Debug)]
pub(super) struct Found {
    pub(super) candidate: Candidate,
    pub(super) event: RawDocumentBuf,
    /// The id the extra lookup found first, if any.
    pub(super) lowest: Option<ObjectId>,
}

/// A lane and its reported deliveries, as the read saw them.
#[derive(Debug)]
pub(super) struct Seen {
    pub(super) lane: Document,
    /// The pending, ready deliveries found, with their events.
    pub(super) deliveries: HashMap<ObjectId, Found>,
}

impl Seen {
    /// Whether the read shows the write in time (see the module documentation): the lane as
    /// the write found it (`before`), unchanged since the read, free and clean or this owner's
    /// without `ids`; or the write's own result, in `epoch`, listing `ids`.
    fn proves_in_time(
        &self,
        before: &Before,
        epoch: i64,
        ids: &[ObjectId],
        owner: &str,
        instance: ObjectId,
        now: DateTime,
    ) -> bool {
        let ours = held_by(&self.lane, owner, instance);
        let seen_epoch = int(&self.lane, field::EPOCH).unwrap_or(0);
        let listed = object_ids(&self.lane, field::IN_FLIGHT);
        // The same requeue count too: a bury between the read and the write moves it (the
        // read found the deliveries pending, the write would list one dead).
        let seen_requeues = self.lane.get(field::REQUEUES).unwrap_or(&Bson::Null);
        let before_the_write = seen_epoch == before.epoch
            && *seen_requeues == before.requeues
            && if before.held {
                ours && ids.iter().all(|id| !listed.contains(id))
            } else {
                listed.is_empty()
                    && lost_is_empty(&self.lane)
                    && (self.lane.get(field::OWNER).is_none_or(|o| *o == Bson::Null)
                        || self.lease_expires_at().is_some_and(|at| at <= now))
            };
        let after_the_write =
            ours && seen_epoch == epoch && ids.iter().all(|id| listed.contains(id));
        before_the_write || after_the_write
    }

    /// Whether another owner (or this owner on another store instance) holds the lane on a
    /// lease that has not ended.
    fn held_elsewhere(&self, owner: &str, instance: ObjectId, now: DateTime) -> bool {
        self.lane.get_str(field::OWNER).is_ok()
            && !held_by(&self.lane, owner, instance)
            && self.lease_expires_at().is_some_and(|at| at > now)
    }

    fn lease_expires_at(&self) -> Option<DateTime> {
        self.lane
            .get_datetime(field::LEASE_EXPIRES_AT)
            .ok()
            .copied()
    }
}

/// Whether a lane document names `owner` on `instance` as its holder.
fn held_by(lane: &Document, owner: &str, instance: ObjectId) -> bool {
    lane.get_str(field::OWNER) == Ok(owner) && lane.get_object_id(field::INSTANCE) == Ok(instance)
}

/// Whether a lane document lists no lost claim.
fn lost_is_empty(lane: &Document) -> bool {
    match lane.get(field::LOST) {
        None | Some(Bson::Null) => true,
        Some(Bson::Array(items)) => items.is_empty(),
        Some(_) => false,
    }
}
