//! The session business code writes through: a pooled connection with the store's
//! transaction on it, or a transaction the caller started with sqlx.

use std::{
    fmt,
    ops::{Deref, DerefMut},
    time::Duration,
};

use sqlx::{Executor, PgConnection, Postgres, Transaction, pool::PoolConnection};

use super::{PostgresEventStore, db_error};
use crate::error::{ConfigurationError, Result};

/// The handle of a PostgreSQL transaction, through which business data is written together
/// with events: the [`Session`](crate::store::Transactions::Session) of [`PostgresEventStore`].
///
/// `&mut PostgresSession` is an sqlx [`Executor`](sqlx::Executor), so a query takes the session
/// as it is: `.execute(&mut *session)`, whether `session` is a `&mut PostgresSession` (a
/// `bus.transaction` body; the reborrow keeps it usable after the query) or a handler's
/// [`SessionGuard`](crate::SessionGuard), and `.execute(publisher.session())` in a route. It also dereferences to sqlx's [`PgConnection`], and
/// [`connection`](Self::connection) lends that for anything else.
///
/// It comes in two kinds:
///
/// - From the store ([`Transactions::session`](crate::store::Transactions::session)): a pooled
///   connection on which the bus's and the store's transactions run
///   ([`RelayBus::transaction`](crate::RelayBus::transaction) begins, commits and retries them).
///   Outside such a transaction it is refused by every operation that must write in one, with
///   [`ConfigurationError::NoTransaction`]. Dropped inside a transaction, its connection is closed
///   rather than returned to the pool, which rolls the transaction back.
/// - From a transaction you started yourself: `PostgresSession::from(pool.begin().await?)`.
///   Publish with it, then take the transaction back with
///   [`into_transaction`](Self::into_transaction) and commit or roll it back; the store never
///   commits it.
///
/// # Example
///
/// ```no_run
/// # async fn example(pool: sqlx::PgPool, bus: relaybus::RelayBus<relaybus::PostgresEventStore>, event: relaybus::EventEnvelope) -> Result<(), relaybus::Error> {
/// use relaybus::PostgresSession;
///
/// let mut session = PostgresSession::from(pool.begin().await?);
/// sqlx::query("UPDATE stock SET count = count - 1 WHERE sku = $1")
///     .bind("sku-1")
///     .execute(&mut *session)
///     .await?;
/// bus.publish_envelope(event).session(&mut session).await?;
/// if let Ok(transaction) = session.into_transaction() {
///     transaction.commit().await?;
/// }
/// # Ok(())
/// # }
/// ```
pub struct PostgresSession {
    state: State,
}

enum State {
    /// A pooled connection, with or without the store's transaction on it.
    Pooled(Pooled),
    /// A transaction of the caller's.
    Transaction(Transaction<'static, Postgres>),
}

/// A pooled connection that knows whether the store began a transaction on it, and closes
/// itself when dropped inside one (so that an open transaction never goes back to the pool).
struct Pooled {
    connection: PoolConnection<Postgres>,
    in_transaction: bool,
}

impl Drop for Pooled {
    fn drop(&mut self) {
        if self.in_transaction {
            self.connection.close_on_drop();
        }
    }
}

impl fmt::Debug for PostgresSession {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (kind, in_transaction) = match &self.state {
            State::Pooled(pooled) => ("pooled", pooled.in_transaction),
            State::Transaction(_) => ("caller's transaction", true),
        };
        f.debug_struct("PostgresSession")
            .field("kind", &kind)
            .field("in_transaction", &in_transaction)
            .finish_non_exhaustive()
    }
}

impl From<Transaction<'static, Postgres>> for PostgresSession {
    /// A session on a transaction you started (`pool.begin().await?`): publishes through it
    /// write in that transaction. Take it back with [`into_transaction`](Self::into_transaction).
    fn from(transaction: Transaction<'static, Postgres>) -> Self {
        PostgresSession {
            state: State::Transaction(transaction),
        }
    }
}

impl PostgresSession {
    /// A session on a pooled connection, outside any transaction.
    pub(crate) fn pooled(connection: PoolConnection<Postgres>) -> Self {
        PostgresSession {
            state: State::Pooled(Pooled {
                connection,
                in_transaction: false,
            }),
        }
    }

    /// The connection, to run your own queries on in the session's transaction.
    pub fn connection(&mut self) -> &mut PgConnection {
        self
    }

    /// The transaction you made the session from; a session the store made is given back
    /// unchanged as the error.
    ///
    /// # Errors
    ///
    /// The session itself when it was not made from a transaction of yours.
    pub fn into_transaction(self) -> Result<Transaction<'static, Postgres>, PostgresSession> {
        match self.state {
            State::Transaction(transaction) => Ok(transaction),
            state @ State::Pooled(_) => Err(PostgresSession { state }),
        }
    }

    /// Whether a transaction is open on the session: the store's, or the caller's.
    pub fn in_transaction(&self) -> bool {
        match &self.state {
            State::Pooled(pooled) => pooled.in_transaction,
            State::Transaction(_) => true,
        }
    }

    /// Refuses a session outside a transaction.
    pub(crate) fn ensure_in_transaction(&self, operation: &'static str) -> Result<()> {
        if self.in_transaction() {
            Ok(())
        } else {
            Err(ConfigurationError::NoTransaction { operation }.into())
        }
    }

    /// Begins the store's transaction, its statements bounded by `budget` when given.
    pub(crate) async fn begin(&mut self, budget: Option<Duration>) -> Result<()> {
        let pooled = match &mut self.state {
            State::Pooled(pooled) if !pooled.in_transaction => pooled,
            _ => {
                return Err(crate::error::InvalidArgumentError::new(
                    "session",
                    "a transaction is open on it already; commit or abort it first (a session \
                     made from your own sqlx transaction is committed by you)",
                )
                .into());
            }
        };
        pooled
            .connection
            .execute("BEGIN ISOLATION LEVEL READ COMMITTED")
            .await
            .map_err(db_error)?;
        pooled.in_transaction = true;
        if let Some(budget) = budget {
            let millis = budget.as_millis().clamp(1, i32::MAX as u128).to_string();
            sqlx::query("SELECT set_config('statement_timeout', $1, true)")
                .bind(millis)
                .execute(&mut *pooled.connection)
                .await
                .map_err(db_error)?;
        }
        Ok(())
    }

    /// Commits the store's transaction. A transaction in which a statement failed is refused
    /// (PostgreSQL would turn the `COMMIT` into a silent rollback) and stays open for
    /// [`abort`](Self::abort).
    pub(crate) async fn commit(&mut self) -> Result<()> {
        let pooled = match &mut self.state {
            State::Pooled(pooled) if pooled.in_transaction => pooled,
            State::Pooled(_) => {
                return Err(ConfigurationError::NoTransaction {
                    operation: "PostgresEventStore.commit",
                }
                .into());
            }
            State::Transaction(_) => {
                return Err(crate::error::InvalidArgumentError::new(
                    "session",
                    "it holds your own sqlx transaction; take it back with \
                     `into_transaction()` and commit it yourself",
                )
                .into());
            }
        };
        // One round trip: the `SELECT` fails in a failed transaction, and the rest of the
        // string is then skipped.
        pooled
            .connection
            .execute("SELECT 1; COMMIT")
            .await
            .map_err(db_error)?;
        pooled.in_transaction = false;
        Ok(())
    }

    /// Rolls the store's transaction back; a session of the caller's transaction is left to
    /// the caller.
    pub(crate) async fn abort(&mut self) {
        // When the rollback fails, the connection is broken: it stays marked, and is closed
        // when the session drops.
        if let State::Pooled(pooled) = &mut self.state
            && pooled.in_transaction
            && pooled.connection.execute("ROLLBACK").await.is_ok()
        {
            pooled.in_transaction = false;
        }
    }
}

impl Deref for PostgresSession {
    type Target = PgConnection;

    fn deref(&self) -> &PgConnection {
        match &self.state {
            State::Pooled(pooled) => &pooled.connection,
            State::Transaction(transaction) => transaction,
        }
    }
}

impl DerefMut for PostgresSession {
    fn deref_mut(&mut self) -> &mut PgConnection {
        match &mut self.state {
            State::Pooled(pooled) => &mut pooled.connection,
            State::Transaction(transaction) => transaction,
        }
    }
}

impl PostgresEventStore {
    /// A session on a pooled connection, outside a transaction.
    pub(crate) async fn new_session(&self) -> Result<PostgresSession> {
        let connection = self.inner.pool.acquire().await.map_err(db_error)?;
        Ok(PostgresSession::pooled(connection))
    }
}
