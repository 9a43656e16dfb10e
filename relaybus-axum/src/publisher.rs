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
