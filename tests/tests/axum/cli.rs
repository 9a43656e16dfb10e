//! The `relaybus` command line, run as a process against a real MongoDB replica set and a real
//! PostgreSQL server: every command's output after a known load, `--json` read back, a filter
//! requeue of 10,000 dead letters, dry runs that write nothing, bad input refused with exit
//! code 2, and `tail` showing an event another process publishes.
//!
//! The binary is `RELAYBUS_CLI_BIN` when set (`scripts/test` builds it), else built here with
//! cargo, with the features of this test build.

use std::{
    io::{BufRead, BufReader},
    path::PathBuf,
    process::{Command, Output, Stdio},
    sync::OnceLock,
    time::{Duration, Instant},
};

use futures::TryStreamExt;
use relaybus::{
    BoxError, DeliveryQuery, DeliveryStatus, EventEnvelope, HandlerContext, MongoEventStore,
    PostgresEventStore, RelayBus, RetryPolicy, Store, Subscription, Timestamp,
};
use relaybus_harness::{TestDb, test_db};
use relaybus_tests::support::{MAILER_ERRORS, OrderPlaced, placed};
use serde_json::Value;
use sqlx::{Connection, PgConnection};

/// The `relaybus` binary, built once per test process.
fn binary() -> &'static PathBuf {
    static BINARY: OnceLock<PathBuf> = OnceLock::new();
    // With the packages of this test build, so that the build shares its features and
    // artifacts.
    BINARY.get_or_init(|| match std::env::var_os("RELAYBUS_CLI_BIN") {
        Some(path) => PathBuf::from(path),
        None => crate::workspace::build(
            "relaybus",
            &[
                "-p",
                "relaybus-tests",
                "-p",
                "relaybus",
                "--all-features",
                "--bin",
                "relaybus",
            ],
        ),
    })
}

/// A store the command line is pointed at: its options, and a store value to check with.
struct Target<S> {
    args: Vec<String>,
    store: S,
    /// Drops the PostgreSQL schema at the end.
    _schema: Option<Schema>,
}

/// What a run printed, and how it ended.
#[derive(Debug)]
struct Run {
    code: i32,
    stdout: String,
    stderr: String,
}

impl Run {
    fn of(output: Output) -> Run {
        Run {
            code: output.status.code().expect("exited, not killed"),
            stdout: String::from_utf8(output.stdout).expect("UTF-8 output"),
            stderr: String::from_utf8(output.stderr).expect("UTF-8 errors"),
        }
    }

    /// The JSON objects of standard output, one per line.
    fn json(&self) -> Vec<Value> {
        self.stdout
            .lines()
            .map(|line| {
                serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line:?}\n{self:?}"))
            })
            .collect()
    }

    fn ok(self) -> Run {
        assert_eq!(self.code, 0, "{self:?}");
        self
    }
}

impl<S: Store> Target<S> {
    /// Runs `relaybus` with the target's store options and `args`, no terminal.
    fn run(&self, args: &[&str]) -> Run {
        let output = Command::new(binary())
            .args(&self.args)
            .args(args)
            .env_remove("RELAYBUS_URL")
            .env_remove("RELAYBUS_SCHEMA")
            .env_remove("RELAYBUS_DATABASE")
            .env_remove("RELAYBUS_PREFIX")
            .stdin(Stdio::null())
            .output()
            .expect("the binary runs");
        Run::of(output)
    }

    async fn dead(&self) -> u64 {
        self.store.statistics().await.expect("statistics").dead
    }

    async fn ids(&self, query: DeliveryQuery) -> Vec<String> {
        let mut ids = Vec::new();
        let mut after: Option<String> = None;
        loop {
            let mut page = query.clone().limit(1_000);
            if let Some(after) = &after {
                page = page.after(after.clone());
            }
            let records = self.store.list_deliveries(&page).await.expect("a listing");
            after = records.last().map(|r| r.id.clone());
            let full = records.len() == 1_000;
            ids.extend(records.into_iter().map(|r| r.id));
            if !full {
                return ids;
            }
        }
    }
}

async fn mongo_target(db: &TestDb) -> Target<MongoEventStore> {
    let store = MongoEventStore::builder(db.client.clone())
        .database(&db.name)
        .build()
        .expect("valid options");
    Target {
        args: vec![
            "--url".into(),
            db.uri.clone(),
            "--database".into(),
            db.name.clone(),
        ],
        store,
        _schema: None,
    }
}

fn postgres_url() -> String {
    std::env::var("RELAYBUS_TEST_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned())
}

/// Drops the test's schema when the test ends, passed or failed.
struct Schema(String);

impl Drop for Schema {
    fn drop(&mut self) {
        let (url, name) = (postgres_url(), self.0.clone());
        let dropped = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .ok()?;
            runtime.block_on(async {
                let mut connection = PgConnection::connect(&url).await.ok()?;
                sqlx::query(&format!("DROP SCHEMA IF EXISTS \"{name}\" CASCADE"))
                    .execute(&mut connection)
                    .await
                    .ok()
            })
        });
        let _ = dropped.join();
    }
}

async fn postgres_target(test: &str) -> Target<PostgresEventStore> {
    let url = postgres_url();
    let name = format!("cli{}_{test}", std::process::id());
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .connect(&url)
        .await
        .unwrap_or_else(|e| panic!("PostgreSQL at {url} does not answer ({e}); start it or set RELAYBUS_TEST_POSTGRES_URL"));
    sqlx::query(&format!("DROP SCHEMA IF EXISTS \"{name}\" CASCADE"))
        .execute(&pool)
        .await
        .expect("a leftover schema dropped");
    let store = PostgresEventStore::builder(pool)
        .schema(&name)
        .build()
        .expect("valid options");
    Target {
        args: vec!["--url".into(), url, "--schema".into(), name.clone()],
        store,
        _schema: Some(Schema(name)),
    }
}

/// The known load: six orders, each projected by `projector` (which succeeds) and mailed by
/// `mailer` (which fails for good, orders 0 to 3 with the first of [`MAILER_ERRORS`], 4 and 5
/// with the second): six dead letters of `mailer`, in two groups. Returns the bus, which has
/// no worker running.
async fn load<S: Store>(store: &S) -> RelayBus<S> {
    let mailer = Subscription::new(
        "mailer",
        |order: OrderPlaced, _: HandlerContext<S>| async move {
            let n: usize = order
                .order_id
                .trim_start_matches("order-")
                .parse()
                .unwrap_or(0);
            Err::<(), BoxError>(MAILER_ERRORS[usize::from(n >= 4)].into())
        },
    )
    .retry(RetryPolicy::new(1));
    let projector = Subscription::new("projector", |_: OrderPlaced, _: HandlerContext<S>| async {
        Ok::<(), BoxError>(())
    });
    let bus = RelayBus::builder(store.clone())
        .without_registered_handlers()
        .subscribe(projector)
        .subscribe(mailer)
        .build()
        .expect("valid bus");
    for n in 0..6 {
        bus.publish(&placed(&format!("order-{n}")))
            .id(format!("order-{n}"))
            .key(format!("customer-{}", n % 2))
            .await
            .expect("publish");
    }
    while bus.run_once().await.expect("a run").claimed > 0 {}
    bus
}

async fn every_command<S: Store>(target: Target<S>, fresh: impl AsyncFn() -> bool) {
    // A dry run of the setup of an empty database plans and writes nothing.
    let plan = target.run(&["--json", "setup", "--dry-run"]).ok();
    let steps = plan.json();
    assert!(
        steps
            .iter()
            .any(|s| s["step"] == "create" && s["done"] == false),
        "{plan:?}"
    );
    assert!(fresh().await, "a dry run wrote nothing");
    let human = target.run(&["setup", "--dry-run"]).ok();
    assert!(human.stdout.contains("dry run:"), "{human:?}");
    assert!(fresh().await);
    let setup = target.run(&["setup"]).ok();
    assert!(setup.stdout.contains("the store is set up"), "{setup:?}");
    assert!(!fresh().await);
    let again = target.run(&["setup", "--dry-run"]).ok();
    assert_eq!(again.stdout.trim(), "nothing to do: the store is set up");

    let bus = load(&target.store).await;

    // stats: the table, and the same counts in JSON.
    let stats = target.run(&["stats"]).ok();
    let header = stats.stdout.lines().next().unwrap();
    assert!(
        header.starts_with("HANDLER") && header.contains("OLDEST DUE"),
        "{stats:?}"
    );
    let mailer_row: Vec<&str> = stats
        .stdout
        .lines()
        .find(|l| l.starts_with("mailer"))
        .expect("a row of mailer")
        .split_whitespace()
        .collect();
    assert_eq!(mailer_row[..5], ["mailer", "0", "0", "0", "6"], "{stats:?}");
    let lines = target.run(&["--json", "stats"]).ok().json();
    let mailer = lines.iter().find(|l| l["handler"] == "mailer").unwrap();
    assert_eq!(mailer["dead"], 6);
    let total = lines.last().unwrap();
    assert_eq!(total["handler"], Value::Null);
    assert_eq!(total["dead"], 6);

    // list: a page of four, the cursor to the next, the next page.
    let page = target
        .run(&[
            "--json",
            "list",
            "--state",
            "dead",
            "--handler",
            "mailer",
            "--limit",
            "4",
        ])
        .ok();
    let first = page.json();
    assert_eq!(first.len(), 4, "{page:?}");
    assert!(
        first
            .iter()
            .all(|d| d["status"] == "dead" && d["handler"] == "mailer")
    );
    let last_id = first[3]["id"].as_str().unwrap();
    assert!(
        page.stderr.contains(&format!("--after {last_id}")),
        "{page:?}"
    );
    let rest = target
        .run(&[
            "--json",
            "list",
            "--state",
            "dead",
            "--handler",
            "mailer",
            "--after",
            last_id,
        ])
        .ok()
        .json();
    assert_eq!(rest.len(), 2);
    let table = target
        .run(&["list", "--state", "dead", "--error", "reset"])
        .ok();
    let mut rows = table.stdout.lines();
    assert!(rows.next().unwrap().starts_with("ID"), "{table:?}");
    let rows: Vec<&str> = rows.collect();
    assert_eq!(rows.len(), 2, "{table:?}");
    assert!(
        rows.iter().all(|r| r.contains("connection reset by peer")),
        "{table:?}"
    );
    // Columns line up: every row's EVENT column starts where the header's does.
    let at = table.stdout.lines().next().unwrap().find("EVENT").unwrap();
    assert!(
        rows.iter().all(|r| r[at..].starts_with("order-")),
        "{table:?}"
    );

    // show: the event and both deliveries, the dead one with its error history.
    let shown = target.run(&["show", "order-5"]).ok();
    assert!(shown.stdout.contains("order.placed.v1"), "{shown:?}");
    assert!(shown.stdout.contains("customer-1 (sequence"), "{shown:?}");
    assert!(shown.stdout.contains("errors of"), "{shown:?}");
    let detail = &target.run(&["--json", "show", "order-5"]).ok().json()[0];
    assert_eq!(detail["event"]["id"], "order-5");
    assert_eq!(detail["event"]["payload"]["order_id"], "order-5");
    let dead = detail["deliveries"]
        .as_array()
        .unwrap()
        .iter()
        .find(|d| d["handler"] == "mailer")
        .unwrap();
    assert_eq!(dead["state"], "dead");
    assert_eq!(dead["errors"][0]["error"], MAILER_ERRORS[1]);
    let unknown = target.run(&["show", "no-such-event"]);
    assert_eq!(unknown.code, 4, "{unknown:?}");

    // lanes: every lane with --all, as JSON.
    let lanes = target.run(&["--json", "lanes", "--all"]).ok().json();
    assert_eq!(lanes.iter().filter(|l| l["kind"] == "lane").count(), 256);
    let human = target.run(&["lanes"]).ok();
    assert!(human.stdout.contains("of 256 lanes held"), "{human:?}");

    // requeue by ids, a dry run first.
    let smtp = target
        .ids(
            DeliveryQuery::new()
                .status(DeliveryStatus::Dead)
                .last_error(MAILER_ERRORS[0]),
        )
        .await;
    assert_eq!(smtp.len(), 4);
    let dry = target
        .run(&["requeue", "--dry-run", &smtp[0], &smtp[1]])
        .ok();
    assert!(dry.stdout.contains("would requeue 2"), "{dry:?}");
    assert_eq!(target.dead().await, 6, "the dry run changed nothing");
    let requeued = target
        .run(&["--json", "requeue", &smtp[0], &smtp[1]])
        .ok()
        .json();
    assert_eq!(requeued[0]["requeued"], 2);
    assert_eq!(target.dead().await, 4);
    // Again: no longer dead letters, so not found, and done in part.
    let again = target.run(&["requeue", &smtp[0]]);
    assert_eq!(again.code, 4, "{again:?}");
    assert!(again.stdout.contains("not found: 1"), "{again:?}");

    // discard by filter: without --yes and without a terminal, not confirmed.
    let unconfirmed = target.run(&["discard", "--error", "RESET BY"]);
    assert_eq!(unconfirmed.code, 3, "{unconfirmed:?}");
    assert!(
        unconfirmed.stdout.contains("2 dead letters match"),
        "{unconfirmed:?}"
    );
    assert_eq!(target.dead().await, 4);
    let discarded = target
        .run(&["--json", "discard", "--error", "RESET BY", "--yes"])
        .ok()
        .json();
    assert_eq!(discarded[0]["matched"], 2);
    assert_eq!(discarded[1]["discarded"], 2);
    assert_eq!(target.dead().await, 2);

    // bury: the two requeued deliveries wait again; one is buried by id.
    let buried = target
        .run(&["bury", "--reason", "the order was cancelled", &smtp[0]])
        .ok();
    assert!(buried.stdout.contains("buried: 1"), "{buried:?}");
    assert_eq!(target.dead().await, 3);
    let record = target
        .store
        .list_deliveries(
            &DeliveryQuery::new()
                .status(DeliveryStatus::Dead)
                .error_contains("cancelled"),
        )
        .await
        .unwrap();
    assert_eq!(record.len(), 1);
    assert_eq!(record[0].id, smtp[0]);

    // purge: a dry run, then every dead letter.
    let future = Timestamp::now()
        .saturating_add(Duration::from_secs(60))
        .to_string();
    let dry = target
        .run(&["purge", "--dead-before", &future, "--dry-run"])
        .ok();
    assert!(
        dry.stdout.starts_with("dry run: would delete dead letters"),
        "{dry:?}"
    );
    assert_eq!(target.dead().await, 3);
    let purged = target
        .run(&["--json", "purge", "--dead-before", &future, "--yes"])
        .ok()
        .json();
    assert_eq!(purged[0]["dead_deliveries"], 3);
    assert_eq!(target.dead().await, 0);
    drop(bus);
}

#[tokio::test]
async fn every_command_on_mongodb_after_a_known_load() {
    let db = test_db("cli_commands").await;
    let target = mongo_target(&db).await;
    let database = db.db();
    every_command(target, async || {
        database.list_collection_names().await.unwrap().is_empty()
    })
    .await;
}

#[tokio::test]
async fn every_command_on_postgres_after_a_known_load() {
    let target = postgres_target("commands").await;
    let pool = target.store.pool().clone();
    let schema = target.store.schema().to_owned();
    every_command(target, async || {
        !sqlx::query_scalar::<_, bool>(
            "SELECT EXISTS (SELECT FROM pg_namespace WHERE nspname = $1)",
        )
        .bind(&schema)
        .fetch_one(&pool)
        .await
        .unwrap()
    })
    .await;
}

#[tokio::test]
async fn a_dry_run_of_setup_shows_the_upgrade_of_a_0_1_database_and_changes_nothing() {
    use mongodb::{
        IndexModel,
        bson::{DateTime, Document, doc},
        options::IndexOptions,
    };
    let db = test_db("cli_upgrade").await;
    let target = mongo_target(&db).await;
    // What 0.1.0 left: events without handlers or creation time, a claimed (`processing`)
    // delivery with its own lease, a pending one outside any lane, and the `running` index.
    let events = db.db().collection::<Document>("relaybus_events");
    let deliveries = db.db().collection::<Document>("relaybus_deliveries");
    events
        .insert_many([
            doc! { "_id": "e-1", "type": "order.placed.v1", "payload": {} },
            doc! { "_id": "e-2", "type": "order.placed.v1", "payload": {} },
        ])
        .await
        .unwrap();
    let delivery = |event: &str, status: &str| {
        doc! {
            "eventId": event, "handler": "projector", "eventType": "order.placed.v1",
            "status": status, "attempts": 1, "dueAt": DateTime::now(),
            "createdAt": DateTime::now(),
        }
    };
    let mut claimed = delivery("e-1", "processing");
    claimed.insert("leaseOwner", "worker-of-0.1.0");
    deliveries
        .insert_many([claimed, delivery("e-2", "pending")])
        .await
        .unwrap();
    deliveries
        .create_index(
            IndexModel::builder()
                .keys(doc! { "status": 1, "leaseOwner": 1 })
                .options(IndexOptions::builder().name("running".to_owned()).build())
                .build(),
        )
        .await
        .unwrap();
    let snapshot = async || {
        let mut all: Vec<Document> = Vec::new();
        for collection in [&events, &deliveries] {
            all.extend(
                collection
                    .find(doc! {})
                    .await
                    .unwrap()
                    .try_collect::<Vec<_>>()
                    .await
                    .unwrap(),
            );
        }
        let indexes = deliveries.list_index_names().await.unwrap();
        (all, indexes)
    };
    let before = snapshot().await;

    let plan = target.run(&["--json", "setup", "--dry-run"]).ok().json();
    let upgrade: Vec<&str> = plan
        .iter()
        .filter(|s| s["step"] == "upgrade")
        .map(|s| s["description"].as_str().unwrap())
        .collect();
    assert_eq!(
        upgrade,
        [
            "upgrade from 0.1.0: make 1 claimed (`processing`) deliveries pending and due again",
            "upgrade from 0.1.0: remove the per-delivery lease fields of 1 deliveries",
            "upgrade from 0.1.0: make 1 pending deliveries claimable",
            "upgrade from 0.1.0: give 2 deliveries the lane of their key",
            "upgrade from 0.1.0: give 2 events their handlers and creation time",
            "upgrade from 0.1.0: drop the 0.1.0 index `running` of relaybus_deliveries",
        ],
        "{plan:?}"
    );
    assert!(
        plan.iter()
            .any(|s| s["description"] == "create 256 lane documents in relaybus_lanes"),
        "{plan:?}"
    );
    assert_eq!(snapshot().await, before, "the dry run changed nothing");
    assert!(
        !db.db()
            .list_collection_names()
            .await
            .unwrap()
            .contains(&"relaybus_lanes".to_owned()),
        "nor created anything"
    );

    target.run(&["setup"]).ok();
    assert_eq!(
        deliveries
            .count_documents(doc! { "status": "processing" })
            .await
            .unwrap(),
        0,
        "the setup upgraded"
    );
    let again = target.run(&["setup", "--dry-run"]).ok();
    assert_eq!(again.stdout.trim(), "nothing to do: the store is set up");
}

/// 10,000 dead letters of `mailer`: published, then buried through the store.
async fn ten_thousand_dead_letters<S: Store>(target: &Target<S>) {
    target.store.setup().await.expect("setup");
    let bus = RelayBus::builder(target.store.clone())
        .without_registered_handlers()
        .subscribe(Subscription::new(
            "mailer",
            |_: OrderPlaced, _: HandlerContext<S>| async { Ok::<(), BoxError>(()) },
        ))
        .build()
        .expect("valid bus");
    for chunk in 0..10 {
        let envelopes: Vec<EventEnvelope> = (0..1_000)
            .map(|n| EventEnvelope::new(&placed(&format!("order-{chunk}-{n}"))).unwrap())
            .collect();
        bus.publish_all(envelopes).await.expect("publish");
    }
    let pending = target
        .ids(DeliveryQuery::new().status(DeliveryStatus::Pending))
        .await;
    assert_eq!(pending.len(), 10_000);
    for batch in pending.chunks(1_000) {
        target
            .store
            .bury_by_id(batch, "SMTP 554: mailbox unavailable", Timestamp::now())
            .await
            .expect("bury");
    }
    assert_eq!(target.dead().await, 10_000);
}

async fn filter_requeue_of_ten_thousand<S: Store>(target: Target<S>) {
    ten_thousand_dead_letters(&target).await;
    let dry = target
        .run(&[
            "requeue",
            "--handler",
            "mailer",
            "--error",
            "smtp 554",
            "--dry-run",
        ])
        .ok();
    assert!(dry.stdout.contains("10000 dead letters match"), "{dry:?}");
    assert_eq!(target.dead().await, 10_000, "the dry run changed nothing");

    let started = Instant::now();
    let run = target
        .run(&[
            "requeue",
            "--handler",
            "mailer",
            "--error",
            "smtp 554",
            "--yes",
        ])
        .ok();
    let took = started.elapsed();
    assert!(
        run.stdout.starts_with("10000 dead letters match"),
        "{run:?}"
    );
    assert!(run.stdout.contains("requeued: 10000"), "{run:?}");
    let progress: Vec<&str> = run
        .stderr
        .lines()
        .filter(|l| l.starts_with("relaybus: requeue: "))
        .collect();
    assert_eq!(progress.len(), 10, "a line per batch of 1000: {run:?}");
    assert_eq!(progress[0], "relaybus: requeue: 1000/10000");
    assert_eq!(progress[9], "relaybus: requeue: 10000/10000");
    let stats = target.store.statistics().await.unwrap();
    assert_eq!((stats.dead, stats.pending), (0, 10_000));
    eprintln!(
        "requeue of 10,000 dead letters by filter on {}: {took:?}",
        S::NAME
    );
}

#[tokio::test]
async fn a_filter_requeue_of_ten_thousand_dead_letters_on_mongodb() {
    let db = test_db("cli_requeue").await;
    filter_requeue_of_ten_thousand(mongo_target(&db).await).await;
}

#[tokio::test]
async fn a_filter_requeue_of_ten_thousand_dead_letters_on_postgres() {
    filter_requeue_of_ten_thousand(postgres_target("requeue").await).await;
}

async fn bad_input<S: Store>(target: Target<S>) {
    target.store.setup().await.expect("setup");
    let _bus = load(&target.store).await;
    let refused = |args: &[&str], says: &str| {
        let run = target.run(args);
        assert_eq!(run.code, 2, "{args:?}: {run:?}");
        assert_eq!(run.stderr.lines().count(), 1, "one line: {run:?}");
        assert!(run.stderr.starts_with("relaybus: "), "{run:?}");
        assert!(
            run.stderr.contains(says),
            "{args:?} should say {says:?}: {run:?}"
        );
        assert!(run.stdout.is_empty(), "{run:?}");
    };
    let smtp_id = target
        .ids(DeliveryQuery::new().status(DeliveryStatus::Dead))
        .await
        .remove(0);
    refused(
        &["list", "--handler", "nobody"],
        "unknown handler \"nobody\"",
    );
    refused(
        &["requeue", "--handler", "nobody", "--yes"],
        "unknown handler",
    );
    refused(&["requeue", "not-an-id"], "is not a delivery id");
    refused(&["discard", "12ab", "--yes"], "is not a delivery id");
    refused(&["requeue", &smtp_id, "--handler", "mailer"], "not both");
    refused(&["requeue"], "give their ids");
    refused(&["list", "--created-from", "yesterday"], "is not a time");
    refused(&["list", "--limit", "0"], "--limit");
    refused(&["list", "--state", "sleeping"], "sleeping");
    refused(
        &["list", "--event-type", "no spaces allowed"],
        "--event-type",
    );
    refused(&["purge", "--yes"], "say what to purge");
    refused(&["bury", "--reason", " ", &smtp_id], "--reason");
    refused(&["frobnicate"], "frobnicate");
    assert_eq!(target.dead().await, 6, "nothing was written");

    // A URL that names no store, or none at all.
    let run = |args: &[&str]| {
        Run::of(
            Command::new(binary())
                .args(args)
                .env_remove("RELAYBUS_URL")
                .stdin(Stdio::null())
                .output()
                .unwrap(),
        )
    };
    for (args, says) in [
        (
            &["--url", "http://127.0.0.1/", "stats"][..],
            "names no store",
        ),
        (&["stats"][..], "no store given"),
        (
            &["--url", "mongodb://", "stats"][..],
            "not a MongoDB connection string",
        ),
        (
            &["--url", "postgres://u@h:notaport/db", "stats"][..],
            "not a PostgreSQL URL",
        ),
        (
            &["--url", "mongodb://127.0.0.1/", "stats"][..],
            "--database",
        ),
        (
            &["--url", "mongodb://127.0.0.1/db", "--schema", "s", "stats"][..],
            "--schema is for PostgreSQL",
        ),
        (
            &[
                "--url",
                "postgres://u@127.0.0.1/db",
                "--database",
                "d",
                "stats",
            ][..],
            "for MongoDB",
        ),
    ] {
        let out = run(args);
        assert_eq!(out.code, 2, "{args:?}: {out:?}");
        assert_eq!(out.stderr.lines().count(), 1, "{out:?}");
        assert!(
            out.stderr.contains(says),
            "{args:?} should say {says:?}: {out:?}"
        );
    }
}

#[tokio::test]
async fn bad_input_is_refused_with_exit_code_2_on_mongodb() {
    let db = test_db("cli_bad_input").await;
    bad_input(mongo_target(&db).await).await;
}

#[tokio::test]
async fn bad_input_is_refused_with_exit_code_2_on_postgres() {
    bad_input(postgres_target("bad_input").await).await;
}

async fn tail_shows_a_new_event<S: Store>(target: Target<S>) {
    target.store.setup().await.expect("setup");
    let bus = load(&target.store).await;
    let mut child = Command::new(binary())
        .args(&target.args)
        .args(["--json", "tail"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("tail starts");
    let (lines, received) = std::sync::mpsc::channel::<(Instant, String)>();
    let stdout = child.stdout.take().unwrap();
    let out = lines.clone();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = out.send((Instant::now(), line));
        }
    });
    let stderr = child.stderr.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            let _ = lines.send((Instant::now(), format!("stderr: {line}")));
        }
    });
    let next = |what: &str| {
        received
            .recv_timeout(Duration::from_secs(30))
            .unwrap_or_else(|_| panic!("timed out waiting for {what}"))
    };
    let (_, ready) = next("tail to start");
    assert!(ready.contains("following new deliveries"), "{ready}");

    let published = Instant::now();
    bus.publish(&placed("order-new"))
        .id("order-new")
        .await
        .expect("publish");
    let mut shown = Vec::new();
    while shown.len() < 2 {
        let (at, line) = next("the new deliveries");
        let delivery: Value = serde_json::from_str(&line).unwrap_or_else(|_| panic!("{line}"));
        assert_eq!(
            delivery["event_id"], "order-new",
            "only the new event: {line}"
        );
        shown.push((
            at.duration_since(published),
            delivery["handler"].as_str().unwrap().to_owned(),
        ));
    }
    let _ = child.kill();
    let _ = child.wait();
    shown.sort_by(|a, b| a.1.cmp(&b.1));
    assert_eq!(shown[0].1, "mailer");
    assert_eq!(shown[1].1, "projector");
    assert!(
        shown
            .iter()
            .all(|(after, _)| *after < Duration::from_secs(1)),
        "shown within a second: {shown:?}"
    );
}

#[tokio::test]
async fn tail_shows_an_event_published_by_another_process_on_mongodb() {
    let db = test_db("cli_tail").await;
    tail_shows_a_new_event(mongo_target(&db).await).await;
}

#[tokio::test]
async fn tail_shows_an_event_published_by_another_process_on_postgres() {
    tail_shows_a_new_event(postgres_target("tail").await).await;
}
