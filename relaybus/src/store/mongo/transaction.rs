//! Transactions: the retry loop, the time budget, and the checks that the server and the caller's
//! session support them.

use std::time::{Duration, Instant};

use mongodb::{
    ClientSession,
    bson::{DateTime, doc},
    error::{ErrorKind, TRANSIENT_TRANSACTION_ERROR, UNKNOWN_TRANSACTION_COMMIT_RESULT},
};

use super::{AppendRequest, Appended, MongoEventStore, error_code};
use crate::error::{
    ConfigurationError, Error, InvalidArgumentError, Result, TransactionTimeoutError,
};

/// How long transactions are retried after transient errors, as the driver's own helper does.
pub(crate) const RETRY_LIMIT: Duration = Duration::from_secs(120);

/// The longest time budget: MongoDB aborts transactions older than a minute by default.
const MAX_BUDGET: Duration = Duration::from_secs(60);

/// `IllegalOperation`, returned by a standalone server to transaction numbers.
const ILLEGAL_OPERATION: i32 = 20;
/// `MaxTimeMSExpired`.
const MAX_TIME_MS_EXPIRED: i32 = 50;

tokio::task_local! {
    /// Set on the task while the body of one of these transactions runs.
    static IN_BODY: ();
}

/// Whether the current task runs the body of a transaction of this crate, where a publish
/// without the body's session would commit on its own.
pub(crate) fn in_transaction_body() -> bool {
    IN_BODY.try_with(|()| ()).is_ok()
}

/// The transaction loop, shared by the closure-based entry points and the store's own transactions:
/// written once as a macro because an async closure that borrows cannot be proven `Send` by the
/// compiler, while inline code can.
macro_rules! transaction_loop {
    ($store:expr, $budget:expr, |$session:ident| $work:expr) => {
        transaction_loop!($store, $budget, None, |$session| $work)
    };
    ($store:expr, $budget:expr, $read_concern:expr, |$session:ident| $work:expr) => {{
        let store: &MongoEventStore = $store;
        let budget: Option<Duration> = $budget;
        let read_concern: Option<mongodb::options::ReadConcern> = $read_concern;
        store.ensure_transactions_supported().await?;
        let mut options = store.inner.transaction_options.clone();
        if let Some(budget) = budget {
            options.max_commit_time = Some(budget);
        }
        if read_concern.is_some() {
            options.read_concern = read_concern;
        }
        let started = Instant::now();
        let mut session = store.inner.client.start_session().await?;
        let mut attempt: u32 = 0;
        'attempts: loop {
            attempt += 1;
            session
                .start_transaction()
                .with_options(options.clone())
                .await?;
            let attempt_started = Instant::now();
            let outcome = {
                let $session: &mut ClientSession = &mut session;
                IN_BODY.scope((), $work).await
            };
            let value = match outcome {
                Ok(value) => value,
                Err(error) => {
                    // Aborting can fail when the server already aborted; the outcome is the same.
                    let _ = session.abort_transaction().await;
                    if error.is_transient_transaction_error() && started.elapsed() < RETRY_LIMIT {
                        backoff(attempt).await;
                        continue 'attempts;
                    }
                    return Err(map_standalone(error));
                }
            };
            if let Some(budget) = budget {
                let elapsed = attempt_started.elapsed();
                if elapsed > budget {
                    let _ = session.abort_transaction().await;
                    return Err(TransactionTimeoutError { budget, elapsed }.into());
                }
            }
            loop {
                match session.commit_transaction().await {
                    Ok(()) => return Ok(value),
                    Err(error) => {
                        if error_code(&error) == Some(MAX_TIME_MS_EXPIRED) {
                            return Err(Error::Database(error));
                        }
                        if started.elapsed() >= RETRY_LIMIT {
                            return Err(map_standalone(Error::Database(error)));
                        }
                        if error.contains_label(UNKNOWN_TRANSACTION_COMMIT_RESULT) {
                            continue;
                        }
                        if error.contains_label(TRANSIENT_TRANSACTION_ERROR) {
                            backoff(attempt).await;
                            continue 'attempts;
                        }
                        return Err(map_standalone(Error::Database(error)));
                    }
                }
            }
        }
    }};
}

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
    /// writes, and the call fails with [`TransactionTimeoutError`]. The commit itself is bounded
    /// on the server with `maxCommitTimeMS` set to the budget.
    ///
    /// # Errors
    ///
    /// As [`transaction`](Self::transaction), plus [`Error::TransactionTimeout`], and
    /// [`Error::InvalidArgument`] for a budget outside 1 ms to 60 s (`work` does not run).
    pub async fn transaction_within<R, F>(&self, budget: Duration, work: F) -> Result<R>
    where
        F: for<'s> AsyncFnMut(&'s mut ClientSession) -> Result<R>,
    {
        if budget < Duration::from_millis(1) || budget > MAX_BUDGET {
            return Err(InvalidArgumentError::new(
                "budget",
                format!(
                    "{budget:?} is out of range; use 1 ms to 60 s (MongoDB aborts longer transactions)"
                ),
            )
            .into());
        }
        self.run_transaction(Some(budget), work).await
    }

    async fn run_transaction<R, F>(&self, budget: Option<Duration>, mut work: F) -> Result<R>
    where
        F: for<'s> AsyncFnMut(&'s mut ClientSession) -> Result<R>,
    {
        transaction_loop!(self, budget, |session| work(session))
    }

    /// Appends events in a transaction of their own, for a publish without a session.
    pub(crate) async fn append_in_own_transaction(
        &self,
        budget: Duration,
        events: &[AppendRequest<'_>],
    ) -> Result<Vec<Appended>> {
        transaction_loop!(self, Some(budget), |session| self.append_in_transaction(
            session,
            events,
            DateTime::now()
        ))
    }

    /// Runs one of the store's own operations in a transaction, with the same retries as
    /// [`transaction`](Self::transaction). What `work` borrows travels in `context`, so that the
    /// future it returns can borrow it for as long as the session (the driver's `and_run` does
    /// the same), and the whole call stays `Send`.
    pub(crate) async fn own_transaction<C, R, F>(&self, mut context: C, mut work: F) -> Result<R>
    where
        F: for<'b> FnMut(
            &'b mut ClientSession,
            &'b mut C,
        ) -> futures::future::BoxFuture<'b, Result<R>>,
    {
        transaction_loop!(self, None, |session| work(session, &mut context))
    }

    /// As [`own_transaction`](Self::own_transaction), reading the latest data the primary has
    /// applied rather than the majority-committed snapshot: for work that must see this
    /// process's own last write even when that write's reply reported a failure before it was
    /// majority-committed. The commit still waits for a majority.
    pub(crate) async fn own_transaction_reading_latest<C, R, F>(
        &self,
        mut context: C,
        mut work: F,
    ) -> Result<R>
    where
        F: for<'b> FnMut(
            &'b mut ClientSession,
            &'b mut C,
        ) -> futures::future::BoxFuture<'b, Result<R>>,
    {
        transaction_loop!(
            self,
            None,
            Some(mongodb::options::ReadConcern::local()),
            |session| work(session, &mut context)
        )
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

/// A short, growing, jittered pause between attempts, so that transactions that conflicted do
/// not collide again in lock step.
async fn backoff(attempt: u32) {
    let cap_ms = (u64::from(attempt.min(8)) * 5).min(40);
    let jitter = u64::from(uuid::Uuid::now_v7().as_u128() as u8) % (cap_ms + 1);
    if jitter > 0 {
        tokio::time::sleep(Duration::from_millis(jitter)).await;
    }
}

/// Turns the server's refusal of transaction numbers into the configuration error it stands for.
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
