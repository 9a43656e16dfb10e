//! The transaction runner of every store: retrying the body after a transient error, sending a
//! commit again while its result is unknown, and the time budget.
//!
//! The bus ([`RelayBus::transaction`](crate::RelayBus::transaction)), the stores' own
//! transactions, the dispatcher's transactional handlers and `relaybus-axum`'s request layer
//! all follow these rules, through [`run`] or, where the body must be written inline, through
//! [`Attempts`].

use std::{
    marker::PhantomData,
    sync::Mutex,
    time::{Duration, Instant},
};

use futures::future::BoxFuture;

use rand::Rng;
// The attempts' clock: Tokio's, which is the system's monotonic clock unless a test paused it,
// so that the retry limit and the budget can be tested on paused time.
use tokio::time::Instant as Moment;

use super::{Store, Transactions};
use crate::error::{ConfigurationError, Error, Result, TransactionTimeoutError};

/// How long a transaction is retried after transient errors, as MongoDB's drivers do.
pub const RETRY_LIMIT: Duration = Duration::from_secs(120);

/// The longest time budget: MongoDB aborts transactions older than a minute by default, and
/// no request should hold locks for longer anywhere.
pub const MAX_BUDGET: Duration = Duration::from_secs(60);

/// Checks a transaction time budget: 1 ms to 60 s. The one check behind the bus's
/// `transaction_timeout`, the store's `transaction_within` and the request layer's budget.
///
/// ```
/// use std::time::Duration;
///
/// assert!(relaybus::store::transaction::validate_budget(Duration::from_secs(5)).is_ok());
/// assert!(relaybus::store::transaction::validate_budget(Duration::ZERO).is_err());
/// ```
///
/// # Errors
///
/// [`ConfigurationError::InvalidOption`] for `transaction_timeout`, saying the range.
pub fn validate_budget(budget: Duration) -> Result<(), ConfigurationError> {
    if budget < Duration::from_millis(1) || budget > MAX_BUDGET {
        return Err(ConfigurationError::InvalidOption {
            option: "transaction_timeout",
            reason: format!(
                "{budget:?} is out of range; use 1 ms to 60 s (MongoDB aborts longer transactions)"
            ),
        });
    }
    Ok(())
}

tokio::task_local! {
    /// Set on the task while the body of one of these transactions runs.
    static IN_BODY: ();
}

/// Whether the current task runs the body of a transaction of this crate, where a publish
/// without the body's session would commit on its own.
pub(crate) fn in_transaction_body() -> bool {
    IN_BODY.try_with(|()| ()).is_ok()
}

/// Runs `body` as the body of a transaction: a publish inside it without the body's session is
/// refused.
pub(crate) async fn as_body<F: Future>(body: F) -> F::Output {
    IN_BODY.scope((), body).await
}

tokio::task_local! {
    /// Set on the task while the attempts of one transaction run (see [`queue_on_keys`]).
    static CONTENDED: Mutex<Vec<String>>;
}

/// Runs `attempts`, the loop of one transaction's attempts, so that its attempts queue for the
/// ordering keys other transactions of this process hold, where a store can tell (MongoDB).
///
/// Inside it, an attempt that finds one of its keys held by another transaction of the same
/// store instance gives up at once with a transient error, naming the key here; the next
/// attempt waits for the key in the process before it starts, so that it reads and writes
/// after the holder committed instead of conflicting with it on the server. Outside it,
/// attempts do not queue: they write the key's counter and retry on conflicts. [`run`] and
/// the stores' own transactions run inside it; a loop written with [`Attempts`] wraps itself.
pub async fn queue_on_keys<F: Future>(attempts: F) -> F::Output {
    CONTENDED.scope(Mutex::new(Vec::new()), attempts).await
}

/// Notes the keys an attempt gave up for, or must take again after an abort, for the next
/// attempt; `false` outside [`queue_on_keys`], where no next attempt would take them.
#[cfg(feature = "mongodb")]
pub(crate) fn note_contended_keys(keys: impl IntoIterator<Item = String>) -> bool {
    CONTENDED
        .try_with(|contended| {
            let mut contended = contended.lock().unwrap_or_else(|p| p.into_inner());
            contended.extend(keys);
        })
        .is_ok()
}

/// Whether attempts queue for their keys on this task (inside [`queue_on_keys`]).
#[cfg(feature = "mongodb")]
pub(crate) fn queues_on_keys() -> bool {
    CONTENDED.try_with(|_| ()).is_ok()
}

/// The keys the last attempt noted, for the attempt that starts now; empty outside
/// [`queue_on_keys`].
#[cfg(feature = "mongodb")]
pub(crate) fn take_contended_keys() -> Vec<String> {
    CONTENDED
        .try_with(|contended| {
            std::mem::take(&mut *contended.lock().unwrap_or_else(|p| p.into_inner()))
        })
        .unwrap_or_default()
}

/// The attempts of one transaction: how many ran, since when, and within which budget.
///
/// For callers whose body must be written inline (so that the compiler can prove the whole
/// future `Send`); [`run`] is the loop for everyone else:
///
/// ```text
/// let mut attempts = Attempts::new(budget);
/// loop {
///     attempts.start();
///     store.begin(&mut session, attempts.remaining_budget()).await?;
///     match body(&mut session).await {
///         Ok(value) => { attempts.check_budget()?; match attempts.commit(..) { .. } }
///         Err(error) => {
///             store.abort(..);
///             if attempts.retry_after(&error).await { continue }
///             return Err(attempts.give_up(error));
///         }
///     }
/// }
/// ```
#[derive(Debug)]
pub struct Attempts {
    started: Moment,
    attempt: u32,
    budget: Option<Duration>,
    deadline: Moment,
}

/// How a commit ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Committed {
    /// The transaction committed.
    Yes,
    /// The commit failed with a transient error, nothing was committed, and there is time
    /// left: run the whole transaction again.
    RunAgain,
}

impl Attempts {
    /// The first attempt, now, retried for at most [`RETRY_LIMIT`].
    pub fn new(budget: Option<Duration>) -> Self {
        let now = Moment::now();
        Attempts {
            started: now,
            attempt: 0,
            budget,
            deadline: now + RETRY_LIMIT,
        }
    }

    /// Retries for `limit` after the first attempt started instead of [`RETRY_LIMIT`].
    pub fn retry_for(mut self, limit: Duration) -> Self {
        self.deadline = self.started + limit;
        self
    }

    /// Stops retrying at `deadline` instead, if it is sooner: a transactional handler must
    /// end within its lease.
    pub fn retry_until(mut self, deadline: Instant) -> Self {
        self.deadline = self.deadline.min(Moment::from_std(deadline));
        self
    }

    /// Counts an attempt that starts now.
    pub fn start(&mut self) {
        self.attempt += 1;
    }

    /// The number of attempts started.
    pub fn attempt(&self) -> u32 {
        self.attempt
    }

    /// Whether retrying is still allowed: before the retry deadline, and within the budget,
    /// which covers every attempt.
    pub fn time_left(&self) -> bool {
        Moment::now() < self.deadline && !self.over_budget()
    }

    /// Whether the attempts so far have used up the budget.
    fn over_budget(&self) -> bool {
        self.budget
            .is_some_and(|budget| self.started.elapsed() > budget)
    }

    /// What is left of the budget for the attempt that starts now (at least 1 ms), to bound its
    /// commit on the server; `None` without a budget.
    pub fn remaining_budget(&self) -> Option<Duration> {
        self.budget.map(|budget| {
            budget
                .saturating_sub(self.started.elapsed())
                .max(Duration::from_millis(1))
        })
    }

    /// The error of a transaction stopped by its budget: at the commit (the server's
    /// `maxCommitTimeMS`), or before another attempt.
    fn timed_out(&self) -> Option<TransactionTimeoutError> {
        self.budget.map(|budget| TransactionTimeoutError {
            budget,
            elapsed: self.started.elapsed(),
        })
    }

    /// After a failed body: the error to return when no retry follows. A transient error that
    /// ran out of budget is a [`TransactionTimeoutError`]; any other error is itself.
    pub fn give_up(&self, error: Error) -> Error {
        match self.timed_out() {
            Some(timeout) if error.is_transient_transaction_error() && self.over_budget() => {
                timeout.into()
            }
            _ => error,
        }
    }

    /// After a failed body or commit: whether to run the transaction again. It may when the
    /// error is transient and there is time left; it then waits a short, growing, jittered
    /// pause first, so that transactions that conflicted do not collide again in lock step.
    pub async fn retry_after(&mut self, error: &Error) -> bool {
        error.is_transient_transaction_error() && self.retry().await
    }

    /// After a failure the caller judged transient (a write conflict that reached it as a
    /// response rather than an [`Error`], say): whether to run the transaction again, after
    /// the same pause as [`retry_after`](Self::retry_after).
    pub async fn retry(&mut self) -> bool {
        if !self.time_left() {
            return false;
        }
        pause(self.attempt).await;
        true
    }

    /// Refuses to commit when the attempts so far ran past the budget, which covers the whole
    /// transaction, every attempt included.
    ///
    /// # Errors
    ///
    /// [`TransactionTimeoutError`]; abort the transaction.
    pub fn check_budget(&self) -> Result<(), TransactionTimeoutError> {
        match self.timed_out() {
            Some(error) if self.over_budget() => Err(error),
            _ => Ok(()),
        }
    }

    /// Commits, sending the commit again while its result is unknown.
    ///
    /// # Errors
    ///
    /// The commit's error when it is neither transient nor unknown, or came after the retry
    /// deadline; [`Error::TransactionTimeout`] when the server stopped the commit at its
    /// `maxCommitTimeMS` (the budget's remainder), or a transient commit error left no budget
    /// to run the transaction again. A commit whose result is unknown is sent again until the
    /// retry deadline, past the budget: it may have committed, and only another send tells.
    pub async fn commit<S: Transactions>(
        &mut self,
        store: &S,
        session: &mut S::Session,
    ) -> Result<Committed> {
        loop {
            let error = match store.commit(session).await {
                Ok(()) => return Ok(Committed::Yes),
                Err(error) => error,
            };
            if error.is_timeout() {
                // The server stopped the commit at `maxCommitTimeMS`: it did not commit.
                return Err(match self.timed_out() {
                    Some(timeout) => timeout.into(),
                    None => error,
                });
            }
            if error.is_unknown_commit_result() {
                // It may have committed: sending it again is the only way to know, whatever
                // the budget says, until the retry deadline.
                if Moment::now() < self.deadline {
                    continue;
                }
                return Err(error);
            }
            if self.retry_after(&error).await {
                return Ok(Committed::RunAgain);
            }
            return Err(self.give_up(error));
        }
    }

    /// How long since the first attempt started.
    pub fn elapsed(&self) -> Duration {
        self.started.elapsed()
    }
}

/// Runs `work` in a transaction of `store` and commits it, running the whole of `work` again
/// after a transient error, within `budget` when one is given: the budget covers every attempt,
/// and each attempt's commit is bounded on the server by what is left of it. Publishes inside
/// `work` without its session are refused.
///
/// # Errors
///
/// The error of `work`; [`Error::TransactionTimeout`] for a transaction past its budget (at
/// the commit, or when a transient error leaves no budget for another attempt); the errors of
/// starting and committing.
pub async fn run<S, R, F>(store: &S, budget: Option<Duration>, work: F) -> Result<R>
where
    S: Store,
    F: for<'s> AsyncFnMut(&'s mut S::Session) -> Result<R>,
{
    run_within(store, budget, RETRY_LIMIT, work).await
}

/// [`run`], retrying transient errors for `retry_limit` instead of [`RETRY_LIMIT`].
///
/// # Errors
///
/// As for [`run`]; after `retry_limit`, the last transient error.
pub async fn run_within<S, R, F>(
    store: &S,
    budget: Option<Duration>,
    retry_limit: Duration,
    work: F,
) -> Result<R>
where
    S: Store,
    F: for<'s> AsyncFnMut(&'s mut S::Session) -> Result<R>,
{
    let attempts = Attempts::new(budget).retry_for(retry_limit);
    queue_on_keys(attempt_until_committed(store, attempts, Work(work))).await
}

/// The store the loop of attempts runs on, and how it begins a transaction: as every store's
/// [`Transactions`] does, or another way for a store's own transactions (MongoDB's that read
/// the latest data).
pub(crate) trait Steps {
    /// The store that opens the session, commits and aborts.
    type Store: Transactions;

    /// The store.
    fn store(&self) -> &Self::Store;

    /// Starts a transaction, `budget` bounding its commit when given.
    fn begin(
        &self,
        session: &mut <Self::Store as Transactions>::Session,
        budget: Option<Duration>,
    ) -> impl Future<Output = Result<()>> + Send {
        Transactions::begin(self.store(), session, budget)
    }
}

impl<T: Transactions> Steps for T {
    type Store = T;

    fn store(&self) -> &T {
        self
    }
}

/// What each attempt of a transaction runs on the attempt's session.
pub(crate) trait Body<S> {
    /// The value of the attempt that commits.
    type Output;

    /// Runs the body once.
    fn attempt<'b>(
        &'b mut self,
        session: &'b mut S,
    ) -> impl Future<Output = Result<Self::Output>> + 'b;
}

/// The body of [`run`]: the caller's async closure, whose future is `Send` wherever the
/// caller's is.
struct Work<F>(F);

impl<S, R, F> Body<S> for Work<F>
where
    F: for<'s> AsyncFnMut(&'s mut S) -> Result<R>,
{
    type Output = R;

    fn attempt<'b>(&'b mut self, session: &'b mut S) -> impl Future<Output = Result<R>> + 'b {
        (self.0)(session)
    }
}

/// A body that returns a boxed future, with what it borrows in `context`: for the loops of
/// the bus and of the stores' own transactions, whose futures must be `Send`. The compiler
/// cannot prove a borrowing closure's future `Send` for every lifetime of the session; a
/// boxed future says it in its type.
pub(crate) struct Boxed<'a, S, C, R> {
    context: C,
    #[allow(clippy::type_complexity)]
    work: Box<dyn for<'b> FnMut(&'b mut S, &'b mut C) -> BoxFuture<'b, Result<R>> + Send + 'a>,
    /// Ties `R` to the lifetimes of `Boxed`, so that a boxed future may return it.
    output: PhantomData<R>,
}

impl<'a, S, C, R> Boxed<'a, S, C, R> {
    /// The body `work`, which gets the session and `context` on each attempt.
    pub(crate) fn new<F>(context: C, work: F) -> Self
    where
        F: for<'b> FnMut(&'b mut S, &'b mut C) -> BoxFuture<'b, Result<R>> + Send + 'a,
    {
        Boxed {
            context,
            work: Box::new(work),
            output: PhantomData,
        }
    }
}

impl<S, C, R> Body<S> for Boxed<'_, S, C, R> {
    type Output = R;

    #[allow(refining_impl_trait)]
    fn attempt<'b>(&'b mut self, session: &'b mut S) -> BoxFuture<'b, Result<R>> {
        (self.work)(session, &mut self.context)
    }
}

/// The loop of a transaction's attempts, the one that [`run`], the bus's publish and the
/// stores' own transactions share: each attempt begins a transaction on one session, runs
/// `body`, and commits; a transient error aborts the attempt and runs the whole body again,
/// as [`attempts`](Attempts) allow.
pub(crate) async fn attempt_until_committed<T, B>(
    steps: &T,
    mut attempts: Attempts,
    mut body: B,
) -> Result<B::Output>
where
    T: Steps,
    B: Body<<T::Store as Transactions>::Session>,
{
    let store = steps.store();
    let mut session = store.session().await?;
    loop {
        attempts.start();
        steps
            .begin(&mut session, attempts.remaining_budget())
            .await?;
        let value = match as_body(body.attempt(&mut session)).await {
            Ok(value) => value,
            Err(error) => {
                store.abort(&mut session).await;
                if attempts.retry_after(&error).await {
                    continue;
                }
                return Err(attempts.give_up(error));
            }
        };
        if let Err(error) = attempts.check_budget() {
            store.abort(&mut session).await;
            return Err(error.into());
        }
        match attempts.commit(store, &mut session).await? {
            Committed::Yes => return Ok(value),
            Committed::RunAgain => continue,
        }
    }
}

/// A short pause that grows with the attempts, taken at random from 0 to 5 ms per attempt (at
/// most 40 ms).
async fn pause(attempt: u32) {
    let cap_ms = (u64::from(attempt.min(8)) * 5).min(40);
    let wait = rand::rng().random_range(0..=cap_ms);
    if wait > 0 {
        tokio::time::sleep(Duration::from_millis(wait)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn budgets_are_checked_once() {
        assert!(validate_budget(Duration::from_millis(1)).is_ok());
        assert!(validate_budget(MAX_BUDGET).is_ok());
        assert!(validate_budget(MAX_BUDGET + Duration::from_millis(1)).is_err());
        assert!(validate_budget(Duration::from_micros(999)).is_err());
    }

    #[tokio::test]
    async fn only_transient_errors_are_retried_and_only_in_time() {
        let transient = Error::Database(
            crate::DatabaseError::new(std::io::Error::other("conflict")).with_transient(true),
        );
        let plain = Error::Database(crate::DatabaseError::new(std::io::Error::other("bad")));
        let mut attempts = Attempts::new(None);
        attempts.start();
        assert!(attempts.retry_after(&transient).await);
        assert!(!attempts.retry_after(&plain).await);
        let mut late = Attempts::new(None).retry_until(Instant::now());
        late.start();
        assert!(!late.retry_after(&transient).await);
    }

    #[tokio::test]
    async fn the_budget_covers_every_attempt() {
        let transient = Error::Database(
            crate::DatabaseError::new(std::io::Error::other("conflict")).with_transient(true),
        );
        let mut attempts = Attempts::new(Some(Duration::from_millis(20)));
        attempts.start();
        assert!(attempts.remaining_budget() <= Some(Duration::from_millis(20)));
        tokio::time::sleep(Duration::from_millis(12)).await;
        assert!(
            attempts.check_budget().is_ok(),
            "the first attempt is within it"
        );
        assert!(attempts.retry_after(&transient).await);
        attempts.start();
        assert!(attempts.remaining_budget() < Some(Duration::from_millis(9)));
        tokio::time::sleep(Duration::from_millis(12)).await;
        // The second attempt alone is within 20 ms; both together are not.
        assert!(attempts.check_budget().is_err());
        assert!(!attempts.retry_after(&transient).await);
        assert!(matches!(
            attempts.give_up(transient),
            Error::TransactionTimeout(_)
        ));
        assert_eq!(attempts.remaining_budget(), Some(Duration::from_millis(1)));
    }

    #[tokio::test]
    async fn an_attempt_past_its_budget_is_refused() {
        let mut attempts = Attempts::new(Some(Duration::from_millis(1)));
        attempts.start();
        tokio::time::sleep(Duration::from_millis(5)).await;
        let error = attempts.check_budget().unwrap_err();
        assert_eq!(error.budget(), Duration::from_millis(1));
        assert!(error.elapsed() >= Duration::from_millis(5));
    }
}
