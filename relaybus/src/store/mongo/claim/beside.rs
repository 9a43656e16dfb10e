//! Claiming new deliveries beside a running claim.
//!
//! A busy owner claims back to back, and a claim hands out what it found only when it ends: a
//! delivery of a new key, reported by the change stream while a claim runs, would wait for that
//! claim and the whole next one. Instead, the owner may claim what the wake-ups reported while
//! its claim runs, on its own, in two round trips:
//!
//! - one read: the lanes of the reported deliveries, the deliveries themselves (still pending,
//!   ready and due), their events, and for a keyed delivery the lowest pending delivery of its
//!   handler and key;
//! - one conditional write per lane, under the epoch, requeue count and holder the read saw,
//!   that lists the deliveries on the lane (taking it, epoch moved on, when it was free).
//!
//! A delivery is taken only when the plain case holds: the lane is free and clean (no live
//! holder, nothing in flight, no lost claim) or held by this owner on this instance with
//! nothing lost and only claims this instance handed out in flight; the delivery is due, of the
//! claim's handlers, not already handed out; and, keyed, it is its key's lowest pending
//! delivery while no claim of its key handed out by this instance is outstanding (a lane held
//! here lists only this instance's claims, a free and clean one nothing). Anything else
//! is left to the owner's next claim, which looks at the reported lanes first.
//!
//! The running claim and this one stay apart through the owner's gate (see [`OwnerGate`]):
//!
//! - the deliveries are remembered as handed out, with their leases, before the write is sent,
//!   so a read of the running claim that finds them listed takes them for its own claims (a
//!   read that cannot tell reconciles, and keeps them);
//! - the running claim decides its record only while no claim beside it runs, and leaves out
//!   what was handed out meanwhile: a pick handed out beside it, or one of a key that now runs;
//! - a lane written beside it is never handed back by the running claim, which read it before
//!   the write;
//! - a claim of a key's next delivery, and a claim of reported deliveries after an idle wait,
//!   never run beside one.
//!
//! [`OwnerGate`]: crate::store::mongo::lease::OwnerGate

use std::collections::{BTreeMap, HashMap, HashSet};

use futures::future;
use mongodb::bson::{Bson, DateTime, doc, oid::ObjectId};

use super::{
    ClaimedDelivery,
    arrive::{Found, LOWEST, Seen, candidate_of},
    hand_out::envelope,
    scan::Candidate,
};
use crate::{
    error::Result,
    store::{
        Arrival,
        mongo::{
            MongoEventStore,
            lane::{Lane, add, check_lease_duration, check_owner, free_and_clean},
            lease::Lease,
            schema::{field, index, path, status},
        },
    },
};

/// The most lanes one claim beside a running claim writes to.
const MAX_LANES: usize = 8;

impl MongoEventStore {
    /// Claims, for `owner`, up to `limit` of the deliveries the wake-ups reported (`arrivals`)
    /// while a claim of the owner runs, when they can be handed out at once (see the module
    /// documentation); the rest is left to the owner's next claim.
    pub(crate) async fn claim_beside(
        &self,
        owner: &str,
        handlers: &[&str],
        arrivals: &[Arrival],
        limit: usize,
        lease_duration: std::time::Duration,
        now: DateTime,
    ) -> Result<Vec<ClaimedDelivery>> {
        check_owner(owner)?;
        check_lease_duration(lease_duration)?;
        let expires_at = add(now, lease_duration)?;
        let claims = &self.inner.claims;
        let gate = claims.gate(owner);
        let _apart = gate.beside.write().await;
        if gate.interrupted.load(std::sync::atomic::Ordering::SeqCst) {
            return Ok(Vec::new());
        }
        let mut by_lane: BTreeMap<i32, Vec<Candidate>> = BTreeMap::new();
        let mut ids = HashSet::new();
        let mut taken = 0;
        for arrival in arrivals {
            let Some(candidate) = candidate_of(arrival) else {
                continue;
            };
            let fresh = candidate.due_at <= now
                && handlers.contains(&candidate.handler.as_str())
                && claims.issued(&candidate.id).is_none()
                && candidate
                    .key
                    .as_ref()
                    .is_none_or(|key| !claims.key_issued(&candidate.handler, key))
                && ids.insert(candidate.id);
            if !fresh || taken == limit {
                continue;
            }
            if !by_lane.contains_key(&candidate.lane) && by_lane.len() == MAX_LANES {
                continue;
            }
            taken += 1;
            by_lane.entry(candidate.lane).or_default().push(candidate);
        }
        if by_lane.is_empty() {
            return Ok(Vec::new());
        }
        let seen = self.read_beside(&by_lane).await?;
        let instance = claims.instance;

        // What each lane may take, with the lease each delivery will have. Of a key, only its
        // lowest pending delivery may run.
        let mut writes = Vec::new();
        let mut keys = HashSet::new();
        for (lane_id, candidates) in &by_lane {
            let Some(seen) = seen.get(lane_id) else {
                continue;
            };
            let Some(lane) = Lane::from_document(&seen.lane) else {
                continue;
            };
            let held = seen.lane.get_str(field::OWNER) == Ok(owner)
                && seen.lane.get_object_id(field::INSTANCE) == Ok(instance);
            let free = lane.in_flight.is_empty()
                && (matches!(seen.lane.get(field::OWNER), None | Some(Bson::Null))
                    || lane.lease_expires_at.is_some_and(|at| at <= now));
            // Nothing of a candidate's key runs on this instance (checked above), and a lane
            // held here lists only this instance's claims: nothing of it runs anywhere.
            if !lane.lost.is_empty() || !(held || free) {
                continue;
            }
            let epoch = if held {
                lane.epoch
            } else {
                lane.epoch.saturating_add(1)
            };
            let mut picks = Vec::new();
            for candidate in candidates {
                let Some(Found {
                    candidate: found,
                    event,
                    lowest,
                }) = seen.deliveries.get(&candidate.id)
                else {
                    continue;
                };
                let may_run = found.lane == *lane_id
                    && found.due_at <= now
                    && !lane.in_flight.contains(&found.id)
                    && found.key == candidate.key
                    && found.key.as_ref().is_none_or(|key| {
                        *lowest == Some(found.id)
                            && keys.insert((found.handler.clone(), key.clone()))
                    });
                if may_run {
                    picks.push((found.clone(), event.clone()));
                }
            }
            if !picks.is_empty() {
                writes.push((lane, held, epoch, picks));
            }
        }
        if writes.is_empty() {
            return Ok(Vec::new());
        }

        // Handed out before the write is sent: see the module documentation.
        let leases: Vec<Lease> = writes
            .iter()
            .flat_map(|(lane, _, epoch, picks)| {
                picks
                    .iter()
                    .map(|(pick, _)| Lease::new(pick.id, lane.id as u32, *epoch, pick.claims))
            })
            .collect();
        claims.issue(leases.iter().copied());
        claims.issue_keys(writes.iter().flat_map(|(_, _, _, picks)| {
            picks.iter().filter_map(|(pick, _)| {
                pick.key
                    .clone()
                    .map(|key| (pick.id, (pick.handler.clone(), key)))
            })
        }));
        gate.touch(
            writes.iter().map(|(lane, ..)| lane.id),
            writes
                .iter()
                .flat_map(|(.., picks)| picks.iter().map(|(pick, _)| pick.id)),
        );
        let ids: Vec<Vec<ObjectId>> = writes
            .iter()
            .map(|(.., picks)| picks.iter().map(|(pick, _)| pick.id).collect())
            .collect();
        let results = future::join_all(writes.iter().zip(&ids).map(
            |((lane, held, epoch, _), ids)| {
                self.record_beside(lane, *held, *epoch, ids, owner, expires_at, now)
            },
        ))
        .await;
        let mut claimed = Vec::new();
        let mut failed = None;
        let mut forget = Vec::new();
        for ((lane, held, epoch, picks), result) in writes.into_iter().zip(results) {
            match result {
                Ok(true) => {
                    let lane_expiry = if held {
                        lane.lease_expires_at
                            .map_or(expires_at, |at| at.max(expires_at))
                    } else {
                        expires_at
                    };
                    for (pick, event) in picks {
                        claimed.push(ClaimedDelivery {
                            lease: Lease::new(pick.id, lane.id as u32, epoch, pick.claims),
                            lease_expires_at: lane_expiry,
                            attempt: u32::try_from(pick.attempts.max(0).saturating_add(1))
                                .unwrap_or(u32::MAX),
                            sequence: pick.sequence,
                            ordered: pick.key.is_some(),
                            event: envelope(&pick.event_id, &event),
                            handler: pick.handler,
                        });
                    }
                }
                Ok(false) => forget.extend(picks.iter().map(|(pick, _)| pick.id)),
                Err(error) => {
                    // It may have listed them: the owner's next claim reconciles its lanes.
                    forget.extend(picks.iter().map(|(pick, _)| pick.id));
                    failed = Some(error);
                }
            }
        }
        claims.forget(forget);
        if let Some(error) = failed {
            gate.interrupted
                .store(true, std::sync::atomic::Ordering::SeqCst);
            if claimed.is_empty() {
                return Err(error);
            }
            tracing::warn!(owner, %error, "relaybus: claiming reported deliveries beside a claim failed in part");
        }
        Ok(claimed)
    }

    /// Reads the lanes of `by_lane`, then (in the same command) each lane's candidates that are
    /// still pending and ready, with their events and, for a keyed one, the lowest pending
    /// delivery of its handler and key.
    async fn read_beside(
        &self,
        by_lane: &BTreeMap<i32, Vec<Candidate>>,
    ) -> Result<HashMap<i32, Seen>> {
        let lanes: Vec<i32> = by_lane.keys().copied().collect();
        let ids: Vec<ObjectId> = by_lane
            .values()
            .flat_map(|candidates| candidates.iter().map(|c| c.id))
            .collect();
        let lowest = doc! { "$lookup": {
            "from": self.inner.deliveries.name(),
            "let": {
                "handler": path::HANDLER,
                "key": { "$ifNull": [path::KEY, Bson::Null] },
            },
            "pipeline": [
                { "$match": {
                    field::STATUS: status::PENDING,
                    field::KEY: { "$exists": true },
                    "$expr": { "$and": [
                        { "$eq": [path::HANDLER, "$$handler"] },
                        { "$eq": [path::KEY, "$$key"] },
                    ] },
                } },
                { "$sort": index::ordering_keys() },
                { "$limit": 1 },
                { "$project": { field::ID: 1 } },
            ],
            "as": LOWEST,
        } };
        self.read_reported(&lanes, &ids, Some(lowest)).await
    }

    /// Lists `ids` on `lane` if it is as the read saw it: held by `owner` on this instance
    /// (`held`), or free and clean (then taken, in `epoch`). Whether it matched.
    #[allow(clippy::too_many_arguments)]
    async fn record_beside(
        &self,
        lane: &Lane,
        held: bool,
        epoch: i64,
        ids: &[ObjectId],
        owner: &str,
        expires_at: DateTime,
        now: DateTime,
    ) -> Result<bool> {
        let instance = self.inner.claims.instance;
        let (filter, update) = if held {
            let mut filter = lane.held_filter(owner, instance);
            filter.insert(field::IN_FLIGHT, doc! { "$nin": ids });
            filter.insert(field::LOST, doc! { "$in": [Bson::Null, []] });
            (
                filter,
                vec![doc! { "$set": {
                    field::IN_FLIGHT: { "$concatArrays": [
                        { "$ifNull": [path::IN_FLIGHT, []] },
                        { "$literal": ids },
                    ] },
                    field::LEASE_EXPIRES_AT: { "$max": [path::LEASE_EXPIRES_AT, expires_at] },
                } }],
            )
        } else {
            let mut filter = doc! {
                field::ID: lane.id,
                field::EPOCH: lane.epoch,
                field::REQUEUES: lane.requeues.clone(),
            };
            filter.extend(free_and_clean(now));
            (
                filter,
                vec![doc! { "$set": {
                    field::EPOCH: epoch,
                    field::OWNER: { "$literal": owner },
                    field::INSTANCE: { "$literal": instance },
                    field::LEASE_EXPIRES_AT: expires_at,
                    field::IN_FLIGHT: { "$literal": ids },
                    field::LOST: { "$literal": [] },
                } }],
            )
        };
        let updated = self.inner.lanes.update_one(filter, update).await?;
        Ok(updated.matched_count == 1)
    }
}
