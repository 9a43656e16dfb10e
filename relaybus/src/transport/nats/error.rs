//! The errors of the NATS JetStream transport.

use std::time::Duration;

use crate::{error::BoxError, transport::settings::InvalidSetting};

/// An error of the NATS JetStream transport: a relay's publish, a consumer's setup, fetch or
/// acknowledgement, or a setting that cannot work.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum NatsError {
    /// A relay or consumer setting cannot work: an empty or wildcard subject prefix, a batch
    /// size of 0, a handler id too long for the event type, and so on. Raised by the builders'
    /// `build` and by [`NatsRelay::subscription`](super::NatsRelay::subscription), before
    /// anything is sent.
    #[error("invalid NATS transport setting `{option}`: {reason}")]
    InvalidConfiguration {
        /// The setting.
        option: &'static str,
        /// What is wrong with it and what to do.
        reason: String,
    },

    /// JetStream refused a relay's publish or did not confirm it: no stream captures the
    /// subject, the connection is down, the stream is full. The delivery's attempt fails and
    /// the bus retries it.
    #[error(
        "publishing event {event_id:?} to {subject:?} failed: {source}; check that a stream \
         captures the subject (see `NatsRelay::stream_config`) and that the server is reachable"
    )]
    Publish {
        /// The event id.
        event_id: String,
        /// The subject it was sent to.
        subject: String,
        /// The client's error.
        #[source]
        source: BoxError,
    },

    /// JetStream did not confirm a relay's publish within the relay's
    /// [`ack_timeout`](super::NatsRelayBuilder::ack_timeout). The message may still be stored:
    /// the retry carries the same `Nats-Msg-Id`, so the stream keeps one copy.
    #[error(
        "JetStream did not confirm event {event_id:?} on {subject:?} within {after:?}; the \
         delivery is retried with the same message id"
    )]
    AckTimeout {
        /// The event id.
        event_id: String,
        /// The subject it was sent to.
        subject: String,
        /// How long the relay waited.
        after: Duration,
    },

    /// The consumer could not be set up: the stream does not exist, or the server refused the
    /// durable consumer's configuration.
    #[error(
        "could not set up the durable consumer {durable:?} on stream {stream:?}: {source}; \
         create the stream first (its subjects must capture the relay's prefix, see \
         `NatsRelay::stream_config`), or delete a consumer of that name made with other settings"
    )]
    Setup {
        /// The stream.
        stream: String,
        /// The durable consumer's name.
        durable: String,
        /// The client's error.
        #[source]
        source: BoxError,
    },

    /// The consumer could not fetch messages: the connection is down or the consumer was
    /// deleted.
    #[error("fetching from the durable consumer {durable:?} failed: {source}")]
    Fetch {
        /// The durable consumer's name.
        durable: String,
        /// The client's error.
        #[source]
        source: BoxError,
    },

    /// The consumer appended a batch but could not acknowledge it. Nothing is lost: the broker
    /// redelivers the messages after the ack wait, and their appends add nothing.
    #[error(
        "acknowledging {count} message(s) failed: {source}; the broker redelivers them after \
         the ack wait, and appending them again adds nothing"
    )]
    Ack {
        /// How many messages were left unacknowledged.
        count: usize,
        /// The client's error.
        #[source]
        source: BoxError,
    },
}

impl NatsError {
    pub(crate) fn invalid(option: &'static str, reason: impl Into<String>) -> Self {
        NatsError::InvalidConfiguration {
            option,
            reason: reason.into(),
        }
    }
}

impl From<InvalidSetting> for NatsError {
    fn from(invalid: InvalidSetting) -> Self {
        NatsError::invalid(invalid.option, invalid.reason)
    }
}

/// Checks a subject or subject prefix to publish to: dot-separated tokens, none empty, no
/// wildcard, no whitespace or control character.
pub(crate) fn check_subject(option: &'static str, subject: &str) -> Result<(), NatsError> {
    let reason = if subject.is_empty() {
        Some("it is empty")
    } else if subject.split('.').any(str::is_empty) {
        Some("it has an empty token (a leading, trailing or doubled `.`)")
    } else if subject.split('.').any(|token| token == "*" || token == ">") {
        Some("it has a wildcard token (`*` or `>`); give a literal subject")
    } else if subject.chars().any(|c| c.is_whitespace() || c.is_control()) {
        Some("it contains whitespace or a control character")
    } else {
        None
    };
    match reason {
        Some(reason) => Err(NatsError::invalid(
            option,
            format!("{subject:?} is not a subject to publish to: {reason}"),
        )),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn subjects() {
        for good in ["orders", "orders.events", "a-b_c.0"] {
            assert!(check_subject("prefix", good).is_ok(), "{good}");
        }
        for bad in ["", ".a", "a.", "a..b", "a.*", "a.>", "a b", "a\nb"] {
            let error = check_subject("prefix", bad).unwrap_err();
            assert!(error.to_string().contains("prefix"), "{error}");
        }
    }
}
