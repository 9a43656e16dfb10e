//! The settings of a [`RabbitConsumer`], checked before it connects.

use std::{
    fmt,
    sync::{Arc, atomic::AtomicU64},
    time::Duration,
};

use lapin::ConnectionProperties;
use tokio::sync::Mutex;

use super::{
    RabbitError,
    connection::Endpoint,
    consumer::{ConsumerInner, MAX_BATCH_SIZE, RabbitConsumer},
    error::check_name,
};

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
    /// [`DEAD_LETTER_REASON_HEADER`](super::DEAD_LETTER_REASON_HEADER) and the queue and
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
