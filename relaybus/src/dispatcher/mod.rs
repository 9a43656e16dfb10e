//! The dispatcher: claims batches of deliveries, runs their handlers, and settles them.

mod batch;
mod idle;
mod limits;
mod run;
mod wake;

use std::{
    collections::{HashMap, HashSet},
    sync::{
        Arc, Mutex as StdMutex,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use futures::future::join_all;
use tokio::{
    sync::{Notify, Semaphore, mpsc},
    task::AbortHandle,
};
use tokio_util::{sync::CancellationToken, task::TaskTracker};
use tracing::{Instrument, debug, info, info_span, warn};

use crate::{
    clock::Clock,
    error::Result,
    handler::{RetryPolicy, Subscription},
    state::StateMap,
    store::{ClaimRequest, Claimed, PurgeOptions, Purged, Queue, Store, StoreLease},
    telemetry::{self, BusMetrics, Operation},
    time::Timestamp,
};

pub(crate) use idle::IdleOptions;
pub use idle::{DEFAULT_MAX_RUNS, DeliveryRun, IdleReport, RunOutcome};
pub(crate) use run::{Outcome, run_delivery};

/// How often a started bus samples the delivery gauges by default.
pub(crate) const DEFAULT_GAUGE_INTERVAL: Duration = Duration::from_secs(15);

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
    pub(crate) concurrency: usize,
    pub(crate) lease_duration: Duration,
    pub(crate) poll_interval: Duration,
    pub(crate) retry: RetryPolicy,
    pub(crate) shutdown_timeout: Duration,
    pub(crate) setup_on_start: bool,
    pub(crate) change_stream: bool,
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
    /// The gates of the limited handlers, and the slots this bus holds.
    gates: limits::Gates,
    /// How long this bus's handlers took, on average (exponentially weighted, in µs; [`UNKNOWN`]
    /// before the first finished).
    handler_micros: AtomicU64,
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

/// The average handler run time up to which a busy bus claims ahead of its free slots.
const QUICK_HANDLER: Duration = Duration::from_millis(20);
/// No handler has finished yet.
const UNKNOWN: u64 = u64::MAX;

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
        let gates = limits::Gates::new(subscriptions_list, settings.concurrency);
        Shared {
            store,
            subscriptions,
            handler_ids,
            settings,
            metrics,
            gauges: StdMutex::new(HashSet::new()),
            running: StdMutex::new(HashMap::new()),
            gates,
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

    /// Claims up to `limit` deliveries.
    async fn claim(&self, limit: u32) -> Result<Vec<Claimed<S::Lease>>> {
        let settings = &self.settings;
        let span = info_span!("relaybus.claim", owner = %settings.owner, limit);
        async {
            let started = Instant::now();
            let batch = self
                .store
                .claim(ClaimRequest {
                    owner: &settings.owner,
                    handlers: &self.handler_ids,
                    limit,
                    lease_duration: settings.lease_duration,
                    now: self.now(),
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
            .dead_before(before(retention.dead))
            .request_keys_expired_at(now);
        self.store.purge(&options).await
    }
}

/// The running dispatcher of a bus.
#[derive(Debug)]
pub(crate) struct Handle {
    cancel: CancellationToken,
    task: tokio::task::JoinHandle<()>,
    /// Tasks beside the dispatch loop that stop with it (publishing scheduled ticks).
    others: Vec<tokio::task::JoinHandle<()>>,
}

impl Handle {
    /// Starts the dispatch loop in the background.
    pub(crate) fn spawn<S: Store>(shared: Arc<Shared<S>>) -> Self {
        let cancel = CancellationToken::new();
        let span = info_span!("relaybus.dispatcher", owner = %shared.settings.owner);
        let task = tokio::spawn(dispatch(shared, cancel.clone()).instrument(span));
        Handle {
            cancel,
            task,
            others: Vec::new(),
        }
    }

    /// The token that stops the dispatcher, for tasks that stop with it.
    pub(crate) fn token(&self) -> &CancellationToken {
        &self.cancel
    }

    /// A task that stops with the dispatcher (on its token) and that [`stop`](Self::stop)
    /// waits for.
    pub(crate) fn also(&mut self, task: tokio::task::JoinHandle<()>) {
        self.others.push(task);
    }

    /// Stops claiming, lets running handlers finish within the shutdown timeout, gives back the
    /// rest and every lane, and waits until all that is done.
    pub(crate) async fn stop(self) {
        self.cancel.cancel();
        if let Err(error) = self.task.await {
            warn!(%error, "the dispatcher task ended abnormally");
        }
        for task in self.others {
            if let Err(error) = task.await {
                warn!(%error, "a task of the dispatcher ended abnormally");
            }
        }
    }
}

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
    let mut gathering = Gathering::new(&shared);
    while !cancel.is_cancelled() && !shared.handler_ids.is_empty() {
        gathering.flush_due(&starter, &semaphore);
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
                _ = gathering.due() => {}
            }
            continue;
        }
        let want = available.min(settings.batch_size as usize) as u32;
        let batch = shared.claim(want).await;
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
        let mut found = false;
        for delivery in batch {
            if gathering.takes(&delivery.handler) {
                found = true;
                let gathered = tokio::select! {
                    _ = cancel.cancelled() => None,
                    gathered = gathering.gather(delivery, &starter, &semaphore) => Some(gathered),
                };
                if gathered.is_none() {
                    break;
                }
                continue;
            }
            if shared.gates.limits(&delivery.handler) {
                if shared.gates.enter(&delivery.handler) {
                    found = true;
                    starter.start(delivery, Seat::Gated(Arc::clone(&semaphore)));
                } else {
                    // The bus holds as many as the limit lets run: not one more.
                    if let Some(metrics) = shared.metrics.handler(&delivery.handler) {
                        metrics.limit_wait("bus");
                    }
                    run::release(&shared, &delivery.lease).await;
                }
                continue;
            }
            found = true;
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
            starter.start(delivery, seat);
        }
        if found {
            continue;
        }
        tokio::select! {
            _ = cancel.cancelled() => break,
            _ = notify.notified() => {}
            _ = tokio::time::sleep(settings.poll_interval) => {}
            _ = gathering.due() => {}
        }
    }
    // Deliveries still gathering never ran: the shutdown gives them back uncharged.
    drop(gathering);
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
    shared.give_back_all().await;
    match shared.store.relinquish(&settings.owner).await {
        Ok(lanes) => info!(released, lanes, "dispatcher stopped; lanes handed back"),
        Err(error) => {
            warn!(%error, "could not hand the lanes back; they free up when their leases end")
        }
    }
}

/// A claimed delivery's right to run: a handler slot, or a place among the deliveries claimed
/// ahead, which waits for a slot.
enum Seat {
    Slot(tokio::sync::OwnedSemaphorePermit),
    /// A delivery of a limited handler: it passes its gate first, then waits for a slot.
    Gated(Arc<Semaphore>),
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
    /// Runs `delivery` in a task of its own, on `seat` (waiting for a slot first if it has a
    /// place among those claimed ahead): its handler and its settlement.
    fn start(&self, delivery: Claimed<S::Lease>, seat: Seat) {
        let shared = &self.shared;
        let transactional = shared
            .subscriptions
            .get(&delivery.handler)
            .is_some_and(|s| s.transactional);
        let waits = matches!(seat, Seat::Ahead { .. } | Seat::Gated(_));
        let id = delivery.lease.delivery_id();
        shared.running().insert(
            id.clone(),
            Running {
                lease: delivery.lease.clone(),
                // No transaction is open while it waits: its lane is renewed meanwhile.
                transactional: transactional && !waits,
                abort: None,
            },
        );
        let task_id = id.clone();
        let task_shared = Arc::clone(shared);
        let done = self.done.clone();
        let wake = Arc::clone(&self.wake);
        let stopping = self.stopping.clone();
        let handle = self.tracker.spawn(async move {
            let handler = delivery.handler.clone();
            let mut admission = None;
            let permit = match seat {
                Seat::Slot(permit) => permit,
                Seat::Gated(slots) => {
                    let partition = task_shared
                        .gates
                        .partition(&handler, delivery.event.payload());
                    let Some(admitted) = task_shared.admit(&handler, partition, &stopping).await
                    else {
                        // Stopping: not run; the shutdown gives it back uncharged.
                        task_shared.gates.leave(&handler);
                        return;
                    };
                    let permit = tokio::select! {
                        permit = slots.acquire_owned() => permit.ok(),
                        _ = stopping.cancelled() => None,
                    };
                    let Some(permit) = permit else {
                        task_shared.give_back(&handler, admitted).await;
                        task_shared.gates.leave(&handler);
                        return;
                    };
                    admission = Some(admitted);
                    if transactional && let Some(entry) = task_shared.running().get_mut(&task_id) {
                        entry.transactional = true;
                    }
                    permit
                }
                Seat::Ahead { place, slots } => {
                    let permit = tokio::select! {
                        permit = slots.acquire_owned() => permit,
                        // Stopping: not run; the shutdown gives it back uncharged.
                        _ = stopping.cancelled() => return,
                    };
                    drop(place);
                    let Ok(permit) = permit else { return };
                    if transactional && let Some(entry) = task_shared.running().get_mut(&task_id) {
                        entry.transactional = true;
                    }
                    permit
                }
            };
            // The next delivery of a key can be claimed only once this one is settled: wake the
            // loop then, rather than leaving the key to the poll interval.
            let keyed = delivery.event.key().is_some();
            let started = Instant::now();
            let outcome = run_delivery(&task_shared, delivery).await;
            task_shared.note_run(started.elapsed());
            if let Some(admission) = admission {
                task_shared.give_back(&handler, admission).await;
                task_shared.gates.leave(&handler);
            }
            match outcome {
                // The completer removes it from the running set once completed, and wakes the
                // loop for a keyed one.
                Outcome::Succeeded(lease) => {
                    if let Err(unsent) = done.send(Completion { lease, keyed }) {
                        task_shared.running().remove(&unsent.0.lease.delivery_id());
                    }
                }
                Outcome::Completed | Outcome::Settled(_) => {
                    task_shared.running().remove(&task_id);
                    if keyed {
                        wake.notify_one();
                    }
                }
            }
            drop(permit);
        });
        if let Some(entry) = shared.running().get_mut(&id) {
            entry.abort = Some(handle.abort_handle());
        }
    }
}

/// The batches of the bus's batch handlers being gathered: claimed deliveries wait here until
/// their handler's batch is full or its wait since its first delivery has passed. Each
/// batch handler has room for two batches (one running, one gathering); a full room holds the
/// dispatch loop until a batch ends, as full handler slots do.
struct Gathering<L> {
    batches: HashMap<String, Gathered<L>>,
}

struct Gathered<L> {
    max: usize,
    wait: Duration,
    room: Arc<Semaphore>,
    deliveries: Vec<Claimed<L>>,
    places: Vec<tokio::sync::OwnedSemaphorePermit>,
    /// When the batch gathering now goes, full or not.
    due: Option<tokio::time::Instant>,
}

impl<L: crate::store::StoreLease> Gathering<L> {
    fn new<S: Store<Lease = L>>(shared: &Shared<S>) -> Self {
        let batches = shared
            .subscriptions
            .values()
            .filter_map(|s| {
                let spec = s.batch.as_ref()?;
                let gathered = Gathered {
                    max: spec.max,
                    wait: spec.wait,
                    room: Arc::new(Semaphore::new(spec.max * 2)),
                    deliveries: Vec::new(),
                    places: Vec::new(),
                    due: None,
                };
                Some((s.id.clone(), gathered))
            })
            .collect();
        Gathering { batches }
    }

    /// Whether `handler` takes batches.
    fn takes(&self, handler: &str) -> bool {
        self.batches.contains_key(handler)
    }

    /// Adds a claimed delivery to its handler's batch, waiting for room first; starts the batch
    /// once full.
    async fn gather<S: Store<Lease = L>>(
        &mut self,
        delivery: Claimed<L>,
        starter: &Starter<S>,
        slots: &Arc<Semaphore>,
    ) {
        let handler = delivery.handler.clone();
        let Some(gathered) = self.batches.get_mut(&handler) else {
            return;
        };
        // A claim may hand out a delivery that already gathers (under faults, a claim can
        // return one twice). A batch holds each delivery once: a transactional batch that
        // held one twice would write its effects twice and complete it once. The later copy
        // is the current claim.
        let id = delivery.lease.delivery_id();
        if let Some(gathering) = gathered
            .deliveries
            .iter_mut()
            .find(|gathering| gathering.lease.delivery_id() == id)
        {
            warn!(
                handler,
                "a claim handed out a delivery that already gathers; the batch holds it once"
            );
            if let Some(running) = starter.shared.running().get_mut(&id) {
                running.lease = delivery.lease.clone();
            }
            *gathering = delivery;
            return;
        }
        let place = match Arc::clone(&gathered.room).try_acquire_owned() {
            Ok(place) => place,
            Err(_) => {
                // No room: what gathers goes now, then wait for a running batch to end.
                Self::start(&handler, gathered, starter, slots);
                match Arc::clone(&gathered.room).acquire_owned().await {
                    Ok(place) => place,
                    Err(_) => return,
                }
            }
        };
        starter.shared.running().insert(
            delivery.lease.delivery_id(),
            Running {
                lease: delivery.lease.clone(),
                // No transaction is open while it gathers: its lease is renewed meanwhile.
                transactional: false,
                abort: None,
            },
        );
        gathered.deliveries.push(delivery);
        gathered.places.push(place);
        if gathered.due.is_none() {
            gathered.due = Some(tokio::time::Instant::now() + gathered.wait);
        }
        if gathered.deliveries.len() >= gathered.max {
            Self::start(&handler, gathered, starter, slots);
        }
    }

    /// Starts the batches whose wait has passed.
    fn flush_due<S: Store<Lease = L>>(&mut self, starter: &Starter<S>, slots: &Arc<Semaphore>) {
        let now = tokio::time::Instant::now();
        for (handler, gathered) in &mut self.batches {
            if gathered.due.is_some_and(|due| due <= now) {
                Self::start(handler, gathered, starter, slots);
            }
        }
    }

    /// Resolves when a batch's wait has passed (never while none gathers). Cancel safe.
    async fn due(&self) {
        match self.batches.values().filter_map(|g| g.due).min() {
            Some(due) => tokio::time::sleep_until(due).await,
            None => std::future::pending().await,
        }
    }

    fn start<S: Store<Lease = L>>(
        handler: &str,
        gathered: &mut Gathered<L>,
        starter: &Starter<S>,
        slots: &Arc<Semaphore>,
    ) {
        gathered.due = None;
        if gathered.deliveries.is_empty() {
            return;
        }
        let deliveries = std::mem::take(&mut gathered.deliveries);
        let places = std::mem::take(&mut gathered.places);
        starter.start_batch(handler, deliveries, places, Arc::clone(slots));
    }
}

impl<S: Store> Starter<S> {
    /// Runs a gathered batch in a task of its own, on one handler slot: its handler and the
    /// settlement of each delivery.
    fn start_batch(
        &self,
        handler: &str,
        deliveries: Vec<Claimed<S::Lease>>,
        places: Vec<tokio::sync::OwnedSemaphorePermit>,
        slots: Arc<Semaphore>,
    ) {
        let Some(subscription) = self.shared.subscriptions.get(handler).cloned() else {
            return;
        };
        let ids: Vec<_> = deliveries.iter().map(|d| d.lease.delivery_id()).collect();
        let shared = Arc::clone(&self.shared);
        let done = self.done.clone();
        let wake = Arc::clone(&self.wake);
        let stopping = self.stopping.clone();
        let task_ids = ids.clone();
        let handle = self.tracker.spawn(async move {
            let permit = tokio::select! {
                permit = slots.acquire_owned() => permit.ok(),
                // Stopping: not run; the shutdown gives the batch back uncharged.
                _ = stopping.cancelled() => None,
            };
            let Some(permit) = permit else { return };
            if subscription.transactional {
                let mut running = shared.running();
                for id in &task_ids {
                    if let Some(entry) = running.get_mut(id) {
                        entry.transactional = true;
                    }
                }
            }
            let keyed = deliveries.iter().any(|d| d.event.key().is_some());
            let started = Instant::now();
            let outcomes = batch::run_batch_deliveries(&shared, &subscription, &deliveries).await;
            shared.note_run(started.elapsed());
            for (outcome, id) in outcomes.into_iter().zip(&task_ids) {
                match outcome {
                    Outcome::Succeeded(lease) => {
                        if let Err(unsent) = done.send(Completion { lease, keyed }) {
                            shared.running().remove(&unsent.0.lease.delivery_id());
                        }
                    }
                    Outcome::Completed | Outcome::Settled(_) => {
                        shared.running().remove(id);
                    }
                }
            }
            if keyed {
                wake.notify_one();
            }
            drop(permit);
            drop(places);
        });
        let mut running = self.shared.running();
        for id in &ids {
            if let Some(entry) = running.get_mut(id) {
                entry.abort = Some(handle.abort_handle());
            }
        }
    }
}

/// A succeeded delivery for the completer: its lease, and whether it is keyed.
struct Completion<L> {
    lease: L,
    keyed: bool,
}

/// Completes the deliveries whose handlers succeeded, batching those that finish close together.
async fn complete_batches<S: Store>(
    shared: Arc<Shared<S>>,
    mut completions: mpsc::UnboundedReceiver<Completion<S::Lease>>,
    wake: Arc<Notify>,
) {
    const MAX_BATCH: usize = 1_000;
    while let Some(first) = completions.recv().await {
        let mut keyed = first.keyed;
        let mut batch = vec![first.lease];
        while batch.len() < MAX_BATCH {
            match completions.try_recv() {
                Ok(completion) => {
                    keyed |= completion.keyed;
                    batch.push(completion.lease);
                }
                Err(_) => break,
            }
        }
        let span = info_span!("relaybus.complete", deliveries = batch.len());
        async {
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
                        break;
                    }
                    Err(error) if attempt < 3 => {
                        warn!(%error, attempt, "completion failed; trying again");
                        tokio::time::sleep(Duration::from_millis(100 * attempt)).await;
                    }
                    Err(error) => {
                        warn!(%error, "completion failed; the deliveries run again once their leases end");
                        break;
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
        shared.renew_slots().await;
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
