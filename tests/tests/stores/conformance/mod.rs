//! The store conformance suite (`relaybus_tests::conformance`) run for every store relaybus
//! ships, one module per store: `cargo test -p relaybus-tests --test stores conformance::memory`
//! runs the in-memory store's, which needs no server. Each module also runs the idempotent
//! requests suite (`relaybus_tests::idempotency`): relaybus-axum's `IdempotencyLayer` through
//! the router, on that store.

mod postgres;

/// MongoDB: every test on a database of its own, with a second store instance for the
/// `_instances` tests.
mod mongo {
    use mongodb::Client;
    use relaybus::MongoEventStore;
    use relaybus_harness::{TestDb, test_db};

    /// A set-up store on a fresh database named after the test. The [`TestDb`] is the guard:
    /// it names the database for [`second_instance`] and holds the test's client.
    async fn mongo_store(test: &'static str) -> (MongoEventStore, TestDb) {
        let db = test_db(&format!("conf_{test}")).await;
        let store = MongoEventStore::builder(db.client.clone())
            .database(&db.name)
            .build()
            .expect("valid options");
        store.setup().await.expect("setup");
        (store, db)
    }

    /// Another store instance on the test's database, through a client of its own, as a
    /// second process would open it.
    async fn second_instance(db: &TestDb) -> MongoEventStore {
        let client = Client::with_uri_str(&db.uri)
            .await
            .expect("a second client");
        let store = MongoEventStore::builder(client)
            .database(&db.name)
            .build()
            .expect("valid options");
        store.setup().await.expect("setup of the second instance");
        store
    }

    relaybus_tests::conformance_tests!(mongo_store, second_instance);
    relaybus_tests::idempotency_tests!(mongo_store);
}

/// The in-memory store: a fresh store per test. It lives in one process, so it has no second
/// instance, and the `_instances` tests are left out.
mod memory {
    use relaybus::MemoryEventStore;

    /// A new, empty store; there is nothing to guard.
    async fn memory_store(_test: &'static str) -> (MemoryEventStore, ()) {
        (MemoryEventStore::new(), ())
    }

    relaybus_tests::conformance_tests!(memory_store);
    relaybus_tests::idempotency_tests!(memory_store);
}
