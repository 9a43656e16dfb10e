//! What every relay is, whatever its broker: one subscription per event type, under the
//! handler id `<handler_id>:<type>`, whose deliveries send the event to the broker and complete
//! once the broker confirmed it; the settings every relay has (the handler id prefix, the
//! partitions keys are spread over), and its counts. Each broker supplies its [`Target`]: how
//! an event is sent there.

mod builder;
mod statistics;

use std::{fmt, future::Future, sync::Arc};

pub use builder::RelayBuilder;
pub(crate) use statistics::Counters;
pub use statistics::RelayStatistics;

use super::{
    forward::Forwarded,
    settings::{InvalidSetting, RelaySettings},
};
use crate::{
    error::BoxError,
    event::{Event, EventEnvelope},
    handler::{HandlerContext, Subscription, validate_handler_id},
    store::Store,
};

/// Where a relay sends events: a broker's side of a relay (a JetStream stream's subjects, a
/// RabbitMQ exchange, a Kafka topic). Sealed: only this crate implements it.
pub trait Target: fmt::Debug + Send + Sync + Sized + 'static {
    /// The transport's error.
    type Error: std::error::Error + Send + Sync + 'static + From<InvalidSetting>;

    /// Sends one event and waits for the broker's confirmation: what each delivery of the
    /// relay's subscriptions does.
    fn forward(
        relay: &Relay<Self>,
        envelope: EventEnvelope,
        sequence: Option<i64>,
    ) -> impl Future<Output = Result<(), Self::Error>> + Send;

    /// The connections the client opened, when it counts them itself.
    fn connections(&self) -> Option<u64> {
        None
    }
}

/// Forwards events to a broker: each [`subscription`](Self::subscription) is a subscription of
/// the bus, so every event of its type gets a delivery of its own, with the bus's retries,
/// backoff, dead letters and requeue, and the delivery completes only once the broker
/// confirmed the event. A key's deliveries run one at a time, in the key's order, so the
/// broker receives a key's events in order.
///
/// Each transport names its relay: [`NatsRelay`](crate::transport::nats::NatsRelay),
/// [`RabbitRelay`](crate::transport::rabbitmq::RabbitRelay) and
/// [`KafkaRelay`](crate::transport::kafka::KafkaRelay), where their builders, their sends and
/// what they write are described.
///
/// Cheap to clone; clones share the connection and the [statistics](Self::statistics).
pub struct Relay<T: Target> {
    inner: Arc<Shared<T>>,
}

struct Shared<T> {
    settings: RelaySettings,
    counters: Counters,
    target: T,
}

impl<T: Target> Clone for Relay<T> {
    fn clone(&self) -> Self {
        Relay {
            inner: Arc::clone(&self.inner),
        }
    }
}

impl<T: Target> fmt::Debug for Relay<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Relay")
            .field("target", &self.inner.target)
            .field("handler_id", &self.inner.settings.handler_id)
            .field("partitions", &self.inner.settings.partitions)
            .finish_non_exhaustive()
    }
}

impl<T: Target> Relay<T> {
    /// A relay of checked settings to `target`.
    pub(crate) fn new(settings: RelaySettings, target: T) -> Self {
        Relay {
            inner: Arc::new(Shared {
                settings,
                counters: Counters::default(),
                target,
            }),
        }
    }

    /// Where the relay sends.
    pub(crate) fn target(&self) -> &T {
        &self.inner.target
    }

    /// The counts behind the relay's [statistics](Self::statistics).
    pub(crate) fn counters(&self) -> &Counters {
        &self.inner.counters
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
    /// The transport's `InvalidConfiguration` error when the handler id and the type name
    /// together make an invalid handler id (over 128 bytes): choose a shorter handler id for
    /// the relay (its builder's `handler_id`).
    pub fn subscription<E: Event, S: Store>(&self) -> Result<Subscription, T::Error> {
        let id = format!("{}:{}", self.inner.settings.handler_id, E::TYPE);
        validate_handler_id(&id).map_err(|error| {
            InvalidSetting::new(
                "handler_id",
                format!("{error}; choose a shorter handler id for the relay"),
            )
        })?;
        let relay = self.clone();
        Ok(Subscription::new(
            id,
            move |event: Forwarded<E>, context: HandlerContext<S>| {
                let relay = relay.clone();
                async move {
                    let envelope = event.envelope(&context);
                    T::forward(&relay, envelope, context.sequence())
                        .await
                        .map_err(BoxError::from)
                }
            },
        ))
    }

    /// What this relay sent so far.
    pub fn statistics(&self) -> RelayStatistics {
        self.inner
            .counters
            .statistics(self.inner.target.connections())
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
