//! The PostgreSQL event store: events and deliveries in tables of one schema, appended in the
//! caller's own transaction, next to the business data.
//!
//! [`PostgresEventStore`] implements [`Store`](crate::Store) on [sqlx](https://docs.rs/sqlx)
//! (0.8, its runtime query functions only: no query needs a database at build time). Business
//! code writes its rows through the transaction's [`PostgresSession`], which dereferences to
//! sqlx's `PgConnection`, so a committed change always has its events and a rolled-back one
//! never leaks one.
//!
//! # Example
//!
//! ```no_run
//! use relaybus::{Event, PostgresEventStore, PostgresSession, RelayBus};
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
//! let pool = sqlx::PgPool::connect("postgres://postgres@127.0.0.1:5432/shop").await?;
//! let store = PostgresEventStore::builder(pool.clone()).schema("relaybus").build()?;
//! store.setup().await?;
//! let bus = RelayBus::builder(store).without_registered_handlers().build()?;
//!
//! // The bus's transaction: run again as a whole after a serialization failure or deadlock.
//! bus.transaction(async |session| {
//!     sqlx::query("INSERT INTO orders (id) VALUES ($1)")
//!         .bind("o-1")
//!         .execute(&mut **session)
//!         .await?;
//!     bus.publish(&OrderPlaced { order_id: "o-1".into() })
//!         .key("o-1")
//!         .session(session)
//!         .await?;
//!     Ok(())
//! })
//! .await?;
//!
//! // Or inside a transaction you started yourself.
//! let mut session = PostgresSession::from(pool.begin().await?);
//! sqlx::query("INSERT INTO orders (id) VALUES ($1)")
//!     .bind("o-2")
//!     .execute(&mut *session)
//!     .await?;
//! bus.publish(&OrderPlaced { order_id: "o-2".into() })
//!     .session(&mut session)
//!     .await?;
//! if let Ok(transaction) = session.into_transaction() {
//!     transaction.commit().await?;
//! }
//! # Ok(())
//! # }
//! ```
//!
//! # Tables
//!
//! In the schema given to [`PostgresEventStoreBuilder::schema`] (`relaybus` by default), made
//! by [`setup`](PostgresEventStore::setup):
//!
//! - `events`: one row per event id (payload and headers as `json`, kept byte for byte), with
//!   the handlers it was ever delivered to (`handlers text[]`, which deduplicates a retried
//!   publish) and when its last delivery finished (`completed_at`, read by purge). Its only
//!   index is the primary key, and it keeps 30% of each page free (fill factor 70), so that
//!   the completion stamp is a heap-only update too.
//! - `deliveries`: one row per unfinished event and handler, `pending` or `dead`, with a
//!   `bigint` identity id (the delivery id of leases and listings), the event's key and
//!   sequence, `unordered`, `parked`, the attempt count and error history, the claim generation
//!   `claims`, and the lease: `lease_owner`, `lease_instance`, `lease_expires_at`. A foreign key
//!   holds every delivery to its event. The table keeps half of each page free (fill factor
//!   50) and no index reads the lease or the claim generation, so that a claim, which writes
//!   only those, updates its rows in place (heap-only tuples) without writing index entries;
//!   `relinquish` and the lane report, which look for running deliveries, scan the table. Its
//!   indexes: the primary key, `(event_id, handler)`, the claim index (unparked pending
//!   deliveries in due order), two of keyed ordered deliveries (which unkeyed ones never
//!   enter) and one of dead letters; listings filtered by handler scan.
//! - `key_sequences`: one counter row per ordering key.
//! - `completed_deliveries`: completion records, with
//!   [`completion_history`](PostgresEventStoreBuilder::completion_history).
//! - `idempotency_keys`: the stored first answer of each idempotent request
//!   ([`IdempotentRequests`](crate::store::IdempotentRequests)), by the SHA-256 of its key and
//!   scope, with an index of its expiry for purge. A transaction takes a key with an advisory
//!   lock on its id, held until it ends.
//! - `leads`: one row per [`lead`](crate::store::Leadership::lead) role, with its holder and
//!   expiry. [`keep_lead`](crate::store::Leadership::keep_lead) updates the row in the caller's
//!   transaction, whose row lock makes a take-over wait for it.
//! - `slots`: one row per slot of a handler's global concurrency taken since it was last given
//!   back, with its holder and expiry ([`Limits`](crate::store::Limits)); `rate_windows`: one
//!   row per rate-limited handler, with its current window and its starts there.
//!
//! Times are `bigint` milliseconds since the epoch, as the store's callers give them (the
//! store takes an explicit `now`); only leads use the server's clock.
//!
//! # How it works
//!
//! - **Append of new unkeyed events** (the common case) is one statement: it inserts the
//!   events, their deliveries and the wake-up only if the store holds none of the batch's ids,
//!   and otherwise writes nothing and leaves the batch to the general path below.
//! - **Append** (in the caller's transaction, `READ COMMITTED` or stricter): it locks the
//!   counter rows of the batch's keys first, in key order (`INSERT .. ON CONFLICT DO UPDATE`,
//!   a row lock that concurrent appenders of a key wait for instead of failing), then reads
//!   and locks the stored events of the batch's ids (`FOR UPDATE`), numbers the new keyed
//!   events from the counters and writes events and deliveries. Appenders of one key run one
//!   after the other, so a key's sequence is gapless and equals commit order, and an aborted
//!   append gives its numbers back with its locks. A known id gets only the deliveries of
//!   handlers not in its `handlers`. An unkeyed id inserted by a concurrent transaction after
//!   this one looked is a transient error, so the transaction runs again and finds it.
//! - **Per-key order by parking.** Of the pending deliveries of one handler and key held to
//!   the key's order, only the one with the lowest sequence (the head) is claimable; the others
//!   are `parked`. Every write that adds or ends such a delivery (append, completion, burial,
//!   requeue, an operator's burial) holds the key's counter row lock and then moves the head
//!   in the same transaction, so a key's backlog is parked when its head's transaction
//!   commits and never in the claim index: a key with ten thousand waiting deliveries costs a
//!   claim nothing. Unordered deliveries are never parked and park nothing.
//! - **Claims** are one statement: `FOR UPDATE SKIP LOCKED` over a partial index of the
//!   unparked pending deliveries, due order, taking those with no lease or an expired one.
//!   Concurrent claimers skip each other's rows instead of waiting; the claimed rows are
//!   updated through their primary key and returned with their events. Each claim bumps the
//!   delivery's claim generation, which the lease carries; taking over an expired lease charges
//!   the lost attempt (and records it, without an attempt number, in the error history). An
//!   owner never takes over what it runs itself through the same store instance (its process
//!   still runs it); a restarted process is a new instance, and takes over once the lease
//!   expired.
//! - **Fencing.** Every settlement (complete, release, reschedule, bury, renew) matches the
//!   delivery id *and* the claim generation of its lease, and every end of a claim moves the
//!   generation on, so a stale worker's lease matches nothing once another claim took the
//!   delivery, whatever the clocks say. A lease that expired but was not taken over is still
//!   honoured.
//! - **Completion** deletes the deliveries (found by primary key, fenced by their claim
//!   generation), writes their completion records when history is on and stamps
//!   `completed_at` on their events, in one statement and one round trip when no delivery of
//!   the batch is held to its key's order. When one is, that statement writes nothing, and
//!   one simple query of two statements (one round trip, one transaction) locks the keys of
//!   the batch, then deletes, records and stamps as above and moves the keys' heads: the
//!   second statement's snapshot is taken once the locks are held, so it sees every append of
//!   those keys. `complete_in_transaction` does the same in the handler's transaction, so the
//!   handler's writes commit with it or not at all.
//! - **Wake-ups.** An append sends one `pg_notify` per call on the channel `relaybus:<schema>`
//!   with the handlers it added deliveries for; PostgreSQL delivers it at commit and drops it
//!   on rollback. [`watch`](crate::store::Queue::watch) listens with sqlx's `PgListener`. Polling
//!   stays the safety net.
//! - **Purge** deletes in batches (`FOR UPDATE SKIP LOCKED`): dead deliveries, completion
//!   records, then events nothing references any more whose last completion (or, never
//!   completed, their creation) is before the cutoff. An append that adds a delivery to a
//!   known event holds its row lock, so purge skips it.
//! - **Lock order.** The store's writes take locks in one order: key counters (sorted by key),
//!   then events, then deliveries; claims lock deliveries only and skip what is locked. So the
//!   store's own transactions wait for each other rather than deadlock, except for an append
//!   that adds handlers to a known event published under another key than it was stored with
//!   (the stored key is locked after the event); a deadlock there, or with the business rows of
//!   a caller's transaction, is transient and runs again.
//! - **Leads** are rows with an expiry by the server's clock, taken with one conditional upsert.
//! - **Setup** runs under a transaction-level advisory lock, so concurrent setups of one schema
//!   (processes starting together) wait for each other instead of failing.
//!
//! Serialization failures (`40001`) and deadlocks (`40P01`) are transient errors
//! ([`DatabaseError::is_transient`](crate::DatabaseError::is_transient)): the transaction
//! helpers run the whole transaction again.
//!
//! # What each operation costs
//!
//! Round trips to the server and rows written, per call; every commit outside the caller's
//! transaction flushes the WAL once. "HOT": the row is rewritten on its page and no index
//! entry is written.
//!
//! | Operation | Round trips | Writes |
//! |---|---|---|
//! | append, new unkeyed events | 1 statement (in the caller's transaction) | per event 1 row + 1 index entry; per delivery 1 row + 3 index entries (primary key, `(event_id, handler)`, claim); 1 notification |
//! | append, keyed or known events | up to 7 statements | as above, plus the key counter rows (HOT), the ordering indexes of keyed deliveries, and the parking of the keys' waiting deliveries |
//! | claim | 1 (its own commit) | per delivery 1 HOT row version (lease, claim generation; an expired lease's charged attempt) |
//! | complete, no ordered delivery | 1 (its own commit) | per delivery: the row deleted, its event's stamp (HOT), a completion record with history (1 row + 3 index entries) |
//! | complete, with ordered deliveries | 2 (the first writes nothing; one commit) | as above, plus the key counter row locks and, per key, the next delivery unparked (1 row + its claim index entry) |
//! | release, reschedule | 1 | 1 row version with a new due time (in the claim index: an entry in each index) |
//! | bury | a transaction of up to 4 statements | the row (`status` changes: an entry in each index), the key's head moved |
//! | renew | 1 per batch | 1 HOT row version per delivery |
//!
//! So an unkeyed delivery of one handler costs, from publish to completion, one statement in
//! the publishing transaction, a share of one claim and of one completion (each a commit of
//! the store's own, batched up to the dispatcher's batch size), and 4 index entries.
//!
//! # Differences from the MongoDB store
//!
//! - **Leases are per delivery, not per lane.** MongoDB has no row locks that wait, so its store
//!   shares deliveries out through 256 lane documents and fences with lane epochs. PostgreSQL has
//!   `FOR UPDATE SKIP LOCKED`, so each delivery carries its own lease and claim generation, and
//!   concurrent claimers never conflict. [`lanes`](crate::store::Inspect::lanes) still reports 256
//!   lanes (the FNV-1a hash of the key or event id, as MongoDB's), each with the deliveries running
//!   in it, for the operator page; `epoch` and `lost` are always 0.
//! - **No reported lanes.** Wake-ups carry no lane (`WakeUp::at` is `None`), and
//!   `ClaimRequest::reported` is ignored: a claim reads the claim index in due order anyway.
//! - **No crash recovery process table.** PostgreSQL aborts the transaction of a connection
//!   that dies, so a killed process holds no key lock for longer than its TCP connection lives;
//!   no `processes` table or heartbeat is needed. (Set `idle_in_transaction_session_timeout`
//!   on the server against clients that hang instead of dying.)
//! - **A relinquished running delivery is charged at once.** `relinquish` hands back the
//!   deliveries the owner still runs through this store value, charging each its attempt then,
//!   where MongoDB charges it when the lane is taken next.
//! - **An ordered delivery waits only for ordered ones.** A delivery held to its key's order
//!   waits for the lower sequences of its handler and key that are held to the order too; the
//!   MongoDB store also makes it wait for unordered ones.
//! - **`NOTIFY` serializes committing appenders.** PostgreSQL takes a global lock at the
//!   commit of a transaction that notified; the store notifies once per append call, not per
//!   event.

mod administration;
mod append;
mod boundary;
mod checks;
mod claim;
mod executor;
mod idempotency;
mod leadership;
mod limits;
mod operator;
mod session;
mod settle;
mod setup;

use std::{fmt, sync::Arc};

use futures::future::BoxFuture;
use sqlx::{PgConnection, PgPool};

pub use claim::PostgresLease;
pub use session::PostgresSession;

use crate::{
    error::{ConfigurationError, DatabaseError, Error, Result},
    store::transaction::{self, Attempts, Boxed, RETRY_LIMIT},
};

/// The default schema.
pub const DEFAULT_SCHEMA: &str = "relaybus";
/// The default number of rows deleted per purge step.
pub const DEFAULT_PURGE_BATCH_SIZE: u32 = 500;
/// The longest schema name, in bytes: the channel `relaybus:<schema>` must stay within
/// PostgreSQL's 63-byte identifiers.
const MAX_SCHEMA_BYTES: usize = 48;

/// The PostgreSQL event store: the transactional outbox and the delivery queue of relaybus, in
/// the tables of one schema. See the [module documentation](self) for the design.
///
/// The store is cheap to clone; clones share the pool and are one store instance (one
/// [`relinquish`](crate::store::Queue::relinquish) scope, one
/// [`lead`](crate::store::Leadership::lead) holder).
///
/// # Example
///
/// ```no_run
/// # async fn example() -> Result<(), relaybus::Error> {
/// use relaybus::PostgresEventStore;
///
/// let pool = sqlx::PgPool::connect("postgres://postgres@127.0.0.1:5432/shop").await?;
/// let store = PostgresEventStore::builder(pool).schema("relaybus").build()?;
/// store.setup().await?;
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct PostgresEventStore {
    pub(crate) inner: Arc<Inner>,
}

pub(crate) struct Inner {
    pub(crate) pool: PgPool,
    pub(crate) schema: String,
    /// The schema as a quoted identifier, for SQL text.
    pub(crate) ident: String,
    pub(crate) completion_history: bool,
    pub(crate) purge_batch_size: u32,
    /// This store instance, for leases handed back by `relinquish` and for leads.
    pub(crate) instance: String,
    /// The last count of deliveries by handler for the gauges: the buses that share this
    /// instance sample with one count.
    pub(crate) gauge_sample: crate::store::GaugeSample,
    /// Set once `setup` succeeded, so that it runs once per store value and its clones.
    pub(crate) set_up: tokio::sync::OnceCell<()>,
}

impl fmt::Debug for PostgresEventStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PostgresEventStore")
            .field("schema", &self.inner.schema)
            .field("completion_history", &self.inner.completion_history)
            .field("purge_batch_size", &self.inner.purge_batch_size)
            .finish_non_exhaustive()
    }
}

impl PostgresEventStore {
    /// Starts building a store on a connection pool. The store never closes the pool.
    pub fn builder(pool: PgPool) -> PostgresEventStoreBuilder {
        PostgresEventStoreBuilder {
            pool,
            schema: DEFAULT_SCHEMA.to_owned(),
            completion_history: false,
            purge_batch_size: DEFAULT_PURGE_BATCH_SIZE,
        }
    }

    /// The pool the store was built with.
    pub fn pool(&self) -> &PgPool {
        &self.inner.pool
    }

    /// The schema holding the store's tables.
    pub fn schema(&self) -> &str {
        &self.inner.schema
    }

    /// Whether completed deliveries are kept in `completed_deliveries`.
    pub fn completion_history(&self) -> bool {
        self.inner.completion_history
    }

    /// The channel appends notify on: `relaybus:<schema>`.
    pub fn channel(&self) -> String {
        format!("relaybus:{}", self.inner.schema)
    }

    /// `template` with every `{s}` replaced by the quoted schema.
    pub(crate) fn sql(&self, template: &str) -> String {
        template.replace("{s}", &self.inner.ident)
    }

    /// Runs `work` with `context` in a transaction of its own on a pooled connection, running
    /// it again after a transient error (a deadlock, a serialization failure) for up to
    /// [`RETRY_LIMIT`].
    pub(crate) async fn own_transaction<C, R, F>(&self, context: &C, work: F) -> Result<R>
    where
        C: Sync + ?Sized,
        F: for<'c> FnMut(&'c mut PgConnection, &'c C) -> BoxFuture<'c, Result<R>> + Send,
        R: Send,
    {
        let attempts = Attempts::new(None).retry_for(RETRY_LIMIT);
        let body = Boxed::new(
            (context, work),
            |session: &mut PostgresSession, (context, work)| work(session.connection(), context),
        );
        transaction::attempt_until_committed(self, attempts, body).await
    }
}

/// Builds a [`PostgresEventStore`]; made by [`PostgresEventStore::builder`].
#[must_use]
#[derive(Debug)]
pub struct PostgresEventStoreBuilder {
    pool: PgPool,
    schema: String,
    completion_history: bool,
    purge_batch_size: u32,
}

impl PostgresEventStoreBuilder {
    /// The schema of the store's tables, `relaybus` by default; [`setup`](PostgresEventStore::setup)
    /// creates it. 1 to 48 characters of lowercase ASCII letters, digits and `_`, starting with
    /// a letter or `_`, not starting with `pg_`.
    pub fn schema(mut self, schema: impl Into<String>) -> Self {
        self.schema = schema.into();
        self
    }

    /// Keep a record of completed deliveries in `completed_deliveries`. Off by default. Every
    /// process sharing the store must use the same value.
    pub fn completion_history(mut self, enabled: bool) -> Self {
        self.completion_history = enabled;
        self
    }

    /// How many rows a purge deletes per step, 500 by default (1 to 100,000).
    pub fn purge_batch_size(mut self, size: u32) -> Self {
        self.purge_batch_size = size;
        self
    }

    /// Validates the options and builds the store. Makes no database call.
    ///
    /// # Errors
    ///
    /// [`ConfigurationError::InvalidOption`] for an invalid schema name (`schema`) or a purge
    /// batch size out of range (`purge_batch_size`), saying what to use.
    pub fn build(self) -> Result<PostgresEventStore, ConfigurationError> {
        validate_schema(&self.schema)?;
        if !(1..=100_000).contains(&self.purge_batch_size) {
            return Err(ConfigurationError::InvalidOption {
                option: "purge_batch_size",
                reason: format!("{} is out of range; use 1 to 100000", self.purge_batch_size),
            });
        }
        let ident = format!("\"{}\"", self.schema);
        Ok(PostgresEventStore {
            inner: Arc::new(Inner {
                pool: self.pool,
                ident,
                schema: self.schema,
                completion_history: self.completion_history,
                purge_batch_size: self.purge_batch_size,
                instance: uuid::Uuid::now_v7().to_string(),
                gauge_sample: crate::store::GaugeSample::default(),
                set_up: tokio::sync::OnceCell::new(),
            }),
        })
    }
}

/// Checks a schema name: what PostgreSQL takes unquoted and keeps as written.
fn validate_schema(name: &str) -> Result<(), ConfigurationError> {
    let reason = if name.is_empty() {
        Some("it is empty")
    } else if name.len() > MAX_SCHEMA_BYTES {
        Some("it is longer than 48 characters")
    } else if !name
        .bytes()
        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
    {
        Some("it contains a character other than lowercase ASCII letters, digits and `_`")
    } else if name.as_bytes()[0].is_ascii_digit() {
        Some("it starts with a digit")
    } else if name.starts_with("pg_") || name == "information_schema" {
        Some("`pg_*` and `information_schema` are PostgreSQL's own schemas")
    } else {
        None
    };
    match reason {
        Some(reason) => Err(ConfigurationError::InvalidOption {
            option: "schema",
            reason: format!(
                "{name:?}: {reason}; use 1 to 48 characters of lowercase ASCII letters, digits \
                 and `_`, starting with a letter or `_` (such as \"relaybus\")",
                name = crate::error::truncate_for_message(name, 64)
            ),
        }),
        None => Ok(()),
    }
}

/// `serialization_failure`: a transaction of `REPEATABLE READ` or `SERIALIZABLE` isolation
/// conflicted with a concurrent one.
const SERIALIZATION_FAILURE: &str = "40001";
/// `deadlock_detected`: PostgreSQL aborted one transaction of a lock cycle.
const DEADLOCK_DETECTED: &str = "40P01";
/// `query_canceled`: a statement ran past `statement_timeout` (or was cancelled).
const QUERY_CANCELED: &str = "57014";

/// The SQLSTATE of an sqlx error, when the server sent one.
fn sqlstate(error: &sqlx::Error) -> Option<String> {
    match error {
        sqlx::Error::Database(e) => e.code().map(|code| code.into_owned()),
        _ => None,
    }
}

/// Whether an sqlx error lets its transaction run again as a whole.
pub(crate) fn is_transient(error: &sqlx::Error) -> bool {
    matches!(
        sqlstate(error).as_deref(),
        Some(SERIALIZATION_FAILURE | DEADLOCK_DETECTED)
    )
}

impl From<sqlx::Error> for DatabaseError {
    /// Keeps the driver error, and reads its SQLSTATE: serialization failures and deadlocks are
    /// transient, a cancelled statement (`statement_timeout`) is a timeout.
    fn from(error: sqlx::Error) -> Self {
        let transient = is_transient(&error);
        let timeout = sqlstate(&error).as_deref() == Some(QUERY_CANCELED);
        DatabaseError::new(error)
            .with_transient(transient)
            .with_timeout(timeout)
    }
}

impl From<sqlx::Error> for Error {
    fn from(error: sqlx::Error) -> Self {
        Error::Database(error.into())
    }
}

/// An sqlx error as a relaybus error.
pub(crate) fn db_error(error: sqlx::Error) -> Error {
    error.into()
}

/// A transient error of the store itself: something changed under a transaction that it
/// cannot finish consistently, and running it again will see the change.
pub(crate) fn conflict(what: &str) -> Error {
    Error::Database(
        DatabaseError::new(std::io::Error::other(format!(
            "write conflict: {what}; the transaction runs again"
        )))
        .with_transient(true),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schema_names() {
        for good in ["relaybus", "_x", "shop_2", &"a".repeat(48)] {
            assert!(validate_schema(good).is_ok(), "{good}");
        }
        for bad in [
            "",
            "Relaybus",
            "a-b",
            "a b",
            "9a",
            "pg_x",
            "information_schema",
            "a\"b",
            "é",
            &"a".repeat(49),
        ] {
            assert!(validate_schema(bad).is_err(), "{bad}");
        }
    }
}
