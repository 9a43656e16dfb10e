//! The Kafka side of the message format: the record's value is the JSON envelope shared by
//! every transport (see [`crate::transport::wire`]), its key the event's ordering key, and a
//! few headers for tools.

use std::collections::BTreeMap;

use rskafka::{
    chrono::{DateTime, Utc},
    record::Record,
};

pub use crate::transport::wire::FORMAT_VERSION;
use crate::{event::EventEnvelope, transport::wire};

/// The record header with the event type name (for tools; the consumer reads the value).
pub const EVENT_TYPE_HEADER: &str = "relaybus-event-type";
/// The record header with the event id (for tools; the consumer reads the value).
pub const EVENT_ID_HEADER: &str = "relaybus-event-id";
/// The header of a dead-lettered record that says why it was dead-lettered.
pub const DEAD_LETTER_REASON_HEADER: &str = "relaybus-dead-letter-reason";
/// The header of a dead-lettered record with where it was read: `<topic>:<partition>:<offset>`.
pub const DEAD_LETTER_SOURCE_HEADER: &str = "relaybus-dead-letter-source";

/// The record of an event: key = the event's ordering key (none for an unkeyed event), value =
/// the JSON envelope, timestamp = the event's creation time, and the id, type and content type
/// as headers.
pub(crate) fn record(envelope: &EventEnvelope, sequence: Option<i64>) -> Record {
    let mut headers = BTreeMap::new();
    headers.insert(
        EVENT_ID_HEADER.to_owned(),
        envelope.id().as_bytes().to_vec(),
    );
    headers.insert(
        EVENT_TYPE_HEADER.to_owned(),
        envelope.event_type().as_bytes().to_vec(),
    );
    headers.insert("content-type".to_owned(), b"application/json".to_vec());
    Record {
        key: envelope.key().map(|key| key.as_bytes().to_vec()),
        value: Some(wire::encode(envelope, sequence)),
        headers,
        timestamp: timestamp(envelope.created_at().timestamp_millis()),
    }
}

/// A record's time from milliseconds since the epoch (the epoch for one out of range).
pub(crate) fn timestamp(millis: i64) -> DateTime<Utc> {
    DateTime::from_timestamp_millis(millis).unwrap_or_default()
}

/// The partition of an event: the 32-bit FNV-1a hash of its key (of its id for an unkeyed
/// event) modulo `partitions`, as every transport routes.
pub(crate) fn partition(partitions: u32, envelope: &EventEnvelope) -> u32 {
    wire::partition(partitions, envelope)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::time::Timestamp;

    #[test]
    fn a_record_carries_the_envelope() {
        let envelope = EventEnvelope::from_json("order.placed.v1", serde_json::json!({"n": 1}))
            .unwrap()
            .with_key("o-1")
            .unwrap()
            .made_at(Timestamp::from_millis(1_764_000_000_123));
        let record = record(&envelope, Some(3));
        assert_eq!(record.key.as_deref(), Some(&b"o-1"[..]));
        assert_eq!(record.timestamp.timestamp_millis(), 1_764_000_000_123);
        assert_eq!(
            record.headers[EVENT_ID_HEADER],
            envelope.id().as_bytes().to_vec()
        );
        let decoded = wire::decode(record.value.as_deref().unwrap()).unwrap();
        assert_eq!(decoded.envelope, envelope);
        let unkeyed = EventEnvelope::from_json("a.b", serde_json::json!({})).unwrap();
        assert_eq!(super::record(&unkeyed, None).key, None);
    }
}
