//! Transactions: the retry loop, the time budget, and the checks that the server and the caller's
//! session support them.

use std::time::Duration;

use futures::TryStreamExt;
use mongodb::{
    ClientSession,
    bson::{Document, doc},
    error::{ErrorKind, WriteFailure},
    options::ReadConcern,
};

use super::{MongoEventStore, error_code, sessions::session_key};
use crate::{
    error::{CommitNotAcknowledgedError, ConfigurationError, Error, Result},
    store::transaction::{self, Attempts, Boxed, Steps},
};

/// `IllegalOperation`, returned by a standalone server to transaction numbers.
const ILLEGAL_OPERATION: i32 = 20;

impl MongoEventStore {
    /// Runs `work` in a new multi-document transaction and commits it.
    ///
    /// `work` gets the transaction's session: pass it to every write that must commit together
    /// with the events, and to [`append`](Self::append) (or the bus's `publish(..).session(..)`).
    ///
    /// # Retries
    ///
    /// When `work` or the commit fails with an error labelled `TransientTransactionError` (a write
    /// conflict, typically), the transaction is aborted and **the whole of `work` runs again**
    /// from the start. When the commit fails with `UnknownTransactionCommitResult`, only the
    /// commit is sent again. Retries stop after 120 seconds with the last error. The value
    /// returned is that of the attempt that committed.
    ///
    /// Everything written through the session is rolled back with an aborted attempt, so a retry
    /// never leaves anything twice. Side effects that do not go through the session (HTTP calls,
    /// other databases) happen once per attempt: keep them out of `work`, or make them
    /// idempotent; publishing an event is the way to have them happen after the commit.
    ///
    /// Any other error aborts the transaction and is returned. To abort with an error of your
    /// own, return [`Error::custom`].
    ///
    /// # `Send`
    ///
    /// Where the calling future must be `Send` (a spawned task, an axum handler), write `work` as
    /// an `async move` closure that owns clones of what it uses. An async closure that borrows
    /// from its surroundings can trip the compiler's "implementation of `Send` is not general
    /// enough" error there.
    ///
    /// # Errors
    ///
    /// [`ConfigurationError::NotReplicaSet`] on a standalone server, the error of `work`, or a
    /// [`Error::Database`] error of the commit.
    ///
    /// # Example
    ///
    /// ```no_run
    /// # async fn example(store: relaybus::MongoEventStore, orders: mongodb::Collection<mongodb::bson::Document>) -> Result<(), relaybus::Error> {
    /// use mongodb::bson::doc;
    ///
    /// let id = store
    ///     .transaction(async |session| {
    ///         let inserted = orders.insert_one(doc! { "total": 10 }).session(session).await?;
    ///         Ok(inserted.inserted_id)
    ///     })
    ///     .await?;
    /// # Ok(())
    /// # }
    /// ```
    pub async fn transaction<R, F>(&self, work: F) -> Result<R>
    where
        F: for<'s> AsyncFnMut(&'s mut ClientSession) -> Result<R>,
    {
        self.run_transaction(None, work).await
    }

    /// Runs `work` in a transaction as [`transaction`](Self::transaction) does, with a time
    /// budget for each attempt.
    ///
    /// An attempt whose `work` ran past `budget` is aborted before its commit, with all its
    /// writes, and the call fails with
    /// [`TransactionTimeoutError`](crate::TransactionTimeoutError). The commit itself is
    /// bounded on the server with `maxCommitTimeMS` set to the budget.
    ///
    /// # Errors
    ///
    /// As [`transaction`](Self::transaction), plus [`Error::TransactionTimeout`], and
    /// [`Error::InvalidArgument`] for a budget outside 1 ms to 60 s (`work` does not run).
    pub async fn transaction_within<R, F>(&self, budget: Duration, work: F) -> Result<R>
    where
        F: for<'s> AsyncFnMut(&'s mut ClientSession) -> Result<R>,
    {
        crate::store::checks::check_budget(budget)?;
        self.run_transaction(Some(budget), work).await
    }

    async fn run_transaction<R, F>(&self, budget: Option<Duration>, work: F) -> Result<R>
    where
        F: for<'s> AsyncFnMut(&'s mut ClientSession) -> Result<R>,
    {
        transaction::run(self, budget, work).await
    }

    /// Runs one of the store's own operations in a transaction, with the same retries as
    /// [`transaction`](Self::transaction). What `work` borrows travels in `context`, so that the
    /// future it returns can borrow it for as long as the session (the driver's `and_run` does
    /// the same), and the whole call stays `Send`.
    pub(crate) async fn own_transaction<C, R, F>(&self, context: C, work: F) -> Result<R>
    where
        F: for<'b> FnMut(
                &'b mut ClientSession,
                &'b mut C,
            ) -> futures::future::BoxFuture<'b, Result<R>>
            + Send,
    {
        self.own_transaction_with(None, Boxed::new(context, work))
            .await
    }

    /// The store's own transactions: the one loop of attempts, with the body's boxed future
    /// keeping the whole call `Send`. With `ReadConcern::local()` the body reads the latest data
    /// the primary has applied rather than the majority-committed snapshot: for work that must
    /// see this process's own last write even when that write's reply reported a failure before
    /// it was majority-committed. The commit still waits for a majority.
    pub(crate) async fn own_transaction_with<C, R>(
        &self,
        read_concern: Option<ReadConcern>,
        body: Boxed<'_, ClientSession, C, R>,
    ) -> Result<R> {
        let steps = OwnSteps {
            store: self,
            read_concern,
        };
        let attempts = Attempts::new(None);
        transaction::queue_on_keys(transaction::attempt_until_committed(&steps, attempts, body))
            .await
            .map_err(map_standalone)
    }

    /// A session, once the server was seen to support transactions.
    pub(crate) async fn new_session(&self) -> Result<ClientSession> {
        self.ensure_transactions_supported().await?;
        Ok(self.inner.client.start_session().await?)
    }

    /// Starts a transaction with the store's options, the budget bounding the commit.
    pub(crate) async fn start_transaction(
        &self,
        session: &mut ClientSession,
        budget: Option<Duration>,
        read_concern: Option<ReadConcern>,
    ) -> Result<()> {
        let mut options = self.inner.transaction_options.clone();
        if let Some(budget) = budget {
            options.max_commit_time = Some(budget);
        }
        if read_concern.is_some() {
            options.read_concern = read_concern;
        }
        // Recorded before the transaction can write anything, so that the sessions of a
        // process that dies with it open can be killed.
        self.inner
            .sessions
            .record(&self.inner, session.id())
            .await?;
        session
            .start_transaction()
            .with_options(options)
            .await
            .map_err(|e| map_standalone(e.into()))?;
        // The keys the last attempt found taken or held: waited for now, before the
        // transaction's first operation takes its snapshot.
        if let Some(id) = session_key(session.id()) {
            let keys = transaction::take_contended_keys();
            self.inner.key_gates.begin(id, keys, budget).await;
        }
        Ok(())
    }

    /// Aborts, releasing the transaction's keys for its next attempt to take first. The server
    /// may have ended the transaction already; the outcome is the same.
    pub(crate) async fn abort_once(&self, session: &mut ClientSession) {
        let _ = session.abort_transaction().await;
        self.end_gated(session, false);
    }

    /// Releases the keys of the transaction on `session`; when it did not commit, notes them
    /// for the next attempt, if one follows.
    fn end_gated(&self, session: &ClientSession, committed: bool) {
        if let Some(id) = session_key(session.id()) {
            let keys = self.inner.key_gates.end(&id);
            if !committed {
                transaction::note_contended_keys(keys);
            }
        }
    }

    /// Commits once, as the runner asks. A write concern error means the primary committed:
    /// it is [`Error::CommitNotAcknowledged`], never an error to run the transaction again on.
    pub(crate) async fn commit_once(&self, session: &mut ClientSession) -> Result<()> {
        let committed = session.commit_transaction().await;
        self.end_gated(session, committed.is_ok());
        committed.map_err(|e| {
            let applied = matches!(
                *e.kind,
                ErrorKind::Write(WriteFailure::WriteConcernError(_))
            );
            match map_standalone(e.into()) {
                Error::Database(error) if applied => {
                    CommitNotAcknowledgedError::new(error.with_transient(false)).into()
                }
                error => error,
            }
        })
    }

    /// Refuses a standalone server once, then remembers that the server is fine.
    pub(crate) async fn ensure_transactions_supported(&self) -> Result<()> {
        self.inner
            .topology_checked
            .get_or_try_init(|| async {
                let hello = self
                    .inner
                    .client
                    .database("admin")
                    .run_command(doc! { "hello": 1 })
                    .await?;
                let replica_set = hello.get_str("setName").is_ok();
                let mongos = hello.get_str("msg") == Ok("isdbgrid");
                if replica_set || mongos {
                    Ok(())
                } else {
                    let address = hello.get_str("me").unwrap_or("the configured server");
                    Err(Error::from(ConfigurationError::NotReplicaSet {
                        address: address.to_owned(),
                    }))
                }
            })
            .await
            .map(|_| ())
    }

    /// Refuses a session that has no started transaction, without a round trip when it has one.
    ///
    /// The driver refuses, before sending anything, a command that sets a read concern inside a
    /// transaction; outside a transaction the same command reaches the server. That is the only
    /// public way to learn the session's state.
    pub(crate) async fn ensure_in_transaction(
        &self,
        session: &mut ClientSession,
        operation: &'static str,
    ) -> Result<()> {
        let probe = self
            .inner
            .client
            .database("admin")
            .run_command(doc! { "ping": 1, "readConcern": { "level": "local" } })
            .session(&mut *session)
            .await;
        match probe {
            Err(error) if matches!(*error.kind, ErrorKind::InvalidArgument { .. }) => Ok(()),
            _ => Err(ConfigurationError::NoTransaction { operation }.into()),
        }
    }
}

/// Turns the server's refusal of transaction numbers into the configuration error it stands for.
/// The steps of the store's own transactions: those of every transaction, begun with the
/// read concern they ask for.
struct OwnSteps<'a> {
    store: &'a MongoEventStore,
    read_concern: Option<ReadConcern>,
}

impl Steps for OwnSteps<'_> {
    type Store = MongoEventStore;

    fn store(&self) -> &MongoEventStore {
        self.store
    }

    async fn begin(&self, session: &mut ClientSession, budget: Option<Duration>) -> Result<()> {
        self.store
            .start_transaction(session, budget, self.read_concern.clone())
            .await
    }
}

fn map_standalone(error: Error) -> Error {
    if let Error::Database(e) = &error
        && error_code(e) == Some(ILLEGAL_OPERATION)
        && e.to_string().contains("Transaction numbers")
    {
        return ConfigurationError::NotReplicaSet {
            address: "the configured server".to_owned(),
        }
        .into();
    }
    error
}

/// Every document of `collection` that `filter` matches, with the fields of `projection` (all
/// when empty), read in the session's transaction.
pub(crate) async fn documents_in(
    session: &mut ClientSession,
    collection: &mongodb::Collection<Document>,
    filter: Document,
    projection: Document,
) -> Result<Vec<Document>> {
    Ok(collection
        .find(filter)
        .projection(projection)
        .session(&mut *session)
        .await?
        .stream(&mut *session)
        .try_collect()
        .await?)
}
