//! Picking: the per-key rules, applied to the due deliveries the scans read, in their order.
//!
//! A delivery the owner runs already is passed over. An unkeyed delivery is picked as it comes,
//! and so is an unordered one (marked `unordered`: its candidate has no key).
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
    /// Deliveries the owner's lanes list: they run, or ran and are gone (a page read before
    /// their completion still shows them); and those of pages read ahead, picked from already.
    pub(super) passed_over: HashSet<ObjectId>,
    /// Keys with a running delivery.
    running_keys: HashSet<KeyOf>,
    /// The lowest pending delivery of each key looked up so far (`None`: nothing pending).
    heads: HashMap<KeyOf, Option<ObjectId>>,
    /// Keys of which this claim picked a delivery.
    picked_keys: HashSet<KeyOf>,
    pub(super) picks: Vec<Candidate>,
    /// Deliveries found waiting behind an unfinished predecessor, per key, with their lanes.
    pub(super) waiting: HashMap<KeyOf, Vec<(ObjectId, i32)>>,
    /// Lanes of due deliveries read after the claim was full.
    left_over: HashSet<i32>,
}

impl Picking {
    /// Picking up to `limit` deliveries, passing over what the owner's lanes list.
    pub(super) fn new(
        limit: usize,
        passed_over: HashSet<ObjectId>,
        running_keys: HashSet<KeyOf>,
    ) -> Picking {
        Picking {
            limit,
            passed_over,
            running_keys,
            ..Picking::default()
        }
    }

    pub(super) fn full(&self) -> bool {
        self.picks.len() >= self.limit
    }

    /// Whether `lane` gave picks, all unkeyed, and nothing of it waits: reading it deeper may
    /// give more.
    pub(super) fn drains_unkeyed(&self, lane: i32) -> bool {
        let mut picked = self
            .picks
            .iter()
            .filter(|pick| pick.lane == lane)
            .peekable();
        picked.peek().is_some()
            && picked.all(|pick| pick.key.is_none())
            && !self
                .waiting
                .values()
                .flatten()
                .any(|(_, waits_in)| *waits_in == lane)
    }

    /// The first `most` lanes that [`drains_unkeyed`](Self::drains_unkeyed) and had due
    /// deliveries left when the claim was full, in the order of their first picks: the next
    /// claim reads them alone first.
    pub(super) fn draining_lanes(&self, most: usize) -> Vec<i32> {
        let mut lanes: Vec<i32> = Vec::new();
        for pick in &self.picks {
            if lanes.len() < most
                && !lanes.contains(&pick.lane)
                && self.left_over.contains(&pick.lane)
                && self.drains_unkeyed(pick.lane)
            {
                lanes.push(pick.lane);
            }
        }
        lanes
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
            if self.passed_over.contains(&candidate.id) {
                continue;
            }
            if self.full() {
                self.left_over.insert(candidate.lane);
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

#[cfg(test)]
mod tests {
    use mongodb::bson::DateTime;

    use super::*;

    /// A due delivery in lane 7.
    fn delivery(handler: &str, key: Option<&str>, sequence: Option<i64>) -> Candidate {
        Candidate {
            id: ObjectId::new(),
            lane: 7,
            event_id: format!("e-{}", ObjectId::new()),
            handler: handler.to_owned(),
            key: key.map(str::to_owned),
            sequence,
            attempts: 0,
            claims: 0,
            due_at: DateTime::from_millis(0),
            quick_since: None,
        }
    }

    fn keyed(handler: &str, key: &str, sequence: i64) -> Candidate {
        delivery(handler, Some(key), Some(sequence))
    }

    fn key_of(handler: &str, key: &str) -> KeyOf {
        (handler.to_owned(), key.to_owned())
    }

    /// The lowest pending delivery of each key as a lookup finds it.
    fn lowest(heads: &[(&Candidate, i64)]) -> HashMap<KeyOf, (ObjectId, i64)> {
        heads
            .iter()
            .map(|(head, sequence)| {
                let key = head.key.as_deref().unwrap();
                (key_of(&head.handler, key), (head.id, *sequence))
            })
            .collect()
    }

    /// Picks from `page` as a scan does, with `found` standing in for the lookup.
    fn pick_page(
        picking: &mut Picking,
        page: &[Candidate],
        found: &HashMap<KeyOf, (ObjectId, i64)>,
    ) {
        let unknown = picking.unknown_keys(page);
        picking.learn_heads(unknown, found);
        picking.pick(page.to_vec());
    }

    fn picked(picking: &Picking) -> Vec<ObjectId> {
        picking.picks.iter().map(|pick| pick.id).collect()
    }

    fn waiting(picking: &Picking, handler: &str, key: &str) -> Vec<ObjectId> {
        picking
            .waiting
            .get(&key_of(handler, key))
            .map(|waiting| waiting.iter().map(|(id, _)| *id).collect())
            .unwrap_or_default()
    }

    fn picking(limit: usize) -> Picking {
        Picking::new(limit, HashSet::new(), HashSet::new())
    }

    #[test]
    fn unkeyed_deliveries_are_picked_in_scan_order_up_to_the_limit() {
        let page: Vec<Candidate> = (0..3).map(|_| delivery("h", None, None)).collect();
        let mut picking = picking(2);
        assert!(picking.unknown_keys(&page).is_empty());
        pick_page(&mut picking, &page, &HashMap::new());
        assert_eq!(picked(&picking), vec![page[0].id, page[1].id]);
        assert!(picking.full());
        assert!(picking.waiting.is_empty());
    }

    #[test]
    fn one_delivery_of_a_key_at_a_time_per_handler() {
        let a1 = keyed("a", "k", 1);
        let a2 = keyed("a", "k", 2);
        let b1 = keyed("b", "k", 1);
        let mut picking = picking(10);
        let found = lowest(&[(&a1, 1), (&b1, 1)]);
        pick_page(&mut picking, &[a1.clone(), a2.clone(), b1.clone()], &found);
        // The same key of another handler is a key of its own.
        assert_eq!(picked(&picking), vec![a1.id, b1.id]);
        assert_eq!(waiting(&picking, "a", "k"), vec![a2.id]);
        assert_eq!(picking.waiting[&key_of("a", "k")], vec![(a2.id, 7)]);

        // A later page of the claim: the key was picked, so it is not looked up and waits.
        let a3 = keyed("a", "k", 3);
        assert!(picking.unknown_keys(std::slice::from_ref(&a3)).is_empty());
        pick_page(&mut picking, std::slice::from_ref(&a3), &HashMap::new());
        assert_eq!(picked(&picking), vec![a1.id, b1.id]);
        assert_eq!(waiting(&picking, "a", "k"), vec![a2.id, a3.id]);
    }

    #[test]
    fn only_the_lowest_pending_delivery_of_a_key_is_picked() {
        // Due in the other order than their sequence (a retry of the first is due later).
        let second = keyed("h", "k", 2);
        let first = keyed("h", "k", 1);
        // The lowest pending delivery of `j` is not in the page (parked, or due later).
        let behind = keyed("h", "j", 5);
        let elsewhere = keyed("h", "j", 4);
        // Nothing pending found for `gone` (it completed meanwhile).
        let gone = keyed("h", "gone", 9);
        let page = vec![second.clone(), first.clone(), behind.clone(), gone.clone()];
        let mut picking = picking(10);
        let found = lowest(&[(&first, 1), (&elsewhere, 4)]);
        pick_page(&mut picking, &page, &found);
        assert_eq!(picked(&picking), vec![first.id]);
        assert_eq!(waiting(&picking, "h", "k"), vec![second.id]);
        assert_eq!(waiting(&picking, "h", "j"), vec![behind.id]);
        assert_eq!(waiting(&picking, "h", "gone"), vec![gone.id]);
    }

    #[test]
    fn running_deliveries_are_passed_over_and_their_keys_wait() {
        let runs = delivery("h", None, None);
        let keyed_runs = keyed("h", "r", 1);
        let after = keyed("h", "r", 2);
        let free = keyed("h", "f", 1);
        let mut picking = Picking::new(
            10,
            HashSet::from([runs.id, keyed_runs.id]),
            HashSet::from([key_of("h", "r")]),
        );
        let page = vec![
            runs.clone(),
            keyed_runs.clone(),
            after.clone(),
            free.clone(),
        ];
        // A key with a running delivery is not looked up.
        assert_eq!(picking.unknown_keys(&page), vec![key_of("h", "f")]);
        // Even if a lookup said it is the lowest, the running key's delivery waits.
        let found = lowest(&[(&free, 1), (&after, 2)]);
        pick_page(&mut picking, &page, &found);
        assert_eq!(picked(&picking), vec![free.id]);
        assert_eq!(waiting(&picking, "h", "r"), vec![after.id]);
        assert_eq!(picking.waiting.len(), 1);
    }

    #[test]
    fn the_limit_stops_picking_and_waiting() {
        let first = keyed("h", "k", 1);
        let second = keyed("h", "k", 2);
        let unkeyed = delivery("h", None, None);
        let mut picking = picking(1);
        let page = vec![unkeyed.clone(), first.clone(), second.clone()];
        pick_page(&mut picking, &page, &lowest(&[(&first, 1)]));
        assert_eq!(picked(&picking), vec![unkeyed.id]);
        assert!(picking.waiting.is_empty());
        pick_page(&mut picking, &page, &HashMap::new());
        assert_eq!(picked(&picking), vec![unkeyed.id]);
    }

    #[test]
    fn a_full_claim_drains_the_unkeyed_lanes_it_left_deliveries_in() {
        let in_lane = |lane, key: Option<&str>| Candidate {
            lane,
            ..delivery("h", key, key.map(|_| 1))
        };
        let keyed = in_lane(3, Some("k"));
        // Lane 1 gave picks and keeps one; lane 2 gave all it had; lane 3's pick was keyed.
        let page = vec![
            in_lane(1, None),
            in_lane(2, None),
            keyed.clone(),
            in_lane(1, None),
            in_lane(1, None),
            in_lane(3, None),
        ];
        let mut picking = picking(4);
        pick_page(&mut picking, &page, &lowest(&[(&keyed, 1)]));
        assert!(picking.full());
        assert_eq!(picking.draining_lanes(8), vec![1]);
        assert!(picking.draining_lanes(0).is_empty());
        // A claim that was not full left nothing behind.
        let mut all = self::picking(10);
        pick_page(&mut all, &page, &lowest(&[(&keyed, 1)]));
        assert!(all.draining_lanes(8).is_empty());
    }

    #[test]
    fn each_key_is_looked_up_once() {
        let page = vec![
            keyed("a", "k", 1),
            keyed("a", "k", 2),
            keyed("b", "k", 1),
            keyed("a", "j", 1),
            delivery("a", None, None),
        ];
        let mut picking = picking(10);
        let unknown = picking.unknown_keys(&page);
        assert_eq!(
            unknown,
            vec![key_of("a", "k"), key_of("b", "k"), key_of("a", "j")]
        );
        // Keys found with nothing pending are known too.
        picking.learn_heads(unknown, &HashMap::new());
        assert!(picking.unknown_keys(&page).is_empty());
    }
}
