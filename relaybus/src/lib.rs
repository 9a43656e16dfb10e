//! relaybus is a reliable event bus on the transactional outbox, with stores for MongoDB,
//! PostgreSQL and memory, and transports to NATS, RabbitMQ and Kafka.
//!
//! An event is written in the **same database transaction** as the business data that caused
//! it: a committed change always has its event, and a rolled-back one never leaks one. Every
//! handler subscribed to the event's type gets a delivery of its own, at least once, with
//! retries, dead letters, per-key order and leases fenced against stale workers.
//!
//! The [`guide`] has a page per subject: [stores](guide::stores), [handlers](guide::handlers),
//! [testing](guide::testing), [scheduled events](guide::schedules),
//! [transports](guide::transports),
//! [operations](guide::operations), [reliability](guide::reliability),
//! [differences from the specification](guide::differences) and [upgrading](guide::upgrading).
//! The Axum integration is the `relaybus-axum` crate.
//!
//! # Stores
//!
//! Each store is a cargo feature: `mongodb` (on by default), `postgres` and `memory`. The bus
//! and the handler context are generic over the store; each store has a module of short names
//! for its types ([`postgres`], [`mongo`], [`memory`]), and without the `mongodb` feature
//! there is no default store, so a service names its own.
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
//! let client = mongodb::Client::with_uri_str("mongodb://127.0.0.1:27017/?replicaSet=rs0").await?;
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
//! The same on PostgreSQL, and with `#[event]` and `#[handler]` declared where they live, is in
//! the [stores](guide::stores) and [handlers](guide::handlers) guides.
//!
//! # Transactions and retries
//!
//! [`RelayBus::transaction`] runs the whole body again after a transient error such as a write
//! conflict or a serialization failure, so the body may run more than once. Keep side effects
//! that do not go through the session out of it: publishing an event is how to make them
//! happen once the data is committed.

#![cfg_attr(docsrs, feature(doc_cfg))]

#[doc(hidden)]
#[path = "private.rs"]
pub mod __private;
pub mod activity;
mod aliases;
mod batch;
mod bus;
pub mod clock;
mod dispatcher;
pub mod error;
pub mod event;
pub mod guide;
mod handler;
#[doc(hidden)]
#[cfg(any(feature = "mongodb", feature = "postgres", feature = "memory"))]
pub mod instances;
pub mod registry;
pub mod schedule;
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

pub use batch::{
    Batch, BatchHandler, BatchItem, BatchOutcome, DEFAULT_BATCH_WAIT, DEFAULT_MAX_BATCH, MAX_BATCH,
};
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
// The macros' documentation lives here, where its examples can compile against this crate;
// the proc-macro crate cannot depend on relaybus, even for its tests, without building the
// whole driver stack a second time.
#[cfg(feature = "macros")]
#[cfg_attr(docsrs, doc(cfg(feature = "macros")))]
#[doc = include_str!("../docs/macros/event.md")]
pub use relaybus_macros::event;
#[cfg(feature = "macros")]
#[cfg_attr(docsrs, doc(cfg(feature = "macros")))]
#[doc = include_str!("../docs/macros/handler.md")]
pub use relaybus_macros::handler;
#[cfg(feature = "macros")]
#[cfg_attr(docsrs, doc(cfg(feature = "macros")))]
#[doc = include_str!("../docs/macros/schedule.md")]
pub use relaybus_macros::schedule;
pub use schedule::{MissedTicks, Schedule, Tick};
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

#[cfg(feature = "memory")]
pub use aliases::memory;
#[cfg(feature = "mongodb")]
pub use aliases::mongo;
#[cfg(feature = "postgres")]
pub use aliases::postgres;

/// The MongoDB driver of the MongoDB store, for its `ClientSession` and `bson` types.
#[cfg(feature = "mongodb")]
#[cfg_attr(docsrs, doc(cfg(feature = "mongodb")))]
pub use mongodb;

/// sqlx, the driver of the PostgreSQL store, for its pool and query types at the version the
/// store uses.
#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub use sqlx;
