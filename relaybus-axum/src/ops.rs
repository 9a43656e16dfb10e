//! The operator page and the JSON routes behind it: counts, listings, event detail, lanes,
//! dead letters by error, and requeueing, discarding or burying deliveries.
//!
//! [`router`] has no authentication of its own: mount it behind yours.
//!
//! # The page
//!
//! `GET /` (the path the router is nested at, `/ops` in the example) is a page for people, with
//! no build step and nothing loaded from elsewhere: its script and style sheet are embedded in
//! this crate and served at `/assets/ops.js` and `/assets/ops.css`. It has
//!
//! - an **overview** per handler: waiting, running, parked and dead deliveries, the age of the
//!   oldest due one, and this process's runs of the last hour (succeeded, failed,
//!   dead-lettered, minute by minute); completed deliveries when completion history is on, and
//!   a note saying why they are not counted when it is off;
//! - a **deliveries browser** filtering by handler, state (waiting, running, parked, dead,
//!   completed), event type, key, event id, error text and creation time, paged by cursor, the
//!   filters kept in the URL;
//! - the **event detail**: payload, headers, every handler's delivery with its attempts and
//!   error history;
//! - **dead letters grouped by error**, each group requeued or discarded as a whole, and in the
//!   browser a selection or everything matching the filter, always behind a confirmation;
//! - the **lanes**: holders, lease expiries, in-flight counts, and the keys whose deliveries
//!   are parked, with the delivery they wait for;
//! - the **schedules** of the bus: when each ticks, its missed-ticks policy, and its last and
//!   next ticks;
//! - **live refresh**, polling every 5 seconds, paused while the tab is hidden.
//!
//! A read-only router ([`Ops::read_only`]) shows no write buttons.
//!
//! # The JSON routes
//!
//! | Route | Answers |
//! |---|---|
//! | `GET /statistics` | `{"pending", "running", "parked", "dead", "completed", "completion_history", "oldest_due_at"}`; `completed` is `null`, with `completed_note`, without completion history |
//! | `GET /handlers` | `{"handlers": [{"handler", "waiting", "running", "parked", "dead", "oldest_due_at", "oldest_due_age_seconds", "last_hour": {"succeeded", "failed", "dead_lettered"}}, ..]}`: every handler the bus runs, and any other with deliveries; `last_hour` counts this process's runs |
//! | `GET /activity` | `{"handlers": [{"handler", "succeeded", "failed", "dead_lettered", "minutes": [..]}, ..]}`: this process's last hour |
//! | `GET /deliveries` | `{"deliveries": [..], "limit", "next_after"}`, oldest first |
//! | `GET /events/{event_id}` | `{"event": {"id", "type", "key", "sequence", "headers", "payload", "created_at", "completed_at", "handlers", ..}, "deliveries": [..]}`, 404 for an unknown id |
//! | `GET /dead-letters` | `{"groups": [{"handler", "error", "count", "first_created_at", "last_updated_at", "sample_id"}, ..]}`, the largest first; `?handler=` narrows it |
//! | `GET /lanes` | `{"lanes": [{"lane", "owner", "lease_expires_at", "held", "in_flight", "lost", "epoch"}, ..], "blocked": [{"handler", "key", "parked", "first_parked_sequence", "waiting_for"}, ..]}` |
//! | `GET /schedules` | `{"schedules": [{"id", "event_type", "cadence", "missed", "last_tick", "next_tick"}, ..]}`: the bus's schedules; `last_tick` is the latest tick whose event the store holds (looking back over the last 16 ticks within the schedule's catch-up window), whichever bus published it, `null` when none of them was |
//! | `POST /deliveries/requeue` | `{"requeued": [..], "blocked": [..], "not_found": [..], "more"}` |
//! | `POST /deliveries/discard` | `{"discarded": [..], "not_found": [..], "more"}` |
//! | `POST /deliveries/bury` | `{"buried": [..], "running": [..], "not_found": [..]}` |
//!
//! `GET /deliveries` takes the query parameters `status` (`pending`, `waiting`, `running`,
//! `parked`, `dead` or `completed`), `handler`, `event_type`, `key`, `event_id`, `error` (text
//! the last error contains, whatever its case), `last_error` (the whole last error, as a group
//! of `GET /dead-letters` names it), `created_from` and `created_before` (RFC 3339 times),
//! `after` (the id of the last record of the previous page) and `limit` (1 to 1,000, 100 by
//! default); `next_after` is the `after` of the next page, or `null` on the last one. Every page
//! costs the same, however deep it is. Each record carries whether it runs now, its error
//! history (`errors`, the last 10 failed attempts) and how often it was requeued.
//!
//! The two writes take a JSON body naming dead letters in one of three ways:
//! `{"ids": ["<delivery id>", ..]}` (1 to 1,000 of the `id`s `GET /deliveries` lists), `{"filter": {"handler", "event_type",
//! "key", "event_id", "error", "last_error", "created_from", "created_before"}}` (at least one
//! field), or `{"all": true}`; an empty filter is refused, so that "everything" is always said
//! explicitly. A filter or `all` takes at most 10,000 dead letters per call, and `more` says
//! whether others are left. Discarding deletes dead letters for good (see
//! [`Operate::discard`](relaybus::store::Operate::discard)). `POST /deliveries/bury` takes
//! `{"ids": [..], "reason": "why"}` and buries pending deliveries that no worker runs, to free a
//! key stuck behind one that will never succeed (see [`RelayBus::bury`]).
//!
//! # Safety
//!
//! - Every write needs the header [`WRITE_HEADER`] (`x-relaybus-ops: 1`) and a
//!   `Content-Type: application/json` body, which a page of another site cannot send: no
//!   cross-site request forgery.
//! - [`config`]`(bus).read_only(true)` refuses every write with 403.
//! - Every answer is sent with `Cache-Control: no-store`, `X-Frame-Options: DENY`,
//!   `X-Content-Type-Options: nosniff`, `Referrer-Policy: no-referrer` and a
//!   `Content-Security-Policy` that cannot be framed: the JSON routes load nothing, the page
//!   only its own script, style sheet and calls (no inline script, no `eval`). The page builds
//!   its DOM from text alone, so nothing stored is ever read as HTML.
//! - Every write is logged at `INFO` (target `relaybus::ops`) with what it selected and what it
//!   changed.
//!
//! Every input is checked before any database call, and anything else is refused with 400 and
//! `{"error": "..."}` saying what is accepted: unknown or repeated parameters, values of the
//! wrong type (an object or array where a string belongs, as in `{"ids": [{"$ne": null}]}` or
//! `?handler[$ne]=x`), names that no handler or event type can have. Other refusals answer
//! with the same JSON shape: 403 for a write without its header or on read-only routes, 415 for
//! a body that is not JSON, 413 for a body over the router's limit, 405 for a wrong method and
//! 404 for an unknown route. A failure of the store answers 500 without its details, which are
//! logged.
//!
//! # Example
//!
//! ```no_run
//! # fn example(bus: relaybus::RelayBus) {
//! use axum::Router;
//! use relaybus_axum::ops::NestOps;
//!
//! # let require_operator = tower::layer::util::Identity::new();
//! let app: Router = Router::new()
//!     // .route(..) for the application
//!     .nest_ops("/ops", relaybus_axum::ops::router(bus).layer(require_operator));
//! # }
//! ```
//!
//! [`NestOps::nest_ops`] nests as [`Router::nest`] does and also answers `/ops/`, which axum's
//! own `nest` leaves to the application's 404.

use axum::{
    Json, Router,
    body::Bytes,
    extract::{Query, RawQuery, State, rejection::BytesRejection},
    http::{HeaderMap, StatusCode, header::CONTENT_TYPE},
    response::{IntoResponse, Response},
    routing::{get, post},
};
use relaybus::{
    DeliveryQuery, DeliveryRecord, DeliveryStatus, PendingState, RelayBus, Store, Timestamp,
};
use serde::Deserialize;
use serde_json::{Value, json};

mod mount;
mod page;

pub use mount::NestOps;

/// The most records per page.
const MAX_LIMIT: u32 = 1_000;
/// The most ids per requeue.
const MAX_REQUEUE_IDS: usize = 1_000;

/// The operator routes of `bus`, to nest under a path of your choice behind your own
/// authentication; see the [module docs](self). Writes are allowed; [`config`] makes them
/// read-only.
pub fn router<S, St: Store>(bus: RelayBus<St>) -> Router<S>
where
    S: Clone + Send + Sync + 'static,
{
    config(bus).router()
}

/// The options of the operator routes of `bus`, to set before [`Ops::router`].
pub fn config<St: Store>(bus: RelayBus<St>) -> Ops<St> {
    Ops {
        bus,
        read_only: false,
    }
}

/// The operator routes' options; made by [`config`].
#[derive(Debug, Clone)]
#[must_use]
pub struct Ops<St: Store> {
    bus: RelayBus<St>,
    read_only: bool,
}

impl<St: Store> Ops<St> {
    /// Refuses every write (requeue, discard) with 403: for a view that only observes.
    pub fn read_only(mut self, read_only: bool) -> Self {
        self.read_only = read_only;
        self
    }

    /// The routes, to nest behind your own authentication.
    pub fn router<S>(self) -> Router<S>
    where
        S: Clone + Send + Sync + 'static,
    {
        let state = OpsState {
            bus: self.bus,
            read_only: self.read_only,
        };
        Router::new()
            .route("/statistics", get(statistics::<St>))
            .route("/handlers", get(handlers::<St>))
            .route("/deliveries", get(deliveries::<St>))
            .route("/deliveries/requeue", post(requeue::<St>))
            .route("/deliveries/discard", post(discard::<St>))
            .route("/deliveries/bury", post(bury::<St>))
            .route("/events/{event_id}", get(event::<St>))
            .route("/lanes", get(lanes::<St>))
            .route("/dead-letters", get(dead_letters::<St>))
            .route("/activity", get(activity::<St>))
            .route("/schedules", get(schedules::<St>))
            .route("/", get(page::index))
            .route("/assets/ops.js", get(page::script))
            .route("/assets/ops.css", get(page::style))
            .method_not_allowed_fallback(method_not_allowed)
            .fallback(not_found)
            .layer(axum::middleware::map_response(secure))
            .with_state(state)
    }
}

/// What the routes share.
#[derive(Debug, Clone)]
struct OpsState<St: Store> {
    bus: RelayBus<St>,
    read_only: bool,
}

impl<St: Store> axum::extract::FromRef<OpsState<St>> for RelayBus<St> {
    fn from_ref(state: &OpsState<St>) -> Self {
        state.bus.clone()
    }
}

/// The header every write must carry, with the value `1`: a page of another site cannot set
/// it on a request to this one.
pub const WRITE_HEADER: &str = "x-relaybus-ops";

/// Headers of every answer: never cached, never framed, never sniffed, no content loaded.
async fn secure(mut response: Response) -> Response {
    use axum::http::{HeaderValue, header};
    let headers = response.headers_mut();
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    headers.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    headers.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    if !headers.contains_key(header::CONTENT_SECURITY_POLICY) {
        headers.insert(
            header::CONTENT_SECURITY_POLICY,
            HeaderValue::from_static("default-src 'none'; frame-ancestors 'none'"),
        );
    }
    headers.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    response
}

async fn method_not_allowed() -> OpsError {
    OpsError::Refused(
        StatusCode::METHOD_NOT_ALLOWED,
        "this route takes another method: GET /, GET /statistics, GET /handlers, \
         GET /activity, GET /deliveries, GET /events/{event_id}, GET /dead-letters, GET /lanes, \
         POST /deliveries/requeue, POST /deliveries/discard, POST /deliveries/bury"
            .to_owned(),
    )
}

async fn not_found() -> OpsError {
    OpsError::Refused(
        StatusCode::NOT_FOUND,
        "no such operator route; the routes are GET / (the page), GET /statistics, \
         GET /handlers, GET /activity, GET /deliveries, GET /events/{event_id}, \
         GET /dead-letters, GET /lanes, POST /deliveries/requeue, POST /deliveries/discard and \
         POST /deliveries/bury"
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
    let mut answer = json!({
        "pending": stats.pending,
        "running": stats.running,
        "parked": stats.parked,
        "dead": stats.dead,
        "completed": stats.completed,
        "completion_history": stats.completion_history,
        "oldest_due_at": stats.oldest_due_at.map(rfc3339),
    });
    if !stats.completion_history {
        answer["completed"] = Value::Null;
        answer["completed_note"] = json!(COMPLETED_NOTE);
    }
    Ok(Json(answer))
}

/// Why `completed` is `null`.
const COMPLETED_NOTE: &str = "completed deliveries are deleted and not counted: turn on \
                              completion history on the store to count and list them";

/// The query string of `GET /deliveries`, every value still text.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct ListParams {
    status: Option<String>,
    handler: Option<String>,
    event_type: Option<String>,
    key: Option<String>,
    event_id: Option<String>,
    error: Option<String>,
    last_error: Option<String>,
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
    let params = list_params(raw)?;
    let mut query = DeliveryQuery::new();
    if let Some(status) = params.status {
        query = match status.as_str() {
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
        };
    }
    query = filtered(
        query,
        &Filter {
            handler: params.handler,
            event_type: params.event_type,
            key: params.key,
            event_id: params.event_id,
            error: params.error,
            last_error: params.last_error,
            created_from: params.created_from,
            created_before: params.created_before,
        },
    )?;
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

fn list_params(raw: Option<&str>) -> Result<ListParams, OpsError> {
    parse_query(
        raw,
        "status, handler, event_type, key, event_id, error, last_error, created_from, \
         created_before, after and limit",
    )
}

/// Reads a query string with axum's [`Query`], which refuses unknown keys (where
/// `handler[$ne]=x` ends up) and repeated ones; `known` names the parameters.
fn parse_query<T: serde::de::DeserializeOwned + Default>(
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

/// The filter of a listing, a requeue or a discard: every field optional, each checked.
#[derive(Debug, Default, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct Filter {
    handler: Option<String>,
    event_type: Option<String>,
    key: Option<String>,
    event_id: Option<String>,
    /// Text the last error contains, whatever its case.
    error: Option<String>,
    /// The last error exactly: a group of `GET /dead-letters`.
    last_error: Option<String>,
    created_from: Option<String>,
    created_before: Option<String>,
}

impl Filter {
    fn is_empty(&self) -> bool {
        self.handler.is_none()
            && self.event_type.is_none()
            && self.key.is_none()
            && self.event_id.is_none()
            && self.error.is_none()
            && self.last_error.is_none()
            && self.created_from.is_none()
            && self.created_before.is_none()
    }
}

/// Refuses a text that is empty, longer than `max` bytes, or holds control characters.
fn check_text(name: &str, value: &str, max: usize, what: &str) -> Result<(), OpsError> {
    if value.is_empty() || value.len() > max || value.chars().any(char::is_control) {
        return Err(bad(format!(
            "`{name}` must be {what}: 1 to {max} bytes without control characters"
        )));
    }
    Ok(())
}

/// `query` narrowed by `filter`, every value checked first.
fn filtered(mut query: DeliveryQuery, filter: &Filter) -> Result<DeliveryQuery, OpsError> {
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
        "running": record.running,
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

/// The body of `POST /deliveries/requeue` and `POST /deliveries/discard`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct WriteBody {
    ids: Option<Vec<String>>,
    filter: Option<Filter>,
    all: Option<bool>,
}

/// The dead letters a write names.
#[derive(Debug)]
enum Selection {
    /// These ids.
    Ids(Vec<String>),
    /// Every dead letter this filter matches.
    Filter(Filter),
    /// Every dead letter, as asked for with `"all": true`.
    All,
}

const WRITE_SHAPES: &str = "send {\"ids\": [\"<delivery id>\", ..]}, {\"filter\": {\"handler\", \
                            \"event_type\", \"key\", \"event_id\", \"error\", \"last_error\", \
                            \"created_from\", \"created_before\"}} or {\"all\": true}";

/// Whether the request says its body is JSON.
fn is_json(headers: &HeaderMap) -> bool {
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

fn parse_write(headers: &HeaderMap, body: &[u8]) -> Result<Selection, OpsError> {
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

/// The most dead letters one write by filter takes; the answer says when more are left.
const MAX_SELECTED: usize = 10_000;

/// The ids of the dead letters a selection names, at most [`MAX_SELECTED`], and whether more
/// match.
async fn select<St: Store>(
    bus: &RelayBus<St>,
    selection: &Selection,
) -> Result<(Vec<String>, bool), OpsError> {
    let filter = match selection {
        Selection::Ids(ids) => return Ok((ids.clone(), false)),
        Selection::Filter(filter) => filter.clone(),
        Selection::All => Filter::default(),
    };
    let base = filtered(DeliveryQuery::new().status(DeliveryStatus::Dead), &filter)?;
    let mut ids = Vec::new();
    let mut after: Option<String> = None;
    loop {
        let mut page = base.clone().limit(MAX_LIMIT);
        if let Some(after) = &after {
            page = page.after(after.clone());
        }
        let records = bus
            .store()
            .list_deliveries(&page)
            .await
            .map_err(OpsError::Store)?;
        let full = records.len() == MAX_LIMIT as usize;
        after = records.last().map(|last| last.id.clone());
        ids.extend(records.into_iter().map(|record| record.id));
        if ids.len() >= MAX_SELECTED {
            let more = ids.len() > MAX_SELECTED || full;
            ids.truncate(MAX_SELECTED);
            return Ok((ids, more));
        }
        if !full {
            return Ok((ids, false));
        }
    }
}

/// Refuses a write of a read-only router, or one without [`WRITE_HEADER`].
fn check_write<St: Store>(state: &OpsState<St>, headers: &HeaderMap) -> Result<(), OpsError> {
    if state.read_only {
        return Err(OpsError::Refused(
            StatusCode::FORBIDDEN,
            "these operator routes are read-only".to_owned(),
        ));
    }
    if headers.get(WRITE_HEADER).and_then(|v| v.to_str().ok()) != Some("1") {
        return Err(OpsError::Refused(
            StatusCode::FORBIDDEN,
            format!(
                "a write needs the header `{WRITE_HEADER}: 1`, which a page of another site \
                 cannot send"
            ),
        ));
    }
    Ok(())
}

/// The body of a write, or the refusal of one that could not be read.
fn write_body(body: Result<Bytes, BytesRejection>) -> Result<Bytes, OpsError> {
    body.map_err(|rejection| {
        OpsError::Refused(
            rejection.status(),
            format!("{}; {WRITE_SHAPES}", rejection.body_text()),
        )
    })
}

/// A requeue's or discard's checks, then the dead letters it names: the selection, their ids
/// and whether more match.
async fn selected<St: Store>(
    state: &OpsState<St>,
    headers: &HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<(Selection, Vec<String>, bool), OpsError> {
    check_write(state, headers)?;
    let selection = parse_write(headers, &write_body(body)?)?;
    let (ids, more) = select(&state.bus, &selection).await?;
    Ok((selection, ids, more))
}

async fn requeue<St: Store>(
    State(state): State<OpsState<St>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, OpsError> {
    let (selection, ids, more) = selected(&state, &headers, body).await?;
    let outcome = state
        .bus
        .store()
        .requeue(&ids, state.bus.now())
        .await
        .map_err(OpsError::Store)?;
    tracing::info!(
        target: "relaybus::ops",
        selection = ?selection,
        requeued = ?outcome.requeued,
        blocked = ?outcome.blocked,
        not_found = outcome.not_found.len(),
        "an operator requeued dead letters"
    );
    Ok(Json(json!({
        "requeued": outcome.requeued,
        "blocked": outcome.blocked,
        "not_found": outcome.not_found,
        "more": more,
    })))
}

async fn discard<St: Store>(
    State(state): State<OpsState<St>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, OpsError> {
    let (selection, ids, more) = selected(&state, &headers, body).await?;
    let outcome = state
        .bus
        .store()
        .discard(&ids, state.bus.now())
        .await
        .map_err(OpsError::Store)?;
    tracing::info!(
        target: "relaybus::ops",
        selection = ?selection,
        discarded = ?outcome.discarded,
        not_found = outcome.not_found.len(),
        "an operator discarded dead letters"
    );
    Ok(Json(json!({
        "discarded": outcome.discarded,
        "not_found": outcome.not_found,
        "more": more,
    })))
}

/// The body of `POST /deliveries/bury`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct BuryBody {
    ids: Vec<String>,
    reason: String,
}

async fn bury<St: Store>(
    State(state): State<OpsState<St>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, OpsError> {
    check_write(&state, &headers)?;
    let body = write_body(body)?;
    if !is_json(&headers) {
        return Err(OpsError::NotJson);
    }
    let BuryBody { ids, reason } = serde_json::from_slice(&body).map_err(|e| {
        bad(format!(
            "{e}; send {{\"ids\": [\"<delivery id>\", ..], \"reason\": \"why\"}}"
        ))
    })?;
    check_ids(&ids)?;
    if reason.trim().is_empty() || reason.len() > 1024 {
        return Err(bad(
            "`reason` must say, in 1 to 1024 bytes, why the deliveries are buried",
        ));
    }
    let outcome = state
        .bus
        .bury(&ids, &reason)
        .await
        .map_err(OpsError::Store)?;
    tracing::info!(
        target: "relaybus::ops",
        %reason,
        buried = ?outcome.buried,
        running = ?outcome.running,
        not_found = outcome.not_found.len(),
        "an operator buried pending deliveries"
    );
    Ok(Json(json!({
        "buried": outcome.buried,
        "running": outcome.running,
        "not_found": outcome.not_found,
    })))
}

async fn handlers<St: Store>(State(bus): State<RelayBus<St>>) -> Result<Json<Value>, OpsError> {
    let statistics = bus
        .store()
        .handler_statistics()
        .await
        .map_err(OpsError::Store)?;
    let activity = bus.activity();
    // Every handler this bus runs, and any other with deliveries in the store: a handler whose
    // work has all finished has no statistics row, and is still worth seeing.
    let mut names: Vec<&str> = bus
        .subscriptions()
        .iter()
        .map(|subscription| subscription.id())
        .chain(statistics.iter().map(|h| h.handler.as_str()))
        .collect();
    names.sort_unstable();
    names.dedup();
    let now = bus.now();
    Ok(Json(json!({
        "handlers": names.iter().map(|name| {
            let counts = statistics.iter().find(|h| h.handler == *name);
            let recent = activity.iter().find(|h| h.handler == *name);
            let pending = counts.map_or(0, |h| h.pending);
            let running = counts.map_or(0, |h| h.running);
            let parked = counts.map_or(0, |h| h.parked);
            let oldest_due_at = counts.and_then(|h| h.oldest_due_at);
            let subscription = bus.subscriptions().iter().find(|s| s.id() == *name);
            let limits = subscription.map(|s| json!({
                "global_concurrency": s.global_concurrency_limit(),
                "concurrency_partitioned": s.is_concurrency_partitioned(),
                "rate_limit": s.rate().map(|(starts, interval)| json!({
                    "starts": starts,
                    "interval_ms": interval.as_millis() as u64,
                })),
                "batch": s.batch_limits().map(|(max, wait)| json!({
                    "max": max,
                    "wait_ms": wait.as_millis() as u64,
                })),
            }));
            json!({
                "handler": name,
                "limits": limits,
                "waiting": pending.saturating_sub(running).saturating_sub(parked),
                "running": running,
                "parked": parked,
                "dead": counts.map_or(0, |h| h.dead),
                "oldest_due_at": oldest_due_at.map(rfc3339),
                "oldest_due_age_seconds": oldest_due_at.map(|due| now.duration_since(due).as_secs_f64()),
                "last_hour": {
                    "succeeded": recent.map_or(0, |h| h.succeeded),
                    "failed": recent.map_or(0, |h| h.failed),
                    "dead_lettered": recent.map_or(0, |h| h.dead_lettered),
                },
            })
        }).collect::<Vec<_>>(),
    })))
}

async fn event<St: Store>(
    State(bus): State<RelayBus<St>>,
    path: Result<axum::extract::Path<String>, axum::extract::rejection::PathRejection>,
) -> Result<Json<Value>, OpsError> {
    let axum::extract::Path(event_id) = path.map_err(|rejection| {
        bad(format!(
            "{}; ask for /events/<event id>",
            rejection.body_text()
        ))
    })?;
    check_text("event_id", &event_id, 256, "an event id")?;
    let detail = bus
        .store()
        .event_detail(&event_id)
        .await
        .map_err(OpsError::Store)?
        .ok_or_else(|| {
            OpsError::Refused(
                StatusCode::NOT_FOUND,
                "no event has this id: it was never published, or it was purged".to_owned(),
            )
        })?;
    let event = &detail.event;
    Ok(Json(json!({
        "event": {
            "id": event.id(),
            "type": event.event_type(),
            "key": event.key(),
            "sequence": detail.sequence,
            "correlation_id": event.correlation_id(),
            "causation_id": event.causation_id(),
            "headers": event.headers(),
            "payload": event.payload(),
            "created_at": rfc3339(event.created_at()),
            "completed_at": detail.completed_at.map(rfc3339),
            "handlers": detail.handlers,
        },
        "deliveries": detail.deliveries.iter().map(record_json).collect::<Vec<_>>(),
    })))
}

async fn lanes<St: Store>(State(bus): State<RelayBus<St>>) -> Result<Json<Value>, OpsError> {
    let report = bus.store().lanes().await.map_err(OpsError::Store)?;
    let now = bus.now();
    Ok(Json(json!({
        "lanes": report.lanes.iter().map(|lane| json!({
            "lane": lane.lane,
            "owner": lane.owner,
            "lease_expires_at": lane.lease_expires_at.map(rfc3339),
            "held": lane.owner.is_some() && lane.lease_expires_at.is_some_and(|at| at > now),
            "in_flight": lane.in_flight,
            "lost": lane.lost,
            "epoch": lane.epoch,
        })).collect::<Vec<_>>(),
        "blocked": report.blocked.iter().map(|key| json!({
            "handler": key.handler,
            "key": key.key,
            "parked": key.parked,
            "first_parked_sequence": key.first_parked_sequence,
            "waiting_for": key.waiting_for.as_ref().map(record_json),
        })).collect::<Vec<_>>(),
    })))
}

/// The query string of `GET /dead-letters`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct GroupParams {
    handler: Option<String>,
}

async fn dead_letters<St: Store>(
    State(bus): State<RelayBus<St>>,
    RawQuery(raw): RawQuery,
) -> Result<Json<Value>, OpsError> {
    let params: GroupParams = parse_query(raw.as_deref(), "handler")?;
    if let Some(handler) = &params.handler {
        relaybus::validate_handler_id(handler).map_err(|e| bad(format!("`handler`: {e}")))?;
    }
    let groups = bus
        .store()
        .dead_letter_groups(params.handler.as_deref())
        .await
        .map_err(OpsError::Store)?;
    Ok(Json(json!({
        "groups": groups.iter().map(|group| json!({
            "handler": group.handler,
            "error": group.error,
            "count": group.count,
            "first_created_at": group.first_created_at.map(rfc3339),
            "last_updated_at": group.last_updated_at.map(rfc3339),
            "sample_id": group.sample_id,
        })).collect::<Vec<_>>(),
    })))
}

async fn schedules<St: Store>(State(bus): State<RelayBus<St>>) -> Result<Json<Value>, OpsError> {
    let statuses = bus.schedule_statuses().await.map_err(OpsError::Store)?;
    Ok(Json(json!({
        "schedules": statuses.iter().map(|status| json!({
            "id": status.id,
            "event_type": status.event_type,
            "cadence": status.cadence,
            "missed": status.missed.to_string(),
            "last_tick": status.last_tick.map(rfc3339),
            "next_tick": status.next_tick.map(rfc3339),
        })).collect::<Vec<_>>(),
    })))
}

async fn activity<St: Store>(State(bus): State<RelayBus<St>>) -> Json<Value> {
    Json(json!({
        "scope": "this process, the last hour",
        "handlers": bus.activity().iter().map(|handler| json!({
            "handler": handler.handler,
            "succeeded": handler.succeeded,
            "failed": handler.failed,
            "dead_lettered": handler.dead_lettered,
            "minutes": handler.minutes.iter().map(|minute| json!({
                "start": rfc3339(minute.start),
                "succeeded": minute.succeeded,
                "failed": minute.failed,
                "dead_lettered": minute.dead_lettered,
            })).collect::<Vec<_>>(),
        })).collect::<Vec<_>>(),
    }))
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
