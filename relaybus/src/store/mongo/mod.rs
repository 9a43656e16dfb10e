//! The MongoDB event store.

mod administration;
mod append;
mod boundary;
mod bson_json;
mod claim;
mod complete;
mod idempotency;
mod inspect;
mod key_gate;
mod lane;
mod leadership;
mod lease;
mod limits;
mod operator;
mod park;
mod process;
mod purge;
mod schema;
mod sessions;
mod settle;
mod setup;
mod transaction;
mod upgrade;

use std::{sync::Arc, time::Duration};

use mongodb::{
    Client, Collection, Database,
    bson::{DateTime, Document},
    options::{
        CollectionOptions, ReadConcern, SelectionCriteria, TransactionOptions, WriteConcern,
    },
};
use tokio::sync::OnceCell;

pub use claim::ClaimedDelivery;
pub use lease::Lease;
pub use sessions::DEFAULT_HEARTBEAT_EXPIRY;

use crate::{
    error::{ConfigurationError, DatabaseError, Error},
    time::Timestamp,
};

/// The default collection prefix.
pub const DEFAULT_COLLECTION_PREFIX: &str = "relaybus_";
/// The default number of documents deleted per purge step.
pub const DEFAULT_PURGE_BATCH_SIZE: u32 = 500;
/// How many deliveries of one key a claim must find waiting behind an unfinished predecessor
/// before it parks them, unless [`MongoEventStoreBuilder::park_threshold`] says otherwise.
pub const DEFAULT_PARK_THRESHOLD: u32 = 32;

/// The MongoDB event store: the transactional outbox and the delivery queue of relaybus, kept in
/// the collections of one database.
///
/// Events are appended in the caller's own multi-document transaction, together with the business
/// data, so a committed change always has its events and an aborted one never leaks one. MongoDB
/// has such transactions on replica sets and sharded clusters only: a standalone `mongod` is
/// refused with [`ConfigurationError::NotReplicaSet`].
///
/// The store is cheap to clone; clones share one set of collection handles.
///
/// # Collections
///
/// With the default prefix `relaybus_`: `relaybus_events` (one document per event),
/// `relaybus_deliveries` (one per unfinished event and handler), `relaybus_key_sequences` (one
/// counter per ordering key), `relaybus_lanes` (256 lane documents) and, with
/// [`completion_history`](MongoEventStoreBuilder::completion_history),
/// `relaybus_completed_deliveries`; `relaybus_processes` holds one document per running store
/// instance, for [crash recovery](MongoEventStoreBuilder::heartbeat_expiry).
///
/// # Example
///
/// ```no_run
/// # async fn example() -> Result<(), relaybus::Error> {
/// use relaybus::MongoEventStore;
///
/// let client = mongodb::Client::with_uri_str("mongodb://127.0.0.1:27017/?replicaSet=rs0").await?;
/// let store = MongoEventStore::builder(client).database("shop").build()?;
/// store.setup().await?;
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct MongoEventStore {
    pub(crate) inner: Arc<StoreInner>,
}

pub(crate) struct StoreInner {
    pub(crate) client: Client,
    pub(crate) db: Database,
    pub(crate) prefix: String,
    pub(crate) completion_history: bool,
    /// Whether `setup()` keeps the three listing indexes, and queries may hint them.
    pub(crate) listing_indexes: bool,
    pub(crate) transaction_options: TransactionOptions,
    pub(crate) purge_batch_size: u32,
    /// How many deliveries of one key a claim must find waiting before it parks them.
    pub(crate) park_threshold: u32,
    /// Whether an append looks up the pending deliveries of its keys to write what waits
    /// behind them parked.
    pub(crate) park_behind_pending: bool,
    pub(crate) events: Collection<Document>,
    pub(crate) deliveries: Collection<Document>,
    pub(crate) key_sequences: Collection<Document>,
    /// Consumer positions (`<prefix>consumer_positions`), one per consumer, source and partition.
    pub(crate) consumer_positions: Collection<Document>,
    pub(crate) lanes: Collection<Document>,
    /// The stored answers of idempotent requests (`<prefix>idempotency_keys`).
    pub(crate) idempotency_keys: Collection<Document>,
    pub(crate) completed: Collection<Document>,
    /// Set once the server was seen to support transactions.
    pub(crate) topology_checked: OnceCell<()>,
    /// Set once `setup` succeeded on this instance (or a clone): a service that sets up the
    /// store before the bus starts it runs it once.
    pub(crate) set_up: OnceCell<()>,
    /// This instance's identity and what it remembers of the claims it handed out.
    pub(crate) claims: lease::ClaimRegistry,
    /// The owners claiming through this instance and the other instances' (see `claim::members`).
    pub(crate) members: claim::members::Members,
    /// Crash recovery: one document per store instance, with its sessions and heartbeat.
    pub(crate) processes: Collection<Document>,
    /// The server sessions this instance starts transactions on.
    pub(crate) sessions: sessions::SessionRegistry,
    /// The in-process queues of this instance's transactions for their ordering keys.
    pub(crate) key_gates: key_gate::KeyGates,
    /// The last count of deliveries by handler for the gauges, and when it was taken: the buses
    /// that share this instance sample with one count (see `gauge_statistics`).
    pub(crate) gauge_sample: crate::store::GaugeSample,
}

impl StoreInner {
    /// The collections `setup()` creates: the completion history only when it is kept.
    pub(crate) fn collections(&self) -> Vec<&Collection<Document>> {
        let mut collections = vec![
            &self.events,
            &self.deliveries,
            &self.key_sequences,
            &self.lanes,
            &self.idempotency_keys,
        ];
        if self.completion_history {
            collections.push(&self.completed);
        }
        collections
    }
}

impl std::fmt::Debug for MongoEventStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MongoEventStore")
            .field("database", &self.inner.db.name())
            .field("collection_prefix", &self.inner.prefix)
            .field("completion_history", &self.inner.completion_history)
            .field("listing_indexes", &self.inner.listing_indexes)
            .field("purge_batch_size", &self.inner.purge_batch_size)
            .field("park_threshold", &self.inner.park_threshold)
            .field("park_behind_pending", &self.inner.park_behind_pending)
            .finish_non_exhaustive()
    }
}

impl MongoEventStore {
    /// Starts building a store on a connected client. The store never closes the client.
    pub fn builder(client: Client) -> MongoEventStoreBuilder {
        MongoEventStoreBuilder {
            client,
            database: None,
            collection_prefix: DEFAULT_COLLECTION_PREFIX.to_owned(),
            completion_history: false,
            listing_indexes: true,
            transaction_options: None,
            purge_batch_size: DEFAULT_PURGE_BATCH_SIZE,
            park_threshold: DEFAULT_PARK_THRESHOLD,
            park_behind_pending: false,
            heartbeat_expiry: Some(DEFAULT_HEARTBEAT_EXPIRY),
        }
    }

    /// The client the store was built with.
    pub fn client(&self) -> &Client {
        &self.inner.client
    }

    /// The database holding the store's collections.
    pub fn database(&self) -> &Database {
        &self.inner.db
    }

    /// The full name of one of the store's collections, such as `relaybus_events`.
    pub fn collection_name(&self, suffix: &str) -> String {
        format!("{}{}", self.inner.prefix, suffix)
    }

    /// Whether completed deliveries are kept in `<prefix>completed_deliveries`.
    pub fn completion_history(&self) -> bool {
        self.inner.completion_history
    }

    /// Whether `setup()` keeps the listing indexes; see
    /// [`MongoEventStoreBuilder::listing_indexes`].
    pub fn listing_indexes(&self) -> bool {
        self.inner.listing_indexes
    }

    /// How many deliveries of one key a claim must find waiting before it parks them; see
    /// [`MongoEventStoreBuilder::park_threshold`].
    pub fn park_threshold(&self) -> u32 {
        self.inner.park_threshold
    }

    /// Whether an append looks up the pending deliveries of its keys; see
    /// [`MongoEventStoreBuilder::park_behind_pending`].
    pub fn park_behind_pending(&self) -> bool {
        self.inner.park_behind_pending
    }

    /// The number of documents deleted per purge step.
    pub fn purge_batch_size(&self) -> u32 {
        self.inner.purge_batch_size
    }
}

/// Builds a [`MongoEventStore`]; made by [`MongoEventStore::builder`].
#[must_use]
#[derive(Debug)]
pub struct MongoEventStoreBuilder {
    client: Client,
    database: Option<String>,
    collection_prefix: String,
    completion_history: bool,
    listing_indexes: bool,
    transaction_options: Option<TransactionOptions>,
    purge_batch_size: u32,
    park_threshold: u32,
    park_behind_pending: bool,
    heartbeat_expiry: Option<Duration>,
}

impl MongoEventStoreBuilder {
    /// The database for the collections. Defaults to the connection string's default database.
    ///
    /// 1 to 63 characters of ASCII letters, digits, `_` and `-`.
    pub fn database(mut self, name: impl Into<String>) -> Self {
        self.database = Some(name.into());
        self
    }

    /// The prefix of the collection names, `relaybus_` by default.
    pub fn collection_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.collection_prefix = prefix.into();
        self
    }

    /// Keep an append-only record of completed deliveries in `<prefix>completed_deliveries`.
    /// Off by default. Every process sharing the store must use the same value.
    pub fn completion_history(mut self, enabled: bool) -> Self {
        self.completion_history = enabled;
        self
    }

    /// Keep the three indexes of the deliveries collection that serve only operator listings
    /// and the purge of dead letters: `status_updated` (`status`, `updatedAt`),
    /// `handler_created` (`handler`, `createdAt`) and `type_created` (`eventType`,
    /// `createdAt`). On by default.
    ///
    /// Every delivery is inserted once and deleted once, and each write updates every index of
    /// the collection: turned off, a delivery is an entry in seven secondary indexes instead of
    /// ten, which makes publishing and delivering cheaper. What it costs: a listing filtered by
    /// handler or event type finds its deliveries through the status index (or in id order) and
    /// skips the others, instead of reading only that handler's or type's; a purge of dead
    /// letters reads every dead delivery through `status_created` and keeps the old ones,
    /// instead of reading only the old ones. Results are the same either way; only these
    /// operator queries get slower on a large backlog. Status counts, claims and the other
    /// indexes are unaffected.
    ///
    /// Off, [`setup()`](MongoEventStore::setup) does not create these indexes and drops them
    /// when they exist, so turning it off on an existing database takes effect at the next
    /// setup; turning it back on creates them again (an index build over the collection). Every
    /// process that runs `setup()` on the store must use the same value, or each setup undoes
    /// the other's.
    ///
    /// ```no_run
    /// # async fn example() -> Result<(), relaybus::Error> {
    /// use relaybus::MongoEventStore;
    ///
    /// let client = mongodb::Client::with_uri_str("mongodb://127.0.0.1:27017/?replicaSet=rs0").await?;
    /// let store = MongoEventStore::builder(client)
    ///     .database("shop")
    ///     .listing_indexes(false)
    ///     .build()?;
    /// store.setup().await?; // drops `status_updated`, `handler_created` and `type_created`
    /// # Ok(())
    /// # }
    /// ```
    pub fn listing_indexes(mut self, enabled: bool) -> Self {
        self.listing_indexes = enabled;
        self
    }

    /// The options of the store's transactions. The default reads with snapshot read concern,
    /// commits with write concern `majority` and runs on the primary.
    pub fn transaction_options(mut self, options: TransactionOptions) -> Self {
        self.transaction_options = Some(options);
        self
    }

    /// How many documents a purge deletes per step, 500 by default (1 to 100,000).
    pub fn purge_batch_size(mut self, size: u32) -> Self {
        self.purge_batch_size = size;
        self
    }

    /// How many deliveries of one key a claim must find waiting behind an unfinished
    /// predecessor before it parks them: moves them out of the claim index, to be moved back
    /// one at a time as their predecessors finish. 32 by default
    /// ([`DEFAULT_PARK_THRESHOLD`], the specification's figure); at least 1, and `u32::MAX`
    /// parks no backlog. A claim that hands a lane back still parks what waits there, however
    /// few.
    ///
    /// An append writes parked the deliveries of new events that wait behind another of the
    /// same append with the same handler and key, and with
    /// [`park_behind_pending`](Self::park_behind_pending) those that wait behind a pending one
    /// written before, unless the threshold is `u32::MAX`: they cost no write of their own then
    /// (see the README's differences from the specification).
    ///
    /// Parking spares the claims a scan over the waiting deliveries of a blocked key, at the
    /// price of two more writes of each of them (parked, then moved back) and of index entries
    /// the claims' reads step over until the storage engine purges them. Which drains a
    /// backlog faster, and keeps the latency of other keys' work lower, depends on the shape of
    /// the backlog: the README's benchmark section has figures for backlogs of a few hundred
    /// deliveries per key. Every process claiming from the store should use the same value.
    ///
    /// ```no_run
    /// # async fn example() -> Result<(), relaybus::Error> {
    /// use relaybus::MongoEventStore;
    ///
    /// let client = mongodb::Client::with_uri_str("mongodb://127.0.0.1:27017/?replicaSet=rs0").await?;
    /// let store = MongoEventStore::builder(client)
    ///     .database("shop")
    ///     .park_threshold(u32::MAX) // never park a key's backlog
    ///     .build()?;
    /// # Ok(())
    /// # }
    /// ```
    pub fn park_threshold(mut self, deliveries: u32) -> Self {
        self.park_threshold = deliveries;
        self
    }

    /// Whether an append looks up, for the keys of its new events, whether a delivery of the
    /// same handler and key is pending, and writes the new one parked when it is; off by
    /// default. An append always writes parked what waits behind a delivery of the same
    /// append.
    ///
    /// On, a key's backlog published one event per transaction is never parked by the claims,
    /// one write per delivery (the README's "Appends that park" has figures: the server's
    /// work per keyed delivery drained fell by a fifth to a third), for one more read in each
    /// publishing transaction with keyed events (keyed publishing took a fifth to a third
    /// longer). Worth it where drains of keyed backlogs are the bottleneck rather than the
    /// publishing requests. Off with `park_threshold(u32::MAX)`.
    ///
    /// ```no_run
    /// # async fn example() -> Result<(), relaybus::Error> {
    /// use relaybus::MongoEventStore;
    ///
    /// let client = mongodb::Client::with_uri_str("mongodb://127.0.0.1:27017/?replicaSet=rs0").await?;
    /// let store = MongoEventStore::builder(client)
    ///     .database("shop")
    ///     .park_behind_pending(true)
    ///     .build()?;
    /// # Ok(())
    /// # }
    /// ```
    pub fn park_behind_pending(mut self, enabled: bool) -> Self {
        self.park_behind_pending = enabled;
        self
    }

    /// How soon the open transactions of a process that died are aborted: 10 seconds by
    /// default ([`DEFAULT_HEARTBEAT_EXPIRY`]), 1 second to 10 minutes.
    ///
    /// MongoDB aborts a transaction whose client died only after
    /// `transactionLifetimeLimitSeconds` (60 s by default); until then it holds what it wrote,
    /// and every transaction writing the same documents (the next publish on its ordering key)
    /// conflicts. So each store instance records the server sessions it starts transactions on
    /// in the `<prefix>processes` collection, with a heartbeat every quarter of `expiry`, and
    /// kills (`killSessions`) the sessions of any process whose heartbeat is older than
    /// `expiry`. A process paused for longer than `expiry` loses its open transactions: they
    /// fail with a transient error and run again. On Linux, a process of the same host (and
    /// user) that is gone is recognised sooner: its sessions are killed at the next sweep of a
    /// live instance of that host, and at once by a process that starts after it died (a
    /// restart). A stopped process is not gone: only `expiry` ends its sessions.
    ///
    /// The heartbeat costs each instance one small write every `expiry / 4` (0.4 writes/s at
    /// the default 10 s, 2 writes/s at 2 s) and one read for the sweep; a shorter expiry ends
    /// the sessions of a dead process on another host sooner, and those of a process that
    /// only paused (a long garbage collection in a neighbour, a stopped container) sooner too.
    ///
    /// Transactions started with this store (its `transaction`, the bus's, the request layer's,
    /// transactional handlers) are covered; a session on which you call `start_transaction()`
    /// yourself is not. With access control on, the database user needs the `killAnySession`
    /// privilege on the cluster to kill the sessions of other processes of the same user.
    pub fn heartbeat_expiry(mut self, expiry: Duration) -> Self {
        self.heartbeat_expiry = Some(expiry);
        self
    }

    /// Turns crash recovery (see [`heartbeat_expiry`](Self::heartbeat_expiry)) off or on; on by
    /// default. Off, a dead process's transactions stay open until the server aborts them.
    pub fn crash_recovery(mut self, enabled: bool) -> Self {
        self.heartbeat_expiry = if enabled {
            self.heartbeat_expiry.or(Some(DEFAULT_HEARTBEAT_EXPIRY))
        } else {
            None
        };
        self
    }

    /// Validates the options and builds the store. Makes no database call.
    ///
    /// # Errors
    ///
    /// [`ConfigurationError`] for an invalid database name or collection prefix, a missing
    /// database, a purge batch size out of range, or a park threshold of 0.
    pub fn build(self) -> Result<MongoEventStore, ConfigurationError> {
        let database = match self.database {
            Some(name) => name,
            None => self
                .client
                .default_database()
                .map(|db| db.name().to_owned())
                .ok_or(ConfigurationError::MissingDatabase)?,
        };
        validate_database_name(&database)?;
        validate_prefix(&self.collection_prefix)?;
        if !(1..=100_000).contains(&self.purge_batch_size) {
            return Err(ConfigurationError::InvalidOption {
                option: "purge_batch_size",
                reason: format!("{} is out of range; use 1 to 100000", self.purge_batch_size),
            });
        }
        if self.park_threshold == 0 {
            return Err(ConfigurationError::InvalidOption {
                option: "park_threshold",
                reason: "0 would park deliveries that wait for nothing; use 1 or more \
                         (u32::MAX parks no backlog)"
                    .to_owned(),
            });
        }
        if let Some(expiry) = self.heartbeat_expiry
            && !(Duration::from_secs(1)..=Duration::from_secs(600)).contains(&expiry)
        {
            return Err(ConfigurationError::InvalidOption {
                option: "heartbeat_expiry",
                reason: format!("{expiry:?} is out of range; use 1 second to 10 minutes"),
            });
        }
        let transaction_options = self.transaction_options.unwrap_or_else(|| {
            TransactionOptions::builder()
                .read_concern(ReadConcern::snapshot())
                .write_concern(WriteConcern::majority())
                .selection_criteria(SelectionCriteria::ReadPreference(
                    mongodb::options::ReadPreference::Primary,
                ))
                .build()
        });
        // Writes outside transactions (claims, lane hand-backs, completions, setup) always use
        // majority write concern and read from the primary, whatever the client's defaults are:
        // a lease or a completion acknowledged once survives a failover, and no claim reads a
        // stale secondary.
        let db = self.client.database_with_options(
            &database,
            mongodb::options::DatabaseOptions::builder()
                .write_concern(WriteConcern::majority())
                .read_concern(ReadConcern::majority())
                .selection_criteria(SelectionCriteria::ReadPreference(
                    mongodb::options::ReadPreference::Primary,
                ))
                .build(),
        );
        let prefix = self.collection_prefix;
        let collection = |suffix: &str| {
            db.collection_with_options::<Document>(
                &format!("{prefix}{suffix}"),
                CollectionOptions::builder().build(),
            )
        };
        let inner = StoreInner {
            events: collection("events"),
            deliveries: collection("deliveries"),
            key_sequences: collection("key_sequences"),
            consumer_positions: collection("consumer_positions"),
            lanes: collection("lanes"),
            idempotency_keys: collection("idempotency_keys"),
            completed: collection("completed_deliveries"),
            processes: collection("processes"),
            sessions: sessions::SessionRegistry::new(self.heartbeat_expiry),
            key_gates: key_gate::KeyGates::default(),
            client: self.client,
            db,
            prefix,
            completion_history: self.completion_history,
            listing_indexes: self.listing_indexes,
            transaction_options,
            purge_batch_size: self.purge_batch_size,
            park_threshold: self.park_threshold,
            park_behind_pending: self.park_behind_pending,
            topology_checked: OnceCell::new(),
            set_up: OnceCell::new(),
            claims: lease::ClaimRegistry::default(),
            members: claim::members::Members::default(),
            gauge_sample: crate::store::GaugeSample::default(),
        };
        Ok(MongoEventStore {
            inner: Arc::new(inner),
        })
    }
}

/// Databases MongoDB keeps for itself: `local` is never replicated and allows no transactions,
/// `admin` and `config` hold the server's and the cluster's own state.
const RESERVED_DATABASES: [&str; 3] = ["admin", "local", "config"];

fn validate_database_name(name: &str) -> Result<(), ConfigurationError> {
    let reason = if name.is_empty() {
        Some("it is empty")
    } else if name.len() > 63 {
        Some("it is longer than 63 characters")
    } else if !name
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
    {
        Some("it contains a character other than ASCII letters, digits, `_` and `-`")
    } else if RESERVED_DATABASES
        .iter()
        .any(|reserved| reserved.eq_ignore_ascii_case(name))
    {
        Some("it is reserved by MongoDB for its own data (`local` is not even replicated)")
    } else {
        None
    };
    match reason {
        Some(reason) => Err(ConfigurationError::InvalidDatabaseName {
            name: name.to_owned(),
            reason,
        }),
        None => Ok(()),
    }
}

fn validate_prefix(prefix: &str) -> Result<(), ConfigurationError> {
    let reason = if prefix.len() > 32 {
        Some("it is longer than 32 characters")
    } else if !prefix
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-' || b == b'.')
    {
        Some("it contains a character other than ASCII letters, digits, `_`, `-` and `.`")
    } else if prefix.starts_with("system.") {
        Some("collections named `system.*` are reserved by MongoDB")
    } else if prefix.starts_with('.') {
        Some("a collection name cannot start with `.`")
    } else {
        None
    };
    match reason {
        Some(reason) => Err(ConfigurationError::InvalidCollectionPrefix {
            prefix: prefix.to_owned(),
            reason,
        }),
        None => Ok(()),
    }
}

impl From<mongodb::error::Error> for DatabaseError {
    /// Keeps the driver error, and reads its labels: `TransientTransactionError`,
    /// `UnknownTransactionCommitResult`, and the `MaxTimeMSExpired` code.
    fn from(error: mongodb::error::Error) -> Self {
        use mongodb::error::{TRANSIENT_TRANSACTION_ERROR, UNKNOWN_TRANSACTION_COMMIT_RESULT};
        let transient = error.contains_label(TRANSIENT_TRANSACTION_ERROR);
        let unknown = error.contains_label(UNKNOWN_TRANSACTION_COMMIT_RESULT);
        let timeout = error_code(&error) == Some(MAX_TIME_MS_EXPIRED);
        DatabaseError::new(error)
            .with_transient(transient)
            .with_unknown_commit_result(unknown)
            .with_timeout(timeout)
    }
}

impl From<mongodb::error::Error> for Error {
    fn from(error: mongodb::error::Error) -> Self {
        Error::Database(error.into())
    }
}

/// `MaxTimeMSExpired`: an operation or commit ran past its time limit.
const MAX_TIME_MS_EXPIRED: i32 = 50;

/// The MongoDB driver's error behind an error, if there is one.
pub(crate) trait DriverError {
    /// The driver's error.
    fn driver(&self) -> Option<&mongodb::error::Error>;
}

impl DriverError for mongodb::error::Error {
    fn driver(&self) -> Option<&mongodb::error::Error> {
        Some(self)
    }
}

impl DriverError for DatabaseError {
    fn driver(&self) -> Option<&mongodb::error::Error> {
        self.downcast_ref()
    }
}

impl From<DateTime> for Timestamp {
    fn from(at: DateTime) -> Self {
        timestamp(at)
    }
}

impl From<Timestamp> for DateTime {
    fn from(at: Timestamp) -> Self {
        bson_date(at)
    }
}

/// A stored date as a timestamp.
pub(crate) fn timestamp(at: DateTime) -> Timestamp {
    Timestamp::from_millis(at.timestamp_millis())
}

/// A timestamp as a stored date.
pub(crate) fn bson_date(at: Timestamp) -> DateTime {
    DateTime::from_millis(at.timestamp_millis())
}

/// The server error code of a driver error, if it has one.
pub(crate) fn error_code<E: DriverError + ?Sized>(error: &E) -> Option<i32> {
    use mongodb::error::{ErrorKind, WriteFailure};
    match error.driver()?.kind.as_ref() {
        ErrorKind::Command(e) => Some(e.code),
        ErrorKind::Write(WriteFailure::WriteError(e)) => Some(e.code),
        ErrorKind::Write(WriteFailure::WriteConcernError(e)) => Some(e.code),
        ErrorKind::InsertMany(e) => e
            .write_errors
            .as_ref()
            .and_then(|errors| errors.first().map(|e| e.code))
            .or_else(|| e.write_concern_error.as_ref().map(|e| e.code)),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn database_names() {
        assert!(validate_database_name("shop").is_ok());
        assert!(validate_database_name("a-b_C9").is_ok());
        assert!(validate_database_name(&"a".repeat(63)).is_ok());
        for bad in [
            "", "a.b", "a b", "a$", "é", "admin", "local", "config", "Local",
        ] {
            assert!(validate_database_name(bad).is_err(), "{bad}");
        }
        assert!(validate_database_name(&"a".repeat(64)).is_err());
    }

    #[test]
    fn prefixes() {
        assert!(validate_prefix("").is_ok());
        assert!(validate_prefix("relaybus_").is_ok());
        assert!(validate_prefix("app.rb_").is_ok());
        for bad in ["a$", "system.x", ".a", "a b"] {
            assert!(validate_prefix(bad).is_err(), "{bad}");
        }
    }
}
