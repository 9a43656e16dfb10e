//! A consumer of a broker whose batches run through the inbound driver, step by step or
//! until shutdown.

use std::fmt;

use tokio_util::sync::CancellationToken;

use super::{batch::InboundBatch, broker::Broker, report::BatchReport, run};
use crate::{bus::RelayBus, store::Store};

/// Takes a broker's events and appends them to the local store with their original ids, so
/// that the local bus's handlers run them through the normal dispatcher.
///
/// Each transport names its consumer:
/// [`NatsConsumer`](crate::transport::nats::NatsConsumer) and
/// [`RabbitConsumer`](crate::transport::rabbitmq::RabbitConsumer), where their builders, how
/// they fetch and what becomes of a batch left unsettled are described.
///
/// A batch goes through three steps, which [`run`](Self::run) and
/// [`run_once`](Self::run_once) chain, and which can be driven one by one:
/// [`fetch`](Self::fetch) takes messages from the broker, [`InboundBatch::append`]
/// dead-letters what cannot be read and appends the events in one transaction of the local
/// store, and [`AppendedBatch::ack`](super::AppendedBatch::ack) settles the messages with the
/// broker. The broker's acknowledgement comes only after the store's commit; a batch dropped
/// between the two is delivered again, and appending it again adds nothing.
///
/// Cheap to clone; clones share the broker connection.
#[derive(Clone)]
pub struct Consumer<B: Broker> {
    broker: B,
}

impl<B: Broker> fmt::Debug for Consumer<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("Consumer").field(&self.broker).finish()
    }
}

impl<B: Broker> Consumer<B> {
    // The Kafka consumer reads partitions with a driver of its own; NATS and RabbitMQ use these.
    #[cfg(any(feature = "nats", feature = "rabbitmq"))]
    pub(crate) fn new(broker: B) -> Self {
        Consumer { broker }
    }

    /// The broker's side of the consumer.
    #[cfg(any(feature = "nats", feature = "rabbitmq"))]
    pub(crate) fn broker(&self) -> &B {
        &self.broker
    }

    /// Takes up to the batch size of messages from the broker, in its order: waits up to the
    /// fetch wait for a first message, then takes it with whatever else is there. An empty
    /// batch means nothing came within the wait.
    ///
    /// # Errors
    ///
    /// The transport's `Fetch` error when the connection is down or the source is gone
    /// (RabbitMQ: also `Connect` and `Setup`, since a fetch opens the connection when there is
    /// none).
    ///
    /// # Cancel safety
    ///
    /// Cancelling it loses nothing: NATS redelivers what it had taken after the ack wait;
    /// RabbitMQ hands a message over only when the call returns.
    pub async fn fetch(&self) -> Result<InboundBatch<B>, B::Error> {
        InboundBatch::fetch(&self.broker).await
    }

    /// Fetches one batch, appends it and acknowledges it: [`fetch`](Self::fetch), then
    /// [`InboundBatch::append`], then [`AppendedBatch::ack`](super::AppendedBatch::ack).
    ///
    /// # Errors
    ///
    /// The errors of [`fetch`](Self::fetch) and of
    /// [`AppendedBatch::ack`](super::AppendedBatch::ack); append failures are in the report
    /// ([`BatchReport::retried`]).
    pub async fn run_once<S: Store>(&self, bus: &RelayBus<S>) -> Result<BatchReport, B::Error> {
        run::run_once(&self.broker, bus).await
    }

    /// Consumes until `shutdown` is cancelled: batch after batch, each appended in one
    /// transaction of `bus`'s store and then acknowledged. Returns every batch's report added
    /// up; a batch whose acknowledgement failed counts its appends too (its redelivery then
    /// counts as duplicates).
    ///
    /// On shutdown it stops fetching, finishes the batch it holds (appends, commits,
    /// acknowledges) and returns; it notices the token within the fetch wait plus the time one
    /// batch takes. RabbitMQ's consumer then closes its connection, so the broker puts what it
    /// had sent ahead back in the queue at once.
    ///
    /// A fetch or acknowledgement that fails (the connection is down) is logged, and the
    /// consumer tries again after the fetch wait: NATS's client reconnects by itself,
    /// RabbitMQ's next fetch connects again, and what was not acknowledged is delivered again.
    /// After a batch whose appends failed it waits (NATS: the nak delay; RabbitMQ: the retry
    /// delay) before fetching again.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future instead of cancelling the token loses nothing either: what was
    /// taken and not acknowledged is delivered again (NATS: after the ack wait), and appending
    /// it again adds nothing. Cancel the token to stop after the batch in hand.
    pub async fn run<S: Store>(
        &self,
        bus: &RelayBus<S>,
        shutdown: CancellationToken,
    ) -> BatchReport {
        run::run(&self.broker, bus, shutdown).await
    }
}
