//! The settings of a [`RabbitConsumer`], checked before it connects.

use std::{
    fmt,
    sync::{Arc, atomic::AtomicU64},
    time::Duration,
};

use lapin::ConnectionProperties;
use tokio::sync::Mutex;

use crate::transport::{
    Consumer, ConsumerBuilder,
    settings::{check_delay, check_timeout},
};

use super::{
    RabbitError,
    connection::Endpoint,
    consumer::{ConsumerInner, RabbitConsumer, RabbitSource},
    error::check_name,
};

impl RabbitConsumer {
    /// Starts building a consumer that connects to `uri`
    /// (`amqp://user:password@host:5672/vhost`, the virtual host percent-encoded, `%2f` for
    /// `/`) and consumes the queue `queue`, such as one partition's queue of a
    /// [`RabbitRelay`](super::RabbitRelay) (`<prefix>.<partition>`).
    pub fn builder(uri: impl Into<String>, queue: impl Into<String>) -> RabbitConsumerBuilder {
        ConsumerBuilder::new(RabbitOptions {
            uri: uri.into(),
            queue: queue.into(),
            retry_delay: Duration::from_secs(5),
            connect_timeout: Duration::from_secs(10),
            dead_letter: None,
            connection_properties: None,
        })
    }
}

/// Builds a [`RabbitConsumer`]; made by [`RabbitConsumer::builder`].
pub type RabbitConsumerBuilder = ConsumerBuilder<RabbitOptions>;

/// The settings of a [`RabbitConsumer`] that only RabbitMQ has.
pub struct RabbitOptions {
    uri: String,
    queue: String,
    retry_delay: Duration,
    connect_timeout: Duration,
    dead_letter: Option<(String, String)>,
    connection_properties: Option<ConnectionProperties>,
}

impl fmt::Debug for RabbitOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RabbitOptions")
            .field("queue", &self.queue)
            .field("retry_delay", &self.retry_delay)
            .field("connect_timeout", &self.connect_timeout)
            .field("dead_letter", &self.dead_letter)
            .finish_non_exhaustive()
    }
}

impl RabbitConsumerBuilder {
    /// How long [`run`](crate::transport::Consumer::run) waits, after a batch whose appends failed, before
    /// it fetches the messages again, 5 seconds by default (at most 1 hour).
    pub fn retry_delay(mut self, delay: Duration) -> Self {
        self.options.retry_delay = delay;
        self
    }

    /// How long opening a connection may take, 10 seconds by default (1 ms to 10 minutes).
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.options.connect_timeout = timeout;
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
        self.options.dead_letter = Some((exchange.into(), routing_key.into()));
        self
    }

    /// The client's connection settings (a connection name, client properties, an
    /// authentication provider). Leave lapin's own recovery off: the consumer opens a new
    /// connection itself when one is lost.
    pub fn connection_properties(mut self, properties: ConnectionProperties) -> Self {
        self.options.connection_properties = Some(properties);
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
        let ConsumerBuilder { batch, options } = self;
        check_name("queue", &options.queue, false)?;
        if let Some((exchange, routing_key)) = &options.dead_letter {
            check_name("dead_letter_exchange", exchange, true)?;
            check_name("dead_letter_exchange", routing_key, true)?;
        }
        batch.check()?;
        check_delay("retry_delay", options.retry_delay)?;
        check_timeout("connect_timeout", options.connect_timeout)?;
        let endpoint = Endpoint::parse(
            &options.uri,
            options.connection_properties,
            format!("relaybus consumer {}", options.queue),
            options.connect_timeout,
        )?;
        let source = RabbitSource {
            inner: Arc::new(ConsumerInner {
                endpoint,
                queue: options.queue,
                batch,
                retry_delay: options.retry_delay,
                dead_letter: options.dead_letter,
                session: Arc::new(Mutex::new(None)),
                connections: AtomicU64::new(0),
            }),
        };
        let session = source.open().await?;
        *source.inner.session.lock().await = Some(session);
        Ok(Consumer::new(source))
    }
}
