//! A consuming service's process killed in the middle of a batch, written once for the three
//! brokers' tests.
//!
//! The consuming store is a PostgreSQL schema of the test's own (`RELAYBUS_TEST_POSTGRES_URL`,
//! default `postgres://postgres@127.0.0.1:5432/test`), which the consumer processes
//! (`relaybus-transport-consumer`) and the test share. The test holds the schema's events
//! table locked, so that a consumer's append waits inside its transaction with a fetched batch
//! in hand: the process is killed there, its transaction never commits, and a new process must
//! take that batch again.
//!
//! The events are [`EVENTS`] of [`KEYS`] keys, the `i`th keyed `k-{i % KEYS}` and numbered
//! `n = i / KEYS`, so each key's events are numbered 0, 1, 2, … in publishing order.

use std::{
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use relaybus::PostgresEventStore;
use sqlx::{PgPool, Postgres, Transaction};

/// How many events cross the broker.
pub const EVENTS: u32 = 500;
/// How many keys they are spread over.
pub const KEYS: u32 = 10;
/// How many of them the first consumer process appends before the store is locked.
pub const BEFORE_THE_CRASH: u32 = 100;
/// How soon after the new consumer process starts the last event must be appended.
pub const RECOVERY: Duration = Duration::from_secs(5);

/// The key and the number of the `i`th event.
pub fn key_and_number(i: u32) -> (String, u32) {
    (format!("k-{}", i % KEYS), i / KEYS)
}

/// The consuming store shared with the consumer processes.
#[derive(Debug)]
pub struct ConsumerCrash {
    binary: String,
    args: Vec<String>,
    url: String,
    pool: PgPool,
    schema: String,
}

impl ConsumerCrash {
    /// Sets up a schema of its own, named after `broker`, for consumer processes run as
    /// `binary` (the path of `relaybus-transport-consumer`) with `args` after the store's URL
    /// and schema.
    pub async fn new(binary: &str, broker: &str, args: Vec<String>) -> ConsumerCrash {
        let url = std::env::var("RELAYBUS_TEST_POSTGRES_URL")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned());
        let pool = PgPool::connect(&url).await.unwrap_or_else(|error| {
            panic!("no PostgreSQL at {url} ({error}); set RELAYBUS_TEST_POSTGRES_URL to one")
        });
        let schema = format!(
            "crash_{broker}_{}_{:08x}",
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
        ConsumerCrash {
            binary: binary.to_owned(),
            args,
            url,
            pool,
            schema,
        }
    }

    /// Starts a consumer process; it dies with the test.
    pub fn spawn(&self) -> Child {
        let mut command = Command::new(&self.binary);
        command
            .arg(&self.url)
            .arg(&self.schema)
            .args(&self.args)
            .stdin(Stdio::null())
            .stdout(Stdio::null());
        relaybus_harness::spawn_tied(command).expect("start the consumer process")
    }

    /// How many events the store holds.
    pub async fn appended(&self) -> u32 {
        let count: i64 =
            sqlx::query_scalar(&format!("SELECT count(*) FROM {}.events", self.schema))
                .fetch_one(&self.pool)
                .await
                .expect("count the events");
        u32::try_from(count).expect("a count")
    }

    /// Waits until the store holds `count` events, polling every 10 ms; fails after 60 s.
    /// Returns when it saw them.
    pub async fn wait_appended(&self, count: u32) -> Instant {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let appended = self.appended().await;
            if appended >= count {
                return Instant::now();
            }
            assert!(
                Instant::now() < deadline,
                "the store holds {appended} of {count} events after 60 s"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Locks the events table against writes until the returned transaction ends: an append
    /// then waits inside its own transaction.
    pub async fn lock_appends(&self) -> Transaction<'static, Postgres> {
        let mut lock = self.pool.begin().await.expect("begin");
        sqlx::query(&format!(
            "LOCK TABLE {}.events IN EXCLUSIVE MODE",
            self.schema
        ))
        .execute(&mut *lock)
        .await
        .expect("lock the events table");
        lock
    }

    /// Waits until an append waits for the lock of [`lock_appends`](Self::lock_appends): a
    /// consumer holds a fetched batch in an open transaction. Fails after 60 s.
    pub async fn wait_append_blocked(&self) {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let waiting: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_locks WHERE NOT granted AND relation = to_regclass($1)",
            )
            .bind(format!("{}.events", self.schema))
            .fetch_one(&self.pool)
            .await
            .expect("read the locks");
            if waiting > 0 {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "no append waited for the lock within 60 s"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Checks that every event is in the store once, each key's in order: the numbers
    /// 0, 1, 2, … under consecutive sequences of the key.
    pub async fn check_once_in_order(&self) {
        let rows: Vec<(String, i64, i64)> = sqlx::query_as(&format!(
            "SELECT key, sequence, (payload->>'n')::bigint FROM {}.events ORDER BY key, sequence",
            self.schema
        ))
        .fetch_all(&self.pool)
        .await
        .expect("read the events");
        check_once_in_order(&rows);
    }

    /// Drops the schema.
    pub async fn drop_schema(self) {
        sqlx::query(&format!("DROP SCHEMA {} CASCADE", self.schema))
            .execute(&self.pool)
            .await
            .expect("drop the test's schema");
    }
}

/// Checks that the store's events, as `(key, sequence, n)` in the order of key and sequence,
/// are every event once, each key's in order: the numbers 0, 1, 2, … under consecutive
/// sequences of the key.
pub fn check_once_in_order(rows: &[(String, i64, i64)]) {
    assert_eq!(rows.len(), EVENTS as usize, "every event once");
    for key in 0..KEYS {
        let key = format!("k-{key}");
        let of_key: Vec<(i64, i64)> = rows
            .iter()
            .filter(|(k, ..)| *k == key)
            .map(|(_, sequence, n)| (*sequence, *n))
            .collect();
        let numbers: Vec<i64> = of_key.iter().map(|(_, n)| *n).collect();
        let expected: Vec<i64> = (0..i64::from(EVENTS / KEYS)).collect();
        assert_eq!(
            numbers, expected,
            "the events of {key}, in the store's order"
        );
        let first = of_key[0].0;
        let sequences: Vec<i64> = of_key.iter().map(|(sequence, _)| *sequence).collect();
        let consecutive: Vec<i64> = (first..first + of_key.len() as i64).collect();
        assert_eq!(sequences, consecutive, "the sequences of {key}");
    }
}

/// The drill, with `publish(from, to)` putting the events `from..to` on the broker: a
/// consumer process appends the first [`BEFORE_THE_CRASH`]; the store is locked, the rest are
/// published, and the process is killed (SIGKILL) once its append waits for the lock; the lock
/// is released and a new process started at once. Checks every event appended once, in each
/// key's order, the last within [`RECOVERY`] of the new process's start, and returns how long
/// that took.
pub async fn drill<F: AsyncFnMut(u32, u32)>(crash: &ConsumerCrash, mut publish: F) -> Duration {
    publish(0, BEFORE_THE_CRASH).await;
    let mut first = crash.spawn();
    crash.wait_appended(BEFORE_THE_CRASH).await;
    let lock = crash.lock_appends().await;
    publish(BEFORE_THE_CRASH, EVENTS).await;
    crash.wait_append_blocked().await;
    relaybus_harness::kill_tied(&mut first);
    lock.rollback().await.expect("release the lock");
    let started = Instant::now();
    let mut second = crash.spawn();
    let took = crash.wait_appended(EVENTS).await - started;
    crash.check_once_in_order().await;
    relaybus_harness::kill_tied(&mut second);
    assert!(
        took <= RECOVERY,
        "the last event was appended {took:?} after the new consumer started, not within \
         {RECOVERY:?}"
    );
    took
}
