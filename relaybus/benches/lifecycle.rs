//! Delivery throughput: deliveries per second through `claim` + `complete_many`, next to the raw
//! driver reading and deleting plain documents in batches of the same size, in the same run on the
//! same server. Also the latency of a claim with and without a blocked backlog of another key.
//!
//! Keyed work (100 keys) runs through `claim` too, one delivery of a key per claim. With several
//! claimers, each relaybus row also gives the share of the deliveries the busiest claimer
//! completed (`*_busiest_share`; an even spread over 4 is 0.25).
//!
//! A third subject, the floor, is the raw driver doing per batch only what the store's document
//! model needs, on collections set up by `setup()` (see `common::floor`). Relaybus against the
//! floor is the cost of the store's own work; the floor against the baseline is the cost of the
//! document model.
//!
//! At 4 claimers, the floor and relaybus unkeyed also run on a store set up without the three
//! listing indexes (`MongoEventStoreBuilder::listing_indexes(false)`): seven secondary indexes
//! on the deliveries instead of ten, which is what those indexes cost each delivery. With
//! `RELAYBUS_BENCH_INDEX_COSTS=1` it also measures, for each secondary index of the deliveries,
//! the floor at 4 claimers with that one index dropped, `RELAYBUS_BENCH_INDEX_ROUNDS` rounds
//! (default 3) taking turns, and prints the medians as a table.
//!
//! Run with `cargo bench -p relaybus --bench lifecycle`. It uses the replica set at
//! `RELAYBUS_BENCH_MONGODB_URI`, or starts a local one. `RELAYBUS_BENCH_DELIVERIES` sets the
//! deliveries per run (default 10000), `RELAYBUS_BENCH_BATCH` the batch size (default 100),
//! `RELAYBUS_BENCH_SNAPSHOT_WINDOW=N` the server's snapshot history window to `N` seconds first
//! (the server keeps it; the header says the window the run had). The last line is one JSON
//! object; `ratio` is relaybus / baseline, unkeyed, 4 claimers, and `snapshot_window_s` the
//! window. Run by `cargo test` (without `--bench`), it makes small runs as a smoke test.

use std::{
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use mongodb::{
    Client, Database,
    bson::{DateTime, Document},
};
use relaybus::{AppendRequest, BoxError, EventEnvelope, MongoEventStore};
use tokio::sync::Notify;

mod common;

use common::{baseline, floor, store, store_with};

const HANDLER: &str = "projector";
const LEASE: Duration = Duration::from_secs(60);
/// How long a claimer that found nothing waits for another's completion before it claims again.
const POLL: Duration = Duration::from_millis(100);

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
    /// Whether the store keeps its three listing indexes.
    listing_indexes: bool,
}

/// What the printed rows say of the indexes of a run.
fn indexes_column(listing_indexes: bool) -> &'static str {
    if listing_indexes { "all" } else { "no listing" }
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
    let probe = client.database(&format!("{prefix}_window"));
    let window = common::snapshot_window(&client, &store(&client, &probe).await?).await?;
    probe.drop().await?;

    println!(
        "lifecycle benchmark: {deliveries} deliveries per run, batches of {batch}, deliveries/s; \
         the server's snapshot history window: {}",
        window_text(window)
    );
    println!(
        "{:<10} {:<8} {:>9} {:>14}  indexes",
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
            "{:<10} {:<8} {:>9} {:>14.0}  -",
            "baseline", "-", claimers, rate
        );
        figures.insert(format!("baseline_{claimers}"), rate.round().into());
        // At 4 claimers, also without the listing indexes: what they cost each delivery.
        let listings: &[bool] = if claimers == 4 {
            &[true, false]
        } else {
            &[true]
        };
        for &listing_indexes in listings {
            n += 1;
            let db = client.database(&format!("{prefix}_{n}"));
            let floor_store = store_with(&client, &db, listing_indexes).await?;
            let appended = timed_publish(&floor_store, deliveries).await?;
            let rate = floor(&floor_store, deliveries, batch, claimers).await?;
            // The store goes first: its heartbeat would write to the dropped database again
            // and leave it behind on the server.
            drop(floor_store);
            db.drop().await?;
            if claimers == 4 {
                // The other half of what an index costs: its entry of each inserted delivery.
                figures.insert(
                    format!("append{}", name_suffix(listing_indexes)),
                    appended.round().into(),
                );
            }
            println!(
                "{:<10} {:<8} {:>9} {:>14.0}  {}",
                "floor",
                "unkeyed",
                claimers,
                rate,
                indexes_column(listing_indexes)
            );
            figures.insert(
                format!("floor_{claimers}{}", name_suffix(listing_indexes)),
                rate.round().into(),
            );
        }
        let mut runs: Vec<Run> = listings
            .iter()
            .map(|&listing_indexes| Run {
                keyed: false,
                claimers,
                listing_indexes,
            })
            .collect();
        runs.push(Run {
            keyed: true,
            claimers,
            listing_indexes: true,
        });
        for run in runs {
            n += 1;
            let db = client.database(&format!("{prefix}_{n}"));
            let (rate, busiest) = relaybus(&client, &db, deliveries, batch, run).await?;
            db.drop().await?;
            let keys = if run.keyed { "100 keys" } else { "unkeyed" };
            let busiest_column = if claimers > 1 {
                format!("; the busiest claimer completed {:.0} %", busiest * 100.0)
            } else {
                String::new()
            };
            println!(
                "{:<10} {:<8} {:>9} {:>14.0}  {}{busiest_column}",
                "relaybus",
                keys,
                claimers,
                rate,
                indexes_column(run.listing_indexes)
            );
            let name = if run.keyed { "keyed" } else { "unkeyed" };
            figures.insert(
                format!("{name}_{claimers}{}", name_suffix(run.listing_indexes)),
                rate.round().into(),
            );
            if claimers > 1 {
                figures.insert(
                    format!(
                        "{name}_{claimers}{}_busiest_share",
                        name_suffix(run.listing_indexes)
                    ),
                    round3(busiest).into(),
                );
            }
        }
    }

    if std::env::var("RELAYBUS_BENCH_INDEX_COSTS").is_ok_and(|v| v == "1") {
        let rounds = if smoke {
            1
        } else {
            env_number("RELAYBUS_BENCH_INDEX_ROUNDS", 3).max(1) as usize
        };
        let costs = index_costs(&client, &prefix, deliveries, batch, rounds).await?;
        print_index_costs(&costs, rounds);
        for cost in &costs {
            let variant = match &cost.dropped {
                Some(index) => format!("without_{index}"),
                None => "all_indexes".to_owned(),
            };
            figures.insert(format!("floor_4_{variant}"), cost.floor.round().into());
            figures.insert(format!("append_{variant}"), cost.append.round().into());
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
    let floor_gain = number("floor_4_no_listing") / number("floor_4");
    let append_gain = number("append_no_listing") / number("append");
    let unkeyed_gain = number("unkeyed_4_no_listing") / number("unkeyed_4");
    let slowdown = with_backlog / plain;
    // Keyed against unkeyed at the same claimer count.
    let keyed_ratios: Vec<(String, f64)> = [1, 4]
        .into_iter()
        .map(|claimers| {
            (
                format!("keyed_{claimers}_of_unkeyed"),
                number(&format!("keyed_{claimers}")) / number(&format!("unkeyed_{claimers}")),
            )
        })
        .collect();
    figures.insert("claim_ms".into(), round3(plain * 1e3).into());
    figures.insert(
        "claim_with_backlog_ms".into(),
        round3(with_backlog * 1e3).into(),
    );
    figures.insert("backlog".into(), backlog.into());
    figures.insert("backlog_slowdown".into(), round3(slowdown).into());
    for (name, value) in keyed_ratios {
        figures.insert(name, round3(value).into());
    }
    figures.insert("deliveries_per_run".into(), deliveries.into());
    figures.insert("batch".into(), batch.into());
    figures.insert("floor_ratio".into(), round3(floor_ratio).into());
    figures.insert("ratio".into(), round3(ratio).into());
    figures.insert("no_listing_floor_gain".into(), round3(floor_gain).into());
    figures.insert("no_listing_append_gain".into(), round3(append_gain).into());
    figures.insert(
        "no_listing_unkeyed_gain".into(),
        round3(unkeyed_gain).into(),
    );
    println!(
        "ratio (relaybus unkeyed / baseline, 4 claimers): {ratio:.3}; the floor of the document \
         model: {floor_ratio:.3}; backlog slowdown: {slowdown:.2}x"
    );
    println!(
        "without the listing indexes: appends {append_gain:.3}x, floor (4 claimers) \
         {floor_gain:.3}x, relaybus unkeyed (4 claimers) {unkeyed_gain:.3}x the rate with them"
    );
    let mut line = serde_json::Map::new();
    line.insert("bench".into(), "lifecycle".into());
    line.insert("snapshot_window_s".into(), window.into());
    line.extend(figures);
    println!("{}", serde_json::Value::Object(line));
    Ok(())
}

/// The snapshot history window as the header says it.
fn window_text(window: Option<u64>) -> String {
    window.map_or_else(|| "not reported".to_owned(), |s| format!("{s} s"))
}

/// The end of a figure's name: nothing with all indexes, `_no_listing` without the listing ones.
fn name_suffix(listing_indexes: bool) -> &'static str {
    if listing_indexes { "" } else { "_no_listing" }
}

/// The floor at 4 claimers with all indexes (`None`) and with each secondary index of the
/// deliveries dropped in turn: the median deliveries/s of `rounds` rounds, each round running
/// every variant once, in the order of the indexes.
async fn index_costs(
    client: &Client,
    prefix: &str,
    deliveries: usize,
    batch: u32,
    rounds: usize,
) -> Result<Vec<IndexCost>, BoxError> {
    let probe = client.database(&format!("{prefix}_indexes"));
    let probe_store = store(client, &probe).await?;
    let names: Vec<String> = probe
        .collection::<Document>(&probe_store.collection_name("deliveries"))
        .list_index_names()
        .await?
        .into_iter()
        .filter(|name| name != "_id_")
        .collect();
    probe.drop().await?;
    let variants: Vec<Option<String>> = std::iter::once(None)
        .chain(names.into_iter().map(Some))
        .collect();
    let mut appends = vec![Vec::with_capacity(rounds); variants.len()];
    let mut rates = vec![Vec::with_capacity(rounds); variants.len()];
    for round in 0..rounds {
        for (i, dropped) in variants.iter().enumerate() {
            let db = client.database(&format!("{prefix}_cost_{round}_{i}"));
            let floor_store = store(client, &db).await?;
            if let Some(index) = dropped {
                db.collection::<Document>(&floor_store.collection_name("deliveries"))
                    .drop_index(index)
                    .await?;
            }
            appends[i].push(timed_publish(&floor_store, deliveries).await?);
            rates[i].push(floor(&floor_store, deliveries, batch, 4).await?);
            db.drop().await?;
        }
    }
    Ok(variants
        .into_iter()
        .zip(appends.into_iter().zip(rates))
        .map(|(dropped, (appends, rates))| IndexCost {
            dropped,
            append: median(appends),
            floor: median(rates),
        })
        .collect())
}

/// Appends `deliveries` unkeyed events for one handler, as the floor runs drain them;
/// deliveries appended per second.
async fn timed_publish(store: &MongoEventStore, deliveries: usize) -> Result<f64, BoxError> {
    let started = Instant::now();
    publish(store, "e", deliveries, |_| None, DateTime::now()).await?;
    Ok(deliveries as f64 / started.elapsed().as_secs_f64())
}

/// The floor with one index dropped, or with all (`dropped` is `None`).
struct IndexCost {
    dropped: Option<String>,
    /// Deliveries appended per second, before the floor drains them.
    append: f64,
    /// The floor's deliveries per second, 4 claimers.
    floor: f64,
}

/// The per-index table: appends and the floor without each index, against both with all.
fn print_index_costs(costs: &[IndexCost], rounds: usize) {
    let all = costs.iter().find(|cost| cost.dropped.is_none());
    let (append_all, floor_all) = all.map_or((f64::NAN, f64::NAN), |c| (c.append, c.floor));
    println!(
        "with one index of the deliveries dropped (medians of {rounds}): appends, and the floor \
         at 4 claimers"
    );
    println!(
        "{:<16} {:>10} {:>8} {:>12} {:>8}",
        "dropped", "appends/s", "vs all", "floor/s", "vs all"
    );
    for cost in costs {
        println!(
            "{:<16} {:>10.0} {:>8.3} {:>12.0} {:>8.3}",
            cost.dropped.as_deref().unwrap_or("(none)"),
            cost.append,
            cost.append / append_all,
            cost.floor,
            cost.floor / floor_all
        );
    }
}

/// The median of `values`.
fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
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

/// Drains `deliveries` with `claimers` claimers, each on its own store instance: deliveries/s,
/// and the share of the deliveries the busiest claimer completed.
async fn relaybus(
    client: &Client,
    db: &Database,
    deliveries: usize,
    batch: u32,
    run: Run,
) -> Result<(f64, f64), BoxError> {
    let first = store_with(client, db, run.listing_indexes).await?;
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
            .listing_indexes(run.listing_indexes)
            .build()?;
        let done = Arc::clone(&done);
        let progress = Arc::clone(&progress);
        let target = deliveries as u64;
        tasks.push(tokio::spawn(async move {
            let owner = format!("claimer-{n}");
            let mut own = 0;
            while done.load(Ordering::SeqCst) < target {
                let notified = progress.notified();
                tokio::pin!(notified);
                notified.as_mut().enable();
                let claimed = store
                    .claim(&owner, &[HANDLER], batch, LEASE, DateTime::now())
                    .await?;
                let leases: Vec<_> = claimed.iter().map(|d| *d.lease()).collect();
                let completed = store
                    .complete_many(&leases, DateTime::now())
                    .await?
                    .iter()
                    .filter(|c| **c)
                    .count() as u64;
                if completed == 0 {
                    if done.load(Ordering::SeqCst) < target {
                        // Woken by another claimer's completion, or polling as a worker does:
                        // work may also come free without one (lanes another claimer handed on).
                        let _ = tokio::time::timeout(POLL, notified).await;
                    }
                    continue;
                }
                own += completed;
                done.fetch_add(completed, Ordering::SeqCst);
                progress.notify_waiters();
            }
            progress.notify_waiters();
            Ok::<u64, relaybus::Error>(own)
        }));
    }
    let mut busiest = 0;
    for task in tasks {
        busiest = busiest.max(task.await??);
    }
    let rate = deliveries as f64 / started.elapsed().as_secs_f64();
    Ok((rate, busiest as f64 / deliveries as f64))
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
    Ok((median(plain_times), median(backlog_times)))
}
