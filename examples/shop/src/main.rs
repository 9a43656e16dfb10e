//! A small shop on relaybus and Axum: `POST /orders` stores an order and publishes
//! `OrderPlaced` in the request's transaction; two handlers react to it, one sending a
//! (simulated) confirmation e-mail, one keeping a projection of order totals per customer in a
//! transaction of its own; the dispatcher runs in the same process and everything stops
//! gracefully on Ctrl-C.
//!
//! Run with
//!
//! ```sh
//! scripts/demo
//! ```
//!
//! which starts a local replica set and runs `example-shop --demo`: the shop serves on a free
//! loopback port, places a few orders over HTTP, shows the projection catching up, and shuts
//! down. Against a replica set of your own, as a server on 127.0.0.1:3000:
//!
//! ```sh
//! MONGODB_URI='mongodb://127.0.0.1:27017/?replicaSet=rs0' cargo run -p example-shop
//! curl -i -X POST localhost:3000/orders -H 'content-type: application/json' \
//!      -d '{"customer": "ada", "total_cents": 1250}'
//! curl localhost:3000/stats
//! ```
//!
//! `POST /orders` is idempotent for a client that sends an `Idempotency-Key` header: the same
//! request sent again with the same key (after a timeout, say) gets the first answer, marked
//! `Idempotent-Replayed: true`, and places no second order; the same key with another body is
//! answered 422.
//!
//! `SHOP_DATABASE` names the database (`shop` by default), `SHOP_ADDR` the address.
//!
//! `--store postgres` runs the shop on PostgreSQL instead: events in the schema `relaybus`
//! (`SHOP_EVENTS_SCHEMA`),
//! orders in the schema `shop` (`SHOP_SCHEMA`), of the database at `DATABASE_URL` (with
//! `--demo`, in the schemas `relaybus_shop_demo` and `shop_demo`, dropped first):
//!
//! ```sh
//! DATABASE_URL=postgres://postgres@127.0.0.1:5432/postgres cargo run -p example-shop -- --store postgres
//! ```
//!
//! `--relay nats://127.0.0.1:4222` (or `SHOP_RELAY`) also relays `order.placed.v1` to the NATS
//! JetStream stream `SHOP_ORDERS` (subjects `shop.orders.<partition>`), where the shipping
//! service (`examples/shipping`) takes it; `scripts/services` runs the two together. Without
//! it, nothing leaves the shop.
//!
//! `--store memory` runs it on relaybus's in-memory store, with no database at all (everything
//! is gone when it stops): `cargo run -p example-shop -- --store memory --demo`.
//!
//! The routes and handlers are generic over where the shop keeps its data (`orders::Orders`),
//! and their tests (`cargo test -p example-shop`) run them on the in-memory store, step by
//! step with `RelayBus::run_until_idle`, in milliseconds.

mod app;
mod demo;
mod handlers;
mod orders;
mod relay;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_services;

use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use mongodb::Client;
use relaybus::{
    BoxError, MemoryEventStore, MongoEventStore, PostgresEventStore, RelayBus,
    transport::nats::NatsRelay,
};
use relaybus_axum::DispatcherService;

use crate::{
    app::basic_credentials,
    handlers::{Mailer, OrderPlaced},
    orders::{MemoryOrders, MongoOrders, Orders, PostgresOrders},
};

/// Where the shop keeps events and orders.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum StoreKind {
    Mongodb,
    Postgres,
    Memory,
}

/// The command line: `[--demo] [--store mongodb|postgres|memory] [--relay NATS_URL]`.
struct Options {
    demo: bool,
    store: StoreKind,
    /// The NATS server to relay `order.placed.v1` to, if any.
    relay: Option<String>,
}

fn options() -> Result<Options, BoxError> {
    let mut options = Options {
        demo: false,
        store: StoreKind::Mongodb,
        relay: std::env::var("SHOP_RELAY")
            .ok()
            .filter(|url| !url.is_empty()),
    };
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--demo" => options.demo = true,
            "--store" => {
                options.store = match args.next().as_deref() {
                    Some("mongodb") => StoreKind::Mongodb,
                    Some("postgres") => StoreKind::Postgres,
                    Some("memory") => StoreKind::Memory,
                    other => {
                        return Err(format!(
                            "--store takes `mongodb`, `postgres` or `memory`, not {other:?}"
                        )
                        .into());
                    }
                }
            }
            "--relay" => match args.next() {
                Some(url) if !url.starts_with("--") => options.relay = Some(url),
                _ => {
                    return Err(
                        "--relay takes the URL of a NATS server, such as nats://127.0.0.1:4222"
                            .into(),
                    );
                }
            },
            other => {
                return Err(format!(
                    "unknown argument {other:?}; use [--demo] [--store mongodb|postgres|memory] \
                     [--relay NATS_URL]"
                )
                .into());
            }
        }
    }
    Ok(options)
}

/// The operators' password: `SHOP_OPS_PASSWORD`, or a random one made up at start and printed.
fn ops_password() -> String {
    std::env::var("SHOP_OPS_PASSWORD").unwrap_or_else(|_| {
        use rand::Rng;
        rand::rng()
            .sample_iter(rand::distr::Alphanumeric)
            .take(20)
            .map(char::from)
            .collect()
    })
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    // relaybus logs through `tracing`: without a subscriber, a failing handler goes unseen.
    tracing_subscriber::fmt()
        .with_max_level(tracing_subscriber::filter::LevelFilter::INFO)
        .init();
    let options = options()?;
    // The metrics recorder goes in before the bus is built: the bus registers its metrics then.
    let metrics = PrometheusBuilder::new().install_recorder()?;
    let relay = match &options.relay {
        Some(url) => {
            let relay = relay::connect(url).await?;
            println!(
                "relaying order.placed.v1 to {url}, stream {}, subjects {}",
                relay::STREAM,
                relay.subjects()
            );
            Some(relay)
        }
        None => None,
    };

    if options.store == StoreKind::Postgres {
        let url = std::env::var("DATABASE_URL").map_err(|_| {
            "DATABASE_URL is not set; set it to a PostgreSQL database, such as \
             postgres://postgres@127.0.0.1:5432/postgres"
        })?;
        let pool = sqlx::PgPool::connect(&url).await?;
        // The demo starts afresh in schemas of its own, as the MongoDB demo drops a database
        // of its own.
        let (events, schema) = if options.demo {
            ("relaybus_shop_demo".to_owned(), "shop_demo".to_owned())
        } else {
            let schema = std::env::var("SHOP_SCHEMA").unwrap_or_else(|_| "shop".to_owned());
            let events =
                std::env::var("SHOP_EVENTS_SCHEMA").unwrap_or_else(|_| "relaybus".to_owned());
            (events, schema)
        };
        if options.demo {
            // One statement, with the server's notices about schemas that are not there off.
            sqlx::raw_sql(&format!(
                "SET client_min_messages = warning; DROP SCHEMA IF EXISTS {events}, {schema} CASCADE; \
                 RESET client_min_messages"
            ))
            .execute(&pool)
            .await
            .map_err(relaybus::Error::from)?;
        }
        let store = PostgresEventStore::builder(pool.clone())
            .schema(events.clone())
            .build()?;
        let orders = PostgresOrders::new(pool, &schema).await?;
        println!(
            "relaybus shop on PostgreSQL, events in schema {events}, orders in schema {schema}"
        );
        return serve(store, orders, metrics, relay, options.demo).await;
    }
    if options.store == StoreKind::Memory {
        let store = MemoryEventStore::new();
        let orders = MemoryOrders {
            store: store.clone(),
        };
        println!("relaybus shop on the in-memory store: nothing is kept after it stops");
        return serve(store, orders, metrics, relay, options.demo).await;
    }

    let uri = std::env::var("MONGODB_URI").map_err(|_| {
        "MONGODB_URI is not set; run `scripts/demo`, which starts a local replica set for you, \
         or add `--store memory`"
    })?;
    let client = Client::with_uri_str(&uri).await?;
    let database = match std::env::var("SHOP_DATABASE") {
        Ok(name) => name,
        Err(_) if options.demo => "relaybus_shop_demo".to_owned(),
        Err(_) => "shop".to_owned(),
    };
    if options.demo {
        client.database(&database).drop().await?;
    }
    let store = MongoEventStore::builder(client.clone())
        .database(&database)
        .build()?;
    let orders = MongoOrders {
        db: client.database(&database),
    };
    println!("relaybus shop on {uri}, database {database}");
    serve(store, orders, metrics, relay, options.demo).await
}

/// Builds the bus with the shop's handlers on `store`, and serves until Ctrl-C (or, with
/// `demo`, until the demo is done).
async fn serve<O: Orders>(
    store: O::Store,
    orders: O,
    metrics: PrometheusHandle,
    relay: Option<NatsRelay>,
    demo: bool,
) -> Result<(), BoxError> {
    // send-confirmation takes the mailer from the bus's state, projector the orders.
    let mut builder = RelayBus::builder(store)
        .state(orders.clone())
        .state(Mailer::default());
    for subscription in handlers::subscriptions::<O>() {
        builder = builder.subscribe(subscription);
    }
    if let Some(relay) = &relay {
        // The relay is one more subscription: a delivery completes on JetStream's ack.
        builder = builder.subscribe(relay.subscription::<OrderPlaced, O::Store>()?);
    }
    let bus = builder.build()?;
    let password = ops_password();
    let app = app::router(bus.clone(), orders, Some(metrics), &password)?;

    let address = match std::env::var("SHOP_ADDR") {
        Ok(address) => address,
        Err(_) if demo => "127.0.0.1:0".to_owned(),
        Err(_) => "127.0.0.1:3000".to_owned(),
    };
    let listener = tokio::net::TcpListener::bind(&address).await?;
    let address = listener.local_addr()?;
    let service = DispatcherService::new(bus);
    if !demo {
        println!("shop on http://{address}; Ctrl-C stops it gracefully");
        println!("operator page on http://{address}/ops (user ops, password {password})");
        service.serve(listener, app).await?;
        println!("stopped");
        return Ok(());
    }

    println!("shop serving on http://{address}, dispatcher running beside it");
    println!("operator page on http://{address}/ops (user ops, password {password})\n");
    let shutdown = service.shutdown_token();
    let server = tokio::spawn(service.serve(listener, app));
    let outcome = demo::run_demo(address, &basic_credentials(&password)).await;
    println!(
        "\nshutting down, as on Ctrl-C: draining requests, releasing deliveries, handing lanes back"
    );
    shutdown.cancel();
    server.await??;
    outcome?;
    println!("stopped cleanly. Done.");
    Ok(())
}
