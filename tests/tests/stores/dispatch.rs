//! The bus and its dispatcher on a real replica set: handlers, retries, transactional handlers,
//! wake-up and graceful shutdown.

use std::{
    collections::HashMap,
    sync::{
        Arc, Mutex,
        atomic::{AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use mongodb::{
    Client,
    bson::{Document, doc},
    event::{EventHandler, command::CommandEvent},
    options::ClientOptions,
};
use relaybus::{
    BoxError, ConfigurationError, EventEnvelope, HandlerContext, MongoEventStore, RelayBus,
    RelayBusBuilder, RetryPolicy, State, Subscription,
};
use relaybus_harness::test_db;
use relaybus_tests::support::{
    OrderPlaced, all, bare_store, deliveries, next, noop, placed, publisher, reports_attempt,
    starts_and_hangs, store, store_on,
};
use tokio::sync::mpsc;

/// A bus tuned for tests: short polls and leases, quick retries.
fn builder(store: &MongoEventStore) -> RelayBusBuilder {
    RelayBus::builder(store.clone())
        .poll_interval(Duration::from_millis(50))
        .lease_duration(Duration::from_secs(10))
        .retry(
            RetryPolicy::new(3)
                .initial_backoff(Duration::from_millis(50))
                .max_backoff(Duration::from_secs(1)),
        )
        .shutdown_timeout(Duration::from_secs(5))
}

async fn publish(bus: &RelayBus, order: &str, key: Option<&str>) -> String {
    let mut envelope = EventEnvelope::new(&placed(order)).unwrap();
    if let Some(key) = key {
        envelope = envelope.with_key(key).unwrap();
    }
    bus.publish_envelope(envelope).await.unwrap().event_id
}

/// Publishes `n` orders (`o-0`, `o-1`, ...) for `handler`, in one transaction.
async fn publish_orders(store: &MongoEventStore, handler: &str, n: usize) {
    let envelopes: Vec<EventEnvelope> = (0..n)
        .map(|i| EventEnvelope::new(&placed(&format!("o-{i}"))).unwrap())
        .collect();
    publisher(store, &[handler])
        .publish_all(envelopes)
        .await
        .unwrap();
}

#[tokio::test]
async fn a_handler_that_fails_twice_runs_three_times_with_growing_delays() {
    let db = test_db("retry").await;
    let store = store(&db).await;
    publish(&publisher(&store, &["flaky"]), "o-1", None).await;

    let (tx, mut rx) = mpsc::unbounded_channel();
    let bus = builder(&store)
        .subscribe(Subscription::new(
            "flaky",
            move |_: OrderPlaced, ctx: HandlerContext| {
                let tx = tx.clone();
                async move {
                    tx.send((Instant::now(), ctx.attempt())).unwrap();
                    if ctx.attempt() < 3 {
                        Err(BoxError::from(format!("attempt {} failed", ctx.attempt())))
                    } else {
                        Ok(())
                    }
                }
            },
        ))
        .build()
        .unwrap();
    bus.start().await.unwrap();
    let (t1, a1) = next(&mut rx, "attempt 1").await;
    let (t2, a2) = next(&mut rx, "attempt 2").await;
    let (t3, a3) = next(&mut rx, "attempt 3").await;
    bus.shutdown().await.unwrap();

    assert_eq!((a1, a2, a3), (1, 2, 3));
    let first_wait = t2 - t1;
    let second_wait = t3 - t2;
    // Backoff 50 ms then 100 ms, each with up to a quarter of jitter taken off. Only lower
    // bounds hold on a busy machine (a claim can come late); an undoubled second backoff
    // (at most 50 ms) would stay under the second one.
    assert!(first_wait >= Duration::from_millis(37), "{first_wait:?}");
    assert!(
        second_wait >= Duration::from_millis(75),
        "{first_wait:?} then {second_wait:?}"
    );
    assert!(
        deliveries(&db).await.is_empty(),
        "completed after the third run"
    );
    assert!(rx.try_recv().is_err(), "no fourth run");
}

#[tokio::test]
async fn a_handler_that_always_fails_is_buried_and_runs_again_after_requeue() {
    let db = test_db("bury").await;
    let store = store(&db).await;
    publish(&publisher(&store, &["doomed"]), "o-1", None).await;

    let (tx, mut rx) = mpsc::unbounded_channel();
    let failing = builder(&store)
        .subscribe(Subscription::new(
            "doomed",
            move |_: OrderPlaced, ctx: HandlerContext| {
                let tx = tx.clone();
                async move {
                    tx.send(ctx.attempt()).unwrap();
                    Err::<(), BoxError>("the mail server said no".into())
                }
            },
        ))
        .build()
        .unwrap();
    failing.start().await.unwrap();
    for attempt in 1..=3 {
        assert_eq!(next(&mut rx, "a failed attempt").await, attempt);
    }
    failing.shutdown().await.unwrap();
    assert!(rx.try_recv().is_err(), "no attempt after the last");

    let dead = deliveries(&db).await;
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].get_str("status").unwrap(), "dead");
    assert_eq!(dead[0].get_i32("attempts").unwrap(), 3);
    assert!(
        dead[0]
            .get_str("lastError")
            .unwrap()
            .contains("the mail server said no")
    );

    let id = dead[0].get_object_id("_id").unwrap().to_hex();
    let requeued = store
        .requeue(&[id], mongodb::bson::DateTime::now())
        .await
        .unwrap();
    assert_eq!(requeued.requeued.len(), 1);

    let (tx, mut rx) = mpsc::unbounded_channel();
    let fixed = builder(&store)
        .subscribe(reports_attempt::<OrderPlaced>("doomed", tx))
        .build()
        .unwrap();
    fixed.start().await.unwrap();
    next(&mut rx, "the run after requeue").await;
    fixed.shutdown().await.unwrap();
    assert!(deliveries(&db).await.is_empty());
}

/// How a transactional handler ends.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Ending {
    Succeed,
    Fail,
    Panic,
}

#[tokio::test]
async fn a_transactional_handler_commits_its_writes_with_the_completion_only() {
    for ending in [Ending::Succeed, Ending::Fail, Ending::Panic] {
        let db = test_db("transactional").await;
        let store = store(&db).await;
        let event_id = publish(&publisher(&store, &["projector"]), "o-1", None).await;
        let projections = db.db().collection::<Document>("projections");

        let (tx, mut rx) = mpsc::unbounded_channel();
        let handler_projections = projections.clone();
        let bus = builder(&store)
            .retry(RetryPolicy::new(1))
            .subscribe(
                Subscription::new(
                    "projector",
                    move |event: OrderPlaced, ctx: HandlerContext| {
                        let (tx, projections) = (tx.clone(), handler_projections.clone());
                        async move {
                            {
                                let mut session = ctx.session().await?;
                                projections
                                    .insert_one(doc! { "order": &event.order_id })
                                    .session(&mut *session)
                                    .await?;
                            }
                            tx.send(()).unwrap();
                            match ending {
                                Ending::Succeed => Ok::<(), BoxError>(()),
                                Ending::Fail => Err("projection rejected".into()),
                                Ending::Panic => panic!("projector bug"),
                            }
                        }
                    },
                )
                .transactional(),
            )
            .build()
            .unwrap();
        bus.start().await.unwrap();
        next(&mut rx, "the transactional handler").await;
        bus.shutdown().await.unwrap();

        let written = projections.count_documents(doc! {}).await.unwrap();
        let left = deliveries(&db).await;
        match ending {
            Ending::Succeed => {
                assert_eq!(written, 1, "{ending:?}");
                assert!(left.is_empty(), "{ending:?}: completed with the write");
                let event = db
                    .db()
                    .collection::<Document>("relaybus_events")
                    .find_one(doc! { "_id": &event_id })
                    .await
                    .unwrap()
                    .unwrap();
                // Completed at once in the handler's transaction: a quick completion of a
                // fresh event, which leaves the event unstamped.
                assert_eq!(event.get_bool("fresh"), Ok(true), "{event}");
                assert!(!event.contains_key("completedAt"), "{event}");
            }
            Ending::Fail | Ending::Panic => {
                assert_eq!(written, 0, "{ending:?}: the write was rolled back");
                assert_eq!(left.len(), 1, "{ending:?}");
                assert_eq!(left[0].get_str("status").unwrap(), "dead", "{ending:?}");
                let error = left[0].get_str("lastError").unwrap();
                let expected = if ending == Ending::Fail {
                    "projection rejected"
                } else {
                    "handler panicked: projector bug"
                };
                assert!(error.contains(expected), "{ending:?}: {error}");
            }
        }
    }
}

#[tokio::test]
async fn a_non_transactional_handler_has_no_session() {
    let db = test_db("no_session").await;
    let store = store(&db).await;
    publish(&publisher(&store, &["plain"]), "o-1", None).await;
    let (tx, mut rx) = mpsc::unbounded_channel();
    let bus = builder(&store)
        .retry(RetryPolicy::new(1))
        .subscribe(Subscription::new(
            "plain",
            move |_: OrderPlaced, ctx: HandlerContext| {
                let tx = tx.clone();
                async move {
                    let error = ctx.session().await.unwrap_err();
                    tx.send(error.to_string()).unwrap();
                    Ok::<(), BoxError>(())
                }
            },
        ))
        .build()
        .unwrap();
    bus.run_once().await.unwrap();
    let message = next(&mut rx, "the handler").await;
    assert!(message.contains("transactional"), "{message}");
}

#[tokio::test]
async fn two_buses_process_each_delivery_once() {
    const EVENTS: usize = 200;
    let db = test_db("two_buses").await;
    let store = store(&db).await;
    let publisher = publisher(&store, &["counter"]);
    let envelopes: Vec<EventEnvelope> = (0..EVENTS)
        .map(|i| EventEnvelope::new(&placed(&format!("o-{i}"))).unwrap())
        .collect();
    publisher.publish_all(envelopes).await.unwrap();

    let runs: Arc<Mutex<HashMap<String, usize>>> = Arc::default();
    let (tx, mut rx) = mpsc::unbounded_channel();
    let bus = |name: &str| {
        let (runs, tx) = (Arc::clone(&runs), tx.clone());
        builder(&store)
            .owner(name)
            .batch_size(16)
            .subscribe(Subscription::new(
                "counter",
                move |event: OrderPlaced, _: HandlerContext| {
                    let (runs, tx) = (Arc::clone(&runs), tx.clone());
                    async move {
                        *runs.lock().unwrap().entry(event.order_id).or_default() += 1;
                        tx.send(()).unwrap();
                        Ok::<(), BoxError>(())
                    }
                },
            ))
            .build()
            .unwrap()
    };
    let (a, b) = (bus("worker-a"), bus("worker-b"));
    a.start().await.unwrap();
    b.start().await.unwrap();
    for _ in 0..EVENTS {
        next(&mut rx, "a handler run").await;
    }
    a.shutdown().await.unwrap();
    b.shutdown().await.unwrap();

    let runs = runs.lock().unwrap().clone();
    assert_eq!(runs.len(), EVENTS);
    assert!(runs.values().all(|n| *n == 1), "each event ran once");
    assert!(deliveries(&db).await.is_empty());
}

#[tokio::test]
async fn per_key_order_holds_end_to_end_across_three_buses() {
    const KEYS: usize = 8;
    const PER_KEY: usize = 25;
    let db = test_db("order_e2e").await;
    let store = store(&db).await;
    let publisher = publisher(&store, &["ordered"]);
    // Interleaved keys, published in batches as a busy service would.
    let mut envelopes = Vec::new();
    for i in 0..PER_KEY {
        for k in 0..KEYS {
            envelopes.push(
                EventEnvelope::new(&placed(&format!("{i}")))
                    .unwrap()
                    .with_key(format!("key-{k}"))
                    .unwrap(),
            );
        }
    }
    publisher.publish_all(envelopes).await.unwrap();

    let seen: Arc<Mutex<Vec<(String, i64)>>> = Arc::default();
    let (tx, mut rx) = mpsc::unbounded_channel();
    let buses: Vec<RelayBus> = (0..3)
        .map(|n| {
            let (seen, tx) = (Arc::clone(&seen), tx.clone());
            builder(&store)
                .owner(format!("worker-{n}"))
                .batch_size(4)
                .subscribe(Subscription::new(
                    "ordered",
                    move |_: OrderPlaced, ctx: HandlerContext| {
                        let (seen, tx) = (Arc::clone(&seen), tx.clone());
                        async move {
                            let key = ctx.key().unwrap().to_owned();
                            seen.lock().unwrap().push((key, ctx.sequence().unwrap()));
                            // Give other deliveries of the key a chance to overtake, if they could.
                            tokio::task::yield_now().await;
                            tx.send(()).unwrap();
                            Ok::<(), BoxError>(())
                        }
                    },
                ))
                .build()
                .unwrap()
        })
        .collect();
    for bus in &buses {
        bus.start().await.unwrap();
    }
    for _ in 0..KEYS * PER_KEY {
        next(&mut rx, "a handler run").await;
    }
    for bus in &buses {
        bus.shutdown().await.unwrap();
    }
    let seen = seen.lock().unwrap().clone();
    for k in 0..KEYS {
        let key = format!("key-{k}");
        let order: Vec<i64> = seen
            .iter()
            .filter(|(seen_key, _)| *seen_key == key)
            .map(|(_, sequence)| *sequence)
            .collect();
        assert_eq!(
            order,
            (1..=PER_KEY as i64).collect::<Vec<_>>(),
            "{key} ran in sequence order, each once"
        );
    }
}

#[tokio::test]
async fn shutdown_releases_running_deliveries_and_another_bus_takes_them_at_once() {
    let db = test_db("shutdown").await;
    let store = store(&db).await;
    publish(&publisher(&store, &["slow"]), "o-1", Some("k")).await;

    let (started_tx, mut started) = mpsc::unbounded_channel();
    let stuck = builder(&store)
        .owner("stuck")
        .lease_duration(Duration::from_secs(600))
        .shutdown_timeout(Duration::from_millis(200))
        .subscribe(starts_and_hangs::<OrderPlaced>("slow", started_tx))
        .build()
        .unwrap();
    stuck.start().await.unwrap();
    next(&mut started, "the slow handler to start").await;
    stuck.shutdown().await.unwrap();
    stuck.shutdown().await.unwrap(); // idempotent

    assert_eq!(
        lanes_held_by(&db, "stuck").await,
        0,
        "every lane was handed back"
    );

    // Another worker gets the delivery now, with the lease of 600 s still far from its end,
    // and the released attempt was not charged.
    let (tx, mut rx) = mpsc::unbounded_channel();
    let other = builder(&store)
        .owner("other")
        .subscribe(reports_attempt::<OrderPlaced>("slow", tx))
        .build()
        .unwrap();
    let report = other.run_once().await.unwrap();
    assert_eq!(report.claimed, 1);
    assert_eq!(report.completed, 1);
    assert_eq!(next(&mut rx, "the other worker's run").await, 1);
    assert!(deliveries(&db).await.is_empty());
}

/// How many lanes `owner` holds.
async fn lanes_held_by(db: &relaybus_harness::TestDb, owner: &str) -> u64 {
    db.db()
        .collection::<Document>("relaybus_lanes")
        .count_documents(doc! { "owner": owner })
        .await
        .unwrap()
}

#[tokio::test]
async fn a_panicking_handler_is_retried_and_the_dispatcher_keeps_running() {
    let db = test_db("panic").await;
    let store = store(&db).await;
    let publisher = publisher(&store, &["fragile"]);
    publish(&publisher, "boom", None).await;
    publish(&publisher, "fine", None).await;

    let (tx, mut rx) = mpsc::unbounded_channel();
    let bus = builder(&store)
        .subscribe(Subscription::new(
            "fragile",
            move |event: OrderPlaced, ctx: HandlerContext| {
                let tx = tx.clone();
                async move {
                    if event.order_id == "boom" && ctx.attempt() == 1 {
                        panic!("first run of boom");
                    }
                    tx.send((event.order_id, ctx.attempt())).unwrap();
                    Ok::<(), BoxError>(())
                }
            },
        ))
        .build()
        .unwrap();
    bus.start().await.unwrap();
    let mut done = vec![
        next(&mut rx, "a run").await,
        next(&mut rx, "another run").await,
    ];
    bus.shutdown().await.unwrap();
    done.sort();
    assert_eq!(done, [("boom".to_owned(), 2), ("fine".to_owned(), 1)]);
    assert!(deliveries(&db).await.is_empty());
}

#[tokio::test]
async fn a_busy_bus_claims_on_while_its_completions_land_and_never_waits_for_a_poll() {
    // The dispatcher completes deliveries while it claims more. A claim whose read saw a
    // delivery that a completion deleted and let go of just after took it for somebody else's
    // claim: it reconciled (a transaction), and when that happened twice in a row it came back
    // empty and the bus waited a whole poll interval with work due. Without the change stream
    // and with a one-minute poll, such a wait fails this; a reconciliation fails it too.
    const EVENTS: usize = 2_000;
    let db = test_db("busy").await;
    let transactions = Arc::new(AtomicUsize::new(0));
    let mut options = ClientOptions::parse(&db.uri).await.unwrap();
    let counter = Arc::clone(&transactions);
    options.command_event_handler = Some(EventHandler::callback(move |event| {
        if let CommandEvent::Started(started) = event
            && started.command_name == "commitTransaction"
        {
            counter.fetch_add(1, Ordering::SeqCst);
        }
    }));
    let client = Client::with_options(options).unwrap();
    let store = store_on(&client, &db).await;
    publish_orders(&store, "busy", EVENTS).await;
    let published = transactions.load(Ordering::SeqCst);
    let (tx, mut rx) = mpsc::unbounded_channel();
    let bus = builder(&store)
        .poll_interval(Duration::from_secs(60))
        .lease_duration(Duration::from_secs(120))
        .change_stream(false)
        .batch_size(32)
        .subscribe(Subscription::new(
            "busy",
            move |_: OrderPlaced, _: HandlerContext| {
                let tx = tx.clone();
                async move {
                    tx.send(()).unwrap();
                    Ok::<(), BoxError>(())
                }
            },
        ))
        .build()
        .unwrap();
    bus.start().await.unwrap();
    for _ in 0..EVENTS {
        next(&mut rx, "a handler run, well before the next poll").await;
    }
    bus.shutdown().await.unwrap();
    assert!(deliveries(&db).await.is_empty(), "every delivery completed");
    assert_eq!(
        transactions.load(Ordering::SeqCst) - published,
        0,
        "no claim reconciled"
    );
}

#[tokio::test]
async fn the_change_stream_wakes_an_idle_dispatcher() {
    let db = test_db("wake").await;
    let store = store(&db).await;
    let (tx, mut rx) = mpsc::unbounded_channel();
    let bus = builder(&store)
        // Without the change stream, a publish would wait a minute for the next poll.
        .poll_interval(Duration::from_secs(60))
        .lease_duration(Duration::from_secs(120))
        .subscribe(Subscription::new(
            "woken",
            move |_: OrderPlaced, _: HandlerContext| {
                let tx = tx.clone();
                async move {
                    tx.send(Instant::now()).unwrap();
                    Ok::<(), BoxError>(())
                }
            },
        ))
        .build()
        .unwrap();
    bus.start().await.unwrap();
    // Let the dispatcher go idle: its first claim finds nothing.
    assert_eq!(
        store.statistics().await.unwrap().pending,
        0,
        "nothing to do before the publish"
    );
    let mut latencies = Vec::new();
    for i in 0..3 {
        let published = Instant::now();
        publish(&bus, &format!("o-{i}"), None).await;
        let handled = next(&mut rx, "the woken handler").await;
        latencies.push(handled - published);
    }
    bus.shutdown().await.unwrap();
    // Far below the minute a poll would take.
    assert!(
        latencies.iter().all(|l| *l < Duration::from_secs(10)),
        "{latencies:?}"
    );
}

#[tokio::test]
async fn a_wake_up_into_a_lane_a_dead_worker_held_charges_its_claim_and_keeps_key_order() {
    let db = test_db("wake_dead_lane").await;
    let store = store(&db).await;
    let (tx, mut rx) = mpsc::unbounded_channel();
    let bus = builder(&store)
        // Only the change stream's wake-up can find the work within the test.
        .poll_interval(Duration::from_secs(60))
        .lease_duration(Duration::from_secs(120))
        .subscribe(reports_attempt::<OrderPlaced>("woken", tx))
        .build()
        .unwrap();

    // A worker claims the first order of key `k` under a short lease and dies with it.
    publish(&bus, "o-1", Some("k")).await;
    let dead = bare_store(&db);
    let lease = Duration::from_millis(300);
    let claimed = dead
        .claim("dead", &["woken"], 1, lease, mongodb::bson::DateTime::now())
        .await
        .unwrap();
    assert_eq!(claimed.len(), 1);
    let lane = claimed[0].lease().lane() as i32;

    // The bus starts while that lane is still leased, and goes idle.
    bus.start().await.unwrap();
    tokio::time::sleep(lease + Duration::from_millis(100)).await;

    // A new order of the same key wakes it: the reported lane is free again but lists the dead
    // worker's claim, which is charged before the lane is read.
    publish(&bus, "o-2", Some("k")).await;
    assert_eq!(next(&mut rx, "the dead worker's order").await, 2);
    assert_eq!(next(&mut rx, "the new order, after it").await, 1);
    bus.shutdown().await.unwrap();
    assert!(deliveries(&db).await.is_empty());
    let lanes = all(&db, "relaybus_lanes").await;
    let taken = &lanes[lane as usize];
    assert_eq!(taken.get_i32("_id"), Ok(lane));
    assert!(taken.get_i64("epoch").unwrap() >= 2, "{taken:?}");
}

#[tokio::test]
async fn bad_builder_settings_are_refused() {
    let db = test_db("bad_builder").await;
    let store = bare_store(&db);
    let cases: Vec<(&str, RelayBusBuilder)> = vec![
        ("batch_size", RelayBus::builder(store.clone()).batch_size(0)),
        (
            "batch_size",
            RelayBus::builder(store.clone()).batch_size(1_001),
        ),
        (
            "concurrency",
            RelayBus::builder(store.clone()).concurrency(0),
        ),
        (
            "lease_duration",
            RelayBus::builder(store.clone())
                .poll_interval(Duration::from_secs(5))
                .lease_duration(Duration::from_secs(5)),
        ),
        (
            "poll_interval",
            RelayBus::builder(store.clone()).poll_interval(Duration::ZERO),
        ),
        ("owner", RelayBus::builder(store.clone()).owner("")),
        (
            "retry",
            RelayBus::builder(store.clone()).retry(RetryPolicy::new(0)),
        ),
        (
            "retry",
            RelayBus::builder(store.clone()).retry(
                RetryPolicy::new(3)
                    .initial_backoff(Duration::from_secs(10))
                    .max_backoff(Duration::from_secs(1)),
            ),
        ),
        (
            "retention",
            RelayBus::builder(store.clone()).retention(Some(relaybus::Retention {
                interval: Duration::ZERO,
                ..relaybus::Retention::default()
            })),
        ),
    ];
    for (option, builder) in cases {
        match builder.build() {
            Err(ConfigurationError::InvalidOption { option: got, .. }) => {
                assert_eq!(got, option)
            }
            other => panic!("{option}: expected an invalid option, got {other:?}"),
        }
    }
    assert!(db.db().list_collection_names().await.unwrap().is_empty());
}

#[tokio::test]
async fn a_payload_that_no_longer_deserializes_is_a_failed_attempt_with_a_clear_message() {
    let db = test_db("bad_payload").await;
    let store = store(&db).await;
    let publisher = publisher(&store, &["strict"]);
    // Published by an older version of the service: no `order_id`.
    let old = EventEnvelope::from_json("order.placed.v1", serde_json::json!({ "id": 7 })).unwrap();
    publisher.publish_envelope(old).await.unwrap();

    let bus = builder(&store)
        .retry(RetryPolicy::new(1))
        .subscribe(noop::<OrderPlaced>("strict"))
        .build()
        .unwrap();
    let report = bus.run_once().await.unwrap();
    assert_eq!((report.claimed, report.completed, report.other), (1, 0, 1));
    let dead = deliveries(&db).await;
    assert_eq!(dead[0].get_str("status").unwrap(), "dead");
    let error = dead[0].get_str("lastError").unwrap();
    assert!(
        error.contains("no longer deserializes") && error.contains("order_id"),
        "{error}"
    );
}

/// The attempts a stored delivery records, 0 when it records none.
fn attempts(doc: &Document) -> i64 {
    match doc.get("attempts") {
        Some(mongodb::bson::Bson::Int32(n)) => i64::from(*n),
        Some(mongodb::bson::Bson::Int64(n)) => *n,
        _ => 0,
    }
}

/// An error that lets a transaction run again, as a store reports a write conflict.
fn transient_error() -> BoxError {
    relaybus::Error::Database(
        relaybus::DatabaseError::new(std::io::Error::other("write conflict")).with_transient(true),
    )
    .into()
}

#[tokio::test]
async fn a_transient_failure_is_known_by_its_type_and_stored_as_its_own_text() {
    let db = test_db("transient_text").await;
    let store = store(&db).await;
    publish(&publisher(&store, &["conflicting", "marked"]), "o-1", None).await;
    let bus = builder(&store)
        .without_registered_handlers()
        .subscribe(Subscription::new(
            "conflicting",
            |_: OrderPlaced, _: HandlerContext| async { Err::<(), BoxError>(transient_error()) },
        ))
        // Not transient, whatever its text says: it is charged at once, not retried as a
        // transaction.
        .subscribe(
            Subscription::new("marked", |_: OrderPlaced, _: HandlerContext| async {
                Err::<(), BoxError>("broken [transient transaction error]".into())
            })
            .transactional(),
        )
        .build()
        .unwrap();
    let report = tokio::time::timeout(Duration::from_secs(30), bus.run_once())
        .await
        .expect("a plain failure is not retried as a transient one")
        .unwrap();
    assert_eq!(report.claimed, 2);
    let stored: HashMap<String, Document> = deliveries(&db)
        .await
        .into_iter()
        .map(|d| (d.get_str("handler").unwrap().to_owned(), d))
        .collect();
    assert_eq!(
        stored["conflicting"].get_str("lastError"),
        Ok("database error: write conflict"),
        "the stored error is the handler's, with no mark"
    );
    assert_eq!(
        stored["marked"].get_str("lastError"),
        Ok("broken [transient transaction error]")
    );
    for doc in stored.values() {
        assert_eq!(attempts(doc), 1, "{doc}");
    }
}

#[tokio::test]
async fn a_transactional_handler_stops_retrying_before_its_lease_ends_and_is_not_charged() {
    let db = test_db("transient_lease").await;
    let store = store(&db).await;
    publish(&publisher(&store, &["conflicting"]), "o-1", None).await;
    // When each run of the handler started: the lease begins with the claim, just before the
    // first.
    let runs = Arc::new(std::sync::Mutex::new(Vec::<Instant>::new()));
    let counted = Arc::clone(&runs);
    let lease = Duration::from_secs(2);
    let bus = builder(&store)
        .lease_duration(lease)
        .without_registered_handlers()
        .subscribe(
            Subscription::new("conflicting", move |_: OrderPlaced, _: HandlerContext| {
                counted.lock().unwrap().push(Instant::now());
                async { Err::<(), BoxError>(transient_error()) }
            })
            .transactional(),
        )
        .build()
        .unwrap();
    let report = tokio::time::timeout(Duration::from_secs(30), bus.run_once())
        .await
        .expect("the handler's transaction is retried only within its lease")
        .unwrap();
    assert_eq!(report.claimed, 1);
    let runs = runs.lock().unwrap().clone();
    assert!(
        runs.len() > 1,
        "a transient error runs the transaction again"
    );
    let retried_for = runs[runs.len() - 1].duration_since(runs[0]);
    assert!(
        retried_for < lease,
        "the last run started {retried_for:?} after the first, past the lease of {lease:?}"
    );
    let doc = &deliveries(&db).await[0];
    assert_eq!(doc.get_str("status"), Ok("pending"));
    assert_eq!(attempts(doc), 0, "given back uncharged: {doc}");
}

#[tokio::test]
async fn a_permanent_failure_is_buried_at_once() {
    let db = test_db("permanent").await;
    let store = store(&db).await;
    publish(&publisher(&store, &["billing"]), "o-1", None).await;
    let bus = builder(&store)
        .without_registered_handlers()
        .subscribe(Subscription::new(
            "billing",
            |_: OrderPlaced, _: HandlerContext| async {
                Err::<(), BoxError>(
                    relaybus::Permanent::new("a negative total cannot be billed").into(),
                )
            },
        ))
        .build()
        .unwrap();
    assert_eq!(bus.run_once().await.unwrap().claimed, 1);
    let doc = &deliveries(&db).await[0];
    assert_eq!(doc.get_str("status"), Ok("dead"), "{doc}");
    assert_eq!(attempts(doc), 1, "no retry was spent: {doc}");
    assert_eq!(
        doc.get_str("lastError"),
        Ok("a negative total cannot be billed")
    );
}

#[tokio::test]
async fn a_handler_past_its_timeout_fails_its_attempt() {
    let db = test_db("timeout").await;
    let store = store(&db).await;
    publish(&publisher(&store, &["hung"]), "o-1", None).await;
    let bus = builder(&store)
        .without_registered_handlers()
        .subscribe(
            Subscription::new("hung", |_: OrderPlaced, _: HandlerContext| {
                std::future::pending::<Result<(), BoxError>>()
            })
            .timeout(Duration::from_millis(100))
            .retry(RetryPolicy::new(1)),
        )
        .build()
        .unwrap();
    let report = tokio::time::timeout(Duration::from_secs(30), bus.run_once())
        .await
        .expect("the hung handler is stopped at its timeout")
        .unwrap();
    assert_eq!(report.claimed, 1);
    let doc = &deliveries(&db).await[0];
    assert_eq!(doc.get_str("status"), Ok("dead"), "{doc}");
    assert!(
        doc.get_str("lastError")
            .unwrap()
            .contains("timeout of 100ms"),
        "{doc}"
    );
}

#[tokio::test]
async fn a_zero_attempt_timeout_is_refused_naming_the_handler() {
    let db = test_db("zero_timeout").await;
    let store = store(&db).await;
    let error = builder(&store)
        .without_registered_handlers()
        .subscribe(noop::<OrderPlaced>("hung").timeout(Duration::ZERO))
        .build()
        .unwrap_err();
    assert!(
        matches!(&error, ConfigurationError::InvalidOption { option: "timeout", reason } if reason.contains("\"hung\"")),
        "{error}"
    );
}

/// What the state test's handlers are given.
#[derive(Clone)]
struct Outbox(mpsc::UnboundedSender<(String, String, u32)>);

#[derive(Clone, Debug, PartialEq)]
struct Greeting(&'static str);

#[tokio::test]
async fn handlers_take_the_state_given_to_the_bus_in_any_argument_order() {
    let db = test_db("state").await;
    let store = store(&db).await;
    publish(&publisher(&store, &["greeter", "counter"]), "o-1", None).await;

    let (tx, mut rx) = mpsc::unbounded_channel();
    let bus = builder(&store)
        .state(Outbox(tx))
        .state(Greeting("hello"))
        .subscribe(Subscription::new(
            "greeter",
            |event: relaybus_tests::support::OrderPlaced,
             State(Outbox(out)): State<Outbox>,
             greeting: State<Greeting>| async move {
                out.send((
                    "greeter".into(),
                    format!("{} {}", greeting.0.0, event.order_id),
                    0,
                ))
                .map_err(|_| "the test ended")?;
                Ok::<(), BoxError>(())
            },
        ))
        .subscribe(
            Subscription::new(
                "counter",
                |event: relaybus_tests::support::OrderPlaced,
                 State(Greeting(word)): State<Greeting>,
                 context: HandlerContext,
                 State(Outbox(out)): State<Outbox>| async move {
                    // The context comes with the state, transactional session and all.
                    let session = context.session().await?;
                    drop(session);
                    out.send((
                        "counter".into(),
                        format!("{word} {}", event.order_id),
                        context.attempt(),
                    ))
                    .map_err(|_| "the test ended")?;
                    Ok::<(), BoxError>(())
                },
            )
            .transactional(),
        )
        .build()
        .unwrap();
    assert_eq!(bus.run_once().await.unwrap().completed, 2);
    let mut got = vec![rx.try_recv().unwrap(), rx.try_recv().unwrap()];
    got.sort();
    assert_eq!(
        got,
        [
            ("counter".into(), "hello o-1".into(), 1),
            ("greeter".into(), "hello o-1".into(), 0)
        ]
    );
    assert!(rx.try_recv().is_err(), "each handler ran once");
}

#[tokio::test]
async fn an_unordered_handler_runs_a_keys_events_at_once_while_an_ordered_one_keeps_their_order() {
    let db = test_db("unordered_e2e").await;
    let store = store(&db).await;
    // A process that only publishes: it registers both handlers, `loose` as unordered, and
    // runs neither. What each handler needs is recorded with its deliveries.
    let publisher = RelayBus::builder(store.clone())
        .subscribe(noop::<OrderPlaced>("in-order"))
        .subscribe(noop::<OrderPlaced>("loose").unordered())
        .build()
        .unwrap();
    for i in 1..=3 {
        publish(&publisher, &format!("o-{i}"), Some("customer-1")).await;
    }

    // The worker runs both. Its own subscription of `loose` need not say unordered: it runs
    // the deliveries as they were published.
    let barrier = Arc::new(tokio::sync::Barrier::new(3));
    let release = Arc::new(tokio::sync::Notify::new());
    let (loose_tx, mut loose_rx) = mpsc::unbounded_channel();
    let (ordered_tx, mut ordered_rx) = mpsc::unbounded_channel();
    let held = Arc::clone(&release);
    let worker = builder(&store)
        .subscribe(Subscription::new(
            "loose",
            move |_: OrderPlaced, ctx: HandlerContext| {
                let (barrier, tx) = (Arc::clone(&barrier), loose_tx.clone());
                async move {
                    // The three runs pass only together: they must run at once.
                    barrier.wait().await;
                    tx.send((ctx.key().map(str::to_owned), ctx.sequence()))
                        .unwrap();
                    Ok::<(), BoxError>(())
                }
            },
        ))
        .subscribe(Subscription::new(
            "in-order",
            move |_: OrderPlaced, ctx: HandlerContext| {
                let (held, tx) = (Arc::clone(&held), ordered_tx.clone());
                async move {
                    tx.send(ctx.sequence()).unwrap();
                    if ctx.sequence() == Some(1) {
                        // The head holds its key until the test lets it go.
                        held.notified().await;
                    }
                    Ok::<(), BoxError>(())
                }
            },
        ))
        .build()
        .unwrap();
    worker.start().await.unwrap();

    let mut loose = Vec::new();
    for _ in 0..3 {
        loose.push(next(&mut loose_rx, "a run of the unordered handler").await);
    }
    loose.sort();
    let key = Some("customer-1".to_owned());
    assert_eq!(
        loose,
        [
            (key.clone(), Some(1)),
            (key.clone(), Some(2)),
            (key, Some(3))
        ],
        "the unordered handler sees the key and the sequences"
    );
    assert_eq!(next(&mut ordered_rx, "the ordered head").await, Some(1));
    assert!(
        ordered_rx.try_recv().is_err(),
        "an ordered follower ran while its head runs"
    );
    release.notify_one();
    assert_eq!(next(&mut ordered_rx, "the second").await, Some(2));
    assert_eq!(next(&mut ordered_rx, "the third").await, Some(3));
    worker.shutdown().await.unwrap();
}

/// One run of [`projector_on_one_slot`]'s handler.
#[derive(Debug)]
struct ProjectorRun {
    order: String,
    attempt: u32,
}

/// A bus with one handler slot and a transactional `projector` that reports each of its runs.
fn projector_on_one_slot(
    store: &MongoEventStore,
) -> (RelayBus, mpsc::UnboundedReceiver<ProjectorRun>) {
    let (tx, rx) = mpsc::unbounded_channel();
    let bus = builder(store)
        .concurrency(1)
        .subscribe(
            Subscription::new(
                "projector",
                move |event: OrderPlaced, ctx: HandlerContext| {
                    let tx = tx.clone();
                    async move {
                        tx.send(ProjectorRun {
                            order: event.order_id,
                            attempt: ctx.attempt(),
                        })
                        .unwrap();
                        Ok::<(), BoxError>(())
                    }
                },
            )
            .transactional(),
        )
        .build()
        .unwrap();
    (bus, rx)
}

#[tokio::test]
async fn a_key_s_next_delivery_claimed_while_a_commit_fails_is_given_back_uncharged_and_runs_after_it()
 {
    let db = test_db("next_of_key_commit_fails").await;
    let store = store(&db).await;
    let publisher = publisher(&store, &["projector"]);
    for n in 0..3 {
        publish(&publisher, &format!("o-{n}"), Some("customer-1")).await;
    }
    // The bus's first commit fails with a transient error: that of the first delivery, while
    // the key's second is claimed beside it.
    let fail = relaybus_tests::support::fail_command(
        &db.client,
        &db.name,
        "commitTransaction",
        1,
        112,
        "TransientTransactionError",
    )
    .await;
    let (bus, mut rx) = projector_on_one_slot(&store);
    bus.start().await.unwrap();
    let mut runs = Vec::new();
    for _ in 0..4 {
        let run = next(&mut rx, "the key's runs").await;
        runs.push((run.order, run.attempt));
    }
    bus.shutdown().await.unwrap();
    fail.disable().await.unwrap();
    let expected: Vec<(String, u32)> = [("o-0", 1), ("o-0", 1), ("o-1", 1), ("o-2", 1)]
        .into_iter()
        .map(|(order, attempt)| (order.to_owned(), attempt))
        .collect();
    assert_eq!(
        runs, expected,
        "the first again after its failed commit, then the others in order, none charged"
    );
    assert!(rx.try_recv().is_err(), "nothing else ran");
    assert!(deliveries(&db).await.is_empty());
}

#[tokio::test]
async fn a_key_s_next_event_on_an_idle_transactional_bus_runs_at_its_wake_up_not_at_the_poll() {
    let db = test_db("next_of_key_idle").await;
    let store = store(&db).await;
    let publisher = publisher(&store, &["projector"]);
    let (tx, mut rx) = mpsc::unbounded_channel();
    // Only the change stream wakes the bus: a poll would come after the test's timeout.
    let bus = builder(&store)
        .poll_interval(Duration::from_secs(60))
        .lease_duration(Duration::from_secs(120))
        .subscribe(
            Subscription::new("projector", move |event: OrderPlaced, _: HandlerContext| {
                let tx = tx.clone();
                async move {
                    tx.send(event.order_id).unwrap();
                    Ok::<(), BoxError>(())
                }
            })
            .transactional(),
        )
        .build()
        .unwrap();
    bus.start().await.unwrap();
    // Each event of the key comes after the last has run and found no next delivery.
    for n in 0..3 {
        let order = format!("o-{n}");
        publish(&publisher, &order, Some("customer-1")).await;
        assert_eq!(
            next(&mut rx, "the key's event, at its wake-up").await,
            order
        );
    }
    bus.shutdown().await.unwrap();
    assert!(deliveries(&db).await.is_empty());
}

/// What the dispatcher's claims asked for and got: the `limit` of each claim span, and the
/// `claimed` count of each claim that returned, sent as it happens.
#[derive(Clone)]
struct Claims {
    limits: Arc<Mutex<Vec<u64>>>,
    claimed: mpsc::UnboundedSender<u64>,
}

impl Claims {
    fn new() -> (Claims, mpsc::UnboundedReceiver<u64>) {
        let (claimed, returned) = mpsc::unbounded_channel();
        let claims = Claims {
            limits: Arc::default(),
            claimed,
        };
        (claims, returned)
    }

    fn limits(&self) -> Vec<u64> {
        self.limits.lock().unwrap().clone()
    }
}

/// The first `u64` field of that name a span or event records.
struct Field(&'static str, Option<u64>);

impl tracing::field::Visit for Field {
    fn record_u64(&mut self, field: &tracing::field::Field, value: u64) {
        if field.name() == self.0 {
            self.1.get_or_insert(value);
        }
    }

    fn record_i64(&mut self, field: &tracing::field::Field, value: i64) {
        if let Ok(value) = u64::try_from(value) {
            self.record_u64(field, value);
        }
    }

    fn record_debug(&mut self, _: &tracing::field::Field, _: &dyn std::fmt::Debug) {}
}

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Claims {
    fn on_new_span(
        &self,
        attrs: &tracing::span::Attributes<'_>,
        _: &tracing::span::Id,
        _: tracing_subscriber::layer::Context<'_, S>,
    ) {
        if attrs.metadata().name() == "relaybus.claim" {
            let mut limit = Field("limit", None);
            attrs.record(&mut limit);
            if let Some(limit) = limit.1 {
                self.limits.lock().unwrap().push(limit);
            }
        }
    }

    fn on_event(&self, event: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
        let mut claimed = Field("claimed", None);
        event.record(&mut claimed);
        if let Some(claimed) = claimed.1 {
            let _ = self.claimed.send(claimed);
        }
    }
}

/// A handler that counts how many of its runs overlap, and reports each order it ran.
fn counts_overlaps(
    id: &str,
    most: Arc<AtomicUsize>,
    ran: mpsc::UnboundedSender<String>,
) -> Subscription {
    let running = Arc::new(AtomicUsize::new(0));
    Subscription::new(id, move |event: OrderPlaced, _: HandlerContext| {
        let (running, most, ran) = (Arc::clone(&running), Arc::clone(&most), ran.clone());
        async move {
            let now = running.fetch_add(1, Ordering::SeqCst) + 1;
            most.fetch_max(now, Ordering::SeqCst);
            tokio::task::yield_now().await;
            running.fetch_sub(1, Ordering::SeqCst);
            ran.send(event.order_id).unwrap();
            Ok::<(), BoxError>(())
        }
    })
}

/// Runs 24 quick deliveries on a bus of 2 handler slots and batches of 4; returns the claims'
/// limits and the most handlers that ran at once.
async fn drain_with_two_slots(name: &str, claim_ahead: bool) -> (Vec<u64>, usize) {
    use tracing_subscriber::layer::SubscriberExt;

    let (claims, _returned) = Claims::new();
    // A test runs on one thread: the dispatcher's spans reach this subscriber.
    let _guard =
        tracing::subscriber::set_default(tracing_subscriber::registry().with(claims.clone()));
    let db = test_db(name).await;
    let store = store(&db).await;
    let publisher = publisher(&store, &["quick"]);
    for n in 0..24 {
        publish(&publisher, &format!("o-{n}"), None).await;
    }
    let most = Arc::new(AtomicUsize::new(0));
    let (tx, mut rx) = mpsc::unbounded_channel();
    let bus = builder(&store)
        .concurrency(2)
        .batch_size(4)
        .claim_ahead(claim_ahead)
        .subscribe(counts_overlaps("quick", Arc::clone(&most), tx))
        .build()
        .unwrap();
    // Tests on other threads without a subscriber may have registered the claim's span first,
    // while this one was being set: have every callsite ask the subscribers again.
    tracing::callsite::rebuild_interest_cache();
    bus.start().await.unwrap();
    let mut ran = std::collections::HashSet::new();
    for _ in 0..24 {
        ran.insert(next(&mut rx, "a run").await);
    }
    bus.shutdown().await.unwrap();
    assert_eq!(ran.len(), 24, "each delivery ran once");
    assert!(deliveries(&db).await.is_empty());
    (claims.limits(), most.load(Ordering::SeqCst))
}

#[tokio::test]
async fn a_bus_with_quick_handlers_claims_ahead_of_its_free_slots_but_runs_no_more_at_once() {
    let (limits, most) = drain_with_two_slots("claim_ahead", true).await;
    assert!(
        limits.iter().any(|&limit| limit > 2),
        "a claim asked for more than the 2 slots: {limits:?}"
    );
    assert!(limits.iter().all(|&limit| limit <= 4), "{limits:?}");
    assert!(most <= 2, "{most} handlers ran at once");

    let (limits, most) = drain_with_two_slots("claim_ahead_off", false).await;
    assert!(
        limits.iter().all(|&limit| limit <= 2),
        "without claiming ahead, claims ask for free slots only: {limits:?}"
    );
    assert!(most <= 2, "{most} handlers ran at once");
}

#[tokio::test]
async fn shutdown_gives_back_uncharged_what_was_claimed_ahead_and_waits_for_a_slot() {
    use tracing_subscriber::layer::SubscriberExt;

    let (claims, mut returned) = Claims::new();
    let _guard =
        tracing::subscriber::set_default(tracing_subscriber::registry().with(claims.clone()));
    let db = test_db("claim_ahead_shutdown").await;
    let store = store(&db).await;
    let publisher = publisher(&store, &["sometimes-stuck"]);
    for n in 0..12 {
        publish(&publisher, &format!("o-{n}"), None).await;
    }
    // Quick runs first, so that the bus claims ahead; then one run that never ends, holding
    // the only slot.
    let (started_tx, mut started) = mpsc::unbounded_channel();
    let runs = Arc::new(AtomicUsize::new(0));
    let counted = Arc::clone(&runs);
    let bus = builder(&store)
        .owner("ahead")
        .concurrency(1)
        .batch_size(4)
        .shutdown_timeout(Duration::from_millis(200))
        .subscribe(Subscription::new(
            "sometimes-stuck",
            move |_: OrderPlaced, _: HandlerContext| {
                let run = counted.fetch_add(1, Ordering::SeqCst) + 1;
                let started = started_tx.clone();
                async move {
                    if run == 4 {
                        started.send(()).unwrap();
                        std::future::pending::<()>().await;
                    }
                    Ok::<(), BoxError>(())
                }
            },
        ))
        .build()
        .unwrap();
    // As in `drain_with_two_slots`: the claim's span asks this subscriber again.
    tracing::callsite::rebuild_interest_cache();
    bus.start().await.unwrap();
    next(&mut started, "the run that never ends").await;
    // A claim that returns deliveries while the only slot is taken claimed them ahead.
    while returned.try_recv().is_ok() {}
    loop {
        let claimed = next(&mut returned, "a claim while the slot is taken").await;
        if claimed > 0 {
            break;
        }
    }
    bus.shutdown().await.unwrap();
    assert_eq!(
        runs.load(Ordering::SeqCst),
        4,
        "nothing ran after the stuck run"
    );

    assert_eq!(
        lanes_held_by(&db, "ahead").await,
        0,
        "every lane was handed back"
    );
    let left = deliveries(&db).await;
    assert_eq!(
        left.len(),
        12 - 3,
        "the three quick runs completed: {left:?}"
    );
    for doc in &left {
        assert_eq!(doc.get_str("status"), Ok("pending"), "{doc}");
        assert_eq!(attempts(doc), 0, "given back uncharged: {doc}");
    }
}

/// Three buses on three store instances, a handler with `global_concurrency(4)`: at most 4
/// runs at once across them, and the work drains.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn global_concurrency_holds_across_three_buses() {
    let db = test_db("global_concurrency").await;
    let stores = [
        store_on(&db.client, &db).await,
        store_on(&db.client, &db).await,
        store_on(&db.client, &db).await,
    ];
    relaybus_tests::limits::global_concurrency_holds_across_buses(stores).await;
}

/// Three buses on three store instances, a global concurrency of 2 partitioned by tenant: at
/// most 2 runs of a tenant at once, the tenants side by side.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partitioned_concurrency_holds_per_partition() {
    let db = test_db("partitioned_concurrency").await;
    let stores = [
        store_on(&db.client, &db).await,
        store_on(&db.client, &db).await,
        store_on(&db.client, &db).await,
    ];
    relaybus_tests::limits::partitioned_concurrency_holds_per_partition(stores).await;
}

/// A rate limit of 50 per second over three buses on three store instances.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rate_limit_holds_across_three_buses() {
    let db = test_db("rate_limit").await;
    let stores = [
        store_on(&db.client, &db).await,
        store_on(&db.client, &db).await,
        store_on(&db.client, &db).await,
    ];
    relaybus_tests::limits::rate_limit_holds_across_buses(stores).await;
}

/// 10,000 unkeyed events through a transactional batch handler of at most 100 that inserts one
/// document per event in the batch's transaction: each effect once, in batches of at most 100.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transactional_batches_drain_exactly_once() {
    use relaybus::Batch;
    use relaybus_tests::batches::{self, BATCHER, Batches};
    let db = test_db("batch_drain").await;
    let store = store(&db).await;
    let effects = db.db().collection::<Document>("effects");
    let recorded = Arc::new(Batches::default());
    let recorder = Arc::clone(&recorded);
    let handler = Subscription::batch(
        BATCHER,
        move |batch: Batch<OrderPlaced>, ctx: HandlerContext| {
            let (recorder, effects) = (Arc::clone(&recorder), effects.clone());
            async move {
                let rows: Vec<Document> = batch
                    .iter()
                    .map(|item| doc! { "_id": item.event_id(), "order": &item.event().order_id })
                    .collect();
                let mut session = ctx.session().await?;
                effects.insert_many(rows).session(&mut *session).await?;
                drop(session);
                recorder.record(&batch);
                Ok::<(), BoxError>(())
            }
        },
    )
    .transactional();
    let bus = batches::bus(store, handler);
    batches::drain_in_batches(&bus, &recorded, 10_000, 100).await;
    let written = db
        .db()
        .collection::<Document>("effects")
        .count_documents(doc! {})
        .await
        .unwrap();
    assert_eq!(written, 10_000, "each effect once");
}

/// Deliveries retried after a failure in their batch come back in later batches, each batch
/// holding a delivery once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_holds_each_delivery_once() {
    let db = test_db("batch_once").await;
    relaybus_tests::batches::a_batch_holds_each_delivery_once(store(&db).await).await;
}

/// Keyed events through a batch handler: each key's order holds across batches.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keyed_order_holds_across_batches() {
    let db = test_db("batch_keyed").await;
    relaybus_tests::batches::keyed_order_holds_across_batches(store(&db).await).await;
}

/// A poison event in a batch goes dead alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poison_event_in_a_batch_goes_dead_alone() {
    let db = test_db("batch_poison").await;
    relaybus_tests::batches::poison_goes_dead_alone(store(&db).await).await;
}
