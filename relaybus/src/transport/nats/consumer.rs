//! The inbound consumer: takes a stream's events through a durable pull consumer and appends
//! them to the local store.

use std::{
    fmt,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use async_nats::{
    header::NATS_MESSAGE_ID,
    jetstream::{self, AckKind, consumer::PullConsumer, message::PublishMessage},
};
use futures::StreamExt;
use tokio_util::sync::CancellationToken;

use super::{
    NatsError,
    error::check_subject,
    progress::InProgress,
    wire::{
        self, DEAD_LETTER_REASON_HEADER, DEAD_LETTER_SOURCE_HEADER, DEAD_LETTER_SUBJECT_HEADER,
    },
};
use crate::{
    bus::RelayBus,
    store::{Appended, Store},
    transport::inbound::{self, Fate},
};

/// The most messages one batch takes.
pub const MAX_BATCH_SIZE: usize = 1_000;

/// How long the broker waits for a message's acknowledgement before it redelivers it, unless
/// [set otherwise](NatsConsumerBuilder::ack_wait): short, so that what a dead process had
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
/// their events in one transaction of the local store, and [`AppendedBatch::ack`]
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
    inner: Arc<ConsumerInner>,
}

struct ConsumerInner {
    jetstream: jetstream::Context,
    consumer: PullConsumer,
    /// The durable consumer's settings, limit of unacknowledged messages included.
    config: jetstream::consumer::pull::Config,
    /// Whether no message of the durable consumer is out unacknowledged but the batch this
    /// process holds: false before the first fetch, and after a batch that was dropped, given
    /// back or not acknowledged. See [`NatsConsumer::take_over`].
    settled: Arc<AtomicBool>,
    stream: String,
    durable: String,
    batch_size: usize,
    fetch_wait: Duration,
    ack_wait: Duration,
    nak_delay: Duration,
    dead_letter_subject: Option<String>,
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

/// What one batch did, or, from [`NatsConsumer::run`], every batch of the run added up.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct BatchReport {
    /// Messages taken from the broker.
    pub fetched: usize,
    /// Events the local store did not hold, appended with their deliveries.
    pub appended: usize,
    /// Events the local store held already (a redelivery, or an event the relay sent twice):
    /// nothing new was written, except deliveries of handlers new to the event.
    pub duplicates: usize,
    /// Messages that are not relaybus events or failed to decode, published to the
    /// dead-letter subject and acknowledged.
    pub dead_lettered: usize,
    /// Messages that could not be read and could not be dead-lettered either (no dead-letter
    /// subject, or its publish failed): terminated, so the broker never redelivers them; the
    /// reason is logged at error level.
    pub terminated: usize,
    /// Messages whose append failed (the store was unreachable, say): negatively
    /// acknowledged with the nak delay, so the broker redelivers them.
    pub retried: usize,
    /// The last append error, when messages were retried.
    pub last_error: Option<String>,
}

impl BatchReport {
    fn add(&mut self, other: BatchReport) {
        self.fetched += other.fetched;
        self.appended += other.appended;
        self.duplicates += other.duplicates;
        self.dead_lettered += other.dead_lettered;
        self.terminated += other.terminated;
        self.retried += other.retried;
        if other.last_error.is_some() {
            self.last_error = other.last_error;
        }
    }
}

impl NatsConsumer {
    /// Starts building a consumer of `stream` under the durable name `durable`. The broker
    /// remembers what a durable consumer acknowledged, so a restarted process goes on where
    /// the last one stopped: give each consuming service its own durable name.
    pub fn builder(
        jetstream: jetstream::Context,
        stream: impl Into<String>,
        durable: impl Into<String>,
    ) -> NatsConsumerBuilder {
        NatsConsumerBuilder {
            jetstream,
            stream: stream.into(),
            durable: durable.into(),
            filter_subject: None,
            batch_size: 64,
            fetch_wait: Duration::from_secs(1),
            ack_wait: DEFAULT_ACK_WAIT,
            nak_delay: Duration::from_secs(5),
            dead_letter_subject: None,
        }
    }

    /// Takes up to the batch size of messages from the broker, in stream order: what is there
    /// now, or, when nothing is, waits up to the [fetch wait](NatsConsumerBuilder::fetch_wait)
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
        let inner = &self.inner;
        let started = Instant::now();
        let limit = self.take_over().await?;
        let mut messages = self.pull(false, limit).await?;
        if messages.is_empty() {
            messages = self.pull(true, 1).await?;
            if messages.is_empty() {
                // The broker answered early (its limit of unacknowledged messages is reached
                // while earlier messages wait for redelivery): wait out the fetch wait rather
                // than ask again at once.
                let rest = inner.fetch_wait.saturating_sub(started.elapsed());
                tokio::time::sleep(rest).await;
            } else if limit > 1 {
                let more = self.pull(false, limit - 1).await?;
                messages.extend(more);
            }
        }
        let replies = messages.iter().filter_map(|m| m.reply.clone()).collect();
        let progress = InProgress::start(
            inner.jetstream.client(),
            replies,
            inner.ack_wait,
            &inner.settled,
        );
        Ok(InboundBatch {
            consumer: self.clone(),
            messages,
            progress,
        })
    }

    /// Makes sure that messages out unacknowledged, which this process does not hold (a dead
    /// process's batch, or one of its own that was dropped, given back or not acknowledged),
    /// are taken again before any later message: the broker hands out messages up to the
    /// durable consumer's limit of unacknowledged messages, so a batch shorter than the limit
    /// would let the next fetch take later messages ahead of it. Until nothing is out, the
    /// limit is narrowed to what is out; the broker then redelivers those messages (after
    /// their ack wait), and only them, and the limit goes back to the batch size.
    ///
    /// Asks the broker only while unsettled: before the first fetch, after a batch that was
    /// not acknowledged in full.
    ///
    /// Returns how many messages this fetch may take: the limit. Asking for more than the
    /// limit would make the broker (2.9) redeliver what it just delivered.
    async fn take_over(&self) -> Result<usize, NatsError> {
        let inner = &self.inner;
        if inner.settled.load(Ordering::Acquire) {
            return Ok(inner.batch_size);
        }
        let failed = |source: async_nats::Error| NatsError::Fetch {
            durable: inner.durable.clone(),
            source,
        };
        let info = inner
            .consumer
            .get_info()
            .await
            .map_err(|e| failed(e.into()))?;
        let out = info.num_ack_pending.min(inner.batch_size);
        let limit =
            i64::try_from(if out == 0 { inner.batch_size } else { out }).unwrap_or(i64::MAX);
        if info.config.max_ack_pending != limit {
            tracing::debug!(
                durable = inner.durable,
                out = info.num_ack_pending,
                limit,
                "setting the limit of unacknowledged messages"
            );
            let config = jetstream::consumer::pull::Config {
                max_ack_pending: limit,
                ..inner.config.clone()
            };
            inner
                .jetstream
                .create_consumer_on_stream(config, &inner.stream)
                .await
                .map_err(|e| failed(e.into()))?;
        }
        if info.num_ack_pending == 0 {
            inner.settled.store(true, Ordering::Release);
        }
        Ok(usize::try_from(limit).unwrap_or(inner.batch_size))
    }

    /// Marks the durable consumer as possibly holding unacknowledged messages that this
    /// process does not: the next fetch takes them first.
    fn unsettle(&self) {
        self.inner.settled.store(false, Ordering::Release);
    }

    /// One pull request: `no_wait` returns what is there now, otherwise the server holds the
    /// request up to the fetch wait.
    async fn pull(&self, wait: bool, count: usize) -> Result<Vec<jetstream::Message>, NatsError> {
        let inner = &self.inner;
        let failed = |source: async_nats::Error| {
            // The request may have been answered with messages that never came.
            self.unsettle();
            NatsError::Fetch {
                durable: inner.durable.clone(),
                source,
            }
        };
        let mut batch = if wait {
            inner
                .consumer
                .batch()
                .max_messages(count)
                .expires(inner.fetch_wait)
                .messages()
                .await
                .map_err(|e| failed(e.into()))?
        } else {
            inner
                .consumer
                .fetch()
                .max_messages(count)
                .messages()
                .await
                .map_err(|e| failed(e.into()))?
        };
        // A pull request whose answer was lost (the connection dropped after it left) gets
        // no answer at all: give up on it past the fetch wait plus the server's grace, and
        // keep what came.
        let guard = inner.fetch_wait.saturating_add(Duration::from_secs(5));
        let mut messages = Vec::new();
        loop {
            match tokio::time::timeout(guard, batch.next()).await {
                Ok(Some(Ok(message))) => messages.push(message),
                Ok(Some(Err(error))) => {
                    // A status such as "exceeded max ack pending" ends the pull; what came
                    // before it is kept.
                    tracing::debug!(durable = inner.durable, %error, "pull request ended");
                    break;
                }
                Ok(None) => break,
                Err(_) => {
                    tracing::debug!(durable = inner.durable, "pull request unanswered");
                    self.unsettle();
                    break;
                }
            }
        }
        Ok(messages)
    }

    /// Fetches one batch, appends it and acknowledges it: [`fetch`](Self::fetch), then
    /// [`InboundBatch::append`], then [`AppendedBatch::ack`].
    ///
    /// # Errors
    ///
    /// The errors of [`fetch`](Self::fetch) and of [`AppendedBatch::ack`]; append failures
    /// are in the report ([`BatchReport::retried`]).
    pub async fn run_once<S: Store>(&self, bus: &RelayBus<S>) -> Result<BatchReport, NatsError> {
        let batch = self.fetch().await?;
        if batch.is_empty() {
            return Ok(BatchReport::default());
        }
        batch.append(bus).await.ack().await
    }

    /// Consumes until `shutdown` is cancelled: batch after batch, each appended in one
    /// transaction of `bus`'s store and then acknowledged. Returns every batch's report added
    /// up; a batch whose acknowledgement failed counts its appends too (its redelivery then
    /// counts as duplicates).
    ///
    /// On shutdown it stops fetching, finishes the batch it holds (appends, commits,
    /// acknowledges) and returns; it notices the token within the
    /// [fetch wait](NatsConsumerBuilder::fetch_wait) plus the time one batch takes. A fetch or
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
        let inner = &self.inner;
        let mut total = BatchReport::default();
        while !shutdown.is_cancelled() {
            let batch = match self.fetch().await {
                Ok(batch) => batch,
                Err(error) => {
                    tracing::warn!(durable = inner.durable, %error, "fetch failed; trying again");
                    pause(&shutdown, inner.fetch_wait).await;
                    continue;
                }
            };
            if batch.is_empty() {
                continue;
            }
            let batch_len = batch.len();
            let appended = batch.append(bus).await;
            // What the store took counts even when the acknowledgement fails: the redelivery
            // then counts as duplicates.
            let created = appended.appended().filter(|a| a.created).count();
            let held = appended.appended().filter(|a| !a.created).count();
            match appended.ack().await {
                Ok(report) => {
                    let retried = report.retried > 0;
                    if let Some(error) = report.last_error.as_deref().filter(|_| retried) {
                        tracing::warn!(
                            durable = inner.durable,
                            retried = report.retried,
                            error,
                            "appending to the store failed; the broker redelivers the messages"
                        );
                    }
                    total.add(report);
                    if retried {
                        pause(&shutdown, inner.nak_delay).await;
                    }
                }
                Err(error) => {
                    total.fetched += batch_len;
                    total.appended += created;
                    total.duplicates += held;
                    tracing::warn!(durable = inner.durable, %error, "acknowledging failed");
                    pause(&shutdown, inner.fetch_wait).await;
                }
            }
        }
        total
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

/// Waits `wait`, or less when `shutdown` is cancelled.
async fn pause(shutdown: &CancellationToken, wait: Duration) {
    tokio::select! {
        () = shutdown.cancelled() => {}
        () = tokio::time::sleep(wait) => {}
    }
}

/// Builds a [`NatsConsumer`]; made by [`NatsConsumer::builder`].
#[must_use]
pub struct NatsConsumerBuilder {
    jetstream: jetstream::Context,
    stream: String,
    durable: String,
    filter_subject: Option<String>,
    batch_size: usize,
    fetch_wait: Duration,
    ack_wait: Duration,
    nak_delay: Duration,
    dead_letter_subject: Option<String>,
}

impl fmt::Debug for NatsConsumerBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NatsConsumerBuilder")
            .field("stream", &self.stream)
            .field("durable", &self.durable)
            .field("filter_subject", &self.filter_subject)
            .field("batch_size", &self.batch_size)
            .field("fetch_wait", &self.fetch_wait)
            .field("ack_wait", &self.ack_wait)
            .field("nak_delay", &self.nak_delay)
            .field("dead_letter_subject", &self.dead_letter_subject)
            .finish_non_exhaustive()
    }
}

impl NatsConsumerBuilder {
    /// Takes only the messages of subjects matching `subject` (wildcards allowed), for
    /// example one partition of a relay, `orders.events.3`. All of the stream's by default.
    pub fn filter_subject(mut self, subject: impl Into<String>) -> Self {
        self.filter_subject = Some(subject.into());
        self
    }

    /// How many messages one batch takes at most, 64 by default (1 to 1,000). It is also the
    /// durable consumer's limit of unacknowledged messages, so that messages waiting for
    /// redelivery are never overtaken by later ones.
    pub fn batch_size(mut self, size: usize) -> Self {
        self.batch_size = size;
        self
    }

    /// How long a fetch waits for a first message when none is there, 1 second by default
    /// (10 ms to 1 minute). [`run`](NatsConsumer::run) notices its shutdown token within it.
    pub fn fetch_wait(mut self, wait: Duration) -> Self {
        self.fetch_wait = wait;
        self
    }

    /// How long the broker waits for a message's acknowledgement before it redelivers it,
    /// [`DEFAULT_ACK_WAIT`] (2 seconds) by default (100 ms to 1 hour). It bounds how long the
    /// messages a dead process had taken wait before they are delivered again. A batch is
    /// reported in progress four times per ack wait from its fetch to its acknowledgement, so
    /// an append that takes longer is not redelivered; only a process stalled for the whole
    /// ack wait (stopped, starved of CPU) has its batch redelivered while it still holds it,
    /// and appending it twice adds nothing.
    pub fn ack_wait(mut self, wait: Duration) -> Self {
        self.ack_wait = wait;
        self
    }

    /// How long the broker waits before it redelivers messages whose append failed, 5
    /// seconds by default (at most 1 hour).
    pub fn nak_delay(mut self, delay: Duration) -> Self {
        self.nak_delay = delay;
        self
    }

    /// Where messages that are not relaybus events, or fail to decode, go: published there
    /// (body and headers as they came, with [`DEAD_LETTER_REASON_HEADER`] and the original
    /// subject and stream position), then acknowledged. Give it a subject that a stream
    /// captures, so that the dead letters are kept; the publish waits for JetStream's
    /// confirmation. Without one, or when that publish fails, such a message is terminated
    /// (`+TERM`): the broker never redelivers it, and the reason is logged at error level.
    pub fn dead_letter_subject(mut self, subject: impl Into<String>) -> Self {
        self.dead_letter_subject = Some(subject.into());
        self
    }

    /// Validates the settings, then creates the durable pull consumer on the stream, or
    /// updates it to these settings.
    ///
    /// # Errors
    ///
    /// [`NatsError::InvalidConfiguration`] for a setting out of range, an empty durable name
    /// or one with `.`, `*`, `>` or whitespace, or a dead-letter subject that is not a literal
    /// subject; [`NatsError::Setup`] when the stream does not exist or the server refuses the
    /// consumer.
    pub async fn build(self) -> Result<NatsConsumer, NatsError> {
        let name_ok = |name: &str| {
            !name.is_empty()
                && !name
                    .chars()
                    .any(|c| matches!(c, '.' | '*' | '>') || c.is_whitespace() || c.is_control())
        };
        if !name_ok(&self.stream) {
            return Err(NatsError::invalid(
                "stream",
                format!(
                    "{:?} is not a stream name; use a name without `.`, `*`, `>` or whitespace",
                    self.stream
                ),
            ));
        }
        if !name_ok(&self.durable) {
            return Err(NatsError::invalid(
                "durable",
                format!(
                    "{:?} is not a durable consumer name; use a name without `.`, `*`, `>` or \
                     whitespace",
                    self.durable
                ),
            ));
        }
        if !(1..=MAX_BATCH_SIZE).contains(&self.batch_size) {
            return Err(NatsError::invalid(
                "batch_size",
                format!(
                    "{} is out of range; use 1 to {MAX_BATCH_SIZE}",
                    self.batch_size
                ),
            ));
        }
        let in_range =
            |value: Duration, low: Duration, high: Duration| low <= value && value <= high;
        if !in_range(
            self.fetch_wait,
            Duration::from_millis(10),
            Duration::from_secs(60),
        ) {
            return Err(NatsError::invalid(
                "fetch_wait",
                format!(
                    "{:?} is out of range; use 10 ms to 1 minute",
                    self.fetch_wait
                ),
            ));
        }
        if !in_range(
            self.ack_wait,
            Duration::from_millis(100),
            Duration::from_secs(3_600),
        ) {
            return Err(NatsError::invalid(
                "ack_wait",
                format!("{:?} is out of range; use 100 ms to 1 hour", self.ack_wait),
            ));
        }
        if self.nak_delay > Duration::from_secs(3_600) {
            return Err(NatsError::invalid(
                "nak_delay",
                format!("{:?} is over an hour; use at most 1 hour", self.nak_delay),
            ));
        }
        if let Some(subject) = &self.dead_letter_subject {
            check_subject("dead_letter_subject", subject)?;
        }
        if self.filter_subject.as_deref() == Some("") {
            return Err(NatsError::invalid(
                "filter_subject",
                "it is empty; leave it unset to take the whole stream",
            ));
        }
        let setup = |source: async_nats::Error| NatsError::Setup {
            stream: self.stream.clone(),
            durable: self.durable.clone(),
            source,
        };
        let stream = self
            .jetstream
            .get_stream(&self.stream)
            .await
            .map_err(|e| setup(e.into()))?;
        let config = jetstream::consumer::pull::Config {
            durable_name: Some(self.durable.clone()),
            filter_subject: self.filter_subject.clone().unwrap_or_default(),
            ack_policy: jetstream::consumer::AckPolicy::Explicit,
            ack_wait: self.ack_wait,
            max_ack_pending: i64::try_from(self.batch_size).unwrap_or(i64::MAX),
            ..Default::default()
        };
        let consumer = stream
            .create_consumer(config.clone())
            .await
            .map_err(|e| setup(e.into()))?;
        Ok(NatsConsumer {
            inner: Arc::new(ConsumerInner {
                jetstream: self.jetstream,
                consumer,
                config,
                settled: Arc::new(AtomicBool::new(false)),
                stream: self.stream,
                durable: self.durable,
                batch_size: self.batch_size,
                fetch_wait: self.fetch_wait,
                ack_wait: self.ack_wait,
                nak_delay: self.nak_delay,
                dead_letter_subject: self.dead_letter_subject,
            }),
        })
    }
}

/// Messages taken from the broker by [`NatsConsumer::fetch`], not yet appended. While it is
/// held, its messages are reported in progress to the broker a few times per ack wait, so
/// they are not redelivered however long the append takes. Dropping it stops the reports and
/// leaves the messages to the broker, which redelivers them after the ack wait.
#[must_use = "a fetched batch is redelivered after the ack wait unless appended and acknowledged"]
pub struct InboundBatch {
    consumer: NatsConsumer,
    messages: Vec<jetstream::Message>,
    progress: InProgress,
}

impl fmt::Debug for InboundBatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("InboundBatch")
            .field("messages", &self.messages.len())
            .finish_non_exhaustive()
    }
}

impl InboundBatch {
    /// How many messages the batch holds.
    pub fn len(&self) -> usize {
        self.messages.len()
    }

    /// Whether the fetch found nothing.
    pub fn is_empty(&self) -> bool {
        self.messages.is_empty()
    }

    /// Reads the batch's events and appends them, in stream order, in one transaction of
    /// `bus`'s store ([`RelayBus::publish_all`]), with their original ids, keys, headers and
    /// creation times, and with the deliveries of `bus`'s handlers. An event the store holds
    /// already adds nothing (but the deliveries of handlers new to it).
    ///
    /// Messages that are not relaybus events are set aside for the dead-letter subject. When
    /// the transaction fails, the events are appended one at a time, in order: an event the
    /// store refuses for good (an invalid or oversized event) is set aside for the dead-letter
    /// subject too, and from the first one that fails otherwise (the store is unreachable),
    /// that event and every one after it are to be redelivered, so that a key's events are
    /// never appended out of order.
    ///
    /// Nothing is acknowledged yet: call [`AppendedBatch::ack`].
    pub async fn append<S: Store>(self, bus: &RelayBus<S>) -> AppendedBatch {
        let (fates, last_error) = inbound::append(
            bus,
            self.messages.iter().map(|message| &message.payload[..]),
        )
        .await;
        AppendedBatch {
            consumer: self.consumer,
            items: self.messages.into_iter().zip(fates).collect(),
            last_error,
            progress: self.progress,
        }
    }
}

/// A batch appended to the local store, not yet acknowledged to the broker; its messages are
/// still reported in progress. Dropping it leaves the messages to the broker, which
/// redelivers them after the ack wait; appending them again adds nothing.
#[must_use = "an appended batch is redelivered after the ack wait unless acknowledged"]
pub struct AppendedBatch {
    consumer: NatsConsumer,
    items: Vec<(jetstream::Message, Fate)>,
    last_error: Option<String>,
    progress: InProgress,
}

impl fmt::Debug for AppendedBatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AppendedBatch")
            .field("messages", &self.items.len())
            .field("last_error", &self.last_error)
            .finish_non_exhaustive()
    }
}

impl AppendedBatch {
    /// The events appended (or found held already), in stream order.
    pub fn appended(&self) -> impl Iterator<Item = &Appended> {
        self.items.iter().filter_map(|(_, fate)| match fate {
            Fate::Appended(appended) => Some(appended),
            _ => None,
        })
    }

    /// Settles every message with the broker, in stream order: acknowledges the appended
    /// ones; publishes the unreadable ones to the dead-letter subject and acknowledges them
    /// (or terminates them when that is impossible); negatively acknowledges, with the nak
    /// delay, those whose append failed, so the broker redelivers them. The last
    /// acknowledgement waits for the server's confirmation (the server takes a consumer's
    /// acknowledgements in order), and the connection is flushed, so the acknowledgements are
    /// in when it returns.
    ///
    /// # Errors
    ///
    /// [`NatsError::Ack`] when acknowledgements could not be sent; the broker then redelivers
    /// those messages after the ack wait, and appending them again adds nothing.
    pub async fn ack(self) -> Result<BatchReport, NatsError> {
        let AppendedBatch {
            consumer,
            items,
            last_error,
            mut progress,
        } = self;
        let inner = &consumer.inner;
        let mut report = BatchReport {
            fetched: items.len(),
            last_error,
            ..BatchReport::default()
        };
        // Dead-lettering waits for JetStream, message by message: the batch stays reported in
        // progress until every message's fate is known.
        let mut kinds = Vec::with_capacity(items.len());
        for (message, fate) in &items {
            kinds.push(match fate {
                Fate::Appended(appended) => {
                    if appended.created {
                        report.appended += 1;
                    } else {
                        report.duplicates += 1;
                    }
                    AckKind::Ack
                }
                Fate::Retry | Fate::Decoded(_) => {
                    report.retried += 1;
                    AckKind::Nak(Some(inner.nak_delay))
                }
                Fate::Unreadable(reason) => match consumer.dead_letter(message, reason).await {
                    Ok(()) => {
                        report.dead_lettered += 1;
                        AckKind::Ack
                    }
                    Err(error) => {
                        tracing::error!(
                            subject = message.subject.as_str(),
                            reason,
                            %error,
                            "an unreadable message could not be dead-lettered; terminating it"
                        );
                        report.terminated += 1;
                        AckKind::Term
                    }
                },
            });
        }
        // No progress report may follow a negative acknowledgement: it could restart the
        // message's timer and cut its nak delay short.
        progress.finish();
        if report.retried > 0 {
            // Negatively acknowledged, they are out until redelivered.
            consumer.unsettle();
        }
        let mut failures = 0;
        let mut first_failure: Option<async_nats::Error> = None;
        let last = items.len().saturating_sub(1);
        for (at, ((message, _), kind)) in items.iter().zip(kinds).enumerate() {
            // The last acknowledgement waits for the server's reply: the server takes a
            // consumer's acknowledgements in order, so all of them are in when it comes.
            let sent = if at == last && matches!(kind, AckKind::Ack) {
                message.double_ack_with(kind).await
            } else {
                message.ack_with(kind).await
            };
            if let Err(error) = sent {
                failures += 1;
                first_failure.get_or_insert(error);
            }
        }
        if let Err(error) = inner.jetstream.client().flush().await {
            failures = items.len();
            first_failure.get_or_insert(error.into());
        }
        if first_failure.is_some() {
            consumer.unsettle();
        }
        match first_failure {
            Some(source) => Err(NatsError::Ack {
                count: failures,
                source,
            }),
            None => Ok(report),
        }
    }
}

impl NatsConsumer {
    /// Publishes an unreadable message to the dead-letter subject and waits for JetStream's
    /// confirmation. Its `Nats-Msg-Id` is `<stream>:<sequence>`, so dead-lettering a
    /// redelivered message again keeps one copy.
    async fn dead_letter(
        &self,
        message: &jetstream::Message,
        reason: &str,
    ) -> Result<(), async_nats::Error> {
        let inner = &self.inner;
        let subject = inner
            .dead_letter_subject
            .as_deref()
            .ok_or("no dead-letter subject is set (`NatsConsumerBuilder::dead_letter_subject`)")?;
        let mut headers = message.headers.clone().unwrap_or_default();
        headers.insert(DEAD_LETTER_REASON_HEADER, wire::header_text(reason));
        headers.insert(
            DEAD_LETTER_SUBJECT_HEADER,
            wire::header_text(message.subject.as_str()),
        );
        if let Ok(info) = message.info() {
            let source = format!("{}:{}", info.stream, info.stream_sequence);
            headers.insert(DEAD_LETTER_SOURCE_HEADER, wire::header_text(&source));
            headers.insert(NATS_MESSAGE_ID, wire::header_text(&source));
        }
        let publish = PublishMessage::build()
            .payload(message.payload.clone())
            .headers(headers);
        inner
            .jetstream
            .send_publish(subject.to_owned(), publish)
            .await?
            .await?;
        Ok(())
    }
}
