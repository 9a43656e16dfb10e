//! The fault suite: real worker processes and real servers, broken on purpose under load.
//!
//! Each scenario starts a private replica set, several `relaybus-fault-worker` processes and a
//! load generator that commits business documents with their events (keyed and unkeyed; some
//! events fail a few attempts, a few always fail). While the load runs, faults are injected at
//! random moments:
//!
//! - `kill_worker`: a worker is killed with SIGKILL and restarted under the same owner name;
//! - `kill_worker_new_owner`: the same, restarted under a new owner name;
//! - `kill_worker_after_claim`: a worker is killed while the first write of a handler run is
//!   held on the server (a `failCommand` fail point that blocks its `insert`): it claimed,
//!   the handler started, nothing of the run committed;
//! - `kill_worker_in_completion`: a worker is killed while the `delete` of a completion is
//!   held on the server: the completion read its fences and has not deleted yet (the held
//!   command still runs once the block ends, with its sender gone);
//! - `pause_worker`: a worker is stopped with SIGSTOP for longer than its lease, so that other
//!   workers take its lanes, then resumed with SIGCONT (its late completions must change
//!   nothing);
//! - `kill_server`: the single `mongod` is killed with SIGKILL and restarted on its data;
//! - `kill_primary`: the primary of a three-node set is killed, a new one is elected, the old
//!   one restarts and rejoins;
//! - `step_down`: the primary of a three-node set steps down.
//!
//! The `postgres` scenario runs the same load and checks on the PostgreSQL store, on a private
//! cluster of its own (`initdb` and `postgres` from `scripts/postgres install`, or `PG_BIN`),
//! with the same worker binary (`--store postgres`): its transactional handler writes its
//! effect rows through the handler's `PostgresSession`, in the transaction that completes the
//! delivery. Its faults:
//!
//! - `kill_worker`, `kill_worker_new_owner` and `pause_worker`, as above;
//! - `kill_worker_after_claim`: the suite locks the handlers' effect tables (`LOCK TABLE ..
//!   IN SHARE MODE`) and kills a worker once one of its connections waits for that lock: it
//!   claimed, its handler runs, its first write is held;
//! - `kill_worker_in_completion`: the same with the store's `events` table, which a completion
//!   updates in its transaction (appends wait too while it is locked);
//! - `restart_server_fast` and `restart_server_immediate`: the server is shut down (fast:
//!   transactions aborted and a checkpoint; immediate: it exits at once and the next start
//!   runs crash recovery) and started again on its data.
//!
//! The `batch` and `batch_postgres` scenarios run a transactional batch handler instead
//! (`projector` alone, at most 100 deliveries a batch; workers started with `--batch`): 10,000
//! unkeyed orders are committed with their events before the workers start, and the worker
//! faults above (the kills and the pause) are injected while the workers drain them. Each
//! event must have exactly one effect (none when dead), and no batch more than 100 deliveries.
//!
//! When the load stops, the workers drain the deliveries and stop gracefully, and the checker
//! compares what the database holds with what must hold. The last line printed is one JSON
//! object with the figures; `lost`, `phantom`, `duplicated`, `order_violations`, `stuck` and
//! `batch_violations` must all be 0, otherwise the suite fails.
//!
//! `RELAYBUS_FAULT_PROFILE=long` runs the long profile (minutes of load per scenario);
//! `RELAYBUS_FAULT_SEED` replays a run's random choices (the seed is printed first);
//! `RELAYBUS_FAULT_SCENARIO=single|failover|postgres|batch|batch_postgres` runs one scenario.

use std::{
    collections::{BTreeMap, HashMap, HashSet},
    fs::File,
    process::{Child, Command, ExitCode, Stdio},
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use futures::TryStreamExt;
use mongodb::{
    Client, Collection, Database,
    bson::{Bson, Document, doc},
    options::{DatabaseOptions, ReadConcern, WriteConcern},
};
use rand::{Rng, SeedableRng, rngs::StdRng, seq::SliceRandom};
use relaybus::{
    BoxError, EventEnvelope, MongoEventStore, PostgresEventStore, PostgresSession, RelayBus,
};
use relaybus_harness::ReplicaSet;
use relaybus_tests::fault::{
    self, AUDITOR, FaultOrder, PROJECTOR,
    postgres::{self as pg, Cluster, Shutdown},
};
use sqlx::{PgPool, Row, postgres::PgPoolOptions};

const WORKER: &str = env!("CARGO_BIN_EXE_relaybus-fault-worker");
const LEASE: Duration = Duration::from_millis(2_000);
const POLL: Duration = Duration::from_millis(200);
const KEYS: u32 = 16;
/// The orders the batch scenarios commit before their workers start.
const BATCH_EVENTS: usize = 10_000;
/// The servers' `transactionLifetimeLimitSeconds`. A worker killed inside a transaction
/// leaves it open on the server, holding its writes, until this limit aborts it (60 s by
/// default); other transactions writing the same documents wait until then.
const TRANSACTION_LIFETIME_SECONDS: i32 = 10;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Fault {
    KillWorker,
    KillWorkerNewOwner,
    KillAfterClaim,
    KillInCompletion,
    PauseWorker,
    KillServer,
    KillPrimary,
    StepDown,
    RestartServerFast,
    RestartServerImmediate,
}

impl Fault {
    fn name(self) -> &'static str {
        match self {
            Fault::KillWorker => "kill_worker",
            Fault::KillWorkerNewOwner => "kill_worker_new_owner",
            Fault::KillAfterClaim => "kill_worker_after_claim",
            Fault::KillInCompletion => "kill_worker_in_completion",
            Fault::PauseWorker => "pause_worker",
            Fault::KillServer => "kill_server",
            Fault::KillPrimary => "kill_primary",
            Fault::StepDown => "step_down",
            Fault::RestartServerFast => "restart_server_fast",
            Fault::RestartServerImmediate => "restart_server_immediate",
        }
    }
}

/// The store a scenario runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Backend {
    /// A private MongoDB replica set of `nodes` nodes.
    MongoDb,
    /// A private PostgreSQL cluster.
    Postgres,
}

impl Backend {
    /// The worker's `--store`.
    fn arg(self) -> &'static str {
        match self {
            Backend::MongoDb => "mongodb",
            Backend::Postgres => "postgres",
        }
    }
}

/// The handlers a scenario's processes run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Handlers {
    /// The transactional `projector` and the at-least-once `auditor`, one delivery a run, under
    /// a load that commits orders at the scenario's rate.
    Single,
    /// `projector` as a transactional batch handler, draining [`BATCH_EVENTS`] orders committed
    /// before the workers start; the scenario's `load` bounds how long faults are injected.
    Batch,
}

impl Handlers {
    /// The handlers every event has a delivery for.
    fn ids(self) -> &'static [&'static str] {
        match self {
            Handlers::Single => &[PROJECTOR, AUDITOR],
            Handlers::Batch => &[PROJECTOR],
        }
    }
}

#[derive(Debug, Clone)]
struct Scenario {
    name: &'static str,
    backend: Backend,
    handlers: Handlers,
    nodes: usize,
    workers: usize,
    faults: Vec<Fault>,
    load: Duration,
    /// Events per second the load generator aims at.
    rate: u32,
    drain: Duration,
}

fn scenarios() -> Vec<Scenario> {
    let long = std::env::var("RELAYBUS_FAULT_PROFILE").is_ok_and(|p| p == "long");
    let (single_load, failover_load, postgres_load, rate, drain) = if long {
        (
            Duration::from_secs(600),
            Duration::from_secs(300),
            Duration::from_secs(600),
            30,
            Duration::from_secs(900),
        )
    } else {
        (
            Duration::from_secs(45),
            Duration::from_secs(35),
            Duration::from_secs(32),
            50,
            Duration::from_secs(180),
        )
    };
    // The batch scenarios inject faults until their orders drained, for this long at most.
    let batch_faults = if long {
        Duration::from_secs(300)
    } else {
        Duration::from_secs(30)
    };
    // What breaks a batch between its claim and its commit: the worker.
    let worker_faults = vec![
        Fault::KillWorker,
        Fault::KillWorkerNewOwner,
        Fault::KillAfterClaim,
        Fault::KillInCompletion,
        Fault::PauseWorker,
    ];
    vec![
        Scenario {
            name: "single",
            backend: Backend::MongoDb,
            handlers: Handlers::Single,
            nodes: 1,
            workers: 3,
            faults: vec![
                Fault::KillWorker,
                Fault::KillWorkerNewOwner,
                Fault::KillAfterClaim,
                Fault::KillInCompletion,
                Fault::PauseWorker,
                Fault::KillServer,
            ],
            load: single_load,
            rate,
            drain,
        },
        Scenario {
            name: "failover",
            backend: Backend::MongoDb,
            handlers: Handlers::Single,
            nodes: 3,
            workers: 2,
            faults: vec![
                Fault::KillPrimary,
                Fault::StepDown,
                Fault::KillWorker,
                Fault::KillInCompletion,
                Fault::PauseWorker,
            ],
            load: failover_load,
            rate: rate / 2,
            drain,
        },
        Scenario {
            name: "postgres",
            backend: Backend::Postgres,
            handlers: Handlers::Single,
            nodes: 1,
            workers: 3,
            faults: vec![
                Fault::KillWorker,
                Fault::KillWorkerNewOwner,
                Fault::KillAfterClaim,
                Fault::KillInCompletion,
                Fault::PauseWorker,
                Fault::RestartServerFast,
                Fault::RestartServerImmediate,
            ],
            load: postgres_load,
            rate,
            drain,
        },
        Scenario {
            name: "batch",
            backend: Backend::MongoDb,
            handlers: Handlers::Batch,
            nodes: 1,
            workers: 3,
            faults: worker_faults.clone(),
            load: batch_faults,
            rate,
            drain,
        },
        Scenario {
            name: "batch_postgres",
            backend: Backend::Postgres,
            handlers: Handlers::Batch,
            nodes: 1,
            workers: 3,
            faults: worker_faults,
            load: batch_faults,
            rate,
            drain,
        },
    ]
}

/// What one scenario found.
#[derive(Debug, Default)]
struct Figures {
    events: u64,
    deliveries: u64,
    acknowledged: u64,
    unacknowledged: u64,
    faults: BTreeMap<&'static str, u64>,
    lost: u64,
    phantom: u64,
    duplicated: u64,
    order_violations: u64,
    stuck: u64,
    dead_poison: u64,
    dead_other: u64,
    reruns: u64,
    /// The most deliveries a batch held (batch scenarios).
    largest_batch: u64,
    /// Batches over [`fault::BATCH_MAX`], and a batch scenario whose batches all held one.
    batch_violations: u64,
    drain_seconds: f64,
    backlog: Option<u64>,
    problems: Vec<String>,
}

impl Figures {
    fn add(&mut self, other: &Figures) {
        self.events += other.events;
        self.deliveries += other.deliveries;
        self.acknowledged += other.acknowledged;
        self.unacknowledged += other.unacknowledged;
        for (kind, n) in &other.faults {
            *self.faults.entry(kind).or_default() += n;
        }
        self.lost += other.lost;
        self.phantom += other.phantom;
        self.duplicated += other.duplicated;
        self.order_violations += other.order_violations;
        self.stuck += other.stuck;
        self.dead_poison += other.dead_poison;
        self.dead_other += other.dead_other;
        self.reruns += other.reruns;
        self.largest_batch = self.largest_batch.max(other.largest_batch);
        self.batch_violations += other.batch_violations;
        self.drain_seconds = self.drain_seconds.max(other.drain_seconds);
        self.problems.extend(other.problems.iter().cloned());
    }

    fn failed(&self) -> bool {
        self.lost
            + self.phantom
            + self.duplicated
            + self.order_violations
            + self.stuck
            + self.batch_violations
            > 0
    }

    fn problem(&mut self, message: String) {
        if self.problems.len() < 20 {
            self.problems.push(message);
        }
    }
}

#[tokio::main]
async fn main() -> ExitCode {
    let seed = std::env::var("RELAYBUS_FAULT_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random::<u64>);
    println!("fault suite: seed {seed} (RELAYBUS_FAULT_SEED={seed} replays the random choices)");
    let started = Instant::now();
    let mut total = Figures::default();
    let mut passed = 0;
    let mut failed = 0;
    let only = std::env::var("RELAYBUS_FAULT_SCENARIO").ok();
    for (n, scenario) in scenarios().into_iter().enumerate() {
        if only.as_deref().is_some_and(|only| only != scenario.name) {
            continue;
        }
        let mut rng = StdRng::seed_from_u64(seed.wrapping_add(n as u64));
        let at = Instant::now();
        let outcome = match scenario.backend {
            Backend::MongoDb => run(&scenario, &mut rng).await,
            Backend::Postgres => run_postgres(&scenario, &mut rng).await,
        };
        let figures = match outcome {
            Ok(figures) => figures,
            Err(error) => {
                let mut figures = Figures::default();
                figures.stuck += 1;
                figures.problem(format!("the scenario could not run: {error}"));
                figures
            }
        };
        let verdict = if figures.failed() { "FAILED" } else { "ok" };
        println!(
            "scenario {}: {verdict} in {:.0} s: {} events ({} acknowledged, {} commits failed), \
             {} deliveries, faults {:?}, lost {}, phantom {}, duplicated {}, order violations {}, \
             stuck {}, dead {} poison + {} charged out by crashes, {} extra runs, largest batch {} \
             ({} batch violations), drained in {:.1} s",
            scenario.name,
            at.elapsed().as_secs_f64(),
            figures.events,
            figures.acknowledged,
            figures.unacknowledged,
            figures.deliveries,
            figures.faults,
            figures.lost,
            figures.phantom,
            figures.duplicated,
            figures.order_violations,
            figures.stuck,
            figures.dead_poison,
            figures.dead_other,
            figures.reruns,
            figures.largest_batch,
            figures.batch_violations,
            figures.drain_seconds,
        );
        for problem in &figures.problems {
            println!("  {problem}");
        }
        if figures.failed() {
            failed += 1;
        } else {
            passed += 1;
        }
        total.add(&figures);
    }
    println!(
        "test result: {}. {passed} passed; {failed} failed; 0 ignored; finished in {:.2}s",
        if failed == 0 { "ok" } else { "FAILED" },
        started.elapsed().as_secs_f64()
    );
    let faults: serde_json::Map<String, serde_json::Value> = total
        .faults
        .iter()
        .map(|(kind, n)| ((*kind).to_owned(), (*n).into()))
        .collect();
    let line = serde_json::json!({
        "suite": "faults",
        "seed": seed,
        "events": total.events,
        "deliveries": total.deliveries,
        "acknowledged": total.acknowledged,
        "unacknowledged": total.unacknowledged,
        "faults": faults,
        "dead_poison": total.dead_poison,
        "dead_charged": total.dead_other,
        "extra_runs": total.reruns,
        "largest_batch": total.largest_batch,
        "longest_drain_seconds": (total.drain_seconds * 10.0).round() / 10.0,
        "seconds": started.elapsed().as_secs(),
        "lost": total.lost,
        "phantom": total.phantom,
        "duplicated": total.duplicated,
        "order_violations": total.order_violations,
        "stuck": total.stuck,
        "batch_violations": total.batch_violations,
    });
    println!("{line}");
    if total.failed() {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}

/// One worker process slot.
struct Worker {
    owner: String,
    child: Child,
    paused: bool,
}

struct Workers {
    backend: Backend,
    handlers: Handlers,
    uri: String,
    database: String,
    logs: std::path::PathBuf,
    slots: Vec<Worker>,
    spawned: u32,
}

impl Workers {
    fn spawn(&mut self, owner: &str) -> Result<Child, BoxError> {
        self.spawned += 1;
        let log = File::create(self.logs.join(format!("{owner}-{}.log", self.spawned)))?;
        // The server tells the workers' connections apart by their application name (MongoDB's
        // `appName`; the PostgreSQL worker sets `application_name` to its owner itself).
        let uri = match self.backend {
            Backend::MongoDb => format!("{}&appName={owner}", self.uri),
            Backend::Postgres => self.uri.clone(),
        };
        let mut command = Command::new(WORKER);
        command.args(["--store", self.backend.arg()]);
        if self.handlers == Handlers::Batch {
            command.arg("--batch");
        }
        command
            .args([
                uri.as_str(),
                self.database.as_str(),
                owner,
                &LEASE.as_millis().to_string(),
                &POLL.as_millis().to_string(),
            ])
            .env("RUST_BACKTRACE", "1")
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log);
        Ok(relaybus_harness::spawn_tied(command)?)
    }

    fn start(&mut self, count: usize) -> Result<(), BoxError> {
        for n in 0..count {
            let owner = format!("worker-{n}");
            let child = self.spawn(&owner)?;
            self.slots.push(Worker {
                owner,
                child,
                paused: false,
            });
        }
        Ok(())
    }

    /// Kills worker `n` with SIGKILL and starts it again, under its owner name or a new one.
    fn kill_and_restart(&mut self, n: usize, new_owner: bool) -> Result<(), BoxError> {
        relaybus_harness::kill_tied(&mut self.slots[n].child);
        let owner = if new_owner {
            format!("worker-{n}-{}", self.spawned)
        } else {
            self.slots[n].owner.clone()
        };
        let child = self.spawn(&owner)?;
        self.slots[n] = Worker {
            owner,
            child,
            paused: false,
        };
        Ok(())
    }

    fn signal(&mut self, n: usize, signal: libc::c_int) {
        let pid = self.slots[n].child.id() as libc::pid_t;
        // SAFETY: a plain system call on a child of this process that has not been reaped.
        unsafe {
            libc::kill(pid, signal);
        }
        match signal {
            libc::SIGSTOP => self.slots[n].paused = true,
            libc::SIGCONT => self.slots[n].paused = false,
            _ => {}
        }
    }

    /// Workers that exited on their own (they must not) are restarted; paused ones resumed.
    fn revive(&mut self, figures: &mut Figures) -> Result<(), BoxError> {
        for n in 0..self.slots.len() {
            if self.slots[n].paused {
                self.signal(n, libc::SIGCONT);
            }
            if let Some(status) = self.slots[n].child.try_wait()? {
                relaybus_harness::forget_tied(&self.slots[n].child);
                figures.problem(format!(
                    "worker {} exited on its own ({status}); see its log; restarted",
                    self.slots[n].owner
                ));
                let owner = self.slots[n].owner.clone();
                self.slots[n].child = self.spawn(&owner)?;
            }
        }
        Ok(())
    }

    /// SIGTERM to every worker, then waits for each to exit; a worker that does not stop in
    /// time is killed and reported.
    async fn stop(&mut self, figures: &mut Figures) {
        for n in 0..self.slots.len() {
            self.signal(n, libc::SIGTERM);
        }
        let deadline = Instant::now() + Duration::from_secs(30);
        for worker in &mut self.slots {
            loop {
                match worker.child.try_wait() {
                    Ok(Some(status)) => {
                        relaybus_harness::forget_tied(&worker.child);
                        if !status.success() {
                            figures
                                .problem(format!("worker {} stopped with {status}", worker.owner));
                        }
                        break;
                    }
                    Ok(None) if Instant::now() < deadline => {
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                    _ => {
                        figures.problem(format!(
                            "worker {} did not stop within 30 s of SIGTERM",
                            worker.owner
                        ));
                        relaybus_harness::kill_tied(&mut worker.child);
                        break;
                    }
                }
            }
        }
    }
}

async fn run(scenario: &Scenario, rng: &mut StdRng) -> Result<Figures, BoxError> {
    let rs = relaybus_harness::start_replica_set(scenario.nodes).await;
    for node in 0..scenario.nodes {
        tune(&rs, node).await?;
    }
    let database = format!("faults_{}", scenario.name);
    let client = Client::with_uri_str(rs.uri()).await?;
    let store = MongoEventStore::builder(client.clone())
        .database(&database)
        .build()?;
    store.setup().await?;
    let db = client.database(&database);

    let logs = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join("faults")
        .join(scenario.name);
    std::fs::create_dir_all(&logs)?;
    let mut workers = Workers {
        backend: Backend::MongoDb,
        handlers: scenario.handlers,
        uri: rs.uri().to_owned(),
        database: database.clone(),
        logs,
        slots: Vec::new(),
        spawned: 0,
    };
    let pending: Collection<Document> = db.collection(&store.collection_name("deliveries"));

    // The load generator's bus registers the same handlers, so its events get their
    // deliveries; it never dispatches.
    let subscriptions = match scenario.handlers {
        Handlers::Single => fault::subscriptions(&db, "generator"),
        Handlers::Batch => fault::batch_subscriptions(&db, "generator"),
    };
    let mut builder = RelayBus::builder(store).without_registered_handlers();
    for subscription in subscriptions {
        builder = builder.subscribe(subscription);
    }
    let bus = Arc::new(builder.build()?);
    let orders: Collection<Document> = db.collection(fault::ORDERS);
    let load = match scenario.handlers {
        Handlers::Single => Load::start(scenario, rng, move |order, key| {
            let (bus, orders) = (Arc::clone(&bus), orders.clone());
            async move { publish(&bus, &orders, &order, key.as_deref()).await }
        }),
        Handlers::Batch => {
            let committed = preload(&bus, &orders, Load::orders(scenario, rng)).await?;
            Load::preloaded(scenario, committed)
        }
    };
    workers.start(scenario.workers)?;
    let deadline = load.deadline;

    let mut figures = Figures::default();
    // Faults, one after the other, at random moments, until the load stops.
    tokio::time::sleep(Duration::from_millis(rng.random_range(500..1_500))).await;
    let mut upcoming: Vec<Fault> = Vec::new();
    while Instant::now() + Duration::from_secs(3) < deadline {
        if scenario.handlers == Handlers::Batch
            && count(&pending, doc! { "status": "pending" }).await? == 0
        {
            break;
        }
        // Every kind in turn, in a fresh random order each round, so that a short run
        // injects each of them.
        if upcoming.is_empty() {
            upcoming = scenario.faults.clone();
            upcoming.shuffle(rng);
        }
        let Some(fault) = upcoming.pop() else {
            break;
        };
        let injected = inject(fault, &rs, &mut workers, &client, rng).await?;
        *figures.faults.entry(injected).or_default() += 1;
        workers.revive(&mut figures)?;
        tokio::time::sleep(Duration::from_millis(rng.random_range(300..2_500))).await;
    }
    let acknowledged = load.finish(&mut figures).await?;

    // Drain: every worker up, until no delivery is pending.
    rs.wait_for_primary().await;
    workers.revive(&mut figures)?;
    let check = Client::with_uri_str(rs.uri()).await?;
    let db = check.database_with_options(
        &database,
        DatabaseOptions::builder()
            .read_concern(ReadConcern::majority())
            .write_concern(WriteConcern::majority())
            .build(),
    );
    let store = MongoEventStore::builder(check.clone())
        .database(&database)
        .build()?;
    let deliveries: Collection<Document> = db.collection(&store.collection_name("deliveries"));
    let drain_started = Instant::now();
    let drained_by = drain_started + scenario.drain;
    let mut shown = Instant::now();
    let mut progress = (u64::MAX, Instant::now(), false);
    loop {
        let pending = count(&deliveries, doc! { "status": "pending" }).await?;
        if pending != progress.0 {
            progress = (pending, Instant::now(), false);
        } else if !progress.2 && progress.1.elapsed() > Duration::from_secs(10) {
            // No progress for 10 s: show where the work waits.
            progress.2 = true;
            println!(
                "  {}: no progress for 10 s; pending deliveries and lanes:",
                scenario.name
            );
            diagnose(&db, &store).await?;
        }
        if shown.elapsed() > Duration::from_secs(5) || figures.backlog.is_none() {
            println!(
                "  {}: {pending} deliveries pending {:.0} s after the load stopped",
                scenario.name,
                drain_started.elapsed().as_secs_f64()
            );
            shown = Instant::now();
        }
        figures.backlog.get_or_insert(pending);
        if pending == 0 {
            break;
        }
        if Instant::now() > drained_by {
            figures.problem(format!(
                "{pending} deliveries still pending {} s after the load stopped",
                scenario.drain.as_secs()
            ));
            break;
        }
        workers.revive(&mut figures)?;
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    figures.drain_seconds = drain_started.elapsed().as_secs_f64();
    workers.stop(&mut figures).await;

    check_database(&db, &store, scenario.handlers, &acknowledged, &mut figures).await?;
    drop(rs);
    Ok(figures)
}

/// The load generator: 4 tasks committing orders with their events at the scenario's rate
/// until its load time is over, counting the commits that were acknowledged.
struct Load {
    deadline: Instant,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    acknowledged: Arc<Mutex<HashSet<String>>>,
    unacknowledged: Arc<AtomicU64>,
}

impl Load {
    /// Starts the tasks; `publish` commits one order (and its event, under the key if any).
    fn start<P, F>(scenario: &Scenario, rng: &mut StdRng, publish: P) -> Load
    where
        P: Fn(FaultOrder, Option<String>) -> F + Clone + Send + 'static,
        F: Future<Output = relaybus::Result<()>> + Send,
    {
        let acknowledged = Arc::new(Mutex::new(HashSet::<String>::new()));
        let unacknowledged = Arc::new(AtomicU64::new(0));
        let deadline = Instant::now() + scenario.load;
        let generators: u32 = 4;
        let mut tasks = Vec::new();
        let next = Arc::new(AtomicU64::new(0));
        for g in 0..generators {
            let publish = publish.clone();
            let acknowledged = Arc::clone(&acknowledged);
            let unacknowledged = Arc::clone(&unacknowledged);
            let next = Arc::clone(&next);
            let name = scenario.name;
            let period = Duration::from_secs_f64(f64::from(generators) / f64::from(scenario.rate));
            let mut rng = StdRng::seed_from_u64(rng.random::<u64>() ^ u64::from(g));
            tasks.push(tokio::spawn(async move {
                let mut ticks = tokio::time::interval(period);
                ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                while Instant::now() < deadline {
                    ticks.tick().await;
                    let i = next.fetch_add(1, Ordering::SeqCst);
                    let id = format!("{name}-{i}");
                    let key = rng
                        .random_bool(0.7)
                        .then(|| format!("k{}", rng.random_range(0..KEYS)));
                    let order = order(id.clone(), &mut rng);
                    match publish(order, key).await {
                        Ok(()) => {
                            acknowledged
                                .lock()
                                .unwrap_or_else(|p| p.into_inner())
                                .insert(id);
                        }
                        Err(_) => {
                            unacknowledged.fetch_add(1, Ordering::SeqCst);
                        }
                    }
                }
            }));
        }
        Load {
            deadline,
            tasks,
            acknowledged,
            unacknowledged,
        }
    }

    /// The orders of a batch scenario: [`BATCH_EVENTS`] of them, unkeyed, failing and poison as
    /// often as the load generator's.
    fn orders(scenario: &Scenario, rng: &mut StdRng) -> Vec<FaultOrder> {
        (0..BATCH_EVENTS)
            .map(|i| order(format!("{}-{i}", scenario.name), rng))
            .collect()
    }

    /// A load already committed (`committed`, the orders' ids): nothing more is published, and
    /// faults may go on for the scenario's load time.
    fn preloaded(scenario: &Scenario, committed: HashSet<String>) -> Load {
        Load {
            deadline: Instant::now() + scenario.load,
            tasks: Vec::new(),
            acknowledged: Arc::new(Mutex::new(committed)),
            unacknowledged: Arc::new(AtomicU64::new(0)),
        }
    }

    /// Waits for the load to end; returns the acknowledged orders.
    async fn finish(self, figures: &mut Figures) -> Result<Arc<Mutex<HashSet<String>>>, BoxError> {
        for task in self.tasks {
            task.await?;
        }
        figures.acknowledged = self
            .acknowledged
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .len() as u64;
        figures.unacknowledged = self.unacknowledged.load(Ordering::SeqCst);
        Ok(self.acknowledged)
    }
}

/// An order with id `id`: one in 20 fails its first one or two attempts, one in 200 is poison.
fn order(id: String, rng: &mut StdRng) -> FaultOrder {
    FaultOrder {
        order: id,
        fail: if rng.random_bool(0.05) {
            rng.random_range(1..=2)
        } else {
            0
        },
        poison: rng.random_bool(0.005),
    }
}

/// The events of `batch` (unkeyed), each with its id.
fn envelopes(batch: &[FaultOrder]) -> Result<Vec<EventEnvelope>, BoxError> {
    batch
        .iter()
        .map(|order| Ok(EventEnvelope::new(order)?.with_id(&order.order)?))
        .collect()
}

/// Commits `batch` with their events (unkeyed), 500 orders a transaction; returns their ids.
async fn preload(
    bus: &Arc<RelayBus>,
    orders: &Collection<Document>,
    batch: Vec<FaultOrder>,
) -> Result<HashSet<String>, BoxError> {
    for chunk in batch.chunks(500) {
        let events = envelopes(chunk)?;
        let business: Vec<Document> = chunk
            .iter()
            .map(|order| doc! { "_id": &order.order, "poison": order.poison })
            .collect();
        let body = {
            let (bus, orders) = (Arc::clone(bus), orders.clone());
            async move |session: &mut mongodb::ClientSession| {
                orders
                    .insert_many(business.clone())
                    .session(&mut *session)
                    .await?;
                bus.publish_all(events.clone()).session(session).await?;
                Ok(())
            }
        };
        bus.transaction(body).await?;
    }
    Ok(batch.into_iter().map(|order| order.order).collect())
}

async fn publish(
    bus: &Arc<RelayBus>,
    orders: &Collection<Document>,
    order: &FaultOrder,
    key: Option<&str>,
) -> relaybus::Result<()> {
    let body = {
        let (bus, orders, order) = (Arc::clone(bus), orders.clone(), order.clone());
        let key = key.map(str::to_owned);
        async move |session: &mut mongodb::ClientSession| {
            let mut business = doc! { "_id": &order.order, "poison": order.poison };
            if let Some(key) = &key {
                business.insert("key", key);
            }
            orders.insert_one(business).session(&mut *session).await?;
            let publish = bus.publish(&order).id(order.order.clone());
            let publish = match &key {
                Some(key) => publish.key(key.clone()),
                None => publish,
            };
            publish.session(session).await?;
            Ok(())
        }
    };
    bus.transaction(body).await
}

/// Injects `fault` and returns the name of what was injected: a held kill whose command was
/// never held counts as a plain kill, a refused step-down as `step_down_refused`.
async fn inject(
    fault: Fault,
    rs: &ReplicaSet,
    workers: &mut Workers,
    client: &Client,
    rng: &mut StdRng,
) -> Result<&'static str, BoxError> {
    match fault {
        Fault::KillAfterClaim | Fault::KillInCompletion => {
            let n = rng.random_range(0..workers.slots.len());
            let command = if fault == Fault::KillAfterClaim {
                "insert"
            } else {
                "delete"
            };
            let admin = client.database("admin");
            let reply = admin
                .run_command(doc! {
                    "configureFailPoint": "failCommand",
                    "mode": { "times": 1 },
                    "data": {
                        "failCommands": [command],
                        "appName": &workers.slots[n].owner,
                        "blockConnection": true,
                        "blockTimeMS": 3_000,
                    },
                })
                .await?;
            let before = match reply.get("count") {
                Some(Bson::Int32(n)) => i64::from(*n),
                Some(Bson::Int64(n)) => *n,
                _ => 0,
            };
            // Held now: kill it there. A worker with nothing to do for 10 s is killed anyway,
            // and counted as a plain kill.
            let held = admin
                .run_command(doc! {
                    "waitForFailPoint": "failCommand",
                    "timesEntered": before + 1,
                    "maxTimeMS": 10_000,
                })
                .await
                .is_ok();
            workers.kill_and_restart(n, false)?;
            admin
                .run_command(doc! { "configureFailPoint": "failCommand", "mode": "off" })
                .await?;
            if !held {
                return Ok(Fault::KillWorker.name());
            }
        }
        Fault::KillWorker | Fault::KillWorkerNewOwner => {
            let n = rng.random_range(0..workers.slots.len());
            workers.kill_and_restart(n, fault == Fault::KillWorkerNewOwner)?;
        }
        Fault::PauseWorker => {
            let n = rng.random_range(0..workers.slots.len());
            workers.signal(n, libc::SIGSTOP);
            let past_lease = Duration::from_millis(rng.random_range(300..2_000));
            tokio::time::sleep(LEASE + past_lease).await;
            workers.signal(n, libc::SIGCONT);
        }
        Fault::KillServer => {
            rs.kill(0);
            tokio::time::sleep(Duration::from_millis(rng.random_range(100..1_500))).await;
            rs.restart(0).await;
            tune(rs, 0).await?;
            rs.wait_for_primary().await;
        }
        Fault::KillPrimary => {
            let primary = rs.wait_for_primary().await;
            rs.kill(primary);
            rs.wait_for_primary().await;
            tokio::time::sleep(Duration::from_millis(rng.random_range(100..1_500))).await;
            rs.restart(primary).await;
            tune(rs, primary).await?;
            wait_for_secondary(rs, primary).await?;
        }
        Fault::RestartServerFast | Fault::RestartServerImmediate => {
            return Err(format!("{} is a PostgreSQL fault", fault.name()).into());
        }
        Fault::StepDown => match rs.try_step_down().await {
            Ok(old) => {
                rs.wait_for_primary().await;
                wait_for_secondary(rs, old).await?;
            }
            // No secondary caught up in time: the primary stays; no fault was injected.
            Err(_) => return Ok("step_down_refused"),
        },
    }
    Ok(fault.name())
}

/// Sets the server parameters of the suite on node `node` (they do not survive a restart).
async fn tune(rs: &ReplicaSet, node: usize) -> Result<(), BoxError> {
    let client = Client::with_uri_str(rs.node_uri(node)).await?;
    client
        .database("admin")
        .run_command(doc! {
            "setParameter": 1,
            "transactionLifetimeLimitSeconds": TRANSACTION_LIFETIME_SECONDS,
        })
        .await?;
    Ok(())
}

/// Waits until node `node` is a secondary again, so that the set keeps a majority for the
/// next fault.
async fn wait_for_secondary(rs: &ReplicaSet, node: usize) -> Result<(), BoxError> {
    let client = Client::with_uri_str(rs.node_uri(node)).await?;
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let hello = client
            .database("admin")
            .run_command(doc! { "hello": 1 })
            .await;
        if let Ok(hello) = hello
            && (hello.get_bool("secondary") == Ok(true)
                || hello.get_bool("isWritablePrimary") == Ok(true))
        {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(format!("node {node} did not rejoin the set within 60 s").into());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn diagnose(db: &Database, store: &MongoEventStore) -> Result<(), BoxError> {
    let deliveries: Collection<Document> = db.collection(&store.collection_name("deliveries"));
    let now = mongodb::bson::DateTime::now();
    let groups: Vec<Document> = deliveries
        .aggregate([
            doc! { "$match": { "status": "pending" } },
            doc! { "$group": {
                "_id": { "lane": "$lane", "handler": "$handler", "due": { "$lte": ["$dueAt", now] } },
                "n": { "$sum": 1 },
                "lanes": { "$addToSet": "$laneId" },
            } },
        ])
        .await?
        .try_collect()
        .await?;
    for group in groups {
        println!("    deliveries {group}");
    }
    let lanes: Collection<Document> = db.collection(&store.collection_name("lanes"));
    let held: Vec<Document> = lanes
        .find(doc! { "owner": { "$ne": null } })
        .projection(doc! { "owner": 1, "leaseExpiresAt": 1, "epoch": 1, "inFlight": { "$size": { "$ifNull": ["$inFlight", []] } }, "lost": { "$size": { "$ifNull": ["$lost", []] } } })
        .await?
        .try_collect()
        .await?;
    println!("    now {now}; {} lanes held", held.len());
    for lane in held.iter().take(20) {
        println!("    lane {lane}");
    }
    Ok(())
}

async fn count(collection: &Collection<Document>, filter: Document) -> Result<u64, BoxError> {
    Ok(collection.count_documents(filter).await?)
}

async fn all(
    db: &Database,
    collection: &str,
    projection: Document,
) -> Result<Vec<Document>, BoxError> {
    let collection: Collection<Document> = db.collection(collection);
    Ok(collection
        .find(doc! {})
        .projection(projection)
        .await?
        .try_collect()
        .await?)
}

/// What the checker reads from the database, whichever the store.
#[derive(Debug, Default)]
struct Snapshot {
    /// Business documents (rows): id, and whether the order is poison.
    orders: HashMap<String, bool>,
    /// Events: id, and the handlers it was delivered to.
    events: HashMap<String, Vec<String>>,
    /// Deliveries left (completed ones are gone): event id, handler, status, last error.
    deliveries: Vec<(String, String, Option<String>, String)>,
    /// The event of each committed effect of the transactional handler.
    effects: Vec<String>,
    /// The size of the batch of each committed effect of the batch handler.
    batch_sizes: Vec<u64>,
    /// The event of each run of the at-least-once handler.
    runs: Vec<String>,
    /// Per `<handler>|<key>`, the sequences of the runs in the order they happened.
    logs: Vec<(String, Vec<i64>)>,
}

/// Compares what the MongoDB database holds with what must hold.
async fn check_database(
    db: &Database,
    store: &MongoEventStore,
    handlers: Handlers,
    acknowledged: &Mutex<HashSet<String>>,
    figures: &mut Figures,
) -> Result<(), BoxError> {
    let orders = all(db, fault::ORDERS, doc! {})
        .await?
        .into_iter()
        .filter_map(|d| {
            let poison = d.get_bool("poison") == Ok(true);
            Some((d.get_str("_id").ok()?.to_owned(), poison))
        })
        .collect();
    let events = all(
        db,
        &store.collection_name("events"),
        doc! { "key": 1, "sequence": 1, "handlers": 1 },
    )
    .await?
    .into_iter()
    .filter_map(|d| {
        let handlers = d
            .get_array("handlers")
            .map(|a| {
                a.iter()
                    .filter_map(Bson::as_str)
                    .map(str::to_owned)
                    .collect()
            })
            .unwrap_or_default();
        Some((d.get_str("_id").ok()?.to_owned(), handlers))
    })
    .collect();
    let deliveries = all(
        db,
        &store.collection_name("deliveries"),
        doc! { "eventId": 1, "handler": 1, "status": 1, "lastError": 1 },
    )
    .await?
    .into_iter()
    .map(|d| {
        (
            d.get_str("eventId").unwrap_or_default().to_owned(),
            d.get_str("handler").unwrap_or_default().to_owned(),
            d.get_str("status").ok().map(str::to_owned),
            d.get_str("lastError").unwrap_or_default().to_owned(),
        )
    })
    .collect();
    let event_of = |d: &Document| d.get_str("event").unwrap_or_default().to_owned();
    let effect_documents = all(db, fault::EFFECTS, doc! { "event": 1, "batch": 1 }).await?;
    let effects = effect_documents.iter().map(event_of).collect();
    let batch_sizes = effect_documents
        .iter()
        .filter_map(|d| d.get_i64("batch").ok())
        .map(|size| u64::try_from(size).unwrap_or(0))
        .collect();
    let runs = all(db, fault::RUNS, doc! { "event": 1 })
        .await?
        .iter()
        .map(event_of)
        .collect();
    let logs = all(db, fault::ORDER_LOG, doc! {})
        .await?
        .into_iter()
        .map(|log| {
            let seqs = log
                .get_array("seqs")
                .map(|a| a.iter().filter_map(Bson::as_i64).collect())
                .unwrap_or_default();
            (log.get_str("_id").unwrap_or_default().to_owned(), seqs)
        })
        .collect();
    let snapshot = Snapshot {
        orders,
        events,
        deliveries,
        effects,
        batch_sizes,
        runs,
        logs,
    };
    check(&snapshot, handlers, acknowledged, figures);
    Ok(())
}

/// Compares what the database holds with what must hold.
fn check(
    snapshot: &Snapshot,
    handlers: Handlers,
    acknowledged: &Mutex<HashSet<String>>,
    figures: &mut Figures,
) {
    let Snapshot {
        orders,
        events,
        deliveries,
        effects,
        batch_sizes,
        runs,
        logs,
    } = snapshot;

    figures.events = events.len() as u64;
    // Committed business documents and their events.
    for id in acknowledged
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .iter()
    {
        if !orders.contains_key(id) {
            figures.lost += 1;
            figures.problem(format!(
                "order {id} was acknowledged but is not in the database"
            ));
        }
    }
    for id in orders.keys() {
        if !events.contains_key(id) {
            figures.lost += 1;
            figures.problem(format!("order {id} committed without its event"));
        }
    }
    for id in events.keys() {
        if !orders.contains_key(id) {
            figures.phantom += 1;
            figures.problem(format!("event {id} exists without its order"));
        }
    }

    // Deliveries: none pending, the dead ones with their error.
    let mut dead: HashSet<(String, String)> = HashSet::new();
    for (event, handler, status, error) in deliveries {
        match status.as_deref() {
            Some("dead") => {
                if error.is_empty() {
                    figures.stuck += 1;
                    figures.problem(format!("dead delivery {event}/{handler} has no error"));
                }
                let poison = orders.get(event).copied().unwrap_or(false);
                if poison {
                    figures.dead_poison += 1;
                } else {
                    figures.dead_other += 1;
                }
                dead.insert((event.clone(), handler.clone()));
            }
            status => {
                figures.stuck += 1;
                figures.problem(format!(
                    "delivery {event}/{handler} left with status {status:?}"
                ));
            }
        }
    }

    // Handler effects: exactly one committed effect of the transactional handler per event
    // (none when dead), at least one run of the other (when the scenario runs it).
    let audited = handlers.ids().contains(&AUDITOR);
    let mut effect_count: HashMap<&str, u64> = HashMap::new();
    for event in effects {
        *effect_count.entry(event.as_str()).or_default() += 1;
    }
    let mut run_count: HashMap<&str, u64> = HashMap::new();
    for event in runs {
        *run_count.entry(event.as_str()).or_default() += 1;
    }
    for (id, delivered_to) in events {
        for handler in handlers.ids() {
            figures.deliveries += 1;
            if !delivered_to.iter().any(|h| h == handler) {
                figures.lost += 1;
                figures.problem(format!("event {id} has no delivery for {handler}"));
            }
        }
        let poison = orders.get(id).copied().unwrap_or(false);
        let projector_dead = dead.contains(&(id.clone(), PROJECTOR.to_owned()));
        let effects = effect_count.get(id.as_str()).copied().unwrap_or(0);
        let expected = u64::from(!projector_dead);
        if effects > expected {
            figures.duplicated += effects - expected;
            figures.problem(format!(
                "event {id}: {effects} effects of {PROJECTOR} (dead: {projector_dead})"
            ));
        } else if effects < expected {
            figures.lost += 1;
            figures.problem(format!(
                "event {id}: no effect of {PROJECTOR} and no dead delivery"
            ));
        }
        if poison && !projector_dead {
            figures.lost += 1;
            figures.problem(format!(
                "poison event {id} did not end dead for {PROJECTOR}"
            ));
        }
        if !audited {
            continue;
        }
        let auditor_dead = dead.contains(&(id.clone(), AUDITOR.to_owned()));
        let runs = run_count.get(id.as_str()).copied().unwrap_or(0);
        if runs == 0 && !auditor_dead {
            figures.lost += 1;
            figures.problem(format!("event {id}: {AUDITOR} never ran and is not dead"));
        }
        if poison && !auditor_dead {
            figures.lost += 1;
            figures.problem(format!("poison event {id} did not end dead for {AUDITOR}"));
        }
        figures.reruns += runs.saturating_sub(1);
    }

    // Batches: none over the most, and the deliveries did run in batches.
    if handlers == Handlers::Batch {
        figures.largest_batch = batch_sizes.iter().copied().max().unwrap_or(0);
        let over = batch_sizes
            .iter()
            .filter(|size| **size > fault::BATCH_MAX as u64)
            .count() as u64;
        if over > 0 {
            figures.batch_violations += over;
            figures.problem(format!(
                "{over} effects written by batches over {}",
                fault::BATCH_MAX
            ));
        }
        if figures.largest_batch < 2 {
            figures.batch_violations += 1;
            figures.problem(format!(
                "no batch held more than {} delivery",
                figures.largest_batch
            ));
        }
    }

    // Per key and handler, the first runs came in sequence order.
    for (id, seqs) in logs {
        let mut seen = HashSet::new();
        let mut last = i64::MIN;
        for &seq in seqs {
            if !seen.insert(seq) {
                continue;
            }
            if seq < last {
                figures.order_violations += 1;
                figures.problem(format!("{id}: sequence {seq} first ran after {last}"));
            }
            last = last.max(seq);
        }
    }
}

/// The `postgres` scenario: as [`run`], on the PostgreSQL store in a private cluster.
async fn run_postgres(scenario: &Scenario, rng: &mut StdRng) -> Result<Figures, BoxError> {
    let logs = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join("faults")
        .join(scenario.name);
    std::fs::create_dir_all(&logs)?;
    let mut cluster = Cluster::start(&logs.join("cluster"))
        .await
        .map_err(|e| format!("the private PostgreSQL cluster did not start: {e}"))?;
    let schema = format!("faults_{}", scenario.name);
    // The suite's own connections: the load generator's bus, the checker, the locks of the
    // held kills.
    let pool = PgPoolOptions::new()
        .max_connections(12)
        .acquire_timeout(Duration::from_secs(30))
        .connect(&cluster.url())
        .await?;
    let store = PostgresEventStore::builder(pool.clone())
        .schema(&schema)
        .build()?;
    store.setup().await?;
    pg::create_tables(&pool, &schema).await?;

    let mut workers = Workers {
        backend: Backend::Postgres,
        handlers: scenario.handlers,
        uri: cluster.url(),
        database: schema.clone(),
        logs,
        slots: Vec::new(),
        spawned: 0,
    };
    let pending_sql = format!(
        "SELECT count(*) FROM {} WHERE status = 'pending'",
        pg::table(&schema, "deliveries")
    );

    // The load generator's bus registers the same handlers, so its events get their
    // deliveries; it never dispatches.
    let subscriptions = match scenario.handlers {
        Handlers::Single => pg::subscriptions(&pool, &schema, "generator"),
        Handlers::Batch => pg::batch_subscriptions(&schema),
    };
    let mut builder = RelayBus::builder(store).without_registered_handlers();
    for subscription in subscriptions {
        builder = builder.subscribe(subscription);
    }
    let bus = Arc::new(builder.build()?);
    let load = match scenario.handlers {
        Handlers::Single => {
            let insert = Arc::new(format!(
                "INSERT INTO {} (id, key, poison) VALUES ($1, $2, $3)",
                pg::table(&schema, fault::ORDERS)
            ));
            Load::start(scenario, rng, move |order, key| {
                let (bus, insert) = (Arc::clone(&bus), Arc::clone(&insert));
                async move { publish_postgres(&bus, &insert, &order, key.as_deref()).await }
            })
        }
        Handlers::Batch => {
            let orders = Load::orders(scenario, rng);
            let committed = preload_postgres(&bus, &schema, orders).await?;
            Load::preloaded(scenario, committed)
        }
    };
    workers.start(scenario.workers)?;
    let deadline = load.deadline;

    let mut figures = Figures::default();
    // Faults, one after the other, at random moments, until the load stops.
    tokio::time::sleep(Duration::from_millis(rng.random_range(500..1_500))).await;
    let mut upcoming: Vec<Fault> = Vec::new();
    while Instant::now() + Duration::from_secs(3) < deadline {
        if scenario.handlers == Handlers::Batch {
            let pending: i64 = sqlx::query_scalar(&pending_sql).fetch_one(&pool).await?;
            if pending == 0 {
                break;
            }
        }
        if upcoming.is_empty() {
            upcoming = scenario.faults.clone();
            upcoming.shuffle(rng);
        }
        let Some(fault) = upcoming.pop() else {
            break;
        };
        let injected =
            inject_postgres(fault, &mut cluster, &mut workers, &pool, &schema, rng).await?;
        *figures.faults.entry(injected).or_default() += 1;
        workers.revive(&mut figures)?;
        tokio::time::sleep(Duration::from_millis(rng.random_range(300..2_500))).await;
    }
    let acknowledged = load.finish(&mut figures).await?;

    // Drain: every worker up, until no delivery is pending.
    workers.revive(&mut figures)?;
    let drain_started = Instant::now();
    let drained_by = drain_started + scenario.drain;
    let mut shown = Instant::now();
    let mut progress = (u64::MAX, Instant::now(), false);
    loop {
        let pending: i64 = sqlx::query_scalar(&pending_sql).fetch_one(&pool).await?;
        let pending = u64::try_from(pending).unwrap_or(0);
        if pending != progress.0 {
            progress = (pending, Instant::now(), false);
        } else if !progress.2 && progress.1.elapsed() > Duration::from_secs(10) {
            // No progress for 10 s: show where the work waits.
            progress.2 = true;
            println!(
                "  {}: no progress for 10 s; pending deliveries and sessions:",
                scenario.name
            );
            diagnose_postgres(&pool, &schema).await?;
        }
        if shown.elapsed() > Duration::from_secs(5) || figures.backlog.is_none() {
            println!(
                "  {}: {pending} deliveries pending {:.0} s after the load stopped",
                scenario.name,
                drain_started.elapsed().as_secs_f64()
            );
            shown = Instant::now();
        }
        figures.backlog.get_or_insert(pending);
        if pending == 0 {
            break;
        }
        if Instant::now() > drained_by {
            figures.problem(format!(
                "{pending} deliveries still pending {} s after the load stopped",
                scenario.drain.as_secs()
            ));
            break;
        }
        workers.revive(&mut figures)?;
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    figures.drain_seconds = drain_started.elapsed().as_secs_f64();
    workers.stop(&mut figures).await;

    check_postgres(
        &pool,
        &schema,
        scenario.handlers,
        &acknowledged,
        &mut figures,
    )
    .await?;
    pool.close().await;
    cluster.stop(Shutdown::Fast).await;
    Ok(figures)
}

async fn publish_postgres(
    bus: &Arc<RelayBus<PostgresEventStore>>,
    insert: &Arc<String>,
    order: &FaultOrder,
    key: Option<&str>,
) -> relaybus::Result<()> {
    // Owned captures: the body runs again after a transient error, and must be `Send`.
    let body = {
        let (bus, insert, order) = (Arc::clone(bus), Arc::clone(insert), order.clone());
        let key = key.map(str::to_owned);
        async move |session: &mut PostgresSession| {
            sqlx::query(insert.as_str())
                .bind(&order.order)
                .bind(&key)
                .bind(order.poison)
                .execute(&mut **session)
                .await?;
            let publish = bus.publish(&order).id(order.order.clone());
            let publish = match &key {
                Some(key) => publish.key(key.clone()),
                None => publish,
            };
            publish.session(session).await?;
            Ok(())
        }
    };
    bus.transaction(body).await
}

/// Commits `batch` with their events (unkeyed), 500 orders a transaction; returns their ids.
async fn preload_postgres(
    bus: &Arc<RelayBus<PostgresEventStore>>,
    schema: &str,
    batch: Vec<FaultOrder>,
) -> Result<HashSet<String>, BoxError> {
    let insert = Arc::new(format!(
        "INSERT INTO {} (id, poison) SELECT * FROM unnest($1::text[], $2::boolean[])",
        pg::table(schema, fault::ORDERS)
    ));
    for chunk in batch.chunks(500) {
        let events = envelopes(chunk)?;
        let ids: Vec<String> = chunk.iter().map(|order| order.order.clone()).collect();
        let poison: Vec<bool> = chunk.iter().map(|order| order.poison).collect();
        let body = {
            let (bus, insert) = (Arc::clone(bus), Arc::clone(&insert));
            async move |session: &mut PostgresSession| {
                sqlx::query(insert.as_str())
                    .bind(&ids)
                    .bind(&poison)
                    .execute(&mut **session)
                    .await?;
                bus.publish_all(events.clone()).session(session).await?;
                Ok(())
            }
        };
        bus.transaction(body).await?;
    }
    Ok(batch.into_iter().map(|order| order.order).collect())
}

/// Injects `fault` on the PostgreSQL scenario and returns the name of what was injected: a
/// held kill whose worker never waited for the lock counts as a plain kill.
async fn inject_postgres(
    fault: Fault,
    cluster: &mut Cluster,
    workers: &mut Workers,
    pool: &PgPool,
    schema: &str,
    rng: &mut StdRng,
) -> Result<&'static str, BoxError> {
    match fault {
        Fault::KillAfterClaim | Fault::KillInCompletion => {
            let n = rng.random_range(0..workers.slots.len());
            let tables: Vec<String> = if fault == Fault::KillAfterClaim {
                vec![
                    pg::table(schema, fault::EFFECTS),
                    pg::table(schema, fault::RUNS),
                ]
            } else {
                vec![pg::table(schema, "events")]
            };
            // SHARE mode lets readers through and holds every insert, update and delete.
            let mut lock = pool.begin().await?;
            sqlx::query("SET LOCAL lock_timeout = '5s'")
                .execute(&mut *lock)
                .await?;
            let locked = sqlx::query(&format!("LOCK TABLE {} IN SHARE MODE", tables.join(", ")))
                .execute(&mut *lock)
                .await
                .is_ok();
            // Held now: kill it there. A worker with nothing to do for 5 s is killed anyway,
            // and counted as a plain kill.
            let mut held = false;
            let deadline = Instant::now() + Duration::from_secs(5);
            while locked && Instant::now() < deadline {
                let waiting: i64 = sqlx::query_scalar(
                    "SELECT count(*) FROM pg_locks AS l JOIN pg_stat_activity AS a ON a.pid = l.pid \
                     WHERE NOT l.granted AND l.locktype = 'relation' AND a.application_name = $1 \
                       AND l.relation IN (SELECT to_regclass(t) FROM unnest($2::text[]) AS t)",
                )
                .bind(&workers.slots[n].owner)
                .bind(&tables)
                .fetch_one(pool)
                .await?;
                if waiting > 0 {
                    held = true;
                    break;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            workers.kill_and_restart(n, false)?;
            let _ = lock.rollback().await;
            if !held {
                return Ok(Fault::KillWorker.name());
            }
        }
        Fault::KillWorker | Fault::KillWorkerNewOwner => {
            let n = rng.random_range(0..workers.slots.len());
            workers.kill_and_restart(n, fault == Fault::KillWorkerNewOwner)?;
        }
        Fault::PauseWorker => {
            let n = rng.random_range(0..workers.slots.len());
            workers.signal(n, libc::SIGSTOP);
            let past_lease = Duration::from_millis(rng.random_range(300..2_000));
            tokio::time::sleep(LEASE + past_lease).await;
            workers.signal(n, libc::SIGCONT);
        }
        Fault::RestartServerFast | Fault::RestartServerImmediate => {
            let how = if fault == Fault::RestartServerFast {
                Shutdown::Fast
            } else {
                Shutdown::Immediate
            };
            cluster.stop(how).await;
            tokio::time::sleep(Duration::from_millis(rng.random_range(100..1_500))).await;
            cluster.start_again().await?;
        }
        Fault::KillServer | Fault::KillPrimary | Fault::StepDown => {
            return Err(format!("{} is a MongoDB fault", fault.name()).into());
        }
    }
    Ok(fault.name())
}

/// Where the pending deliveries wait, and what the sessions do.
async fn diagnose_postgres(pool: &PgPool, schema: &str) -> Result<(), BoxError> {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_millis() as i64;
    let deliveries = pg::table(schema, "deliveries");
    let groups = sqlx::query(&format!(
        "SELECT handler, parked, due_at <= $1 AS due, lease_owner IS NOT NULL AS leased, \
             count(*) AS n \
         FROM {deliveries} WHERE status = 'pending' GROUP BY 1, 2, 3, 4 ORDER BY 1, 2, 3, 4"
    ))
    .bind(now)
    .fetch_all(pool)
    .await?;
    for row in groups {
        println!(
            "    deliveries handler {} parked {} due {} leased {}: {}",
            row.try_get::<String, _>("handler")?,
            row.try_get::<bool, _>("parked")?,
            row.try_get::<bool, _>("due")?,
            row.try_get::<bool, _>("leased")?,
            row.try_get::<i64, _>("n")?,
        );
    }
    let leased = sqlx::query(&format!(
        "SELECT id, event_id, handler, coalesce(key, '') AS key, coalesce(sequence, 0) AS seq, \
             attempts, coalesce(lease_owner, '') AS owner, \
             coalesce(lease_expires_at - $1, 0) AS expires_in \
         FROM {deliveries} WHERE status = 'pending' AND NOT parked ORDER BY id LIMIT 20"
    ))
    .bind(now)
    .fetch_all(pool)
    .await?;
    for row in leased {
        println!(
            "    delivery {} {}/{} key {:?} seq {} attempts {} owner {:?} lease expires in {} ms",
            row.try_get::<i64, _>("id")?,
            row.try_get::<String, _>("event_id")?,
            row.try_get::<String, _>("handler")?,
            row.try_get::<String, _>("key")?,
            row.try_get::<i64, _>("seq")?,
            row.try_get::<i32, _>("attempts")?,
            row.try_get::<String, _>("owner")?,
            row.try_get::<i64, _>("expires_in")?,
        );
    }
    let sessions = sqlx::query(
        "SELECT coalesce(application_name, '') AS app, coalesce(state, '') AS state, \
             coalesce(wait_event_type, '') AS wait, left(coalesce(query, ''), 100) AS query \
         FROM pg_stat_activity \
         WHERE datname = current_database() AND state <> 'idle' AND pid <> pg_backend_pid()",
    )
    .fetch_all(pool)
    .await?;
    for row in sessions {
        println!(
            "    session {} {} waits {:?}: {}",
            row.try_get::<String, _>("app")?,
            row.try_get::<String, _>("state")?,
            row.try_get::<String, _>("wait")?,
            row.try_get::<String, _>("query")?,
        );
    }
    Ok(())
}

/// Compares what the PostgreSQL database holds with what must hold.
async fn check_postgres(
    pool: &PgPool,
    schema: &str,
    handlers: Handlers,
    acknowledged: &Mutex<HashSet<String>>,
    figures: &mut Figures,
) -> Result<(), BoxError> {
    let orders = sqlx::query_as::<_, (String, bool)>(&format!(
        "SELECT id, poison FROM {}",
        pg::table(schema, fault::ORDERS)
    ))
    .fetch_all(pool)
    .await?
    .into_iter()
    .collect();
    let events = sqlx::query_as::<_, (String, Vec<String>)>(&format!(
        "SELECT id, handlers FROM {}",
        pg::table(schema, "events")
    ))
    .fetch_all(pool)
    .await?
    .into_iter()
    .collect();
    let deliveries = sqlx::query_as::<_, (String, String, String, String)>(&format!(
        "SELECT event_id, handler, status, coalesce(last_error, '') FROM {}",
        pg::table(schema, "deliveries")
    ))
    .fetch_all(pool)
    .await?
    .into_iter()
    .map(|(event, handler, status, error)| (event, handler, Some(status), error))
    .collect();
    let effect_rows = sqlx::query_as::<_, (String, Option<i32>)>(&format!(
        "SELECT event, batch FROM {}",
        pg::table(schema, fault::EFFECTS)
    ))
    .fetch_all(pool)
    .await?;
    let batch_sizes = effect_rows
        .iter()
        .filter_map(|(_, size)| *size)
        .map(|size| u64::try_from(size).unwrap_or(0))
        .collect();
    let effects = effect_rows.into_iter().map(|(event, _)| event).collect();
    let runs = sqlx::query_scalar::<_, String>(&format!(
        "SELECT event FROM {}",
        pg::table(schema, fault::RUNS)
    ))
    .fetch_all(pool)
    .await?;
    let mut logs: Vec<(String, Vec<i64>)> = Vec::new();
    let mut index: HashMap<String, usize> = HashMap::new();
    let rows = sqlx::query_as::<_, (String, String, i64)>(&format!(
        "SELECT handler, key, seq FROM {} ORDER BY id",
        pg::table(schema, fault::ORDER_LOG)
    ))
    .fetch_all(pool)
    .await?;
    for (handler, key, seq) in rows {
        let id = format!("{handler}|{key}");
        let n = *index.entry(id.clone()).or_insert_with(|| {
            logs.push((id, Vec::new()));
            logs.len() - 1
        });
        logs[n].1.push(seq);
    }
    let snapshot = Snapshot {
        orders,
        events,
        deliveries,
        effects,
        batch_sizes,
        runs,
        logs,
    };
    check(&snapshot, handlers, acknowledged, figures);
    Ok(())
}
