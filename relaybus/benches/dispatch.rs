//! Dispatch throughput and latency: deliveries per second through the whole bus (claim, no-op
//! handler, batched completion) with 1, 2 and 4 buses, next to the raw driver reading and
//! deleting plain documents in batches of the same size; and the time from a publish's commit to
//! its handler starting, on idle buses with and without the change stream, next to the round
//! trip of one majority write (a claim's record is one, so no latency is below it) and the time
//! from a majority insert's return to its change event (the wake-up's own). The floor of the
//! document model (see `common::floor`) runs next to them with the same batch size; each
//! unkeyed row gives relaybus / floor, each keyed row keyed / unkeyed at the same bus count.
//! Relaybus and floor rows also give the server's work per 1,000 deliveries while they drained
//! (from `serverStatus`): its CPU time (on Linux servers), which on a small machine limits the
//! rates and is moved less by scheduling noise than they are, and the commands, index keys and
//! documents examined and documents written that say where it goes; and the buses' claims per
//! 1,000 deliveries (a claim's commands are the same whatever it hands out, so fewer and fuller
//! claims cost the server less), with the lanes those claims picked from that another claimer
//! wrote first (`lane_conflicts`: the picks there go back).
//!
//! Then, each with one bus set as in the throughput runs:
//! - hot keys: a transactional handler over 10 keys, its rate against the unkeyed one-bus rate,
//!   the gap between one delivery of a key and the next (from the handler's return, and from
//!   its transaction's commit, which the bus reports in a `debug` event the benchmark records
//!   with a tracing layer of its own), and the server's and this process's work per 1,000
//!   deliveries (ten keys' transactions keep two cores busy);
//! - after the idle buses' latency, a fresh key under a backlog: events with keys never seen
//!   before, published one at a time while the bus drains a backlog keyed over 100 keys, and
//!   their commit-to-handler latency; then the same with a store that parks no key's backlog
//!   (`park_threshold(u32::MAX)`);
//! - a backlog: the drain rate of the first and the last tenth of an unkeyed backlog, and the
//!   process's resident memory (`VmRSS`, `VmHWM`) while it drains.
//!
//! Run with `cargo bench -p relaybus --bench dispatch`. It uses the replica set at
//! `RELAYBUS_BENCH_MONGODB_URI`, or starts a local one. Sizes:
//! - `RELAYBUS_BENCH_DELIVERIES`: deliveries per throughput run (default 4000);
//! - `RELAYBUS_BENCH_BUSES`: the bus counts of the throughput runs (default `1,2,4`);
//! - `RELAYBUS_BENCH_SAMPLES`: latency samples with the change stream (default 1000);
//! - `RELAYBUS_BENCH_POLL_SAMPLES`: latency samples when polling (default 150);
//! - `RELAYBUS_BENCH_BACKLOG_KEYS_DELIVERIES`: the keyed backlog of the fresh-key run (default
//!   20000; at most 1000 samples);
//! - `RELAYBUS_BENCH_BACKLOG`: the backlog run (default 20000, 100000 with
//!   `RELAYBUS_PROFILE=long`);
//! - `RELAYBUS_BENCH_HOT_KEYS_DELIVERIES`: the hot-keys run (default 2000), over
//!   `RELAYBUS_BENCH_HOT_KEYS` keys (default 10).
//!
//! `RELAYBUS_BENCH_CONCURRENCY` sets the buses' handler slots (default 64, twice the batch; the
//! bus's own default is 32).
//!
//! `RELAYBUS_BENCH_ONLY=throughput` runs the throughput table alone, for profiling the server;
//! `RELAYBUS_BENCH_ONLY=hot-keys` the hot keys with the unkeyed one-bus row they are set against;
//! `RELAYBUS_BENCH_ONLY=projection` the projection: a transactional handler inserting one
//! document per event, one delivery at a time against a batch handler of up to 100 (one
//! `insert_many` per batch), on one bus.
//! `RELAYBUS_BENCH_SNAPSHOT_WINDOW=N` sets the server's snapshot history window to `N` seconds
//! first (the server keeps it); the header and the JSON line say the window the run had.
//!
//! Run by `cargo test` (without `--bench`), it makes small runs of everything as a smoke test.

use std::{
    collections::HashMap,
    sync::{
        Arc, Mutex,
        atomic::{AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use futures::{TryStreamExt, future::try_join_all};
use mongodb::{
    Client, Database,
    bson::{Document, doc},
};
use relaybus::{
    BoxError, Event, EventEnvelope, HandlerContext, MongoEventStore, RelayBus, Subscription,
};
use serde::{Deserialize, Serialize};
use tokio::sync::{Notify, mpsc, oneshot};

mod common;
#[path = "dispatch/rebalance.rs"]
mod rebalance;

use common::{ClaimCounter, Floor, Memory, ServerWork, Summary, baseline, floor, store};

const BATCH: u32 = 32;
/// The keys of the hot-keys run, unless `RELAYBUS_BENCH_HOT_KEYS` says otherwise.
const HOT_KEYS: usize = 10;
/// The most fresh-key samples taken while a keyed backlog drains.
const FRESH_KEY_SAMPLES: usize = 1000;
/// The prefix of the keys never seen before in the fresh-key run.
const FRESH_PREFIX: &str = "fresh-";

#[derive(Debug, Serialize, Deserialize)]
struct Tick {
    n: u64,
}

impl Event for Tick {
    const TYPE: &'static str = "bench.tick.v1";
}

fn env_number(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    // A bus of the rebalance run, in a process of its own so that it can be killed.
    if rebalance::child_bus().await? {
        return Ok(());
    }
    // Before any bus is built: buses register their metrics as they are built.
    ClaimCounter::install();
    let smoke = !std::env::args().any(|arg| arg == "--bench");
    let long = std::env::var("RELAYBUS_PROFILE").is_ok_and(|profile| profile == "long");
    let sized = |name: &str, default: usize, tiny: usize| {
        if smoke {
            tiny
        } else {
            env_number(name, default)
        }
    };
    let deliveries = sized("RELAYBUS_BENCH_DELIVERIES", 4000, 64);
    let bus_counts = bus_counts()?;
    let only = match std::env::var("RELAYBUS_BENCH_ONLY") {
        Ok(only) if only == "throughput" => Some(Only::Throughput),
        Ok(only) if only == "hot-keys" => Some(Only::HotKeys),
        Ok(only) if only == "rebalance" => Some(Only::Rebalance),
        Ok(only) if only == "projection" => Some(Only::Projection),
        Ok(other) => {
            return Err(format!(
                "RELAYBUS_BENCH_ONLY={other:?}: the parts that run alone are `throughput`, \
                 `hot-keys`, `rebalance` and `projection`"
            )
            .into());
        }
        Err(_) => None,
    };
    // The hot keys' rate is given against the unkeyed one-bus rate: that row runs with them.
    let bus_counts = if only == Some(Only::HotKeys) {
        vec![1]
    } else {
        bus_counts
    };
    let samples = sized("RELAYBUS_BENCH_SAMPLES", 1000, 5);
    let poll_samples = sized("RELAYBUS_BENCH_POLL_SAMPLES", 150, 5);
    let backlog_size = sized(
        "RELAYBUS_BENCH_BACKLOG",
        if long { 100_000 } else { 20_000 },
        64,
    );
    let keyed_backlog = sized("RELAYBUS_BENCH_BACKLOG_KEYS_DELIVERIES", 20_000, 64);
    let fresh_samples = if smoke { 5 } else { FRESH_KEY_SAMPLES };
    let hot_deliveries = sized("RELAYBUS_BENCH_HOT_KEYS_DELIVERIES", 2000, 64);
    let hot_keys_count = sized("RELAYBUS_BENCH_HOT_KEYS", HOT_KEYS, HOT_KEYS).max(1);
    let uri = relaybus_harness::shared_uri("RELAYBUS_BENCH_MONGODB_URI").await?;
    let client = Client::with_uri_str(&uri).await?;
    let mut run = 0_u32;
    let mut fresh_db = || {
        run += 1;
        client.database(&format!("bench_dispatch_{}_{run}", std::process::id()))
    };
    if only == Some(Only::Projection) {
        let projection = projection_part(&client, [fresh_db(), fresh_db()], deliveries).await?;
        println!(
            "{}",
            serde_json::json!({ "bench": "dispatch", "profile": "projection", "projection": projection })
        );
        return Ok(());
    }
    let probe = fresh_db();
    let window = common::snapshot_window(&client, &store(&client, &probe).await?).await?;
    probe.drop().await?;

    println!(
        "dispatch benchmark: {deliveries} deliveries per throughput run, batch {BATCH}, {} \
         handler slots per bus; the server's snapshot history window: {}",
        concurrency()?,
        window.map_or_else(|| "not reported".to_owned(), |s| format!("{s} s"))
    );
    let rebalance_backlog = sized("RELAYBUS_BENCH_REBALANCE_BACKLOG", 20_000, 64);
    if only == Some(Only::Rebalance) {
        let rebalance =
            rebalance_part(&client, &uri, [fresh_db(), fresh_db()], rebalance_backlog).await?;
        println!(
            "{}",
            serde_json::json!({ "bench": "dispatch", "profile": "rebalance", "rebalance": rebalance })
        );
        return Ok(());
    }
    println!(
        "{:<10} {:<8} {:>6} {:>16} {:>8} {:>10} {:>12}",
        "subject", "keys", "buses", "deliveries/s", "/ floor", "/ unkeyed", "server CPU"
    );
    println!("{:>76}", "ms / 1000");
    let mut throughput = Vec::new();
    let mut unkeyed_one_bus = f64::NAN;
    let mut work = Vec::new();
    for buses in bus_counts {
        let db = fresh_db();
        let baseline = baseline(&db, deliveries, BATCH, buses).await?;
        db.drop().await?;
        println!(
            "{:<10} {:<8} {:>6} {:>16.0}",
            "baseline", "-", buses, baseline
        );
        let db = fresh_db();
        let floor_store = store(&client, &db).await?;
        publish(&floor_store, deliveries, None).await?;
        let before = ServerWork::now(&client).await;
        let floor = floor(&floor_store, deliveries, BATCH, buses).await?;
        let floor_work =
            ServerWork::per_thousand(before, ServerWork::now(&client).await, deliveries);
        let floor_cpu = floor_work["cpu_ms"].as_f64();
        work.push(("floor", "none", buses, floor_work.clone()));
        // The store goes first: its heartbeat would write to the dropped database again and
        // leave it behind on the server.
        drop(floor_store);
        db.drop().await?;
        println!(
            "{:<10} {:<8} {:>6} {:>16.0} {:>8} {:>10} {:>12}",
            "floor",
            "none",
            buses,
            floor,
            "",
            "",
            cpu_text(floor_cpu)
        );
        let mut unkeyed = f64::NAN;
        for keyed in [false, true] {
            let db = fresh_db();
            let (ours, ours_work) = relaybus_run(&client, &db, deliveries, buses, keyed).await?;
            let ours_cpu = ours_work["cpu_ms"].as_f64();
            work.push((
                "relaybus",
                if keyed { "100 keys" } else { "none" },
                buses,
                ours_work.clone(),
            ));
            db.drop().await?;
            let mut row = serde_json::json!({
                "buses": buses,
                "keyed": keyed,
                "relaybus_per_sec": ours.round(),
                "baseline_per_sec": baseline.round(),
                "floor_per_sec": floor.round(),
                "ratio": thousandths(ours / baseline),
                "floor_ratio": thousandths(floor / baseline),
                "relaybus_server_cpu_ms_per_1000": ours_cpu,
                "floor_server_cpu_ms_per_1000": floor_cpu,
                "relaybus_server_work_per_1000": ours_work,
                "floor_server_work_per_1000": floor_work,
            });
            if keyed {
                let keyed_to_unkeyed = ours / unkeyed;
                row["keyed_to_unkeyed"] = thousandths(keyed_to_unkeyed).into();
                println!(
                    "{:<10} {:<8} {:>6} {:>16.0} {:>8} {:>10.3} {:>12}",
                    "relaybus",
                    "100 keys",
                    buses,
                    ours,
                    "",
                    keyed_to_unkeyed,
                    cpu_text(ours_cpu)
                );
            } else {
                unkeyed = ours;
                if buses == 1 {
                    unkeyed_one_bus = ours;
                }
                let relaybus_floor_ratio = ours / floor;
                row["relaybus_floor_ratio"] = thousandths(relaybus_floor_ratio).into();
                println!(
                    "{:<10} {:<8} {:>6} {:>16.0} {:>8.3} {:>10} {:>12}",
                    "relaybus",
                    "none",
                    buses,
                    ours,
                    relaybus_floor_ratio,
                    "",
                    cpu_text(ours_cpu)
                );
            }
            throughput.push(row);
        }
    }

    print_work(&work);
    let hot_keys = if only == Some(Only::Throughput) {
        serde_json::Value::Null
    } else {
        hot_keys_part(
            &client,
            [fresh_db(), fresh_db()],
            (hot_deliveries, hot_keys_count),
            unkeyed_one_bus,
        )
        .await?
    };
    if only == Some(Only::HotKeys) {
        println!(
            "{}",
            serde_json::json!({
                "bench": "dispatch",
                "profile": "hot-keys",
                "snapshot_window_s": window,
                "concurrency": concurrency()?,
                "throughput": throughput,
                "hot_keys": hot_keys,
            })
        );
        return Ok(());
    }
    if only == Some(Only::Throughput) {
        println!(
            "{}",
            serde_json::json!({
                "bench": "dispatch",
                "profile": "throughput",
                "snapshot_window_s": window,
                "deliveries_per_run": deliveries,
                "batch": BATCH,
                "concurrency": concurrency()?,
                "throughput": throughput,
            })
        );
        return Ok(());
    }

    println!("\ncommit-to-handler latency on idle buses");
    println!(
        "{:<22} {:>8} {:>10} {:>10} {:>10}",
        "wake-up", "samples", "p50 ms", "p99 ms", "max ms"
    );
    let mut latency = Vec::new();
    for (change_stream, poll, samples) in [
        (true, Duration::from_secs(1), samples),
        (false, Duration::from_millis(250), poll_samples),
    ] {
        let db = fresh_db();
        let summary = latency_run(&client, &db, samples, change_stream, poll).await?;
        db.drop().await?;
        let label = if change_stream {
            "change stream".to_owned()
        } else {
            format!("polling every {} ms", poll.as_millis())
        };
        print_summary(&label, &summary);
        let mut row = serde_json::json!({
            "change_stream": change_stream,
            "poll_interval_ms": poll.as_millis() as u64,
        });
        merge(&mut row, summary.json());
        latency.push(row);
    }
    // The floors of the idle path: a claim records its batch with one majority write before the
    // handler starts, and the wake-up is a change event; no latency is below either.
    let db = fresh_db();
    let floors = [
        (
            "floor: majority write",
            "one majority write",
            majority_write_run(&db, samples).await?,
        ),
        (
            "floor: change event",
            "insert to change event",
            change_stream_run(&db, samples).await?,
        ),
    ];
    db.drop().await?;
    for (label, floor, summary) in floors {
        print_summary(label, &summary);
        let mut row = serde_json::json!({ "floor": floor });
        merge(&mut row, summary.json());
        latency.push(row);
    }

    let db = fresh_db();
    let fresh = fresh_key_run(&client, &db, keyed_backlog, fresh_samples, None).await?;
    db.drop().await?;
    print_summary("fresh key, backlog", &fresh.latency);
    println!(
        "  behind {keyed_backlog} deliveries over 100 keys, drained at {:.0}/s",
        fresh.drain_per_sec
    );
    let db = fresh_db();
    let unparked =
        fresh_key_run(&client, &db, keyed_backlog, fresh_samples, Some(u32::MAX)).await?;
    db.drop().await?;
    print_summary("  backlogs not parked", &unparked.latency);
    println!(
        "  (park_threshold(u32::MAX)), drained at {:.0}/s",
        unparked.drain_per_sec
    );
    let mut fresh_key_under_backlog = serde_json::json!({
        "backlog_deliveries": keyed_backlog,
        "backlog_keys": 100,
        "drain_per_sec": fresh.drain_per_sec.round(),
    });
    merge(
        &mut fresh_key_under_backlog,
        samples_taken(fresh.latency.json()),
    );
    let mut backlogs_not_parked = serde_json::json!({
        "park_threshold": u32::MAX,
        "drain_per_sec": unparked.drain_per_sec.round(),
    });
    merge(
        &mut backlogs_not_parked,
        samples_taken(unparked.latency.json()),
    );
    merge(
        &mut fresh_key_under_backlog,
        serde_json::json!({ "backlogs_not_parked": backlogs_not_parked }),
    );

    let db = fresh_db();
    let backlog = backlog_run(&client, &db, backlog_size).await?;
    db.drop().await?;
    let db = fresh_db();
    let floor_backlog = floor_backlog_run(&client, &db, backlog_size).await?;
    db.drop().await?;
    println!(
        "\nbacklog of {backlog_size} unkeyed deliveries, 1 bus: first 10% {:.0}/s, last 10% \
         {:.0}/s (last / first {:.3}), all {:.0}/s",
        backlog.first_10,
        backlog.last_10,
        backlog.last_10 / backlog.first_10,
        backlog.total
    );
    println!(
        "  floor, 1 worker: first 10% {:.0}/s, last 10% {:.0}/s (last / first {:.3})",
        floor_backlog.0,
        floor_backlog.1,
        floor_backlog.1 / floor_backlog.0
    );
    let kb = |memory: Option<Memory>, field: fn(&Memory) -> u64| memory.as_ref().map(field);
    let shown = |figure: Option<u64>| figure.map_or("-".to_owned(), |kb| kb.to_string());
    println!(
        "  VmRSS kB: start {}, max {}, end {}; VmHWM kB at the end {}",
        shown(kb(backlog.memory[0], |m| m.rss_kb)),
        shown(kb(backlog.memory[1], |m| m.rss_kb)),
        shown(kb(backlog.memory[2], |m| m.rss_kb)),
        shown(kb(backlog.memory[2], |m| m.hwm_kb)),
    );
    let memory_json = |field: fn(&Memory) -> u64| {
        serde_json::json!({
            "start": kb(backlog.memory[0], field),
            "max": kb(backlog.memory[1], field),
            "end": kb(backlog.memory[2], field),
        })
    };
    let backlog_json = serde_json::json!({
        "deliveries": backlog_size,
        "first_10_per_sec": backlog.first_10.round(),
        "last_10_per_sec": backlog.last_10.round(),
        "last_to_first": thousandths(backlog.last_10 / backlog.first_10),
        "total_per_sec": backlog.total.round(),
        "floor_first_10_per_sec": floor_backlog.0.round(),
        "floor_last_10_per_sec": floor_backlog.1.round(),
        "floor_last_to_first": thousandths(floor_backlog.1 / floor_backlog.0),
        "rss_kb": memory_json(|m| m.rss_kb),
        "hwm_kb": memory_json(|m| m.hwm_kb),
    });

    // The kill waits out a lease (30 s): not in the smoke run of `cargo test`.
    let rebalance = if smoke {
        println!("\nrebalance: runs with --bench only (it waits out a lease)");
        serde_json::Value::Null
    } else {
        rebalance_part(&client, &uri, [fresh_db(), fresh_db()], rebalance_backlog).await?
    };
    let projection_json = projection_part(&client, [fresh_db(), fresh_db()], deliveries).await?;

    let headline = throughput
        .iter()
        .find(|r| r["buses"] == 4 && r["keyed"] == false);
    let figure = |name: &str| headline.and_then(|r| r[name].as_f64()).unwrap_or(f64::NAN);
    let (ratio, floor_ratio) = (figure("ratio"), figure("floor_ratio"));
    println!(
        "\nratio (relaybus unkeyed / baseline, 4 buses): {ratio:.3}; the floor of the document \
         model: {floor_ratio:.3}"
    );
    println!(
        "{}",
        serde_json::json!({
            "bench": "dispatch",
            "snapshot_window_s": window,
            "profile": if smoke { "smoke" } else if long { "long" } else { "default" },
            "deliveries_per_run": deliveries,
            "batch": BATCH,
            "concurrency": concurrency()?,
            "throughput": throughput,
            "latency": latency,
            "fresh_key_under_backlog": fresh_key_under_backlog,
            "backlog": backlog_json,
            "hot_keys": hot_keys,
            "rebalance": rebalance,
            "rebalance_join_s": rebalance["join_s"],
            "rebalance_kill_s": rebalance["kill_s"],
            "projection": projection_json,
            "floor_ratio": floor_ratio,
            "ratio": ratio,
        })
    );
    Ok(())
}

/// The rebalance runs (see [`rebalance`]) on `dbs`, printed and as JSON.
async fn rebalance_part(
    client: &Client,
    uri: &str,
    dbs: [Database; 2],
    backlog: usize,
) -> Result<serde_json::Value, BoxError> {
    let figures = rebalance::rebalance(client, uri, dbs, backlog).await?;
    println!(
        "\nrebalance over a backlog of {backlog}: a fourth bus joining three holds its share in \
         {:.2} s ({} deliveries ran twice); a bus SIGKILLed mid-drain has its lanes held \
         elsewhere in {:.2} s (lease {:.0} s)",
        figures.join_s, figures.join_run_twice, figures.kill_s, figures.lease_s
    );
    Ok(serde_json::json!({
        "backlog": backlog,
        "join_s": (figures.join_s * 100.0).round() / 100.0,
        "join_run_twice": figures.join_run_twice,
        "kill_s": (figures.kill_s * 100.0).round() / 100.0,
        "lease_s": figures.lease_s,
    }))
}

/// The parts of the benchmark that run alone (`RELAYBUS_BENCH_ONLY`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Only {
    /// The throughput table.
    Throughput,
    /// The hot keys, with the unkeyed one-bus row their rate is given against.
    HotKeys,
    /// The rebalance runs.
    Rebalance,
    /// The projection: batch handler against single-delivery handler.
    Projection,
}

/// The hot-keys profile, relaybus then its floor, each on one of `dbs`: prints them and
/// returns their JSON: `hot_deliveries` deliveries over `hot_keys_count` keys.
async fn hot_keys_part(
    client: &Client,
    dbs: [Database; 2],
    (hot_deliveries, hot_keys_count): (usize, usize),
    unkeyed_one_bus: f64,
) -> Result<serde_json::Value, BoxError> {
    let [db, floor_db] = dbs;
    let hot = hot_keys_run(client, &db, hot_deliveries, hot_keys_count).await?;
    db.drop().await?;
    let hot_floor = hot_keys_floor(client, &floor_db, hot_deliveries, hot_keys_count).await?;
    floor_db.drop().await?;
    let to_unkeyed = hot.per_sec / unkeyed_one_bus;
    println!(
        "\nhot keys: {hot_deliveries} deliveries over {hot_keys_count} keys, transactional handler, \
         1 bus: {:.0}/s ({to_unkeyed:.3} of unkeyed); gap from a handler's return to the next \
         of its key p50 {:.1} ms, p99 {:.1} ms (from its transaction's commit: p50 {:.2} ms, p99 \
         {:.2} ms); server CPU {} ms and bus CPU {} ms per 1000\n  \
         the floor: {:.0}/s; gap p50 {:.1} ms, p99 {:.1} ms (from the commit: p50 {:.2} ms, p99 \
         {:.2} ms); server CPU {} ms and its workers' CPU {} ms per 1000",
        hot.per_sec,
        hot.gap.p50,
        hot.gap.p99,
        hot.from_commit.p50,
        hot.from_commit.p99,
        hot.work["cpu_ms"],
        hot.work["client_cpu_ms"],
        hot_floor.per_sec,
        hot_floor.gap.p50,
        hot_floor.gap.p99,
        hot_floor.from_commit.p50,
        hot_floor.from_commit.p99,
        hot_floor.work["cpu_ms"],
        hot_floor.work["client_cpu_ms"],
    );
    let ms = |v: f64| (v * 10.0).round() / 10.0;
    let ms2 = |v: f64| (v * 100.0).round() / 100.0;
    Ok(serde_json::json!({
        "deliveries": hot_deliveries,
        "keys": hot_keys_count,
        "per_sec": hot.per_sec.round(),
        "to_unkeyed_1_bus": thousandths(to_unkeyed),
        "key_gap_p50_ms": ms(hot.gap.p50),
        "key_gap_p99_ms": ms(hot.gap.p99),
        "key_gaps": hot.gap.samples,
        "key_gap_from_commit_p50_ms": ms2(hot.from_commit.p50),
        "key_gap_from_commit_p99_ms": ms2(hot.from_commit.p99),
        "key_gaps_from_commit": hot.from_commit.samples,
        "floor_per_sec": hot_floor.per_sec.round(),
        "floor_key_gap_p50_ms": ms(hot_floor.gap.p50),
        "floor_key_gap_p99_ms": ms(hot_floor.gap.p99),
        "floor_key_gap_from_commit_p50_ms": ms2(hot_floor.from_commit.p50),
        "floor_key_gap_from_commit_p99_ms": ms2(hot_floor.from_commit.p99),
        "server_work_per_1000": hot.work,
        "floor_server_work_per_1000": hot_floor.work,
    }))
}

/// The bus counts of the throughput runs: `RELAYBUS_BENCH_BUSES`, a comma-separated list
/// (default `1,2,4`).
fn bus_counts() -> Result<Vec<usize>, BoxError> {
    let Ok(list) = std::env::var("RELAYBUS_BENCH_BUSES") else {
        return Ok(vec![1, 2, 4]);
    };
    list.split(',')
        .map(|count| match count.trim().parse::<usize>() {
            Ok(count) if count > 0 => Ok(count),
            _ => Err(format!(
                "RELAYBUS_BENCH_BUSES={list:?}: give bus counts of at least 1, separated by \
                 commas, such as 1,2,4"
            )
            .into()),
        })
        .collect()
}

/// Prints the server's work per 1,000 deliveries of each throughput run.
fn print_work(work: &[(&str, &str, usize, serde_json::Value)]) {
    println!(
        "\nthe server's work per 1000 deliveries (and this process's CPU time: the buses, or the \
         floor's workers; and the buses' claims)"
    );
    println!(
        "{:<10} {:<8} {:>6} {:>8} {:>9} {:>14} {:>14} {:>13} {:>10} {:>7}",
        "subject",
        "keys",
        "buses",
        "CPU ms",
        "commands",
        "keys examined",
        "docs examined",
        "docs written",
        "bus CPU ms",
        "claims"
    );
    for (subject, keys, buses, work) in work {
        let figure = |name: &str| {
            work[name]
                .as_f64()
                .map_or_else(|| "-".to_owned(), |value| format!("{value:.0}"))
        };
        println!(
            "{:<10} {:<8} {:>6} {:>8} {:>9} {:>14} {:>14} {:>13} {:>10} {:>7}",
            subject,
            keys,
            buses,
            figure("cpu_ms"),
            figure("commands"),
            figure("keys_examined"),
            figure("docs_examined"),
            figure("docs_written"),
            figure("client_cpu_ms"),
            figure("claims")
        );
    }
}

/// `value` rounded to three decimals.
fn thousandths(value: f64) -> f64 {
    (value * 1000.0).round() / 1000.0
}

/// A latency summary whose sample count is a measurement, not a setting: the fresh-key runs
/// take a sample after the previous one started, so faster runs take more. The count goes under
/// `samples_taken`, so that runs compared side by side line up on the same fields.
fn samples_taken(mut latency: serde_json::Value) -> serde_json::Value {
    if let Some(fields) = latency.as_object_mut()
        && let Some(samples) = fields.remove("samples")
    {
        fields.insert("samples_taken".to_owned(), samples);
    }
    latency
}

/// Adds the fields of the object `extra` to the object `row`.
fn merge(row: &mut serde_json::Value, extra: serde_json::Value) {
    if let (Some(row), serde_json::Value::Object(extra)) = (row.as_object_mut(), extra) {
        row.extend(extra);
    }
}

/// One row of the latency table.
fn print_summary(label: &str, summary: &Summary) {
    println!(
        "{label:<22} {:>8} {:>10.1} {:>10.1} {:>10.1}",
        summary.samples, summary.p50, summary.p99, summary.max
    );
}

/// The pause after the latency sample `n`: 3 to 27 ms, varied so that the samples do not fall
/// into step with the bus.
fn spacing(n: u64) -> Duration {
    Duration::from_millis(3 + (n % 7) * 4)
}

/// Publishes `count` events for the handler `tick`, keyed over `keys` keys or not.
async fn publish(store: &MongoEventStore, count: usize, keys: Option<u64>) -> Result<(), BoxError> {
    let publisher = RelayBus::builder(store.clone())
        .subscribe(Subscription::new(
            "tick",
            |_: Tick, _: HandlerContext| async { Ok::<(), BoxError>(()) },
        ))
        .build()?;
    let mut n = 0_u64;
    while (n as usize) < count {
        let chunk = (count - n as usize).min(500);
        let mut envelopes = Vec::with_capacity(chunk);
        for _ in 0..chunk {
            let mut envelope = EventEnvelope::new(&Tick { n })?;
            if let Some(keys) = keys {
                envelope = envelope.with_key(format!("key-{}", n % keys))?;
            }
            envelopes.push(envelope);
            n += 1;
        }
        publisher.publish_all(envelopes).await?;
    }
    Ok(())
}

/// A collection of `db` written with majority.
fn majority_collection(db: &Database, name: &str) -> mongodb::Collection<Document> {
    db.collection_with_options(
        name,
        mongodb::options::CollectionOptions::builder()
            .write_concern(mongodb::options::WriteConcern::majority())
            .build(),
    )
}

/// The round trip of one majority write (an update of one small document), `samples` times, in
/// milliseconds.
async fn majority_write_run(db: &Database, samples: usize) -> Result<Summary, BoxError> {
    let collection = majority_collection(db, "majority_writes");
    let mut ms = Vec::with_capacity(samples);
    for _ in 0..samples {
        let started = Instant::now();
        collection
            .update_one(doc! { "_id": 1 }, doc! { "$inc": { "n": 1 } })
            .upsert(true)
            .await?;
        ms.push(started.elapsed().as_secs_f64() * 1000.0);
    }
    Ok(Summary::of(ms))
}

/// The time from a majority insert's return to its change event reaching a change stream on the
/// collection, `samples` times, in milliseconds.
async fn change_stream_run(db: &Database, samples: usize) -> Result<Summary, BoxError> {
    use futures::StreamExt;

    let collection = majority_collection(db, "change_events");
    let mut stream = collection
        .watch()
        .pipeline([doc! { "$match": { "operationType": "insert" } }])
        .await?;
    let mut ms = Vec::with_capacity(samples);
    for n in 0..samples {
        collection.insert_one(doc! { "n": n as i64 }).await?;
        let inserted = Instant::now();
        match stream.next().await {
            Some(event) => {
                event?;
            }
            None => return Err("the change stream ended".into()),
        }
        ms.push(inserted.elapsed().as_secs_f64() * 1000.0);
    }
    Ok(Summary::of(ms))
}

/// Deliveries per second through `buses` buses running a no-op handler.
/// Deliveries per second through `buses` buses, and the server's CPU milliseconds per 1,000
/// deliveries while they drained (when the server reports its CPU time).
async fn relaybus_run(
    client: &Client,
    db: &Database,
    count: usize,
    buses: usize,
    keyed: bool,
) -> Result<(f64, serde_json::Value), BoxError> {
    let store = store(client, db).await?;
    publish(&store, count, keyed.then_some(100)).await?;
    let handled = Arc::new(AtomicUsize::new(0));
    let all_done = Arc::new(Notify::new());
    let mut running = Vec::new();
    for i in 0..buses {
        let (handled, all_done) = (Arc::clone(&handled), Arc::clone(&all_done));
        let bus = draining_bus(
            &store,
            &format!("bench-{i}"),
            Subscription::new("tick", move |_: Tick, _: HandlerContext| {
                let (handled, all_done) = (Arc::clone(&handled), Arc::clone(&all_done));
                async move {
                    if handled.fetch_add(1, Ordering::Relaxed) + 1 == count {
                        all_done.notify_one();
                    }
                    Ok::<(), BoxError>(())
                }
            }),
        )?;
        running.push(bus);
    }
    let before = ServerWork::now(client).await;
    let started = Instant::now();
    for bus in &running {
        bus.start().await?;
    }
    tokio::time::timeout(Duration::from_secs(600), all_done.notified()).await?;
    // The last completions are flushed by the shutdown; count them in.
    try_join_all(running.iter().map(|bus| bus.shutdown())).await?;
    let elapsed = started.elapsed();
    let work = ServerWork::per_thousand(before, ServerWork::now(client).await, count);
    assert_drained(db).await?;
    Ok((count as f64 / elapsed.as_secs_f64(), work))
}

/// The buses' handler slots: `RELAYBUS_BENCH_CONCURRENCY`, or twice the batch.
fn concurrency() -> Result<usize, BoxError> {
    match std::env::var("RELAYBUS_BENCH_CONCURRENCY") {
        Err(_) => Ok(BATCH as usize * 2),
        Ok(text) => text.trim().parse().map_err(|_| {
            format!(
                "RELAYBUS_BENCH_CONCURRENCY={text:?}: give the handler slots per bus as a whole \
                 number, such as 32 or 64"
            )
            .into()
        }),
    }
}

/// A server CPU figure for the table: `-` when the server did not report it.
fn cpu_text(ms: Option<f64>) -> String {
    ms.map_or_else(|| "-".to_owned(), |ms| format!("{ms:.1}"))
}

/// Commit-to-handler latency (ms) on one idle bus: from the return of `publish`, which returns
/// once the publishing transaction committed, to the handler starting.
async fn latency_run(
    client: &Client,
    db: &Database,
    samples: usize,
    change_stream: bool,
    poll_interval: Duration,
) -> Result<Summary, BoxError> {
    let store = store(client, db).await?;
    let (tx, mut rx) = mpsc::unbounded_channel::<Instant>();
    let bus = RelayBus::builder(store.clone())
        .owner("bench-latency")
        .change_stream(change_stream)
        .poll_interval(poll_interval)
        .retention(None)
        .subscribe(Subscription::new(
            "tick",
            move |_: Tick, _: HandlerContext| {
                let tx = tx.clone();
                async move {
                    let _ = tx.send(Instant::now());
                    Ok::<(), BoxError>(())
                }
            },
        ))
        .build()?;
    bus.start().await?;
    // Let the dispatcher settle into idle.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut latencies = Vec::with_capacity(samples);
    for n in 0..samples as u64 {
        bus.publish(&Tick { n }).await?;
        let committed = Instant::now();
        let handled = tokio::time::timeout(Duration::from_secs(30), rx.recv())
            .await?
            .ok_or("handler channel closed")?;
        latencies.push(handled.saturating_duration_since(committed).as_secs_f64() * 1000.0);
        // Polling: spread the samples over the poll cycle.
        let pause = if change_stream {
            spacing(n)
        } else {
            Duration::from_millis(17 + (n % 7) * 11)
        };
        tokio::time::sleep(pause).await;
    }
    bus.shutdown().await?;
    assert_drained(db).await?;
    Ok(Summary::of(latencies))
}

/// A bus set like those of the throughput runs (batch 32, 64 handlers at once unless
/// `RELAYBUS_BENCH_CONCURRENCY` says otherwise).
fn draining_bus(
    store: &MongoEventStore,
    owner: &str,
    subscription: Subscription,
) -> Result<RelayBus, BoxError> {
    Ok(RelayBus::builder(store.clone())
        .owner(owner)
        .batch_size(BATCH)
        .concurrency(concurrency()?)
        .retention(None)
        .setup_on_start(false)
        .subscribe(subscription)
        .build()?)
}

/// The projection, single-delivery handler then batch handler, each on one of `dbs`: prints
/// them and returns their JSON.
async fn projection_part(
    client: &Client,
    [single_db, batch_db]: [Database; 2],
    deliveries: usize,
) -> Result<serde_json::Value, BoxError> {
    let single = projection_run(client, &single_db, deliveries, false).await?;
    let batched = projection_run(client, &batch_db, deliveries, true).await?;
    println!(
        "\nprojection, one document per event in the handler's transaction, one bus: one \
         delivery at a time {single:.0}/s, batches of up to {PROJECTION_BATCH} {batched:.0}/s \
         (batch / single {:.2})",
        batched / single
    );
    Ok(serde_json::json!({
        "deliveries": deliveries,
        "max_batch": PROJECTION_BATCH,
        "single_per_sec": single.round(),
        "batch_per_sec": batched.round(),
        "batch_to_single": thousandths(batched / single),
    }))
}

/// The most deliveries per batch of the projection's batch handler.
const PROJECTION_BATCH: usize = 100;

/// Deliveries per second of a projection that inserts one document per event in its handler's
/// transaction, on one bus: a transactional handler of one delivery at a time, or a
/// transactional batch handler of up to [`PROJECTION_BATCH`] (one `insert_many` per batch).
async fn projection_run(
    client: &Client,
    db: &Database,
    count: usize,
    batch: bool,
) -> Result<f64, BoxError> {
    let store = store(client, db).await?;
    publish(&store, count, None).await?;
    let rows = db.collection::<Document>("projection");
    let handled = Arc::new(AtomicUsize::new(0));
    let all_done = Arc::new(Notify::new());
    let done = {
        let (handled, all_done) = (Arc::clone(&handled), Arc::clone(&all_done));
        move |n: usize| {
            if handled.fetch_add(n, Ordering::Relaxed) + n >= count {
                all_done.notify_one();
            }
        }
    };
    let subscription = if batch {
        let rows = rows.clone();
        Subscription::batch(
            "tick",
            move |batch: relaybus::Batch<Tick>, ctx: HandlerContext| {
                let (rows, done) = (rows.clone(), done.clone());
                async move {
                    let docs: Vec<Document> = batch
                        .iter()
                        .map(|item| doc! { "_id": item.event_id(), "n": item.event().n as i64 })
                        .collect();
                    let mut session = ctx.session().await?;
                    rows.insert_many(docs).session(&mut *session).await?;
                    drop(session);
                    done(batch.len());
                    Ok::<(), BoxError>(())
                }
            },
        )
        .max_batch(PROJECTION_BATCH)
        .transactional()
    } else {
        let rows = rows.clone();
        Subscription::new("tick", move |tick: Tick, ctx: HandlerContext| {
            let (rows, done) = (rows.clone(), done.clone());
            async move {
                let mut session = ctx.session().await?;
                rows.insert_one(doc! { "_id": ctx.event_id(), "n": tick.n as i64 })
                    .session(&mut *session)
                    .await?;
                drop(session);
                done(1);
                Ok::<(), BoxError>(())
            }
        })
        .transactional()
    };
    let bus = draining_bus(&store, "projection", subscription)?;
    let started = Instant::now();
    bus.start().await?;
    tokio::time::timeout(Duration::from_secs(600), all_done.notified()).await?;
    // A transaction that ran again called its handler again: the count reached `count` before
    // every row committed. Wait for the rows.
    while rows.count_documents(doc! {}).await? < count as u64 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    bus.shutdown().await?;
    let elapsed = started.elapsed();
    assert_drained(db).await?;
    let written = rows.count_documents(doc! {}).await?;
    if written != count as u64 {
        return Err(format!("the projection holds {written} rows for {count} events").into());
    }
    drop(store);
    db.drop().await?;
    Ok(count as f64 / elapsed.as_secs_f64())
}

/// Asserts that no delivery is left in `db`; if some are, the message shows the first few.
async fn assert_drained(db: &Database) -> Result<(), BoxError> {
    let deliveries = db.collection::<Document>("relaybus_deliveries");
    let left = deliveries.count_documents(doc! {}).await?;
    if left > 0 {
        let first: Vec<Document> = deliveries
            .find(doc! {})
            .limit(5)
            .await?
            .try_collect()
            .await?;
        let shown: Vec<String> = first.iter().map(ToString::to_string).collect();
        panic!(
            "every delivery completed: {left} left, the first {}",
            shown.join("; ")
        );
    }
    Ok(())
}

/// A store on `db` with `count` deliveries published over `keys` keys, and the collection the
/// hot-keys handlers write to, made up front so that the first transactions do not race to
/// create it.
async fn hot_keys_setup(
    client: &Client,
    db: &Database,
    count: usize,
    keys: usize,
) -> Result<(MongoEventStore, mongodb::Collection<Document>), BoxError> {
    let store = store(client, db).await?;
    publish(&store, count, Some(keys as u64)).await?;
    let writes = db.collection::<Document>("bench_hot_key_writes");
    db.create_collection(writes.name()).await?;
    Ok((store, writes))
}

/// The floor of [`hot_keys_run`]: one task per key runs the key's deliveries one after the
/// other with the raw driver, doing only what the document model needs. For each: read the
/// key's lowest pending delivery and its event, record it on its lane (a majority write), then
/// in one transaction write the handler's document, delete the delivery and stamp the event,
/// and commit. Deliveries/s and the gap from the handler's write returning to the key's next
/// delivery being recorded, as in the bus's run.
async fn hot_keys_floor(
    client: &Client,
    db: &Database,
    count: usize,
    keys: usize,
) -> Result<HotKeys, BoxError> {
    let (store, writes) = hot_keys_setup(client, db, count, keys).await?;
    let floor = Floor::of(&store);
    let before = ServerWork::now(client).await;
    let started = Instant::now();
    let tasks = (0..keys).map(|k| {
        let (client, floor, writes) = (client.clone(), floor.clone(), writes.clone());
        async move {
            let key = format!("key-{k}");
            let mut session = client.start_session().await?;
            let mut gaps = Vec::new();
            let mut returned: Option<Instant> = None;
            let mut committed: Option<Instant> = None;
            while let Some(delivery) = floor.next_of_key("tick", &key).await? {
                if let (Some(returned), Some(committed)) = (returned, committed) {
                    gaps.push((
                        returned.elapsed().as_secs_f64() * 1000.0,
                        committed.elapsed().as_secs_f64() * 1000.0,
                    ));
                }
                session
                    .start_transaction()
                    .read_concern(mongodb::options::ReadConcern::snapshot())
                    .write_concern(mongodb::options::WriteConcern::majority())
                    .await?;
                writes
                    .insert_one(doc! { "n": delivery.get_object_id("_id")? })
                    .session(&mut session)
                    .await?;
                returned = Some(Instant::now());
                floor.complete_in(&mut session, &delivery).await?;
                session.commit_transaction().await?;
                committed = Some(Instant::now());
            }
            Ok::<_, BoxError>(gaps)
        }
    });
    let gaps: Vec<(f64, f64)> = try_join_all(tasks).await?.into_iter().flatten().collect();
    let per_sec = count as f64 / started.elapsed().as_secs_f64();
    let work = ServerWork::per_thousand(before, ServerWork::now(client).await, count);
    assert_drained(db).await?;
    Ok(HotKeys {
        per_sec,
        gap: Summary::of(gaps.iter().map(|(returned, _)| *returned).collect()),
        from_commit: Summary::of(gaps.iter().map(|(_, committed)| *committed).collect()),
        work,
    })
}

/// What [`fresh_key_run`] measured.
struct FreshKey {
    latency: Summary,
    drain_per_sec: f64,
}

/// Commit-to-handler latency (ms) of events with a key never seen before, published one at a
/// time while one bus drains `backlog` deliveries keyed over 100 keys; and the rate at which the
/// backlog drained. Samples stop when the backlog is drained (after at least one) or after
/// `samples`. `park_threshold`: the store's, if not the default.
async fn fresh_key_run(
    client: &Client,
    db: &Database,
    backlog: usize,
    samples: usize,
    park_threshold: Option<u32>,
) -> Result<FreshKey, BoxError> {
    let store = match park_threshold {
        None => store(client, db).await?,
        Some(threshold) => {
            let store = MongoEventStore::builder(client.clone())
                .database(db.name())
                .park_threshold(threshold)
                .build()?;
            store.setup().await?;
            store
        }
    };
    publish(&store, backlog, Some(100)).await?;
    let (tx, mut rx) = mpsc::unbounded_channel::<(u64, Instant)>();
    let handled = Arc::new(AtomicUsize::new(0));
    let drained = Arc::new(Notify::new());
    let drained_at = Arc::new(Mutex::new(None::<Instant>));
    let subscription = Subscription::new("tick", {
        let (handled, drained, drained_at) = (
            Arc::clone(&handled),
            Arc::clone(&drained),
            Arc::clone(&drained_at),
        );
        move |tick: Tick, ctx: HandlerContext| {
            let started = Instant::now();
            let (tx, handled, drained, drained_at) = (
                tx.clone(),
                Arc::clone(&handled),
                Arc::clone(&drained),
                Arc::clone(&drained_at),
            );
            async move {
                if ctx.key().is_some_and(|key| key.starts_with(FRESH_PREFIX)) {
                    let _ = tx.send((tick.n, started));
                } else if handled.fetch_add(1, Ordering::Relaxed) + 1 == backlog {
                    *drained_at.lock().map_err(|_| "drain time poisoned")? = Some(started);
                    drained.notify_one();
                }
                Ok::<(), BoxError>(())
            }
        }
    });
    let bus = draining_bus(&store, "bench-fresh-key", subscription)?;
    let started = Instant::now();
    bus.start().await?;
    let mut latencies = Vec::with_capacity(samples);
    for n in 0..samples as u64 {
        if n > 0 && handled.load(Ordering::Relaxed) >= backlog {
            break;
        }
        bus.publish(&Tick { n })
            .key(format!("{FRESH_PREFIX}{n}"))
            .await?;
        let committed = Instant::now();
        // Each fresh key's delivery runs once: no failure happens here, so a second run of an
        // earlier one is a duplicate hand-out.
        let (ran, handler_started) = tokio::time::timeout(Duration::from_secs(600), rx.recv())
            .await?
            .ok_or("handler channel closed")?;
        assert_eq!(
            ran, n,
            "fresh key {ran}'s delivery ran again while the delivery of {n} was awaited"
        );
        latencies.push(
            handler_started
                .saturating_duration_since(committed)
                .as_secs_f64()
                * 1000.0,
        );
        tokio::time::sleep(spacing(n)).await;
    }
    tokio::time::timeout(Duration::from_secs(600), drained.notified()).await?;
    bus.shutdown().await?;
    assert_drained(db).await?;
    let drained_at = (*drained_at.lock().map_err(|_| "drain time poisoned")?)
        .ok_or("the backlog's last delivery left no time")?;
    Ok(FreshKey {
        latency: Summary::of(latencies),
        drain_per_sec: backlog as f64 / drained_at.duration_since(started).as_secs_f64(),
    })
}

/// What [`backlog_run`] measured: deliveries/s over the first and the last tenth of the
/// backlog and over all of it, and the process's memory at the start of the drain, the largest
/// sampled during it and at the end.
struct Backlog {
    first_10: f64,
    last_10: f64,
    total: f64,
    memory: [Option<Memory>; 3],
}

/// One bus drains `count` unkeyed deliveries published beforehand (not timed). The handler
/// notes when each tenth of them has started; the total runs until the bus has shut down, with
/// the last completions flushed, as in the throughput runs.
async fn backlog_run(client: &Client, db: &Database, count: usize) -> Result<Backlog, BoxError> {
    let store = store(client, db).await?;
    publish(&store, count, None).await?;
    // The deliveries handled when each tenth is done: the ceiling of count * k / 10.
    let tenths: Arc<Vec<usize>> = Arc::new((1..=10).map(|k| (count * k).div_ceil(10)).collect());
    let reached = Arc::new(Mutex::new([None::<Instant>; 10]));
    let handled = Arc::new(AtomicUsize::new(0));
    let all_done = Arc::new(Notify::new());
    let subscription = Subscription::new("tick", {
        let (tenths, reached, all_done) = (
            Arc::clone(&tenths),
            Arc::clone(&reached),
            Arc::clone(&all_done),
        );
        move |_: Tick, _: HandlerContext| {
            let now = Instant::now();
            let n = handled.fetch_add(1, Ordering::Relaxed) + 1;
            let (tenths, reached, all_done) = (
                Arc::clone(&tenths),
                Arc::clone(&reached),
                Arc::clone(&all_done),
            );
            async move {
                if tenths.contains(&n) {
                    let mut reached = reached.lock().map_err(|_| "tenths poisoned")?;
                    // A backlog under ten deliveries has tenths that share a count.
                    for (tenth, _) in tenths.iter().enumerate().filter(|(_, at)| **at == n) {
                        reached[tenth] = Some(now);
                    }
                }
                if n == count {
                    all_done.notify_one();
                }
                Ok::<(), BoxError>(())
            }
        }
    });
    let bus = draining_bus(&store, "bench-backlog", subscription)?;
    let at_start = Memory::now();
    let (stop, mut stopped) = oneshot::channel::<()>();
    let sampler = tokio::spawn(async move {
        let mut most = at_start;
        let mut every = tokio::time::interval(Duration::from_millis(100));
        loop {
            tokio::select! {
                _ = &mut stopped => return most,
                _ = every.tick() => {
                    most = match (most, Memory::now()) {
                        (Some(most), Some(now)) => Some(most.max(now)),
                        (most, now) => most.or(now),
                    };
                }
            }
        }
    });
    let started = Instant::now();
    bus.start().await?;
    tokio::time::timeout(Duration::from_secs(1800), all_done.notified()).await?;
    bus.shutdown().await?;
    let elapsed = started.elapsed();
    let _ = stop.send(());
    let most = sampler.await?;
    let at_end = Memory::now();
    assert_drained(db).await?;
    let reached = *reached.lock().map_err(|_| "tenths poisoned")?;
    let mut times = [started; 10];
    for (time, at) in times.iter_mut().zip(reached) {
        *time = at.ok_or("a tenth of the backlog left no time")?;
    }
    let rate = |from: usize, to: usize, since: Instant, until: Instant| {
        (to - from) as f64 / until.saturating_duration_since(since).as_secs_f64()
    };
    Ok(Backlog {
        first_10: rate(0, tenths[0], started, times[0]),
        last_10: rate(tenths[8], count, times[8], times[9]),
        total: count as f64 / elapsed.as_secs_f64(),
        memory: [at_start, most.map(|m| m.max(at_end.unwrap_or(m))), at_end],
    })
}

/// The floor over the same backlog as [`backlog_run`]: one worker of [`floor`] drains `count`
/// unkeyed deliveries published beforehand (not timed), in batches of the bus's size; a tenth
/// is reached when the batch holding its last delivery is read. Deliveries/s over the first and
/// the last tenth.
async fn floor_backlog_run(
    client: &Client,
    db: &Database,
    count: usize,
) -> Result<(f64, f64), BoxError> {
    let store = store(client, db).await?;
    publish(&store, count, None).await?;
    let tenths: Vec<usize> = (1..=10).map(|k| (count * k).div_ceil(10)).collect();
    let mut reached = [None::<Instant>; 10];
    let mut read = 0;
    let lanes: Vec<i32> = (0..256).collect();
    let started = Instant::now();
    Floor::of(&store)
        .drain(&lanes, BATCH, |batch| {
            let now = Instant::now();
            for (tenth, at) in tenths.iter().enumerate() {
                if (read + 1..=read + batch).contains(at) {
                    reached[tenth] = Some(now);
                }
            }
            read += batch;
        })
        .await?;
    assert_drained(db).await?;
    let at = |tenth: usize| reached[tenth].ok_or("a tenth of the floor's backlog left no time");
    let (first, ninth, last) = (at(0)?, at(8)?, at(9)?);
    let rate = |n: usize, since: Instant, until: Instant| {
        n as f64 / until.saturating_duration_since(since).as_secs_f64()
    };
    Ok((
        rate(tenths[0], started, first),
        rate(count - tenths[8], ninth, last),
    ))
}

/// When each run of a key's deliveries started and when its handler returned, with its event's
/// id, per key.
type RunLog = HashMap<String, Vec<(Instant, Instant, String)>>;

/// What [`hot_keys_run`] measured: the rate, the gaps (from a handler's return, and from its
/// transaction's commit), and the server's work per 1,000 deliveries (see
/// [`ServerWork::per_thousand`]).
struct HotKeys {
    per_sec: f64,
    gap: Summary,
    from_commit: Summary,
    work: serde_json::Value,
}

/// When the bus's transactions committed, per event id: the time of the bus's `debug` event
/// that says a delivery completed in its handler's transaction (sent when the commit has
/// returned), inside the delivery's `relaybus.handle` span. Records only while `on` is set.
#[derive(Clone, Default)]
struct Commits {
    on: Arc<std::sync::atomic::AtomicBool>,
    spans: Arc<Mutex<HashMap<tracing::span::Id, String>>>,
    at: Arc<Mutex<HashMap<String, Instant>>>,
}

/// The first string-like field of that name an event or span records.
struct TextField(&'static str, Option<String>);

impl tracing::field::Visit for TextField {
    fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
        if field.name() == self.0 {
            self.1.get_or_insert_with(|| value.to_owned());
        }
    }

    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        if field.name() == self.0 {
            self.1.get_or_insert_with(|| format!("{value:?}"));
        }
    }
}

/// The bus's message when a delivery completed in its handler's transaction.
const COMMITTED: &str = "handler succeeded and its delivery completed in its transaction";

impl<S> tracing_subscriber::Layer<S> for Commits
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
{
    fn on_new_span(
        &self,
        attrs: &tracing::span::Attributes<'_>,
        id: &tracing::span::Id,
        _: tracing_subscriber::layer::Context<'_, S>,
    ) {
        if attrs.metadata().name() == "relaybus.handle" {
            let mut event_id = TextField("event_id", None);
            attrs.record(&mut event_id);
            if let (Some(event_id), Ok(mut spans)) = (event_id.1, self.spans.lock()) {
                spans.insert(id.clone(), event_id);
            }
        }
    }

    fn on_event(&self, event: &tracing::Event<'_>, ctx: tracing_subscriber::layer::Context<'_, S>) {
        let now = Instant::now();
        let mut message = TextField("message", None);
        event.record(&mut message);
        if message.1.as_deref() != Some(COMMITTED) {
            return;
        }
        let Some(span) = ctx.event_span(event) else {
            return;
        };
        let event_id = self
            .spans
            .lock()
            .ok()
            .and_then(|spans| spans.get(&span.id()).cloned());
        if let (Some(event_id), Ok(mut at)) = (event_id, self.at.lock()) {
            at.insert(event_id, now);
        }
    }

    fn on_close(&self, id: tracing::span::Id, _: tracing_subscriber::layer::Context<'_, S>) {
        if let Ok(mut spans) = self.spans.lock() {
            spans.remove(&id);
        }
    }
}

impl Commits {
    /// Installs the recorder as the process's subscriber, off; `None` when a subscriber is
    /// installed already.
    fn install() -> Option<Commits> {
        use tracing_subscriber::{Layer, layer::SubscriberExt};
        let commits = Commits::default();
        let on = Arc::clone(&commits.on);
        let filter = tracing_subscriber::filter::dynamic_filter_fn(move |metadata, _| {
            on.load(Ordering::Relaxed) && metadata.target().starts_with("relaybus")
        });
        let subscriber = tracing_subscriber::registry().with(commits.clone().with_filter(filter));
        tracing::subscriber::set_global_default(subscriber)
            .ok()
            .map(|()| commits)
    }
}

/// One bus runs `count` deliveries over `keys` keys through a transactional handler that
/// writes one small document through its session. Returns deliveries/s (until the bus has shut
/// down) and, per key, the gap from a delivery's handler returning to the next delivery of the
/// same key starting. The gap is taken from the handler's return, so it includes the commit of
/// the transaction that completes the delivery, besides claiming the next one; and from the
/// commit's return (see [`Commits`]).
async fn hot_keys_run(
    client: &Client,
    db: &Database,
    count: usize,
    keys: usize,
) -> Result<HotKeys, BoxError> {
    let (store, writes) = hot_keys_setup(client, db, count, keys).await?;
    let commits = Commits::install();
    let runs: Arc<Mutex<RunLog>> = Arc::default();
    let handled = Arc::new(AtomicUsize::new(0));
    let all_done = Arc::new(Notify::new());
    let subscription = Subscription::new("tick", {
        let (runs, all_done) = (Arc::clone(&runs), Arc::clone(&all_done));
        move |event: Tick, ctx: HandlerContext| {
            let started = Instant::now();
            let (writes, runs, handled, all_done) = (
                writes.clone(),
                Arc::clone(&runs),
                Arc::clone(&handled),
                Arc::clone(&all_done),
            );
            async move {
                {
                    let mut session = ctx.session().await?;
                    writes
                        .insert_one(doc! { "n": event.n as i64 })
                        .session(&mut *session)
                        .await?;
                }
                let key = ctx.key().unwrap_or_default().to_owned();
                let returned = Instant::now();
                runs.lock()
                    .map_err(|_| "run log poisoned")?
                    .entry(key)
                    .or_default()
                    .push((started, returned, ctx.event_id().to_owned()));
                if handled.fetch_add(1, Ordering::Relaxed) + 1 == count {
                    all_done.notify_one();
                }
                Ok::<(), BoxError>(())
            }
        }
    })
    .transactional();
    let bus = draining_bus(&store, "bench-hot-keys", subscription)?;
    let before = ServerWork::now(client).await;
    if let Some(commits) = &commits {
        commits.on.store(true, Ordering::Relaxed);
    }
    let started = Instant::now();
    bus.start().await?;
    tokio::time::timeout(Duration::from_secs(600), all_done.notified()).await?;
    bus.shutdown().await?;
    let elapsed = started.elapsed();
    if let Some(commits) = &commits {
        commits.on.store(false, Ordering::Relaxed);
    }
    let work = ServerWork::per_thousand(before, ServerWork::now(client).await, count);
    assert_drained(db).await?;
    let committed: HashMap<String, Instant> = match &commits {
        Some(commits) => commits
            .at
            .lock()
            .map_err(|_| "commit log poisoned")?
            .clone(),
        None => HashMap::new(),
    };
    let ms = |from: Instant, to: Instant| to.saturating_duration_since(from).as_secs_f64() * 1000.0;
    let (mut gaps, mut from_commit) = (Vec::with_capacity(count), Vec::with_capacity(count));
    for runs in runs.lock().map_err(|_| "run log poisoned")?.values_mut() {
        runs.sort_by_key(|(started, _, _)| *started);
        for pair in runs.windows(2) {
            gaps.push(ms(pair[0].1, pair[1].0));
            // A run whose transaction ran again has no commit of its own: the later run's.
            if pair[0].2 != pair[1].2
                && let Some(commit) = committed.get(&pair[0].2)
            {
                from_commit.push(ms(*commit, pair[1].0));
            }
        }
    }
    if commits.is_some() && from_commit.is_empty() && !gaps.is_empty() {
        return Err(format!(
            "no commit of the bus was recorded: its debug event no longer says {COMMITTED:?}"
        )
        .into());
    }
    Ok(HotKeys {
        per_sec: count as f64 / elapsed.as_secs_f64(),
        gap: Summary::of(gaps),
        from_commit: Summary::of(from_commit),
        work,
    })
}
