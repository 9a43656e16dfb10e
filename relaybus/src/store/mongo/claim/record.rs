//! Recording: the batch written on the lanes, then what waits parked.
//!
//! The record is one conditional write per lane, all in one `update` command. It takes the free
//! lanes the claim picked from (the epoch grows by one), takes and hands back at once the free
//! lanes that yielded nothing, and hands back the held lanes that yielded nothing and run
//! nothing, but for the lanes the owner owns. The writes to the other held lanes (new picks
//! listed, gone deliveries taken off, a lease renewed before it runs out) are one
//! multi-document statement ([`relist_statements`]). A lane whose condition no longer holds
//! (another claimer took it first, or a requeue touched it) keeps nothing of this claim: when
//! fewer lanes matched than were written to, the lanes are read again to confirm which picks
//! they list.

use std::collections::{BTreeMap, HashMap, HashSet};

use futures::TryStreamExt;
use mongodb::bson::{Bson, DateTime, Document, doc, oid::ObjectId};

use super::{Request, pick::KeyOf, scan::Candidate, take::Hold};
use crate::{
    error::Result,
    store::mongo::{
        MongoEventStore,
        lane::{Lane, Relist, STATEMENTS_PER_COMMAND, free_and_clean, relist_statements},
        schema::field,
    },
};

/// What the record kept.
#[derive(Debug)]
pub(super) struct Recorded {
    /// The claim's lanes, with the epochs of the lanes it took moved on.
    pub(super) lanes: Vec<Lane>,
    /// The picks the lanes list: all of them, unless a lane changed hands.
    pub(super) picks: Vec<Candidate>,
    /// Some picks were given up because another claimer took their lane first.
    pub(super) raced: bool,
    /// The lanes handed back: everything due in them waits.
    pub(super) handed_back: HashSet<i32>,
    /// Every lane written to matched its condition.
    pub(super) all_matched: bool,
}

impl MongoEventStore {
    /// Records `picks` on the claim's `lanes` in one command, and hands back the lanes that yielded
    /// nothing and run nothing, but those in `keep`. Deliveries a held lane lists that no longer
    /// exist (not in `running`) are taken off it. A kept lane whose lease runs out within half
    /// the claim's lease is renewed. When a write did not match, keeps only the picks of the
    /// lanes that list them under the epoch they were read in.
    pub(super) async fn record(
        &self,
        request: &Request<'_>,
        mut lanes: Vec<(Lane, Hold)>,
        mut picks: Vec<Candidate>,
        running: &HashSet<ObjectId>,
        keep: &HashSet<i32>,
    ) -> Result<Recorded> {
        let inner = &self.inner;
        let instance = inner.claims.instance;
        let Request {
            owner,
            expires_at,
            now,
            ..
        } = *request;
        // A kept lane is renewed once less than half the claim's lease is left of its own.
        let renew_before = DateTime::from_millis(
            now.timestamp_millis() + (expires_at.timestamp_millis() - now.timestamp_millis()) / 2,
        );
        let mut by_lane: BTreeMap<i32, Vec<ObjectId>> = BTreeMap::new();
        for pick in &picks {
            by_lane.entry(pick.lane).or_default().push(pick.id);
        }
        let mut statements = Vec::new();
        let mut relists = Vec::new();
        let mut recorded_lanes = Vec::new();
        let mut handed_back = HashSet::new();
        let mut gone_ids = Vec::new();
        for (lane, hold) in &mut lanes {
            let new_ids = by_lane.get(&lane.id).map(Vec::as_slice).unwrap_or(&[]);
            if let Hold::Joining { epoch } = hold {
                // Taken only if it is still free and unchanged since it was read: same epoch,
                // no requeue, nothing listed.
                let mut filter = doc! {
                    field::ID: lane.id,
                    field::EPOCH: epoch.clone(),
                    field::REQUEUES: lane.requeues.clone(),
                };
                filter.extend(free_and_clean(now));
                lane.epoch = lane.epoch.saturating_add(1);
                if new_ids.is_empty() && !keep.contains(&lane.id) {
                    // Taken and handed back in one write: it yielded nothing.
                    handed_back.insert(lane.id);
                    statements.push(doc! {
                        "q": filter,
                        "u": { "$set": {
                            field::EPOCH: lane.epoch,
                            field::OWNER: Bson::Null,
                            field::INSTANCE: Bson::Null,
                            field::LEASE_EXPIRES_AT: Bson::Null,
                            field::IN_FLIGHT: [],
                            field::LOST: [],
                        } },
                    });
                } else {
                    lane.lease_expires_at = Some(expires_at);
                    lane.in_flight = new_ids.to_vec();
                    lane.lost.clear();
                    statements.push(doc! {
                        "q": filter,
                        "u": { "$set": {
                            field::EPOCH: lane.epoch,
                            field::OWNER: owner,
                            field::INSTANCE: instance,
                            field::LEASE_EXPIRES_AT: expires_at,
                            field::IN_FLIGHT: new_ids,
                            field::LOST: [],
                        } },
                    });
                    recorded_lanes.push(lane.id);
                }
                continue;
            }
            let held = matches!(hold, Hold::Held);
            let gone: Vec<ObjectId> = lane
                .in_flight
                .iter()
                .filter(|id| !running.contains(id))
                .copied()
                .collect();
            let runs = lane.in_flight.len() > gone.len();
            let kept = keep.contains(&lane.id);
            let renew = kept && lane.lease_expires_at.is_none_or(|at| at < renew_before);
            gone_ids.extend(gone.iter().copied());
            let filter = lane.held_filter(owner, instance);
            if new_ids.is_empty() && !runs && !kept {
                handed_back.insert(lane.id);
                statements.push(doc! {
                    "q": filter,
                    "u": { "$set": {
                        field::OWNER: Bson::Null,
                        field::INSTANCE: Bson::Null,
                        field::LEASE_EXPIRES_AT: Bson::Null,
                        field::IN_FLIGHT: [],
                        field::LOST: [],
                    } },
                });
            } else if !new_ids.is_empty()
                || !gone.is_empty()
                || !lane.lost.is_empty()
                || !held
                || renew
            {
                relists.push(Relist {
                    filter,
                    lane: lane.id,
                    gone,
                    added: new_ids.to_vec(),
                });
                if !new_ids.is_empty() {
                    recorded_lanes.push(lane.id);
                }
            }
        }
        let (relisting, relisted_lanes) = relist_statements(&relists, expires_at);
        let expected = statements.len() as u64 + relisted_lanes;
        statements.extend(relisting);
        let lanes: Vec<Lane> = lanes
            .into_iter()
            .map(|(mut lane, _)| {
                // A relist renews the lease up to the claim's expiry, and lists what it says.
                if let Some(relist) = relists.iter().find(|relist| relist.lane == lane.id) {
                    lane.lease_expires_at = lane.lease_expires_at.max(Some(expires_at));
                    lane.in_flight.retain(|id| !relist.gone.contains(id));
                    lane.in_flight.extend(relist.added.iter().copied());
                    lane.lost.clear();
                }
                lane
            })
            .collect();
        let mut matched = 0;
        for chunk in statements.chunks(STATEMENTS_PER_COMMAND) {
            matched += self.update_lanes(chunk).await?;
        }
        inner.claims.forget(gone_ids);
        let mut raced = false;
        if matched < expected && !recorded_lanes.is_empty() {
            // A lane changed hands, or a requeue touched it, since it was read: keep only the
            // picks of lanes that list them under the epoch they were read in.
            let confirmed = self
                .confirm_recorded(&lanes, &recorded_lanes, &by_lane, owner)
                .await?;
            let lost = recorded_lanes
                .iter()
                .filter(|lane| !confirmed.contains(lane))
                .count();
            crate::telemetry::record_lane_conflicts(lost as u64);
            let before = picks.len();
            picks.retain(|pick| confirmed.contains(&pick.lane));
            raced = picks.len() < before;
        }
        Ok(Recorded {
            lanes,
            picks,
            raced,
            handed_back,
            all_matched: matched == expected,
        })
    }

    /// Parks what waits, best effort: big backlogs of one key, and whatever waits in a lane
    /// handed back (its due work is all blocked). A failure is logged; the next claims scan
    /// them again.
    pub(super) async fn park_waiting(
        &self,
        owner: &str,
        waiting: &HashMap<KeyOf, Vec<(ObjectId, i32)>>,
        handed_back: &HashSet<i32>,
    ) {
        let threshold = usize::try_from(self.inner.park_threshold).unwrap_or(usize::MAX);
        let mut to_park: Vec<ObjectId> = Vec::new();
        for waiting in waiting.values() {
            if waiting.len() >= threshold {
                to_park.extend(waiting.iter().map(|(id, _)| *id));
            } else {
                to_park.extend(
                    waiting
                        .iter()
                        .filter(|(_, lane)| handed_back.contains(lane))
                        .map(|(id, _)| *id),
                );
            }
        }
        if !to_park.is_empty()
            && let Err(error) = self.park(&to_park).await
        {
            tracing::warn!(
                owner,
                count = to_park.len(),
                %error,
                "relaybus: parking waiting deliveries failed; the next claims scan them again"
            );
        }
    }

    /// After a short write: the lanes (of those given) that list their picks under the epoch the
    /// claim read.
    async fn confirm_recorded(
        &self,
        lanes: &[Lane],
        recorded: &[i32],
        picks: &BTreeMap<i32, Vec<ObjectId>>,
        owner: &str,
    ) -> Result<HashSet<i32>> {
        let instance = self.inner.claims.instance;
        let docs: Vec<Document> = self
            .inner
            .lanes
            .find(doc! { field::ID: { "$in": recorded } })
            .await?
            .try_collect()
            .await?;
        let mut confirmed = HashSet::new();
        for doc in &docs {
            let Some(now) = Lane::from_document(doc) else {
                continue;
            };
            let Some(then) = lanes.iter().find(|lane| lane.id == now.id) else {
                continue;
            };
            let ours = doc.get_str(field::OWNER) == Ok(owner)
                && doc.get_object_id(field::INSTANCE) == Ok(instance)
                && now.epoch == then.epoch;
            let listed = picks
                .get(&now.id)
                .is_some_and(|ids| ids.iter().all(|id| now.in_flight.contains(id)));
            if ours && listed {
                confirmed.insert(now.id);
            }
        }
        Ok(confirmed)
    }
}
