//! The in-memory store's own errors, which reach callers inside
//! [`Error::Database`] as the driver errors of other stores do.

use std::time::Duration;

use crate::error::{DatabaseError, Error};

/// What the in-memory store refuses, as its "driver" error: it reaches callers as
/// [`Error::Database`], from which [`DatabaseError::downcast_ref`] gets it back.
///
/// ```
/// use relaybus::{Error, MemoryEventStore, store::memory::MemoryStoreError};
/// use serde_json::json;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let store = MemoryEventStore::new();
/// let twice = store
///     .transaction(async |session| {
///         session.insert("orders", "o-1", json!({}))?;
///         session.insert("orders", "o-1", json!({}))
///     })
///     .await;
/// let Err(Error::Database(error)) = twice else { panic!("{twice:?}") };
/// assert!(matches!(
///     error.downcast_ref::<MemoryStoreError>(),
///     Some(MemoryStoreError::DuplicateDocument { .. })
/// ));
/// assert_eq!(store.count("orders"), 0, "the transaction was aborted");
/// # }
/// ```
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum MemoryStoreError {
    /// The transaction wrote something another open transaction had written already, or
    /// something that changed since it read it. Transient: the transaction is lost, and the
    /// transaction helpers ([`transaction::run`](crate::store::transaction::run), the bus, the
    /// dispatcher's transactional handlers, the request layer) run the whole of it again.
    #[error(
        "write conflict: {what}; this transaction is aborted and runs again from the start \
         (the transaction helpers do so; a transaction begun by hand must be run again by its caller)"
    )]
    WriteConflict {
        /// What the transaction conflicted on.
        what: String,
    },

    /// [`MemorySession::insert`](crate::MemorySession::insert) of an id the collection holds
    /// already. Nothing was written; the transaction can go on.
    #[error(
        "collection {collection:?} already holds a document with id {id:?}; use `put` to \
         replace it, or `update` to change it"
    )]
    DuplicateDocument {
        /// The collection.
        collection: String,
        /// The id.
        id: String,
    },

    /// A commit after the transaction's budget (given to
    /// [`begin`](crate::store::Transactions::begin)) ran out: nothing was applied. The transaction
    /// runner reports it as [`Error::TransactionTimeout`].
    #[error(
        "the transaction ran for {elapsed:?}, past its budget of {budget:?}, so its commit \
         applied nothing; do less work per transaction or give it a larger budget"
    )]
    BudgetExceeded {
        /// The budget given to `begin`.
        budget: Duration,
        /// How long the transaction had run at the commit.
        elapsed: Duration,
    },

    /// [`begin`](crate::store::Transactions::begin) on a session whose transaction is still open.
    #[error(
        "the session has an open transaction already; commit or abort it before beginning \
         another, or take another session with `store.session()`"
    )]
    TransactionInProgress,
}

impl MemoryStoreError {
    /// Whether the transaction that got this error may run again as a whole: a write
    /// conflict.
    pub fn is_transient(&self) -> bool {
        matches!(self, MemoryStoreError::WriteConflict { .. })
    }
}

impl From<MemoryStoreError> for DatabaseError {
    /// Marks a write conflict transient and an exceeded budget a timeout.
    fn from(error: MemoryStoreError) -> Self {
        let transient = error.is_transient();
        let timeout = matches!(error, MemoryStoreError::BudgetExceeded { .. });
        DatabaseError::new(error)
            .with_transient(transient)
            .with_timeout(timeout)
    }
}

impl From<MemoryStoreError> for Error {
    fn from(error: MemoryStoreError) -> Self {
        Error::Database(error.into())
    }
}

/// The transient write conflict on `what`.
pub(super) fn conflict(what: impl Into<String>) -> Error {
    MemoryStoreError::WriteConflict { what: what.into() }.into()
}
