//! The [`Tx`] extractor: the request's session, for the route's own writes.

use std::{
    fmt,
    marker::PhantomData,
    ops::{Deref, DerefMut},
};

use axum::{extract::FromRequestParts, http::request::Parts, response::IntoResponse};
use mongodb::ClientSession;

use crate::{
    rejection::TxRejection,
    transaction::{Lease, Slot},
};

/// The request's MongoDB session, inside the request's transaction: pass it to the route's
/// writes with `.session(&mut *tx)`. They commit with the response, or not at all.
///
/// Dereferences to [`ClientSession`]. The transaction starts on the first extraction and is
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
pub struct Tx<E = TxRejection> {
    lease: Lease,
    _rejection: PhantomData<fn() -> E>,
}

impl<E> Deref for Tx<E> {
    type Target = ClientSession;

    fn deref(&self) -> &ClientSession {
        self.lease.session()
    }
}

impl<E> DerefMut for Tx<E> {
    fn deref_mut(&mut self) -> &mut ClientSession {
        self.lease.session_mut()
    }
}

impl<E> AsMut<ClientSession> for Tx<E> {
    fn as_mut(&mut self) -> &mut ClientSession {
        self.lease.session_mut()
    }
}

impl<E> fmt::Debug for Tx<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tx").finish_non_exhaustive()
    }
}

impl<S, E> FromRequestParts<S> for Tx<E>
where
    S: Send + Sync,
    E: From<TxRejection> + IntoResponse,
{
    type Rejection = E;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, E> {
        let slot = Slot::of(&parts.extensions).map_err(TxRejection::from)?;
        let lease = slot.lease().await?;
        Ok(Tx {
            lease,
            _rejection: PhantomData,
        })
    }
}
