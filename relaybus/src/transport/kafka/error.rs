//! The errors of the Kafka transport.

use std::time::Duration;

use crate::{error::BoxError, transport::settings::InvalidSetting};

/// An error of the Kafka transport: a relay's produce, a consumer's fetch or append, a topic
/// that cannot be used, or a setting that cannot work.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum KafkaError {
    /// A relay or consumer setting cannot work: an empty topic or consumer name, a number of
    /// partitions or a timeout out of range, a handler id too long for the event type. Raised
    /// by the builders' `build` and by [`KafkaRelay::subscription`](super::KafkaRelay::subscription),
    /// before anything is sent.
    #[error("invalid Kafka transport setting `{option}`: {reason}")]
    InvalidConfiguration {
        /// The setting.
        option: &'static str,
        /// What is wrong with it and what to do.
        reason: String,
    },

    /// A topic could not be created, listed or reached: the broker is unreachable, or the topic
    /// does not exist (create it first, with [`KafkaRelay::create_topic`](super::KafkaRelay::create_topic)
    /// or the broker's tools).
    #[error(
        "Kafka topic {topic:?}: {what} failed: {source}; check that the broker is reachable and the topic exists"
    )]
    Topic {
        /// The topic.
        topic: String,
        /// What was attempted.
        what: &'static str,
        /// The client's error.
        #[source]
        source: BoxError,
    },

    /// The partition leader refused a relay's produce or the connection failed. The delivery's
    /// attempt fails and the bus retries it.
    #[error(
        "producing event {event_id:?} to {topic:?} partition {partition} failed: {source}; check \
         that the topic exists with enough partitions and that the broker is reachable"
    )]
    Produce {
        /// The event id.
        event_id: String,
        /// The topic.
        topic: String,
        /// The partition.
        partition: u32,
        /// The client's error.
        #[source]
        source: BoxError,
    },

    /// The partition leader did not acknowledge a relay's produce within the relay's
    /// [`produce_timeout`](super::KafkaRelayBuilder::produce_timeout). The record may still be
    /// written: the retry produces it again, and consumers append it once.
    #[error(
        "no acknowledgement for event {event_id:?} on {topic:?} partition {partition} within \
         {after:?}; the delivery is retried, and consumers deduplicate by event id"
    )]
    ProduceTimeout {
        /// The event id.
        event_id: String,
        /// The topic.
        topic: String,
        /// The partition.
        partition: u32,
        /// How long the relay waited.
        after: Duration,
    },

    /// A consumer could not fetch records: the broker is unreachable, did not answer within the
    /// [`fetch_timeout`](super::KafkaConsumerBuilder::fetch_timeout), or refused the offset.
    /// Nothing was appended; the consumer fetches again from its stored position.
    #[error("fetching {topic:?} partition {partition} from offset {offset} failed: {source}")]
    Fetch {
        /// The topic.
        topic: String,
        /// The partition.
        partition: u32,
        /// The offset asked for.
        offset: i64,
        /// The client's error.
        #[source]
        source: BoxError,
    },

    /// A consumer could not read its stored position (the local store is unreachable, say)
    /// before a fetch. Nothing was taken; the consumer tries again. A batch whose append fails
    /// is no error: its records are counted in [`BatchReport::retried`](crate::transport::BatchReport::retried)
    /// and taken again from the stored position.
    #[error(
        "reading the stored position of {topic:?} partition {partition} failed: {source}; \
         nothing was taken, and the consumer tries again"
    )]
    Position {
        /// The topic.
        topic: String,
        /// The partition.
        partition: u32,
        /// The store's error.
        #[source]
        source: crate::Error,
    },
}

impl KafkaError {
    pub(crate) fn invalid(option: &'static str, reason: impl Into<String>) -> Self {
        KafkaError::InvalidConfiguration {
            option,
            reason: reason.into(),
        }
    }
}

impl From<InvalidSetting> for KafkaError {
    fn from(invalid: InvalidSetting) -> Self {
        KafkaError::invalid(invalid.option, invalid.reason)
    }
}

/// Checks a topic name the way Kafka does: 1 to 249 characters of ASCII letters, digits, `.`,
/// `_` and `-`, and neither `.` nor `..`.
pub(crate) fn check_topic(option: &'static str, topic: &str) -> Result<(), KafkaError> {
    let reason = if topic.is_empty() {
        Some("it is empty")
    } else if topic.len() > 249 {
        Some("it is longer than 249 characters")
    } else if topic == "." || topic == ".." {
        Some("`.` and `..` are not topic names")
    } else if !topic
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
    {
        Some("use ASCII letters, digits, `.`, `_` and `-` only")
    } else {
        None
    };
    match reason {
        Some(reason) => Err(KafkaError::invalid(
            option,
            format!("{topic:?} is not a Kafka topic name: {reason}"),
        )),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn topics() {
        for good in ["orders", "orders.events", "a-b_c.0"] {
            assert!(check_topic("topic", good).is_ok(), "{good}");
        }
        for bad in ["", ".", "..", "a b", "a/b", "é", &"a".repeat(250)] {
            let error = check_topic("topic", bad).unwrap_err();
            assert!(error.to_string().contains("`topic`"), "{error}");
        }
    }
}
