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

use super::connection::{Endpoint, close_quietly};
use crate::transport::{Consumer, settings::BatchSettings};

/// Takes the events of a RabbitMQ queue and appends them to the local store with their
/// original ids, so that the local bus's handlers run them through the normal dispatcher.
///
/// The consumer owns its connection and one channel that consumes the queue with a prefetch
/// of its batch size (`basic.qos`), so the broker never has more than one batch out to it. A
/// batch goes through three steps, which [`run`](Consumer::run) and
/// [`run_once`](Consumer::run_once) chain, and which can be driven one by one:
/// [`fetch`](Consumer::fetch) takes messages,
/// [`InboundBatch::append`](crate::transport::InboundBatch::append) dead-letters what cannot
/// be read and appends the events in one transaction of the local store, and
/// [`AppendedBatch::ack`](crate::transport::AppendedBatch::ack) acknowledges them to the
/// broker. The broker's ack comes only after the store's commit. A batch dropped between the
/// two makes the consumer close its channel before the next fetch, so the broker puts the
/// messages back in the queue at once; appending them again adds nothing.
///
/// One batch is out at a time: [`fetch`](Consumer::fetch) waits while another batch of this
/// consumer (or of a clone) is neither acknowledged nor dropped.
///
/// When the connection is lost, the fetch or the ack in progress fails, the broker puts every
/// unacknowledged message back in the queue, and the next [`fetch`](Consumer::fetch) opens a new
/// connection: [`run`](Consumer::run) goes on by itself.
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
pub type RabbitConsumer = Consumer<RabbitSource>;

/// The RabbitMQ side of a [`RabbitConsumer`]: its connection, queue and settings.
#[derive(Clone)]
pub struct RabbitSource {
    pub(super) inner: Arc<ConsumerInner>,
}

impl RabbitSource {
    /// Closes the connection, if open: the broker puts every message it sent and that was not
    /// acknowledged back in the queue. Waits while a batch is out.
    pub(super) async fn close(&self) {
        if let Some(session) = self.inner.session.lock().await.take() {
            close_quietly(&session.connection, "relaybus consumer closed").await;
        }
    }
}

pub(super) struct ConsumerInner {
    pub(super) endpoint: Endpoint,
    pub(super) queue: String,
    pub(super) batch: BatchSettings,
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

impl fmt::Debug for RabbitSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let inner = &self.inner;
        f.debug_struct("RabbitSource")
            .field("endpoint", &inner.endpoint)
            .field("queue", &inner.queue)
            .field("batch", &inner.batch)
            .field("retry_delay", &inner.retry_delay)
            .field("dead_letter", &inner.dead_letter)
            .finish_non_exhaustive()
    }
}

impl RabbitConsumer {
    /// Closes the consumer's connection, if open: the broker puts every message it sent and
    /// that was not acknowledged back in the queue. Waits while a batch is out. A later
    /// [`fetch`](Consumer::fetch) connects again.
    pub async fn close(&self) {
        self.broker().close().await;
    }

    /// The queue consumed.
    pub fn queue(&self) -> &str {
        &self.broker().inner.queue
    }

    /// Connections opened: the first one, and one after each loss, dropped batch or batch
    /// given back.
    pub fn connections(&self) -> u64 {
        self.broker().inner.connections.load(Ordering::Relaxed)
    }
}
