//! The Kafka transport: a relay that produces events to a topic, and a consumer that appends
//! a topic's events to the local store, keeping its position in the store.
//!
//! Built on [rskafka](https://docs.rs/rskafka), a pure-Rust Kafka client: no librdkafka, no C
//! build, plain Tokio. rskafka has no consumer groups, no committed offsets and no idempotent
//! producer; this transport does without them, and the guarantees below say how.
//!
//! # The record
//!
//! An event becomes one record:
//!
//! - **value**: the JSON envelope every transport writes (see the NATS transport's
//!   documentation for its fields): `{"relaybus": 1, "id": …, "type": …, "key": …,
//!   "sequence": …, "correlation_id": …, "causation_id": …, "headers": {…}, "created_at": …,
//!   "payload": {…}}`, read back exactly as published, headers and trace context included;
//! - **key**: the event's ordering key (none for an unkeyed event), so Kafka's tools and
//!   compaction see it;
//! - **headers**: [`EVENT_ID_HEADER`], [`EVENT_TYPE_HEADER`] and `content-type:
//!   application/json`, for tools (the consumer reads the value);
//! - **timestamp**: the event's creation time.
//!
//! # Partitioning and order
//!
//! An event goes to partition `fnv1a32(key) % partitions` of the topic, as in every relaybus
//! transport (the hash of its id for an unkeyed event, which may land anywhere). One key
//! always takes one partition, and Kafka orders a partition. The publishing bus runs one
//! delivery of a key at a time for each relay subscription, in the key's order, and the next
//! starts only after the leader acknowledged the previous one; the consumer reads each
//! partition in offset order, in one task per partition (in one process at a time), and appends
//! each batch in order. So
//! order holds end to end per key (and per event type: each type has its own relay
//! subscription, so two events of one key with different types may cross when the first
//! one's delivery is retried).
//!
//! # Guarantees
//!
//! - **At least once to the broker.** A relay delivery completes only after the partition
//!   leader acknowledged the produce. rskafka produces with `acks = -1` (all in-sync
//!   replicas), so an acknowledged record survives the leader's loss when the topic has
//!   replicas. A failed or timed-out produce fails the attempt, which the bus retries.
//! - **Duplicates in the topic, none in the consuming store.** rskafka has no idempotent
//!   producer, so a relay that crashes between the acknowledgement and the delivery's
//!   completion (or whose acknowledgement timed out after the write) produces the event
//!   again, and **the topic holds two records** of it. The consumer appends events under their
//!   original ids, and appending an id the store holds adds nothing: one local effect.
//! - **Exactly once from the topic into the store.** Kafka keeps no position for the consumer;
//!   the consumer keeps each partition's next offset in the local store
//!   ([`advance_consumer_position`](crate::store::ConsumerPositions::advance_consumer_position))
//!   and writes it in the transaction that appends the batch. A consumer stopped anywhere (before,
//!   during or after the commit) goes on from the stored offset: the batch's events and the
//!   offset after them committed together, or neither did. Positions only move forward.
//! - **One reader per partition across processes.** The consumer reads the partitions the
//!   broker's metadata lists, and the processes that run it (its name and topic, on one
//!   database) share them through leads of the local store
//!   ([`Leadership`](crate::store::Leadership)), renewed every third of the
//!   [lease](KafkaConsumerBuilder::lease): each reads an even share, and the partitions of a
//!   process that died are read by another within the lease and a third. Each append's
//!   transaction keeps its reader's lead first
//!   ([`keep_lead`](crate::store::Leadership::keep_lead)), so a reader whose lead was taken over
//!   appends nothing more; see [`KafkaConsumer::run`].
//! - **Unreadable records never block.** A record that is not a relaybus event (no value, not
//!   JSON, another format version, an invalid event), or whose event the store refuses, is
//!   produced to the consumer's [dead-letter topic](KafkaConsumerBuilder::dead_letter_topic)
//!   with [`DEAD_LETTER_REASON_HEADER`] and [`DEAD_LETTER_SOURCE_HEADER`] (without one, or
//!   when that produce fails, it is skipped and the reason logged at error level), and the
//!   offset moves past it with the events behind it. A consumer that stops between the dead
//!   letter's produce and the commit produces the dead letter again.
//! - **A failed fetch or append is taken again.** When the batch's transaction fails, its
//!   events are appended one at a time, each with the offset after it, up to the first that
//!   fails for a reason other than the event itself (the store is unreachable); an event the
//!   store refuses for good is dead-lettered. What was not written is counted in
//!   [`BatchReport::retried`](crate::transport::BatchReport::retried), and the partition's
//!   task takes it again from the stored offset after the
//!   [retry delay](KafkaConsumerBuilder::retry_delay), as it does after a failed fetch. rskafka has
//!   no request timeout of its own: the relay's
//!   [`produce_timeout`](KafkaRelayBuilder::produce_timeout) and the consumer's
//!   [`fetch_timeout`](KafkaConsumerBuilder::fetch_timeout) bound each call, and rskafka
//!   reconnects on the next one.
//! - **Graceful shutdown.** The relay's deliveries stop with the bus. The consumer's
//!   [`run`](KafkaConsumer::run) stops fetching when its token is cancelled, finishes the
//!   batch it holds (dead letters, append and offset in one commit), and returns.

mod assignment;
mod builder;
mod consumer;
mod error;
mod partition;
mod relay;
mod wire;

pub use builder::{DEFAULT_LEASE, KafkaConsumerBuilder};
pub use consumer::{KafkaConsumer, MAX_BATCH_RECORDS};
pub use error::KafkaError;
pub use relay::{DEFAULT_RELAY_HANDLER_ID, KafkaRelay, KafkaRelayBuilder};
pub use rskafka;
pub use wire::{
    DEAD_LETTER_REASON_HEADER, DEAD_LETTER_SOURCE_HEADER, EVENT_ID_HEADER, EVENT_TYPE_HEADER,
    FORMAT_VERSION,
};
