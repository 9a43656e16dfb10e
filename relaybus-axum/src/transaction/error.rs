//! What can go wrong when the request's transaction is resolved.

use std::time::Duration;

use axum::{
    http::{HeaderValue, StatusCode, header::RETRY_AFTER},
    response::{IntoResponse, Response},
};

/// The request's transaction could not be committed, so the route's response is replaced by
/// this error's: a 503 with `Retry-After` when trying again later may work, a 500 otherwise.
/// The body is a short text without database details; the layer logs the error.
///
/// When it happens, in the order of the request lifecycle:
///
/// 1. [`TimedOut`](Self::TimedOut) with `outcome_known: true`: the route answered after the
///    transaction's time budget was spent. The transaction was aborted; nothing was committed.
/// 2. [`Transient`](Self::Transient): the commit failed with a `TransientTransactionError`
///    (a write conflict with another transaction, a primary that stepped down). The
///    transaction was aborted; nothing was committed.
/// 3. [`Unknown`](Self::Unknown): the commit's result stayed unknown
///    (`UnknownTransactionCommitResult`) after the commit was sent again
///    [`commit_retries`](crate::Config::commit_retries) times. It may or may not have been
///    committed.
/// 4. [`TimedOut`](Self::TimedOut) with `outcome_known: false`: the commit ran past the budget
///    (`maxCommitTimeMS`, or no reply in time). It may or may not have been committed.
/// 5. [`NotAcknowledged`](Self::NotAcknowledged): the primary committed, but the commit's
///    write concern failed (no majority acknowledged it in time, or it cannot be satisfied).
///    It is committed unless the primary fails before the other members have it.
/// 6. [`Database`](Self::Database): any other error of the commit. It was not committed.
/// 7. [`StillHeld`](Self::StillHeld): an extractor outlived the handler, so the session could
///    not be taken back to commit. Nothing was committed; the transaction is aborted when that
///    extractor drops.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CommitError {
    /// The transaction was aborted by the server on a transient error.
    #[error("the commit failed with a transient error and nothing was committed: {error}")]
    Transient {
        /// The commit's error.
        #[source]
        error: relaybus::Error,
        /// The `Retry-After` to send.
        retry_after: Duration,
    },

    /// The transaction ran past its time budget.
    #[error(
        "the request transaction ran {elapsed:?}, over its budget of {budget:?} ({})",
        if *outcome_known { "aborted, nothing was committed" } else { "the commit's outcome is unknown" }
    )]
    TimedOut {
        /// The budget.
        budget: Duration,
        /// How long the transaction ran.
        elapsed: Duration,
        /// The `Retry-After` to send.
        retry_after: Duration,
        /// `true` when the layer aborted the transaction before its commit, `false` when the
        /// commit itself timed out.
        outcome_known: bool,
    },

    /// The commit's result stayed unknown.
    #[error("the outcome of the commit is unknown after retries: {error}")]
    Unknown {
        /// The last error of the commit.
        #[source]
        error: relaybus::Error,
        /// The `Retry-After` to send.
        retry_after: Duration,
    },

    /// The primary committed, but the commit's write concern failed: see
    /// [`relaybus::Error::CommitNotAcknowledged`].
    #[error("the commit was applied but not acknowledged: {0}")]
    NotAcknowledged(#[source] relaybus::Error),

    /// The commit failed.
    #[error("the commit failed: {0}")]
    Database(#[source] relaybus::Error),

    /// An extractor still held the session after the handler returned.
    #[error(
        "the request transaction is still held by an extractor after the response; do not move \
         `Tx` or `Publisher` out of the handler"
    )]
    StillHeld,
}

impl CommitError {
    /// 503 for a transient error, a timeout or an unknown outcome, 500 otherwise.
    pub fn status(&self) -> StatusCode {
        match self {
            CommitError::Transient { .. }
            | CommitError::TimedOut { .. }
            | CommitError::Unknown { .. } => StatusCode::SERVICE_UNAVAILABLE,
            CommitError::NotAcknowledged(_) | CommitError::Database(_) | CommitError::StillHeld => {
                StatusCode::INTERNAL_SERVER_ERROR
            }
        }
    }

    /// The `Retry-After` of a 503.
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            CommitError::Transient { retry_after, .. }
            | CommitError::TimedOut { retry_after, .. }
            | CommitError::Unknown { retry_after, .. } => Some(*retry_after),
            CommitError::NotAcknowledged(_) | CommitError::Database(_) | CommitError::StillHeld => {
                None
            }
        }
    }

    /// Whether nothing of the request's transaction was committed. `false` only when the
    /// outcome is unknown.
    pub fn nothing_committed(&self) -> bool {
        !matches!(
            self,
            CommitError::Unknown { .. }
                | CommitError::NotAcknowledged(_)
                | CommitError::TimedOut {
                    outcome_known: false,
                    ..
                }
        )
    }

    /// The response body: what happened, without database details.
    pub fn body_text(&self) -> String {
        match self {
            CommitError::Transient { .. }
            | CommitError::TimedOut {
                outcome_known: true,
                ..
            } => "the request could not be completed and nothing was saved; try again".to_owned(),
            CommitError::Unknown { .. } | CommitError::TimedOut { .. } => {
                "the request may not have been saved; check before trying again".to_owned()
            }
            CommitError::NotAcknowledged(_) => "the request was saved, but the database could \
                not confirm it on enough servers; check before trying again"
                .to_owned(),
            CommitError::Database(_) | CommitError::StillHeld => {
                "the request could not be saved".to_owned()
            }
        }
    }
}

impl IntoResponse for CommitError {
    fn into_response(self) -> Response {
        let mut response = (self.status(), self.body_text()).into_response();
        if let Some(delay) = self.retry_after() {
            let seconds = delay.as_secs() + u64::from(delay.subsec_nanos() > 0);
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
    fn a_transient_error_is_a_503_with_retry_after_in_whole_seconds() {
        let error = CommitError::Transient {
            error: relaybus::Error::custom("write conflict"),
            retry_after: Duration::from_millis(1_500),
        };
        assert!(error.nothing_committed());
        let response = error.into_response();
        assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(response.headers()[RETRY_AFTER], "2");
    }

    #[test]
    fn an_unknown_outcome_does_not_claim_nothing_was_committed() {
        let error = CommitError::TimedOut {
            budget: Duration::from_secs(1),
            elapsed: Duration::from_secs(2),
            retry_after: Duration::ZERO,
            outcome_known: false,
        };
        assert!(!error.nothing_committed());
        assert!(error.body_text().contains("may not have been saved"));
        assert_eq!(error.into_response().headers()[RETRY_AFTER], "0");
    }

    #[test]
    fn other_errors_are_500_without_retry_after() {
        let response = CommitError::StillHeld.into_response();
        assert_eq!(response.status(), StatusCode::INTERNAL_SERVER_ERROR);
        assert!(response.headers().get(RETRY_AFTER).is_none());
    }
}
