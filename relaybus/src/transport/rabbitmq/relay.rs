//! The outbound relay: a subscription that publishes events to an exchange, with publisher
//! confirms.

use std::{fmt, time::Duration};

use lapin::{
    Channel, Confirmation, Connection, ConnectionProperties, ExchangeKind,
    options::{
        BasicPublishOptions, ConfirmSelectOptions, ExchangeDeclareOptions, QueueBindOptions,
        QueueDeclareOptions,
    },
    types::FieldTable,
};

use super::{
    RabbitError,
    connection::{Endpoint, close_quietly},
    error::check_name,
    wire,
};
use crate::{
    error::BoxError,
    event::EventEnvelope,
    transport::relay::{Relay, RelayBuilder, Target},
};

/// The handler id prefix a relay uses unless told otherwise.
pub const DEFAULT_RELAY_HANDLER_ID: &str = "rabbitmq-relay";

/// A [`Relay`] to a RabbitMQ exchange: each delivery of its
/// [`subscription`](Self::subscription)s publishes the event as a persistent message and
/// completes only once the broker confirmed it (publisher confirms).
///
/// The relay owns its connection and one channel in confirm mode, opened at the first
/// publish. When the connection is lost, the publishes in flight fail (their deliveries are
/// retried by the bus) and the next publish opens a new connection.
///
/// Cheap to clone; clones share the connection and the [statistics](Self::statistics).
///
/// See the [module documentation](super) for the message format, the routing and the
/// guarantees.
///
/// # Example
///
/// ```no_run
/// # use relaybus::{Event, RelayBus, Store};
/// # #[derive(serde::Serialize, serde::Deserialize)]
/// # struct OrderPlaced { order_id: String }
/// # impl Event for OrderPlaced { const TYPE: &'static str = "order.placed.v1"; }
/// use relaybus::transport::rabbitmq::RabbitRelay;
///
/// # async fn example<S: Store>(store: S) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// let relay = RabbitRelay::builder("amqp://guest:guest@127.0.0.1:5672/%2f", "orders")
///     .handler_id("relay-rabbitmq")
///     .partitions(4)
///     .build()?;
/// // The direct exchange `orders` and the durable queues `orders.0` to `orders.3`.
/// relay.declare_topology().await?;
///
/// let bus = RelayBus::builder(store)
///     .subscribe(relay.subscription::<OrderPlaced, S>()?)
///     .build()?;
/// bus.start().await?;
/// # Ok(())
/// # }
/// ```
pub type RabbitRelay = Relay<RabbitTarget>;

/// Builds a [`RabbitRelay`]; made by [`RabbitRelay::builder`].
pub type RabbitRelayBuilder = RelayBuilder<RabbitOptions>;

/// Where a [`RabbitRelay`] publishes: an exchange, on a connection of its own.
pub struct RabbitTarget {
    endpoint: Endpoint,
    exchange: String,
    prefix: String,
    confirm_timeout: Duration,
    /// The connection and its confirm-mode channel, opened at the first publish and again
    /// after a loss.
    link: tokio::sync::Mutex<Option<Link>>,
}

struct Link {
    connection: Connection,
    channel: Channel,
}

impl Link {
    fn is_open(&self) -> bool {
        self.connection.status().connected() && self.channel.status().connected()
    }
}

impl fmt::Debug for RabbitTarget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RabbitTarget")
            .field("endpoint", &self.endpoint)
            .field("exchange", &self.exchange)
            .field("prefix", &self.prefix)
            .field("confirm_timeout", &self.confirm_timeout)
            .finish_non_exhaustive()
    }
}

impl Target for RabbitTarget {
    type Error = RabbitError;

    async fn forward(
        relay: &RabbitRelay,
        envelope: EventEnvelope,
        sequence: Option<i64>,
    ) -> Result<(), RabbitError> {
        relay.send(&envelope, sequence).await
    }
}

/// The settings of a [`RabbitRelay`] that only RabbitMQ has.
pub struct RabbitOptions {
    uri: String,
    exchange: String,
    routing_prefix: Option<String>,
    confirm_timeout: Duration,
    connect_timeout: Duration,
    connection_properties: Option<ConnectionProperties>,
}

impl fmt::Debug for RabbitOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RabbitOptions")
            .field("exchange", &self.exchange)
            .field("routing_prefix", &self.routing_prefix)
            .field("confirm_timeout", &self.confirm_timeout)
            .field("connect_timeout", &self.connect_timeout)
            .finish_non_exhaustive()
    }
}

impl RabbitRelay {
    /// Starts building a relay that connects to `uri` (`amqp://user:password@host:5672/vhost`,
    /// the virtual host percent-encoded, `%2f` for `/`) and publishes to the exchange
    /// `exchange`, with the routing keys `<exchange>.<partition>` unless told otherwise.
    pub fn builder(uri: impl Into<String>, exchange: impl Into<String>) -> RabbitRelayBuilder {
        RelayBuilder::new(
            DEFAULT_RELAY_HANDLER_ID,
            RabbitOptions {
                uri: uri.into(),
                exchange: exchange.into(),
                routing_prefix: None,
                confirm_timeout: Duration::from_secs(10),
                connect_timeout: Duration::from_secs(10),
                connection_properties: None,
            },
        )
    }

    /// Publishes one event as a persistent, mandatory message and waits for the broker's
    /// confirmation: what the relay's subscriptions do for each delivery. `sequence` is the
    /// event's sequence within its key in the publishing store, carried in the message for
    /// information. Opens the connection first when there is none (or the last one was lost).
    ///
    /// Sending an event twice puts two copies in the queue; the consumer's store keeps one.
    ///
    /// # Errors
    ///
    /// - [`RabbitError::Connect`] when no connection could be opened;
    /// - [`RabbitError::Publish`] when the publish could not be sent or its confirmation was
    ///   lost (the connection closed, the exchange does not exist);
    /// - [`RabbitError::Unroutable`] when no queue is bound for the routing key;
    /// - [`RabbitError::Nacked`] when the broker refused the message;
    /// - [`RabbitError::ConfirmTimeout`] when no confirmation came within the
    ///   [`confirm_timeout`](RabbitRelayBuilder::confirm_timeout).
    ///
    /// # Cancel safety
    ///
    /// Not cancel safe in the sense that a cancelled call may have published the message:
    /// sending it again makes a second copy, which the consumer's store deduplicates.
    pub async fn send(
        &self,
        envelope: &EventEnvelope,
        sequence: Option<i64>,
    ) -> Result<(), RabbitError> {
        let target = self.target();
        let routing_key = self.routing_key_of(envelope);
        let failed = |source: BoxError| RabbitError::Publish {
            event_id: envelope.id().to_owned(),
            exchange: target.exchange.clone(),
            routing_key: routing_key.clone(),
            source,
        };
        let channel = self.channel().await?;
        let body = wire::encode(envelope, sequence);
        let publish = async {
            let confirm = channel
                .basic_publish(
                    target.exchange.as_str().into(),
                    routing_key.as_str().into(),
                    BasicPublishOptions {
                        mandatory: true,
                        ..BasicPublishOptions::default()
                    },
                    &body,
                    wire::properties(envelope),
                )
                .await
                .map_err(|error| failed(error.into()))?;
            confirm.await.map_err(|error| failed(error.into()))
        };
        let confirmation = tokio::time::timeout(target.confirm_timeout, publish)
            .await
            .map_err(|_| RabbitError::ConfirmTimeout {
                event_id: envelope.id().to_owned(),
                routing_key: routing_key.clone(),
                after: target.confirm_timeout,
            })
            .and_then(|confirmed| confirmed);
        let confirmation = match confirmation {
            Ok(confirmation) => confirmation,
            Err(error) => {
                if !channel.status().connected() {
                    self.forget_lost().await;
                }
                return Err(error);
            }
        };
        match confirmation {
            Confirmation::Ack(None) => {
                self.counters().published(false);
                Ok(())
            }
            Confirmation::Ack(Some(_)) | Confirmation::Nack(Some(_)) => {
                Err(RabbitError::Unroutable {
                    event_id: envelope.id().to_owned(),
                    exchange: target.exchange.clone(),
                    routing_key,
                })
            }
            Confirmation::Nack(None) => Err(RabbitError::Nacked {
                event_id: envelope.id().to_owned(),
                exchange: target.exchange.clone(),
                routing_key,
            }),
            Confirmation::NotRequested => Err(failed("the channel is not in confirm mode".into())),
        }
    }

    /// The relay's channel, opening a connection when there is none or the last one was lost.
    async fn channel(&self) -> Result<Channel, RabbitError> {
        let target = self.target();
        let mut link = target.link.lock().await;
        if let Some(open) = link.as_ref().filter(|open| open.is_open()) {
            return Ok(open.channel.clone());
        }
        if let Some(lost) = link.take() {
            close_quietly(&lost.connection, "relaybus relay reconnecting").await;
        }
        let connection = target.endpoint.connect().await?;
        let channel = match connection.create_channel().await {
            Ok(channel) => channel,
            Err(error) => {
                close_quietly(&connection, "relaybus relay could not open a channel").await;
                return Err(target.endpoint.failed(error));
            }
        };
        if let Err(error) = channel
            .confirm_select(ConfirmSelectOptions::default())
            .await
        {
            close_quietly(&connection, "relaybus relay could not select confirms").await;
            return Err(target.endpoint.failed(error));
        }
        self.counters().connected();
        tracing::debug!(endpoint = target.endpoint.display(), "relay connected");
        *link = Some(Link {
            connection,
            channel: channel.clone(),
        });
        Ok(channel)
    }

    /// Drops the link when it is lost, so that the next publish connects again.
    async fn forget_lost(&self) {
        let mut link = self.target().link.lock().await;
        if link.as_ref().is_some_and(|open| !open.is_open())
            && let Some(lost) = link.take()
        {
            close_quietly(&lost.connection, "relaybus relay reconnecting").await;
        }
    }

    /// Declares what the relay publishes to, on a connection of its own: the durable direct
    /// exchange, and for each partition a durable queue named after its routing key
    /// (`<prefix>.<partition>`), bound with it. Declaring what exists with the same settings
    /// does nothing, so every service may call it at start. Declare the queues yourself to
    /// give them arguments (a queue type, a length limit, a dead-letter exchange): bind each
    /// [routing key](Self::routing_keys) to one queue.
    ///
    /// # Errors
    ///
    /// [`RabbitError::Connect`] when the broker cannot be reached; [`RabbitError::Setup`] when
    /// an exchange or queue of the same name exists with other settings.
    pub async fn declare_topology(&self) -> Result<(), RabbitError> {
        let target = self.target();
        let connection = target.endpoint.connect().await?;
        let result = async {
            let channel = connection
                .create_channel()
                .await
                .map_err(|error| target.endpoint.failed(error))?;
            let setup = |what: String| move |source| RabbitError::Setup { what, source };
            channel
                .exchange_declare(
                    target.exchange.as_str().into(),
                    ExchangeKind::Direct,
                    ExchangeDeclareOptions {
                        durable: true,
                        ..ExchangeDeclareOptions::default()
                    },
                    FieldTable::default(),
                )
                .await
                .map_err(setup(format!("the exchange {:?}", target.exchange)))?;
            for key in self.routing_keys() {
                channel
                    .queue_declare(
                        key.as_str().into(),
                        QueueDeclareOptions {
                            durable: true,
                            ..QueueDeclareOptions::default()
                        },
                        FieldTable::default(),
                    )
                    .await
                    .map_err(setup(format!("the queue {key:?}")))?;
                channel
                    .queue_bind(
                        key.as_str().into(),
                        target.exchange.as_str().into(),
                        key.as_str().into(),
                        QueueBindOptions::default(),
                        FieldTable::default(),
                    )
                    .await
                    .map_err(setup(format!("the binding of the queue {key:?}")))?;
            }
            Ok(())
        }
        .await;
        close_quietly(&connection, "relaybus topology declared").await;
        result
    }

    /// Closes the relay's connection, if open. Publishes in flight fail; a later publish
    /// opens a new connection.
    pub async fn close(&self) {
        if let Some(link) = self.target().link.lock().await.take() {
            close_quietly(&link.connection, "relaybus relay closed").await;
        }
    }

    /// The routing key an event goes to: `<prefix>.<partition>`, where the partition is the
    /// 32-bit FNV-1a hash of the event's key (of its id when it has none) modulo the number of
    /// [`partitions`](RabbitRelayBuilder::partitions).
    pub fn routing_key_of(&self, envelope: &EventEnvelope) -> String {
        wire::routing_key(&self.target().prefix, self.partitions(), envelope)
    }

    /// Every routing key the relay publishes with, partition 0 first:
    /// `<prefix>.0` to `<prefix>.<partitions - 1>`. [`declare_topology`](Self::declare_topology)
    /// names a queue after each.
    pub fn routing_keys(&self) -> Vec<String> {
        (0..self.partitions())
            .map(|partition| format!("{}.{partition}", self.target().prefix))
            .collect()
    }

    /// The exchange.
    pub fn exchange(&self) -> &str {
        &self.target().exchange
    }

    /// The routing key prefix.
    pub fn routing_prefix(&self) -> &str {
        &self.target().prefix
    }
}

impl RabbitRelayBuilder {
    /// The prefix of the routing keys, `<prefix>.<partition>`; the exchange's name by default.
    pub fn routing_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.options.routing_prefix = Some(prefix.into());
        self
    }

    /// How long a publish may wait for the broker's confirmation before its attempt fails,
    /// 10 seconds by default (1 ms to 10 minutes). Keep the bus's lease duration above it.
    pub fn confirm_timeout(mut self, timeout: Duration) -> Self {
        self.options.confirm_timeout = timeout;
        self
    }

    /// How long opening a connection may take, 10 seconds by default (1 ms to 10 minutes).
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.options.connect_timeout = timeout;
        self
    }

    /// The client's connection settings (a connection name, client properties, an
    /// authentication provider). Leave lapin's own recovery off: the relay opens a new
    /// connection itself when one is lost.
    pub fn connection_properties(mut self, properties: ConnectionProperties) -> Self {
        self.options.connection_properties = Some(properties);
        self
    }

    /// Validates the settings and builds the relay. Makes no broker call: the connection is
    /// opened at the first publish (or by [`RabbitRelay::declare_topology`]).
    ///
    /// # Errors
    ///
    /// [`RabbitError::InvalidConfiguration`] for a URI that does not parse, an empty exchange
    /// name, a routing key prefix or exchange name too long, a number of partitions or a
    /// timeout out of range, or an invalid handler id.
    pub fn build(self) -> Result<RabbitRelay, RabbitError> {
        let options = self.options;
        check_name("exchange", &options.exchange, false)?;
        let prefix = options
            .routing_prefix
            .unwrap_or_else(|| options.exchange.clone());
        check_name("routing_prefix", &prefix, false)?;
        self.settings.check(&[
            ("confirm_timeout", options.confirm_timeout),
            ("connect_timeout", options.connect_timeout),
        ])?;
        // The longest routing key must fit in 255 bytes.
        check_name(
            "routing_prefix",
            &format!("{prefix}.{}", self.settings.partitions - 1),
            false,
        )?;
        let endpoint = Endpoint::parse(
            &options.uri,
            options.connection_properties,
            format!("relaybus relay {}", options.exchange),
            options.connect_timeout,
        )?;
        let target = RabbitTarget {
            endpoint,
            exchange: options.exchange,
            prefix,
            confirm_timeout: options.confirm_timeout,
            link: tokio::sync::Mutex::new(None),
        };
        Ok(Relay::new(self.settings, target))
    }
}
