//! Gathering the deliveries of batch handlers into batches.

use std::{collections::HashMap, sync::Arc, time::Duration};

use tokio::sync::Semaphore;
use tracing::warn;

use super::{Running, Shared, starter::Starter};
use crate::store::{Claimed, Store};

/// The batches of the bus's batch handlers being gathered: claimed deliveries wait here until
/// their handler's batch is full or its wait since its first delivery has passed. Each
/// batch handler has room for two batches (one running, one gathering); a full room holds the
/// dispatch loop until a batch ends, as full handler slots do.
pub(super) struct Gathering<L> {
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
    pub(super) fn new<S: Store<Lease = L>>(shared: &Shared<S>) -> Self {
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
    pub(super) fn takes(&self, handler: &str) -> bool {
        self.batches.contains_key(handler)
    }

    /// Adds a claimed delivery to its handler's batch, waiting for room first; starts the batch
    /// once full.
    pub(super) async fn gather<S: Store<Lease = L>>(
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
    pub(super) fn flush_due<S: Store<Lease = L>>(
        &mut self,
        starter: &Starter<S>,
        slots: &Arc<Semaphore>,
    ) {
        let now = tokio::time::Instant::now();
        for (handler, gathered) in &mut self.batches {
            if gathered.due.is_some_and(|due| due <= now) {
                Self::start(handler, gathered, starter, slots);
            }
        }
    }

    /// Resolves when a batch's wait has passed (never while none gathers). Cancel safe.
    pub(super) async fn due(&self) {
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
