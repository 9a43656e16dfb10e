//! Rebalancing: how long lanes take to move when a bus joins draining buses, and when a bus is
//! SIGKILLed while it drains.
//!
//! - **Join**: three buses drain a backlog; a fourth starts. The time until it holds every lane
//!   of its share (`rebalance_join_s`), and how many deliveries ran twice meanwhile (none may:
//!   a lane moves only once its holder's deliveries there settled).
//! - **Kill**: three buses and a fourth in a child process (this benchmark run again as a bus)
//!   drain a backlog; once the child holds lanes, it is SIGKILLed. The time until every lane it
//!   held is held by a live bus (`rebalance_kill_s`): a process of this host that is gone
//!   leaves its lanes at the next beat of the member lists, not at the end of its lease.

use std::{
    collections::HashMap,
    process::Stdio,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use futures::future::try_join_all;
use mongodb::{
    Client, Database,
    bson::{Document, doc},
};
use relaybus::{BoxError, HandlerContext, MongoEventStore, RelayBus, Subscription};
use tokio::io::{AsyncBufReadExt, BufReader};

use super::{Tick, assert_drained, common::store, publish};

/// What a child bus process is told through its environment.
const ROLE: &str = "RELAYBUS_BENCH_ROLE";
const CHILD_URI: &str = "RELAYBUS_BENCH_CHILD_URI";
const CHILD_DB: &str = "RELAYBUS_BENCH_CHILD_DB";
/// The owner name of the bus that is killed.
const KILLED: &str = "bench-killed";
/// Handler slots per bus: a few, so that lanes settle quickly and the backlog lasts.
const SLOTS: usize = 8;
/// How long a delivery's handler takes.
const WORK: Duration = Duration::from_millis(2);
/// How often the lanes are looked at.
const LOOK: Duration = Duration::from_millis(20);
/// The buses' lease, the default one.
const LEASE: Duration = Duration::from_secs(30);

/// The figures of both runs.
pub(crate) struct Rebalance {
    pub(crate) join_s: f64,
    pub(crate) join_run_twice: usize,
    pub(crate) kill_s: f64,
    pub(crate) lease_s: f64,
}

/// Runs this process as a child bus when it was started as one; `false` when it was not.
pub(crate) async fn child_bus() -> Result<bool, BoxError> {
    if std::env::var(ROLE).as_deref() != Ok("bus") {
        return Ok(false);
    }
    let client = Client::with_uri_str(std::env::var(CHILD_URI)?).await?;
    let db = client.database(&std::env::var(CHILD_DB)?);
    let store = store(&client, &db).await?;
    let bus = bus(&store, KILLED, Arc::new(Mutex::new(HashMap::new())))?;
    bus.start().await?;
    println!("started");
    // Runs until it is killed.
    std::future::pending::<()>().await;
    Ok(true)
}

/// Both runs, each on a database of its own.
pub(crate) async fn rebalance(
    client: &Client,
    uri: &str,
    dbs: [Database; 2],
    backlog: usize,
) -> Result<Rebalance, BoxError> {
    let [join_db, kill_db] = dbs;
    let (join_s, join_run_twice) = join(client, &join_db, backlog).await?;
    join_db.drop().await?;
    let (kill_s, lease_s) = kill(client, uri, &kill_db, backlog).await?;
    kill_db.drop().await?;
    Ok(Rebalance {
        join_s,
        join_run_twice,
        kill_s,
        lease_s,
    })
}

/// A draining bus that counts the runs of each event in `runs`.
fn bus(
    store: &MongoEventStore,
    owner: &str,
    runs: Arc<Mutex<HashMap<String, usize>>>,
) -> Result<RelayBus, BoxError> {
    Ok(RelayBus::builder(store.clone())
        .owner(owner)
        .batch_size(super::BATCH)
        .concurrency(SLOTS)
        .lease_duration(LEASE)
        .retention(None)
        .setup_on_start(false)
        .subscribe(Subscription::new(
            "tick",
            move |_: Tick, context: HandlerContext| {
                let runs = Arc::clone(&runs);
                async move {
                    *runs
                        .lock()
                        .map_err(|_| "the run counts were poisoned")?
                        .entry(context.event_id().to_owned())
                        .or_default() += 1;
                    tokio::time::sleep(WORK).await;
                    Ok::<(), BoxError>(())
                }
            },
        ))
        .build()?)
}

/// The lanes `owner` holds.
async fn held_by(db: &Database, owner: &str) -> Result<Vec<i32>, BoxError> {
    let lanes = db.collection::<Document>("relaybus_lanes");
    let mut held = Vec::new();
    let mut cursor = lanes.find(doc! { "owner": owner }).await?;
    while cursor.advance().await? {
        held.push(cursor.deserialize_current()?.get_i32("_id")?);
    }
    Ok(held)
}

/// Seconds until a fourth bus holds its share of the lanes three draining buses held, and the
/// deliveries that ran more than once.
async fn join(client: &Client, db: &Database, backlog: usize) -> Result<(f64, usize), BoxError> {
    let store = store(client, db).await?;
    publish(&store, backlog, None).await?;
    let runs = Arc::new(Mutex::new(HashMap::new()));
    let mut buses = Vec::new();
    for i in 0..3 {
        let bus = bus(&store, &format!("bench-{i}"), Arc::clone(&runs))?;
        bus.start().await?;
        buses.push(bus);
    }
    // Draining, with the three holding every lane between them.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let mut held = 0;
        for i in 0..3 {
            held += held_by(db, &format!("bench-{i}")).await?.len();
        }
        if held == 256 {
            break;
        }
        if Instant::now() > deadline {
            return Err(format!("three buses held {held} of the 256 lanes after 60 s").into());
        }
        tokio::time::sleep(LOOK).await;
    }
    let fourth = bus(&store, "bench-3", Arc::clone(&runs))?;
    let started = Instant::now();
    fourth.start().await?;
    let joined = loop {
        let share = store.lane_share("bench-3").unwrap_or_default();
        let held = held_by(db, "bench-3").await?;
        if !share.is_empty() && share.iter().all(|lane| held.contains(lane)) {
            break started.elapsed();
        }
        if started.elapsed() > Duration::from_secs(120) {
            return Err(format!(
                "the fourth bus held {} of its {} lanes after 120 s",
                held.len(),
                share.len()
            )
            .into());
        }
        tokio::time::sleep(LOOK).await;
    };
    buses.push(fourth);
    wait_drained(&runs, backlog).await?;
    try_join_all(buses.iter().map(RelayBus::shutdown)).await?;
    assert_drained(db).await?;
    let twice = runs
        .lock()
        .map_err(|_| "the run counts were poisoned")?
        .values()
        .filter(|runs| **runs > 1)
        .count();
    Ok((joined.as_secs_f64(), twice))
}

/// Seconds from a SIGKILL of a draining bus (in a child process) until every lane it held is
/// held by one of the three live buses; and the lease duration it must wait out.
async fn kill(
    client: &Client,
    uri: &str,
    db: &Database,
    backlog: usize,
) -> Result<(f64, f64), BoxError> {
    let store = store(client, db).await?;
    publish(&store, backlog, None).await?;
    let runs = Arc::new(Mutex::new(HashMap::new()));
    let mut buses = Vec::new();
    for i in 0..3 {
        let bus = bus(&store, &format!("bench-{i}"), Arc::clone(&runs))?;
        bus.start().await?;
        buses.push(bus);
    }
    let mut child = tokio::process::Command::new(std::env::current_exe()?)
        .env(ROLE, "bus")
        .env(CHILD_URI, uri)
        .env(CHILD_DB, db.name())
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()?;
    let stdout = child.stdout.take().ok_or("the child bus has no output")?;
    let mut lines = BufReader::new(stdout).lines();
    match tokio::time::timeout(Duration::from_secs(60), lines.next_line()).await?? {
        Some(line) if line == "started" => {}
        other => return Err(format!("the child bus did not start: {other:?}").into()),
    }
    // Killed once it holds a quarter of the lanes, a few less for the hashing's spread.
    let deadline = Instant::now() + Duration::from_secs(60);
    let held = loop {
        let held = held_by(db, KILLED).await?;
        if held.len() >= 40 {
            break held;
        }
        if Instant::now() > deadline {
            return Err(format!("the child bus held {} lanes after 60 s", held.len()).into());
        }
        tokio::time::sleep(LOOK).await;
    };
    child.start_kill()?;
    let killed = Instant::now();
    child.wait().await?;
    let lanes = db.collection::<Document>("relaybus_lanes");
    let live: Vec<String> = (0..3).map(|i| format!("bench-{i}")).collect();
    let moved = loop {
        let taken = lanes
            .count_documents(doc! { "_id": { "$in": &held }, "owner": { "$in": &live } })
            .await?;
        if taken as usize == held.len() {
            break killed.elapsed();
        }
        if killed.elapsed() > Duration::from_secs(120) {
            return Err(format!(
                "live buses held {taken} of the {} lanes of the killed bus after 120 s",
                held.len()
            )
            .into());
        }
        tokio::time::sleep(LOOK).await;
    };
    // What the killed bus had claimed runs again: every event runs at least once.
    wait_drained(&runs, backlog).await?;
    try_join_all(buses.iter().map(RelayBus::shutdown)).await?;
    assert_drained(db).await?;
    Ok((moved.as_secs_f64(), LEASE.as_secs_f64()))
}

/// Waits until every one of `backlog` events ran in this process.
async fn wait_drained(
    runs: &Arc<Mutex<HashMap<String, usize>>>,
    backlog: usize,
) -> Result<(), BoxError> {
    let deadline = Instant::now() + Duration::from_secs(180);
    loop {
        let ran = runs
            .lock()
            .map_err(|_| "the run counts were poisoned")?
            .len();
        if ran >= backlog {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(format!("{ran} of {backlog} events ran after 180 s").into());
        }
        tokio::time::sleep(LOOK).await;
    }
}
