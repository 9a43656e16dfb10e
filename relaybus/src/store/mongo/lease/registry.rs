//! What one store instance remembers of the claims it handed out: the leases not seen settled,
//! the owners' locks and known lanes, and when parked deliveries were last looked up. None of it
//! decides a hand-out: the lanes' conditional writes do, and a claim checks what is remembered
//! against the lanes it reads.

use std::{
    collections::{HashMap, HashSet},
    sync::{Arc, Mutex, MutexGuard},
};

use mongodb::bson::{DateTime, oid::ObjectId};

use super::Lease;

/// A claim this store instance handed out and has not seen settled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Issued {
    pub(crate) lane: i32,
    pub(crate) epoch: i64,
    pub(crate) claims: i64,
}

/// Per-owner state: claims of one owner on one store instance run one after the other.
#[derive(Debug, Default)]
pub(crate) struct OwnerState {
    /// Set while a claim runs; still set at the start of the next claim when the previous one
    /// was dropped half-way, which then reconciles the owner's lanes first.
    pub(crate) interrupted: bool,
    /// The owned lanes the owner held when its last claim ended: the next claim reads their
    /// first page while it reads its lanes, and uses it if they are still the lanes it scans.
    pub(crate) held: Vec<i32>,
    /// The few held lanes the last claim drained deep, all unkeyed (sorted): the next
    /// claim reads them alone first, and the rest of its lanes only when they do not fill it.
    /// Which lanes to read, never what may be handed out.
    pub(crate) draining: Vec<i32>,
    /// Lanes the last read of every held lane found due unkeyed deliveries in and no claim has
    /// read alone since, oldest first: the next claims read them a few at a time beside the
    /// draining lanes.
    pub(crate) ranked: Vec<i32>,
    /// Claims in a row filled from the draining lanes alone.
    pub(crate) drained: u32,
    /// The lanes the owner held when its last claim ended, as that claim wrote them, when its
    /// record matched every lane it wrote, with the registry's generation then: the next claim
    /// takes them from here instead of reading them. What they list and this instance handed
    /// out and has not seen settled runs; the rest is gone. `None`: unknown, read them. A lane
    /// that changed meanwhile fails the record's condition, which forgets them; so does
    /// [`ClaimRegistry::forget_everything`].
    pub(crate) known: Option<(u64, Vec<super::super::lane::Lane>)>,
    /// Claims since the owner last read its lanes.
    pub(crate) unread: u32,
    /// The handler and key of each keyed delivery the owner was handed out, for as long as it
    /// is listed: what runs of a key when the lanes are not read.
    pub(crate) keys: HashMap<ObjectId, (String, String)>,
    /// When the owner last tried to take owned lanes it did not hold, and the member list's
    /// generation then.
    pub(crate) taken_at: Option<(u64, super::super::claim::Tried)>,
    /// The owner's last claim handed out nothing: the next one tries to take its lanes and
    /// looks at free lanes whatever the intervals say.
    pub(crate) came_up_empty: bool,
    /// When the owner last looked at free lanes.
    pub(crate) probed_at: Option<super::super::claim::Tried>,
    /// The lanes it holds that it took to help with, not owning them: scanned until they are
    /// handed back.
    pub(crate) helping: std::collections::HashSet<i32>,
}

/// What one store instance (one `build()`, shared by clones) knows about its claims.
#[derive(Debug)]
pub(crate) struct ClaimRegistry {
    /// Written to the lanes this instance holds, next to the owner name, so that a restarted
    /// process with the same owner name does not adopt its predecessor's lanes.
    pub(crate) instance: ObjectId,
    owners: Mutex<HashMap<String, Arc<tokio::sync::Mutex<OwnerState>>>>,
    issued: Mutex<HashMap<ObjectId, Issued>>,
    /// What a completion needs of each issued claim's delivery, when the claim read it.
    facts: Mutex<HashMap<ObjectId, Facts>>,
    /// What the lane reads found of each handler's parked deliveries, and this instance's own
    /// parking writes since.
    parked: Mutex<ParkedLooks>,
    /// Bumped when everything is forgotten: the owners' known lanes of before no longer count.
    generation: std::sync::atomic::AtomicU64,
    /// Deliveries whose claim this instance ended with the delivery kept (released,
    /// rescheduled, buried), with that claim's count: their lanes no longer list them, and the
    /// owners' known lanes still do until their next claim takes them off, unless a later claim
    /// of the delivery was handed out meanwhile (then it runs again, and stays listed).
    given_back: Mutex<HashMap<ObjectId, i64>>,
    /// Deliveries completed in a caller's transaction, which this instance does not see
    /// commit: a claim whose known lanes list one reads its lanes.
    completing: Mutex<HashSet<ObjectId>>,
}

/// The most given-back deliveries remembered for the owners' known lanes.
const MAX_GIVEN_BACK: usize = 100_000;

/// How long, in claim time, lane reads go without looking up the parked deliveries of a handler
/// whose last lookup found none, unless this store instance parks deliveries meanwhile: the
/// longest a delivery another instance parks can wait for this one to look.
const PARKED_LOOKUP_INTERVAL_MS: i64 = 250;

/// What lane reads found of the handlers' parked deliveries (see [`ParkedLookup`]).
#[derive(Debug, Default)]
struct ParkedLooks {
    /// Bumped by each write of this instance that parks deliveries (or may, once committed),
    /// and by each delivery written parked that the change stream reports.
    parkings: u64,
    by_handler: HashMap<String, ParkedLook>,
}

/// The last lookup of one handler's parked deliveries.
#[derive(Debug, Clone, Copy)]
struct ParkedLook {
    /// Whether it found any.
    found: bool,
    /// The claim time it was made at.
    at: DateTime,
    /// [`ParkedLooks::parkings`] when the read that made it began.
    parkings: u64,
}

/// What a lane read looks up of one handler's parked deliveries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ParkedLookup {
    /// Nothing: the last lookup, less than [`PARKED_LOOKUP_INTERVAL_MS`] ago, found none, and
    /// this instance parked nothing since it began.
    Skip,
    /// The lowest parked delivery of each key.
    Heads,
    /// The lowest parked delivery of each key and the keys' lowest pending deliveries: the last
    /// lookup found parked deliveries.
    HeadsAndLowest,
}

/// What a completion of an issued claim needs of its delivery, as the claim read it: the event
/// to stamp, and, for a delivery a completion may leave unstamped (appended with its new event,
/// never requeued), when it was created. Neither changes while the claim holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Facts {
    pub(crate) event_id: String,
    pub(crate) quick_since: Option<DateTime>,
}

impl Default for ClaimRegistry {
    fn default() -> Self {
        ClaimRegistry {
            instance: ObjectId::new(),
            owners: Mutex::default(),
            issued: Mutex::default(),
            facts: Mutex::default(),
            parked: Mutex::default(),
            generation: Default::default(),
            given_back: Mutex::default(),
            completing: Mutex::default(),
        }
    }
}

/// Locks a mutex whose data stays consistent even if a holder panicked (plain maps).
fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl ClaimRegistry {
    /// The lock serialising the claims of `owner` on this instance.
    pub(crate) fn owner(&self, owner: &str) -> Arc<tokio::sync::Mutex<OwnerState>> {
        let mut owners = lock(&self.owners);
        Arc::clone(owners.entry(owner.to_owned()).or_default())
    }

    /// Remembers claims handed out to a caller.
    pub(crate) fn issue(&self, leases: impl IntoIterator<Item = Lease>) {
        let mut issued = lock(&self.issued);
        let mut facts = lock(&self.facts);
        for lease in leases {
            // What an earlier claim of the delivery noted is not this claim's.
            facts.remove(&lease.delivery_id);
            issued.insert(
                lease.delivery_id,
                Issued {
                    lane: lease.lane_i32(),
                    epoch: lease.epoch,
                    claims: lease.claims,
                },
            );
        }
    }

    /// What a lane read starting at claim time `now` looks up of `handler`'s parked deliveries.
    pub(crate) fn parked_lookup(&self, handler: &str, now: DateTime) -> ParkedLookup {
        let looks = lock(&self.parked);
        match looks.by_handler.get(handler) {
            Some(look) if look.found => ParkedLookup::HeadsAndLowest,
            Some(look)
                if look.parkings == looks.parkings
                    && (look.at.timestamp_millis()
                        ..look.at.timestamp_millis() + PARKED_LOOKUP_INTERVAL_MS)
                        .contains(&now.timestamp_millis()) =>
            {
                ParkedLookup::Skip
            }
            _ => ParkedLookup::Heads,
        }
    }

    /// This instance's parking writes so far: taken before a lane read, for
    /// [`note_parked_lookup`](Self::note_parked_lookup).
    pub(crate) fn parkings(&self) -> u64 {
        lock(&self.parked).parkings
    }

    /// Notes that deliveries were parked: by a write of this instance (an append's, once its
    /// transaction commits), or by any, as the change stream reported. The next lane reads look
    /// up every handler's parked deliveries.
    pub(crate) fn note_parking(&self) {
        let mut looks = lock(&self.parked);
        looks.parkings = looks.parkings.wrapping_add(1);
    }

    /// Notes what a lane read that began at claim time `now`, after `parkings` parking writes,
    /// found of the parked deliveries of the handlers it `looked` up: `found` those with some.
    pub(crate) fn note_parked_lookup<'a>(
        &self,
        looked: impl IntoIterator<Item = &'a str>,
        found: &HashSet<&str>,
        now: DateTime,
        parkings: u64,
    ) {
        let mut looks = lock(&self.parked);
        for handler in looked {
            let look = ParkedLook {
                found: found.contains(handler),
                at: now,
                parkings,
            };
            match looks.by_handler.get_mut(handler) {
                Some(known) => *known = look,
                None => {
                    looks.by_handler.insert(handler.to_owned(), look);
                }
            }
        }
    }

    /// Remembers what a completion needs of claims handed out (see [`Facts`]).
    pub(crate) fn issue_facts(&self, facts: impl IntoIterator<Item = (ObjectId, Facts)>) {
        lock(&self.facts).extend(facts);
    }

    /// What a completion needs of each lease's delivery, in order, when every lease is the
    /// claim this instance issued for its delivery, not seen settled, with its facts noted;
    /// `None` otherwise.
    pub(crate) fn facts_of(&self, leases: &[Lease]) -> Option<Vec<Facts>> {
        let issued = lock(&self.issued);
        let facts = lock(&self.facts);
        leases
            .iter()
            .map(|lease| {
                let current = issued.get(&lease.delivery_id)
                    == Some(&Issued {
                        lane: lease.lane_i32(),
                        epoch: lease.epoch,
                        claims: lease.claims,
                    });
                current.then(|| facts.get(&lease.delivery_id).cloned())?
            })
            .collect()
    }

    /// Forgets claims that ended (settled, lost, or found gone).
    pub(crate) fn forget(&self, ids: impl IntoIterator<Item = ObjectId>) {
        let mut issued = lock(&self.issued);
        let mut facts = lock(&self.facts);
        for id in ids {
            issued.remove(&id);
            facts.remove(&id);
        }
    }

    /// Forgets the claim of `lease` if it is the one this instance remembers for its delivery:
    /// a settlement with an older lease must not forget a newer claim.
    pub(crate) fn settled(&self, lease: &Lease) {
        let mut issued = lock(&self.issued);
        let current = Issued {
            lane: lease.lane_i32(),
            epoch: lease.epoch,
            claims: lease.claims,
        };
        if issued.get(&lease.delivery_id) == Some(&current) {
            issued.remove(&lease.delivery_id);
            lock(&self.facts).remove(&lease.delivery_id);
        }
    }

    /// The claim this instance handed out for `id`, if it has not seen it settled.
    pub(crate) fn issued(&self, id: &ObjectId) -> Option<Issued> {
        lock(&self.issued).get(id).copied()
    }

    /// Every claim this instance has handed out and not seen settled, as of now.
    ///
    /// A claim takes this before it reads its lanes and judges what they list against it. A
    /// completion settles its deliveries only after deleting them, so a read that started
    /// before the delete can still find a delivery the registry has already let go of; judged
    /// against the registry of that moment, it is still this instance's own claim.
    pub(crate) fn snapshot(&self) -> HashMap<ObjectId, Issued> {
        lock(&self.issued).clone()
    }

    /// Forgets everything but the instance's identity, as a restart would.
    pub(crate) fn forget_everything(&self) {
        self.generation
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        lock(&self.issued).clear();
        lock(&self.given_back).clear();
        lock(&self.completing).clear();
        lock(&self.facts).clear();
        *lock(&self.parked) = ParkedLooks::default();
    }

    /// Notes that the claim of `lease` ended with its delivery kept and taken off its lane.
    pub(crate) fn given_back(&self, lease: &Lease) {
        let mut given_back = lock(&self.given_back);
        if given_back.len() >= MAX_GIVEN_BACK {
            // Owners that stopped claiming left them: every owner reads its lanes again.
            given_back.clear();
            self.generation
                .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
        given_back.insert(lease.delivery_id, lease.claims);
    }

    /// Notes that the delivery of `lease` is completed in a transaction that may commit.
    pub(crate) fn completing(&self, lease: &Lease) {
        let mut completing = lock(&self.completing);
        if completing.len() >= MAX_GIVEN_BACK {
            completing.clear();
            self.generation
                .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
        completing.insert(lease.delivery_id);
    }

    /// Whether `lanes` list a delivery completed in a transaction that may have committed.
    pub(crate) fn list_completing(&self, lanes: &[super::super::lane::Lane]) -> bool {
        let completing = lock(&self.completing);
        !completing.is_empty()
            && lanes
                .iter()
                .any(|lane| lane.in_flight.iter().any(|id| completing.contains(id)))
    }

    /// Forgets the completions in a transaction of the deliveries `lanes` list and that a read
    /// of them found gone (not in `running`).
    pub(crate) fn seen_completed(
        &self,
        lanes: &[super::super::lane::Lane],
        running: &HashSet<ObjectId>,
    ) {
        let mut completing = lock(&self.completing);
        if completing.is_empty() {
            return;
        }
        for lane in lanes {
            for id in lane.in_flight.iter().filter(|id| !running.contains(id)) {
                completing.remove(id);
            }
        }
    }

    /// Takes off `lanes` what was given back since they were written.
    pub(crate) fn take_off_given_back(&self, lanes: &mut [super::super::lane::Lane]) {
        let mut given_back = lock(&self.given_back);
        if given_back.is_empty() {
            return;
        }
        let issued = lock(&self.issued);
        for lane in lanes {
            lane.in_flight.retain(|id| match given_back.remove(id) {
                // A later claim of it was handed out after the one that ended: it runs.
                Some(ended) => issued.get(id).is_some_and(|later| later.claims > ended),
                None => true,
            });
        }
    }

    /// Moves on each time everything is forgotten.
    pub(crate) fn generation(&self) -> u64 {
        self.generation.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// How many claims this instance has handed out and not seen settled.
    #[cfg(test)]
    pub(crate) fn outstanding(&self) -> usize {
        lock(&self.issued).len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ID: &str = "65f0c0ffee0000000000beef";

    #[test]
    fn registry_remembers_and_forgets() {
        let registry = ClaimRegistry::default();
        let lease = Lease::parse(ID, "3:4:5").unwrap();
        registry.issue([lease]);
        assert_eq!(
            registry.issued(&lease.delivery_id()),
            Some(Issued {
                lane: 3,
                epoch: 4,
                claims: 5
            })
        );
        registry.forget([lease.delivery_id()]);
        assert_eq!(registry.outstanding(), 0);
        let a = registry.owner("w");
        let b = registry.owner("w");
        assert!(Arc::ptr_eq(&a, &b));
    }

    #[test]
    fn a_completion_knows_only_the_claims_issued_as_leased_with_their_facts() {
        let registry = ClaimRegistry::default();
        let lease = Lease::parse(ID, "3:4:5").unwrap();
        let facts = Facts {
            event_id: "e-1".into(),
            quick_since: None,
        };
        registry.issue([lease]);
        assert_eq!(registry.facts_of(&[lease]), None, "no facts noted");
        registry.issue_facts([(lease.delivery_id(), facts.clone())]);
        assert_eq!(registry.facts_of(&[lease]), Some(vec![facts.clone()]));
        let older = Lease::parse(ID, "3:3:5").unwrap();
        assert_eq!(registry.facts_of(&[lease, older]), None, "another claim");
        // A new claim of the delivery does not inherit what the last one noted.
        let newer = Lease::parse(ID, "3:5:6").unwrap();
        registry.issue([newer]);
        assert_eq!(registry.facts_of(&[newer]), None);
        registry.issue_facts([(newer.delivery_id(), facts.clone())]);
        registry.settled(&newer);
        assert_eq!(registry.facts_of(&[newer]), None, "settled");
    }

    #[test]
    fn parked_deliveries_are_looked_up_while_some_may_be_parked() {
        let registry = ClaimRegistry::default();
        let at = DateTime::from_millis;
        assert_eq!(
            registry.parked_lookup("h", at(0)),
            ParkedLookup::Heads,
            "never looked"
        );

        let parkings = registry.parkings();
        registry.note_parked_lookup(["h"], &HashSet::new(), at(1_000), parkings);
        assert_eq!(registry.parked_lookup("h", at(1_000)), ParkedLookup::Skip);
        assert_eq!(registry.parked_lookup("h", at(1_249)), ParkedLookup::Skip);
        assert_eq!(registry.parked_lookup("h", at(1_250)), ParkedLookup::Heads);
        assert_eq!(
            registry.parked_lookup("h", at(999)),
            ParkedLookup::Heads,
            "clock behind"
        );
        assert_eq!(
            registry.parked_lookup("other", at(1_000)),
            ParkedLookup::Heads
        );

        // A parking while a read ran: that read's lookup may have missed it.
        let parkings = registry.parkings();
        registry.note_parking();
        registry.note_parked_lookup(["h"], &HashSet::new(), at(2_000), parkings);
        assert_eq!(registry.parked_lookup("h", at(2_000)), ParkedLookup::Heads);

        let parkings = registry.parkings();
        registry.note_parked_lookup(["h"], &HashSet::from(["h"]), at(3_000), parkings);
        assert_eq!(
            registry.parked_lookup("h", at(3_000)),
            ParkedLookup::HeadsAndLowest
        );
    }
}
