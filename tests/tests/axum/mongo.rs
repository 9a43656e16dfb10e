//! relaybus-axum through the real router (`tower::ServiceExt::oneshot`) on a real replica set:
//! the request transaction, the extractors, the dispatcher service and the operator routes.

use std::{
    sync::{Arc, Mutex},
    time::Duration,
};

use axum::{
    Router,
    body::Body,
    extract::{Path, State},
    http::{Request, Response, StatusCode, header::RETRY_AFTER},
    routing::{get, post},
};
use futures::TryStreamExt;
use mongodb::{
    Client, Collection,
    bson::{Document, doc},
    event::{EventHandler, command::CommandEvent},
    options::ClientOptions,
};
use relaybus::{BoxError, HandlerContext, RelayBus, RelayBusBuilder, RetryPolicy, Subscription};
use relaybus_axum::{DispatcherService, PublishError, Publisher, RelayState, Tx};
use relaybus_harness::{TestDb, test_db};
use relaybus_tests::support::{
    OrderPlaced, count, deliveries, fail_command, next, placed, reports_attempt, starts_and_hangs,
    store, store_on,
};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    sync::{mpsc, oneshot},
};
use tokio_util::sync::CancellationToken;
use tower::ServiceExt;

/// A client of its own for one test, whose commands are reported on a channel: its
/// application name scopes fail points to this test.
struct Monitored {
    client: Client,
    app: String,
    commands: mpsc::UnboundedReceiver<(&'static str, String)>,
}

impl Monitored {
    async fn new(db: &TestDb) -> Self {
        let app = format!("axum-{}", db.name);
        let mut options = ClientOptions::parse(&db.uri).await.unwrap();
        options.app_name = Some(app.clone());
        let (tx, commands) = mpsc::unbounded_channel();
        options.command_event_handler = Some(EventHandler::callback(move |event| {
            let _ = tx.send(match event {
                CommandEvent::Started(e) => ("started", e.command_name),
                CommandEvent::Succeeded(e) => ("succeeded", e.command_name),
                CommandEvent::Failed(e) => ("failed", e.command_name),
                _ => ("other", String::new()),
            });
        }));
        Monitored {
            client: Client::with_options(options).unwrap(),
            app,
            commands,
        }
    }

    /// The commands started since the last call.
    fn started(&mut self) -> Vec<String> {
        let mut names = Vec::new();
        while let Ok((kind, name)) = self.commands.try_recv() {
            if kind == "started" {
                names.push(name);
            }
        }
        names
    }

    /// Waits until a command of this name succeeded.
    async fn wait_for(&mut self, command: &str) {
        loop {
            let (kind, name) = next(&mut self.commands, command).await;
            if kind == "succeeded" && name == command {
                return;
            }
        }
    }
}

/// The shop of these tests: a store on the monitored client, a bus with a confirmation
/// handler and a transactional projector, and the routes below.
struct Shop {
    db: TestDb,
    monitored: Monitored,
    bus: RelayBus,
    state: RelayState,
    layer: relaybus_axum::RequestTxLayer,
    confirmations: mpsc::UnboundedReceiver<String>,
}

fn orders_of(publisher: &Publisher) -> Collection<Document> {
    publisher.bus().store().database().collection("orders")
}

async fn insert_and_publish(publisher: &mut Publisher, id: &str) {
    orders_of(publisher)
        .insert_one(doc! { "_id": id, "total_cents": 1250_i64 })
        .session(publisher.session())
        .await
        .unwrap();
    publisher.publish(&placed(id)).key(id).await.unwrap();
}

impl Shop {
    async fn new(hint: &str) -> Self {
        Shop::with(hint, |builder| builder, |config| config).await
    }

    async fn with(
        hint: &str,
        bus: impl FnOnce(RelayBusBuilder) -> RelayBusBuilder,
        config: impl FnOnce(relaybus_axum::Config) -> relaybus_axum::Config,
    ) -> Self {
        let db = test_db(hint).await;
        let mut monitored = Monitored::new(&db).await;
        let store = store_on(&monitored.client, &db).await;
        let (tx, confirmations) = mpsc::unbounded_channel();
        let projections = monitored
            .client
            .database(&db.name)
            .collection::<Document>("order_totals");
        let builder = RelayBus::builder(store)
            .poll_interval(Duration::from_millis(50))
            .lease_duration(Duration::from_secs(10))
            .subscribe(Subscription::new(
                "send-confirmation",
                move |event: OrderPlaced, _: HandlerContext| {
                    let tx = tx.clone();
                    async move {
                        tx.send(event.order_id).unwrap();
                        Ok::<(), BoxError>(())
                    }
                },
            ))
            .subscribe(
                Subscription::new(
                    "projector",
                    move |event: OrderPlaced, ctx: HandlerContext| {
                        let projections = projections.clone();
                        async move {
                            let mut session = ctx.session().await?;
                            projections
                            .update_one(
                                doc! { "_id": "all" },
                                doc! { "$inc": { "orders": 1, "total_cents": event.total_cents as i64 } },
                            )
                            .upsert(true)
                            .session(&mut *session)
                            .await?;
                            Ok::<(), BoxError>(())
                        }
                    },
                )
                .transactional(),
            );
        let bus = bus(builder).build().unwrap();
        let (state, layer) = config(relaybus_axum::config(bus.clone())).setup().unwrap();
        monitored.started();
        Shop {
            db,
            monitored,
            bus,
            state,
            layer,
            confirmations,
        }
    }

    fn router(&self) -> Router {
        Router::new()
            .route(
                "/orders/{id}",
                post(async |Path(id): Path<String>, mut publisher: Publisher| {
                    insert_and_publish(&mut publisher, &id).await;
                    StatusCode::CREATED
                }),
            )
            .route(
                "/orders/{id}/answer/{status}",
                post(
                    async |Path((id, status)): Path<(String, u16)>, mut publisher: Publisher| {
                        insert_and_publish(&mut publisher, &id).await;
                        StatusCode::from_u16(status).unwrap()
                    },
                ),
            )
            .route(
                "/orders/{id}/panic",
                post(async |Path(id): Path<String>, mut publisher: Publisher| {
                    insert_and_publish(&mut publisher, &id).await;
                    panic!("the route failed after publishing");
                    #[allow(unreachable_code)]
                    StatusCode::CREATED
                }),
            )
            .route(
                "/orders/{id}/slow",
                post(async |Path(id): Path<String>, mut publisher: Publisher| {
                    insert_and_publish(&mut publisher, &id).await;
                    // Slow work inside the transaction: the budget runs out.
                    tokio::time::sleep(Duration::from_millis(400)).await;
                    StatusCode::CREATED
                }),
            )
            .route(
                "/orders/{id}/cancel",
                post(
                    async |State(relay): State<RelayState>, Path(id): Path<String>, mut tx: Tx| {
                        let orders = relay
                            .bus()
                            .store()
                            .database()
                            .collection::<Document>("orders");
                        orders
                            .update_one(doc! { "_id": id }, doc! { "$set": { "cancelled": true } })
                            .session(&mut *tx)
                            .await
                            .unwrap();
                        StatusCode::NO_CONTENT
                    },
                ),
            )
            .route(
                "/orders/{id}/noted",
                post(
                    async |Path(id): Path<String>,
                           mut publisher: Publisher,
                           note: String|
                           -> Result<StatusCode, PublishError> {
                        // The route's own write and the publish answer with `?`: a transient
                        // error marks the response, and the layer runs the request again.
                        orders_of(&publisher)
                            .insert_one(doc! { "_id": &id, "note": note })
                            .session(publisher.session())
                            .await?;
                        publisher.publish(&placed(&id)).key(&id).await?;
                        Ok(StatusCode::CREATED)
                    },
                ),
            )
            .route(
                "/twice",
                post(async |_tx: Tx, _publisher: Publisher| StatusCode::CREATED),
            )
            .route("/health", get(async || "ok"))
            .layer(self.layer.clone())
            .with_state(self.state.clone())
    }

    async fn counts(&self) -> (u64, u64, u64) {
        (
            count(&self.db, "orders").await,
            count(&self.db, "relaybus_events").await,
            count(&self.db, "relaybus_deliveries").await,
        )
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

#[tokio::test]
async fn a_created_order_commits_the_order_and_its_event_and_the_handlers_run() {
    let mut shop = Shop::new("axum_commit").await;
    let response = shop.router().oneshot(post_to("/orders/o-1")).await.unwrap();
    assert_eq!(response.status(), StatusCode::CREATED);
    assert_eq!(
        shop.counts().await,
        (1, 1, 2),
        "order, event, two deliveries"
    );
    let started = shop.monitored.started();
    assert!(
        started.iter().any(|c| c == "commitTransaction"),
        "{started:?}"
    );
    assert!(!started.iter().any(|c| c == "abortTransaction"));

    let report = shop.bus.run_once().await.unwrap();
    // The projector's delivery completes in its own transaction, the other in a batch.
    assert_eq!((report.claimed, report.completed), (2, 2), "{report:?}");
    assert_eq!(
        next(&mut shop.confirmations, "the confirmation").await,
        "o-1"
    );
    let totals = shop
        .db
        .db()
        .collection::<Document>("order_totals")
        .find_one(doc! { "_id": "all" })
        .await
        .unwrap()
        .expect("the projector wrote its totals");
    assert_eq!(totals.get_i32("orders").unwrap(), 1);
    assert_eq!(totals.get_i64("total_cents").unwrap(), 1250);
    assert_eq!(shop.counts().await, (1, 1, 0), "both deliveries completed");
}

#[tokio::test]
async fn a_route_that_answers_4xx_or_5xx_after_publishing_commits_nothing() {
    let mut shop = Shop::new("axum_error_status").await;
    for (id, status) in [("o-1", 422), ("o-2", 500), ("o-3", 409)] {
        let response = shop
            .router()
            .oneshot(post_to(&format!("/orders/{id}/answer/{status}")))
            .await
            .unwrap();
        assert_eq!(response.status().as_u16(), status);
        let started = shop.monitored.started();
        assert!(
            started.iter().any(|c| c == "abortTransaction"),
            "aborted before the response: {started:?}"
        );
        assert!(!started.iter().any(|c| c == "commitTransaction"));
    }
    assert_eq!(shop.counts().await, (0, 0, 0));

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
        "axum_policy",
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
}

#[tokio::test]
async fn a_panicking_route_commits_nothing_and_its_transaction_is_aborted() {
    let mut shop = Shop::new("axum_panic").await;
    let request = shop.router().oneshot(post_to("/orders/o-1/panic"));
    let outcome = tokio::spawn(request).await;
    assert!(outcome.unwrap_err().is_panic());
    // The driver aborts the transaction of the dropped session in the background.
    shop.monitored.wait_for("abortTransaction").await;
    assert_eq!(shop.counts().await, (0, 0, 0));
}

#[tokio::test]
async fn a_dropped_request_aborts_its_transaction() {
    let mut shop = Shop::new("axum_dropped").await;
    let (entered_tx, mut entered) = mpsc::unbounded_channel();
    let router = Router::new()
        .route(
            "/orders/{id}",
            post(
                async move |Path(id): Path<String>, mut publisher: Publisher| {
                    insert_and_publish(&mut publisher, &id).await;
                    entered_tx.send(()).unwrap();
                    // The client goes away while the route still works.
                    std::future::pending::<()>().await;
                    StatusCode::CREATED
                },
            ),
        )
        .layer(shop.layer.clone())
        .with_state(shop.state.clone());
    let request = router.oneshot(post_to("/orders/o-1"));
    tokio::select! {
        _ = request => panic!("the route never answers"),
        _ = next(&mut entered, "the route to publish") => {}
    }
    // The request future is dropped here.
    shop.monitored.wait_for("abortTransaction").await;
    assert_eq!(shop.counts().await, (0, 0, 0));
}

#[tokio::test]
async fn an_extractor_that_outlives_its_handler_fails_the_request_and_commits_nothing() {
    let mut shop = Shop::new("axum_outlived").await;
    let (release_tx, release_rx) = oneshot::channel::<()>();
    let release = Arc::new(Mutex::new(Some(release_rx)));
    let router = Router::new()
        .route(
            "/orders/{id}",
            post(
                async move |Path(id): Path<String>, mut publisher: Publisher| {
                    insert_and_publish(&mut publisher, &id).await;
                    let release = release.lock().unwrap().take().unwrap();
                    // The publisher escapes into a task that outlives the handler.
                    tokio::spawn(async move {
                        let _kept = publisher;
                        let _ = release.await;
                    });
                    StatusCode::CREATED
                },
            ),
        )
        .layer(shop.layer.clone())
        .with_state(shop.state.clone());
    let response = router.oneshot(post_to("/orders/o-1")).await.unwrap();
    assert_eq!(response.status(), StatusCode::INTERNAL_SERVER_ERROR);
    assert!(
        !shop
            .monitored
            .started()
            .iter()
            .any(|c| c == "commitTransaction")
    );
    // When the escaped publisher drops, the driver aborts the transaction.
    release_tx.send(()).unwrap();
    shop.monitored.wait_for("abortTransaction").await;
    assert_eq!(shop.counts().await, (0, 0, 0));
}

#[tokio::test]
async fn a_route_that_never_extracts_makes_no_database_call() {
    let mut shop = Shop::new("axum_lazy").await;
    let response = shop
        .router()
        .oneshot(Request::get("/health").body(Body::empty()).unwrap())
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(
        shop.monitored.started(),
        Vec::<String>::new(),
        "no session, no transaction, no command"
    );
    // The same router, extracting, does reach the database: the monitor sees it.
    let response = shop.router().oneshot(post_to("/orders/o-1")).await.unwrap();
    assert_eq!(response.status(), StatusCode::CREATED);
    assert!(!shop.monitored.started().is_empty());
}

#[tokio::test]
async fn tx_gives_the_session_for_the_routes_own_writes() {
    let shop = Shop::new("axum_tx").await;
    let orders = shop.db.db().collection::<Document>("orders");
    orders.insert_one(doc! { "_id": "o-1" }).await.unwrap();
    let response = shop
        .router()
        .oneshot(post_to("/orders/o-1/cancel"))
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::NO_CONTENT);
    let order = orders
        .find_one(doc! { "_id": "o-1" })
        .await
        .unwrap()
        .unwrap();
    assert_eq!(order.get_bool("cancelled"), Ok(true));
}

#[tokio::test]
async fn a_write_conflict_at_commit_runs_the_request_again_and_commits_it_once() {
    let mut shop = Shop::new("axum_conflict_retry").await;
    let fail = fail_command(
        &shop.monitored.client,
        &shop.monitored.app,
        "commitTransaction",
        1,
        112,
        "TransientTransactionError",
    )
    .await;
    shop.monitored.started();
    let response = shop.router().oneshot(post_to("/orders/o-1")).await.unwrap();
    fail.disable().await.unwrap();
    assert_eq!(response.status(), StatusCode::CREATED);
    let started = shop.monitored.started();
    assert_eq!(
        started.iter().filter(|c| *c == "commitTransaction").count(),
        2,
        "the failed commit, then the second run's: {started:?}"
    );
    assert_eq!(
        started.iter().filter(|c| *c == "findAndModify").count(),
        2,
        "the route published twice, taking the key's counter each time: {started:?}"
    );
    assert_eq!(
        shop.counts().await,
        (1, 1, 2),
        "one order, one event, two deliveries"
    );
}

#[tokio::test]
async fn without_retries_a_write_conflict_at_commit_answers_503_with_retry_after_and_commits_nothing()
 {
    let mut shop = Shop::with(
        "axum_conflict",
        |builder| builder,
        |config| {
            config
                .retry_after(Duration::from_secs(7))
                .request_attempts(1)
        },
    )
    .await;
    let fail = fail_command(
        &shop.monitored.client,
        &shop.monitored.app,
        "commitTransaction",
        1,
        112,
        "TransientTransactionError",
    )
    .await;
    shop.monitored.started();
    let response = shop.router().oneshot(post_to("/orders/o-1")).await.unwrap();
    fail.disable().await.unwrap();
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(response.headers()[RETRY_AFTER], "7");
    assert!(text(response).await.contains("nothing was saved"));
    let started = shop.monitored.started();
    assert_eq!(
        started.iter().filter(|c| *c == "commitTransaction").count(),
        1,
        "one attempt: {started:?}"
    );
    assert_eq!(shop.counts().await, (0, 0, 0));
}

fn noted(id: &str, note: &'static str) -> Request<Body> {
    Request::post(format!("/orders/{id}/noted"))
        .header("content-length", note.len())
        .body(Body::from(note))
        .unwrap()
}

#[tokio::test]
async fn a_conflict_in_the_routes_own_write_runs_it_again_on_a_copy_of_the_body() {
    let mut shop = Shop::new("axum_route_conflict").await;
    // The route's first insert meets a write conflict; its `?` answers 503 with the mark.
    let fail = fail_command(
        &shop.monitored.client,
        &shop.monitored.app,
        "insert",
        1,
        112,
        "TransientTransactionError",
    )
    .await;
    shop.monitored.started();
    let response = shop
        .router()
        .oneshot(noted("o-1", "gift wrap"))
        .await
        .unwrap();
    fail.disable().await.unwrap();
    assert_eq!(response.status(), StatusCode::CREATED);
    let started = shop.monitored.started();
    assert_eq!(
        started.iter().filter(|c| *c == "abortTransaction").count(),
        1,
        "the first run's transaction is aborted: {started:?}"
    );
    assert_eq!(
        started.iter().filter(|c| *c == "commitTransaction").count(),
        1,
        "{started:?}"
    );
    let order = shop
        .db
        .db()
        .collection::<Document>("orders")
        .find_one(doc! { "_id": "o-1" })
        .await
        .unwrap()
        .unwrap();
    assert_eq!(order.get_str("note"), Ok("gift wrap"), "the body, replayed");
    assert_eq!(shop.counts().await, (1, 1, 2));
}

#[tokio::test]
async fn a_body_over_the_buffer_limit_runs_once() {
    let mut shop = Shop::with(
        "axum_big_body",
        |builder| builder,
        |config| config.max_buffered_body(4),
    )
    .await;
    let fail = fail_command(
        &shop.monitored.client,
        &shop.monitored.app,
        "insert",
        1,
        112,
        "TransientTransactionError",
    )
    .await;
    shop.monitored.started();
    let response = shop
        .router()
        .oneshot(noted("o-1", "gift wrap"))
        .await
        .unwrap();
    fail.disable().await.unwrap();
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(response.headers()[RETRY_AFTER], "1");
    let started = shop.monitored.started();
    assert_eq!(
        started.iter().filter(|c| *c == "insert").count(),
        1,
        "not run again: {started:?}"
    );
    assert_eq!(shop.counts().await, (0, 0, 0));
    // Within the limit, the same request is run again.
    let mut shop = Shop::with(
        "axum_small_body",
        |builder| builder,
        |config| config.max_buffered_body(9),
    )
    .await;
    let fail = fail_command(
        &shop.monitored.client,
        &shop.monitored.app,
        "insert",
        1,
        112,
        "TransientTransactionError",
    )
    .await;
    shop.monitored.started();
    let response = shop
        .router()
        .oneshot(noted("o-1", "gift wrap"))
        .await
        .unwrap();
    fail.disable().await.unwrap();
    assert_eq!(response.status(), StatusCode::CREATED);
}

#[tokio::test]
async fn an_unknown_commit_result_sends_the_commit_again() {
    let mut shop = Shop::new("axum_unknown_commit").await;
    let fail = fail_command(
        &shop.monitored.client,
        &shop.monitored.app,
        "commitTransaction",
        2,
        // WriteConcernFailed: an unknown outcome that the driver does not retry itself.
        64,
        "UnknownTransactionCommitResult",
    )
    .await;
    shop.monitored.started();
    let response = shop.router().oneshot(post_to("/orders/o-1")).await.unwrap();
    fail.disable().await.unwrap();
    let started = shop.monitored.started();
    assert_eq!(
        response.status(),
        StatusCode::CREATED,
        "{started:?} {}",
        text(response).await
    );
    assert_eq!(
        started.iter().filter(|c| *c == "commitTransaction").count(),
        3,
        "two failed commits and the one that went through: {started:?}"
    );
    assert_eq!(shop.counts().await, (1, 1, 2));
}

#[tokio::test]
async fn a_transaction_over_its_budget_answers_503_and_commits_nothing() {
    let shop = Shop::with(
        "axum_budget",
        |builder| builder,
        |config| config.transaction_timeout(Duration::from_millis(200)),
    )
    .await;
    let response = shop
        .router()
        .oneshot(post_to("/orders/o-1/slow"))
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(response.headers()[RETRY_AFTER], "1");
    assert_eq!(shop.counts().await, (0, 0, 0));
}

#[tokio::test]
async fn without_the_layer_the_extractors_answer_500_naming_the_layer() {
    let shop = Shop::new("axum_missing_layer").await;
    let router = Router::new()
        .route("/publisher", post(async |_: Publisher| StatusCode::CREATED))
        .route("/tx", post(async |_: Tx| StatusCode::CREATED))
        .with_state(shop.state.clone());
    for uri in ["/publisher", "/tx"] {
        let response = router.clone().oneshot(post_to(uri)).await.unwrap();
        assert_eq!(response.status(), StatusCode::INTERNAL_SERVER_ERROR);
        let body = text(response).await;
        assert!(
            body.contains(
                "no request transaction; add `relaybus_axum::RequestTxLayer` to the router"
            ),
            "{body}"
        );
    }
}

#[tokio::test]
async fn a_second_extractor_in_one_handler_fails_clearly_and_commits_nothing() {
    let mut shop = Shop::new("axum_overlap").await;
    let response = tokio::time::timeout(
        Duration::from_secs(30),
        shop.router().oneshot(post_to("/twice")),
    )
    .await
    .expect("no deadlock")
    .unwrap();
    assert_eq!(response.status(), StatusCode::INTERNAL_SERVER_ERROR);
    assert!(text(response).await.contains("held by another extractor"));
    assert!(
        !shop
            .monitored
            .started()
            .iter()
            .any(|c| c == "commitTransaction")
    );
}

#[tokio::test]
async fn a_state_and_a_layer_of_two_setups_are_refused() {
    let shop = Shop::new("axum_foreign").await;
    let (other_state, _other_layer) = relaybus_axum::setup(shop.bus.clone()).unwrap();
    let router = Router::new()
        .route("/", post(async |_: Publisher| StatusCode::CREATED))
        .layer(shop.layer.clone())
        .with_state(other_state);
    let response = router.oneshot(post_to("/")).await.unwrap();
    assert_eq!(response.status(), StatusCode::INTERNAL_SERVER_ERROR);
    assert!(
        text(response)
            .await
            .contains("different `relaybus_axum::setup` calls")
    );
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

#[tokio::test]
async fn graceful_shutdown_drains_requests_releases_deliveries_and_frees_the_lanes() {
    let db = test_db("axum_shutdown").await;
    let store = store(&db).await;
    let (handler_tx, mut handler_started) = mpsc::unbounded_channel();
    let bus = RelayBus::builder(store.clone())
        .owner("web-1")
        .poll_interval(Duration::from_millis(50))
        .lease_duration(Duration::from_secs(600))
        .shutdown_timeout(Duration::from_millis(200))
        .subscribe(starts_and_hangs::<OrderPlaced>("slow", handler_tx))
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
            post(async |Path(id): Path<String>, mut publisher: Publisher| {
                insert_and_publish(&mut publisher, &id).await;
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

    let lanes = db.db().collection::<Document>("relaybus_lanes");
    assert_eq!(
        lanes
            .count_documents(doc! { "owner": "web-1" })
            .await
            .unwrap(),
        0,
        "every lane was handed back"
    );
    let deliveries = deliveries(&db).await;
    assert_eq!(deliveries.len(), 1);
    assert_eq!(deliveries[0].get_str("status").unwrap(), "pending");

    // Another worker takes it at once, with the 600 s lease far from its end, as attempt 1.
    let (tx, mut rx) = mpsc::unbounded_channel();
    let other = RelayBus::builder(store)
        .owner("web-2")
        .subscribe(reports_attempt::<OrderPlaced>("slow", tx))
        .build()
        .unwrap();
    let report = other.run_once().await.unwrap();
    assert_eq!((report.claimed, report.completed), (1, 1));
    assert_eq!(next(&mut rx, "the other worker's run").await, 1);
}

async fn json(response: Response<Body>) -> serde_json::Value {
    serde_json::from_str(&text(response).await).unwrap()
}

fn get_from(uri: &str) -> Request<Body> {
    Request::get(uri).body(Body::empty()).unwrap()
}

fn requeue_request(body: &str, json: bool) -> Request<Body> {
    ops_write("/ops/deliveries/requeue", body, json)
}

/// A write to the operator routes, with the header writes need.
fn ops_write(uri: &str, body: &str, json: bool) -> Request<Body> {
    let mut request = Request::post(uri).header(relaybus_axum::ops::WRITE_HEADER, "1");
    if json {
        request = request.header("content-type", "application/json");
    }
    request.body(Body::from(body.to_owned())).unwrap()
}

#[tokio::test]
async fn ops_routes_answer_and_refuse_bad_input() {
    let db = test_db("axum_ops").await;
    let store = store(&db).await;
    let bus = RelayBus::builder(store)
        .subscribe(
            Subscription::new("doomed", |_: OrderPlaced, _: HandlerContext| async {
                Err::<(), BoxError>("the mail server said no".into())
            })
            .retry(RetryPolicy::new(1)),
        )
        .build()
        .unwrap();
    for n in 0..3 {
        bus.publish(&OrderPlaced {
            order_id: format!("o-{n}"),
            total_cents: 100,
        })
        .await
        .unwrap();
    }
    assert_eq!(bus.run_once().await.unwrap().claimed, 3);
    let router: Router = Router::new().nest("/ops", relaybus_axum::ops::router(bus.clone()));
    let call = |request: Request<Body>| router.clone().oneshot(request);

    let stats = json(call(get_from("/ops/statistics")).await.unwrap()).await;
    assert_eq!(stats["dead"], 3, "{stats}");
    assert_eq!(stats["pending"], 0, "{stats}");

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

    let unknown = "65f0a1b2c3d4e5f601234567";
    let requeued = call(requeue_request(
        &format!(r#"{{"ids": ["{id}", "{unknown}"]}}"#),
        true,
    ))
    .await
    .unwrap();
    assert_eq!(requeued.status(), StatusCode::OK);
    let requeued = json(requeued).await;
    assert_eq!(requeued["requeued"], serde_json::json!([id]));
    assert_eq!(requeued["not_found"], serde_json::json!([unknown]));
    let stats = json(call(get_from("/ops/statistics")).await.unwrap()).await;
    assert_eq!(
        (stats["dead"].as_u64(), stats["pending"].as_u64()),
        (Some(2), Some(1))
    );

    for uri in [
        "/ops/deliveries?handler[$ne]=x",
        "/ops/deliveries?status[$ne]=pending",
        "/ops/deliveries?status=buried",
        "/ops/deliveries?handler=doomed&handler=other",
        "/ops/deliveries?limit=5000",
        "/ops/deliveries?created_from=yesterday",
        "/ops/deliveries?event_type=%7B%22%24gt%22%3A%22%22%7D",
    ] {
        let response = call(get_from(uri)).await.unwrap();
        assert_eq!(response.status(), StatusCode::BAD_REQUEST, "{uri}");
        assert!(json(response).await["error"].is_string(), "{uri}");
    }
    for body in [
        r#"{"ids": [{"$ne": null}]}"#,
        r#"{"ids": {"$gt": ""}}"#,
        r#"{"ids": ["not-an-id"]}"#,
        r#"{"ids": []}"#,
        r#"{"ids": [], "$where": "1"}"#,
        "not json",
    ] {
        let response = call(requeue_request(body, true)).await.unwrap();
        assert_eq!(response.status(), StatusCode::BAD_REQUEST, "{body}");
    }
    let response = call(requeue_request(&format!(r#"{{"ids": ["{id}"]}}"#), false))
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::UNSUPPORTED_MEDIA_TYPE);
    let stats = json(call(get_from("/ops/statistics")).await.unwrap()).await;
    assert_eq!(stats["dead"], 2, "refused input changed nothing: {stats}");
}

/// A bus with `n` dead letters of handler `doomed` and `m` of handler `broken`.
async fn dead_letters(db: &TestDb, doomed: usize, broken: usize) -> RelayBus {
    let store = store(db).await;
    let failing = |id: &'static str| {
        Subscription::new(id, |_: OrderPlaced, _: HandlerContext| async {
            Err::<(), BoxError>("the mail server said no".into())
        })
        .retry(RetryPolicy::new(1))
    };
    let bus = RelayBus::builder(store)
        .without_registered_handlers()
        .subscribe(failing("doomed"))
        .build()
        .unwrap();
    for n in 0..doomed {
        bus.publish(&placed(&format!("d-{n}"))).await.unwrap();
    }
    let both = RelayBus::builder(bus.store().clone())
        .without_registered_handlers()
        .subscribe(failing("doomed"))
        .subscribe(failing("broken"))
        .build()
        .unwrap();
    for n in 0..broken {
        // An event for `broken` alone: a bus whose only handler of it is `broken`.
        let only = RelayBus::builder(bus.store().clone())
            .without_registered_handlers()
            .subscribe(failing("broken"))
            .build()
            .unwrap();
        only.publish(&placed(&format!("b-{n}"))).await.unwrap();
    }
    while both.run_once().await.unwrap().claimed > 0 {}
    both
}

#[tokio::test]
async fn ops_writes_need_their_header_and_take_ids_a_filter_or_all() {
    let db = test_db("axum_ops_writes").await;
    let bus = dead_letters(&db, 3, 2).await;
    let router: Router = Router::new().nest("/ops", relaybus_axum::ops::router(bus.clone()));
    let call = |request: Request<Body>| router.clone().oneshot(request);
    let stats = json(call(get_from("/ops/statistics")).await.unwrap()).await;
    assert_eq!(stats["dead"], 5, "{stats}");

    // Every answer is uncacheable and unframeable.
    let answer = call(get_from("/ops/statistics")).await.unwrap();
    let headers = answer.headers();
    assert_eq!(headers["cache-control"], "no-store");
    assert_eq!(headers["x-frame-options"], "DENY");
    assert_eq!(headers["x-content-type-options"], "nosniff");
    assert!(
        headers["content-security-policy"]
            .to_str()
            .unwrap()
            .contains("frame-ancestors 'none'")
    );

    // Per handler.
    let handlers = json(call(get_from("/ops/handlers")).await.unwrap()).await;
    let list = handlers["handlers"].as_array().unwrap();
    let dead_of = |id: &str| {
        list.iter()
            .find(|h| h["handler"] == id)
            .map(|h| h["dead"].as_u64().unwrap())
    };
    assert_eq!(
        (dead_of("doomed"), dead_of("broken")),
        (Some(3), Some(2)),
        "{handlers}"
    );

    // Without the header, a write is refused and changes nothing.
    let unmarked = Request::post("/ops/deliveries/requeue")
        .header("content-type", "application/json")
        .body(Body::from(r#"{"all": true}"#))
        .unwrap();
    let refused = call(unmarked).await.unwrap();
    assert_eq!(refused.status(), StatusCode::FORBIDDEN);
    assert!(
        json(refused).await["error"]
            .as_str()
            .unwrap()
            .contains(relaybus_axum::ops::WRITE_HEADER)
    );
    let stats = json(call(get_from("/ops/statistics")).await.unwrap()).await;
    assert_eq!(stats["dead"], 5, "{stats}");

    // Read-only routes refuse every write.
    let read_only: Router = Router::new().nest(
        "/ops",
        relaybus_axum::ops::config(bus.clone())
            .read_only(true)
            .router(),
    );
    for uri in ["/ops/deliveries/requeue", "/ops/deliveries/discard"] {
        let response = read_only
            .clone()
            .oneshot(ops_write(uri, r#"{"all": true}"#, true))
            .await
            .unwrap();
        assert_eq!(response.status(), StatusCode::FORBIDDEN, "{uri}");
    }
    let stats = json(call(get_from("/ops/statistics")).await.unwrap()).await;
    assert_eq!(stats["dead"], 5, "{stats}");

    // Requeue by filter: the handler's dead letters only.
    let requeued = json(
        call(ops_write(
            "/ops/deliveries/requeue",
            r#"{"filter": {"handler": "broken"}}"#,
            true,
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
    assert_eq!(requeued["more"], false);
    let stats = json(call(get_from("/ops/statistics")).await.unwrap()).await;
    assert_eq!(
        (stats["dead"].as_u64(), stats["pending"].as_u64()),
        (Some(3), Some(2))
    );

    // Discard one by id, then the rest with "all".
    let page = json(
        call(get_from("/ops/deliveries?status=dead&limit=1"))
            .await
            .unwrap(),
    )
    .await;
    let id = page["deliveries"][0]["id"].as_str().unwrap().to_owned();
    let discarded = json(
        call(ops_write(
            "/ops/deliveries/discard",
            &format!(r#"{{"ids": ["{id}"]}}"#),
            true,
        ))
        .await
        .unwrap(),
    )
    .await;
    assert_eq!(
        discarded["discarded"],
        serde_json::json!([id]),
        "{discarded}"
    );
    let rest = json(
        call(ops_write(
            "/ops/deliveries/discard",
            r#"{"all": true}"#,
            true,
        ))
        .await
        .unwrap(),
    )
    .await;
    assert_eq!(rest["discarded"].as_array().unwrap().len(), 2, "{rest}");
    let stats = json(call(get_from("/ops/statistics")).await.unwrap()).await;
    assert_eq!(
        (stats["dead"].as_u64(), stats["pending"].as_u64()),
        (Some(0), Some(2)),
        "the requeued ones are left: {stats}"
    );

    // Bury a pending one by id, with a reason; none is refused.
    let page = json(
        call(get_from("/ops/deliveries?status=pending&limit=1"))
            .await
            .unwrap(),
    )
    .await;
    let id = page["deliveries"][0]["id"].as_str().unwrap().to_owned();
    let unexplained = call(ops_write(
        "/ops/deliveries/bury",
        &format!(r#"{{"ids": ["{id}"], "reason": " "}}"#),
        true,
    ))
    .await
    .unwrap();
    assert_eq!(unexplained.status(), StatusCode::BAD_REQUEST);
    let buried = json(
        call(ops_write(
            "/ops/deliveries/bury",
            &format!(r#"{{"ids": ["{id}"], "reason": "the customer was deleted"}}"#),
            true,
        ))
        .await
        .unwrap(),
    )
    .await;
    assert_eq!(buried["buried"], serde_json::json!([id]), "{buried}");
    let dead = json(call(get_from("/ops/deliveries?status=dead")).await.unwrap()).await;
    assert!(
        dead["deliveries"][0]["last_error"]
            .as_str()
            .unwrap()
            .contains("the customer was deleted"),
        "{dead}"
    );
}

#[tokio::test]
async fn the_request_transaction_uses_the_transaction_options_of_the_store() {
    use mongodb::options::{Acknowledgment, TransactionOptions, WriteConcern};

    let db = test_db("axum_options").await;
    // A write concern no test replica set can satisfy: a commit with it fails.
    let options = TransactionOptions::builder()
        .write_concern(
            WriteConcern::builder()
                .w(Acknowledgment::Nodes(9))
                .w_timeout(Duration::from_millis(200))
                .build(),
        )
        .build();
    let store = relaybus::MongoEventStore::builder(db.client.clone())
        .database(&db.name)
        .transaction_options(options)
        .build()
        .unwrap();
    store.setup().await.unwrap();
    let bus = RelayBus::builder(store)
        .without_registered_handlers()
        .build()
        .unwrap();
    let (state, layer) = relaybus_axum::setup(bus).unwrap();
    let app: Router = Router::new()
        .route(
            "/orders/{id}",
            post(async |Path(id): Path<String>, mut publisher: Publisher| {
                insert_and_publish(&mut publisher, &id).await;
                StatusCode::CREATED
            }),
        )
        .layer(layer)
        .with_state(state);
    let response = app.oneshot(post_to("/orders/o-1")).await.unwrap();
    assert_eq!(
        response.status(),
        StatusCode::INTERNAL_SERVER_ERROR,
        "the commit used the store's write concern, which cannot be satisfied"
    );
    // The primary applied the commit before the write concern failed: the answer says so
    // rather than "not saved", and the order is there.
    let body = axum::body::to_bytes(response.into_body(), 4096)
        .await
        .unwrap();
    let body = String::from_utf8_lossy(&body);
    assert!(body.contains("was saved, but"), "{body}");
    assert!(
        db.db()
            .collection::<mongodb::bson::Document>("orders")
            .find_one(doc! { "_id": "o-1" })
            .await
            .unwrap()
            .is_some()
    );
}

/// `bus.transaction` inside an Axum handler and inside a spawned task: both need a `Send`
/// future, which a borrowing closure could not give. This only has to compile.
#[allow(dead_code)]
fn bus_transactions_compile_in_a_handler_and_in_a_spawned_task(bus: RelayBus) {
    async fn place(State(bus): State<RelayBus>, Path(id): Path<String>) -> StatusCode {
        let orders = bus.store().database().collection::<Document>("orders");
        let body = {
            let bus = bus.clone();
            async move |session: &mut mongodb::ClientSession| {
                orders
                    .insert_one(doc! { "_id": &id })
                    .session(&mut *session)
                    .await?;
                bus.publish(&placed(&id)).key(&id).session(session).await
            }
        };
        match bus.transaction(body).await {
            Ok(_) => StatusCode::CREATED,
            Err(_) => StatusCode::SERVICE_UNAVAILABLE,
        }
    }
    let spawned = bus.clone();
    drop(tokio::spawn(async move {
        spawned
            .transaction(async move |_: &mut mongodb::ClientSession| Ok(()))
            .await
    }));
    let _: Router = Router::new()
        .route("/orders/{id}", post(place))
        .with_state(bus);
}

#[tokio::test]
async fn twenty_concurrent_requests_publishing_on_one_key_all_commit() {
    let shop = Shop::new("axum_hot_key").await;
    let router = Router::new()
        .route(
            "/hot/{id}",
            post(
                async |Path(id): Path<String>,
                       mut publisher: Publisher|
                       -> Result<StatusCode, PublishError> {
                    orders_of(&publisher)
                        .insert_one(doc! { "_id": &id })
                        .session(publisher.session())
                        .await?;
                    publisher.publish(&placed(&id)).key("hot").await?;
                    Ok(StatusCode::CREATED)
                },
            ),
        )
        .layer(shop.layer.clone())
        .with_state(shop.state.clone());
    let barrier = Arc::new(tokio::sync::Barrier::new(20));
    let requests: Vec<_> = (0..20)
        .map(|i| {
            let (router, barrier) = (router.clone(), Arc::clone(&barrier));
            tokio::spawn(async move {
                barrier.wait().await;
                router
                    .oneshot(post_to(&format!("/hot/o-{i}")))
                    .await
                    .unwrap()
            })
        })
        .collect();
    let mut statuses = Vec::new();
    for request in requests {
        statuses.push(request.await.unwrap().status());
    }
    assert_eq!(statuses, [StatusCode::CREATED; 20], "every request commits");
    assert_eq!(shop.counts().await, (20, 20, 40));
    // One key, twenty events: the sequences 1 to 20, each once.
    let mut sequences: Vec<i64> = shop
        .db
        .db()
        .collection::<Document>("relaybus_events")
        .find(doc! {})
        .await
        .unwrap()
        .try_collect::<Vec<_>>()
        .await
        .unwrap()
        .iter()
        .map(|event| event.get_i64("sequence").unwrap())
        .collect();
    sequences.sort_unstable();
    assert_eq!(sequences, (1..=20).collect::<Vec<_>>());
}

/// A service that sets its store up before the dispatcher starts sets it up once: the start
/// sends none of setup's commands again.
#[tokio::test]
async fn a_store_set_up_before_the_service_starts_is_not_set_up_again() {
    let db = test_db("axum_setup_once").await;
    let mut monitored = Monitored::new(&db).await;
    let store = store_on(&monitored.client, &db).await;
    let setup = monitored.started();
    assert!(
        setup.iter().any(|name| name == "createIndexes"),
        "setup creates indexes: {setup:?}"
    );
    let bus = RelayBus::builder(store)
        .without_registered_handlers()
        .subscribe(Subscription::new(
            "send-confirmation",
            |_: OrderPlaced, _: HandlerContext| async { Ok::<(), BoxError>(()) },
        ))
        .build()
        .unwrap();
    let token = CancellationToken::new();
    let service = DispatcherService::new(bus)
        .handle_signals(false)
        .with_shutdown_token(token.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let served = tokio::spawn(service.serve(listener, axum::Router::new()));
    // The dispatcher reads once it runs: its start is behind it.
    loop {
        let (kind, name) = next(&mut monitored.commands, "the dispatcher's commands").await;
        assert!(
            name != "createIndexes" && name != "create",
            "the start set the store up again: {name}"
        );
        if kind == "started" && (name == "find" || name == "aggregate") {
            break;
        }
    }
    token.cancel();
    served.await.unwrap().unwrap();
}
