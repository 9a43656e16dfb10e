//! The store boundary: what the bus, the dispatcher, the operator API and `relaybus-axum` ask of
//! an event store, and the stores relaybus ships.
//!
//! A store keeps events and their deliveries in a database, next to the business data, and
//! implements [`Store`]. The MongoDB store ([`mongo`], feature `mongodb`, on by default) is one
//! implementation, the PostgreSQL store ([`postgres`], feature `postgres`) another, and the
//! in-memory store ([`memory`], feature `memory`) a third, for tests and development; every
//! layer above them (bus, dispatcher, handler context, request layer, extractors, dispatcher
//! service) is generic over `S: Store` with the MongoDB store as the default type, so code
//! written for MongoDB names no store type at all.
//!
//! # Capability traits
//!
//! [`Store`] declares little itself (its name and [`setup`](Store::setup)); it is the
//! composition of small traits, one per kind of caller, in the manner of sqlx's `Database` and
//! apalis's backend capabilities:
//!
//! - [`Transactions`]: sessions; begin, commit and abort; which driver errors are transient. For
//!   the transaction runner ([`transaction`]).
//! - [`Append`]: events with their deliveries, in the caller's transaction. For publishing and
//!   the transports' consumers.
//! - [`ConsumerPositions`]: a log consumer's positions, in the same transaction. For the Kafka
//!   consumer.
//! - [`Queue`]: claiming, settling, renewing and handing back deliveries; wake-ups. For the
//!   dispatcher's workers.
//! - [`Inspect`]: counts, listings, an event's deliveries, lanes, dead letter groups. For the
//!   operator page and the delivery gauges.
//! - [`Operate`]: requeueing, burying and discarding by id; purging. For operators and the
//!   bus's retention.
//! - [`Leadership`]: one store instance at a time per role, listed by prefix, and fenced in the
//!   caller's transaction. For the delivery gauges and the Kafka consumer's partitions.
//! - [`IdempotentRequests`]: the stored first answers of idempotent requests, in the request's
//!   transaction. For `relaybus-axum`'s `IdempotencyLayer`.
//! - [`Limits`]: the slots of handlers' global concurrency and the start counters of their rate
//!   limits, shared by every bus of the database. For the dispatcher's workers.
//!
//! A method belongs to a capability every store implements; a store that has nothing better to
//! do takes a trait's default. Code generic over `S: Store` calls every capability's methods
//! without importing them; code holding a concrete store imports the traits it calls, or
//! [`prelude`]`::*`. Through `S: Store`, `S::Session` and `S::Lease` name the associated types;
//! a qualified path names the trait that declares them (`<S as Transactions>::Session`,
//! `<S as Queue>::Lease`). New storage needs go into capability traits (a new one, or the one
//! whose callers need it), never into `Store` itself.
//!
//! # Generics, not a trait object
//!
//! [`Store`] is used as a type parameter, in the manner of sqlx's `Database`, not as
//! `dyn Store`:
//!
//! - The hot path (claim, complete, append) is called through static dispatch. Its futures
//!   are the store's own, unboxed (`impl Future + Send` in the trait), so a claim of 32
//!   deliveries costs no allocation for the call itself.
//! - What differs between databases is carried by associated types:
//!   [`Session`](Transactions::Session) is the handle of an open transaction that business code
//!   writes through (the driver's `ClientSession` for MongoDB, a transaction on a connection
//!   for PostgreSQL), and [`Lease`](Queue::Lease) is a claim's proof of ownership with the
//!   store's own delivery id type. A trait object could not hand a user their driver's own
//!   session type without downcasting at every write.
//! - The cost: `RelayBus<S>`, `HandlerContext<S>` and the axum types carry a type parameter.
//!   Defaults (`S = MongoEventStore`) keep it out of user code for MongoDB; a user of another
//!   store writes it once, in a type alias. Handlers registered with `#[handler]` are type
//!   erased ([`Subscription`](crate::Subscription)), so the registry needs no parameter: a
//!   handler remembers the store its context names, and
//!   [`build`](crate::RelayBusBuilder::build) refuses one of another store with
//!   [`ConfigurationError::HandlerOfAnotherStore`](crate::ConfigurationError::HandlerOfAnotherStore).
//!
//! Errors cross the boundary as [`Error`](crate::Error): a driver error becomes
//! [`Error::Database`](crate::Error::Database) holding a [`DatabaseError`](crate::DatabaseError)
//! that keeps the driver error (to downcast) and answers whether the transaction may run again.
//!
//! # Transactions
//!
//! A store offers transaction primitives ([`Transactions`]): [`session`](Transactions::session),
//! [`begin`](Transactions::begin), [`commit`](Transactions::commit) and
//! [`abort`](Transactions::abort). The policy around them (retrying the body after a transient
//! error, sending a commit again while its result is unknown, the time budget) is written once,
//! in [`transaction`], and used by the bus, the dispatcher's transactional handlers and
//! `relaybus-axum`'s request layer.

pub mod administration;
mod append;
#[cfg(any(feature = "memory", feature = "postgres", feature = "mongodb"))]
mod checks;
mod idempotency;
mod inspect;
mod leadership;
mod limits;
#[cfg(feature = "memory")]
#[cfg_attr(docsrs, doc(cfg(feature = "memory")))]
pub mod memory;
pub(crate) mod model;
#[cfg(feature = "mongodb")]
#[cfg_attr(docsrs, doc(cfg(feature = "mongodb")))]
pub mod mongo;
#[cfg(not(feature = "mongodb"))]
mod no_store;
mod operate;
mod position;
#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub mod postgres;
mod queue;
pub mod transaction;
mod transactions;

use std::{fmt, future::Future, time::Duration};

use crate::{error::Result, event::EventEnvelope, time::Timestamp};

pub use model::{
    AppendRequest, Appended, AttemptError, BlockedKey, Buried, DeadLetterGroup, DeliveryQuery,
    DeliveryRecord, DeliveryStatus, Discarded, EventDetail, HandlerStatistics, LaneReport,
    LaneStatus, MAX_BLOCKED_KEYS, MAX_DEAD_LETTER_GROUPS, MAX_ERROR_HISTORY, PendingState,
    PurgeOptions, Purged, Requeued, Statistics,
};

pub use administration::{Administration, SetupStep, SetupStepKind};
pub use append::Append;
pub use idempotency::{
    IdempotentRequests, MAX_IDEMPOTENCY_KEY_LEN, MAX_REQUEST_SCOPE_BYTES, RequestKey,
    RequestKeyState, StoredResponse, key_problem,
};
pub use inspect::Inspect;
pub use leadership::{Lead, Leadership, MAX_ROLE_BYTES};
#[cfg(any(feature = "mongodb", feature = "postgres", feature = "memory"))]
pub(crate) use limits::rate_window;
pub use limits::{Limits, MAX_GLOBAL_CONCURRENCY, Slot, SlotRequest, StartsRequest};
#[cfg(not(feature = "mongodb"))]
pub use no_store::NoStore;
pub use operate::Operate;
pub use position::{ConsumerPositions, MAX_POSITION_NAME_BYTES, PositionKey};
pub use queue::{Queue, StoreLease};
pub use transactions::Transactions;

/// The store traits, to call their methods on a concrete store type:
/// `use relaybus::store::prelude::*;`. Code generic over `S: Store` needs none of it.
pub mod prelude {
    pub use super::{
        Append, ConsumerPositions, IdempotentRequests, Inspect, Leadership, Limits, Operate, Queue,
        Store, StoreLease, Transactions,
    };
}

/// The store a bus uses when none is named: the MongoDB store.
#[cfg(feature = "mongodb")]
pub type DefaultStore = mongo::MongoEventStore;

/// The store a bus uses when none is named. Without the `mongodb` feature there is none: name
/// the store type (`RelayBus<MyStore>`). This type has no values.
#[cfg(not(feature = "mongodb"))]
pub type DefaultStore = NoStore;

/// An event store: the transactional outbox and the delivery queue behind a bus, as the
/// capability traits it is made of.
///
/// Every method that writes runs in one transaction of the store, or in the caller's
/// ([`append`](Append::append), [`complete_in_transaction`](Queue::complete_in_transaction)).
/// The bus, the dispatcher, the handler context and `relaybus-axum` take `S: Store`, so every
/// capability's methods can be called through it without naming the capability; code that
/// calls them on a concrete store type imports the traits, or [`prelude`]`::*`.
///
/// A store implements each capability trait and this one. Implementations are checked by the
/// conformance suite in `tests/`, which runs the same behavioural tests against every store.
pub trait Store:
    Transactions
    + Append
    + ConsumerPositions
    + IdempotentRequests
    + Queue
    + Inspect
    + Operate
    + Leadership
    + Limits
    + Clone
    + Send
    + Sync
    + fmt::Debug
    + 'static
{
    /// The store's name in messages, such as `"MongoDB"`.
    const NAME: &'static str;

    /// Creates what the store needs (tables or collections, indexes), idempotently.
    fn setup(&self) -> impl Future<Output = Result<()>> + Send;
}

/// A delivery handed out by [`Queue::claim`]: the event, which handler runs it, which attempt
/// this is, and the lease to settle it with.
#[derive(Debug, Clone)]
pub struct Claimed<L> {
    /// The lease to settle the delivery with.
    pub lease: L,
    /// When the lease ends unless it is renewed.
    pub lease_expires_at: Timestamp,
    /// The handler that should run the delivery.
    pub handler: String,
    /// Which attempt this is, from 1.
    pub attempt: u32,
    /// The event's sequence within its ordering key, if it has a key.
    pub sequence: Option<i64>,
    /// Held to its key's order (keyed, and not appended for an unordered handler): a claim
    /// hands out at most one delivery of its handler and key, and none while one of them runs.
    pub ordered: bool,
    /// The event.
    pub event: EventEnvelope,
}

/// What one claim asks for.
#[derive(Debug, Clone, Copy)]
pub struct ClaimRequest<'a> {
    /// The worker's owner name.
    pub owner: &'a str,
    /// The handlers whose deliveries it runs.
    pub handlers: &'a [String],
    /// At most this many deliveries.
    pub limit: u32,
    /// How long the claim holds what it takes without renewal.
    pub lease_duration: Duration,
    /// The current time.
    pub now: Timestamp,
}

/// A wake-up: deliveries of the watched handlers committed.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct WakeUp {
    /// Where the new delivery is (MongoDB: its lane), when the store can tell.
    pub at: Option<u32>,
}

/// The last count of deliveries by handler a store instance took for the delivery gauges, which
/// the buses sharing the instance report (see [`Inspect::gauge_statistics`]).
#[cfg(any(feature = "mongodb", feature = "postgres"))]
#[derive(Debug, Default)]
pub(crate) struct GaugeSample(
    tokio::sync::Mutex<Option<(std::time::Instant, Vec<HandlerStatistics>)>>,
);

#[cfg(any(feature = "mongodb", feature = "postgres"))]
impl GaugeSample {
    /// The last count if it is younger than `max_age`, else a new one from `count`. One count at
    /// a time: callers that ask while it runs take its result.
    pub(crate) async fn get_or_count(
        &self,
        max_age: Duration,
        count: impl Future<Output = Result<Vec<HandlerStatistics>>>,
    ) -> Result<Vec<HandlerStatistics>> {
        let mut last = self.0.lock().await;
        if let Some((at, statistics)) = last.as_ref()
            && at.elapsed() < max_age
        {
            return Ok(statistics.clone());
        }
        let statistics = count.await?;
        *last = Some((std::time::Instant::now(), statistics.clone()));
        Ok(statistics)
    }
}
