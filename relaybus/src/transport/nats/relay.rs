//! The outbound relay: a subscription that forwards events to a JetStream subject.

use std::{fmt, sync::atomic::Ordering, time::Duration};

use async_nats::jetstream::{self, message::PublishMessage, publish::PublishAck};

use super::{NatsError, error::check_subject, wire};
use crate::{
    error::BoxError,
    event::EventEnvelope,
    transport::relay::{Relay, RelayBuilder, Target},
};

/// The handler id prefix a relay uses unless told otherwise.
pub const DEFAULT_RELAY_HANDLER_ID: &str = "nats-relay";

/// A [`Relay`] to a JetStream stream: each delivery of its
/// [`subscription`](Self::subscription)s publishes the event to a subject of the stream and
/// completes only once JetStream confirmed the publish.
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
pub type NatsRelay = Relay<NatsTarget>;

/// Builds a [`NatsRelay`]; made by [`NatsRelay::builder`].
pub type NatsRelayBuilder = RelayBuilder<NatsTarget>;

/// Where a [`NatsRelay`] publishes: subjects of a JetStream stream, and how.
pub struct NatsTarget {
    jetstream: jetstream::Context,
    prefix: String,
    ack_timeout: Duration,
    expected_stream: Option<String>,
}

impl fmt::Debug for NatsTarget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NatsTarget")
            .field("prefix", &self.prefix)
            .field("ack_timeout", &self.ack_timeout)
            .field("expected_stream", &self.expected_stream)
            .finish_non_exhaustive()
    }
}

impl Target for NatsTarget {
    type Error = NatsError;

    async fn forward(
        relay: &NatsRelay,
        envelope: EventEnvelope,
        sequence: Option<i64>,
    ) -> Result<(), NatsError> {
        relay.send(&envelope, sequence).await?;
        Ok(())
    }

    fn connections(&self) -> Option<u64> {
        let statistics = self.jetstream.client().statistics();
        Some(statistics.connects.load(Ordering::Relaxed))
    }
}

impl NatsRelay {
    /// Starts building a relay that publishes through `jetstream` to subjects under `prefix`
    /// (`<prefix>.<partition>`).
    pub fn builder(jetstream: jetstream::Context, prefix: impl Into<String>) -> NatsRelayBuilder {
        RelayBuilder::new(
            DEFAULT_RELAY_HANDLER_ID,
            NatsTarget {
                jetstream,
                prefix: prefix.into(),
                ack_timeout: Duration::from_secs(10),
                expected_stream: None,
            },
        )
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
        let target = self.target();
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
        if let Some(stream) = &target.expected_stream {
            message = message.expected_stream(stream);
        }
        let publish = async {
            let pending = target
                .jetstream
                .send_publish(subject.clone(), message)
                .await
                .map_err(|error| failed(error.into()))?;
            pending.await.map_err(|error| failed(error.into()))
        };
        let ack = tokio::time::timeout(target.ack_timeout, publish)
            .await
            .map_err(|_| NatsError::AckTimeout {
                event_id: envelope.id().to_owned(),
                subject: subject.clone(),
                after: target.ack_timeout,
            })??;
        self.counters().published(ack.duplicate);
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
        wire::subject(&self.target().prefix, self.partitions(), envelope)
    }

    /// The subjects a stream must capture for this relay: `<prefix>.>`.
    pub fn subjects(&self) -> String {
        format!("{}.>", self.target().prefix)
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

    /// The subject prefix.
    pub fn prefix(&self) -> &str {
        &self.target().prefix
    }
}

impl NatsRelayBuilder {
    /// How long a publish may wait for JetStream's confirmation before its attempt fails,
    /// 10 seconds by default (1 ms to 10 minutes). Keep the bus's lease duration above it.
    pub fn ack_timeout(mut self, timeout: Duration) -> Self {
        self.options.ack_timeout = timeout;
        self
    }

    /// Makes JetStream refuse a publish unless the stream that captures the subject is named
    /// `stream` (`Nats-Expected-Stream`), so that events never land in another stream by a
    /// subject overlap.
    pub fn expected_stream(mut self, stream: impl Into<String>) -> Self {
        self.options.expected_stream = Some(stream.into());
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
        let target = &self.options;
        check_subject("prefix", &target.prefix)?;
        self.settings
            .check(&[("ack_timeout", target.ack_timeout)])?;
        if let Some(stream) = &target.expected_stream
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
        Ok(Relay::new(self.settings, self.options))
    }
}
