//! Handlers' limits across buses: a delivery of a limited handler passes its gate before it
//! runs: a slot of the handler's global concurrency, then a start within its rate limit.
//!
//! A bus holds at most as many deliveries of a limited handler past their claim (waiting or
//! running) as its limit lets run at once; it gives the others back uncharged. Waiting
//! deliveries hold their delivery leases (renewed like running ones) but no handler slot of
//! the bus, so other handlers run meanwhile. The waiters of one handler take turns asking the
//! store, so a bus asks once at a time per handler, with a backoff from 5 ms up to the poll
//! interval (200 ms at most); a slot given back on this bus wakes the next waiter at once.
//!
//! A partitioned global concurrency has `n` slots per partition (stored under
//! `<handler>/<partition>`, which no handler id can name), and the waiters take turns per
//! partition, so a full partition holds up no other. Such a handler's bus holds at most its
//! concurrency of deliveries past their claim.

use std::{
    collections::{HashMap, HashSet},
    sync::{
        Arc, Mutex as StdMutex, MutexGuard,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use tokio::sync::{Mutex, Notify};
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use super::Shared;
use crate::{
    handler::{ConcurrencyPartition, Subscription},
    store::{Slot, SlotRequest, StartsRequest, Store},
    time::Timestamp,
};

/// The shortest wait before asking the store again.
const MIN_BACKOFF: Duration = Duration::from_millis(5);
/// The longest, unless the poll interval is shorter.
const MAX_BACKOFF: Duration = Duration::from_millis(200);

/// The gates of a bus's limited handlers, and the slots the bus holds.
#[derive(Debug, Default)]
pub(crate) struct Gates {
    gates: HashMap<String, Gate>,
    held: StdMutex<HashSet<Slot>>,
}

/// The gate of one limited handler.
struct Gate {
    concurrency: Option<u32>,
    /// Names a delivery's partition of the global concurrency, if partitioned.
    partition: Option<ConcurrencyPartition>,
    rate: Option<(u32, Duration)>,
    /// The most deliveries the bus holds past their claim.
    cap: usize,
    /// How many it holds now.
    entered: AtomicUsize,
    /// How many of them wait to pass.
    waiting: AtomicUsize,
    /// Starts this bus took in the store and has not used yet: until when (the window's end),
    /// and how many.
    starts: StdMutex<Option<(Timestamp, u32)>>,
    /// The turns of the partitions that have deliveries waiting or running (`""` alone when
    /// not partitioned).
    turns: StdMutex<HashMap<String, Arc<Turn>>>,
}

impl std::fmt::Debug for Gate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gate")
            .field("concurrency", &self.concurrency)
            .field("partitioned", &self.partition.is_some())
            .field("rate", &self.rate)
            .field("cap", &self.cap)
            .finish_non_exhaustive()
    }
}

impl Gate {
    /// The turn of `partition`, made when none waits or runs there.
    fn turn(&self, partition: &str) -> Arc<Turn> {
        let mut turns = self.turns.lock().unwrap_or_else(|e| e.into_inner());
        Arc::clone(turns.entry(partition.to_owned()).or_default())
    }

    /// Lets go of `turn`, forgetting its partition once nothing waits or runs there.
    fn let_go(&self, partition: &str, turn: Arc<Turn>) {
        let mut turns = self.turns.lock().unwrap_or_else(|e| e.into_inner());
        drop(turn);
        if turns
            .get(partition)
            .is_some_and(|turn| Arc::strong_count(turn) == 1)
        {
            turns.remove(partition);
        }
    }
}

/// The waiters of one partition of a handler (all of it, when not partitioned).
#[derive(Debug, Default)]
struct Turn {
    /// The waiters' turn to ask the store.
    turn: Mutex<()>,
    /// A slot was given back on this bus.
    freed: Notify,
}

/// A delivery's pass through its gate: the slot it holds, if its handler has a global
/// concurrency, and its partition's turn.
#[derive(Debug, Default)]
pub(crate) struct Admission {
    slot: Option<Slot>,
    partition: String,
    turn: Option<Arc<Turn>>,
}

impl Gates {
    /// The gates of `subscriptions`' limited handlers, on a bus that runs `concurrency`
    /// handlers at once.
    pub(crate) fn new(subscriptions: &[Subscription], concurrency: usize) -> Self {
        let gates = subscriptions
            .iter()
            .filter(|s| s.is_limited())
            .map(|s| {
                let limit = s
                    .global_concurrency
                    .into_iter()
                    .chain(s.rate_limit.map(|(rate, _)| rate))
                    .min()
                    .unwrap_or(1)
                    .max(1) as usize;
                // A partitioned handler may run `n` per partition: as many as the bus runs.
                let cap = if s.concurrency_partition.is_some() {
                    concurrency.max(limit)
                } else {
                    limit
                };
                let gate = Gate {
                    concurrency: s.global_concurrency,
                    partition: s.concurrency_partition.clone(),
                    rate: s.rate_limit,
                    cap,
                    entered: AtomicUsize::new(0),
                    waiting: AtomicUsize::new(0),
                    starts: StdMutex::new(None),
                    turns: StdMutex::new(HashMap::new()),
                };
                (s.id.clone(), gate)
            })
            .collect();
        Gates {
            gates,
            held: StdMutex::new(HashSet::new()),
        }
    }

    /// Whether `handler` has limits.
    pub(crate) fn limits(&self, handler: &str) -> bool {
        self.gates.contains_key(handler)
    }

    /// The partition of `handler`'s global concurrency that a delivery of `payload` runs in:
    /// `""` when not partitioned.
    pub(crate) fn partition(
        &self,
        handler: &str,
        payload: &serde_json::Map<String, serde_json::Value>,
    ) -> String {
        self.gates
            .get(handler)
            .and_then(|gate| gate.partition.as_ref())
            .map(|partition| partition(payload))
            .unwrap_or_default()
    }

    /// Lets one more delivery of `handler` wait at its gate, unless the bus holds as many as
    /// the limit lets run: `false` then (give the delivery back).
    pub(crate) fn enter(&self, handler: &str) -> bool {
        let Some(gate) = self.gates.get(handler) else {
            return true;
        };
        gate.entered
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |entered| {
                (entered < gate.cap).then_some(entered + 1)
            })
            .is_ok()
    }

    /// A delivery that entered left the gate (it ran, or it was given back).
    pub(crate) fn leave(&self, handler: &str) {
        if let Some(gate) = self.gates.get(handler) {
            let _ = gate
                .entered
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1));
        }
    }

    /// The slots this bus holds now.
    pub(crate) fn held(&self) -> Vec<Slot> {
        self.held_set().iter().cloned().collect()
    }

    fn held_set(&self) -> MutexGuard<'_, HashSet<Slot>> {
        // Inserts and removals only: a panic cannot leave it half-changed.
        self.held.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl<S: Store> Shared<S> {
    /// Waits until the limits of a delivery of `handler` in `partition` (see
    /// [`Gates::partition`]) let it start: a slot of its global concurrency, then a start
    /// within its rate limit. `None` when the bus stops first (the delivery did not start;
    /// give it back uncharged). A handler without limits passes at once.
    pub(crate) async fn admit(
        &self,
        handler: &str,
        partition: String,
        stopping: &CancellationToken,
    ) -> Option<Admission> {
        let Some(gate) = self.gates.gates.get(handler) else {
            return Some(Admission::default());
        };
        gate.waiting.fetch_add(1, Ordering::AcqRel);
        let turn = gate.turn(&partition);
        let admission = Admission {
            slot: None,
            partition,
            turn: Some(Arc::clone(&turn)),
        };
        let admitted = self
            .admit_at(handler, gate, &turn, admission, stopping)
            .await;
        gate.waiting.fetch_sub(1, Ordering::AcqRel);
        admitted
    }

    async fn admit_at(
        &self,
        handler: &str,
        gate: &Gate,
        turn: &Turn,
        mut admission: Admission,
        stopping: &CancellationToken,
    ) -> Option<Admission> {
        let _turn = tokio::select! {
            guard = turn.turn.lock() => guard,
            _ = stopping.cancelled() => {
                self.give_back(handler, admission).await;
                return None;
            }
        };
        let max_backoff = self.settings.poll_interval.clamp(MIN_BACKOFF, MAX_BACKOFF);
        let mut backoff = MIN_BACKOFF;
        let mut waited: HashSet<&'static str> = HashSet::new();
        let metrics = self.metrics.handler(handler);
        loop {
            let wait = match self.pass(handler, gate, &mut admission).await {
                Ok(None) => return Some(admission),
                Ok(Some((limit, wait))) => {
                    if waited.insert(limit)
                        && let Some(metrics) = metrics
                    {
                        metrics.limit_wait(limit);
                    }
                    wait.unwrap_or(backoff)
                }
                Err(error) => {
                    warn!(%error, handler, "could not ask the store for the handler's limits; trying again");
                    backoff
                }
            };
            backoff = (backoff * 2).min(max_backoff);
            tokio::select! {
                _ = tokio::time::sleep(wait) => {}
                _ = turn.freed.notified(), if admission.slot.is_none() => {}
                _ = stopping.cancelled() => {
                    self.give_back(handler, admission).await;
                    return None;
                }
            }
        }
    }

    /// One try at the gate: `None` when it passed, or the limit that held it with how long to
    /// wait, if known (the rate window's end).
    async fn pass(
        &self,
        handler: &str,
        gate: &Gate,
        admission: &mut Admission,
    ) -> crate::error::Result<Option<(&'static str, Option<Duration>)>> {
        if let Some(limit) = gate.concurrency
            && admission.slot.is_none()
        {
            let partitioned;
            let request = SlotRequest {
                handler: if gate.partition.is_some() {
                    partitioned = format!("{handler}/{}", admission.partition);
                    &partitioned
                } else {
                    handler
                },
                limit,
                owner: &self.settings.owner,
                lease_duration: self.settings.lease_duration,
                now: self.now(),
            };
            match self.store.take_slot(request).await? {
                Some(slot) => {
                    self.gates.held_set().insert(slot.clone());
                    admission.slot = Some(slot);
                }
                None => return Ok(Some(("concurrency", None))),
            }
        }
        if let Some((rate, interval)) = gate.rate {
            let now = self.now();
            {
                let mut starts = gate.starts.lock().unwrap_or_else(|e| e.into_inner());
                if let Some((end, left)) = starts.as_mut()
                    && now < *end
                    && *left > 0
                {
                    *left -= 1;
                    return Ok(None);
                }
            }
            // One write for every delivery waiting here: the others take theirs from what is
            // left over, within the window.
            let wanted =
                u32::try_from(gate.waiting.load(Ordering::Acquire).max(1)).unwrap_or(u32::MAX);
            let (granted, end) = self
                .store
                .take_starts(StartsRequest {
                    handler,
                    wanted,
                    rate,
                    interval,
                    now,
                })
                .await?;
            if granted == 0 {
                // Into the next window, with a little spread so the buses do not all ask at
                // its first millisecond.
                let spread = Duration::from_millis(rand::random_range(0..=5));
                return Ok(Some(("rate", Some(end.duration_since(now) + spread))));
            }
            *gate.starts.lock().unwrap_or_else(|e| e.into_inner()) = Some((end, granted - 1));
        }
        Ok(None)
    }

    /// Gives back what a delivery took at its gate, and wakes the next waiter of its
    /// partition.
    pub(crate) async fn give_back(&self, handler: &str, admission: Admission) {
        let Admission {
            slot,
            partition,
            turn,
        } = admission;
        if let (Some(gate), Some(turn)) = (self.gates.gates.get(handler), turn) {
            if slot.is_some() {
                turn.freed.notify_one();
            }
            gate.let_go(&partition, turn);
        }
        let Some(slot) = slot else { return };
        self.gates.held_set().remove(&slot);
        match self.store.give_back_slot(&slot).await {
            Ok(true) => {}
            Ok(false) => debug!(
                handler,
                slot = slot.index,
                "the slot had expired before it was given back"
            ),
            Err(error) => {
                warn!(%error, handler, "could not give a slot back; it frees up when its lease ends")
            }
        }
    }

    /// Gives back every slot the bus still holds (at shutdown).
    pub(crate) async fn give_back_all(&self) {
        let held: Vec<Slot> = self.gates.held_set().drain().collect();
        for slot in held {
            if let Err(error) = self.store.give_back_slot(&slot).await {
                warn!(%error, handler = slot.handler, "could not give a slot back; it frees up when its lease ends");
            }
        }
    }

    /// Renews the slots the bus holds, with its delivery leases.
    pub(crate) async fn renew_slots(&self) {
        let held = self.gates.held();
        if held.is_empty() {
            return;
        }
        match self
            .store
            .renew_slots(
                &held,
                self.now().saturating_add(self.settings.lease_duration),
            )
            .await
        {
            Ok(renewed) if renewed < held.len() => warn!(
                held = held.len(),
                renewed, "some slots had expired before their renewal; another bus may hold them"
            ),
            Ok(_) => {}
            Err(error) => warn!(%error, "renewing slots failed"),
        }
    }
}
