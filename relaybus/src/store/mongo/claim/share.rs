//! Sharing the lanes with claimers that found nothing.
//!
//! A claim takes as many free lanes as its batch needs, and hands back only lanes that yield
//! nothing. With keyed work a lane yields one delivery of each of its keys per claim, so a claim
//! whose limit is at least the number of keys takes the lanes of every key, and keeps them
//! while they have work: the other claimers find every lane with work held, and stay idle.
//!
//! A claimer that finds nothing and runs nothing while another holds several lanes keeps one lane,
//! with nothing listed, instead of handing it back: the other claimers' lane reads then count it
//! (one lane, listing nothing: [`Sharing::waiting`]). A claimer that sees
//! waiting claimers holds at most its share of the lanes live holders hold, `held / holders`
//! rounded up: at each claim it hands back the held lanes beyond it that run nothing, without
//! scanning them, and the waiting claimers' next claims find them free. It may take them again
//! itself at a later claim, as any free lane: a waiting claimer that claims seldom (a bus waits for
//! a wake-up or its poll interval) is not waited for, and leaves the lanes with the one that
//! claims.

use std::collections::{BTreeSet, HashSet};

use mongodb::bson::oid::ObjectId;

use crate::store::mongo::lane::Lane;

/// What a claim knows of the other live holders, from its lane read.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Sharing {
    /// This claimer plus the other live holders.
    pub(super) contenders: usize,
    /// The lanes live holders hold, this claimer's included.
    pub(super) held_by_live: usize,
    /// Other live holders that hold one lane listing nothing.
    pub(super) waiting: usize,
    /// The most lanes another live holder holds.
    pub(super) most_held_by_another: usize,
    /// The claimers that may rank free lanes at the same time, this one included: the live
    /// holders and the owners claiming through this store instance ([`Sharing::rank_among`]).
    pub(super) claimers: usize,
    /// This claimer's place among them, ordered by owner and store instance, from 0: claimers
    /// that see the same others prefer different free lanes (see `rank::choose`).
    pub(super) slot: usize,
}

impl Sharing {
    /// From what a lane read found: the lanes this claimer holds, and for each other live
    /// holder the lanes it holds and whether any of them lists something.
    pub(super) fn of(held: usize, others: impl IntoIterator<Item = (usize, bool)>) -> Sharing {
        let mut sharing = Sharing {
            contenders: 1,
            held_by_live: held,
            ..Sharing::default()
        };
        for (lanes, lists) in others {
            sharing.contenders += 1;
            sharing.held_by_live += lanes;
            sharing.waiting += usize::from(lanes == 1 && !lists);
            sharing.most_held_by_another = sharing.most_held_by_another.max(lanes);
        }
        sharing
    }

    /// The most lanes this claimer holds while others wait: its share of the lanes held, or
    /// `None` when nobody waits.
    pub(super) fn cap(&self) -> Option<usize> {
        (self.waiting > 0).then(|| self.held_by_live.div_ceil(self.contenders.max(1)).max(1))
    }

    /// Sets [`claimers`](Sharing::claimers) and [`slot`](Sharing::slot) for `owner` of store
    /// `instance`: among the other live `holders` (owner and instance) and the owners claiming
    /// through the same instance (`local`), which other buses of the process cannot see
    /// before they hold lanes.
    pub(super) fn rank_among(
        &mut self,
        owner: &str,
        instance: ObjectId,
        holders: &[(String, Option<ObjectId>)],
        local: &[String],
    ) {
        let me = (owner.to_owned(), Some(instance));
        let mut all: BTreeSet<(String, Option<ObjectId>)> = holders.iter().cloned().collect();
        all.extend(local.iter().map(|other| (other.clone(), Some(instance))));
        all.insert(me.clone());
        self.claimers = all.len();
        self.slot = all.iter().position(|claimer| *claimer == me).unwrap_or(0);
    }

    /// Whether a claim that found nothing keeps a lane, to be counted by the others: another
    /// holder holds more than one lane.
    pub(super) fn keeps_a_lane(&self) -> bool {
        self.most_held_by_another > 1
    }
}

/// The held lanes to hand back for the waiting claimers: beyond [`Sharing::cap`], those that
/// run nothing (not in `running`, nothing lost), the highest ids first.
pub(super) fn surplus(held: &[Lane], sharing: &Sharing, running: &HashSet<i32>) -> Vec<i32> {
    let Some(cap) = sharing.cap() else {
        return Vec::new();
    };
    let excess = held.len().saturating_sub(cap);
    if excess == 0 {
        return Vec::new();
    }
    let mut idle: Vec<i32> = held
        .iter()
        .filter(|lane| lane.lost.is_empty() && !running.contains(&lane.id))
        .map(|lane| lane.id)
        .collect();
    idle.sort_unstable_by(|a, b| b.cmp(a));
    idle.truncate(excess);
    idle
}

#[cfg(test)]
mod tests {
    use mongodb::bson::Bson;

    use super::*;

    fn lane(id: i32, in_flight: Vec<ObjectId>) -> Lane {
        Lane {
            id,
            epoch: 1,
            lease_expires_at: None,
            in_flight,
            lost: Vec::new(),
            requeues: Bson::Null,
        }
    }

    #[test]
    fn the_holders_a_lane_read_found_are_tallied() {
        // This claimer holds 3; others hold 1 listing nothing, 1 listing something, and 5.
        let sharing = Sharing::of(3, [(1, false), (1, true), (5, true)]);
        assert_eq!(sharing.contenders, 4);
        assert_eq!(sharing.held_by_live, 10);
        assert_eq!(
            sharing.waiting, 1,
            "only the holder of one lane listing nothing waits"
        );
        assert_eq!(sharing.most_held_by_another, 5);
        let alone = Sharing::of(2, []);
        assert_eq!((alone.contenders, alone.held_by_live), (1, 2));
        assert_eq!((alone.waiting, alone.most_held_by_another), (0, 0));
        assert!(!alone.keeps_a_lane());
    }

    #[test]
    fn a_claimer_ranks_among_the_holders_and_the_owners_of_its_instance() {
        let (mine, theirs) = (ObjectId::new(), ObjectId::new());
        let holders = vec![("a".to_owned(), Some(theirs)), ("c".to_owned(), Some(mine))];
        let mut sharing = Sharing::default();
        // Alone.
        sharing.rank_among("b", mine, &[], &["b".to_owned()]);
        assert_eq!((sharing.claimers, sharing.slot), (1, 0));
        // Two holders, and `d` of the same instance, which holds nothing yet; `c` is both.
        let local = ["b", "c", "d"].map(str::to_owned);
        sharing.rank_among("b", mine, &holders, &local);
        assert_eq!((sharing.claimers, sharing.slot), (4, 1), "a, b, c, d");
        sharing.rank_among("d", mine, &holders, &local);
        assert_eq!((sharing.claimers, sharing.slot), (4, 3));
        // The same owner name on another instance is another claimer.
        sharing.rank_among("a", mine, &holders, &["a".to_owned()]);
        assert_eq!(sharing.claimers, 3, "a of both instances, and c");
    }

    #[test]
    fn a_holder_hands_back_its_idle_lanes_beyond_its_share_only_while_others_wait() {
        let held: Vec<Lane> = (0..10)
            .map(|id| {
                lane(
                    id,
                    if id == 9 {
                        vec![ObjectId::new()]
                    } else {
                        Vec::new()
                    },
                )
            })
            .collect();
        // What lane 9 lists runs.
        let running: HashSet<i32> = [9].into();
        // 10 lanes held here, 2 waiting claimers with one lane each: 12 over 3, 4 each.
        let sharing = Sharing {
            contenders: 3,
            held_by_live: 12,
            waiting: 2,
            most_held_by_another: 1,
            claimers: 3,
            slot: 0,
        };
        assert_eq!(sharing.cap(), Some(4));
        assert_eq!(
            surplus(&held, &sharing, &running),
            vec![8, 7, 6, 5, 4, 3],
            "the highest idle lanes; lane 9 runs something"
        );
        let nobody_waits = Sharing {
            waiting: 0,
            ..sharing
        };
        assert_eq!(nobody_waits.cap(), None);
        assert!(surplus(&held, &nobody_waits, &running).is_empty());
        let within = Sharing {
            held_by_live: 40,
            ..sharing
        };
        assert!(
            surplus(&held, &within, &running).is_empty(),
            "10 of 40 over 3"
        );
    }

    #[test]
    fn a_claimer_keeps_a_lane_only_while_another_holds_several() {
        let mut sharing = Sharing {
            contenders: 2,
            held_by_live: 2,
            waiting: 0,
            most_held_by_another: 1,
            claimers: 3,
            slot: 0,
        };
        assert!(!sharing.keeps_a_lane());
        sharing.most_held_by_another = 2;
        assert!(sharing.keeps_a_lane());
    }
}
