//! The inbound consumer: takes a stream's events through a durable pull consumer and appends
//! them to the local store.

use std::{
    fmt,
    sync::{Arc, atomic::AtomicBool},
    time::Duration,
};

use async_nats::jetstream::{self, consumer::PullConsumer};
use tokio_util::sync::CancellationToken;

use super::{InboundBatch, NatsError};
use crate::{
    bus::RelayBus,
    store::Store,
    transport::{BatchReport, inbound},
};

/// The most messages one batch takes.
pub const MAX_BATCH_SIZE: usize = 1_000;

/// How long the broker waits for a message's acknowledgement before it redelivers it, unless
/// [set otherwise](super::NatsConsumerBuilder::ack_wait): short, so that what a dead process had
/// taken is delivered again within seconds. A batch being appended is reported in progress
/// several times per ack wait, so a slow append is not redelivered.
pub const DEFAULT_ACK_WAIT: Duration = Duration::from_secs(2);

/// Takes the events of a JetStream stream through a durable pull consumer and appends them
/// to the local store with their original ids, so that the local bus's handlers run them
/// through the normal dispatcher.
///
/// A batch goes through three steps, which [`run`](Self::run) and
/// [`run_once`](Self::run_once) chain, and which can be driven one by one:
/// [`fetch`](Self::fetch) takes messages from the broker, [`InboundBatch::append`] appends
/// their events in one transaction of the local store, and [`AppendedBatch::ack`](super::AppendedBatch::ack)
/// acknowledges them to the broker (and dead-letters what could not be read). The broker's
/// ack comes only after the store's commit; a batch dropped between the two is redelivered
/// after the ack wait, and appending it again adds nothing.
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
#[derive(Clone)]
pub struct NatsConsumer {
    pub(super) inner: Arc<ConsumerInner>,
}

pub(super) struct ConsumerInner {
    pub(super) jetstream: jetstream::Context,
    pub(super) consumer: PullConsumer,
    /// The durable consumer's settings, limit of unacknowledged messages included.
    pub(super) config: jetstream::consumer::pull::Config,
    /// Whether no message of the durable consumer is out unacknowledged but the batch this
    /// process holds: false before the first fetch, and after a batch that was dropped, given
    /// back or not acknowledged. See `NatsConsumer::take_over`.
    pub(super) settled: Arc<AtomicBool>,
    pub(super) stream: String,
    pub(super) durable: String,
    pub(super) batch_size: usize,
    pub(super) fetch_wait: Duration,
    pub(super) ack_wait: Duration,
    pub(super) nak_delay: Duration,
    pub(super) dead_letter_subject: Option<String>,
}

impl fmt::Debug for NatsConsumer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let inner = &self.inner;
        f.debug_struct("NatsConsumer")
            .field("stream", &inner.stream)
            .field("durable", &inner.durable)
            .field("batch_size", &inner.batch_size)
            .field("fetch_wait", &inner.fetch_wait)
            .field("ack_wait", &inner.ack_wait)
            .field("nak_delay", &inner.nak_delay)
            .field("dead_letter_subject", &inner.dead_letter_subject)
            .finish_non_exhaustive()
    }
}

impl NatsConsumer {
    /// Takes up to the batch size of messages from the broker, in stream order: what is there
    /// now, or, when nothing is, waits up to the [fetch wait](super::NatsConsumerBuilder::fetch_wait)
    /// for the first message and takes it with whatever came along. An empty batch means
    /// nothing came within the wait.
    ///
    /// # Errors
    ///
    /// [`NatsError::Fetch`] when the pull request could not be sent (the connection is down,
    /// the consumer was deleted).
    ///
    /// # Cancel safety
    ///
    /// Cancelling it loses nothing: messages it had taken are redelivered after the ack wait.
    pub async fn fetch(&self) -> Result<InboundBatch, NatsError> {
        InboundBatch::fetch(self).await
    }

    /// Fetches one batch, appends it and acknowledges it: [`fetch`](Self::fetch), then
    /// [`InboundBatch::append`], then [`AppendedBatch::ack`](super::AppendedBatch::ack).
    ///
    /// # Errors
    ///
    /// The errors of [`fetch`](Self::fetch) and of [`AppendedBatch::ack`](super::AppendedBatch::ack); append failures
    /// are in the report ([`BatchReport::retried`]).
    pub async fn run_once<S: Store>(&self, bus: &RelayBus<S>) -> Result<BatchReport, NatsError> {
        inbound::run_once(self, bus).await
    }

    /// Consumes until `shutdown` is cancelled: batch after batch, each appended in one
    /// transaction of `bus`'s store and then acknowledged. Returns every batch's report added
    /// up; a batch whose acknowledgement failed counts its appends too (its redelivery then
    /// counts as duplicates).
    ///
    /// On shutdown it stops fetching, finishes the batch it holds (appends, commits,
    /// acknowledges) and returns; it notices the token within the
    /// [fetch wait](super::NatsConsumerBuilder::fetch_wait) plus the time one batch takes. A fetch or
    /// acknowledgement that fails (the connection is down) is logged, and the consumer tries
    /// again after the fetch wait: the client reconnects by itself, and what was not
    /// acknowledged is redelivered. After a batch whose appends failed it waits for the nak
    /// delay before fetching again.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future instead of cancelling the token loses nothing either: what was
    /// taken and not acknowledged is redelivered after the ack wait, and appending it again
    /// adds nothing. Cancel the token to stop without that delay.
    pub async fn run<S: Store>(
        &self,
        bus: &RelayBus<S>,
        shutdown: CancellationToken,
    ) -> BatchReport {
        inbound::run(self, bus, shutdown).await
    }

    /// The stream consumed.
    pub fn stream(&self) -> &str {
        &self.inner.stream
    }

    /// The durable consumer's name.
    pub fn durable_name(&self) -> &str {
        &self.inner.durable
    }

    /// The client's handle on the durable consumer, to read its state
    /// (`consumer.info().await`) in tests and monitoring.
    pub fn pull_consumer(&self) -> PullConsumer {
        self.inner.consumer.clone()
    }
}
