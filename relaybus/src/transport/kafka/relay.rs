//! The outbound relay: a subscription that produces events to a Kafka topic.

use std::{
    collections::HashMap,
    fmt,
    sync::{Arc, Mutex},
    time::Duration,
};

use rskafka::client::{
    Client,
    error::{Error as ClientError, ProtocolError},
    partition::{Compression, PartitionClient, UnknownTopicHandling},
};

use super::{KafkaError, error::check_topic, wire};
use crate::{
    error::BoxError,
    event::EventEnvelope,
    transport::relay::{Relay, RelayBuilder, Target},
};

/// The handler id prefix a relay uses unless told otherwise.
pub const DEFAULT_RELAY_HANDLER_ID: &str = "kafka-relay";

/// A [`Relay`] to a Kafka topic: each delivery of its [`subscription`](Self::subscription)s
/// produces the event to its partition and completes only once the partition leader
/// acknowledged the produce (rskafka produces with `acks = -1`: all in-sync replicas).
///
/// Cheap to clone; clones share the client, the partition connections and the
/// [statistics](Self::statistics).
///
/// See the [module documentation](super) for the record format, the partitioning and the
/// guarantees.
///
/// # Example
///
/// ```no_run
/// # use relaybus::{Event, RelayBus, Store};
/// # #[derive(serde::Serialize, serde::Deserialize)]
/// # struct OrderPlaced { order_id: String }
/// # impl Event for OrderPlaced { const TYPE: &'static str = "order.placed.v1"; }
/// use std::sync::Arc;
/// use relaybus::transport::kafka::{KafkaRelay, rskafka};
///
/// # async fn example<S: Store>(store: S) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// let client = rskafka::client::ClientBuilder::new(vec!["127.0.0.1:9092".to_owned()])
///     .build()
///     .await?;
/// let relay = KafkaRelay::builder(Arc::new(client), "orders.events")
///     .handler_id("relay-kafka")
///     .partitions(16)
///     .build()?;
/// relay.create_topic(1).await?; // 16 partitions, replication factor 1
///
/// let bus = RelayBus::builder(store)
///     .subscribe(relay.subscription::<OrderPlaced, S>()?)
///     .build()?;
/// bus.start().await?;
/// # Ok(())
/// # }
/// ```
pub type KafkaRelay = Relay<KafkaTarget>;

/// Builds a [`KafkaRelay`]; made by [`KafkaRelay::builder`].
pub type KafkaRelayBuilder = RelayBuilder<KafkaTarget>;

/// Where a [`KafkaRelay`] produces: a topic, through one connection per partition leader.
pub struct KafkaTarget {
    client: Arc<Client>,
    topic: String,
    produce_timeout: Duration,
    connections: Mutex<HashMap<u32, Arc<PartitionClient>>>,
}

impl fmt::Debug for KafkaTarget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KafkaTarget")
            .field("topic", &self.topic)
            .field("produce_timeout", &self.produce_timeout)
            .finish_non_exhaustive()
    }
}

impl Target for KafkaTarget {
    type Error = KafkaError;

    async fn forward(
        relay: &KafkaRelay,
        envelope: EventEnvelope,
        sequence: Option<i64>,
    ) -> Result<(), KafkaError> {
        relay.send(&envelope, sequence).await?;
        Ok(())
    }
}

impl KafkaRelay {
    /// Starts building a relay that produces through `client` to `topic`.
    pub fn builder(client: Arc<Client>, topic: impl Into<String>) -> KafkaRelayBuilder {
        RelayBuilder::new(
            DEFAULT_RELAY_HANDLER_ID,
            KafkaTarget {
                client,
                topic: topic.into(),
                produce_timeout: Duration::from_secs(10),
                connections: Mutex::new(HashMap::new()),
            },
        )
    }

    /// Produces one event to its partition and waits for the partition leader's
    /// acknowledgement (`acks = -1`): what the relay's subscriptions do for each delivery.
    /// Returns the record's offset. `sequence` is the event's sequence within its key in the
    /// publishing store, carried in the record for information.
    ///
    /// Sending an event twice writes two records (rskafka has no idempotent producer);
    /// consumers append the event once.
    ///
    /// # Errors
    ///
    /// [`KafkaError::Produce`] when the produce was refused or the connection failed (no such
    /// topic or partition, the broker is down); [`KafkaError::ProduceTimeout`] when no
    /// acknowledgement came within the [`produce_timeout`](KafkaRelayBuilder::produce_timeout).
    ///
    /// # Cancel safety
    ///
    /// A cancelled call may have written the record: producing it again writes a second copy,
    /// which consumers append once.
    pub async fn send(
        &self,
        envelope: &EventEnvelope,
        sequence: Option<i64>,
    ) -> Result<i64, KafkaError> {
        let target = self.target();
        let partition = self.partition_of(envelope);
        let failed = |source: BoxError| KafkaError::Produce {
            event_id: envelope.id().to_owned(),
            topic: target.topic.clone(),
            partition,
            source,
        };
        let record = wire::record(envelope, sequence);
        let produce = async {
            let connection = self.connection(partition).await.map_err(failed)?;
            let result = connection
                .produce(vec![record], Compression::NoCompression)
                .await;
            if result.is_err() {
                self.forget(partition);
            }
            result.map_err(|error| failed(error.into()))
        };
        let offsets = match tokio::time::timeout(target.produce_timeout, produce).await {
            Ok(result) => result?,
            Err(_) => {
                self.forget(partition);
                return Err(KafkaError::ProduceTimeout {
                    event_id: envelope.id().to_owned(),
                    topic: target.topic.clone(),
                    partition,
                    after: target.produce_timeout,
                });
            }
        };
        self.counters().published(false);
        offsets
            .first()
            .copied()
            .ok_or_else(|| failed("the broker acknowledged no record".into()))
    }

    /// The connection to a partition's leader, made on first use and kept.
    async fn connection(&self, partition: u32) -> Result<Arc<PartitionClient>, BoxError> {
        let cached = self
            .target()
            .connections
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&partition)
            .cloned();
        if let Some(connection) = cached {
            return Ok(connection);
        }
        let connection = Arc::new(
            partition_client(&self.target().client, &self.target().topic, partition)
                .await
                .map_err(BoxError::from)?,
        );
        self.counters().connected();
        self.target()
            .connections
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(partition, Arc::clone(&connection));
        Ok(connection)
    }

    /// Drops a partition's connection after a failure, so the next produce looks the leader
    /// up again.
    fn forget(&self, partition: u32) {
        self.target()
            .connections
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&partition);
    }

    /// The partition an event goes to: the 32-bit FNV-1a hash of the event's key (of its id
    /// when it has none) modulo the number of [`partitions`](KafkaRelayBuilder::partitions).
    pub fn partition_of(&self, envelope: &EventEnvelope) -> u32 {
        wire::partition(self.partitions(), envelope)
    }

    /// Creates the relay's topic with its number of partitions and `replication_factor`; a
    /// topic that exists already is left as it is (Kafka cannot change a topic's partitions
    /// here: give a new topic a new name).
    ///
    /// # Errors
    ///
    /// [`KafkaError::Topic`] when the broker refused or could not be reached.
    pub async fn create_topic(&self, replication_factor: i16) -> Result<(), KafkaError> {
        create_topic(
            &self.target().client,
            &self.target().topic,
            self.partitions(),
            replication_factor,
        )
        .await
    }

    /// The topic.
    pub fn topic(&self) -> &str {
        &self.target().topic
    }
}

/// A client of one partition of `topic`, refusing a topic that does not exist rather than
/// waiting for it.
pub(crate) async fn partition_client(
    client: &Client,
    topic: &str,
    partition: u32,
) -> Result<PartitionClient, ClientError> {
    let partition = i32::try_from(partition).unwrap_or(i32::MAX);
    client
        .partition_client(topic, partition, UnknownTopicHandling::Error)
        .await
}

/// Creates `topic` with `partitions` partitions; one that exists already is fine.
pub(crate) async fn create_topic(
    client: &Client,
    topic: &str,
    partitions: u32,
    replication_factor: i16,
) -> Result<(), KafkaError> {
    let failed = |source: BoxError| KafkaError::Topic {
        topic: topic.to_owned(),
        what: "creating it",
        source,
    };
    let controller = client
        .controller_client()
        .map_err(|error| failed(error.into()))?;
    let partitions = i32::try_from(partitions).unwrap_or(i32::MAX);
    match controller
        .create_topic(topic, partitions, replication_factor, 10_000)
        .await
    {
        Ok(()) => Ok(()),
        Err(ClientError::ServerError {
            protocol_error: ProtocolError::TopicAlreadyExists,
            ..
        }) => Ok(()),
        Err(error) => Err(failed(error.into())),
    }
}

impl KafkaRelayBuilder {
    /// How long a produce may wait for the partition leader's acknowledgement before its
    /// attempt fails, 10 seconds by default (1 ms to 10 minutes). rskafka retries a failed
    /// request by itself; this bounds the whole. Keep the bus's lease duration above it.
    pub fn produce_timeout(mut self, timeout: Duration) -> Self {
        self.options.produce_timeout = timeout;
        self
    }

    /// Validates the settings and builds the relay. Makes no broker call.
    ///
    /// # Errors
    ///
    /// [`KafkaError::InvalidConfiguration`] for an invalid topic name, a number of partitions
    /// or a produce timeout out of range, or an invalid handler id.
    pub fn build(self) -> Result<KafkaRelay, KafkaError> {
        check_topic("topic", &self.options.topic)?;
        self.settings
            .check(&[("produce_timeout", self.options.produce_timeout)])?;
        Ok(Relay::new(self.settings, self.options))
    }
}
