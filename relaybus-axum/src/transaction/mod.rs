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
//!    one is held fails with [`OverlappingExtractors`](crate::rejection::OverlappingExtractors).
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
//! A commit that still fails replaces the response with a [`CommitError`](error::CommitError):
//! a 503 with `Retry-After` for a transient error (nothing was committed) or for a timeout, a
//! 500 otherwise.
//!
//! # Panics and dropped requests
//!
//! When the handler panics, or the request future is dropped (the client went away, or a
//! timeout dropped it), the session is dropped with its transaction still open, and the
//! database driver aborts it (MongoDB's in the background). Nothing is ever committed from
//! `Drop`.

mod commit;
mod keyed;
mod layer;
mod slot;

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
    http::Request,
    response::{IntoResponse, Response},
};
use relaybus::{
    BoxError, Store,
    store::{DefaultStore, transaction::Attempts},
};
use tower::{Service, ServiceExt};

pub use self::layer::RequestTxLayer;
use self::{future::ResponseFuture, replay::Buffered};
pub(crate) use self::{
    keyed::{KeyError, KeyedSlot, KeyedTransaction},
    slot::{Lease, Slot},
};
use crate::config::Shared;

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
pub(crate) fn count(outcome: &'static str) {
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
pub(crate) struct Outcome {
    /// When its transaction opened, if it did.
    pub(crate) opened: Option<Instant>,
    /// Whether it failed with a transient error, so that running the request again may
    /// succeed: at commit, or in the route, as the route's response says
    /// ([`RetryRequest`]).
    pub(crate) retry: bool,
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
