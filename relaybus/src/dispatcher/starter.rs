//! Starting the tasks that run claimed deliveries, one by one or as a gathered batch, each on
//! its seat, and sending their successes to the completer.

use std::{sync::Arc, time::Instant};

use tokio::sync::{Notify, Semaphore, mpsc};
use tokio_util::{sync::CancellationToken, task::TaskTracker};

use super::{Outcome, Running, Shared, batch, completion::Completion, run_delivery};
use crate::store::{Claimed, Store, StoreLease};

/// A claimed delivery's right to run: a handler slot, or a place among the deliveries claimed
/// ahead, which waits for a slot.
pub(super) enum Seat {
    Slot(tokio::sync::OwnedSemaphorePermit),
    /// A delivery of a limited handler: it passes its gate first, then waits for a slot.
    Gated(Arc<Semaphore>),
    Ahead {
        place: tokio::sync::OwnedSemaphorePermit,
        slots: Arc<Semaphore>,
    },
}

/// Starts the tasks that run claimed deliveries.
pub(super) struct Starter<S: Store> {
    pub(super) shared: Arc<Shared<S>>,
    pub(super) tracker: TaskTracker,
    /// Where succeeded deliveries go to be completed in batches.
    pub(super) done: mpsc::UnboundedSender<Completion<S::Lease>>,
    /// Wakes the dispatch loop (a keyed delivery settled).
    pub(super) wake: Arc<Notify>,
    /// The dispatcher is stopping.
    pub(super) stopping: CancellationToken,
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
    pub(super) fn start(&self, delivery: Claimed<S::Lease>, seat: Seat) {
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

impl<S: Store> Starter<S> {
    /// Runs a gathered batch in a task of its own, on one handler slot: its handler and the
    /// settlement of each delivery.
    pub(super) fn start_batch(
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
