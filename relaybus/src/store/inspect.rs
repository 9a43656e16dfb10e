//! Operator reads: counts, listings and the state of events, lanes and dead letters.

use std::{future::Future, time::Duration};

use super::{
    DeadLetterGroup, DeliveryQuery, DeliveryRecord, EventDetail, HandlerStatistics, LaneReport,
    Statistics,
};
use crate::error::Result;

/// What the operator page, the delivery gauges and tests read of a store. Nothing here writes.
pub trait Inspect {
    /// Counts deliveries by state.
    fn statistics(&self) -> impl Future<Output = Result<Statistics>> + Send;

    /// Counts deliveries by handler and state, every handler with a pending or dead delivery
    /// listed once, in handler order: what the `relaybus.deliveries` gauges report.
    fn handler_statistics(&self) -> impl Future<Output = Result<Vec<HandlerStatistics>>> + Send;

    /// [`handler_statistics`](Self::handler_statistics) for the delivery gauges, which a
    /// started bus samples on its interval: a store instance that several buses share may
    /// answer them with one count taken less than `max_age` ago, and count once for callers
    /// that ask at the same time. By default, a new count for every call.
    fn gauge_statistics(
        &self,
        max_age: Duration,
    ) -> impl Future<Output = Result<Vec<HandlerStatistics>>> + Send {
        let _ = max_age;
        self.handler_statistics()
    }

    /// Lists deliveries, a page at a time.
    fn list_deliveries(
        &self,
        query: &DeliveryQuery,
    ) -> impl Future<Output = Result<Vec<DeliveryRecord>>> + Send;

    /// An event with all its deliveries, completion records included: `None` when the store
    /// holds no event with this id (never seen, or purged).
    fn event_detail(
        &self,
        event_id: &str,
    ) -> impl Future<Output = Result<Option<EventDetail>>> + Send;

    /// Every unit of lease with its holder, and the keys whose deliveries are parked with what
    /// they wait for.
    fn lanes(&self) -> impl Future<Output = Result<LaneReport>> + Send;

    /// Dead letters grouped by handler and last error, the largest groups first, at most
    /// [`MAX_DEAD_LETTER_GROUPS`](super::MAX_DEAD_LETTER_GROUPS); only `handler`'s when given. A
    /// group's dead letters are selected with [`DeliveryQuery::last_error`].
    fn dead_letter_groups(
        &self,
        handler: Option<&str>,
    ) -> impl Future<Output = Result<Vec<DeadLetterGroup>>> + Send;
}
