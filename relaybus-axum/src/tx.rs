//! The [`Tx`] extractor: the request's session, for the route's own writes.

use std::{
    fmt,
    marker::PhantomData,
    ops::{Deref, DerefMut},
};

use axum::{extract::FromRequestParts, http::request::Parts, response::IntoResponse};
use relaybus::{Store, store::DefaultStore};

use crate::{
    rejection::TxRejection,
    transaction::{Lease, Slot},
};

/// The request's store session, inside the request's transaction: pass it to the route's
/// writes with `.session(&mut *tx)`. They commit with the response, or not at all.
///
/// Dereferences to the store's session: MongoDB's `ClientSession` unless the store type `S`
/// says otherwise. The transaction starts on the first extraction and is
/// resolved by the [`RequestTxLayer`](crate::RequestTxLayer); do not commit or abort it
/// yourself. To publish events as well, extract a [`Publisher`](crate::Publisher) instead,
/// which holds the same session.
///
/// The rejection type `E` defaults to [`TxRejection`]; any type that converts from it and
/// implements `IntoResponse` can replace it, to shape the error responses.
///
/// # Example
///
/// ```no_run
/// use axum::{extract::{Path, State}, http::StatusCode};
/// use mongodb::{Collection, bson::{Document, doc}};
/// use relaybus_axum::Tx;
///
/// async fn cancel_order(
///     State(orders): State<Collection<Document>>,
///     Path(id): Path<String>,
///     mut tx: Tx,
/// ) -> Result<StatusCode, StatusCode> {
///     orders
///         .update_one(doc! { "_id": id }, doc! { "$set": { "cancelled": true } })
///         .session(&mut *tx)
///         .await
///         .map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?;
///     Ok(StatusCode::NO_CONTENT)
/// }
/// ```
pub struct Tx<E = TxRejection, S: Store = DefaultStore> {
    lease: Lease<S>,
    _rejection: PhantomData<fn() -> E>,
}

impl<E, S: Store> Deref for Tx<E, S> {
    type Target = S::Session;

    fn deref(&self) -> &S::Session {
        self.lease.session()
    }
}

impl<E, S: Store> DerefMut for Tx<E, S> {
    fn deref_mut(&mut self) -> &mut S::Session {
        self.lease.session_mut()
    }
}

impl<E, S: Store> AsMut<S::Session> for Tx<E, S> {
    fn as_mut(&mut self) -> &mut S::Session {
        self.lease.session_mut()
    }
}

impl<E, S: Store> fmt::Debug for Tx<E, S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tx").finish_non_exhaustive()
    }
}

impl<State, E, S> FromRequestParts<State> for Tx<E, S>
where
    State: Send + Sync,
    E: From<TxRejection> + IntoResponse,
    S: Store,
{
    type Rejection = E;

    async fn from_request_parts(parts: &mut Parts, _state: &State) -> Result<Self, E> {
        let slot = Slot::<S>::of(&parts.extensions).map_err(TxRejection::from)?;
        let lease = slot.lease().await?;
        Ok(Tx {
            lease,
            _rejection: PhantomData,
        })
    }
}
