//! The shipping service: takes the shop's `order.placed.v1` from NATS JetStream into its own
//! database, makes one shipment per order, and lists them at `GET /shipments`. See the
//! library's documentation for how to run it (`scripts/services` runs it with the shop).
//!
//! ```sh
//! DATABASE_URL=postgres://postgres@127.0.0.1:5432/postgres cargo run -p example-shipping
//! cargo run -p example-shipping -- --store memory
//! ```

use example_shipping::{
    app, broker, handlers,
    shipments::{MemoryShipments, PostgresShipments, Shipments},
};
use relaybus::{
    BoxError, MemoryEventStore, PostgresEventStore, RelayBus, Store, transport::nats::async_nats,
};
use relaybus_axum::DispatcherService;

/// Where shipping keeps its events and shipments.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum StoreKind {
    Postgres,
    Memory,
}

fn store_kind() -> Result<StoreKind, BoxError> {
    let mut store = StoreKind::Postgres;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--store" => {
                store = match args.next().as_deref() {
                    Some("postgres") => StoreKind::Postgres,
                    Some("memory") => StoreKind::Memory,
                    other => {
                        return Err(
                            format!("--store takes `postgres` or `memory`, not {other:?}").into(),
                        );
                    }
                }
            }
            other => {
                return Err(
                    format!("unknown argument {other:?}; use [--store postgres|memory]").into(),
                );
            }
        }
    }
    Ok(store)
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    tracing_subscriber::fmt()
        .with_max_level(tracing_subscriber::filter::LevelFilter::INFO)
        .init();
    let store = store_kind()?;
    let nats_url = std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".to_owned());
    let client = async_nats::connect(&nats_url).await.map_err(|error| {
        format!(
            "no NATS server answers at {nats_url} ({error}); start one with JetStream \
             (`scripts/nats start`) and set NATS_URL to the URL it prints"
        )
    })?;
    let jetstream = async_nats::jetstream::new(client);
    broker::ensure_stream(&jetstream, broker::STREAM, broker::PREFIX)
        .await
        .map_err(|error| {
            format!(
                "could not make the stream {} at {nats_url} ({error}): is JetStream on?",
                broker::STREAM
            )
        })?;

    match store {
        StoreKind::Postgres => {
            let url = std::env::var("DATABASE_URL").map_err(|_| {
                "DATABASE_URL is not set; set it to a PostgreSQL database, such as \
                 postgres://postgres@127.0.0.1:5432/postgres, or add `--store memory`"
            })?;
            let pool = sqlx::PgPool::connect(&url).await?;
            let events = std::env::var("SHIPPING_EVENTS_SCHEMA")
                .unwrap_or_else(|_| "relaybus_shipping".to_owned());
            let schema = std::env::var("SHIPPING_SCHEMA").unwrap_or_else(|_| "shipping".to_owned());
            let store = PostgresEventStore::builder(pool.clone())
                .schema(events.clone())
                .build()?;
            let shipments = PostgresShipments::new(pool, &schema).await?;
            println!(
                "relaybus shipping on PostgreSQL, events in schema {events}, shipments in schema {schema}"
            );
            serve(store, shipments, jetstream).await
        }
        StoreKind::Memory => {
            let store = MemoryEventStore::new();
            let shipments = MemoryShipments {
                store: store.clone(),
            };
            println!("relaybus shipping on the in-memory store: nothing is kept after it stops");
            serve(store, shipments, jetstream).await
        }
    }
}

/// Consumes the shop's stream into `store` and serves `GET /shipments`, until SIGINT or
/// SIGTERM; then stops fetching, commits and acknowledges the batch in hand, and shuts the
/// dispatcher down.
async fn serve<H: Shipments>(
    store: H::Store,
    shipments: H,
    jetstream: async_nats::jetstream::Context,
) -> Result<(), BoxError> {
    // The consumer appends before the dispatcher starts: the store must be ready for it.
    store.setup().await?;
    let mut builder = RelayBus::builder(store).state(shipments.clone());
    for subscription in handlers::subscriptions::<H>() {
        builder = builder.subscribe(subscription);
    }
    let bus = builder.build()?;
    let consumer = broker::consumer(jetstream, broker::STREAM, broker::DURABLE).await?;

    let address = std::env::var("SHIPPING_ADDR").unwrap_or_else(|_| "127.0.0.1:3001".to_owned());
    let listener = tokio::net::TcpListener::bind(&address).await?;
    let address = listener.local_addr()?;
    let service = DispatcherService::new(bus.clone());
    let shutdown = service.shutdown_token();
    let consuming = tokio::spawn({
        let bus = bus.clone();
        let shutdown = shutdown.child_token();
        async move { consumer.run(&bus, shutdown).await }
    });
    println!(
        "shipping on http://{address}, consuming stream {} as {}; Ctrl-C stops it gracefully",
        broker::STREAM,
        broker::DURABLE
    );
    let served = service.serve(listener, app::router(shipments)).await;
    // The server stopped (a signal, or a failure): the consumer stops too.
    shutdown.cancel();
    let report = consuming.await?;
    served?;
    println!(
        "stopped: {} events taken from the stream, {} of them already held",
        report.appended + report.duplicates,
        report.duplicates
    );
    Ok(())
}
