//! A consuming service's process for the tests that kill one: it appends a broker's events to
//! a PostgreSQL or MongoDB store with the transport's consumer, at its default settings (but
//! the Kafka consumer's lease), until it is killed.
//!
//! ```text
//! relaybus-transport-consumer STORE_URL NAMESPACE nats NATS_URL STREAM DURABLE
//! relaybus-transport-consumer STORE_URL NAMESPACE rabbitmq AMQP_URI QUEUE
//! relaybus-transport-consumer STORE_URL NAMESPACE kafka BROKER TOPIC NAME LEASE_MS
//! ```
//!
//! `STORE_URL` is a PostgreSQL URL, whose schema `NAMESPACE` is used, or a MongoDB URI
//! (`mongodb://…`), whose database `NAMESPACE` is used. The store must be set up already. The
//! bus has no handlers: the test reads the appended events from the store. The Kafka consumer
//! prints the partitions it reads whenever they change, a line `assigned 0,2` each.

use std::{process::ExitCode, sync::Arc, time::Duration};

use relaybus::{
    BoxError, MongoEventStore, PostgresEventStore, RelayBus, Store,
    transport::{kafka::KafkaConsumer, nats::NatsConsumer, rabbitmq::RabbitConsumer},
};
use tokio_util::sync::CancellationToken;

const USAGE: &str = "usage: relaybus-transport-consumer STORE_URL NAMESPACE \
                     (nats NATS_URL STREAM DURABLE | rabbitmq AMQP_URI QUEUE | \
                     kafka BROKER TOPIC NAME LEASE_MS)";

#[tokio::main]
async fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [url, namespace, broker @ ..] = args.as_slice() else {
        eprintln!("{USAGE}");
        return ExitCode::from(2);
    };
    let consumed = if url.starts_with("mongodb://") || url.starts_with("mongodb+srv://") {
        mongodb(url, namespace, broker).await
    } else {
        postgres(url, namespace, broker).await
    };
    match consumed {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("relaybus-transport-consumer: {error}");
            ExitCode::FAILURE
        }
    }
}

async fn postgres(url: &str, schema: &str, broker: &[String]) -> Result<(), BoxError> {
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(8)
        .connect(url)
        .await?;
    let store = PostgresEventStore::builder(pool).schema(schema).build()?;
    consume(store, broker).await
}

async fn mongodb(uri: &str, database: &str, broker: &[String]) -> Result<(), BoxError> {
    let client = mongodb::Client::with_uri_str(uri).await?;
    let store = MongoEventStore::builder(client)
        .database(database)
        .build()?;
    consume(store, broker).await
}

async fn consume<S: Store>(store: S, broker: &[String]) -> Result<(), BoxError> {
    let bus = RelayBus::builder(store)
        .without_registered_handlers()
        .build()?;
    let forever = CancellationToken::new();
    match broker {
        [kind, url, stream, durable] if kind == "nats" => {
            let client = relaybus::transport::nats::async_nats::connect(url.as_str()).await?;
            let jetstream = relaybus::transport::nats::async_nats::jetstream::new(client);
            let consumer = NatsConsumer::builder(jetstream, stream, durable)
                .build()
                .await?;
            consumer.run(&bus, forever).await;
        }
        [kind, uri, queue] if kind == "rabbitmq" => {
            let consumer = RabbitConsumer::builder(uri, queue).build().await?;
            consumer.run(&bus, forever).await;
        }
        [kind, broker, topic, name, lease_ms] if kind == "kafka" => {
            let client = relaybus::transport::kafka::rskafka::client::ClientBuilder::new(vec![
                broker.clone(),
            ])
            .build()
            .await?;
            let consumer = KafkaConsumer::builder(Arc::new(client), topic, name)
                .lease(Duration::from_millis(lease_ms.parse()?))
                .build()?;
            let mut assignment = consumer.assignment();
            tokio::spawn(async move {
                loop {
                    let reading = assignment.borrow_and_update().clone();
                    let listed: Vec<String> = reading.iter().map(u32::to_string).collect();
                    println!("assigned {}", listed.join(","));
                    if assignment.changed().await.is_err() {
                        break;
                    }
                }
            });
            consumer.run(&bus, forever).await;
        }
        _ => return Err(USAGE.into()),
    }
    Ok(())
}
