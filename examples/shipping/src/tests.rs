//! Shipping's handler and route on the in-memory store, without a broker: events published on
//! shipping's bus stand for those its consumer appends. The shop's tests run both services
//! through a real NATS server.

use axum::{body::Body, http::Request};
use relaybus::{MemoryEventStore, RelayBus, Store};
use serde_json::{Value, json};

use crate::{
    app, handlers,
    handlers::OrderPlaced,
    shipments::{MemoryShipments, Shipments},
};

async fn shipments_over_http(shipments: &MemoryShipments) -> Value {
    use tower::ServiceExt;
    let response = app::router(shipments.clone())
        .oneshot(
            Request::get("/shipments")
                .body(Body::empty())
                .expect("request"),
        )
        .await
        .expect("infallible");
    assert!(response.status().is_success(), "{}", response.status());
    let bytes = axum::body::to_bytes(response.into_body(), usize::MAX)
        .await
        .expect("body");
    serde_json::from_slice(&bytes).expect("JSON")
}

#[tokio::test]
async fn an_order_placed_makes_one_shipment_listed_over_http() {
    let store = MemoryEventStore::new();
    store.setup().await.expect("setup");
    let shipments = MemoryShipments {
        store: store.clone(),
    };
    let mut builder = RelayBus::builder(store.clone()).state(shipments.clone());
    for subscription in handlers::subscriptions::<MemoryShipments>() {
        builder = builder.subscribe(subscription);
    }
    let bus = builder.build().expect("valid bus");
    assert_eq!(
        shipments_over_http(&shipments).await,
        json!({ "shipments": [] })
    );

    bus.publish(&OrderPlaced {
        order_id: "o-1".into(),
        customer: "ada".into(),
        total_cents: 1250,
    })
    .key("ada")
    .await
    .expect("published");
    bus.run_until_idle().await.expect("handled");
    // Nothing is left to do, so a second run makes nothing more.
    bus.run_until_idle().await.expect("idle");

    assert_eq!(
        shipments.list().await.expect("listed").len(),
        1,
        "one shipment per order"
    );
    assert_eq!(
        shipments_over_http(&shipments).await,
        json!({ "shipments": [{ "order_id": "o-1", "customer": "ada", "total_cents": 1250 }] })
    );
}
