//! Idempotent requests: [`IdempotencyLayer`] makes [`Idempotent`], which runs a request that
//! carries an idempotency key once, stores its answer in the request's own transaction, and
//! gives that answer to every repeat of the request instead of running it again.
//!
//! A client that sends a `POST` again (after a timeout, a lost connection, a double click)
//! sends the same `Idempotency-Key` header with it, a key it made for that one request (a
//! UUID, say). Then, with the layer on the route:
//!
//! - **The first request runs.** Before the route runs, the layer takes the key in the
//!   request's transaction. When the route answers with a status the
//!   [`CommitPolicy`](crate::CommitPolicy) commits (1xx–3xx by default), the layer stores
//!   the answer (status, headers, body) in that same transaction, so it commits with the
//!   route's data and events, or not at all.
//! - **A repeat gets the stored answer**, marked with `Idempotent-Replayed: true`, without
//!   running the route: no second order, no second event.
//! - **A repeat while the first still runs** is answered 409 with `Retry-After`, or, with
//!   [`wait`](IdempotencyLayerBuilder::wait), waits up to that long for the first to end
//!   and gets its answer (409 if it is still running then). It never runs the route a
//!   second time.
//! - **The same key with another request** (another method, path and query, or body) is
//!   answered 422 ([`KeyReused`](error::IdempotencyError::KeyReused)).
//! - **A failed first request stores nothing**: a status the policy does not commit (4xx and
//!   5xx by default), a failed commit, a panic or a dropped request abort the transaction and
//!   the key with it, so a retry runs the route again.
//! - **Answers expire** after the [retention](IdempotencyLayerBuilder::retention) (24 hours
//!   by default): the key is new again, and the bus's retention purge deletes them
//!   ([`RelayBus::purge_expired`](relaybus::RelayBus::purge_expired)).
//!
//! A key is scoped by the request's method, its route (the matched route, such as
//! `/orders/{id}`, or the path when there is none) and, when the application names one, its
//! caller ([`IdempotencyLayerBuilder::caller`]): the same key sent by another caller, or to
//! another route, is another request. A malformed key (sent twice, empty, over 255 characters,
//! or not printable ASCII) is answered 400. Requests without the header, and `GET`, `HEAD`,
//! `OPTIONS` and `TRACE` requests, pass through untouched.
//!
//! The answers are kept by the store, through
//! [`IdempotentRequests`](relaybus::store::IdempotentRequests): a table of the PostgreSQL
//! store's schema, a collection of the MongoDB store, documents of the memory store, made by
//! `setup()`.
//!
//! # Ordering
//!
//! The layer needs the request's transaction: add it before (inside) the
//! [`RequestTxLayer`](crate::RequestTxLayer), on the router or on single routes.
//! Outside it, a keyed request is answered 500
//! ([`MissingRequestTx`](error::IdempotencyError::MissingRequestTx)).
//!
//! ```
//! # #[cfg(feature = "memory")]
//! # fn example(bus: relaybus::RelayBus<relaybus::MemoryEventStore>) -> Result<(), relaybus::ConfigurationError> {
//! use std::time::Duration;
//! use axum::{Router, routing::post};
//! use relaybus_axum::IdempotencyLayer;
//!
//! let (state, request_tx) = relaybus_axum::setup(bus)?;
//! let idempotency = IdempotencyLayer::builder()
//!     .wait(Duration::from_secs(5)) // a repeat waits for the first instead of a 409
//!     .build()?;
//! let app: Router = Router::new()
//!     .route("/orders", post(|| async { "placed" }))
//!     .layer(idempotency) // inside…
//!     .layer(request_tx) // …the request transaction
//!     .with_state(state);
//! # let _ = app;
//! # Ok(())
//! # }
//! ```
//!
//! # What a run costs
//!
//! A keyed request starts its transaction before the route runs (it would otherwise start on
//! the route's first extraction), reads the key and writes it: on PostgreSQL two statements
//! (an advisory lock on the key, a read), on MongoDB a read and an upsert, and the answer
//! one upsert before the commit. A replay reads the key and aborts: one transaction that
//! writes nothing. The layer reads the whole request body
//! ([`max_request_body`](IdempotencyLayerBuilder::max_request_body)) to hash it, and the
//! whole response body of a committed answer
//! ([`max_response_body`](IdempotencyLayerBuilder::max_response_body)) to store it.

pub mod error;
mod layer;

use std::{
    convert::Infallible,
    sync::Arc,
    task::{Context, Poll},
    time::{Duration, Instant},
};

use axum::{
    body::Body,
    extract::MatchedPath,
    http::{
        HeaderMap, HeaderName, HeaderValue, Method, Request, StatusCode, header, request::Parts,
    },
    response::{IntoResponse, Response},
};
use relaybus::store::{RequestKey, RequestKeyState, StoredResponse, key_problem};
use sha2::{Digest, Sha256};
use tower::{Service, ServiceExt};

pub use self::layer::{
    DEFAULT_HEADER, DEFAULT_MAX_REQUEST_BODY, DEFAULT_MAX_RESPONSE_BODY, DEFAULT_RETENTION,
    IdempotencyLayer, IdempotencyLayerBuilder,
};
use self::{error::IdempotencyError, layer::Settings};
use crate::{
    RetryRequest,
    transaction::{KeyError, KeyedSlot},
};

/// The header that marks a replayed answer.
pub const REPLAYED_HEADER: &str = "idempotent-replayed";

/// The middleware of [`IdempotencyLayer`]. See the [module docs](self).
#[derive(Debug, Clone)]
pub struct Idempotent<S> {
    inner: S,
    settings: Arc<Settings>,
}

impl<S> Idempotent<S> {
    fn new(inner: S, settings: Arc<Settings>) -> Self {
        Idempotent { inner, settings }
    }
}

impl<S> Service<Request<Body>> for Idempotent<S>
where
    S: Service<Request<Body>, Error = Infallible> + Clone + Send + 'static,
    S::Response: IntoResponse,
    S::Future: Send + 'static,
{
    type Response = Response;
    type Error = Infallible;
    type Future = futures::future::BoxFuture<'static, Result<Response, Infallible>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<Body>) -> Self::Future {
        // The service polled ready goes with this request; the clone stays for the next.
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        let settings = Arc::clone(&self.settings);
        Box::pin(async move { Ok(serve(inner, &settings, request).await) })
    }
}

/// Runs `request` once per key, or answers it from the stored answer.
async fn serve<S>(inner: S, settings: &Settings, request: Request<Body>) -> Response
where
    S: Service<Request<Body>, Error = Infallible>,
    S::Response: IntoResponse,
{
    let safe = [Method::GET, Method::HEAD, Method::OPTIONS, Method::TRACE];
    if safe.contains(request.method()) || !request.headers().contains_key(&settings.header) {
        return run(inner, request).await;
    }
    let (parts, body) = request.into_parts();
    let key = match key_of(&parts.headers, &settings.header) {
        Ok(key) => key,
        Err(reason) => {
            return IdempotencyError::InvalidKey {
                header: settings.header.to_string(),
                reason,
            }
            .into_response();
        }
    };
    let Some(KeyedSlot(slot)) = parts.extensions.get::<KeyedSlot>().cloned() else {
        return IdempotencyError::MissingRequestTx.into_response();
    };
    let too_large = || {
        IdempotencyError::RequestTooLarge {
            limit: settings.max_request_body,
        }
        .into_response()
    };
    let Ok(body) = axum::body::to_bytes(body, settings.max_request_body).await else {
        return too_large();
    };
    let fingerprint = fingerprint(&parts, &body);
    let route = match parts.extensions.get::<MatchedPath>() {
        Some(matched) => matched.as_str().to_owned(),
        None => parts.uri.path().to_owned(),
    };
    let caller = settings.caller.as_ref().and_then(|caller| caller(&parts));
    let method = parts.method.as_str().to_owned();
    let request_key = RequestKey::new(&key, &method, &route).caller(caller.as_deref());

    // Take the key, or find its answer; while another transaction holds it, wait up to the
    // layer's wait, each time in a new transaction.
    let started = Instant::now();
    let mut pause = Duration::from_millis(10);
    loop {
        match slot.take_key(request_key).await {
            Ok(RequestKeyState::Taken) => break,
            Ok(RequestKeyState::Answered(stored)) => {
                slot.restart().await;
                if stored.fingerprint != fingerprint {
                    return IdempotencyError::KeyReused.into_response();
                }
                return replay(stored);
            }
            Ok(RequestKeyState::Running) => {
                slot.restart().await;
                if started.elapsed() + pause > settings.wait {
                    return IdempotencyError::InProgress {
                        retry_after: settings.retry_after,
                    }
                    .into_response();
                }
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_millis(200));
            }
            Ok(_) => {
                slot.restart().await;
                return IdempotencyError::Store(relaybus::Error::custom(
                    "the store answered the key with a state this layer does not know",
                ))
                .into_response();
            }
            Err(error) => return key_error(&*slot, error).await,
        }
    }

    let response = run(inner, Request::from_parts(parts, Body::from(body))).await;
    if !slot.commits(response.status()) {
        // The request transaction aborts, and the key with it.
        return response;
    }
    let (mut parts, body) = response.into_parts();
    let Ok(body) = axum::body::to_bytes(body, settings.max_response_body).await else {
        slot.restart().await;
        return IdempotencyError::ResponseTooLarge {
            limit: settings.max_response_body,
        }
        .into_response();
    };
    let now = slot.now();
    let stored = StoredResponse::new(
        fingerprint,
        parts.status.as_u16(),
        kept_headers(&parts.headers),
        body.to_vec(),
        now,
        now.saturating_add(settings.retention),
    );
    if let Err(error) = slot.store_response(request_key, &stored).await {
        return key_error(&*slot, error).await;
    }
    parts.headers.remove(header::CONTENT_LENGTH);
    Response::from_parts(parts, Body::from(body))
}

/// Runs the inner service.
async fn run<S>(inner: S, request: Request<Body>) -> Response
where
    S: Service<Request<Body>, Error = Infallible>,
    S::Response: IntoResponse,
{
    match inner.oneshot(request).await {
        Ok(response) => response.into_response(),
        Err(never) => match never {},
    }
}

/// The answer to a failed key lookup or write. A transient store error asks the request layer
/// to run the request again; any other ends the transaction first, so that nothing commits.
async fn key_error(slot: &dyn crate::transaction::KeyedTransaction, error: KeyError) -> Response {
    match error {
        KeyError::Rejection(rejection) => rejection.into_response(),
        KeyError::Store(error) => {
            let transient = error.is_transient_transaction_error();
            let mut response = IdempotencyError::Store(error).into_response();
            if transient && !slot.commits(response.status()) {
                response.extensions_mut().insert(RetryRequest);
            } else {
                slot.restart().await;
            }
            response
        }
    }
}

/// The key the request carries, or what is wrong with it.
fn key_of(headers: &HeaderMap, name: &HeaderName) -> Result<String, String> {
    let mut values = headers.get_all(name).iter();
    let (Some(value), None) = (values.next(), values.next()) else {
        return Err("the idempotency key header is sent more than once".to_owned());
    };
    let key = value
        .to_str()
        .map_err(|_| "the idempotency key is not printable ASCII".to_owned())?;
    match key_problem(key) {
        Some(problem) => Err(problem),
        None => Ok(key.to_owned()),
    }
}

/// What identifies the request's content: the SHA-256 of its method, path and query, and body.
fn fingerprint(parts: &Parts, body: &[u8]) -> String {
    let target = parts
        .uri
        .path_and_query()
        .map_or_else(|| parts.uri.path(), |p| p.as_str());
    let mut hash = Sha256::new();
    hash.update(parts.method.as_str().as_bytes());
    hash.update([0]);
    hash.update(target.as_bytes());
    hash.update([0]);
    hash.update(Sha256::digest(body));
    hash.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

/// Headers that belong to one connection or one moment, not to the answer: not stored.
const NOT_STORED: [HeaderName; 9] = [
    header::CONNECTION,
    header::CONTENT_LENGTH,
    header::DATE,
    header::PROXY_AUTHENTICATE,
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
    header::RETRY_AFTER,
];

/// The response headers stored with the answer, in order.
fn kept_headers(headers: &HeaderMap) -> Vec<(String, String)> {
    headers
        .iter()
        .filter(|(name, _)| !NOT_STORED.contains(name) && name.as_str() != "keep-alive")
        .filter_map(|(name, value)| Some((name.to_string(), value.to_str().ok()?.to_owned())))
        .collect()
}

/// The stored answer, marked as replayed.
fn replay(stored: StoredResponse) -> Response {
    let mut response = Response::new(Body::from(stored.body));
    *response.status_mut() =
        StatusCode::from_u16(stored.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let headers = response.headers_mut();
    for (name, value) in stored.headers {
        if let (Ok(name), Ok(value)) = (
            HeaderName::try_from(name.as_str()),
            HeaderValue::try_from(value.as_str()),
        ) {
            headers.append(name, value);
        }
    }
    headers.insert(
        HeaderName::from_static(REPLAYED_HEADER),
        HeaderValue::from_static("true"),
    );
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_checked() {
        let name = HeaderName::from_static(DEFAULT_HEADER);
        let mut headers = HeaderMap::new();
        headers.insert(&name, HeaderValue::from_static("k-1"));
        assert_eq!(key_of(&headers, &name), Ok("k-1".to_owned()));
        headers.append(&name, HeaderValue::from_static("k-2"));
        assert!(
            key_of(&headers, &name)
                .unwrap_err()
                .contains("more than once")
        );
        headers.insert(&name, HeaderValue::from_static(""));
        assert!(key_of(&headers, &name).unwrap_err().contains("empty"));
        let long = "k".repeat(256);
        headers.insert(&name, HeaderValue::try_from(long.as_str()).unwrap());
        assert!(
            key_of(&headers, &name)
                .unwrap_err()
                .contains("more than 255")
        );
    }

    #[test]
    fn fingerprints_tell_requests_apart() {
        let parts = |method: &str, uri: &str| {
            Request::builder()
                .method(method)
                .uri(uri)
                .body(())
                .unwrap()
                .into_parts()
                .0
        };
        let first = fingerprint(&parts("POST", "/orders"), b"{}");
        assert_eq!(first, fingerprint(&parts("POST", "/orders"), b"{}"));
        assert_ne!(first, fingerprint(&parts("POST", "/orders"), b"{ }"));
        assert_ne!(first, fingerprint(&parts("PUT", "/orders"), b"{}"));
        assert_ne!(first, fingerprint(&parts("POST", "/orders?x=1"), b"{}"));
    }
}
