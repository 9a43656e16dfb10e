//! Running one claimed delivery: the handler, then completion, retry or burial.

use std::{
    panic::AssertUnwindSafe,
    sync::Arc,
    time::{Duration, Instant},
};

use futures::FutureExt;
use rand::Rng;
use tokio::sync::Mutex;
use tracing::{Instrument, debug, info_span, warn};

use super::Shared;
use crate::telemetry::FailureKind;
use crate::{
    error::{DatabaseError, Error},
    handler::{HandlerContext, Permanent, Subscription},
    state::StateMap,
    store::{
        Claimed, Store, Transactions,
        transaction::{Attempts, Committed},
    },
    time::Timestamp,
};

/// How much of its lease a transactional handler leaves unused: it stops retrying its
/// transaction this long before the lease ends (a quarter of the lease when that is less), and
/// gives the delivery back uncharged, so that it never runs on past its lease. Its lease is not
/// renewed while it runs.
const LEASE_MARGIN: Duration = Duration::from_secs(5);

/// How one run of a delivery ended.
#[derive(Debug)]
pub(crate) enum Outcome<L> {
    /// The handler succeeded; its delivery still has to be completed (batched).
    Succeeded(L),
    /// The handler succeeded and its delivery completed in the handler's transaction; with the
    /// key's next delivery, when it was claimed while the transaction committed.
    Completed,
    /// The delivery was settled otherwise: rescheduled, buried, given back, or its lease was
    /// lost.
    Settled(Settled),
}

/// How a delivery that did not succeed was settled.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Settled {
    /// Its attempt failed; it runs again at `due_at`.
    Retried { error: String, due_at: Timestamp },
    /// Its last attempt failed, or it failed for good: a dead letter.
    Buried { error: String },
    /// Given back without charging an attempt.
    Released,
    /// Its lease ended before it could be settled, or the store could not settle it: another
    /// claim decides.
    Lost,
}

/// Runs the delivery's handler and settles what the handler's result decides, except the
/// completion of a non-transactional success, which the caller batches.
pub(crate) async fn run_delivery<S: Store>(
    shared: &Shared<S>,
    delivery: Claimed<S::Lease>,
) -> Outcome<S::Lease> {
    let span = info_span!(
        "relaybus.handle",
        event_id = delivery.event.id(),
        event_type = delivery.event.event_type(),
        handler = delivery.handler,
        attempt = delivery.attempt,
    );
    crate::trace::continue_trace(&span, &delivery.event);
    async move {
        if let Some(metrics) = shared.metrics.handler(&delivery.handler) {
            metrics.attempts.increment(1);
            if delivery.attempt == 1 {
                let waited = shared.now().duration_since(delivery.event.created_at());
                metrics.latency.record(waited.as_secs_f64());
            }
        }
        let Some(subscription) = shared.subscriptions.get(&delivery.handler) else {
            // The claim asks only for our handlers, so this cannot happen; give it back.
            warn!("claimed a delivery of a handler this bus does not run; releasing it");
            return Outcome::Settled(release(shared, &delivery.lease).await);
        };
        if subscription.transactional {
            run_transactional(shared, subscription, &delivery).await
        } else {
            let context = HandlerContext::<S>::for_delivery(
                &delivery.event,
                &delivery.handler,
                delivery.sequence,
                delivery.attempt,
                None,
            );
            match call(shared, subscription, &delivery, context).await {
                Ok(()) => {
                    debug!("handler succeeded");
                    Outcome::Succeeded(delivery.lease.clone())
                }
                Err(failure) => {
                    Outcome::Settled(fail(shared, subscription, &delivery, &failure).await)
                }
            }
        }
    }
    .instrument(span)
    .await
}

/// A failed handler run: what went wrong, and whether the transaction it ran in may run again
/// as a whole (its error, or one in the error's chain, is a transient transaction error).
#[derive(Debug)]
pub(crate) struct Failure {
    pub(super) message: String,
    pub(super) transient: bool,
    /// The handler said no retry can help ([`Permanent`]).
    pub(super) permanent: bool,
    /// How it failed, for the metrics.
    pub(super) kind: FailureKind,
}

impl Failure {
    pub(super) fn new(message: impl Into<String>) -> Self {
        Failure {
            message: message.into(),
            transient: false,
            permanent: false,
            kind: FailureKind::Error,
        }
    }

    pub(super) fn panic(message: impl Into<String>) -> Self {
        Failure {
            kind: FailureKind::Panic,
            ..Failure::new(message)
        }
    }

    /// The failure of a handler that returned `error`: permanent when it is [`Permanent`],
    /// transient when the store says its transaction may run again.
    pub(super) fn of_error<S: Store>(error: &(dyn std::error::Error + 'static)) -> Self {
        let permanent = error.downcast_ref::<Permanent>().is_some();
        Failure {
            message: crate::error::chain(error),
            transient: is_transient::<S>(error),
            permanent,
            kind: if permanent {
                FailureKind::Permanent
            } else {
                FailureKind::Error
            },
        }
    }
}

/// Calls the handler, turning an error or a panic into a failure.
async fn call<S: Store>(
    shared: &Shared<S>,
    subscription: &Subscription,
    delivery: &Claimed<S::Lease>,
    context: HandlerContext<S>,
) -> Result<(), Failure> {
    let started = Instant::now();
    let result = call_timed(subscription, &shared.settings.state, delivery, context).await;
    if let Some(metrics) = shared.metrics.handler(&delivery.handler) {
        let seconds = started.elapsed().as_secs_f64();
        let outcome = match &result {
            Ok(()) => {
                metrics.succeeded.record(seconds);
                crate::activity::Outcome::Succeeded
            }
            Err(failure) => {
                metrics.failed(failure.kind, seconds);
                crate::activity::Outcome::Failed
            }
        };
        metrics.activity.record(outcome, shared.now());
    }
    result
}

/// Calls the handler, within its timeout, catching its panics.
async fn call_timed<S: Store>(
    subscription: &Subscription,
    state: &StateMap,
    delivery: &Claimed<S::Lease>,
    context: HandlerContext<S>,
) -> Result<(), Failure> {
    let payload = serde_json::Value::Object(delivery.event.payload().clone());
    let future = match std::panic::catch_unwind(AssertUnwindSafe(|| {
        subscription.call(payload, context, state)
    })) {
        Ok(future) => future,
        Err(panic) => return Err(Failure::panic(panic_message(panic.as_ref()))),
    };
    let run = AssertUnwindSafe(future).catch_unwind();
    let ended = match subscription.timeout {
        Some(limit) => match tokio::time::timeout(limit, run).await {
            Ok(ended) => ended,
            Err(_) => {
                return Err(Failure {
                    kind: FailureKind::Timeout,
                    ..Failure::new(format!(
                        "the handler did not finish within its timeout of {limit:?}"
                    ))
                });
            }
        },
        None => run.await,
    };
    match ended {
        Ok(Ok(())) => Ok(()),
        Ok(Err(error)) => Err(Failure::of_error::<S>(error.as_ref())),
        Err(panic) => Err(Failure::panic(panic_message(panic.as_ref()))),
    }
}

/// Runs a transactional handler in a transaction that also completes its delivery, running
/// the transaction again after transient errors until the lease is nearly spent; the delivery
/// is then given back uncharged.
async fn run_transactional<S: Store>(
    shared: &Shared<S>,
    subscription: &Subscription,
    delivery: &Claimed<S::Lease>,
) -> Outcome<S::Lease> {
    let mut attempts = Attempts::new(None).retry_until(retry_deadline(
        delivery.lease_expires_at,
        shared.now(),
        shared.settings.lease_duration,
    ));
    // One session for every attempt, lent to the handler through its context.
    let session = match shared.store.session().await {
        Ok(session) => Arc::new(Mutex::new(session)),
        Err(error) => {
            warn!(%error, "could not start the handler's transaction; releasing the delivery");
            return Outcome::Settled(release(shared, &delivery.lease).await);
        }
    };
    loop {
        attempts.start();
        let failure =
            match transactional_attempt(shared, subscription, delivery, &session, &mut attempts)
                .await
            {
                Ok(outcome) => return outcome,
                Err(failure) => failure,
            };
        match failure {
            AttemptFailure::Transient(failure) => {
                if attempts.time_left() {
                    debug!(message = %failure.message, attempt = attempts.attempt(), "transient error in the handler's transaction; running it again");
                    continue;
                }
                warn!(
                    message = %failure.message,
                    "the handler's transaction kept failing with transient errors until its lease was nearly spent; releasing the delivery uncharged"
                );
                return Outcome::Settled(release(shared, &delivery.lease).await);
            }
            AttemptFailure::Failed(failure) => {
                return Outcome::Settled(fail(shared, subscription, delivery, &failure).await);
            }
            AttemptFailure::Store(error) => {
                warn!(%error, "could not start the handler's transaction; releasing the delivery");
                return Outcome::Settled(release(shared, &delivery.lease).await);
            }
        }
    }
}

/// When a transactional handler stops retrying: a margin before its lease ends.
pub(super) fn retry_deadline(
    lease_expires_at: Timestamp,
    now: Timestamp,
    lease_duration: Duration,
) -> Instant {
    let margin = LEASE_MARGIN.min(lease_duration / 4);
    let left = lease_expires_at.duration_since(now);
    Instant::now() + left.saturating_sub(margin)
}

enum AttemptFailure {
    /// The transaction can run again as a whole.
    Transient(Failure),
    /// The handler failed: the attempt counts.
    Failed(Failure),
    /// The store could not even start the transaction.
    Store(Error),
}

impl AttemptFailure {
    /// A failure of the store's own step (completing, committing) inside the transaction.
    fn of_store(error: Error) -> Self {
        let failure = Failure {
            transient: error.is_transient_transaction_error(),
            ..Failure::new(error.to_string())
        };
        AttemptFailure::of(failure)
    }

    fn of(failure: Failure) -> Self {
        if failure.transient {
            AttemptFailure::Transient(failure)
        } else {
            AttemptFailure::Failed(failure)
        }
    }
}

/// The session a transactional handler's attempts share with it.
type SharedSession<S> = Arc<Mutex<<S as Transactions>::Session>>;

/// One run of the handler's transaction.
async fn transactional_attempt<S: Store>(
    shared: &Shared<S>,
    subscription: &Subscription,
    delivery: &Claimed<S::Lease>,
    shared_session: &SharedSession<S>,
    attempts: &mut Attempts,
) -> Result<Outcome<S::Lease>, AttemptFailure> {
    let store = &shared.store;
    store
        .begin(&mut *shared_session.lock().await, None)
        .await
        .map_err(AttemptFailure::Store)?;
    let context = HandlerContext::<S>::for_delivery(
        &delivery.event,
        &delivery.handler,
        delivery.sequence,
        delivery.attempt,
        Some(Arc::clone(shared_session)),
    );
    let result = call(shared, subscription, delivery, context).await;
    // The handler is done; a guard it leaked into a task of its own would block here, so wait
    // for the session only as long as a transaction may live.
    let guard = tokio::time::timeout(
        Duration::from_secs(60),
        Arc::clone(shared_session).lock_owned(),
    )
    .await;
    let Ok(mut guard) = guard else {
        return Err(AttemptFailure::Failed(Failure::new(
            "the handler kept its transaction session after it returned",
        )));
    };
    let session = &mut *guard;
    if let Err(failure) = result {
        store.abort(session).await;
        return Err(AttemptFailure::of(failure));
    }
    complete_and_commit(shared, delivery, session, attempts).await
}

/// Completes the delivery in the handler's transaction and commits it.
async fn complete_and_commit<S: Store>(
    shared: &Shared<S>,
    delivery: &Claimed<S::Lease>,
    session: &mut S::Session,
    attempts: &mut Attempts,
) -> Result<Outcome<S::Lease>, AttemptFailure> {
    let store = &shared.store;
    match store
        .complete_in_transaction(session, &delivery.lease, shared.now())
        .await
    {
        Ok(true) => {}
        Ok(false) => {
            store.abort(session).await;
            warn!(
                "the lease ended before the handler's transaction could complete the delivery; its writes were rolled back"
            );
            return Ok(Outcome::Settled(Settled::Lost));
        }
        Err(error) => {
            store.abort(session).await;
            return Err(AttemptFailure::of_store(error));
        }
    }
    match attempts.commit(store, session).await {
        Ok(Committed::Yes) => {
            debug!("handler succeeded and its delivery completed in its transaction");
            Ok(Outcome::Completed)
        }
        Ok(Committed::RunAgain) => Err(AttemptFailure::Transient(Failure {
            transient: true,
            ..Failure::new("the commit met a transient error")
        })),
        Err(error) => Err(AttemptFailure::of_store(error)),
    }
}

/// Whether an error, or one in its chain, lets the whole transaction run again: a relaybus
/// error or database error saying so, or a driver error the store recognizes.
pub(super) fn is_transient<S: Store>(error: &(dyn std::error::Error + 'static)) -> bool {
    let mut next = Some(error);
    while let Some(error) = next {
        let transient = if let Some(error) = error.downcast_ref::<Error>() {
            error.is_transient_transaction_error()
        } else if let Some(error) = error.downcast_ref::<DatabaseError>() {
            error.is_transient()
        } else {
            S::is_transient(error)
        };
        if transient {
            return true;
        }
        next = error.source();
    }
    false
}

pub(super) fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    let text = panic
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic payload that is not a string".to_owned());
    format!("handler panicked: {text}")
}

/// Ends a failed attempt: a retry after the backoff, or the dead letters after the last attempt.
pub(super) async fn fail<S: Store>(
    shared: &Shared<S>,
    subscription: &Subscription,
    delivery: &Claimed<S::Lease>,
    failure: &Failure,
) -> Settled {
    let policy = subscription.retry.unwrap_or(shared.settings.retry);
    let now = shared.now();
    let lease = &delivery.lease;
    let attempt = delivery.attempt;
    let message = failure.message.as_str();
    if failure.permanent || attempt >= policy.max_attempts() {
        return match shared.store.bury(lease, message, now).await {
            Ok(true) => {
                if let Some(metrics) = shared.metrics.handler(&delivery.handler) {
                    metrics.dead_letters.increment(1);
                    metrics
                        .activity
                        .record(crate::activity::Outcome::DeadLettered, now);
                }
                warn!(error = %message, attempt, "handler failed for the last time; the delivery is dead");
                Settled::Buried {
                    error: message.to_owned(),
                }
            }
            Ok(false) => {
                debug!("the lease ended before the delivery could be buried");
                Settled::Lost
            }
            Err(error) => {
                warn!(%error, "could not bury the delivery; it runs again once its lease ends");
                Settled::Lost
            }
        };
    }
    let wait = jittered(policy.backoff(attempt));
    let due_at = now.saturating_add(wait);
    match shared.store.reschedule(lease, due_at, message, now).await {
        Ok(true) => {
            if let Some(metrics) = shared.metrics.handler(&delivery.handler) {
                metrics.retries.increment(1);
            }
            warn!(error = %message, attempt, retry_in_ms = wait.as_millis() as u64, "handler failed; retrying later");
            Settled::Retried {
                error: message.to_owned(),
                due_at,
            }
        }
        Ok(false) => {
            debug!("the lease ended before the delivery could be rescheduled");
            Settled::Lost
        }
        Err(error) => {
            warn!(%error, "could not reschedule the delivery; it runs again once its lease ends");
            Settled::Lost
        }
    }
}

/// Takes up to a quarter off a wait, at random, so that retries of many deliveries spread out.
fn jittered(wait: Duration) -> Duration {
    let quarter = wait.as_millis() as u64 / 4;
    let cut = rand::rng().random_range(0..=quarter);
    wait.saturating_sub(Duration::from_millis(cut))
}

/// Gives a delivery back without charging an attempt.
pub(crate) async fn release<S: Store>(shared: &Shared<S>, lease: &S::Lease) -> Settled {
    match shared.store.release(lease, shared.now()).await {
        Ok(true) => Settled::Released,
        Ok(false) => Settled::Lost,
        Err(error) => {
            warn!(%error, "could not release a delivery; it runs again once its lease ends");
            Settled::Lost
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jitter_takes_at_most_a_quarter() {
        for _ in 0..100 {
            let wait = jittered(Duration::from_millis(1000));
            assert!(wait >= Duration::from_millis(750) && wait <= Duration::from_millis(1000));
        }
        assert_eq!(jittered(Duration::ZERO), Duration::ZERO);
    }

    #[test]
    fn error_chains_are_flattened() {
        #[derive(Debug, thiserror::Error)]
        #[error("outer")]
        struct Outer(#[source] std::io::Error);
        let error = Outer(std::io::Error::other("inner"));
        assert_eq!(crate::error::chain(&error), "outer: inner");
        let panic: Box<dyn std::any::Any + Send> = Box::new("boom");
        assert_eq!(panic_message(panic.as_ref()), "handler panicked: boom");
    }
}
