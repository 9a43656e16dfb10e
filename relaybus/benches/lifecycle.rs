//! Delivery throughput: deliveries per second through `claim` + `complete_many`, next to the raw
//! driver reading and deleting plain documents in batches of the same size, in the same run on the
//! same server. Also the latency of a claim with and without a blocked backlog of another key.
//!
//! A third subject, the floor, is the raw driver doing per batch only what the store's document
//! model needs, on collections set up by `setup()` (see `common::floor`). Relaybus against the
//! floor is the cost of the store's own work; the floor against the baseline is the cost of the
//! document model.
//!
//! Run with `cargo bench -p relaybus --bench lifecycle`. It uses the replica set at
//! `RELAYBUS_BENCH_MONGODB_URI`, or starts a local one. `RELAYBUS_BENCH_DELIVERIES` sets the
//! deliveries per run (default 10000), `RELAYBUS_BENCH_BATCH` the batch size (default 100). The
//! last line is one JSON object; `ratio` is relaybus / baseline, unkeyed, 4 claimers. Run by
//! `cargo test` (without `--bench`), it makes small runs as a smoke test.

use std::{
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use mongodb::{Client, Database, bson::DateTime};
use relaybus::{AppendRequest, BoxError, EventEnvelope, MongoEventStore};
use tokio::sync::Notify;

mod common;

use common::{baseline, floor, store};

const HANDLER: &str = "projector";
const LEASE: Duration = Duration::from_secs(60);

fn env_number(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

#[derive(Debug, Clone, Copy)]
struct Run {
    keyed: bool,
    claimers: usize,
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    // Run by `cargo test` (without `--bench`), it only checks that everything runs.
    let smoke = !std::env::args().any(|arg| arg == "--bench");
    let (deliveries, batch, backlog, rounds) = if smoke {
        (200, 20, 100, 3)
    } else {
        (
            env_number("RELAYBUS_BENCH_DELIVERIES", 10_000) as usize,
            env_number("RELAYBUS_BENCH_BATCH", 100) as u32,
            5_000,
            30,
        )
    };
    let uri = relaybus_harness::shared_uri("RELAYBUS_BENCH_MONGODB_URI").await?;
    let client = Client::with_uri_str(&uri).await?;
    let prefix = format!("bench_lifecycle_{}", std::process::id());

    println!(
        "lifecycle benchmark: {deliveries} deliveries per run, batches of {batch}, deliveries/s"
    );
    println!(
        "{:<10} {:<8} {:>9} {:>14}",
        "subject", "keys", "claimers", "deliveries/s"
    );
    let mut figures = serde_json::Map::new();
    let mut n = 0;
    for claimers in [1_usize, 4] {
        n += 1;
        let db = client.database(&format!("{prefix}_{n}"));
        let rate = baseline(&db, deliveries, batch, claimers).await?;
        db.drop().await?;
        println!(
            "{:<10} {:<8} {:>9} {:>14.0}",
            "baseline", "-", claimers, rate
        );
        figures.insert(format!("baseline_{claimers}"), rate.round().into());
        n += 1;
        let db = client.database(&format!("{prefix}_{n}"));
        let floor_store = store(&client, &db).await?;
        publish(&floor_store, "e", deliveries, |_| None, DateTime::now()).await?;
        let rate = floor(&floor_store, deliveries, batch, claimers).await?;
        db.drop().await?;
        println!(
            "{:<10} {:<8} {:>9} {:>14.0}",
            "floor", "unkeyed", claimers, rate
        );
        figures.insert(format!("floor_{claimers}"), rate.round().into());
        for keyed in [false, true] {
            n += 1;
            let db = client.database(&format!("{prefix}_{n}"));
            let rate = relaybus(&client, &db, deliveries, batch, Run { keyed, claimers }).await?;
            db.drop().await?;
            let keys = if keyed { "100 keys" } else { "unkeyed" };
            println!(
                "{:<10} {:<8} {:>9} {:>14.0}",
                "relaybus", keys, claimers, rate
            );
            let name = if keyed { "keyed" } else { "unkeyed" };
            figures.insert(format!("{name}_{claimers}"), rate.round().into());
        }
    }

    n += 1;
    let db = client.database(&format!("{prefix}_{n}"));
    let (plain, with_backlog) = claim_latency(&client, &db, batch, backlog, rounds).await?;
    db.drop().await?;
    println!(
        "claim of {batch} (median of {rounds}): {:.2} ms, with a blocked backlog of {backlog} of another key: {:.2} ms",
        plain * 1e3,
        with_backlog * 1e3
    );
    let number = |name: &str| {
        figures
            .get(name)
            .and_then(|v| v.as_f64())
            .unwrap_or(f64::NAN)
    };
    let ratio = number("unkeyed_4") / number("baseline_4");
    let floor_ratio = number("floor_4") / number("baseline_4");
    let slowdown = with_backlog / plain;
    figures.insert("claim_ms".into(), round3(plain * 1e3).into());
    figures.insert(
        "claim_with_backlog_ms".into(),
        round3(with_backlog * 1e3).into(),
    );
    figures.insert("backlog".into(), backlog.into());
    figures.insert("backlog_slowdown".into(), round3(slowdown).into());
    figures.insert("deliveries_per_run".into(), deliveries.into());
    figures.insert("batch".into(), batch.into());
    figures.insert("floor_ratio".into(), round3(floor_ratio).into());
    figures.insert("ratio".into(), round3(ratio).into());
    println!(
        "ratio (relaybus unkeyed / baseline, 4 claimers): {ratio:.3}; the floor of the document \
         model: {floor_ratio:.3}; backlog slowdown: {slowdown:.2}x"
    );
    let mut line = serde_json::Map::new();
    line.insert("bench".into(), "lifecycle".into());
    line.extend(figures);
    println!("{}", serde_json::Value::Object(line));
    Ok(())
}

fn round3(value: f64) -> f64 {
    (value * 1000.0).round() / 1000.0
}

/// Appends `count` events, unkeyed or over 100 keys, in transactions of 1000.
async fn publish(
    store: &MongoEventStore,
    tag: &str,
    count: usize,
    key: impl Fn(usize) -> Option<String>,
    now: DateTime,
) -> Result<(), BoxError> {
    let handlers = vec![HANDLER.to_owned()];
    let events: Vec<EventEnvelope> = (0..count)
        .map(|i| {
            let event = EventEnvelope::from_json(
                "order.placed.v1",
                serde_json::json!({ "order": i, "total_cents": 1250 }),
            )?
            .with_id(format!("{tag}-{i}"))?;
            Ok::<_, BoxError>(match key(i) {
                Some(key) => event.with_key(key)?,
                None => event,
            })
        })
        .collect::<Result<_, _>>()?;
    for chunk in events.chunks(1_000) {
        let requests: Vec<AppendRequest<'_>> = chunk
            .iter()
            .map(|e| AppendRequest::new(e, &handlers))
            .collect();
        store
            .transaction(async |session| store.append(session, &requests, now).await)
            .await?;
    }
    Ok(())
}

/// Drains `deliveries` with `claimers` claimers, each on its own store instance; deliveries/s.
async fn relaybus(
    client: &Client,
    db: &Database,
    deliveries: usize,
    batch: u32,
    run: Run,
) -> Result<f64, BoxError> {
    let first = store(client, db).await?;
    let keys = 100;
    publish(
        &first,
        "e",
        deliveries,
        |i| run.keyed.then(|| format!("key-{}", i % keys)),
        DateTime::now(),
    )
    .await?;
    let done = Arc::new(AtomicU64::new(0));
    let progress = Arc::new(Notify::new());
    let started = Instant::now();
    let mut tasks = Vec::new();
    for n in 0..run.claimers {
        let store = MongoEventStore::builder(client.clone())
            .database(db.name())
            .build()?;
        let done = Arc::clone(&done);
        let progress = Arc::clone(&progress);
        let target = deliveries as u64;
        tasks.push(tokio::spawn(async move {
            let owner = format!("claimer-{n}");
            while done.load(Ordering::SeqCst) < target {
                let notified = progress.notified();
                tokio::pin!(notified);
                notified.as_mut().enable();
                let claimed = store
                    .claim(&owner, &[HANDLER], batch, LEASE, DateTime::now())
                    .await?;
                if claimed.is_empty() {
                    if done.load(Ordering::SeqCst) < target {
                        notified.await;
                    }
                    continue;
                }
                let leases: Vec<_> = claimed.iter().map(|d| *d.lease()).collect();
                let completed = store.complete_many(&leases, DateTime::now()).await?;
                let completed = completed.iter().filter(|c| **c).count() as u64;
                done.fetch_add(completed, Ordering::SeqCst);
                progress.notify_waiters();
            }
            progress.notify_waiters();
            Ok::<(), relaybus::Error>(())
        }));
    }
    for task in tasks {
        task.await??;
    }
    Ok(deliveries as f64 / started.elapsed().as_secs_f64())
}

/// Median time of a claim of `batch` unkeyed deliveries (each batch completed before the next
/// claim), in two databases side by side: one plain, one with `backlog` deliveries of another
/// key waiting behind its running head. Claims alternate between the two, so that both see the
/// same server conditions.
async fn claim_latency(
    client: &Client,
    db: &Database,
    batch: u32,
    backlog: usize,
    rounds: usize,
) -> Result<(f64, f64), BoxError> {
    let backlog_db = client.database(&format!("{}_backlog", db.name()));
    let plain = store(client, db).await?;
    let blocked = store(client, &backlog_db).await?;
    let now = DateTime::now();
    publish(&blocked, "hot", backlog, |_| Some("hot".to_owned()), now).await?;
    // The hot key's head keeps running; the first measured claim parks the rest of its key.
    let head = blocked
        .claim("w", &[HANDLER], 1, LEASE, DateTime::now())
        .await?;
    assert_eq!(head.len(), 1, "the head of the hot key");
    for store in [&plain, &blocked] {
        publish(store, "e", batch as usize * rounds, |_| None, now).await?;
    }
    let claim = async |store: &MongoEventStore| -> Result<f64, BoxError> {
        let started = Instant::now();
        let claimed = store
            .claim("w", &[HANDLER], batch, LEASE, DateTime::now())
            .await?;
        let elapsed = started.elapsed().as_secs_f64();
        let leases: Vec<_> = claimed.iter().map(|d| *d.lease()).collect();
        store.complete_many(&leases, DateTime::now()).await?;
        Ok(elapsed)
    };
    let mut plain_times = Vec::with_capacity(rounds);
    let mut backlog_times = Vec::with_capacity(rounds);
    for _ in 0..rounds {
        plain_times.push(claim(&plain).await?);
        backlog_times.push(claim(&blocked).await?);
    }
    backlog_db.drop().await?;
    let median = |mut times: Vec<f64>| {
        times.sort_by(f64::total_cmp);
        times[times.len() / 2]
    };
    Ok((median(plain_times), median(backlog_times)))
}
