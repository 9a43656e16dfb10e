//! The errors of the RabbitMQ transport.

use std::time::Duration;

use crate::{error::BoxError, transport::settings::InvalidSetting};

/// An error of the RabbitMQ transport: a relay's publish, a consumer's connection, consume or
/// acknowledgement, or a setting that cannot work.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RabbitError {
    /// A relay or consumer setting cannot work: a URI that does not parse, an empty exchange
    /// or queue name, a batch size of 0, a handler id too long for the event type, and so on.
    /// Raised by the builders' `build` and by
    /// [`RabbitRelay::subscription`](super::RabbitRelay::subscription), before anything is
    /// sent.
    #[error("invalid RabbitMQ transport setting `{option}`: {reason}")]
    InvalidConfiguration {
        /// The setting.
        option: &'static str,
        /// What is wrong with it and what to do.
        reason: String,
    },

    /// The broker could not be reached, refused the credentials or the virtual host, or would
    /// not open a channel. A relay's delivery attempt fails (the bus retries it, and the relay
    /// connects again then); a consumer's [`run`](super::RabbitConsumer::run) tries again
    /// after its fetch wait.
    #[error(
        "could not connect to RabbitMQ at {endpoint}: {source}; check that the broker is \
         reachable and that the URI's credentials and virtual host are right (the user needs \
         permissions on the virtual host: `rabbitmqctl set_permissions`)"
    )]
    Connect {
        /// The broker's host, port and virtual host (without the credentials).
        endpoint: String,
        /// The client's error.
        #[source]
        source: lapin::Error,
    },

    /// Declaring the relay's topology or starting to consume a queue failed: the queue does
    /// not exist, or an exchange or queue of that name exists with other settings.
    #[error(
        "could not set up {what}: {source}; declare the relay's exchange and queues first (see \
         `RabbitRelay::declare_topology`), or delete the existing one made with other settings"
    )]
    Setup {
        /// What was being set up, such as `the queue "orders.0"`.
        what: String,
        /// The client's error.
        #[source]
        source: lapin::Error,
    },

    /// A relay's publish could not be sent or its confirmation was lost (the connection or the
    /// channel closed, the exchange does not exist). The delivery's attempt fails and the bus
    /// retries it; the relay opens a new connection for the retry.
    #[error(
        "publishing event {event_id:?} to exchange {exchange:?} with routing key \
         {routing_key:?} failed: {source}; check that the exchange exists (see \
         `RabbitRelay::declare_topology`) and that the broker is reachable"
    )]
    Publish {
        /// The event id.
        event_id: String,
        /// The exchange it was sent to.
        exchange: String,
        /// The routing key.
        routing_key: String,
        /// The client's error.
        #[source]
        source: BoxError,
    },

    /// The broker returned a relay's message as unroutable: no queue is bound to the exchange
    /// with its routing key, so the message would have been dropped. The attempt fails and the
    /// bus retries it.
    #[error(
        "no queue takes event {event_id:?}: exchange {exchange:?} routes nothing for routing \
         key {routing_key:?}; declare and bind the relay's queues (see \
         `RabbitRelay::declare_topology` and `RabbitRelay::routing_keys`)"
    )]
    Unroutable {
        /// The event id.
        event_id: String,
        /// The exchange it was sent to.
        exchange: String,
        /// The routing key.
        routing_key: String,
    },

    /// The broker negatively confirmed a relay's publish (an internal error, or a queue at its
    /// length limit with `x-overflow: reject-publish`). The attempt fails and the bus retries
    /// it.
    #[error(
        "RabbitMQ refused event {event_id:?} on exchange {exchange:?} with routing key \
         {routing_key:?} (a negative publisher confirm); check the queues' length limits and \
         the broker's logs"
    )]
    Nacked {
        /// The event id.
        event_id: String,
        /// The exchange it was sent to.
        exchange: String,
        /// The routing key.
        routing_key: String,
    },

    /// The broker did not confirm a relay's publish within the relay's
    /// [`confirm_timeout`](super::RabbitRelayBuilder::confirm_timeout). The message may still
    /// be in the queue: the retry sends it again, and the consumer's store keeps one copy.
    #[error(
        "RabbitMQ did not confirm event {event_id:?} with routing key {routing_key:?} within \
         {after:?}; the delivery is retried, and a second copy is deduplicated by the consumer"
    )]
    ConfirmTimeout {
        /// The event id.
        event_id: String,
        /// The routing key.
        routing_key: String,
        /// How long the relay waited.
        after: Duration,
    },

    /// The consumer lost its channel while waiting for messages (the connection closed, the
    /// queue was deleted). What it had not acknowledged goes back to the queue; the next
    /// [`fetch`](super::RabbitConsumer::fetch) connects again.
    #[error(
        "consuming queue {queue:?} failed: {source}; the next fetch connects again, and the \
         broker redelivers what was not acknowledged"
    )]
    Fetch {
        /// The queue.
        queue: String,
        /// The client's error.
        #[source]
        source: BoxError,
    },

    /// The consumer appended a batch but could not acknowledge (or dead-letter) it. Nothing is
    /// lost: the broker redelivers the messages once the channel closes, and appending them
    /// again adds nothing.
    #[error(
        "settling {count} message(s) with the broker failed: {source}; the broker redelivers \
         them, and appending them again adds nothing"
    )]
    Ack {
        /// How many messages were left unsettled.
        count: usize,
        /// The client's error.
        #[source]
        source: BoxError,
    },
}

impl RabbitError {
    pub(crate) fn invalid(option: &'static str, reason: impl Into<String>) -> Self {
        RabbitError::InvalidConfiguration {
            option,
            reason: reason.into(),
        }
    }
}

impl From<InvalidSetting> for RabbitError {
    fn from(invalid: InvalidSetting) -> Self {
        RabbitError::invalid(invalid.option, invalid.reason)
    }
}

/// Checks an exchange, queue or routing key name: not empty, at most 255 bytes (an AMQP short
/// string), no control character.
pub(crate) fn check_name(
    option: &'static str,
    name: &str,
    allow_empty: bool,
) -> Result<(), RabbitError> {
    let reason = if name.is_empty() && !allow_empty {
        Some("it is empty")
    } else if name.len() > 255 {
        Some("it is longer than 255 bytes, the most AMQP allows")
    } else if name.chars().any(char::is_control) {
        Some("it contains a control character")
    } else {
        None
    };
    match reason {
        Some(reason) => Err(RabbitError::invalid(
            option,
            format!("{name:?} cannot be used: {reason}"),
        )),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        for good in ["orders", "orders.events", "a-b_c.0"] {
            assert!(check_name("exchange", good, false).is_ok(), "{good}");
        }
        assert!(check_name("exchange", "", true).is_ok());
        for bad in ["", "a\nb", &"x".repeat(256)] {
            let error = check_name("exchange", bad, false).unwrap_err();
            assert!(error.to_string().contains("exchange"), "{error}");
        }
    }
}
