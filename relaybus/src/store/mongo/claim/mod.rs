//! Claiming deliveries.
//!
//! Workers lease lanes, not deliveries. A claim goes through these phases, each in a module of
//! its own:
//!
//! - **Reading the lanes** ([`read`]). One aggregation reads every lane document (which lanes are
//!   free, which this owner holds on this store instance; after an idle wait, only the held and
//!   reported lanes' documents and those of the lanes other live owners hold), the deliveries its
//!   held lanes list that its store instance neither vouches for nor completed itself, the
//!   lowest parked delivery of each key of its handlers, and the lowest
//!   pending delivery of those keys (for the handlers whose parked deliveries the last such read
//!   found). Then, at the same time, parked deliveries whose predecessors finished go back to the
//!   ready lane (for the keys of every lane no other live owner holds and in which nothing of the
//!   key runs), and the claims an earlier holder lost in the held lanes are charged. When every
//!   such head is in a lane the owner holds, the claim picks the heads itself (after the reported
//!   lanes, before the held lanes' scan): those it picks run from the parked lane, and the others
//!   go back with an update sent with its record. Held lanes that list a claim this instance did
//!   not hand out are reconciled before the claim starts again.
//! - **Scanning** ([`scan`]) the held lanes: their due, ready deliveries in `(dueAt, _id)` order,
//!   leaving out the ones the owner already runs, a page at a time. Their first page comes with
//!   the first read (ahead of the lanes, for the lanes held when the owner's last claim ended),
//!   unless lanes were reported (then theirs does), the owner holds other lanes now, or
//!   unparking sent deliveries back to a held lane after it.
//! - **Ranking free lanes** ([`rank`]) and **taking** them ([`take`]), if the claim needs more:
//!   free lanes (no holder, or an expired lease) with due deliveries of its handlers, the lanes
//!   with the oldest due deliveries first, in rounds of twice as many lanes each, scanned in turn.
//!   A free lane with nothing in flight and nothing lost is read without a write, and the record
//!   takes it; any other is taken at once, and the claims its previous holder lost are charged
//!   before it is read.
//! - **Picking** ([`pick`]) from every page the scans read, under the per-key rules, until the
//!   claim has `limit` deliveries.
//! - **Recording** ([`record`]) the batch, while the events of the picks are read: one
//!   conditional write per lane, all in one `update` command (the held lanes' in one statement),
//!   that takes the free lanes picked from and hands back the lanes that yielded nothing and run
//!   nothing. A lane whose condition no longer holds keeps nothing of this claim.
//! - **Handing out** ([`hand_out`]) the deliveries with their events and leases. A recorded
//!   pick whose event is missing is given back at once, uncharged. Then the deliveries found
//!   waiting are parked.
//!
//! A claim can be told which lanes the change stream reported new deliveries in. It reads those
//! lanes first, held or free, their first page coming with the first read. After an idle wait
//! (the owner's last claim found nothing) it reads them alone, instead of scanning the held lanes
//! and ranking free ones: nothing older was due when the dispatcher went idle. A busy owner goes
//! on to its held lanes and free ones when the reported lanes do not fill the claim, so that a
//! new key's delivery does not wait behind the backlog of other keys. An idle claim that took
//! every due delivery of the reported lanes, while the reports were complete, spares the claim
//! right after it ([`Exhausted`]).
//!
//! After an idle wait, when the wake-ups told what they reported (the new deliveries'
//! documents) and those are all unkeyed and due, the claim records them on their lanes beside
//! one read that proves the record was in time, without reading the lanes first ([`arrive`]).
//!
//! A claim for a worker that runs a key's deliveries one after the other hands out, behind each
//! keyed delivery it picked, the key's next deliveries as a run ([`runs`]), listed with it.
//!
//! A worker that just completed a keyed delivery can claim the key's next one alone, without a
//! whole claim ([`next`]); and while a claim runs, the worker can claim what the change stream
//! reports meanwhile beside it, when it may run at once ([`beside`]).
//!
//! An unkeyed claim writes no delivery document. Any failure reconciles the owner's lanes
//! ([`reconcile`]).

pub(crate) mod arrive;
mod beside;
pub(crate) mod hand_out;
mod next;
mod pick;
mod rank;
mod read;
mod reconcile;
mod record;
pub(crate) mod runs;
mod scan;
mod share;
mod take;

pub(crate) use self::scan::DeliveryFields;

use std::{collections::HashSet, sync::atomic::Ordering, time::Duration};

use mongodb::bson::{DateTime, oid::ObjectId};

use self::{
    arrive::Arrived,
    pick::Picking,
    read::{FirstPage, LaneView, Running, Unparking, lists_foreign_claims},
    record::Keep,
    scan::{Candidate, Scan, page_window},
    take::Hold,
};
use super::{
    MongoEventStore,
    lane::{Lane, MAX_CLAIM_LIMIT, add, check_lease_duration, check_owner},
    lease::{Exhausted, Lease, OwnerState},
};
use crate::{
    error::{InvalidArgumentError, Result},
    event::EventEnvelope,
    handler::validate_handler_id,
};

/// Claims in a row that take the deliveries this instance handed out for running without
/// reading them (see `read_lanes`).
const VOUCHED_READS: u32 = 15;
/// Further passes of a claim after it lost lanes to other claimers.
const RACE_RETRIES: usize = 2;
/// The most handlers one claim serves.
const MAX_HANDLERS: usize = 1_000;

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

/// A claim's deliveries grouped as their worker runs them: the ordered deliveries of one
/// handler and key together, in sequence order; every other delivery alone; in the order of the
/// claim.
fn group_runs(claimed: Vec<ClaimedDelivery>) -> Vec<Vec<ClaimedDelivery>> {
    crate::store::group_runs(
        claimed,
        |delivery| {
            let key = delivery.key().filter(|_| delivery.ordered)?;
            Some((delivery.handler(), key))
        },
        ClaimedDelivery::sequence,
    )
}

/// What one pass of a claim hands out.
#[derive(Debug, Default)]
struct Batch {
    claimed: Vec<ClaimedDelivery>,
    /// Some picks were given up because another claimer took their lane first.
    raced: bool,
    /// A claim after an idle wait that found nothing sent parked deliveries back to lanes it
    /// did not read after, or a claim that found nothing handed lanes on unread: the claim
    /// right after it reads those lanes (see `claim_locked`).
    again: bool,
}

/// What every phase of one claim goes by: who claims, for which handlers, the lease expiry the
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
    /// Deliveries come in `(dueAt, id)` order within each group of lanes, from the lanes the
    /// owner already holds first. A keyed delivery is handed out only when no earlier delivery
    /// of its handler and key is pending and none of them runs, and one claim never hands out
    /// two deliveries of one key ([`claim_runs`](Self::claim_runs) hands out runs of a key's
    /// next deliveries); the claim looks past blocked keys until it has `limit`. An
    /// unordered delivery (its handler was [unordered](crate::Subscription::unordered) when the
    /// event was appended) is handed out as an unkeyed one is.
    /// Deliveries a claim finds waiting behind a slow predecessor may be parked, and come back
    /// once the predecessor finished (see the crate documentation).
    ///
    /// `owner` names the worker. Lanes are held per owner **and per store instance** (one
    /// [`build`](crate::MongoEventStoreBuilder::build), shared by clones): a restarted process
    /// with the same owner name takes its predecessor's lanes over once their leases expired,
    /// and is charged for what the predecessor left running. Claims of one owner on one store
    /// instance run one after the other.
    ///
    /// Claimers share the lanes: a claim that finds nothing while another holder holds several
    /// lanes keeps one lane, listing nothing, so that the others count it as waiting, and a
    /// claimer that sees waiting ones holds at most its share of the lanes held (their number
    /// over the holders', rounded up), handing back the others that run nothing. Without that,
    /// one claim whose `limit` covers every key of a keyed backlog would take all their lanes
    /// and keep them while they have work.
    ///
    /// The store compares lease expiries with `now` and never reads the server clock, so keep
    /// worker clocks synchronised.
    ///
    /// # Cost
    ///
    /// With its lanes already held, an unkeyed claim costs the same three commands whatever
    /// `limit` is (the lanes with the first page of their deliveries, then their events and the
    /// record together), and writes no delivery document; one more when the page does not fill it
    /// or the owner holds other lanes than when its last claim ended. Each round over free lanes
    /// adds two reads (one per 128 lanes ranked, in parallel, and one scan); a free lane with lost
    /// claims to charge adds one write before it is read. A keyed claim adds one lookup per key, in
    /// parallel; the lanes' read looks up the parked keys (up to 500 per handler, one lookup per
    /// 500 beyond), which serves both: a key unparked in a lane the owner holds is not looked up
    /// again; a read that finds a handler's first parked keys leaves their lookup to unparking, one
    /// aggregation more. Unparking adds one write, unless every parked delivery it would send back
    /// is the head of its key in a lane the owner holds and the claim picks it: it then runs from
    /// the parked lane.
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
    /// They are not lost: every claim checks that the owner's lanes list only deliveries this
    /// instance handed out, and reconciles them first when they do not, so the next claim of the
    /// same owner on the same instance puts them back. Without one, they wait for the lane lease
    /// to expire and are charged one attempt when the lane is taken over.
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
        self.claim_with_runs(owner, handlers, limit, (1, 0), lease_duration, now)
            .await
    }

    /// [`claim`](Self::claim), handing out behind each keyed delivery it picks the key's next
    /// deliveries in sequence order, up to `run` of the key in all: a key's backlog drains in
    /// runs rather than one delivery per claim. `limit` counts a run as one.
    ///
    /// The deliveries come grouped: each inner list is one run of a handler and key in sequence
    /// order, or one delivery alone (unkeyed, of an unordered handler, or the only one its key
    /// had ready). **Run a run's deliveries one after the other, each only once its
    /// predecessor's [completion](Self::complete_many) returned `true`**: a member is the key's
    /// next delivery only once the one before it completed. When one does not complete (its
    /// handler failed, or its lease is lost), [`release`](Self::release) the rest of its run
    /// or let it wait out its lease; the members were not started, and releasing them charges
    /// no attempt. Runs of different keys are independent: complete the first members of all of
    /// them in one batch, then the second members, and so on.
    ///
    /// A member is due, pending and the key's next in sequence, with no gap in the numbers
    /// between it and its predecessor; a run ends before the first delivery that is not. A
    /// handler that takes only some of a key's event types sees gaps, and its runs end there.
    ///
    /// # Cost
    ///
    /// As [`claim`](Self::claim), plus one read for the runs of all the keys picked.
    ///
    /// # Errors
    ///
    /// As [`claim`](Self::claim), and [`Error::InvalidArgument`](crate::Error::InvalidArgument)
    /// for a `run` outside 1 to 1,000. Nothing is sent to the database then.
    ///
    /// # Cancel safety
    ///
    /// As [`claim`](Self::claim).
    ///
    /// # Example
    ///
    /// ```no_run
    /// # async fn example(store: relaybus::MongoEventStore) -> Result<(), relaybus::Error> {
    /// use std::time::Duration;
    /// use relaybus::mongodb::bson::DateTime;
    ///
    /// let mut runs = store
    ///     .claim_runs("worker-1", &["projector"], 50, 16, Duration::from_secs(30), DateTime::now())
    ///     .await?;
    /// // Wave by wave: the first delivery of every run, then the second, ...
    /// let mut at = 0;
    /// while runs.iter().any(|run| run.len() > at) {
    ///     let wave: Vec<_> = runs.iter().filter_map(|run| run.get(at)).collect();
    ///     // run the handler of each delivery in `wave`, then:
    ///     let leases: Vec<_> = wave.iter().map(|delivery| *delivery.lease()).collect();
    ///     let completed = store.complete_many(&leases, DateTime::now()).await?;
    ///     let mut done = completed.into_iter();
    ///     for run in runs.iter_mut().filter(|run| run.len() > at) {
    ///         if !done.next().unwrap_or(false) {
    ///             // Not completed: the rest of this run goes back.
    ///             for rest in run.drain(at + 1..) {
    ///                 store.release(rest.lease(), DateTime::now()).await?;
    ///             }
    ///         }
    ///     }
    ///     at += 1;
    /// }
    /// # Ok(())
    /// # }
    /// ```
    pub async fn claim_runs<H: AsRef<str>>(
        &self,
        owner: &str,
        handlers: &[H],
        limit: u32,
        run: u32,
        lease_duration: Duration,
        now: DateTime,
    ) -> Result<Vec<Vec<ClaimedDelivery>>> {
        let claimed = self
            .claim_with_runs(owner, handlers, limit, (run, limit), lease_duration, now)
            .await?;
        Ok(group_runs(claimed))
    }

    /// [`claim`](Self::claim), handing out behind each keyed delivery the key's next
    /// deliveries, up to `run` in all, behind at most `runs` of them (see [`runs`]): the caller
    /// runs each key's deliveries one after the other, in sequence order, each only once its
    /// predecessor's completion is durable, and gives back the rest when one does not complete.
    /// `limit` counts a run as one. A `run` of 1 is [`claim`](Self::claim).
    pub(crate) async fn claim_with_runs<H: AsRef<str>>(
        &self,
        owner: &str,
        handlers: &[H],
        limit: u32,
        (run, runs): (u32, u32),
        lease_duration: Duration,
        now: DateTime,
    ) -> Result<Vec<ClaimedDelivery>> {
        check_owner(owner)?;
        // A dispatcher that never runs a transaction still sweeps the sessions of dead ones.
        self.inner.sessions.start(&self.inner).await;
        let mut wanted: Vec<&str> = Vec::with_capacity(handlers.len());
        for handler in handlers {
            let handler = handler.as_ref();
            validate_handler_id(handler)?;
            if !wanted.contains(&handler) {
                wanted.push(handler);
            }
        }
        if wanted.is_empty() || wanted.len() > MAX_HANDLERS {
            return Err(InvalidArgumentError::new(
                "handlers",
                format!(
                    "{} handlers given; claim for 1 to 1000 handlers",
                    wanted.len()
                ),
            )
            .into());
        }
        if !(1..=MAX_CLAIM_LIMIT).contains(&limit) {
            return Err(InvalidArgumentError::new(
                "limit",
                format!("{limit} is out of range; claim 1 to 10000 deliveries at a time"),
            )
            .into());
        }
        if !(1..=runs::MAX_RUN).contains(&run) {
            return Err(InvalidArgumentError::new(
                "run",
                format!("{run} is out of range; hand out 1 to 1000 deliveries of a key at a time"),
            )
            .into());
        }
        check_lease_duration(lease_duration)?;
        let expires_at = add(now, lease_duration)?;

        let lock = self.inner.claims.owner(owner);
        let mut state = lock.lock().await;
        // No claim of a key's next delivery runs beside this claim.
        let gate = self.inner.claims.gate(owner);
        let _closed = gate.gate.write().await;
        {
            // What claims beside the last claim wrote is in the lanes this one reads.
            let _apart = gate.beside.read().await;
            gate.clear_touched();
        }
        if gate.interrupted.swap(false, Ordering::SeqCst) {
            state.interrupted = true;
        }
        if state.interrupted {
            // The previous claim of this owner was dropped half-way.
            self.reconcile(owner, now).await?;
            state.interrupted = false;
        }
        state.interrupted = true;
        let asked = (limit as usize, run, runs);
        let mut outcome = self
            .claim_locked(owner, &wanted, asked, expires_at, now, &mut state)
            .await;
        if matches!(outcome, Ok(None)) {
            // The owner's lanes list deliveries this instance did not hand out (a claim that
            // was dropped, or whose record landed late): reconcile, then claim again.
            outcome = match self.reconcile(owner, now).await {
                Ok(()) => {
                    self.claim_locked(owner, &wanted, asked, expires_at, now, &mut state)
                        .await
                }
                Err(error) => Err(error),
            };
        }
        match outcome.map(Option::unwrap_or_default) {
            Ok(Batch {
                mut claimed,
                mut raced,
                mut again,
            }) => {
                // Lanes another claimer took first were given up at the record. A claim left
                // with nothing tries other lanes, a few times at most: an empty claim sends its
                // dispatcher to wait for a wake-up. One that got something returns it; the
                // dispatcher claims again at once, for a whole batch, where another pass here
                // would read every lane again for the few deliveries missing.
                let mut retries = 0;
                while (raced || again) && claimed.is_empty() && retries < RACE_RETRIES {
                    retries += 1;
                    let more = self
                        .claim_locked(
                            owner,
                            &wanted,
                            (limit as usize - claimed.len(), run, runs),
                            expires_at,
                            now,
                            &mut state,
                        )
                        .await;
                    match more {
                        Ok(Some(more)) => {
                            claimed.extend(more.claimed);
                            raced = more.raced;
                            again = more.again;
                        }
                        Ok(None) => break,
                        Err(error) => {
                            // What this claim handed out so far stays handed out; whatever the
                            // failed attempt may have recorded is reconciled.
                            tracing::warn!(owner, %error, "relaybus: claiming more after a lost race failed");
                            if self.reconcile(owner, now).await.is_err() {
                                return Ok(claimed);
                            }
                            break;
                        }
                    }
                }
                state.interrupted = false;
                state.busy = !claimed.is_empty();
                Ok(claimed)
            }
            Err(error) => {
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
        }
    }

    /// Tells the next claim of `owner` on this instance which lanes just received new
    /// deliveries (a change stream reported them), for it to look at first: alone after an idle
    /// wait (nothing older was due), before its other lanes when the owner is busy. `complete`:
    /// no lane received a delivery since the owner's last claim that is not among `lanes`.
    /// `arrivals`: what the wake-ups told of each new delivery, when they told it of all.
    pub(crate) async fn hint_lanes(
        &self,
        owner: &str,
        lanes: Vec<i32>,
        complete: bool,
        arrivals: Vec<crate::store::Arrival>,
    ) {
        let lock = self.inner.claims.owner(owner);
        let mut state = lock.lock().await;
        state.hints = lanes;
        state.reports_complete = complete;
        state.arrivals = arrivals;
    }

    /// One claim, with the owner's lock held. `None` when the owner's lanes list a delivery
    /// this instance did not hand out; nothing was recorded then.
    async fn claim_locked(
        &self,
        owner: &str,
        handlers: &[&str],
        (limit, run, runs): (usize, u32, u32),
        expires_at: DateTime,
        now: DateTime,
        state: &mut OwnerState,
    ) -> Result<Option<Batch>> {
        let request = Request {
            owner,
            handlers,
            expires_at,
            now,
        };
        let reported = std::mem::take(&mut state.hints);
        let reports_complete = std::mem::take(&mut state.reports_complete);
        let arrivals = std::mem::take(&mut state.arrivals);
        let exhausted = state.exhausted.take();
        if !reports_complete {
            if let Some(ranking) = state.ranked.as_mut() {
                // Deliveries may have come into the lanes the last ranking found empty, unseen.
                ranking.covered.clear();
            }
        } else if reported.is_empty() && exhausted.is_some_and(|last| last.holds(handlers, now)) {
            // Right after an idle claim that took everything due where deliveries were
            // reported, and nothing reported since: nothing to find.
            return Ok(Some(Batch::default()));
        }

        // After an idle wait, what the wake-ups reported may be claimed as it is.
        let idle = !state.busy && !reported.is_empty();
        let gate = self.inner.claims.gate(owner);
        if idle && reports_complete && !arrivals.is_empty() {
            // Its proof takes a listed delivery for its own: no claim beside it may list one.
            let apart = gate.beside.read().await;
            let arrived = self.claim_arrivals(&request, &arrivals, limit).await?;
            drop(apart);
            match arrived {
                Arrived::Claimed { batch, all } => {
                    if all {
                        state.exhausted = Some(Exhausted {
                            at: now,
                            handlers: handlers.iter().map(|h| (*h).to_owned()).collect(),
                        });
                    }
                    return Ok(Some(batch));
                }
                Arrived::Declined => {}
            }
        }

        // Reading the lanes. After an idle wait, the first page of the reported lanes comes
        // along. The claims outstanding are taken before: the held lanes are judged by them.
        let issued = self.inner.claims.snapshot();
        // Most claims take the deliveries this instance handed out for running without reading
        // them; every `VOUCHED_READS + 1`th reads them all, so that one whose settlement never
        // reached the registry (its command failed after it applied) is found gone.
        let vouch = state.vouched_reads < VOUCHED_READS;
        state.vouched_reads = if vouch { state.vouched_reads + 1 } else { 0 };
        // The first page of the lanes scanned first comes with the read: the reported lanes,
        // or, without any, the lanes held when the owner's last claim ended.
        let expected = std::mem::take(&mut state.held);
        let first = if reported.is_empty() {
            FirstPage::Held {
                lanes: &expected,
                window: page_window(limit),
                issued: &issued,
            }
        } else {
            FirstPage::Reported(&reported, page_window(limit))
        };
        // The registry holds the claims of every owner on this instance; the read sends the
        // ids of those whose completion was sent, handed out in the lanes the owner held when
        // its last claim ended, to read them with the lanes.
        let vouched = vouch.then(|| {
            let lanes: HashSet<i32> = expected.iter().copied().collect();
            self.inner.claims.vouched(&issued, &lanes)
        });
        // The buses of this process count among the claimers ranking free lanes before any
        // lane read shows them: noted before the read, so that buses starting together see
        // each other.
        self.inner.claims.note_claimer(owner);
        // After an idle wait the claim reads the reported lanes alone: no other free lane
        // need be read.
        let LaneView {
            held,
            running_docs,
            free,
            taken_by_others,
            mut sharing,
            holders,
            parked,
            prescanned,
            held_page,
        } = self
            .read_lanes(
                owner,
                handlers,
                now,
                first,
                idle.then_some(reported.as_slice()),
                vouched.as_ref(),
            )
            .await?;
        let held_set: HashSet<i32> = held.iter().map(|lane| lane.id).collect();
        // What unparking looked up of the keys of held lanes still holds unless claims lost in
        // them were charged since; only then may the claim pick the heads it sends back itself.
        let nothing_lost = held.iter().all(|lane| lane.lost.is_empty());
        let (unparking, running) = futures::join!(
            self.unpark_for_claim(
                handlers,
                parked,
                &taken_by_others,
                &running_docs,
                &held_set,
                nothing_lost,
            ),
            self.running_in_held_lanes(&held, &running_docs, now),
        );
        let Unparking {
            heads: seen_heads,
            unparked,
            deferred,
        } = unparking;
        if let Some(ranking) = state.ranked.as_mut() {
            // Deliveries sent back to lanes the ranking found empty were not there then.
            match &unparked {
                Some(lanes) => ranking.covered.retain(|lane| !lanes.contains(lane)),
                None => ranking.covered.clear(),
            }
        }
        let mut running = running?;
        if lists_foreign_claims(&held, &running.generations, &issued) {
            return Ok(None);
        }
        let handing_over = running.handing_over(&held, &issued, &self.inner.claims);
        // Claimers that found nothing wait for lanes: beyond its share, this one hands back
        // the held lanes that run nothing, unread (see `share`).
        // The held lanes that run something: they list a delivery that runs or is handed over.
        // Only held lanes can: a lane taken lists what it ran as lost, and a joining one nothing.
        let running_lanes: HashSet<i32> = held
            .iter()
            .filter(|lane| {
                lane.in_flight
                    .iter()
                    .any(|id| running.ids.contains(id) || handing_over.contains(id))
            })
            .map(|lane| lane.id)
            .collect();
        let ceded: HashSet<i32> = share::surplus(&held, &sharing, &running_lanes)
            .into_iter()
            .collect();
        // A free lane with nothing to charge, for a claim that finds nothing to keep.
        let spare = free.iter().find(|lane| lane.clean).cloned();
        let Running {
            ids: running,
            keys: running_keys,
            ..
        } = running;

        // Scanning and picking: the reported lanes first, if any; then the held lanes and free
        // lanes, ranked, unless the owner was idle (the reported lanes alone then).
        let mut lanes: Vec<(Lane, Hold)> =
            held.into_iter().map(|lane| (lane, Hold::Held)).collect();
        let mut picking = Picking::new(limit, running, running_keys);
        if nothing_lost {
            picking.know_heads(seen_heads);
        }
        let mut scan = Scan::new(picking);
        let held_ids: Vec<i32> = lanes
            .iter()
            .map(|(lane, _)| lane.id)
            .filter(|lane| !ceded.contains(lane))
            .collect();
        let mut picked_all_reported = false;
        let rest = if reported.is_empty() {
            Some(held_ids)
        } else {
            picked_all_reported = self
                .scan_reported_lanes(
                    &request, &reported, &free, prescanned, &mut lanes, &mut scan,
                )
                .await?;
            // A busy worker looks at the reported lanes first, so that new deliveries do not
            // wait behind its backlog, then at its other lanes and free ones.
            (state.busy && !scan.picking.full()).then(|| {
                held_ids
                    .into_iter()
                    .filter(|lane| !reported.contains(lane))
                    .collect::<Vec<i32>>()
            })
        };
        // The heads unparking left to this claim come before the held lanes' scan, after the
        // reported lanes: the oldest of their keys, found without a scan. They go back to their
        // lanes with the record. After an idle wait too: a delivery written parked behind a
        // predecessor that completed before its append committed is reported, and found here.
        // Not those of the lanes handed back to waiting claimers: they go back to them unread.
        scan.picking.offer(
            deferred
                .iter()
                .filter(|head| head.lane.is_none_or(|lane| !ceded.contains(&lane)))
                .filter_map(|head| Candidate::from_parked(head, now))
                .collect(),
        );
        if let Some(rest) = rest {
            // The page read with the lanes (asked for only when no lane was reported) holds
            // when it read the same held lanes, and nothing went back to them from the parked
            // lane since: unparking sent nothing to a held lane, or left every head it freed to
            // this claim (they are still parked).
            let page = held_page.filter(|read| {
                read.lanes.len() == rest.len()
                    && rest.iter().all(|lane| read.lanes.contains(lane))
                    && (!deferred.is_empty()
                        || unparked
                            .as_ref()
                            .is_some_and(|lanes| rest.iter().all(|lane| !lanes.contains(lane))))
            });
            self.scan_lanes_from(
                &rest,
                handlers,
                now,
                &mut scan,
                page.map(|read| (read.page, read.window)),
            )
            .await?;
            // Only a claim that ranks free lanes needs its place among the claimers.
            if !scan.picking.full() {
                sharing.rank_among(
                    owner,
                    self.inner.claims.instance,
                    &holders,
                    &self.inner.claims.claimers(),
                );
            }
            self.scan_free_lanes(
                &request,
                free,
                &sharing,
                &mut state.ranked,
                &mut lanes,
                &mut scan,
            )
            .await?;
        }

        // Recording, with the events of the picks the scans did not bring read at the same
        // time; then parking what waits.
        let Scan {
            picking,
            mut events,
            ..
        } = scan;
        let Picking {
            mut picks,
            running,
            mut waiting,
            ..
        } = picking;
        let picked = picks.len();
        // From here to handing out, no claim beside this one runs. What one handed out since
        // this claim read is left out: its deliveries (running, or already completed: a
        // delivery this claim read may be gone by now), and deliveries of a key it started.
        // Lanes it wrote to are not handed back: this claim read them before.
        let apart = gate.beside.read().await;
        let claims = &self.inner.claims;
        picks.retain(|pick| {
            !gate.handed_beside(&pick.id)
                && claims.issued(&pick.id).is_none()
                && pick
                    .key
                    .as_ref()
                    .is_none_or(|key| !claims.key_issued(&pick.handler, key))
        });
        // Behind each key it picked, the key's next deliveries, for a worker that runs them
        // one after the other (see `runs`); they are not parked.
        let mut picked_ids: HashSet<ObjectId> = picks.iter().map(|pick| pick.id).collect();
        let members = self
            .runs_behind(&request, &picks, (run, runs), |id| {
                running.contains(id)
                    || picked_ids.contains(id)
                    || gate.handed_beside(id)
                    || claims.issued(id).is_some()
            })
            .await?;
        if !members.is_empty() {
            picked_ids.extend(members.iter().map(|member| member.id));
            for waits in waiting.values_mut() {
                waits.retain(|(id, _)| !picked_ids.contains(id));
            }
            picks.extend(members);
        }
        let handed = picks.len();
        let touched = gate.touched();
        // A claim that found nothing while another holds several lanes keeps one, listing
        // nothing, so that the other counts it as waiting: a lane it holds, one it took, or a
        // spare free one. Not when it keeps a lane anyway, for what runs there.
        let keep = if picks.is_empty() && running_lanes.is_empty() && sharing.keeps_a_lane() {
            let kept = lanes
                .iter()
                .filter(|(lane, hold)| !ceded.contains(&lane.id) && !matches!(hold, Hold::Taken))
                .map(|(lane, _)| lane.id)
                .next();
            match (kept, spare) {
                (Some(lane), _) => Some(lane),
                (None, Some(spare)) if !lanes.iter().any(|(lane, _)| lane.id == spare.lane.id) => {
                    let id = spare.lane.id;
                    lanes.push((
                        spare.lane,
                        Hold::Joining {
                            epoch: spare.stored_epoch,
                        },
                    ));
                    Some(id)
                }
                _ => None,
            }
        } else {
            None
        };
        // A head it picks runs from the parked lane, as a key's next delivery claimed after its
        // predecessor does (see `next`): it is deleted when it completes, and if it does not,
        // the level-triggered unparking of a later claim sends it back once nothing of its key
        // runs. The heads it does not pick go back to their lanes now.
        let deferred_ids: Vec<ObjectId> = deferred
            .iter()
            .map(|head| head.id)
            .filter(|id| !picked_ids.contains(id))
            .collect();
        let (read, recorded, moved) = futures::join!(
            self.events_missing(&picks, &events),
            self.record(
                &request,
                lanes,
                picks.clone(),
                &running,
                &handing_over,
                Keep {
                    touched: &touched,
                    lane: keep,
                },
            ),
            self.unpark_ids(deferred_ids.clone()),
        );
        let recorded = recorded?;
        state.held = recorded
            .lanes
            .iter()
            .map(|lane| lane.id)
            .filter(|lane| !recorded.handed_back.contains(lane))
            .collect();
        events.extend(read?);
        if let Err(error) = moved {
            // A later claim sends them back.
            tracing::warn!(%error, "relaybus: unparking deliveries failed");
        }
        // A claim that filled up may have handed back lanes it never read to the end: held
        // lanes, or free ones it joined, whose due deliveries came after its picks. A kept
        // ranking that read them when they were free must not go on saying they have nothing
        // due: they go back to the front of its lanes, to be tried again.
        if picked >= limit
            && let Some(ranking) = state.ranked.as_mut()
        {
            let unread: Vec<i32> = recorded
                .lanes
                .iter()
                .map(|lane| lane.id)
                .filter(|lane| {
                    recorded.handed_back.contains(lane)
                        && ranking.covered.contains(lane)
                        && !ranking.lanes.contains(lane)
                })
                .collect();
            ranking.lanes.splice(0..0, unread);
        }
        // A busy claim that did not fill up read its held lanes, and the free lanes it took,
        // in full: those it handed back have nothing it could run (what is due there waits
        // for its key), as a ranking that found them empty would say.
        if !idle
            && reports_complete
            && picked < limit
            && let Some(ranking) = state.ranked.as_mut()
            && !ranking.covered.is_empty()
        {
            // The lanes handed back to waiting claimers were not read: they have work.
            for lane in recorded.handed_back.difference(&ceded) {
                if !ranking.covered.contains(lane) {
                    ranking.covered.push(*lane);
                }
            }
        }
        if idle
            && reports_complete
            && picked_all_reported
            && waiting.is_empty()
            && !recorded.raced
            && recorded.picks.len() == handed
        {
            state.exhausted = Some(Exhausted {
                at: now,
                handlers: handlers.iter().map(|h| (*h).to_owned()).collect(),
            });
        }

        // Handing out.
        let (claimed, orphaned) =
            self.hand_out(recorded.picks, &recorded.lanes, &events, expires_at);
        // Handed out: claims beside this one may run again. Parking needs no keeping apart: a
        // delivery parked while it runs is moved back only once nothing of its key runs.
        drop(apart);
        self.park_waiting(owner, &waiting, &recorded.handed_back)
            .await;
        for lease in orphaned {
            // Not handed out: taken off its lane again, uncharged. The next claim finds it.
            if let Err(error) = self.release(&lease, now).await {
                tracing::warn!(%error, "relaybus: giving back a delivery the claim did not hand out failed");
            }
        }
        // After an idle wait, the reported lanes were read before unparking sent deliveries
        // back to lanes: a delivery written parked whose predecessor completed before its
        // append committed may be among them. A claim that found nothing reads them next.
        let mut again = false;
        // (Heads left to the claim were offered to it above.)
        if idle
            && claimed.is_empty()
            && deferred.is_empty()
            && let Some(lanes) = &unparked
            && !lanes.is_empty()
        {
            state.hints = lanes.iter().copied().collect();
            state.reports_complete = false;
            again = true;
        }
        // A claim that handed lanes on unread and found nothing in the lanes it kept tries
        // again at once: the lanes it handed on may hold all the work, and the claimers waiting
        // for them may not claim before their next wake-up.
        if claimed.is_empty() && !ceded.is_empty() {
            again = true;
        }
        Ok(Some(Batch {
            claimed,
            raced: recorded.raced,
            again,
        }))
    }
}
