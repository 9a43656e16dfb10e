//! The dispatcher: claims batches of deliveries, runs their handlers, and settles them.

mod idle;
mod run;
mod wake;

use std::{
    collections::{HashMap, HashSet, VecDeque},
    sync::{
        Arc, Mutex as StdMutex,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use futures::future::join_all;
use tokio::{
    sync::{Notify, Semaphore, mpsc, oneshot},
    task::AbortHandle,
};
use tokio_util::{sync::CancellationToken, task::TaskTracker};
use tracing::{Instrument, debug, info, info_span, warn};

use crate::{
    clock::Clock,
    error::Result,
    handler::{RetryPolicy, Subscription},
    state::StateMap,
    store::{
        Arrival, ClaimRequest, Claimed, NextOfKey, PurgeOptions, Purged, Queue, Store, StoreLease,
        WakePace, WakeUp,
    },
    telemetry::{self, BusMetrics, Operation},
    time::Timestamp,
};

pub(crate) use idle::IdleOptions;
pub use idle::{DEFAULT_MAX_RUNS, DeliveryRun, IdleReport, RunOutcome};
pub(crate) use run::{Outcome, run_delivery};

/// How often a started bus samples the delivery gauges by default.
pub(crate) const DEFAULT_GAUGE_INTERVAL: Duration = Duration::from_secs(15);

/// How often a busy bus reads its gathered wake-ups by default
/// ([`busy_wake_ups`](crate::RelayBusBuilder::busy_wake_ups)).
pub(crate) const DEFAULT_BUSY_WAKE_UPS: Duration = Duration::from_millis(10);

/// How long a bus claims without a pause before it gathers its wake-ups: bursts shorter than
/// this, such as one event and its follow-ups, keep every wake-up at once.
const BUSY_BEFORE_GATHERING: Duration = Duration::from_millis(100);

/// How long completed and dead deliveries are kept, and how often the bus purges older ones.
///
/// Completed events are kept as deduplication records for `completed`: a publish of the same
/// event id within that window adds nothing. Keep it longer than any redelivery window of the
/// systems that publish into the bus.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Retention {
    /// How long events stay after their last completion (and completion records, with
    /// completion history).
    pub completed: Duration,
    /// How long dead deliveries stay after they died.
    pub dead: Duration,
    /// How often the bus purges.
    pub interval: Duration,
}

impl Default for Retention {
    /// Completed for 7 days, dead for 30 days, purged hourly.
    fn default() -> Self {
        Retention {
            completed: Duration::from_secs(7 * 86_400),
            dead: Duration::from_secs(30 * 86_400),
            interval: Duration::from_secs(3_600),
        }
    }
}

/// The dispatcher's settings, validated by the bus builder.
#[derive(Debug, Clone)]
pub(crate) struct Settings {
    pub(crate) owner: String,
    pub(crate) batch_size: u32,
    /// The most deliveries of one key a claim hands out together, run one after the other.
    pub(crate) key_run: u32,
    pub(crate) concurrency: usize,
    pub(crate) lease_duration: Duration,
    pub(crate) poll_interval: Duration,
    pub(crate) retry: RetryPolicy,
    pub(crate) shutdown_timeout: Duration,
    pub(crate) setup_on_start: bool,
    pub(crate) change_stream: bool,
    /// How often a bus that claims without a pause reads its wake-ups; `None`: at once always.
    pub(crate) busy_wake_ups: Option<Duration>,
    /// Claim up to a batch beyond the free handler slots while handlers finish quickly.
    pub(crate) claim_ahead: bool,
    pub(crate) retention: Option<Retention>,
    /// How often a started bus samples the delivery gauges, if it leads; `None`: never.
    pub(crate) gauge_interval: Option<Duration>,
    /// The application state handlers take.
    pub(crate) state: StateMap,
    /// Where every time handed to the store comes from.
    pub(crate) clock: Clock,
}

/// A delivery a task of this bus is running.
#[derive(Debug)]
struct Running<L> {
    lease: L,
    transactional: bool,
    abort: Option<AbortHandle>,
}

/// What the dispatcher's tasks share.
pub(crate) struct Shared<S: Store> {
    pub(crate) store: S,
    pub(crate) subscriptions: HashMap<String, Subscription>,
    pub(crate) handler_ids: Vec<String>,
    pub(crate) settings: Settings,
    /// The bus's metrics, registered when it was built.
    pub(crate) metrics: BusMetrics,
    /// The handlers whose delivery gauges this bus set last.
    gauges: StdMutex<HashSet<String>>,
    running: StdMutex<RunningSet<S>>,
    /// Where the wake-ups reported new deliveries since the last claim (MongoDB: lanes).
    reported: StdMutex<Reports>,
    /// A claim of the dispatch loop is running.
    claiming: AtomicBool,
    /// How soon the dispatch loop wants its wake-ups; the wake-up stream reads it.
    pace: tokio::sync::watch::Sender<WakePace>,
    /// A wake-up told of a new delivery not yet offered to a claim beside the running one.
    arrived: Notify,
    /// How long this bus's handlers took, on average (exponentially weighted, in µs; [`UNKNOWN`]
    /// before the first finished).
    handler_micros: AtomicU64,
}

/// What the wake-ups reported since the last claim.
#[derive(Debug, Default)]
struct Reports {
    /// Where new deliveries are.
    lanes: Vec<u32>,
    /// What the wake-ups told of each new delivery, in order.
    arrivals: Vec<Arrival>,
    /// The wake-up stream is open.
    open: bool,
    /// Some new deliveries may not be in `lanes`: the stream (re)opened after deliveries it
    /// cannot report, or more lanes were reported than are remembered.
    gap: bool,
    /// Some new deliveries may not be in `arrivals`: a wake-up told nothing of its delivery,
    /// or more were reported than are remembered.
    arrivals_gap: bool,
    /// The arrivals not yet offered to a claim beside the running claim.
    fresh: Vec<Arrival>,
}

/// What the wake-ups reported between two claims.
#[derive(Debug, Default, PartialEq, Eq)]
struct Reported {
    /// Where new deliveries are.
    lanes: Vec<u32>,
    /// `lanes` holds every place where deliveries were inserted.
    complete: bool,
    /// What the wake-ups told of each new delivery: all of them, or none when some told
    /// nothing or the reports are not complete.
    arrivals: Vec<Arrival>,
}

impl Reports {
    /// A wake-up: a new delivery, at `wake_up.at` if the store could tell.
    fn report(&mut self, wake_up: WakeUp) {
        if let Some(lane) = wake_up.at
            && !self.lanes.contains(&lane)
        {
            if self.lanes.len() < MAX_REPORTED_LANES {
                self.lanes.push(lane);
            } else {
                self.gap = true;
            }
        }
        if let Some(arrival) = &wake_up.arrival
            && self.fresh.len() < MAX_ARRIVALS
        {
            self.fresh.push(arrival.clone());
        }
        match wake_up.arrival {
            Some(arrival) if self.arrivals.len() < MAX_ARRIVALS => self.arrivals.push(arrival),
            _ => self.arrivals_gap = true,
        }
    }

    /// The arrivals reported since the last claim began that no claim beside it was offered.
    fn take_fresh(&mut self) -> Vec<Arrival> {
        std::mem::take(&mut self.fresh)
    }

    /// The stream opened (`true`) or closed: what it reports is complete only from its opening
    /// on, and not at all while it is closed.
    fn opened(&mut self, open: bool) {
        self.open = open;
        self.gap = true;
    }

    /// What was reported since the last call.
    fn take(&mut self) -> Reported {
        let complete = self.open && !self.gap;
        let arrivals = std::mem::take(&mut self.arrivals);
        let arrivals = if complete && !self.arrivals_gap {
            arrivals
        } else {
            Vec::new()
        };
        self.gap = false;
        self.arrivals_gap = false;
        self.fresh.clear();
        Reported {
            lanes: std::mem::take(&mut self.lanes),
            complete,
            arrivals,
        }
    }
}

/// The deliveries a task of this bus runs, by delivery id.
type RunningSet<S> =
    HashMap<<<S as Queue>::Lease as StoreLease>::DeliveryId, Running<<S as Queue>::Lease>>;

impl<S: Store> std::fmt::Debug for Shared<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared")
            .field("settings", &self.settings)
            .field("handler_ids", &self.handler_ids)
            .finish_non_exhaustive()
    }
}

/// The most reported lanes remembered between two claims.
const MAX_REPORTED_LANES: usize = 64;
/// The average handler run time up to which a busy bus claims ahead of its free slots.
const QUICK_HANDLER: Duration = Duration::from_millis(20);
/// No handler has finished yet.
const UNKNOWN: u64 = u64::MAX;
/// The most arrivals remembered between two claims: more come only when the bus is busy,
/// and a busy claim looks for its deliveries anyway.
const MAX_ARRIVALS: usize = 64;

/// What one [`RelayBus::run_once`](crate::RelayBus::run_once) did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct RunReport {
    /// Deliveries claimed.
    pub claimed: usize,
    /// Deliveries whose handler succeeded and that were completed.
    pub completed: usize,
    /// Deliveries settled otherwise: retried later, buried, or given back.
    pub other: usize,
}

impl<S: Store> Shared<S> {
    pub(crate) fn new(store: S, subscriptions: &[Subscription], settings: Settings) -> Self {
        let subscriptions_list = subscriptions;
        let handler_ids = subscriptions.iter().map(|s| s.id.clone()).collect();
        let subscriptions = subscriptions
            .iter()
            .map(|s| (s.id.clone(), s.clone()))
            .collect();
        let metrics = BusMetrics::new(subscriptions_list);
        Shared {
            store,
            subscriptions,
            handler_ids,
            settings,
            metrics,
            gauges: StdMutex::new(HashSet::new()),
            running: StdMutex::new(HashMap::new()),
            reported: StdMutex::new(Reports::default()),
            claiming: AtomicBool::new(false),
            pace: tokio::sync::watch::Sender::new(WakePace::Eager),
            arrived: Notify::new(),
            handler_micros: AtomicU64::new(UNKNOWN),
        }
    }

    /// Takes one handler run's duration into the average.
    fn note_run(&self, took: Duration) {
        let took = u64::try_from(took.as_micros()).unwrap_or(u64::MAX / 2);
        let average = self.handler_micros.load(Ordering::Relaxed);
        let average = if average == UNKNOWN {
            took
        } else {
            // Weight 1/8: a few slow runs move it, one does not.
            average - average / 8 + took / 8
        };
        self.handler_micros.store(average, Ordering::Relaxed);
    }

    /// Whether the loop may claim beyond its free slots now: the bus allows it and its handlers
    /// have been quick.
    fn may_claim_ahead(&self) -> bool {
        self.settings.claim_ahead
            && self.handler_micros.load(Ordering::Relaxed) <= QUICK_HANDLER.as_micros() as u64
    }

    /// The current time of the bus's clock.
    pub(crate) fn now(&self) -> Timestamp {
        self.settings.clock.now()
    }

    fn running(&self) -> std::sync::MutexGuard<'_, RunningSet<S>> {
        // A panic while holding this lock cannot leave the map inconsistent: recover it.
        self.running.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn reports(&self) -> std::sync::MutexGuard<'_, Reports> {
        self.reported.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Remembers what a wake-up reported of a new delivery.
    pub(super) fn report(&self, wake_up: WakeUp) {
        let told = wake_up.arrival.is_some();
        self.reports().report(wake_up);
        if told {
            self.arrived.notify_one();
        }
    }

    /// The wake-up stream opened (`true`) or closed.
    pub(super) fn reports_open(&self, open: bool) {
        self.reports().opened(open);
    }

    /// What the wake-ups reported since the last call.
    fn take_reported(&self) -> Reported {
        self.reports().take()
    }

    /// Claims up to `limit` deliveries, looking first where the wake-ups reported new
    /// deliveries since the last claim.
    async fn claim(&self, limit: u32, (run, runs): (u32, u32)) -> Result<Vec<Claimed<S::Lease>>> {
        let settings = &self.settings;
        let span = info_span!("relaybus.claim", owner = %settings.owner, limit);
        let reported = self.take_reported();
        async {
            let started = Instant::now();
            let batch = self
                .store
                .claim(ClaimRequest {
                    owner: &settings.owner,
                    handlers: &self.handler_ids,
                    limit,
                    run,
                    runs,
                    lease_duration: settings.lease_duration,
                    now: self.now(),
                    reported: &reported.lanes,
                    reports_complete: reported.complete,
                    arrivals: &reported.arrivals,
                })
                .await;
            self.metrics.operation(
                Operation::Receive,
                started.elapsed().as_secs_f64(),
                batch.is_err(),
            );
            let batch = batch?;
            for delivery in &batch {
                if let Some(metrics) = self.metrics.handler(&delivery.handler) {
                    metrics.consumed.increment(1);
                }
            }
            if !batch.is_empty() {
                debug!(claimed = batch.len(), "claimed deliveries");
            }
            Ok(batch)
        }
        .instrument(span)
        .await
    }

    /// Claims, beside the running claim, deliveries the wake-ups told of since it began, up to
    /// `limit`, where the store can hand them out at once.
    async fn claim_beside(&self, limit: u32) -> Vec<Claimed<S::Lease>> {
        let arrivals = self.reports().take_fresh();
        if arrivals.is_empty() || limit == 0 {
            return Vec::new();
        }
        let settings = &self.settings;
        let started = Instant::now();
        let batch = self
            .store
            .claim_beside(ClaimRequest {
                owner: &settings.owner,
                handlers: &self.handler_ids,
                limit,
                run: 1,
                runs: 0,
                lease_duration: settings.lease_duration,
                now: self.now(),
                reported: &[],
                reports_complete: false,
                arrivals: &arrivals,
            })
            .await;
        match batch {
            Ok(batch) => {
                if !batch.is_empty() {
                    self.metrics.operation(
                        Operation::Receive,
                        started.elapsed().as_secs_f64(),
                        false,
                    );
                    debug!(
                        claimed = batch.len(),
                        "claimed reported deliveries beside a claim"
                    );
                }
                for delivery in &batch {
                    if let Some(metrics) = self.metrics.handler(&delivery.handler) {
                        metrics.consumed.increment(1);
                    }
                }
                batch
            }
            Err(error) => {
                self.metrics
                    .operation(Operation::Receive, started.elapsed().as_secs_f64(), true);
                debug!(%error, "claiming reported deliveries beside a claim failed; the next claim finds them");
                Vec::new()
            }
        }
    }

    /// Samples the delivery gauges if this bus leads their sampling (see [`crate::telemetry`]);
    /// a bus that no longer leads sets its gauges to zero. Whether it sampled. `shared`: a
    /// count another bus of the store instance took in the last half interval will do.
    pub(crate) async fn sample_gauges(&self, shared: bool) -> Result<bool> {
        let interval = self
            .settings
            .gauge_interval
            .unwrap_or(DEFAULT_GAUGE_INTERVAL);
        let leads = self
            .store
            .lead(telemetry::GAUGE_ROLE, interval.saturating_mul(3))
            .await?;
        if !leads {
            let mut reported = self.gauges.lock().unwrap_or_else(|e| e.into_inner());
            if !reported.is_empty() {
                telemetry::record_gauges(&[], self.now(), &mut reported);
            }
            return Ok(false);
        }
        // Buses sharing a store instance sample on their interval with one count: whichever
        // asks first in half an interval counts, the others report what it found.
        let max_age = if shared { interval / 2 } else { Duration::ZERO };
        let statistics = self.store.gauge_statistics(max_age).await?;
        let mut reported = self.gauges.lock().unwrap_or_else(|e| e.into_inner());
        telemetry::record_gauges(&statistics, self.now(), &mut reported);
        Ok(true)
    }

    /// Completes a batch of successful deliveries, timed.
    async fn complete(&self, leases: &[S::Lease]) -> Result<Vec<bool>> {
        let started = Instant::now();
        let completed = self.store.complete(leases, self.now()).await;
        self.metrics.operation(
            Operation::Settle,
            started.elapsed().as_secs_f64(),
            completed.is_err(),
        );
        completed
    }

    /// One claim, its handlers run concurrently, successes completed in one call.
    pub(crate) async fn run_once(&self) -> Result<RunReport> {
        let runs = self.run_batch().await?;
        let completed = runs.iter().filter(|run| run.succeeded()).count();
        Ok(RunReport {
            claimed: runs.len(),
            completed,
            other: runs.len() - completed,
        })
    }

    /// Deletes what the retention settings let go.
    pub(crate) async fn purge(&self, retention: Retention) -> Result<Purged> {
        let now = self.now();
        let before = |keep: Duration| now.saturating_sub(keep);
        let options = PurgeOptions::new()
            .completed_before(before(retention.completed))
            .dead_before(before(retention.dead));
        self.store.purge(&options).await
    }
}

/// The running dispatcher of a bus.
#[derive(Debug)]
pub(crate) struct Handle {
    cancel: CancellationToken,
    task: tokio::task::JoinHandle<()>,
}

impl Handle {
    /// Starts the dispatch loop in the background.
    pub(crate) fn spawn<S: Store>(shared: Arc<Shared<S>>) -> Self {
        let cancel = CancellationToken::new();
        let span = info_span!("relaybus.dispatcher", owner = %shared.settings.owner);
        let task = tokio::spawn(dispatch(shared, cancel.clone()).instrument(span));
        Handle { cancel, task }
    }

    /// Stops claiming, lets running handlers finish within the shutdown timeout, gives back the
    /// rest and every lane, and waits until all that is done.
    pub(crate) async fn stop(self) {
        self.cancel.cancel();
        if let Err(error) = self.task.await {
            warn!(%error, "the dispatcher task ended abnormally");
        }
    }
}

/// The handler slots runs leave to single deliveries: `concurrency / RUN_FREE_SLOTS`.
const RUN_FREE_SLOTS: usize = 4;

/// The dispatch loop.
async fn dispatch<S: Store>(shared: Arc<Shared<S>>, cancel: CancellationToken) {
    let settings = shared.settings.clone();
    let notify = Arc::new(Notify::new());
    let semaphore = Arc::new(Semaphore::new(settings.concurrency));
    // Places for deliveries claimed ahead of a free slot: one batch.
    let ahead = Arc::new(Semaphore::new(if settings.claim_ahead {
        settings.batch_size as usize
    } else {
        0
    }));
    let tracker = TaskTracker::new();
    let background = CancellationToken::new();
    let (done, completions) = mpsc::unbounded_channel::<Completion<S::Lease>>();
    let completer = tokio::spawn(complete_batches(
        Arc::clone(&shared),
        completions,
        Arc::clone(&notify),
    ));
    let renewer = tokio::spawn(renew_leases(Arc::clone(&shared), background.clone()));
    let waker = settings.change_stream.then(|| {
        tokio::spawn(wake::watch(
            Arc::clone(&shared),
            Arc::clone(&notify),
            background.clone(),
        ))
    });
    let purger = settings.retention.map(|retention| {
        tokio::spawn(purge_periodically(
            Arc::clone(&shared),
            retention,
            background.clone(),
        ))
    });
    let sampler = settings.gauge_interval.map(|interval| {
        tokio::spawn(sample_periodically(
            Arc::clone(&shared),
            interval,
            background.clone(),
        ))
    });
    info!(handlers = ?shared.handler_ids, "dispatcher started");

    let starter = Starter {
        shared: Arc::clone(&shared),
        tracker: tracker.clone(),
        done,
        wake: Arc::clone(&notify),
        stopping: cancel.clone(),
    };
    let beside_stop = CancellationToken::new();
    let beside = tokio::spawn(claim_beside_loop(
        starter.clone(),
        Arc::clone(&semaphore),
        beside_stop.clone(),
    ));
    let mut pacer = Pacer {
        pace: &shared.pace,
        gathered: settings.busy_wake_ups,
        busy_since: None,
    };
    while !cancel.is_cancelled() && !shared.handler_ids.is_empty() {
        // While handlers finish quickly, the next claim runs while they do: it may take a
        // batch beyond the free slots, which waits for slots in the bus.
        let ahead_free = if shared.may_claim_ahead() {
            ahead.available_permits()
        } else {
            0
        };
        let available = semaphore.available_permits() + ahead_free;
        if available == 0 {
            tokio::select! {
                _ = cancel.cancelled() => break,
                permit = Arc::clone(&semaphore).acquire_owned() => drop(permit),
            }
            continue;
        }
        // A run holds its slot until its last delivery: a quarter of the slots is kept for
        // single deliveries, which free their slots at once, so that the bus still claims often
        // enough for a new key's delivery not to wait behind the runs. Runs take free slots
        // only, never places claimed ahead.
        let kept = settings.concurrency / RUN_FREE_SLOTS;
        let with_runs = semaphore.available_permits().saturating_sub(kept) as u32;
        let want = available.min(settings.batch_size as usize) as u32;
        shared.claiming.store(true, Ordering::SeqCst);
        let batch = shared.claim(want, (settings.key_run, with_runs)).await;
        shared.claiming.store(false, Ordering::SeqCst);
        let batch = match batch {
            Ok(batch) => batch,
            Err(error) => {
                warn!(%error, "claim failed; trying again after the poll interval");
                tokio::select! {
                    _ = cancel.cancelled() => break,
                    _ = tokio::time::sleep(settings.poll_interval) => {}
                }
                continue;
            }
        };
        // A claim that found something may have left more behind (lanes another worker took
        // first, deliveries not yet due when it looked): claim again at once, and wait for a
        // wake-up or the poll interval only after a claim that found nothing. Lanes this
        // worker holds are not left idle for a poll interval while they still have work.
        let found = !batch.is_empty();
        pacer.claimed(found);
        for run in runs(batch) {
            let seat = match Arc::clone(&semaphore).try_acquire_owned() {
                Ok(permit) => Seat::Slot(permit),
                Err(_) => match Arc::clone(&ahead).try_acquire_owned() {
                    Ok(place) => Seat::Ahead {
                        place,
                        slots: Arc::clone(&semaphore),
                    },
                    Err(_) => match Arc::clone(&semaphore).acquire_owned().await {
                        Ok(permit) => Seat::Slot(permit),
                        Err(_) => break,
                    },
                },
            };
            starter.start(run, seat);
        }
        if found {
            continue;
        }
        tokio::select! {
            _ = cancel.cancelled() => break,
            _ = notify.notified() => {}
            _ = tokio::time::sleep(settings.poll_interval) => {}
        }
    }
    // The claims beside the loop's end first: what they claim runs under the tracker.
    beside_stop.cancel();
    if let Err(error) = beside.await {
        warn!(%error, "the task claiming beside the claims ended abnormally");
    }
    drop(starter);

    // Shutdown: no more claims; running handlers get the shutdown timeout to finish.
    tracker.close();
    if tokio::time::timeout(settings.shutdown_timeout, tracker.wait())
        .await
        .is_err()
    {
        let aborted: Vec<AbortHandle> = shared
            .running()
            .values()
            .filter_map(|r| r.abort.clone())
            .collect();
        warn!(
            unfinished = aborted.len(),
            "handlers still running at the shutdown deadline; stopping them and releasing their deliveries"
        );
        for handle in aborted {
            handle.abort();
        }
        tracker.wait().await;
    }
    if let Err(error) = completer.await {
        warn!(%error, "the completion task ended abnormally");
    }
    background.cancel();
    for task in [Some(renewer), waker, purger, sampler]
        .into_iter()
        .flatten()
    {
        let _ = task.await;
    }
    let unfinished: Vec<S::Lease> = shared
        .running()
        .drain()
        .map(|(_, running)| running.lease)
        .collect();
    let released = unfinished.len();
    join_all(unfinished.iter().map(|lease| run::release(&shared, lease))).await;
    match shared.store.relinquish(&settings.owner).await {
        Ok(lanes) => info!(released, lanes, "dispatcher stopped; lanes handed back"),
        Err(error) => {
            warn!(%error, "could not hand the lanes back; they free up when their leases end")
        }
    }
}

/// Sets the pace of the wake-ups from what the dispatch loop's claims find: gathered once the
/// loop has claimed without a pause for [`BUSY_BEFORE_GATHERING`], eager from its first claim
/// that finds nothing.
struct Pacer<'a> {
    pace: &'a tokio::sync::watch::Sender<WakePace>,
    /// How often gathered wake-ups are read; `None`: never gathered.
    gathered: Option<Duration>,
    /// When the claims began to find something every time.
    busy_since: Option<tokio::time::Instant>,
}

impl Pacer<'_> {
    /// Takes in whether a claim found something.
    fn claimed(&mut self, found: bool) {
        let Some(interval) = self.gathered else {
            return;
        };
        let pace = if found {
            let since = *self
                .busy_since
                .get_or_insert_with(tokio::time::Instant::now);
            if since.elapsed() >= BUSY_BEFORE_GATHERING {
                WakePace::Gathered(interval)
            } else {
                WakePace::Eager
            }
        } else {
            self.busy_since = None;
            WakePace::Eager
        };
        self.pace.send_if_modified(|current| {
            let changed = *current != pace;
            if changed {
                debug!(?pace, "wake-up pace");
            }
            *current = pace;
            changed
        });
    }
}

/// A claimed delivery's right to run: a handler slot, or a place among the deliveries claimed
/// ahead, which waits for a slot.
enum Seat {
    Slot(tokio::sync::OwnedSemaphorePermit),
    Ahead {
        place: tokio::sync::OwnedSemaphorePermit,
        slots: Arc<Semaphore>,
    },
}

/// Starts the tasks that run claimed deliveries.
struct Starter<S: Store> {
    shared: Arc<Shared<S>>,
    tracker: TaskTracker,
    /// Where succeeded deliveries go to be completed in batches.
    done: mpsc::UnboundedSender<Completion<S::Lease>>,
    /// Wakes the dispatch loop (a keyed delivery settled).
    wake: Arc<Notify>,
    /// The dispatcher is stopping.
    stopping: CancellationToken,
}

impl<S: Store> Clone for Starter<S> {
    fn clone(&self) -> Self {
        Starter {
            shared: Arc::clone(&self.shared),
            tracker: self.tracker.clone(),
            done: self.done.clone(),
            wake: Arc::clone(&self.wake),
            stopping: self.stopping.clone(),
        }
    }
}

impl<S: Store> Starter<S> {
    /// Runs `run` (one delivery, or a run of one key's deliveries in sequence order) in a task
    /// of its own, on `seat` (waiting for a slot first if it has a place among those claimed
    /// ahead): each handler and its settlement, the next delivery of a run only once its
    /// predecessor's completion is durable, and the key's next deliveries the task may claim
    /// after a transactional completion. When a delivery of a run does not complete, the rest
    /// of the run is given back uncharged.
    fn start(&self, run: Vec<Claimed<S::Lease>>, seat: Seat) {
        let shared = &self.shared;
        let mut run = VecDeque::from(run);
        let Some(first) = run.pop_front() else {
            return;
        };
        let transactional = shared
            .subscriptions
            .get(&first.handler)
            .is_some_and(|s| s.transactional);
        let waits = matches!(seat, Seat::Ahead { .. });
        // The rest of a run waits in the running set with the first: renewed with the lane of
        // the one that runs (unless that one runs a transaction on it), given back at shutdown.
        let ids: Vec<_> = std::iter::once(&first)
            .chain(&run)
            .map(|delivery| delivery.lease.delivery_id())
            .collect();
        {
            let mut running = shared.running();
            for delivery in std::iter::once(&first).chain(&run) {
                running.insert(
                    delivery.lease.delivery_id(),
                    Running {
                        lease: delivery.lease.clone(),
                        // No transaction is open while it waits: its lanes are renewed
                        // meanwhile.
                        transactional: transactional && !waits,
                        abort: None,
                    },
                );
            }
        }
        let task_ids = ids.clone();
        let task_shared = Arc::clone(shared);
        let done = self.done.clone();
        let wake = Arc::clone(&self.wake);
        let stopping = self.stopping.clone();
        let handle = self.tracker.spawn(async move {
            let permit = match seat {
                Seat::Slot(permit) => permit,
                Seat::Ahead { place, slots } => {
                    let permit = tokio::select! {
                        permit = slots.acquire_owned() => permit,
                        // Stopping: not run; the shutdown gives it back uncharged.
                        _ = stopping.cancelled() => return,
                    };
                    drop(place);
                    let Ok(permit) = permit else { return };
                    if transactional {
                        let mut running = task_shared.running();
                        for id in &task_ids {
                            if let Some(entry) = running.get_mut(id) {
                                entry.transactional = true;
                            }
                        }
                    }
                    permit
                }
            };
            let mut delivery = first;
            // The key's delivery this task completed last, before `delivery`, when `delivery`
            // was claimed as it committed.
            let mut finished = None;
            loop {
                let task_id = delivery.lease.delivery_id();
                // The next delivery of a key can be claimed only once this one is
                // settled: wake the loop then, rather than leaving the key to the poll
                // interval.
                let keyed = delivery.event.key().is_some();
                // The last of a run may claim the key's next delivery as it commits.
                let follow = if run.is_empty() {
                    follow_key(&task_shared, &delivery, finished.take())
                } else {
                    None
                };
                let lease = delivery.lease.clone();
                let started = Instant::now();
                let mut outcome = run_delivery(&task_shared, delivery, follow).await;
                // Each delivery's handler, not the task, whose run or chain takes many.
                task_shared.note_run(started.elapsed());
                if let Outcome::Completed(next) = &mut outcome
                    && let Some(next) = next.take()
                {
                    if stopping.is_cancelled() {
                        // Claimed as the dispatcher began to stop: given back, not run.
                        run::release(&task_shared, &next.lease).await;
                    } else {
                        // The key's next delivery runs in this task, on this permit.
                        let mut running = task_shared.running();
                        let abort = running.remove(&task_id).and_then(|r| r.abort);
                        running.insert(
                            next.lease.delivery_id(),
                            Running {
                                lease: next.lease.clone(),
                                transactional: true,
                                abort,
                            },
                        );
                        drop(running);
                        delivery = *next;
                        finished = Some(lease);
                        continue;
                    }
                }
                // Whether the run may go on, and whether the loop is woken now: a settled keyed
                // delivery may let the key's next one be claimed (the completer wakes it
                // after a batched completion).
                let (went_on, wake_now) = match outcome {
                    // The completer removes it from the running set once completed.
                    Outcome::Succeeded(lease) if run.is_empty() => {
                        if let Err(unsent) = done.send(Completion {
                            lease,
                            keyed,
                            durable: None,
                        }) {
                            task_shared.running().remove(&unsent.0.lease.delivery_id());
                        }
                        (false, false)
                    }
                    // The run goes on once the completion is durable.
                    Outcome::Succeeded(lease) => {
                        let (durable, completed) = oneshot::channel();
                        let durable = match done.send(Completion {
                            lease,
                            // The key's next delivery runs here: nothing to wake the loop for.
                            keyed: false,
                            durable: Some(durable),
                        }) {
                            Ok(()) => completed.await.unwrap_or(false),
                            Err(unsent) => {
                                task_shared.running().remove(&unsent.0.lease.delivery_id());
                                false
                            }
                        };
                        (durable, false)
                    }
                    Outcome::Completed(_) => {
                        task_shared.running().remove(&task_id);
                        (true, keyed && run.is_empty())
                    }
                    Outcome::Settled(_) => {
                        task_shared.running().remove(&task_id);
                        (false, keyed)
                    }
                };
                if wake_now {
                    wake.notify_one();
                }
                if stopping.is_cancelled() {
                    // The shutdown gives back what is left of the run.
                    break;
                }
                match run.pop_front() {
                    // Its entry in the running set has the task's abort handle already.
                    Some(next) if went_on => delivery = next,
                    Some(next) => {
                        // Not completed: none of the key's later deliveries may run before it.
                        run.push_front(next);
                        give_back(&task_shared, run.drain(..)).await;
                        wake.notify_one();
                        break;
                    }
                    None => break,
                }
            }
            drop(permit);
        });
        let mut running = shared.running();
        for id in &ids {
            if let Some(entry) = running.get_mut(id) {
                entry.abort = Some(handle.abort_handle());
            }
        }
    }
}

/// Gives back, uncharged, the deliveries of a run that will not run now.
async fn give_back<S: Store>(shared: &Shared<S>, members: impl Iterator<Item = Claimed<S::Lease>>) {
    let leases: Vec<S::Lease> = members.map(|member| member.lease).collect();
    join_all(leases.iter().map(|lease| run::release(shared, lease))).await;
    let mut running = shared.running();
    for lease in &leases {
        running.remove(&lease.delivery_id());
    }
}

/// A succeeded delivery for the completer: its lease, whether it is keyed, and where to say
/// whether its completion is durable, for a run that waits for it.
struct Completion<L> {
    lease: L,
    keyed: bool,
    durable: Option<oneshot::Sender<bool>>,
}

/// A claimed batch as the tasks run it: the deliveries of one handler and key held to their
/// order together, in sequence order (a store that hands out runs gives several), each other
/// delivery alone; in the order of the batch.
fn runs<L>(batch: Vec<Claimed<L>>) -> Vec<Vec<Claimed<L>>> {
    crate::store::group_runs(
        batch,
        |delivery| {
            let key = delivery.event.key().filter(|_| delivery.ordered)?;
            Some((delivery.handler.as_str(), key))
        },
        |delivery| delivery.sequence,
    )
}

/// While the dispatch loop claims, claims what the wake-ups report beside its claim (a new
/// key's delivery need not wait for the claim in progress and the next one), as far as free
/// slots allow. Stops at `stop`, never in the middle of a claim.
async fn claim_beside_loop<S: Store>(
    starter: Starter<S>,
    semaphore: Arc<Semaphore>,
    stop: CancellationToken,
) {
    let shared = &starter.shared;
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = shared.arrived.notified() => {}
        }
        if !shared.claiming.load(Ordering::SeqCst) || starter.stopping.is_cancelled() {
            continue;
        }
        let limit = semaphore
            .available_permits()
            .min(shared.settings.batch_size as usize) as u32;
        for delivery in shared.claim_beside(limit).await {
            match Arc::clone(&semaphore).try_acquire_owned() {
                Ok(permit) if !starter.stopping.is_cancelled() => {
                    starter.start(vec![delivery], Seat::Slot(permit));
                }
                _ => {
                    // No slot left (the loop's claim took them) or stopping: give it back.
                    run::release(shared, &delivery.lease).await;
                }
            }
        }
    }
}

/// What a transactional delivery's task needs to claim the key's next delivery while the
/// delivery's completion commits (see [`ClaimShortcuts::claim_next_of_key`]).
#[derive(Debug)]
pub(crate) struct Follow<L> {
    handler: String,
    key: String,
    /// The key's delivery the task completed before this one.
    finished: Option<L>,
}

/// How the task of `delivery` follows its key: `None` for a delivery whose order does not
/// matter (unkeyed, or an unordered handler's) or whose handler does not complete in its
/// transaction. `finished`: the key's delivery the task completed before it.
fn follow_key<S: Store>(
    shared: &Shared<S>,
    delivery: &Claimed<S::Lease>,
    finished: Option<S::Lease>,
) -> Option<Follow<S::Lease>> {
    let key = delivery.event.key()?;
    let subscription = shared.subscriptions.get(&delivery.handler)?;
    (subscription.transactional && !subscription.unordered).then(|| Follow {
        handler: delivery.handler.clone(),
        key: key.to_owned(),
        finished,
    })
}

/// Claims the next delivery of the key of `completed`, whose completion commits meanwhile, if
/// the store can hand it out at once. A failure is logged: the next claim finds the delivery.
pub(crate) async fn claim_next<S: Store>(
    shared: &Shared<S>,
    completed: &S::Lease,
    follow: &Follow<S::Lease>,
) -> Option<Claimed<S::Lease>> {
    let settings = &shared.settings;
    let started = Instant::now();
    let next = shared
        .store
        .claim_next_of_key(NextOfKey {
            owner: &settings.owner,
            completed,
            committing: true,
            finished: follow.finished.as_ref(),
            handler: &follow.handler,
            key: &follow.key,
            lease_duration: settings.lease_duration,
            now: shared.now(),
        })
        .await;
    match next {
        Ok(Some(next)) => {
            shared
                .metrics
                .operation(Operation::Receive, started.elapsed().as_secs_f64(), false);
            if let Some(metrics) = shared.metrics.handler(&next.handler) {
                metrics.consumed.increment(1);
            }
            Some(next)
        }
        Ok(None) => None,
        Err(error) => {
            shared
                .metrics
                .operation(Operation::Receive, started.elapsed().as_secs_f64(), true);
            debug!(%error, "claiming the key's next delivery failed; the next claim finds it");
            None
        }
    }
}

/// Completes the deliveries whose handlers succeeded, batching those that finish close together;
/// tells the runs that wait for a completion whether it is durable.
async fn complete_batches<S: Store>(
    shared: Arc<Shared<S>>,
    mut completions: mpsc::UnboundedReceiver<Completion<S::Lease>>,
    wake: Arc<Notify>,
) {
    const MAX_BATCH: usize = 1_000;
    while let Some(first) = completions.recv().await {
        let mut keyed = first.keyed;
        let mut batch = vec![first.lease];
        let mut waiting = vec![first.durable];
        while batch.len() < MAX_BATCH {
            match completions.try_recv() {
                Ok(completion) => {
                    keyed |= completion.keyed;
                    batch.push(completion.lease);
                    waiting.push(completion.durable);
                }
                Err(_) => break,
            }
        }
        let span = info_span!("relaybus.complete", deliveries = batch.len());
        let completed = async {
            let mut attempt = 0;
            loop {
                attempt += 1;
                match shared.complete(&batch).await {
                    Ok(completed) => {
                        let lost = completed.iter().filter(|c| !**c).count();
                        if lost > 0 {
                            debug!(
                                lost,
                                "some completions could not be proven; those deliveries may run again"
                            );
                        }
                        break completed;
                    }
                    Err(error) if attempt < 3 => {
                        warn!(%error, attempt, "completion failed; trying again");
                        tokio::time::sleep(Duration::from_millis(100 * attempt)).await;
                    }
                    Err(error) => {
                        warn!(%error, "completion failed; the deliveries run again once their leases end");
                        break Vec::new();
                    }
                }
            }
        }
        .instrument(span)
        .await;
        {
            let mut running = shared.running();
            for lease in &batch {
                running.remove(&lease.delivery_id());
            }
        }
        for (at, durable) in waiting.into_iter().enumerate() {
            if let Some(durable) = durable {
                // A run that stopped waiting (its task was aborted) does not need the answer.
                let _ = durable.send(completed.get(at).copied().unwrap_or(false));
            }
        }
        if keyed {
            // Followers of these keys may be claimable now.
            wake.notify_one();
        }
    }
}

/// Extends, every third of the lease duration, the leases of the running non-transactional
/// handlers; the store renews what covers them (MongoDB: their lanes, each once). Transactional
/// handlers are not renewed: their completion must not conflict with a renewal.
async fn renew_leases<S: Store>(shared: Arc<Shared<S>>, cancel: CancellationToken) {
    let lease_duration = shared.settings.lease_duration;
    let period = (lease_duration / 3).max(Duration::from_millis(10));
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep(period) => {}
        }
        let leases: Vec<S::Lease> = shared
            .running()
            .values()
            .filter(|running| !running.transactional)
            .map(|running| running.lease.clone())
            .collect();
        if leases.is_empty() {
            continue;
        }
        match shared
            .store
            .renew(&leases, lease_duration, shared.now())
            .await
        {
            Ok(covered) if covered < leases.len() => debug!(
                running = leases.len(),
                covered, "some leases not renewed: their claims ended or changed hands"
            ),
            Ok(_) => {}
            Err(error) => warn!(%error, "renewing leases failed"),
        }
    }
}

/// Samples the delivery gauges on their interval.
async fn sample_periodically<S: Store>(
    shared: Arc<Shared<S>>,
    interval: Duration,
    cancel: CancellationToken,
) {
    loop {
        if let Err(error) = shared.sample_gauges(true).await {
            debug!(%error, "sampling the delivery gauges failed; trying again at the next interval");
        }
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep(interval) => {}
        }
    }
}

/// Purges on the retention interval.
async fn purge_periodically<S: Store>(
    shared: Arc<Shared<S>>,
    retention: Retention,
    cancel: CancellationToken,
) {
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep(retention.interval) => {}
        }
        match shared.purge(retention).await {
            Ok(purged) => debug!(?purged, "purged expired deliveries and events"),
            Err(error) => warn!(%error, "purge failed; trying again at the next interval"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{Arrival, MAX_ARRIVALS, MAX_REPORTED_LANES, Reported, Reports, WakeUp};
    use crate::{event::EventEnvelope, store::Claimed, time::Timestamp};

    /// A claimed delivery of `handler` whose lease is `id`.
    fn claimed(
        id: u32,
        handler: &str,
        key: Option<&str>,
        sequence: Option<i64>,
        ordered: bool,
    ) -> Claimed<u32> {
        let mut event = EventEnvelope::from_json("order.placed.v1", serde_json::json!({}))
            .unwrap()
            .with_id(format!("e-{id}"))
            .unwrap();
        if let Some(key) = key {
            event = event.with_key(key).unwrap();
        }
        Claimed {
            lease: id,
            lease_expires_at: Timestamp::EPOCH,
            handler: handler.to_owned(),
            attempt: 1,
            sequence,
            ordered,
            event,
        }
    }

    #[test]
    fn a_batch_runs_a_keys_ordered_deliveries_together_in_sequence_and_the_rest_alone() {
        let batch = vec![
            claimed(1, "h", Some("k"), Some(2), true),
            claimed(2, "h", None, None, false),
            claimed(3, "h", Some("k"), Some(1), true),
            // The same key of another handler is a run of its own.
            claimed(4, "g", Some("k"), Some(1), true),
            // Unordered deliveries of a key run apart, at once.
            claimed(5, "h", Some("u"), Some(1), false),
            claimed(6, "h", Some("u"), Some(2), false),
            claimed(7, "h", Some("k"), Some(3), true),
        ];
        let runs: Vec<Vec<u32>> = super::runs(batch)
            .into_iter()
            .map(|run| run.into_iter().map(|delivery| delivery.lease).collect())
            .collect();
        assert_eq!(
            runs,
            vec![vec![3, 1, 7], vec![2], vec![4], vec![5], vec![6]]
        );
    }

    fn at(lane: u32) -> WakeUp {
        WakeUp {
            at: Some(lane),
            arrival: None,
        }
    }

    fn lanes(reported: Reported) -> (Vec<u32>, bool) {
        (reported.lanes, reported.complete)
    }

    #[test]
    fn reports_are_complete_only_while_the_stream_is_open_and_drops_nothing() {
        let mut reports = Reports::default();
        reports.report(at(3));
        assert_eq!(lanes(reports.take()), (vec![3], false), "no stream open");
        reports.opened(true);
        reports.report(at(5));
        assert_eq!(
            lanes(reports.take()),
            (vec![5], false),
            "what was inserted before the stream opened was not reported"
        );
        reports.report(at(7));
        reports.report(at(7));
        assert_eq!(lanes(reports.take()), (vec![7], true));
        assert_eq!(
            lanes(reports.take()),
            (vec![], true),
            "nothing new, and that is known"
        );
        for lane in 0..=MAX_REPORTED_LANES as u32 {
            reports.report(at(lane));
        }
        let (lanes_seen, complete) = lanes(reports.take());
        assert_eq!(
            (lanes_seen.len(), complete),
            (MAX_REPORTED_LANES, false),
            "one dropped"
        );
        assert!(reports.take().complete);
        reports.opened(false);
        reports.report(at(9));
        assert_eq!(lanes(reports.take()), (vec![9], false), "the stream closed");
    }

    #[test]
    fn arrivals_are_passed_on_only_when_every_wake_up_told_one() {
        let arrival = |byte: u8| WakeUp {
            at: Some(u32::from(byte)),
            arrival: Some(Arrival::new(vec![byte])),
        };
        let mut reports = Reports::default();
        reports.report(arrival(1));
        assert!(reports.take().arrivals.is_empty(), "no stream open");
        reports.opened(true);
        reports.take();
        reports.report(arrival(1));
        reports.report(arrival(1));
        reports.report(arrival(2));
        let taken = reports.take();
        assert_eq!(
            taken.arrivals,
            vec![
                Arrival::new(vec![1]),
                Arrival::new(vec![1]),
                Arrival::new(vec![2])
            ],
            "each wake-up's, in order"
        );
        assert_eq!(taken.lanes, vec![1, 2]);
        reports.report(arrival(3));
        reports.report(at(4));
        let taken = reports.take();
        assert!(
            taken.arrivals.is_empty() && taken.complete,
            "one wake-up told nothing: none are passed on, the lanes still are"
        );
        reports.report(arrival(5));
        assert_eq!(
            reports.take().arrivals.len(),
            1,
            "the gap ends with the claim"
        );
        for _ in 0..=MAX_ARRIVALS {
            reports.report(arrival(6));
        }
        assert!(reports.take().arrivals.is_empty(), "too many to remember");
    }

    #[test]
    fn arrivals_are_offered_beside_a_claim_once_and_until_the_next_claim_begins() {
        let arrival = |byte: u8| WakeUp {
            at: Some(u32::from(byte)),
            arrival: Some(Arrival::new(vec![byte])),
        };
        let mut reports = Reports::default();
        reports.report(arrival(1));
        reports.report(WakeUp {
            at: Some(2),
            arrival: None,
        });
        reports.report(arrival(3));
        assert_eq!(
            reports.take_fresh(),
            vec![Arrival::new(vec![1]), Arrival::new(vec![3])],
            "whatever the stream's state, those that told their delivery"
        );
        assert!(reports.take_fresh().is_empty(), "offered once");
        reports.report(arrival(4));
        reports.take();
        assert!(
            reports.take_fresh().is_empty(),
            "the claim that begins takes them"
        );
        for _ in 0..=MAX_ARRIVALS {
            reports.report(arrival(5));
        }
        assert_eq!(reports.take_fresh().len(), MAX_ARRIVALS, "bounded");
    }
}
