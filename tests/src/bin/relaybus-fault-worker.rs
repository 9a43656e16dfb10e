//! A worker of the fault suite: one bus running the suite's handlers, as an OS process of its
//! own so that the suite can kill it, pause it and restart it.
//!
//! ```text
//! relaybus-fault-worker [--store mongodb|postgres] [--schedule | --batch] URL DATABASE OWNER LEASE_MS POLL_MS
//! ```
//!
//! On MongoDB (the default) `URL` is a MongoDB URI and `DATABASE` the database; on PostgreSQL
//! `URL` is a `postgres://` URL and `DATABASE` the store's schema (the worker names its
//! connections `OWNER` as their `application_name`).
//!
//! With `--schedule` the bus runs no handler and one schedule instead,
//! [`SCHEDULE`](relaybus_tests::fault::SCHEDULE) every second, publishing
//! `schedule.beat.v1` with no deliveries: the processes of the schedule test.
//!
//! With `--batch` the bus runs the batch scenarios' handler instead of the two handlers
//! ([`relaybus_tests::fault::batch_subscriptions`]).
//!
//! It prints `ready` once its bus runs, and shuts the bus down gracefully on SIGTERM or SIGINT
//! (its lanes are handed back), exiting 0.

use std::{process::ExitCode, str::FromStr, time::Duration};

use relaybus::{
    MongoEventStore, PostgresEventStore, RelayBus, Schedule, Store, Subscription, Tick,
    mongodb::Client,
};
use relaybus_tests::fault;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use tokio::signal::unix::{SignalKind, signal};

const USAGE: &str = "usage: relaybus-fault-worker [--store mongodb|postgres] [--schedule | --batch] \
                     URL DATABASE OWNER LEASE_MS POLL_MS";

#[tokio::main]
async fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_max_level(tracing_subscriber::filter::LevelFilter::INFO)
        .with_ansi(false)
        .with_writer(std::io::stderr)
        .init();
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    let mut store = "mongodb".to_owned();
    if args.first().is_some_and(|a| a == "--store") {
        if args.len() < 2 {
            eprintln!("{USAGE}");
            return ExitCode::from(2);
        }
        store = args.remove(1);
        args.remove(0);
    }
    let mode = match args.first().map(String::as_str) {
        Some("--schedule") => Mode::Schedule,
        Some("--batch") => Mode::Batch,
        _ => Mode::Handlers,
    };
    if mode != Mode::Handlers {
        args.remove(0);
    }
    let [url, database, owner, lease_ms, poll_ms] = args.as_slice() else {
        eprintln!("{USAGE}");
        return ExitCode::from(2);
    };
    let (Ok(lease_ms), Ok(poll_ms)) = (lease_ms.parse::<u64>(), poll_ms.parse::<u64>()) else {
        eprintln!("relaybus-fault-worker: LEASE_MS and POLL_MS must be whole numbers");
        return ExitCode::from(2);
    };
    let timing = Timing {
        owner,
        lease: Duration::from_millis(lease_ms),
        poll: Duration::from_millis(poll_ms),
        mode,
    };
    let outcome = match store.as_str() {
        "mongodb" => run_mongodb(url, database, &timing).await,
        "postgres" => run_postgres(url, database, &timing).await,
        other => {
            eprintln!("relaybus-fault-worker: unknown store {other:?}; {USAGE}");
            return ExitCode::from(2);
        }
    };
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("relaybus-fault-worker {owner}: {error}");
            ExitCode::FAILURE
        }
    }
}

struct Timing<'a> {
    owner: &'a str,
    lease: Duration,
    poll: Duration,
    mode: Mode,
}

/// What the worker's bus runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// The suite's two handlers.
    Handlers,
    /// The schedule, and no handler.
    Schedule,
    /// The batch scenarios' batch handler.
    Batch,
}

async fn run_mongodb(
    uri: &str,
    database: &str,
    timing: &Timing<'_>,
) -> Result<(), relaybus::BoxError> {
    let client = Client::with_uri_str(uri).await?;
    let store = MongoEventStore::builder(client.clone())
        .database(database)
        .build()?;
    let db = client.database(database);
    let subscriptions = match timing.mode {
        Mode::Handlers => fault::subscriptions(&db, timing.owner),
        Mode::Schedule => Vec::new(),
        Mode::Batch => fault::batch_subscriptions(&db, timing.owner),
    };
    run(store, subscriptions, timing).await
}

async fn run_postgres(
    url: &str,
    schema: &str,
    timing: &Timing<'_>,
) -> Result<(), relaybus::BoxError> {
    let options = PgConnectOptions::from_str(url)?.application_name(timing.owner);
    // Lazy: a worker restarted while the server is down connects once it is back.
    let pool = PgPoolOptions::new()
        .max_connections(24)
        .acquire_timeout(Duration::from_secs(10))
        .connect_lazy_with(options);
    let store = PostgresEventStore::builder(pool.clone())
        .schema(schema)
        .build()?;
    let subscriptions = match timing.mode {
        Mode::Handlers => fault::postgres::subscriptions(&pool, schema, timing.owner),
        Mode::Schedule => Vec::new(),
        Mode::Batch => fault::postgres::batch_subscriptions(schema),
    };
    run(store, subscriptions, timing).await
}

async fn run<S: Store>(
    store: S,
    subscriptions: Vec<Subscription>,
    timing: &Timing<'_>,
) -> Result<(), relaybus::BoxError> {
    let owner = timing.owner;
    let mut terminate = signal(SignalKind::terminate())?;
    let mut interrupt = signal(SignalKind::interrupt())?;
    let mut bus = RelayBus::builder(store)
        .without_registered_handlers()
        .without_registered_schedules()
        .owner(owner)
        .lease_duration(timing.lease)
        .poll_interval(timing.poll)
        .batch_size(16)
        .concurrency(16)
        .shutdown_timeout(Duration::from_secs(5));
    for subscription in subscriptions {
        bus = bus.subscribe(subscription);
    }
    if timing.mode == Mode::Schedule {
        bus = bus.schedule(Schedule::every(
            fault::SCHEDULE,
            Duration::from_secs(1),
            |tick: Tick| fault::Beat { at: tick.at() },
        ));
    }
    let bus = bus.build()?;
    // A worker restarted while the server is down or electing keeps trying for a minute.
    let mut tries = 0;
    while let Err(error) = bus.start().await {
        tries += 1;
        if tries >= 120 {
            return Err(error.into());
        }
        eprintln!("relaybus-fault-worker {owner}: start failed, trying again: {error}");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    println!("ready");
    tokio::select! {
        _ = terminate.recv() => {}
        _ = interrupt.recv() => {}
    }
    bus.shutdown().await?;
    println!("stopped");
    Ok(())
}
