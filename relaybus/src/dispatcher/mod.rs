//! The dispatcher: claims batches of deliveries, runs their handlers, and settles them.
//!
//! This module holds what the dispatcher's tasks share ([`Shared`]) and the handle of a running
//! dispatcher. The loop that claims is in `claim_loop`; it seats each delivery and starts its
//! task (`starter`), gathers the deliveries of batch handlers (`gather`), and hands successes
//! to the completer (`completion`). Leases, gauges and purges are kept up beside it (`upkeep`).

mod batch;
mod claim_loop;
mod completion;
mod gather;
mod idle;
mod limits;
mod run;
mod starter;
mod upkeep;
mod wake;

use std::{
    collections::{HashMap, HashSet},
    sync::{
        Arc, Mutex as StdMutex,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use tokio::task::AbortHandle;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, debug, info_span, warn};

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
        let task = tokio::spawn(claim_loop::dispatch(shared, cancel.clone()).instrument(span));
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
