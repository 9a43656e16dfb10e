//! relaybus is a reliable event bus on the transactional outbox, with a MongoDB event store.
//!
//! An event is written in the **same MongoDB transaction** as the business data that caused it:
//! a committed change always has its event, and a rolled-back one never leaks one. Every handler
//! subscribed to the event's type gets a delivery of its own.
//!
//! # Example
//!
//! ```no_run
//! use mongodb::bson::doc;
//! use relaybus::{BoxError, Event, HandlerContext, MongoEventStore, RelayBus, Subscription};
//! use serde::{Deserialize, Serialize};
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
//! # async fn example() -> Result<(), relaybus::Error> {
//! let client = mongodb::Client::with_uri_str("mongodb://127.0.0.1:27117/?replicaSet=relaybus-dev").await?;
//! let store = MongoEventStore::builder(client.clone()).database("shop").build()?;
//! store.setup().await?;
//!
//! let bus = RelayBus::builder(store)
//!     .subscribe(Subscription::new(
//!         "send-confirmation",
//!         |event: OrderPlaced, _: HandlerContext| async move {
//!             println!("confirming {}", event.order_id);
//!             Ok::<(), BoxError>(())
//!         },
//!     ))
//!     .build()?;
//!
//! let orders = client.database("shop").collection("orders");
//! bus.transaction(async |session| {
//!     orders.insert_one(doc! { "_id": "o-1" }).session(&mut *session).await?;
//!     bus.publish(&OrderPlaced { order_id: "o-1".into() })
//!         .key("o-1")
//!         .session(session)
//!         .await?;
//!     Ok(())
//! })
//! .await?;
//! # Ok(())
//! # }
//! ```
//!
//! # Events and handlers declared where they live
//!
//! With the `macros` feature (on by default), [`#[event]`](macro@event) declares an event type
//! and [`#[handler]`](macro@handler) an `async fn` that handles one; both are registered at link
//! time, and [`RelayBus::builder`] subscribes every registered handler, so there is no central
//! list to keep. [`registry`] lists what is registered; two events with one type name or two
//! handlers with one id anywhere in the binary make [`build`](RelayBusBuilder::build) fail,
//! naming both items.
//!
//! ```no_run
//! use relaybus::{BoxError, HandlerContext, MongoEventStore, RelayBus};
//! use serde::{Deserialize, Serialize};
//!
//! #[relaybus::event("order.placed.v1")]
//! #[derive(Debug, Serialize, Deserialize)]
//! struct OrderPlaced {
//!     order_id: String,
//! }
//!
//! #[relaybus::handler(id = "send-confirmation", max_attempts = 5)]
//! async fn send_confirmation(event: OrderPlaced, context: HandlerContext) -> Result<(), BoxError> {
//!     println!("confirming {} (attempt {})", event.order_id, context.attempt());
//!     Ok(())
//! }
//!
//! # async fn example(store: MongoEventStore) -> Result<(), relaybus::Error> {
//! let bus = RelayBus::builder(store).build()?;
//! assert_eq!(bus.handlers_for("order.placed.v1"), ["send-confirmation"]);
//! bus.start().await?;
//! bus.publish(&OrderPlaced { order_id: "o-1".into() }).await?;
//! # Ok(())
//! # }
//! ```
//!
//! # Requirements
//!
//! MongoDB 6.0 or newer running as a replica set or a sharded cluster: MongoDB has
//! multi-document transactions only there. A single-node replica set is enough for development.
//! A standalone `mongod` is refused with [`ConfigurationError::NotReplicaSet`].
//!
//! # Transactions and retries
//!
//! [`RelayBus::transaction`] and [`MongoEventStore::transaction`] run the whole body again after
//! a transient error such as a write conflict, so the body may run more than once. Keep side
//! effects that do not go through the session out of it: publishing an event is how to make them
//! happen once the data is committed.

#![cfg_attr(docsrs, feature(doc_cfg))]

#[doc(hidden)]
#[path = "private.rs"]
pub mod __private;
pub mod activity;
mod bus;
pub mod clock;
mod dispatcher;
pub mod error;
pub mod event;
mod handler;
pub mod registry;
mod state;
pub mod store;
pub mod telemetry;
mod time;
mod trace;
#[cfg(any(feature = "nats", feature = "rabbitmq", feature = "kafka"))]
#[cfg_attr(
    docsrs,
    doc(cfg(any(feature = "nats", feature = "rabbitmq", feature = "kafka")))
)]
pub mod transport;

pub use bus::{
    DEFAULT_TRANSACTION_TIMEOUT, Publish, PublishAll, RelayBus, RelayBusBuilder, RunUntilIdle,
};
pub use dispatcher::{DEFAULT_MAX_RUNS, DeliveryRun, IdleReport, Retention, RunOutcome, RunReport};
pub use error::{
    BoxError, CommitNotAcknowledgedError, ConfigurationError, DatabaseError, Error,
    EventValidationError, InvalidArgumentError, LeaseError, Result, TransactionTimeoutError,
};
pub use event::{Event, EventEnvelope};
pub use handler::{
    Handler, HandlerArgument, HandlerArguments, HandlerContext, NotTransactional, Permanent,
    RetryPolicy, SessionGuard, Subscription, validate_handler_id,
};
#[cfg(feature = "macros")]
#[cfg_attr(docsrs, doc(cfg(feature = "macros")))]
pub use relaybus_macros::{event, handler};
pub use state::State;
#[cfg(feature = "memory")]
pub use store::memory::{MemoryEventStore, MemorySession};
#[cfg(feature = "mongodb")]
#[cfg_attr(docsrs, doc(cfg(feature = "mongodb")))]
pub use store::mongo::{ClaimedDelivery, Lease, MongoEventStore, MongoEventStoreBuilder};
#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub use store::postgres::{PostgresEventStore, PostgresSession};
pub use store::{
    AppendRequest, Appended, AttemptError, BlockedKey, Buried, DeadLetterGroup, DeliveryQuery,
    DeliveryRecord, DeliveryStatus, Discarded, EventDetail, HandlerStatistics, LaneReport,
    LaneStatus, PendingState, PurgeOptions, Purged, Requeued, Statistics, Store,
};
pub use time::Timestamp;

#[doc = include_str!("../docs/cli.md")]
pub mod command_line {}

/// The README's examples, compiled as doc tests. They use the MongoDB and the in-memory store,
/// so they run when both features are on (`scripts/test --all-features`, as in CI).
#[cfg(all(doctest, feature = "mongodb", feature = "memory"))]
#[doc = include_str!("../../README.md")]
struct ReadmeDoctests;

/// The MongoDB driver of the MongoDB store, for its `ClientSession` and `bson` types.
#[cfg(feature = "mongodb")]
#[cfg_attr(docsrs, doc(cfg(feature = "mongodb")))]
pub use mongodb;
