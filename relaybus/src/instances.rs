//! Each store's bus, compiled once, here.
//!
//! Most of the bus is generic over its store, and Rust compiles generic code in the crate that
//! uses it: every test binary, benchmark and service running a MongoDB bus would compile the
//! dispatcher, the claim and the driver's calls again. The functions below are not generic, so
//! this crate compiles what they name; in debug builds, where rustc shares generic code between
//! crates, dependent crates then link to it instead of compiling their own copy. Release builds
//! drop these functions at link time. Not a public API.

use std::{future::Future, pin::Pin};

use crate::{EventEnvelope, RelayBus, store::Store};

/// Futures that are never polled: naming them is what compiles them.
pub type Named = Vec<Pin<Box<dyn Future<Output = ()> + Send>>>;

/// The bus's entry points on one store: start and stop, runs, publishing, operator calls.
fn bus<S: Store>(bus: RelayBus<S>, envelope: EventEnvelope) -> Named {
    let mut named = consumers(&bus);
    named.push(Box::pin(async move {
        let store = bus.store().clone();
        let _ = store.setup().await;
        let _ = store.statistics().await;
        let _ = store.handler_statistics().await;
        let _ = store.lanes().await;
        let _ = RelayBus::builder(store).build();
        let _ = bus.start().await;
        let _ = bus.run_once().await;
        let _ = bus.run_until_idle().await;
        let _ = bus.publish_envelope(envelope.clone()).await;
        let _ = bus.publish_all([envelope]).await;
        let _ = bus.requeue(&[]).await;
        let _ = bus.bury(&[], "").await;
        let _ = bus.sample_gauges().await;
        let _ = bus.purge_expired().await;
        let _ = bus.shutdown().await;
    }));
    named
}

/// The transports' consumers appending to one store: their loops are generic over the store.
#[allow(unused_variables, unused_mut)] // with no transport feature, nothing is named
fn consumers<S: Store>(bus: &RelayBus<S>) -> Named {
    let mut named: Named = Vec::new();
    #[cfg(feature = "nats")]
    named.push(Box::pin({
        use crate::transport::nats::{NatsConsumer, async_nats};
        let bus = bus.clone();
        async move {
            let Ok(client) = async_nats::connect("").await else {
                return;
            };
            let jetstream = async_nats::jetstream::new(client);
            if let Ok(consumer) = NatsConsumer::builder(jetstream, "", "").build().await {
                let _ = consumer.run_once(&bus).await;
                consumer.run(&bus, Default::default()).await;
            }
        }
    }));
    #[cfg(feature = "rabbitmq")]
    named.push(Box::pin({
        use crate::transport::rabbitmq::RabbitConsumer;
        let bus = bus.clone();
        async move {
            if let Ok(consumer) = RabbitConsumer::builder("", "").build().await {
                let _ = consumer.run_once(&bus).await;
                consumer.run(&bus, Default::default()).await;
            }
        }
    }));
    #[cfg(feature = "kafka")]
    named.push(Box::pin({
        use crate::transport::kafka::{KafkaConsumer, rskafka::client::ClientBuilder};
        let bus = bus.clone();
        async move {
            let Ok(client) = ClientBuilder::new(Vec::new()).build().await else {
                return;
            };
            if let Ok(consumer) = KafkaConsumer::builder(client.into(), "", "").build() {
                let _ = consumer.position(&bus, 0).await;
                let _ = consumer.poll(&bus, 0).await;
                let _ = consumer.run_partition(&bus, 0, Default::default()).await;
                consumer.run(&bus, Default::default()).await;
            }
        }
    }));
    named
}

/// The MongoDB store's bus.
#[cfg(feature = "mongodb")]
pub fn mongodb(bus: RelayBus<crate::MongoEventStore>, envelope: EventEnvelope) -> Named {
    self::bus(bus, envelope)
}

/// The PostgreSQL store's bus.
#[cfg(feature = "postgres")]
pub fn postgres(bus: RelayBus<crate::PostgresEventStore>, envelope: EventEnvelope) -> Named {
    self::bus(bus, envelope)
}

/// The memory store's bus.
#[cfg(feature = "memory")]
pub fn memory(bus: RelayBus<crate::MemoryEventStore>, envelope: EventEnvelope) -> Named {
    self::bus(bus, envelope)
}
