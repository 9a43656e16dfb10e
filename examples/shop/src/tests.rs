//! The shop's routes and handlers on the in-memory store: each test posts requests to the
//! router, then runs the handlers they caused with `run_until_idle`, on a test clock. No
//! database, no sleep; each runs in milliseconds.

use axum::{
    Router,
    body::Body,
    http::{Request, StatusCode, header},
};
use http_body_util::BodyExt;
use relaybus::{
    DeliveryQuery, MemoryEventStore, RelayBus, Store, Timestamp, clock::TestClock, store::Inspect,
};
use serde_json::{Value, json};
use tower::ServiceExt;

use crate::{
    app::{self, basic_credentials},
    handlers::{self, Mailer, OrderPlaced, PROJECTOR, SEND_CONFIRMATION},
    orders::{MemoryOrders, Orders},
};

const PASSWORD: &str = "test-password";

/// The shop on a store, its bus on a test clock.
struct Shop<O: Orders> {
    bus: RelayBus<O::Store>,
    store: O::Store,
    orders: O,
    mailer: Mailer,
    router: Router,
}

/// The shop on a fresh in-memory store.
async fn shop() -> Shop<MemoryOrders> {
    let store = MemoryEventStore::new();
    let orders = MemoryOrders {
        store: store.clone(),
    };
    shop_on(store, orders).await
}

/// The shop on `store`, set up, keeping its data in `orders`.
async fn shop_on<O: Orders>(store: O::Store, orders: O) -> Shop<O> {
    store.setup().await.expect("setup");
    let mailer = Mailer::default();
    let mut builder = RelayBus::builder(store.clone())
        .clock(TestClock::new(Timestamp::from_millis(1_900_000_000_000)))
        .state(orders.clone())
        .state(mailer.clone());
    for subscription in handlers::subscriptions::<O>() {
        builder = builder.subscribe(subscription);
    }
    let bus = builder.build().expect("valid bus");
    let router = app::router(bus.clone(), orders.clone(), None, PASSWORD).expect("router");
    Shop {
        bus,
        store,
        orders,
        mailer,
        router,
    }
}

impl<O: Orders> Shop<O> {
    /// One request to the router; the answer's status and JSON body (`null` when not JSON).
    async fn request(&self, method: &str, path: &str, body: Option<Value>) -> (StatusCode, Value) {
        self.request_as(method, path, body, None).await
    }

    async fn request_as(
        &self,
        method: &str,
        path: &str,
        body: Option<Value>,
        authorization: Option<&str>,
    ) -> (StatusCode, Value) {
        let mut request = Request::builder().method(method).uri(path);
        if let Some(authorization) = authorization {
            request = request.header(header::AUTHORIZATION, authorization);
        }
        let body = match body {
            Some(body) => {
                request = request.header(header::CONTENT_TYPE, "application/json");
                Body::from(body.to_string())
            }
            None => Body::empty(),
        };
        let response = self
            .router
            .clone()
            .oneshot(request.body(body).expect("request"))
            .await
            .expect("infallible");
        let status = response.status();
        let bytes = response
            .into_body()
            .collect()
            .await
            .expect("body")
            .to_bytes();
        (
            status,
            serde_json::from_slice(&bytes).unwrap_or(Value::Null),
        )
    }

    /// Places an order and returns its id.
    async fn place(&self, customer: &str, total_cents: i64) -> String {
        let (status, answer) = self
            .request(
                "POST",
                "/orders",
                Some(json!({ "customer": customer, "total_cents": total_cents })),
            )
            .await;
        assert_eq!(status, StatusCode::CREATED, "{answer}");
        answer["id"].as_str().expect("an order id").to_owned()
    }

    /// Every pending or dead delivery, as (handler, event type, key).
    async fn deliveries(&self) -> Vec<(String, String, Option<String>)> {
        let mut found: Vec<_> = self
            .store
            .list_deliveries(&DeliveryQuery::new())
            .await
            .expect("listing")
            .into_iter()
            .map(|d| (d.handler, d.event_type, d.key))
            .collect();
        found.sort();
        found
    }
}

#[tokio::test]
async fn post_order_commits_the_order_and_its_event_together() {
    let shop = shop().await;
    let id = shop.place("ada", 1250).await;
    assert_eq!(
        shop.store.document("orders", &id),
        Some(json!({ "id": id, "customer": "ada", "total_cents": 1250 }))
    );
    let ada = Some("ada".to_owned());
    assert_eq!(
        shop.deliveries().await,
        [
            (
                PROJECTOR.to_owned(),
                "order.placed.v1".to_owned(),
                ada.clone()
            ),
            (
                SEND_CONFIRMATION.to_owned(),
                "order.placed.v1".to_owned(),
                ada
            ),
        ],
        "one delivery per handler, keyed by the customer"
    );
}

#[tokio::test]
async fn a_refused_order_leaves_neither_order_nor_event() {
    let shop = shop().await;
    for body in [
        json!({ "customer": "ada", "total_cents": -5 }),
        json!({ "customer": " ", "total_cents": 100 }),
        json!({ "customer": "ada" }),
    ] {
        let (status, answer) = shop.request("POST", "/orders", Some(body.clone())).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
        assert!(answer["error"].is_string(), "says what is wrong: {answer}");
    }
    assert_eq!(shop.store.count("orders"), 0);
    assert_eq!(shop.deliveries().await, []);
    let report = shop.bus.run_until_idle().await.expect("run");
    assert!(report.runs.is_empty(), "nothing to run: {report:?}");
}

#[tokio::test]
async fn get_order_answers_the_order_or_404() {
    let shop = shop().await;
    let id = shop.place("grace", 990).await;
    let (status, answer) = shop.request("GET", &format!("/orders/{id}"), None).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(
        answer,
        json!({ "id": id, "customer": "grace", "total_cents": 990 })
    );
    let (status, _) = shop.request("GET", "/orders/no-such-order", None).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn stats_show_what_the_projector_counted() {
    let shop = shop().await;
    shop.place("ada", 1250).await;
    shop.place("grace", 990).await;
    shop.place("ada", 4200).await;
    let (_, before) = shop.request("GET", "/stats", None).await;
    assert_eq!(before["orders"], 3);
    assert_eq!(before["projected_orders"], 0, "no handler ran yet");

    let report = shop.bus.run_until_idle().await.expect("run");
    assert_eq!(report.succeeded().count(), 6, "{report:?}");
    let (status, after) = shop.request("GET", "/stats", None).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(
        after,
        json!({
            "orders": 3,
            "projected_orders": 3,
            "customers": [
                { "customer": "ada", "orders": 2, "total_cents": 5450 },
                { "customer": "grace", "orders": 1, "total_cents": 990 },
            ],
        })
    );
}

#[tokio::test]
async fn send_confirmation_mails_the_customer_once() {
    let shop = shop().await;
    let id = shop.place("ada", 1250).await;
    let report = shop.bus.run_until_idle().await.expect("run");
    let runs: Vec<_> = report.of_handler(SEND_CONFIRMATION).collect();
    assert_eq!(runs.len(), 1, "{report:?}");
    assert!(runs[0].succeeded());
    let sent = shop.mailer.sent();
    assert_eq!(sent.len(), 1);
    assert_eq!(
        (sent[0].to.as_str(), sent[0].order_id.as_str()),
        ("ada", id.as_str())
    );
    assert!(sent[0].text.contains("$12.50"), "{}", sent[0].text);

    let again = shop.bus.run_until_idle().await.expect("second run");
    assert!(
        again.runs.is_empty(),
        "a completed delivery does not run again"
    );
    assert_eq!(shop.mailer.sent().len(), 1);
}

#[tokio::test]
async fn projector_counts_a_republished_event_once() {
    let shop = shop().await;
    let event = OrderPlaced {
        order_id: "o-1".into(),
        customer: "ada".into(),
        total_cents: 700,
    };
    // The same event id published twice, as a relay that retries would: the second adds nothing.
    for _ in 0..2 {
        shop.bus
            .transaction(async |session| {
                shop.bus
                    .publish(&event)
                    .id("event-o-1")
                    .key("ada")
                    .session(session)
                    .await
            })
            .await
            .expect("publish");
    }
    let report = shop.bus.run_until_idle().await.expect("run");
    assert_eq!(report.of_handler(PROJECTOR).count(), 1, "{report:?}");
    let stats = shop.orders.stats().await.expect("stats");
    assert_eq!(stats.customers.len(), 1);
    assert_eq!(
        (stats.customers[0].orders, stats.customers[0].total_cents),
        (1, 700)
    );
}

#[tokio::test]
async fn the_operator_routes_need_the_password() {
    let shop = shop().await;
    shop.place("ada", 1250).await;
    let (status, _) = shop.request("GET", "/ops/statistics", None).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    let (status, statistics) = shop
        .request_as(
            "GET",
            "/ops/statistics",
            None,
            Some(&basic_credentials(PASSWORD)),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{statistics}");
    assert_eq!(statistics["pending"], 2, "{statistics}");
}

/// The same routes and handlers on PostgreSQL: the request layer commits an order with its
/// event and rolls a refused one back, and the transactional projector commits its totals
/// with its completion.
mod postgres {
    use relaybus::PostgresEventStore;

    use super::*;
    use crate::orders::PostgresOrders;

    #[tokio::test]
    async fn routes_and_handlers_on_postgres() {
        let url = std::env::var("RELAYBUS_TEST_POSTGRES_URL")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned());
        let pool = sqlx::PgPool::connect(&url).await.unwrap_or_else(|error| {
            panic!(
                "no PostgreSQL at {url} ({error}); start one (scripts/postgres start) and set \
                 RELAYBUS_TEST_POSTGRES_URL"
            )
        });
        let events = format!("shop_events_{}", std::process::id());
        let tables = format!("shop_orders_{}", std::process::id());
        let store = PostgresEventStore::builder(pool.clone())
            .schema(events.clone())
            .build()
            .expect("valid schema");
        let orders = PostgresOrders::new(pool.clone(), &tables)
            .await
            .expect("shop tables");
        let shop = shop_on(store, orders).await;

        let ada = shop.place("ada", 1250).await;
        shop.place("grace", 990).await;
        let (status, _) = shop
            .request(
                "POST",
                "/orders",
                Some(json!({ "customer": "ada", "total_cents": 0 })),
            )
            .await;
        assert_eq!(status, StatusCode::BAD_REQUEST);
        let (status, order) = shop.request("GET", &format!("/orders/{ada}"), None).await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(order["total_cents"], 1250);
        assert_eq!(shop.deliveries().await.len(), 4, "two orders, two handlers");

        let report = shop.bus.run_until_idle().await.expect("run");
        assert_eq!(report.succeeded().count(), 4, "{report:?}");
        assert_eq!(shop.mailer.sent().len(), 2);
        let (_, stats) = shop.request("GET", "/stats", None).await;
        assert_eq!(
            stats,
            json!({
                "orders": 2,
                "projected_orders": 2,
                "customers": [
                    { "customer": "ada", "orders": 1, "total_cents": 1250 },
                    { "customer": "grace", "orders": 1, "total_cents": 990 },
                ],
            })
        );
        let stats = shop.orders.stats().await.expect("stats");
        assert_eq!(stats.orders, 2);

        for schema in [events, tables] {
            sqlx::query(&format!("DROP SCHEMA {schema} CASCADE"))
                .execute(&pool)
                .await
                .expect("drop the test's schema");
        }
    }
}
