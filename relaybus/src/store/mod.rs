//! The store boundary: what the bus, the dispatcher, the operator API and `relaybus-axum` ask of
//! an event store, and the stores relaybus ships.
//!
//! A store keeps events and their deliveries in a database, next to the business data, and
//! implements [`Store`]. The MongoDB store ([`mongo`], feature `mongodb`, on by default) is one
//! implementation, and the in-memory store ([`memory`], feature `memory`) a second one, for
//! tests and development; every layer above them (bus, dispatcher, handler context, request
//! layer, extractors, dispatcher service) is generic over `S: Store` with the MongoDB store as
//! the default type, so code written for MongoDB names no store type at all.
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
//!   [`Session`](Store::Session) is the handle of an open transaction that business code
//!   writes through (the driver's `ClientSession` for MongoDB, a transaction on a connection
//!   for PostgreSQL), and [`Lease`](Store::Lease) is a claim's proof of ownership with the
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
//! A store offers transaction primitives: [`session`](Store::session),
//! [`begin`](Store::begin), [`commit`](Store::commit) and [`abort`](Store::abort). The policy
//! around them (retrying the body after a transient error, sending a commit again while its
//! result is unknown, the time budget) is written once, in [`transaction`], and used by the
//! bus, the dispatcher's transactional handlers and `relaybus-axum`'s request layer.

pub mod administration;
#[cfg(any(feature = "memory", feature = "postgres"))]
mod checks;
#[cfg(feature = "memory")]
#[cfg_attr(docsrs, doc(cfg(feature = "memory")))]
pub mod memory;
pub(crate) mod model;
#[cfg(feature = "mongodb")]
#[cfg_attr(docsrs, doc(cfg(feature = "mongodb")))]
pub mod mongo;
mod position;
#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub mod postgres;
pub mod transaction;

use std::{collections::HashMap, fmt, future::Future, hash::Hash, time::Duration};

use futures::stream::BoxStream;

pub use model::{
    AppendRequest, Appended, AttemptError, BlockedKey, Buried, DeadLetterGroup, DeliveryQuery,
    DeliveryRecord, DeliveryStatus, Discarded, EventDetail, HandlerStatistics, LaneReport,
    LaneStatus, MAX_BLOCKED_KEYS, MAX_DEAD_LETTER_GROUPS, MAX_ERROR_HISTORY, PendingState,
    PurgeOptions, Purged, Requeued, Statistics,
};

pub use administration::{Administration, SetupStep, SetupStepKind};
pub use position::{MAX_POSITION_NAME_BYTES, PositionKey};

use crate::{error::Result, event::EventEnvelope, time::Timestamp};

/// The store a bus uses when none is named: the MongoDB store.
#[cfg(feature = "mongodb")]
pub type DefaultStore = mongo::MongoEventStore;

/// The store a bus uses when none is named. Without the `mongodb` feature there is none: name
/// the store type (`RelayBus<MyStore>`). This type has no values.
#[cfg(not(feature = "mongodb"))]
pub type DefaultStore = NoStore;

/// A store type with no values: the default type parameter when the `mongodb` feature is off,
/// so that the default can never be used by mistake.
#[cfg(not(feature = "mongodb"))]
#[derive(Debug, Clone, Copy)]
pub enum NoStore {}

/// A claim's proof of ownership of one delivery, handed back to settle it.
pub trait StoreLease: Clone + Send + Sync + fmt::Debug + 'static {
    /// The store's delivery id.
    type DeliveryId: Clone + Eq + Hash + Send + Sync + fmt::Debug + fmt::Display + 'static;

    /// The id of the delivery this lease settles.
    fn delivery_id(&self) -> Self::DeliveryId;
}

/// A delivery handed out by [`Store::claim`]: the event, which handler runs it, which attempt
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
    /// hands out more than one delivery of its handler and key only as a run (see
    /// [`ClaimRequest::run`]), which the worker runs one after the other.
    pub ordered: bool,
    /// The event.
    pub event: EventEnvelope,
}

/// Deliveries grouped as their worker runs them: those of one handler and key held to their
/// key's order together, in sequence order; every other delivery alone; in the order given.
/// `ordered_key` gives a delivery's handler and key when it is held to its key's order.
pub(crate) fn group_runs<T>(
    deliveries: Vec<T>,
    ordered_key: impl Fn(&T) -> Option<(&str, &str)>,
    sequence: impl Fn(&T) -> Option<i64>,
) -> Vec<Vec<T>> {
    let mut runs: Vec<Vec<T>> = Vec::with_capacity(deliveries.len());
    let mut of_key: HashMap<(String, String), usize> = HashMap::new();
    for delivery in deliveries {
        let Some((handler, key)) = ordered_key(&delivery) else {
            runs.push(vec![delivery]);
            continue;
        };
        let key = (handler.to_owned(), key.to_owned());
        match of_key.get(&key) {
            Some(&at) => runs[at].push(delivery),
            None => {
                of_key.insert(key, runs.len());
                runs.push(vec![delivery]);
            }
        }
    }
    for run in &mut runs {
        if run.len() > 1 {
            run.sort_by_key(&sequence);
        }
    }
    runs
}

/// What one claim asks for.
#[derive(Debug, Clone, Copy)]
pub struct ClaimRequest<'a> {
    /// The worker's owner name.
    pub owner: &'a str,
    /// The handlers whose deliveries it runs.
    pub handlers: &'a [String],
    /// At most this many deliveries, a run counting as one (see `run`).
    pub limit: u32,
    /// The most deliveries of one key and handler the claim may hand out together, as a run:
    /// the key's next deliveries in sequence order. The worker runs a run's deliveries one
    /// after the other, each only once its predecessor's completion is durable, and gives back
    /// the rest when one does not complete. 1: one delivery of a key at a time. A store may
    /// always hand out fewer (a store without runs, one).
    pub run: u32,
    /// At most this many of the deliveries handed out have a run behind them (a run holds the
    /// worker's handler slot until its last delivery); the others are handed out alone.
    pub runs: u32,
    /// How long the claim holds what it takes without renewal.
    pub lease_duration: Duration,
    /// The current time.
    pub now: Timestamp,
    /// Where wake-ups reported new deliveries since the worker's last claim (MongoDB: lanes),
    /// looked at first; empty otherwise.
    pub reported: &'a [u32],
    /// `reported` lists every place where deliveries were inserted since the worker's last
    /// claim: the wake-up stream was open all along and dropped nothing. A store may then trust
    /// that places it found empty a moment ago received nothing new but what is reported. Pass
    /// `false` when unsure; the claim is then as thorough as without reports.
    pub reports_complete: bool,
    /// What the wake-ups told of each new delivery since the worker's last claim, in the order
    /// they came, when every wake-up told it ([`WakeUp::arrival`]); empty otherwise. A store may
    /// claim these deliveries without looking for them, when `reports_complete` holds.
    pub arrivals: &'a [Arrival],
}

/// What [`Store::claim_next_of_key`] asks for: the next delivery of a key whose delivery the
/// worker just completed, or is completing.
#[derive(Debug, Clone, Copy)]
pub struct NextOfKey<'a, L> {
    /// The worker's owner name.
    pub owner: &'a str,
    /// The lease of the delivery that completed, or whose completion commits meanwhile (see
    /// `committing`).
    pub completed: &'a L,
    /// The completion of `completed` commits while this claim runs: the claim leaves
    /// `completed` listed as running, and the worker starts what it returns only once that
    /// commit succeeded (and says so with [`Store::completion_committed`]), and
    /// [releases](Store::release) it otherwise.
    pub committing: bool,
    /// The key's delivery that completed before `completed` started, when its lane may still
    /// list it (a claim with `committing` left it there): the claim takes it off.
    pub finished: Option<&'a L>,
    /// Its handler.
    pub handler: &'a str,
    /// Its ordering key.
    pub key: &'a str,
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
    /// What the store can tell of the new delivery, for the next claim
    /// ([`ClaimRequest::arrivals`]); `None` when it tells nothing.
    pub arrival: Option<Arrival>,
}

/// How soon a dispatcher wants to hear of new deliveries. It changes as the dispatcher works:
/// see [`Store::watch_paced`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum WakePace {
    /// The dispatcher waits for wake-ups, or may soon: report each new delivery at once.
    #[default]
    Eager,
    /// The dispatcher has been claiming without a pause, and its claims find most new
    /// deliveries without being told: the store may gather wake-ups and report them up to this
    /// long after they commit, where that saves the database work per write.
    Gathered(Duration),
}

/// What a wake-up told of one new delivery, in the store's own encoding (MongoDB: the
/// delivery document as BSON), handed back to the store with the next claim. The bus never
/// looks inside; a store checks what it reads back, since it comes from a stream.
#[derive(Clone, PartialEq, Eq)]
pub struct Arrival(std::sync::Arc<[u8]>);

impl Arrival {
    /// An arrival holding `bytes`.
    pub fn new(bytes: impl Into<std::sync::Arc<[u8]>>) -> Self {
        Arrival(bytes.into())
    }

    /// The bytes the store put in.
    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }
}

impl fmt::Debug for Arrival {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Arrival({} bytes)", self.0.len())
    }
}

/// An event store: the transactional outbox and the delivery queue behind a bus.
///
/// Every method that writes runs in one transaction of the store, or in the caller's
/// ([`append`](Self::append), [`complete_in_transaction`](Self::complete_in_transaction)).
/// Settling methods take the lease a claim returned and change nothing when it no longer
/// holds (another worker took the delivery over): they return `false` then.
///
/// Implementations are checked by the conformance suite in `tests/`, which runs the same
/// behavioural tests against every store.
pub trait Store: Clone + Send + Sync + fmt::Debug + 'static {
    /// The handle of an open transaction, through which business data is written together
    /// with events: `mongodb::ClientSession` for MongoDB.
    type Session: Send + 'static;
    /// A claim's proof of ownership of one delivery.
    type Lease: StoreLease;

    /// The store's name in messages, such as `"MongoDB"`.
    const NAME: &'static str;

    /// Creates what the store needs (tables or collections, indexes), idempotently.
    fn setup(&self) -> impl Future<Output = Result<()>> + Send;

    /// A new session to run transactions on. Refuses a server that has no transactions.
    fn session(&self) -> impl Future<Output = Result<Self::Session>> + Send;

    /// Starts a transaction on `session` with the store's transaction options. `budget`, when
    /// given, bounds the commit on the server as well.
    fn begin(
        &self,
        session: &mut Self::Session,
        budget: Option<Duration>,
    ) -> impl Future<Output = Result<()>> + Send;

    /// Sends the commit once. The caller decides about retries from the error
    /// ([`Error::is_unknown_commit_result`](crate::Error::is_unknown_commit_result),
    /// [`Error::is_transient_transaction_error`](crate::Error::is_transient_transaction_error)).
    fn commit(&self, session: &mut Self::Session) -> impl Future<Output = Result<()>> + Send;

    /// Aborts the transaction; a transaction the server ended already counts as aborted.
    fn abort(&self, session: &mut Self::Session) -> impl Future<Output = ()> + Send;

    /// Refuses a session that has no started transaction, where each write would commit on
    /// its own, with [`ConfigurationError::NoTransaction`](crate::ConfigurationError::NoTransaction).
    fn ensure_in_transaction(
        &self,
        session: &mut Self::Session,
        operation: &'static str,
    ) -> impl Future<Output = Result<()>> + Send;

    /// Appends events with their deliveries in the caller's transaction. An event id the
    /// store holds gets only the deliveries of handlers new to it.
    ///
    /// The requests are validated first, then a session without a started transaction is
    /// refused ([`ConfigurationError::NoTransaction`](crate::ConfigurationError::NoTransaction));
    /// nothing is written in either case.
    fn append(
        &self,
        session: &mut Self::Session,
        requests: &[AppendRequest<'_>],
        now: Timestamp,
    ) -> impl Future<Output = Result<Vec<Appended>>> + Send;

    /// As [`append`](Self::append), in a transaction the caller started with
    /// [`begin`](Self::begin), so the session is not checked.
    fn append_in_transaction(
        &self,
        session: &mut Self::Session,
        requests: &[AppendRequest<'_>],
        now: Timestamp,
    ) -> impl Future<Output = Result<Vec<Appended>>> + Send;

    /// The position of a consumer of a partitioned log, as the transaction of `session` sees
    /// it: the offset of the next record to take, or `None` when the consumer has none there
    /// yet. A consumer reads it inside the transaction that appends what it reads, and moves it
    /// with [`advance_consumer_position`](Self::advance_consumer_position) in that same
    /// transaction, so the appended records and the position commit together: a consumer
    /// that crashes before the commit reads the records again, one that crashes after it
    /// goes on behind them.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`](crate::Error::InvalidArgument) for an empty consumer or
    /// source name, one over 255 bytes or with a control character;
    /// [`ConfigurationError::NoTransaction`](crate::ConfigurationError::NoTransaction) for a
    /// session without a started transaction; database errors.
    fn consumer_position(
        &self,
        session: &mut Self::Session,
        key: &PositionKey<'_>,
    ) -> impl Future<Output = Result<Option<i64>>> + Send;

    /// Moves a consumer's position forward to `next` (the offset of the next record to take)
    /// in the transaction of `session`. A position never moves back: a `next` below the stored
    /// one leaves it as it is.
    ///
    /// # Errors
    ///
    /// As [`consumer_position`](Self::consumer_position), and
    /// [`Error::InvalidArgument`](crate::Error::InvalidArgument) for a negative `next`. Nothing
    /// is written then.
    fn advance_consumer_position(
        &self,
        session: &mut Self::Session,
        key: &PositionKey<'_>,
        next: i64,
        now: Timestamp,
    ) -> impl Future<Output = Result<()>> + Send;

    /// Claims up to `request.limit` due deliveries of the given handlers, one at a time per
    /// key and handler (or one run of them, see [`ClaimRequest::run`]), in sequence order; deliveries appended for a handler named
    /// [unordered](AppendRequest::unordered) are claimed as those of unkeyed events are. With no
    /// other claimer, it returns `limit` deliveries whenever that many are claimable.
    fn claim(
        &self,
        request: ClaimRequest<'_>,
    ) -> impl Future<Output = Result<Vec<Claimed<Self::Lease>>>> + Send;

    /// Claims the next delivery of a key for the worker that just completed its predecessor,
    /// when the store can hand it out at once, without a whole claim: the per-key rules hold as
    /// for [`claim`](Self::claim) (it is the key's lowest pending delivery, due, and nothing of
    /// the key runs). `None` when it cannot tell cheaply; the worker's next claim finds the
    /// delivery then. The default claims nothing.
    fn claim_next_of_key(
        &self,
        request: NextOfKey<'_, Self::Lease>,
    ) -> impl Future<Output = Result<Option<Claimed<Self::Lease>>>> + Send {
        let _ = request;
        async { Ok(None) }
    }

    /// Claims, while a [`claim`](Self::claim) of the same worker runs, deliveries the wake-ups
    /// just told of (`request.arrivals`, up to `request.limit`), when the store can hand them
    /// out at once without waiting for that claim: a new key's delivery then need not wait for
    /// the claim in progress and the next one. The per-key rules hold as for `claim`. What it
    /// leaves is found by the worker's next claim. The default claims nothing.
    fn claim_beside(
        &self,
        request: ClaimRequest<'_>,
    ) -> impl Future<Output = Result<Vec<Claimed<Self::Lease>>>> + Send {
        let _ = request;
        async { Ok(Vec::new()) }
    }

    /// Completes deliveries whose handlers succeeded; one flag per lease, `false` where the
    /// lease no longer held.
    fn complete(
        &self,
        leases: &[Self::Lease],
        now: Timestamp,
    ) -> impl Future<Output = Result<Vec<bool>>> + Send;

    /// Completes a delivery inside the caller's transaction, for transactional handlers. A
    /// session without a started transaction is refused with
    /// [`ConfigurationError::NoTransaction`](crate::ConfigurationError::NoTransaction).
    fn complete_in_transaction(
        &self,
        session: &mut Self::Session,
        lease: &Self::Lease,
        now: Timestamp,
    ) -> impl Future<Output = Result<bool>> + Send;

    /// Tells the store that the transaction in which
    /// [`complete_in_transaction`](Self::complete_in_transaction) completed `lease` has
    /// committed: a store that remembers the claims it handed out until they settle forgets
    /// this one. The default does nothing.
    fn completion_committed(&self, lease: &Self::Lease) {
        let _ = lease;
    }

    /// Gives a delivery back, due now, without charging its attempt.
    fn release(
        &self,
        lease: &Self::Lease,
        now: Timestamp,
    ) -> impl Future<Output = Result<bool>> + Send;

    /// Ends a failed attempt: charged, with its error, due again at `due_at`.
    fn reschedule(
        &self,
        lease: &Self::Lease,
        due_at: Timestamp,
        error: &str,
        now: Timestamp,
    ) -> impl Future<Output = Result<bool>> + Send;

    /// Ends the last failed attempt: the delivery becomes a dead letter with its error.
    fn bury(
        &self,
        lease: &Self::Lease,
        error: &str,
        now: Timestamp,
    ) -> impl Future<Output = Result<bool>> + Send;

    /// Extends the leases of running deliveries to `now + lease_duration`. Returns how many
    /// of `leases` are covered by a renewed lease.
    fn renew(
        &self,
        leases: &[Self::Lease],
        lease_duration: Duration,
        now: Timestamp,
    ) -> impl Future<Output = Result<usize>> + Send;

    /// Hands back everything `owner` holds through this store value (and its clones), for
    /// graceful shutdown. Returns how many units of lease (MongoDB: lanes) it handed back.
    fn relinquish(&self, owner: &str) -> impl Future<Output = Result<u64>> + Send;

    /// Deletes what `options` lets go, in batches.
    fn purge(&self, options: &PurgeOptions) -> impl Future<Output = Result<Purged>> + Send;

    /// Counts deliveries by state.
    fn statistics(&self) -> impl Future<Output = Result<Statistics>> + Send;

    /// Counts deliveries by handler and state, every handler with a pending or dead delivery
    /// listed once, in handler order: what the `relaybus.deliveries` gauges report.
    fn handler_statistics(&self) -> impl Future<Output = Result<Vec<HandlerStatistics>>> + Send;

    /// [`handler_statistics`](Self::handler_statistics) for the delivery gauges, which a
    /// started bus samples on its interval: a store instance that several buses share may
    /// answer them with one count taken less than `max_age` ago, and count once for callers
    /// that ask at the same time. By default, a new count for every call.
    fn gauge_statistics(
        &self,
        max_age: Duration,
    ) -> impl Future<Output = Result<Vec<HandlerStatistics>>> + Send {
        let _ = max_age;
        self.handler_statistics()
    }

    /// Takes or keeps the lead of `role` for `period`: `true` when this store instance holds it
    /// now, `false` when another instance, of this process or another, holds it and its lead
    /// has not expired. For work one process of a deployment does at a time (sampling the
    /// delivery gauges). A store of one process only leads always.
    fn lead(&self, role: &str, period: Duration) -> impl Future<Output = Result<bool>> + Send {
        let _ = (role, period);
        async { Ok(true) }
    }

    /// Lists deliveries, a page at a time.
    fn list_deliveries(
        &self,
        query: &DeliveryQuery,
    ) -> impl Future<Output = Result<Vec<DeliveryRecord>>> + Send;

    /// An event with all its deliveries, completion records included: `None` when the store
    /// holds no event with this id (never seen, or purged).
    fn event_detail(
        &self,
        event_id: &str,
    ) -> impl Future<Output = Result<Option<EventDetail>>> + Send;

    /// Every unit of lease with its holder, and the keys whose deliveries are parked with what
    /// they wait for.
    fn lanes(&self) -> impl Future<Output = Result<LaneReport>> + Send;

    /// Dead letters grouped by handler and last error, the largest groups first, at most
    /// [`MAX_DEAD_LETTER_GROUPS`]; only `handler`'s when given. A group's dead letters are
    /// selected with [`DeliveryQuery::last_error`].
    fn dead_letter_groups(
        &self,
        handler: Option<&str>,
    ) -> impl Future<Output = Result<Vec<DeadLetterGroup>>> + Send;

    /// Deletes dead deliveries for good: dead letters an operator gave up on. An event left
    /// with no delivery counts as finished from `now` (it stays as a deduplication record until
    /// the retention of completed events purges it). Ids that name no dead delivery are
    /// reported, never refused.
    fn discard(
        &self,
        ids: &[String],
        now: Timestamp,
    ) -> impl Future<Output = Result<Discarded>> + Send;

    /// Buries pending deliveries that no worker runs, by id, with `reason` as their error: an
    /// operator's way to free a key stuck behind a delivery that will never succeed. Their
    /// key's later deliveries can then run. Running ones are reported and left to their worker.
    fn bury_by_id(
        &self,
        ids: &[String],
        reason: &str,
        now: Timestamp,
    ) -> impl Future<Output = Result<Buried>> + Send;

    /// Makes dead deliveries pending again.
    fn requeue(
        &self,
        ids: &[String],
        now: Timestamp,
    ) -> impl Future<Output = Result<Requeued>> + Send;

    /// Whether an error a handler returned, from the store's driver, lets the transaction it
    /// ran in run again as a whole (a write conflict, say). Errors of relaybus itself are
    /// recognized without it.
    fn is_transient(error: &(dyn std::error::Error + 'static)) -> bool;

    /// Opens a stream of wake-ups for new deliveries of `handlers`. The dispatcher reopens it
    /// after it fails or ends, and polls meanwhile: correctness never depends on it. A wake-up
    /// may tell where its delivery is ([`WakeUp::at`]) and what it is ([`WakeUp::arrival`]);
    /// the dispatcher hands both back with its next claim.
    fn watch(
        &self,
        handlers: &[String],
    ) -> impl Future<Output = Result<BoxStream<'static, Result<WakeUp>>>> + Send;

    /// [`watch`](Self::watch), told how soon the dispatcher wants its wake-ups: `pace` changes
    /// as it works. A store whose stream costs the database work for every write while it
    /// waits (a MongoDB change stream scans each new oplog entry for every open stream) may
    /// read it less often while the pace is [`WakePace::Gathered`]; every new delivery must
    /// still be reported, only later. The default ignores the pace.
    fn watch_paced(
        &self,
        handlers: &[String],
        pace: tokio::sync::watch::Receiver<WakePace>,
    ) -> impl Future<Output = Result<BoxStream<'static, Result<WakeUp>>>> + Send {
        let _ = pace;
        self.watch(handlers)
    }
}

#[cfg(not(feature = "mongodb"))]
impl StoreLease for NoStore {
    type DeliveryId = String;

    fn delivery_id(&self) -> String {
        match *self {}
    }
}

/// Never called: `NoStore` has no values.
#[cfg(not(feature = "mongodb"))]
impl Store for NoStore {
    type Session = NoStore;
    type Lease = NoStore;

    const NAME: &'static str = "no";

    async fn setup(&self) -> Result<()> {
        match *self {}
    }

    async fn session(&self) -> Result<NoStore> {
        match *self {}
    }

    async fn begin(&self, _: &mut NoStore, _: Option<Duration>) -> Result<()> {
        match *self {}
    }

    async fn commit(&self, _: &mut NoStore) -> Result<()> {
        match *self {}
    }

    async fn abort(&self, _: &mut NoStore) {
        match *self {}
    }

    async fn ensure_in_transaction(&self, _: &mut NoStore, _: &'static str) -> Result<()> {
        match *self {}
    }

    async fn append(
        &self,
        _: &mut NoStore,
        _: &[AppendRequest<'_>],
        _: Timestamp,
    ) -> Result<Vec<Appended>> {
        match *self {}
    }

    async fn append_in_transaction(
        &self,
        _: &mut NoStore,
        _: &[AppendRequest<'_>],
        _: Timestamp,
    ) -> Result<Vec<Appended>> {
        match *self {}
    }

    async fn consumer_position(&self, _: &mut NoStore, _: &PositionKey<'_>) -> Result<Option<i64>> {
        match *self {}
    }

    async fn advance_consumer_position(
        &self,
        _: &mut NoStore,
        _: &PositionKey<'_>,
        _: i64,
        _: Timestamp,
    ) -> Result<()> {
        match *self {}
    }

    async fn claim(&self, _: ClaimRequest<'_>) -> Result<Vec<Claimed<NoStore>>> {
        match *self {}
    }

    async fn complete(&self, _: &[NoStore], _: Timestamp) -> Result<Vec<bool>> {
        match *self {}
    }

    async fn complete_in_transaction(
        &self,
        _: &mut NoStore,
        _: &NoStore,
        _: Timestamp,
    ) -> Result<bool> {
        match *self {}
    }

    async fn release(&self, _: &NoStore, _: Timestamp) -> Result<bool> {
        match *self {}
    }

    async fn reschedule(&self, _: &NoStore, _: Timestamp, _: &str, _: Timestamp) -> Result<bool> {
        match *self {}
    }

    async fn bury(&self, _: &NoStore, _: &str, _: Timestamp) -> Result<bool> {
        match *self {}
    }

    async fn renew(&self, _: &[NoStore], _: Duration, _: Timestamp) -> Result<usize> {
        match *self {}
    }

    async fn relinquish(&self, _: &str) -> Result<u64> {
        match *self {}
    }

    async fn purge(&self, _: &PurgeOptions) -> Result<Purged> {
        match *self {}
    }

    async fn statistics(&self) -> Result<Statistics> {
        match *self {}
    }

    async fn handler_statistics(&self) -> Result<Vec<HandlerStatistics>> {
        match *self {}
    }

    async fn list_deliveries(&self, _: &DeliveryQuery) -> Result<Vec<DeliveryRecord>> {
        match *self {}
    }

    async fn event_detail(&self, _: &str) -> Result<Option<EventDetail>> {
        match *self {}
    }

    async fn lanes(&self) -> Result<LaneReport> {
        match *self {}
    }

    async fn dead_letter_groups(&self, _: Option<&str>) -> Result<Vec<DeadLetterGroup>> {
        match *self {}
    }

    async fn bury_by_id(&self, _: &[String], _: &str, _: Timestamp) -> Result<Buried> {
        match *self {}
    }

    async fn discard(&self, _: &[String], _: Timestamp) -> Result<Discarded> {
        match *self {}
    }

    async fn requeue(&self, _: &[String], _: Timestamp) -> Result<Requeued> {
        match *self {}
    }

    fn is_transient(_: &(dyn std::error::Error + 'static)) -> bool {
        false
    }

    async fn watch(&self, _: &[String]) -> Result<BoxStream<'static, Result<WakeUp>>> {
        match *self {}
    }
}

/// The last count of deliveries by handler a store instance took for the delivery gauges, which
/// the buses sharing the instance report (see [`Store::gauge_statistics`]).
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
