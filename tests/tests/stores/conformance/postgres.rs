//! The store conformance suite (`relaybus_tests::conformance`) for the PostgreSQL store: every
//! test on a schema of its own, with a second store instance (its own pool) for the
//! `_instances` tests; then the idempotent requests suite (`relaybus_tests::idempotency`) on it.
//!
//! The server is `RELAYBUS_TEST_POSTGRES_URL` (default `postgres://postgres@127.0.0.1:5432/test`);
//! a test fails, never skips, when it does not answer.

use relaybus::PostgresEventStore;
use sqlx::{Connection, PgConnection, PgPool, postgres::PgPoolOptions};

/// The server's URL.
fn url() -> String {
    std::env::var("RELAYBUS_TEST_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned())
}

/// A pool on the test server, or a failure that says how to get one.
async fn pool() -> PgPool {
    let url = url();
    PgPoolOptions::new()
        .max_connections(6)
        .acquire_timeout(std::time::Duration::from_secs(30))
        .connect(&url)
        .await
        .unwrap_or_else(|e| {
            panic!(
                "PostgreSQL at {url} does not answer ({e}); start PostgreSQL 15 or newer there, \
                 or set RELAYBUS_TEST_POSTGRES_URL to the URL of a server and database where the \
                 user may create schemas"
            )
        })
}

/// The test's schema: its name, unique to this process, within the store's 48 characters.
fn schema_of(test: &str) -> String {
    let hash = test.bytes().fold(0x811c_9dc5_u32, |h, b| {
        (h ^ u32::from(b)).wrapping_mul(0x0100_0193)
    });
    let prefix: String = test.chars().take(24).collect();
    format!("c{}_{hash:08x}_{prefix}", std::process::id())
}

/// Drops the test's schema when the test ends, passed or failed.
struct Schema {
    name: String,
}

impl Drop for Schema {
    fn drop(&mut self) {
        let (url, name) = (url(), self.name.clone());
        // The test's runtime is going away: drop it on a thread with a runtime of its own.
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

/// A set-up store on a fresh schema named after the test; the guard drops the schema.
async fn postgres_store(test: &'static str) -> (PostgresEventStore, Schema) {
    let schema = Schema {
        name: schema_of(test),
    };
    let pool = pool().await;
    sqlx::query(&format!(
        "DROP SCHEMA IF EXISTS \"{}\" CASCADE",
        schema.name
    ))
    .execute(&pool)
    .await
    .expect("a leftover schema dropped");
    let store = PostgresEventStore::builder(pool)
        .schema(&schema.name)
        .build()
        .expect("valid options");
    store.setup().await.expect("setup");
    (store, schema)
}

/// Another store instance on the test's schema, through a pool of its own, as a second
/// process would open it.
async fn second_instance(schema: &Schema) -> PostgresEventStore {
    let store = PostgresEventStore::builder(pool().await)
        .schema(&schema.name)
        .build()
        .expect("valid options");
    store.setup().await.expect("setup of the second instance");
    store
}

relaybus_tests::conformance_tests!(postgres_store, second_instance);
relaybus_tests::idempotency_tests!(postgres_store);
