//! Crash recovery: a process killed with transactions open stops holding its keys once its
//! heartbeat expires, instead of for the server's `transactionLifetimeLimitSeconds`.

use std::{
    io::{BufRead, BufReader},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use futures::future::join_all;
use mongodb::bson::{Document, doc};
use relaybus::{ConfigurationError, MongoEventStore};
use relaybus_harness::{TestDb, test_db};
use relaybus_tests::support::{all, placed, publisher};

const APP: &str = env!("CARGO_BIN_EXE_relaybus-crash-app");

/// The heartbeat expiry of the killed process and of the test's own store.
const HEARTBEAT: Duration = Duration::from_secs(2);
/// The target: the dead process's keys take publishes again within a lease duration...
const LEASE: Duration = Duration::from_secs(5);
/// ... with a margin for a busy two-core machine running other tests.
const MARGIN: Duration = Duration::from_secs(2);

fn store(db: &TestDb) -> MongoEventStore {
    MongoEventStore::builder(db.client.clone())
        .database(&db.name)
        .heartbeat_expiry(HEARTBEAT)
        .build()
        .expect("valid options")
}

async fn processes(db: &TestDb) -> Vec<Document> {
    all(db, "relaybus_processes").await
}

/// The server's own limit, after which it aborts a dead client's transactions anyway.
async fn transaction_lifetime_limit(db: &TestDb) -> Duration {
    let reply = db
        .client
        .database("admin")
        .run_command(doc! { "getParameter": 1, "transactionLifetimeLimitSeconds": 1 })
        .await
        .expect("getParameter");
    let seconds = match reply.get("transactionLifetimeLimitSeconds") {
        Some(mongodb::bson::Bson::Int32(n)) => u64::try_from(*n).unwrap_or(0),
        Some(mongodb::bson::Bson::Int64(n)) => u64::try_from(*n).unwrap_or(0),
        other => panic!("transactionLifetimeLimitSeconds: {other:?}"),
    };
    Duration::from_secs(seconds)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_process_killed_mid_load_frees_its_keys_within_the_lease_duration() {
    let db = test_db("crash_frees_keys").await;
    let store = store(&db);
    store.setup().await.unwrap();
    let limit = transaction_lifetime_limit(&db).await;
    assert!(
        limit > LEASE + MARGIN,
        "the server aborts dead transactions after {limit:?} anyway; the test needs a longer limit"
    );

    let mut command = Command::new(APP);
    command
        .args([
            db.uri.as_str(),
            db.name.as_str(),
            &HEARTBEAT.as_millis().to_string(),
            "4",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    let mut app = relaybus_harness::spawn_tied(command).expect("start the application");
    let stdout = app.stdout.take().expect("piped stdout");
    let holding = tokio::task::spawn_blocking(move || {
        BufReader::new(stdout)
            .lines()
            .map_while(Result::ok)
            .any(|line| line == "holding")
    });
    let holding = tokio::time::timeout(Duration::from_secs(60), holding)
        .await
        .expect("the application holds a transaction within a minute")
        .unwrap();
    assert!(
        holding,
        "the application exited before holding its transaction"
    );

    // The application named the sessions of its transactions before it started them.
    let recorded = processes(&db).await;
    assert_eq!(recorded.len(), 1, "one process document: {recorded:?}");
    let sessions = recorded[0].get_array("sessions").unwrap().len();
    assert!(
        sessions >= 2,
        "the load and the held transaction: {recorded:?}"
    );

    relaybus_harness::kill_tied(&mut app);
    let killed = Instant::now();

    // Publish on every key the dead process was writing: the held one, whose counter its open
    // transaction holds, and the load's keys, whose transactions were cut off mid-flight.
    let bus = publisher(&store, &["projector"]);
    let orders = db.db().collection::<Document>("orders");
    let keys = ["held", "key-0", "key-1", "key-2", "key-3"];
    let took = join_all(keys.iter().map(|key| {
        let (bus, orders) = (bus.clone(), orders.clone());
        async move {
            let id = format!("after-{key}");
            let publisher = bus.clone();
            bus.transaction(async move |session| {
                orders
                    .insert_one(doc! { "_id": &id, "key": *key })
                    .session(&mut *session)
                    .await?;
                publisher
                    .publish(&placed(&id))
                    .key(*key)
                    .session(session)
                    .await?;
                Ok(())
            })
            .await
            .unwrap_or_else(|e| panic!("publish on {key} after the crash: {e}"));
            killed.elapsed()
        }
    }))
    .await;
    let worst = took.iter().max().copied().unwrap();
    eprintln!(
        "crash recovery: publishes on the dead process's {} keys succeeded {:?} after the kill \
         (each: {took:?}); heartbeat expiry {HEARTBEAT:?}, server limit {limit:?}",
        keys.len(),
        worst
    );
    assert!(
        worst <= LEASE + MARGIN,
        "the dead process's keys took publishes again only after {worst:?}"
    );

    // Its held transaction was aborted, never committed: the key's first event is ours.
    assert!(
        orders
            .find_one(doc! { "_id": "held" })
            .await
            .unwrap()
            .is_none(),
        "the held transaction's write must not survive"
    );
    let held: Vec<Document> = all(&db, "relaybus_events")
        .await
        .into_iter()
        .filter(|event| event.get_str("key") == Ok("held"))
        .collect();
    assert_eq!(held.len(), 1, "{held:?}");
    assert_eq!(held[0].get_i64("sequence").unwrap(), 1, "{held:?}");

    // The dead process's document is gone; only the test's own store beats.
    let left = processes(&db).await;
    assert_eq!(left.len(), 1, "{left:?}");
    assert_ne!(left[0].get("_id"), recorded[0].get("_id"));
    db.drop_database().await.unwrap();
}

#[tokio::test]
async fn a_dropped_store_takes_its_process_document_away() {
    let db = test_db("crash_dropped_store").await;
    let first = store(&db);
    first.setup().await.unwrap();
    first
        .transaction(async |_| Ok(()))
        .await
        .expect("a transaction");
    let recorded = processes(&db).await;
    assert_eq!(recorded.len(), 1, "{recorded:?}");
    assert_eq!(recorded[0].get_array("sessions").unwrap().len(), 1);
    drop(first);

    // Its sessions went back to the client's pool, where another store may take them: the
    // document must go, so that nobody kills them later.
    let gone = async {
        while !processes(&db).await.is_empty() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    tokio::time::timeout(HEARTBEAT * 2, gone)
        .await
        .expect("the dropped store's document is deleted within a beat");

    // Without crash recovery, nothing is recorded.
    let quiet = MongoEventStore::builder(db.client.clone())
        .database(&db.name)
        .crash_recovery(false)
        .build()
        .unwrap();
    quiet.transaction(async |_| Ok(())).await.unwrap();
    assert!(processes(&db).await.is_empty());
    db.drop_database().await.unwrap();
}

#[tokio::test]
async fn a_heartbeat_expiry_out_of_range_is_refused() {
    let db = test_db("crash_bad_expiry").await;
    for expiry in [
        Duration::ZERO,
        Duration::from_millis(999),
        Duration::from_secs(601),
    ] {
        let error = MongoEventStore::builder(db.client.clone())
            .database(&db.name)
            .heartbeat_expiry(expiry)
            .build()
            .unwrap_err();
        assert!(
            matches!(
                &error,
                ConfigurationError::InvalidOption {
                    option: "heartbeat_expiry",
                    ..
                }
            ),
            "{error:?}"
        );
        assert!(
            error.to_string().contains("1 second to 10 minutes"),
            "{error}"
        );
    }
}
