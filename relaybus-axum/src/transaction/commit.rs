//! The commit of a request transaction: bounded by its budget, and sent again while its
//! result is unknown.

use std::time::{Duration, Instant};

use relaybus::Store;

use super::error::CommitError;
use crate::config::Shared;

/// How long past the budget the layer waits for a commit reply before giving up on it: the
/// server stops at the budget, this covers the round trip.
const COMMIT_REPLY_GRACE: Duration = Duration::from_secs(1);

/// Commits, sending the commit again while its result is unknown, within the budget. The
/// body cannot run again here (the request is gone), so a transient error ends it.
pub(crate) async fn commit<St: Store>(
    session: &mut St::Session,
    shared: &Shared<St>,
    started: Instant,
    budget: Duration,
) -> Result<(), CommitError> {
    let store = shared.bus.store();
    let deadline = tokio::time::Instant::from_std(started + budget + COMMIT_REPLY_GRACE);
    let timed_out = || CommitError::TimedOut {
        budget,
        elapsed: started.elapsed(),
        retry_after: shared.retry_after,
        outcome_known: false,
    };
    let mut retries = 0;
    loop {
        let error = match tokio::time::timeout_at(deadline, store.commit(session)).await {
            Err(_) => return Err(timed_out()),
            Ok(Ok(())) => return Ok(()),
            Ok(Err(error)) => error,
        };
        if error.is_timeout() {
            return Err(timed_out());
        }
        if error.is_unknown_commit_result() && retries < shared.commit_retries {
            retries += 1;
            continue;
        }
        if matches!(error, relaybus::Error::CommitNotAcknowledged(_)) {
            return Err(CommitError::NotAcknowledged(error));
        }
        if error.is_unknown_commit_result() {
            return Err(CommitError::Unknown {
                error,
                retry_after: shared.retry_after,
            });
        }
        if error.is_transient_transaction_error() {
            return Err(CommitError::Transient {
                error,
                retry_after: shared.retry_after,
            });
        }
        return Err(CommitError::Database(error));
    }
}
