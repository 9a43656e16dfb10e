//! Building a NATS or RabbitMQ consumer: the batch settings both have, and the broker's own
//! (`O`).

use std::{fmt, time::Duration};

use crate::transport::settings::BatchSettings;

/// Builds a [`Consumer`](super::Consumer): the batch settings every NATS and RabbitMQ
/// consumer has, here, and the broker's own with its builder
/// ([`NatsConsumerBuilder`](crate::transport::nats::NatsConsumerBuilder),
/// [`RabbitConsumerBuilder`](crate::transport::rabbitmq::RabbitConsumerBuilder)), which also
/// validates them in `build()`.
#[must_use]
pub struct ConsumerBuilder<O> {
    pub(crate) batch: BatchSettings,
    pub(crate) options: O,
}

impl<O: fmt::Debug> fmt::Debug for ConsumerBuilder<O> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ConsumerBuilder")
            .field("options", &self.options)
            .field("batch_size", &self.batch.batch_size)
            .field("fetch_wait", &self.batch.fetch_wait)
            .finish()
    }
}

impl<O> ConsumerBuilder<O> {
    /// The default batch settings, and the broker's own `options`.
    // The Kafka consumer reads partitions with a driver of its own; NATS and RabbitMQ use it.
    #[cfg(any(feature = "nats", feature = "rabbitmq"))]
    pub(crate) fn new(options: O) -> Self {
        ConsumerBuilder {
            batch: BatchSettings::default(),
            options,
        }
    }

    /// How many messages one batch takes at most, 64 by default (1 to
    /// [`MAX_BATCH_SIZE`](crate::transport::MAX_BATCH_SIZE)). It is also how many the broker
    /// lets the consumer hold unacknowledged (NATS: the durable consumer's limit of
    /// unacknowledged messages, so that messages waiting for redelivery are never overtaken
    /// by later ones; RabbitMQ: the channel's prefetch, `basic.qos`).
    pub fn batch_size(mut self, size: usize) -> Self {
        self.batch.batch_size = size;
        self
    }

    /// How long a fetch waits for a first message when none is there, 1 second by default
    /// (10 ms to 1 minute). [`run`](super::Consumer::run) notices its shutdown token within
    /// it, and waits as long after a failed fetch or acknowledgement before trying again.
    pub fn fetch_wait(mut self, wait: Duration) -> Self {
        self.batch.fetch_wait = wait;
        self
    }
}
