//! An application process for the crash-recovery test: it publishes keyed events in
//! transactions under load, as a service does, so that the test can kill it with transactions
//! open.
//!
//! ```text
//! relaybus-crash-app URI DATABASE HEARTBEAT_MS KEYS [resume]
//! ```
//!
//! Eight tasks commit business documents with their events, keyed `key-0` .. `key-{KEYS-1}`,
//! in a loop. Once 50 of them committed, one more transaction writes a business document and
//! publishes on `held`, prints `holding`, and never ends: it is open when the process dies.
//! The process runs until it is killed.
//!
//! With `resume`, the held transaction's first attempt waits for a line on stdin instead, then
//! writes one more document and commits; later attempts do not wait. Once it committed, the
//! process prints `held committed after N attempts`, and runs on until it is killed.
//!
//! ```text
//! relaybus-crash-app lanes URI DATABASE LEASE_MS HEARTBEAT_MS EVENTS
//! ```
//!
//! Runs a bus whose handler `slow` (of `order.placed.v1`) never ends, with a lease of
//! `LEASE_MS` and a heartbeat expiry of `HEARTBEAT_MS`; once `EVENTS` runs started, it prints
//! `holding` and runs on until it is killed, holding their lanes.
//!
//! ```text
//! relaybus-crash-app slots mongodb|postgres URI DATABASE_OR_SCHEMA LEASE_MS
//! ```
//!
//! Runs a bus whose handler `limited` (of `order.placed.v1`, `global_concurrency(4)`) never
//! ends, with a lease of `LEASE_MS`; once 4 runs hold the handler's 4 slots, it prints
//! `holding` and runs on until it is killed.

use std::{
    process::ExitCode,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use relaybus::{
    MongoEventStore, RelayBus,
    mongodb::{Client, bson::doc},
};
use relaybus_tests::support::placed;
use tokio::sync::Notify;

#[tokio::main]
async fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if let [mode, store, uri, database, lease_ms] = args.as_slice()
        && mode == "slots"
    {
        let Ok(lease_ms) = lease_ms.parse::<u64>() else {
            eprintln!("relaybus-crash-app: LEASE_MS must be a whole number");
            return ExitCode::from(2);
        };
        let lease = Duration::from_millis(lease_ms);
        let held = match store.as_str() {
            "mongodb" => hold_slots_mongodb(uri, database, lease).await,
            "postgres" => hold_slots_postgres(uri, database, lease).await,
            _ => {
                eprintln!("relaybus-crash-app: the store is `mongodb` or `postgres`");
                return ExitCode::from(2);
            }
        };
        if let Err(error) = held {
            eprintln!("relaybus-crash-app: {error}");
            return ExitCode::FAILURE;
        }
        return ExitCode::SUCCESS;
    }
    if let [mode, uri, database, lease_ms, heartbeat_ms, events] = args.as_slice()
        && mode == "lanes"
    {
        let (Ok(lease_ms), Ok(heartbeat_ms), Ok(events)) = (
            lease_ms.parse::<u64>(),
            heartbeat_ms.parse::<u64>(),
            events.parse::<usize>(),
        ) else {
            eprintln!(
                "relaybus-crash-app: LEASE_MS, HEARTBEAT_MS and EVENTS must be whole numbers"
            );
            return ExitCode::from(2);
        };
        let times = (
            Duration::from_millis(lease_ms),
            Duration::from_millis(heartbeat_ms),
        );
        if let Err(error) = hold_lanes(uri, database, times, events).await {
            eprintln!("relaybus-crash-app: {error}");
            return ExitCode::FAILURE;
        }
        return ExitCode::SUCCESS;
    }
    let (uri, database, heartbeat_ms, keys, resume) = match args.as_slice() {
        [uri, database, heartbeat_ms, keys] => (uri, database, heartbeat_ms, keys, false),
        [uri, database, heartbeat_ms, keys, resume] if resume == "resume" => {
            (uri, database, heartbeat_ms, keys, true)
        }
        _ => {
            eprintln!("usage: relaybus-crash-app URI DATABASE HEARTBEAT_MS KEYS [resume]");
            return ExitCode::from(2);
        }
    };
    let (Ok(heartbeat_ms), Ok(keys)) = (heartbeat_ms.parse::<u64>(), keys.parse::<u32>()) else {
        eprintln!("relaybus-crash-app: HEARTBEAT_MS and KEYS must be whole numbers");
        return ExitCode::from(2);
    };
    match run(uri, database, heartbeat_ms, keys.max(1), resume).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("relaybus-crash-app: {error}");
            ExitCode::FAILURE
        }
    }
}

async fn run(
    uri: &str,
    database: &str,
    heartbeat_ms: u64,
    keys: u32,
    resume: bool,
) -> Result<(), relaybus::BoxError> {
    let client = Client::with_uri_str(uri).await?;
    let store = MongoEventStore::builder(client.clone())
        .database(database)
        .heartbeat_expiry(Duration::from_millis(heartbeat_ms))
        .build()?;
    let bus = RelayBus::builder(store)
        .without_registered_handlers()
        .build()?;
    let orders = client.database(database).collection("orders");
    let committed = Arc::new(AtomicU64::new(0));
    let enough = Arc::new(Notify::new());
    for worker in 0..8u32 {
        let (bus, orders) = (bus.clone(), orders.clone());
        let (committed, enough) = (Arc::clone(&committed), Arc::clone(&enough));
        tokio::spawn(async move {
            for n in 0u64.. {
                let key = format!("key-{}", (u64::from(worker) + n) % u64::from(keys));
                let id = format!("w{worker}-{n}");
                let (publisher, orders) = (bus.clone(), orders.clone());
                let result = bus
                    .transaction(async move |session| {
                        orders
                            .insert_one(doc! { "_id": &id, "key": &key })
                            .session(&mut *session)
                            .await?;
                        publisher
                            .publish(&placed(&id))
                            .key(key.clone())
                            .session(session)
                            .await?;
                        Ok(())
                    })
                    .await;
                match result {
                    Ok(()) => {
                        if committed.fetch_add(1, Ordering::Relaxed) + 1 == 50 {
                            enough.notify_one();
                        }
                    }
                    Err(error) => eprintln!("relaybus-crash-app: {error}"),
                }
            }
        });
    }
    enough.notified().await;
    let mut attempts = 0u32;
    bus.transaction(async |session| {
        attempts += 1;
        orders
            .insert_one(doc! { "_id": "held", "key": "held" })
            .session(&mut *session)
            .await?;
        bus.publish(&placed("held"))
            .key("held")
            .session(&mut *session)
            .await?;
        if !resume {
            println!("holding");
            std::future::pending::<()>().await;
        }
        if attempts == 1 {
            println!("holding");
            let line =
                tokio::task::spawn_blocking(|| std::io::stdin().read_line(&mut String::new()));
            line.await
                .map_err(relaybus::Error::custom)?
                .map_err(relaybus::Error::custom)?;
        }
        orders
            .insert_one(doc! { "_id": "held-after", "key": "held" })
            .session(session)
            .await?;
        Ok(())
    })
    .await?;
    println!("held committed after {attempts} attempts");
    std::future::pending::<()>().await;
    Ok(())
}

/// Runs the `slow` handler until `events` runs that never end hold their lanes.
async fn hold_lanes(
    uri: &str,
    database: &str,
    (lease, heartbeat): (Duration, Duration),
    events: usize,
) -> Result<(), relaybus::BoxError> {
    let client = Client::with_uri_str(uri).await?;
    let store = MongoEventStore::builder(client)
        .database(database)
        .heartbeat_expiry(heartbeat)
        .build()?;
    let (started_tx, mut started) = tokio::sync::mpsc::unbounded_channel::<()>();
    let slow = relaybus::Subscription::new(
        "slow",
        move |_: relaybus_tests::support::OrderPlaced, _: relaybus::HandlerContext| {
            let started = started_tx.clone();
            async move {
                let _ = started.send(());
                std::future::pending::<()>().await;
                Ok::<(), relaybus::BoxError>(())
            }
        },
    );
    let bus = RelayBus::builder(store)
        .without_registered_handlers()
        .subscribe(slow)
        .lease_duration(lease)
        .build()?;
    bus.start().await?;
    for _ in 0..events {
        started.recv().await;
    }
    println!("holding");
    std::future::pending::<()>().await;
    Ok(())
}

async fn hold_slots_mongodb(
    uri: &str,
    database: &str,
    lease: Duration,
) -> Result<(), relaybus::BoxError> {
    let client = Client::with_uri_str(uri).await?;
    let store = MongoEventStore::builder(client)
        .database(database)
        .build()?;
    hold_slots(store, lease).await
}

async fn hold_slots_postgres(
    url: &str,
    schema: &str,
    lease: Duration,
) -> Result<(), relaybus::BoxError> {
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(8)
        .connect(url)
        .await?;
    let store = relaybus::PostgresEventStore::builder(pool)
        .schema(schema)
        .build()?;
    hold_slots(store, lease).await
}

/// Runs the limited handler until its 4 slots are held by runs that never end.
async fn hold_slots<S: relaybus::Store>(
    store: S,
    lease: Duration,
) -> Result<(), relaybus::BoxError> {
    let runs = Arc::new(relaybus_tests::limits::Runs::default());
    let handler = relaybus_tests::limits::recording(&runs, None).global_concurrency(4);
    let bus = relaybus_tests::limits::bus(store, handler, lease);
    bus.start().await?;
    runs.until(Duration::from_secs(60), "4 runs hold the slots", |runs| {
        runs.running.load(Ordering::SeqCst) >= 4
    })
    .await;
    println!("holding");
    std::future::pending::<()>().await;
    Ok(())
}
