//! Picking: the per-key rules, applied to the due deliveries the scans read, in their order.
//!
//! A delivery the owner runs already is passed over. An unkeyed delivery is picked as it comes.
//! A keyed delivery is picked only when it is the lowest pending delivery of its handler and key,
//! no delivery of that handler and key runs, and this claim picked none of them yet: deliveries
//! of one key run one at a time per handler, in sequence order. The others wait, and the claim
//! may park them. Picking stops at the claim's limit.
//!
//! Picking reads nothing. Before a page is picked from, the scan looks up the lowest pending
//! delivery of the keys the rules need and do not know yet ([`Picking::unknown_keys`]).

use std::collections::{HashMap, HashSet};

use mongodb::bson::oid::ObjectId;

use super::scan::Candidate;

/// A handler and an ordering key.
pub(super) type KeyOf = (String, String);

/// What the per-key rules know and what they decided, over one claim.
#[derive(Debug, Default)]
pub(super) struct Picking {
    /// The most deliveries the claim hands out.
    pub(super) limit: usize,
    /// Deliveries listed by the owner's lanes whose documents exist: they run.
    pub(super) running: HashSet<ObjectId>,
    /// Keys with a running delivery.
    running_keys: HashSet<KeyOf>,
    /// The lowest pending delivery of each key looked up so far (`None`: nothing pending).
    heads: HashMap<KeyOf, Option<ObjectId>>,
    /// Keys of which this claim picked a delivery.
    picked_keys: HashSet<KeyOf>,
    pub(super) picks: Vec<Candidate>,
    /// Deliveries found waiting behind an unfinished predecessor, per key, with their lanes.
    pub(super) waiting: HashMap<KeyOf, Vec<(ObjectId, i32)>>,
}

impl Picking {
    /// Picking up to `limit` deliveries, with what runs in the owner's lanes.
    pub(super) fn new(
        limit: usize,
        running: HashSet<ObjectId>,
        running_keys: HashSet<KeyOf>,
    ) -> Picking {
        Picking {
            limit,
            running,
            running_keys,
            ..Picking::default()
        }
    }

    pub(super) fn full(&self) -> bool {
        self.picks.len() >= self.limit
    }

    /// The keys of `page` whose lowest pending delivery the per-key rules need and do not know
    /// yet: keys seen for the first time, unless one of their deliveries runs or was picked
    /// (their deliveries wait whatever the lowest is).
    pub(super) fn unknown_keys(&self, page: &[Candidate]) -> Vec<KeyOf> {
        let mut unknown: Vec<KeyOf> = Vec::new();
        for candidate in page {
            if let Some(key) = &candidate.key {
                let key_of = (candidate.handler.clone(), key.clone());
                if !self.heads.contains_key(&key_of)
                    && !self.running_keys.contains(&key_of)
                    && !self.picked_keys.contains(&key_of)
                    && !unknown.contains(&key_of)
                {
                    unknown.push(key_of);
                }
            }
        }
        unknown
    }

    /// Remembers the lowest pending delivery of each of `keys` as looked up; `lowest` leaves out
    /// the keys with nothing pending.
    pub(super) fn learn_heads(
        &mut self,
        keys: Vec<KeyOf>,
        lowest: &HashMap<KeyOf, (ObjectId, i64)>,
    ) {
        for key_of in keys {
            let head = lowest.get(&key_of).map(|(id, _)| *id);
            self.heads.insert(key_of, head);
        }
    }

    /// Applies the per-key rules to a page of candidates, in order, until the claim is full. No
    /// database access: the lowest pending delivery of each key was looked up before.
    pub(super) fn pick(&mut self, page: Vec<Candidate>) {
        for candidate in page {
            if self.full() {
                break;
            }
            if self.running.contains(&candidate.id) {
                continue;
            }
            let Some(key) = &candidate.key else {
                self.picks.push(candidate);
                continue;
            };
            let key_of = (candidate.handler.clone(), key.clone());
            let free = !self.picked_keys.contains(&key_of)
                && !self.running_keys.contains(&key_of)
                && self.heads.get(&key_of) == Some(&Some(candidate.id));
            if free {
                self.picked_keys.insert(key_of);
                self.picks.push(candidate);
            } else {
                self.waiting
                    .entry(key_of)
                    .or_default()
                    .push((candidate.id, candidate.lane));
            }
        }
    }
}
