//! Transactions: the session a caller writes business data through, and the primitives to
//! start, commit and abort a transaction on it.

use std::{future::Future, time::Duration};

use crate::error::Result;

/// The transaction primitives of a store: what the transaction runner ([`transaction`]), the
/// bus, the dispatcher's transactional handlers and `relaybus-axum`'s request layer use.
///
/// The policy around them (retrying the body after a transient error, sending a commit again
/// while its result is unknown, the time budget) is written once, in [`transaction`], not here.
///
/// [`transaction`]: super::transaction
pub trait Transactions {
    /// The handle of an open transaction, through which business data is written together
    /// with events: `mongodb::ClientSession` for MongoDB.
    type Session: Send + 'static;

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

    /// Refuses a session that has no started transaction, where each write would commit on its own,
    /// with [`ConfigurationError::NoTransaction`](crate::ConfigurationError::NoTransaction).
    fn ensure_in_transaction(
        &self,
        session: &mut Self::Session,
        operation: &'static str,
    ) -> impl Future<Output = Result<()>> + Send;

    /// Whether an error a handler returned, from the store's driver, lets the transaction it
    /// ran in run again as a whole (a write conflict, say). Errors of relaybus itself are
    /// recognized without it.
    fn is_transient(error: &(dyn std::error::Error + 'static)) -> bool;
}
