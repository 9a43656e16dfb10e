//! Operator routes: statistics, deliveries, and requeueing dead letters, as JSON.
//!
//! [`router`] has no authentication of its own: mount it behind yours.
//!
//! | Route | Answers |
//! |---|---|
//! | `GET /statistics` | `{"pending", "running", "parked", "dead", "completed", "oldest_due_at"}` |
//! | `GET /deliveries` | `{"deliveries": [..], "limit", "next_after"}`, oldest first |
//! | `POST /deliveries/requeue` | `{"requeued": [..], "blocked": [..], "not_found": [..]}` |
//!
//! `GET /deliveries` takes the query parameters `status` (`pending`, `dead` or `completed`),
//! `handler`, `event_type`, `created_from` and `created_before` (RFC 3339 times), `after` (the
//! id of the last record of the previous page) and `limit` (1 to 1,000, 100 by default);
//! `next_after` is the `after` of the next page, or `null` on the last one. Every page costs
//! the same, however deep it is. `POST /deliveries/requeue` takes a JSON body
//! `{"ids": ["<24 hex digits>", ..]}` with 1 to 1,000 ids, sent as `application/json` (which
//! a cross-site HTML form cannot send).
//!
//! Every input is checked before any database call, and anything else is refused with 400 and
//! `{"error": "..."}` saying what is accepted: unknown or repeated parameters, values of the
//! wrong type (an object or array where a string belongs, as in `{"ids": [{"$ne": null}]}` or
//! `?handler[$ne]=x`), names that no handler or event type can have. Other refusals answer
//! with the same JSON shape: 415 for a body that is not JSON, 413 for a body over the
//! router's limit, 405 for a wrong method and 404 for an unknown route. A failure of the store
//! answers 500 without its details, which are logged.
//!
//! # Example
//!
//! ```no_run
//! # fn example(bus: relaybus::RelayBus) {
//! use axum::Router;
//!
//! # let require_operator = tower::layer::util::Identity::new();
//! let app: Router = Router::new()
//!     // .route(..) for the application
//!     .nest("/ops", relaybus_axum::ops::router(bus).layer(require_operator));
//! # }
//! ```

use axum::{
    Json, Router,
    body::Bytes,
    extract::{RawQuery, State, rejection::BytesRejection},
    http::{HeaderMap, StatusCode, header::CONTENT_TYPE},
    response::{IntoResponse, Response},
    routing::{get, post},
};
use relaybus::{DeliveryQuery, DeliveryRecord, DeliveryStatus, RelayBus, Store, Timestamp};
use serde::Deserialize;
use serde_json::{Value, json};

/// The most records per page.
const MAX_LIMIT: u32 = 1_000;
/// The most ids per requeue.
const MAX_REQUEUE_IDS: usize = 1_000;

/// The operator routes of `bus`, to nest under a path of your choice behind your own
/// authentication; see the [module docs](self).
pub fn router<S, St: Store>(bus: RelayBus<St>) -> Router<S>
where
    S: Clone + Send + Sync + 'static,
{
    Router::new()
        .route("/statistics", get(statistics::<St>))
        .route("/deliveries", get(deliveries::<St>))
        .route("/deliveries/requeue", post(requeue::<St>))
        .method_not_allowed_fallback(method_not_allowed)
        .fallback(not_found)
        .with_state(bus)
}

async fn method_not_allowed() -> OpsError {
    OpsError::Refused(
        StatusCode::METHOD_NOT_ALLOWED,
        "this route takes another method: GET /statistics, GET /deliveries, \
         POST /deliveries/requeue"
            .to_owned(),
    )
}

async fn not_found() -> OpsError {
    OpsError::Refused(
        StatusCode::NOT_FOUND,
        "no such operator route; the routes are GET /statistics, GET /deliveries and \
         POST /deliveries/requeue"
            .to_owned(),
    )
}

/// An answer of the operator routes that is not a success.
#[derive(Debug)]
enum OpsError {
    /// The input is refused: 400.
    BadRequest(String),
    /// The body is not JSON: 415.
    NotJson,
    /// Refused with another 4xx status: an unknown route, a wrong method, a body that could
    /// not be read.
    Refused(StatusCode, String),
    /// The store failed: 500.
    Store(relaybus::Error),
}

impl IntoResponse for OpsError {
    fn into_response(self) -> Response {
        let (status, message) = match self {
            OpsError::BadRequest(message) => (StatusCode::BAD_REQUEST, message),
            OpsError::NotJson => (
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "send the body as `Content-Type: application/json`".to_owned(),
            ),
            OpsError::Refused(status, message) => (status, message),
            OpsError::Store(error) => {
                tracing::error!(%error, "an operator route failed");
                (
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "the event store could not be reached; see the server log".to_owned(),
                )
            }
        };
        (status, Json(json!({ "error": message }))).into_response()
    }
}

fn bad(message: impl Into<String>) -> OpsError {
    OpsError::BadRequest(message.into())
}

async fn statistics<St: Store>(State(bus): State<RelayBus<St>>) -> Result<Json<Value>, OpsError> {
    let stats = bus.store().statistics().await.map_err(OpsError::Store)?;
    Ok(Json(json!({
        "pending": stats.pending,
        "running": stats.running,
        "parked": stats.parked,
        "dead": stats.dead,
        "completed": stats.completed,
        "oldest_due_at": stats.oldest_due_at.map(rfc3339),
    })))
}

/// The query string of `GET /deliveries`, every value still text.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct ListParams {
    status: Option<String>,
    handler: Option<String>,
    event_type: Option<String>,
    created_from: Option<String>,
    created_before: Option<String>,
    after: Option<String>,
    limit: Option<String>,
}

/// A checked `GET /deliveries` query.
#[derive(Debug)]
struct Listing {
    query: DeliveryQuery,
    limit: u32,
}

fn parse_listing(raw: Option<&str>) -> Result<Listing, OpsError> {
    let params: ListParams = match raw {
        None | Some("") => ListParams::default(),
        Some(raw) => serde_urlencoded_params(raw)?,
    };
    let mut query = DeliveryQuery::new();
    if let Some(status) = params.status {
        query = query.status(match status.as_str() {
            "pending" => DeliveryStatus::Pending,
            "dead" => DeliveryStatus::Dead,
            "completed" => DeliveryStatus::Completed,
            _ => return Err(bad("`status` must be `pending`, `dead` or `completed`")),
        });
    }
    if let Some(handler) = params.handler {
        relaybus::validate_handler_id(&handler).map_err(|e| bad(format!("`handler`: {e}")))?;
        query = query.handler(handler);
    }
    if let Some(event_type) = params.event_type {
        relaybus::event::validate_type_name(&event_type)
            .map_err(|e| bad(format!("`event_type`: {e}")))?;
        query = query.event_type(event_type);
    }
    if let Some(from) = params.created_from {
        query = query.created_from(parse_time("created_from", &from)?);
    }
    if let Some(before) = params.created_before {
        query = query.created_before(parse_time("created_before", &before)?);
    }
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

/// Parses a query string into [`ListParams`], refusing repeated and unknown keys (which is
/// where `handler[$ne]=x` ends up).
fn serde_urlencoded_params(raw: &str) -> Result<ListParams, OpsError> {
    let mut seen = std::collections::HashSet::new();
    let mut object = serde_json::Map::new();
    for pair in raw.split('&').filter(|pair| !pair.is_empty()) {
        let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
        let key = decode(key).map_err(bad)?;
        let value = decode(value).map_err(bad)?;
        if !seen.insert(key.clone()) {
            return Err(bad(format!("`{key}` is given more than once")));
        }
        object.insert(key, Value::String(value));
    }
    serde_json::from_value(Value::Object(object)).map_err(|e| {
        bad(format!(
            "{e}; the parameters are status, handler, event_type, created_from, created_before, \
             after and limit"
        ))
    })
}

/// Percent-decodes one component of a query string, `+` as a space; the error says what is
/// wrong with it.
fn decode(component: &str) -> Result<String, &'static str> {
    const BAD_ESCAPE: &str = "the query string has a `%` not followed by two hexadecimal \
                              digits; percent-encode `%` itself as `%25`";
    let bytes = component.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut at = 0;
    while at < bytes.len() {
        match bytes[at] {
            b'+' => out.push(b' '),
            b'%' => {
                let hex = bytes
                    .get(at + 1..at + 3)
                    .filter(|hex| hex.iter().all(u8::is_ascii_hexdigit))
                    .ok_or(BAD_ESCAPE)?;
                let hex = std::str::from_utf8(hex).map_err(|_| BAD_ESCAPE)?;
                out.push(u8::from_str_radix(hex, 16).map_err(|_| BAD_ESCAPE)?);
                at += 2;
            }
            byte => out.push(byte),
        }
        at += 1;
    }
    String::from_utf8(out).map_err(|_| "the query string is not valid UTF-8 once percent-decoded")
}

fn parse_time(name: &str, value: &str) -> Result<Timestamp, OpsError> {
    Timestamp::parse_rfc3339(value).ok_or_else(|| {
        bad(format!(
            "`{name}` must be an RFC 3339 time such as 2025-01-31T12:00:00Z"
        ))
    })
}

async fn deliveries<St: Store>(
    State(bus): State<RelayBus<St>>,
    RawQuery(raw): RawQuery,
) -> Result<Json<Value>, OpsError> {
    let listing = parse_listing(raw.as_deref())?;
    let records = bus
        .store()
        .list_deliveries(&listing.query)
        .await
        .map_err(OpsError::Store)?;
    let full = records.len() == listing.limit as usize;
    let next_after = records.last().filter(|_| full).map(|last| last.id.clone());
    Ok(Json(json!({
        "deliveries": records.iter().map(record_json).collect::<Vec<_>>(),
        "limit": listing.limit,
        "next_after": next_after,
    })))
}

fn record_json(record: &DeliveryRecord) -> Value {
    json!({
        "id": record.id,
        "event_id": record.event_id,
        "handler": record.handler,
        "event_type": record.event_type,
        "key": record.key,
        "sequence": record.sequence,
        "unordered": record.unordered,
        "status": record.status.as_str(),
        "parked": record.parked,
        "attempts": record.attempts,
        "due_at": record.due_at.map(rfc3339),
        "created_at": record.created_at.map(rfc3339),
        "updated_at": record.updated_at.map(rfc3339),
        "completed_at": record.completed_at.map(rfc3339),
        "last_error": record.last_error,
        "errors": record.errors.iter().map(|e| json!({
            "at": rfc3339(e.at),
            "attempt": e.attempt,
            "error": e.error,
        })).collect::<Vec<_>>(),
        "requeues": record.requeues,
    })
}

fn rfc3339(time: Timestamp) -> String {
    time.to_string()
}

/// The body of `POST /deliveries/requeue`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RequeueBody {
    ids: Vec<String>,
}

fn parse_requeue(headers: &HeaderMap, body: &[u8]) -> Result<Vec<String>, OpsError> {
    let json = headers
        .get(CONTENT_TYPE)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.split(';').next())
        .is_some_and(|mime| mime.trim().eq_ignore_ascii_case("application/json"));
    if !json {
        return Err(OpsError::NotJson);
    }
    let body: RequeueBody = serde_json::from_slice(body).map_err(|e| {
        bad(format!(
            "{e}; send {{\"ids\": [\"<delivery id>\", ..]}} with the ids as strings"
        ))
    })?;
    if body.ids.is_empty() || body.ids.len() > MAX_REQUEUE_IDS {
        return Err(bad(format!(
            "`ids` must hold 1 to {MAX_REQUEUE_IDS} ids, not {}",
            body.ids.len()
        )));
    }
    if let Some(id) = body
        .ids
        .iter()
        .find(|id| id.len() != 24 || !id.bytes().all(|b| b.is_ascii_hexdigit()))
    {
        let shown: String = id.chars().take(64).collect();
        return Err(bad(format!(
            "{shown:?} is not a delivery id; ids are the 24 hexadecimal digits listed by GET /deliveries"
        )));
    }
    Ok(body.ids)
}

async fn requeue<St: Store>(
    State(bus): State<RelayBus<St>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, OpsError> {
    let body = body.map_err(|rejection| {
        OpsError::Refused(
            rejection.status(),
            format!(
                "{}; send {{\"ids\": [..]}} with at most {MAX_REQUEUE_IDS} ids",
                rejection.body_text()
            ),
        )
    })?;
    let ids = parse_requeue(&headers, &body)?;
    let outcome = bus
        .store()
        .requeue(&ids, Timestamp::now())
        .await
        .map_err(OpsError::Store)?;
    Ok(Json(json!({
        "requeued": outcome.requeued,
        "blocked": outcome.blocked,
        "not_found": outcome.not_found,
    })))
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
        assert!(refused("handler=a&handler=b").contains("more than once"));
        assert!(refused("handler=a%20b").contains("`handler`"));
        assert!(refused("event_type=Order%24Placed").contains("`event_type`"));
        assert!(refused("created_before=yesterday").contains("RFC 3339"));
        assert!(refused("limit=0").contains("`limit`"));
        assert!(refused("limit=1001").contains("`limit`"));
        assert!(refused("after=%24ne").contains("`after`"));
        assert!(refused("skip=20").contains("unknown field"));
        assert!(refused("limit=%FF").contains("UTF-8"));
        assert!(refused("limit=%zz").contains("two hexadecimal digits"));
        assert!(refused("limit=1%2").contains("two hexadecimal digits"));
        assert!(refused("limit=%+1").contains("two hexadecimal digits"));
    }

    #[test]
    fn requeue_bodies_are_checked() {
        let mut headers = HeaderMap::new();
        assert!(matches!(
            parse_requeue(&headers, br#"{"ids": []}"#),
            Err(OpsError::NotJson)
        ));
        headers.insert(
            CONTENT_TYPE,
            HeaderValue::from_static("application/json; charset=utf-8"),
        );
        let id = "65f0a1b2c3d4e5f601234567";
        assert_eq!(
            parse_requeue(&headers, format!(r#"{{"ids": ["{id}"]}}"#).as_bytes()).unwrap(),
            [id]
        );
        for body in [
            r#"{"ids": [{"$ne": null}]}"#,
            r#"{"ids": {"$gt": ""}}"#,
            r#"{"ids": ["65f0a1b2c3d4e5f601234567"], "all": true}"#,
            r#"{"ids": []}"#,
            r#"{"ids": ["not-an-id"]}"#,
            r#"["65f0a1b2c3d4e5f601234567"]"#,
            "ids=65f0a1b2c3d4e5f601234567",
        ] {
            assert!(
                matches!(
                    parse_requeue(&headers, body.as_bytes()),
                    Err(OpsError::BadRequest(_))
                ),
                "{body}"
            );
        }
    }
}
