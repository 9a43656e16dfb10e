//! The shop and the shipping service (`examples/shipping`) together, through a real NATS
//! server: both on the in-memory store, the shop relaying `order.placed.v1` to a stream of the
//! test's own, shipping consuming it into its store. Each side runs its handlers step by step
//! with `run_until_idle`; shipping's consumer fetches until the shipment is there, within a
//! bounded time.
//!
//! The server comes from `RELAYBUS_TEST_NATS_URL` (default `nats://127.0.0.1:4222`) and must
//! run JetStream (`scripts/nats start` starts one).

use std::time::{Duration, Instant};

use axum::{
    body::Body,
    http::{Request, StatusCode},
};
use example_shipping::shipments::{MemoryShipments, Shipment, Shipments};
use http_body_util::BodyExt;
use relaybus::{
    MemoryEventStore, RelayBus, Store,
    transport::nats::async_nats::{self, jetstream},
};
use serde_json::{Value, json};
use tower::ServiceExt;

use crate::{
    app, handlers,
    handlers::{Mailer, OrderPlaced},
    orders::{MemoryOrders, Order, Orders},
    relay,
};

async fn jetstream() -> jetstream::Context {
    let url = std::env::var("RELAYBUS_TEST_NATS_URL")
        .unwrap_or_else(|_| "nats://127.0.0.1:4222".to_owned());
    let connecting = async_nats::ConnectOptions::new()
        .connection_timeout(Duration::from_secs(5))
        .connect(url.as_str());
    match tokio::time::timeout(Duration::from_secs(10), connecting).await {
        Ok(Ok(client)) => jetstream::new(client),
        Ok(Err(error)) => panic!(
            "no NATS server answers at {url} ({error}): start one with JetStream \
             (`scripts/nats start`), or set RELAYBUS_TEST_NATS_URL to the URL of one"
        ),
        Err(_) => panic!("the NATS server at {url} did not answer within 10 s"),
    }
}

async fn post(router: &axum::Router, path: &str, body: Value) -> (StatusCode, Value) {
    let request = Request::post(path)
        .header("content-type", "application/json")
        .body(Body::from(body.to_string()))
        .expect("request");
    let response = router.clone().oneshot(request).await.expect("infallible");
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

#[tokio::test]
async fn an_order_placed_on_the_shop_is_shipped_once_and_a_rolled_back_one_never() {
    let jetstream = jetstream().await;
    let unique = format!("{}_{:08x}", std::process::id(), rand::random::<u32>());
    let stream = format!("SHOP_ORDERS_TEST_{unique}");
    let prefix = format!("shop-test.{unique}.orders");
    // The test's own stream, in memory and expiring, made before the relay finds it.
    jetstream
        .create_stream(jetstream::stream::Config {
            name: stream.clone(),
            subjects: vec![format!("{prefix}.>")],
            storage: jetstream::stream::StorageType::Memory,
            max_age: Duration::from_secs(3_600),
            duplicate_window: Duration::from_secs(120),
            ..Default::default()
        })
        .await
        .expect("the test's stream (is JetStream on?)");

    // The shop, relaying its events to the stream.
    let shop_store = MemoryEventStore::new();
    shop_store.setup().await.expect("setup");
    let orders = MemoryOrders {
        store: shop_store.clone(),
    };
    let relay = relay::nats_relay(jetstream.clone(), &stream, &prefix)
        .await
        .expect("relay");
    let mut builder = RelayBus::builder(shop_store.clone())
        .state(orders.clone())
        .state(Mailer::default());
    for subscription in handlers::subscriptions::<MemoryOrders>() {
        builder = builder.subscribe(subscription);
    }
    let shop = builder
        .subscribe(
            relay
                .subscription::<OrderPlaced, MemoryEventStore>()
                .expect("relay subscription"),
        )
        .build()
        .expect("valid shop bus");
    let router = app::router(shop.clone(), orders.clone(), None, "test-password").expect("router");

    // Shipping, with a store of its own, fed by the stream.
    let shipping_store = MemoryEventStore::new();
    shipping_store.setup().await.expect("setup");
    let shipments = MemoryShipments {
        store: shipping_store.clone(),
    };
    let mut builder = RelayBus::builder(shipping_store).state(shipments.clone());
    for subscription in example_shipping::handlers::subscriptions::<MemoryShipments>() {
        builder = builder.subscribe(subscription);
    }
    let shipping = builder.build().expect("valid shipping bus");
    let consumer = example_shipping::broker::consumer(jetstream.clone(), &stream, "shipping")
        .await
        .expect("consumer");

    // An order whose transaction rolls back after it published its event.
    let rolled_back = Order {
        id: "rolled-back-order".into(),
        customer: "bob".into(),
        total_cents: 990,
    };
    let outcome = shop
        .transaction(async |session| {
            orders.insert(session, &rolled_back).await?;
            shop.publish(&OrderPlaced {
                order_id: rolled_back.id.clone(),
                customer: rolled_back.customer.clone(),
                total_cents: rolled_back.total_cents,
            })
            .key(&rolled_back.customer)
            .session(session)
            .await?;
            Err::<(), _>(relaybus::Error::custom("payment refused"))
        })
        .await;
    assert!(outcome.is_err(), "the transaction rolls back");
    // An order the shop refuses: nothing is written either.
    let (status, _) = post(
        &router,
        "/orders",
        json!({ "customer": "", "total_cents": 5 }),
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    // And one that commits.
    let (status, placed) = post(
        &router,
        "/orders",
        json!({ "customer": "ada", "total_cents": 1250 }),
    )
    .await;
    assert_eq!(status, StatusCode::CREATED, "{placed}");
    let order_id = placed["id"].as_str().expect("an order id").to_owned();

    // The shop's handlers run, its relay among them: the delivery completes on the ack.
    shop.run_until_idle().await.expect("shop handlers");
    assert_eq!(relay.statistics().published, 1, "one event went out");

    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        consumer.run_once(&shipping).await.expect("fetched");
        shipping.run_until_idle().await.expect("shipping handlers");
        if !shipments.list().await.expect("listed").is_empty() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the order did not reach shipping within 30 s"
        );
    }
    // Once more: nothing new arrives, and the shipment stays one.
    shop.run_until_idle().await.expect("shop handlers");
    consumer.run_once(&shipping).await.expect("fetched");
    shipping.run_until_idle().await.expect("shipping handlers");

    assert_eq!(
        shipments.list().await.expect("listed"),
        [Shipment {
            order_id: order_id.clone(),
            customer: "ada".into(),
            total_cents: 1250,
        }],
        "the committed order is shipped once; the rolled-back and refused ones never"
    );
    let info = jetstream
        .get_stream(&stream)
        .await
        .expect("stream")
        .info()
        .await
        .expect("stream info")
        .clone();
    assert_eq!(
        info.state.messages, 1,
        "the stream holds the committed order only"
    );
    assert_eq!(orders.find(&rolled_back.id).await.expect("read"), None);

    jetstream
        .delete_stream(&stream)
        .await
        .expect("stream deleted");
}
