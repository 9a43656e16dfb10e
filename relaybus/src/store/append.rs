//! Appending: the outbox write, events with their deliveries in the caller's transaction.

use std::future::Future;

use super::{AppendRequest, Appended, Transactions};
use crate::{error::Result, time::Timestamp};

/// Appends events with their deliveries, in the caller's transaction: what the bus's publish
/// and the transports' consumers use.
pub trait Append: Transactions {
    /// Appends events with their deliveries in the caller's transaction. An event id the
    /// store holds gets only the deliveries of handlers new to it.
    ///
    /// The requests are validated first, then a session without a started transaction is
    /// refused ([`ConfigurationError::NoTransaction`](crate::ConfigurationError::NoTransaction));
    /// nothing is written in either case.
    fn append(
        &self,
        session: &mut Self::Session,
        requests: &[AppendRequest<'_>],
        now: Timestamp,
    ) -> impl Future<Output = Result<Vec<Appended>>> + Send;

    /// As [`append`](Self::append), in a transaction the caller started with
    /// [`begin`](Transactions::begin), so the session is not checked.
    fn append_in_transaction(
        &self,
        session: &mut Self::Session,
        requests: &[AppendRequest<'_>],
        now: Timestamp,
    ) -> impl Future<Output = Result<Vec<Appended>>> + Send;
}
