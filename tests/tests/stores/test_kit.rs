//! The test kit: a bus on a `TestClock`, run step by step with `run_until_idle`, on the
//! in-memory store and on MongoDB. Backoff, delayed publishes, lease expiry and retention move
//! with the test clock; nothing here sleeps.

use std::{
    sync::{
        Arc,
        atomic::{AtomicU32, Ordering},
    },
    time::{Duration, Instant},
};

use relaybus::{
    BoxError, ConfigurationError, Error, Event, HandlerContext, RelayBus, RetryPolicy, RunOutcome,
    Store, Subscription, Timestamp,
    clock::TestClock,
    store::{ClaimRequest, StoreLease},
};
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Pinged {
    n: u32,
}

impl Event for Pinged {
    const TYPE: &'static str = "test.pinged.v1";
}

/// 2030, later than the creation time of anything the tests make.
const START: i64 = 1_900_000_000_000;

/// A bus on `store` with one handler, `flaky`, that fails its first `failures` calls and counts
/// every call; backoff from 1 s to 1 min, 5 attempts; on a test clock at `START`.
fn flaky_bus<S: Store>(store: S, failures: u32) -> (RelayBus<S>, TestClock, Arc<AtomicU32>) {
    let calls = Arc::new(AtomicU32::new(0));
    let counted = Arc::clone(&calls);
    let clock = TestClock::new(Timestamp::from_millis(START));
    let bus = RelayBus::builder(store)
        .without_registered_handlers()
        .clock(clock.clone())
        .retry(
            RetryPolicy::new(5)
                .initial_backoff(Duration::from_secs(1))
                .max_backoff(Duration::from_secs(60)),
        )
        .subscribe(Subscription::new(
            "flaky",
            move |event: Pinged, _: HandlerContext<S>| {
                let calls = Arc::clone(&counted);
                async move {
                    let call = calls.fetch_add(1, Ordering::SeqCst) + 1;
                    if call <= failures {
                        return Err(BoxError::from(format!(
                            "ping {} failed on call {call}",
                            event.n
                        )));
                    }
                    Ok::<(), BoxError>(())
                }
            },
        ))
        .build()
        .expect("valid bus");
    (bus, clock, calls)
}

/// A handler that fails twice, then succeeds: one `run_until_idle` that moves the clock over
/// both backoffs runs all three attempts. Returns how long the run took.
async fn fails_twice_then_succeeds<S: Store>(store: S) -> Duration {
    let (bus, clock, calls) = flaky_bus(store, 2);
    bus.publish(&Pinged { n: 1 }).await.expect("publish");

    let started = Instant::now();
    let report = bus
        .run_until_idle()
        .advance_clock(Duration::from_secs(3600))
        .await
        .expect("run until idle");
    let took = started.elapsed();

    assert_eq!(calls.load(Ordering::SeqCst), 3);
    let attempts: Vec<(u32, bool)> = report
        .runs
        .iter()
        .map(|r| (r.attempt, r.succeeded()))
        .collect();
    assert_eq!(attempts, [(1, false), (2, false), (3, true)], "{report:?}");
    assert_eq!(report.failed().count(), 2);
    assert_eq!(report.dead().count(), 0);
    assert_eq!(report.runs[0].error(), Some("ping 1 failed on call 1"));
    // The clock moved to the second retry's due time: past both backoffs (1 s and 2 s, less
    // up to a quarter of jitter), and no further.
    let moved = clock.now().duration_since(Timestamp::from_millis(START));
    assert!(
        moved >= Duration::from_millis(750 + 1500) && moved <= Duration::from_secs(3),
        "moved {moved:?}"
    );
    match &report.runs[1].outcome {
        RunOutcome::Retried { due_at, .. } => assert_eq!(*due_at, clock.now()),
        other => panic!("the second attempt was retried, not {other:?}"),
    }
    assert_eq!(report.next_due_at, None);
    took
}

/// Without `advance_clock`, a retry waits for the test to move the clock.
async fn a_retry_waits_for_the_clock<S: Store>(store: S) {
    let (bus, clock, calls) = flaky_bus(store, 1);
    bus.publish(&Pinged { n: 2 }).await.expect("publish");
    let first = bus.run_until_idle().await.expect("first run");
    assert_eq!(first.runs.len(), 1);
    let Some(due) = first.next_due_at else {
        panic!("the retry is scheduled: {first:?}");
    };
    assert!(due > clock.now());
    assert!(
        bus.run_until_idle().await.expect("run").runs.is_empty(),
        "not due yet"
    );
    assert_eq!(calls.load(Ordering::SeqCst), 1);

    clock.advance_to(due);
    let second = bus.run_until_idle().await.expect("second run");
    assert_eq!(second.succeeded().count(), 1, "{second:?}");
    assert_eq!(second.runs[0].attempt, 2);
}

/// A delayed publish is due on the bus's clock.
async fn a_delayed_publish_is_due_on_the_clock<S: Store>(store: S) {
    let (bus, clock, calls) = flaky_bus(store, 0);
    bus.publish(&Pinged { n: 3 })
        .delay(Duration::from_secs(600))
        .await
        .expect("publish");
    let report = bus.run_until_idle().await.expect("run");
    assert!(report.runs.is_empty());
    assert_eq!(
        report.next_due_at,
        Some(Timestamp::from_millis(START + 600_000))
    );
    clock.advance(Duration::from_secs(599));
    assert!(bus.run_until_idle().await.expect("run").runs.is_empty());
    clock.advance(Duration::from_secs(1));
    assert_eq!(
        bus.run_until_idle().await.expect("run").succeeded().count(),
        1
    );
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

/// A delivery claimed by a worker that died is taken over once its lease ends on the test
/// clock, and its lost attempt is charged.
async fn a_dead_workers_lease_ends_on_the_clock<S: Store>(store: S) {
    let (bus, clock, calls) = flaky_bus(store.clone(), 0);
    bus.publish(&Pinged { n: 4 }).await.expect("publish");
    let handlers = ["flaky".to_owned()];
    let taken = store
        .claim(ClaimRequest {
            owner: "a-worker-that-dies",
            handlers: &handlers,
            limit: 10,
            lease_duration: Duration::from_secs(30),
            now: clock.now(),
        })
        .await
        .expect("claim");
    assert_eq!(taken.len(), 1);
    let _ = taken[0].lease.delivery_id();

    clock.advance(Duration::from_secs(29));
    assert!(
        bus.run_until_idle().await.expect("run").runs.is_empty(),
        "the lease still holds"
    );
    clock.advance(Duration::from_secs(2));
    let report = bus.run_until_idle().await.expect("run");
    assert_eq!(report.succeeded().count(), 1, "{report:?}");
    assert_eq!(report.runs[0].attempt, 2, "the lost attempt was charged");
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

/// The retention purge cuts off on the bus's clock.
async fn retention_runs_on_the_clock<S: Store>(store: S) {
    let (bus, clock, _) = flaky_bus(store, 0);
    bus.publish(&Pinged { n: 5 }).await.expect("publish");
    assert_eq!(
        bus.run_until_idle().await.expect("run").succeeded().count(),
        1
    );
    assert_eq!(bus.purge_expired().await.expect("purge").events, 0);
    // The completed retention (seven days) and two minutes: the MongoDB store takes a new
    // event completed within a minute as completed two minutes after its creation.
    clock.advance(Duration::from_secs(7 * 86_400 + 121));
    assert_eq!(bus.purge_expired().await.expect("purge").events, 1);
}

/// A delivery that keeps failing becomes a dead letter in the report.
async fn the_report_shows_dead_letters<S: Store>(store: S) {
    let (bus, _, calls) = flaky_bus(store, u32::MAX);
    bus.publish(&Pinged { n: 6 }).await.expect("publish");
    let report = bus
        .run_until_idle()
        .advance_clock(Duration::from_secs(86_400))
        .await
        .expect("run");
    assert_eq!(calls.load(Ordering::SeqCst), 5);
    let dead: Vec<_> = report.dead().collect();
    assert_eq!(dead.len(), 1, "{report:?}");
    assert_eq!(dead[0].attempt, 5);
    assert_eq!(dead[0].error(), Some("ping 6 failed on call 5"));
}

/// Misuse is refused with an error that says what to do.
async fn misuse_is_refused<S: Store>(store: S) {
    let (bus, _, _) = flaky_bus(store.clone(), u32::MAX);
    bus.publish(&Pinged { n: 7 }).await.expect("publish");
    match bus
        .run_until_idle()
        .advance_clock(Duration::from_secs(86_400))
        .max_runs(2)
        .await
    {
        Err(Error::InvalidArgument(error)) => {
            assert_eq!(error.argument(), "max_runs");
            assert!(error.reason().contains("raise the limit"), "{error}");
        }
        other => panic!("expected the run limit, got {other:?}"),
    }

    let system = RelayBus::builder(store)
        .without_registered_handlers()
        .build()
        .expect("valid bus");
    match system
        .run_until_idle()
        .advance_clock(Duration::from_secs(1))
        .await
    {
        Err(Error::Configuration(ConfigurationError::InvalidOption { option, reason })) => {
            assert_eq!(option, "advance_clock");
            assert!(reason.contains("TestClock"), "{reason}");
        }
        other => panic!("expected advance_clock to be refused, got {other:?}"),
    }
    bus.start().await.expect("start");
    match bus.run_until_idle().await {
        Err(Error::Configuration(ConfigurationError::InvalidOption { option, .. })) => {
            assert_eq!(option, "run_until_idle")
        }
        other => panic!("expected a started bus to be refused, got {other:?}"),
    }
    bus.shutdown().await.expect("shutdown");
}

macro_rules! test_kit_tests {
    ($make_store:expr) => {
        #[tokio::test]
        async fn a_handler_that_fails_twice_then_succeeds() {
            let (store, _guard) = ($make_store)("kit_fails_twice").await;
            fails_twice_then_succeeds(store).await;
        }

        #[tokio::test]
        async fn a_retry_waits_for_the_test_clock() {
            let (store, _guard) = ($make_store)("kit_retry_waits").await;
            a_retry_waits_for_the_clock(store).await;
        }

        #[tokio::test]
        async fn a_delayed_publish_is_due_on_the_test_clock() {
            let (store, _guard) = ($make_store)("kit_delayed").await;
            a_delayed_publish_is_due_on_the_clock(store).await;
        }

        #[tokio::test]
        async fn a_dead_workers_lease_ends_on_the_test_clock() {
            let (store, _guard) = ($make_store)("kit_lease").await;
            a_dead_workers_lease_ends_on_the_clock(store).await;
        }

        #[tokio::test]
        async fn retention_runs_on_the_test_clock() {
            let (store, _guard) = ($make_store)("kit_retention").await;
            retention_runs_on_the_clock(store).await;
        }

        #[tokio::test]
        async fn run_until_idle_reports_dead_letters() {
            let (store, _guard) = ($make_store)("kit_dead").await;
            the_report_shows_dead_letters(store).await;
        }

        #[tokio::test]
        async fn run_until_idle_refuses_misuse() {
            let (store, _guard) = ($make_store)("kit_misuse").await;
            misuse_is_refused(store).await;
        }
    };
}

mod memory {
    use super::*;
    use relaybus::MemoryEventStore;

    async fn memory_store(_: &'static str) -> (MemoryEventStore, ()) {
        let store = MemoryEventStore::new();
        store.setup().await.expect("setup");
        (store, ())
    }

    test_kit_tests!(memory_store);

    /// The bound: a handler that fails twice and then succeeds, tested with no sleep,
    /// in under 100 ms.
    #[tokio::test]
    async fn fails_twice_then_succeeds_in_under_100_ms() {
        let (store, ()) = memory_store("").await;
        let took = fails_twice_then_succeeds(store).await;
        assert!(took < Duration::from_millis(100), "took {took:?}");
    }
}

mod mongo {
    use super::*;
    use relaybus::MongoEventStore;
    use relaybus_harness::{TestDb, test_db};

    async fn mongo_store(test: &'static str) -> (MongoEventStore, TestDb) {
        let db = test_db(test).await;
        let store = MongoEventStore::builder(db.client.clone())
            .database(&db.name)
            .build()
            .expect("valid options");
        store.setup().await.expect("setup");
        (store, db)
    }

    test_kit_tests!(mongo_store);
}
