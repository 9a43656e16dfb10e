//! The message body every transport writes and reads: a JSON envelope with the event's id,
//! type, key, sequence, correlation and causation ids, headers, creation time and payload;
//! and the partition an event is routed to.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::{event::EventEnvelope, time::Timestamp};

/// The version of the message format this crate writes and reads.
pub const FORMAT_VERSION: u32 = 1;

/// The body as written: borrows from the envelope.
#[derive(Serialize)]
struct Outgoing<'a> {
    relaybus: u32,
    id: &'a str,
    #[serde(rename = "type")]
    event_type: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    key: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    sequence: Option<i64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    correlation_id: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    causation_id: Option<&'a str>,
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    headers: &'a BTreeMap<String, String>,
    created_at: String,
    payload: &'a serde_json::Map<String, serde_json::Value>,
}

/// The body as read. Unknown fields are ignored, so that a later minor addition does not
/// dead-letter messages.
#[derive(Deserialize)]
struct Incoming {
    id: String,
    #[serde(rename = "type")]
    event_type: String,
    #[serde(default)]
    key: Option<String>,
    #[serde(default)]
    sequence: Option<i64>,
    #[serde(default)]
    correlation_id: Option<String>,
    #[serde(default)]
    causation_id: Option<String>,
    #[serde(default)]
    headers: BTreeMap<String, String>,
    created_at: String,
    payload: serde_json::Value,
}

/// An event read back from a message: the envelope as it was published, and the sequence it
/// had within its key in the publishing store.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Decoded {
    pub(crate) envelope: EventEnvelope,
    /// The event's sequence within its key in the publishing store (informational: the local
    /// store numbers the key's events itself, in broker order).
    #[allow(dead_code)]
    pub(crate) source_sequence: Option<i64>,
}

/// The body of the message of an event.
pub(crate) fn encode(envelope: &EventEnvelope, sequence: Option<i64>) -> Vec<u8> {
    let body = Outgoing {
        relaybus: FORMAT_VERSION,
        id: envelope.id(),
        event_type: envelope.event_type(),
        key: envelope.key(),
        sequence,
        correlation_id: envelope.correlation_id(),
        causation_id: envelope.causation_id(),
        headers: envelope.headers(),
        created_at: envelope.created_at().to_string(),
        payload: envelope.payload(),
    };
    // Serializing strings, integers and a JSON map cannot fail.
    serde_json::to_vec(&body).unwrap_or_default()
}

/// Reads an event back from a message body; the error says why the body is not a relaybus
/// event.
pub(crate) fn decode(body: &[u8]) -> Result<Decoded, String> {
    let value: serde_json::Value = serde_json::from_slice(body)
        .map_err(|error| format!("not a relaybus event: the body is not JSON ({error})"))?;
    let version = value
        .get("relaybus")
        .ok_or("not a relaybus event: the body has no `relaybus` format version")?;
    match version.as_u64() {
        Some(v) if v == u64::from(FORMAT_VERSION) => {}
        _ => {
            return Err(format!(
                "unsupported relaybus message format version {version}; this consumer reads \
                 version {FORMAT_VERSION}: upgrade it"
            ));
        }
    }
    let incoming: Incoming = serde_json::from_value(value)
        .map_err(|error| format!("malformed relaybus event: {error}"))?;
    let invalid = |error: crate::error::EventValidationError| {
        format!("invalid relaybus event {:?}: {error}", incoming.id)
    };
    let created_at = Timestamp::parse_rfc3339(&incoming.created_at).ok_or_else(|| {
        format!(
            "invalid relaybus event {:?}: `created_at` {:?} is not an RFC 3339 time",
            incoming.id, incoming.created_at
        )
    })?;
    let mut envelope = EventEnvelope::from_json(&incoming.event_type, incoming.payload.clone())
        .and_then(|e| e.with_id(incoming.id.clone()))
        .map_err(invalid)?;
    if let Some(key) = &incoming.key {
        envelope = envelope.with_key(key.clone()).map_err(invalid)?;
    }
    if let Some(id) = &incoming.correlation_id {
        envelope = envelope.with_correlation_id(id.clone()).map_err(invalid)?;
    }
    if let Some(id) = &incoming.causation_id {
        envelope = envelope.with_causation_id(id.clone()).map_err(invalid)?;
    }
    for (name, value) in &incoming.headers {
        envelope = envelope
            .with_header(name.clone(), value.clone())
            .map_err(invalid)?;
    }
    Ok(Decoded {
        envelope: envelope.made_at(created_at),
        source_sequence: incoming.sequence,
    })
}

/// Free text (an error message) made fit for a message header: control characters become
/// spaces, and it is cut at 1024 bytes.
#[cfg_attr(not(any(feature = "nats", feature = "rabbitmq")), allow(dead_code))]
pub(crate) fn header_text(text: &str) -> String {
    let mut clean: String = text
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    if clean.len() > 1024 {
        let mut cut = 1024;
        while !clean.is_char_boundary(cut) {
            cut -= 1;
        }
        clean.truncate(cut);
    }
    clean
}

/// The partition of an event: the 32-bit FNV-1a hash of its key (of its id for an unkeyed
/// event) modulo `partitions`. One key always takes one partition.
pub(crate) fn partition(partitions: u32, envelope: &EventEnvelope) -> u32 {
    let routed = envelope.key().unwrap_or(envelope.id());
    crate::event::fnv1a32(routed.as_bytes()) % partitions.max(1)
}

/// An event with every part of the envelope set, some of them hard to carry (a header name
/// with spaces, a value with a line break), for the transports' tests.
#[cfg(test)]
pub(crate) fn sample_envelope() -> EventEnvelope {
    EventEnvelope::from_json(
        "order.placed.v1",
        serde_json::json!({"order_id": "o-1", "n": [1, 2]}),
    )
    .unwrap()
    .with_key("o-1")
    .unwrap()
    .with_correlation_id("req-1")
    .unwrap()
    .with_causation_id("cmd-1")
    .unwrap()
    .with_header("tenant", "acme")
    .unwrap()
    .with_header("odd name: with spaces", "line\nbreak")
    .unwrap()
    .made_at(Timestamp::from_millis(1_764_000_000_123))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip() {
        let sent = sample_envelope();
        let decoded = decode(&encode(&sent, Some(7))).unwrap();
        assert_eq!(decoded.envelope, sent);
        assert_eq!(decoded.source_sequence, Some(7));
        let unkeyed = EventEnvelope::from_json("a.b", serde_json::json!({})).unwrap();
        let decoded = decode(&encode(&unkeyed, None)).unwrap();
        assert_eq!(decoded.envelope.key(), None);
        assert_eq!(decoded.envelope.id(), unkeyed.id());
    }

    #[test]
    fn refusals_say_why() {
        let reason = |body: &[u8]| decode(body).unwrap_err();
        assert!(reason(b"hello").contains("not JSON"));
        assert!(reason(br#"{"id":"x"}"#).contains("no `relaybus` format version"));
        assert!(reason(br#"{"relaybus":2}"#).contains("version 2"));
        assert!(reason(br#"{"relaybus":1,"id":"x"}"#).contains("malformed"));
        let bad_type = br#"{"relaybus":1,"id":"x","type":"Bad Type","created_at":"2026-01-01T00:00:00Z","payload":{}}"#;
        assert!(
            reason(bad_type).contains("type name"),
            "{}",
            reason(bad_type)
        );
        let bad_time = br#"{"relaybus":1,"id":"x","type":"a.b","created_at":"now","payload":{}}"#;
        assert!(reason(bad_time).contains("RFC 3339"));
        let not_object = br#"{"relaybus":1,"id":"x","type":"a.b","created_at":"2026-01-01T00:00:00Z","payload":[1]}"#;
        assert!(reason(not_object).contains("invalid relaybus event"));
    }

    #[test]
    fn one_key_one_partition() {
        let e = sample_envelope();
        let first = partition(16, &e);
        assert!(first < 16);
        for _ in 0..3 {
            let again = e.clone().with_id(uuid::Uuid::now_v7().to_string()).unwrap();
            assert_eq!(partition(16, &again), first);
        }
        assert_eq!(partition(1, &e), 0);
    }
}
