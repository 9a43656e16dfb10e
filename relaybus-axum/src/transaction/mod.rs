//! The request transaction: [`RequestTxLayer`] makes [`RequestTx`], which gives each request a
//! lazily started store transaction and resolves it from the response status.
//!
//! # Lifecycle
//!
//! 1. The layer puts an empty slot into the request's extensions. Nothing else happens: a
//!    request that never extracts [`Tx`](crate::Tx) or [`Publisher`](crate::Publisher) costs
//!    no database call.
//! 2. The first extraction starts a session and a transaction on the bus's store, with the
//!    transaction options the store was built with, and later extractions of the same request
//!    reuse it. An extractor holds the session until it is dropped; a second extraction while
//!    one is held fails with [`OverlappingExtractors`].
//! 3. When the inner service has answered, the transaction is committed if the
//!    [`CommitPolicy`](crate::CommitPolicy) commits the status (1xx–3xx by default) and
//!    aborted otherwise. The response is sent after that, so a client that sees a success
//!    sees committed data.
//!
//! The commit is bounded: the transaction must end within its time budget (the bus's
//! [`transaction_timeout`](relaybus::RelayBus::transaction_timeout) by default), which is also
//! sent as `maxCommitTimeMS`. A commit whose result is unknown (`UnknownTransactionCommitResult`)
//! is sent again, a few times ([`Config::commit_retries`](crate::Config::commit_retries)).
//!
//! # Retries
//!
//! A request whose transaction fails with a transient error (a write conflict on a hot ordering
//! key, a primary that stepped down) runs again, in a new transaction, after a short jittered
//! pause: when its commit fails so, or when the route's response carries
//! [`RetryRequest`] ([`PublishError`](crate::PublishError) marks its transient 503s). For that
//! the layer keeps a copy of the request's body, up to
//! [`Config::max_buffered_body`](crate::Config::max_buffered_body) (256 KiB); a larger body
//! runs once. All runs of one request share one budget, counted from the first run's
//! transaction, and run at most [`Config::request_attempts`](crate::Config::request_attempts)
//! times (25; 1 turns retries off). **The route may run more than once**: keep side effects
//! that do not go through the request's session out of it, or publish an event for them.
//!
//! A commit that still fails replaces the response with a [`CommitError`]:
//! a 503 with `Retry-After` for a transient error (nothing was committed) or for a timeout, a
//! 500 otherwise.
//!
//! # Panics and dropped requests
//!
//! When the handler panics, or the request future is dropped (the client went away, or a
//! timeout dropped it), the session is dropped with its transaction still open, and the
//! database driver aborts it (MongoDB's in the background). Nothing is ever committed from
//! `Drop`.

mod layer;

pub mod error;
pub mod future;

mod replay;

use std::{
    convert::Infallible,
    sync::Arc,
    task::{Context, Poll},
    time::{Duration, Instant},
};

use axum::{
    body::{Body, Bytes, HttpBody},
    http::{Extensions, Request, StatusCode},
    response::{IntoResponse, Response},
};
use futures::future::BoxFuture;
use relaybus::{
    BoxError, Store, Timestamp,
    store::{DefaultStore, RequestKey, RequestKeyState, StoredResponse, transaction::Attempts},
};
use tokio::sync::{Mutex, OwnedMutexGuard};
use tower::{Service, ServiceExt};

pub use self::layer::RequestTxLayer;
use self::{error::CommitError, future::ResponseFuture, replay::Buffered};
use crate::{
    config::Shared,
    rejection::{
        MissingRequestTx, OverlappingExtractors, StartTransaction, TransactionEnded, TxRejection,
    },
};

/// How long past the budget the layer waits for a commit reply before giving up on it: the
/// server stops at the budget, this covers the round trip.
const COMMIT_REPLY_GRACE: std::time::Duration = std::time::Duration::from_secs(1);

/// The middleware of [`RequestTxLayer`]: a lazily started store transaction per request,
/// committed or aborted from the response status. See the [module docs](self).
#[derive(Debug)]
pub struct RequestTx<S, St: Store = DefaultStore> {
    inner: S,
    shared: Arc<Shared<St>>,
}

impl<S: Clone, St: Store> Clone for RequestTx<S, St> {
    fn clone(&self) -> Self {
        RequestTx {
            inner: self.inner.clone(),
            shared: Arc::clone(&self.shared),
        }
    }
}

impl<S, St: Store> RequestTx<S, St> {
    pub(crate) fn new(inner: S, shared: Arc<Shared<St>>) -> Self {
        RequestTx { inner, shared }
    }
}

impl<S, St: Store, B> Service<Request<B>> for RequestTx<S, St>
where
    S: Service<Request<Body>, Error = Infallible> + Clone + Send + 'static,
    S::Response: IntoResponse,
    S::Future: Send + 'static,
    B: HttpBody<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    type Response = Response;
    type Error = Infallible;
    type Future = ResponseFuture;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        // The service polled ready goes with this request; the clone stays for the next.
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        let shared = Arc::clone(&self.shared);
        ResponseFuture::new(async move { Ok(serve(inner, shared, request).await) })
    }
}

/// Runs the request, and runs it again on a buffered copy while its transaction fails with a
/// transient error, within the attempts and the budget.
async fn serve<S, St, B>(mut inner: S, shared: Arc<Shared<St>>, request: Request<B>) -> Response
where
    S: Service<Request<Body>, Error = Infallible> + Clone + Send + 'static,
    S::Response: IntoResponse,
    S::Future: Send + 'static,
    St: Store,
    B: HttpBody<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    let (parts, body) = request.into_parts();
    let body = Body::new(body);
    if shared.attempts <= 1 {
        return attempt(
            inner,
            &shared,
            Request::from_parts(parts, body),
            shared.budget,
        )
        .await
        .0;
    }
    let body = match replay::buffer(body, &parts.headers, shared.max_buffered_body).await {
        Buffered::Whole(bytes) => bytes,
        Buffered::TooLarge(body) => {
            // Too large to keep a copy of: one attempt, as without retries.
            return attempt(
                inner,
                &shared,
                Request::from_parts(parts, body),
                shared.budget,
            )
            .await
            .0;
        }
        Buffered::Failed(response) => return response,
    };
    // Attempts of one request queue for the ordering keys other requests of this process hold
    // (see `queue_on_keys`): an attempt that finds its key taken gives up at once, and the
    // next one waits for the key before its transaction starts.
    relaybus::store::transaction::queue_on_keys(async move {
        let mut attempts = Attempts::new(None);
        // Set when the first attempt opens its transaction: all attempts share one budget.
        let mut deadline: Option<Instant> = None;
        loop {
            attempts.start();
            let budget = match deadline {
                None => shared.budget,
                Some(deadline) => deadline.saturating_duration_since(Instant::now()),
            };
            let request = Request::from_parts(parts.clone(), Body::from(body.clone()));
            let replica = inner.clone();
            let (response, outcome) = attempt(inner, &shared, request, budget).await;
            inner = replica;
            let Some(opened) = outcome.opened else {
                return response;
            };
            let deadline = *deadline.get_or_insert(opened + shared.budget);
            let time_left =
                || deadline.saturating_duration_since(Instant::now()) >= MIN_ATTEMPT_BUDGET;
            if !outcome.retry || attempts.attempt() >= shared.attempts || !time_left() {
                return response;
            }
            // A short jittered pause, so that requests that conflicted do not meet again.
            attempts.retry().await;
            if !time_left() {
                return response;
            }
            count("retried");
            tracing::debug!(
                attempt = attempts.attempt() + 1,
                "the request transaction met a transient error; running the request again"
            );
        }
    })
    .await
}

/// Counts a request transaction's outcome: `relaybus.request.transactions`.
fn count(outcome: &'static str) {
    use relaybus::telemetry::{OUTCOME_ATTRIBUTE, REQUEST_TRANSACTIONS, SYSTEM, SYSTEM_ATTRIBUTE};
    metrics::counter!(
        REQUEST_TRANSACTIONS,
        SYSTEM_ATTRIBUTE => SYSTEM,
        OUTCOME_ATTRIBUTE => outcome,
    )
    .increment(1);
}

/// The least budget worth starting another attempt with.
const MIN_ATTEMPT_BUDGET: Duration = Duration::from_millis(10);

/// One run of the request in a transaction of its own, within `budget`.
async fn attempt<S, St>(
    inner: S,
    shared: &Arc<Shared<St>>,
    mut request: Request<Body>,
    budget: Duration,
) -> (Response, Outcome)
where
    S: Service<Request<Body>, Error = Infallible>,
    S::Response: IntoResponse,
    St: Store,
{
    let slot = Slot::new(Arc::clone(shared), budget);
    request.extensions_mut().insert(slot.clone());
    request
        .extensions_mut()
        .insert(KeyedSlot(Arc::new(slot.clone())));
    let response = match inner.oneshot(request).await {
        Ok(response) => response.into_response(),
        Err(never) => match never {},
    };
    slot.resolve(response).await
}

/// How an attempt's transaction ended, for the retry loop.
#[derive(Debug, Default)]
struct Outcome {
    /// When its transaction opened, if it did.
    opened: Option<Instant>,
    /// Whether it failed with a transient error, so that running the request again may
    /// succeed: at commit, or in the route, as the route's response says
    /// ([`RetryRequest`](crate::RetryRequest)).
    retry: bool,
}

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
    fn new(shared: Arc<Shared<St>>, budget: Duration) -> Self {
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
    async fn restart(&self) {
        let Ok(mut guard) = Arc::clone(&self.state).try_lock_owned() else {
            return;
        };
        if let State::Open { mut session, .. } = std::mem::replace(&mut *guard, State::Idle) {
            self.shared.bus.store().abort(&mut session).await;
            count("aborted");
        }
    }

    /// Commits or aborts from the response status, and ends the slot.
    async fn resolve(&self, response: Response) -> (Response, Outcome) {
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

/// Marks a response whose request failed with a transient error in its transaction (a write
/// conflict in the route's own writes, say), so that the
/// [`RequestTxLayer`] aborts the transaction and runs the request again
/// on a fresh one, as it does after a transient error at commit.
///
/// [`PublishError`](crate::PublishError) marks its 503s with it. A route that maps store
/// errors itself inserts it into its response's extensions:
///
/// ```
/// use axum::{http::StatusCode, response::{IntoResponse, Response}};
/// use relaybus_axum::RetryRequest;
///
/// fn conflict() -> Response {
///     let mut response = StatusCode::SERVICE_UNAVAILABLE.into_response();
///     response.extensions_mut().insert(RetryRequest);
///     response
/// }
/// # assert!(conflict().extensions().get::<RetryRequest>().is_some());
/// ```
///
/// The mark asks for a retry; the layer runs the request again only when the response's
/// status aborts the transaction, the request opened one, its body was buffered, and
/// attempts and budget are left. Otherwise the response goes out as it is.
#[derive(Debug, Clone, Copy, Default)]
pub struct RetryRequest;

/// Commits, sending the commit again while its result is unknown, within the budget. The
/// body cannot run again here (the request is gone), so a transient error ends it.
async fn commit<St: Store>(
    session: &mut St::Session,
    shared: &Shared<St>,
    started: Instant,
    budget: Duration,
) -> Result<(), CommitError> {
    let store = shared.bus.store();
    let deadline = tokio::time::Instant::from_std(started + budget + COMMIT_REPLY_GRACE);
    let timed_out = || CommitError::TimedOut {
        budget,
        elapsed: started.elapsed(),
        retry_after: shared.retry_after,
        outcome_known: false,
    };
    let mut retries = 0;
    loop {
        let error = match tokio::time::timeout_at(deadline, store.commit(session)).await {
            Err(_) => return Err(timed_out()),
            Ok(Ok(())) => return Ok(()),
            Ok(Err(error)) => error,
        };
        if error.is_timeout() {
            return Err(timed_out());
        }
        if error.is_unknown_commit_result() && retries < shared.commit_retries {
            retries += 1;
            continue;
        }
        if matches!(error, relaybus::Error::CommitNotAcknowledged(_)) {
            return Err(CommitError::NotAcknowledged(error));
        }
        if error.is_unknown_commit_result() {
            return Err(CommitError::Unknown {
                error,
                retry_after: shared.retry_after,
            });
        }
        if error.is_transient_transaction_error() {
            return Err(CommitError::Transient {
                error,
                retry_after: shared.retry_after,
            });
        }
        return Err(CommitError::Database(error));
    }
}

/// The request's transaction seen without its store type, as
/// [`IdempotencyLayer`](crate::IdempotencyLayer) uses it: the layer names no store.
#[derive(Clone)]
pub(crate) struct KeyedSlot(pub(crate) Arc<dyn KeyedTransaction>);

/// Why a key could not be taken or an answer stored.
#[derive(Debug)]
pub(crate) enum KeyError {
    /// The transaction could not be had.
    Rejection(TxRejection),
    /// The store failed.
    Store(relaybus::Error),
}

/// What [`IdempotencyLayer`](crate::IdempotencyLayer) asks of the request's transaction.
pub(crate) trait KeyedTransaction: Send + Sync {
    /// Takes `key` in the transaction, starting it if need be.
    fn take_key<'a>(
        &'a self,
        key: RequestKey<'a>,
    ) -> BoxFuture<'a, Result<RequestKeyState, KeyError>>;

    /// Stores the answer of `key` in the transaction.
    fn store_response<'a>(
        &'a self,
        key: RequestKey<'a>,
        response: &'a StoredResponse,
    ) -> BoxFuture<'a, Result<(), KeyError>>;

    /// Aborts the transaction, leaving the slot idle.
    fn restart(&self) -> BoxFuture<'_, ()>;

    /// Whether the commit policy commits `status`.
    fn commits(&self, status: StatusCode) -> bool;

    /// The time by the bus's clock.
    fn now(&self) -> Timestamp;
}

impl<St: Store> KeyedTransaction for Slot<St> {
    fn take_key<'a>(
        &'a self,
        key: RequestKey<'a>,
    ) -> BoxFuture<'a, Result<RequestKeyState, KeyError>> {
        Box::pin(async move {
            let mut lease = self.lease().await.map_err(KeyError::Rejection)?;
            let now = self.shared.bus.now();
            self.shared
                .bus
                .store()
                .take_request_key(lease.session_mut(), &key, now)
                .await
                .map_err(KeyError::Store)
        })
    }

    fn store_response<'a>(
        &'a self,
        key: RequestKey<'a>,
        response: &'a StoredResponse,
    ) -> BoxFuture<'a, Result<(), KeyError>> {
        Box::pin(async move {
            let mut lease = self.lease().await.map_err(KeyError::Rejection)?;
            self.shared
                .bus
                .store()
                .store_response(lease.session_mut(), &key, response)
                .await
                .map_err(KeyError::Store)
        })
    }

    fn restart(&self) -> BoxFuture<'_, ()> {
        Box::pin(Slot::restart(self))
    }

    fn commits(&self, status: StatusCode) -> bool {
        self.shared.policy.commits(status)
    }

    fn now(&self) -> Timestamp {
        self.shared.bus.now()
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

#[cfg(test)]
mod tests {
    use axum::{Router, routing::get};

    // The trait bounds axum puts on layers are many: this only has to compile.
    #[allow(dead_code)]
    fn layer_compiles(bus: relaybus::RelayBus, listener: tokio::net::TcpListener) {
        let (state, layer) = crate::setup(bus).unwrap();
        let app: Router = Router::new()
            .route("/", get(|| async { "hello" }))
            .layer(layer)
            .with_state(state);
        let _ = axum::serve(listener, app);
    }
}
