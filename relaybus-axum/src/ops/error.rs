//! The refusals of the operator routes: every answer that is not a success, as
//! `{"error": "..."}` with its status.

use axum::{
    Json,
    http::StatusCode,
    response::{IntoResponse, Response},
};

use super::model::ErrorAnswer;

/// An answer of the operator routes that is not a success.
#[derive(Debug)]
pub(super) enum OpsError {
    /// The input is refused: 400.
    BadRequest(String),
    /// The body is not JSON: 415.
    NotJson,
    /// Refused with another 4xx status: an unknown route, a wrong method, a body that could
    /// not be read.
    Refused(StatusCode, String),
    /// The store failed: 500.
    Store(relaybus::Error),
}

impl IntoResponse for OpsError {
    fn into_response(self) -> Response {
        let (status, error) = match self {
            OpsError::BadRequest(message) => (StatusCode::BAD_REQUEST, message),
            OpsError::NotJson => (
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "send the body as `Content-Type: application/json`".to_owned(),
            ),
            OpsError::Refused(status, message) => (status, message),
            OpsError::Store(error) => {
                tracing::error!(%error, "an operator route failed");
                (
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "the event store could not be reached; see the server log".to_owned(),
                )
            }
        };
        (status, Json(ErrorAnswer { error })).into_response()
    }
}

/// A refusal of the input, with `message` saying what is accepted.
pub(super) fn bad(message: impl Into<String>) -> OpsError {
    OpsError::BadRequest(message.into())
}

/// The answer to a known route asked with another method.
pub(super) async fn method_not_allowed() -> OpsError {
    OpsError::Refused(
        StatusCode::METHOD_NOT_ALLOWED,
        "this route takes another method: GET /, GET /statistics, GET /handlers, \
         GET /activity, GET /deliveries, GET /events/{event_id}, GET /dead-letters, GET /lanes, \
         POST /deliveries/requeue, POST /deliveries/discard, POST /deliveries/bury"
            .to_owned(),
    )
}

/// The answer to a path no route has.
pub(super) async fn not_found() -> OpsError {
    OpsError::Refused(
        StatusCode::NOT_FOUND,
        "no such operator route; the routes are GET / (the page), GET /statistics, \
         GET /handlers, GET /activity, GET /deliveries, GET /events/{event_id}, \
         GET /dead-letters, GET /lanes, POST /deliveries/requeue, POST /deliveries/discard and \
         POST /deliveries/bury"
            .to_owned(),
    )
}
