//! The queue: claiming due deliveries, settling them, keeping their leases, and hearing of new
//! ones.

use std::{fmt, future::Future, hash::Hash, time::Duration};

use futures::stream::BoxStream;

use super::{ClaimRequest, Claimed, Transactions, WakeUp};
use crate::{error::Result, time::Timestamp};

/// The delivery queue: what the dispatcher's workers use to claim deliveries, settle them and
/// renew or hand back their leases.
///
/// Settling methods take the lease a claim returned and change nothing when it no longer
/// holds (another worker took the delivery over): they return `false` then.
pub trait Queue: Transactions {
    /// A claim's proof of ownership of one delivery.
    type Lease: StoreLease;

    /// Claims up to `request.limit` due deliveries of the given handlers, one at a time per key and
    /// handler, in sequence order; deliveries
    /// appended for a handler named [unordered](super::AppendRequest::unordered) are claimed as
    /// those of unkeyed events are. With no other claimer, it returns `limit` deliveries whenever
    /// that many are claimable.
    fn claim(
        &self,
        request: ClaimRequest<'_>,
    ) -> impl Future<Output = Result<Vec<Claimed<Self::Lease>>>> + Send;

    /// Completes deliveries whose handlers succeeded; one flag per lease, `false` where the
    /// lease no longer held.
    fn complete(
        &self,
        leases: &[Self::Lease],
        now: Timestamp,
    ) -> impl Future<Output = Result<Vec<bool>>> + Send;

    /// Completes a delivery inside the caller's transaction, for transactional handlers. A
    /// session without a started transaction is refused with
    /// [`ConfigurationError::NoTransaction`](crate::ConfigurationError::NoTransaction).
    fn complete_in_transaction(
        &self,
        session: &mut Self::Session,
        lease: &Self::Lease,
        now: Timestamp,
    ) -> impl Future<Output = Result<bool>> + Send;

    /// Completes deliveries inside the caller's transaction, for transactional batch
    /// handlers: one flag per lease, `false` where the lease no longer held (abort the
    /// transaction then). The default completes them one by one with
    /// [`complete_in_transaction`](Self::complete_in_transaction); a store that can do better
    /// in fewer round trips overrides it.
    fn complete_many_in_transaction(
        &self,
        session: &mut Self::Session,
        leases: &[Self::Lease],
        now: Timestamp,
    ) -> impl Future<Output = Result<Vec<bool>>> + Send
    where
        Self: Sync,
    {
        async move {
            let mut completed = Vec::with_capacity(leases.len());
            for lease in leases {
                completed.push(self.complete_in_transaction(session, lease, now).await?);
            }
            Ok(completed)
        }
    }

    /// Gives a delivery back, due now, without charging its attempt.
    fn release(
        &self,
        lease: &Self::Lease,
        now: Timestamp,
    ) -> impl Future<Output = Result<bool>> + Send;

    /// Ends a failed attempt: charged, with its error, due again at `due_at`.
    fn reschedule(
        &self,
        lease: &Self::Lease,
        due_at: Timestamp,
        error: &str,
        now: Timestamp,
    ) -> impl Future<Output = Result<bool>> + Send;

    /// Ends the last failed attempt: the delivery becomes a dead letter with its error.
    fn bury(
        &self,
        lease: &Self::Lease,
        error: &str,
        now: Timestamp,
    ) -> impl Future<Output = Result<bool>> + Send;

    /// Extends the leases of running deliveries to `now + lease_duration`. Returns how many
    /// of `leases` are covered by a renewed lease.
    fn renew(
        &self,
        leases: &[Self::Lease],
        lease_duration: Duration,
        now: Timestamp,
    ) -> impl Future<Output = Result<usize>> + Send;

    /// Hands back everything `owner` holds through this store value (and its clones), for
    /// graceful shutdown. Returns how many units of lease (MongoDB: lanes) it handed back.
    fn relinquish(&self, owner: &str) -> impl Future<Output = Result<u64>> + Send;

    /// Opens a stream of wake-ups for new deliveries of `handlers`. The dispatcher reopens it
    /// after it fails or ends, and polls meanwhile: correctness never depends on it. A wake-up
    /// may tell where its delivery is ([`WakeUp::at`]); the dispatcher claims at once.
    fn watch(
        &self,
        handlers: &[String],
    ) -> impl Future<Output = Result<BoxStream<'static, Result<WakeUp>>>> + Send;
}

/// A claim's proof of ownership of one delivery, handed back to settle it.
pub trait StoreLease: Clone + Send + Sync + fmt::Debug + 'static {
    /// The store's delivery id.
    type DeliveryId: Clone + Eq + Hash + Send + Sync + fmt::Debug + fmt::Display + 'static;

    /// The id of the delivery this lease settles.
    fn delivery_id(&self) -> Self::DeliveryId;
}
