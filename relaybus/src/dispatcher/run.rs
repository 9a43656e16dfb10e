//! Running one claimed delivery: the handler, then completion, retry or burial.

use std::{
    panic::AssertUnwindSafe,
    sync::Arc,
    time::{Duration, Instant},
};

use futures::FutureExt;
use mongodb::{
    ClientSession,
    bson::DateTime,
    error::{TRANSIENT_TRANSACTION_ERROR, UNKNOWN_TRANSACTION_COMMIT_RESULT},
};
use tokio::sync::Mutex;
use tracing::{Instrument, debug, info_span, warn};

use super::Shared;
use crate::{
    error::Error,
    handler::{HandlerContext, Subscription},
    store::mongo::{ClaimedDelivery, Lease},
};

/// How long a transactional handler's transaction is tried again after transient errors.
const TRANSACTION_RETRY_LIMIT: Duration = Duration::from_secs(120);

/// How one run of a delivery ended.
#[derive(Debug)]
pub(crate) enum Outcome {
    /// The handler succeeded; its delivery still has to be completed (batched).
    Succeeded(Lease),
    /// The delivery was settled here: completed in the handler's transaction, rescheduled,
    /// buried, or its lease was lost.
    Settled,
}

/// Runs the delivery's handler and settles what the handler's result decides, except the
/// completion of a non-transactional success, which the caller batches.
pub(crate) async fn run_delivery(shared: &Shared, delivery: ClaimedDelivery) -> Outcome {
    let span = info_span!(
        "relaybus.handle",
        event_id = delivery.event_id(),
        event_type = delivery.event_type(),
        handler = delivery.handler(),
        attempt = delivery.attempt(),
        lane = delivery.lease().lane(),
    );
    async move {
        let Some(subscription) = shared.subscriptions.get(delivery.handler()) else {
            // The claim asks only for our handlers, so this cannot happen; give it back.
            warn!("claimed a delivery of a handler this bus does not run; releasing it");
            release(shared, delivery.lease()).await;
            return Outcome::Settled;
        };
        if subscription.transactional {
            run_transactional(shared, subscription, &delivery).await
        } else {
            let context = HandlerContext::for_delivery(
                delivery.event(),
                delivery.handler(),
                delivery.sequence(),
                delivery.attempt(),
                None,
            );
            match call(subscription, &delivery, context).await {
                Ok(()) => {
                    debug!("handler succeeded");
                    Outcome::Succeeded(*delivery.lease())
                }
                Err(message) => {
                    fail(shared, subscription, &delivery, &message).await;
                    Outcome::Settled
                }
            }
        }
    }
    .instrument(span)
    .await
}

/// Calls the handler, turning an error or a panic into a message.
async fn call(
    subscription: &Subscription,
    delivery: &ClaimedDelivery,
    context: HandlerContext,
) -> Result<(), String> {
    let payload = serde_json::Value::Object(delivery.event().payload().clone());
    let handler = Arc::clone(&subscription.handler);
    let future = match std::panic::catch_unwind(AssertUnwindSafe(|| (handler)(payload, context))) {
        Ok(future) => future,
        Err(panic) => return Err(panic_message(panic.as_ref())),
    };
    match AssertUnwindSafe(future).catch_unwind().await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(error)) => Err(error_chain(error.as_ref())),
        Err(panic) => Err(panic_message(panic.as_ref())),
    }
}

/// Runs a transactional handler in a transaction that also completes its delivery.
async fn run_transactional(
    shared: &Shared,
    subscription: &Subscription,
    delivery: &ClaimedDelivery,
) -> Outcome {
    let started = Instant::now();
    let mut attempt = 0_u32;
    loop {
        attempt += 1;
        let failure = match transactional_attempt(shared, subscription, delivery).await {
            Ok(outcome) => return outcome,
            Err(failure) => failure,
        };
        match failure {
            AttemptFailure::Transient(message) if started.elapsed() < TRANSACTION_RETRY_LIMIT => {
                debug!(%message, attempt, "transient error in the handler's transaction; running it again");
                tokio::time::sleep(Duration::from_millis(u64::from(attempt.min(10)) * 5)).await;
            }
            AttemptFailure::Transient(message) | AttemptFailure::Failed(message) => {
                fail(shared, subscription, delivery, &message).await;
                return Outcome::Settled;
            }
            AttemptFailure::Store(error) => {
                warn!(%error, "could not start the handler's transaction; releasing the delivery");
                release(shared, delivery.lease()).await;
                return Outcome::Settled;
            }
        }
    }
}

enum AttemptFailure {
    /// The transaction can run again as a whole.
    Transient(String),
    /// The handler failed: the attempt counts.
    Failed(String),
    /// The store could not even start the transaction.
    Store(Error),
}

async fn transactional_attempt(
    shared: &Shared,
    subscription: &Subscription,
    delivery: &ClaimedDelivery,
) -> Result<Outcome, AttemptFailure> {
    let store = &shared.store;
    let inner = &store.inner;
    let mut session = inner
        .client
        .start_session()
        .await
        .map_err(|e| AttemptFailure::Store(e.into()))?;
    session
        .start_transaction()
        .with_options(inner.transaction_options.clone())
        .await
        .map_err(|e| AttemptFailure::Store(e.into()))?;
    let shared_session = Arc::new(Mutex::new(session));
    let context = HandlerContext::for_delivery(
        delivery.event(),
        delivery.handler(),
        delivery.sequence(),
        delivery.attempt(),
        Some(Arc::clone(&shared_session)),
    );
    let result = call(subscription, delivery, context).await;
    // The handler is done; a guard it leaked into a task of its own would block here, so wait
    // for the session only as long as a transaction may live.
    let mut session = match tokio::time::timeout(
        Duration::from_secs(60),
        Arc::clone(&shared_session).lock_owned(),
    )
    .await
    {
        Ok(guard) => guard,
        Err(_) => {
            return Err(AttemptFailure::Failed(
                "the handler kept its transaction session after it returned".to_owned(),
            ));
        }
    };
    if let Err(message) = result {
        let _ = session.abort_transaction().await;
        return Err(if message.contains(TRANSIENT_MARKER) {
            AttemptFailure::Transient(message)
        } else {
            AttemptFailure::Failed(message)
        });
    }
    let now = DateTime::now();
    match store
        .complete_in_transaction(&mut session, delivery.lease(), now)
        .await
    {
        Ok(true) => {}
        Ok(false) => {
            let _ = session.abort_transaction().await;
            warn!(
                "the lease ended before the handler's transaction could complete the delivery; its writes were rolled back"
            );
            return Ok(Outcome::Settled);
        }
        Err(error) => {
            let _ = session.abort_transaction().await;
            let message = error.to_string();
            return Err(if error.is_transient_transaction_error() {
                AttemptFailure::Transient(message)
            } else {
                AttemptFailure::Failed(message)
            });
        }
    }
    commit(&mut session).await?;
    debug!("handler succeeded and its delivery completed in its transaction");
    Ok(Outcome::Settled)
}

async fn commit(session: &mut ClientSession) -> Result<(), AttemptFailure> {
    let started = Instant::now();
    loop {
        match session.commit_transaction().await {
            Ok(()) => return Ok(()),
            Err(error)
                if error.contains_label(UNKNOWN_TRANSACTION_COMMIT_RESULT)
                    && started.elapsed() < TRANSACTION_RETRY_LIMIT => {}
            Err(error) if error.contains_label(TRANSIENT_TRANSACTION_ERROR) => {
                return Err(AttemptFailure::Transient(error.to_string()));
            }
            Err(error) => return Err(AttemptFailure::Failed(error.to_string())),
        }
    }
}

/// Marks a handler error that carries the `TransientTransactionError` label somewhere in its
/// chain, so the transactional runner can tell it from a plain failure.
const TRANSIENT_MARKER: &str = "[transient transaction error]";

/// The message of an error with its sources, marked when it is a transient transaction error.
fn error_chain(error: &(dyn std::error::Error + 'static)) -> String {
    let mut message = error.to_string();
    let mut transient = is_transient(error);
    let mut source = error.source();
    while let Some(cause) = source {
        let text = cause.to_string();
        if !message.contains(&text) {
            message.push_str(": ");
            message.push_str(&text);
        }
        transient |= is_transient(cause);
        source = cause.source();
    }
    if transient {
        message.push(' ');
        message.push_str(TRANSIENT_MARKER);
    }
    message
}

fn is_transient(error: &(dyn std::error::Error + 'static)) -> bool {
    if let Some(error) = error.downcast_ref::<mongodb::error::Error>() {
        return error.contains_label(TRANSIENT_TRANSACTION_ERROR);
    }
    if let Some(error) = error.downcast_ref::<Error>() {
        return error.is_transient_transaction_error();
    }
    false
}

fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    let text = panic
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic payload that is not a string".to_owned());
    format!("handler panicked: {text}")
}

/// Ends a failed attempt: a retry after the backoff, or the dead letters after the last attempt.
async fn fail(
    shared: &Shared,
    subscription: &Subscription,
    delivery: &ClaimedDelivery,
    message: &str,
) {
    let policy = subscription.retry.unwrap_or(shared.settings.retry);
    let now = DateTime::now();
    let lease = delivery.lease();
    let attempt = delivery.attempt();
    if attempt >= policy.max_attempts() {
        match shared.store.bury(lease, message, now).await {
            Ok(true) => {
                warn!(error = %message, attempt, "handler failed for the last time; the delivery is dead")
            }
            Ok(false) => debug!("the lease ended before the delivery could be buried"),
            Err(error) => {
                warn!(%error, "could not bury the delivery; it runs again once its lease ends")
            }
        }
        return;
    }
    let wait = jittered(policy.backoff(attempt));
    let due_at = DateTime::from_millis(
        now.timestamp_millis()
            .saturating_add(wait.as_millis() as i64),
    );
    match shared.store.reschedule(lease, due_at, message, now).await {
        Ok(true) => {
            warn!(error = %message, attempt, retry_in_ms = wait.as_millis() as u64, "handler failed; retrying later")
        }
        Ok(false) => debug!("the lease ended before the delivery could be rescheduled"),
        Err(error) => {
            warn!(%error, "could not reschedule the delivery; it runs again once its lease ends")
        }
    }
}

/// Takes up to a quarter off a wait, at random, so that retries of many deliveries spread out.
fn jittered(wait: Duration) -> Duration {
    // The low bits of a UUID v7 are random.
    let random = uuid::Uuid::now_v7().as_u128() as u64;
    let quarter = wait.as_millis() as u64 / 4;
    let cut = if quarter == 0 {
        0
    } else {
        random % (quarter + 1)
    };
    wait.saturating_sub(Duration::from_millis(cut))
}

/// Gives a delivery back without charging an attempt.
pub(crate) async fn release(shared: &Shared, lease: &Lease) {
    if let Err(error) = shared.store.release(lease, DateTime::now()).await {
        warn!(%error, "could not release a delivery; it runs again once its lease ends");
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
    fn error_chains_are_flattened_and_marked() {
        #[derive(Debug, thiserror::Error)]
        #[error("outer")]
        struct Outer(#[source] std::io::Error);
        let error = Outer(std::io::Error::other("inner"));
        assert_eq!(error_chain(&error), "outer: inner");
        let panic: Box<dyn std::any::Any + Send> = Box::new("boom");
        assert_eq!(panic_message(panic.as_ref()), "handler panicked: boom");
    }
}
