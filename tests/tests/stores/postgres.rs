//! The PostgreSQL store beyond the conformance suite: business rows and events in one
//! transaction (the bus's, or one the caller started with sqlx), sessions outside a
//! transaction, concurrent setups, wake-ups at commit, and per-key order under concurrent
//! appends.
//!
//! The server is `RELAYBUS_TEST_POSTGRES_URL` (default `postgres://postgres@127.0.0.1:5432/test`);
//! a test fails, never skips, when it does not answer.

use std::time::Duration;

use futures::StreamExt;
use relaybus::store::prelude::*;
use relaybus::{
    AppendRequest, ConfigurationError, Error, EventEnvelope, PostgresEventStore, PostgresSession,
    RelayBus, Timestamp, store::transaction,
};
use serde_json::json;
use sqlx::{Connection, PgConnection, PgPool, Row, postgres::PgListener, postgres::PgPoolOptions};

/// The server's URL.
fn url() -> String {
    std::env::var("RELAYBUS_TEST_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned())
}

/// A pool on the test server, or a failure that says how to get one.
async fn pool() -> PgPool {
    let url = url();
    PgPoolOptions::new()
        .max_connections(24)
        .acquire_timeout(Duration::from_secs(30))
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

/// A schema of the test's own, dropped when the test ends.
struct Schema {
    name: String,
}

impl Schema {
    fn new(test: &str) -> Schema {
        Schema {
            name: format!("pg{}_{test}", std::process::id()),
        }
    }

    /// `table` of this schema, quoted for SQL.
    fn table(&self, table: &str) -> String {
        format!("\"{}\".{table}", self.name)
    }
}

impl Drop for Schema {
    fn drop(&mut self) {
        let (url, name) = (url(), self.name.clone());
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

/// A set-up store on the test's schema, with an `orders` table for business rows.
async fn store(test: &str) -> (PostgresEventStore, Schema) {
    let schema = Schema::new(test);
    let pool = pool().await;
    sqlx::query(&format!(
        "DROP SCHEMA IF EXISTS \"{}\" CASCADE",
        schema.name
    ))
    .execute(&pool)
    .await
    .expect("a leftover schema dropped");
    let store = PostgresEventStore::builder(pool.clone())
        .schema(&schema.name)
        .build()
        .expect("valid options");
    store.setup().await.expect("setup");
    sqlx::query(&format!(
        "CREATE TABLE {} (id text PRIMARY KEY)",
        schema.table("orders")
    ))
    .execute(&pool)
    .await
    .expect("the orders table");
    (store, schema)
}

/// An `order.placed.v1` event with this id and, if given, this ordering key.
fn event(id: &str, key: Option<&str>) -> EventEnvelope {
    let event = EventEnvelope::from_json("order.placed.v1", json!({ "order": id }))
        .expect("valid event")
        .with_id(id)
        .expect("valid id");
    match key {
        Some(key) => event.with_key(key).expect("valid key"),
        None => event,
    }
}

/// Whether the store holds the event.
async fn holds(store: &PostgresEventStore, id: &str) -> bool {
    store
        .event_detail(id)
        .await
        .expect("event_detail")
        .is_some()
}

/// The ids in the orders table.
async fn orders(store: &PostgresEventStore, schema: &Schema) -> Vec<String> {
    sqlx::query_scalar(&format!(
        "SELECT id FROM {} ORDER BY id",
        schema.table("orders")
    ))
    .fetch_all(store.pool())
    .await
    .expect("orders")
}

fn handlers(names: &[&str]) -> Vec<String> {
    names.iter().map(|h| (*h).to_owned()).collect()
}

/// Appends `event` for `handlers` in a transaction of its own.
async fn append_alone(
    store: &PostgresEventStore,
    event: &EventEnvelope,
    handlers: &[String],
) -> Vec<relaybus::store::Appended> {
    transaction::run(store, None, async |session| {
        store
            .append(
                session,
                &[AppendRequest::new(event, handlers)],
                Timestamp::now(),
            )
            .await
    })
    .await
    .unwrap()
}

/// A user transaction that fails after writing its row and appending its event leaves
/// neither; the same body that succeeds leaves both.
#[tokio::test]
async fn a_rolled_back_user_transaction_leaves_neither_row_nor_event() {
    let (store, schema) = store("rolled_back").await;
    let insert = format!("INSERT INTO {} (id) VALUES ($1)", schema.table("orders"));
    let projector = handlers(&["projector"]);

    let failed: Result<(), Error> = transaction::run(&store, None, async |session| {
        sqlx::query(&insert)
            .bind("o-1")
            .execute(&mut **session)
            .await?;
        let placed = event("e-1", Some("o-1"));
        store
            .append(
                session,
                &[AppendRequest::new(&placed, &projector)],
                Timestamp::now(),
            )
            .await?;
        Err(Error::custom("the request failed after writing"))
    })
    .await;
    assert!(matches!(failed, Err(Error::Custom(_))), "{failed:?}");
    assert!(orders(&store, &schema).await.is_empty(), "the row was kept");
    assert!(!holds(&store, "e-1").await, "the event was kept");
    assert_eq!(store.statistics().await.unwrap().pending, 0);

    transaction::run(&store, None, async |session| {
        sqlx::query(&insert)
            .bind("o-1")
            .execute(&mut **session)
            .await?;
        let placed = event("e-1", Some("o-1"));
        store
            .append(
                session,
                &[AppendRequest::new(&placed, &projector)],
                Timestamp::now(),
            )
            .await
    })
    .await
    .expect("the transaction commits");
    assert_eq!(orders(&store, &schema).await, ["o-1"]);
    let detail = store.event_detail("e-1").await.unwrap().expect("the event");
    assert_eq!(detail.sequence, Some(1), "the rollback took no number");
}

/// A bus publishes inside a transaction the caller started with sqlx: nothing is visible
/// before the caller commits, row and event are after; a rolled-back one leaves nothing.
#[tokio::test]
async fn publishing_inside_a_user_started_sqlx_transaction() {
    let (store, schema) = store("user_transaction").await;
    let bus = RelayBus::builder(store.clone())
        .without_registered_handlers()
        .build()
        .expect("a bus");
    let insert = format!("INSERT INTO {} (id) VALUES ($1)", schema.table("orders"));

    let mut session = PostgresSession::from(store.pool().begin().await.unwrap());
    assert!(session.in_transaction());
    sqlx::query(&insert)
        .bind("o-1")
        .execute(&mut *session)
        .await
        .unwrap();
    bus.publish_envelope(event("e-1", Some("o-1")))
        .session(&mut session)
        .await
        .expect("a publish in the caller's transaction");
    // `Transactions::commit` leaves the caller's transaction alone.
    assert!(store.commit(&mut session).await.is_err());
    assert!(!holds(&store, "e-1").await, "visible before the commit");
    assert!(orders(&store, &schema).await.is_empty());
    let transaction = session
        .into_transaction()
        .expect("the caller's transaction back");
    transaction.commit().await.unwrap();
    assert!(holds(&store, "e-1").await, "the event did not commit");
    assert_eq!(orders(&store, &schema).await, ["o-1"]);

    let mut session = PostgresSession::from(store.pool().begin().await.unwrap());
    sqlx::query(&insert)
        .bind("o-2")
        .execute(session.connection())
        .await
        .unwrap();
    bus.publish_envelope(event("e-2", Some("o-2")))
        .session(&mut session)
        .await
        .unwrap();
    session
        .into_transaction()
        .unwrap()
        .rollback()
        .await
        .unwrap();
    assert!(!holds(&store, "e-2").await, "a rolled-back event was kept");
    assert_eq!(orders(&store, &schema).await, ["o-1"]);
}

/// A session outside a transaction is refused with `NoTransaction` by the store and the bus,
/// and nothing is written; once a transaction begins on it, it is taken.
#[tokio::test]
async fn a_connection_not_in_a_transaction_is_refused() {
    let (store, _schema) = store("no_transaction").await;
    let bus = RelayBus::builder(store.clone())
        .without_registered_handlers()
        .build()
        .unwrap();
    let mut session = store.session().await.unwrap();
    assert!(!session.in_transaction());

    let placed = event("e-1", None);
    let projector = handlers(&["projector"]);
    let refused = store
        .append(
            &mut session,
            &[AppendRequest::new(&placed, &projector)],
            Timestamp::now(),
        )
        .await;
    assert!(
        matches!(
            refused,
            Err(Error::Configuration(
                ConfigurationError::NoTransaction { .. }
            ))
        ),
        "{refused:?}"
    );
    let refused = bus
        .publish_envelope(event("e-2", None))
        .session(&mut session)
        .await;
    assert!(
        matches!(
            refused,
            Err(Error::Configuration(
                ConfigurationError::NoTransaction { .. }
            ))
        ),
        "{refused:?}"
    );
    let message = refused.map(|_| ()).unwrap_err().to_string();
    assert!(
        message.contains(
            "PostgresEventStore.append needs a PostgresSession inside a started transaction"
        ),
        "{message}"
    );
    assert!(!holds(&store, "e-1").await);
    assert!(!holds(&store, "e-2").await);

    store.begin(&mut session, None).await.unwrap();
    store
        .append(
            &mut session,
            &[AppendRequest::new(&placed, &projector)],
            Timestamp::now(),
        )
        .await
        .expect("taken in a transaction");
    store.commit(&mut session).await.unwrap();
    assert!(holds(&store, "e-1").await);
}

/// Setups of one schema running at the same time, from stores of their own pools, all
/// succeed, and leave one working schema.
#[tokio::test]
async fn concurrent_setups_succeed() {
    let schema = Schema::new("concurrent_setups");
    let first = pool().await;
    sqlx::query(&format!(
        "DROP SCHEMA IF EXISTS \"{}\" CASCADE",
        schema.name
    ))
    .execute(&first)
    .await
    .unwrap();
    let mut stores = Vec::new();
    for _ in 0..8 {
        let pool = PgPoolOptions::new()
            .max_connections(1)
            .connect(&url())
            .await
            .unwrap();
        stores.push(
            PostgresEventStore::builder(pool)
                .schema(&schema.name)
                .build()
                .unwrap(),
        );
    }
    let outcomes = futures::future::join_all(stores.iter().map(|s| s.setup())).await;
    for outcome in &outcomes {
        assert!(outcome.is_ok(), "a concurrent setup failed: {outcome:?}");
    }
    let store = &stores[0];
    let projector = handlers(&["projector"]);
    let placed = event("e-1", Some("k"));
    let appended = append_alone(store, &placed, &projector).await;
    assert_eq!(appended[0].sequence, Some(1));
    let tables: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM information_schema.tables WHERE table_schema = $1",
    )
    .bind(&schema.name)
    .fetch_one(&first)
    .await
    .unwrap();
    assert_eq!(
        tables, 9,
        "events, deliveries, key_sequences, completed_deliveries, leads, consumer_positions, \
         idempotency_keys, slots, rate_windows"
    );
}

/// An append notifies at its commit, never before and never after a rollback: a listener on
/// the store's channel gets the notifications in commit order, each naming the handlers, and
/// `watch` wakes for its handlers.
#[tokio::test]
async fn notify_wakes_a_watcher_at_commit_and_not_on_rollback() {
    let (store, _schema) = store("notify").await;
    let mut listener = PgListener::connect_with(store.pool()).await.unwrap();
    listener.listen(&store.channel()).await.unwrap();
    let mut watch = store.watch(&handlers(&["projector"])).await.unwrap();
    let projector = handlers(&["projector"]);
    let mailer = handlers(&["mailer"]);
    let next = async |listener: &mut PgListener| {
        tokio::time::timeout(Duration::from_secs(10), listener.recv())
            .await
            .expect("a notification")
            .expect("the listener")
            .payload()
            .to_owned()
    };

    // Appended first, committed last.
    let held = event("e-1", None);
    let mut session = store.session().await.unwrap();
    store.begin(&mut session, None).await.unwrap();
    store
        .append(
            &mut session,
            &[AppendRequest::new(&held, &projector)],
            Timestamp::now(),
        )
        .await
        .unwrap();
    let other = event("e-2", None);
    transaction::run(&store, None, async |s| {
        store
            .append(s, &[AppendRequest::new(&other, &mailer)], Timestamp::now())
            .await
    })
    .await
    .unwrap();
    assert_eq!(
        next(&mut listener).await,
        "mailer",
        "the uncommitted append notified"
    );
    store.commit(&mut session).await.unwrap();
    assert_eq!(next(&mut listener).await, "projector");
    let woken = tokio::time::timeout(Duration::from_secs(10), watch.next())
        .await
        .expect("the watcher woke");
    assert!(matches!(woken, Some(Ok(_))), "{woken:?}");

    // A rolled-back append never notifies: the next notification is the committed one after.
    let dropped = event("e-3", None);
    store.begin(&mut session, None).await.unwrap();
    store
        .append(
            &mut session,
            &[AppendRequest::new(&dropped, &projector)],
            Timestamp::now(),
        )
        .await
        .unwrap();
    store.abort(&mut session).await;
    let last = event("e-4", None);
    transaction::run(&store, None, async |s| {
        store
            .append(
                s,
                &[AppendRequest::new(&last, &handlers(&["mailer", "audit"]))],
                Timestamp::now(),
            )
            .await
    })
    .await
    .unwrap();
    assert_eq!(
        next(&mut listener).await,
        "audit,mailer",
        "the rolled-back append notified"
    );
}

/// Many transactions appending on one key at once: each takes its numbers only once every
/// lower number committed (it sees them all), and together they are 1 to N without a gap.
#[tokio::test]
async fn concurrent_appends_on_one_key_are_gapless_in_commit_order() {
    let (store, schema) = store("concurrent_appends").await;
    let events = schema.table("events");
    let tasks = (0..16).map(|task| {
        let (store, events) = (&store, &events);
        async move {
            let batch = [
                event(&format!("t{task}-a"), Some("K")),
                event(&format!("t{task}-b"), Some("K")),
            ];
            let projector = handlers(&["projector"]);
            let requests: Vec<AppendRequest<'_>> = batch
                .iter()
                .map(|e| AppendRequest::new(e, &projector))
                .collect();
            transaction::run(store, None, async |session| {
                let appended = store.append(session, &requests, Timestamp::now()).await?;
                // Committed events of the key, and this transaction's own.
                let row = sqlx::query(&format!(
                    "SELECT count(*) AS n, max(sequence) AS last FROM {events} WHERE key = 'K'"
                ))
                .fetch_one(&mut **session)
                .await?;
                let seen: i64 = row.get("n");
                let last: Option<i64> = row.get("last");
                Ok((appended, seen, last))
            })
            .await
        }
    });
    let mut sequences = Vec::new();
    for outcome in futures::future::join_all(tasks).await {
        let (appended, seen, last) = outcome.expect("the append");
        let mine: Vec<i64> = appended.iter().filter_map(|a| a.sequence).collect();
        assert_eq!(mine.len(), 2);
        assert_eq!(
            mine[1],
            mine[0] + 1,
            "one transaction's numbers are contiguous"
        );
        assert_eq!(
            (seen, last),
            (mine[1], Some(mine[1])),
            "numbers were taken before every lower number committed"
        );
        sequences.extend(mine);
    }
    sequences.sort_unstable();
    assert_eq!(sequences, (1..=32).collect::<Vec<i64>>(), "gapless");
}

/// A schema name PostgreSQL would fold or refuse is refused at `build`, saying what to use.
#[tokio::test]
async fn a_bad_schema_name_is_refused() {
    let pool = PgPoolOptions::new().connect_lazy(&url()).unwrap();
    for bad in ["Relaybus", "a-b", "", "pg_catalog", "1abc"] {
        match PostgresEventStore::builder(pool.clone())
            .schema(bad)
            .build()
        {
            Err(ConfigurationError::InvalidOption { option, reason }) => {
                assert_eq!(option, "schema");
                assert!(reason.contains("lowercase ASCII letters"), "{reason}");
            }
            other => panic!("{bad:?} was not refused: {other:?}"),
        }
    }
}

/// A deadlock between two transactions is a transient error, through the store's predicate
/// and through `relaybus::Error`, so the transaction helpers run the loser again.
#[tokio::test]
async fn a_deadlock_is_a_transient_error() {
    let (store, schema) = store("deadlock").await;
    let orders = schema.table("orders");
    sqlx::query(&format!("INSERT INTO {orders} (id) VALUES ('a'), ('b')"))
        .execute(store.pool())
        .await
        .unwrap();
    let lock = format!("SELECT id FROM {orders} WHERE id = $1 FOR UPDATE");
    let (mut first, mut second) = (
        store.session().await.unwrap(),
        store.session().await.unwrap(),
    );
    store.begin(&mut first, None).await.unwrap();
    store.begin(&mut second, None).await.unwrap();
    sqlx::query(&lock)
        .bind("a")
        .execute(&mut *first)
        .await
        .unwrap();
    sqlx::query(&lock)
        .bind("b")
        .execute(&mut *second)
        .await
        .unwrap();
    // Each now waits for the other; PostgreSQL aborts one, which then rolls back.
    let cross = async |session: &mut PostgresSession, id: &str| {
        let outcome = sqlx::query(&lock).bind(id).execute(&mut **session).await;
        if outcome.is_err() {
            store.abort(session).await;
        }
        outcome
    };
    let (one, two) = tokio::join!(cross(&mut first, "b"), cross(&mut second, "a"));
    let error = match (one, two) {
        (Err(error), Ok(_)) | (Ok(_), Err(error)) => error,
        other => panic!("expected one deadlock victim: {other:?}"),
    };
    assert!(PostgresEventStore::is_transient(&error), "{error}");
    assert!(Error::from(error).is_transient_transaction_error());
    store.abort(&mut first).await;
    store.abort(&mut second).await;
}

#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct OrderPlaced {
    order_id: String,
}

impl relaybus::Event for OrderPlaced {
    const TYPE: &'static str = "order.placed.v1";
}

/// A bus on the store end to end: an order and its event commit together, a transactional
/// handler's row commits with its completion, the completion is recorded with completion
/// history, and purge lets both go.
#[tokio::test]
async fn a_transactional_handler_writes_with_its_completion() {
    use relaybus::{
        BoxError, DeliveryQuery, DeliveryStatus, HandlerContext, PurgeOptions, Subscription,
    };

    let (plain, schema) = store("end_to_end").await;
    let store = PostgresEventStore::builder(plain.pool().clone())
        .schema(&schema.name)
        .completion_history(true)
        .build()
        .unwrap();
    let projections = schema.table("projections");
    sqlx::query(&format!("CREATE TABLE {projections} (id text PRIMARY KEY)"))
        .execute(store.pool())
        .await
        .unwrap();
    let project = format!("INSERT INTO {projections} (id) VALUES ($1)");
    let bus: RelayBus<PostgresEventStore> = RelayBus::builder(store.clone())
        .without_registered_handlers()
        .subscribe(
            Subscription::new(
                "project-orders",
                move |event: OrderPlaced, ctx: HandlerContext<PostgresEventStore>| {
                    let project = project.clone();
                    async move {
                        let mut session = ctx.session().await?;
                        sqlx::query(&project)
                            .bind(&event.order_id)
                            .execute(&mut **session)
                            .await?;
                        Ok::<(), BoxError>(())
                    }
                },
            )
            .transactional(),
        )
        .build()
        .unwrap();

    let insert = format!("INSERT INTO {} (id) VALUES ($1)", schema.table("orders"));
    bus.transaction(async |session| {
        sqlx::query(&insert)
            .bind("o-1")
            .execute(&mut **session)
            .await?;
        bus.publish(&OrderPlaced {
            order_id: "o-1".into(),
        })
        .id("e-1")
        .key("o-1")
        .session(session)
        .await?;
        Ok(())
    })
    .await
    .unwrap();
    bus.run_until_idle().await.expect("the handler ran");

    let rows: Vec<String> = sqlx::query_scalar(&format!("SELECT id FROM {projections}"))
        .fetch_all(store.pool())
        .await
        .unwrap();
    assert_eq!(rows, ["o-1"]);
    let stats = store.statistics().await.unwrap();
    assert_eq!((stats.pending, stats.completed), (0, 1), "{stats:?}");
    let records = store
        .list_deliveries(&DeliveryQuery::new().status(DeliveryStatus::Completed))
        .await
        .unwrap();
    assert_eq!(records.len(), 1, "{records:?}");
    assert_eq!(
        (records[0].event_id.as_str(), records[0].attempts),
        ("e-1", 1)
    );
    let detail = store.event_detail("e-1").await.unwrap().expect("the event");
    assert!(detail.completed_at.is_some(), "{detail:?}");
    assert_eq!(detail.deliveries.len(), 1);

    let later = Timestamp::now().saturating_add(Duration::from_secs(3600));
    let purged = store
        .purge(&PurgeOptions::new().completed_before(later))
        .await
        .unwrap();
    assert_eq!(
        (purged.completion_records, purged.events),
        (1, 1),
        "{purged:?}"
    );
    assert!(!holds(&store, "e-1").await);
}

/// Bad input is refused with a typed error saying what is wrong, before anything is written.
#[tokio::test]
async fn bad_input_is_refused_and_writes_nothing() {
    use relaybus::{DeliveryQuery, EventValidationError, store::ClaimRequest};

    let (store, _schema) = store("bad_input").await;
    let projector = handlers(&["projector"]);
    let claim = |owner: &'static str, limit: u32, lease: Duration| ClaimRequest {
        owner,
        handlers: &projector,
        limit,
        lease_duration: lease,
        now: Timestamp::now(),
    };
    for (request, argument) in [
        (claim("", 1, Duration::from_secs(30)), "owner"),
        (claim("w", 0, Duration::from_secs(30)), "limit"),
        (claim("w", 1, Duration::ZERO), "lease_duration"),
    ] {
        match store.claim(request).await {
            Err(Error::InvalidArgument(error)) => assert_eq!(error.argument(), argument),
            other => panic!("{argument}: {other:?}"),
        }
    }
    for query in [
        DeliveryQuery::new().limit(0),
        DeliveryQuery::new().after("not-an-id"),
    ] {
        let refused = store.list_deliveries(&query).await;
        assert!(
            matches!(refused, Err(Error::InvalidArgument(_))),
            "{refused:?}"
        );
    }
    let junk = ["junk".to_owned(), "-1".to_owned()];
    assert_eq!(
        store
            .requeue(&junk, Timestamp::now())
            .await
            .unwrap()
            .not_found,
        junk
    );
    assert!(
        store
            .bury_by_id(&junk, "  ", Timestamp::now())
            .await
            .is_err()
    );

    let bad_key = event("e-1", Some("a\0b"));
    let refused = transaction::run(&store, None, async |session| {
        store
            .append(
                session,
                &[AppendRequest::new(&bad_key, &projector)],
                Timestamp::now(),
            )
            .await
    })
    .await;
    assert!(
        matches!(
            refused,
            Err(Error::EventValidation(
                EventValidationError::InvalidKey { .. }
            ))
        ),
        "{refused:?}"
    );
    let bad_handler = handlers(&["no spaces"]);
    let good = event("e-2", None);
    let refused = transaction::run(&store, None, async |session| {
        store
            .append(
                session,
                &[AppendRequest::new(&good, &bad_handler)],
                Timestamp::now(),
            )
            .await
    })
    .await;
    assert!(
        matches!(
            refused,
            Err(Error::Configuration(
                ConfigurationError::InvalidHandlerId { .. }
            ))
        ),
        "{refused:?}"
    );
    assert!(!holds(&store, "e-1").await && !holds(&store, "e-2").await);
    assert!(store.event_detail("a\0b").await.unwrap().is_none());
    let stats = store.statistics().await.unwrap();
    assert_eq!((stats.pending, stats.dead), (0, 0));
}

/// The buses that share a store instance sample the delivery gauges with one count while it is
/// young; a sample that asks for a newer count, the operators' statistics and another instance
/// count anew.
#[tokio::test]
async fn gauge_samples_of_one_store_instance_share_a_count_while_it_is_young() {
    let (store, _schema) = store("gauge_sample").await;
    let projector = handlers(&["projector"]);
    let append = async |id: &str| {
        append_alone(&store, &event(id, None), &projector).await;
    };
    let pending = |stats: Vec<relaybus::HandlerStatistics>| -> Vec<u64> {
        stats.iter().map(|handler| handler.pending).collect()
    };
    let age = Duration::from_secs(60);

    append("g-1").await;
    assert_eq!(pending(store.gauge_statistics(age).await.unwrap()), [1]);
    append("g-2").await;
    let other = store.clone();
    assert_eq!(
        pending(other.gauge_statistics(age).await.unwrap()),
        [1],
        "shared"
    );
    assert_eq!(
        pending(store.gauge_statistics(Duration::ZERO).await.unwrap()),
        [2]
    );
    append("g-3").await;
    assert_eq!(pending(store.handler_statistics().await.unwrap()), [3]);
    let apart = PostgresEventStore::builder(store.pool().clone())
        .schema(store.schema())
        .build()
        .unwrap();
    assert_eq!(pending(apart.gauge_statistics(age).await.unwrap()), [3]);
}

/// The tables and indexes `setup()` made before completions stopped writing index entries
/// (`{s}` standing for the schema), as that version wrote them: a database to upgrade.
const PREVIOUS_SCHEMA: &str = r#"
CREATE SCHEMA IF NOT EXISTS {s};

CREATE TABLE IF NOT EXISTS {s}.events (
    id text PRIMARY KEY,
    event_type text NOT NULL,
    key text,
    sequence bigint,
    payload json NOT NULL,
    headers json NOT NULL,
    correlation_id text,
    causation_id text,
    created_at bigint NOT NULL,
    appended_at bigint NOT NULL,
    handlers text[] NOT NULL,
    completed_at bigint
);

CREATE TABLE IF NOT EXISTS {s}.key_sequences (
    key text PRIMARY KEY,
    sequence bigint NOT NULL
);

CREATE TABLE IF NOT EXISTS {s}.consumer_positions (
    consumer text NOT NULL,
    source text NOT NULL,
    partition integer NOT NULL,
    next_offset bigint NOT NULL,
    updated_at bigint NOT NULL,
    PRIMARY KEY (consumer, source, partition)
);

CREATE TABLE IF NOT EXISTS {s}.deliveries (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    event_id text NOT NULL REFERENCES {s}.events (id),
    handler text NOT NULL,
    event_type text NOT NULL,
    key text,
    sequence bigint,
    unordered boolean NOT NULL DEFAULT false,
    status text NOT NULL CHECK (status IN ('pending', 'dead')),
    parked boolean NOT NULL DEFAULT false,
    attempts integer NOT NULL DEFAULT 0,
    due_at bigint NOT NULL,
    created_at bigint NOT NULL,
    updated_at bigint,
    last_error text,
    errors jsonb NOT NULL DEFAULT '[]',
    requeued integer NOT NULL DEFAULT 0,
    claims bigint NOT NULL DEFAULT 0,
    lease_owner text,
    lease_instance text,
    lease_expires_at bigint,
    lane integer NOT NULL,
    UNIQUE (event_id, handler)
) WITH (fillfactor = 50);

DO $$
BEGIN
    IF NOT EXISTS (SELECT FROM pg_class WHERE oid = to_regclass('{s}.deliveries')
                   AND 'fillfactor=50' = ANY (reloptions)) THEN
        ALTER TABLE {s}.deliveries SET (fillfactor = 50);
    END IF;
END
$$;
DROP INDEX IF EXISTS {s}.deliveries_running;

CREATE INDEX IF NOT EXISTS deliveries_claim ON {s}.deliveries (due_at, id)
    WHERE status = 'pending' AND NOT parked;
CREATE INDEX IF NOT EXISTS deliveries_ordering ON {s}.deliveries (handler, key, sequence)
    WHERE status = 'pending' AND key IS NOT NULL AND NOT unordered;
CREATE INDEX IF NOT EXISTS deliveries_heads ON {s}.deliveries (handler, key)
    WHERE status = 'pending' AND key IS NOT NULL AND NOT unordered AND NOT parked;
CREATE INDEX IF NOT EXISTS deliveries_dead ON {s}.deliveries (updated_at)
    WHERE status = 'dead';
CREATE INDEX IF NOT EXISTS deliveries_handler ON {s}.deliveries (handler, status);

CREATE INDEX IF NOT EXISTS events_finished ON {s}.events (coalesce(completed_at, created_at));

CREATE TABLE IF NOT EXISTS {s}.completed_deliveries (
    id bigint PRIMARY KEY,
    event_id text NOT NULL,
    handler text NOT NULL,
    event_type text NOT NULL,
    key text,
    sequence bigint,
    unordered boolean NOT NULL,
    attempts integer NOT NULL,
    due_at bigint NOT NULL,
    created_at bigint NOT NULL,
    updated_at bigint,
    completed_at bigint NOT NULL,
    last_error text,
    errors jsonb NOT NULL,
    requeued integer NOT NULL
);
CREATE INDEX IF NOT EXISTS completed_deliveries_completed_at
    ON {s}.completed_deliveries (completed_at);
CREATE INDEX IF NOT EXISTS completed_deliveries_event ON {s}.completed_deliveries (event_id);

CREATE TABLE IF NOT EXISTS {s}.leads (
    role text PRIMARY KEY,
    holder text NOT NULL,
    expires_at timestamptz NOT NULL
);
"#;

/// `setup()` upgrades a database made by the previous schema in place: the indexes no query
/// reads any more are gone, the events keep room for their completion stamps, and what the
/// old tables held (parked backlogs of keys, unkeyed deliveries, completed events) drains in
/// order.
#[tokio::test]
async fn setup_upgrades_a_database_of_the_previous_schema_in_place() {
    use relaybus::{BoxError, HandlerContext, Subscription};
    use sqlx::Executor;
    use std::sync::{Arc, Mutex};

    let schema = Schema::new("upgrade");
    let pool = pool().await;
    let quoted = format!("\"{}\"", schema.name);
    pool.execute(format!("DROP SCHEMA IF EXISTS {quoted} CASCADE").as_str())
        .await
        .expect("a leftover schema dropped");
    pool.execute(PREVIOUS_SCHEMA.replace("{s}", &quoted).as_str())
        .await
        .expect("the previous schema");
    let store = PostgresEventStore::builder(pool.clone())
        .schema(&schema.name)
        .build()
        .expect("valid options");
    let indexes = async |table: &str| -> Vec<String> {
        sqlx::query_scalar(
            "SELECT indexname::text FROM pg_indexes WHERE schemaname = $1 AND tablename = $2 \
             ORDER BY indexname",
        )
        .bind(&schema.name)
        .bind(table)
        .fetch_all(&pool)
        .await
        .expect("the indexes")
    };
    assert!(
        indexes("events")
            .await
            .contains(&"events_finished".to_owned())
    );
    assert!(
        indexes("deliveries")
            .await
            .contains(&"deliveries_handler".to_owned())
    );

    // What the old tables hold: keyed backlogs (parked behind their heads) and unkeyed
    // deliveries for two handlers, and one event already completed.
    // Each run's handler, key and sequence, in the order they ran.
    type Runs = Vec<(String, Option<String>, Option<i64>)>;
    let ran: Arc<Mutex<Runs>> = Arc::default();
    let subscribe = |id: &'static str| {
        let ran = Arc::clone(&ran);
        Subscription::new(
            id,
            move |_: OrderPlaced, ctx: HandlerContext<PostgresEventStore>| {
                ran.lock().unwrap().push((
                    ctx.handler().to_owned(),
                    ctx.key().map(str::to_owned),
                    ctx.sequence(),
                ));
                async { Ok::<(), BoxError>(()) }
            },
        )
    };
    let bus: RelayBus<PostgresEventStore> = RelayBus::builder(store.clone())
        .without_registered_handlers()
        .subscribe(subscribe("tally"))
        .subscribe(subscribe("ship"))
        .build()
        .unwrap();
    let publish = async |n: usize, key: Option<String>| {
        bus.transaction(async |session| {
            let publish = bus.publish(&OrderPlaced {
                order_id: format!("o-{n}"),
            });
            match key.clone() {
                Some(key) => publish.key(key).session(session).await?,
                None => publish.session(session).await?,
            };
            Ok(())
        })
        .await
        .expect("published");
    };
    publish(0, None).await;
    let both = handlers(&["tally", "ship"]);
    let completed = store
        .claim(relaybus::store::ClaimRequest {
            owner: "before",
            handlers: &both,
            limit: 2,
            lease_duration: Duration::from_secs(60),
            now: Timestamp::now(),
        })
        .await
        .expect("claimed");
    assert_eq!(completed.len(), 2);
    let leases: Vec<_> = completed.iter().map(|c| c.lease).collect();
    assert_eq!(
        store.complete(&leases, Timestamp::now()).await.unwrap(),
        [true, true]
    );
    for n in 1..=12 {
        publish(n, Some(format!("k{}", n % 3))).await;
    }
    for n in 13..=16 {
        publish(n, None).await;
    }
    let parked: i64 = sqlx::query_scalar(&format!(
        "SELECT count(*) FROM {quoted}.deliveries WHERE parked"
    ))
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(
        parked, 18,
        "3 of each key's 4 deliveries wait, for each handler"
    );

    store.setup().await.expect("the upgrade");
    store
        .setup()
        .await
        .expect("setup again, on the upgraded schema");
    assert!(
        !indexes("events")
            .await
            .contains(&"events_finished".to_owned())
    );
    assert!(
        !indexes("deliveries")
            .await
            .contains(&"deliveries_handler".to_owned())
    );
    let options: Vec<String> =
        sqlx::query_scalar("SELECT unnest(reloptions) FROM pg_class WHERE oid = to_regclass($1)")
            .bind(format!("{quoted}.events"))
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(options, ["fillfactor=70"]);

    let report = bus.run_until_idle().await.expect("drained");
    assert_eq!(report.succeeded().count(), 32, "{report:?}");
    assert_eq!(store.statistics().await.unwrap().pending, 0);
    let ran = ran.lock().unwrap().clone();
    for handler in ["tally", "ship"] {
        for key in ["k0", "k1", "k2"] {
            let sequences: Vec<i64> = ran
                .iter()
                .filter(|(h, k, _)| h == handler && k.as_deref() == Some(key))
                .filter_map(|(_, _, s)| *s)
                .collect();
            assert_eq!(sequences, [1, 2, 3, 4], "{handler} {key}");
        }
        let unkeyed = ran.iter().filter(|(h, k, _)| h == handler && k.is_none());
        assert_eq!(unkeyed.count(), 4, "{handler}");
    }
}

/// Everything `tracing` records while it is installed on this thread, as text.
#[derive(Clone, Default)]
struct CapturedLog(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

impl CapturedLog {
    /// Installs a subscriber of every level that writes here, for the current thread (the
    /// test's runtime runs on it, and sqlx reads notices in the task that queries).
    fn install(&self) -> tracing::subscriber::DefaultGuard {
        let subscriber = tracing_subscriber::fmt()
            .with_max_level(tracing::Level::TRACE)
            .with_ansi(false)
            .with_writer(self.clone())
            .finish();
        tracing::subscriber::set_default(subscriber)
    }

    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }
}

impl std::io::Write for CapturedLog {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for CapturedLog {
    type Writer = CapturedLog;

    fn make_writer(&'a self) -> Self::Writer {
        self.clone()
    }
}

/// A process that starts on an existing schema (a new store value, its `setup()` and the bus's
/// start) logs no server notice: `IF NOT EXISTS` on an existing table is no news.
#[tokio::test]
async fn a_start_on_an_existing_schema_logs_no_server_notice() {
    let (first, schema) = store("quiet_setup").await;
    let log = CapturedLog::default();
    let _installed = log.install();

    let restarted = PostgresEventStore::builder(first.pool().clone())
        .schema(&schema.name)
        .build()
        .unwrap();
    restarted
        .setup()
        .await
        .expect("setup on the existing schema");
    let bus = RelayBus::builder(restarted.clone())
        .without_registered_handlers()
        .build()
        .unwrap();
    bus.start().await.unwrap();
    bus.shutdown().await.unwrap();
    let quiet = log.text();
    assert!(
        !quiet.contains("already exists"),
        "a start on an existing schema logged the server's notices:\n{quiet}"
    );

    // The capture does see the server's notices: the same statement outside the setup logs one.
    sqlx::query(&format!("CREATE SCHEMA IF NOT EXISTS \"{}\"", schema.name))
        .execute(first.pool())
        .await
        .unwrap();
    assert!(
        log.text().contains("already exists, skipping"),
        "the capture missed a notice: {}",
        log.text()
    );
}

/// A store value and its clones set up once: the setup that `bus.start()` makes after the
/// service's own changes nothing, while a new store value (another process) sets up again.
#[tokio::test]
async fn a_store_value_and_its_clones_set_up_once() {
    let (store, schema) = store("setup_once").await;
    let leads = schema.table("leads");
    let exists = async |store: &PostgresEventStore| -> bool {
        sqlx::query_scalar::<_, Option<String>>("SELECT to_regclass($1)::text")
            .bind(&leads)
            .fetch_one(store.pool())
            .await
            .unwrap()
            .is_some()
    };
    sqlx::query(&format!("DROP TABLE {leads}"))
        .execute(store.pool())
        .await
        .unwrap();

    store.clone().setup().await.unwrap();
    let bus = RelayBus::builder(store.clone())
        .without_registered_handlers()
        .gauge_interval(None)
        .build()
        .unwrap();
    bus.start().await.unwrap();
    bus.shutdown().await.unwrap();
    assert!(
        !exists(&store).await,
        "a second setup of one store value ran"
    );

    let another = PostgresEventStore::builder(store.pool().clone())
        .schema(&schema.name)
        .build()
        .unwrap();
    another.setup().await.unwrap();
    assert!(exists(&store).await, "a new store value sets up");
}

/// The PostgreSQL names (`relaybus::postgres::{Bus, Context, Session}`) and a session handed to
/// sqlx as it is: `&mut PostgresSession` is an `Executor`, in a bus transaction, in a
/// transactional handler and from a transaction of the caller's.
#[tokio::test]
async fn the_postgres_names_and_a_session_as_an_sqlx_executor() {
    use relaybus::{
        BoxError, Subscription,
        postgres::{Bus, Context, Session},
    };

    let (store, schema) = store("names").await;
    let projections = schema.table("projections");
    sqlx::query(&format!("CREATE TABLE {projections} (id text PRIMARY KEY)"))
        .execute(store.pool())
        .await
        .unwrap();
    let project = format!("INSERT INTO {projections} (id) VALUES ($1)");
    let bus: Bus = Bus::builder(store.clone())
        .without_registered_handlers()
        .subscribe(
            Subscription::new("project", move |event: OrderPlaced, ctx: Context| {
                let project = project.clone();
                async move {
                    let mut session = ctx.session().await?;
                    sqlx::query(&project)
                        .bind(&event.order_id)
                        .execute(&mut *session)
                        .await?;
                    Ok::<(), BoxError>(())
                }
            })
            .transactional(),
        )
        .build()
        .unwrap();

    let insert = format!("INSERT INTO {} (id) VALUES ($1)", schema.table("orders"));
    bus.transaction(async |session| {
        sqlx::query(&insert)
            .bind("o-1")
            .execute(&mut *session)
            .await?;
        let (count,): (i64,) =
            sqlx::query_as(&format!("SELECT count(*) FROM {}", schema.table("orders")))
                .fetch_one(&mut *session)
                .await?;
        assert_eq!(count, 1, "the session reads its own transaction's row");
        bus.publish(&OrderPlaced {
            order_id: "o-1".into(),
        })
        .session(session)
        .await?;
        Ok(())
    })
    .await
    .unwrap();

    let mut own = Session::from(store.pool().begin().await.unwrap());
    sqlx::query(&insert)
        .bind("o-2")
        .execute(&mut own)
        .await
        .unwrap();
    own.into_transaction().unwrap().rollback().await.unwrap();

    let report = bus.run_until_idle().await.unwrap();
    assert_eq!(report.succeeded().count(), 1, "{report:?}");
    assert_eq!(orders(&store, &schema).await, ["o-1"]);
    let projected: Vec<String> = sqlx::query_scalar(&format!("SELECT id FROM {projections}"))
        .fetch_all(store.pool())
        .await
        .unwrap();
    assert_eq!(projected, ["o-1"]);
}

/// Three worker processes run a schedule every second on one schema for 30 seconds of real
/// time; one is killed with SIGKILL and started again: each tick is one event, none missing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_schedule_survives_a_killed_process_with_one_event_per_tick() {
    let (store, schema) = store("schedule_kill").await;
    let url = url();
    let (started, ended) = relaybus_tests::fault::three_schedule_workers_one_killed(
        env!("CARGO_BIN_EXE_relaybus-fault-worker"),
        |owner| {
            [
                "--store",
                "postgres",
                "--schedule",
                &url,
                &schema.name,
                owner,
                "2000",
                "200",
            ]
            .map(str::to_owned)
            .to_vec()
        },
        Duration::from_secs(30),
        Duration::from_millis(12_300),
    )
    .await;
    let ids: Vec<String> = sqlx::query_scalar(&format!(
        "SELECT id FROM {} WHERE event_type = 'schedule.beat.v1'",
        schema.table("events")
    ))
    .fetch_all(&pool().await)
    .await
    .expect("the ticks' events");
    relaybus_tests::fault::check_one_event_per_tick(
        relaybus_tests::fault::tick_times(ids),
        started,
        ended,
    );
    drop(store);
}

/// Three buses on three stores of one schema (three pools, as three processes have), a
/// handler with `global_concurrency(4)`: at most 4 runs at once, and the work drains.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn global_concurrency_holds_across_three_buses() {
    let (first, schema) = store("global_concurrency").await;
    let stores = [
        first,
        same_schema(&schema).await,
        same_schema(&schema).await,
    ];
    relaybus_tests::limits::global_concurrency_holds_across_buses(stores).await;
}

/// Three buses on three stores of one schema, a global concurrency of 2 partitioned by
/// tenant: at most 2 runs of a tenant at once, the tenants side by side.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partitioned_concurrency_holds_per_partition() {
    let (first, schema) = store("partitioned").await;
    let stores = [
        first,
        same_schema(&schema).await,
        same_schema(&schema).await,
    ];
    relaybus_tests::limits::partitioned_concurrency_holds_per_partition(stores).await;
}

/// A rate limit of 50 per second over three buses on three stores of one schema.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rate_limit_holds_across_three_buses() {
    let (first, schema) = store("rate_limit").await;
    let stores = [
        first,
        same_schema(&schema).await,
        same_schema(&schema).await,
    ];
    relaybus_tests::limits::rate_limit_holds_across_buses(stores).await;
}

/// Another store (its own pool) on the schema of a test.
async fn same_schema(schema: &Schema) -> PostgresEventStore {
    let store = PostgresEventStore::builder(pool().await)
        .schema(&schema.name)
        .build()
        .expect("valid options");
    store.setup().await.expect("setup");
    store
}

/// A process holding all 4 slots of a handler's global concurrency is killed: the other buses
/// take them within its lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_slots_of_a_killed_bus_free_within_its_lease() {
    let (first, schema) = store("crash_slots").await;
    let stores = [first, same_schema(&schema).await];
    let mut holder = std::process::Command::new(env!("CARGO_BIN_EXE_relaybus-crash-app"));
    holder.args([
        "slots",
        "postgres",
        url().as_str(),
        schema.name.as_str(),
        &relaybus_tests::limits::KILLED_LEASE.as_millis().to_string(),
    ]);
    relaybus_tests::limits::slots_of_a_killed_bus_free_within_the_lease(stores, holder).await;
}

/// 10,000 unkeyed events through a transactional batch handler of at most 100 that inserts one
/// row per event in the batch's transaction: each effect once, in batches of at most 100.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transactional_batches_drain_exactly_once() {
    use relaybus::{Batch, BoxError, HandlerContext, Subscription};
    use relaybus_tests::batches::{self, BATCHER, Batches};
    use relaybus_tests::support::OrderPlaced;
    let (store, schema) = store("batch_drain").await;
    let effects = schema.table("effects");
    sqlx::query(&format!("CREATE TABLE {effects} (id text PRIMARY KEY)"))
        .execute(store.pool())
        .await
        .unwrap();
    let insert = format!("INSERT INTO {effects} (id) SELECT unnest($1::text[])");
    let recorded = std::sync::Arc::new(Batches::default());
    let recorder = std::sync::Arc::clone(&recorded);
    let handler = Subscription::batch(
        BATCHER,
        move |batch: Batch<OrderPlaced>, ctx: HandlerContext<PostgresEventStore>| {
            let (recorder, insert) = (std::sync::Arc::clone(&recorder), insert.clone());
            async move {
                let ids: Vec<String> = batch.iter().map(|i| i.event_id().to_owned()).collect();
                let mut session = ctx.session().await?;
                sqlx::query(&insert)
                    .bind(&ids)
                    .execute(&mut **session)
                    .await?;
                drop(session);
                recorder.record(&batch);
                Ok::<(), BoxError>(())
            }
        },
    )
    .transactional();
    let bus = batches::bus(store.clone(), handler);
    batches::drain_in_batches(&bus, &recorded, 10_000, 100).await;
    let written: i64 = sqlx::query_scalar(&format!("SELECT count(*) FROM {effects}"))
        .fetch_one(store.pool())
        .await
        .unwrap();
    assert_eq!(written, 10_000, "each effect once");
}

/// Deliveries retried after a failure in their batch come back in later batches, each batch
/// holding a delivery once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_holds_each_delivery_once() {
    let (store, _schema) = store("batch_once").await;
    relaybus_tests::batches::a_batch_holds_each_delivery_once(store).await;
}

/// Keyed events through a batch handler: each key's order holds across batches.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keyed_order_holds_across_batches() {
    let (store, _schema) = store("batch_keyed").await;
    relaybus_tests::batches::keyed_order_holds_across_batches(store).await;
}

/// A poison event in a batch goes dead alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poison_event_in_a_batch_goes_dead_alone() {
    let (store, _schema) = store("batch_poison").await;
    relaybus_tests::batches::poison_goes_dead_alone(store).await;
}
