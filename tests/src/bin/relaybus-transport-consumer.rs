//! A consuming service's process for the tests that kill one: it appends a broker's events to
//! a PostgreSQL store with the transport's consumer, at its default settings, until it is
//! killed.
//!
//! ```text
//! relaybus-transport-consumer POSTGRES_URL SCHEMA nats NATS_URL STREAM DURABLE
//! relaybus-transport-consumer POSTGRES_URL SCHEMA rabbitmq AMQP_URI QUEUE
//! relaybus-transport-consumer POSTGRES_URL SCHEMA kafka BROKER TOPIC NAME PARTITIONS
//! ```
//!
//! The store's schema must be set up already. The bus has no handlers: the test reads the
//! appended events from the schema's tables.

use std::{process::ExitCode, sync::Arc};

use relaybus::{
    BoxError, PostgresEventStore, RelayBus,
    transport::{kafka::KafkaConsumer, nats::NatsConsumer, rabbitmq::RabbitConsumer},
};
use tokio_util::sync::CancellationToken;

const USAGE: &str = "usage: relaybus-transport-consumer POSTGRES_URL SCHEMA \
                     (nats NATS_URL STREAM DURABLE | rabbitmq AMQP_URI QUEUE | \
                     kafka BROKER TOPIC NAME PARTITIONS)";

#[tokio::main]
async fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [url, schema, broker @ ..] = args.as_slice() else {
        eprintln!("{USAGE}");
        return ExitCode::from(2);
    };
    match consume(url, schema, broker).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("relaybus-transport-consumer: {error}");
            ExitCode::FAILURE
        }
    }
}

async fn consume(url: &str, schema: &str, broker: &[String]) -> Result<(), BoxError> {
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(8)
        .connect(url)
        .await?;
    let store = PostgresEventStore::builder(pool).schema(schema).build()?;
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
        [kind, broker, topic, name, partitions] if kind == "kafka" => {
            let client = relaybus::transport::kafka::rskafka::client::ClientBuilder::new(vec![
                broker.clone(),
            ])
            .build()
            .await?;
            let consumer = KafkaConsumer::builder(Arc::new(client), topic, name)
                .partitions(partitions.parse()?)
                .build()?;
            consumer.run(&bus, forever).await;
        }
        _ => return Err(USAGE.into()),
    }
    Ok(())
}
