//! Leases: the fencing token a claim hands out with each delivery, and what one store instance
//! remembers about the claims it handed out.
//!
//! A lease token reads `<lane>:<epoch>:<claims>`. `lane` is the delivery's lane, `epoch` the lane
//! epoch under which it was claimed (every take of a lane increments it), and `claims` the
//! delivery's claim generation at the time (every claim that ends, however it ends, increments
//! it). A settlement changes something only while all three still hold, so a worker that lost its
//! lane, or that holds the lease of an earlier claim of the same delivery, changes nothing.

use std::{
    collections::{HashMap, HashSet},
    fmt,
    str::FromStr,
    sync::{Arc, Mutex, MutexGuard},
};

use mongodb::bson::{Bson, DateTime, oid::ObjectId};

use crate::{
    error::{LeaseError, truncate_for_message},
    event::LANE_COUNT,
};

/// The right to settle one claimed delivery: its id plus the fencing token
/// `<lane>:<epoch>:<claims>`.
///
/// A claim returns one with every delivery. Pass it back unchanged to
/// [`complete`](crate::MongoEventStore::complete), [`reschedule`](crate::MongoEventStore::reschedule),
/// [`release`](crate::MongoEventStore::release), [`bury`](crate::MongoEventStore::bury) or
/// [`extend_lease`](crate::MongoEventStore::extend_lease). A lease kept as text (the delivery id
/// and [`token`](Lease::token)) is read back with [`Lease::parse`], which refuses what no claim
/// can have produced, before anything reaches the database.
///
/// # Example
///
/// ```
/// use relaybus::Lease;
///
/// let lease = Lease::parse("65f0c0ffee0000000000beef", "17:3:0")?;
/// assert_eq!(lease.token(), "17:3:0");
/// assert_eq!(lease.lane(), 17);
/// assert!(Lease::parse("65f0c0ffee0000000000beef", "256:1:0").is_err());
/// # Ok::<(), relaybus::LeaseError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Lease {
    delivery_id: ObjectId,
    lane: u32,
    epoch: i64,
    claims: i64,
}

impl Lease {
    pub(crate) fn new(delivery_id: ObjectId, lane: u32, epoch: i64, claims: i64) -> Self {
        Lease {
            delivery_id,
            lane,
            epoch,
            claims,
        }
    }

    /// Reads a lease back from the delivery id (24 hexadecimal digits) and the token
    /// `<lane>:<epoch>:<claims>`, as [`delivery_id`](Lease::delivery_id) and
    /// [`token`](Lease::token) wrote them.
    ///
    /// # Errors
    ///
    /// [`LeaseError`] when the id is not an ObjectId, the token is not three decimal numbers, the
    /// lane is not one of the 256 lanes, the epoch is below 1 (taking a lane makes it at least
    /// 1) or the claim generation is negative.
    pub fn parse(delivery_id: &str, token: &str) -> Result<Self, LeaseError> {
        let id = ObjectId::parse_str(delivery_id).map_err(|_| LeaseError::InvalidDeliveryId {
            id: truncate_for_message(delivery_id, 64),
        })?;
        let parsed: Token = token.parse()?;
        Ok(Lease::new(id, parsed.lane, parsed.epoch, parsed.claims))
    }

    /// The id of the leased delivery.
    pub fn delivery_id(&self) -> ObjectId {
        self.delivery_id
    }

    /// The fencing token, `<lane>:<epoch>:<claims>`.
    pub fn token(&self) -> String {
        format!("{}:{}:{}", self.lane, self.epoch, self.claims)
    }

    /// The lane of the delivery, 0 to 255.
    pub fn lane(&self) -> u32 {
        self.lane
    }

    /// The lane epoch under which the delivery was claimed.
    pub fn epoch(&self) -> i64 {
        self.epoch
    }

    /// The delivery's claim generation at the time of the claim.
    pub fn claims(&self) -> i64 {
        self.claims
    }

    /// The stored form of the lane id.
    pub(crate) fn lane_i32(&self) -> i32 {
        // Parsing and claiming both keep lanes below 256.
        self.lane as i32
    }

    /// A filter matching the delivery while it still has this lease's claim generation. A
    /// document without a generation (written before generations existed) counts as 0.
    pub(crate) fn generation_filter(&self) -> Bson {
        generation_filter(self.claims)
    }
}

/// The filter value that matches claim generation `claims`, counting a missing one as 0.
pub(crate) fn generation_filter(claims: i64) -> Bson {
    if claims == 0 {
        Bson::Document(mongodb::bson::doc! { "$in": [0_i64, Bson::Null] })
    } else {
        Bson::Int64(claims)
    }
}

impl fmt::Display for Lease {
    /// Writes `<delivery id>@<lane>:<epoch>:<claims>`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}@{}:{}:{}",
            self.delivery_id, self.lane, self.epoch, self.claims
        )
    }
}

/// The three numbers of a token.
struct Token {
    lane: u32,
    epoch: i64,
    claims: i64,
}

impl FromStr for Token {
    type Err = LeaseError;

    fn from_str(token: &str) -> Result<Self, LeaseError> {
        let malformed = |reason| LeaseError::MalformedToken {
            token: truncate_for_message(token, 64),
            reason,
        };
        let mut parts = token.split(':');
        let (Some(lane), Some(epoch), Some(claims), None) =
            (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            return Err(malformed("it does not have three `:`-separated parts"));
        };
        let number = |part: &str| -> Result<u64, LeaseError> {
            if part.is_empty() || part.len() > 20 || !part.bytes().all(|b| b.is_ascii_digit()) {
                return Err(malformed(
                    "a part is not a decimal number of 1 to 20 digits",
                ));
            }
            part.parse::<u64>()
                .map_err(|_| malformed("a part is not a decimal number"))
        };
        let lane = number(lane)?;
        let epoch = number(epoch)?;
        let claims = number(claims)?;
        if lane >= u64::from(LANE_COUNT) {
            return Err(LeaseError::LaneOutOfRange { lane });
        }
        let epoch = i64::try_from(epoch).map_err(|_| malformed("the epoch is too large"))?;
        if epoch < 1 {
            return Err(malformed(
                "the epoch is 0, and a claimed lane has epoch 1 or more",
            ));
        }
        let claims =
            i64::try_from(claims).map_err(|_| malformed("the claim generation is too large"))?;
        Ok(Token {
            lane: lane as u32,
            epoch,
            claims,
        })
    }
}

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
    /// The lanes the owner held when its last claim ended, as that claim wrote them, when its
    /// record matched every lane it wrote, with the registry's generation then: the next claim
    /// takes them from here instead of reading them. What they list and this instance handed
    /// out and has not seen settled runs; the rest is gone. `None`: unknown, read them. A lane
    /// that changed meanwhile fails the record's condition, which forgets them; so does
    /// [`ClaimRegistry::forget_everything`].
    pub(crate) known: Option<(u64, Vec<super::lane::Lane>)>,
    /// Claims since the owner last read its lanes.
    pub(crate) unread: u32,
    /// The handler and key of each keyed delivery the owner was handed out, for as long as it
    /// is listed: what runs of a key when the lanes are not read.
    pub(crate) keys: HashMap<ObjectId, (String, String)>,
    /// When the owner last tried to take owned lanes it did not hold, and the member list's
    /// generation then.
    pub(crate) taken_at: Option<(u64, super::claim::Tried)>,
    /// The owner's last claim handed out nothing: the next one tries to take its lanes and
    /// looks at free lanes whatever the intervals say.
    pub(crate) came_up_empty: bool,
    /// When the owner last looked at free lanes.
    pub(crate) probed_at: Option<super::claim::Tried>,
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
    pub(crate) fn list_completing(&self, lanes: &[super::lane::Lane]) -> bool {
        let completing = lock(&self.completing);
        !completing.is_empty()
            && lanes
                .iter()
                .any(|lane| lane.in_flight.iter().any(|id| completing.contains(id)))
    }

    /// Forgets the completions in a transaction of the deliveries `lanes` list and that a read
    /// of them found gone (not in `running`).
    pub(crate) fn seen_completed(&self, lanes: &[super::lane::Lane], running: &HashSet<ObjectId>) {
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
    pub(crate) fn take_off_given_back(&self, lanes: &mut [super::lane::Lane]) {
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
    fn tokens_round_trip() {
        let lease = Lease::parse(ID, "255:9223372036854775807:0").unwrap();
        assert_eq!(lease.lane(), 255);
        assert_eq!(lease.epoch(), i64::MAX);
        assert_eq!(lease.claims(), 0);
        assert_eq!(lease.token(), "255:9223372036854775807:0");
        assert_eq!(lease.delivery_id().to_hex(), ID);
        assert_eq!(lease.to_string(), format!("{ID}@255:9223372036854775807:0"));
        let again = Lease::parse(&lease.delivery_id().to_hex(), &lease.token()).unwrap();
        assert_eq!(again, lease);
    }

    #[test]
    fn tokens_no_claim_can_have_issued_are_refused() {
        for bad in [
            "",
            "1",
            "1:2",
            "1:2:3:4",
            "a:1:0",
            "1:b:0",
            "1:1:c",
            " 1:1:0",
            "1:1:0 ",
            "+1:1:0",
            "-1:1:0",
            "1:-1:0",
            "1:1:-1",
            "1::0",
            "1:1:",
            "1:0:0",
            "1:1:9223372036854775808",
            "1:9223372036854775808:0",
            "1:99999999999999999999:0",
            "1.0:1:0",
            "１:1:0",
        ] {
            assert!(
                matches!(
                    Lease::parse(ID, bad),
                    Err(LeaseError::MalformedToken { .. })
                ),
                "{bad:?}"
            );
        }
        assert_eq!(
            Lease::parse(ID, "256:1:0"),
            Err(LeaseError::LaneOutOfRange { lane: 256 })
        );
        assert_eq!(
            Lease::parse(ID, "18446744073709551615:1:0"),
            Err(LeaseError::LaneOutOfRange { lane: u64::MAX })
        );
        for bad_id in [
            "",
            "xyz",
            "65f0c0ffee0000000000beeg",
            "65f0c0ffee0000000000beef0",
        ] {
            assert!(
                matches!(
                    Lease::parse(bad_id, "1:1:0"),
                    Err(LeaseError::InvalidDeliveryId { .. })
                ),
                "{bad_id:?}"
            );
        }
    }

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
