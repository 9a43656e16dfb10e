//! The [`Publisher`] extractor: publishes into the request's transaction.

use std::{fmt, marker::PhantomData, sync::Arc};

use axum::{
    extract::{FromRef, FromRequestParts},
    http::request::Parts,
    response::IntoResponse,
};
use relaybus::{Event, EventEnvelope, Publish, PublishAll, RelayBus, Store, store::DefaultStore};

use crate::{
    config::RelayState,
    rejection::{ForeignState, PublisherRejection},
    transaction::{Lease, Slot},
};

/// Publishes events into the request's transaction: they commit with the route's writes when
/// the response commits, and vanish with them otherwise.
///
/// [`session`](Self::session) lends the same session for the route's own writes, so one
/// `Publisher` is all a route needs. The bus comes from the router's state, which must provide
/// a [`RelayState`] (through [`FromRef`]), and the transaction from the
/// [`RequestTxLayer`](crate::RequestTxLayer); both come from one [`setup`](crate::setup) call.
///
/// The rejection type `E` defaults to [`PublisherRejection`], and can be replaced as for
/// [`Tx`](crate::Tx).
///
/// # Example
///
/// ```no_run
/// use axum::{Json, http::StatusCode};
/// use mongodb::bson::{Document, doc};
/// use relaybus_axum::Publisher;
/// use serde::{Deserialize, Serialize};
///
/// #[derive(Serialize, Deserialize)]
/// struct OrderPlaced {
///     order_id: String,
/// }
///
/// impl relaybus::Event for OrderPlaced {
///     const TYPE: &'static str = "order.placed.v1";
/// }
///
/// async fn place_order(mut publisher: Publisher) -> Result<StatusCode, StatusCode> {
///     let orders = publisher.bus().store().database().collection::<Document>("orders");
///     orders
///         .insert_one(doc! { "_id": "o-1", "total_cents": 1250 })
///         .session(publisher.session())
///         .await
///         .map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?;
///     publisher
///         .publish(&OrderPlaced { order_id: "o-1".into() })
///         .key("o-1")
///         .await
///         .map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?;
///     Ok(StatusCode::CREATED)
/// }
/// ```
pub struct Publisher<E = PublisherRejection, S: Store = DefaultStore> {
    bus: RelayBus<S>,
    lease: Lease<S>,
    _rejection: PhantomData<fn() -> E>,
}

impl<E, S: Store> Publisher<E, S> {
    /// Publishes a typed event in the request's transaction. Chain the options of
    /// [`Publish`] (`.key(..)`, `.id(..)`, `.correlation_id(..)`, `.causation_id(..)`,
    /// `.header(..)`), then `.await`.
    ///
    /// # Errors
    ///
    /// Those of [`RelayBus::publish`]. A failed publish leaves the transaction in place; answer
    /// with an error status to abort it.
    pub fn publish<T: Event>(&mut self, event: &T) -> Publish<'_, S> {
        self.bus.publish(event).session(self.lease.session_mut())
    }

    /// Publishes a prepared envelope in the request's transaction.
    pub fn publish_envelope(&mut self, envelope: EventEnvelope) -> Publish<'_, S> {
        self.bus
            .publish_envelope(envelope)
            .session(self.lease.session_mut())
    }

    /// Publishes several envelopes in one append, in the request's transaction.
    pub fn publish_all(
        &mut self,
        envelopes: impl IntoIterator<Item = EventEnvelope>,
    ) -> PublishAll<'_, S> {
        self.bus
            .publish_all(envelopes)
            .session(self.lease.session_mut())
    }

    /// The request's session, for the route's own writes: `.session(publisher.session())`.
    pub fn session(&mut self) -> &mut S::Session {
        self.lease.session_mut()
    }

    /// The bus.
    pub fn bus(&self) -> &RelayBus<S> {
        &self.bus
    }
}

impl<E, S: Store> fmt::Debug for Publisher<E, S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Publisher")
            .field("bus", &self.bus)
            .finish_non_exhaustive()
    }
}

impl<State, E, S> FromRequestParts<State> for Publisher<E, S>
where
    RelayState<S>: FromRef<State>,
    State: Send + Sync,
    E: From<PublisherRejection> + IntoResponse,
    S: Store,
{
    type Rejection = E;

    async fn from_request_parts(parts: &mut Parts, state: &State) -> Result<Self, E> {
        let state = RelayState::<S>::from_ref(state);
        let slot = Slot::<S>::of(&parts.extensions).map_err(PublisherRejection::from)?;
        if !Arc::ptr_eq(&slot.shared, &state.shared) {
            return Err(PublisherRejection::from(ForeignState).into());
        }
        let lease = slot.lease().await.map_err(PublisherRejection::from)?;
        Ok(Publisher {
            bus: state.shared.bus.clone(),
            lease,
            _rejection: PhantomData,
        })
    }
}

/// A store error in a route, from a publish or from the route's own writes through the
/// request's session, as a response, so that a route can answer with `?`:
///
/// - 503 with `Retry-After: 1` for a transient error (a write conflict on a hot key, a primary
///   that stepped down) or a transaction over its time budget: the request's transaction is
///   aborted, nothing is saved, and the client may try again. A transient error also marks
///   the response with [`RetryRequest`](crate::RetryRequest), so the
///   [`RequestTxLayer`](crate::RequestTxLayer) runs the request again first, and the client
///   sees the 503 only when the retries are spent;
/// - 500 for anything else.
///
/// It converts from [`relaybus::Error`], from the MongoDB driver's error (feature `mongodb`)
/// and from sqlx's (feature `postgres`), so that the route's own writes answer the same way. The body says what happened without database
/// details; the error is logged.
///
/// ```no_run
/// use axum::http::StatusCode;
/// use relaybus_axum::{PublishError, Publisher};
/// # #[derive(serde::Serialize, serde::Deserialize)]
/// # struct OrderPlaced { order_id: String }
/// # impl relaybus::Event for OrderPlaced { const TYPE: &'static str = "order.placed.v1"; }
///
/// async fn place_order(mut publisher: Publisher) -> Result<StatusCode, PublishError> {
///     publisher
///         .publish(&OrderPlaced { order_id: "o-1".into() })
///         .key("o-1")
///         .await?;
///     Ok(StatusCode::CREATED)
/// }
/// ```
#[derive(Debug)]
pub struct PublishError(pub relaybus::Error);

impl From<relaybus::Error> for PublishError {
    fn from(error: relaybus::Error) -> Self {
        PublishError(error)
    }
}

#[cfg(feature = "mongodb")]
impl From<relaybus::mongodb::error::Error> for PublishError {
    fn from(error: relaybus::mongodb::error::Error) -> Self {
        PublishError(error.into())
    }
}

/// A route's own queries answer as its publishes do: a serialization failure or a deadlock is
/// transient (503, and the request runs again), anything else a 500.
#[cfg(feature = "postgres")]
impl From<relaybus::sqlx::Error> for PublishError {
    fn from(error: relaybus::sqlx::Error) -> Self {
        PublishError(error.into())
    }
}

impl fmt::Display for PublishError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl std::error::Error for PublishError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.0)
    }
}

impl PublishError {
    /// Whether the client may simply try again: a transient error or a timeout.
    pub fn is_retryable(&self) -> bool {
        self.0.is_transient_transaction_error()
            || matches!(self.0, relaybus::Error::TransactionTimeout(_))
    }

    /// 503 when the client may try again, 500 otherwise.
    pub fn status(&self) -> axum::http::StatusCode {
        if self.is_retryable() {
            axum::http::StatusCode::SERVICE_UNAVAILABLE
        } else {
            axum::http::StatusCode::INTERNAL_SERVER_ERROR
        }
    }

    /// The response body, without database details.
    pub fn body_text(&self) -> &'static str {
        if self.is_retryable() {
            "the request could not be completed and nothing was saved; try again"
        } else {
            "the request could not be saved"
        }
    }
}

impl IntoResponse for PublishError {
    fn into_response(self) -> axum::response::Response {
        if self.is_retryable() {
            tracing::debug!(error = %self.0, "publish failed; answering 503");
        } else {
            tracing::error!(error = %self.0, "publish failed; answering 500");
        }
        let mut response = (self.status(), self.body_text()).into_response();
        if self.is_retryable() {
            response.headers_mut().insert(
                axum::http::header::RETRY_AFTER,
                axum::http::HeaderValue::from_static("1"),
            );
        }
        if self.0.is_transient_transaction_error() {
            response.extensions_mut().insert(crate::RetryRequest);
        }
        response
    }
}

#[cfg(test)]
mod tests {
    use axum::{http::StatusCode, response::IntoResponse};

    use super::PublishError;

    #[test]
    fn a_transient_publish_error_answers_503_with_retry_after() {
        let transient = relaybus::Error::Database(
            relaybus::DatabaseError::new(std::io::Error::other("write conflict"))
                .with_transient(true),
        );
        let response = PublishError::from(transient).into_response();
        assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(response.headers()[axum::http::header::RETRY_AFTER], "1");
        assert!(
            response.extensions().get::<crate::RetryRequest>().is_some(),
            "the layer runs the request again"
        );
    }

    #[test]
    fn other_publish_errors_answer_500_without_retry_after() {
        let response = PublishError::from(relaybus::Error::custom("broken")).into_response();
        assert_eq!(response.status(), StatusCode::INTERNAL_SERVER_ERROR);
        assert!(
            response
                .headers()
                .get(axum::http::header::RETRY_AFTER)
                .is_none()
        );
    }
}
