//! What the fault suite's load generator, workers and checker share: the event, the two
//! handlers and the collections they write.
//!
//! Every handler run leaves a trace the checker can count:
//!
//! - `projector` is transactional. In its transaction it inserts one document into
//!   [`EFFECTS`] and, for a keyed event, appends the event's sequence to the key's log in
//!   [`ORDER_LOG`]. Both commit together with the delivery's completion, so each event must
//!   have exactly one effect (none when its delivery is dead).
//! - `auditor` is not transactional (at least once). It inserts one document per run into
//!   [`RUNS`] and appends the sequence to its own log for the key. A run may repeat after a
//!   crash; the checker only asks that every event ran at least once and that the first runs
//!   of a key came in sequence order.
//!
//! An event can ask to fail its first `fail` attempts (retries), or to always fail (`poison`,
//! which must end as a dead letter carrying its error).
//!
//! The batch scenarios run [`batch_subscriptions`] instead: `projector` alone, as a
//! transactional batch handler of at most [`BATCH_MAX`] deliveries. In the batch's transaction
//! it inserts one effect per delivery that succeeds, with the size of its batch; the deliveries
//! that fail are marked failed in its [`BatchOutcome`] and write nothing, so each event must
//! still have exactly one effect (none when dead).
//!
//! [`postgres`] has the same handlers and tables for the PostgreSQL store, and a private
//! PostgreSQL cluster the scenarios can restart.

pub mod postgres;

use std::time::Duration;

use mongodb::{
    Collection, Database,
    bson::{Document, doc},
};
use relaybus::{
    Batch, BatchItem, BatchOutcome, BoxError, Event, HandlerContext, RetryPolicy, Subscription,
};
use serde::{Deserialize, Serialize};

/// Business documents, one per published event, written in the event's transaction.
pub const ORDERS: &str = "orders";
/// The transactional handler's effects, one document per committed run.
pub const EFFECTS: &str = "effects";
/// The non-transactional handler's runs, one document per run.
pub const RUNS: &str = "runs";
/// Per handler and key, the sequences of the runs in the order they happened
/// (`_id: "<handler>|<key>"`, `seqs: [..]`).
pub const ORDER_LOG: &str = "order_log";

/// The transactional handler.
pub const PROJECTOR: &str = "projector";
/// The at-least-once handler.
pub const AUDITOR: &str = "auditor";

/// Attempts before a delivery is buried. Above the 2 failures an event can ask for, with room
/// for the attempts that crashes charge (each crash charges what the worker was running).
pub const MAX_ATTEMPTS: u32 = 6;

/// The most deliveries a batch of the batch scenarios' `projector` holds.
pub const BATCH_MAX: usize = 100;

/// The event the load generator publishes with each order.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct FaultOrder {
    /// The order's id, also the event id.
    pub order: String,
    /// How many first attempts of each handler fail.
    pub fail: u32,
    /// Every attempt fails: the deliveries must end dead.
    pub poison: bool,
}

impl Event for FaultOrder {
    const TYPE: &'static str = "fault.order.v1";
}

/// The subscriptions of every process of the suite: the workers run them, the load
/// generator registers them so that its events get their deliveries.
pub fn subscriptions(db: &Database, owner: &str) -> Vec<Subscription> {
    let retry = retry();

    let effects: Collection<Document> = db.collection(EFFECTS);
    let log: Collection<Document> = db.collection(ORDER_LOG);
    let projector = Subscription::new(PROJECTOR, move |event: FaultOrder, ctx: HandlerContext| {
        let effects = effects.clone();
        let log = log.clone();
        async move {
            let mut session = ctx.session().await?;
            effects
                .insert_one(doc! {
                    "event": ctx.event_id(),
                    "attempt": i64::from(ctx.attempt()),
                })
                .session(&mut *session)
                .await?;
            if let (Some(key), Some(sequence)) = (ctx.key(), ctx.sequence()) {
                log.update_one(
                    doc! { "_id": format!("{PROJECTOR}|{key}") },
                    doc! { "$push": { "seqs": sequence } },
                )
                .upsert(true)
                .session(&mut *session)
                .await?;
            }
            drop(session);
            outcome(&event, ctx.attempt())
        }
    })
    .transactional()
    .retry(retry);

    let runs: Collection<Document> = db.collection(RUNS);
    let log: Collection<Document> = db.collection(ORDER_LOG);
    let owner = owner.to_owned();
    let auditor = Subscription::new(AUDITOR, move |event: FaultOrder, ctx: HandlerContext| {
        let runs = runs.clone();
        let log = log.clone();
        let owner = owner.clone();
        async move {
            runs.insert_one(doc! {
                "event": ctx.event_id(),
                "attempt": i64::from(ctx.attempt()),
                "owner": owner,
            })
            .await?;
            if let (Some(key), Some(sequence)) = (ctx.key(), ctx.sequence()) {
                log.update_one(
                    doc! { "_id": format!("{AUDITOR}|{key}") },
                    doc! { "$push": { "seqs": sequence } },
                )
                .upsert(true)
                .await?;
            }
            // A short pause widens the window in which a worker can be killed mid-handler.
            let pause = rand::random_range(0..8);
            tokio::time::sleep(Duration::from_millis(pause)).await;
            outcome(&event, ctx.attempt())
        }
    })
    .retry(retry);

    vec![projector, auditor]
}

/// The subscriptions of every process of the batch scenarios: `projector` as a transactional
/// batch handler that inserts the effects of a batch's succeeding deliveries into [`EFFECTS`]
/// (each with the batch's size and the process's `owner`) with one `insert_many`, in the
/// transaction that completes them.
pub fn batch_subscriptions(db: &Database, owner: &str) -> Vec<Subscription> {
    let effects: Collection<Document> = db.collection(EFFECTS);
    let owner = owner.to_owned();
    let projector = Subscription::batch(
        PROJECTOR,
        move |batch: Batch<FaultOrder>, ctx: HandlerContext| {
            let effects = effects.clone();
            let owner = owner.clone();
            async move {
                let size = batch.len() as i64;
                let (outcome, succeeded) = split_batch(&batch);
                let rows: Vec<Document> = succeeded
                    .iter()
                    .map(|item| {
                        doc! {
                            "event": item.event_id(),
                            "attempt": i64::from(item.attempt()),
                            "batch": size,
                            "owner": &owner,
                        }
                    })
                    .collect();
                if !rows.is_empty() {
                    let mut session = ctx.session().await?;
                    effects.insert_many(rows).session(&mut *session).await?;
                }
                batch_pause().await;
                Ok::<_, BoxError>(outcome)
            }
        },
    )
    .transactional()
    .max_batch(BATCH_MAX)
    .retry(retry());
    vec![projector]
}

/// The retries of the suite's handlers.
pub(crate) fn retry() -> RetryPolicy {
    RetryPolicy::new(MAX_ATTEMPTS)
        .initial_backoff(Duration::from_millis(20))
        .max_backoff(Duration::from_millis(100))
}

/// What becomes of each delivery of `batch`, as [`outcome`] decides for one: the batch's
/// outcome, with every failing delivery marked, and the deliveries that succeed.
pub(crate) fn split_batch(
    batch: &Batch<FaultOrder>,
) -> (BatchOutcome, Vec<&BatchItem<FaultOrder>>) {
    let mut outcome = BatchOutcome::succeeded();
    let mut succeeded = Vec::new();
    for item in batch {
        match self::outcome(item.event(), item.attempt()) {
            Ok(()) => succeeded.push(item),
            Err(error) => {
                outcome.fail(item, error);
            }
        }
    }
    (outcome, succeeded)
}

/// A short pause inside a batch's transaction, which widens the window in which a worker can
/// be killed between a batch's writes and its commit.
pub(crate) async fn batch_pause() {
    let pause = rand::random_range(0..30);
    tokio::time::sleep(Duration::from_millis(pause)).await;
}

pub(crate) fn outcome(event: &FaultOrder, attempt: u32) -> Result<(), BoxError> {
    if event.poison {
        return Err(format!("order {} is poison: every attempt fails", event.order).into());
    }
    if attempt <= event.fail {
        return Err(format!(
            "order {} fails its first {} attempts (this was attempt {attempt})",
            event.order, event.fail
        )
        .into());
    }
    Ok(())
}

/// The schedule the `--schedule` workers run: every second, publishing [`Beat`].
pub const SCHEDULE: &str = "beat";

/// The event of a tick of [`SCHEDULE`].
#[derive(Debug, Serialize, Deserialize)]
pub struct Beat {
    /// The tick's time.
    pub at: relaybus::Timestamp,
}

impl Event for Beat {
    const TYPE: &'static str = "schedule.beat.v1";
}

/// Starts a `relaybus-fault-worker` (the binary at `worker`) with `args`, tied to the test
/// process, and waits up to a minute for its `ready`.
fn start_worker(worker: &str, args: &[String]) -> std::process::Child {
    use std::io::{BufRead, BufReader};

    let mut command = std::process::Command::new(worker);
    command
        .args(args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null());
    let mut child = relaybus_harness::spawn_tied(command).expect("start a worker");
    let stdout = child.stdout.take().expect("the worker's stdout");
    let (ready, wait) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            match line {
                Ok(line) if line == "ready" => {
                    let _ = ready.send(());
                }
                Ok(_) => {}
                Err(_) => return,
            }
        }
    });
    wait.recv_timeout(Duration::from_secs(60))
        .expect("the worker prints `ready` within a minute");
    child
}

/// The schedule test on real processes: three `--schedule` workers on one database run
/// [`SCHEDULE`] for `run` of real time; one is killed with SIGKILL at `kill_after` and started
/// again under the same owner name. `args(owner)` gives a worker's arguments. Returns the
/// wall-clock times between which all three ran (the kill and restart inside), once every
/// worker is killed.
pub async fn three_schedule_workers_one_killed(
    worker: &str,
    args: impl Fn(&str) -> Vec<String>,
    run: Duration,
    kill_after: Duration,
) -> (relaybus::Timestamp, relaybus::Timestamp) {
    let owners = ["beat-a", "beat-b", "beat-c"];
    let mut workers: Vec<std::process::Child> = owners
        .iter()
        .map(|owner| start_worker(worker, &args(owner)))
        .collect();
    let started = relaybus::Timestamp::now();
    tokio::time::sleep(kill_after).await;
    relaybus_harness::kill_tied(&mut workers[1]);
    workers[1] = start_worker(worker, &args(owners[1]));
    tokio::time::sleep(run.saturating_sub(kill_after)).await;
    let ended = relaybus::Timestamp::now();
    for worker in &mut workers {
        relaybus_harness::kill_tied(worker);
    }
    (started, ended)
}

/// Checks the ticks of [`SCHEDULE`] a database holds, as the times in their event ids: one per
/// second, none missing or doubled, from no later than `started` to no earlier than 2 seconds
/// before `ended`.
pub fn check_one_event_per_tick(
    mut ticks: Vec<relaybus::Timestamp>,
    started: relaybus::Timestamp,
    ended: relaybus::Timestamp,
) {
    ticks.sort();
    let (Some(first), Some(last)) = (ticks.first().copied(), ticks.last().copied()) else {
        panic!("no tick was published");
    };
    assert!(
        first <= started,
        "the first tick {first} came after the start {started}"
    );
    assert!(
        last >= ended.saturating_sub(Duration::from_secs(2)),
        "the last tick {last} is long before the end {ended}"
    );
    let expected: Vec<relaybus::Timestamp> = (0..)
        .map(|n| first.saturating_add(Duration::from_secs(n)))
        .take_while(|at| *at <= last)
        .collect();
    assert_eq!(ticks, expected, "one event per tick from {first} to {last}");
    eprintln!(
        "schedule: {} ticks from {first} to {last}, one event each",
        ticks.len()
    );
}

/// The tick times in the ids of [`Beat`] events, which must all be ticks of [`SCHEDULE`]
/// (`schedule:beat:<time>`).
pub fn tick_times(ids: impl IntoIterator<Item = String>) -> Vec<relaybus::Timestamp> {
    let prefix = format!("schedule:{SCHEDULE}:");
    ids.into_iter()
        .map(|id| {
            let time = id
                .strip_prefix(&prefix)
                .unwrap_or_else(|| panic!("{id:?} is no tick of {SCHEDULE}"));
            relaybus::Timestamp::parse_rfc3339(time).expect("the tick's time in its event id")
        })
        .collect()
}
