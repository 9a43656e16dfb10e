//! Handlers' limits across buses, for every store: global concurrency and rate limits, with
//! several buses on one database. The store binaries call these with their own stores
//! (`dispatch` for MongoDB, `postgres`, `memory`).

use std::{
    sync::{
        Arc, Mutex,
        atomic::{AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use relaybus::{BoxError, EventEnvelope, RelayBus, Store, Subscription};
use tokio::sync::Notify;

use crate::support::{OrderPlaced, placed};

/// The handler id of the limited handler.
pub const LIMITED: &str = "limited";

/// What a limited handler saw: how many of its runs overlap now, the most that ever did, how
/// many ended.
#[derive(Debug, Default)]
pub struct Runs {
    /// Runs going on now.
    pub running: AtomicUsize,
    /// The most runs that went on at once.
    pub max: AtomicUsize,
    /// Runs that ended.
    pub done: AtomicUsize,
    /// When each run started.
    pub starts: Mutex<Vec<Instant>>,
    /// A run started or ended.
    pub changed: Notify,
}

impl Runs {
    /// Waits until `check` holds, or fails after `limit` saying `what`.
    pub async fn until(&self, limit: Duration, what: &str, check: impl Fn(&Runs) -> bool) {
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
            "{what} within {limit:?}: {} running, {} done, at most {} at once",
            self.running.load(Ordering::SeqCst),
            self.done.load(Ordering::SeqCst),
            self.max.load(Ordering::SeqCst)
        );
    }
}

/// A handler of `order.placed.v1` under [`LIMITED`] that records its runs in `runs` and takes
/// `took` (forever when `None`).
pub fn recording(runs: &Arc<Runs>, took: Option<Duration>) -> Subscription {
    let runs = Arc::clone(runs);
    Subscription::new(LIMITED, move |_: OrderPlaced| {
        let runs = Arc::clone(&runs);
        async move {
            let now = runs.running.fetch_add(1, Ordering::SeqCst) + 1;
            runs.max.fetch_max(now, Ordering::SeqCst);
            runs.starts
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(Instant::now());
            runs.changed.notify_waiters();
            match took {
                Some(took) => tokio::time::sleep(took).await,
                None => std::future::pending::<()>().await,
            }
            runs.running.fetch_sub(1, Ordering::SeqCst);
            runs.done.fetch_add(1, Ordering::SeqCst);
            runs.changed.notify_waiters();
            Ok::<(), BoxError>(())
        }
    })
}

/// A bus on `store` with `subscription`, 16 handlers at once, claiming ahead.
pub fn bus<S: Store>(store: S, subscription: Subscription, lease: Duration) -> RelayBus<S> {
    RelayBus::builder(store)
        .without_registered_handlers()
        .subscribe(subscription)
        .concurrency(16)
        .lease_duration(lease)
        .poll_interval(Duration::from_millis(50))
        .build()
        .expect("valid bus")
}

/// Publishes `count` unkeyed events through `bus`, in appends of 500.
pub async fn publish<S: Store>(bus: &RelayBus<S>, prefix: &str, count: usize) {
    let ids: Vec<String> = (0..count).map(|n| format!("{prefix}-{n}")).collect();
    for chunk in ids.chunks(500) {
        let envelopes = chunk.iter().map(|id| {
            EventEnvelope::new(&placed(id))
                .expect("valid event")
                .with_id(id)
                .expect("valid id")
        });
        bus.publish_all(envelopes).await.expect("published");
    }
}

/// Three buses (on `stores`), a handler with `global_concurrency(4)` that records its
/// concurrent runs: never more than 4 at once, and the work drains.
pub async fn global_concurrency_holds_across_buses<S: Store>(stores: [S; 3]) {
    const EVENTS: usize = 160;
    let runs = Arc::new(Runs::default());
    let buses: Vec<RelayBus<S>> = stores
        .into_iter()
        .map(|store| {
            let handler = recording(&runs, Some(Duration::from_millis(40))).global_concurrency(4);
            bus(store, handler, Duration::from_secs(30))
        })
        .collect();
    publish(&buses[0], "gc", EVENTS).await;
    for bus in &buses {
        bus.start().await.expect("started");
    }
    runs.until(Duration::from_secs(120), "the work drains", |runs| {
        runs.done.load(Ordering::SeqCst) >= EVENTS
    })
    .await;
    for bus in &buses {
        bus.shutdown().await.expect("stopped");
    }
    let max = runs.max.load(Ordering::SeqCst);
    assert!(
        max <= 4,
        "{max} runs at once across three buses, over the global concurrency of 4"
    );
    // Slots move between buses as runs end, so the busiest moment of a loaded machine may
    // miss the fourth; runs did overlap across the buses.
    assert!(max >= 2, "the runs overlapped: at most {max} at once");
    assert_eq!(
        runs.done.load(Ordering::SeqCst),
        EVENTS,
        "each event ran once"
    );
}

/// A rate limit of 50 per second over three buses for 20 s: no sliding window of 10 s holds
/// more than 550 starts, and the starts keep within 10 % of the limit.
pub async fn rate_limit_holds_across_buses<S: Store>(stores: [S; 3]) {
    const RATE: u32 = 50;
    const EVENTS: usize = 1_000;
    let runs = Arc::new(Runs::default());
    let buses: Vec<RelayBus<S>> = stores
        .into_iter()
        .map(|store| {
            let handler = recording(&runs, Some(Duration::from_millis(1)))
                .rate_limit(RATE, Duration::from_secs(1));
            bus(store, handler, Duration::from_secs(30))
        })
        .collect();
    publish(&buses[0], "rate", EVENTS).await;
    for bus in &buses {
        bus.start().await.expect("started");
    }
    runs.until(Duration::from_secs(60), "the work drains", |runs| {
        runs.done.load(Ordering::SeqCst) >= EVENTS
    })
    .await;
    for bus in &buses {
        bus.shutdown().await.expect("stopped");
    }
    let mut starts = runs.starts.lock().unwrap().clone();
    starts.sort();
    assert_eq!(starts.len(), EVENTS, "each event started once");
    let window = Duration::from_secs(10);
    let most = (0..starts.len())
        .map(|first| {
            starts[first..]
                .iter()
                .take_while(|at| at.duration_since(starts[first]) < window)
                .count()
        })
        .max()
        .unwrap_or(0);
    assert!(
        most <= 550,
        "{most} starts in a sliding window of 10 s, over 11 windows of 50"
    );
    // Steady state: 15 s from 2 s after the first start hold 15 or 16 windows of 50 (the
    // starts of a window come together at its opening), within 10 % of 750.
    let from = starts[0] + Duration::from_secs(2);
    let to = from + Duration::from_secs(15);
    let steady = starts.iter().filter(|at| **at >= from && **at < to).count();
    let rate = steady as f64 / 15.0;
    assert!(
        (f64::from(RATE) * 0.9..=f64::from(RATE) * 1.1).contains(&rate),
        "{rate:.1} starts per second in 15 s of steady state, not within 10 % of {RATE}"
    );
}

/// The lease of the killed bus in [`slots_of_a_killed_bus_free_within_the_lease`].
pub const KILLED_LEASE: Duration = Duration::from_secs(3);

/// A process (`holder`, `relaybus-crash-app slots ..` with a lease of [`KILLED_LEASE`]) holds
/// all 4 slots of the limited handler with runs that never end, and is killed with SIGKILL:
/// the two buses on `stores` reach 4 runs at once within its lease (and a margin for a busy
/// machine), and never more than 4.
pub async fn slots_of_a_killed_bus_free_within_the_lease<S: Store>(
    stores: [S; 2],
    mut holder: std::process::Command,
) {
    const MARGIN: Duration = Duration::from_secs(3);
    let runs = Arc::new(Runs::default());
    let buses: Vec<RelayBus<S>> = stores
        .into_iter()
        .map(|store| {
            let handler = recording(&runs, Some(Duration::from_millis(100))).global_concurrency(4);
            bus(store, handler, KILLED_LEASE)
        })
        .collect();
    publish(&buses[0], "held", 60).await;

    holder
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::inherit());
    let mut child = relaybus_harness::spawn_tied(holder).expect("start the holding process");
    let stdout = child.stdout.take().expect("piped stdout");
    let holding = tokio::task::spawn_blocking(move || {
        use std::io::BufRead;
        std::io::BufReader::new(stdout)
            .lines()
            .map_while(Result::ok)
            .any(|line| line == "holding")
    });
    let holding = tokio::time::timeout(Duration::from_secs(60), holding)
        .await
        .expect("the process holds the slots within a minute")
        .expect("its output read");
    assert!(holding, "the process exited before it held the slots");

    for bus in &buses {
        bus.start().await.expect("started");
    }
    relaybus_harness::kill_tied(&mut child);
    let killed = Instant::now();
    runs.until(KILLED_LEASE + MARGIN, "4 runs at once again", |runs| {
        runs.running.load(Ordering::SeqCst) >= 4
    })
    .await;
    let took = killed.elapsed();
    eprintln!("the slots of the killed bus were taken again {took:?} after the kill");
    for bus in &buses {
        bus.shutdown().await.expect("stopped");
    }
    assert!(
        runs.max.load(Ordering::SeqCst) <= 4,
        "never more than 4 at once"
    );
}

/// The partition of an event published by [`partitioned_concurrency_holds_per_partition`]:
/// its order id up to the first `-` (`t0`, `t1` or `t2`).
pub fn tenant(event: &OrderPlaced) -> String {
    event
        .order_id
        .split('-')
        .next()
        .unwrap_or_default()
        .to_owned()
}

/// Three buses (on `stores`), a handler with `global_concurrency(2)` partitioned by tenant,
/// three tenants: never more than 2 runs of a tenant at once, the tenants ran side by side
/// (more than 2 runs at once in all), and the work drains.
pub async fn partitioned_concurrency_holds_per_partition<S: Store>(stores: [S; 3]) {
    const EVENTS: usize = 120;
    const TENANTS: usize = 3;
    let all = Arc::new(Runs::default());
    let tenants: Arc<[Runs; TENANTS]> = Arc::new(Default::default());
    let buses: Vec<RelayBus<S>> = stores
        .into_iter()
        .map(|store| {
            let (all, tenants) = (Arc::clone(&all), Arc::clone(&tenants));
            let handler = Subscription::new(LIMITED, move |event: OrderPlaced| {
                let (all, tenants) = (Arc::clone(&all), Arc::clone(&tenants));
                async move {
                    let n: usize = tenant(&event)[1..].parse()?;
                    let runs = [&*all, &tenants[n]];
                    for runs in runs {
                        let now = runs.running.fetch_add(1, Ordering::SeqCst) + 1;
                        runs.max.fetch_max(now, Ordering::SeqCst);
                    }
                    tokio::time::sleep(Duration::from_millis(40)).await;
                    for runs in runs {
                        runs.running.fetch_sub(1, Ordering::SeqCst);
                        runs.done.fetch_add(1, Ordering::SeqCst);
                    }
                    all.changed.notify_waiters();
                    Ok::<(), BoxError>(())
                }
            })
            .global_concurrency(2)
            .partition_concurrency_by(tenant);
            bus(store, handler, Duration::from_secs(30))
        })
        .collect();
    let ids: Vec<String> = (0..EVENTS)
        .map(|n| format!("t{}-{n}", n % TENANTS))
        .collect();
    let envelopes = ids.iter().map(|id| {
        EventEnvelope::new(&placed(id))
            .expect("valid event")
            .with_id(id)
            .expect("valid id")
    });
    buses[0].publish_all(envelopes).await.expect("published");
    for bus in &buses {
        bus.start().await.expect("started");
    }
    all.until(Duration::from_secs(120), "the work drains", |runs| {
        runs.done.load(Ordering::SeqCst) >= EVENTS
    })
    .await;
    for bus in &buses {
        bus.shutdown().await.expect("stopped");
    }
    for (n, runs) in tenants.iter().enumerate() {
        let max = runs.max.load(Ordering::SeqCst);
        assert!(
            max <= 2,
            "{max} runs of tenant t{n} at once across three buses, over its global concurrency of 2"
        );
        assert_eq!(
            runs.done.load(Ordering::SeqCst),
            EVENTS / TENANTS,
            "each event of t{n} ran once"
        );
    }
    let max = all.max.load(Ordering::SeqCst);
    assert!(
        max > 2,
        "the tenants ran side by side: at most {max} runs at once in all, no more than one partition's 2"
    );
}
