//! The publish path on a real replica set: events written in the caller's transaction.

use std::{
    collections::HashMap,
    sync::{
        Arc, Mutex,
        atomic::{AtomicU32, Ordering},
    },
    time::Duration,
};

use futures::TryStreamExt;
use mongodb::{
    Client,
    bson::{Bson, Document, doc},
    event::{EventHandler, command::CommandEvent},
    options::ClientOptions,
};
use relaybus::{
    ConfigurationError, Error, Event, EventEnvelope, EventValidationError, MongoEventStore,
    RelayBus,
};
use relaybus_harness::{TestDb, test_db};
use relaybus_tests::support::{
    OrderPlaced, all, bare_store, count, fail_command, noop, placed, publisher, store, store_on,
};
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Serialize, Deserialize)]
struct OrderShipped {
    order_id: String,
}

impl Event for OrderShipped {
    const TYPE: &'static str = "order.shipped.v1";
}

/// Everything the store and the business collection hold, for "nothing was written" checks.
async fn written(db: &TestDb) -> (u64, u64, u64, u64) {
    (
        count(db, "orders").await,
        count(db, "relaybus_events").await,
        count(db, "relaybus_deliveries").await,
        count(db, "relaybus_key_sequences").await,
    )
}

#[tokio::test]
async fn commit_writes_the_event_and_one_delivery_per_handler() {
    let db = test_db("commit").await;
    let store = store(&db).await;
    let bus = RelayBus::builder(store.clone())
        .subscribe(noop::<OrderPlaced>("send-confirmation"))
        .subscribe(noop::<OrderPlaced>("projector"))
        .subscribe(noop::<OrderShipped>("notify-shipping"))
        .build()
        .unwrap();
    let orders = db.db().collection::<Document>("orders");

    let appended = bus
        .transaction(async |session| {
            orders
                .insert_one(doc! { "_id": "o-1", "total": 1250 })
                .session(&mut *session)
                .await?;
            bus.publish(&placed("o-1"))
                .key("o-1")
                .correlation_id("req-1")
                .header("tenant", "acme")
                .session(session)
                .await
        })
        .await
        .expect("transaction commits");
    assert!(appended.created);
    assert_eq!(appended.sequence, Some(1));
    assert_eq!(appended.new_deliveries, ["send-confirmation", "projector"]);

    assert_eq!(count(&db, "orders").await, 1);
    let events = all(&db, "relaybus_events").await;
    assert_eq!(events.len(), 1);
    let event = &events[0];
    assert_eq!(event.get_str("_id").unwrap(), appended.event_id);
    assert_eq!(event.get_str("type").unwrap(), "order.placed.v1");
    assert_eq!(event.get_str("key").unwrap(), "o-1");
    assert_eq!(event.get_i64("sequence").unwrap(), 1);
    assert_eq!(event.get_str("correlationId").unwrap(), "req-1");
    assert_eq!(
        event.get_document("headers").unwrap(),
        &doc! { "tenant": "acme" }
    );
    assert_eq!(
        event.get_document("payload").unwrap(),
        &doc! { "order_id": "o-1", "total_cents": 1250 }
    );
    let handlers: Vec<&str> = event
        .get_array("handlers")
        .unwrap()
        .iter()
        .map(|h| h.as_str().unwrap())
        .collect();
    assert_eq!(handlers, ["send-confirmation", "projector"]);
    // Absent values are left out, not stored as null.
    for absent in ["causationId", "revision"] {
        assert!(!event.contains_key(absent), "{absent} should be absent");
    }

    let deliveries = all(&db, "relaybus_deliveries").await;
    assert_eq!(deliveries.len(), 2);
    let expected_lane = relaybus::event::lane_of(Some("o-1"), "ignored") as i32;
    for (delivery, handler) in deliveries.iter().zip(["send-confirmation", "projector"]) {
        assert_eq!(delivery.get_str("handler").unwrap(), handler);
        assert_eq!(delivery.get_str("eventId").unwrap(), appended.event_id);
        assert_eq!(delivery.get_str("eventType").unwrap(), "order.placed.v1");
        assert_eq!(delivery.get_str("status").unwrap(), "pending");
        assert_eq!(delivery.get_str("lane").unwrap(), "ready");
        assert_eq!(delivery.get_i32("laneId").unwrap(), expected_lane);
        assert_eq!(delivery.get_i64("sequence").unwrap(), 1);
        assert_eq!(delivery.get_i32("attempts").unwrap(), 0);
        assert!(!delivery.contains_key("updatedAt"));
        assert_eq!(
            delivery.get_datetime("dueAt").unwrap(),
            delivery.get_datetime("createdAt").unwrap()
        );
    }
}

#[tokio::test]
async fn unkeyed_events_take_the_lane_of_their_id() {
    let db = test_db("unkeyed").await;
    let store = store(&db).await;
    let bus = publisher(&store, &["a"]);
    let appended = bus.publish(&placed("o-1")).await.unwrap();
    assert_eq!(appended.sequence, None);
    let delivery = db
        .db()
        .collection::<Document>("relaybus_deliveries")
        .find_one(doc! {})
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        delivery.get_i32("laneId").unwrap(),
        relaybus::event::lane_of(None, &appended.event_id) as i32
    );
    assert!(!delivery.contains_key("key"));
    assert!(!delivery.contains_key("sequence"));
    assert_eq!(count(&db, "relaybus_key_sequences").await, 0);
}

#[tokio::test]
async fn an_aborted_transaction_leaves_nothing() {
    let db = test_db("abort").await;
    let store = store(&db).await;
    let bus = publisher(&store, &["send-confirmation"]);
    let orders = db.db().collection::<Document>("orders");

    let result: Result<(), Error> = bus
        .transaction(async |session| {
            orders
                .insert_one(doc! { "_id": "o-1" })
                .session(&mut *session)
                .await?;
            bus.publish(&placed("o-1"))
                .key("o-1")
                .session(&mut *session)
                .await?;
            Err(Error::custom("payment declined"))
        })
        .await;
    let error = result.expect_err("the body failed");
    assert_eq!(error.to_string(), "payment declined");
    assert_eq!(written(&db).await, (0, 0, 0, 0));
}

#[tokio::test]
async fn a_retried_publish_adds_nothing_and_a_new_handler_gets_only_its_own_delivery() {
    let db = test_db("dedupe").await;
    let store = store(&db).await;
    let envelope = EventEnvelope::new(&placed("o-1"))
        .unwrap()
        .with_key("o-1")
        .unwrap();

    let first = publisher(&store, &["a", "b"]);
    let appended = first.publish_envelope(envelope.clone()).await.unwrap();
    assert!(appended.created);
    assert_eq!(appended.new_deliveries, ["a", "b"]);

    // The same id again, as a broker redelivery or a retried request would send it.
    let again = first.publish_envelope(envelope.clone()).await.unwrap();
    assert!(!again.created);
    assert!(again.new_deliveries.is_empty());
    assert_eq!(again.sequence, Some(1), "the stored sequence is kept");
    assert_eq!(count(&db, "relaybus_events").await, 1);
    assert_eq!(count(&db, "relaybus_deliveries").await, 2);

    // Handler "a" completed meanwhile: its delivery document is gone.
    db.db()
        .collection::<Document>("relaybus_deliveries")
        .delete_one(doc! { "handler": "a" })
        .await
        .unwrap();

    // A process that also subscribes "c" publishes the same id: only "c" is new.
    let second = publisher(&store, &["a", "b", "c"]);
    let appended = second.publish_envelope(envelope.clone()).await.unwrap();
    assert!(!appended.created);
    assert_eq!(appended.new_deliveries, ["c"]);
    let handlers: Vec<String> = all(&db, "relaybus_deliveries")
        .await
        .iter()
        .map(|d| d.get_str("handler").unwrap().to_owned())
        .collect();
    assert_eq!(
        handlers,
        ["b", "c"],
        "the completed handler `a` does not run again"
    );
    let event = &all(&db, "relaybus_events").await[0];
    assert_eq!(event.get_array("handlers").unwrap().len(), 3);
    assert_eq!(event.get_i64("revision").unwrap(), 1);
    // The key's counter did not move for the duplicates.
    let counter = &all(&db, "relaybus_key_sequences").await[0];
    assert_eq!(counter.get("value").unwrap(), &Bson::Int64(1));
}

#[tokio::test]
async fn publish_all_appends_a_batch_with_consecutive_sequences() {
    let db = test_db("batch").await;
    let store = store(&db).await;
    let bus = publisher(&store, &["a"]);
    let mut envelopes = Vec::new();
    for i in 0..10 {
        let key = if i % 2 == 0 { "even" } else { "odd" };
        envelopes.push(
            EventEnvelope::new(&placed(&format!("o-{i}")))
                .unwrap()
                .with_key(key)
                .unwrap(),
        );
    }
    envelopes.push(EventEnvelope::new(&placed("unkeyed")).unwrap());
    // The same id twice in one batch is one event.
    envelopes.push(envelopes[0].clone());
    let appended = bus.publish_all(envelopes).await.unwrap();
    assert_eq!(appended.len(), 11);
    let even: Vec<i64> = appended[..10]
        .iter()
        .step_by(2)
        .map(|a| a.sequence.unwrap())
        .collect();
    let odd: Vec<i64> = appended[1..10]
        .iter()
        .step_by(2)
        .map(|a| a.sequence.unwrap())
        .collect();
    assert_eq!(even, [1, 2, 3, 4, 5]);
    assert_eq!(odd, [1, 2, 3, 4, 5]);
    assert_eq!(count(&db, "relaybus_events").await, 11);
    assert_eq!(count(&db, "relaybus_deliveries").await, 11);
}

/// Reads, from the oplog, the sequences of the events of `db` in the order their transactions
/// committed.
async fn sequences_in_commit_order(db: &TestDb) -> Vec<i64> {
    let namespace = format!("{}.relaybus_events", db.name);
    let oplog = db
        .client
        .database("local")
        .collection::<Document>("oplog.rs");
    let entries: Vec<Document> = oplog
        .find(doc! { "op": "c", "o.applyOps.ns": &namespace })
        .sort(doc! { "$natural": 1 })
        .await
        .unwrap()
        .try_collect()
        .await
        .unwrap();
    let mut sequences = Vec::new();
    for entry in entries {
        for op in entry
            .get_document("o")
            .unwrap()
            .get_array("applyOps")
            .unwrap()
        {
            let op = op.as_document().unwrap();
            if op.get_str("ns") == Ok(namespace.as_str()) && op.get_str("op") == Ok("i") {
                sequences.push(op.get_document("o").unwrap().get_i64("sequence").unwrap());
            }
        }
    }
    sequences
}

#[tokio::test]
async fn concurrent_publishers_on_one_key_get_gapless_sequences_in_commit_order() {
    const PUBLISHERS: usize = 8;
    const EACH: usize = 5;
    let db = test_db("sequence").await;
    let store = store(&db).await;
    let bus = publisher(&store, &["a"]);
    let attempts = Arc::new(AtomicU32::new(0));

    let mut tasks = Vec::new();
    for publisher in 0..PUBLISHERS {
        let bus = bus.clone();
        let attempts = Arc::clone(&attempts);
        let orders = db.db().collection::<Document>("orders");
        tasks.push(tokio::spawn(async move {
            let mut sequences = Vec::new();
            for i in 0..EACH {
                let order = format!("o-{publisher}-{i}");
                let envelope = EventEnvelope::new(&placed(&order))
                    .unwrap()
                    .with_key("hot")
                    .unwrap();
                // A spawned task needs a `Send` future: the body is an `async move` closure that
                // owns what it uses.
                let body = {
                    let (bus, orders, attempts) = (bus.clone(), orders.clone(), attempts.clone());
                    async move |session: &mut mongodb::ClientSession| {
                        attempts.fetch_add(1, Ordering::Relaxed);
                        orders
                            .insert_one(doc! { "_id": &order })
                            .session(&mut *session)
                            .await?;
                        bus.publish_envelope(envelope.clone())
                            .session(session)
                            .await
                    }
                };
                let appended = bus.transaction(body).await.expect("committed");
                sequences.push(appended.sequence.unwrap());
            }
            sequences
        }));
    }
    let mut all_sequences = Vec::new();
    for task in tasks {
        let sequences = task.await.unwrap();
        assert!(
            sequences.windows(2).all(|w| w[0] < w[1]),
            "one publisher's sequences grow: {sequences:?}"
        );
        all_sequences.extend(sequences);
    }
    all_sequences.sort_unstable();
    let total = (PUBLISHERS * EACH) as i64;
    assert_eq!(all_sequences, (1..=total).collect::<Vec<_>>());
    assert_eq!(count(&db, "relaybus_events").await, total as u64);
    assert_eq!(count(&db, "orders").await, total as u64);

    let committed = sequences_in_commit_order(&db).await;
    assert_eq!(
        committed,
        (1..=total).collect::<Vec<_>>(),
        "sequence order is commit order"
    );
    // Conflicting publishers really raced, and their retries left nothing twice.
    assert!(attempts.load(Ordering::Relaxed) as i64 >= total);
}

/// A transaction that inserts the order `id` first (taking the transaction's snapshot) and
/// then publishes its event on each of `keys`, in turn; gives how many attempts it took.
async fn place_on_keys(bus: &RelayBus, db: &TestDb, id: String, keys: Vec<&'static str>) -> u32 {
    let orders = db.db().collection::<Document>("orders");
    let mut attempts = 0;
    bus.transaction(async |session| {
        attempts += 1;
        orders
            .insert_one(doc! { "_id": &id })
            .session(&mut *session)
            .await?;
        for key in &keys {
            let envelope = EventEnvelope::new(&placed(&format!("{id}-{key}")))?.with_key(*key)?;
            bus.publish_envelope(envelope)
                .session(&mut *session)
                .await?;
        }
        Ok(())
    })
    .await
    .expect("committed");
    attempts
}

/// The sequence numbers of `key`'s events, sorted.
async fn sequences_of(db: &TestDb, key: &str) -> Vec<i64> {
    let mut numbers: Vec<i64> = all(db, "relaybus_events")
        .await
        .iter()
        .filter(|event| event.get_str("key") == Ok(key))
        .map(|event| event.get_i64("sequence").unwrap())
        .collect();
    numbers.sort_unstable();
    numbers
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publishers_of_one_key_in_one_process_queue_for_it_instead_of_conflicting() {
    const PUBLISHERS: usize = 12;
    let db = test_db("key_queue").await;
    let store = store(&db).await;
    let bus = publisher(&store, &["a"]);
    let attempts = futures::future::join_all(
        (0..PUBLISHERS).map(|n| place_on_keys(&bus, &db, format!("o-{n}"), vec!["hot"])),
    )
    .await;
    // An attempt that finds the key taken gives up before it writes the counter, and the next
    // one waits for the key before its snapshot: never a third attempt, where conflicting
    // publishers retry until they happen not to meet.
    assert!(
        attempts.iter().all(|n| *n <= 2),
        "attempts per transaction: {attempts:?}"
    );
    assert!(attempts.contains(&2), "they met: {attempts:?}");
    assert_eq!(
        sequences_of(&db, "hot").await,
        (1..=PUBLISHERS as i64).collect::<Vec<_>>()
    );
    assert_eq!(count(&db, "orders").await, PUBLISHERS as u64);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publishers_of_two_keys_in_opposite_orders_never_deadlock() {
    const PUBLISHERS: usize = 8;
    const ROUNDS: usize = 3;
    let db = test_db("key_queue_two").await;
    let store = store(&db).await;
    let bus = publisher(&store, &["a"]);
    let all_done = async {
        for round in 0..ROUNDS {
            futures::future::join_all((0..PUBLISHERS).map(|n| {
                let keys = if n % 2 == 0 {
                    vec!["a", "b"]
                } else {
                    vec!["b", "a"]
                };
                place_on_keys(&bus, &db, format!("o-{round}-{n}"), keys)
            }))
            .await;
        }
    };
    tokio::time::timeout(Duration::from_secs(60), all_done)
        .await
        .expect("every transaction commits");
    let total = (PUBLISHERS * ROUNDS) as i64;
    for key in ["a", "b"] {
        assert_eq!(
            sequences_of(&db, key).await,
            (1..=total).collect::<Vec<_>>()
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transaction_dropped_while_holding_a_key_keeps_it_only_briefly() {
    let db = test_db("key_queue_dropped").await;
    let store = store(&db).await;
    let bus = publisher(&store, &["a"]);
    let (published, mut held) = tokio::sync::mpsc::unbounded_channel();
    let holder = {
        let bus = bus.clone();
        tokio::spawn(async move {
            let publisher = bus.clone();
            bus.transaction(async move |session| {
                publisher
                    .publish(&placed("dropped"))
                    .key("k")
                    .session(session)
                    .await?;
                let _ = published.send(());
                std::future::pending::<()>().await;
                Ok(())
            })
            .await
        })
    };
    held.recv().await.expect("the holder published");
    holder.abort();
    assert!(holder.await.unwrap_err().is_cancelled());

    // Nothing tells the store that the holder's session was dropped: its gate counts for a
    // second at most, then the key's next publisher takes it.
    let started = std::time::Instant::now();
    let attempts = place_on_keys(&bus, &db, "next".to_owned(), vec!["k"]).await;
    let took = started.elapsed();
    assert!(
        took < Duration::from_millis(2_500),
        "took {took:?} ({attempts} attempts)"
    );
    assert_eq!(sequences_of(&db, "k").await, [1]);
}

#[tokio::test]
async fn a_transient_error_runs_the_whole_body_again() {
    let db = test_db("transient").await;
    let app = format!("transient-{}", db.name);
    let client = client_named(&db, &app).await;
    let store = store_on(&client, &db).await;
    let bus = publisher(&store, &["a"]);
    let orders = client.database(&db.name).collection::<Document>("orders");

    let _fail = fail_command(&client, &app, "insert", 1, 112, "TransientTransactionError").await;

    let runs = AtomicU32::new(0);
    let value = bus
        .transaction(async |session| {
            let run = runs.fetch_add(1, Ordering::SeqCst) + 1;
            orders
                .insert_one(doc! { "_id": "o-1" })
                .session(&mut *session)
                .await?;
            bus.publish(&placed("o-1")).session(session).await?;
            Ok(run)
        })
        .await
        .unwrap();
    assert_eq!(runs.load(Ordering::SeqCst), 2, "the body ran twice");
    assert_eq!(value, 2, "the value of the attempt that committed");
    assert_eq!(written(&db).await, (1, 1, 1, 0));
}

#[tokio::test]
async fn an_unknown_commit_result_retries_the_commit_alone() {
    let db = test_db("unknown_commit").await;
    let app = format!("commit-{}", db.name);
    let client = client_named(&db, &app).await;
    let store = store_on(&client, &db).await;
    let bus = publisher(&store, &["a"]);

    let _fail = fail_command(
        &client,
        &app,
        "commitTransaction",
        2,
        91,
        "UnknownTransactionCommitResult",
    )
    .await;

    let runs = AtomicU32::new(0);
    bus.transaction(async |session| {
        runs.fetch_add(1, Ordering::SeqCst);
        bus.publish(&placed("o-1")).session(session).await?;
        Ok(())
    })
    .await
    .unwrap();
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the body ran once");
    assert_eq!(count(&db, "relaybus_events").await, 1);
}

async fn client_named(db: &TestDb, app: &str) -> Client {
    let mut options = ClientOptions::parse(&db.uri).await.unwrap();
    options.app_name = Some(app.to_owned());
    Client::with_options(options).unwrap()
}

#[tokio::test]
async fn a_transaction_over_its_budget_is_aborted_with_all_its_writes() {
    let db = test_db("budget").await;
    let store = store(&db).await;
    let bus = RelayBus::builder(store.clone())
        .subscribe(noop::<OrderPlaced>("a"))
        .transaction_timeout(Duration::from_millis(200))
        .build()
        .unwrap();
    let orders = db.db().collection::<Document>("orders");
    let result = bus
        .transaction(async |session| {
            orders
                .insert_one(doc! { "_id": "o-1" })
                .session(&mut *session)
                .await?;
            bus.publish(&placed("o-1")).session(&mut *session).await?;
            // Slow work inside the transaction: the budget is spent before the commit.
            tokio::time::sleep(Duration::from_millis(400)).await;
            Ok(())
        })
        .await;
    match result {
        Err(Error::TransactionTimeout(timeout)) => {
            assert_eq!(timeout.budget(), Duration::from_millis(200));
            assert!(timeout.elapsed() >= Duration::from_millis(400));
        }
        other => panic!("expected a transaction timeout, got {other:?}"),
    }
    assert_eq!(written(&db).await, (0, 0, 0, 0));
}

#[tokio::test]
async fn the_budget_covers_every_attempt_of_a_transaction() {
    let db = test_db("budget_attempts").await;
    let bus = RelayBus::builder(store(&db).await)
        .subscribe(noop::<OrderPlaced>("a"))
        .transaction_timeout(Duration::from_millis(1_000))
        .build()
        .unwrap();
    // Created ahead: a collection created inside a transaction can take an attempt's budget.
    db.db().create_collection("orders").await.unwrap();
    let orders = db.db().collection::<Document>("orders");
    let runs = AtomicU32::new(0);
    let result = bus
        .transaction(async |session| {
            let run = runs.fetch_add(1, Ordering::SeqCst) + 1;
            orders
                .insert_one(doc! { "run": run })
                .session(&mut *session)
                .await?;
            // Each attempt is within the budget alone; two are not.
            tokio::time::sleep(Duration::from_millis(600)).await;
            if run < 3 {
                return Err(Error::Database(
                    relaybus::DatabaseError::new(std::io::Error::other("a write conflict"))
                        .with_transient(true),
                ));
            }
            Ok(())
        })
        .await;
    match result {
        Err(Error::TransactionTimeout(timeout)) => {
            assert_eq!(timeout.budget(), Duration::from_millis(1_000));
            assert!(
                timeout.elapsed() >= Duration::from_millis(1_200),
                "two attempts ran: {timeout:?}"
            );
        }
        other => panic!("expected a transaction timeout, got {other:?}"),
    }
    assert_eq!(
        runs.load(Ordering::SeqCst),
        2,
        "no third attempt past the budget"
    );
    assert_eq!(
        count(&db, "orders").await,
        0,
        "nothing of any attempt committed"
    );
}

#[tokio::test]
async fn a_commit_stopped_at_max_commit_time_is_a_transaction_timeout() {
    let db = test_db("budget_commit").await;
    let app = "relaybus-max-commit-time";
    // The commits the client sends, as the server receives them.
    let commits = Arc::new(Mutex::new(Vec::new()));
    let mut options = ClientOptions::parse(&db.uri).await.unwrap();
    options.app_name = Some(app.to_owned());
    let sink = Arc::clone(&commits);
    options.command_event_handler = Some(EventHandler::callback(move |event| {
        if let CommandEvent::Started(started) = event
            && started.command_name == "commitTransaction"
        {
            sink.lock().unwrap().push(started.command);
        }
    }));
    let client = Client::with_options(options).unwrap();
    let store = store_on(&client, &db).await;
    let bus = RelayBus::builder(store)
        .subscribe(noop::<OrderPlaced>("a"))
        .build()
        .unwrap();
    // The server answers the commit with MaxTimeMSExpired, as when `maxCommitTimeMS` (the
    // budget's remainder) runs out.
    let _expired = relaybus_harness::FailPoint::enable(
        &db.client,
        doc! {
            "configureFailPoint": "failCommand",
            "mode": { "times": 1 },
            "data": { "failCommands": ["commitTransaction"], "appName": app, "errorCode": 50 },
        },
    )
    .await
    .unwrap();
    let orders = client.database(&db.name).collection::<Document>("orders");
    let result = bus
        .transaction(async |session| {
            orders
                .insert_one(doc! { "_id": "o-1" })
                .session(&mut *session)
                .await?;
            bus.publish(&placed("o-1")).session(&mut *session).await?;
            Ok(())
        })
        .await;
    match result {
        Err(Error::TransactionTimeout(timeout)) => {
            assert_eq!(timeout.budget(), bus.transaction_timeout());
        }
        other => panic!("expected a transaction timeout, got {other:?}"),
    }
    assert_eq!(written(&db).await, (0, 0, 0, 0));
    // The commit carried what was left of the budget as its `maxTimeMS`.
    let commits = commits.lock().unwrap().clone();
    assert_eq!(commits.len(), 1, "one commit, not retried: {commits:?}");
    let budget = bus.transaction_timeout().as_millis() as i64;
    let max_time = match commits[0].get("maxTimeMS") {
        Some(Bson::Int32(ms)) => i64::from(*ms),
        Some(Bson::Int64(ms)) => *ms,
        other => panic!(
            "the commit carries no maxTimeMS ({other:?}): {}",
            commits[0]
        ),
    };
    assert!(
        (1..=budget).contains(&max_time),
        "maxTimeMS {max_time} within the budget of {budget} ms"
    );
}

#[tokio::test]
async fn setup_creates_collections_indexes_and_lanes_and_can_run_concurrently() {
    let db = test_db("setup").await;
    let store = MongoEventStore::builder(db.client.clone())
        .database(&db.name)
        .completion_history(true)
        .build()
        .unwrap();
    let other = MongoEventStore::builder(db.client.clone())
        .database(&db.name)
        .completion_history(true)
        .build()
        .unwrap();
    let (a, b) = tokio::join!(store.setup(), other.setup());
    a.expect("first concurrent setup");
    b.expect("second concurrent setup");
    // The next start's setup (a store runs its own once).
    MongoEventStore::builder(db.client.clone())
        .database(&db.name)
        .completion_history(true)
        .build()
        .unwrap()
        .setup()
        .await
        .expect("setup again");

    let mut names = db.db().list_collection_names().await.unwrap();
    names.sort();
    assert_eq!(
        names,
        [
            "relaybus_completed_deliveries",
            "relaybus_deliveries",
            "relaybus_events",
            "relaybus_idempotency_keys",
            "relaybus_key_sequences",
            "relaybus_lanes",
        ]
    );
    let lanes = all(&db, "relaybus_lanes").await;
    assert_eq!(lanes.len(), 256);
    assert_eq!(lanes[255].get_i32("_id").unwrap(), 255);
    assert_eq!(lanes[0].get_i64("epoch").unwrap(), 0);

    let indexes: Vec<Document> = db
        .db()
        .collection::<Document>("relaybus_deliveries")
        .list_indexes()
        .await
        .unwrap()
        .map_ok(|model| {
            let options = model.options.unwrap_or_default();
            doc! {
                "name": options.name.unwrap_or_default(),
                "keys": model.keys,
                "unique": options.unique.unwrap_or(false),
                "partial": options.partial_filter_expression.map(Bson::Document).unwrap_or(Bson::Null),
            }
        })
        .try_collect()
        .await
        .unwrap();
    let find = |name: &str| {
        indexes
            .iter()
            .find(|i| i.get_str("name") == Ok(name))
            .unwrap_or_else(|| panic!("index {name} missing: {indexes:?}"))
            .clone()
    };
    assert_eq!(indexes.len(), 11, "{indexes:?}");
    let unique = find("event_handler");
    assert_eq!(
        unique.get_document("keys").unwrap(),
        &doc! { "eventId": 1, "handler": 1 }
    );
    assert!(unique.get_bool("unique").unwrap());
    let claim = find("claim");
    assert_eq!(
        claim.get_document("keys").unwrap(),
        &doc! { "laneId": 1, "dueAt": 1, "_id": 1, "handler": 1 }
    );
    assert_eq!(
        claim.get_document("partial").unwrap(),
        &doc! { "status": "pending", "lane": "ready" }
    );
    assert_eq!(
        find("parked").get_document("partial").unwrap(),
        &doc! { "lane": "parked" }
    );
    assert_eq!(
        find("parked").get_document("keys").unwrap(),
        &doc! { "lane": 1, "handler": 1, "key": 1, "sequence": 1 }
    );
    assert_eq!(
        find("ordering").get_document("keys").unwrap(),
        &doc! { "status": 1, "handler": 1, "key": 1, "sequence": 1 }
    );
    for name in [
        "due",
        "completed",
        "status_created",
        "status_updated",
        "handler_created",
        "type_created",
    ] {
        find(name);
    }
}

#[tokio::test]
async fn setup_replaces_the_parked_and_ordering_indexes_of_an_earlier_setup() {
    let db = test_db("setup_index_upgrade").await;
    let deliveries = db.db().collection::<Document>("relaybus_deliveries");
    db.db()
        .create_collection("relaybus_deliveries")
        .await
        .unwrap();
    // The keys earlier versions gave them: without the constant leading field.
    for (name, partial) in [
        ("parked", doc! { "lane": "parked" }),
        (
            "ordering",
            doc! { "status": "pending", "key": { "$exists": true } },
        ),
    ] {
        deliveries
            .create_index(
                mongodb::IndexModel::builder()
                    .keys(doc! { "handler": 1, "key": 1, "sequence": 1 })
                    .options(
                        mongodb::options::IndexOptions::builder()
                            .name(name.to_owned())
                            .partial_filter_expression(partial)
                            .build(),
                    )
                    .build(),
            )
            .await
            .unwrap();
    }

    bare_store(&db).setup().await.unwrap();
    // The next start's setup (a store runs its own once).
    let store = bare_store(&db);
    store.setup().await.unwrap();

    let keys: HashMap<String, Document> = deliveries
        .list_indexes()
        .await
        .unwrap()
        .try_filter_map(|model| async move {
            let name = model.options.as_ref().and_then(|o| o.name.clone());
            Ok(name.map(|name| (name, model.keys)))
        })
        .try_collect()
        .await
        .unwrap();
    assert_eq!(keys.len(), 11, "{keys:?}");
    assert_eq!(
        keys["parked"],
        doc! { "lane": 1, "handler": 1, "key": 1, "sequence": 1 }
    );
    assert_eq!(
        keys["ordering"],
        doc! { "status": 1, "handler": 1, "key": 1, "sequence": 1 }
    );
}

#[tokio::test]
async fn a_standalone_server_is_refused_by_setup_and_by_the_first_transaction() {
    let standalone = relaybus_harness::start_standalone().await;
    let client = Client::with_uri_str(standalone.uri()).await.unwrap();
    let store = MongoEventStore::builder(client.clone())
        .database("standalone")
        .build()
        .unwrap();
    let error = store.setup().await.expect_err("a standalone is refused");
    assert!(
        matches!(
            error,
            Error::Configuration(ConfigurationError::NotReplicaSet { .. })
        ),
        "{error:?}"
    );
    assert!(error.to_string().contains("replica set"), "{error}");
    // The specification's own words, which runbooks may search for.
    assert!(
        error
            .to_string()
            .contains("MongoEventStore needs multi-document transactions"),
        "{error}"
    );

    let fresh = MongoEventStore::builder(client.clone())
        .database("standalone")
        .build()
        .unwrap();
    let bus = RelayBus::builder(fresh).build().unwrap();
    let error = bus
        .transaction(async |_| Ok(()))
        .await
        .expect_err("a standalone is refused");
    assert!(
        matches!(
            error,
            Error::Configuration(ConfigurationError::NotReplicaSet { .. })
        ),
        "{error:?}"
    );
    let names = client
        .database("standalone")
        .list_collection_names()
        .await
        .unwrap();
    assert!(names.is_empty(), "nothing was written: {names:?}");
}

#[tokio::test]
async fn a_session_without_a_transaction_is_refused_and_nothing_is_written() {
    let db = test_db("no_txn").await;
    let store = store(&db).await;
    let bus = publisher(&store, &["a"]);
    let mut session = db.client.start_session().await.unwrap();
    let error = bus
        .publish(&placed("o-1"))
        .session(&mut session)
        .await
        .expect_err("refused");
    assert!(
        matches!(
            error,
            Error::Configuration(ConfigurationError::NoTransaction { .. })
        ),
        "{error:?}"
    );
    assert!(error.to_string().contains("start_transaction"), "{error}");
    assert!(
        error
            .to_string()
            .contains("MongoEventStore.append needs a ClientSession inside a started transaction"),
        "the specification's words: {error}"
    );

    // A session whose transaction was committed already is refused too.
    session.start_transaction().await.unwrap();
    session.commit_transaction().await.unwrap();
    let error = bus
        .publish(&placed("o-1"))
        .session(&mut session)
        .await
        .expect_err("refused");
    assert!(matches!(error, Error::Configuration(_)), "{error:?}");
    assert_eq!(written(&db).await, (0, 0, 0, 0));

    // The caller's own started transaction works.
    session.start_transaction().await.unwrap();
    bus.publish(&placed("o-1"))
        .session(&mut session)
        .await
        .unwrap();
    assert_eq!(count(&db, "relaybus_events").await, 0, "not committed yet");
    session.commit_transaction().await.unwrap();
    assert_eq!(count(&db, "relaybus_events").await, 1);
}

#[tokio::test]
async fn invalid_events_are_refused_before_anything_is_written() {
    let db = test_db("bad_events").await;
    let store = store(&db).await;
    let bus = publisher(&store, &["a"]);
    let orders = db.db().collection::<Document>("orders");

    type Check = Box<dyn Fn(Error) -> bool>;
    let cases: Vec<(&str, Check)> = vec![
        (
            "key",
            Box::new(|e| {
                matches!(
                    e,
                    Error::EventValidation(EventValidationError::InvalidKey { .. })
                )
            }),
        ),
        (
            "id",
            Box::new(|e| {
                matches!(
                    e,
                    Error::EventValidation(EventValidationError::InvalidId { .. })
                )
            }),
        ),
        (
            "size",
            Box::new(|e| match e {
                Error::EventValidation(EventValidationError::TooLarge { size, limit, .. }) => {
                    size > limit && limit == 16 * 1024 * 1024
                }
                _ => false,
            }),
        ),
    ];
    for (case, expected) in cases {
        let result: Result<(), Error> = bus
            .transaction(async |session| {
                orders
                    .insert_one(doc! { "case": case })
                    .session(&mut *session)
                    .await?;
                let publish = match case {
                    "key" => bus.publish(&placed("o")).key("k".repeat(513)),
                    "id" => bus.publish(&placed("o")).id(""),
                    _ => bus.publish(&OrderPlaced {
                        order_id: "x".repeat(17 * 1024 * 1024),
                        total_cents: 1,
                    }),
                };
                publish.session(session).await?;
                Ok(())
            })
            .await;
        let error = result.expect_err(case);
        let message = error.to_string();
        assert!(expected(error), "{case}: {message}");
        if case == "size" {
            assert!(message.contains("16777216"), "{message}");
        }
    }
    assert_eq!(written(&db).await, (0, 0, 0, 0));

    let error = EventEnvelope::from_json("Order Placed", serde_json::json!({})).unwrap_err();
    assert!(matches!(
        error,
        EventValidationError::InvalidTypeName { .. }
    ));
    assert!(error.to_string().contains("order.placed.v1"), "{error}");
    let error = EventEnvelope::from_json("a.b", serde_json::json!(5)).unwrap_err();
    assert!(matches!(
        error,
        EventValidationError::PayloadNotObject { .. }
    ));
}

#[tokio::test]
async fn invalid_options_are_refused_when_building() {
    let db = test_db("bad_options").await;
    let builder = || MongoEventStore::builder(db.client.clone());
    for name in ["", "has.dot", "has space", &"x".repeat(64)] {
        let error = builder().database(name).build().unwrap_err();
        assert!(
            matches!(error, ConfigurationError::InvalidDatabaseName { .. }),
            "{name}: {error:?}"
        );
    }
    let error = builder()
        .database("ok")
        .collection_prefix("bad$")
        .build()
        .unwrap_err();
    assert!(matches!(
        error,
        ConfigurationError::InvalidCollectionPrefix { .. }
    ));
    let error = builder()
        .database("ok")
        .purge_batch_size(0)
        .build()
        .unwrap_err();
    assert!(matches!(
        error,
        ConfigurationError::InvalidOption {
            option: "purge_batch_size",
            ..
        }
    ));
    let no_default = Client::with_uri_str(&db.uri).await.unwrap();
    if no_default.default_database().is_none() {
        assert_eq!(
            MongoEventStore::builder(no_default).build().unwrap_err(),
            ConfigurationError::MissingDatabase
        );
    }

    let store = builder().database(&db.name).build().unwrap();
    let error = RelayBus::builder(store.clone())
        .subscribe(noop::<OrderPlaced>("bad id!"))
        .build()
        .unwrap_err();
    assert!(matches!(error, ConfigurationError::InvalidHandlerId { .. }));
    let error = RelayBus::builder(store.clone())
        .subscribe(noop::<OrderPlaced>("twice"))
        .subscribe(noop::<OrderShipped>("twice"))
        .build()
        .unwrap_err();
    let message = error.to_string();
    assert!(matches!(
        error,
        ConfigurationError::DuplicateHandlerId { .. }
    ));
    assert!(message.contains("order.placed.v1") && message.contains("order.shipped.v1"));
    for timeout in [Duration::ZERO, Duration::from_secs(61)] {
        let error = RelayBus::builder(store.clone())
            .transaction_timeout(timeout)
            .build()
            .unwrap_err();
        assert!(matches!(
            error,
            ConfigurationError::InvalidOption {
                option: "transaction_timeout",
                ..
            }
        ));
    }
    // Building touched nothing.
    assert!(db.db().list_collection_names().await.unwrap().is_empty());
}

#[tokio::test]
async fn payload_keys_with_dots_and_dollars_are_stored_as_they_are() {
    let db = test_db("payload_keys").await;
    let store = store(&db).await;
    let bus = publisher(&store, &[]);
    let envelope = EventEnvelope::from_json(
        "order.placed.v1",
        serde_json::json!({ "a.b": 1, "$oid": "not an id", "nested": { "$set": [1, 2] } }),
    )
    .unwrap();
    bus.publish_envelope(envelope).await.unwrap();
    // Read the raw bytes: decoding into a `Document` would take `$oid` for an object id.
    let event = db
        .db()
        .collection::<mongodb::bson::RawDocumentBuf>("relaybus_events")
        .find_one(doc! {})
        .await
        .unwrap()
        .unwrap();
    let payload = event.get_document("payload").unwrap();
    assert_eq!(payload.get_i32("a.b").unwrap(), 1);
    assert_eq!(payload.get_str("$oid").unwrap(), "not an id");
    let nested = payload.get_document("nested").unwrap();
    let set: Vec<i32> = nested
        .get_array("$set")
        .unwrap()
        .into_iter()
        .map(|v| v.unwrap().as_i32().unwrap())
        .collect();
    assert_eq!(set, [1, 2]);
    // No subscribers: the event is kept, with no delivery.
    assert_eq!(count(&db, "relaybus_deliveries").await, 0);
}

#[tokio::test]
async fn a_known_event_in_a_keyed_batch_leaves_no_gap_in_the_sequence() {
    let db = test_db("gapless_batch").await;
    let store = store(&db).await;
    let bus = publisher(&store, &["a"]);
    let keyed = |order: &str| {
        EventEnvelope::new(&placed(order))
            .unwrap()
            .with_key("k")
            .unwrap()
    };
    let known = keyed("known");
    assert_eq!(
        bus.publish_envelope(known.clone()).await.unwrap().sequence,
        Some(1)
    );

    let batch = vec![keyed("first"), known, keyed("last")];
    let appended = bus.publish_all(batch).await.unwrap();
    let sequences: Vec<(bool, Option<i64>)> =
        appended.iter().map(|a| (a.created, a.sequence)).collect();
    assert_eq!(
        sequences,
        [(true, Some(2)), (false, Some(1)), (true, Some(3))]
    );

    let stored: Vec<i64> = all(&db, "relaybus_events")
        .await
        .iter()
        .map(|e| e.get_i64("sequence").unwrap())
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .collect();
    assert_eq!(stored, [1, 2, 3]);
    let delivery_sequences: Vec<i64> = all(&db, "relaybus_deliveries")
        .await
        .iter()
        .map(|d| d.get_i64("sequence").unwrap())
        .collect();
    assert_eq!(delivery_sequences, [1, 2, 3]);
    let counter = &all(&db, "relaybus_key_sequences").await[0];
    assert_eq!(counter.get("value").unwrap(), &Bson::Int64(3));
}

#[tokio::test]
async fn a_delayed_publish_is_stored_now_and_its_deliveries_are_due_later() {
    use relaybus::Timestamp;

    let db = test_db("delayed").await;
    let store = store(&db).await;
    let bus = publisher(&store, &["a"]);
    let now = Timestamp::now();
    let due = now.saturating_add(Duration::from_secs(3_600));
    bus.publish(&placed("o-1")).key("k").at(due).await.unwrap();
    // The next event of the key is due at once, and waits for its delayed predecessor.
    bus.publish(&placed("o-2")).key("k").await.unwrap();
    bus.publish(&placed("o-3"))
        .delay(Duration::from_secs(60))
        .await
        .unwrap();
    assert_eq!(count(&db, "relaybus_events").await, 3, "stored at once");
    let delayed = all(&db, "relaybus_deliveries")
        .await
        .into_iter()
        .find(|d| d.get_i64("sequence") == Ok(1))
        .unwrap();
    assert_eq!(
        delayed.get_datetime("dueAt").unwrap().timestamp_millis(),
        due.timestamp_millis()
    );

    let lease = Duration::from_secs(30);
    let claim = |at: Timestamp| store.claim("w1", &["a"], 10, lease, at.into());
    assert!(
        claim(now).await.unwrap().is_empty(),
        "nothing is due yet: the key waits for its delayed head"
    );
    let after_a_minute = claim(now.saturating_add(Duration::from_secs(61)))
        .await
        .unwrap();
    assert_eq!(
        after_a_minute.len(),
        1,
        "the unkeyed event delayed by a minute"
    );
    assert_eq!(after_a_minute[0].key(), None);
    let at_due = claim(due).await.unwrap();
    assert_eq!(at_due.len(), 1, "the key's head, then its follower");
    assert_eq!(at_due[0].sequence(), Some(1));
}

#[tokio::test]
async fn a_commit_whose_write_concern_fails_is_committed_not_acknowledged_and_never_run_again() {
    use mongodb::options::{Acknowledgment, TransactionOptions, WriteConcern};

    let db = test_db("commit_unacknowledged").await;
    store(&db).await;
    // More members than any test replica set has: the primary applies the commit, then
    // reports that the write concern cannot be met.
    for wait in [None, Some(Duration::from_millis(200))] {
        let options = TransactionOptions::builder()
            .write_concern(
                WriteConcern::builder()
                    .w(Acknowledgment::Nodes(9))
                    .w_timeout(wait)
                    .build(),
            )
            .build();
        let unacknowledged = MongoEventStore::builder(db.client.clone())
            .database(&db.name)
            .transaction_options(options)
            .build()
            .unwrap();
        let bus = publisher(&unacknowledged, &["projector"]);
        let orders = db.db().collection::<Document>("orders");
        let id = format!("o-{}", wait.map_or(0, |w| w.as_millis()));
        let runs = AtomicU32::new(0);
        let outcome = bus
            .transaction(async |session| {
                runs.fetch_add(1, Ordering::SeqCst);
                orders
                    .insert_one(doc! { "_id": &id })
                    .session(&mut *session)
                    .await?;
                bus.publish(&placed(&id)).session(session).await?;
                Ok(())
            })
            .await;
        let error = outcome.unwrap_err();
        assert!(
            matches!(error, Error::CommitNotAcknowledged(_)),
            "{wait:?}: {error:?}"
        );
        assert!(!error.is_transient_transaction_error());
        let message = error.to_string();
        assert!(
            message.contains("committed on the primary") && message.contains("twice"),
            "{message}"
        );
        assert_eq!(
            runs.load(Ordering::SeqCst),
            1,
            "{wait:?}: the body ran again"
        );
        // It did commit: the order and its event are there, once.
        assert!(
            orders
                .find_one(doc! { "_id": &id })
                .await
                .unwrap()
                .is_some()
        );
        let events = all(&db, "relaybus_events").await;
        let ours: Vec<_> = events
            .iter()
            .filter(|event| event.get_document("payload").unwrap().get_str("order_id") == Ok(&id))
            .collect();
        assert_eq!(ours.len(), 1, "{wait:?}: {events:?}");
    }
}

/// The warnings logged on the current thread, their messages.
#[derive(Clone, Default)]
struct Warnings(Arc<std::sync::Mutex<Vec<String>>>);

impl Warnings {
    fn messages(&self) -> Vec<String> {
        self.0.lock().unwrap().clone()
    }
}

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Warnings {
    fn on_event(&self, event: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
        struct Message(String);
        impl tracing::field::Visit for Message {
            fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
                if field.name() == "message" {
                    self.0 = format!("{value:?}");
                }
            }
        }
        if *event.metadata().level() == tracing::Level::WARN {
            let mut message = Message(String::new());
            event.record(&mut message);
            self.0.lock().unwrap().push(message.0);
        }
    }
}

/// The window is the server's, so this test has a server of its own.
#[tokio::test]
async fn setup_warns_when_the_server_keeps_a_long_snapshot_history() {
    use tracing_subscriber::layer::SubscriberExt;

    let server = relaybus_harness::start_replica_set(1).await;
    let client = Client::with_uri_str(server.uri()).await.unwrap();
    let store = MongoEventStore::builder(client.clone())
        .database("window")
        .build()
        .unwrap();
    let warnings = Warnings::default();
    // A test runs on one thread: what setup logs reaches this subscriber.
    let _guard =
        tracing::subscriber::set_default(tracing_subscriber::registry().with(warnings.clone()));

    store.setup().await.unwrap();
    assert_eq!(
        store.snapshot_history_window().await.unwrap(),
        Some(Duration::ZERO),
        "the harness starts servers without snapshot history"
    );
    assert_eq!(warnings.messages(), Vec::<String>::new());

    for (seconds, warned) in [(10, false), (11, true), (300, true)] {
        client
            .database("admin")
            .run_command(doc! { "setParameter": 1, "minSnapshotHistoryWindowInSeconds": seconds })
            .await
            .unwrap();
        let before = warnings.messages().len();
        // The next start's setup: a store runs its own once.
        let store = MongoEventStore::builder(client.clone())
            .database("window")
            .build()
            .unwrap();
        store.setup().await.unwrap();
        assert_eq!(
            store.snapshot_history_window().await.unwrap(),
            Some(Duration::from_secs(seconds as u64))
        );
        let logged = &warnings.messages()[before..];
        if warned {
            assert_eq!(logged.len(), 1, "{logged:?}");
            assert!(
                logged[0].contains(&format!("keeps {seconds} s of snapshot history"))
                    && logged[0].contains("minSnapshotHistoryWindowInSeconds"),
                "{}",
                logged[0]
            );
        } else {
            assert_eq!(logged, &[] as &[String], "a window of {seconds} s is quiet");
        }
    }
}
