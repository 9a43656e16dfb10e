//! Transports: relays that forward events to a message broker, and consumers that take a
//! broker's events into the local store, exactly as they were published.
//!
//! An outbox exists to tell other services, reliably. A transport has two halves:
//!
//! - **The relay** is a [`Subscription`](crate::Subscription) of the publishing bus, so each
//!   event of the chosen types gets a delivery of its own, with the bus's retries, backoff,
//!   dead letters and requeue. The delivery completes only once the broker confirmed the
//!   message, so an event committed in the outbox reaches the broker at least once.
//! - **The consumer** takes the broker's messages and appends their events to the local
//!   store under their original ids, in one transaction per batch, and acknowledges them to
//!   the broker only after the commit. Appending an event id the store holds adds nothing, so
//!   a redelivered message, or an event the relay sent twice, has one local effect. Local
//!   handlers then run through the normal dispatcher.
//!
//! Brokers so far:
//!
//! - `nats`: NATS JetStream, with [async-nats](https://docs.rs/async-nats) (feature `nats`).
//! - `rabbitmq`: RabbitMQ, with [lapin](https://docs.rs/lapin) (feature `rabbitmq`).
//! - `kafka`: Kafka, with [rskafka](https://docs.rs/rskafka) (feature `kafka`); the consumer
//!   keeps its offsets in the local store, written in the transaction of each batch.
//!
//! Every transport writes the same message body, a JSON envelope with the event's id, type,
//! key, sequence, correlation and causation ids, headers, creation time and payload (see
//! *The message* in each transport's documentation), so a consumer of one broker reads what a
//! relay of another wrote, once bridged.
//!
//! # One shape for every broker
//!
//! What relays and consumers have in common is written once, here, and each transport adds
//! only its broker's side:
//!
//! - [`Relay`] is every relay (`NatsRelay`, `RabbitRelay` and `KafkaRelay` name it for their
//!   broker): its [`subscription`](Relay::subscription)s, its [`RelayStatistics`], its handler
//!   id prefix and partitions, set on its [`RelayBuilder`].
//! - [`Consumer`] is the NATS and RabbitMQ consumers (`NatsConsumer`, `RabbitConsumer`):
//!   [`fetch`](Consumer::fetch) an [`InboundBatch`], [`append`](InboundBatch::append) it to
//!   get an [`AppendedBatch`], [`ack`](AppendedBatch::ack) it; or
//!   [`run_once`](Consumer::run_once) and [`run`](Consumer::run), which chain the three.
//!   Its batch size and fetch wait are set on its [`ConsumerBuilder`].
//! - Every consumer, Kafka's included, runs its batches through the same steps: messages that
//!   are not relaybus events are dead-lettered first; the events are appended in one
//!   transaction of the local store (Kafka's consumer writes the partition's next offset in
//!   that transaction); then the batch is settled with the broker. Each reports what it did
//!   in a [`BatchReport`], in the same terms for every broker.

mod forward;
mod inbound;
#[cfg(feature = "kafka")]
#[cfg_attr(docsrs, doc(cfg(feature = "kafka")))]
pub mod kafka;
#[cfg(feature = "nats")]
#[cfg_attr(docsrs, doc(cfg(feature = "nats")))]
pub mod nats;
#[cfg(feature = "rabbitmq")]
#[cfg_attr(docsrs, doc(cfg(feature = "rabbitmq")))]
pub mod rabbitmq;
mod relay;
mod settings;
mod wire;

pub use inbound::{AppendedBatch, BatchReport, Consumer, ConsumerBuilder, InboundBatch};
pub use relay::{Relay, RelayBuilder, RelayStatistics};
pub use settings::{MAX_BATCH_SIZE, MAX_PARTITIONS};
