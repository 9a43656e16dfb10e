//! The bad-input catalogue: every public entry point fed malformed input, on a real replica set.
//!
//! Organised by entry point: the store builder, the bus builder, publishing and appending, lease
//! tokens, claims, the operator calls of the store, the operator routes and request
//! transactions of relaybus-axum, and what `#[event]` and `#[handler]` leave to run time. Each test asserts the exact error
//! variant, that its message says what is wrong and what is accepted, and that nothing was
//! written: either the database has no collection at all (nothing was ever set up), or every
//! document of every collection is the same before and after.
//!
//! The registry of this binary holds a handler whose retry settings only fail at run time (see
//! the last section), so every bus here picks its registered handlers explicitly.

use std::{
    collections::{BTreeMap, HashMap},
    sync::atomic::{AtomicU32, Ordering},
    time::Duration,
};

use axum::{
    Router,
    body::Body,
    http::{Request, Response, StatusCode, header::CONTENT_TYPE},
};
use mongodb::{
    Client,
    bson::{DateTime, Document, doc, oid::ObjectId},
    options::{ReadConcern, TransactionOptions},
};
use relaybus::{
    AppendRequest, BoxError, ConfigurationError, DeliveryQuery, DeliveryStatus, Error, Event,
    EventEnvelope, EventValidationError, Lease, LeaseError, MongoEventStore, PurgeOptions,
    RelayBus, RelayBusBuilder, Retention, RetryPolicy, State, Subscription,
};
use relaybus_harness::{TestDb, test_db};
use relaybus_tests::support::{all, bare_store, noop, store};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use tower::ServiceExt;

// ---------------------------------------------------------------------------------------------
// Events and helpers

#[derive(Debug, Clone, Serialize, Deserialize)]
struct OrderPlaced {
    order_id: String,
    total_cents: u64,
}

impl Event for OrderPlaced {
    const TYPE: &'static str = "badin.order.placed.v1";
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct OrderShipped {
    order_id: String,
}

impl Event for OrderShipped {
    const TYPE: &'static str = "badin.order.shipped.v1";
}

/// An event whose type name breaks the naming rule.
#[derive(Debug, Serialize, Deserialize)]
struct Shouted {
    text: String,
}

impl Event for Shouted {
    const TYPE: &'static str = "Order Placed";
}

/// Serializes to a JSON number.
#[derive(Debug, Serialize, Deserialize)]
struct Counted(u32);

impl Event for Counted {
    const TYPE: &'static str = "badin.counted.v1";
}

/// Serializes to a JSON array.
#[derive(Debug, Serialize, Deserialize)]
struct Listed(Vec<u32>);

impl Event for Listed {
    const TYPE: &'static str = "badin.listed.v1";
}

/// Serializes to JSON null.
#[derive(Debug, Serialize, Deserialize)]
struct Nothing;

impl Event for Nothing {
    const TYPE: &'static str = "badin.nothing.v1";
}

/// Nests as deep as its chain of parts.
#[derive(Debug, Serialize, Deserialize)]
struct Part {
    inner: Option<Box<Part>>,
}

impl Event for Part {
    const TYPE: &'static str = "badin.part.v1";
}

/// A check that an error matches `pattern`, for tables of cases.
macro_rules! is {
    ($pattern:pat $(if $guard:expr)?) => {
        |e: &Error| matches!(e, $pattern $(if $guard)?)
    };
}

fn parts(depth: usize) -> Part {
    let mut part = Part { inner: None };
    for _ in 1..depth {
        part = Part {
            inner: Some(Box::new(part)),
        };
    }
    part
}

/// A JSON object with `depth` objects nested in one another, itself counted.
fn nested(depth: usize) -> Value {
    let mut value = json!(1);
    for _ in 0..depth {
        value = json!({ "a": value });
    }
    value
}

/// Does not serialize to JSON at all: map keys must be strings.
#[derive(Debug, Serialize, Deserialize)]
struct Grid {
    cells: HashMap<(u8, u8), u8>,
}

impl Event for Grid {
    const TYPE: &'static str = "badin.grid.v1";
}

fn placed(id: &str) -> OrderPlaced {
    OrderPlaced {
        order_id: id.to_owned(),
        total_cents: 1250,
    }
}

/// A bus builder that leaves the handlers registered in this binary out.
fn bus_builder(store: &MongoEventStore) -> RelayBusBuilder {
    RelayBus::builder(store.clone()).without_registered_handlers()
}

/// A bus subscribing no-op handlers of [`OrderPlaced`].
fn bus(store: &MongoEventStore, handlers: &[&str]) -> RelayBus {
    let mut builder = bus_builder(store);
    for id in handlers {
        builder = builder.subscribe(noop::<OrderPlaced>(id));
    }
    builder.build().expect("valid bus")
}

/// The store instance's crash-recovery record: its heartbeat moves on by itself, whatever was
/// refused.
const PROCESSES: &str = "relaybus_processes";

/// Every document of every collection of the test database, by collection, in `_id` order.
async fn contents(db: &TestDb) -> BTreeMap<String, Vec<Document>> {
    let mut collections = BTreeMap::new();
    for name in db.db().list_collection_names().await.unwrap() {
        if name.starts_with("system.") || name == PROCESSES {
            continue;
        }
        let documents = all(db, &name).await;
        collections.insert(name, documents);
    }
    collections
}

/// How many documents the collections of the test database hold, in all.
fn total(contents: &BTreeMap<String, Vec<Document>>) -> usize {
    contents.values().map(Vec::len).sum()
}

/// Asserts that the database is exactly as `before`.
async fn assert_unchanged(db: &TestDb, before: &BTreeMap<String, Vec<Document>>, what: &str) {
    let after = contents(db).await;
    assert_eq!(
        after.keys().collect::<Vec<_>>(),
        before.keys().collect::<Vec<_>>(),
        "{what}: the collections changed"
    );
    for (name, documents) in before {
        assert_eq!(
            &after[name],
            documents,
            "{what}: {name} changed ({} documents before, {} after)",
            documents.len(),
            after[name].len()
        );
    }
}

/// Asserts that nothing was ever created in the test database.
async fn assert_no_collections(db: &TestDb) {
    let mut names = db.db().list_collection_names().await.unwrap();
    names.retain(|name| name != PROCESSES);
    assert!(names.is_empty(), "collections were created: {names:?}");
}

/// Asserts that `message` contains every one of `parts`.
#[track_caller]
fn says(message: &str, parts: &[&str]) {
    for part in parts {
        assert!(message.contains(part), "{message:?} does not say {part:?}");
    }
}

async fn no_transaction_session(db: &TestDb) -> mongodb::ClientSession {
    db.client.start_session().await.unwrap()
}

// ---------------------------------------------------------------------------------------------
// The store builder

#[tokio::test]
async fn store_builder_refuses_bad_database_names_prefixes_and_batch_sizes() {
    let db = test_db("bi_store_opts").await;
    let builder = || MongoEventStore::builder(db.client.clone());

    let long_name = "d".repeat(64);
    let bad_names: [(&str, &str); 11] = [
        ("", "it is empty"),
        ("has.dot", "a character other than"),
        ("has space", "a character other than"),
        ("dollar$", "a character other than"),
        ("slash/", "a character other than"),
        ("nul\0", "a character other than"),
        ("é", "a character other than"),
        (&long_name, "longer than 63"),
        ("admin", "reserved"),
        ("local", "reserved"),
        ("config", "reserved"),
    ];
    for (name, reason) in bad_names {
        let error = builder().database(name).build().unwrap_err();
        assert!(
            matches!(&error, ConfigurationError::InvalidDatabaseName { name: n, .. } if n == name),
            "{name:?}: {error:?}"
        );
        says(&error.to_string(), &[reason, "use 1 to 63 characters"]);
        // The same error reaches callers of the crate's own `Error`.
        assert!(matches!(Error::from(error), Error::Configuration(_)));
    }

    let long_prefix = "p".repeat(33);
    let bad_prefixes: [(&str, &str); 7] = [
        ("bad$", "a character other than"),
        ("with space", "a character other than"),
        ("nul\0", "a character other than"),
        ("system.", "reserved by MongoDB"),
        ("system.relaybus_", "reserved by MongoDB"),
        (".hidden", "cannot start with `.`"),
        (&long_prefix, "longer than 32"),
    ];
    for (prefix, reason) in bad_prefixes {
        let error = builder()
            .database(&db.name)
            .collection_prefix(prefix)
            .build()
            .unwrap_err();
        assert!(
            matches!(&error, ConfigurationError::InvalidCollectionPrefix { prefix: p, .. } if p == prefix),
            "{prefix:?}: {error:?}"
        );
        says(&error.to_string(), &[reason, "use up to 32 characters"]);
    }

    for size in [0, 100_001, u32::MAX] {
        let error = builder()
            .database(&db.name)
            .purge_batch_size(size)
            .build()
            .unwrap_err();
        assert!(
            matches!(
                error,
                ConfigurationError::InvalidOption {
                    option: "purge_batch_size",
                    ..
                }
            ),
            "{size}: {error:?}"
        );
        says(&error.to_string(), &[&size.to_string(), "use 1 to 100000"]);
    }

    // No database in the builder and none in the connection string.
    let no_default = Client::with_uri_str(&db.uri).await.unwrap();
    assert!(no_default.default_database().is_none(), "{}", db.uri);
    let error = MongoEventStore::builder(no_default).build().unwrap_err();
    assert_eq!(error, ConfigurationError::MissingDatabase);
    says(&error.to_string(), &[".database(\"name\")"]);

    // The limits themselves are accepted.
    for size in [1, 100_000] {
        builder()
            .database(&db.name)
            .purge_batch_size(size)
            .build()
            .unwrap();
    }
    builder()
        .database("d".repeat(63))
        .collection_prefix("p".repeat(32))
        .build()
        .unwrap();

    // Building never touches the database.
    assert_no_collections(&db).await;
}

#[tokio::test]
async fn store_transaction_options_the_server_refuses_fail_the_transaction_and_write_nothing() {
    let db = test_db("bi_store_txn_opts").await;
    store(&db).await;
    let before = contents(&db).await;
    // Transactions cannot read with a linearizable read concern: the options are valid on
    // their own, only the server refuses them, at the first read or write of a transaction.
    let options = TransactionOptions::builder()
        .read_concern(ReadConcern::linearizable())
        .build();
    let refused = MongoEventStore::builder(db.client.clone())
        .database(&db.name)
        .transaction_options(options)
        .build()
        .expect("the builder leaves transaction options to the server");
    let bus = bus(&refused, &["a"]);
    let orders = db.db().collection::<Document>("orders");
    let outcome: Result<(), Error> = bus
        .transaction(async |session| {
            orders
                .insert_one(doc! { "_id": "o-1" })
                .session(&mut *session)
                .await?;
            bus.publish(&placed("o-1")).session(session).await?;
            Ok(())
        })
        .await;
    let error = outcome.unwrap_err();
    assert!(matches!(error, Error::Database(_)), "{error:?}");
    says(
        &error.to_string(),
        &["database error", "readConcern level must be"],
    );
    let error = bus.publish(&placed("o-2")).await.unwrap_err();
    assert!(matches!(error, Error::Database(_)), "{error:?}");
    assert_unchanged(&db, &before, "transactions the server refused").await;
}

#[tokio::test]
async fn store_transaction_budgets_out_of_range_are_refused_before_the_body_runs() {
    let db = test_db("bi_store_budget").await;
    let store = store(&db).await;
    let bus = bus(&store, &["a"]);
    let before = contents(&db).await;
    let runs = AtomicU32::new(0);
    for budget in [Duration::ZERO, Duration::from_secs(61), Duration::MAX] {
        let outcome: Result<(), Error> = store
            .transaction_within(budget, async |session| {
                runs.fetch_add(1, Ordering::SeqCst);
                bus.publish(&placed("o-1")).session(session).await?;
                Ok(())
            })
            .await;
        match outcome {
            Err(Error::InvalidArgument(error)) => {
                assert_eq!(error.argument(), "budget", "{error}");
                says(&error.to_string(), &["use 1 ms to 60 s"]);
            }
            other => panic!("{budget:?}: {other:?}"),
        }
    }
    assert_eq!(runs.load(Ordering::SeqCst), 0, "the body ran");
    assert_unchanged(&db, &before, "transactions with a bad budget").await;
}

// ---------------------------------------------------------------------------------------------
// The bus builder, start and purge

#[tokio::test]
async fn bus_builder_refuses_settings_out_of_range_before_any_database_call() {
    let db = test_db("bi_bus_settings").await;
    let store = bare_store(&db);
    let b = || bus_builder(&store);
    let cases: Vec<(&str, &str, RelayBusBuilder)> = vec![
        ("batch_size", "use 1 to 1000", b().batch_size(0)),
        ("batch_size", "use 1 to 1000", b().batch_size(1_001)),
        ("concurrency", "use 1 to 10000", b().concurrency(0)),
        ("concurrency", "use 1 to 10000", b().concurrency(10_001)),
        (
            "lease_duration",
            "longer than the poll interval",
            b().poll_interval(Duration::from_secs(5))
                .lease_duration(Duration::from_secs(5)),
        ),
        (
            "lease_duration",
            "longer than the poll interval",
            b().poll_interval(Duration::from_secs(5))
                .lease_duration(Duration::from_secs(1)),
        ),
        (
            "lease_duration",
            "at most 7 days",
            b().lease_duration(Duration::from_secs(8 * 86_400)),
        ),
        (
            "poll_interval",
            "use 1 ms to 1 hour",
            b().poll_interval(Duration::ZERO),
        ),
        (
            "poll_interval",
            "use 1 ms to 1 hour",
            b().poll_interval(Duration::from_secs(3_601)),
        ),
        ("owner", "use 1 to 256 bytes", b().owner("")),
        ("owner", "use 1 to 256 bytes", b().owner("w".repeat(257))),
        ("owner", "use 1 to 256 bytes", b().owner("line\nbreak")),
        (
            "shutdown_timeout",
            "use at most 1 hour",
            b().shutdown_timeout(Duration::from_secs(3_601)),
        ),
        (
            "retention",
            "purge at most once a second",
            b().retention(Some(Retention {
                interval: Duration::from_millis(999),
                ..Retention::default()
            })),
        ),
        ("retry", "use 1 to 1000", b().retry(RetryPolicy::new(0))),
        ("retry", "use 1 to 1000", b().retry(RetryPolicy::new(1_001))),
        (
            "retry",
            "initial_backoff is zero",
            b().retry(RetryPolicy::new(3).initial_backoff(Duration::ZERO)),
        ),
        (
            "retry",
            "shorter than initial_backoff",
            b().retry(
                RetryPolicy::new(3)
                    .initial_backoff(Duration::from_secs(10))
                    .max_backoff(Duration::from_secs(1)),
            ),
        ),
        (
            "retry",
            "over a day",
            b().retry(RetryPolicy::new(3).max_backoff(Duration::from_secs(86_401))),
        ),
        (
            "transaction_timeout",
            "use 1 ms to 60 s",
            b().transaction_timeout(Duration::ZERO),
        ),
        (
            "transaction_timeout",
            "use 1 ms to 60 s",
            b().transaction_timeout(Duration::from_secs(61)),
        ),
        (
            "transaction_retry_limit",
            "use 1 ms to 10 minutes",
            b().transaction_retry_limit(Duration::ZERO),
        ),
        (
            "transaction_retry_limit",
            "use 1 ms to 10 minutes",
            b().transaction_retry_limit(Duration::from_secs(601)),
        ),
    ];
    for (option, hint, builder) in cases {
        match builder.build() {
            Err(ConfigurationError::InvalidOption {
                option: got,
                reason,
            }) => {
                assert_eq!(got, option, "{reason}");
                says(&reason, &[hint]);
            }
            other => panic!("{option}: expected an invalid option, got {other:?}"),
        }
    }
    // The limits themselves are accepted.
    b().batch_size(1_000)
        .concurrency(10_000)
        .owner("w".repeat(256))
        .poll_interval(Duration::from_millis(1))
        .lease_duration(Duration::from_secs(7 * 86_400))
        .transaction_timeout(Duration::from_secs(60))
        .build()
        .unwrap();
    assert_no_collections(&db).await;
}

#[tokio::test]
async fn bus_builder_refuses_bad_subscriptions_naming_the_handler() {
    let db = test_db("bi_bus_subs").await;
    let store = bare_store(&db);

    let long_id = "h".repeat(129);
    for (id, reason) in [
        ("", "it is empty"),
        ("has space", "a character other than"),
        ("slash/", "a character other than"),
        ("dollar$", "a character other than"),
        (&long_id, "longer than 128 bytes"),
    ] {
        let error = bus_builder(&store)
            .subscribe(noop::<OrderPlaced>(id))
            .build()
            .unwrap_err();
        assert!(
            matches!(&error, ConfigurationError::InvalidHandlerId { id: got, .. } if got == id),
            "{id:?}: {error:?}"
        );
        says(&error.to_string(), &[reason, "use 1 to 128 characters"]);
    }

    // One id twice, for two event types: both are named.
    let error = bus_builder(&store)
        .subscribe(noop::<OrderPlaced>("twice"))
        .subscribe(noop::<OrderShipped>("twice"))
        .build()
        .unwrap_err();
    assert!(
        matches!(&error, ConfigurationError::DuplicateHandlerId { id, .. } if id == "twice"),
        "{error:?}"
    );
    says(
        &error.to_string(),
        &[
            "\"twice\"",
            OrderPlaced::TYPE,
            OrderShipped::TYPE,
            "give each handler its own id",
        ],
    );

    // A retry policy of one subscription: the error names the handler it belongs to.
    let error = bus_builder(&store)
        .subscribe(noop::<OrderPlaced>("fine"))
        .subscribe(noop::<OrderPlaced>("hasty").retry(RetryPolicy::new(0)))
        .build()
        .unwrap_err();
    match &error {
        ConfigurationError::InvalidOption { option, reason } => {
            assert_eq!(*option, "retry");
            says(reason, &["\"hasty\"", "use 1 to 1000"]);
        }
        other => panic!("{other:?}"),
    }

    // A subscription to an event type whose name no event can have would never run.
    let error = bus_builder(&store)
        .subscribe(noop::<Shouted>("listener"))
        .build()
        .unwrap_err();
    match &error {
        ConfigurationError::InvalidOption { option, reason } => {
            assert_eq!(*option, "subscribe");
            says(
                reason,
                &["\"listener\"", "\"Order Placed\"", "order.placed.v1"],
            );
        }
        other => panic!("{other:?}"),
    }

    // A handler taking state the bus was never given: the error names the handler and type.
    #[derive(Clone)]
    struct Mailer;
    let error = bus_builder(&store)
        .state(7_u32)
        .subscribe(Subscription::new(
            "mail",
            |_: OrderPlaced, _: State<u32>, _: State<Mailer>| async { Ok::<(), BoxError>(()) },
        ))
        .build()
        .unwrap_err();
    assert!(
        matches!(&error, ConfigurationError::MissingState { handler, type_name }
            if handler == "mail" && type_name.ends_with("Mailer")),
        "{error:?}"
    );
    says(&error.to_string(), &["\"mail\"", "Mailer", ".state(value)"]);

    // One state type given twice: which would a handler get?
    let error = bus_builder(&store)
        .state(Mailer)
        .state(Mailer)
        .build()
        .unwrap_err();
    assert!(
        matches!(&error, ConfigurationError::DuplicateState { type_name } if type_name.ends_with("Mailer")),
        "{error:?}"
    );
    says(&error.to_string(), &["Mailer", "give each type once"]);
    assert_no_collections(&db).await;
}

#[tokio::test]
async fn bus_start_after_shutdown_and_purge_without_retention_are_refused() {
    let db = test_db("bi_bus_lifecycle").await;
    let store = bare_store(&db);

    let bus = bus_builder(&store).setup_on_start(false).build().unwrap();
    bus.shutdown().await.unwrap();
    let error = bus.start().await.unwrap_err();
    match &error {
        Error::Configuration(ConfigurationError::InvalidOption { option, reason }) => {
            assert_eq!(*option, "start");
            says(reason, &["shut down", "build a new bus"]);
        }
        other => panic!("{other:?}"),
    }

    let bus = bus_builder(&store).retention(None).build().unwrap();
    let error = bus.purge_expired().await.unwrap_err();
    match &error {
        Error::Configuration(ConfigurationError::InvalidOption { option, reason }) => {
            assert_eq!(*option, "retention");
            says(reason, &["retention is off", "RelayBusBuilder::retention"]);
        }
        other => panic!("{other:?}"),
    }
    assert_no_collections(&db).await;
}

// ---------------------------------------------------------------------------------------------
// Publishing and appending

#[tokio::test]
async fn publish_refuses_malformed_events_and_the_transaction_writes_nothing() {
    let db = test_db("bi_publish").await;
    let store = store(&db).await;
    let bus = bus(&store, &["a"]);
    let orders = db.db().collection::<Document>("orders");
    let before = contents(&db).await;

    type Check = fn(&Error) -> bool;
    let long = |n: usize| "x".repeat(n);
    let cases: Vec<(&str, Check, &[&str])> = vec![
        (
            "empty key",
            is!(Error::EventValidation(
                EventValidationError::InvalidKey { .. }
            )),
            &["it is empty", "use 1 to 512 bytes"],
        ),
        (
            "long key",
            is!(Error::EventValidation(
                EventValidationError::InvalidKey { .. }
            )),
            &["too long", "use 1 to 512 bytes"],
        ),
        (
            "empty id",
            is!(Error::EventValidation(
                EventValidationError::InvalidId { .. }
            )),
            &["it is empty", "use 1 to 256 bytes"],
        ),
        (
            "long id",
            is!(Error::EventValidation(
                EventValidationError::InvalidId { .. }
            )),
            &["too long", "use 1 to 256 bytes"],
        ),
        (
            "control id",
            is!(Error::EventValidation(
                EventValidationError::InvalidId { .. }
            )),
            &["control characters", "without control characters"],
        ),
        (
            "empty correlation id",
            is!(Error::EventValidation(EventValidationError::InvalidField {
                field: "correlation id",
                ..
            })),
            &["correlation id", "it is empty"],
        ),
        (
            "long causation id",
            is!(Error::EventValidation(EventValidationError::InvalidField {
                field: "causation id",
                ..
            })),
            &["causation id", "longer than 1024 bytes"],
        ),
        (
            "empty header name",
            is!(Error::EventValidation(EventValidationError::InvalidField {
                field: "header name",
                ..
            })),
            &["header name", "it is empty"],
        ),
        (
            "long header value",
            is!(Error::EventValidation(EventValidationError::InvalidField {
                field: "header value",
                ..
            })),
            &["\"tenant\"", "longer than 1024 bytes"],
        ),
        (
            "type name",
            is!(Error::EventValidation(
                EventValidationError::InvalidTypeName { .. }
            )),
            &["\"Order Placed\"", "for example \"order.placed.v1\""],
        ),
        (
            "number payload",
            is!(Error::EventValidation(
                EventValidationError::PayloadNotObject {
                    found: "a number",
                    ..
                }
            )),
            &[
                "badin.counted.v1",
                "not an object",
                "wrap the value in a struct",
            ],
        ),
        (
            "array payload",
            is!(Error::EventValidation(
                EventValidationError::PayloadNotObject {
                    found: "an array",
                    ..
                }
            )),
            &["badin.listed.v1", "an array"],
        ),
        (
            "null payload",
            is!(Error::EventValidation(
                EventValidationError::PayloadNotObject { found: "null", .. }
            )),
            &["badin.nothing.v1", "null"],
        ),
        (
            "unserializable payload",
            is!(Error::EventValidation(EventValidationError::Payload { .. })),
            &[
                "badin.grid.v1",
                "could not be serialized",
                "key must be a string",
            ],
        ),
        (
            "too deep",
            is!(Error::EventValidation(
                EventValidationError::PayloadTooDeep { limit: 100, .. }
            )),
            &["badin.part.v1", "more than 100 levels deep", "flatten it"],
        ),
        (
            "too large",
            is!(Error::EventValidation(EventValidationError::TooLarge { size, limit, .. }) if *size > *limit && *limit == 16 * 1024 * 1024),
            &["16777216", "store large data elsewhere"],
        ),
    ];
    for (case, check, hints) in cases {
        let outcome: Result<(), Error> = bus
            .transaction(async |session| {
                orders
                    .insert_one(doc! { "case": case })
                    .session(&mut *session)
                    .await?;
                let publish = match case {
                    "empty key" => bus.publish(&placed("o")).key(""),
                    "long key" => bus.publish(&placed("o")).key(long(513)),
                    "empty id" => bus.publish(&placed("o")).id(""),
                    "long id" => bus.publish(&placed("o")).id(long(257)),
                    "control id" => bus.publish(&placed("o")).id("a\u{7}b"),
                    "empty correlation id" => bus.publish(&placed("o")).correlation_id(""),
                    "long causation id" => bus.publish(&placed("o")).causation_id(long(1025)),
                    "empty header name" => bus.publish(&placed("o")).header("", "v"),
                    "long header value" => bus.publish(&placed("o")).header("tenant", long(1025)),
                    "type name" => bus.publish(&Shouted { text: "hi".into() }),
                    "number payload" => bus.publish(&Counted(7)),
                    "array payload" => bus.publish(&Listed(vec![1, 2])),
                    "null payload" => bus.publish(&Nothing),
                    "unserializable payload" => bus.publish(&Grid {
                        cells: HashMap::from([((1, 2), 3)]),
                    }),
                    "too deep" => bus.publish(&parts(101)),
                    _ => bus.publish(&OrderPlaced {
                        order_id: long(17 * 1024 * 1024),
                        total_cents: 1,
                    }),
                };
                publish.session(session).await?;
                Ok(())
            })
            .await;
        let error = outcome.expect_err(case);
        assert!(check(&error), "{case}: {error:?}");
        says(&error.to_string(), hints);
    }
    // An error of the transaction body itself passes through unchanged and aborts it all.
    let outcome: Result<(), Error> = bus
        .transaction(async |session| {
            orders
                .insert_one(doc! { "case": "custom" })
                .session(&mut *session)
                .await?;
            bus.publish(&placed("o")).session(session).await?;
            Err(Error::custom("the order was refused"))
        })
        .await;
    match outcome {
        Err(Error::Custom(error)) => assert_eq!(error.to_string(), "the order was refused"),
        other => panic!("{other:?}"),
    }
    assert_unchanged(&db, &before, "malformed publishes").await;
    assert!(
        !db.db()
            .list_collection_names()
            .await
            .unwrap()
            .contains(&"orders".to_owned()),
        "the business write of an aborted transaction stayed"
    );

    // Payloads built as JSON: refused when the envelope is made, however deep they are. Deep
    // enough, they used to overflow the stack of the conversion to BSON and abort the process.
    bus.publish(&parts(100))
        .await
        .expect("100 levels are accepted");
    let before = contents(&db).await;
    for depth in [101, 180, 1_000] {
        let error = EventEnvelope::from_json("badin.deep.v1", nested(depth)).unwrap_err();
        assert!(
            matches!(
                error,
                EventValidationError::PayloadTooDeep { limit: 100, .. }
            ),
            "{depth}: {error:?}"
        );
    }
    let in_array = json!({ "list": [[[nested(98)]]] });
    assert!(matches!(
        EventEnvelope::from_json("badin.deep.v1", in_array),
        Err(EventValidationError::PayloadTooDeep { .. })
    ));

    // The same events without a session: nothing either.
    let errors = [
        bus.publish(&placed("o")).key("").await.unwrap_err(),
        bus.publish(&Counted(1)).await.unwrap_err(),
        bus.publish(&OrderPlaced {
            order_id: long(17 * 1024 * 1024),
            total_cents: 1,
        })
        .await
        .unwrap_err(),
    ];
    for error in errors {
        assert!(matches!(error, Error::EventValidation(_)), "{error:?}");
    }
    assert_unchanged(&db, &before, "malformed publishes without a session").await;
}

#[tokio::test]
async fn publish_and_append_with_a_session_outside_a_transaction_write_nothing() {
    let db = test_db("bi_no_txn").await;
    let store = store(&db).await;
    let bus = bus(&store, &["a"]);
    let before = contents(&db).await;
    let envelope = EventEnvelope::new(&placed("o-1")).unwrap();
    let handlers = vec!["a".to_owned()];

    let mut fresh = no_transaction_session(&db).await;
    let mut committed = no_transaction_session(&db).await;
    committed.start_transaction().await.unwrap();
    committed.commit_transaction().await.unwrap();
    let mut aborted = no_transaction_session(&db).await;
    aborted.start_transaction().await.unwrap();
    aborted.abort_transaction().await.unwrap();

    for (state, session) in [
        ("never started", &mut fresh),
        ("committed", &mut committed),
        ("aborted", &mut aborted),
    ] {
        let errors = [
            bus.publish(&placed("o-1"))
                .session(&mut *session)
                .await
                .unwrap_err(),
            bus.publish_all([envelope.clone()])
                .session(&mut *session)
                .await
                .unwrap_err(),
            store
                .append(
                    &mut *session,
                    &[AppendRequest::new(&envelope, &handlers)],
                    DateTime::now(),
                )
                .await
                .unwrap_err(),
        ];
        for error in errors {
            assert!(
                matches!(
                    error,
                    Error::Configuration(ConfigurationError::NoTransaction { .. })
                ),
                "{state}: {error:?}"
            );
            says(
                &error.to_string(),
                &[
                    "inside a started transaction",
                    "session.start_transaction()",
                ],
            );
        }
        let lease = Lease::parse(&ObjectId::new().to_hex(), "1:1:0").unwrap();
        let error = store
            .complete_in_transaction(&mut *session, &lease, DateTime::now())
            .await
            .unwrap_err();
        assert!(
            matches!(
                &error,
                Error::Configuration(ConfigurationError::NoTransaction {
                    operation: "MongoEventStore.complete_in_transaction"
                })
            ),
            "{state}: {error:?}"
        );
    }
    assert_unchanged(&db, &before, "sessions without a transaction").await;
}

#[tokio::test]
async fn a_publish_without_the_session_inside_a_transaction_body_is_refused() {
    let db = test_db("bi_forgotten_session").await;
    let store = store(&db).await;
    let bus = bus(&store, &["a"]);
    let orders = db.db().collection::<Document>("orders");
    let before = contents(&db).await;

    // Without `.session(session)` the event would commit in a transaction of its own, and stay
    // when the body's transaction is aborted.
    let outcomes: [Result<(), Error>; 3] = [
        bus.transaction(async |session| {
            orders
                .insert_one(doc! { "_id": "o-1" })
                .session(&mut *session)
                .await?;
            bus.publish(&placed("o-1")).await?;
            Ok(())
        })
        .await,
        bus.transaction(async |session| {
            orders
                .insert_one(doc! { "_id": "o-2" })
                .session(&mut *session)
                .await?;
            bus.publish_all([EventEnvelope::new(&placed("o-2")).unwrap()])
                .await?;
            Ok(())
        })
        .await,
        store
            .transaction(async |session| {
                orders
                    .insert_one(doc! { "_id": "o-3" })
                    .session(&mut *session)
                    .await?;
                bus.publish(&placed("o-3")).await?;
                Ok(())
            })
            .await,
    ];
    for outcome in outcomes {
        let error = outcome.unwrap_err();
        assert!(
            matches!(
                error,
                Error::Configuration(ConfigurationError::SessionNotPassed {
                    operation: "publish"
                })
            ),
            "{error:?}"
        );
        says(
            &error.to_string(),
            &[
                "without `.session(session)`",
                "pass the session the body was given",
            ],
        );
    }
    assert_unchanged(&db, &before, "publishes that forgot the session").await;

    // Outside a body, a publish without a session runs in a transaction of its own.
    bus.publish(&placed("o-4")).await.unwrap();
}

#[tokio::test]
async fn publish_all_with_one_bad_event_among_good_ones_writes_none_of_them() {
    let db = test_db("bi_publish_all").await;
    let store = store(&db).await;
    let bus = bus(&store, &["a", "b"]);
    let orders = db.db().collection::<Document>("orders");
    let before = contents(&db).await;

    let good = |n: usize| {
        EventEnvelope::new(&placed(&format!("o-{n}")))
            .unwrap()
            .with_key(format!("k-{}", n % 2))
            .unwrap()
    };
    let huge = EventEnvelope::new(&OrderPlaced {
        order_id: "x".repeat(17 * 1024 * 1024),
        total_cents: 1,
    })
    .unwrap();
    let batch = vec![good(0), good(1), huge.clone(), good(2)];

    // In a transaction of its own.
    let error = bus.publish_all(batch.clone()).await.unwrap_err();
    assert!(
        matches!(
            &error,
            Error::EventValidation(EventValidationError::TooLarge { id, .. }) if id == huge.id()
        ),
        "{error:?}"
    );
    says(&error.to_string(), &[huge.id()]);

    // In the caller's transaction, after a business write.
    let outcome: Result<(), Error> = bus
        .transaction(async |session| {
            orders
                .insert_one(doc! { "_id": "o-0" })
                .session(&mut *session)
                .await?;
            bus.publish_all(batch.clone()).session(session).await?;
            Ok(())
        })
        .await;
    assert!(
        matches!(
            outcome,
            Err(Error::EventValidation(
                EventValidationError::TooLarge { .. }
            ))
        ),
        "{outcome:?}"
    );

    // Straight to the store, with one malformed handler id in one request.
    let handlers = vec!["a".to_owned()];
    let bad_handlers = vec!["a".to_owned(), "not a handler id".to_owned()];
    let events = [good(3), good(4), good(5)];
    let outcome = store
        .transaction(async |session| {
            let requests = [
                AppendRequest::new(&events[0], &handlers),
                AppendRequest::new(&events[1], &bad_handlers),
                AppendRequest::new(&events[2], &handlers),
            ];
            store.append(session, &requests, DateTime::now()).await
        })
        .await;
    match outcome {
        Err(Error::Configuration(ConfigurationError::InvalidHandlerId { id, .. })) => {
            assert_eq!(id, "not a handler id")
        }
        other => panic!("{other:?}"),
    }
    assert_unchanged(&db, &before, "batches with one bad event").await;

    // An empty batch is no error and writes nothing.
    assert_eq!(bus.publish_all([]).await.unwrap(), []);
    assert_unchanged(&db, &before, "an empty batch").await;
}

#[tokio::test]
async fn an_event_id_reused_for_another_event_type_is_refused_and_writes_nothing() {
    let db = test_db("bi_dup_ids").await;
    let store = store(&db).await;
    let bus = bus_builder(&store)
        .subscribe(noop::<OrderPlaced>("placed-handler"))
        .subscribe(noop::<OrderShipped>("shipped-handler"))
        .build()
        .unwrap();

    // The same id twice in one batch, of one type: one event, as a retry would give.
    let first = EventEnvelope::new(&placed("o-1"))
        .unwrap()
        .with_id("evt-1")
        .unwrap();
    let appended = bus
        .publish_all([first.clone(), first.clone()])
        .await
        .unwrap();
    assert_eq!(appended.len(), 1, "one outcome per event: {appended:?}");
    assert!(appended[0].created);
    let before = contents(&db).await;
    assert_eq!(before["relaybus_events"].len(), 1);
    assert_eq!(before["relaybus_deliveries"].len(), 1);

    // The stored id again, for another event type: its handler would get a delivery of an
    // event it cannot read.
    let shipped = EventEnvelope::new(&OrderShipped {
        order_id: "o-1".into(),
    })
    .unwrap()
    .with_id("evt-1")
    .unwrap();
    let error = bus.publish_envelope(shipped.clone()).await.unwrap_err();
    match &error {
        Error::EventValidation(EventValidationError::IdReused {
            id,
            existing_type,
            event_type,
        }) => {
            assert_eq!(id, "evt-1");
            assert_eq!(existing_type, OrderPlaced::TYPE);
            assert_eq!(event_type, OrderShipped::TYPE);
        }
        other => panic!("{other:?}"),
    }
    says(
        &error.to_string(),
        &[
            "\"evt-1\"",
            OrderPlaced::TYPE,
            OrderShipped::TYPE,
            "give every event its own id",
        ],
    );
    assert_unchanged(&db, &before, "an id reused for another type").await;

    // Two types under one new id in one batch: refused before anything is written.
    let a = EventEnvelope::new(&placed("o-2"))
        .unwrap()
        .with_id("evt-2")
        .unwrap();
    let b = shipped.clone().with_id("evt-2").unwrap();
    let error = bus.publish_all([a, b]).await.unwrap_err();
    assert!(
        matches!(
            &error,
            Error::EventValidation(EventValidationError::IdReused { id, .. }) if id == "evt-2"
        ),
        "{error:?}"
    );
    assert_unchanged(&db, &before, "two types under one id in a batch").await;
}

// ---------------------------------------------------------------------------------------------
// Lease tokens

#[test]
fn lease_tokens_no_claim_can_have_issued_are_refused_with_what_is_wrong() {
    const ID: &str = "65f0c0ffee0000000000beef";
    let malformed = [
        ("", "three `:`-separated parts"),
        ("1:2", "three `:`-separated parts"),
        ("1:2:3:4", "three `:`-separated parts"),
        ("1::0", "decimal number"),
        ("a:1:0", "decimal number"),
        ("1:b:0", "decimal number"),
        ("1:1:c", "decimal number"),
        (" 1:1:0", "decimal number"),
        ("+1:1:0", "decimal number"),
        ("-1:1:0", "decimal number"),
        ("1:-1:0", "decimal number"),
        ("1.0:1:0", "decimal number"),
        ("\u{ff11}:1:0", "decimal number"),
        ("1:99999999999999999999999:0", "decimal number"),
        ("1:0:0", "epoch is 0"),
        ("1:9223372036854775808:0", "epoch is too large"),
        ("1:1:9223372036854775808", "claim generation is too large"),
    ];
    for (token, reason) in malformed {
        let error = Lease::parse(ID, token).unwrap_err();
        assert!(
            matches!(&error, LeaseError::MalformedToken { .. }),
            "{token:?}: {error:?}"
        );
        says(
            &error.to_string(),
            &[reason, "pass the token a claim returned"],
        );
        assert!(matches!(Error::from(error), Error::Lease(_)));
    }
    // The echo of a long token is cut.
    let long = format!("{}:1:0", "9".repeat(10_000));
    match Lease::parse(ID, &long).unwrap_err() {
        LeaseError::MalformedToken { token, .. } => assert_eq!(token.chars().count(), 64),
        other => panic!("{other:?}"),
    }
    for (token, lane) in [
        ("256:1:0", 256),
        ("99999:1:0", 99_999),
        ("18446744073709551615:1:0", u64::MAX),
    ] {
        let error = Lease::parse(ID, token).unwrap_err();
        assert_eq!(error, LeaseError::LaneOutOfRange { lane }, "{token}");
        says(&error.to_string(), &["numbered 0 to 255"]);
    }
    for id in [
        "",
        "xyz",
        "65f0c0ffee0000000000beeg",
        "65f0c0ffee0000000000beef0",
        "{\"$ne\": null}",
    ] {
        let error = Lease::parse(id, "1:1:0").unwrap_err();
        assert!(
            matches!(&error, LeaseError::InvalidDeliveryId { .. }),
            "{id:?}: {error:?}"
        );
        says(&error.to_string(), &["24 hexadecimal digits"]);
    }
}

#[tokio::test]
async fn forged_and_stale_leases_change_nothing_through_any_settlement() {
    let db = test_db("bi_leases").await;
    let store = store(&db).await;
    let handlers = vec!["h".to_owned()];
    let envelope = EventEnvelope::new(&placed("o-1")).unwrap();
    store
        .transaction(async |session| {
            store
                .append(
                    session,
                    &[AppendRequest::new(&envelope, &handlers)],
                    DateTime::now(),
                )
                .await
        })
        .await
        .unwrap();
    let lease_time = Duration::from_secs(30);
    let now = DateTime::now();
    let claimed = store.claim("w", &["h"], 1, lease_time, now).await.unwrap();
    let lease = *claimed[0].lease();
    let id = lease.delivery_id().to_hex();
    let before = contents(&db).await;

    let lane = lease.lane();
    let forged: Vec<Lease> = [
        (
            id.clone(),
            format!("{lane}:{}:{}", lease.epoch() + 1, lease.claims()),
        ),
        (
            id.clone(),
            format!("{lane}:{}:{}", lease.epoch(), lease.claims() + 1),
        ),
        (
            id.clone(),
            format!("{}:{}:{}", (lane + 1) % 256, lease.epoch(), lease.claims()),
        ),
        (
            id.clone(),
            format!("{lane}:{}:{}", i64::MAX, lease.claims()),
        ),
        (
            ObjectId::new().to_hex(),
            format!("{lane}:{}:{}", lease.epoch(), lease.claims()),
        ),
    ]
    .iter()
    .map(|(id, token)| Lease::parse(id, token).unwrap())
    .collect();

    let settle_all = async |lease: &Lease, what: &str| {
        let at = DateTime::now();
        assert!(
            !store.complete(lease, at).await.unwrap(),
            "{what}: complete"
        );
        assert_eq!(
            store.complete_many(&[*lease, *lease], at).await.unwrap(),
            [false, false],
            "{what}: complete_many"
        );
        assert!(
            !store
                .transaction(async |session| store
                    .complete_in_transaction(session, lease, at)
                    .await)
                .await
                .unwrap(),
            "{what}: complete_in_transaction"
        );
        assert!(
            !store.reschedule(lease, at, "failed", at).await.unwrap(),
            "{what}: reschedule"
        );
        assert!(
            !store.bury(lease, "failed", at).await.unwrap(),
            "{what}: bury"
        );
        assert!(!store.release(lease, at).await.unwrap(), "{what}: release");
        assert_eq!(
            store.extend_lease(lease, lease_time, at).await.unwrap(),
            None,
            "{what}: extend_lease"
        );
    };
    for forged in &forged {
        settle_all(forged, &forged.to_string()).await;
    }
    assert_unchanged(&db, &before, "forged leases").await;

    // An extension past the end of BSON time is refused before any database call.
    let error = store
        .extend_lease(&lease, lease_time, DateTime::MAX)
        .await
        .unwrap_err();
    match &error {
        Error::InvalidArgument(error) => {
            assert_eq!(error.argument(), "now");
            says(error.reason(), &["past the year"]);
        }
        other => panic!("{other:?}"),
    }
    for duration in [Duration::ZERO, Duration::from_secs(8 * 86_400)] {
        match store.extend_lease(&lease, duration, now).await {
            Err(Error::InvalidArgument(error)) => {
                assert_eq!(error.argument(), "lease_duration");
                says(error.reason(), &["use 1 ms to 7 days"]);
            }
            other => panic!("{duration:?}: {other:?}"),
        }
    }
    assert_unchanged(&db, &before, "extensions out of range").await;

    // The genuine lease ends; the same delivery is claimed again under the same lane epoch.
    assert!(store.release(&lease, DateTime::now()).await.unwrap());
    let again = store
        .claim("w", &["h"], 1, lease_time, DateTime::now())
        .await
        .unwrap();
    assert_eq!(again[0].delivery_id(), lease.delivery_id());
    assert_eq!(again[0].lease().epoch(), lease.epoch());
    let before = contents(&db).await;
    settle_all(&lease, "stale").await;
    assert_unchanged(&db, &before, "a stale lease").await;

    // The current lease still works, once.
    assert!(
        store
            .complete(again[0].lease(), DateTime::now())
            .await
            .unwrap()
    );
    let before = contents(&db).await;
    settle_all(again[0].lease(), "completed").await;
    assert_unchanged(&db, &before, "a lease whose delivery completed").await;
}

#[tokio::test]
async fn an_oversized_error_message_is_cut_at_a_character_boundary() {
    let db = test_db("bi_long_error").await;
    let store = store(&db).await;
    let handlers = vec!["h".to_owned()];
    let envelope = EventEnvelope::new(&placed("o-1")).unwrap();
    store
        .transaction(async |session| {
            store
                .append(
                    session,
                    &[AppendRequest::new(&envelope, &handlers)],
                    DateTime::now(),
                )
                .await
        })
        .await
        .unwrap();
    let claimed = store
        .claim("w", &["h"], 1, Duration::from_secs(30), DateTime::now())
        .await
        .unwrap();
    // Three-byte characters across the 8 KiB limit, a megabyte of them.
    let message = "\u{20ac}".repeat(350_000);
    assert!(
        store
            .bury(claimed[0].lease(), &message, DateTime::now())
            .await
            .unwrap()
    );
    let dead = store
        .list_deliveries(&DeliveryQuery::new().status(DeliveryStatus::Dead))
        .await
        .unwrap();
    let kept = dead[0].last_error.as_deref().unwrap();
    assert!(kept.len() <= 8 * 1024, "{}", kept.len());
    assert!(kept.len() > 8 * 1024 - 3, "{}", kept.len());
    assert!(kept.chars().all(|c| c == '\u{20ac}'));
}

// ---------------------------------------------------------------------------------------------
// Claims

#[tokio::test]
async fn claim_refuses_bad_arguments_and_takes_nothing() {
    let db = test_db("bi_claim").await;
    let store = store(&db).await;
    let handlers = vec!["h".to_owned()];
    let envelope = EventEnvelope::new(&placed("o-1")).unwrap();
    store
        .transaction(async |session| {
            store
                .append(
                    session,
                    &[AppendRequest::new(&envelope, &handlers)],
                    DateTime::now(),
                )
                .await
        })
        .await
        .unwrap();
    let before = contents(&db).await;
    let lease = Duration::from_secs(30);
    let now = DateTime::now();
    let many: Vec<String> = (0..1_001).map(|n| format!("h{n}")).collect();
    let long_owner = "w".repeat(257);

    let refused = [
        (
            "limit",
            "claim 1 to 10000",
            store.claim("w", &["h"], 0, lease, now).await,
        ),
        (
            "limit",
            "claim 1 to 10000",
            store.claim("w", &["h"], 10_001, lease, now).await,
        ),
        (
            "handlers",
            "claim for 1 to 1000 handlers",
            store.claim("w", &[] as &[&str], 1, lease, now).await,
        ),
        (
            "handlers",
            "claim for 1 to 1000 handlers",
            store.claim("w", &many, 1, lease, now).await,
        ),
        (
            "owner",
            "it is empty",
            store.claim("", &["h"], 1, lease, now).await,
        ),
        (
            "owner",
            "longer than 256 bytes",
            store.claim(&long_owner, &["h"], 1, lease, now).await,
        ),
        (
            "owner",
            "control character",
            store.claim("w\0", &["h"], 1, lease, now).await,
        ),
        (
            "lease_duration",
            "use 1 ms to 7 days",
            store.claim("w", &["h"], 1, Duration::ZERO, now).await,
        ),
        (
            "lease_duration",
            "use 1 ms to 7 days",
            store
                .claim("w", &["h"], 1, Duration::from_secs(8 * 86_400), now)
                .await,
        ),
        (
            "now",
            "past the year",
            store.claim("w", &["h"], 1, lease, DateTime::MAX).await,
        ),
    ];
    for (argument, hint, outcome) in refused {
        match outcome {
            Err(Error::InvalidArgument(error)) => {
                assert_eq!(error.argument(), argument, "{error}");
                says(&error.to_string(), &[hint]);
            }
            other => panic!("{argument}: {other:?}"),
        }
    }
    match store.claim("w", &["h", "no good"], 1, lease, now).await {
        Err(Error::Configuration(ConfigurationError::InvalidHandlerId { id, .. })) => {
            assert_eq!(id, "no good")
        }
        other => panic!("{other:?}"),
    }
    assert_unchanged(&db, &before, "refused claims").await;

    // The delivery is still there for a claim with good arguments.
    let claimed = store.claim("w", &["h"], 1, lease, now).await.unwrap();
    assert_eq!(claimed.len(), 1);
}

// ---------------------------------------------------------------------------------------------
// Operator calls of the store

/// A store with one dead and one pending delivery of handler `h`, and their ids.
async fn with_dead_letter(db: &TestDb) -> (MongoEventStore, ObjectId, ObjectId) {
    let store = store(db).await;
    let handlers = vec!["h".to_owned()];
    let events = [
        EventEnvelope::new(&placed("o-dead")).unwrap(),
        EventEnvelope::new(&placed("o-pending")).unwrap(),
    ];
    store
        .transaction(async |session| {
            store
                .append(
                    session,
                    &[AppendRequest::new(&events[0], &handlers)],
                    DateTime::now(),
                )
                .await
        })
        .await
        .unwrap();
    let claimed = store
        .claim("w", &["h"], 1, Duration::from_secs(30), DateTime::now())
        .await
        .unwrap();
    let dead = claimed[0].delivery_id();
    assert!(
        store
            .bury(claimed[0].lease(), "poison", DateTime::now())
            .await
            .unwrap()
    );
    store
        .transaction(async |session| {
            store
                .append(
                    session,
                    &[AppendRequest::new(&events[1], &handlers)],
                    DateTime::now(),
                )
                .await
        })
        .await
        .unwrap();
    let pending = store
        .list_deliveries(&DeliveryQuery::new().status(DeliveryStatus::Pending))
        .await
        .unwrap()[0]
        .id
        .parse()
        .unwrap();
    (store, dead, pending)
}

#[tokio::test]
async fn operator_calls_refuse_bad_filters_and_ids_and_write_nothing() {
    let db = test_db("bi_operator").await;
    let (store, dead, pending) = with_dead_letter(&db).await;
    let before = contents(&db).await;

    for limit in [0, 1_001] {
        match store
            .list_deliveries(&DeliveryQuery::new().limit(limit))
            .await
        {
            Err(Error::InvalidArgument(error)) => {
                assert_eq!(error.argument(), "limit");
                says(error.reason(), &[&limit.to_string(), "1 to 1000"]);
            }
            other => panic!("{limit}: {other:?}"),
        }
    }
    // Filters are plain values: text shaped like a query operator matches nothing.
    for query in [
        DeliveryQuery::new().handler("{\"$ne\": null}"),
        DeliveryQuery::new().handler("$ne"),
        DeliveryQuery::new().event_type("{\"$gt\": \"\"}"),
    ] {
        assert_eq!(
            store.list_deliveries(&query).await.unwrap(),
            [],
            "{query:?}"
        );
    }
    // A page past the end lists nothing.
    assert_eq!(
        store
            .list_deliveries(&DeliveryQuery::new().after("ffffffffffffffffffffffff"))
            .await
            .unwrap(),
        []
    );
    // A cursor that is no delivery id is refused, and names the argument.
    match store
        .list_deliveries(&DeliveryQuery::new().after("{\"$gt\": \"\"}"))
        .await
    {
        Err(Error::InvalidArgument(error)) => assert_eq!(error.argument(), "after"),
        other => panic!("a malformed cursor was accepted: {other:?}"),
    }
    // An empty time range lists nothing.
    let now = DateTime::now();
    assert_eq!(
        store
            .list_deliveries(&DeliveryQuery::new().created_from(now).created_before(now))
            .await
            .unwrap(),
        []
    );

    // Requeue: too many ids is an error; ids that name no dead delivery are reported back.
    let too_many: Vec<String> = (0..10_001).map(|_| ObjectId::new().to_hex()).collect();
    match store.requeue(&too_many, DateTime::now()).await {
        Err(Error::InvalidArgument(error)) => {
            assert_eq!(error.argument(), "ids");
            says(error.reason(), &["10001", "at most 10000"]);
        }
        other => panic!("{other:?}"),
    }
    let unknown = ObjectId::new().to_hex();
    let malformed = [
        "",
        "xyz",
        "{\"$ne\": null}",
        "65f0c0ffee0000000000beeg",
        "65f0c0ffee0000000000beef0",
    ];
    let mut ids: Vec<String> = malformed.iter().map(|s| (*s).to_owned()).collect();
    ids.push(unknown.clone());
    ids.push(pending.to_hex());
    let outcome = store.requeue(&ids, DateTime::now()).await.unwrap();
    assert!(
        outcome.requeued.is_empty() && outcome.blocked.is_empty(),
        "{outcome:?}"
    );
    let mut not_found = outcome.not_found.clone();
    not_found.sort();
    let mut expected = ids.clone();
    expected.sort();
    assert_eq!(not_found, expected);
    assert_eq!(
        store
            .requeue(&[] as &[&str], DateTime::now())
            .await
            .unwrap(),
        relaybus::Requeued::default()
    );

    // Relinquish with a malformed owner.
    for owner in ["", "a\nb"] {
        match store.relinquish(owner).await {
            Err(Error::InvalidArgument(error)) => assert_eq!(error.argument(), "owner"),
            other => panic!("{owner:?}: {other:?}"),
        }
    }
    // A purge without cutoffs, or with cutoffs before everything, deletes nothing.
    assert_eq!(
        store.purge(&PurgeOptions::new()).await.unwrap(),
        relaybus::Purged::default()
    );
    let long_ago = DateTime::from_millis(0);
    assert_eq!(
        store
            .purge(
                &PurgeOptions::new()
                    .dead_before(long_ago)
                    .completed_before(DateTime::MIN)
            )
            .await
            .unwrap(),
        relaybus::Purged::default()
    );
    assert_unchanged(&db, &before, "refused operator calls").await;

    // The dead letter is still there to requeue.
    let outcome = store
        .requeue(&[dead.to_hex()], DateTime::now())
        .await
        .unwrap();
    assert_eq!(outcome.requeued, [dead.to_hex()]);
}

// ---------------------------------------------------------------------------------------------
// relaybus-axum: the operator routes and the request transactions

async fn answer(router: &Router, request: Request<Body>) -> (StatusCode, Option<String>, Value) {
    let response: Response<Body> = router.clone().oneshot(request).await.unwrap();
    let status = response.status();
    let content_type = response
        .headers()
        .get(CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let bytes = axum::body::to_bytes(response.into_body(), 1 << 20)
        .await
        .unwrap();
    let body = serde_json::from_slice(&bytes)
        .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into_owned()));
    (status, content_type, body)
}

#[track_caller]
fn refused_with(
    (status, content_type, body): &(StatusCode, Option<String>, Value),
    expected: StatusCode,
    hint: &str,
    what: &str,
) {
    assert_eq!(*status, expected, "{what}: {body}");
    assert_eq!(
        content_type.as_deref(),
        Some("application/json"),
        "{what}: {body}"
    );
    let error = body["error"]
        .as_str()
        .unwrap_or_else(|| panic!("{what}: no error in {body}"));
    says(error, &[hint]);
}

fn requeue(body: impl Into<Body>, content_type: Option<&str>) -> Request<Body> {
    let mut request =
        Request::post("/ops/deliveries/requeue").header(relaybus_axum::ops::WRITE_HEADER, "1");
    if let Some(content_type) = content_type {
        request = request.header(CONTENT_TYPE, content_type);
    }
    request.body(body.into()).unwrap()
}

#[tokio::test]
async fn ops_routes_refuse_malformed_input_with_a_json_4xx_and_write_nothing() {
    let db = test_db("bi_ops").await;
    let (store, _dead, pending) = with_dead_letter(&db).await;
    let bus = bus_builder(&store).build().unwrap();
    let router: Router = Router::new().nest("/ops", relaybus_axum::ops::router(bus));
    let before = contents(&db).await;

    let listings = [
        ("status=buried", "`status` must be"),
        ("status=", "`status` must be"),
        ("status=DEAD", "`status` must be"),
        ("handler[$ne]=x", "unknown field"),
        ("handler=a&handler=b", "more than once"),
        ("handler=bad%20id", "`handler`"),
        ("handler=", "`handler`"),
        ("event_type=Order%24Placed", "`event_type`"),
        ("event_type=%7B%22%24gt%22%3A%22%22%7D", "`event_type`"),
        ("created_from=yesterday", "RFC 3339"),
        ("created_before=2025-13-45T00:00:00Z", "RFC 3339"),
        ("limit=0", "`limit` must be"),
        ("limit=1001", "`limit` must be"),
        ("limit=ten", "`limit` must be"),
        ("limit=", "`limit` must be"),
        ("skip=20", "unknown field"),
        ("after=", "`after` must be"),
        ("after=%7B%22%24gt%22%3A%22%22%7D", "`after` must be"),
        ("after=not%20an%20id", "`after` must be"),
        // Escapes that decode to nothing usable leave values no check accepts.
        ("limit=%FF", "`limit` must be"),
        ("limit=%zz", "`limit` must be"),
        ("limit=1%2", "`limit` must be"),
        ("handler=%zz", "`handler`"),
    ];
    for (query, hint) in listings {
        let request = Request::get(format!("/ops/deliveries?{query}"))
            .body(Body::empty())
            .unwrap();
        refused_with(
            &answer(&router, request).await,
            StatusCode::BAD_REQUEST,
            hint,
            query,
        );
    }

    let json = Some("application/json");
    let too_many =
        json!({ "ids": (0..1_001).map(|_| ObjectId::new().to_hex()).collect::<Vec<_>>() });
    let bodies = [
        (r#"{"ids": [{"$ne": null}]}"#.to_owned(), "invalid type"),
        (r#"{"ids": {"$gt": ""}}"#.to_owned(), "invalid type"),
        (r#"{"ids": ["not-an-id"]}"#.to_owned(), "not a delivery id"),
        (
            r#"{"ids": ["65f0c0ffee-0000000000beef"]}"#.to_owned(),
            "not a delivery id",
        ),
        (
            format!(r#"{{"ids": ["{}"]}}"#, "a".repeat(65)),
            "not a delivery id",
        ),
        (r#"{"ids": []}"#.to_owned(), "1 to 1000 ids"),
        (too_many.to_string(), "1 to 1000 ids"),
        (
            format!(r#"{{"ids": ["{pending}"], "all": true}}"#),
            "exactly one of",
        ),
        (
            format!(r#"{{"ids": ["{pending}"], "$where": "1"}}"#),
            "unknown field",
        ),
        (r#"{"filter": {}}"#.to_owned(), r#"{"all": true}"#),
        (
            r#"{"filter": {"handler": {"$ne": null}}}"#.to_owned(),
            "invalid type",
        ),
        (r#"{"all": false}"#.to_owned(), "must be `true`"),
        (
            r#"["65f0c0ffee0000000000beef"]"#.to_owned(),
            r#"{"all": true}"#,
        ),
        ("not json".to_owned(), r#"{"ids": ["#),
        (String::new(), r#"{"ids": ["#),
    ];
    for (body, hint) in bodies {
        let shown: String = body.chars().take(60).collect();
        refused_with(
            &answer(&router, requeue(body, json)).await,
            StatusCode::BAD_REQUEST,
            hint,
            &shown,
        );
    }
    for content_type in [
        None,
        Some("text/plain"),
        Some("application/x-www-form-urlencoded"),
    ] {
        refused_with(
            &answer(
                &router,
                requeue(format!(r#"{{"ids": ["{pending}"]}}"#), content_type),
            )
            .await,
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "application/json",
            &format!("{content_type:?}"),
        );
    }
    // A body too large to be a list of ids.
    let huge = format!(r#"{{"ids": ["{}"]}}"#, "a".repeat(4 << 20));
    refused_with(
        &answer(&router, requeue(huge, json)).await,
        StatusCode::PAYLOAD_TOO_LARGE,
        "length limit exceeded",
        "a 4 MiB body",
    );
    // Wrong methods and unknown routes.
    for (method, uri, expected) in [
        ("POST", "/ops/statistics", StatusCode::METHOD_NOT_ALLOWED),
        ("DELETE", "/ops/deliveries", StatusCode::METHOD_NOT_ALLOWED),
        (
            "GET",
            "/ops/deliveries/requeue",
            StatusCode::METHOD_NOT_ALLOWED,
        ),
        ("GET", "/ops/nothing-here", StatusCode::NOT_FOUND),
    ] {
        let request = Request::builder()
            .method(method)
            .uri(uri)
            .body(Body::empty())
            .unwrap();
        refused_with(
            &answer(&router, request).await,
            expected,
            "",
            &format!("{method} {uri}"),
        );
    }
    // A well-formed id of a delivery that is not dead is reported, not requeued.
    let (status, _, body) = answer(
        &router,
        requeue(format!(r#"{{"ids": ["{pending}"]}}"#), json),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["not_found"], json!([pending.to_hex()]), "{body}");
    assert_unchanged(&db, &before, "refused operator requests").await;
}

#[tokio::test]
async fn request_transaction_options_out_of_range_are_refused_at_setup() {
    let db = test_db("bi_axum_config").await;
    let bus = bus(&bare_store(&db), &["a"]);
    let config = || relaybus_axum::config(bus.clone());
    let cases = [
        (
            "transaction_timeout",
            "use 1 ms to 60 s",
            config().transaction_timeout(Duration::ZERO).setup(),
        ),
        (
            "transaction_timeout",
            "use 1 ms to 60 s",
            config()
                .transaction_timeout(Duration::from_secs(61))
                .setup(),
        ),
        (
            "retry_after",
            "use at most 1 hour",
            config().retry_after(Duration::from_secs(3_601)).setup(),
        ),
        (
            "commit_retries",
            "use 0 to 10",
            config().commit_retries(11).setup(),
        ),
    ];
    for (option, hint, outcome) in cases {
        match outcome {
            Err(ConfigurationError::InvalidOption {
                option: got,
                reason,
            }) => {
                assert_eq!(got, option, "{reason}");
                says(&reason, &[hint]);
            }
            Err(other) => panic!("{option}: {other:?}"),
            Ok(_) => panic!("{option}: accepted"),
        }
    }
    assert_no_collections(&db).await;
}

#[tokio::test]
async fn a_route_whose_publish_is_refused_answers_with_the_error_and_commits_nothing() {
    use axum::{Json, extract::Path, routing::post};
    use relaybus_axum::Publisher;

    let db = test_db("bi_axum_publish").await;
    let store = store(&db).await;
    let bus = bus(&store, &["a"]);
    // An event of another type under the id the route reuses.
    bus.publish_envelope(
        EventEnvelope::new(&OrderShipped {
            order_id: "o-0".into(),
        })
        .unwrap()
        .with_id("taken")
        .unwrap(),
    )
    .await
    .unwrap();
    let (state, layer) = relaybus_axum::setup(bus.clone()).unwrap();
    let router: Router = Router::new()
        .route(
            "/orders/{kind}",
            post(async |Path(kind): Path<String>, mut publisher: Publisher| {
                let orders = publisher
                    .bus()
                    .store()
                    .database()
                    .collection::<Document>("orders");
                orders
                    .insert_one(doc! { "kind": &kind })
                    .session(publisher.session())
                    .await
                    .unwrap();
                let publish = match kind.as_str() {
                    "key" => publisher.publish(&placed("o-1")).key("k".repeat(513)),
                    "payload" => publisher.publish(&parts(101)),
                    _ => publisher.publish(&placed("o-1")).id("taken"),
                };
                match publish.await {
                    Ok(_) => Ok(StatusCode::CREATED),
                    Err(error) => Err((
                        StatusCode::UNPROCESSABLE_ENTITY,
                        Json(json!({ "error": error.to_string() })),
                    )),
                }
            }),
        )
        .layer(layer)
        .with_state(state);
    let before = contents(&db).await;
    for (kind, hint) in [
        ("key", "use 1 to 512 bytes"),
        ("payload", "more than 100 levels deep"),
        ("reused-id", "give every event its own id"),
    ] {
        let request = Request::post(format!("/orders/{kind}"))
            .body(Body::empty())
            .unwrap();
        refused_with(
            &answer(&router, request).await,
            StatusCode::UNPROCESSABLE_ENTITY,
            hint,
            kind,
        );
    }
    assert_unchanged(&db, &before, "routes whose publish was refused").await;
}

// ---------------------------------------------------------------------------------------------
// What `#[event]` and `#[handler]` leave to run time

/// Handlers declared with the macros. Their ids start with `badin.`; the tests above leave them
/// out of their buses.
mod declared {
    use std::sync::atomic::{AtomicU32, Ordering};

    use relaybus::BoxError;
    use serde::{Deserialize, Serialize};

    #[relaybus::event("badin.parcel.sent.v1")]
    #[derive(Debug, Clone, Serialize, Deserialize)]
    pub(crate) struct ParcelSent {
        pub(crate) parcel_id: String,
        pub(crate) weight_grams: u32,
    }

    /// An event whose payload is a bare number: the macro accepts it, publishing refuses it.
    #[relaybus::event("badin.tally.v1")]
    #[derive(Debug, Clone, Serialize, Deserialize)]
    pub(crate) struct Tally(pub(crate) u32);

    /// How often [`strict`] ran.
    pub(crate) static STRICT_CALLS: AtomicU32 = AtomicU32::new(0);

    #[relaybus::handler(id = "badin.strict", max_attempts = 1)]
    pub(crate) async fn strict(_event: ParcelSent) -> Result<(), BoxError> {
        STRICT_CALLS.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }

    /// Takes the session of its transaction twice, after a write through the first.
    #[relaybus::handler(id = "badin.greedy", transactional, max_attempts = 1)]
    pub(crate) async fn greedy(
        event: ParcelSent,
        context: relaybus::HandlerContext,
    ) -> Result<(), BoxError> {
        let mut first = context.session().await?;
        let database = super::GREEDY_DATABASE
            .get()
            .ok_or("the test sets the database first")?;
        database
            .collection::<mongodb::bson::Document>("parcels")
            .insert_one(mongodb::bson::doc! { "_id": &event.parcel_id })
            .session(&mut *first)
            .await?;
        let _second = context.session().await?;
        Ok(())
    }

    /// A longest wait under the default first wait (1 s): only the bus builder can tell.
    #[relaybus::handler(id = "badin.impatient", max_backoff_ms = 100)]
    pub(crate) async fn impatient(_event: ParcelSent) -> Result<(), BoxError> {
        Ok(())
    }
}

#[tokio::test]
async fn a_payload_that_no_longer_fits_a_macro_handler_is_buried_with_the_reason() {
    let db = test_db("bi_macro_payload").await;
    let store = store(&db).await;
    let bus = RelayBus::builder(store.clone())
        .registered_handlers_where(|h| h.id() == "badin.strict")
        .build()
        .unwrap();
    assert_eq!(
        bus.handlers_for(declared::ParcelSent::TYPE),
        ["badin.strict"]
    );
    // Written by an older version of the service: other field names, a weight as text.
    for payload in [
        json!({ "parcel": "p-1" }),
        json!({ "parcel_id": "p-2", "weight_grams": "heavy" }),
    ] {
        let old = EventEnvelope::from_json(declared::ParcelSent::TYPE, payload).unwrap();
        bus.publish_envelope(old).await.unwrap();
    }
    let report = bus.run_once().await.unwrap();
    assert_eq!((report.claimed, report.completed, report.other), (2, 0, 2));
    assert_eq!(declared::STRICT_CALLS.load(Ordering::SeqCst), 0);
    let dead = store
        .list_deliveries(&DeliveryQuery::new().status(DeliveryStatus::Dead))
        .await
        .unwrap();
    assert_eq!(dead.len(), 2);
    for record in &dead {
        says(
            record.last_error.as_deref().unwrap_or_default(),
            &[
                "badin.parcel.sent.v1",
                "no longer deserializes",
                "ParcelSent",
            ],
        );
    }
    let errors: Vec<&str> = dead
        .iter()
        .filter_map(|r| r.last_error.as_deref())
        .collect();
    assert!(errors.iter().any(|e| e.contains("parcel_id")), "{errors:?}");
    assert!(errors.iter().any(|e| e.contains("heavy")), "{errors:?}");
    assert_eq!(store.statistics().await.unwrap().pending, 0);
}

/// The database of the test of [`declared::greedy`].
static GREEDY_DATABASE: std::sync::OnceLock<mongodb::Database> = std::sync::OnceLock::new();

#[tokio::test]
async fn a_transactional_macro_handler_misusing_its_session_is_buried_and_its_writes_roll_back() {
    let db = test_db("bi_macro_session").await;
    GREEDY_DATABASE.set(db.db()).unwrap();
    let store = store(&db).await;
    let bus = RelayBus::builder(store.clone())
        .registered_handlers_where(|h| h.id() == "badin.greedy")
        .build()
        .unwrap();
    bus.publish(&declared::ParcelSent {
        parcel_id: "p-1".into(),
        weight_grams: 500,
    })
    .await
    .unwrap();
    let report = bus.run_once().await.unwrap();
    assert_eq!((report.claimed, report.completed, report.other), (1, 0, 1));
    let dead = store
        .list_deliveries(&DeliveryQuery::new().status(DeliveryStatus::Dead))
        .await
        .unwrap();
    assert_eq!(dead.len(), 1);
    says(
        dead[0].last_error.as_deref().unwrap_or_default(),
        &["\"badin.greedy\"", "held by another guard", "drop it first"],
    );
    assert!(
        !contents(&db).await.contains_key("parcels"),
        "the write of the failed attempt was committed"
    );
}

#[tokio::test]
async fn macro_declared_items_that_only_fail_at_run_time_are_refused_clearly() {
    let db = test_db("bi_macro_build").await;
    let store = bare_store(&db);

    // All registered handlers: the impatient one's retry settings are refused, naming it.
    let error = RelayBus::builder(store.clone()).build().unwrap_err();
    match &error {
        ConfigurationError::InvalidOption { option, reason } => {
            assert_eq!(*option, "retry");
            says(
                reason,
                &["\"badin.impatient\"", "shorter than initial_backoff"],
            );
        }
        other => panic!("{other:?}"),
    }
    // Leaving it out builds.
    RelayBus::builder(store.clone())
        .registered_handlers_where(|h| h.id() != "badin.impatient")
        .build()
        .unwrap();
    assert_no_collections(&db).await;

    // An `#[event]` whose payload is not an object is refused when published.
    let store = self::store(&db).await;
    let bus = bus_builder(&store).build().unwrap();
    let before = contents(&db).await;
    let error = bus.publish(&declared::Tally(3)).await.unwrap_err();
    assert!(
        matches!(
            &error,
            Error::EventValidation(EventValidationError::PayloadNotObject {
                found: "a number",
                ..
            })
        ),
        "{error:?}"
    );
    says(
        &error.to_string(),
        &["badin.tally.v1", "wrap the value in a struct"],
    );
    assert_unchanged(&db, &before, "a macro event that is not an object").await;
    assert!(total(&before) > 0);
}
