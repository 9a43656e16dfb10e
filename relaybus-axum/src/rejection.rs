//! Why [`Tx`](crate::Tx) or [`Publisher`](crate::Publisher) could not be extracted.
//!
//! Every rejection answers with a status and a short text that does not leak database details;
//! the full error is logged (at `trace` level for misuse, `error` for database failures) and kept
//! as the source of the rejection.

use axum::{
    http::StatusCode,
    response::{IntoResponse, Response},
};

/// The request has no transaction slot: the route is not under a
/// [`RequestTxLayer`](crate::RequestTxLayer). Answers 500.
#[derive(Debug, Clone, Copy, Default, thiserror::Error)]
#[error(
    "no request transaction; add `relaybus_axum::RequestTxLayer` to the router \
     (`.layer(layer)` after the routes that use `Tx` or `Publisher`, with the layer from `relaybus_axum::setup`)"
)]
#[non_exhaustive]
pub struct MissingRequestTx;

/// The request's transaction is held by another extractor of the same request (two `Tx`, or a
/// `Tx` and a `Publisher`, in one handler), or by one that outlived its handler. Answers 500.
///
/// A ClientSession serves one operation at a time, so the second extraction fails instead of
/// waiting for the first, which would wait forever. Use one extractor per handler:
/// [`Publisher::session`](crate::Publisher::session) gives the session for the route's own
/// writes.
#[derive(Debug, Clone, Copy, Default, thiserror::Error)]
#[error(
    "the request transaction is held by another extractor; use one `Tx` or one `Publisher` per \
     handler (`Publisher::session` gives the session for your own writes)"
)]
#[non_exhaustive]
pub struct OverlappingExtractors;

/// The transaction was committed or aborted already: an extractor ran after the response.
/// Answers 500.
#[derive(Debug, Clone, Copy, Default, thiserror::Error)]
#[error("the request transaction has ended; extract `Tx` or `Publisher` before the response")]
#[non_exhaustive]
pub struct TransactionEnded;

/// The state given to the router and the layer come from two different
/// [`setup`](crate::setup) calls, so the publisher would write outside the request's
/// transaction. Answers 500.
#[derive(Debug, Clone, Copy, Default, thiserror::Error)]
#[error(
    "the router's `RelayState` and its `RequestTxLayer` come from different `relaybus_axum::setup` \
     calls; use the state and the layer of one call"
)]
#[non_exhaustive]
pub struct ForeignState;

/// The session or its transaction could not be started. Answers 503, since it is usually a
/// server that cannot be reached.
#[derive(Debug, thiserror::Error)]
#[error("could not start the request transaction: {0}")]
pub struct StartTransaction(#[source] pub(crate) relaybus::Error);

impl StartTransaction {
    /// The underlying error.
    pub fn error(&self) -> &relaybus::Error {
        &self.0
    }
}

macro_rules! misuse {
    ($($name:ident),*) => {$(
        impl $name {
            /// The response status: 500.
            pub fn status(&self) -> StatusCode {
                StatusCode::INTERNAL_SERVER_ERROR
            }

            /// The response body: the message, which names the fix.
            pub fn body_text(&self) -> String {
                self.to_string()
            }
        }

        impl IntoResponse for $name {
            fn into_response(self) -> Response {
                tracing::trace!(target: "relaybus_axum::rejection", rejection = %self, "rejecting request");
                (self.status(), self.body_text()).into_response()
            }
        }
    )*};
}

misuse!(
    MissingRequestTx,
    OverlappingExtractors,
    TransactionEnded,
    ForeignState
);

impl StartTransaction {
    /// The response status: 503.
    pub fn status(&self) -> StatusCode {
        StatusCode::SERVICE_UNAVAILABLE
    }

    /// The response body, without the database error.
    pub fn body_text(&self) -> String {
        "the database is unavailable; try again later".to_owned()
    }
}

impl IntoResponse for StartTransaction {
    fn into_response(self) -> Response {
        tracing::error!(target: "relaybus_axum::rejection", error = %self.0, "could not start the request transaction");
        (self.status(), self.body_text()).into_response()
    }
}

macro_rules! composite {
    (
        $(#[$meta:meta])*
        pub enum $name:ident {
            $($(#[$vmeta:meta])* $variant:ident($inner:ty),)*
        }
    ) => {
        $(#[$meta])*
        #[derive(Debug, thiserror::Error)]
        #[non_exhaustive]
        pub enum $name {
            $($(#[$vmeta])* #[error(transparent)] $variant(#[from] $inner),)*
        }

        impl $name {
            /// The response status of the cause.
            pub fn status(&self) -> StatusCode {
                match self {
                    $($name::$variant(inner) => inner.status(),)*
                }
            }

            /// The response body of the cause.
            pub fn body_text(&self) -> String {
                match self {
                    $($name::$variant(inner) => inner.body_text(),)*
                }
            }
        }

        impl IntoResponse for $name {
            fn into_response(self) -> Response {
                match self {
                    $($name::$variant(inner) => inner.into_response(),)*
                }
            }
        }
    };
}

composite! {
    /// Why [`Tx`](crate::Tx) could not be extracted.
    pub enum TxRejection {
        /// See [`MissingRequestTx`].
        MissingRequestTx(MissingRequestTx),
        /// See [`OverlappingExtractors`].
        OverlappingExtractors(OverlappingExtractors),
        /// See [`TransactionEnded`].
        TransactionEnded(TransactionEnded),
        /// See [`StartTransaction`].
        StartTransaction(StartTransaction),
    }
}

composite! {
    /// Why [`Publisher`](crate::Publisher) could not be extracted.
    pub enum PublisherRejection {
        /// See [`MissingRequestTx`].
        MissingRequestTx(MissingRequestTx),
        /// See [`OverlappingExtractors`].
        OverlappingExtractors(OverlappingExtractors),
        /// See [`TransactionEnded`].
        TransactionEnded(TransactionEnded),
        /// See [`ForeignState`].
        ForeignState(ForeignState),
        /// See [`StartTransaction`].
        StartTransaction(StartTransaction),
    }
}

impl From<TxRejection> for PublisherRejection {
    fn from(rejection: TxRejection) -> Self {
        match rejection {
            TxRejection::MissingRequestTx(r) => r.into(),
            TxRejection::OverlappingExtractors(r) => r.into(),
            TxRejection::TransactionEnded(r) => r.into(),
            TxRejection::StartTransaction(r) => r.into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_missing_layer_message_names_the_layer() {
        let rejection = TxRejection::from(MissingRequestTx);
        assert_eq!(rejection.status(), StatusCode::INTERNAL_SERVER_ERROR);
        assert!(
            rejection
                .body_text()
                .contains("add `relaybus_axum::RequestTxLayer` to the router")
        );
    }

    #[test]
    fn database_errors_do_not_reach_the_body() {
        let error = relaybus::Error::custom("secret host name db-7.internal");
        let rejection = PublisherRejection::from(StartTransaction(error));
        assert_eq!(rejection.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert!(!rejection.body_text().contains("db-7"));
    }
}
