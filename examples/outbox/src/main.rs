//! The transactional outbox in a few lines: orders and their events commit together, an aborted
//! order leaves nothing behind, and a retried publish adds nothing.
//!
//! Run with
//!
//! ```sh
//! scripts/demo
//! ```
//!
//! or, against a replica set of your own,
//!
//! ```sh
//! MONGODB_URI='mongodb://127.0.0.1:27017/?replicaSet=rs0' cargo run -p example-outbox
//! ```

use futures::TryStreamExt;
use mongodb::{
    Client, ClientSession,
    bson::{Document, doc},
};
use relaybus::{
    BoxError, Error, Event, EventEnvelope, HandlerContext, MongoEventStore, RelayBus, Subscription,
};
use serde::{Deserialize, Serialize};

#[derive(Debug, Serialize, Deserialize)]
struct OrderPlaced {
    order_id: String,
    total_cents: u64,
}

impl Event for OrderPlaced {
    const TYPE: &'static str = "order.placed.v1";
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    // relaybus logs through `tracing`: without a subscriber, a failing handler goes unseen.
    tracing_subscriber::fmt()
        .with_max_level(tracing_subscriber::filter::LevelFilter::INFO)
        .init();
    let uri = std::env::var("MONGODB_URI").map_err(
        |_| "MONGODB_URI is not set; run `scripts/demo`, which starts a local replica set for you",
    )?;
    let client = Client::with_uri_str(&uri).await?;
    let database = "relaybus_demo";
    client.database(database).drop().await?;

    let store = MongoEventStore::builder(client.clone())
        .database(database)
        .build()?;
    store.setup().await?;
    let bus = RelayBus::builder(store)
        .subscribe(Subscription::new(
            "send-confirmation",
            |_: OrderPlaced, _: HandlerContext| async { Ok::<(), BoxError>(()) },
        ))
        .subscribe(Subscription::new(
            "projector",
            |_: OrderPlaced, _: HandlerContext| async { Ok::<(), BoxError>(()) },
        ))
        .build()?;
    let orders = client.database(database).collection::<Document>("orders");

    println!("relaybus demo on {uri}, database {database}\n");

    // Two orders, each committed with its event in one transaction.
    for (order_id, total_cents) in [("o-1", 1250), ("o-2", 990)] {
        let appended = bus
            .transaction(async |session: &mut ClientSession| {
                orders
                    .insert_one(doc! { "_id": order_id, "total_cents": total_cents as i64 })
                    .session(&mut *session)
                    .await?;
                bus.publish(&OrderPlaced {
                    order_id: order_id.into(),
                    total_cents,
                })
                .key("customer-42")
                .session(session)
                .await
            })
            .await?;
        println!(
            "committed order {order_id} with event {} (sequence {} of key customer-42)",
            appended.event_id,
            appended.sequence.unwrap_or_default()
        );
    }

    // A failed order: its insert and its event roll back together.
    let failed: Result<(), Error> = bus
        .transaction(async |session: &mut ClientSession| {
            orders
                .insert_one(doc! { "_id": "o-3", "total_cents": 0_i64 })
                .session(&mut *session)
                .await?;
            bus.publish(&OrderPlaced {
                order_id: "o-3".into(),
                total_cents: 0,
            })
            .session(&mut *session)
            .await?;
            Err(Error::custom("payment declined"))
        })
        .await;
    println!(
        "order o-3 failed ({}): nothing of it was committed",
        failed.expect_err("the body fails")
    );

    // The same event published twice, as a retried request would: stored once.
    let envelope = EventEnvelope::new(&OrderPlaced {
        order_id: "o-1".into(),
        total_cents: 1250,
    })?
    .with_id("o-1-placed")?;
    let first = bus.publish_envelope(envelope.clone()).await?;
    let second = bus.publish_envelope(envelope).await?;
    println!(
        "published o-1-placed twice: first created={} with {} deliveries, second created={} with {}",
        first.created,
        first.new_deliveries.len(),
        second.created,
        second.new_deliveries.len()
    );

    println!("\nWhat the database holds:");
    let db = client.database(database);
    let order_ids: Vec<String> = orders
        .find(doc! {})
        .sort(doc! { "_id": 1 })
        .await?
        .map_ok(|o| o.get_str("_id").unwrap_or_default().to_owned())
        .try_collect()
        .await?;
    println!("  orders: {order_ids:?}");
    let events = db.collection::<Document>("relaybus_events");
    let mut cursor = events.find(doc! {}).sort(doc! { "createdAt": 1 }).await?;
    while let Some(event) = cursor.try_next().await? {
        println!(
            "  event {} {} key={} sequence={} handlers={:?}",
            event.get_str("_id")?,
            event.get_str("type")?,
            event.get_str("key").unwrap_or("-"),
            event
                .get_i64("sequence")
                .map(|s| s.to_string())
                .unwrap_or_else(|_| "-".into()),
            event
                .get_array("handlers")?
                .iter()
                .filter_map(|h| h.as_str())
                .collect::<Vec<_>>()
        );
    }
    let deliveries = db.collection::<Document>("relaybus_deliveries");
    let mut cursor = deliveries.find(doc! {}).sort(doc! { "_id": 1 }).await?;
    let mut pending = 0;
    while let Some(delivery) = cursor.try_next().await? {
        pending += 1;
        println!(
            "  delivery of {} to {:<17} lane {:>3} status {}",
            delivery.get_str("eventId")?,
            delivery.get_str("handler")?,
            delivery.get_i32("laneId")?,
            delivery.get_str("status")?
        );
    }
    println!("\n{pending} deliveries wait for a dispatcher. Done.");
    Ok(())
}
