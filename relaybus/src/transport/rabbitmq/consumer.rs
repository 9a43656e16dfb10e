//! The inbound consumer: takes a queue's events with a prefetch window and appends them to the
//! local store.

use std::{
    fmt,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use lapin::{Channel, Connection};
use tokio::sync::Mutex;
use tokio_util::sync::CancellationToken;

use super::{
    InboundBatch, RabbitError,
    connection::{Endpoint, close_quietly},
};
use crate::{
    bus::RelayBus,
    store::Store,
    transport::{BatchReport, inbound},
};

/// The most messages one batch takes (and the most the broker sends ahead).
pub const MAX_BATCH_SIZE: usize = 1_000;

/// Takes the events of a RabbitMQ queue and appends them to the local store with their
/// original ids, so that the local bus's handlers run them through the normal dispatcher.
///
/// The consumer owns its connection and one channel that consumes the queue with a prefetch
/// of its batch size (`basic.qos`), so the broker never has more than one batch out to it. A
/// batch goes through three steps, which [`run`](Self::run) and [`run_once`](Self::run_once)
/// chain, and which can be driven one by one: [`fetch`](Self::fetch) takes messages,
/// [`InboundBatch::append`] appends their events in one transaction of the local store, and
/// [`AppendedBatch::ack`](super::AppendedBatch::ack) acknowledges them to the broker (and dead-letters what could not be
/// read). The broker's ack comes only after the store's commit. A batch dropped between the
/// two makes the consumer close its channel before the next fetch, so the broker puts the
/// messages back in the queue at once; appending them again adds nothing.
///
/// One batch is out at a time: [`fetch`](Self::fetch) waits while another batch of this
/// consumer (or of a clone) is neither acknowledged nor dropped.
///
/// When the connection is lost, the fetch or the ack in progress fails, the broker puts every
/// unacknowledged message back in the queue, and the next [`fetch`](Self::fetch) opens a new
/// connection: [`run`](Self::run) goes on by itself.
///
/// Cheap to clone; clones share the connection.
///
/// See the [module documentation](super) for the message format and the guarantees.
///
/// # Example
///
/// ```no_run
/// # use relaybus::{RelayBus, Store};
/// use relaybus::transport::rabbitmq::RabbitConsumer;
/// use tokio_util::sync::CancellationToken;
///
/// # async fn example<S: Store>(bus: RelayBus<S>) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// let consumer = RabbitConsumer::builder("amqp://guest:guest@127.0.0.1:5672/%2f", "orders.0")
///     .dead_letter_exchange("orders.dead", "orders.0")
///     .build()
///     .await?;
/// let shutdown = CancellationToken::new();
/// bus.start().await?;
/// let report = consumer.run(&bus, shutdown.child_token()).await;
/// println!("appended {} events", report.appended);
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct RabbitConsumer {
    pub(super) inner: Arc<ConsumerInner>,
}

pub(super) struct ConsumerInner {
    pub(super) endpoint: Endpoint,
    pub(super) queue: String,
    pub(super) batch_size: usize,
    pub(super) fetch_wait: Duration,
    pub(super) retry_delay: Duration,
    pub(super) dead_letter: Option<(String, String)>,
    pub(super) session: Arc<Mutex<Option<Session>>>,
    pub(super) connections: AtomicU64,
}

/// A connection, its consuming channel, and the channel dead letters are published on.
pub(super) struct Session {
    pub(super) connection: Connection,
    pub(super) channel: Channel,
    pub(super) consumer: lapin::Consumer,
    pub(super) dead_letter: Option<Channel>,
    /// Close the channel before the next fetch, so the broker puts what it sent ahead back in
    /// the queue in order: set when a batch was dropped unsettled or given back.
    pub(super) reopen: bool,
}

impl Session {
    pub(super) fn is_open(&self) -> bool {
        self.connection.status().connected() && self.channel.status().connected()
    }
}

impl fmt::Debug for RabbitConsumer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let inner = &self.inner;
        f.debug_struct("RabbitConsumer")
            .field("endpoint", &inner.endpoint)
            .field("queue", &inner.queue)
            .field("batch_size", &inner.batch_size)
            .field("fetch_wait", &inner.fetch_wait)
            .field("retry_delay", &inner.retry_delay)
            .field("dead_letter", &inner.dead_letter)
            .finish_non_exhaustive()
    }
}

impl RabbitConsumer {
    /// Takes up to the batch size of messages, in queue order: waits up to the
    /// [fetch wait](super::RabbitConsumerBuilder::fetch_wait) for a first message, then takes it
    /// with whatever else the broker has sent ahead. An empty batch means nothing came within
    /// the wait. Opens a connection first when there is none, the last one was lost, or the
    /// last batch was dropped or given back.
    ///
    /// # Errors
    ///
    /// [`RabbitError::Connect`] when no connection could be opened; [`RabbitError::Setup`]
    /// when the queue cannot be consumed (it does not exist); [`RabbitError::Fetch`] when the
    /// connection or the channel was lost while waiting.
    ///
    /// # Cancel safety
    ///
    /// Cancelling it loses nothing: a message is taken only when the call returns.
    pub async fn fetch(&self) -> Result<InboundBatch, RabbitError> {
        InboundBatch::fetch(self).await
    }

    /// # Errors
    ///
    /// The errors of [`fetch`](Self::fetch) and of [`AppendedBatch::ack`](super::AppendedBatch::ack); append failures
    /// are in the report ([`BatchReport::retried`]).
    pub async fn run_once<S: Store>(&self, bus: &RelayBus<S>) -> Result<BatchReport, RabbitError> {
        inbound::run_once(self, bus).await
    }

    /// Consumes until `shutdown` is cancelled: batch after batch, each appended in one
    /// transaction of `bus`'s store and then acknowledged. Returns every batch's report added
    /// up; a batch whose acknowledgement failed counts its appends too (its redelivery then
    /// counts as duplicates).
    ///
    /// On shutdown it stops taking batches, finishes the batch it holds (appends, commits,
    /// acknowledges), closes its connection, so the broker puts what it had sent ahead back
    /// in the queue at once, and returns; it notices the token within the
    /// [fetch wait](super::RabbitConsumerBuilder::fetch_wait) plus the time one batch takes.
    ///
    /// A lost connection is no reason to stop: a fetch or acknowledgement that fails is
    /// logged, and the next fetch, after the fetch wait, connects again; the broker
    /// redelivers what was not acknowledged, and appending it again adds nothing. After a
    /// batch whose appends failed it waits for the
    /// [retry delay](super::RabbitConsumerBuilder::retry_delay) before fetching again.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future instead of cancelling the token loses nothing either: what was
    /// taken and not acknowledged is redelivered, and appending it again adds nothing. Cancel
    /// the token to stop after the batch in hand.
    pub async fn run<S: Store>(
        &self,
        bus: &RelayBus<S>,
        shutdown: CancellationToken,
    ) -> BatchReport {
        inbound::run(self, bus, shutdown).await
    }

    /// Closes the consumer's connection, if open: the broker puts every message it sent and
    /// that was not acknowledged back in the queue. Waits while a batch is out. A later
    /// [`fetch`](Self::fetch) connects again.
    pub async fn close(&self) {
        if let Some(session) = self.inner.session.lock().await.take() {
            close_quietly(&session.connection, "relaybus consumer closed").await;
        }
    }

    /// The queue consumed.
    pub fn queue(&self) -> &str {
        &self.inner.queue
    }

    /// Connections opened: the first one, and one after each loss, dropped batch or batch
    /// given back.
    pub fn connections(&self) -> u64 {
        self.inner.connections.load(Ordering::Relaxed)
    }
}
