//! Every check of the input, made before any database call: query strings and bodies read
//! into the [shapes](super::model) they must have, then each value checked and turned into a
//! [`DeliveryQuery`] or a [`Selection`]. A refusal says what is accepted.

use axum::{
    extract::Query,
    http::{HeaderMap, header::CONTENT_TYPE},
};
use relaybus::{DeliveryQuery, DeliveryStatus, PendingState, Timestamp};

use super::{
    error::{OpsError, bad},
    model::{BuryBody, Filter, ListParams, WriteBody},
};

/// The most records per page.
pub(super) const MAX_LIMIT: u32 = 1_000;
/// The most ids per requeue.
const MAX_REQUEUE_IDS: usize = 1_000;

/// A checked `GET /deliveries` query.
#[derive(Debug)]
pub(super) struct Listing {
    pub(super) query: DeliveryQuery,
    pub(super) limit: u32,
}

/// The query string of `GET /deliveries`, checked.
pub(super) fn parse_listing(raw: Option<&str>) -> Result<Listing, OpsError> {
    let params = list_params(raw)?;
    let query = match &params.status {
        Some(status) => with_status(DeliveryQuery::new(), status)?,
        None => DeliveryQuery::new(),
    };
    let mut query = filtered(query, &params.filter())?;
    if let Some(after) = params.after {
        let usable = (1..=128).contains(&after.len())
            && after
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_'));
        if !usable {
            return Err(bad(
                "`after` must be the `id` of a listed delivery (the last one of the previous page)",
            ));
        }
        query = query.after(after);
    }
    let limit = match params.limit {
        None => 100,
        Some(limit) => limit
            .parse::<u32>()
            .ok()
            .filter(|limit| (1..=MAX_LIMIT).contains(limit))
            .ok_or_else(|| {
                bad(format!(
                    "`limit` must be a whole number from 1 to {MAX_LIMIT}"
                ))
            })?,
    };
    Ok(Listing {
        query: query.limit(limit),
        limit,
    })
}

/// `query` narrowed to the deliveries in `status`, a state the listing names.
fn with_status(query: DeliveryQuery, status: &str) -> Result<DeliveryQuery, OpsError> {
    Ok(match status {
        "pending" => query.status(DeliveryStatus::Pending),
        "waiting" => query.pending_state(PendingState::Waiting),
        "running" => query.pending_state(PendingState::Running),
        "parked" => query.pending_state(PendingState::Parked),
        "dead" => query.status(DeliveryStatus::Dead),
        "completed" => query.status(DeliveryStatus::Completed),
        _ => {
            return Err(bad(
                "`status` must be `pending`, `waiting`, `running`, `parked`, `dead` or \
                 `completed`",
            ));
        }
    })
}

fn list_params(raw: Option<&str>) -> Result<ListParams, OpsError> {
    parse_query(
        raw,
        "status, handler, event_type, key, event_id, error, last_error, created_from, \
         created_before, after and limit",
    )
}

/// Reads a query string with axum's [`Query`], which refuses unknown keys (where
/// `handler[$ne]=x` ends up) and repeated ones; `known` names the parameters.
pub(super) fn parse_query<T: serde::de::DeserializeOwned + Default>(
    raw: Option<&str>,
    known: &str,
) -> Result<T, OpsError> {
    let uri: axum::http::Uri = match raw {
        None | Some("") => return Ok(T::default()),
        Some(raw) => format!("/?{raw}")
            .parse()
            .map_err(|_| bad("the query string is not a valid URI query"))?,
    };
    Query::<T>::try_from_uri(&uri)
        .map(|Query(params)| params)
        .map_err(|rejection| {
            bad(format!(
                "{}; the parameters are {known}, none given more than once",
                rejection.body_text()
            ))
        })
}

/// Refuses a text that is empty, longer than `max` bytes, or holds control characters.
pub(super) fn check_text(name: &str, value: &str, max: usize, what: &str) -> Result<(), OpsError> {
    if value.is_empty() || value.len() > max || value.chars().any(char::is_control) {
        return Err(bad(format!(
            "`{name}` must be {what}: 1 to {max} bytes without control characters"
        )));
    }
    Ok(())
}

/// `query` narrowed by `filter`, every value checked first.
pub(super) fn filtered(
    mut query: DeliveryQuery,
    filter: &Filter,
) -> Result<DeliveryQuery, OpsError> {
    if let Some(handler) = &filter.handler {
        relaybus::validate_handler_id(handler).map_err(|e| bad(format!("`handler`: {e}")))?;
        query = query.handler(handler.clone());
    }
    if let Some(event_type) = &filter.event_type {
        relaybus::event::validate_type_name(event_type)
            .map_err(|e| bad(format!("`event_type`: {e}")))?;
        query = query.event_type(event_type.clone());
    }
    if let Some(key) = &filter.key {
        check_text("key", key, 512, "an ordering key")?;
        query = query.key(key.clone());
    }
    if let Some(event_id) = &filter.event_id {
        check_text("event_id", event_id, 256, "an event id")?;
        query = query.event_id(event_id.clone());
    }
    if let Some(error) = &filter.error {
        check_text("error", error, 256, "text of the last error")?;
        query = query.error_contains(error.clone());
    }
    if let Some(error) = &filter.last_error {
        // Stored errors are cut to 1 KiB, with an ellipsis.
        if error.is_empty() || error.len() > 1100 {
            return Err(bad(
                "`last_error` must be a last error as listed, 1 to 1100 bytes",
            ));
        }
        query = query.last_error(error.clone());
    }
    if let Some(from) = &filter.created_from {
        query = query.created_from(parse_time("created_from", from)?);
    }
    if let Some(before) = &filter.created_before {
        query = query.created_before(parse_time("created_before", before)?);
    }
    Ok(query)
}

fn parse_time(name: &str, value: &str) -> Result<Timestamp, OpsError> {
    Timestamp::parse_rfc3339(value).ok_or_else(|| {
        bad(format!(
            "`{name}` must be an RFC 3339 time such as 2025-01-31T12:00:00Z"
        ))
    })
}

/// The dead letters a write names.
#[derive(Debug)]
pub(super) enum Selection {
    /// These ids.
    Ids(Vec<String>),
    /// Every dead letter this filter matches.
    Filter(Filter),
    /// Every dead letter, as asked for with `"all": true`.
    All,
}

/// The bodies a requeue or a discard takes, as a refusal names them.
pub(super) const WRITE_SHAPES: &str = "send {\"ids\": [\"<delivery id>\", ..]}, \
                                       {\"filter\": {\"handler\", \"event_type\", \"key\", \
                                       \"event_id\", \"error\", \"last_error\", \
                                       \"created_from\", \"created_before\"}} or {\"all\": true}";

/// Whether the request says its body is JSON.
pub(super) fn is_json(headers: &HeaderMap) -> bool {
    headers
        .get(CONTENT_TYPE)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.split(';').next())
        .is_some_and(|mime| mime.trim().eq_ignore_ascii_case("application/json"))
}

/// The longest delivery id the routes take, in bytes.
const MAX_ID_BYTES: usize = 64;

/// Refuses a list of ids that is empty, too long, or holds anything but delivery ids.
fn check_ids(ids: &[String]) -> Result<(), OpsError> {
    if ids.is_empty() || ids.len() > MAX_REQUEUE_IDS {
        return Err(bad(format!(
            "`ids` must hold 1 to {MAX_REQUEUE_IDS} ids, not {}",
            ids.len()
        )));
    }
    // Each store has its own id form (MongoDB: 24 hexadecimal digits, PostgreSQL: a decimal
    // number); all are letters and digits. The store reports an id of another form as not
    // found.
    if let Some(id) = ids.iter().find(|id| {
        !(1..=MAX_ID_BYTES).contains(&id.len()) || !id.bytes().all(|b| b.is_ascii_alphanumeric())
    }) {
        let shown: String = id.chars().take(64).collect();
        return Err(bad(format!(
            "{shown:?} is not a delivery id; ids are the `id`s listed by GET /deliveries \
             (letters and digits)"
        )));
    }
    Ok(())
}

/// The body of a requeue or a discard, checked: the dead letters it names.
pub(super) fn parse_write(headers: &HeaderMap, body: &[u8]) -> Result<Selection, OpsError> {
    if !is_json(headers) {
        return Err(OpsError::NotJson);
    }
    let body: WriteBody =
        serde_json::from_slice(body).map_err(|e| bad(format!("{e}; {WRITE_SHAPES}")))?;
    match (body.ids, body.filter, body.all) {
        (Some(ids), None, None) => {
            check_ids(&ids)?;
            Ok(Selection::Ids(ids))
        }
        (None, Some(filter), None) => {
            if filter.is_empty() {
                return Err(bad(
                    "an empty `filter` matches every dead letter; send {\"all\": true} if that \
                     is what you mean",
                ));
            }
            // Checked now, so that a bad value is refused before anything is read.
            let _checked = filtered(DeliveryQuery::new(), &filter)?;
            Ok(Selection::Filter(filter))
        }
        (None, None, Some(true)) => Ok(Selection::All),
        (None, None, Some(false)) => Err(bad(
            "`all` must be `true` when given; to name some dead letters, send `ids` or `filter`",
        )),
        _ => Err(bad(format!(
            "give exactly one of `ids`, `filter` and `all`; {WRITE_SHAPES}"
        ))),
    }
}

/// The body of a bury, checked: the ids of the deliveries and why they are buried.
pub(super) fn parse_bury(headers: &HeaderMap, body: &[u8]) -> Result<BuryBody, OpsError> {
    if !is_json(headers) {
        return Err(OpsError::NotJson);
    }
    let body: BuryBody = serde_json::from_slice(body).map_err(|e| {
        bad(format!(
            "{e}; send {{\"ids\": [\"<delivery id>\", ..], \"reason\": \"why\"}}"
        ))
    })?;
    check_ids(&body.ids)?;
    if body.reason.trim().is_empty() || body.reason.len() > 1024 {
        return Err(bad(
            "`reason` must say, in 1 to 1024 bytes, why the deliveries are buried",
        ));
    }
    Ok(body)
}

#[cfg(test)]
mod tests {
    use axum::http::HeaderValue;

    use super::*;

    fn refused(raw: &str) -> String {
        match parse_listing(Some(raw)) {
            Err(OpsError::BadRequest(message)) => message,
            other => panic!("{raw:?} was not refused: {other:?}"),
        }
    }

    #[test]
    fn listing_parameters_are_checked() {
        let listing = parse_listing(Some(
            "status=dead&handler=send-confirmation&event_type=order.placed.v1\
             &created_from=2025-01-01T00%3A00%3A00Z&after=65f0c0ffee0123456789abcd&limit=10",
        ))
        .unwrap();
        assert_eq!(listing.limit, 10);
        let defaults = parse_listing(None).unwrap();
        assert_eq!(defaults.limit, 100);

        assert!(refused("status=buried").contains("`status`"));
        assert!(refused("handler[$ne]=x").contains("unknown field"));
        assert!(refused("handler=a&handler=b").contains("duplicate field"));
        assert!(refused("handler=a%20b").contains("`handler`"));
        assert!(refused("event_type=Order%24Placed").contains("`event_type`"));
        assert!(refused("created_before=yesterday").contains("RFC 3339"));
        assert!(refused("limit=0").contains("`limit`"));
        assert!(refused("limit=1001").contains("`limit`"));
        assert!(refused("after=%24ne").contains("`after`"));
        assert!(refused("skip=20").contains("unknown field"));
        assert!(refused("status=stuck").contains("`waiting`"));
        assert!(refused("key=").contains("`key`"));
        assert!(refused("event_id=").contains("`event_id`"));
        assert!(refused("error=%00").contains("`error`"));
        for state in [
            "pending",
            "waiting",
            "running",
            "parked",
            "dead",
            "completed",
        ] {
            assert!(
                parse_listing(Some(&format!("status={state}&key=k&event_id=e&error=x"))).is_ok()
            );
        }
        // Escapes that decode to nothing usable leave values no check accepts.
        assert!(refused("limit=%FF").contains("`limit`"));
        assert!(refused("limit=%zz").contains("`limit`"));
        assert!(refused("handler=%zz").contains("`handler`"));
        assert!(refused("after=%2").contains("`after`"));
    }

    #[test]
    fn write_bodies_are_checked() {
        let mut headers = HeaderMap::new();
        assert!(matches!(
            parse_write(&headers, br#"{"ids": []}"#),
            Err(OpsError::NotJson)
        ));
        headers.insert(
            CONTENT_TYPE,
            HeaderValue::from_static("application/json; charset=utf-8"),
        );
        let id = "65f0a1b2c3d4e5f601234567";
        match parse_write(&headers, format!(r#"{{"ids": ["{id}"]}}"#).as_bytes()) {
            Ok(Selection::Ids(ids)) => assert_eq!(ids, [id]),
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            parse_write(&headers, br#"{"filter": {"handler": "mailer"}}"#),
            Ok(Selection::Filter(_))
        ));
        assert!(matches!(
            parse_write(&headers, br#"{"all": true}"#),
            Ok(Selection::All)
        ));
        for (body, says) in [
            (r#"{"ids": [{"$ne": null}]}"#, "invalid type"),
            (r#"{"ids": {"$gt": ""}}"#, "invalid type"),
            (
                r#"{"ids": ["65f0a1b2c3d4e5f601234567"], "all": true}"#,
                "exactly one",
            ),
            (r#"{"ids": []}"#, "1 to 1000"),
            (r#"{"ids": ["not-an-id"]}"#, "not a delivery id"),
            (r#"["65f0a1b2c3d4e5f601234567"]"#, "invalid type"),
            ("ids=65f0a1b2c3d4e5f601234567", "expected"),
            (r#"{"filter": {}}"#, "\"all\": true"),
            (r#"{"filter": {"handler": {"$ne": 1}}}"#, "invalid type"),
            (r#"{"filter": {"handler": "a b"}}"#, "`handler`"),
            (r#"{"filter": {"sequence": 1}}"#, "unknown field"),
            (r#"{"filter": {"key": ""}}"#, "`key`"),
            (r#"{"filter": {"error": "a\u0000b"}}"#, "`error`"),
            (r#"{"all": false}"#, "must be `true`"),
            ("{}", "exactly one"),
        ] {
            match parse_write(&headers, body.as_bytes()) {
                Err(OpsError::BadRequest(message)) => {
                    assert!(message.contains(says), "{body}: {message}")
                }
                other => panic!("{body} was not refused: {other:?}"),
            }
        }
    }
}
