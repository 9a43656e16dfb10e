//! The inbound consumer: takes a stream's events through a durable pull consumer and appends
//! them to the local store.

use std::{
    fmt,
    sync::{Arc, atomic::AtomicBool},
    time::Duration,
};

use async_nats::jetstream::{self, consumer::PullConsumer};

use crate::transport::{Consumer, settings::BatchSettings};

/// How long the broker waits for a message's acknowledgement before it redelivers it, unless
/// [set otherwise](super::NatsConsumerBuilder::ack_wait): short, so that what a dead process had
/// taken is delivered again within seconds. A batch being appended is reported in progress
/// several times per ack wait, so a slow append is not redelivered.
pub const DEFAULT_ACK_WAIT: Duration = Duration::from_secs(2);

/// Takes the events of a JetStream stream through a durable pull consumer and appends them
/// to the local store with their original ids, so that the local bus's handlers run them
/// through the normal dispatcher.
///
/// A batch goes through three steps, which [`run`](Consumer::run) and
/// [`run_once`](Consumer::run_once) chain, and which can be driven one by one:
/// [`fetch`](Consumer::fetch) takes messages from the broker (and reports them in progress
/// while the batch is held), [`InboundBatch::append`](crate::transport::InboundBatch::append)
/// dead-letters what cannot be read and appends the events in one transaction of the local
/// store, and [`AppendedBatch::ack`](crate::transport::AppendedBatch::ack) acknowledges them
/// to the broker. The broker's ack comes only after the store's commit; a batch dropped
/// between the two is redelivered after the ack wait, and appending it again adds nothing.
///
/// Cheap to clone; clones share the durable consumer.
///
/// See the [module documentation](super) for the message format and the guarantees.
///
/// # Example
///
/// ```no_run
/// # use relaybus::{RelayBus, Store};
/// use relaybus::transport::nats::{NatsConsumer, async_nats};
/// use tokio_util::sync::CancellationToken;
///
/// # async fn example<S: Store>(bus: RelayBus<S>) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// let client = async_nats::connect("nats://127.0.0.1:4222").await?;
/// let jetstream = async_nats::jetstream::new(client);
///
/// let consumer = NatsConsumer::builder(jetstream, "ORDERS", "shipping")
///     .dead_letter_subject("orders.dead")
///     .build()
///     .await?;
/// let shutdown = CancellationToken::new();
/// bus.start().await?;
/// let report = consumer.run(&bus, shutdown.child_token()).await;
/// println!("appended {} events", report.appended);
/// # Ok(())
/// # }
/// ```
pub type NatsConsumer = Consumer<NatsSource>;

/// The JetStream side of a [`NatsConsumer`]: its durable pull consumer and settings.
#[derive(Clone)]
pub struct NatsSource {
    pub(super) inner: Arc<ConsumerInner>,
}

pub(super) struct ConsumerInner {
    pub(super) jetstream: jetstream::Context,
    pub(super) consumer: PullConsumer,
    /// The durable consumer's settings, limit of unacknowledged messages included.
    pub(super) config: jetstream::consumer::pull::Config,
    /// Whether no message of the durable consumer is out unacknowledged but the batch this
    /// process holds: false before the first fetch, and after a batch that was dropped, given
    /// back or not acknowledged. See `NatsSource::take_over`.
    pub(super) settled: Arc<AtomicBool>,
    pub(super) stream: String,
    pub(super) durable: String,
    pub(super) batch: BatchSettings,
    pub(super) ack_wait: Duration,
    pub(super) nak_delay: Duration,
    pub(super) dead_letter_subject: Option<String>,
}

impl fmt::Debug for NatsSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let inner = &self.inner;
        f.debug_struct("NatsSource")
            .field("stream", &inner.stream)
            .field("durable", &inner.durable)
            .field("batch", &inner.batch)
            .field("ack_wait", &inner.ack_wait)
            .field("nak_delay", &inner.nak_delay)
            .field("dead_letter_subject", &inner.dead_letter_subject)
            .finish_non_exhaustive()
    }
}

impl NatsConsumer {
    /// The stream consumed.
    pub fn stream(&self) -> &str {
        &self.broker().inner.stream
    }

    /// The durable consumer's name.
    pub fn durable_name(&self) -> &str {
        &self.broker().inner.durable
    }

    /// The client's handle on the durable consumer, to read its state
    /// (`consumer.info().await`) in tests and monitoring.
    pub fn pull_consumer(&self) -> PullConsumer {
        self.broker().inner.consumer.clone()
    }
}
