//! Taking lanes: the free lanes a member owns, free lanes joined to a claim, and the claims
//! earlier holders lost.
//!
//! The owned lanes that are free and clean (nothing in flight, nothing lost) are taken in one
//! conditional write that increments their epochs. Any other free lane is taken with a
//! conditional `findAndModify` that increments the lane epoch and moves the previous holder's
//! in-flight list to `lost`, which the claim charges, one attempt per lost claim that may have
//! started and once, before it reads anything from the lane. A free, clean lane joined to a
//! claim for its work is read without a write: the record takes it, on condition that its
//! epoch, its requeue count and its empty lists are still what was read.

use std::collections::HashSet;

use futures::{TryStreamExt, future};
use mongodb::{
    bson::{Bson, DateTime, Document, doc, oid::ObjectId},
    options::ReturnDocument,
};

use super::{Request, free::FreeLane};
use crate::{
    error::{Error, Result},
    store::mongo::{
        MongoEventStore,
        lane::{Lane, LostClaim, STATEMENTS_PER_COMMAND, free_and_clean},
        schema::{field, path, status},
    },
};

/// How a claim holds a lane it records in.
#[derive(Debug, Clone)]
pub(super) enum Hold {
    /// Held under a live lease before the claim started.
    Held,
    /// Taken by this claim with its own conditional write, before it was read.
    Taken,
    /// Free and clean when read: the record takes it, if it is still unchanged. `epoch` is the
    /// epoch as stored when read.
    Joining { epoch: Bson },
}

impl MongoEventStore {
    /// Joins the `chosen` free lanes to the claim and returns the ids to scan. A clean lane
    /// (nothing in flight, nothing lost) is only remembered: the record takes it on condition
    /// that it is unchanged. Any other is taken at once with a conditional write and its lost
    /// claims are charged before it is read; a lane another claimer took first is left out.
    pub(super) async fn join_lanes(
        &self,
        chosen: &[i32],
        free: &[FreeLane],
        lanes: &mut Vec<(Lane, Hold)>,
        request: &Request<'_>,
    ) -> Result<Vec<i32>> {
        let Request {
            owner,
            expires_at,
            now,
            ..
        } = *request;
        let mut dirty = Vec::new();
        let mut scanned = Vec::new();
        for id in chosen {
            let Some(lane) = free.iter().find(|lane| lane.lane.id == *id) else {
                continue;
            };
            if lane.clean {
                scanned.push(*id);
                lanes.push((
                    lane.lane.clone(),
                    Hold::Joining {
                        epoch: lane.stored_epoch.clone(),
                    },
                ));
            } else {
                dirty.push(*id);
            }
        }
        if !dirty.is_empty() {
            let taken = self.take_lanes(&dirty, owner, expires_at, now).await?;
            self.charge_lost(&taken, now).await?;
            scanned.extend(taken.iter().map(|lane| lane.id));
            lanes.extend(taken.into_iter().map(|lane| (lane, Hold::Taken)));
        }
        Ok(scanned)
    }

    /// Takes the free lanes among the owned `ids`: the clean ones in one write, then the others
    /// one by one, their lost claims charged. Returns the lanes taken; a lane another holder
    /// still holds is left out.
    pub(super) async fn take_owned(&self, ids: &[i32], request: &Request<'_>) -> Result<Vec<Lane>> {
        let Request {
            owner,
            expires_at,
            now,
            ..
        } = *request;
        let inner = &self.inner;
        let instance = inner.claims.instance;
        let mut clean = doc! { field::ID: { "$in": ids } };
        clean.extend(free_and_clean(now));
        inner
            .lanes
            .update_many(
                clean,
                vec![doc! { "$set": {
                    field::EPOCH: { "$add": [{ "$ifNull": [path::EPOCH, 0_i64] }, 1_i64] },
                    field::OWNER: { "$literal": owner },
                    field::INSTANCE: { "$literal": instance },
                    field::LEASE_EXPIRES_AT: { "$literal": expires_at },
                    field::IN_FLIGHT: { "$literal": [] },
                    field::LOST: { "$literal": [] },
                } }],
            )
            .await?;
        let docs: Vec<Document> = inner
            .lanes
            .find(doc! { field::ID: { "$in": ids } })
            .await?
            .try_collect()
            .await?;
        let mut taken = Vec::new();
        let mut dirty = Vec::new();
        for doc in &docs {
            let Some(lane) = Lane::from_document(doc) else {
                continue;
            };
            let ours = doc.get_str(field::OWNER) == Ok(owner)
                && doc.get_object_id(field::INSTANCE) == Ok(instance);
            let expired = doc
                .get_datetime(field::LEASE_EXPIRES_AT)
                .map_or(true, |at| *at <= now);
            let unheld = doc.get_str(field::OWNER).is_err();
            if ours {
                taken.push(lane);
            } else if unheld || expired {
                dirty.push(lane.id);
            }
        }
        if !dirty.is_empty() {
            let more = self.take_lanes(&dirty, owner, expires_at, now).await?;
            self.charge_lost(&more, now).await?;
            taken.extend(more);
        }
        Ok(taken)
    }

    /// Takes free lanes, in parallel, each with one conditional `findAndModify`: the epoch grows
    /// by one and the previous holder's in-flight list moves to `lost`, tagged with the epoch it
    /// was claimed in. A lane another claimer took first is skipped.
    async fn take_lanes(
        &self,
        lanes: &[i32],
        owner: &str,
        expires_at: DateTime,
        now: DateTime,
    ) -> Result<Vec<Lane>> {
        let instance = self.inner.claims.instance;
        let takes = lanes.iter().map(|&lane| async move {
            let taken = self
                .inner
                .lanes
                .find_one_and_update(
                    doc! {
                        field::ID: lane,
                        "$or": [
                            { field::OWNER: Bson::Null },
                            { field::LEASE_EXPIRES_AT: { "$lte": now } },
                        ],
                    },
                    vec![doc! { "$set": {
                        field::LOST: { "$concatArrays": [
                            { "$ifNull": [path::LOST, []] },
                            { "$map": {
                                "input": { "$ifNull": [path::IN_FLIGHT, []] },
                                "in": {
                                    field::LOST_DELIVERY: "$$this",
                                    field::LOST_EPOCH: { "$ifNull": [path::EPOCH, 0_i64] },
                                },
                            } },
                        ] },
                        field::IN_FLIGHT: { "$literal": [] },
                        field::EPOCH: { "$add": [{ "$ifNull": [path::EPOCH, 0_i64] }, 1_i64] },
                        field::OWNER: { "$literal": owner },
                        field::INSTANCE: { "$literal": instance },
                        field::LEASE_EXPIRES_AT: { "$literal": expires_at },
                    } }],
                )
                .return_document(ReturnDocument::After)
                .await?;
            Ok::<_, Error>(taken.as_ref().and_then(Lane::from_document))
        });
        Ok(future::try_join_all(takes)
            .await?
            .into_iter()
            .flatten()
            .collect())
    }

    /// Charges the lost claims listed by `lanes` one attempt, once, with [`LOST_ERROR`] as its
    /// error: `lostAt` records the epoch of the last lost claim charged and only grows. The
    /// claim generation moves on, so the lease of the lost claim can no longer match.
    pub(super) async fn charge_lost(&self, lanes: &[Lane], now: DateTime) -> Result<()> {
        let lost: Vec<&LostClaim> = lanes.iter().flat_map(|lane| lane.lost.iter()).collect();
        if lost.is_empty() {
            return Ok(());
        }
        // A lane taken over lists what its holder ran; what completed since is gone, and its
        // completion wrote no lane document. Only lanes with a lost claim that still runs count
        // as taken over.
        let ids: Vec<ObjectId> = lost.iter().map(|lost| lost.delivery).collect();
        let pending: HashSet<ObjectId> = self
            .inner
            .deliveries
            .find(doc! { field::ID: { "$in": &ids }, field::STATUS: status::PENDING })
            .projection(doc! { field::ID: 1 })
            .await?
            .try_collect::<Vec<Document>>()
            .await?
            .iter()
            .filter_map(|doc| doc.get_object_id(field::ID).ok())
            .collect();
        let taken_over = lanes
            .iter()
            .filter(|lane| {
                lane.lost
                    .iter()
                    .any(|lost| pending.contains(&lost.delivery))
            })
            .count();
        crate::telemetry::record_takeovers(taken_over as u64, 0);
        let statements: Vec<Document> = lost
            .iter()
            .map(|lost| {
                let set = doc! {
                    field::CLAIMS: { "$add": [{ "$ifNull": [path::CLAIMS, 0_i64] }, 1_i64] },
                    field::LOST_AT: lost.epoch,
                    field::UPDATED_AT: now,
                    field::ATTEMPTS: { "$add": [{ "$ifNull": [path::ATTEMPTS, 0_i32] }, 1_i32] },
                    field::LAST_ERROR: { "$literal": LOST_ERROR },
                    field::ERRORS: crate::store::mongo::lane::push_error(LOST_ERROR, now),
                };
                doc! {
                    "q": {
                        field::ID: lost.delivery,
                        field::STATUS: status::PENDING,
                        "$or": [
                            { field::LOST_AT: { "$exists": false } },
                            { field::LOST_AT: { "$lt": lost.epoch } },
                        ],
                    },
                    "u": [{ "$set": set }],
                }
            })
            .collect();
        let mut charged = 0;
        for chunk in statements.chunks(STATEMENTS_PER_COMMAND) {
            let reply = self
                .update_statements(self.inner.deliveries.name(), chunk)
                .await?;
            charged +=
                crate::store::mongo::lane::int(&reply, "nModified").map_or(0, |n| n.max(0) as u64);
        }
        crate::telemetry::record_takeovers(0, charged);
        self.inner
            .claims
            .forget(lost.iter().map(|lost| lost.delivery));
        Ok(())
    }
}

/// The error of an attempt charged because its worker lost the claim.
pub(crate) const LOST_ERROR: &str =
    "the worker running this delivery stopped or lost its lease before it finished";
