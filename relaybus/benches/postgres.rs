//! The PostgreSQL store against raw SQL and against graphile_worker, in one run on one server:
//! publish and drain throughput, and commit-to-handler latency.
//!
//! Subjects, each in a schema of its own that the run drops at the end:
//!
//! - **raw**, the baseline: one plain `outbox` table. Publishing inserts one row per
//!   transaction; draining takes `SELECT … ORDER BY id LIMIT n FOR UPDATE SKIP LOCKED`, reads
//!   the payloads and deletes the rows, in one transaction per batch.
//! - **floor**: the store's own tables (made by `setup()`), written and read with raw SQL and
//!   nothing else. Publishing inserts the event and its delivery and sends the `pg_notify`;
//!   draining takes a batch of due deliveries with their events (`FOR UPDATE SKIP LOCKED`),
//!   deletes them and stamps their events' `completed_at`, in one transaction per batch. The
//!   floor against raw is the cost of the table design; relaybus against the floor is the cost
//!   of the library's own work (leases and their fencing, per-key order, retries).
//! - **relaybus**: publishing through `bus.publish(..).session(..)` in a transaction the caller
//!   began and commits; draining through whole buses with a no-op handler.
//! - **peer**: graphile_worker 0.14, the job queue a Rust user would pick instead. Its sqlx 0.9
//!   cannot share a build with ours, so it is the crate `benches/graphile-peer` (excluded from
//!   the workspace), built by this benchmark with `cargo build --release --manifest-path
//!   benches/graphile-peer/Cargo.toml` into `target/graphile-peer` and run as a separate
//!   process against the same server; it prints its figures as one JSON line. It drains twice:
//!   with its local queue and batched completions, and with its defaults (one job per fetch
//!   and wake-up, which drain a backlog at about one job per handler slot and poll interval, so
//!   they get at most `4 x workers x 32` jobs); `peer_ratio` is set against the faster.
//!
//! Everything runs at the same concurrency: `RELAYBUS_BENCH_PUBLISHERS` publishers (8) with one
//! event per transaction, and `RELAYBUS_BENCH_WORKERS` workers (2) that each run 32 handlers
//! at once on a pool of their own of 20 connections (a bus with batch size and concurrency
//! 32, a raw claimer taking 32 rows at a time, a graphile_worker `Worker` with concurrency 32).
//! Publishing is timed while the drained rows are written, `RELAYBUS_BENCH_DELIVERIES` of them
//! (4000); draining is timed from the workers' start to their shutdown.
//!
//! Keyed drains: relaybus and the floor drain `RELAYBUS_BENCH_DELIVERIES` events spread over
//! `RELAYBUS_BENCH_KEYS` keys (100), and `RELAYBUS_BENCH_HOT_DELIVERIES` (1000) over
//! `RELAYBUS_BENCH_HOT_KEYS` (10), published before the drain. Each checks that every key's
//! deliveries start in sequence order, once each, and measures the time from a key's delivery
//! starting to its next one starting (the handler does nothing, so this is the predecessor's
//! completion and the next delivery's claim): `next_start_p50_ms` of the hot keys is the
//! figure to watch. `keyed_ratio` is relaybus keyed / relaybus unkeyed, per round. The WAL the
//! server wrote per delivery while publishing and while draining is printed for relaybus and
//! the floor (the server's whole WAL, so other clients count too).
//!
//! Latency is the time from just after the publishing transaction's commit returned to the
//! handler starting, on one idle worker woken by `NOTIFY` (relaybus's background dispatcher
//! with its wake-up stream; graphile_worker's notification delivery), with a few milliseconds
//! of idleness between samples, `RELAYBUS_BENCH_SAMPLES` times (1000).
//!
//! `RELAYBUS_BENCH_ROUNDS` rounds (3) run the subjects in turn; the figures are the medians
//! with their min..max, and the ratios are the medians of each round's ratio. It ends with one
//! JSON line whose keys include `ratio` (relaybus drain / raw drain), `peer_ratio` (relaybus
//! drain / graphile_worker drain), `latency_p50_ms`, `latency_p99_ms`, `peer_latency_p50_ms`
//! and `peer_latency_p99_ms`.
//!
//! Last comes the projection (`projection` in the JSON): a transactional handler inserting one
//! row per event, one delivery at a time, against a transactional batch handler of up to 100
//! inserting its batch with one `INSERT .. SELECT unnest(..)`, each draining
//! `RELAYBUS_BENCH_DELIVERIES` on one worker. `RELAYBUS_BENCH_ONLY=projection` runs it alone
//! (`RELAYBUS_BENCH_ROUNDS` times, with medians and min..max).
//!
//! Run with `cargo bench -p relaybus --bench postgres --features postgres`. The server is
//! `RELAYBUS_BENCH_POSTGRES_URL` (default `postgres://postgres@127.0.0.1:5432/test`); the
//! user must be allowed to create schemas. Run by `cargo test` (without `--bench`), it makes a
//! tiny run of relaybus and raw only, checking that every delivery was handled once; the peer
//! is built and run only under `cargo bench`.

use std::{
    collections::HashMap,
    path::PathBuf,
    process::{Command, Stdio},
    sync::{
        Arc, Mutex,
        atomic::{AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use futures::future::try_join_all;
use relaybus::{
    BoxError, Event, HandlerContext, PostgresEventStore, PostgresSession, RelayBus, Subscription,
};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use sqlx::{PgPool, Row, postgres::PgPoolOptions};
use tokio::sync::{Notify, mpsc};

/// Deliveries per claim, and handlers running at once per worker.
const BATCH: u32 = 32;
/// Connections in each worker's pool (graphile_worker's default).
const POOL: u32 = 20;
/// The handler of every subject.
const HANDLER: &str = "tick";

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

/// What every subject runs with.
#[derive(Clone)]
struct Settings {
    url: String,
    deliveries: usize,
    publishers: usize,
    workers: usize,
    samples: usize,
    /// Keys of the keyed drain, over `deliveries` events.
    keys: usize,
    /// Keys of the hot-keys drain, over `hot_deliveries` events.
    hot_keys: usize,
    hot_deliveries: usize,
}

/// One round's figures of one subject.
#[derive(Clone, Copy, Default)]
struct Figures {
    publish: f64,
    drain: f64,
    p50: f64,
    p99: f64,
    /// Claim statements per run (scans of the claim index), for the store's tables.
    claims: f64,
    /// Completion transactions per run (relaybus only).
    completions: f64,
    /// WAL bytes the server wrote per delivery while publishing, and while draining (the
    /// server's, so other clients of it count too).
    wal_publish: f64,
    wal_drain: f64,
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let smoke = !std::env::args().any(|arg| arg == "--bench");
    let settings = Settings {
        url: std::env::var("RELAYBUS_BENCH_POSTGRES_URL")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned()),
        deliveries: if smoke {
            64
        } else {
            env_number("RELAYBUS_BENCH_DELIVERIES", 4000)
        },
        publishers: env_number("RELAYBUS_BENCH_PUBLISHERS", 8).max(1),
        workers: env_number("RELAYBUS_BENCH_WORKERS", 2).max(1),
        samples: if smoke {
            3
        } else {
            env_number("RELAYBUS_BENCH_SAMPLES", 1000).max(1)
        },
        keys: if smoke {
            8
        } else {
            env_number("RELAYBUS_BENCH_KEYS", 100).max(1)
        },
        hot_keys: if smoke {
            2
        } else {
            env_number("RELAYBUS_BENCH_HOT_KEYS", 10).max(1)
        },
        hot_deliveries: if smoke {
            16
        } else {
            env_number("RELAYBUS_BENCH_HOT_DELIVERIES", 1000).max(1)
        },
    };
    let rounds = if smoke {
        1
    } else {
        env_number("RELAYBUS_BENCH_ROUNDS", 3).max(1)
    };
    let admin = pool(&settings.url, settings.publishers as u32 + 2).await?;
    if std::env::var("RELAYBUS_BENCH_ONLY").is_ok_and(|only| only == "projection") {
        let (mut single, mut batched) = (Vec::new(), Vec::new());
        for round in 1..=rounds {
            let prefix = format!("rbbench_{}_{round}_projection", std::process::id());
            single.push(
                in_schema(&admin, &format!("{prefix}_single"), async |schema| {
                    projection_run(&settings, &admin, schema, false).await
                })
                .await?,
            );
            batched.push(
                in_schema(&admin, &format!("{prefix}_batch"), async |schema| {
                    projection_run(&settings, &admin, schema, true).await
                })
                .await?,
            );
            println!(
                "round {round}: one delivery at a time {:.0}/s, batches of up to \
                 {PROJECTION_BATCH} {:.0}/s",
                single[round - 1],
                batched[round - 1]
            );
        }
        let ratios: Vec<f64> = single.iter().zip(&batched).map(|(s, b)| b / s).collect();
        let (single, batched, ratios) =
            (Spread::of(single), Spread::of(batched), Spread::of(ratios));
        println!(
            "{}",
            json!({
                "bench": "postgres",
                "profile": "projection",
                "projection": {
                    "deliveries": settings.deliveries,
                    "max_batch": PROJECTION_BATCH,
                    "single_per_sec": single.median_json(0),
                    "batch_per_sec": batched.median_json(0),
                    "batch_to_single": ratios.median_json(3),
                    "spreads": {
                        "single_per_sec": single.json(0),
                        "batch_per_sec": batched.json(0),
                        "batch_to_single": ratios.json(3),
                    },
                },
            })
        );
        return Ok(());
    }
    let peer = if smoke { None } else { Some(build_peer()?) };

    println!(
        "postgres benchmark: {} deliveries per run, {} publishers (1 event per transaction), {} \
         workers x {BATCH} handlers, {} latency samples, {rounds} rounds",
        settings.deliveries, settings.publishers, settings.workers, settings.samples
    );
    println!(
        "{:<6} {:<10} {:>11} {:>11} {:>9} {:>9}",
        "round", "subject", "publish/s", "drain/s", "p50 ms", "p99 ms"
    );
    let mut raw = Vec::new();
    let mut floor = Vec::new();
    let mut ours = Vec::new();
    let mut theirs: Vec<Value> = Vec::new();
    // Keyed drains: relaybus and the floor, over many keys and over a few hot ones.
    let (mut ours_keyed, mut ours_hot) = (Vec::new(), Vec::new());
    let (mut floor_keyed_runs, mut floor_hot) = (Vec::new(), Vec::new());
    for round in 1..=rounds {
        let prefix = format!("rbbench_{}_{round}", std::process::id());
        let figures = in_schema(&admin, &format!("{prefix}_raw"), async |schema| {
            raw_run(&settings, &admin, schema).await
        })
        .await?;
        print_row(round, "raw", &figures, false);
        raw.push(figures);
        if !smoke {
            let figures = in_schema(&admin, &format!("{prefix}_floor"), async |schema| {
                floor_run(&settings, &admin, schema).await
            })
            .await?;
            print_row(round, "floor", &figures, false);
            floor.push(figures);
        }
        let mut figures = in_schema(&admin, &format!("{prefix}_relaybus"), async |schema| {
            relaybus_run(&settings, &admin, schema).await
        })
        .await?;
        (figures.p50, figures.p99) =
            in_schema(&admin, &format!("{prefix}_latency"), async |schema| {
                latency_run(&settings, schema).await
            })
            .await?;
        print_row(round, "relaybus", &figures, true);
        ours.push(figures);
        let keyed = in_schema(&admin, &format!("{prefix}_keyed"), async |schema| {
            relaybus_keyed(
                &settings,
                &admin,
                schema,
                settings.deliveries,
                settings.keys,
            )
            .await
        })
        .await?;
        let hot = in_schema(&admin, &format!("{prefix}_hot"), async |schema| {
            relaybus_keyed(
                &settings,
                &admin,
                schema,
                settings.hot_deliveries,
                settings.hot_keys,
            )
            .await
        })
        .await?;
        print_keyed(round, "relaybus", &keyed, &hot);
        ours_keyed.push(keyed);
        ours_hot.push(hot);
        if !smoke {
            let keyed = in_schema(&admin, &format!("{prefix}_fkeyed"), async |schema| {
                floor_keyed(
                    &settings,
                    &admin,
                    schema,
                    settings.deliveries,
                    settings.keys,
                )
                .await
            })
            .await?;
            let hot = in_schema(&admin, &format!("{prefix}_fhot"), async |schema| {
                floor_keyed(
                    &settings,
                    &admin,
                    schema,
                    settings.hot_deliveries,
                    settings.hot_keys,
                )
                .await
            })
            .await?;
            print_keyed(round, "floor", &keyed, &hot);
            floor_keyed_runs.push(keyed);
            floor_hot.push(hot);
        }
        if let Some(peer) = &peer {
            let figures = run_peer(peer, &settings, &format!("{prefix}_graphile"))?;
            let number = |name: &str| figures[name].as_f64().unwrap_or(f64::NAN);
            println!(
                "{:<6} {:<10} {:>11.0} {:>11.0} {:>9.2} {:>9.2}   (local queue: {:.0} drain/s)",
                round,
                "graphile",
                number("publish_per_sec"),
                number("drain_per_sec"),
                number("latency_p50_ms"),
                number("latency_p99_ms"),
                number("drain_local_queue_per_sec"),
            );
            theirs.push(figures);
        }
    }

    // The smoke run's checks are in the runs themselves; the figures only say it ran.
    let summary = |figures: &[Figures], latency: bool| -> Value {
        if figures.is_empty() {
            return Value::Null;
        }
        let spread = |pick: fn(&Figures) -> f64| Spread::of(figures.iter().map(pick).collect());
        let mut summary = json!({
            "publish_per_sec": spread(|f| f.publish).json(0),
            "drain_per_sec": spread(|f| f.drain).json(0),
        });
        if latency {
            summary["latency_p50_ms"] = spread(|f| f.p50).json(2);
            summary["latency_p99_ms"] = spread(|f| f.p99).json(2);
        }
        if figures.iter().any(|f| f.claims > 0.0) {
            summary["claims_per_run"] = spread(|f| f.claims).json(0);
        }
        if figures.iter().any(|f| f.completions > 0.0) {
            summary["completions_per_run"] = spread(|f| f.completions).json(0);
        }
        if figures.iter().any(|f| f.wal_drain > 0.0) {
            summary["wal_publish_bytes_per_delivery"] = spread(|f| f.wal_publish).json(0);
            summary["wal_drain_bytes_per_delivery"] = spread(|f| f.wal_drain).json(0);
        }
        summary
    };
    let peer_number = |figures: &Value, name: &str| figures[name].as_f64().unwrap_or(f64::NAN);
    // The peer's drain: the faster of its two settings in each round.
    let peer_drain: Vec<f64> = theirs
        .iter()
        .map(|f| peer_number(f, "drain_per_sec").max(peer_number(f, "drain_local_queue_per_sec")))
        .collect();
    let per_round = |values: Vec<f64>| Spread::of(values);
    let ratio = per_round(
        ours.iter()
            .zip(&raw)
            .map(|(o, r)| o.drain / r.drain)
            .collect(),
    );
    let publish_ratio = per_round(
        ours.iter()
            .zip(&raw)
            .map(|(o, r)| o.publish / r.publish)
            .collect(),
    );
    let floor_ratio = per_round(
        floor
            .iter()
            .zip(&raw)
            .map(|(f, r)| f.drain / r.drain)
            .collect(),
    );
    let peer_ratio = per_round(
        ours.iter()
            .zip(&peer_drain)
            .map(|(o, p)| o.drain / p)
            .collect(),
    );
    let latency = |pick: fn(&Figures) -> f64| Spread::of(ours.iter().map(pick).collect());
    let peer_spread =
        |name: &str| Spread::of(theirs.iter().map(|f| peer_number(f, name)).collect());
    let peer = if theirs.is_empty() {
        Value::Null
    } else {
        json!({
            "publish_per_sec": peer_spread("publish_per_sec").json(0),
            "drain_per_sec": peer_spread("drain_per_sec").json(0),
            "drain_local_queue_per_sec": peer_spread("drain_local_queue_per_sec").json(0),
            "latency_p50_ms": peer_spread("latency_p50_ms").json(2),
            "latency_p99_ms": peer_spread("latency_p99_ms").json(2),
        })
    };

    let relaybus_floor_ratio = per_round(
        ours.iter()
            .zip(&floor)
            .map(|(o, f)| o.drain / f.drain)
            .collect(),
    );
    let peer_publish_ratio = per_round(
        ours.iter()
            .zip(&theirs)
            .map(|(o, p)| o.publish / peer_number(p, "publish_per_sec"))
            .collect(),
    );
    let keyed_ratio = per_round(
        ours_keyed
            .iter()
            .zip(&ours)
            .map(|(k, o)| k.drain / o.drain)
            .collect(),
    );
    let keyed_floor_ratio = per_round(
        ours_keyed
            .iter()
            .zip(&floor_keyed_runs)
            .map(|(o, f)| o.drain / f.drain)
            .collect(),
    );
    let keyed_spread =
        |runs: &[Keyed], pick: fn(&Keyed) -> f64| Spread::of(runs.iter().map(pick).collect());
    let keyed_json = |runs: &[Keyed]| -> Value {
        if runs.is_empty() {
            return Value::Null;
        }
        json!({
            "drain_per_sec": keyed_spread(runs, |k| k.drain).json(0),
            "next_start_p50_ms": keyed_spread(runs, |k| k.next_p50).json(2),
            "next_start_p99_ms": keyed_spread(runs, |k| k.next_p99).json(2),
        })
    };

    println!("\nmedians (min..max) over {rounds} rounds");
    for (name, figures) in [("raw", &raw), ("floor", &floor), ("relaybus", &ours)] {
        if figures.is_empty() {
            continue;
        }
        let spread = |pick: fn(&Figures) -> f64| Spread::of(figures.iter().map(pick).collect());
        let claims = spread(|f| f.claims);
        let claims = match claims.median() {
            Some(c) if c > 0.0 => format!(
                ", {} claims ({:.1} deliveries per claim)",
                claims.text(0),
                settings.deliveries as f64 / c
            ),
            _ => String::new(),
        };
        let wal = match spread(|f| f.wal_drain).median() {
            Some(w) if w > 0.0 => format!(
                "; WAL per delivery: publish {} B, drain {} B",
                spread(|f| f.wal_publish).text(0),
                spread(|f| f.wal_drain).text(0)
            ),
            _ => String::new(),
        };
        println!(
            "{name:<10} publish {} /s, drain {} /s{claims}{wal}",
            spread(|f| f.publish).text(0),
            spread(|f| f.drain).text(0)
        );
    }
    println!(
        "relaybus   latency p50 {} ms, p99 {} ms",
        latency(|f| f.p50).text(2),
        latency(|f| f.p99).text(2)
    );
    if !theirs.is_empty() {
        println!(
            "graphile   publish {} /s, drain {} /s (local queue {} /s), latency p50 {} ms, \
             p99 {} ms",
            peer_spread("publish_per_sec").text(0),
            peer_spread("drain_per_sec").text(0),
            peer_spread("drain_local_queue_per_sec").text(0),
            peer_spread("latency_p50_ms").text(2),
            peer_spread("latency_p99_ms").text(2),
        );
    }
    println!(
        "ratio (relaybus drain / raw drain) {}; floor / raw {}; publish relaybus / raw {}; \
         peer_ratio (relaybus drain / graphile_worker drain) {}",
        ratio.text(3),
        floor_ratio.text(3),
        publish_ratio.text(3),
        peer_ratio.text(3)
    );
    for (name, keyed, hot) in [
        ("relaybus", &ours_keyed, &ours_hot),
        ("floor", &floor_keyed_runs, &floor_hot),
    ] {
        if keyed.is_empty() {
            continue;
        }
        println!(
            "{name:<10} keyed ({} keys) drain {} /s, next start p50 {} ms; hot keys ({}) \
             drain {} /s, next start p50 {} ms, p99 {} ms",
            settings.keys,
            keyed_spread(keyed, |k| k.drain).text(0),
            keyed_spread(keyed, |k| k.next_p50).text(2),
            settings.hot_keys,
            keyed_spread(hot, |k| k.drain).text(0),
            keyed_spread(hot, |k| k.next_p50).text(2),
            keyed_spread(hot, |k| k.next_p99).text(2),
        );
    }
    println!(
        "relaybus / floor {}; publish relaybus / graphile_worker {}; keyed relaybus / unkeyed \
         relaybus {}; keyed relaybus / keyed floor {}",
        relaybus_floor_ratio.text(3),
        peer_publish_ratio.text(3),
        keyed_ratio.text(3),
        keyed_floor_ratio.text(3),
    );
    let projection = {
        let prefix = format!("rbbench_{}_projection", std::process::id());
        let single = in_schema(&admin, &format!("{prefix}_single"), async |schema| {
            projection_run(&settings, &admin, schema, false).await
        })
        .await?;
        let batched = in_schema(&admin, &format!("{prefix}_batch"), async |schema| {
            projection_run(&settings, &admin, schema, true).await
        })
        .await?;
        println!(
            "projection, one row per event in the handler's transaction, one worker: one \
             delivery at a time {single:.0}/s, batches of up to {PROJECTION_BATCH} {batched:.0}/s \
             (batch / single {:.2})",
            batched / single
        );
        json!({
            "deliveries": settings.deliveries,
            "max_batch": PROJECTION_BATCH,
            "single_per_sec": single.round(),
            "batch_per_sec": batched.round(),
            "batch_to_single": (batched / single * 1000.0).round() / 1000.0,
        })
    };
    println!(
        "{}",
        json!({
            "bench": "postgres",
            "projection": projection,
            "keys": settings.keys,
            "hot_keys": settings.hot_keys,
            "hot_deliveries_per_run": settings.hot_deliveries,
            "keyed": {
                "relaybus": keyed_json(&ours_keyed),
                "floor": keyed_json(&floor_keyed_runs),
            },
            "hot": {
                "relaybus": keyed_json(&ours_hot),
                "floor": keyed_json(&floor_hot),
            },
            "relaybus_floor_ratio": relaybus_floor_ratio.median_json(3),
            "peer_publish_ratio": peer_publish_ratio.median_json(3),
            "keyed_ratio": keyed_ratio.median_json(3),
            "keyed_floor_ratio": keyed_floor_ratio.median_json(3),
            "hot_next_start_p50_ms": keyed_spread(&ours_hot, |k| k.next_p50).median_json(2),
            "spreads": {
                "ratio": ratio.json(3),
                "floor_ratio": floor_ratio.json(3),
                "publish_ratio": publish_ratio.json(3),
                "peer_ratio": peer_ratio.json(3),
                "relaybus_floor_ratio": relaybus_floor_ratio.json(3),
                "peer_publish_ratio": peer_publish_ratio.json(3),
                "keyed_ratio": keyed_ratio.json(3),
                "keyed_floor_ratio": keyed_floor_ratio.json(3),
            },
            "deliveries_per_run": settings.deliveries,
            "publishers": settings.publishers,
            "workers": settings.workers,
            "handlers_per_worker": BATCH,
            "latency_samples": settings.samples,
            "rounds": rounds,
            "relaybus": summary(&ours, true),
            "raw": summary(&raw, false),
            "floor": summary(&floor, false),
            "peer": peer,
            "ratio": ratio.median_json(3),
            "floor_ratio": floor_ratio.median_json(3),
            "publish_ratio": publish_ratio.median_json(3),
            "peer_ratio": peer_ratio.median_json(3),
            "latency_p50_ms": latency(|f| f.p50).median_json(2),
            "latency_p99_ms": latency(|f| f.p99).median_json(2),
            "peer_latency_p50_ms": peer_spread("latency_p50_ms").median_json(2),
            "peer_latency_p99_ms": peer_spread("latency_p99_ms").median_json(2),
        })
    );
    Ok(())
}

fn print_keyed(round: usize, subject: &str, keyed: &Keyed, hot: &Keyed) {
    println!(
        "{round:<6} {subject:<10} keyed drain {:>8.0}/s, next start p50 {:.2} ms; hot keys \
         drain {:>8.0}/s, next start p50 {:.2} ms, p99 {:.2} ms",
        keyed.drain, keyed.next_p50, hot.drain, hot.next_p50, hot.next_p99
    );
}

fn print_row(round: usize, subject: &str, figures: &Figures, latency: bool) {
    let (p50, p99) = if latency {
        (format!("{:.2}", figures.p50), format!("{:.2}", figures.p99))
    } else {
        ("-".to_owned(), "-".to_owned())
    };
    let claims = match (figures.claims, figures.completions) {
        (0.0, _) => String::new(),
        (claims, 0.0) => format!("   ({claims:.0} claims)"),
        (claims, completions) => format!("   ({claims:.0} claims, {completions:.0} completions)"),
    };
    println!(
        "{round:<6} {subject:<10} {:>11.0} {:>11.0} {p50:>9} {p99:>9}{claims}",
        figures.publish, figures.drain
    );
}

/// The median and range of one figure over the rounds.
struct Spread {
    sorted: Vec<f64>,
}

impl Spread {
    fn of(mut values: Vec<f64>) -> Spread {
        values.retain(|v| !v.is_nan());
        values.sort_by(|a, b| a.total_cmp(b));
        Spread { sorted: values }
    }

    fn median(&self) -> Option<f64> {
        let n = self.sorted.len();
        match n {
            0 => None,
            _ if n % 2 == 1 => Some(self.sorted[n / 2]),
            _ => Some((self.sorted[n / 2 - 1] + self.sorted[n / 2]) / 2.0),
        }
    }

    fn round(value: f64, digits: i32) -> f64 {
        let scale = 10_f64.powi(digits);
        (value * scale).round() / scale
    }

    fn median_json(&self, digits: i32) -> Value {
        self.median()
            .map_or(Value::Null, |m| json!(Spread::round(m, digits)))
    }

    fn json(&self, digits: i32) -> Value {
        match (self.median(), self.sorted.first(), self.sorted.last()) {
            (Some(median), Some(min), Some(max)) => json!({
                "median": Spread::round(median, digits),
                "min": Spread::round(*min, digits),
                "max": Spread::round(*max, digits),
            }),
            _ => Value::Null,
        }
    }

    fn text(&self, digits: i32) -> String {
        let digits = digits as usize;
        match (self.median(), self.sorted.first(), self.sorted.last()) {
            (Some(median), Some(min), Some(max)) => {
                format!("{median:.digits$} ({min:.digits$}..{max:.digits$})")
            }
            _ => "-".to_owned(),
        }
    }
}

/// A pool of `size` connections on the server, or an error that says how to get one.
async fn pool(url: &str, size: u32) -> Result<PgPool, BoxError> {
    PgPoolOptions::new()
        .max_connections(size)
        .acquire_timeout(Duration::from_secs(60))
        .connect(url)
        .await
        .map_err(|e| {
            format!(
                "PostgreSQL at {url} does not answer ({e}); start PostgreSQL there, or set \
                 RELAYBUS_BENCH_POSTGRES_URL to a server and database where the user may create \
                 schemas"
            )
            .into()
        })
}

/// Runs `work` with the schema `name`, dropped before and after (whatever `work` returned).
async fn in_schema<R>(
    admin: &PgPool,
    name: &str,
    work: impl AsyncFnOnce(&str) -> Result<R, BoxError>,
) -> Result<R, BoxError> {
    let drop = format!("DROP SCHEMA IF EXISTS \"{name}\" CASCADE");
    sqlx::query(&drop).execute(admin).await?;
    let outcome = work(name).await;
    sqlx::query(&drop).execute(admin).await?;
    outcome
}

/// Runs `publishers` tasks that call `publish(n)` until `count` calls were made; per second.
async fn publish_with<F, Fut>(count: usize, publishers: usize, publish: F) -> Result<f64, BoxError>
where
    F: Fn(u64) -> Fut + Clone + Send + 'static,
    Fut: Future<Output = Result<(), BoxError>> + Send,
{
    let next = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let tasks = (0..publishers).map(|_| {
        let (next, publish) = (Arc::clone(&next), publish.clone());
        tokio::spawn(async move {
            loop {
                let n = next.fetch_add(1, Ordering::Relaxed);
                if n >= count {
                    return Ok::<(), BoxError>(());
                }
                publish(n as u64).await?;
            }
        })
    });
    for outcome in try_join_all(tasks).await? {
        outcome?;
    }
    Ok(count as f64 / started.elapsed().as_secs_f64())
}

/// Runs `workers` claim loops, each on a pool of its own, until each finds nothing left;
/// deliveries per second, after checking that `count` were handled.
async fn drain_with<F, Fut>(
    settings: &Settings,
    count: usize,
    claim_loop: F,
) -> Result<f64, BoxError>
where
    F: Fn(PgPool) -> Fut,
    Fut: Future<Output = Result<usize, BoxError>> + Send + 'static,
{
    let mut pools = Vec::new();
    for _ in 0..settings.workers {
        pools.push(pool(&settings.url, POOL).await?);
    }
    let started = Instant::now();
    let tasks = pools
        .iter()
        .map(|pool| tokio::spawn(claim_loop(pool.clone())));
    let mut handled = 0;
    for outcome in try_join_all(tasks).await? {
        handled += outcome?;
    }
    let elapsed = started.elapsed();
    // Closed, their server processes report their statistics (see `claims`).
    for pool in &pools {
        pool.close().await;
    }
    assert_eq!(handled, count, "every delivery handled once");
    Ok(count as f64 / elapsed.as_secs_f64())
}

/// The server's WAL position, in bytes.
async fn wal(admin: &PgPool) -> Result<f64, BoxError> {
    let row = sqlx::query("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::float8")
        .fetch_one(admin)
        .await?;
    Ok(row.try_get(0)?)
}

async fn count_rows(admin: &PgPool, table: &str) -> Result<i64, BoxError> {
    let row = sqlx::query(&format!("SELECT count(*) FROM {table}"))
        .fetch_one(admin)
        .await?;
    Ok(row.try_get(0)?)
}

/// The baseline: a plain outbox table, one row per event.
async fn raw_run(settings: &Settings, admin: &PgPool, schema: &str) -> Result<Figures, BoxError> {
    let table = format!("\"{schema}\".outbox");
    sqlx::query(&format!("CREATE SCHEMA \"{schema}\""))
        .execute(admin)
        .await?;
    sqlx::query(&format!(
        "CREATE TABLE {table} (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, \
         event_type text NOT NULL, payload json NOT NULL, \
         created_at timestamptz NOT NULL DEFAULT now())"
    ))
    .execute(admin)
    .await?;
    let insert = format!("INSERT INTO {table} (event_type, payload) VALUES ($1, $2::json)");
    let publish = publish_with(settings.deliveries, settings.publishers, {
        let (admin, insert) = (admin.clone(), insert.clone());
        move |n| {
            let (admin, insert) = (admin.clone(), insert.clone());
            async move {
                let mut transaction = admin.begin().await?;
                sqlx::query(&insert)
                    .bind(Tick::TYPE)
                    .bind(serde_json::to_string(&Tick { n })?)
                    .execute(&mut *transaction)
                    .await?;
                transaction.commit().await?;
                Ok(())
            }
        }
    })
    .await?;
    let select = format!(
        "SELECT id, payload::text AS payload FROM {table} ORDER BY id LIMIT {BATCH} \
         FOR UPDATE SKIP LOCKED"
    );
    let delete = format!("DELETE FROM {table} WHERE id = ANY($1)");
    let drain = drain_with(settings, settings.deliveries, |pool| {
        let (select, delete) = (select.clone(), delete.clone());
        async move {
            let mut handled = 0;
            loop {
                let mut transaction = pool.begin().await?;
                let rows = sqlx::query(&select).fetch_all(&mut *transaction).await?;
                if rows.is_empty() {
                    transaction.commit().await?;
                    return Ok(handled);
                }
                let mut ids = Vec::with_capacity(rows.len());
                for row in &rows {
                    let payload: String = row.try_get("payload")?;
                    let _: Tick = serde_json::from_str(&payload)?;
                    ids.push(row.try_get::<i64, _>("id")?);
                }
                sqlx::query(&delete)
                    .bind(&ids)
                    .execute(&mut *transaction)
                    .await?;
                transaction.commit().await?;
                handled += ids.len();
            }
        }
    })
    .await?;
    assert_eq!(count_rows(admin, &table).await?, 0, "the outbox is empty");
    Ok(Figures {
        publish,
        drain,
        ..Figures::default()
    })
}

/// A set-up store on `schema`, on `pool`.
async fn store(pool: PgPool, schema: &str) -> Result<PostgresEventStore, BoxError> {
    let store = PostgresEventStore::builder(pool).schema(schema).build()?;
    store.setup().await?;
    Ok(store)
}

/// The floor: the store's tables written and read with raw SQL, nothing more.
async fn floor_run(settings: &Settings, admin: &PgPool, schema: &str) -> Result<Figures, BoxError> {
    let store = store(admin.clone(), schema).await?;
    let s = format!("\"{schema}\"");
    let insert_event = format!(
        "INSERT INTO {s}.events (id, event_type, payload, headers, created_at, appended_at, \
         handlers) VALUES ($1, $2, $3::json, '{{}}'::json, $4, $4, ARRAY[$5])"
    );
    let insert_delivery = format!(
        "INSERT INTO {s}.deliveries (event_id, handler, event_type, status, due_at, \
         created_at, lane) VALUES ($1, $2, $3, 'pending', $4, $4, 0)"
    );
    let channel = store.channel();
    let wal_start = wal(admin).await?;
    let publish = publish_with(settings.deliveries, settings.publishers, {
        let admin = admin.clone();
        move |n| {
            let (admin, insert_event, insert_delivery, channel) = (
                admin.clone(),
                insert_event.clone(),
                insert_delivery.clone(),
                channel.clone(),
            );
            async move {
                let id = uuid::Uuid::now_v7().to_string();
                let now = relaybus::Timestamp::now().timestamp_millis();
                let mut transaction = admin.begin().await?;
                sqlx::query(&insert_event)
                    .bind(&id)
                    .bind(Tick::TYPE)
                    .bind(serde_json::to_string(&Tick { n })?)
                    .bind(now)
                    .bind(HANDLER)
                    .execute(&mut *transaction)
                    .await?;
                sqlx::query(&insert_delivery)
                    .bind(&id)
                    .bind(HANDLER)
                    .bind(Tick::TYPE)
                    .bind(now)
                    .execute(&mut *transaction)
                    .await?;
                sqlx::query("SELECT pg_notify($1, $2)")
                    .bind(&channel)
                    .bind(HANDLER)
                    .execute(&mut *transaction)
                    .await?;
                transaction.commit().await?;
                Ok(())
            }
        }
    })
    .await?;
    let claim = format!(
        "WITH picked AS MATERIALIZED ( \
             SELECT id, event_id FROM {s}.deliveries \
             WHERE status = 'pending' AND NOT parked AND due_at <= $1 \
             ORDER BY due_at, id LIMIT {BATCH} FOR UPDATE SKIP LOCKED) \
         SELECT p.id, e.payload::text AS payload FROM picked AS p \
         JOIN {s}.events AS e ON e.id = p.event_id"
    );
    let complete = format!(
        "WITH done AS (DELETE FROM {s}.deliveries WHERE id = ANY($1) RETURNING event_id) \
         UPDATE {s}.events SET completed_at = $2 WHERE id IN (SELECT event_id FROM done)"
    );
    let wal_published = wal(admin).await?;
    let drain = drain_with(settings, settings.deliveries, |pool| {
        let (claim, complete) = (claim.clone(), complete.clone());
        async move {
            let mut handled = 0;
            loop {
                let now = relaybus::Timestamp::now().timestamp_millis();
                let mut transaction = pool.begin().await?;
                let rows = sqlx::query(&claim)
                    .bind(now)
                    .fetch_all(&mut *transaction)
                    .await?;
                if rows.is_empty() {
                    transaction.commit().await?;
                    return Ok(handled);
                }
                let mut ids = Vec::with_capacity(rows.len());
                for row in &rows {
                    let payload: String = row.try_get("payload")?;
                    let _: Tick = serde_json::from_str(&payload)?;
                    ids.push(row.try_get::<i64, _>("id")?);
                }
                sqlx::query(&complete)
                    .bind(&ids)
                    .bind(now)
                    .execute(&mut *transaction)
                    .await?;
                transaction.commit().await?;
                handled += ids.len();
            }
        }
    })
    .await?;
    assert_eq!(
        count_rows(admin, &format!("{s}.deliveries")).await?,
        0,
        "every delivery completed"
    );
    let wal_drained = wal(admin).await?;
    let per_delivery = settings.deliveries as f64;
    Ok(Figures {
        publish,
        drain,
        claims: statements(admin, schema).await?.0,
        wal_publish: (wal_published - wal_start) / per_delivery,
        wal_drain: (wal_drained - wal_published) / per_delivery,
        ..Figures::default()
    })
}

/// The floor on `count` events spread over `keys` keys, held to their keys' order as the store
/// holds them: a key's first delivery is its head, the others are parked, and a completion
/// deletes the delivery and unparks its key's next one in the same statement. The events are
/// written (numbered `n / keys + 1` within key `n % keys`) before the drain; a claimer that
/// finds nothing while others still run waits for their next completion.
async fn floor_keyed(
    settings: &Settings,
    admin: &PgPool,
    schema: &str,
    count: usize,
    keys: usize,
) -> Result<Keyed, BoxError> {
    store(admin.clone(), schema).await?;
    let s = format!("\"{schema}\"");
    let insert = format!(
        "WITH event AS (INSERT INTO {s}.events (id, event_type, key, sequence, payload, headers, \
         created_at, appended_at, handlers) VALUES ($1, $2, $3, $4, $5::json, '{{}}'::json, $6, $6, \
         ARRAY[$7]) RETURNING id) \
         INSERT INTO {s}.deliveries (event_id, handler, event_type, key, sequence, status, \
         parked, due_at, created_at, lane) \
         SELECT id, $7, $2, $3, $4, 'pending', $4 > 1, $6, $6, 0 FROM event"
    );
    publish_with(count, settings.publishers, {
        let admin = admin.clone();
        move |n| {
            let (admin, insert) = (admin.clone(), insert.clone());
            async move {
                let now = relaybus::Timestamp::now().timestamp_millis();
                sqlx::query(&insert)
                    .bind(uuid::Uuid::now_v7().to_string())
                    .bind(Tick::TYPE)
                    .bind(key_of(n, keys))
                    .bind((n / keys as u64) as i64 + 1)
                    .bind(serde_json::to_string(&Tick { n })?)
                    .bind(now)
                    .bind(HANDLER)
                    .execute(&admin)
                    .await?;
                Ok(())
            }
        }
    })
    .await?;
    let claim = format!(
        "WITH picked AS MATERIALIZED ( \
             SELECT id, event_id, key, sequence FROM {s}.deliveries \
             WHERE status = 'pending' AND NOT parked AND due_at <= $1 \
             ORDER BY due_at, id LIMIT {BATCH} FOR UPDATE SKIP LOCKED) \
         SELECT p.id, p.key, p.sequence, e.payload::text AS payload FROM picked AS p \
         JOIN {s}.events AS e ON e.id = p.event_id"
    );
    let complete = format!(
        "WITH done AS ( \
             DELETE FROM {s}.deliveries WHERE id = ANY($1) \
             RETURNING event_id, handler, key, sequence \
         ), stamped AS ( \
             UPDATE {s}.events SET completed_at = $2 WHERE id IN (SELECT event_id FROM done) \
         ) \
         UPDATE {s}.deliveries AS d SET parked = false FROM done \
         WHERE d.handler = done.handler AND d.key = done.key \
           AND d.sequence = done.sequence + 1 AND d.status = 'pending'"
    );
    let handled = Arc::new(AtomicUsize::new(0));
    let completed = Arc::new(Notify::new());
    let watch = Arc::new(Mutex::new(KeyWatch::default()));
    let drain = drain_with(settings, count, |pool| {
        let (claim, complete) = (claim.clone(), complete.clone());
        let (handled, completed, watch) = (
            Arc::clone(&handled),
            Arc::clone(&completed),
            Arc::clone(&watch),
        );
        async move {
            let mut mine = 0;
            loop {
                let now = relaybus::Timestamp::now().timestamp_millis();
                let mut transaction = pool.begin().await?;
                let rows = sqlx::query(&claim)
                    .bind(now)
                    .fetch_all(&mut *transaction)
                    .await?;
                if rows.is_empty() {
                    transaction.commit().await?;
                    if handled.load(Ordering::SeqCst) >= count {
                        return Ok(mine);
                    }
                    // Another claimer runs the heads: wait for its completion.
                    let _ =
                        tokio::time::timeout(Duration::from_millis(5), completed.notified()).await;
                    continue;
                }
                let mut ids = Vec::with_capacity(rows.len());
                {
                    let mut watch = watch.lock().expect("the watch is never poisoned");
                    for row in &rows {
                        let payload: String = row.try_get("payload")?;
                        let _: Tick = serde_json::from_str(&payload)?;
                        watch.started(row.try_get("key")?, row.try_get("sequence")?);
                        ids.push(row.try_get::<i64, _>("id")?);
                    }
                }
                sqlx::query(&complete)
                    .bind(&ids)
                    .bind(now)
                    .execute(&mut *transaction)
                    .await?;
                transaction.commit().await?;
                mine += ids.len();
                handled.fetch_add(ids.len(), Ordering::SeqCst);
                completed.notify_waiters();
            }
        }
    })
    .await?;
    assert_eq!(
        count_rows(admin, &format!("{s}.deliveries")).await?,
        0,
        "every delivery completed"
    );
    let (next_p50, next_p99) = watch
        .lock()
        .expect("the watch is never poisoned")
        .percentiles();
    Ok(Keyed {
        drain,
        next_p50,
        next_p99,
    })
}

/// A bus on `store` with the `tick` handler calling `on_tick`.
/// The most deliveries per batch of the projection's batch handler.
const PROJECTION_BATCH: usize = 100;

/// Deliveries per second of a projection that inserts one row per event in its handler's
/// transaction, on one worker: a transactional handler of one delivery at a time, or a
/// transactional batch handler of up to [`PROJECTION_BATCH`] (one `INSERT .. SELECT unnest`
/// per batch).
async fn projection_run(
    settings: &Settings,
    admin: &PgPool,
    schema: &str,
    batch: bool,
) -> Result<f64, BoxError> {
    let count = settings.deliveries;
    let publisher = bus(
        store(admin.clone(), schema).await?,
        "bench-publisher".to_owned(),
        |_, _| {},
    )?;
    let rows = format!("\"{schema}\".projection");
    sqlx::query(&format!(
        "CREATE TABLE {rows} (id text PRIMARY KEY, n bigint NOT NULL)"
    ))
    .execute(admin)
    .await?;
    let mut n = 0_u64;
    while (n as usize) < count {
        let chunk = (count - n as usize).min(500) as u64;
        let envelopes = (n..n + chunk)
            .map(|n| relaybus::EventEnvelope::new(&Tick { n }))
            .collect::<Result<Vec<_>, _>>()?;
        publisher.publish_all(envelopes).await?;
        n += chunk;
    }
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
    let insert =
        format!("INSERT INTO {rows} (id, n) SELECT * FROM unnest($1::text[], $2::bigint[])");
    let subscription = if batch {
        Subscription::batch(
            HANDLER,
            move |batch: relaybus::Batch<Tick>, ctx: HandlerContext<PostgresEventStore>| {
                let (insert, done) = (insert.clone(), done.clone());
                async move {
                    let ids: Vec<String> = batch
                        .iter()
                        .map(|item| item.event_id().to_owned())
                        .collect();
                    let ns: Vec<i64> = batch.events().map(|tick| tick.n as i64).collect();
                    let mut session = ctx.session().await?;
                    sqlx::query(&insert)
                        .bind(&ids)
                        .bind(&ns)
                        .execute(&mut **session)
                        .await?;
                    drop(session);
                    done(batch.len());
                    Ok::<(), BoxError>(())
                }
            },
        )
        .max_batch(PROJECTION_BATCH)
        .transactional()
    } else {
        Subscription::new(
            HANDLER,
            move |tick: Tick, ctx: HandlerContext<PostgresEventStore>| {
                let (insert, done) = (insert.clone(), done.clone());
                async move {
                    let mut session = ctx.session().await?;
                    sqlx::query(&insert)
                        .bind(vec![ctx.event_id().to_owned()])
                        .bind(vec![tick.n as i64])
                        .execute(&mut **session)
                        .await?;
                    drop(session);
                    done(1);
                    Ok::<(), BoxError>(())
                }
            },
        )
        .transactional()
    };
    let store = PostgresEventStore::builder(pool(&settings.url, POOL).await?)
        .schema(schema)
        .build()?;
    let worker = RelayBus::builder(store)
        .owner("bench-projection")
        .batch_size(BATCH)
        .concurrency(BATCH as usize)
        .retention(None)
        .gauge_interval(None)
        .setup_on_start(false)
        .without_registered_handlers()
        .subscribe(subscription)
        .build()?;
    let started = Instant::now();
    worker.start().await?;
    tokio::time::timeout(Duration::from_secs(600), all_done.notified()).await?;
    // A transaction that ran again called its handler again: the count reached `count` before
    // every row committed. Wait for the rows.
    while count_rows(admin, &rows).await? < count as i64 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    worker.shutdown().await?;
    let rate = count as f64 / started.elapsed().as_secs_f64();
    worker.store().pool().close().await;
    let written = count_rows(admin, &rows).await?;
    if written != count as i64 {
        return Err(format!("the projection holds {written} rows for {count} events").into());
    }
    Ok(rate)
}

fn bus(
    store: PostgresEventStore,
    owner: String,
    on_tick: impl Fn(Option<&str>, Option<i64>) + Clone + Send + Sync + 'static,
) -> Result<RelayBus<PostgresEventStore>, BoxError> {
    Ok(RelayBus::builder(store)
        .owner(owner)
        .batch_size(BATCH)
        .concurrency(BATCH as usize)
        .retention(None)
        .gauge_interval(None)
        .setup_on_start(false)
        .without_registered_handlers()
        .subscribe(Subscription::new(
            HANDLER,
            move |_: Tick, context: HandlerContext<PostgresEventStore>| {
                on_tick(context.key(), context.sequence());
                async { Ok::<(), BoxError>(()) }
            },
        ))
        .build()?)
}

/// Publishes one event, under `key` if given, in a transaction the caller began and commits.
async fn publish_one(
    bus: &RelayBus<PostgresEventStore>,
    pool: &PgPool,
    n: u64,
    key: Option<String>,
) -> Result<(), BoxError> {
    let mut session = PostgresSession::from(pool.begin().await?);
    let publish = bus.publish(&Tick { n });
    let publish = match key {
        Some(key) => publish.key(key),
        None => publish,
    };
    publish.session(&mut session).await?;
    session
        .into_transaction()
        .map_err(|_| "the session left its transaction")?
        .commit()
        .await?;
    Ok(())
}

/// The key of the `n`-th event of a run over `keys` keys.
fn key_of(n: u64, keys: usize) -> String {
    format!("k{}", n % keys as u64)
}

/// Per-key order and the time between a key's deliveries starting, as the handlers see them.
#[derive(Default)]
struct KeyWatch {
    /// Each key's last sequence started, and when.
    last: HashMap<String, (i64, Instant)>,
    /// Milliseconds from a key's delivery starting to its next one starting.
    gaps: Vec<f64>,
    /// Deliveries that did not start with their key's next sequence.
    violations: usize,
}

impl KeyWatch {
    fn started(&mut self, key: &str, sequence: i64) {
        let now = Instant::now();
        let previous = self.last.get(key).copied();
        if sequence != previous.map_or(1, |(last, _)| last + 1) {
            self.violations += 1;
        }
        if let Some((_, at)) = previous {
            self.gaps
                .push(now.saturating_duration_since(at).as_secs_f64() * 1000.0);
        }
        self.last.insert(key.to_owned(), (sequence, now));
    }

    /// The gaps' p50 and p99 (ms), after checking per-key order.
    fn percentiles(&mut self) -> (f64, f64) {
        assert_eq!(
            self.violations, 0,
            "every key's deliveries start in sequence order"
        );
        if self.gaps.is_empty() {
            return (f64::NAN, f64::NAN);
        }
        self.gaps.sort_by(|a, b| a.total_cmp(b));
        let at = |q: f64| self.gaps[((self.gaps.len() as f64 - 1.0) * q).round() as usize];
        (at(0.5), at(0.99))
    }
}

/// A keyed drain's figures: deliveries per second, and the milliseconds from a key's delivery
/// starting to the key's next one starting (p50, p99), the handler doing nothing: the
/// predecessor's completion and the next delivery's claim.
#[derive(Clone, Copy, Default)]
struct Keyed {
    drain: f64,
    next_p50: f64,
    next_p99: f64,
}

/// Relaybus: publishing in the caller's transactions, then draining through whole buses.
async fn relaybus_run(
    settings: &Settings,
    admin: &PgPool,
    schema: &str,
) -> Result<Figures, BoxError> {
    let (figures, _) = relaybus_drain(settings, admin, schema, settings.deliveries, None).await?;
    Ok(figures)
}

/// Relaybus on `count` events spread over `keys` keys, published before the drain.
async fn relaybus_keyed(
    settings: &Settings,
    admin: &PgPool,
    schema: &str,
    count: usize,
    keys: usize,
) -> Result<Keyed, BoxError> {
    let (figures, mut watch) = relaybus_drain(settings, admin, schema, count, Some(keys)).await?;
    let (next_p50, next_p99) = watch.percentiles();
    Ok(Keyed {
        drain: figures.drain,
        next_p50,
        next_p99,
    })
}

/// Publishes `count` events (over `keys` keys when given), then drains them through whole
/// buses, watching per-key order.
async fn relaybus_drain(
    settings: &Settings,
    admin: &PgPool,
    schema: &str,
    count: usize,
    keys: Option<usize>,
) -> Result<(Figures, KeyWatch), BoxError> {
    let publisher = Arc::new(bus(
        store(admin.clone(), schema).await?,
        "bench-publisher".to_owned(),
        |_, _| {},
    )?);
    let wal_start = wal(admin).await?;
    let publish = publish_with(count, settings.publishers, {
        let admin = admin.clone();
        move |n| {
            let (publisher, admin) = (Arc::clone(&publisher), admin.clone());
            let key = keys.map(|keys| key_of(n, keys));
            async move { publish_one(&publisher, &admin, n, key).await }
        }
    })
    .await?;

    let handled = Arc::new(AtomicUsize::new(0));
    let all_done = Arc::new(Notify::new());
    let watch = Arc::new(Mutex::new(KeyWatch::default()));
    let mut buses = Vec::new();
    for i in 0..settings.workers {
        let (handled, all_done, watch) = (
            Arc::clone(&handled),
            Arc::clone(&all_done),
            Arc::clone(&watch),
        );
        let store = PostgresEventStore::builder(pool(&settings.url, POOL).await?)
            .schema(schema)
            .build()?;
        buses.push(bus(store, format!("bench-{i}"), move |key, sequence| {
            if let (Some(key), Some(sequence)) = (key, sequence) {
                watch
                    .lock()
                    .expect("the watch is never poisoned")
                    .started(key, sequence);
            }
            if handled.fetch_add(1, Ordering::Relaxed) + 1 == count {
                all_done.notify_one();
            }
        })?);
    }
    let wal_published = wal(admin).await?;
    let started = Instant::now();
    for bus in &buses {
        bus.start().await?;
    }
    tokio::time::timeout(Duration::from_secs(600), all_done.notified()).await?;
    // The last completions are flushed by the shutdown; count them in.
    try_join_all(buses.iter().map(|bus| bus.shutdown())).await?;
    let drain = count as f64 / started.elapsed().as_secs_f64();
    let wal_drained = wal(admin).await?;
    for bus in &buses {
        bus.store().pool().close().await;
    }
    let (claims, completions) = statements(admin, schema).await?;
    assert_eq!(
        handled.load(Ordering::Relaxed),
        count,
        "every delivery handled once"
    );
    assert_eq!(
        count_rows(admin, &format!("\"{schema}\".deliveries")).await?,
        0,
        "every delivery completed"
    );
    let watch = std::mem::take(&mut *watch.lock().expect("the watch is never poisoned"));
    Ok((
        Figures {
            publish,
            drain,
            claims,
            completions,
            wal_publish: (wal_published - wal_start) / count as f64,
            wal_drain: (wal_drained - wal_published) / count as f64,
            ..Figures::default()
        },
        watch,
    ))
}

/// How many claim statements and completion transactions the drain of `schema` made: the
/// scans of its claim index and of its ordering index (which relaybus's completion reads
/// first, and the floor never), as the server reports them once the drainers' connections
/// closed; a claim the planner serves through another index is not counted. Where the time
/// goes: relaybus claims up to a batch for its free handler slots (and, while its handlers are
/// quick, ahead of them), and completes what finished since its last completion.
async fn statements(admin: &PgPool, schema: &str) -> Result<(f64, f64), BoxError> {
    // The closed connections' server processes report as they exit.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let scans = |index: &'static str| {
        sqlx::query(
            "SELECT coalesce(sum(idx_scan), 0)::bigint FROM pg_stat_user_indexes \
             WHERE schemaname = $1 AND indexrelname = $2",
        )
        .bind(schema)
        .bind(index)
        .fetch_one(admin)
    };
    let claims: i64 = scans("deliveries_claim").await?.try_get(0)?;
    let completions: i64 = scans("deliveries_ordering").await?.try_get(0)?;
    Ok((claims as f64, completions as f64))
}

/// Commit-to-handler latency percentiles (ms) on one idle bus woken by `NOTIFY`.
async fn latency_run(settings: &Settings, schema: &str) -> Result<(f64, f64), BoxError> {
    let store = store(pool(&settings.url, POOL).await?, schema).await?;
    let (sender, mut receiver) = mpsc::unbounded_channel::<Instant>();
    let bus = bus(store, "bench-latency".to_owned(), move |_, _| {
        let _ = sender.send(Instant::now());
    })?;
    let publisher = pool(&settings.url, 2).await?;
    bus.start().await?;
    // Let the dispatcher settle into idle.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut latencies = Vec::with_capacity(settings.samples);
    for n in 0..settings.samples as u64 {
        publish_one(&bus, &publisher, n, None).await?;
        let committed = Instant::now();
        let handled = tokio::time::timeout(Duration::from_secs(30), receiver.recv())
            .await?
            .ok_or("the handler's channel closed")?;
        latencies.push(handled.saturating_duration_since(committed).as_secs_f64() * 1000.0);
        // Let the dispatcher go idle again, at a spread of gaps.
        tokio::time::sleep(Duration::from_millis(2 + n % 5)).await;
    }
    bus.shutdown().await?;
    assert_eq!(latencies.len(), settings.samples, "every sample handled");
    latencies.sort_by(|a, b| a.total_cmp(b));
    let at = |q: f64| latencies[((latencies.len() as f64 - 1.0) * q).round() as usize];
    Ok((at(0.5), at(0.99)))
}

/// Builds the peer (release) and returns its binary.
fn build_peer() -> Result<PathBuf, BoxError> {
    let manifest =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../benches/graphile-peer/Cargo.toml");
    // The target directory of this binary (target/release/deps/postgres-*), or the default.
    let target = std::env::current_exe()
        .ok()
        .and_then(|exe| exe.ancestors().nth(3).map(PathBuf::from))
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target"))
        .join("graphile-peer");
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
    println!(
        "building the peer: cargo build --release --manifest-path {}",
        manifest.display()
    );
    let started = Instant::now();
    let status = Command::new(cargo)
        .args(["build", "--release", "--quiet", "--manifest-path"])
        .arg(&manifest)
        .arg("--target-dir")
        .arg(&target)
        .stdout(Stdio::null())
        .status()?;
    if !status.success() {
        return Err(format!("building the peer failed ({status})").into());
    }
    println!("built the peer in {:.1} s", started.elapsed().as_secs_f64());
    Ok(target.join("release/graphile-peer"))
}

/// Runs the peer in the schema `schema` and reads its JSON line.
fn run_peer(peer: &PathBuf, settings: &Settings, schema: &str) -> Result<Value, BoxError> {
    let output = Command::new(peer)
        .arg(format!("url={}", settings.url))
        .arg(format!("schema={schema}"))
        .arg(format!("deliveries={}", settings.deliveries))
        .arg(format!("workers={}", settings.workers))
        .arg(format!("batch={BATCH}"))
        .arg(format!("publishers={}", settings.publishers))
        .arg(format!("samples={}", settings.samples))
        .arg(format!("pool={POOL}"))
        .stderr(Stdio::inherit())
        .output()?;
    if !output.status.success() {
        return Err(format!("the peer failed ({})", output.status).into());
    }
    let stdout = String::from_utf8(output.stdout)?;
    let line = stdout
        .lines()
        .rev()
        .find(|line| line.starts_with('{'))
        .ok_or("the peer printed no JSON line")?;
    Ok(serde_json::from_str(line)?)
}
