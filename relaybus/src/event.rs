//! The event model: the [`Event`] trait and the [`EventEnvelope`] that carries an event to the
//! store.

use std::collections::BTreeMap;

use serde::{Serialize, de::DeserializeOwned};

use crate::{error::EventValidationError, time::Timestamp};

/// The longest event type name, in bytes.
pub const MAX_TYPE_NAME_BYTES: usize = 128;
/// The longest event id, in bytes.
pub const MAX_ID_BYTES: usize = 256;
/// The longest ordering key, in bytes.
pub const MAX_KEY_BYTES: usize = 512;
/// The longest correlation id, causation id, header name or header value, in bytes.
pub const MAX_FIELD_BYTES: usize = 1024;
/// The deepest payload: objects and arrays nested in the payload object, itself counted. MongoDB
/// supports 100 levels of nesting in a document.
pub const MAX_PAYLOAD_DEPTH: usize = 100;

/// An event type: a serializable payload with a stable wire name.
///
/// Declare it with [`#[event("...")]`](macro@crate::event), which implements this trait and
/// lists the type in the [`registry`](crate::registry); implement it by hand for a type the
/// registry need not know.
///
/// The name (`TYPE`) is what the store records and what handlers subscribe to, so it must never
/// change once events of it were published: a new version of an event is a new type with a new
/// name, `order.placed.v2` next to `order.placed.v1`.
///
/// The payload is stored as the JSON value serde makes of it, and must serialize to a JSON object
/// nested at most [`MAX_PAYLOAD_DEPTH`] levels deep.
///
/// # Example
///
/// ```
/// use relaybus::Event;
/// use serde::{Deserialize, Serialize};
///
/// #[derive(Debug, Serialize, Deserialize)]
/// struct OrderPlaced {
///     order_id: String,
///     total_cents: u64,
/// }
///
/// impl Event for OrderPlaced {
///     const TYPE: &'static str = "order.placed.v1";
/// }
/// ```
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not a relaybus event",
    label = "not an event",
    note = "declare the type with `#[relaybus::event(\"aggregate.happened.v1\")]`, or implement `relaybus::Event` for it"
)]
pub trait Event: Serialize + DeserializeOwned + Send + Sync + 'static {
    /// The wire name of the event type, such as `order.placed.v1`.
    ///
    /// Dot-separated segments of lowercase ASCII letters, digits, `_` and `-`, each starting with
    /// a letter or digit; 128 bytes at most.
    const TYPE: &'static str;
}

/// Checks an event type name against the naming rule, returning what is wrong with it.
///
/// The rule: 1 to 128 bytes; dot-separated segments, none empty; each segment made of lowercase
/// ASCII letters, digits, `_` and `-`, starting with a letter or digit.
///
/// This is a `const fn`, so the rule can also be checked at compile time.
///
/// ```
/// assert!(relaybus::event::check_type_name("order.placed.v1").is_ok());
/// assert!(relaybus::event::check_type_name("Order Placed").is_err());
/// ```
pub const fn check_type_name(name: &str) -> Result<(), &'static str> {
    let bytes = name.as_bytes();
    if bytes.is_empty() {
        return Err("it is empty");
    }
    if bytes.len() > MAX_TYPE_NAME_BYTES {
        return Err("it is longer than 128 bytes");
    }
    let mut i = 0;
    let mut segment_start = true;
    while i < bytes.len() {
        let b = bytes[i];
        if b == b'.' {
            if segment_start {
                return Err("it has an empty segment (a leading, trailing or doubled `.`)");
            }
            segment_start = true;
        } else {
            let alnum = b.is_ascii_lowercase() || b.is_ascii_digit();
            if segment_start && !alnum {
                return Err(
                    "a segment starts with a character other than a lowercase letter or digit",
                );
            }
            if !alnum && b != b'_' && b != b'-' {
                return Err(
                    "it contains a character other than lowercase letters, digits, `_`, `-` and `.`",
                );
            }
            segment_start = false;
        }
        i += 1;
    }
    if segment_start {
        return Err("it has an empty segment (a leading, trailing or doubled `.`)");
    }
    Ok(())
}

/// Validates an event type name, as [`check_type_name`] does, with a typed error.
pub fn validate_type_name(name: &str) -> Result<(), EventValidationError> {
    check_type_name(name).map_err(|reason| EventValidationError::InvalidTypeName {
        name: name.to_owned(),
        reason,
    })
}

/// An event ready to be appended to the store: its payload as JSON plus the metadata that travels
/// with it.
///
/// Build one from a typed event with [`EventEnvelope::new`], then chain the optional settings.
/// Every setter validates its input, so an envelope that exists is one the store accepts
/// (except for the document size, which is checked when it is appended).
///
/// # Example
///
/// ```
/// # use relaybus::{Event, EventEnvelope};
/// # #[derive(serde::Serialize, serde::Deserialize)]
/// # struct OrderPlaced { order_id: String }
/// # impl Event for OrderPlaced { const TYPE: &'static str = "order.placed.v1"; }
/// # fn main() -> Result<(), relaybus::EventValidationError> {
/// let envelope = EventEnvelope::new(&OrderPlaced { order_id: "o-1".into() })?
///     .with_key("o-1")?
///     .with_correlation_id("req-42")?
///     .with_header("tenant", "acme")?;
/// assert_eq!(envelope.event_type(), "order.placed.v1");
/// assert_eq!(envelope.key(), Some("o-1"));
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct EventEnvelope {
    pub(crate) id: String,
    pub(crate) event_type: String,
    pub(crate) payload: serde_json::Map<String, serde_json::Value>,
    pub(crate) key: Option<String>,
    pub(crate) correlation_id: Option<String>,
    pub(crate) causation_id: Option<String>,
    pub(crate) headers: BTreeMap<String, String>,
    pub(crate) created_at: Timestamp,
}

impl EventEnvelope {
    /// Serializes a typed event into a new envelope with a fresh UUID v7 id and the current time.
    ///
    /// # Errors
    ///
    /// [`EventValidationError`] when the type name breaks the naming rule, or when the payload
    /// does not serialize to a JSON object.
    pub fn new<E: Event>(event: &E) -> Result<Self, EventValidationError> {
        let value =
            serde_json::to_value(event).map_err(|source| EventValidationError::Payload {
                event_type: E::TYPE.to_owned(),
                source,
            })?;
        Self::from_json(E::TYPE, value)
    }

    /// Builds an envelope from a type name and a JSON payload, for code that does not have a Rust
    /// type for the event (relays, replays, tests).
    ///
    /// # Errors
    ///
    /// [`EventValidationError`] when the type name breaks the naming rule, the payload is not a
    /// JSON object, or it is nested more than [`MAX_PAYLOAD_DEPTH`] levels deep.
    pub fn from_json(
        event_type: &str,
        payload: serde_json::Value,
    ) -> Result<Self, EventValidationError> {
        validate_type_name(event_type)?;
        let payload = match payload {
            serde_json::Value::Object(map) => map,
            other => {
                return Err(EventValidationError::PayloadNotObject {
                    event_type: event_type.to_owned(),
                    found: json_kind(&other),
                });
            }
        };
        if too_deep(&payload) {
            return Err(EventValidationError::PayloadTooDeep {
                event_type: event_type.to_owned(),
                limit: MAX_PAYLOAD_DEPTH,
            });
        }
        Ok(EventEnvelope {
            id: uuid::Uuid::now_v7().to_string(),
            event_type: event_type.to_owned(),
            payload,
            key: None,
            correlation_id: None,
            causation_id: None,
            headers: BTreeMap::new(),
            created_at: Timestamp::now(),
        })
    }

    /// The envelope with its creation time set to `at`: the time of the bus's clock when it
    /// publishes.
    pub(crate) fn made_at(mut self, at: Timestamp) -> Self {
        self.created_at = at;
        self
    }

    /// Replaces the generated id with one of the caller's, for example the id of a message being
    /// relayed. Appending an event whose id the store already holds adds nothing but the
    /// deliveries of handlers the stored event has never had.
    ///
    /// # Errors
    ///
    /// [`EventValidationError::InvalidId`] for an empty id, one over 256 bytes or one with
    /// control characters.
    pub fn with_id(mut self, id: impl Into<String>) -> Result<Self, EventValidationError> {
        let id = id.into();
        let reason = if id.is_empty() {
            Some("it is empty")
        } else if id.len() > MAX_ID_BYTES {
            Some("it is too long")
        } else if id.chars().any(char::is_control) {
            Some("it contains control characters")
        } else {
            None
        };
        if let Some(reason) = reason {
            return Err(EventValidationError::InvalidId { id, reason });
        }
        self.id = id;
        Ok(self)
    }

    /// Sets the ordering key. Deliveries of events with the same key run one at a time per
    /// handler, in the order their transactions committed, except for the handlers subscribed
    /// [unordered](crate::Subscription::unordered).
    ///
    /// # Errors
    ///
    /// [`EventValidationError::InvalidKey`] for an empty key or one over 512 bytes.
    pub fn with_key(mut self, key: impl Into<String>) -> Result<Self, EventValidationError> {
        let key = key.into();
        let reason = if key.is_empty() {
            Some("it is empty")
        } else if key.len() > MAX_KEY_BYTES {
            Some("it is too long")
        } else {
            None
        };
        if let Some(reason) = reason {
            return Err(EventValidationError::InvalidKey {
                key: key.chars().take(64).collect(),
                reason,
            });
        }
        self.key = Some(key);
        Ok(self)
    }

    /// Sets the correlation id, which ties together the events of one business process.
    ///
    /// # Errors
    ///
    /// [`EventValidationError::InvalidField`] for an empty value or one over 1024 bytes.
    pub fn with_correlation_id(
        mut self,
        id: impl Into<String>,
    ) -> Result<Self, EventValidationError> {
        self.correlation_id = Some(check_field("correlation id", id.into())?);
        Ok(self)
    }

    /// Sets the causation id: the id of the event or command that caused this one.
    ///
    /// # Errors
    ///
    /// [`EventValidationError::InvalidField`] for an empty value or one over 1024 bytes.
    pub fn with_causation_id(
        mut self,
        id: impl Into<String>,
    ) -> Result<Self, EventValidationError> {
        self.causation_id = Some(check_field("causation id", id.into())?);
        Ok(self)
    }

    /// Adds a header, a string that travels with the event (tenant, trace id, ...).
    ///
    /// # Errors
    ///
    /// [`EventValidationError::InvalidField`] for an empty name, or a name or value over 1024
    /// bytes.
    pub fn with_header(
        mut self,
        name: impl Into<String>,
        value: impl Into<String>,
    ) -> Result<Self, EventValidationError> {
        let name = check_field("header name", name.into())?;
        let value = value.into();
        if value.len() > MAX_FIELD_BYTES {
            return Err(EventValidationError::InvalidField {
                field: "header value",
                reason: format!("the value of {name:?} is longer than {MAX_FIELD_BYTES} bytes"),
            });
        }
        self.headers.insert(name, value);
        Ok(self)
    }

    /// The event id.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The event type name.
    pub fn event_type(&self) -> &str {
        &self.event_type
    }

    /// The payload as the JSON object it is stored as.
    pub fn payload(&self) -> &serde_json::Map<String, serde_json::Value> {
        &self.payload
    }

    /// The ordering key, if any.
    pub fn key(&self) -> Option<&str> {
        self.key.as_deref()
    }

    /// The correlation id, if any.
    pub fn correlation_id(&self) -> Option<&str> {
        self.correlation_id.as_deref()
    }

    /// The causation id, if any.
    pub fn causation_id(&self) -> Option<&str> {
        self.causation_id.as_deref()
    }

    /// The headers.
    pub fn headers(&self) -> &BTreeMap<String, String> {
        &self.headers
    }

    /// The headers, to change in place (trace context).
    #[cfg_attr(not(feature = "opentelemetry"), allow(dead_code))]
    pub(crate) fn headers_mut(&mut self) -> &mut BTreeMap<String, String> {
        &mut self.headers
    }

    /// When the envelope was made.
    pub fn created_at(&self) -> Timestamp {
        self.created_at
    }
}

fn check_field(field: &'static str, value: String) -> Result<String, EventValidationError> {
    if value.is_empty() {
        return Err(EventValidationError::InvalidField {
            field,
            reason: "it is empty".to_owned(),
        });
    }
    if value.len() > MAX_FIELD_BYTES {
        return Err(EventValidationError::InvalidField {
            field,
            reason: format!("it is longer than {MAX_FIELD_BYTES} bytes"),
        });
    }
    Ok(value)
}

/// Whether objects and arrays nest more than [`MAX_PAYLOAD_DEPTH`] levels deep in `payload`,
/// the payload itself counted. Walks without recursion: the conversions to BSON recurse, and
/// a payload deep enough would overflow their stack.
fn too_deep(payload: &serde_json::Map<String, serde_json::Value>) -> bool {
    let mut pending: Vec<(&serde_json::Value, usize)> = payload.values().map(|v| (v, 1)).collect();
    while let Some((value, above)) = pending.pop() {
        let children: Box<dyn Iterator<Item = &serde_json::Value>> = match value {
            serde_json::Value::Object(map) => Box::new(map.values()),
            serde_json::Value::Array(items) => Box::new(items.iter()),
            _ => continue,
        };
        let depth = above + 1;
        if depth > MAX_PAYLOAD_DEPTH {
            return true;
        }
        pending.extend(children.map(|child| (child, depth)));
    }
    false
}

fn json_kind(value: &serde_json::Value) -> &'static str {
    match value {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "an array",
        serde_json::Value::Object(_) => "an object",
    }
}

/// The 32-bit FNV-1a hash of `bytes`.
pub(crate) fn fnv1a32(bytes: &[u8]) -> u32 {
    let mut hash: u32 = 0x811c_9dc5;
    for &b in bytes {
        hash ^= u32::from(b);
        hash = hash.wrapping_mul(0x0100_0193);
    }
    hash
}

/// The 64-bit FNV-1a hash of `bytes`: the same in every process and build.
#[cfg(feature = "kafka")]
pub(crate) fn fnv1a64(bytes: &[u8]) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        hash ^= u64::from(b);
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
    hash
}

/// The number of lanes deliveries are spread over.
pub const LANE_COUNT: u32 = 256;

/// The lane of an event's deliveries: the FNV-1a hash of its ordering key, or of its id when it
/// has none, modulo 256. All deliveries of one key share a lane.
pub fn lane_of(key: Option<&str>, event_id: &str) -> u32 {
    fnv1a32(key.unwrap_or(event_id).as_bytes()) % LANE_COUNT
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn type_names() {
        for good in ["order.placed.v1", "a", "x-y_z.0", "9.lives"] {
            assert_eq!(check_type_name(good), Ok(()), "{good}");
        }
        for bad in [
            "",
            ".a",
            "a.",
            "a..b",
            "Order.placed",
            "order placed",
            "_a",
            "a.-b",
            "ordér",
        ] {
            assert!(check_type_name(bad).is_err(), "{bad}");
        }
        assert!(check_type_name(&"a".repeat(129)).is_err());
        assert!(check_type_name(&"a".repeat(128)).is_ok());
    }

    #[test]
    fn fnv_matches_reference_values() {
        // Reference values of 32-bit FNV-1a.
        assert_eq!(fnv1a32(b""), 0x811c_9dc5);
        assert_eq!(fnv1a32(b"a"), 0xe40c_292c);
        assert_eq!(fnv1a32(b"foobar"), 0xbf9c_f968);
        assert_eq!(lane_of(Some("foobar"), "ignored"), 0x68);
        assert_eq!(lane_of(None, "a"), 0x2c);
    }

    #[test]
    fn envelope_validation() {
        let e = EventEnvelope::from_json("a.b", serde_json::json!({"x": 1})).unwrap();
        assert!(e.clone().with_key("").is_err());
        assert!(e.clone().with_key("k".repeat(513)).is_err());
        assert!(e.clone().with_id("").is_err());
        assert!(e.clone().with_id("a\nb").is_err());
        assert!(e.clone().with_header("", "v").is_err());
        assert!(matches!(
            EventEnvelope::from_json("a.b", serde_json::json!([1])),
            Err(EventValidationError::PayloadNotObject { .. })
        ));
        let nested = |levels: usize| {
            let mut value = serde_json::json!(1);
            for _ in 1..levels {
                value = serde_json::json!({ "a": value });
            }
            serde_json::json!({ "a": value })
        };
        assert!(EventEnvelope::from_json("a.b", nested(MAX_PAYLOAD_DEPTH)).is_ok());
        assert!(matches!(
            EventEnvelope::from_json("a.b", nested(MAX_PAYLOAD_DEPTH + 1)),
            Err(EventValidationError::PayloadTooDeep { limit: 100, .. })
        ));
        // The payload object, then arrays in arrays up to the limit.
        let mut listed = serde_json::json!([]);
        for _ in 2..MAX_PAYLOAD_DEPTH {
            listed = serde_json::json!([listed]);
        }
        assert!(EventEnvelope::from_json("a.b", serde_json::json!({ "l": listed })).is_ok());
        let listed = serde_json::json!([listed]);
        assert!(EventEnvelope::from_json("a.b", serde_json::json!({ "l": listed })).is_err());
        let id = uuid::Uuid::parse_str(e.id()).unwrap();
        assert_eq!(id.get_version_num(), 7);
    }
}
