//! The in-memory event store: everything in the process's memory, for tests and development.
//!
//! [`MemoryEventStore`] implements [`Store`](crate::Store) with the same behaviour as the
//! MongoDB store where the conformance suite checks it (appends, per-key order, leases and
//! fencing, retries, dead letters, the operator calls), so a bus, its handlers and
//! `relaybus-axum` run on it unchanged, with no server to start. Business data lives next to
//! the events, as named collections of JSON documents written through the transaction's
//! [`MemorySession`], so a route or a transactional handler commits its writes and its events
//! together, exactly as it would with MongoDB.
//!
//! **It is not a production store.** It lives in one process: nothing is written to disk, the
//! data is lost with the process, and no other process can share it (there is no second
//! instance to take work over after a crash).
//!
//! # Example
//!
//! ```
//! use relaybus::{
//!     BoxError, Event, HandlerContext, MemoryEventStore, RelayBus, Subscription,
//! };
//! use serde::{Deserialize, Serialize};
//! use serde_json::json;
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
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), relaybus::Error> {
//! let store = MemoryEventStore::new();
//! let bus = RelayBus::builder(store.clone())
//!     .without_registered_handlers()
//!     .subscribe(
//!         Subscription::new(
//!             "count-orders",
//!             |_: OrderPlaced, ctx: HandlerContext<MemoryEventStore>| async move {
//!                 // Written in the transaction that completes the delivery.
//!                 let mut session = ctx.session().await?;
//!                 session.update("counters", "orders", |count| {
//!                     Some(json!(count.and_then(|c| c.as_u64()).unwrap_or(0) + 1))
//!                 })?;
//!                 Ok::<(), BoxError>(())
//!             },
//!         )
//!         .transactional(),
//!     )
//!     .build()?;
//!
//! // The order and its event commit together, or not at all.
//! bus.transaction(async |session| {
//!     session.insert("orders", "o-1", json!({ "total_cents": 1250 }))?;
//!     bus.publish(&OrderPlaced { order_id: "o-1".into() })
//!         .key("o-1")
//!         .session(session)
//!         .await?;
//!     Ok(())
//! })
//! .await?;
//! assert_eq!(store.document("orders", "o-1"), Some(json!({ "total_cents": 1250 })));
//!
//! bus.run_once().await?;
//! assert_eq!(store.document("counters", "orders"), Some(json!(1)));
//! # Ok(())
//! # }
//! ```
//!
//! # Design
//!
//! All committed state (events, pending and dead deliveries, completion records, the counter
//! of each ordering key, business documents) sits in one [`std::sync::Mutex`] shared by the
//! store's clones. Every call takes it for a short, synchronous step and never across an
//! `.await`, so calls never wait on one another for longer than that step, and nothing blocks
//! on an open transaction.
//!
//! **Transactions** are buffers. A [`MemorySession`] started with
//! [`begin`](crate::store::Transactions::begin) collects what the transaction writes (new events
//! and the handlers added to known ones, key counters, new deliveries, completions, business
//! documents); readers outside it see none of it. The commit checks that what the transaction
//! relied on still holds and then applies everything in one step under the mutex; an abort, or
//! dropping the session with the transaction open, throws the buffer away. An aborted transaction
//! leaves nothing: no event, no delivery, no sequence number, no document.
//!
//! **Conflicts** are MongoDB's: the first write of a transaction to a thing (an event id, the
//! counter of an ordering key, a delivery it completes, a business document) takes it until the
//! transaction ends, and a second open transaction writing the same thing fails at once with
//! [`MemoryStoreError::WriteConflict`], a transient [`Error::Database`](crate::Error::Database):
//! [`transaction::run`], the bus, transactional handlers and the request layer run the whole
//! transaction again. A transaction that read a business document and writes it after another
//! transaction committed a change to it conflicts the same way (no lost update). After a
//! conflict the transaction can only abort: its commit fails with the same error. Nothing ever
//! waits for another transaction, so there are no deadlocks. A key's counter is advanced only
//! at commit and taken by one open transaction at a time, so sequences are gapless and in
//! commit order.
//!
//! **The budget** given to [`begin`](crate::store::Transactions::begin) is enforced at the commit:
//! a commit past it applies nothing and fails with a timeout
//! ([`MemoryStoreError::BudgetExceeded`]), which the transaction runner reports as
//! [`Error::TransactionTimeout`](crate::Error::TransactionTimeout).
//!
//! **Leases** are per delivery, not per lane: a claim gives each delivery it hands out its owner,
//! an expiry, and a fencing token that no other claim ever gets ([`MemoryLease`]). A settlement
//! changes something only while the delivery still carries the lease's token, so a stale owner
//! never settles what another one took over. A lease that expired is honoured until a claim of
//! another owner takes the delivery over (an owner is never handed again what it runs); one that
//! [`relinquish`](crate::store::Queue::relinquish) handed back, until any claim does. The takeover
//! charges the lost attempt.
//! [`complete_in_transaction`](crate::store::Queue::complete_in_transaction) checks the lease when
//! it is called and again at the commit: a delivery taken over in between makes the commit fail
//! with the transient write conflict, and the handler's transaction, run again, sees the lease
//! gone.
//!
//! **Order** within a key is computed, not stored: a pending delivery held to its key's order
//! is claimable only while it has the lowest sequence among its handler's pending deliveries
//! of that key, and the others count as parked. Claims take due deliveries in `(due time, id)`
//! order and look past blocked keys until they have their limit.
//!
//! **Wake-ups**: [`watch`](crate::store::Queue::watch) yields a [`WakeUp`](crate::store::WakeUp)
//! (with no lane) when a commit appends deliveries of the watched handlers; the dispatcher's
//! polling stays the safety net.
//!
//! # What differs from MongoDB
//!
//! - [`lanes`](crate::store::Inspect::lanes) has no lanes to show: it lists one entry per owner
//!   that holds leases (numbered from 0, in owner order; handed-back leases under no owner) with
//!   its running deliveries, and the blocked keys as MongoDB does.
//! - [`lead`](crate::store::Leadership::lead) always leads: there is one process.
//! - Business data is JSON documents written through [`MemorySession`], so the code that
//!   writes it is the store's own, as it is with MongoDB's collections. A write to a document
//!   the transaction never read is not checked against commits made since the transaction
//!   began (MongoDB's snapshot would conflict): the last commit wins.
//! - An owner is never handed again what it runs, even after its lease expired: within one
//!   process, an owner name stands for one worker. A bus stopped without
//!   [`shutdown`](crate::RelayBus::shutdown) leaves its deliveries to other owners.
//! - Events have no size limit (MongoDB's is 16 MiB per event document).
//! - Purges run in one step under the mutex, not in batches.
//!
//! Input is checked as the MongoDB store checks it (handler ids, owner names, limits, lease
//! durations, id lists, business collection names and ids): bad input gets a typed error that
//! says what is wrong and what to do, and nothing is written.

mod append;
mod boundary;
mod checks;
mod claim;
mod deliveries;
mod documents;
mod error;
mod inspect;
mod limits;
mod operator;
mod session;
mod settle;
mod state;

use std::{
    fmt,
    sync::{Arc, Mutex, MutexGuard, PoisonError},
    time::Duration,
};

use tokio::sync::broadcast;

pub use boundary::{CONSUMER_POSITIONS, IDEMPOTENCY_KEYS};
pub use claim::{MemoryDeliveryId, MemoryLease};
pub use error::MemoryStoreError;
pub use session::MemorySession;

use crate::store::transaction;

/// How many commits with new deliveries a watcher may fall behind before it is told to look
/// anyway (a lagging watcher gets one wake-up, never an error).
const WAKE_CAPACITY: usize = 256;

/// The in-memory event store: events, deliveries and business documents kept in the process's
/// memory, for tests and development. See the [module documentation](self) for the design and
/// what differs from MongoDB.
///
/// Clones share the same data. [`Store::NAME`](crate::Store::NAME) is `"memory"`.
///
/// # Example
///
/// ```
/// use relaybus::MemoryEventStore;
/// use serde_json::json;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), relaybus::Error> {
/// let store = MemoryEventStore::builder().completion_history(true).build();
/// store
///     .transaction(async |session| session.put("carts", "c-1", json!({ "items": 2 })))
///     .await?;
/// assert_eq!(store.count("carts"), 1);
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct MemoryEventStore {
    pub(crate) inner: Arc<Shared>,
}

/// What the clones of one store share.
pub(crate) struct Shared {
    state: Mutex<state::State>,
    completion_history: bool,
    /// The handlers of the deliveries each commit appended, for
    /// [`watch`](crate::store::Queue::watch).
    wake: broadcast::Sender<Arc<[String]>>,
    /// Slots and start counters of the handlers' limits.
    limits: Mutex<limits::LimitState>,
}

impl Shared {
    /// The committed state, for one short step. A panic in an earlier step cannot have left
    /// it half-changed (every step checks before it writes), so a poisoned lock is taken as is.
    fn lock(&self) -> MutexGuard<'_, state::State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl fmt::Debug for MemoryEventStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryEventStore")
            .field("completion_history", &self.inner.completion_history)
            .finish_non_exhaustive()
    }
}

impl Default for MemoryEventStore {
    fn default() -> Self {
        MemoryEventStore::new()
    }
}

impl MemoryEventStore {
    /// An empty store, without completion history.
    pub fn new() -> Self {
        MemoryEventStore::builder().build()
    }

    /// Starts building a store with options.
    pub fn builder() -> MemoryEventStoreBuilder {
        MemoryEventStoreBuilder {
            completion_history: false,
        }
    }

    /// Whether completed deliveries are kept as completion records.
    pub fn completion_history(&self) -> bool {
        self.inner.completion_history
    }

    /// Runs `work` in a transaction of this store and commits it, running the whole of `work`
    /// again after a write conflict, as
    /// [`transaction::run`] does (for 120 seconds at most).
    /// `work` gets the transaction's session: write business documents through it and pass it
    /// to [`publish(..).session(..)`](crate::Publish::session).
    ///
    /// # Errors
    ///
    /// The error of `work` (the transaction is aborted and nothing of it is kept), or the last
    /// write conflict once the retry time is used up.
    ///
    /// # Example
    ///
    /// ```
    /// # use relaybus::MemoryEventStore;
    /// # use serde_json::json;
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), relaybus::Error> {
    /// let store = MemoryEventStore::new();
    /// let total = store
    ///     .transaction(async |session| {
    ///         session.put("orders", "o-1", json!({ "total_cents": 1250 }))?;
    ///         Ok(1250)
    ///     })
    ///     .await?;
    /// assert_eq!(total, 1250);
    /// # Ok(())
    /// # }
    /// ```
    pub async fn transaction<R, F>(&self, work: F) -> crate::Result<R>
    where
        F: for<'s> AsyncFnMut(&'s mut MemorySession) -> crate::Result<R>,
    {
        transaction::run(self, None, work).await
    }

    /// As [`transaction`](Self::transaction), within a time budget that covers every attempt:
    /// a transaction past it is aborted with all its writes.
    ///
    /// # Errors
    ///
    /// As [`transaction`](Self::transaction), plus
    /// [`Error::TransactionTimeout`](crate::Error::TransactionTimeout), and
    /// [`Error::InvalidArgument`](crate::Error::InvalidArgument) for a budget outside 1 ms to
    /// 60 s (`work` does not run).
    pub async fn transaction_within<R, F>(&self, budget: Duration, work: F) -> crate::Result<R>
    where
        F: for<'s> AsyncFnMut(&'s mut MemorySession) -> crate::Result<R>,
    {
        checks::check_budget(budget)?;
        transaction::run(self, Some(budget), work).await
    }
}

/// Builds a [`MemoryEventStore`]; made by [`MemoryEventStore::builder`].
#[must_use]
#[derive(Debug, Clone)]
pub struct MemoryEventStoreBuilder {
    completion_history: bool,
}

impl MemoryEventStoreBuilder {
    /// Keep a record of every completed delivery, as the MongoDB store's option of the same
    /// name does: listed with [`DeliveryStatus::Completed`](crate::DeliveryStatus::Completed),
    /// counted in [`Statistics::completed`](crate::Statistics::completed), shown by
    /// [`event_detail`](crate::store::Inspect::event_detail), and deleted by a purge's
    /// `completed_before`. Off by default: a completed delivery is then deleted.
    pub fn completion_history(mut self, enabled: bool) -> Self {
        self.completion_history = enabled;
        self
    }

    /// Builds the store, empty. There is nothing to validate.
    pub fn build(self) -> MemoryEventStore {
        let (wake, _) = broadcast::channel(WAKE_CAPACITY);
        MemoryEventStore {
            inner: Arc::new(Shared {
                state: Mutex::new(state::State::default()),
                completion_history: self.completion_history,
                wake,
                limits: limits::new_state(),
            }),
        }
    }
}
