//! Two consumer processes of one consumer (`relaybus-transport-consumer`, one name and topic on
//! one store) share a topic's partitions through the store's leads, and one takes over the
//! partitions of the other once it was killed, within the lease.

use std::{
    collections::BTreeSet,
    io::{BufRead, BufReader},
    process::{Child, Command, Stdio},
    sync::Arc,
    time::{Duration, Instant},
};

use mongodb::bson::{Document, doc};
use relaybus::{
    MongoEventStore, PostgresEventStore, RelayBus, store::Leadership,
    transport::kafka::KafkaConsumer,
};
use relaybus_harness::TestDb;
use relaybus_tests::consumer_crash::{self, EVENTS};
use sqlx::PgPool;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::{Topics, broker_url, placed, shop};

/// The lease of the consumer processes: short, so that the test is.
const LEASE: Duration = Duration::from_millis(1_500);

/// How soon the partitions of a killed process must be read by the other: the lease, the
/// third of it between two rounds, and a margin for a loaded machine.
const TAKE_OVER: Duration = Duration::from_millis(1_500 + 500 + 1_500);

/// The partitions a consumer process said it reads.
#[derive(Debug)]
struct Said {
    process: usize,
    reading: BTreeSet<u32>,
}

/// The consuming store the processes share, and what the test reads of it.
enum Shared {
    Mongo {
        db: TestDb,
        store: MongoEventStore,
    },
    Postgres {
        pool: PgPool,
        url: String,
        schema: String,
    },
}

impl Shared {
    async fn mongo() -> Shared {
        let db = relaybus_harness::test_db("kafka_share").await;
        let store = MongoEventStore::builder(db.client.clone())
            .database(&db.name)
            .build()
            .expect("valid store");
        store.setup().await.expect("set up the consuming store");
        Shared::Mongo { db, store }
    }

    async fn postgres() -> Shared {
        let url = std::env::var("RELAYBUS_TEST_POSTGRES_URL")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned());
        let pool = PgPool::connect(&url).await.unwrap_or_else(|error| {
            panic!("no PostgreSQL at {url} ({error}); set RELAYBUS_TEST_POSTGRES_URL to one")
        });
        let schema = format!(
            "kafka_share_{}_{:08x}",
            std::process::id(),
            rand::random::<u32>()
        );
        PostgresEventStore::builder(pool.clone())
            .schema(schema.clone())
            .build()
            .expect("valid schema")
            .setup()
            .await
            .expect("set up the consuming store");
        Shared::Postgres { pool, url, schema }
    }

    fn name(&self) -> &'static str {
        match self {
            Shared::Mongo { .. } => "MongoDB",
            Shared::Postgres { .. } => "PostgreSQL",
        }
    }

    /// The store's URL and namespace, as the consumer process takes them.
    fn location(&self) -> [String; 2] {
        match self {
            Shared::Mongo { db, .. } => [db.uri.clone(), db.name.clone()],
            Shared::Postgres { url, schema, .. } => [url.clone(), schema.clone()],
        }
    }

    /// The events as `(key, sequence, n)`, in the order of key and sequence.
    async fn rows(&self) -> Vec<(String, i64, i64)> {
        match self {
            Shared::Mongo { db, store } => {
                let events = db
                    .db()
                    .collection::<Document>(&store.collection_name("events"));
                let mut found = events
                    .find(doc! {})
                    .sort(doc! { "key": 1, "sequence": 1 })
                    .await
                    .expect("read the events");
                let mut rows = Vec::new();
                while found.advance().await.expect("read the events") {
                    let event = found.deserialize_current().expect("an event");
                    let payload = event.get_document("payload").expect("a payload");
                    let number = |field: Option<&mongodb::bson::Bson>| match field {
                        Some(mongodb::bson::Bson::Int32(n)) => i64::from(*n),
                        Some(mongodb::bson::Bson::Int64(n)) => *n,
                        other => panic!("not a number: {other:?}"),
                    };
                    rows.push((
                        event.get_str("key").expect("a key").to_owned(),
                        number(event.get("sequence")),
                        number(payload.get("n")),
                    ));
                }
                rows
            }
            Shared::Postgres { pool, schema, .. } => sqlx::query_as(&format!(
                "SELECT key, sequence, (payload->>'n')::bigint FROM {schema}.events \
                 ORDER BY key, sequence"
            ))
            .fetch_all(pool)
            .await
            .expect("read the events"),
        }
    }

    /// Waits until the store holds `count` events; fails after 60 s.
    async fn wait_appended(&self, count: usize) {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let appended = self.rows().await.len();
            if appended >= count {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "the store holds {appended} of {count} events after 60 s"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    async fn drop(self) {
        match self {
            Shared::Mongo { db, .. } => db.db().drop().await.expect("drop the test's database"),
            Shared::Postgres { pool, schema, .. } => {
                sqlx::query(&format!("DROP SCHEMA {schema} CASCADE"))
                    .execute(&pool)
                    .await
                    .expect("drop the test's schema");
            }
        }
    }
}

/// Starts consumer process number `process` of the consumer `shipping` of `topic`, which sends
/// what it says it reads to `said`.
fn spawn(
    shared: &Shared,
    topic: &str,
    process: usize,
    said: &mpsc::UnboundedSender<Said>,
) -> Child {
    let mut command = Command::new(env!("CARGO_BIN_EXE_relaybus-transport-consumer"));
    command
        .args(shared.location())
        .args(["kafka", &broker_url(), topic, "shipping"])
        .arg(LEASE.as_millis().to_string())
        .stdin(Stdio::null())
        .stdout(Stdio::piped());
    let mut child = relaybus_harness::spawn_tied(command).expect("start the consumer process");
    let stdout = child.stdout.take().expect("the process's output");
    let said = said.clone();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            let Some(listed) = line.strip_prefix("assigned ") else {
                continue;
            };
            let reading = listed
                .split(',')
                .filter(|p| !p.is_empty())
                .map(|p| p.parse().expect("a partition"))
                .collect();
            if said.send(Said { process, reading }).is_err() {
                break;
            }
        }
    });
    child
}

/// What each process reads now, as it last said.
struct Assignments {
    said: mpsc::UnboundedReceiver<Said>,
    reading: [BTreeSet<u32>; 2],
    /// How many times either said something.
    changes: usize,
}

impl Assignments {
    /// Waits until `done` holds of what the processes read; fails after `within`.
    async fn wait(
        &mut self,
        what: &str,
        within: Duration,
        done: impl Fn(&[BTreeSet<u32>; 2]) -> bool,
    ) {
        let deadline = tokio::time::Instant::now() + within;
        while !done(&self.reading) {
            match tokio::time::timeout_at(deadline, self.said.recv()).await {
                Ok(Some(said)) => {
                    self.reading[said.process] = said.reading;
                    self.changes += 1;
                }
                Ok(None) => panic!("the consumer processes stopped talking; {what}"),
                Err(_) => panic!(
                    "not within {within:?}: {what}; they read {:?}",
                    self.reading
                ),
            }
        }
    }

    /// Takes in what the processes said meanwhile, without waiting.
    fn catch_up(&mut self) {
        while let Ok(said) = self.said.try_recv() {
            self.reading[said.process] = said.reading;
            self.changes += 1;
        }
    }
}

/// The drill on `shared`: two processes settle on two partitions each, disjoint; half the
/// events are appended with nothing moving; one process is killed and the other reads all four
/// partitions within [`TAKE_OVER`]; the other half is published meanwhile. Every event is
/// appended once, each key's in order.
async fn share_and_take_over(shared: &Shared) {
    let topics = Topics::new("share", 4).await;
    let relay = topics.relay();
    let (_, shop_bus) = shop(&relay);
    let publish = async |from: u32, to: u32| {
        for i in from..to {
            let (key, n) = consumer_crash::key_and_number(i);
            shop_bus.publish(&placed(&key, n)).key(key).await.unwrap();
        }
        let relayed = shop_bus.run_until_idle().await.unwrap();
        assert_eq!(relayed.succeeded().count(), (to - from) as usize);
    };

    let (said, heard) = mpsc::unbounded_channel();
    let mut processes = [
        spawn(shared, &topics.topic, 0, &said),
        spawn(shared, &topics.topic, 1, &said),
    ];
    let mut assignments = Assignments {
        said: heard,
        reading: Default::default(),
        changes: 0,
    };
    let all: BTreeSet<u32> = (0..4).collect();
    let shared_out = |reading: &[BTreeSet<u32>; 2]| {
        reading[0].len() == 2
            && reading[1].len() == 2
            && reading[0].is_disjoint(&reading[1])
            && reading[0]
                .union(&reading[1])
                .copied()
                .collect::<BTreeSet<u32>>()
                == all
    };
    assignments
        .wait(
            "each process reads two partitions of its own",
            Duration::from_secs(30),
            shared_out,
        )
        .await;
    let settled = assignments.reading.clone();
    let changes = assignments.changes;

    publish(0, EVENTS / 2).await;
    shared.wait_appended((EVENTS / 2) as usize).await;
    assignments.catch_up();
    assert_eq!(
        (assignments.changes, &assignments.reading),
        (changes, &settled),
        "a partition moved while both processes ran"
    );

    relaybus_harness::kill_tied(&mut processes[0]);
    let killed = Instant::now();
    publish(EVENTS / 2, EVENTS).await;
    assignments
        .wait(
            "the other process reads every partition",
            Duration::from_secs(30),
            |reading| reading[1] == all,
        )
        .await;
    let took = killed.elapsed();
    shared.wait_appended(EVENTS as usize).await;
    consumer_crash::check_once_in_order(&shared.rows().await);
    relaybus_harness::kill_tied(&mut processes[1]);
    eprintln!(
        "{}: the killed process's partitions were read by the other {took:?} after the kill",
        shared.name()
    );
    assert!(
        took <= TAKE_OVER,
        "the killed process's partitions {:?} were read by the other {took:?} after the kill, \
         not within {TAKE_OVER:?}",
        settled[0]
    );
}

/// Two consumer processes on one topic of 4 partitions and one MongoDB database: each
/// partition is read by exactly one of them; one is killed (SIGKILL) and its partitions are
/// read by the other within the lease; every event is appended once, each key's in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_consumer_processes_share_the_partitions_on_mongodb() {
    let shared = Shared::mongo().await;
    share_and_take_over(&shared).await;
    shared.drop().await;
}

/// The same on one PostgreSQL schema.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_consumer_processes_share_the_partitions_on_postgres() {
    let shared = Shared::postgres().await;
    share_and_take_over(&shared).await;
    shared.drop().await;
}

/// A reader whose lead another store instance took over (here by hand: its own instance resigns
/// each partition's lead, `kafka/<topic>/<name>/p<partition>`, and another takes it for an
/// hour) appends nothing more and stops at its next batch, long before its process's next
/// round would notice: the append's transaction keeps the lead first, and finds it lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reader_whose_lead_was_taken_appends_nothing_more() {
    let shared = Shared::postgres().await;
    let Shared::Postgres { pool, schema, .. } = &shared else {
        unreachable!()
    };
    let instance = || {
        PostgresEventStore::builder(pool.clone())
            .schema(schema.clone())
            .build()
            .expect("valid store")
    };
    let (ours, theirs) = (instance(), instance());
    let topics = Topics::new("fence", 4).await;
    let relay = topics.relay();
    let (_, shop_bus) = shop(&relay);
    let bus = RelayBus::builder(ours.clone())
        .without_registered_handlers()
        .build()
        .expect("shipping bus");
    // Rounds every 20 s: only the fence can stop the readers within the test.
    let consumer = KafkaConsumer::builder(Arc::clone(&topics.client), &topics.topic, "shipping")
        .lease(Duration::from_secs(60))
        .fetch_wait(Duration::from_millis(50))
        .retry_delay(Duration::from_millis(50))
        .build()
        .expect("valid consumer settings");
    let mut assignment = consumer.assignment();
    let shutdown = CancellationToken::new();
    let running = tokio::spawn({
        let consumer = consumer.clone();
        let shutdown = shutdown.clone();
        async move { consumer.run(&bus, shutdown).await }
    });
    let all: Vec<u32> = (0..4).collect();
    tokio::time::timeout(
        Duration::from_secs(30),
        assignment.wait_for(|reading| *reading == all),
    )
    .await
    .expect("the consumer reads every partition")
    .expect("the consumer runs");

    for partition in 0..4 {
        let role = format!("kafka/{}/shipping/p{partition}", topics.topic);
        ours.resign(&role).await.expect("resign");
        assert!(
            theirs
                .lead(&role, Duration::from_secs(3600))
                .await
                .expect("lead"),
            "{role} taken by the other instance"
        );
    }
    // Forty keys: each partition gets some.
    for i in 0..80 {
        let key = format!("k-{}", i % 40);
        shop_bus
            .publish(&placed(&key, i / 40))
            .key(key)
            .await
            .unwrap();
    }
    shop_bus.run_until_idle().await.unwrap();
    tokio::time::timeout(Duration::from_secs(10), assignment.wait_for(Vec::is_empty))
        .await
        .expect("every reader stops at its next batch")
        .expect("the consumer runs");
    assert_eq!(
        shared.rows().await.len(),
        0,
        "appended by readers that lost their leads"
    );
    shutdown.cancel();
    let report = running.await.expect("the run");
    assert_eq!(report.appended, 0, "{report:?}");
    assert!(
        report.fetched > 0 && report.retried == report.fetched,
        "{report:?}"
    );
    shared.drop().await;
}
