//! The NATS JetStream transport (feature `nats`): [`NatsRelay`] forwards events to a stream,
//! [`NatsConsumer`] appends a stream's events to the local store.
//!
//! Built on [async-nats](https://docs.rs/async-nats), the NATS maintainers' Tokio client,
//! re-exported here as [`async_nats`] so that the versions match.
//!
//! # Example
//!
//! Service A relays `order.placed.v1` to the stream `ORDERS`; service B appends what the
//! stream holds to its own store, where its handlers run.
//!
//! ```no_run
//! use relaybus::transport::nats::{NatsConsumer, NatsRelay, async_nats};
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
//! let client = async_nats::connect("nats://127.0.0.1:4222").await?;
//! let jetstream = async_nats::jetstream::new(client);
//!
//! // Service A: the relay is one more subscription of its bus.
//! let relay = NatsRelay::builder(jetstream.clone(), "orders.events")
//!     .partitions(16)
//!     .build()?;
//! jetstream.get_or_create_stream(relay.stream_config("ORDERS")).await?;
//! let shop = RelayBus::builder(shop_store)
//!     .subscribe(relay.subscription::<OrderPlaced, S>()?)
//!     .build()?;
//! shop.start().await?;
//! shop.publish(&OrderPlaced { order_id: "o-1".into() }).key("o-1").await?;
//!
//! // Service B: its own store, its own handlers, fed by the stream.
//! let shipping = RelayBus::builder(shipping_store)
//!     .subscribe(Subscription::without_context("ship", |event: OrderPlaced| async move {
//!         println!("shipping {}", event.order_id);
//!         Ok::<(), BoxError>(())
//!     }))
//!     .build()?;
//! shipping.start().await?;
//! let consumer = NatsConsumer::builder(jetstream, "ORDERS", "shipping")
//!     .dead_letter_subject("orders.dead")
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
//! One NATS message per event. **The body is a JSON envelope**, the only part the consumer
//! reads:
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
//! headers travel in the body rather than as NATS headers, because relaybus headers may hold
//! names and values NATS headers cannot (`:`, spaces, line breaks): the envelope reads back
//! exactly what was published, trace context included. `sequence` is the event's sequence
//! within its key in the publishing store, for information: the consuming store numbers the
//! key's events itself, in the order the stream holds them.
//!
//! The NATS headers are for the server and for tools: `Nats-Msg-Id` is the event id, so
//! JetStream drops a second copy published within the stream's duplicate window;
//! [`EVENT_ID_HEADER`] and [`EVENT_TYPE_HEADER`] repeat the id and the type for filters and
//! inspection; `Content-Type` is `application/json`.
//!
//! # Routing and order
//!
//! An event goes to the subject `<prefix>.<partition>`: the partition is the 32-bit FNV-1a
//! hash of its ordering key (of its id when it has none) modulo the relay's
//! [`partitions`](NatsRelayBuilder::partitions), 1 by default. One key always takes one
//! subject, and one stream (capturing `<prefix>.>`, see [`NatsRelay::stream_config`]) orders
//! every subject's messages.
//!
//! Order holds end to end, per key and per event type:
//!
//! - The publishing bus runs one delivery of a key at a time for each relay subscription, in
//!   the key's order, and the next starts only after JetStream confirmed the previous one;
//!   a failing delivery holds its key's later events back until it succeeds or is buried.
//! - The stream keeps messages in the order it confirmed them.
//! - The consumer reads the stream (or one partition of it, with
//!   [`filter_subject`](NatsConsumerBuilder::filter_subject)) in order, and appends each
//!   batch in one transaction, in stream order; the consumer's limit of unacknowledged
//!   messages is its batch size, so messages waiting for redelivery are never overtaken, and a
//!   consumer that finds messages out unacknowledged which it does not hold (a dead process's
//!   batch) narrows that limit to them until they came back.
//!
//! Each event type has its own relay subscription (a handler id names one subscription), so
//! two events of one key **with different types** may cross when the first one's delivery is
//! retried: keep the events whose relative order matters in one type, or give them an order
//! field the consumer's handlers check.
//!
//! # Guarantees
//!
//! - **At least once to the broker, once in the stream.** A relay delivery completes only
//!   after JetStream's publish ack ([`NatsRelay::send`]); a failed or timed-out ack fails the
//!   attempt, which the bus retries. A relay that crashes after the ack and before the
//!   completion sends the event again: the stream keeps one copy (the ack says
//!   `duplicate`), as long as the retry comes within the stream's duplicate window (two
//!   minutes by default).
//! - **Once in the consuming store.** The consumer acknowledges a message only after the
//!   transaction that appended its event committed; a message redelivered (the consumer
//!   crashed before its ack, or the ack was lost) appends nothing new, since the store holds
//!   its event id. The ack wait is short ([`DEFAULT_ACK_WAIT`], 2 seconds) and a held batch is
//!   reported in progress several times per ack wait, so what a dead consumer process had
//!   taken is redelivered within seconds while a slow append is not. Events live in the
//!   consuming store as deduplication records for its
//!   retention of completed events ([`Retention`](crate::Retention)): keep it longer than
//!   the broker's redeliveries can take.
//! - **Unreadable messages never block.** A message that is not a relaybus event, or whose
//!   event is invalid, is published to the consumer's
//!   [dead-letter subject](NatsConsumerBuilder::dead_letter_subject) with a
//!   [`DEAD_LETTER_REASON_HEADER`] and then acknowledged; when there is no such subject or
//!   that publish fails, it is terminated (`+TERM`) and the reason is logged at error level.
//!   The messages behind it are appended as usual.
//! - **A failed append is redelivered.** When the store cannot append (it is unreachable),
//!   the message and every later one of its batch are negatively acknowledged with the
//!   [nak delay](NatsConsumerBuilder::nak_delay), and the broker redelivers them in order.
//! - **Graceful shutdown.** The relay's deliveries stop with the bus
//!   ([`RelayBus::shutdown`](crate::RelayBus::shutdown)): a publish still waiting for its
//!   ack when the shutdown timeout ends is released without charging an attempt, and sent
//!   again later (deduplicated by the stream). The consumer's [`run`](NatsConsumer::run)
//!   stops fetching when its token is cancelled, finishes its batch (append, commit,
//!   acknowledge), and returns.

mod builder;
mod consumer;
mod error;
mod fetch;
mod inbound;
mod progress;
mod relay;
mod wire;

pub use async_nats;
pub use builder::NatsConsumerBuilder;
use consumer::NatsSource;
pub use consumer::{DEFAULT_ACK_WAIT, NatsConsumer};
pub use error::NatsError;
pub use relay::{DEFAULT_RELAY_HANDLER_ID, NatsRelay, NatsRelayBuilder};
pub use wire::{
    DEAD_LETTER_REASON_HEADER, DEAD_LETTER_SOURCE_HEADER, DEAD_LETTER_SUBJECT_HEADER,
    EVENT_ID_HEADER, EVENT_TYPE_HEADER, FORMAT_VERSION,
};

/// A batch [`NatsConsumer::fetch`] took, not yet appended. While it is held, its messages are
/// reported in progress to the broker a few times per ack wait, so they are not redelivered
/// however long the append takes. Dropping it stops the reports and leaves the messages to the
/// broker, which redelivers them after the ack wait.
pub type InboundBatch = crate::transport::InboundBatch<NatsSource>;

/// A batch appended to the local store, not yet acknowledged to the broker; its messages are
/// still reported in progress. Dropping it leaves the messages to the broker, which
/// redelivers them after the ack wait; appending them again adds nothing.
pub type AppendedBatch = crate::transport::AppendedBatch<NatsSource>;
