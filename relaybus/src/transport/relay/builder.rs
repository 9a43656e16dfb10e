//! Building a relay: the settings every relay has, and the broker's own (`O`).

use std::fmt;

use crate::transport::settings::RelaySettings;

/// Builds a [`Relay`](super::Relay): the settings every relay has, here, and the broker's own
/// with its builder ([`NatsRelayBuilder`](crate::transport::nats::NatsRelayBuilder),
/// [`RabbitRelayBuilder`](crate::transport::rabbitmq::RabbitRelayBuilder),
/// [`KafkaRelayBuilder`](crate::transport::kafka::KafkaRelayBuilder)), which also validates
/// them in `build()`.
#[must_use]
pub struct RelayBuilder<O> {
    pub(crate) settings: RelaySettings,
    pub(crate) options: O,
}

impl<O: fmt::Debug> fmt::Debug for RelayBuilder<O> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RelayBuilder")
            .field("options", &self.options)
            .field("handler_id", &self.settings.handler_id)
            .field("partitions", &self.settings.partitions)
            .finish()
    }
}

impl<O> RelayBuilder<O> {
    /// One partition, the broker's default handler id prefix, and its own `options`.
    pub(crate) fn new(handler_id: &str, options: O) -> Self {
        RelayBuilder {
            settings: RelaySettings::new(handler_id),
            options,
        }
    }

    /// The prefix of the relay's handler ids, the transport's `DEFAULT_RELAY_HANDLER_ID` by
    /// default: the subscription of type `T` has the id `<handler_id>:<T>`. Handler ids key
    /// stored deliveries, so keep it stable, and give each relay of one bus its own.
    pub fn handler_id(mut self, id: impl Into<String>) -> Self {
        self.settings.handler_id = id.into();
        self
    }

    /// How many partitions keys are spread over, 1 by default (1 to 1,024): a NATS relay's
    /// subjects `<prefix>.<partition>`, a RabbitMQ relay's routing keys (and queues)
    /// `<prefix>.<partition>`, a Kafka relay's partitions of the topic (give the topic's
    /// number of partitions). One key always goes to the same partition, so consumers that
    /// read one partition each still see their keys in order. Changing it moves keys to other
    /// partitions: events of a key sent before and after the change may then be read out of
    /// order.
    pub fn partitions(mut self, partitions: u32) -> Self {
        self.settings.partitions = partitions;
        self
    }
}
