//! The AMQP side of the message format: the JSON envelope in the body (shared by every
//! transport), the message properties for the broker and for tools, and the routing of events
//! to routing keys.

use lapin::{
    BasicProperties,
    types::{AMQPValue, FieldTable, LongString, ShortString},
};

pub use crate::transport::wire::FORMAT_VERSION;
pub(crate) use crate::transport::wire::encode;
use crate::{event::EventEnvelope, transport::wire::partition};

/// The AMQP header with the event type name (for tools and bindings; the consumer reads the
/// body). The `type` property carries it too.
pub const EVENT_TYPE_HEADER: &str = "relaybus-event-type";
/// The AMQP header with the event id (for tools; the `message_id` property carries it too when
/// it fits in 255 bytes).
pub const EVENT_ID_HEADER: &str = "relaybus-event-id";
/// The AMQP header of a dead-lettered message that says why it was dead-lettered.
pub const DEAD_LETTER_REASON_HEADER: &str = "relaybus-dead-letter-reason";
/// The AMQP header of a dead-lettered message with the queue it was taken from.
pub const DEAD_LETTER_QUEUE_HEADER: &str = "relaybus-dead-letter-queue";
/// The AMQP header of a dead-lettered message with the routing key it had.
pub const DEAD_LETTER_ROUTING_KEY_HEADER: &str = "relaybus-dead-letter-routing-key";

/// The `delivery_mode` of a persistent message: the broker writes it to disk in a durable
/// queue before it confirms it.
pub(crate) const PERSISTENT: u8 = 2;

/// The properties of the message of an event: persistent, `message_id` the event id (when it
/// fits an AMQP short string), `type` the event type, `content_type` JSON, and the id and type
/// as headers.
pub(crate) fn properties(envelope: &EventEnvelope) -> BasicProperties {
    let mut headers = FieldTable::default();
    headers.insert(EVENT_ID_HEADER.into(), text(envelope.id()));
    headers.insert(EVENT_TYPE_HEADER.into(), text(envelope.event_type()));
    let mut properties = BasicProperties::default()
        .with_delivery_mode(PERSISTENT)
        .with_content_type("application/json".into())
        .with_app_id("relaybus".into())
        .with_headers(headers);
    if let Ok(id) = ShortString::try_new(envelope.id()) {
        properties = properties.with_message_id(id);
    }
    if let Ok(event_type) = ShortString::try_new(envelope.event_type()) {
        properties = properties.with_type(event_type);
    }
    properties
}

/// The routing key of an event: `<prefix>.<partition>`, the partition being the 32-bit FNV-1a
/// hash of the key (of the id for an unkeyed event) modulo `partitions`. One key always takes
/// one routing key.
pub(crate) fn routing_key(prefix: &str, partitions: u32, envelope: &EventEnvelope) -> String {
    format!("{prefix}.{}", partition(partitions, envelope))
}

/// A header value of text.
pub(crate) fn text(text: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(text))
}

/// A header value made of free text (an error message): control characters become spaces, and
/// it is cut at 1024 bytes.
pub(crate) fn header_text(text: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(crate::transport::wire::header_text(text)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn envelope() -> EventEnvelope {
        EventEnvelope::from_json("order.placed.v1", serde_json::json!({"order_id": "o-1"}))
            .unwrap()
            .with_key("o-1")
            .unwrap()
    }

    #[test]
    fn one_key_one_routing_key() {
        let e = envelope();
        let first = routing_key("orders", 16, &e);
        assert!(first.starts_with("orders."));
        for _ in 0..3 {
            let again = e.clone().with_id(uuid::Uuid::now_v7().to_string()).unwrap();
            assert_eq!(routing_key("orders", 16, &again), first);
        }
        assert_eq!(routing_key("orders", 1, &e), "orders.0");
    }

    #[test]
    fn properties_carry_the_id_and_persistence() {
        let e = envelope();
        let properties = properties(&e);
        assert_eq!(*properties.delivery_mode(), Some(PERSISTENT));
        assert_eq!(
            properties.message_id().as_ref().map(ShortString::as_str),
            Some(e.id())
        );
        let long = e.clone().with_id("i".repeat(256)).unwrap();
        assert_eq!(*self::properties(&long).message_id(), None);
        let headers = self::properties(&long).headers().clone().unwrap();
        assert_eq!(
            headers.inner().get(EVENT_ID_HEADER),
            Some(&text(&"i".repeat(256)))
        );
    }

    #[test]
    fn header_text_is_cut() {
        let AMQPValue::LongString(value) = header_text(&"é".repeat(600)) else {
            panic!("a long string")
        };
        assert_eq!(value.len(), 1024);
        assert_eq!(header_text("a\r\nb"), text("a  b"));
    }
}
