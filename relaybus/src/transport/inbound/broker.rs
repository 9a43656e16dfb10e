//! What the inbound driver asks of a broker's client: take a batch, dead-letter a message,
//! settle a batch, and, for a broker that keeps no position for its consumers, where the local
//! store keeps it.

use std::{fmt, future::Future, time::Duration};

use tokio_util::sync::CancellationToken;

use crate::{error::BoxError, store::PositionKey};

/// How a message is settled with the broker once its fate is known.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Settlement {
    /// Done with: appended, held already, or dead-lettered.
    Ack,
    /// To be taken again: its append failed, or one before it in the batch did.
    Retry,
    /// Given up: unreadable, and it could not be dead-lettered.
    Discard,
}

/// Where the local store keeps a consumer's position in a partitioned log, for a broker that
/// keeps none (Kafka): the driver writes the position after a batch in the transaction that
/// appends it, so the two commit together.
#[derive(Debug, Clone)]
pub struct Position {
    pub(crate) consumer: String,
    pub(crate) source: String,
    pub(crate) partition: u32,
    /// The lead the reader holds on the partition, when processes share the partitions.
    pub(crate) fence: Option<Fence>,
}

impl Position {
    pub(crate) fn key(&self) -> PositionKey<'_> {
        PositionKey::new(&self.consumer, &self.source, self.partition)
    }

    /// Whether a transaction found the reader's lead lost.
    pub(crate) fn lost(&self) -> bool {
        self.fence
            .as_ref()
            .is_some_and(|fence| fence.lost.is_cancelled())
    }
}

/// The lead of a partition a reader holds while processes share a topic's partitions: each
/// append's transaction keeps it first ([`Leadership::keep_lead`](crate::store::Leadership::keep_lead)),
/// so a reader whose lead another process took appends nothing more, and stops.
#[derive(Debug, Clone)]
pub(crate) struct Fence {
    /// The lead's role.
    pub(crate) role: String,
    /// How long a keep renews it for.
    pub(crate) period: Duration,
    /// Cancelled by the transaction that found the lead lost: the reader's run stops on it.
    pub(crate) lost: CancellationToken,
}

/// A transaction found that another process took the reader's lead over.
#[derive(Debug, thiserror::Error)]
#[error(
    "the lead {role:?} was taken over by another process; this reader appends nothing more and \
     stops"
)]
pub(crate) struct LeadLost {
    pub(crate) role: String,
}

/// What a fetch took: the messages, in the broker's order, and what holds them until the
/// batch is settled.
pub(crate) type Taken<B> = (Vec<<B as Broker>::Message>, <B as Broker>::Hold);

/// A broker's side of a consumer, which the inbound driver runs: the NATS and RabbitMQ
/// consumers, and one partition of the Kafka consumer. Sealed: only this crate implements it.
pub trait Broker: Clone + fmt::Debug + Send + Sync + 'static {
    /// One message as the client hands it over.
    type Message: Send + Sync + 'static;
    /// What a batch holds from its fetch to its settlement: NATS's progress reports, RabbitMQ's
    /// channel, Kafka's partition connection and offset. Dropped unsettled, it gives the batch
    /// back to the broker.
    type Hold: Send + 'static;
    /// The client's errors, as the transport reports them.
    type Error: std::error::Error + Send + Sync + 'static;

    /// Whether a fetch waiting for messages may be dropped when the consumer is shut down:
    /// true when nothing a fetch took is left out at the broker by dropping it.
    const FETCH_STOPS_ON_SHUTDOWN: bool;

    /// Takes the next batch, in the broker's order; an empty one when nothing came within the
    /// consumer's fetch wait.
    fn fetch(&self) -> impl Future<Output = Result<Taken<Self>, Self::Error>> + Send;

    /// The message's body, or why it has none to read.
    fn body(message: &Self::Message) -> Result<&[u8], &'static str>;

    /// Whether the broker delivered the message before.
    fn redelivered(message: &Self::Message) -> bool;

    /// Where the local store keeps this consumer's position, for a broker that keeps none.
    fn position(&self) -> Option<&Position> {
        None
    }

    /// The message's offset in its partition, for a consumer with a [position](Self::position).
    fn offset(_message: &Self::Message) -> i64 {
        0
    }

    /// Publishes a message that cannot be appended to the dead-letter destination, with the
    /// reason, and waits for the broker's confirmation.
    fn dead_letter(
        &self,
        hold: &mut Self::Hold,
        message: &Self::Message,
        reason: &str,
    ) -> impl Future<Output = Result<(), BoxError>> + Send;

    /// Settles every message of a batch with the broker, in the broker's order.
    fn settle(
        &self,
        hold: Self::Hold,
        messages: Vec<(Self::Message, Settlement)>,
    ) -> impl Future<Output = Result<(), Self::Error>> + Send;

    /// How long a run waits after a fetch or a settlement that failed.
    fn pause_after_failure(&self) -> Duration;

    /// How long a run waits after a batch whose appends failed, before taking them again.
    fn pause_after_retry(&self) -> Duration;

    /// What the consumer reads, for logs: a durable consumer, a queue, a topic's partition.
    fn source(&self) -> &str;

    /// What a run does when it stops: closes what it holds open.
    fn stop(&self) -> impl Future<Output = ()> + Send {
        async {}
    }
}
