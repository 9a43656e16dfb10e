//! The dispatcher: claims batches of deliveries, runs their handlers, and settles them.

mod run;
mod wake;

use std::{
    collections::HashMap,
    sync::{Arc, Mutex as StdMutex},
    time::Duration,
};

use futures::future::join_all;
use mongodb::bson::{DateTime, oid::ObjectId};
use tokio::{
    sync::{Notify, Semaphore, mpsc},
    task::AbortHandle,
};
use tokio_util::{sync::CancellationToken, task::TaskTracker};
use tracing::{Instrument, debug, info, info_span, warn};

use crate::{
    error::Result,
    handler::{RetryPolicy, Subscription},
    store::mongo::{Lease, MongoEventStore, PurgeOptions, Purged},
};

pub(crate) use run::{Outcome, run_delivery};

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
    pub(crate) retention: Option<Retention>,
}

/// A delivery a task of this bus is running.
#[derive(Debug)]
struct Running {
    lease: Lease,
    transactional: bool,
    abort: Option<AbortHandle>,
}

/// What the dispatcher's tasks share.
pub(crate) struct Shared {
    pub(crate) store: MongoEventStore,
    pub(crate) subscriptions: HashMap<String, Subscription>,
    pub(crate) handler_ids: Vec<String>,
    pub(crate) settings: Settings,
    running: StdMutex<HashMap<ObjectId, Running>>,
    /// Lanes the change stream reported new deliveries in since the last claim.
    reported: StdMutex<Vec<i32>>,
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared")
            .field("settings", &self.settings)
            .field("handler_ids", &self.handler_ids)
            .finish_non_exhaustive()
    }
}

/// The most reported lanes remembered between two claims.
const MAX_REPORTED_LANES: usize = 64;

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

impl Shared {
    pub(crate) fn new(
        store: MongoEventStore,
        subscriptions: &[Subscription],
        settings: Settings,
    ) -> Self {
        let handler_ids = subscriptions.iter().map(|s| s.id.clone()).collect();
        let subscriptions = subscriptions
            .iter()
            .map(|s| (s.id.clone(), s.clone()))
            .collect();
        Shared {
            store,
            subscriptions,
            handler_ids,
            settings,
            running: StdMutex::new(HashMap::new()),
            reported: StdMutex::new(Vec::new()),
        }
    }

    fn running(&self) -> std::sync::MutexGuard<'_, HashMap<ObjectId, Running>> {
        // A panic while holding this lock cannot leave the map inconsistent: recover it.
        self.running.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Remembers a lane the change stream reported a new delivery in.
    pub(super) fn report_lane(&self, lane: i32) {
        let mut reported = self.reported.lock().unwrap_or_else(|e| e.into_inner());
        if reported.len() < MAX_REPORTED_LANES && !reported.contains(&lane) {
            reported.push(lane);
        }
    }

    /// The lanes reported since the last call.
    fn take_reported(&self) -> Vec<i32> {
        std::mem::take(&mut *self.reported.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// Claims up to `limit` deliveries. `after_wait`: the loop waited idle before this claim,
    /// so the lanes the change stream reported meanwhile hold the only new work and are looked
    /// at first.
    async fn claim(
        &self,
        limit: u32,
        after_wait: bool,
    ) -> Result<Vec<crate::store::mongo::ClaimedDelivery>> {
        let settings = &self.settings;
        let span = info_span!("relaybus.claim", owner = %settings.owner, limit);
        let reported = self.take_reported();
        async {
            if after_wait && !reported.is_empty() {
                self.store.hint_lanes(&settings.owner, reported).await;
            }
            let batch = self
                .store
                .claim(
                    &settings.owner,
                    &self.handler_ids,
                    limit,
                    settings.lease_duration,
                    DateTime::now(),
                )
                .await?;
            if !batch.is_empty() {
                debug!(claimed = batch.len(), "claimed deliveries");
            }
            Ok(batch)
        }
        .instrument(span)
        .await
    }

    /// One claim, its handlers run concurrently, successes completed in one call.
    pub(crate) async fn run_once(&self) -> Result<RunReport> {
        if self.handler_ids.is_empty() {
            return Ok(RunReport::default());
        }
        let claimed = self.claim(self.settings.batch_size, false).await?;
        let mut report = RunReport {
            claimed: claimed.len(),
            ..RunReport::default()
        };
        let outcomes = join_all(claimed.into_iter().map(|d| run_delivery(self, d))).await;
        let leases: Vec<Lease> = outcomes
            .into_iter()
            .filter_map(|outcome| match outcome {
                Outcome::Succeeded(lease) => Some(lease),
                Outcome::Settled => None,
            })
            .collect();
        report.other = report.claimed - leases.len();
        if !leases.is_empty() {
            let completed = self.store.complete_many(&leases, DateTime::now()).await?;
            report.completed = completed.iter().filter(|c| **c).count();
            report.other += leases.len() - report.completed;
        }
        Ok(report)
    }

    /// Deletes what the retention settings let go.
    pub(crate) async fn purge(&self, retention: Retention) -> Result<Purged> {
        let now = DateTime::now().timestamp_millis();
        let before = |keep: Duration| {
            DateTime::from_millis(now.saturating_sub(keep.as_millis().min(i64::MAX as u128) as i64))
        };
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
    pub(crate) fn spawn(shared: Arc<Shared>) -> Self {
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

/// The dispatch loop.
async fn dispatch(shared: Arc<Shared>, cancel: CancellationToken) {
    let settings = shared.settings.clone();
    let notify = Arc::new(Notify::new());
    let semaphore = Arc::new(Semaphore::new(settings.concurrency));
    let tracker = TaskTracker::new();
    let background = CancellationToken::new();
    let (done, completions) = mpsc::unbounded_channel::<(Lease, bool)>();
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
    info!(handlers = ?shared.handler_ids, "dispatcher started");

    let mut after_wait = false;
    while !cancel.is_cancelled() && !shared.handler_ids.is_empty() {
        let available = semaphore.available_permits();
        if available == 0 {
            tokio::select! {
                _ = cancel.cancelled() => break,
                permit = Arc::clone(&semaphore).acquire_owned() => drop(permit),
            }
            continue;
        }
        let want = available.min(settings.batch_size as usize) as u32;
        let batch = match shared.claim(want, std::mem::take(&mut after_wait)).await {
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
        for delivery in batch {
            let permit = match Arc::clone(&semaphore).try_acquire_owned() {
                Ok(permit) => permit,
                Err(_) => match Arc::clone(&semaphore).acquire_owned().await {
                    Ok(permit) => permit,
                    Err(_) => break,
                },
            };
            let id = delivery.delivery_id();
            let transactional = shared
                .subscriptions
                .get(delivery.handler())
                .is_some_and(|s| s.transactional);
            shared.running().insert(
                id,
                Running {
                    lease: *delivery.lease(),
                    transactional,
                    abort: None,
                },
            );
            let task_shared = Arc::clone(&shared);
            let done = done.clone();
            // The next delivery of a key can be claimed only once this one is settled: wake
            // the loop then, rather than leaving the key to the poll interval.
            let keyed = delivery.key().is_some();
            let wake = Arc::clone(&notify);
            let handle = tracker.spawn(async move {
                match run_delivery(&task_shared, delivery).await {
                    // The completer removes it from the running set once completed.
                    Outcome::Succeeded(lease) => {
                        if let Err(unsent) = done.send((lease, keyed)) {
                            task_shared.running().remove(&unsent.0.0.delivery_id());
                        }
                    }
                    Outcome::Settled => {
                        task_shared.running().remove(&id);
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
        if found {
            continue;
        }
        tokio::select! {
            _ = cancel.cancelled() => break,
            _ = notify.notified() => {}
            _ = tokio::time::sleep(settings.poll_interval) => {}
        }
        after_wait = true;
    }

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
    drop(done);
    if let Err(error) = completer.await {
        warn!(%error, "the completion task ended abnormally");
    }
    background.cancel();
    for task in [Some(renewer), waker, purger].into_iter().flatten() {
        let _ = task.await;
    }
    let unfinished: Vec<Lease> = shared
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

/// Completes the deliveries whose handlers succeeded, batching those that finish close together.
async fn complete_batches(
    shared: Arc<Shared>,
    mut completions: mpsc::UnboundedReceiver<(Lease, bool)>,
    wake: Arc<Notify>,
) {
    const MAX_BATCH: usize = 1_000;
    while let Some((first, first_keyed)) = completions.recv().await {
        let mut batch = vec![first];
        let mut keyed = first_keyed;
        while batch.len() < MAX_BATCH {
            match completions.try_recv() {
                Ok((lease, is_keyed)) => {
                    batch.push(lease);
                    keyed |= is_keyed;
                }
                Err(_) => break,
            }
        }
        let span = info_span!("relaybus.complete", deliveries = batch.len());
        async {
            let mut attempt = 0;
            loop {
                attempt += 1;
                match shared.store.complete_many(&batch, DateTime::now()).await {
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

/// Extends, every third of the lease duration, the lease of each lane in which a
/// non-transactional handler runs. Transactional handlers are not renewed: their completion
/// must not conflict with a renewal.
async fn renew_leases(shared: Arc<Shared>, cancel: CancellationToken) {
    let lease_duration = shared.settings.lease_duration;
    let period = (lease_duration / 3).max(Duration::from_millis(10));
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep(period) => {}
        }
        let mut per_lane: HashMap<u32, Lease> = HashMap::new();
        for running in shared.running().values() {
            if !running.transactional {
                per_lane
                    .entry(running.lease.lane())
                    .or_insert_with(|| running.lease);
            }
        }
        let now = DateTime::now();
        let renewals = per_lane
            .values()
            .map(|lease| shared.store.extend_lease(lease, lease_duration, now));
        for (result, lane) in join_all(renewals).await.into_iter().zip(per_lane.keys()) {
            match result {
                Ok(Some(_)) => {}
                Ok(None) => debug!(
                    lane,
                    "lane lease not renewed: the claim ended or the lane changed hands"
                ),
                Err(error) => warn!(%error, lane, "renewing a lane lease failed"),
            }
        }
    }
}

/// Purges on the retention interval.
async fn purge_periodically(shared: Arc<Shared>, retention: Retention, cancel: CancellationToken) {
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
