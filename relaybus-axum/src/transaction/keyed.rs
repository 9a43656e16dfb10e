//! The request's transaction as [`IdempotencyLayer`](crate::IdempotencyLayer) sees it: without
//! its store type, so that the layer names no store.

use std::sync::Arc;

use axum::http::StatusCode;
use futures::future::BoxFuture;
use relaybus::{
    Store, Timestamp,
    store::{RequestKey, RequestKeyState, StoredResponse},
};

use super::Slot;
use crate::rejection::TxRejection;

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
