//! Running a batch of deliveries of one batch handler: the handler once, then each delivery
//! settled as its [`BatchOutcome`](crate::BatchOutcome) says.
//!
//! A transactional batch runs in one transaction that completes every delivery that
//! succeeded; the failed ones are settled after it commits. A transaction that meets a
//! transient error runs again as a whole while the batch's leases last; a delivery whose lease
//! ended before the completion aborts the transaction, and the others go back uncharged.

use std::{
    panic::AssertUnwindSafe,
    sync::Arc,
    time::{Duration, Instant},
};

use futures::FutureExt;
use tokio::sync::Mutex;
use tracing::{Instrument, debug, info_span, warn};

use super::{
    Shared,
    run::{Failure, Outcome, fail, panic_message, release, retry_deadline},
};
use crate::{
    batch::{BatchOutcome, ItemMeta},
    handler::{HandlerContext, Subscription},
    store::{
        Claimed, Store,
        transaction::{Attempts, Committed},
    },
    telemetry::FailureKind,
};

/// Runs `deliveries` (all of `subscription`, a batch handler) as one batch and settles each;
/// one outcome per delivery, in their order.
pub(crate) async fn run_batch_deliveries<S: Store>(
    shared: &Shared<S>,
    subscription: &Subscription,
    deliveries: &[Claimed<S::Lease>],
) -> Vec<Outcome<S::Lease>> {
    let span = info_span!(
        "relaybus.handle_batch",
        handler = subscription.id,
        deliveries = deliveries.len(),
    );
    async move {
        if let Some(metrics) = shared.metrics.handler(&subscription.id) {
            metrics.attempts.increment(deliveries.len() as u64);
            metrics.batch_size.record(deliveries.len() as f64);
            let now = shared.now();
            for delivery in deliveries.iter().filter(|d| d.attempt == 1) {
                let waited = now.duration_since(delivery.event.created_at());
                metrics.latency.record(waited.as_secs_f64());
            }
        }
        if subscription.transactional {
            return run_transactional_batch(shared, subscription, deliveries).await;
        }
        let context = context_of(deliveries, &subscription.id, None);
        match call_batch(shared, subscription, deliveries, context).await {
            Ok(outcome) => settle(shared, subscription, deliveries, &outcome, false).await,
            Err(failure) => fail_all(shared, subscription, deliveries, &failure).await,
        }
    }
    .instrument(span)
    .await
}

/// The context a batch handler gets: its first delivery's, with the batch's session.
fn context_of<S: Store>(
    deliveries: &[Claimed<S::Lease>],
    handler: &str,
    session: Option<Arc<Mutex<S::Session>>>,
) -> HandlerContext<S> {
    let first = &deliveries[0];
    HandlerContext::for_delivery(
        &first.event,
        handler,
        first.sequence,
        first.attempt,
        session,
    )
}

/// Calls the batch handler within its timeout, catching its panics.
async fn call_batch<S: Store>(
    shared: &Shared<S>,
    subscription: &Subscription,
    deliveries: &[Claimed<S::Lease>],
    context: HandlerContext<S>,
) -> Result<BatchOutcome, Failure> {
    let Some(spec) = subscription.batch.as_ref() else {
        return Err(Failure::new(
            "BUG: a batch of a handler that takes no batches",
        ));
    };
    let items: Vec<(serde_json::Value, ItemMeta)> = deliveries
        .iter()
        .map(|delivery| {
            (
                serde_json::Value::Object(delivery.event.payload().clone()),
                ItemMeta {
                    event_id: delivery.event.id().to_owned(),
                    key: delivery.event.key().map(str::to_owned),
                    sequence: delivery.sequence,
                    attempt: delivery.attempt,
                },
            )
        })
        .collect();
    let started = Instant::now();
    let called = {
        let parts = crate::handler::seal::Parts {
            context: &context,
            state: &shared.settings.state,
        };
        std::panic::catch_unwind(AssertUnwindSafe(|| (spec.handler)(items, &parts)))
    };
    let result = match called {
        Err(panic) => Err(Failure::panic(panic_message(panic.as_ref()))),
        Ok(future) => {
            let run = AssertUnwindSafe(future).catch_unwind();
            let ended = match subscription.timeout {
                Some(limit) => tokio::time::timeout(limit, run).await.map_err(|_| Failure {
                    kind: FailureKind::Timeout,
                    ..Failure::new(format!(
                        "the batch handler did not finish within its timeout of {limit:?}"
                    ))
                }),
                None => Ok(run.await),
            };
            match ended {
                Err(failure) => Err(failure),
                Ok(Err(panic)) => Err(Failure::panic(panic_message(panic.as_ref()))),
                Ok(Ok(Ok(outcome))) => Ok(outcome),
                Ok(Ok(Err(error))) => Err(Failure::of_error::<S>(error.as_ref())),
            }
        }
    };
    if let Some(metrics) = shared.metrics.handler(&subscription.id) {
        let seconds = started.elapsed().as_secs_f64();
        let now = shared.now();
        match &result {
            Ok(outcome) => {
                metrics.succeeded.record(seconds);
                let failed = outcome.failures().min(deliveries.len());
                for at in 0..deliveries.len() {
                    let ran = if at < failed {
                        crate::activity::Outcome::Failed
                    } else {
                        crate::activity::Outcome::Succeeded
                    };
                    metrics.activity.record(ran, now);
                }
            }
            Err(failure) => {
                metrics.failed(failure.kind, seconds);
                for _ in deliveries {
                    metrics
                        .activity
                        .record(crate::activity::Outcome::Failed, now);
                }
            }
        }
    }
    result
}

/// Settles each delivery as `outcome` says: the failed ones fail (retried or buried), the
/// others succeeded (`completed`: in the batch's transaction already).
async fn settle<S: Store>(
    shared: &Shared<S>,
    subscription: &Subscription,
    deliveries: &[Claimed<S::Lease>],
    outcome: &BatchOutcome,
    completed: bool,
) -> Vec<Outcome<S::Lease>> {
    let mut outcomes = Vec::with_capacity(deliveries.len());
    for (position, delivery) in deliveries.iter().enumerate() {
        outcomes.push(match outcome.failure(position) {
            Some((message, permanent)) => {
                let failure = Failure {
                    permanent,
                    kind: if permanent {
                        FailureKind::Permanent
                    } else {
                        FailureKind::Error
                    },
                    ..Failure::new(message)
                };
                Outcome::Settled(fail(shared, subscription, delivery, &failure).await)
            }
            None if completed => Outcome::Completed,
            None => Outcome::Succeeded(delivery.lease.clone()),
        });
    }
    debug!(
        deliveries = deliveries.len(),
        failed = outcome.failures(),
        "batch handled"
    );
    outcomes
}

/// The whole batch failed: each delivery fails with `failure`.
async fn fail_all<S: Store>(
    shared: &Shared<S>,
    subscription: &Subscription,
    deliveries: &[Claimed<S::Lease>],
    failure: &Failure,
) -> Vec<Outcome<S::Lease>> {
    let mut outcomes = Vec::with_capacity(deliveries.len());
    for delivery in deliveries {
        outcomes.push(Outcome::Settled(
            fail(shared, subscription, delivery, failure).await,
        ));
    }
    outcomes
}

/// Gives every delivery back uncharged.
async fn release_all<S: Store>(
    shared: &Shared<S>,
    deliveries: &[Claimed<S::Lease>],
) -> Vec<Outcome<S::Lease>> {
    let mut outcomes = Vec::with_capacity(deliveries.len());
    for delivery in deliveries {
        outcomes.push(Outcome::Settled(release(shared, &delivery.lease).await));
    }
    outcomes
}

/// What one run of a batch's transaction came to.
enum Attempt<L> {
    /// Settled: these are the outcomes.
    Done(Vec<Outcome<L>>),
    /// Run the transaction again, if time is left (with the reason).
    Again(String),
    /// Give the batch back uncharged.
    GiveBack(String),
}

/// Runs a transactional batch handler in one transaction that completes every delivery that
/// succeeded.
async fn run_transactional_batch<S: Store>(
    shared: &Shared<S>,
    subscription: &Subscription,
    deliveries: &[Claimed<S::Lease>],
) -> Vec<Outcome<S::Lease>> {
    let expires_at = deliveries
        .iter()
        .map(|d| d.lease_expires_at)
        .min()
        .unwrap_or_else(|| shared.now());
    let mut attempts = Attempts::new(None).retry_until(retry_deadline(
        expires_at,
        shared.now(),
        shared.settings.lease_duration,
    ));
    let session = match shared.store.session().await {
        Ok(session) => Arc::new(Mutex::new(session)),
        Err(error) => {
            warn!(%error, "could not start the batch's transaction; releasing its deliveries");
            return release_all(shared, deliveries).await;
        }
    };
    loop {
        attempts.start();
        match transactional_attempt(shared, subscription, deliveries, &session, &mut attempts).await
        {
            Attempt::Done(outcomes) => return outcomes,
            Attempt::Again(reason) if attempts.time_left() => {
                debug!(%reason, attempt = attempts.attempt(), "transient error in the batch's transaction; running it again");
            }
            Attempt::Again(reason) | Attempt::GiveBack(reason) => {
                warn!(%reason, "the batch's transaction could not commit; releasing its deliveries uncharged");
                return release_all(shared, deliveries).await;
            }
        }
    }
}

/// One run of a batch's transaction.
async fn transactional_attempt<S: Store>(
    shared: &Shared<S>,
    subscription: &Subscription,
    deliveries: &[Claimed<S::Lease>],
    session: &Arc<Mutex<S::Session>>,
    attempts: &mut Attempts,
) -> Attempt<S::Lease> {
    let store = &shared.store;
    if let Err(error) = store.begin(&mut *session.lock().await, None).await {
        return Attempt::GiveBack(error.to_string());
    }
    let context = context_of(deliveries, &subscription.id, Some(Arc::clone(session)));
    let result = call_batch(shared, subscription, deliveries, context).await;
    let guard =
        tokio::time::timeout(Duration::from_secs(60), Arc::clone(session).lock_owned()).await;
    let Ok(mut guard) = guard else {
        let failure =
            Failure::new("the batch handler kept its transaction session after it returned");
        return Attempt::Done(fail_all(shared, subscription, deliveries, &failure).await);
    };
    let session = &mut *guard;
    let outcome = match result {
        Ok(outcome) => outcome,
        Err(failure) => {
            store.abort(session).await;
            if failure.transient {
                return Attempt::Again(failure.message);
            }
            return Attempt::Done(fail_all(shared, subscription, deliveries, &failure).await);
        }
    };
    let succeeded: Vec<S::Lease> = deliveries
        .iter()
        .enumerate()
        .filter(|(position, _)| outcome.failure(*position).is_none())
        .map(|(_, delivery)| delivery.lease.clone())
        .collect();
    match store
        .complete_many_in_transaction(session, &succeeded, shared.now())
        .await
    {
        Ok(completed) if completed.iter().all(|c| *c) => {}
        Ok(_) => {
            store.abort(session).await;
            return Attempt::GiveBack(
                "a lease of the batch ended before its transaction could complete it; its \
                 writes were rolled back"
                    .to_owned(),
            );
        }
        Err(error) => {
            store.abort(session).await;
            return if error.is_transient_transaction_error() {
                Attempt::Again(error.to_string())
            } else {
                Attempt::GiveBack(error.to_string())
            };
        }
    }
    match attempts.commit(store, session).await {
        Ok(Committed::Yes) => {
            drop(guard);
            Attempt::Done(settle(shared, subscription, deliveries, &outcome, true).await)
        }
        Ok(Committed::RunAgain) => Attempt::Again("the commit met a transient error".to_owned()),
        Err(error) if error.is_transient_transaction_error() => Attempt::Again(error.to_string()),
        Err(error) => Attempt::GiveBack(error.to_string()),
    }
}
