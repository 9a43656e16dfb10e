//! The NATS side of the message format: the JSON envelope in the body (shared by every
//! transport, see [`crate::transport::wire`]), a few NATS headers for the server and for tools,
//! and the routing of events to subjects.

use async_nats::{HeaderMap, HeaderValue, header::NATS_MESSAGE_ID};

pub use crate::transport::wire::FORMAT_VERSION;
pub(crate) use crate::transport::wire::encode;
use crate::{
    event::EventEnvelope,
    transport::wire::{self, partition},
};

/// The NATS header with the event type name (for tools and filters; the consumer reads the
/// body).
pub const EVENT_TYPE_HEADER: &str = "Relaybus-Event-Type";
/// The NATS header with the event id (for tools; `Nats-Msg-Id` carries it too).
pub const EVENT_ID_HEADER: &str = "Relaybus-Event-Id";
/// The NATS header of a dead-lettered message that says why it was dead-lettered.
pub const DEAD_LETTER_REASON_HEADER: &str = "Relaybus-Dead-Letter-Reason";
/// The NATS header of a dead-lettered message with the subject it was taken from.
pub const DEAD_LETTER_SUBJECT_HEADER: &str = "Relaybus-Dead-Letter-Subject";
/// The NATS header of a dead-lettered message with its stream and stream sequence, as
/// `<stream>:<sequence>`.
pub const DEAD_LETTER_SOURCE_HEADER: &str = "Relaybus-Dead-Letter-Source";

/// The NATS headers of the message of an event: `Nats-Msg-Id` (the server deduplicates on it
/// within the stream's duplicate window), the event id and the type.
pub(crate) fn headers(envelope: &EventEnvelope) -> Result<HeaderMap, String> {
    let value = |text: &str| {
        text.parse::<HeaderValue>()
            .map_err(|_| format!("{text:?} cannot be a NATS header value"))
    };
    let mut headers = HeaderMap::new();
    headers.insert(NATS_MESSAGE_ID, value(envelope.id())?);
    headers.insert(EVENT_ID_HEADER, value(envelope.id())?);
    headers.insert(EVENT_TYPE_HEADER, value(envelope.event_type())?);
    headers.insert("Content-Type", value("application/json")?);
    Ok(headers)
}

/// The subject of an event: `<prefix>.<bucket>`, the bucket being the 32-bit FNV-1a hash of
/// the key (of the id for an unkeyed event) modulo `partitions`. One key always goes to one
/// subject.
pub(crate) fn subject(prefix: &str, partitions: u32, envelope: &EventEnvelope) -> String {
    format!("{prefix}.{}", partition(partitions, envelope))
}

/// A header value made of free text (an error message): control characters become spaces, and
/// it is cut at 1024 bytes.
pub(crate) fn header_text(text: &str) -> HeaderValue {
    // Without `\r` and `\n` the value is valid.
    wire::header_text(text).parse().unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::wire::sample_envelope;

    #[test]
    fn one_key_one_subject() {
        let e = sample_envelope();
        let first = subject("orders", 16, &e);
        assert!(first.starts_with("orders."));
        for _ in 0..3 {
            let again = e.clone().with_id(uuid::Uuid::now_v7().to_string()).unwrap();
            assert_eq!(subject("orders", 16, &again), first);
        }
        assert_eq!(subject("orders", 1, &e), "orders.0");
    }

    #[test]
    fn header_text_is_always_valid() {
        assert_eq!(header_text("a\r\nb").as_str(), "a  b");
        assert_eq!(header_text(&"é".repeat(600)).as_str().len(), 1024);
    }
}
