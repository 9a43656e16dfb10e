//! Batch handlers, for every store: batches drain exactly once and never exceed their most,
//! keyed order holds across batches, and a poison event goes dead alone. The store binaries
//! call these with their own stores and, for the transactional drain, their own writes.

use std::{
    collections::{HashMap, HashSet},
    sync::{Arc, Mutex},
    time::Duration,
};

use relaybus::{
    Batch, BatchOutcome, BoxError, DeliveryQuery, DeliveryStatus, EventEnvelope, RelayBus,
    RetryPolicy, Store, Subscription,
};
use tokio::sync::Notify;

use crate::support::{OrderPlaced, placed};

/// The handler id of the batch handlers.
pub const BATCHER: &str = "batcher";

/// One delivery a batch handler saw: its event id, key and sequence.
pub type Seen = (String, Option<String>, Option<i64>);

/// What batch handlers saw: each batch's event ids, in order.
#[derive(Debug, Default)]
pub struct Batches {
    /// Each batch's event ids, with their keys and sequences.
    pub batches: Mutex<Vec<Vec<Seen>>>,
    /// A batch ended.
    pub changed: Notify,
}

impl Batches {
    /// Records a batch.
    pub fn record(&self, batch: &Batch<OrderPlaced>) {
        let items = batch
            .iter()
            .map(|item| {
                (
                    item.event_id().to_owned(),
                    item.key().map(str::to_owned),
                    item.sequence(),
                )
            })
            .collect();
        self.batches.lock().unwrap().push(items);
        self.changed.notify_waiters();
    }

    /// How many deliveries the batches held in all.
    pub fn deliveries(&self) -> usize {
        self.batches.lock().unwrap().iter().map(Vec::len).sum()
    }

    /// How many events the batches held, each counted once.
    pub fn distinct(&self) -> usize {
        let batches = self.batches.lock().unwrap();
        let ids: HashSet<&String> = batches.iter().flatten().map(|(id, _, _)| id).collect();
        ids.len()
    }

    /// The largest batch.
    pub fn largest(&self) -> usize {
        self.batches
            .lock()
            .unwrap()
            .iter()
            .map(Vec::len)
            .max()
            .unwrap_or(0)
    }

    /// Waits until `check` holds, or fails after `limit` saying `what`.
    pub async fn until(&self, limit: Duration, what: &str, check: impl Fn(&Batches) -> bool) {
        let waited = tokio::time::timeout(limit, async {
            loop {
                let changed = self.changed.notified();
                if check(self) {
                    return;
                }
                changed.await;
            }
        })
        .await;
        assert!(
            waited.is_ok(),
            "{what} within {limit:?}: {} deliveries in {} batches",
            self.deliveries(),
            self.batches.lock().unwrap().len()
        );
    }
}

/// A bus on `store` with `subscription`, quick polls and retries.
pub fn bus<S: Store>(store: S, subscription: Subscription) -> RelayBus<S> {
    RelayBus::builder(store)
        .without_registered_handlers()
        .subscribe(subscription)
        .poll_interval(Duration::from_millis(50))
        .lease_duration(Duration::from_secs(30))
        .retry(
            RetryPolicy::new(3)
                .initial_backoff(Duration::from_millis(20))
                .max_backoff(Duration::from_millis(100)),
        )
        .build()
        .expect("valid bus")
}

/// Publishes events `<prefix>-0..count` through `bus` in appends of 500, keyed by `key` of
/// their number when given.
pub async fn publish<S: Store>(
    bus: &RelayBus<S>,
    prefix: &str,
    count: usize,
    key: Option<fn(usize) -> String>,
) {
    let envelopes: Vec<EventEnvelope> = (0..count)
        .map(|n| {
            let id = format!("{prefix}-{n}");
            let envelope = EventEnvelope::new(&placed(&id))
                .expect("valid event")
                .with_id(&id)
                .expect("valid id");
            match key {
                Some(key) => envelope.with_key(key(n)).expect("valid key"),
                None => envelope,
            }
        })
        .collect();
    for chunk in envelopes.chunks(500) {
        bus.publish_all(chunk.to_vec()).await.expect("published");
    }
}

/// `count` unkeyed events drain through `bus` (whose batch handler records into `batches`
/// and writes one effect per event), in batches of at most `max`.
pub async fn drain_in_batches<S: Store>(
    bus: &RelayBus<S>,
    batches: &Batches,
    count: usize,
    max: usize,
) {
    publish(bus, "drain", count, None).await;
    bus.start().await.expect("started");
    batches
        .until(Duration::from_secs(180), "every event handled", |b| {
            b.distinct() >= count
        })
        .await;
    // A batch whose transaction gave up goes back and runs again: wait for the queue to empty.
    let emptied = tokio::time::timeout(Duration::from_secs(120), async {
        loop {
            let pending = bus
                .store()
                .list_deliveries(
                    &DeliveryQuery::new()
                        .status(DeliveryStatus::Pending)
                        .limit(1),
                )
                .await
                .expect("pending listed");
            if pending.is_empty() {
                return;
            }
            let changed = batches.changed.notified();
            let _ = tokio::time::timeout(Duration::from_millis(100), changed).await;
        }
    })
    .await;
    assert!(emptied.is_ok(), "the queue empties within 2 minutes");
    bus.shutdown().await.expect("stopped");
    let recorded = batches.batches.lock().unwrap();
    // A transaction that runs again calls its handler again: each event is in one batch at
    // least; that its effect is written once is for the caller to check in its store.
    let ids: HashSet<&String> = recorded.iter().flatten().map(|(id, _, _)| id).collect();
    assert_eq!(ids.len(), count, "each event in a batch");
    let largest = recorded.iter().map(Vec::len).max().unwrap_or(0);
    assert!(
        largest <= max,
        "a batch of {largest}, over its most of {max}"
    );
    assert!(
        largest > 1,
        "the deliveries ran in batches, not one by one: the largest held {largest}"
    );
}

/// 20 keys of 10 events each through a batch handler of at most 8: each key's events come in
/// sequence order across batches, a batch holds at most one of a key, and every event once.
pub async fn keyed_order_holds_across_batches<S: Store>(store: S) {
    let batches = Arc::new(Batches::default());
    let recorder = Arc::clone(&batches);
    let handler = Subscription::batch(BATCHER, move |batch: Batch<OrderPlaced>| {
        let recorder = Arc::clone(&recorder);
        async move {
            recorder.record(&batch);
            Ok::<(), BoxError>(())
        }
    })
    .max_batch(8)
    .batch_wait(Duration::from_millis(20));
    let bus = bus(store, handler);
    publish(&bus, "keyed", 200, Some(|n| format!("key-{}", n % 20))).await;
    bus.start().await.expect("started");
    batches
        .until(Duration::from_secs(120), "every event handled", |b| {
            b.deliveries() >= 200
        })
        .await;
    bus.shutdown().await.expect("stopped");
    let recorded = batches.batches.lock().unwrap();
    let mut last: HashMap<String, i64> = HashMap::new();
    for batch in recorded.iter() {
        assert!(batch.len() <= 8, "a batch of {}", batch.len());
        let keys: HashSet<&String> = batch.iter().filter_map(|(_, k, _)| k.as_ref()).collect();
        assert_eq!(
            keys.len(),
            batch.len(),
            "one delivery of a key per batch: {batch:?}"
        );
        for (id, key, sequence) in batch {
            let (key, sequence) = (key.clone().unwrap(), sequence.unwrap());
            let before = last.insert(key.clone(), sequence).unwrap_or(0);
            assert_eq!(
                sequence,
                before + 1,
                "{id} of {key} came as sequence {sequence} after {before}"
            );
        }
    }
    assert_eq!(last.len(), 20, "every key handled");
    assert!(
        last.values().all(|s| *s == 10),
        "every event once: {last:?}"
    );
}

/// A batch of 30 with one poison event that the handler marks failed every time: the poison
/// goes dead alone after its attempts; the others complete once.
pub async fn poison_goes_dead_alone<S: Store>(store: S) {
    let batches = Arc::new(Batches::default());
    let recorder = Arc::clone(&batches);
    let handler = Subscription::batch(BATCHER, move |batch: Batch<OrderPlaced>| {
        let recorder = Arc::clone(&recorder);
        async move {
            recorder.record(&batch);
            let mut outcome = BatchOutcome::succeeded();
            for item in &batch {
                if item.event_id() == "poison-7" {
                    outcome.fail(item, "the projection rejects this order");
                }
            }
            Ok::<_, BoxError>(outcome)
        }
    })
    .max_batch(50)
    .batch_wait(Duration::from_millis(100));
    let bus = bus(store.clone(), handler);
    publish(&bus, "poison", 30, None).await;
    bus.start().await.expect("started");
    // The first batch, then the poison's two retries alone.
    batches
        .until(
            Duration::from_secs(60),
            "the poison's three attempts",
            |b| {
                b.batches
                    .lock()
                    .unwrap()
                    .iter()
                    .flatten()
                    .filter(|(id, _, _)| id == "poison-7")
                    .count()
                    >= 3
            },
        )
        .await;
    let dead = loop {
        let dead = store
            .list_deliveries(&DeliveryQuery::new().status(DeliveryStatus::Dead))
            .await
            .expect("dead letters listed");
        if !dead.is_empty() {
            break dead;
        }
        let changed = batches.changed.notified();
        let _ = tokio::time::timeout(Duration::from_millis(50), changed).await;
    };
    bus.shutdown().await.expect("stopped");
    let ids: Vec<&str> = dead.iter().map(|d| d.event_id.as_str()).collect();
    assert_eq!(ids, ["poison-7"], "the poison alone is dead");
    assert_eq!(dead[0].attempts, 3);
    let others = batches
        .batches
        .lock()
        .unwrap()
        .iter()
        .flatten()
        .filter(|(id, _, _)| id != "poison-7")
        .count();
    assert_eq!(others, 29, "the other events ran once each");
    let pending = store
        .list_deliveries(&DeliveryQuery::new().status(DeliveryStatus::Pending))
        .await
        .expect("pending listed");
    assert!(pending.is_empty(), "nothing left: {pending:?}");
}

/// 3,000 unkeyed events through a batch handler of at most 100 that fails the first attempt
/// of one event in ten: retried deliveries come back in later batches, and no batch holds a
/// delivery twice.
pub async fn a_batch_holds_each_delivery_once<S: Store>(store: S) {
    const EVENTS: usize = 3_000;
    let batches = Arc::new(Batches::default());
    let recorder = Arc::clone(&batches);
    let handler = Subscription::batch(BATCHER, move |batch: Batch<OrderPlaced>| {
        let recorder = Arc::clone(&recorder);
        async move {
            recorder.record(&batch);
            let mut outcome = BatchOutcome::succeeded();
            for item in &batch {
                if item.event_id().ends_with('0') && item.attempt() == 1 {
                    outcome.fail(item, "the first attempt of one event in ten fails");
                }
            }
            Ok::<_, BoxError>(outcome)
        }
    })
    .max_batch(100)
    .batch_wait(Duration::from_millis(20));
    let bus = bus(store, handler);
    publish(&bus, "once", EVENTS, None).await;
    bus.start().await.expect("started");
    batches
        .until(Duration::from_secs(120), "every event succeeded", |b| {
            b.deliveries() >= EVENTS + EVENTS / 10
        })
        .await;
    bus.shutdown().await.expect("stopped");
    for batch in batches.batches.lock().unwrap().iter() {
        let ids: HashSet<&String> = batch.iter().map(|(id, _, _)| id).collect();
        assert_eq!(
            ids.len(),
            batch.len(),
            "a delivery twice in one batch: {batch:?}"
        );
    }
    assert_eq!(batches.distinct(), EVENTS, "every event in a batch");
}
