//! Why an idempotent request was answered without running it.

use std::time::Duration;

use axum::{
    http::{HeaderValue, StatusCode, header::RETRY_AFTER},
    response::{IntoResponse, Response},
};

/// Why [`IdempotencyLayer`](crate::IdempotencyLayer) answered a request itself. Each variant
/// answers with its own status and a short text that names the fix and leaves database details
/// out; store errors are logged.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum IdempotencyError {
    /// The idempotency key header is malformed: sent more than once, empty, over 255
    /// characters, or with a character outside printable ASCII. Answers 400; nothing ran.
    #[error("{reason}; send one `{header}` header of 1 to 255 printable ASCII characters")]
    InvalidKey {
        /// The header's name.
        header: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The key was used before for another request (another method, path or body): the key
    /// identifies one request. Answers 422; nothing ran.
    #[error(
        "this idempotency key was used for a different request (method, path or body); send a \
         new key for a new request"
    )]
    KeyReused,
    /// The first request with this key is still running, and did not end within the layer's
    /// wait. Answers 409 with `Retry-After`; nothing ran. Send the request again later: it gets
    /// the first request's answer.
    #[error(
        "a request with this idempotency key is still running; send it again later to get its answer"
    )]
    InProgress {
        /// The `Retry-After` sent.
        retry_after: Duration,
    },
    /// The request body is longer than the layer reads to compare requests
    /// ([`IdempotencyLayerBuilder::max_request_body`](crate::idempotency::IdempotencyLayerBuilder::max_request_body)),
    /// or could not be read. Answers 413; nothing ran.
    #[error(
        "the request body is over {limit} bytes or could not be read; an idempotent request's \
         body must be read whole"
    )]
    RequestTooLarge {
        /// The limit, in bytes.
        limit: usize,
    },
    /// The route's response body is longer than the layer stores
    /// ([`IdempotencyLayerBuilder::max_response_body`](crate::idempotency::IdempotencyLayerBuilder::max_response_body)).
    /// Answers 500, and the request's transaction is aborted: a response that cannot be
    /// replayed is not committed. Raise the limit, or answer with less.
    #[error(
        "the response is over {limit} bytes, more than an idempotent request's stored answer \
         holds; raise `IdempotencyLayerBuilder::max_response_body`"
    )]
    ResponseTooLarge {
        /// The limit, in bytes.
        limit: usize,
    },
    /// The request is not under a [`RequestTxLayer`](crate::RequestTxLayer), so its answer
    /// could not be stored with its data. Answers 500.
    #[error(
        "no request transaction; add `relaybus_axum::RequestTxLayer` outside the \
         `IdempotencyLayer` (`.layer(idempotency).layer(request_tx)`)"
    )]
    MissingRequestTx,
    /// The store failed to look the key up or to store the answer. Answers 503 with
    /// `Retry-After` (nothing was committed).
    #[error("the idempotency key could not be read or stored: {0}")]
    Store(#[source] relaybus::Error),
}

impl IdempotencyError {
    /// The response status of the variant.
    pub fn status(&self) -> StatusCode {
        match self {
            IdempotencyError::InvalidKey { .. } => StatusCode::BAD_REQUEST,
            IdempotencyError::KeyReused => StatusCode::UNPROCESSABLE_ENTITY,
            IdempotencyError::InProgress { .. } => StatusCode::CONFLICT,
            IdempotencyError::RequestTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            IdempotencyError::ResponseTooLarge { .. } | IdempotencyError::MissingRequestTx => {
                StatusCode::INTERNAL_SERVER_ERROR
            }
            IdempotencyError::Store(_) => StatusCode::SERVICE_UNAVAILABLE,
        }
    }

    /// The response body: the message, without database details.
    pub fn body_text(&self) -> String {
        match self {
            IdempotencyError::Store(_) => "the database is unavailable; try again later".to_owned(),
            other => other.to_string(),
        }
    }
}

impl IntoResponse for IdempotencyError {
    fn into_response(self) -> Response {
        let retry_after = match &self {
            IdempotencyError::InProgress { retry_after } => Some(*retry_after),
            IdempotencyError::Store(_) => Some(Duration::from_secs(1)),
            _ => None,
        };
        match &self {
            IdempotencyError::Store(error) => {
                tracing::error!(target: "relaybus_axum::idempotency", %error, "the idempotency key could not be read or stored");
            }
            IdempotencyError::ResponseTooLarge { .. } | IdempotencyError::MissingRequestTx => {
                tracing::error!(target: "relaybus_axum::idempotency", error = %self, "idempotent request failed");
            }
            _ => {
                tracing::trace!(target: "relaybus_axum::idempotency", rejection = %self, "answering an idempotent request");
            }
        }
        let mut response = (self.status(), self.body_text()).into_response();
        if let Some(after) = retry_after {
            let seconds = after.as_secs_f64().ceil().max(1.0) as u64;
            response
                .headers_mut()
                .insert(RETRY_AFTER, HeaderValue::from(seconds));
        }
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_and_texts() {
        let reused = IdempotencyError::KeyReused;
        assert_eq!(reused.status(), StatusCode::UNPROCESSABLE_ENTITY);
        let store = IdempotencyError::Store(relaybus::Error::custom("db-7.internal refused"));
        assert_eq!(store.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert!(!store.body_text().contains("db-7"));
        let running = IdempotencyError::InProgress {
            retry_after: Duration::from_millis(1_500),
        }
        .into_response();
        assert_eq!(running.status(), StatusCode::CONFLICT);
        assert_eq!(running.headers()[RETRY_AFTER], "2");
    }
}
