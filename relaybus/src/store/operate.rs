//! Operator writes: what an operator (and the bus's retention) changes in a store.

use std::future::Future;

use super::{Buried, Discarded, PurgeOptions, Purged, Requeued};
use crate::{error::Result, time::Timestamp};

/// What an operator changes by hand (requeueing dead letters, burying stuck deliveries,
/// discarding dead letters) and what the bus's retention deletes.
pub trait Operate {
    /// Deletes what `options` lets go, in batches.
    fn purge(&self, options: &PurgeOptions) -> impl Future<Output = Result<Purged>> + Send;

    /// Deletes dead deliveries for good: dead letters an operator gave up on. An event left
    /// with no delivery counts as finished from `now` (it stays as a deduplication record until
    /// the retention of completed events purges it). Ids that name no dead delivery are
    /// reported, never refused.
    fn discard(
        &self,
        ids: &[String],
        now: Timestamp,
    ) -> impl Future<Output = Result<Discarded>> + Send;

    /// Buries pending deliveries that no worker runs, by id, with `reason` as their error: an
    /// operator's way to free a key stuck behind a delivery that will never succeed. Their
    /// key's later deliveries can then run. Running ones are reported and left to their worker.
    fn bury_by_id(
        &self,
        ids: &[String],
        reason: &str,
        now: Timestamp,
    ) -> impl Future<Output = Result<Buried>> + Send;

    /// Makes dead deliveries pending again.
    fn requeue(
        &self,
        ids: &[String],
        now: Timestamp,
    ) -> impl Future<Output = Result<Requeued>> + Send;
}
