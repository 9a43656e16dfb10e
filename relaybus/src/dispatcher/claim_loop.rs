//! The dispatch loop: claims deliveries while handler slots are free, seats and starts each,
//! and on shutdown waits for the running ones, releases the rest and hands the lanes back.

use std::sync::Arc;

use futures::future::join_all;
use tokio::{
    sync::{Notify, Semaphore, mpsc},
    task::AbortHandle,
};
use tokio_util::{sync::CancellationToken, task::TaskTracker};
use tracing::{info, warn};

use super::{
    Shared,
    completion::{Completion, complete_batches},
    gather::Gathering,
    run,
    starter::{Seat, Starter},
    upkeep::{purge_periodically, renew_leases, sample_periodically},
    wake,
};
use crate::store::Store;

/// The dispatch loop.
pub(super) async fn dispatch<S: Store>(shared: Arc<Shared<S>>, cancel: CancellationToken) {
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
