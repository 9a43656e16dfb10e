//! The outbound relay: a subscription that forwards events to a JetStream subject.

use std::{
    fmt,
    sync::{Arc, atomic::Ordering},
    time::Duration,
};

use async_nats::jetstream::{self, message::PublishMessage, publish::PublishAck};

use super::{NatsError, error::check_subject, wire};
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
pub const DEFAULT_RELAY_HANDLER_ID: &str = "nats-relay";

/// Forwards events to a JetStream stream: each [`subscription`](Self::subscription) is a
/// subscription of the bus, so every event of its type gets a delivery of its own, with the
/// bus's retries, backoff, dead letters and requeue, and the delivery completes only once
/// JetStream confirmed the publish.
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
/// use relaybus::transport::nats::{NatsRelay, async_nats};
///
/// # async fn example<S: Store>(store: S) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// let client = async_nats::connect("nats://127.0.0.1:4222").await?;
/// let jetstream = async_nats::jetstream::new(client);
///
/// let relay = NatsRelay::builder(jetstream.clone(), "orders.events")
///     .handler_id("relay-nats")
///     .partitions(16)
///     .build()?;
/// // A stream that captures `orders.events.>`, with a two-minute duplicate window.
/// jetstream.get_or_create_stream(relay.stream_config("ORDERS")).await?;
///
/// let bus = RelayBus::builder(store)
///     .subscribe(relay.subscription::<OrderPlaced, S>()?)
///     .build()?;
/// bus.start().await?;
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct NatsRelay {
    inner: Arc<RelayInner>,
}

struct RelayInner {
    jetstream: jetstream::Context,
    prefix: String,
    settings: RelaySettings,
    ack_timeout: Duration,
    expected_stream: Option<String>,
    counters: Counters,
}

impl fmt::Debug for NatsRelay {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NatsRelay")
            .field("prefix", &self.inner.prefix)
            .field("settings", &self.inner.settings)
            .field("ack_timeout", &self.inner.ack_timeout)
            .field("expected_stream", &self.inner.expected_stream)
            .finish_non_exhaustive()
    }
}

impl NatsRelay {
    /// Starts building a relay that publishes through `jetstream` to subjects under `prefix`
    /// (`<prefix>.<partition>`).
    pub fn builder(jetstream: jetstream::Context, prefix: impl Into<String>) -> NatsRelayBuilder {
        NatsRelayBuilder {
            jetstream,
            prefix: prefix.into(),
            settings: RelaySettings::new(DEFAULT_RELAY_HANDLER_ID),
            ack_timeout: Duration::from_secs(10),
            expected_stream: None,
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
    /// [`NatsError::InvalidConfiguration`] when the handler id and the type name together
    /// make an invalid handler id (over 128 bytes): choose a shorter
    /// [`handler_id`](NatsRelayBuilder::handler_id).
    pub fn subscription<E: Event, S: Store>(&self) -> Result<Subscription, NatsError> {
        Ok(relay::subscription::<E, S, _>(self)?)
    }

    /// Publishes one event and waits for JetStream's confirmation: what the relay's
    /// subscriptions do for each delivery. `sequence` is the event's sequence within its key
    /// in the publishing store, carried in the message for information.
    ///
    /// Sending an event twice is safe within the stream's duplicate window: the second
    /// confirmation has [`duplicate`](PublishAck::duplicate) set, and the stream keeps one
    /// message.
    ///
    /// # Errors
    ///
    /// [`NatsError::Publish`] when the publish was refused or not confirmed (no stream
    /// captures the subject, the connection is down); [`NatsError::AckTimeout`] when no
    /// confirmation came within the [`ack_timeout`](NatsRelayBuilder::ack_timeout).
    ///
    /// # Cancel safety
    ///
    /// Not cancel safe in the sense that a cancelled call may have published the message:
    /// sending it again is deduplicated by the stream.
    pub async fn send(
        &self,
        envelope: &EventEnvelope,
        sequence: Option<i64>,
    ) -> Result<PublishAck, NatsError> {
        let inner = &self.inner;
        let subject = self.subject_of(envelope);
        let failed = |source: BoxError| NatsError::Publish {
            event_id: envelope.id().to_owned(),
            subject: subject.clone(),
            source,
        };
        let headers = wire::headers(envelope).map_err(|reason| failed(reason.into()))?;
        let mut message = PublishMessage::build()
            .payload(wire::encode(envelope, sequence).into())
            .headers(headers);
        if let Some(stream) = &inner.expected_stream {
            message = message.expected_stream(stream);
        }
        let publish = async {
            let pending = inner
                .jetstream
                .send_publish(subject.clone(), message)
                .await
                .map_err(|error| failed(error.into()))?;
            pending.await.map_err(|error| failed(error.into()))
        };
        let ack = tokio::time::timeout(inner.ack_timeout, publish)
            .await
            .map_err(|_| NatsError::AckTimeout {
                event_id: envelope.id().to_owned(),
                subject: subject.clone(),
                after: inner.ack_timeout,
            })??;
        inner.counters.published(ack.duplicate);
        if ack.duplicate {
            tracing::debug!(
                event_id = envelope.id(),
                subject,
                stream = ack.stream,
                "JetStream already held the event; kept one copy"
            );
        }
        Ok(ack)
    }

    /// The subject an event goes to: `<prefix>.<partition>`, where the partition is the 32-bit
    /// FNV-1a hash of the event's key (of its id when it has none) modulo the number of
    /// [`partitions`](NatsRelayBuilder::partitions).
    pub fn subject_of(&self, envelope: &EventEnvelope) -> String {
        wire::subject(&self.inner.prefix, self.inner.settings.partitions, envelope)
    }

    /// The subjects a stream must capture for this relay: `<prefix>.>`.
    pub fn subjects(&self) -> String {
        format!("{}.>", self.inner.prefix)
    }

    /// A stream configuration for this relay: named `name`, capturing [`subjects`](Self::subjects),
    /// on file storage, with a two-minute duplicate window (JetStream's default). Change what
    /// you need before creating it; keep the duplicate window longer than a relay's retries of
    /// one event take, since the stream only drops copies within it.
    pub fn stream_config(&self, name: impl Into<String>) -> jetstream::stream::Config {
        jetstream::stream::Config {
            name: name.into(),
            subjects: vec![self.subjects()],
            duplicate_window: Duration::from_secs(120),
            ..Default::default()
        }
    }

    /// What this relay sent so far.
    pub fn statistics(&self) -> RelayStatistics {
        let client = self.inner.jetstream.client();
        let connects = client.statistics().connects.load(Ordering::Relaxed);
        self.inner.counters.statistics(Some(connects))
    }

    /// The subject prefix.
    pub fn prefix(&self) -> &str {
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

impl Outbound for NatsRelay {
    fn settings(&self) -> &RelaySettings {
        &self.inner.settings
    }

    async fn forward(
        &self,
        envelope: EventEnvelope,
        sequence: Option<i64>,
    ) -> Result<(), BoxError> {
        self.send(&envelope, sequence).await?;
        Ok(())
    }
}

/// Builds a [`NatsRelay`]; made by [`NatsRelay::builder`].
#[must_use]
pub struct NatsRelayBuilder {
    jetstream: jetstream::Context,
    prefix: String,
    settings: RelaySettings,
    ack_timeout: Duration,
    expected_stream: Option<String>,
}

impl fmt::Debug for NatsRelayBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NatsRelayBuilder")
            .field("prefix", &self.prefix)
            .field("settings", &self.settings)
            .field("ack_timeout", &self.ack_timeout)
            .field("expected_stream", &self.expected_stream)
            .finish_non_exhaustive()
    }
}

impl NatsRelayBuilder {
    /// The prefix of the relay's handler ids, [`DEFAULT_RELAY_HANDLER_ID`] by default: the
    /// subscription of type `T` has the id `<handler_id>:<T>`. Handler ids key stored
    /// deliveries, so keep it stable, and give each relay of one bus its own.
    pub fn handler_id(mut self, id: impl Into<String>) -> Self {
        self.settings.handler_id = id.into();
        self
    }

    /// How many subjects keys are spread over, 1 by default (1 to 1,024): events go to
    /// `<prefix>.<partition>`, one key always to the same partition, so consumers can split a
    /// stream by partition and each still sees its keys in order. Changing it moves keys to
    /// other partitions: events of a key published before and after the change may then be
    /// read out of order by consumers that read one partition each.
    pub fn partitions(mut self, partitions: u32) -> Self {
        self.settings.partitions = partitions;
        self
    }

    /// How long a publish may wait for JetStream's confirmation before its attempt fails,
    /// 10 seconds by default (1 ms to 10 minutes). Keep the bus's lease duration above it.
    pub fn ack_timeout(mut self, timeout: Duration) -> Self {
        self.ack_timeout = timeout;
        self
    }

    /// Makes JetStream refuse a publish unless the stream that captures the subject is named
    /// `stream` (`Nats-Expected-Stream`), so that events never land in another stream by a
    /// subject overlap.
    pub fn expected_stream(mut self, stream: impl Into<String>) -> Self {
        self.expected_stream = Some(stream.into());
        self
    }

    /// Validates the settings and builds the relay. Makes no server call.
    ///
    /// # Errors
    ///
    /// [`NatsError::InvalidConfiguration`] for a prefix that is not a literal subject, a
    /// number of partitions or an ack timeout out of range, an invalid handler id or an
    /// empty expected stream name.
    pub fn build(self) -> Result<NatsRelay, NatsError> {
        check_subject("prefix", &self.prefix)?;
        self.settings.check(&[("ack_timeout", self.ack_timeout)])?;
        if let Some(stream) = &self.expected_stream
            && (stream.is_empty() || stream.contains(['.', '*', '>', ' ']))
        {
            return Err(NatsError::invalid(
                "expected_stream",
                format!(
                    "{stream:?} is not a stream name; give the name of the stream that captures \
                     the relay's subjects"
                ),
            ));
        }
        Ok(NatsRelay {
            inner: Arc::new(RelayInner {
                jetstream: self.jetstream,
                prefix: self.prefix,
                settings: self.settings,
                ack_timeout: self.ack_timeout,
                expected_stream: self.expected_stream,
                counters: Counters::default(),
            }),
        })
    }
}
