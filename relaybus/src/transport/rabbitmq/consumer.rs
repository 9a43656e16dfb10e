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

use futures::{FutureExt, StreamExt};
use lapin::{
    Channel, Confirmation, Connection, ConnectionProperties,
    message::Delivery,
    options::{
        BasicAckOptions, BasicConsumeOptions, BasicNackOptions, BasicPublishOptions,
        BasicQosOptions, ConfirmSelectOptions,
    },
    types::FieldTable,
};
use tokio::sync::{Mutex, OwnedMutexGuard};
use tokio_util::sync::CancellationToken;

use super::{
    RabbitError,
    connection::{Endpoint, close_quietly},
    error::check_name,
    wire::{
        self, DEAD_LETTER_QUEUE_HEADER, DEAD_LETTER_REASON_HEADER, DEAD_LETTER_ROUTING_KEY_HEADER,
        PERSISTENT,
    },
};
use crate::{
    bus::RelayBus,
    error::BoxError,
    store::{Appended, Store},
    transport::inbound::{self, Fate},
};

/// The most messages one batch takes (and the most the broker sends ahead).
pub const MAX_BATCH_SIZE: usize = 1_000;

/// How long publishing an unreadable message to the dead-letter exchange may wait for the
/// broker's confirmation.
const DEAD_LETTER_CONFIRM_TIMEOUT: Duration = Duration::from_secs(10);

/// Takes the events of a RabbitMQ queue and appends them to the local store with their
/// original ids, so that the local bus's handlers run them through the normal dispatcher.
///
/// The consumer owns its connection and one channel that consumes the queue with a prefetch
/// of its batch size (`basic.qos`), so the broker never has more than one batch out to it. A
/// batch goes through three steps, which [`run`](Self::run) and [`run_once`](Self::run_once)
/// chain, and which can be driven one by one: [`fetch`](Self::fetch) takes messages,
/// [`InboundBatch::append`] appends their events in one transaction of the local store, and
/// [`AppendedBatch::ack`] acknowledges them to the broker (and dead-letters what could not be
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
    inner: Arc<ConsumerInner>,
}

struct ConsumerInner {
    endpoint: Endpoint,
    queue: String,
    batch_size: usize,
    fetch_wait: Duration,
    retry_delay: Duration,
    dead_letter: Option<(String, String)>,
    session: Arc<Mutex<Option<Session>>>,
    connections: AtomicU64,
}

/// A connection, its consuming channel, and the channel dead letters are published on.
struct Session {
    connection: Connection,
    channel: Channel,
    consumer: lapin::Consumer,
    dead_letter: Option<Channel>,
    /// Close the channel before the next fetch, so the broker puts what it sent ahead back in
    /// the queue in order: set when a batch was dropped unsettled or given back.
    reopen: bool,
}

impl Session {
    fn is_open(&self) -> bool {
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

/// What one batch did, or, from [`RabbitConsumer::run`], every batch of the run added up.
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
    /// dead-letter exchange and acknowledged.
    pub dead_lettered: usize,
    /// Messages that could not be read and could not be dead-lettered either (no dead-letter
    /// exchange, or its publish failed): rejected without requeue, so the broker drops them
    /// (or routes them to the queue's own `x-dead-letter-exchange`); the reason is logged at
    /// error level.
    pub rejected: usize,
    /// Messages whose append failed (the store was unreachable, say): given back to the
    /// broker with a requeue, so it delivers them again.
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
        self.rejected += other.rejected;
        self.retried += other.retried;
        if other.last_error.is_some() {
            self.last_error = other.last_error;
        }
    }
}

impl RabbitConsumer {
    /// Starts building a consumer that connects to `uri`
    /// (`amqp://user:password@host:5672/vhost`, the virtual host percent-encoded, `%2f` for
    /// `/`) and consumes the queue `queue`, such as one partition's queue of a
    /// [`RabbitRelay`](super::RabbitRelay) (`<prefix>.<partition>`).
    pub fn builder(uri: impl Into<String>, queue: impl Into<String>) -> RabbitConsumerBuilder {
        RabbitConsumerBuilder {
            uri: uri.into(),
            queue: queue.into(),
            batch_size: 64,
            fetch_wait: Duration::from_secs(1),
            retry_delay: Duration::from_secs(5),
            connect_timeout: Duration::from_secs(10),
            dead_letter: None,
            connection_properties: None,
        }
    }

    /// Takes up to the batch size of messages, in queue order: waits up to the
    /// [fetch wait](RabbitConsumerBuilder::fetch_wait) for a first message, then takes it
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
        let inner = &self.inner;
        let mut guard = Arc::clone(&inner.session).lock_owned().await;
        if guard
            .as_ref()
            .is_some_and(|session| session.reopen || !session.is_open())
            && let Some(session) = guard.take()
        {
            close_quietly(&session.connection, "relaybus consumer reopening").await;
        }
        let session = match guard.as_mut() {
            Some(session) => session,
            None => guard.insert(self.open().await?),
        };
        let lost = |source: BoxError| RabbitError::Fetch {
            queue: inner.queue.clone(),
            source,
        };
        let mut deliveries = Vec::new();
        match tokio::time::timeout(inner.fetch_wait, session.consumer.next()).await {
            Ok(Some(Ok(delivery))) => deliveries.push(delivery),
            Ok(Some(Err(error))) => {
                *guard = None;
                return Err(lost(error.into()));
            }
            Ok(None) => {
                *guard = None;
                return Err(lost(
                    "the broker cancelled the consumer (the queue was deleted?)".into(),
                ));
            }
            Err(_) if !session.is_open() => {
                *guard = None;
                return Err(lost("the connection or the channel closed".into()));
            }
            Err(_) => {}
        }
        while !deliveries.is_empty() && deliveries.len() < inner.batch_size {
            match session.consumer.next().now_or_never() {
                Some(Some(Ok(delivery))) => deliveries.push(delivery),
                // The channel is lost: settling this batch fails, and the next fetch reopens.
                Some(Some(Err(_)) | None) => {
                    session.reopen = true;
                    break;
                }
                None => break,
            }
        }
        Ok(InboundBatch {
            consumer: self.clone(),
            session: Some(guard),
            deliveries,
        })
    }

    /// Opens a connection and a channel that consumes the queue with a prefetch of the batch
    /// size.
    async fn open(&self) -> Result<Session, RabbitError> {
        let inner = &self.inner;
        let connection = inner.endpoint.connect().await?;
        let setup = |source| RabbitError::Setup {
            what: format!("a consumer of the queue {:?}", inner.queue),
            source,
        };
        let opened = async {
            let channel = connection
                .create_channel()
                .await
                .map_err(|error| inner.endpoint.failed(error))?;
            // The batch size is at most MAX_BATCH_SIZE, within u16.
            let prefetch = u16::try_from(inner.batch_size).unwrap_or(u16::MAX);
            channel
                .basic_qos(prefetch, BasicQosOptions::default())
                .await
                .map_err(setup)?;
            let tag = format!("relaybus-{}", uuid::Uuid::now_v7());
            let consumer = channel
                .basic_consume(
                    inner.queue.as_str().into(),
                    tag.into(),
                    BasicConsumeOptions::default(),
                    FieldTable::default(),
                )
                .await
                .map_err(setup)?;
            Ok::<_, RabbitError>((channel, consumer))
        }
        .await;
        match opened {
            Ok((channel, consumer)) => {
                inner.connections.fetch_add(1, Ordering::Relaxed);
                tracing::debug!(
                    endpoint = inner.endpoint.display(),
                    queue = inner.queue,
                    "consumer connected"
                );
                Ok(Session {
                    connection,
                    channel,
                    consumer,
                    dead_letter: None,
                    reopen: false,
                })
            }
            Err(error) => {
                close_quietly(&connection, "relaybus consumer could not consume").await;
                Err(error)
            }
        }
    }

    /// Fetches one batch, appends it and acknowledges it: [`fetch`](Self::fetch), then
    /// [`InboundBatch::append`], then [`AppendedBatch::ack`].
    ///
    /// # Errors
    ///
    /// The errors of [`fetch`](Self::fetch) and of [`AppendedBatch::ack`]; append failures
    /// are in the report ([`BatchReport::retried`]).
    pub async fn run_once<S: Store>(&self, bus: &RelayBus<S>) -> Result<BatchReport, RabbitError> {
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
    /// On shutdown it stops taking batches, finishes the batch it holds (appends, commits,
    /// acknowledges), closes its connection, so the broker puts what it had sent ahead back
    /// in the queue at once, and returns; it notices the token within the
    /// [fetch wait](RabbitConsumerBuilder::fetch_wait) plus the time one batch takes.
    ///
    /// A lost connection is no reason to stop: a fetch or acknowledgement that fails is
    /// logged, and the next fetch, after the fetch wait, connects again; the broker
    /// redelivers what was not acknowledged, and appending it again adds nothing. After a
    /// batch whose appends failed it waits for the
    /// [retry delay](RabbitConsumerBuilder::retry_delay) before fetching again.
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
        let inner = &self.inner;
        let mut total = BatchReport::default();
        while !shutdown.is_cancelled() {
            let batch = match self.fetch().await {
                Ok(batch) => batch,
                Err(error) => {
                    tracing::warn!(queue = inner.queue, %error, "fetch failed; trying again");
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
                            queue = inner.queue,
                            retried = report.retried,
                            error,
                            "appending to the store failed; the broker redelivers the messages"
                        );
                    }
                    total.add(report);
                    if retried {
                        pause(&shutdown, inner.retry_delay).await;
                    }
                }
                Err(error) => {
                    total.fetched += batch_len;
                    total.appended += created;
                    total.duplicates += held;
                    tracing::warn!(queue = inner.queue, %error, "acknowledging failed");
                    pause(&shutdown, inner.fetch_wait).await;
                }
            }
        }
        self.close().await;
        total
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

    /// Publishes an unreadable message to the dead-letter exchange and waits for the broker's
    /// confirmation.
    async fn dead_letter(
        &self,
        session: &mut Session,
        delivery: &Delivery,
        reason: &str,
    ) -> Result<(), BoxError> {
        let inner = &self.inner;
        let (exchange, routing_key) = inner.dead_letter.as_ref().ok_or(
            "no dead-letter exchange is set (`RabbitConsumerBuilder::dead_letter_exchange`)",
        )?;
        let channel = match &session.dead_letter {
            Some(channel) if channel.status().connected() => channel.clone(),
            _ => {
                let channel = session.connection.create_channel().await?;
                channel
                    .confirm_select(ConfirmSelectOptions::default())
                    .await?;
                session.dead_letter = Some(channel.clone());
                channel
            }
        };
        let mut headers = delivery.properties.headers().clone().unwrap_or_default();
        headers.insert(DEAD_LETTER_REASON_HEADER.into(), wire::header_text(reason));
        headers.insert(DEAD_LETTER_QUEUE_HEADER.into(), wire::text(&inner.queue));
        headers.insert(
            DEAD_LETTER_ROUTING_KEY_HEADER.into(),
            wire::text(delivery.routing_key.as_str()),
        );
        let properties = delivery
            .properties
            .clone()
            .with_headers(headers)
            .with_delivery_mode(PERSISTENT);
        let publish = async {
            let confirm = channel
                .basic_publish(
                    exchange.as_str().into(),
                    routing_key.as_str().into(),
                    BasicPublishOptions {
                        mandatory: true,
                        ..BasicPublishOptions::default()
                    },
                    &delivery.data,
                    properties,
                )
                .await?;
            confirm.await
        };
        match tokio::time::timeout(DEAD_LETTER_CONFIRM_TIMEOUT, publish).await {
            Ok(Ok(Confirmation::Ack(None))) => Ok(()),
            Ok(Ok(Confirmation::Ack(Some(_)) | Confirmation::Nack(Some(_)))) => Err(format!(
                "the dead-letter exchange {exchange:?} routes nothing for {routing_key:?}; \
                 bind a queue to it"
            )
            .into()),
            Ok(Ok(_)) => Err("the broker refused the dead letter".into()),
            Ok(Err(error)) => Err(error.into()),
            Err(_) => Err(format!(
                "the broker did not confirm the dead letter within {DEAD_LETTER_CONFIRM_TIMEOUT:?}"
            )
            .into()),
        }
    }
}

/// Waits `wait`, or less when `shutdown` is cancelled.
async fn pause(shutdown: &CancellationToken, wait: Duration) {
    tokio::select! {
        () = shutdown.cancelled() => {}
        () = tokio::time::sleep(wait) => {}
    }
}

/// Builds a [`RabbitConsumer`]; made by [`RabbitConsumer::builder`].
#[must_use]
pub struct RabbitConsumerBuilder {
    uri: String,
    queue: String,
    batch_size: usize,
    fetch_wait: Duration,
    retry_delay: Duration,
    connect_timeout: Duration,
    dead_letter: Option<(String, String)>,
    connection_properties: Option<ConnectionProperties>,
}

impl fmt::Debug for RabbitConsumerBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RabbitConsumerBuilder")
            .field("queue", &self.queue)
            .field("batch_size", &self.batch_size)
            .field("fetch_wait", &self.fetch_wait)
            .field("retry_delay", &self.retry_delay)
            .field("connect_timeout", &self.connect_timeout)
            .field("dead_letter", &self.dead_letter)
            .finish_non_exhaustive()
    }
}

impl RabbitConsumerBuilder {
    /// How many messages one batch takes at most, 64 by default (1 to 1,000). It is also the
    /// channel's prefetch (`basic.qos`): the broker sends no more than that many messages
    /// ahead of their acknowledgements.
    pub fn batch_size(mut self, size: usize) -> Self {
        self.batch_size = size;
        self
    }

    /// How long a fetch waits for a first message when none is there, 1 second by default
    /// (10 ms to 1 minute). [`run`](RabbitConsumer::run) notices its shutdown token within it,
    /// and waits as long after a failed fetch before connecting again.
    pub fn fetch_wait(mut self, wait: Duration) -> Self {
        self.fetch_wait = wait;
        self
    }

    /// How long [`run`](RabbitConsumer::run) waits, after a batch whose appends failed, before
    /// it fetches the messages again, 5 seconds by default (at most 1 hour).
    pub fn retry_delay(mut self, delay: Duration) -> Self {
        self.retry_delay = delay;
        self
    }

    /// How long opening a connection may take, 10 seconds by default (1 ms to 10 minutes).
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// Where messages that are not relaybus events, or fail to decode, go: published to
    /// `exchange` with `routing_key` (body and properties as they came, with
    /// [`DEAD_LETTER_REASON_HEADER`] and the queue and
    /// routing key they came with), confirmed by the broker, then acknowledged. Bind a queue
    /// to it, or the dead letter is refused as unroutable. Without it, or when that publish
    /// fails, they are rejected without requeue and the reason is logged at error level.
    pub fn dead_letter_exchange(
        mut self,
        exchange: impl Into<String>,
        routing_key: impl Into<String>,
    ) -> Self {
        self.dead_letter = Some((exchange.into(), routing_key.into()));
        self
    }

    /// The client's connection settings (a connection name, client properties, an
    /// authentication provider). Leave lapin's own recovery off: the consumer opens a new
    /// connection itself when one is lost.
    pub fn connection_properties(mut self, properties: ConnectionProperties) -> Self {
        self.connection_properties = Some(properties);
        self
    }

    /// Validates the settings, connects, and starts consuming the queue.
    ///
    /// # Errors
    ///
    /// [`RabbitError::InvalidConfiguration`] for a URI that does not parse, an empty queue
    /// name, a dead-letter exchange name that cannot be one, or a setting out of range;
    /// [`RabbitError::Connect`] when the broker cannot be reached; [`RabbitError::Setup`]
    /// when the queue does not exist.
    pub async fn build(self) -> Result<RabbitConsumer, RabbitError> {
        check_name("queue", &self.queue, false)?;
        if let Some((exchange, routing_key)) = &self.dead_letter {
            check_name("dead_letter_exchange", exchange, true)?;
            check_name("dead_letter_exchange", routing_key, true)?;
        }
        if !(1..=MAX_BATCH_SIZE).contains(&self.batch_size) {
            return Err(RabbitError::invalid(
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
            return Err(RabbitError::invalid(
                "fetch_wait",
                format!(
                    "{:?} is out of range; use 10 ms to 1 minute",
                    self.fetch_wait
                ),
            ));
        }
        if self.retry_delay > Duration::from_secs(3_600) {
            return Err(RabbitError::invalid(
                "retry_delay",
                format!("{:?} is over an hour; use at most 1 hour", self.retry_delay),
            ));
        }
        if !in_range(
            self.connect_timeout,
            Duration::from_millis(1),
            Duration::from_secs(600),
        ) {
            return Err(RabbitError::invalid(
                "connect_timeout",
                format!(
                    "{:?} is out of range; use 1 ms to 10 minutes",
                    self.connect_timeout
                ),
            ));
        }
        let endpoint = Endpoint::parse(
            &self.uri,
            self.connection_properties,
            format!("relaybus consumer {}", self.queue),
            self.connect_timeout,
        )?;
        let consumer = RabbitConsumer {
            inner: Arc::new(ConsumerInner {
                endpoint,
                queue: self.queue,
                batch_size: self.batch_size,
                fetch_wait: self.fetch_wait,
                retry_delay: self.retry_delay,
                dead_letter: self.dead_letter,
                session: Arc::new(Mutex::new(None)),
                connections: AtomicU64::new(0),
            }),
        };
        let session = consumer.open().await?;
        *consumer.inner.session.lock().await = Some(session);
        Ok(consumer)
    }
}

/// Messages taken from the broker by [`RabbitConsumer::fetch`], not yet appended. Dropping it
/// gives them back: the consumer closes its channel before its next fetch, and the broker puts
/// them back in the queue.
#[must_use = "a fetched batch is given back to the broker unless appended and acknowledged"]
pub struct InboundBatch {
    consumer: RabbitConsumer,
    session: Option<OwnedMutexGuard<Option<Session>>>,
    deliveries: Vec<Delivery>,
}

impl fmt::Debug for InboundBatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("InboundBatch")
            .field("messages", &self.deliveries.len())
            .finish_non_exhaustive()
    }
}

impl Drop for InboundBatch {
    fn drop(&mut self) {
        give_back(&mut self.session, !self.deliveries.is_empty());
    }
}

/// Marks the session of a batch dropped unsettled, so that the next fetch reopens it and the
/// broker requeues the batch.
fn give_back(session: &mut Option<OwnedMutexGuard<Option<Session>>>, unsettled: bool) {
    if unsettled
        && let Some(guard) = session.as_mut()
        && let Some(session) = guard.as_mut()
    {
        session.reopen = true;
    }
}

impl InboundBatch {
    /// How many messages the batch holds.
    pub fn len(&self) -> usize {
        self.deliveries.len()
    }

    /// Whether the fetch found nothing.
    pub fn is_empty(&self) -> bool {
        self.deliveries.is_empty()
    }

    /// How many of the batch's messages the broker marked as redelivered (delivered before,
    /// and not acknowledged).
    pub fn redelivered(&self) -> usize {
        self.deliveries.iter().filter(|d| d.redelivered).count()
    }

    /// Reads the batch's events and appends them, in queue order, in one transaction of
    /// `bus`'s store ([`RelayBus::publish_all`]), with their original ids, keys, headers and
    /// creation times, and with the deliveries of `bus`'s handlers. An event the store holds
    /// already adds nothing (but the deliveries of handlers new to it).
    ///
    /// Messages that are not relaybus events are set aside for the dead-letter exchange. When
    /// the transaction fails, the events are appended one at a time, in order: an event the
    /// store refuses for good (an invalid or oversized event) is set aside for the dead-letter
    /// exchange too, and from the first one that fails otherwise (the store is unreachable),
    /// that event and every one after it are given back to the broker, so that a key's events
    /// are never appended out of order.
    ///
    /// Nothing is acknowledged yet: call [`AppendedBatch::ack`].
    pub async fn append<S: Store>(mut self, bus: &RelayBus<S>) -> AppendedBatch {
        let deliveries = std::mem::take(&mut self.deliveries);
        let (fates, last_error) =
            inbound::append(bus, deliveries.iter().map(|d| d.data.as_slice())).await;
        AppendedBatch {
            consumer: self.consumer.clone(),
            session: self.session.take(),
            items: deliveries.into_iter().zip(fates).collect(),
            last_error,
        }
    }
}

/// A batch appended to the local store, not yet acknowledged to the broker. Dropping it gives
/// the messages back: the consumer closes its channel before its next fetch, the broker puts
/// them back in the queue, and appending them again adds nothing.
#[must_use = "an appended batch is given back to the broker unless acknowledged"]
pub struct AppendedBatch {
    consumer: RabbitConsumer,
    session: Option<OwnedMutexGuard<Option<Session>>>,
    items: Vec<(Delivery, Fate)>,
    last_error: Option<String>,
}

impl fmt::Debug for AppendedBatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AppendedBatch")
            .field("messages", &self.items.len())
            .field("last_error", &self.last_error)
            .finish_non_exhaustive()
    }
}

impl Drop for AppendedBatch {
    fn drop(&mut self) {
        give_back(&mut self.session, !self.items.is_empty());
    }
}

/// How a message is settled with the broker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Settle {
    /// `basic.ack`.
    Ack,
    /// `basic.nack` with requeue: delivered again.
    Requeue,
    /// `basic.nack` without requeue: dropped, or dead-lettered by the queue's own policy.
    Reject,
}

impl AppendedBatch {
    /// The events appended (or found held already), in queue order.
    pub fn appended(&self) -> impl Iterator<Item = &Appended> {
        self.items.iter().filter_map(|(_, fate)| match fate {
            Fate::Appended(appended) => Some(appended),
            _ => None,
        })
    }

    /// Settles every message with the broker, in queue order: acknowledges the appended
    /// ones; publishes the unreadable ones to the dead-letter exchange and acknowledges them
    /// (or rejects them without requeue when that is impossible); gives back, with a requeue,
    /// those whose append failed. Consecutive messages settled alike are settled with one
    /// `multiple` acknowledgement. After giving messages back, the consumer closes its channel
    /// before the next fetch, so what the broker had sent ahead goes back too and the queue
    /// keeps its order.
    ///
    /// # Errors
    ///
    /// [`RabbitError::Ack`] when the acknowledgements could not be sent (the connection was
    /// lost); the broker then puts those messages back in the queue, and appending them again
    /// adds nothing.
    pub async fn ack(mut self) -> Result<BatchReport, RabbitError> {
        let items = std::mem::take(&mut self.items);
        let mut report = BatchReport {
            fetched: items.len(),
            last_error: self.last_error.take(),
            ..BatchReport::default()
        };
        let Some(mut guard) = self.session.take() else {
            return Ok(report);
        };
        let Some(session) = guard.as_mut() else {
            return Err(RabbitError::Ack {
                count: items.len(),
                source: "the connection was closed".into(),
            });
        };
        let mut run: Option<(Settle, u64)> = None;
        let mut settled = 0;
        let mut failure: Option<BoxError> = None;
        for (at, (delivery, fate)) in items.iter().enumerate() {
            let settle = match fate {
                Fate::Appended(appended) => {
                    if appended.created {
                        report.appended += 1;
                    } else {
                        report.duplicates += 1;
                    }
                    Settle::Ack
                }
                Fate::Retry | Fate::Decoded(_) => {
                    report.retried += 1;
                    Settle::Requeue
                }
                Fate::Unreadable(reason) => {
                    match self.consumer.dead_letter(session, delivery, reason).await {
                        Ok(()) => {
                            report.dead_lettered += 1;
                            Settle::Ack
                        }
                        Err(error) => {
                            tracing::error!(
                                queue = self.consumer.inner.queue,
                                reason,
                                %error,
                                "an unreadable message could not be dead-lettered; rejecting it"
                            );
                            report.rejected += 1;
                            Settle::Reject
                        }
                    }
                }
            };
            match &mut run {
                Some((kind, tag)) if *kind == settle => *tag = delivery.delivery_tag,
                _ => {
                    if let Some((kind, tag)) = run.take() {
                        if let Err(error) = settle_up_to(&session.channel, kind, tag).await {
                            failure = Some(error.into());
                            break;
                        }
                        settled = at;
                    }
                    run = Some((settle, delivery.delivery_tag));
                }
            }
        }
        if failure.is_none()
            && let Some((kind, tag)) = run
        {
            match settle_up_to(&session.channel, kind, tag).await {
                Ok(()) => settled = items.len(),
                Err(error) => failure = Some(error.into()),
            }
        }
        if report.retried > 0 || failure.is_some() {
            session.reopen = true;
        }
        match failure {
            Some(source) => Err(RabbitError::Ack {
                count: items.len() - settled,
                source,
            }),
            None => Ok(report),
        }
    }
}

/// Settles every unsettled message of the channel up to `tag` (`multiple`): the batch's
/// earlier messages are settled already, and the later ones have greater tags.
async fn settle_up_to(channel: &Channel, kind: Settle, tag: u64) -> Result<(), lapin::Error> {
    match kind {
        Settle::Ack => {
            channel
                .basic_ack(tag, BasicAckOptions { multiple: true })
                .await
        }
        Settle::Requeue | Settle::Reject => {
            channel
                .basic_nack(
                    tag,
                    BasicNackOptions {
                        multiple: true,
                        requeue: kind == Settle::Requeue,
                    },
                )
                .await
        }
    }
}
