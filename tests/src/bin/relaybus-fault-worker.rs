//! A worker of the fault suite: one bus running the suite's handlers, as an OS process of its
//! own so that the suite can kill it, pause it and restart it.
//!
//! ```text
//! relaybus-fault-worker URI DATABASE OWNER LEASE_MS POLL_MS
//! ```
//!
//! It prints `ready` once its bus runs, and shuts the bus down gracefully on SIGTERM or SIGINT
//! (its lanes are handed back), exiting 0.

use std::{process::ExitCode, time::Duration};

use relaybus::{MongoEventStore, RelayBus, mongodb::Client};
use relaybus_tests::fault;
use tokio::signal::unix::{SignalKind, signal};

#[tokio::main]
async fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_max_level(tracing_subscriber::filter::LevelFilter::INFO)
        .with_ansi(false)
        .with_writer(std::io::stderr)
        .init();
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [uri, database, owner, lease_ms, poll_ms] = args.as_slice() else {
        eprintln!("usage: relaybus-fault-worker URI DATABASE OWNER LEASE_MS POLL_MS");
        return ExitCode::from(2);
    };
    let (Ok(lease_ms), Ok(poll_ms)) = (lease_ms.parse::<u64>(), poll_ms.parse::<u64>()) else {
        eprintln!("relaybus-fault-worker: LEASE_MS and POLL_MS must be whole numbers");
        return ExitCode::from(2);
    };
    match run(uri, database, owner, lease_ms, poll_ms).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("relaybus-fault-worker {owner}: {error}");
            ExitCode::FAILURE
        }
    }
}

async fn run(
    uri: &str,
    database: &str,
    owner: &str,
    lease_ms: u64,
    poll_ms: u64,
) -> Result<(), relaybus::BoxError> {
    let mut terminate = signal(SignalKind::terminate())?;
    let mut interrupt = signal(SignalKind::interrupt())?;
    let client = Client::with_uri_str(uri).await?;
    let store = MongoEventStore::builder(client.clone())
        .database(database)
        .build()?;
    let mut bus = RelayBus::builder(store)
        .without_registered_handlers()
        .owner(owner)
        .lease_duration(Duration::from_millis(lease_ms))
        .poll_interval(Duration::from_millis(poll_ms))
        .batch_size(16)
        .concurrency(16)
        .shutdown_timeout(Duration::from_secs(5));
    for subscription in fault::subscriptions(&client.database(database), owner) {
        bus = bus.subscribe(subscription);
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
