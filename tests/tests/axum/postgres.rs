//! relaybus-axum on the PostgreSQL store, through the real router (`tower::ServiceExt::oneshot`
//! and a real listener): the request transaction on a `PostgresSession`, the extractors, the
//! retries of serialization failures and deadlocks, the dispatcher service and the operator
//! routes. The `mongo` module proves the same on MongoDB.
//!
//! The server is `RELAYBUS_TEST_POSTGRES_URL` (default `postgres://postgres@127.0.0.1:5432/test`);
//! each test has a schema of its own, and a test fails, never skips, when the server does not
//! answer.

use std::{
    collections::HashMap,
    str::FromStr,
    sync::{
        Arc, Mutex,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use axum::{
    Router,
    body::Body,
    extract::{Path, State},
    http::{Request, Response, StatusCode, header::RETRY_AFTER},
    routing::{get, post},
};
use relaybus::{
    BoxError, HandlerContext, PostgresEventStore, RelayBus, RelayBusBuilder, RetryPolicy,
    Subscription,
};
use relaybus_axum::{
    Config, DispatcherService, PublishError, Publisher, RelayState, RequestTxLayer, Tx,
    rejection::{PublisherRejection, TxRejection},
};
use relaybus_tests::support::{OrderPlaced, next, placed};
use sqlx::{
    Connection, PgConnection, PgPool,
    postgres::{PgConnectOptions, PgPoolOptions},
};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    sync::{Barrier, mpsc, oneshot},
};
use tokio_util::sync::CancellationToken;
use tower::ServiceExt;

type Pg = PostgresEventStore;
type PgPublisher = Publisher<PublisherRejection, Pg>;
type PgTx = Tx<TxRejection, Pg>;

/// The server's URL.
fn url() -> String {
    std::env::var("RELAYBUS_TEST_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned())
}

/// A pool of at most `size` connections named `app` (their `application_name`), counting every
/// connection it hands out in `acquired`.
async fn pool(app: &str, size: u32, acquired: Arc<AtomicUsize>) -> PgPool {
    let url = url();
    let options = PgConnectOptions::from_str(&url)
        .expect("a PostgreSQL URL")
        .application_name(app);
    let (fresh, reused) = (Arc::clone(&acquired), acquired);
    PgPoolOptions::new()
        .max_connections(size)
        .acquire_timeout(Duration::from_secs(30))
        // A new connection goes straight to its first user; an idle one passes here.
        .after_connect(move |_, _| {
            fresh.fetch_add(1, Ordering::SeqCst);
            Box::pin(async { Ok(()) })
        })
        .before_acquire(move |_, _| {
            reused.fetch_add(1, Ordering::SeqCst);
            Box::pin(async { Ok(true) })
        })
        .connect_with(options)
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

/// `table` of the store's schema, quoted for SQL.
fn table(store: &Pg, table: &str) -> String {
    format!("\"{}\".{table}", store.schema())
}

/// A set-up store on a schema of the test's own, on a pool of `size` connections, with the
/// business tables: `orders`, `order_totals` (the projector's) and `counters`.
async fn schema_store(test: &str, size: u32) -> (Pg, Schema, Arc<AtomicUsize>) {
    let schema = Schema {
        name: format!("axpg{}_{test}", std::process::id()),
    };
    let acquired = Arc::new(AtomicUsize::new(0));
    let pool = pool(&schema.name, size, Arc::clone(&acquired)).await;
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
    let tables = format!(
        "CREATE TABLE {orders} (id text PRIMARY KEY, total_cents bigint NOT NULL, note text, \
             cancelled boolean NOT NULL DEFAULT false); \
         CREATE TABLE {totals} (id text PRIMARY KEY, orders bigint NOT NULL, \
             total_cents bigint NOT NULL); \
         CREATE TABLE {counters} (id text PRIMARY KEY, n bigint NOT NULL); \
         INSERT INTO {counters} VALUES ('a', 0), ('b', 0);",
        orders = table(&store, "orders"),
        totals = table(&store, "order_totals"),
        counters = table(&store, "counters"),
    );
    sqlx::raw_sql(&tables)
        .execute(&pool)
        .await
        .expect("the business tables");
    (store, schema, acquired)
}

/// `count(*)` of a table of the store's schema.
async fn count(store: &Pg, name: &str) -> i64 {
    sqlx::query_scalar(&format!("SELECT count(*) FROM {}", table(store, name)))
        .fetch_one(store.pool())
        .await
        .expect("count")
}

/// Inserts the order and publishes its event, through the request's session.
async fn insert_and_publish(publisher: &mut PgPublisher, id: &str) -> Result<(), relaybus::Error> {
    let insert = format!(
        "INSERT INTO {} (id, total_cents) VALUES ($1, 1250)",
        table(publisher.bus().store(), "orders")
    );
    sqlx::query(&insert)
        .bind(id)
        .execute(&mut **publisher.session())
        .await?;
    publisher.publish(&placed(id)).key(id).await?;
    Ok(())
}

/// The backend pid of the request's connection.
async fn backend_pid(publisher: &mut PgPublisher) -> i32 {
    sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut **publisher.session())
        .await
        .expect("the backend pid")
}

/// A handler of the PostgreSQL store.
fn handler<F, Fut>(id: &str, run: F) -> Subscription
where
    F: Fn(OrderPlaced, HandlerContext<Pg>) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = Result<(), BoxError>> + Send + 'static,
{
    Subscription::new(id, run)
}

/// The shop of these tests: a store on a schema of its own, a bus with a confirmation handler
/// and a transactional projector, and the routes below.
struct Shop {
    _schema: Schema,
    store: Pg,
    bus: RelayBus<Pg>,
    state: RelayState<Pg>,
    layer: RequestTxLayer<Pg>,
    confirmations: mpsc::UnboundedReceiver<String>,
    /// The connections the pool handed out.
    acquired: Arc<AtomicUsize>,
    /// The backend pids of the routes that report them.
    pids: mpsc::UnboundedSender<i32>,
    reported_pids: mpsc::UnboundedReceiver<i32>,
}

impl Shop {
    async fn new(test: &str) -> Self {
        Shop::with(test, 24, |builder| builder, |config| config).await
    }

    async fn with(
        test: &str,
        pool_size: u32,
        bus: impl FnOnce(RelayBusBuilder<Pg>) -> RelayBusBuilder<Pg>,
        config: impl FnOnce(Config<Pg>) -> Config<Pg>,
    ) -> Self {
        let (store, schema, acquired) = schema_store(test, pool_size).await;
        let (tx, confirmations) = mpsc::unbounded_channel();
        let project = format!(
            "INSERT INTO {} AS t VALUES ('all', 1, $1) ON CONFLICT (id) DO UPDATE \
             SET orders = t.orders + 1, total_cents = t.total_cents + $1",
            table(&store, "order_totals")
        );
        let builder = RelayBus::builder(store.clone())
            .without_registered_handlers()
            .poll_interval(Duration::from_millis(50))
            .lease_duration(Duration::from_secs(10))
            .subscribe(handler(
                "send-confirmation",
                move |event: OrderPlaced, _: HandlerContext<Pg>| {
                    let tx = tx.clone();
                    async move {
                        tx.send(event.order_id).unwrap();
                        Ok(())
                    }
                },
            ))
            .subscribe(
                handler(
                    "projector",
                    move |event: OrderPlaced, ctx: HandlerContext<Pg>| {
                        let project = project.clone();
                        async move {
                            let mut session = ctx.session().await?;
                            sqlx::query(&project)
                                .bind(event.total_cents as i64)
                                .execute(&mut **session)
                                .await?;
                            Ok(())
                        }
                    },
                )
                .transactional(),
            );
        let bus = bus(builder).build().unwrap();
        let (state, layer) = config(relaybus_axum::config(bus.clone())).setup().unwrap();
        let (pids, reported_pids) = mpsc::unbounded_channel();
        Shop {
            _schema: schema,
            store,
            bus,
            state,
            layer,
            confirmations,
            acquired,
            pids,
            reported_pids,
        }
    }

    fn router(&self) -> Router {
        let pids = self.pids.clone();
        Router::new()
            .route(
                "/orders/{id}",
                post(async |Path(id): Path<String>, mut publisher: PgPublisher| {
                    insert_and_publish(&mut publisher, &id).await.unwrap();
                    StatusCode::CREATED
                }),
            )
            .route(
                "/orders/{id}/answer/{status}",
                post(
                    async |Path((id, status)): Path<(String, u16)>, mut publisher: PgPublisher| {
                        insert_and_publish(&mut publisher, &id).await.unwrap();
                        StatusCode::from_u16(status).unwrap()
                    },
                ),
            )
            .route(
                "/orders/{id}/panic",
                post(
                    async move |Path(id): Path<String>, mut publisher: PgPublisher| {
                        let pid = backend_pid(&mut publisher).await;
                        insert_and_publish(&mut publisher, &id).await.unwrap();
                        pids.send(pid).unwrap();
                        panic!("the route failed after publishing");
                        #[allow(unreachable_code)]
                        StatusCode::CREATED
                    },
                ),
            )
            .route(
                "/orders/{id}/cancel",
                post(
                    async |State(relay): State<RelayState<Pg>>,
                           Path(id): Path<String>,
                           mut tx: PgTx| {
                        // `Tx` alone: the route's own write, nothing published.
                        let cancel = format!(
                            "UPDATE {} SET cancelled = true WHERE id = $1",
                            table(relay.bus().store(), "orders")
                        );
                        let updated = sqlx::query(&cancel)
                            .bind(&id)
                            .execute(&mut **tx)
                            .await
                            .unwrap();
                        if updated.rows_affected() == 1 {
                            StatusCode::NO_CONTENT
                        } else {
                            StatusCode::NOT_FOUND
                        }
                    },
                ),
            )
            .route(
                "/orders/{id}/noted",
                post(
                    async |Path(id): Path<String>,
                           mut publisher: PgPublisher,
                           note: String|
                           -> Result<StatusCode, PublishError> {
                        // The route's own write and the publish answer with `?`: a transient
                        // error marks the response, and the layer runs the request again.
                        let insert = format!(
                            "INSERT INTO {} (id, total_cents, note) VALUES ($1, 1250, $2)",
                            table(publisher.bus().store(), "orders")
                        );
                        sqlx::query(&insert)
                            .bind(&id)
                            .bind(note)
                            .execute(&mut **publisher.session())
                            .await
                            .map_err(relaybus::Error::from)?;
                        publisher.publish(&placed(&id)).key(&id).await?;
                        Ok(StatusCode::CREATED)
                    },
                ),
            )
            .route(
                "/twice",
                post(async |_tx: PgTx, _publisher: PgPublisher| StatusCode::CREATED),
            )
            .route("/health", get(async || "ok"))
            .layer(self.layer.clone())
            .with_state(self.state.clone())
    }

    /// Orders, events and deliveries.
    async fn counts(&self) -> (i64, i64, i64) {
        (
            count(&self.store, "orders").await,
            count(&self.store, "events").await,
            count(&self.store, "deliveries").await,
        )
    }

    /// Asserts that the transaction of the route on backend `pid`, which inserted order `id`,
    /// was rolled back and its connection did not go back to the pool inside it.
    async fn assert_rolled_back(&self, id: &str, pid: i32) {
        // The route's uncommitted row holds its key: an insert of the same key waits for the
        // route's transaction to end, and goes through only if it rolled back.
        let mut probe = PgConnection::connect(&url()).await.unwrap();
        let mut transaction = probe.begin().await.unwrap();
        sqlx::query("SET LOCAL lock_timeout = '30s'")
            .execute(&mut *transaction)
            .await
            .unwrap();
        sqlx::query(&format!(
            "INSERT INTO {} (id, total_cents) VALUES ($1, 0)",
            table(&self.store, "orders")
        ))
        .bind(id)
        .execute(&mut *transaction)
        .await
        .expect("the route's order was rolled back, not committed");
        transaction.rollback().await.unwrap();
        assert_eq!(
            self.counts().await,
            (0, 0, 0),
            "no order, event or delivery"
        );

        // The pool (of one connection here) hands out a connection again: the request's did
        // not stay checked out. It is not the request's: a session dropped inside its
        // transaction is closed, so no pooled connection is ever in a transaction.
        let pool = self.store.pool();
        assert_eq!(pool.options().get_max_connections(), 1);
        let mut connection = pool.acquire().await.expect("the pool's connection is back");
        let now_pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
            .fetch_one(&mut *connection)
            .await
            .unwrap();
        assert_ne!(
            now_pid, pid,
            "the connection of the rolled-back request was closed, not pooled"
        );
        assert_eq!(
            (pool.size(), pool.num_idle()),
            (1, 0),
            "this one, checked out"
        );
        drop(connection);
        let report = self.bus.run_once().await.unwrap();
        assert_eq!(report.claimed, 0, "nothing to deliver: {report:?}");
    }
}

fn post_to(uri: &str) -> Request<Body> {
    Request::post(uri).body(Body::empty()).unwrap()
}

async fn text(response: Response<Body>) -> String {
    let bytes = axum::body::to_bytes(response.into_body(), 1 << 20)
        .await
        .unwrap();
    String::from_utf8(bytes.to_vec()).unwrap()
}

async fn json(response: Response<Body>) -> serde_json::Value {
    serde_json::from_str(&text(response).await).unwrap()
}

#[tokio::test]
async fn a_created_order_commits_the_row_and_its_event_and_the_handlers_run() {
    let mut shop = Shop::new("commit").await;
    let response = shop.router().oneshot(post_to("/orders/o-1")).await.unwrap();
    assert_eq!(response.status(), StatusCode::CREATED);
    assert_eq!(
        shop.counts().await,
        (1, 1, 2),
        "order, event, two deliveries"
    );

    // `Tx`: the route's own write through the `PostgresSession`, committed with the 204.
    let response = shop
        .router()
        .oneshot(post_to("/orders/o-1/cancel"))
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::NO_CONTENT);
    let cancelled: bool = sqlx::query_scalar(&format!(
        "SELECT cancelled FROM {} WHERE id = 'o-1'",
        table(&shop.store, "orders")
    ))
    .fetch_one(shop.store.pool())
    .await
    .unwrap();
    assert!(cancelled, "the `Tx` route's update committed");

    let report = shop.bus.run_once().await.unwrap();
    assert_eq!((report.claimed, report.completed), (2, 2), "{report:?}");
    assert_eq!(
        next(&mut shop.confirmations, "the confirmation").await,
        "o-1"
    );
    let totals: (i64, i64) = sqlx::query_as(&format!(
        "SELECT orders, total_cents FROM {} WHERE id = 'all'",
        table(&shop.store, "order_totals")
    ))
    .fetch_one(shop.store.pool())
    .await
    .expect("the projector wrote its totals");
    assert_eq!(totals, (1, 1250));
    assert_eq!(shop.counts().await, (1, 1, 0), "both deliveries completed");
}

#[tokio::test]
async fn a_route_that_answers_4xx_or_5xx_after_publishing_commits_nothing() {
    let mut shop = Shop::new("error_status").await;
    for (id, status) in [("o-1", 422), ("o-2", 500), ("o-3", 409)] {
        let response = shop
            .router()
            .oneshot(post_to(&format!("/orders/{id}/answer/{status}")))
            .await
            .unwrap();
        assert_eq!(response.status().as_u16(), status);
        assert_eq!(shop.counts().await, (0, 0, 0), "after {status}");
    }
    let report = shop.bus.run_once().await.unwrap();
    assert_eq!(report.claimed, 0, "nothing delivered: {report:?}");
    assert!(shop.confirmations.try_recv().is_err(), "no handler ran");

    // A redirect commits, as the default policy says.
    let response = shop
        .router()
        .oneshot(post_to("/orders/o-4/answer/303"))
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::SEE_OTHER);
    assert_eq!(shop.counts().await, (1, 1, 2));
}

#[tokio::test]
async fn the_commit_policy_decides_which_statuses_commit() {
    let shop = Shop::with(
        "policy",
        24,
        |builder| builder,
        |config| {
            config.commit_policy(relaybus_axum::CommitPolicy::new(|status| {
                status.is_success() || status == StatusCode::CONFLICT
            }))
        },
    )
    .await;
    let router = shop.router();
    let answer = |uri: &'static str| router.clone().oneshot(post_to(uri));
    assert_eq!(
        answer("/orders/o-1/answer/303").await.unwrap().status(),
        StatusCode::SEE_OTHER
    );
    assert_eq!(shop.counts().await, (0, 0, 0), "303 no longer commits");
    assert_eq!(
        answer("/orders/o-2/answer/409").await.unwrap().status(),
        StatusCode::CONFLICT
    );
    assert_eq!(shop.counts().await, (1, 1, 2), "409 commits");
    assert_eq!(
        answer("/orders/o-3/answer/201").await.unwrap().status(),
        StatusCode::CREATED
    );
    assert_eq!(shop.counts().await, (2, 2, 4), "201 commits");
}

#[tokio::test]
async fn a_panicking_route_commits_nothing_and_its_transaction_is_rolled_back() {
    let mut shop = Shop::with("panic", 1, |builder| builder, |config| config).await;
    let request = shop.router().oneshot(post_to("/orders/o-1/panic"));
    let outcome = tokio::spawn(request).await;
    assert!(outcome.unwrap_err().is_panic());
    let pid = next(&mut shop.reported_pids, "the route's backend").await;
    shop.assert_rolled_back("o-1", pid).await;
}

#[tokio::test]
async fn a_dropped_request_rolls_its_transaction_back() {
    let shop = Shop::with("dropped", 1, |builder| builder, |config| config).await;
    let (entered_tx, mut entered) = mpsc::unbounded_channel();
    let router = Router::new()
        .route(
            "/orders/{id}",
            post(
                async move |Path(id): Path<String>, mut publisher: PgPublisher| {
                    let pid = backend_pid(&mut publisher).await;
                    insert_and_publish(&mut publisher, &id).await.unwrap();
                    entered_tx.send(pid).unwrap();
                    // The client goes away while the route still works.
                    std::future::pending::<()>().await;
                    StatusCode::CREATED
                },
            ),
        )
        .layer(shop.layer.clone())
        .with_state(shop.state.clone());
    let request = router.oneshot(post_to("/orders/o-1"));
    let pid = tokio::select! {
        _ = request => panic!("the route never answers"),
        pid = next(&mut entered, "the route to publish") => pid,
    };
    // The request future is dropped here.
    shop.assert_rolled_back("o-1", pid).await;
}

#[tokio::test]
async fn a_route_that_never_extracts_takes_no_connection_from_the_pool() {
    let shop = Shop::new("lazy").await;
    let before = shop.acquired.load(Ordering::SeqCst);
    let response = shop
        .router()
        .oneshot(Request::get("/health").body(Body::empty()).unwrap())
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(
        shop.acquired.load(Ordering::SeqCst),
        before,
        "no connection, no transaction"
    );
    // The same router, extracting, does take one: the count sees it.
    let response = shop.router().oneshot(post_to("/orders/o-1")).await.unwrap();
    assert_eq!(response.status(), StatusCode::CREATED);
    assert!(shop.acquired.load(Ordering::SeqCst) > before);
}

/// Makes the first `failures` commits that inserted an order fail with a serialization
/// failure (SQLSTATE 40001), raised by PostgreSQL itself from a deferred constraint trigger at
/// `COMMIT`, as a `SERIALIZABLE` conflict is. The counter is a sequence, which rollbacks do not
/// reset.
async fn fail_commits(store: &Pg, failures: u32) {
    let schema = store.schema();
    let sql = format!(
        r#"CREATE SEQUENCE "{schema}".commit_failures;
        CREATE FUNCTION "{schema}".fail_commit() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            IF nextval('"{schema}".commit_failures') <= {failures} THEN
                RAISE EXCEPTION 'could not serialize access due to read/write dependencies'
                    USING ERRCODE = 'serialization_failure';
            END IF;
            RETURN NULL;
        END $$;
        CREATE CONSTRAINT TRIGGER fail_commit AFTER INSERT ON "{schema}".orders
            DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION "{schema}".fail_commit();"#
    );
    sqlx::raw_sql(&sql)
        .execute(store.pool())
        .await
        .expect("the failing trigger");
}

/// How many commits the trigger of [`fail_commits`] saw.
async fn commits_seen(store: &Pg) -> i64 {
    sqlx::query_scalar(&format!(
        "SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM {}",
        table(store, "commit_failures")
    ))
    .fetch_one(store.pool())
    .await
    .unwrap()
}

#[tokio::test]
async fn a_serialization_failure_at_commit_runs_the_request_again_and_commits_it_once() {
    let shop = Shop::new("commit_retry").await;
    fail_commits(&shop.store, 1).await;
    let response = shop
        .router()
        .oneshot(noted("o-1", "gift wrap"))
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::CREATED);
    assert_eq!(
        commits_seen(&shop.store).await,
        2,
        "the failed commit, then the second run's"
    );
    assert_eq!(
        shop.counts().await,
        (1, 1, 2),
        "one order, one event, two deliveries"
    );
    let sequence: i64 = sqlx::query_scalar(&format!(
        "SELECT sequence FROM {}",
        table(&shop.store, "events")
    ))
    .fetch_one(shop.store.pool())
    .await
    .unwrap();
    assert_eq!(sequence, 1, "the failed run gave its number back");
}

#[tokio::test]
async fn without_retries_a_serialization_failure_at_commit_answers_503_with_retry_after_and_commits_nothing()
 {
    let shop = Shop::with(
        "commit_fail",
        24,
        |builder| builder,
        |config| {
            config
                .retry_after(Duration::from_secs(7))
                .request_attempts(1)
        },
    )
    .await;
    fail_commits(&shop.store, 1).await;
    let response = shop.router().oneshot(post_to("/orders/o-1")).await.unwrap();
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(response.headers()[RETRY_AFTER], "7");
    assert!(text(response).await.contains("nothing was saved"));
    assert_eq!(commits_seen(&shop.store).await, 1, "one attempt");
    assert_eq!(shop.counts().await, (0, 0, 0));
}

fn noted(id: &str, note: &'static str) -> Request<Body> {
    Request::post(format!("/orders/{id}/noted"))
        .header("content-length", note.len())
        .body(Body::from(note))
        .unwrap()
}

/// Two requests that each bump counter `a` and `b` in opposite orders, meeting after their
/// first bump: PostgreSQL breaks the deadlock by failing one of them (SQLSTATE 40P01) in the
/// route's own write. Returns the statuses, the `Retry-After` of each, and how many times the
/// route ran for each request.
async fn deadlock(shop: &Shop) -> (Vec<(StatusCode, Option<String>)>, Vec<usize>) {
    let barrier = Arc::new(Barrier::new(2));
    let runs: Arc<Mutex<HashMap<String, usize>>> = Arc::default();
    let router = {
        let runs = Arc::clone(&runs);
        Router::new()
            .route(
                "/transfer/{id}/{first}/{second}",
                post(
                    async move |Path((id, first, second)): Path<(String, String, String)>,
                                mut publisher: PgPublisher|
                                -> Result<StatusCode, PublishError> {
                        let run = {
                            let mut runs = runs.lock().unwrap();
                            let run = runs.entry(id.clone()).or_insert(0);
                            *run += 1;
                            *run
                        };
                        let bump = format!(
                            "UPDATE {} SET n = n + 1 WHERE id = $1",
                            table(publisher.bus().store(), "counters")
                        );
                        sqlx::query(&bump)
                            .bind(&first)
                            .execute(&mut **publisher.session())
                            .await
                            .map_err(relaybus::Error::from)?;
                        if run == 1 {
                            // Both first runs hold their first row before either asks for its
                            // second.
                            tokio::time::timeout(Duration::from_secs(30), barrier.wait())
                                .await
                                .expect("both requests hold their first counter");
                        }
                        sqlx::query(&bump)
                            .bind(&second)
                            .execute(&mut **publisher.session())
                            .await
                            .map_err(relaybus::Error::from)?;
                        insert_and_publish(&mut publisher, &id).await?;
                        Ok(StatusCode::CREATED)
                    },
                ),
            )
            .layer(shop.layer.clone())
            .with_state(shop.state.clone())
    };
    let requests = [("t-1", "a", "b"), ("t-2", "b", "a")].map(|(id, first, second)| {
        let router = router.clone();
        tokio::spawn(async move {
            router
                .oneshot(post_to(&format!("/transfer/{id}/{first}/{second}")))
                .await
                .unwrap()
        })
    });
    let mut answers = Vec::new();
    for request in requests {
        let response = request.await.unwrap();
        let retry_after = response
            .headers()
            .get(RETRY_AFTER)
            .map(|value| value.to_str().unwrap().to_owned());
        answers.push((response.status(), retry_after));
    }
    answers.sort_by_key(|(status, _)| *status);
    let mut runs: Vec<usize> = runs.lock().unwrap().values().copied().collect();
    runs.sort_unstable();
    (answers, runs)
}

/// The counters `a` and `b`.
async fn counters(store: &Pg) -> Vec<i64> {
    sqlx::query_scalar(&format!(
        "SELECT n FROM {} ORDER BY id",
        table(store, "counters")
    ))
    .fetch_all(store.pool())
    .await
    .unwrap()
}

#[tokio::test]
async fn a_deadlock_in_the_routes_own_write_runs_the_request_again_and_commits_each_once() {
    let shop = Shop::new("deadlock_retry").await;
    let (answers, runs) = deadlock(&shop).await;
    assert_eq!(
        answers,
        [(StatusCode::CREATED, None), (StatusCode::CREATED, None)],
        "the deadlock's victim ran again instead of answering 503"
    );
    assert_eq!(runs, [1, 2], "one request ran once, its victim twice");
    assert_eq!(
        counters(&shop.store).await,
        [2, 2],
        "each request's bumps committed once; the victim's first run rolled back"
    );
    assert_eq!(shop.counts().await, (2, 2, 4));
}

#[tokio::test]
async fn without_retries_a_deadlock_answers_503_with_retry_after_and_commits_nothing_of_the_victim()
{
    let shop = Shop::with(
        "deadlock_fail",
        24,
        |builder| builder,
        |config| config.request_attempts(1),
    )
    .await;
    let (answers, runs) = deadlock(&shop).await;
    assert_eq!(
        answers,
        [
            (StatusCode::CREATED, None),
            (StatusCode::SERVICE_UNAVAILABLE, Some("1".to_owned()))
        ]
    );
    assert_eq!(runs, [1, 1], "no request ran again");
    assert_eq!(
        counters(&shop.store).await,
        [1, 1],
        "the winner's bumps only"
    );
    assert_eq!(shop.counts().await, (1, 1, 2), "the winner's order only");
}

#[tokio::test]
async fn the_extractors_refuse_misuse_and_bad_input_with_typed_errors_and_write_nothing() {
    let shop = Shop::new("bad_input").await;
    let before = shop.acquired.load(Ordering::SeqCst);

    // No layer: the typed rejection names it, and no connection is taken.
    let (rejections_tx, mut rejections) = mpsc::unbounded_channel();
    let seen = rejections_tx.clone();
    let router = Router::new()
        .route(
            "/publisher",
            post(
                async move |publisher: Result<PgPublisher, PublisherRejection>| match publisher {
                    Ok(_) => StatusCode::CREATED,
                    Err(rejection) => {
                        let status = rejection.status();
                        seen.send(rejection).unwrap();
                        status
                    }
                },
            ),
        )
        .route("/tx", post(async |_: PgTx| StatusCode::CREATED))
        .with_state(shop.state.clone());
    let response = router.clone().oneshot(post_to("/publisher")).await.unwrap();
    assert_eq!(response.status(), StatusCode::INTERNAL_SERVER_ERROR);
    let rejection = next(&mut rejections, "the rejection").await;
    assert!(
        matches!(rejection, PublisherRejection::MissingRequestTx(_)),
        "{rejection:?}"
    );
    let response = router.oneshot(post_to("/tx")).await.unwrap();
    assert_eq!(response.status(), StatusCode::INTERNAL_SERVER_ERROR);
    let body = text(response).await;
    assert!(
        body.contains("no request transaction; add `relaybus_axum::RequestTxLayer` to the router"),
        "{body}"
    );
    assert_eq!(shop.acquired.load(Ordering::SeqCst), before);

    // A state and a layer of two setups.
    let (other_state, _other_layer) = relaybus_axum::setup(shop.bus.clone()).unwrap();
    let seen = rejections_tx.clone();
    let router = Router::new()
        .route(
            "/",
            post(
                async move |publisher: Result<PgPublisher, PublisherRejection>| match publisher {
                    Ok(_) => StatusCode::CREATED,
                    Err(rejection) => {
                        let status = rejection.status();
                        seen.send(rejection).unwrap();
                        status
                    }
                },
            ),
        )
        .layer(shop.layer.clone())
        .with_state(other_state);
    let response = router.oneshot(post_to("/")).await.unwrap();
    assert_eq!(response.status(), StatusCode::INTERNAL_SERVER_ERROR);
    let rejection = next(&mut rejections, "the rejection").await;
    assert!(
        matches!(rejection, PublisherRejection::ForeignState(_)),
        "{rejection:?}"
    );
    assert!(
        rejection
            .body_text()
            .contains("different `relaybus_axum::setup` calls")
    );

    // Two extractors in one handler.
    let response = tokio::time::timeout(
        Duration::from_secs(30),
        shop.router().oneshot(post_to("/twice")),
    )
    .await
    .expect("no deadlock")
    .unwrap();
    assert_eq!(response.status(), StatusCode::INTERNAL_SERVER_ERROR);
    assert!(text(response).await.contains("held by another extractor"));

    // An event the bus refuses: a typed error, and the route's row goes with it.
    let (errors_tx, mut errors) = mpsc::unbounded_channel();
    let router = Router::new()
        .route(
            "/orders/{id}",
            post(
                async move |Path(id): Path<String>,
                            mut publisher: PgPublisher|
                            -> Result<StatusCode, PublishError> {
                    let insert = format!(
                        "INSERT INTO {} (id, total_cents) VALUES ($1, 1250)",
                        table(publisher.bus().store(), "orders")
                    );
                    sqlx::query(&insert)
                        .bind(&id)
                        .execute(&mut **publisher.session())
                        .await
                        .map_err(relaybus::Error::from)?;
                    let published = publisher.publish(&placed(&id)).key("").await;
                    let error = published.expect_err("an empty key is refused");
                    let message = error.to_string();
                    let typed = matches!(
                        error,
                        relaybus::Error::EventValidation(
                            relaybus::EventValidationError::InvalidKey { .. }
                        )
                    );
                    errors_tx.send((typed, message)).unwrap();
                    Err(error.into())
                },
            ),
        )
        .layer(shop.layer.clone())
        .with_state(shop.state.clone());
    let response = router.oneshot(post_to("/orders/o-1")).await.unwrap();
    assert_eq!(response.status(), StatusCode::INTERNAL_SERVER_ERROR);
    assert!(
        response.headers().get(RETRY_AFTER).is_none(),
        "not transient"
    );
    let (typed, message) = next(&mut errors, "the publish error").await;
    assert!(typed, "{message}");
    assert!(message.contains("empty"), "{message}");
    assert_eq!(shop.counts().await, (0, 0, 0), "nothing written");
}

/// Sends one HTTP/1.1 request and returns the status code.
async fn http_post(address: std::net::SocketAddr, path: &str) -> u16 {
    let mut stream = tokio::net::TcpStream::connect(address).await.unwrap();
    let request = format!(
        "POST {path} HTTP/1.1\r\nHost: {address}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
    );
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).await.unwrap();
    response
        .split_whitespace()
        .nth(1)
        .and_then(|code| code.parse().ok())
        .unwrap_or_else(|| panic!("not an HTTP response: {response:?}"))
}

/// The deliveries: status, lease owner, attempts.
async fn delivery_rows(store: &Pg) -> Vec<(String, Option<String>, i32)> {
    sqlx::query_as(&format!(
        "SELECT status, lease_owner, attempts FROM {} ORDER BY id",
        table(store, "deliveries")
    ))
    .fetch_all(store.pool())
    .await
    .unwrap()
}

#[tokio::test]
async fn graceful_shutdown_drains_requests_releases_deliveries_and_frees_their_leases() {
    let (store, _schema, _) = schema_store("shutdown", 24).await;
    let (handler_tx, mut handler_started) = mpsc::unbounded_channel();
    let bus = RelayBus::builder(store.clone())
        .without_registered_handlers()
        .owner("web-1")
        .poll_interval(Duration::from_millis(50))
        .lease_duration(Duration::from_secs(600))
        .shutdown_timeout(Duration::from_millis(200))
        .subscribe(handler(
            "slow",
            move |_: OrderPlaced, _: HandlerContext<Pg>| {
                let started = handler_tx.clone();
                async move {
                    started.send(()).unwrap();
                    std::future::pending::<()>().await;
                    Ok(())
                }
            },
        ))
        .build()
        .unwrap();
    let (state, layer) = relaybus_axum::setup(bus.clone()).unwrap();

    let (entered_tx, mut entered) = mpsc::unbounded_channel();
    let release: Arc<Mutex<Option<oneshot::Receiver<()>>>> = Arc::default();
    let (release_tx, release_rx) = oneshot::channel();
    *release.lock().unwrap() = Some(release_rx);
    let router = Router::new()
        .route(
            "/orders/{id}",
            post(async |Path(id): Path<String>, mut publisher: PgPublisher| {
                insert_and_publish(&mut publisher, &id).await.unwrap();
                StatusCode::CREATED
            }),
        )
        .route(
            "/slow",
            post(async move || {
                entered_tx.send(()).unwrap();
                let release = release.lock().unwrap().take().unwrap();
                release.await.unwrap();
                StatusCode::OK
            }),
        )
        .layer(layer)
        .with_state(state);

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let token = CancellationToken::new();
    let service = DispatcherService::new(bus)
        .handle_signals(false)
        .with_shutdown_token(token.clone());
    let served = tokio::spawn(service.serve(listener, router));

    assert_eq!(http_post(address, "/orders/o-1").await, 201);
    next(&mut handler_started, "the handler to start").await;
    let running = delivery_rows(&store).await;
    assert_eq!(
        running,
        [("pending".to_owned(), Some("web-1".to_owned()), 0)],
        "leased while it runs"
    );

    // A request in flight when shutdown begins is answered.
    let slow = tokio::spawn(http_post(address, "/slow"));
    next(&mut entered, "the slow request").await;
    token.cancel();
    release_tx.send(()).unwrap();
    assert_eq!(slow.await.unwrap(), 200, "drained, not cut off");
    tokio::time::timeout(Duration::from_secs(30), served)
        .await
        .expect("serve returns after shutdown")
        .unwrap()
        .unwrap();
    assert!(
        tokio::net::TcpStream::connect(address).await.is_err(),
        "the listener is closed"
    );

    // Released: pending, no lease, the attempt not charged.
    assert_eq!(
        delivery_rows(&store).await,
        [("pending".to_owned(), None, 0)],
        "released and its lease freed"
    );

    // Another worker takes it at once, with the 600 s lease far from its end, as attempt 1.
    let (tx, mut rx) = mpsc::unbounded_channel();
    let other = RelayBus::builder(store.clone())
        .without_registered_handlers()
        .owner("web-2")
        .subscribe(handler(
            "slow",
            move |_: OrderPlaced, ctx: HandlerContext<Pg>| {
                let tx = tx.clone();
                async move {
                    tx.send(ctx.attempt()).unwrap();
                    Ok(())
                }
            },
        ))
        .build()
        .unwrap();
    let report = other.run_once().await.unwrap();
    assert_eq!((report.claimed, report.completed), (1, 1), "{report:?}");
    assert_eq!(next(&mut rx, "the other worker's run").await, 1);
    assert!(delivery_rows(&store).await.is_empty());
}

fn get_from(uri: &str) -> Request<Body> {
    Request::get(uri).body(Body::empty()).unwrap()
}

/// A write to the operator routes, with the header writes need.
fn ops_write(uri: &str, body: &str) -> Request<Body> {
    Request::post(uri)
        .header(relaybus_axum::ops::WRITE_HEADER, "1")
        .header("content-type", "application/json")
        .body(Body::from(body.to_owned()))
        .unwrap()
}

#[tokio::test]
async fn ops_routes_answer_statistics_listings_and_requeues_on_postgres() {
    let (store, _schema, _) = schema_store("ops", 24).await;
    let bus = RelayBus::builder(store.clone())
        .without_registered_handlers()
        .subscribe(
            handler("doomed", |_: OrderPlaced, _: HandlerContext<Pg>| async {
                Err::<(), BoxError>("the mail server said no".into())
            })
            .retry(RetryPolicy::new(1)),
        )
        .build()
        .unwrap();
    for n in 0..3 {
        bus.publish(&placed(&format!("o-{n}"))).await.unwrap();
    }
    assert_eq!(bus.run_once().await.unwrap().claimed, 3);
    let router: Router = Router::new().nest("/ops", relaybus_axum::ops::router(bus.clone()));
    let call = |request: Request<Body>| router.clone().oneshot(request);

    let stats = json(call(get_from("/ops/statistics")).await.unwrap()).await;
    assert_eq!(
        (stats["dead"].as_u64(), stats["pending"].as_u64()),
        (Some(3), Some(0)),
        "{stats}"
    );
    let handlers = json(call(get_from("/ops/handlers")).await.unwrap()).await;
    let doomed = handlers["handlers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|h| h["handler"] == "doomed")
        .map(|h| h["dead"].as_u64());
    assert_eq!(doomed, Some(Some(3)), "{handlers}");

    // Listing, two pages.
    let page = call(get_from(
        "/ops/deliveries?status=dead&handler=doomed&limit=2",
    ))
    .await
    .unwrap();
    assert_eq!(page.status(), StatusCode::OK);
    let page = json(page).await;
    assert_eq!(page["deliveries"].as_array().unwrap().len(), 2, "{page}");
    let after = page["next_after"].as_str().unwrap().to_owned();
    assert_eq!(page["deliveries"][1]["id"], after.as_str(), "{page}");
    assert!(
        page["deliveries"][0]["last_error"]
            .as_str()
            .unwrap()
            .contains("the mail server said no")
    );
    let last = json(
        call(get_from(&format!(
            "/ops/deliveries?status=dead&after={after}&limit=2"
        )))
        .await
        .unwrap(),
    )
    .await;
    assert_eq!(last["deliveries"].as_array().unwrap().len(), 1, "{last}");
    assert_eq!(last["next_after"], serde_json::Value::Null);
    let id = last["deliveries"][0]["id"].as_str().unwrap().to_owned();
    assert!(
        id.parse::<i64>().is_ok(),
        "a PostgreSQL delivery id is a number: {id}"
    );

    // Requeue by id: the store's own ids are taken; one it cannot have made is not found.
    let unknown = "65f0a1b2c3d4e5f601234567";
    let requeued = call(ops_write(
        "/ops/deliveries/requeue",
        &format!(r#"{{"ids": ["{id}", "{unknown}", "999999999"]}}"#),
    ))
    .await
    .unwrap();
    assert_eq!(requeued.status(), StatusCode::OK);
    let requeued = json(requeued).await;
    assert_eq!(requeued["requeued"], serde_json::json!([id]), "{requeued}");
    let mut not_found: Vec<String> = serde_json::from_value(requeued["not_found"].clone()).unwrap();
    not_found.sort();
    assert_eq!(not_found, [unknown, "999999999"], "{requeued}");
    let stats = json(call(get_from("/ops/statistics")).await.unwrap()).await;
    assert_eq!(
        (stats["dead"].as_u64(), stats["pending"].as_u64()),
        (Some(2), Some(1)),
        "{stats}"
    );

    // Requeue by filter, then refused input changes nothing.
    let requeued = json(
        call(ops_write(
            "/ops/deliveries/requeue",
            r#"{"filter": {"handler": "doomed"}}"#,
        ))
        .await
        .unwrap(),
    )
    .await;
    assert_eq!(
        requeued["requeued"].as_array().unwrap().len(),
        2,
        "{requeued}"
    );
    for body in [
        r#"{"ids": [{"$ne": null}]}"#,
        r#"{"ids": ["not-an-id"]}"#,
        r#"{"ids": ["1; DROP TABLE x"]}"#,
        r#"{"ids": []}"#,
        r#"{"filter": {}}"#,
        "not json",
    ] {
        let response = call(ops_write("/ops/deliveries/requeue", body))
            .await
            .unwrap();
        assert_eq!(response.status(), StatusCode::BAD_REQUEST, "{body}");
        assert!(json(response).await["error"].is_string(), "{body}");
    }
    let stats = json(call(get_from("/ops/statistics")).await.unwrap()).await;
    assert_eq!(
        (stats["dead"].as_u64(), stats["pending"].as_u64()),
        (Some(0), Some(3)),
        "{stats}"
    );
    // The requeued deliveries run again.
    let report = bus.run_once().await.unwrap();
    assert_eq!(report.claimed, 3, "{report:?}");
}

/// The PostgreSQL names of the extractors and the state (`relaybus_axum::postgres`), the
/// request's session handed to sqlx as it is, and sqlx's errors answered through `?` as
/// `PublishError`: a failed query answers 500 and commits nothing of the request.
#[tokio::test]
async fn the_postgres_names_take_sqlx_queries_and_errors_as_they_are() {
    use relaybus_axum::postgres;

    let shop = Shop::new("names").await;
    let orders = table(&shop.store, "orders");
    let state: postgres::RelayState = shop.state.clone();
    let layer: postgres::RequestTxLayer = shop.layer.clone();
    let insert = format!("INSERT INTO {orders} (id, total_cents) VALUES ($1, 1250)");
    let router = Router::new()
        .route(
            "/orders/{id}",
            post(
                async move |Path(id): Path<String>,
                            mut publisher: postgres::Publisher|
                            -> Result<StatusCode, PublishError> {
                    sqlx::query(&insert)
                        .bind(&id)
                        .execute(publisher.session())
                        .await?;
                    publisher.publish(&placed(&id)).key(&id).await?;
                    // A query the server refuses, after the row and the event.
                    if id == "bad" {
                        sqlx::query("SELECT * FROM no_such_table")
                            .execute(publisher.session())
                            .await?;
                    }
                    Ok(StatusCode::CREATED)
                },
            ),
        )
        .layer(layer)
        .with_state(state);

    let created = router
        .clone()
        .oneshot(post_to("/orders/o-1"))
        .await
        .unwrap();
    assert_eq!(created.status(), StatusCode::CREATED);
    assert_eq!(
        shop.counts().await,
        (1, 1, 2),
        "order, event, two deliveries"
    );

    let refused = router.oneshot(post_to("/orders/bad")).await.unwrap();
    assert_eq!(refused.status(), StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(text(refused).await, "the request could not be saved");
    assert_eq!(
        shop.counts().await,
        (1, 1, 2),
        "nothing of the failed request"
    );

    // Once the work is done, the operators still see both handlers, with what they ran.
    let report = shop.bus.run_until_idle().await.unwrap();
    assert_eq!(report.succeeded().count(), 2, "{report:?}");
    assert_eq!(shop.counts().await, (1, 1, 0), "both deliveries completed");
    let ops: Router = Router::new().nest("/ops", relaybus_axum::ops::router(shop.bus.clone()));
    let handlers = json(
        ops.clone()
            .oneshot(get_from("/ops/handlers"))
            .await
            .unwrap(),
    )
    .await;
    let listed: Vec<(&str, u64, u64)> = handlers["handlers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|h| {
            (
                h["handler"].as_str().unwrap(),
                h["waiting"].as_u64().unwrap(),
                h["last_hour"]["succeeded"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        listed,
        [("projector", 0, 1), ("send-confirmation", 0, 1)],
        "{handlers}"
    );
}
