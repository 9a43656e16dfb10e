//! Claiming deliveries.
//!
//! Workers lease lanes, not deliveries. Every owner that claims is a member of the database
//! ([`members`]), and owns the lanes that rendezvous hashing gives it among the members. A
//! claim goes through these steps, each in a module of its own:
//!
//! - **Its lanes.** It reads the lanes the owner holds on this store instance, while it reads
//!   the first page of the due deliveries of the lanes it held when its last claim ended: of
//!   only a few, when it knows lanes with unkeyed deliveries due (those its last claim drained
//!   and left more in, then those the last read of every lane ranked, oldest first), so that a
//!   backlog is drained a few lanes at a time; the other lanes are read when those do not fill
//!   the claim, and at least once in eight claims.
//!   A held lane listing a claim this instance did not hand out is reconciled first
//!   ([`reconcile`]); lost claims a held lane still lists are charged.
//! - **Taking** ([`take`]) the owned lanes it does not hold yet, when they are free: after the
//!   member list changed, and otherwise every 250 ms at most. A lane another holder still
//!   holds is left to it until it hands the lane back or its lease expires.
//! - **Scanning** ([`scan`]) the owned lanes it holds: their due, ready deliveries in
//!   `(dueAt, _id)` order, and **picking** ([`pick`]) from them under the per-key rules, a few
//!   lanes at a time, the lanes of the oldest deliveries first, so that a batch is recorded on
//!   a few lanes.
//! - **Free lanes** ([`free`]), if its lanes did not fill the claim, at most once a second
//!   (at every such claim while the members claim for different handler sets): free lanes
//!   with due deliveries of its handlers, the oldest due first, 4, then 8, 16, ... a round.
//! - **Recording** ([`record`]) the batch, while the events of the picks are read: one
//!   conditional write per lane, all in one `update` command. Lanes the owner holds and does
//!   not own are handed back once they run nothing; lanes it owns are kept, idle or not, and
//!   their leases renewed before they run out.
//! - **Handing out** ([`hand_out`]) the deliveries with their events and leases. Then the
//!   deliveries found waiting behind their key are parked.
//!
//! Nothing kept in memory decides what is handed out: the member list only says which lanes to
//! try, and the lanes' conditional writes decide; what the instance remembers of its claims is
//! checked against the lanes at every claim, and a claim that finds a lane listing what the
//! instance does not know reconciles the lane. An unkeyed claim writes no delivery document.

pub(crate) mod free;
pub(crate) mod hand_out;
mod held;
pub(crate) mod members;
mod pick;
mod reconcile;
mod record;
mod scan;
mod take;

use held::listed_from_memory;

use std::{collections::HashSet, time::Duration};

use mongodb::bson::{DateTime, doc, oid::ObjectId};

use self::{
    members::Members,
    pick::Picking,
    scan::{Scan, page_window},
    take::Hold,
};
use super::{
    MongoEventStore,
    lane::{Lane, add},
    lease::{Lease, OwnerState},
    sessions::DEFAULT_HEARTBEAT_EXPIRY,
};
use crate::{
    error::Result,
    event::EventEnvelope,
    store::checks::{check_handlers, check_lease_duration, check_limit, check_owner},
};

/// Further passes of a claim that found nothing after it lost lanes to other claimers.
const RACE_RETRIES: usize = 2;
/// How often a member tries to take owned lanes another holder held.
const TAKE_INTERVAL: Duration = Duration::from_millis(250);
/// How many claims in a row take the owner's lanes as its last record left them: then one
/// reads them, and finds what settled without this instance seeing it (a completion whose
/// reply was lost, a delivery deleted by hand).
const READ_LANES_EVERY: u32 = 8;
/// The most lanes a claim reads alone: those its last claim drained, then ranked ones.
const DRAIN_LANES: usize = 8;
/// Claims in a row that read the draining lanes alone: then one reads every lane again.
const DRAIN_CLAIMS: u32 = 8;
/// How often a member whose lanes did not fill its claim looks at free lanes.
const PROBE_INTERVAL: Duration = Duration::from_secs(1);

/// A delivery handed out by [`MongoEventStore::claim`]: the event, which handler should run it,
/// which attempt this is, and the lease to settle it with.
#[derive(Debug, Clone)]
pub struct ClaimedDelivery {
    lease: Lease,
    lease_expires_at: DateTime,
    handler: String,
    attempt: u32,
    sequence: Option<i64>,
    /// Held to its key's order: keyed, not unordered.
    pub(crate) ordered: bool,
    event: EventEnvelope,
}

impl ClaimedDelivery {
    /// The delivery id.
    pub fn delivery_id(&self) -> ObjectId {
        self.lease.delivery_id()
    }

    /// The lease to settle the delivery with.
    pub fn lease(&self) -> &Lease {
        &self.lease
    }

    /// When the lane lease expires unless it is extended. An expired lease nobody took over is
    /// still honoured.
    pub fn lease_expires_at(&self) -> DateTime {
        self.lease_expires_at
    }

    /// The handler that should run the delivery.
    pub fn handler(&self) -> &str {
        &self.handler
    }

    /// Which attempt this is, from 1: the attempts that ended before it plus one.
    pub fn attempt(&self) -> u32 {
        self.attempt
    }

    /// The event's sequence within its ordering key, if it has a key.
    pub fn sequence(&self) -> Option<i64> {
        self.sequence
    }

    /// The event: id, type, payload, key, correlation and causation ids, headers, creation time.
    pub fn event(&self) -> &EventEnvelope {
        &self.event
    }

    /// The event id.
    pub fn event_id(&self) -> &str {
        self.event.id()
    }

    /// The event type name.
    pub fn event_type(&self) -> &str {
        self.event.event_type()
    }

    /// The ordering key, if the event has one.
    pub fn key(&self) -> Option<&str> {
        self.event.key()
    }

    /// Takes the event out, for handing it to a handler.
    pub fn into_event(self) -> EventEnvelope {
        self.event
    }
}

/// What every step of one claim goes by: who claims, for which handlers, the lease expiry the
/// claim gives, and its clock.
#[derive(Debug, Clone, Copy)]
struct Request<'a> {
    owner: &'a str,
    handlers: &'a [&'a str],
    expires_at: DateTime,
    now: DateTime,
}

impl MongoEventStore {
    /// Claims up to `limit` due deliveries of `handlers` for `owner`, leasing their lanes for
    /// `lease_duration` from `now`.
    ///
    /// `owner` becomes a member of the database (see the crate documentation on lane
    /// ownership) and owns a share of the 256 lanes; a claim takes the free lanes of its share,
    /// reads their due, ready deliveries in `(dueAt, id)` order, and takes free lanes with due
    /// deliveries beyond its share when its own did not fill the claim. A keyed delivery is handed
    /// out only when no earlier delivery of its handler and key is pending and none of them
    /// runs, and one claim never hands out two deliveries of one key; the claim looks past
    /// blocked keys until it has `limit`. An unordered delivery (its handler was
    /// [unordered](crate::Subscription::unordered) when the event was appended) is handed out
    /// as an unkeyed one is. Deliveries a claim finds waiting behind a slow predecessor may be
    /// parked, and come back once the predecessor finished.
    ///
    /// Lanes are held per owner **and per store instance** (one
    /// [`build`](crate::MongoEventStoreBuilder::build), shared by clones): a restarted process
    /// with the same owner name takes its predecessor's lanes over once their leases expired,
    /// and is charged for what the predecessor left running. Claims of one owner on one store
    /// instance run one after the other. Call [`relinquish`](Self::relinquish) when the owner
    /// stops, so that the others take its lanes at once.
    ///
    /// The store compares lease expiries with `now` and never reads the server clock, so keep
    /// worker clocks synchronised.
    ///
    /// # Cost
    ///
    /// With its lanes held, a claim costs four commands in two round trips whatever `limit` is
    /// (its lanes beside the first page of their deliveries, then the events of the picks beside
    /// the record), one more when the page does not fill it from the first lanes it picks from
    /// (a claim picks from a few lanes at a time), and one lookup per handler for the
    /// keys it picks from, in parallel. It writes no delivery document for an unkeyed batch.
    ///
    /// # Errors
    ///
    /// - [`Error::InvalidArgument`] for an empty or over-long `owner`, a `limit` outside 1 to
    ///   10,000, a `lease_duration` outside 1 ms to 7 days, or no handlers;
    ///   [`Error::Configuration`] for a malformed handler id. Nothing is sent to the database.
    /// - [`Error::Database`]. The owner's lanes on this instance are then reconciled: nothing
    ///   this failed claim recorded stays listed as running, and no lease of it can match.
    ///
    /// [`Error::InvalidArgument`]: crate::Error::InvalidArgument
    /// [`Error::Configuration`]: crate::Error::Configuration
    /// [`Error::Database`]: crate::Error::Database
    ///
    /// # Cancel safety
    ///
    /// Not cancel safe: a claim dropped half-way may have recorded deliveries nobody received.
    /// They are not lost: the next claim of the owner on this instance finds them listed and
    /// not handed out, and reconciles them. Without one, they wait for the lane lease to expire
    /// and are charged one attempt when the lane is taken over.
    ///
    /// # Example
    ///
    /// ```no_run
    /// # async fn example(store: relaybus::MongoEventStore) -> Result<(), relaybus::Error> {
    /// use std::time::Duration;
    /// use relaybus::mongodb::bson::DateTime;
    ///
    /// let batch = store
    ///     .claim("worker-1", &["send-confirmation"], 50, Duration::from_secs(30), DateTime::now())
    ///     .await?;
    /// for delivery in &batch {
    ///     // run the handler, then:
    ///     store.complete(delivery.lease(), DateTime::now()).await?;
    /// }
    /// # Ok(())
    /// # }
    /// ```
    pub async fn claim<H: AsRef<str>>(
        &self,
        owner: &str,
        handlers: &[H],
        limit: u32,
        lease_duration: Duration,
        now: DateTime,
    ) -> Result<Vec<ClaimedDelivery>> {
        check_owner(owner)?;
        let wanted = check_handlers(handlers)?;
        check_limit(limit)?;
        check_lease_duration(lease_duration)?;
        let expires_at = add(now, lease_duration)?;
        let inner = &self.inner;
        // A dispatcher that never runs a transaction still sweeps the sessions of dead ones.
        inner.sessions.start(inner).await;
        let expiry = inner.sessions.expiry().unwrap_or(DEFAULT_HEARTBEAT_EXPIRY);
        inner.members.start(inner, expiry).await;
        if inner.members.note(owner, &wanted) {
            // A new member: the others learn of it at their next read of the lists.
            Members::announce(inner, expiry).await;
        }

        let lock = inner.claims.owner(owner);
        let mut state = lock.lock().await;
        if state.interrupted {
            // The previous claim of this owner was dropped half-way.
            state.known = None;
            self.reconcile(owner, now).await?;
            state.interrupted = false;
        }
        state.interrupted = true;
        let request = Request {
            owner,
            handlers: &wanted,
            expires_at,
            now,
        };
        let limit = limit as usize;
        let mut claimed = Vec::new();
        let mut passes = 0;
        let outcome = loop {
            match self.claim_locked(&request, limit, &mut state).await {
                // A lane lists a delivery this instance did not hand out: reconcile, again.
                Ok(None) if passes == 0 => {
                    passes += 1;
                    if let Err(error) = self.reconcile(owner, now).await {
                        break Err(error);
                    }
                }
                Ok(None) => break Ok(()),
                Ok(Some((batch, raced))) => {
                    claimed.extend(batch);
                    passes += 1;
                    // Lanes another claimer took first were given up at the record: a claim
                    // left with nothing tries again, a few times at most.
                    if !(raced && claimed.is_empty() && passes <= RACE_RETRIES) {
                        break Ok(());
                    }
                }
                Err(error) => break Err(error),
            }
        };
        match outcome {
            Ok(()) => {
                state.interrupted = false;
                Ok(claimed)
            }
            Err(error) if claimed.is_empty() => {
                match self.reconcile(owner, now).await {
                    Ok(()) => state.interrupted = false,
                    Err(reconcile_error) => tracing::warn!(
                        owner,
                        error = %reconcile_error,
                        "relaybus: reconciling the lanes of a failed claim failed; \
                         the next claim of this owner tries again"
                    ),
                }
                Err(error)
            }
            Err(error) => {
                // What this claim handed out stays handed out; what the failed pass may have
                // recorded is reconciled by the next claim.
                tracing::warn!(owner, %error, "relaybus: claiming more after a lost race failed");
                Ok(claimed)
            }
        }
    }

    /// Forgets what this store instance keeps in memory about its claims and members, as a
    /// restart would, without letting go of anything it holds. The next claims read the lanes
    /// again and reconcile what they list; deliveries that were running may run again.
    #[doc(hidden)]
    pub fn forget_claim_state(&self) {
        self.inner.claims.forget_everything();
        self.inner.members.clear();
    }

    /// The lanes `owner` owns among the members this store instance knows of, as a claim of it
    /// through this instance would take them; `None` when it owns none (it is no member, or the
    /// members claim for different handler sets). For benchmarks and tests of rebalancing.
    #[doc(hidden)]
    pub fn lane_share(&self, owner: &str) -> Option<Vec<i32>> {
        self.inner
            .members
            .lanes_of(owner, self.inner.claims.instance)
    }

    /// One pass of a claim, with the owner's lock held: what it handed out, and whether it gave
    /// up picks because another claimer took their lane first. `None` when the owner's lanes
    /// list a delivery this instance did not hand out; nothing was recorded then.
    async fn claim_locked(
        &self,
        request: &Request<'_>,
        limit: usize,
        state: &mut OwnerState,
    ) -> Result<Option<(Vec<ClaimedDelivery>, bool)>> {
        let Request {
            owner,
            handlers,
            now,
            expires_at,
        } = *request;
        let inner = &self.inner;
        let instance = inner.claims.instance;
        let issued = inner.claims.snapshot();

        // The owner's lanes, read while the first pages of the lanes it kept are: of the few
        // its last claim drained deep when there are some, and a claim in DRAIN_CLAIMS reads
        // them all, so that the oldest due delivery of every lane is looked at.
        let expected = std::mem::take(&mut state.held);
        let mut draining = std::mem::take(&mut state.draining);
        if state.drained >= DRAIN_CLAIMS {
            draining.clear();
            state.ranked.clear();
        }
        // Beside them, the next lanes the last read of every lane ranked.
        while draining.len() < DRAIN_LANES && !state.ranked.is_empty() {
            let lane = state.ranked.remove(0);
            if !draining.contains(&lane) {
                draining.push(lane);
            }
        }
        draining.sort_unstable();
        let first_lanes = if draining.is_empty() {
            &expected
        } else {
            &draining
        };
        let window = page_window(limit);
        let first_pages = async {
            if first_lanes.is_empty() {
                return Ok(None);
            }
            // What this instance handed out in those lanes runs, or ran: left out on the index
            // keys, so that the page holds what may be picked.
            let handed: HashSet<ObjectId> = issued
                .iter()
                .filter(|(_, claim)| first_lanes.binary_search(&claim.lane).is_ok())
                .map(|(id, _)| *id)
                .collect();
            self.first_pages(first_lanes, handlers, now, window, &handed)
                .await
                .map(Some)
        };
        // The lanes as the last claim left them, when it knew them all; else read.
        let generation = inner.claims.generation();
        let known = state
            .known
            .take()
            .filter(|(then, lanes)| {
                *then == generation
                    && state.unread < READ_LANES_EVERY
                    && !inner.claims.list_completing(lanes)
            })
            .map(|(_, lanes)| lanes);
        state.unread = if known.is_some() { state.unread + 1 } else { 0 };
        let read = async {
            match known {
                Some(_) => Ok(None),
                None => self.own_lanes(owner).await.map(Some),
            }
        };
        let (read, first_pages) = futures::join!(read, first_pages);
        let (held, listed) = match read? {
            Some((held, found)) => {
                let lost: Vec<Lane> = held
                    .iter()
                    .filter(|lane| !lane.lost.is_empty())
                    .cloned()
                    .collect();
                self.charge_lost(&lost, now).await?;
                let Some(listed) = self.judge_listed(&held, &found, &issued) else {
                    return Ok(None);
                };
                inner.claims.seen_completed(&held, &listed.running);
                (held, listed)
            }
            None => {
                let mut held = known.unwrap_or_default();
                inner.claims.take_off_given_back(&mut held);
                let listed = listed_from_memory(&held, &issued, &mut state.keys);
                (held, listed)
            }
        };

        // The lanes it owns, taken when free.
        let owned: Option<HashSet<i32>> = inner
            .members
            .lanes_of(owner, instance)
            .map(|lanes| lanes.into_iter().collect());
        let mut lanes: Vec<(Lane, Hold)> =
            held.into_iter().map(|lane| (lane, Hold::Held)).collect();
        if let Some(owned) = &owned {
            let generation = inner.members.generation();
            let missing: Vec<i32> = owned
                .iter()
                .filter(|id| !lanes.iter().any(|(lane, _)| lane.id == **id))
                .copied()
                .collect();
            // An owner whose last claim came up empty tries at once: it may have been woken by
            // work in one of these lanes, and an idle owner claims seldom.
            let due = state.came_up_empty
                || state.taken_at.is_none_or(|(known, tried)| {
                    known != generation || tried.due(TAKE_INTERVAL, now)
                });
            if !missing.is_empty() && due {
                state.taken_at = Some((generation, Tried::at(now)));
                let taken = self.take_owned(&missing, request).await?;
                lanes.extend(taken.into_iter().map(|lane| (lane, Hold::Taken)));
            }
        }

        // Parked heads whose predecessors finished go back to their lanes first; what it looked
        // up of their keys serves the per-key rules.
        let (unparked, lowest) = self
            .unpark_for_claim(handlers, &listed.running_keys, now)
            .await;

        // Scanning the lanes it owns and holds, and those it took to help with (all it holds
        // when it owns none). A lane that moved to another member is not scanned: it is handed
        // on once it runs nothing.
        let mut scanned: Vec<i32> = lanes
            .iter()
            .map(|(lane, _)| lane.id)
            .filter(|id| {
                owned.as_ref().is_none_or(|owned| owned.contains(id)) || state.helping.contains(id)
            })
            .collect();
        scanned.sort_unstable();
        // Passed over: what the lanes list, gone or not. A page read before a completion
        // deleted a delivery still shows it; its lane lists it until the record takes it off.
        let passed_over: HashSet<ObjectId> = lanes
            .iter()
            .flat_map(|(lane, _)| lane.in_flight.iter().copied())
            .collect();
        let running = listed.running;
        let mut scan = Scan::new(Picking::new(limit, passed_over, listed.running_keys));
        scan.picking
            .learn_heads(lowest.keys().cloned().collect(), &lowest);
        // Deliveries unparking sent back to the lanes are not in the pages read before.
        let mut first_pages = first_pages?.filter(|_| !unparked);
        if !draining.is_empty() {
            // The draining lanes first; the rest only when they did not fill the claim.
            let still = draining.iter().all(|id| scanned.binary_search(id).is_ok());
            if let Some(pages) = first_pages.take().filter(|_| still) {
                self.pick_from_pages(pages, &mut scan).await?;
            }
        }
        state.drained = if !draining.is_empty() && scan.picking.full() {
            state.drained + 1
        } else {
            0
        };
        self.scan_lanes_from(&scanned, handlers, now, &mut scan, first_pages)
            .await?;
        let draining = scan.picking.draining_lanes(DRAIN_LANES);
        let ranked = scan.ranked.take();

        // Free lanes with work, when its own did not fill the claim: at once when it owns
        // none, else once a second at most (a member's free lanes are those of dead members, and
        // of members it did not see join yet).
        let probe = !scan.picking.full()
            && (owned.is_none()
                || (state.came_up_empty && scan.picking.picks.is_empty())
                || state
                    .probed_at
                    .is_none_or(|tried| tried.due(PROBE_INTERVAL, now)));
        if probe {
            state.probed_at = Some(Tried::at(now));
            let before: HashSet<i32> = lanes.iter().map(|(lane, _)| lane.id).collect();
            self.take_free_lanes(request, &mut lanes, &mut scan).await?;
            state.helping.extend(
                lanes
                    .iter()
                    .map(|(lane, _)| lane.id)
                    .filter(|id| !before.contains(id)),
            );
        }

        // Recording, while the events of the picks are read; then parking what waits.
        let Scan {
            picking,
            mut events,
            ..
        } = scan;
        let Picking { picks, waiting, .. } = picking;
        let keep: HashSet<i32> = owned.clone().unwrap_or_default();
        let (read, recorded) = futures::join!(
            self.events_missing(&picks, &events),
            self.record(request, lanes, picks.clone(), &running, &keep),
        );
        let recorded = recorded?;
        if !recorded.handed_back.is_empty() {
            // The owners of the lanes handed back on this instance take them at their next claim.
            inner.members.lanes_freed();
        }
        events.extend(read?);
        state
            .helping
            .retain(|id| recorded.lanes.iter().any(|lane| lane.id == *id));
        state
            .helping
            .retain(|id| !recorded.handed_back.contains(id));
        state.held = recorded
            .lanes
            .iter()
            .map(|lane| lane.id)
            .filter(|id| !recorded.handed_back.contains(id))
            .filter(|id| {
                owned.as_ref().is_none_or(|owned| owned.contains(id)) || state.helping.contains(id)
            })
            .collect();
        state.held.sort_unstable();
        let held = |id: &i32| state.held.binary_search(id).is_ok();
        state.draining = draining.into_iter().filter(held).collect();
        let ranked = ranked.unwrap_or_else(|| std::mem::take(&mut state.ranked));
        state.ranked = ranked
            .into_iter()
            .filter(|id| held(id) && !state.draining.contains(id))
            .collect();
        state.draining.sort_unstable();
        if recorded.raced {
            state.draining.clear();
            state.ranked.clear();
        }
        state.known = recorded.all_matched.then(|| {
            let lanes = recorded
                .lanes
                .iter()
                .filter(|lane| !recorded.handed_back.contains(&lane.id))
                .cloned()
                .collect();
            (generation, lanes)
        });
        state.keys.extend(recorded.picks.iter().filter_map(|pick| {
            let key = pick.key.clone()?;
            Some((pick.id, (pick.handler.clone(), key)))
        }));

        let (claimed, orphaned) =
            self.hand_out(recorded.picks, &recorded.lanes, &events, expires_at);
        state.came_up_empty = claimed.is_empty();
        self.park_waiting(owner, &waiting, &recorded.handed_back)
            .await;
        for lease in orphaned {
            // Not handed out: taken off its lane again, uncharged. The next claim finds it.
            if let Err(error) = self.release(&lease, now).await {
                tracing::warn!(%error, "relaybus: giving back a delivery the claim did not hand out failed");
            }
        }
        Ok(Some((claimed, recorded.raced)))
    }
}

/// When something was last tried: by the claims' clock and by this process's.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Tried {
    claim_time: DateTime,
    instant: std::time::Instant,
}

impl Tried {
    fn at(now: DateTime) -> Tried {
        Tried {
            claim_time: now,
            instant: std::time::Instant::now(),
        }
    }

    /// Whether it may be tried again at claim time `now`: `interval` later by either clock, or
    /// when the claims' clock went back.
    fn due(&self, interval: Duration, now: DateTime) -> bool {
        let passed = now.timestamp_millis() - self.claim_time.timestamp_millis();
        self.instant.elapsed() >= interval || !(0..interval.as_millis() as i64).contains(&passed)
    }
}
