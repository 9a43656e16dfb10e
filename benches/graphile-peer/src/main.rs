//! The peer of relaybus's PostgreSQL benchmark: graphile_worker 0.14, measured the way
//! `relaybus/benches/postgres.rs` measures relaybus, and run by it as a separate process (its
//! sqlx 0.9 cannot share a build with the workspace's sqlx 0.8).
//!
//! Run with `cargo bench -p relaybus --bench postgres --features postgres`, which builds this
//! crate with `cargo build --release --manifest-path benches/graphile-peer/Cargo.toml` and runs
//! it. By hand:
//!
//! ```text
//! graphile-peer url=postgres://postgres@127.0.0.1:5432/test schema=gw_bench \
//!     deliveries=4000 workers=2 batch=32 publishers=8 samples=1000 pool=20
//! ```
//!
//! In the schema given (dropped first and at the end) it measures:
//!
//! - publishing: `publishers` tasks, each adding one job per transaction of its own, begun on
//!   the pool and committed by the caller (`WorkerUtils::with_executor`), until `deliveries`
//!   jobs are stored;
//! - draining them: `workers` worker instances, each with `concurrency(batch)` and a pool of
//!   its own of `pool` connections, running a no-op task, from the first `run()` to the last
//!   worker's shutdown; with the local queue (`batch` jobs per fetch) and batched completions,
//!   graphile_worker's throughput settings; then with the defaults (one job per fetch and
//!   wake-up) on `4 * workers * batch` jobs at most, since a backlog drains at about
//!   `workers * batch` jobs per poll interval (1 s) that way;
//! - commit-to-handler latency: one idle worker with `concurrency(batch)` and notifications on,
//!   from just after the adding transaction's commit returned to the task starting, `samples`
//!   times.
//!
//! It prints one JSON line on stdout: `publish_per_sec`, `drain_per_sec`,
//! `drain_local_queue_per_sec`, `latency_p50_ms`, `latency_p99_ms`, `samples`.

use std::{
    collections::HashMap,
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use graphile_worker::{
    IntoTaskHandlerResult, JobSpec, LocalQueueConfig, RawJobSpec, TaskHandler, Worker,
    WorkerContext, WorkerOptions,
};
use serde::{Deserialize, Serialize};
use sqlx::{PgPool, postgres::PgPoolOptions};
use tokio::sync::{Notify, mpsc};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The job: the same payload as relaybus's `bench.tick.v1` event.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Tick {
    n: u64,
}

/// Counts handled jobs and says when the last one ran.
#[derive(Debug, Clone)]
struct Counter {
    handled: Arc<AtomicUsize>,
    target: usize,
    all_done: Arc<Notify>,
}

/// Reports when each job started.
#[derive(Debug, Clone)]
struct Started(mpsc::UnboundedSender<Instant>);

impl TaskHandler for Tick {
    const IDENTIFIER: &'static str = "bench_tick";

    async fn run(self, ctx: WorkerContext) -> impl IntoTaskHandlerResult {
        if let Some(started) = ctx.get_ext::<Started>() {
            let _ = started.0.send(Instant::now());
        }
        if let Some(counter) = ctx.get_ext::<Counter>()
            && counter.handled.fetch_add(1, Ordering::Relaxed) + 1 == counter.target
        {
            counter.all_done.notify_one();
        }
        Ok::<(), String>(())
    }
}

struct Settings {
    url: String,
    schema: String,
    deliveries: usize,
    workers: usize,
    batch: usize,
    publishers: usize,
    samples: usize,
    pool: u32,
}

fn settings() -> Result<Settings, BoxError> {
    let args: HashMap<String, String> = std::env::args()
        .skip(1)
        .filter_map(|arg| {
            arg.split_once('=')
                .map(|(k, v)| (k.to_owned(), v.to_owned()))
        })
        .collect();
    let text = |name: &str, default: &str| {
        args.get(name)
            .cloned()
            .unwrap_or_else(|| default.to_owned())
    };
    let number = |name: &str, default: usize| -> Result<usize, BoxError> {
        match args.get(name) {
            Some(v) => v.parse().map_err(|e| format!("{name}={v}: {e}").into()),
            None => Ok(default),
        }
    };
    Ok(Settings {
        url: text("url", "postgres://postgres@127.0.0.1:5432/test"),
        schema: text("schema", &format!("gw_bench_{}", std::process::id())),
        deliveries: number("deliveries", 4000)?,
        workers: number("workers", 2)?.max(1),
        batch: number("batch", 32)?.max(1),
        publishers: number("publishers", 8)?.max(1),
        samples: number("samples", 1000)?,
        pool: u32::try_from(number("pool", 20)?)?,
    })
}

async fn pool(settings: &Settings, size: u32) -> Result<PgPool, BoxError> {
    Ok(PgPoolOptions::new()
        .max_connections(size)
        .acquire_timeout(Duration::from_secs(60))
        .connect(&settings.url)
        .await?)
}

fn options(settings: &Settings, pool: PgPool) -> WorkerOptions {
    WorkerOptions::default()
        .pg_pool(pool)
        .schema(settings.schema.as_str())
        .concurrency(settings.batch)
        .listen_os_shutdown_signals(false)
        .define_job::<Tick>()
}

async fn drop_schema(pool: &PgPool, schema: &str) -> Result<(), BoxError> {
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "DROP SCHEMA IF EXISTS \"{schema}\" CASCADE"
    )))
    .execute(pool)
    .await?;
    Ok(())
}

async fn jobs_left(pool: &PgPool, schema: &str) -> Result<i64, BoxError> {
    let (left,): (i64,) = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT count(*) FROM \"{schema}\"._private_jobs"
    )))
    .fetch_one(pool)
    .await?;
    Ok(left)
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let settings = settings()?;
    let admin = pool(&settings, settings.publishers as u32 + 2).await?;
    drop_schema(&admin, &settings.schema).await?;
    let outcome = measure(&settings, &admin).await;
    drop_schema(&admin, &settings.schema).await?;
    let figures = outcome?;
    println!("{figures}");
    Ok(())
}

async fn measure(settings: &Settings, admin: &PgPool) -> Result<serde_json::Value, BoxError> {
    // A worker that never runs: it migrates the schema and makes the utilities.
    let utils_worker = options(settings, admin.clone()).init().await?;
    let utils = utils_worker.create_utils();

    // Publishing: one job per caller transaction.
    let next = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..settings.publishers {
        let (next, admin, utils, count) = (
            Arc::clone(&next),
            admin.clone(),
            utils.clone(),
            settings.deliveries,
        );
        tasks.push(tokio::spawn(async move {
            loop {
                let n = next.fetch_add(1, Ordering::Relaxed);
                if n >= count {
                    return Ok::<(), BoxError>(());
                }
                let mut transaction = admin.begin().await?;
                utils
                    .clone()
                    .with_executor(&mut transaction)
                    .add_job(Tick { n: n as u64 }, JobSpec::default())
                    .await?;
                transaction.commit().await?;
            }
        }));
    }
    for task in tasks {
        task.await??;
    }
    let publish_per_sec = settings.deliveries as f64 / started.elapsed().as_secs_f64();
    let drain_local_queue_per_sec = drain(settings, settings.deliveries, true).await?;
    assert_eq!(
        jobs_left(admin, &settings.schema).await?,
        0,
        "every job ran"
    );

    // The defaults' drain, on jobs added in bulk (not timed). Each job slot fetches one job
    // per wake-up (a notification or the 1 s poll), so a backlog drains at about
    // `workers * batch` jobs per second: four polls' worth of jobs measure it.
    let defaults = settings
        .deliveries
        .min(4 * settings.workers * settings.batch);
    let jobs: Vec<RawJobSpec> = (0..defaults)
        .map(|n| RawJobSpec {
            identifier: Tick::IDENTIFIER.to_owned(),
            payload: serde_json::json!({ "n": n }),
            spec: JobSpec::default(),
        })
        .collect();
    for chunk in jobs.chunks(500) {
        utils.add_raw_jobs(chunk).await?;
    }
    let drain_per_sec = drain(settings, defaults, false).await?;
    assert_eq!(
        jobs_left(admin, &settings.schema).await?,
        0,
        "every job ran"
    );

    let latencies = latency(settings).await?;
    drop(utils_worker);
    let at = |q: f64| {
        latencies
            .get(((latencies.len() as f64 - 1.0) * q).round() as usize)
            .copied()
            .unwrap_or(f64::NAN)
    };
    let round = |x: f64| (x * 100.0).round() / 100.0;
    Ok(serde_json::json!({
        "peer": "graphile_worker 0.14",
        "deliveries": settings.deliveries,
        "workers": settings.workers,
        "concurrency_per_worker": settings.batch,
        "publishers": settings.publishers,
        "publish_per_sec": publish_per_sec.round(),
        "drain_per_sec": drain_per_sec.round(),
        "drain_deliveries": defaults,
        "drain_local_queue_per_sec": drain_local_queue_per_sec.round(),
        "latency_p50_ms": round(at(0.5)),
        "latency_p99_ms": round(at(0.99)),
        "samples": latencies.len(),
    }))
}

/// Jobs per second through `workers` worker instances, each on a pool of its own.
async fn drain(settings: &Settings, count: usize, local_queue: bool) -> Result<f64, BoxError> {
    let counter = Counter {
        handled: Arc::new(AtomicUsize::new(0)),
        target: count,
        all_done: Arc::new(Notify::new()),
    };
    let mut workers: Vec<Arc<Worker>> = Vec::new();
    for _ in 0..settings.workers {
        let mut options =
            options(settings, pool(settings, settings.pool).await?).add_extension(counter.clone());
        if local_queue {
            options = options
                .local_queue(LocalQueueConfig::default().with_size(settings.batch))
                .complete_job_batch_delay(Duration::from_millis(1));
        }
        workers.push(Arc::new(options.init().await?));
    }
    let started = Instant::now();
    let running: Vec<_> = workers
        .iter()
        .map(|worker| {
            let worker = Arc::clone(worker);
            tokio::spawn(async move { worker.run().await })
        })
        .collect();
    if count > 0 {
        tokio::time::timeout(Duration::from_secs(600), counter.all_done.notified()).await?;
    }
    for worker in &workers {
        worker.request_shutdown();
    }
    for run in running {
        run.await??;
    }
    Ok(count as f64 / started.elapsed().as_secs_f64())
}

/// Commit-to-handler latencies (ms, sorted) on one idle worker woken by its notifications.
async fn latency(settings: &Settings) -> Result<Vec<f64>, BoxError> {
    let (sender, mut receiver) = mpsc::unbounded_channel();
    let worker = Arc::new(
        options(settings, pool(settings, settings.pool).await?)
            .add_extension(Started(sender))
            .init()
            .await?,
    );
    let publisher = pool(settings, 2).await?;
    let utils = worker.create_utils();
    let running = {
        let worker = Arc::clone(&worker);
        tokio::spawn(async move { worker.run().await })
    };
    // Let the worker settle into idle.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut latencies = Vec::with_capacity(settings.samples);
    for n in 0..settings.samples as u64 {
        let mut transaction = publisher.begin().await?;
        utils
            .clone()
            .with_executor(&mut transaction)
            .add_job(Tick { n }, JobSpec::default())
            .await?;
        transaction.commit().await?;
        let committed = Instant::now();
        let handled = tokio::time::timeout(Duration::from_secs(30), receiver.recv())
            .await?
            .ok_or("the task's channel closed")?;
        latencies.push(handled.saturating_duration_since(committed).as_secs_f64() * 1000.0);
        // Let the worker go idle again, at a spread of gaps.
        tokio::time::sleep(Duration::from_millis(2 + n % 5)).await;
    }
    worker.request_shutdown();
    running.await??;
    latencies.sort_by(|a, b| a.total_cmp(b));
    Ok(latencies)
}
