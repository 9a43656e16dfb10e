//! The response future of [`RequestTx`](super::RequestTx).

use std::{
    convert::Infallible,
    fmt,
    future::Future,
    pin::Pin,
    task::{Context, Poll},
};

use axum::response::Response;

/// The response future of [`RequestTx`](super::RequestTx): the inner service's response, once
/// the request's transaction is committed or aborted.
///
/// Dropping it before it completes drops the request's session, and the MongoDB driver aborts
/// a transaction still open.
pub struct ResponseFuture {
    inner: Pin<Box<dyn Future<Output = Result<Response, Infallible>> + Send>>,
}

impl ResponseFuture {
    pub(crate) fn new(
        future: impl Future<Output = Result<Response, Infallible>> + Send + 'static,
    ) -> Self {
        ResponseFuture {
            inner: Box::pin(future),
        }
    }
}

impl Future for ResponseFuture {
    type Output = Result<Response, Infallible>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.inner.as_mut().poll(cx)
    }
}

impl fmt::Debug for ResponseFuture {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}
