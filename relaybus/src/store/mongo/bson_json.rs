//! Plain conversions between JSON values and BSON.
//!
//! Payloads are stored as the JSON value serde makes of them. Extended JSON is deliberately not
//! interpreted: an object `{"$oid": "..."}` in a payload stays an object with a `$oid` key.

use mongodb::bson::{Bson, Document, RawBsonRef, RawDocument};

/// Converts a JSON value to BSON: integers that fit 32 bits become `Int32`, other integers
/// `Int64`, integers beyond `i64` and fractions `Double`; objects keep their keys as they are.
pub(crate) fn json_to_bson(value: &serde_json::Value) -> Bson {
    use serde_json::Value;
    match value {
        Value::Null => Bson::Null,
        Value::Bool(b) => Bson::Boolean(*b),
        Value::Number(n) => {
            if let Some(i) = n.as_i64() {
                match i32::try_from(i) {
                    Ok(small) => Bson::Int32(small),
                    Err(_) => Bson::Int64(i),
                }
            } else {
                Bson::Double(n.as_f64().unwrap_or(f64::NAN))
            }
        }
        Value::String(s) => Bson::String(s.clone()),
        Value::Array(items) => Bson::Array(items.iter().map(json_to_bson).collect()),
        Value::Object(map) => Bson::Document(object_to_document(map)),
    }
}

/// Converts a JSON object to a BSON document.
pub(crate) fn object_to_document(map: &serde_json::Map<String, serde_json::Value>) -> Document {
    map.iter()
        .map(|(k, v)| (k.clone(), json_to_bson(v)))
        .collect()
}

/// Converts stored BSON back to JSON. Values that JSON cannot hold natively (dates, object ids,
/// binary) become their relaxed extended-JSON form.
pub(crate) fn bson_to_json(value: &Bson) -> serde_json::Value {
    use serde_json::Value;
    match value {
        Bson::Null | Bson::Undefined => Value::Null,
        Bson::Boolean(b) => Value::Bool(*b),
        Bson::Int32(i) => Value::from(*i),
        Bson::Int64(i) => Value::from(*i),
        Bson::Double(f) => serde_json::Number::from_f64(*f)
            .map(Value::Number)
            .unwrap_or(Value::Null),
        Bson::String(s) => Value::String(s.clone()),
        Bson::Array(items) => Value::Array(items.iter().map(bson_to_json).collect()),
        Bson::Document(doc) => Value::Object(
            doc.iter()
                .map(|(k, v)| (k.clone(), bson_to_json(v)))
                .collect(),
        ),
        other => other.clone().into_relaxed_extjson(),
    }
}

/// Converts a stored value to JSON straight from its raw bytes, as [`bson_to_json`] does.
///
/// Stored payloads are read raw because decoding them into a [`Document`] would interpret a
/// user's `{"$oid": ...}` object as extended JSON and fail or change it.
pub(crate) fn raw_to_json(value: RawBsonRef<'_>) -> serde_json::Value {
    use serde_json::Value;
    match value {
        RawBsonRef::Null | RawBsonRef::Undefined => Value::Null,
        RawBsonRef::Boolean(b) => Value::Bool(b),
        RawBsonRef::Int32(i) => Value::from(i),
        RawBsonRef::Int64(i) => Value::from(i),
        RawBsonRef::Double(f) => serde_json::Number::from_f64(f)
            .map(Value::Number)
            .unwrap_or(Value::Null),
        RawBsonRef::String(s) => Value::String(s.to_owned()),
        RawBsonRef::Array(items) => Value::Array(
            items
                .into_iter()
                .filter_map(Result::ok)
                .map(raw_to_json)
                .collect(),
        ),
        RawBsonRef::Document(doc) => Value::Object(raw_document_to_json(doc)),
        other => match other.to_raw_bson().try_into() {
            Ok(bson) => bson_to_json(&bson),
            Err(_) => Value::Null,
        },
    }
}

/// Converts a stored document to a JSON object straight from its raw bytes. Elements that do
/// not parse (a corrupted document) are left out.
pub(crate) fn raw_document_to_json(
    doc: &RawDocument,
) -> serde_json::Map<String, serde_json::Value> {
    doc.into_iter()
        .filter_map(Result::ok)
        .map(|(k, v)| (k.to_owned(), raw_to_json(v)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn round_trip_keeps_plain_json() {
        let value = json!({
            "small": 1,
            "big": 5_000_000_000_i64,
            "huge": u64::MAX,
            "frac": 1.5,
            "s": "x",
            "n": null,
            "a": [true, {"$oid": "not an id", "a.b": 1}],
        });
        let bson = json_to_bson(&value);
        let doc = bson.as_document().unwrap();
        assert_eq!(doc.get("small"), Some(&Bson::Int32(1)));
        assert_eq!(doc.get("big"), Some(&Bson::Int64(5_000_000_000)));
        assert!(matches!(doc.get("huge"), Some(Bson::Double(_))));
        let back = bson_to_json(&bson);
        let raw = mongodb::bson::RawDocumentBuf::from_document(doc).unwrap();
        assert_eq!(serde_json::Value::Object(raw_document_to_json(&raw)), back);
        assert_eq!(back["a"], value["a"]);
        assert_eq!(back["small"], value["small"]);
        assert_eq!(back["frac"], value["frac"]);
    }
}
