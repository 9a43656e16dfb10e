//! Idempotent requests through the real router, on every store: relaybus-axum's
//! [`IdempotencyLayer`] with the request transaction, a route that writes an order and
//! publishes its event, and clients that send one request many times.
//!
//! Each test is a generic `async fn <behaviour><S: OrderBook>(store: S)`;
//! [`idempotency_tests!`](crate::idempotency_tests) turns them into one `#[tokio::test]` per
//! behaviour for a store, with the store maker of the conformance suite.

use std::{
    future::Future,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicUsize, Ordering},
    },
    time::Duration,
};

use axum::{
    Extension, Json, Router,
    body::Body,
    http::{Request, StatusCode, header::RETRY_AFTER},
    response::{IntoResponse, Response},
    routing::post,
};
use futures::future::join_all;
use mongodb::bson::{Document, doc};
use relaybus::{
    BoxError, HandlerContext, MemoryEventStore, MongoEventStore, PostgresEventStore, RelayBus,
    Retention, Store, Subscription, Timestamp, clock::TestClock,
};
use relaybus_axum::{
    IdempotencyLayer, PublishError, Publisher, idempotency::REPLAYED_HEADER,
    rejection::PublisherRejection,
};
use serde_json::json;
use tokio::sync::{mpsc, oneshot};
use tower::ServiceExt;

use crate::support::{OrderPlaced, placed};

/// Where the tests' route keeps orders: written in the request's transaction, read committed.
pub trait OrderBook: Store {
    /// Makes what orders need (a table), before the first request.
    fn prepare(&self) -> impl Future<Output = ()> + Send {
        async {}
    }

    /// Writes the order `id` in the transaction of `session`.
    fn write_order(
        &self,
        session: &mut Self::Session,
        id: &str,
        body: &str,
    ) -> impl Future<Output = Result<(), BoxError>> + Send;

    /// The committed orders' ids, sorted.
    fn order_ids(&self) -> impl Future<Output = Vec<String>> + Send;
}

impl OrderBook for MongoEventStore {
    async fn write_order(
        &self,
        session: &mut mongodb::ClientSession,
        id: &str,
        body: &str,
    ) -> Result<(), BoxError> {
        self.database()
            .collection::<Document>("orders")
            .insert_one(doc! { "_id": id, "body": body })
            .session(session)
            .await?;
        Ok(())
    }

    async fn order_ids(&self) -> Vec<String> {
        use futures::TryStreamExt;
        let orders: Vec<Document> = self
            .database()
            .collection::<Document>("orders")
            .find(doc! {})
            .await
            .unwrap()
            .try_collect()
            .await
            .unwrap();
        let mut ids: Vec<String> = orders
            .iter()
            .map(|o| o.get_str("_id").unwrap().to_owned())
            .collect();
        ids.sort();
        ids
    }
}

impl OrderBook for PostgresEventStore {
    async fn prepare(&self) {
        sqlx::query(&format!(
            "CREATE TABLE \"{}\".orders (id text PRIMARY KEY, body text NOT NULL)",
            self.schema()
        ))
        .execute(self.pool())
        .await
        .unwrap();
    }

    async fn write_order(
        &self,
        session: &mut relaybus::PostgresSession,
        id: &str,
        body: &str,
    ) -> Result<(), BoxError> {
        sqlx::query(&format!(
            "INSERT INTO \"{}\".orders (id, body) VALUES ($1, $2)",
            self.schema()
        ))
        .bind(id)
        .bind(body)
        .execute(&mut *session)
        .await?;
        Ok(())
    }

    async fn order_ids(&self) -> Vec<String> {
        sqlx::query_scalar(&format!(
            "SELECT id FROM \"{}\".orders ORDER BY id",
            self.schema()
        ))
        .fetch_all(self.pool())
        .await
        .unwrap()
    }
}

impl OrderBook for MemoryEventStore {
    async fn write_order(
        &self,
        session: &mut relaybus::MemorySession,
        id: &str,
        body: &str,
    ) -> Result<(), BoxError> {
        session.insert("orders", id, json!({ "body": body }))?;
        Ok(())
    }

    async fn order_ids(&self) -> Vec<String> {
        self.documents("orders")
            .into_iter()
            .map(|(id, _)| id)
            .collect()
    }
}

/// What the tests ask of the route.
#[derive(Debug, Default)]
struct Controls {
    /// How many times the route ran.
    runs: AtomicUsize,
    /// Answer 500 (after writing and publishing) on the next run.
    fail_next: AtomicBool,
    /// Stop the next run after its writes: say so on the sender, go on when the receiver
    /// fires.
    gate: Mutex<Option<(mpsc::UnboundedSender<()>, oneshot::Receiver<()>)>>,
}

/// Places an order: writes it and publishes its event in the request's transaction, and
/// answers 201 with its id.
async fn place_order<S: OrderBook>(
    Extension(controls): Extension<Arc<Controls>>,
    mut publisher: Publisher<PublisherRejection, S>,
    body: String,
) -> Response {
    let run = controls.runs.fetch_add(1, Ordering::SeqCst) + 1;
    let id = format!("o-{run:03}");
    let store = publisher.bus().store().clone();
    if let Err(error) = store.write_order(publisher.session(), &id, &body).await {
        return (StatusCode::INTERNAL_SERVER_ERROR, error.to_string()).into_response();
    }
    if let Err(error) = publisher.publish(&placed(&id)).key(&id).await {
        return PublishError::from(error).into_response();
    }
    let gate = controls.gate.lock().unwrap().take();
    if let Some((entered, release)) = gate {
        let _ = entered.send(());
        let _ = release.await;
    }
    if controls.fail_next.swap(false, Ordering::SeqCst) {
        return (StatusCode::INTERNAL_SERVER_ERROR, "the order failed").into_response();
    }
    (
        StatusCode::CREATED,
        [("x-order-id", id.clone())],
        Json(json!({ "order_id": id })),
    )
        .into_response()
}

/// The shop of a test: the router, its bus (on a test clock, with retention) and the controls.
struct Shop<S: OrderBook> {
    app: Router,
    bus: RelayBus<S>,
    clock: TestClock,
    controls: Arc<Controls>,
}

impl<S: OrderBook> Shop<S> {
    async fn new(
        store: S,
        idempotency: relaybus_axum::idempotency::IdempotencyLayerBuilder,
    ) -> Self {
        store.prepare().await;
        let clock = TestClock::new(Timestamp::from_millis(1_900_000_000_000));
        let projector =
            Subscription::new("projector", |_: OrderPlaced, _: HandlerContext<S>| async {
                Ok::<(), BoxError>(())
            });
        let bus = RelayBus::builder(store)
            .without_registered_handlers()
            .subscribe(projector)
            .clock(clock.clone())
            .retention(Some(Retention::default()))
            .build()
            .unwrap();
        let (state, request_tx) = relaybus_axum::setup(bus.clone()).unwrap();
        let idempotency = idempotency
            .caller(|parts| Some(parts.headers.get("x-caller")?.to_str().ok()?.to_owned()))
            .build()
            .unwrap();
        let controls = Arc::new(Controls::default());
        let app = Router::new()
            .route("/orders", post(place_order::<S>))
            .layer(idempotency)
            .layer(request_tx)
            .layer(Extension(Arc::clone(&controls)))
            .with_state(state);
        Shop {
            app,
            bus,
            clock,
            controls,
        }
    }

    /// Sends `POST /orders` with this body and key (none: no header), from `caller`.
    async fn post(&self, key: Option<&str>, body: &str, caller: Option<&str>) -> Answer {
        let mut request = Request::post("/orders");
        if let Some(key) = key {
            request = request.header("Idempotency-Key", key);
        }
        if let Some(caller) = caller {
            request = request.header("x-caller", caller);
        }
        let request = request.body(Body::from(body.to_owned())).unwrap();
        Answer::of(self.app.clone().oneshot(request).await.unwrap()).await
    }

    async fn orders(&self) -> Vec<String> {
        self.bus.store().order_ids().await
    }

    /// Events published: one projector delivery each.
    async fn events(&self) -> u64 {
        self.bus.store().statistics().await.unwrap().pending
    }

    fn runs(&self) -> usize {
        self.controls.runs.load(Ordering::SeqCst)
    }
}

/// A response, read.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Answer {
    status: StatusCode,
    replayed: bool,
    order_id: Option<String>,
    retry_after: Option<String>,
    body: String,
}

impl Answer {
    async fn of(response: Response) -> Self {
        let (replayed, order_id, retry_after) = {
            let header = |name: &str| {
                response
                    .headers()
                    .get(name)
                    .map(|v| v.to_str().unwrap().to_owned())
            };
            (
                header(REPLAYED_HEADER).as_deref() == Some("true"),
                header("x-order-id"),
                header(RETRY_AFTER.as_str()),
            )
        };
        let status = response.status();
        let bytes = axum::body::to_bytes(response.into_body(), usize::MAX)
            .await
            .unwrap();
        Answer {
            status,
            replayed,
            order_id,
            retry_after,
            body: String::from_utf8(bytes.to_vec()).unwrap(),
        }
    }

    /// The answer as the client reads it, without the replay mark.
    fn content(&self) -> (StatusCode, Option<&str>, &str) {
        (self.status, self.order_id.as_deref(), &self.body)
    }
}

const BODY: &str = r#"{"sku":"book","quantity":1}"#;

/// 20 identical requests with one key, sent at once to a layer that waits for the first: one
/// run, one order, one event, and 20 identical answers, 19 of them replays.
pub async fn twenty_concurrent_identical_posts_run_once<S: OrderBook>(store: S) {
    let shop = Shop::new(
        store,
        IdempotencyLayer::builder().wait(Duration::from_secs(30)),
    )
    .await;
    let answers = join_all((0..20).map(|_| shop.post(Some("k-20"), BODY, None))).await;
    let first = answers
        .iter()
        .find(|a| !a.replayed)
        .expect("one run")
        .clone();
    assert_eq!(first.status, StatusCode::CREATED, "{}: {first:?}", S::NAME);
    for answer in &answers {
        assert_eq!(answer.content(), first.content(), "{}", S::NAME);
    }
    let replays = answers.iter().filter(|a| a.replayed).count();
    assert_eq!(replays, 19, "{}: {answers:?}", S::NAME);
    assert_eq!(shop.runs(), 1, "{}", S::NAME);
    assert_eq!(shop.orders().await, ["o-001"], "{}", S::NAME);
    assert_eq!(shop.events().await, 1, "{}", S::NAME);
}

/// The same, without waiting: the requests that find the first running get 409 with
/// `Retry-After`, and sent again once it answered, its answer.
pub async fn concurrent_repeats_get_409_then_the_first_answer<S: OrderBook>(store: S) {
    let shop = Shop::new(store, IdempotencyLayer::builder()).await;
    let answers = join_all((0..20).map(|_| shop.post(Some("k-409"), BODY, None))).await;
    let first = answers
        .iter()
        .find(|a| a.status == StatusCode::CREATED && !a.replayed)
        .expect("one run")
        .clone();
    let mut retried = Vec::new();
    for answer in &answers {
        match answer.status {
            StatusCode::CREATED => assert_eq!(answer.content(), first.content(), "{}", S::NAME),
            StatusCode::CONFLICT => {
                assert_eq!(answer.retry_after.as_deref(), Some("1"), "{}", S::NAME);
                retried.push(shop.post(Some("k-409"), BODY, None).await);
            }
            other => panic!("{}: {other} {answer:?}", S::NAME),
        }
    }
    for answer in &retried {
        assert!(answer.replayed, "{}: {answer:?}", S::NAME);
        assert_eq!(answer.content(), first.content(), "{}", S::NAME);
    }
    assert_eq!(shop.runs(), 1, "{}", S::NAME);
    assert_eq!(shop.orders().await, ["o-001"], "{}", S::NAME);
    assert_eq!(shop.events().await, 1, "{}", S::NAME);

    // One held in the route: a repeat meanwhile is a 409, never a second run.
    let (entered_tx, mut entered) = mpsc::unbounded_channel();
    let (release, released) = oneshot::channel();
    *shop.controls.gate.lock().unwrap() = Some((entered_tx, released));
    let app = shop.app.clone();
    let held = tokio::spawn(async move {
        let request = Request::post("/orders")
            .header("Idempotency-Key", "k-held")
            .body(Body::from(BODY))
            .unwrap();
        Answer::of(app.oneshot(request).await.unwrap()).await
    });
    entered
        .recv()
        .await
        .expect("the first run entered the route");
    let repeat = shop.post(Some("k-held"), BODY, None).await;
    assert_eq!(
        repeat.status,
        StatusCode::CONFLICT,
        "{}: {repeat:?}",
        S::NAME
    );
    assert!(repeat.body.contains("still running"), "{}", S::NAME);
    release.send(()).unwrap();
    let first = held.await.unwrap();
    assert_eq!(first.status, StatusCode::CREATED, "{}", S::NAME);
    let repeat = shop.post(Some("k-held"), BODY, None).await;
    assert!(repeat.replayed, "{}", S::NAME);
    assert_eq!(repeat.content(), first.content(), "{}", S::NAME);
    assert_eq!(shop.runs(), 2, "{}", S::NAME);
}

/// A key sent again with another body is refused with 422, and runs nothing; a malformed key
/// is refused with 400; the same key from another caller is another request; requests without
/// a key run every time.
pub async fn a_key_reused_for_another_request_gets_422<S: OrderBook>(store: S) {
    let shop = Shop::new(store, IdempotencyLayer::builder()).await;
    let first = shop.post(Some("k-1"), BODY, None).await;
    assert_eq!(first.status, StatusCode::CREATED, "{}", S::NAME);
    let other = shop
        .post(Some("k-1"), r#"{"sku":"book","quantity":2}"#, None)
        .await;
    assert_eq!(
        other.status,
        StatusCode::UNPROCESSABLE_ENTITY,
        "{}: {other:?}",
        S::NAME
    );
    assert!(other.body.contains("different request"), "{}", S::NAME);
    assert_eq!((shop.runs(), shop.events().await), (1, 1), "{}", S::NAME);

    let long = "k".repeat(256);
    for bad in ["", long.as_str(), "tab\tkey"] {
        let refused = shop.post(Some(bad), BODY, None).await;
        assert_eq!(
            refused.status,
            StatusCode::BAD_REQUEST,
            "{}: {bad:?}",
            S::NAME
        );
        assert!(refused.body.contains("printable ASCII"), "{}", S::NAME);
    }
    assert_eq!(shop.runs(), 1, "{}", S::NAME);

    let alice = shop.post(Some("k-1"), BODY, Some("alice")).await;
    assert_eq!(
        (alice.status, alice.replayed, alice.order_id.as_deref()),
        (StatusCode::CREATED, false, Some("o-002")),
        "{}",
        S::NAME
    );
    let again = shop.post(Some("k-1"), BODY, Some("alice")).await;
    assert!(again.replayed, "{}", S::NAME);
    assert_eq!(again.order_id.as_deref(), Some("o-002"), "{}", S::NAME);

    shop.post(None, BODY, None).await;
    shop.post(None, BODY, None).await;
    assert_eq!(shop.orders().await.len(), 4, "{}", S::NAME);
}

/// A first request that fails (answered 500, its transaction rolled back) stores nothing: the
/// retry runs, and commits one order and one event.
pub async fn a_rolled_back_first_request_lets_the_retry_run<S: OrderBook>(store: S) {
    let shop = Shop::new(store, IdempotencyLayer::builder()).await;
    shop.controls.fail_next.store(true, Ordering::SeqCst);
    let failed = shop.post(Some("k-retry"), BODY, None).await;
    assert_eq!(
        failed.status,
        StatusCode::INTERNAL_SERVER_ERROR,
        "{}",
        S::NAME
    );
    assert!(shop.orders().await.is_empty(), "{}", S::NAME);
    assert_eq!(shop.events().await, 0, "{}", S::NAME);

    let retry = shop.post(Some("k-retry"), BODY, None).await;
    assert_eq!(
        (retry.status, retry.replayed),
        (StatusCode::CREATED, false),
        "{}",
        S::NAME
    );
    let again = shop.post(Some("k-retry"), BODY, None).await;
    assert!(again.replayed, "{}", S::NAME);
    assert_eq!(again.content(), retry.content(), "{}", S::NAME);
    assert_eq!(shop.runs(), 2, "{}", S::NAME);
    assert_eq!(shop.orders().await, ["o-002"], "{}", S::NAME);
    assert_eq!(shop.events().await, 1, "{}", S::NAME);
}

/// An answer is replayed for the retention (24 hours by default), then its key is new again,
/// and the bus's retention purge deletes it.
pub async fn expired_keys_are_purged_and_run_again<S: OrderBook>(store: S) {
    let shop = Shop::new(store, IdempotencyLayer::builder()).await;
    shop.post(Some("k-old"), BODY, None).await;
    shop.clock.advance(Duration::from_secs(12 * 3_600));
    shop.post(Some("k-new"), BODY, None).await;
    shop.clock.advance(Duration::from_secs(12 * 3_600 + 1));

    let purged = shop.bus.purge_expired().await.unwrap();
    assert_eq!(purged.request_keys, 1, "{}: {purged:?}", S::NAME);
    let purged = shop.bus.purge_expired().await.unwrap();
    assert_eq!(purged.request_keys, 0, "{}: {purged:?}", S::NAME);

    let new = shop.post(Some("k-new"), BODY, None).await;
    assert_eq!(
        (new.replayed, new.order_id.as_deref()),
        (true, Some("o-002")),
        "{}",
        S::NAME
    );
    let old = shop.post(Some("k-old"), BODY, None).await;
    assert_eq!(
        (old.replayed, old.order_id.as_deref()),
        (false, Some("o-003")),
        "{}",
        S::NAME
    );
    assert_eq!(shop.orders().await.len(), 3, "{}", S::NAME);
}

/// Expands to one `#[tokio::test]` per idempotency test for a store, with a maker of the
/// conformance suite's shape: `fn(test: &'static str) -> (S, guard)`.
#[macro_export]
macro_rules! idempotency_tests {
    ($make_store:expr $(,)?) => {
        $crate::idempotency_tests!(@tests $make_store;
            twenty_concurrent_identical_posts_run_once,
            concurrent_repeats_get_409_then_the_first_answer,
            a_key_reused_for_another_request_gets_422,
            a_rolled_back_first_request_lets_the_retry_run,
            expired_keys_are_purged_and_run_again,
        );
    };
    (@tests $make_store:expr; $($test:ident),+ $(,)?) => {
        $(
            #[::tokio::test]
            async fn $test() {
                let (store, _guard) = ($make_store)(::core::stringify!($test)).await;
                $crate::idempotency::$test(store).await;
            }
        )+
    };
}
