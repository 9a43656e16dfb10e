//! The RabbitMQ transport (feature `rabbitmq`): [`RabbitRelay`] publishes events to an
//! exchange with publisher confirms, [`RabbitConsumer`] appends a queue's events to the local
//! store.
//!
//! Built on [lapin](https://docs.rs/lapin), the maintained AMQP 0-9-1 client for Tokio,
//! re-exported here as [`lapin`] so that the versions match.
//!
//! # Example
//!
//! Service A relays `order.placed.v1` to the exchange `orders`, over four queues; service B
//! appends what one queue holds to its own store, where its handlers run (run one consumer
//! per queue to take all four).
//!
//! ```no_run
//! use relaybus::transport::rabbitmq::{RabbitConsumer, RabbitRelay};
//! use relaybus::{BoxError, Event, RelayBus, Store, Subscription};
//! use serde::{Deserialize, Serialize};
//! use tokio_util::sync::CancellationToken;
//!
//! #[derive(Debug, Serialize, Deserialize)]
//! struct OrderPlaced {
//!     order_id: String,
//! }
//!
//! impl Event for OrderPlaced {
//!     const TYPE: &'static str = "order.placed.v1";
//! }
//!
//! async fn run<S: Store>(shop_store: S, shipping_store: S) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
//! let uri = "amqp://guest:guest@127.0.0.1:5672/%2f";
//!
//! // Service A: the relay is one more subscription of its bus.
//! let relay = RabbitRelay::builder(uri, "orders").partitions(4).build()?;
//! relay.declare_topology().await?;
//! let shop = RelayBus::builder(shop_store)
//!     .subscribe(relay.subscription::<OrderPlaced, S>()?)
//!     .build()?;
//! shop.start().await?;
//! shop.publish(&OrderPlaced { order_id: "o-1".into() }).key("o-1").await?;
//!
//! // Service B: its own store, its own handlers, fed by the queue `orders.0`.
//! let shipping = RelayBus::builder(shipping_store)
//!     .subscribe(Subscription::without_context("ship", |event: OrderPlaced| async move {
//!         println!("shipping {}", event.order_id);
//!         Ok::<(), BoxError>(())
//!     }))
//!     .build()?;
//! shipping.start().await?;
//! let consumer = RabbitConsumer::builder(uri, "orders.0")
//!     .dead_letter_exchange("orders.dead", "orders.0")
//!     .build()
//!     .await?;
//! let shutdown = CancellationToken::new();
//! consumer.run(&shipping, shutdown.child_token()).await;
//! Ok(())
//! }
//! ```
//!
//! # The message
//!
//! One AMQP message per event. **The body is the JSON envelope every relaybus transport
//! writes**, the only part the consumer reads:
//!
//! ```json
//! {
//!   "relaybus": 1,
//!   "id": "0193a6c1-…",
//!   "type": "order.placed.v1",
//!   "key": "o-1",
//!   "sequence": 3,
//!   "correlation_id": "req-42",
//!   "causation_id": "cmd-7",
//!   "headers": { "tenant": "acme", "traceparent": "00-…" },
//!   "created_at": "2026-12-01T08:53:53.123Z",
//!   "payload": { "order_id": "o-1" }
//! }
//! ```
//!
//! `relaybus` is the format version ([`FORMAT_VERSION`]); `key`, `sequence`, the two ids and
//! `headers` are left out when absent. The payload is forwarded as stored, and the event's
//! headers travel in the body, so the envelope reads back exactly what was published, trace
//! context included. `sequence` is the event's sequence within its key in the publishing
//! store, for information: the consuming store numbers the key's events itself, in the order
//! the queue holds them.
//!
//! The message properties are for the broker and for tools: `delivery_mode` 2 (persistent),
//! `message_id` the event id (when it fits AMQP's 255 bytes), `type` the event type,
//! `content_type` `application/json`, `app_id` `relaybus`, and the headers
//! [`EVENT_ID_HEADER`] and [`EVENT_TYPE_HEADER`].
//!
//! # Routing and order
//!
//! The relay publishes to one durable **direct** exchange. An event's routing key is
//! `<prefix>.<partition>` (the prefix is the exchange's name unless
//! [set](RabbitRelayBuilder::routing_prefix)): the partition is the 32-bit FNV-1a hash of its
//! ordering key (of its id when it has none) modulo the relay's
//! [`partitions`](RabbitRelayBuilder::partitions), 1 by default, the same partition the NATS
//! transport picks. [`RabbitRelay::declare_topology`] declares the exchange and one durable
//! queue per routing key, named after it and bound with it. One key always takes one routing
//! key, so one queue; give each queue **one consumer** (RabbitMQ hands a queue's messages to
//! its consumers in turn, so two consumers of one queue would split a key between them).
//!
//! Order holds end to end, per key and per event type:
//!
//! - The publishing bus runs one delivery of a key at a time for each relay subscription, in
//!   the key's order, and the next starts only after the broker confirmed the previous one;
//!   a failing delivery holds its key's later events back until it succeeds or is buried.
//! - A queue keeps messages in the order it took them.
//! - The consumer takes the queue in order, with a prefetch of its batch size, and appends
//!   each batch in one transaction, in queue order.
//! - **Giving messages back.** RabbitMQ puts a message given back with a requeue (a `nack`,
//!   a closed channel or connection) back at its place in the queue, ahead of later messages,
//!   when the queue has one consumer. The messages the broker had already sent ahead of the
//!   failed batch are not given back by the `nack`: so after a failed append the consumer
//!   also closes its channel, which gives them back too, and the queue is taken again from
//!   the first message given back. With more than one consumer on a queue, or a requeue that
//!   races with new publishes to a quorum queue's tail, that place is not guaranteed:
//!   another reason for one consumer per queue.
//!
//! Each event type has its own relay subscription (a handler id names one subscription), so
//! two events of one key **with different types** may cross when the first one's delivery is
//! retried: keep the events whose relative order matters in one type, or give them an order
//! field the consumer's handlers check.
//!
//! # Guarantees
//!
//! - **At least once to the broker.** A relay delivery completes only after the broker's
//!   publisher confirm ([`RabbitRelay::send`]); the message is persistent and mandatory, so a
//!   confirm means a durable queue holds it. A negative confirm, an unroutable message (no
//!   queue bound for the routing key), a lost connection or a confirm that does not come
//!   within the [`confirm_timeout`](RabbitRelayBuilder::confirm_timeout) fails the attempt,
//!   which the bus retries. RabbitMQ does not deduplicate: a relay that crashes after the
//!   confirm and before the completion, or whose confirm was lost, sends the event again, and
//!   the queue holds two copies.
//! - **Once in the consuming store.** The consumer acknowledges a message only after the
//!   transaction that appended its event committed; a message redelivered (the consumer
//!   crashed before its ack, the ack was lost, or the relay sent the event twice) appends
//!   nothing new, since the store holds its event id. Events live in the consuming store as
//!   deduplication records for its retention of completed events
//!   ([`Retention`](crate::Retention)): keep it longer than a redelivery can take.
//! - **Unreadable messages never block.** A message that is not a relaybus event, or whose
//!   event is invalid, is published to the consumer's
//!   [dead-letter exchange](RabbitConsumerBuilder::dead_letter_exchange) with a
//!   [`DEAD_LETTER_REASON_HEADER`] and then acknowledged; when there is no such exchange or
//!   that publish fails, it is rejected without requeue (the queue's own
//!   `x-dead-letter-exchange`, if any, takes it) and the reason is logged at error level.
//!   The messages behind it are appended as usual.
//! - **A failed append is redelivered in order.** When the store cannot append (it is
//!   unreachable), the message and every later one of its batch are given back with a
//!   requeue, the consumer reopens its channel (see *Giving messages back* above), and
//!   [`run`](RabbitConsumer::run) waits for its
//!   [retry delay](RabbitConsumerBuilder::retry_delay) before taking them again.
//! - **A lost connection loses nothing.** The relay and the consumer each own their
//!   connection and open a new one when it is lost: the relay at its next publish (the
//!   delivery whose publish failed is retried by the bus, with its backoff), the consumer at
//!   its next fetch ([`run`](RabbitConsumer::run) logs the failure and goes on after the
//!   fetch wait). The broker puts back every message the lost consumer had not acknowledged,
//!   and the consuming store appends each event once. A caller driving
//!   [`fetch`](RabbitConsumer::fetch) itself gets [`RabbitError::Fetch`] or
//!   [`RabbitError::Ack`] and only has to call it again.
//! - **Graceful shutdown.** The relay's deliveries stop with the bus
//!   ([`RelayBus::shutdown`](crate::RelayBus::shutdown)): a publish still waiting for its
//!   confirm when the shutdown timeout ends is released without charging an attempt, and
//!   sent again later (the consumer's store keeps one copy). The consumer's
//!   [`run`](RabbitConsumer::run) stops taking batches when its token is cancelled, finishes
//!   its batch (append, commit, acknowledge), closes its connection and returns.

mod builder;
mod connection;
mod consumer;
mod error;
mod fetch;
mod inbound;
mod relay;
mod wire;

pub use builder::RabbitConsumerBuilder;
pub use consumer::RabbitConsumer;
use consumer::RabbitSource;
pub use error::RabbitError;
pub use lapin;
pub use relay::{DEFAULT_RELAY_HANDLER_ID, RabbitRelay, RabbitRelayBuilder};
pub use wire::{
    DEAD_LETTER_QUEUE_HEADER, DEAD_LETTER_REASON_HEADER, DEAD_LETTER_ROUTING_KEY_HEADER,
    EVENT_ID_HEADER, EVENT_TYPE_HEADER, FORMAT_VERSION,
};

/// A batch [`RabbitConsumer::fetch`] took, not yet appended. It holds the consumer's channel:
/// the next fetch waits until it is settled or dropped. Dropping it gives the messages back:
/// the consumer closes its channel before its next fetch, and the broker puts them back in the
/// queue.
pub type InboundBatch = crate::transport::InboundBatch<RabbitSource>;

/// A batch appended to the local store, not yet acknowledged to the broker. Dropping it gives
/// the messages back: the consumer closes its channel before its next fetch, the broker puts
/// them back in the queue, and appending them again adds nothing.
pub type AppendedBatch = crate::transport::AppendedBatch<RabbitSource>;
