//! The request's transaction: a slot in the request's extensions, started by the first
//! extraction, leased to one extractor at a time, and resolved from the response status.

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use axum::{
    http::Extensions,
    response::{IntoResponse, Response},
};
use relaybus::Store;
use tokio::sync::{Mutex, OwnedMutexGuard};

use super::{Outcome, RetryRequest, commit::commit, count, error::CommitError};
use crate::{
    config::Shared,
    rejection::{
        MissingRequestTx, OverlappingExtractors, StartTransaction, TransactionEnded, TxRejection,
    },
};

/// The request's transaction, shared by the request extensions (for the extractors) and the
/// layer's future (to resolve it).
pub(crate) struct Slot<St: Store> {
    pub(crate) shared: Arc<Shared<St>>,
    state: Arc<Mutex<State<St>>>,
    /// This attempt's budget: the whole budget for the first, what is left for the others.
    budget: Duration,
}

impl<St: Store> Clone for Slot<St> {
    fn clone(&self) -> Self {
        Slot {
            shared: Arc::clone(&self.shared),
            state: Arc::clone(&self.state),
            budget: self.budget,
        }
    }
}

enum State<St: Store> {
    /// Nothing started yet.
    Idle,
    /// A session with a started transaction.
    Open {
        session: Box<St::Session>,
        started: Instant,
    },
    /// Committed, aborted, or never started, and the response is on its way.
    Ended,
}

impl<St: Store> Slot<St> {
    pub(crate) fn new(shared: Arc<Shared<St>>, budget: Duration) -> Self {
        Slot {
            shared,
            state: Arc::new(Mutex::new(State::Idle)),
            budget,
        }
    }

    /// The slot of a request, or the rejection for a router without the layer.
    pub(crate) fn of(extensions: &Extensions) -> Result<Slot<St>, MissingRequestTx> {
        extensions
            .get::<Slot<St>>()
            .cloned()
            .ok_or(MissingRequestTx)
    }

    /// Takes the session, starting it and its transaction on first use.
    ///
    /// Cancel safe: dropped before the transaction started, the slot stays idle.
    pub(crate) async fn lease(&self) -> Result<Lease<St>, TxRejection> {
        let mut guard = Arc::clone(&self.state)
            .try_lock_owned()
            .map_err(|_| OverlappingExtractors)?;
        match &*guard {
            State::Open { .. } => {}
            State::Ended => return Err(TransactionEnded.into()),
            State::Idle => {
                // The store's own transaction options, with the budget bounding the commit.
                let store = self.shared.bus.store();
                let start = async {
                    let mut session = store.session().await?;
                    store.begin(&mut session, Some(self.budget)).await?;
                    Ok::<_, relaybus::Error>(session)
                };
                let session = start.await.map_err(StartTransaction)?;
                *guard = State::Open {
                    session: Box::new(session),
                    started: Instant::now(),
                };
            }
        }
        Ok(Lease { guard })
    }

    /// Aborts the transaction if one is open, and makes the slot idle again: the next
    /// extraction starts a new transaction. Does nothing while an extractor holds it.
    pub(crate) async fn restart(&self) {
        let Ok(mut guard) = Arc::clone(&self.state).try_lock_owned() else {
            return;
        };
        if let State::Open { mut session, .. } = std::mem::replace(&mut *guard, State::Idle) {
            self.shared.bus.store().abort(&mut session).await;
            count("aborted");
        }
    }

    /// Commits or aborts from the response status, and ends the slot.
    pub(crate) async fn resolve(&self, response: Response) -> (Response, Outcome) {
        let Ok(mut guard) = Arc::clone(&self.state).try_lock_owned() else {
            // An extractor outlived its handler (moved into a spawned task, say). The
            // transaction cannot be committed under it; it is aborted when that extractor
            // drops, and the client must not believe its request succeeded.
            tracing::error!(
                "the request transaction is still held by an extractor after the response; \
                 do not move `Tx` or `Publisher` out of the handler"
            );
            return (CommitError::StillHeld.into_response(), Outcome::default());
        };
        let State::Open {
            mut session,
            started,
        } = std::mem::replace(&mut *guard, State::Ended)
        else {
            return (response, Outcome::default());
        };
        drop(guard);
        let mut outcome = Outcome {
            opened: Some(started),
            retry: false,
        };
        let shared = &self.shared;
        let store = shared.bus.store();
        if !shared.policy.commits(response.status()) {
            store.abort(&mut session).await;
            count("aborted");
            outcome.retry = response.extensions().get::<RetryRequest>().is_some();
            return (response, outcome);
        }
        let elapsed = started.elapsed();
        if elapsed > self.budget {
            store.abort(&mut session).await;
            count("aborted");
            let timed_out = CommitError::TimedOut {
                budget: self.budget,
                elapsed,
                retry_after: shared.retry_after,
                outcome_known: true,
            };
            return (timed_out.into_response(), outcome);
        }
        match commit(&mut *session, shared, started, self.budget).await {
            Ok(()) => {
                count("committed");
                (response, outcome)
            }
            Err(error) => {
                count(if matches!(error, CommitError::NotAcknowledged(_)) {
                    "unacknowledged"
                } else {
                    "aborted"
                });
                if matches!(error, CommitError::NotAcknowledged(_)) {
                    tracing::error!(%error, "the request transaction committed unacknowledged");
                } else if matches!(error, CommitError::Database(_)) {
                    tracing::error!(%error, "the request transaction did not commit");
                } else {
                    tracing::debug!(%error, "the request transaction did not commit");
                }
                outcome.retry = matches!(error, CommitError::Transient { .. });
                (error.into_response(), outcome)
            }
        }
    }
}

/// Exclusive use of the request's session, with its transaction started; held by an extractor.
pub(crate) struct Lease<St: Store> {
    guard: OwnedMutexGuard<State<St>>,
}

impl<St: Store> Lease<St> {
    pub(crate) fn session(&self) -> &St::Session {
        match &*self.guard {
            State::Open { session, .. } => session,
            _ => panic!("BUG: a lease of a request transaction that is not open"),
        }
    }

    pub(crate) fn session_mut(&mut self) -> &mut St::Session {
        match &mut *self.guard {
            State::Open { session, .. } => session,
            _ => panic!("BUG: a lease of a request transaction that is not open"),
        }
    }
}
