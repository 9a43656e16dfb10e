//! The outbound relay: a subscription that publishes events to an exchange, with publisher
//! confirms.

use std::{fmt, sync::Arc, time::Duration};

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
    event::{Event, EventEnvelope},
    handler::Subscription,
    store::Store,
    transport::{
        RelayStatistics,
        relay::{self, Counters, Outbound, RelaySettings},
    },
};

/// The handler id prefix a relay uses unless told otherwise.
pub const DEFAULT_RELAY_HANDLER_ID: &str = "rabbitmq-relay";

/// Publishes events to a RabbitMQ exchange: each [`subscription`](Self::subscription) is a
/// subscription of the bus, so every event of its type gets a delivery of its own, with the
/// bus's retries, backoff, dead letters and requeue, and the delivery completes only once the
/// broker confirmed the persistent message (publisher confirms).
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
#[derive(Clone)]
pub struct RabbitRelay {
    inner: Arc<RelayInner>,
}

struct RelayInner {
    endpoint: Endpoint,
    exchange: String,
    prefix: String,
    settings: RelaySettings,
    confirm_timeout: Duration,
    /// The connection and its confirm-mode channel, opened at the first publish and again
    /// after a loss.
    link: tokio::sync::Mutex<Option<Link>>,
    counters: Counters,
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

impl fmt::Debug for RabbitRelay {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RabbitRelay")
            .field("endpoint", &self.inner.endpoint)
            .field("exchange", &self.inner.exchange)
            .field("prefix", &self.inner.prefix)
            .field("settings", &self.inner.settings)
            .field("confirm_timeout", &self.inner.confirm_timeout)
            .finish_non_exhaustive()
    }
}

impl RabbitRelay {
    /// Starts building a relay that connects to `uri` (`amqp://user:password@host:5672/vhost`,
    /// the virtual host percent-encoded, `%2f` for `/`) and publishes to the exchange
    /// `exchange`, with the routing keys `<exchange>.<partition>` unless told otherwise.
    pub fn builder(uri: impl Into<String>, exchange: impl Into<String>) -> RabbitRelayBuilder {
        RabbitRelayBuilder {
            uri: uri.into(),
            exchange: exchange.into(),
            routing_prefix: None,
            settings: RelaySettings::new(DEFAULT_RELAY_HANDLER_ID),
            confirm_timeout: Duration::from_secs(10),
            connect_timeout: Duration::from_secs(10),
            connection_properties: None,
        }
    }

    /// The subscription that forwards every event of type `E` on a bus of store `S`, under the
    /// handler id `<handler_id>:<E::TYPE>` (one subscription per type, since a handler id
    /// names one subscription). Configure it further as any subscription (`.retry(..)`,
    /// `.timeout(..)`); leave it ordered to keep each key's order.
    ///
    /// The payload is forwarded as stored, fields that `E` does not know included.
    ///
    /// # Errors
    ///
    /// [`RabbitError::InvalidConfiguration`] when the handler id and the type name together
    /// make an invalid handler id (over 128 bytes): choose a shorter
    /// [`handler_id`](RabbitRelayBuilder::handler_id).
    pub fn subscription<E: Event, S: Store>(&self) -> Result<Subscription, RabbitError> {
        Ok(relay::subscription::<E, S, _>(self)?)
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
        let inner = &self.inner;
        let routing_key = self.routing_key_of(envelope);
        let failed = |source: BoxError| RabbitError::Publish {
            event_id: envelope.id().to_owned(),
            exchange: inner.exchange.clone(),
            routing_key: routing_key.clone(),
            source,
        };
        let channel = self.channel().await?;
        let body = wire::encode(envelope, sequence);
        let publish = async {
            let confirm = channel
                .basic_publish(
                    inner.exchange.as_str().into(),
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
        let confirmation = tokio::time::timeout(inner.confirm_timeout, publish)
            .await
            .map_err(|_| RabbitError::ConfirmTimeout {
                event_id: envelope.id().to_owned(),
                routing_key: routing_key.clone(),
                after: inner.confirm_timeout,
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
                inner.counters.published(false);
                Ok(())
            }
            Confirmation::Ack(Some(_)) | Confirmation::Nack(Some(_)) => {
                Err(RabbitError::Unroutable {
                    event_id: envelope.id().to_owned(),
                    exchange: inner.exchange.clone(),
                    routing_key,
                })
            }
            Confirmation::Nack(None) => Err(RabbitError::Nacked {
                event_id: envelope.id().to_owned(),
                exchange: inner.exchange.clone(),
                routing_key,
            }),
            Confirmation::NotRequested => Err(failed("the channel is not in confirm mode".into())),
        }
    }

    /// The relay's channel, opening a connection when there is none or the last one was lost.
    async fn channel(&self) -> Result<Channel, RabbitError> {
        let inner = &self.inner;
        let mut link = inner.link.lock().await;
        if let Some(open) = link.as_ref().filter(|open| open.is_open()) {
            return Ok(open.channel.clone());
        }
        if let Some(lost) = link.take() {
            close_quietly(&lost.connection, "relaybus relay reconnecting").await;
        }
        let connection = inner.endpoint.connect().await?;
        let channel = match connection.create_channel().await {
            Ok(channel) => channel,
            Err(error) => {
                close_quietly(&connection, "relaybus relay could not open a channel").await;
                return Err(inner.endpoint.failed(error));
            }
        };
        if let Err(error) = channel
            .confirm_select(ConfirmSelectOptions::default())
            .await
        {
            close_quietly(&connection, "relaybus relay could not select confirms").await;
            return Err(inner.endpoint.failed(error));
        }
        inner.counters.connected();
        tracing::debug!(endpoint = inner.endpoint.display(), "relay connected");
        *link = Some(Link {
            connection,
            channel: channel.clone(),
        });
        Ok(channel)
    }

    /// Drops the link when it is lost, so that the next publish connects again.
    async fn forget_lost(&self) {
        let mut link = self.inner.link.lock().await;
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
        let inner = &self.inner;
        let connection = inner.endpoint.connect().await?;
        let result = async {
            let channel = connection
                .create_channel()
                .await
                .map_err(|error| inner.endpoint.failed(error))?;
            let setup = |what: String| move |source| RabbitError::Setup { what, source };
            channel
                .exchange_declare(
                    inner.exchange.as_str().into(),
                    ExchangeKind::Direct,
                    ExchangeDeclareOptions {
                        durable: true,
                        ..ExchangeDeclareOptions::default()
                    },
                    FieldTable::default(),
                )
                .await
                .map_err(setup(format!("the exchange {:?}", inner.exchange)))?;
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
                        inner.exchange.as_str().into(),
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
        if let Some(link) = self.inner.link.lock().await.take() {
            close_quietly(&link.connection, "relaybus relay closed").await;
        }
    }

    /// The routing key an event goes to: `<prefix>.<partition>`, where the partition is the
    /// 32-bit FNV-1a hash of the event's key (of its id when it has none) modulo the number of
    /// [`partitions`](RabbitRelayBuilder::partitions).
    pub fn routing_key_of(&self, envelope: &EventEnvelope) -> String {
        wire::routing_key(&self.inner.prefix, self.inner.settings.partitions, envelope)
    }

    /// Every routing key the relay publishes with, partition 0 first:
    /// `<prefix>.0` to `<prefix>.<partitions - 1>`. [`declare_topology`](Self::declare_topology)
    /// names a queue after each.
    pub fn routing_keys(&self) -> Vec<String> {
        (0..self.inner.settings.partitions)
            .map(|partition| format!("{}.{partition}", self.inner.prefix))
            .collect()
    }

    /// What this relay did so far.
    pub fn statistics(&self) -> RelayStatistics {
        self.inner.counters.statistics(None)
    }

    /// The exchange.
    pub fn exchange(&self) -> &str {
        &self.inner.exchange
    }

    /// The routing key prefix.
    pub fn routing_prefix(&self) -> &str {
        &self.inner.prefix
    }

    /// The number of partitions keys are spread over.
    pub fn partitions(&self) -> u32 {
        self.inner.settings.partitions
    }

    /// The prefix of the relay's handler ids.
    pub fn handler_id(&self) -> &str {
        &self.inner.settings.handler_id
    }
}

impl Outbound for RabbitRelay {
    fn settings(&self) -> &RelaySettings {
        &self.inner.settings
    }

    async fn forward(
        &self,
        envelope: EventEnvelope,
        sequence: Option<i64>,
    ) -> Result<(), BoxError> {
        Ok(self.send(&envelope, sequence).await?)
    }
}

/// Builds a [`RabbitRelay`]; made by [`RabbitRelay::builder`].
#[must_use]
pub struct RabbitRelayBuilder {
    uri: String,
    exchange: String,
    routing_prefix: Option<String>,
    settings: RelaySettings,
    confirm_timeout: Duration,
    connect_timeout: Duration,
    connection_properties: Option<ConnectionProperties>,
}

impl fmt::Debug for RabbitRelayBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RabbitRelayBuilder")
            .field("exchange", &self.exchange)
            .field("routing_prefix", &self.routing_prefix)
            .field("settings", &self.settings)
            .field("confirm_timeout", &self.confirm_timeout)
            .field("connect_timeout", &self.connect_timeout)
            .finish_non_exhaustive()
    }
}

impl RabbitRelayBuilder {
    /// The prefix of the relay's handler ids, [`DEFAULT_RELAY_HANDLER_ID`] by default: the
    /// subscription of type `T` has the id `<handler_id>:<T>`. Handler ids key stored
    /// deliveries, so keep it stable, and give each relay of one bus its own.
    pub fn handler_id(mut self, id: impl Into<String>) -> Self {
        self.settings.handler_id = id.into();
        self
    }

    /// The prefix of the routing keys, `<prefix>.<partition>`; the exchange's name by default.
    pub fn routing_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.routing_prefix = Some(prefix.into());
        self
    }

    /// How many routing keys (and queues) keys are spread over, 1 by default (1 to 1,024):
    /// events go to `<prefix>.<partition>`, one key always to the same partition, and each
    /// partition's queue has one consumer, which sees its keys in order. Changing it moves
    /// keys to other partitions: events of a key published before and after the change may
    /// then be appended out of order.
    pub fn partitions(mut self, partitions: u32) -> Self {
        self.settings.partitions = partitions;
        self
    }

    /// How long a publish may wait for the broker's confirmation before its attempt fails,
    /// 10 seconds by default (1 ms to 10 minutes). Keep the bus's lease duration above it.
    pub fn confirm_timeout(mut self, timeout: Duration) -> Self {
        self.confirm_timeout = timeout;
        self
    }

    /// How long opening a connection may take, 10 seconds by default (1 ms to 10 minutes).
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// The client's connection settings (a connection name, client properties, an
    /// authentication provider). Leave lapin's own recovery off: the relay opens a new
    /// connection itself when one is lost.
    pub fn connection_properties(mut self, properties: ConnectionProperties) -> Self {
        self.connection_properties = Some(properties);
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
        check_name("exchange", &self.exchange, false)?;
        let prefix = self.routing_prefix.unwrap_or_else(|| self.exchange.clone());
        check_name("routing_prefix", &prefix, false)?;
        self.settings.check(&[
            ("confirm_timeout", self.confirm_timeout),
            ("connect_timeout", self.connect_timeout),
        ])?;
        // The longest routing key must fit in 255 bytes.
        check_name(
            "routing_prefix",
            &format!("{prefix}.{}", self.settings.partitions - 1),
            false,
        )?;
        let endpoint = Endpoint::parse(
            &self.uri,
            self.connection_properties,
            format!("relaybus relay {}", self.exchange),
            self.connect_timeout,
        )?;
        Ok(RabbitRelay {
            inner: Arc::new(RelayInner {
                endpoint,
                exchange: self.exchange,
                prefix,
                settings: self.settings,
                confirm_timeout: self.confirm_timeout,
                link: tokio::sync::Mutex::new(None),
                counters: Counters::default(),
            }),
        })
    }
}
