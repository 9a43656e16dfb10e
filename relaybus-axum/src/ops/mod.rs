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
    Router,
    routing::{get, post},
};
use relaybus::{RelayBus, Store};

mod check;
mod deliveries;
mod error;
mod lanes;
mod model;
mod mount;
mod overview;
mod page;
mod secure;
mod writes;

pub use mount::NestOps;

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
            .route("/statistics", get(overview::statistics::<St>))
            .route("/handlers", get(overview::handlers::<St>))
            .route("/activity", get(overview::activity::<St>))
            .route("/schedules", get(overview::schedules::<St>))
            .route("/deliveries", get(deliveries::deliveries::<St>))
            .route("/events/{event_id}", get(deliveries::event::<St>))
            .route("/dead-letters", get(deliveries::dead_letters::<St>))
            .route("/lanes", get(lanes::lanes::<St>))
            .route("/deliveries/requeue", post(writes::requeue::<St>))
            .route("/deliveries/discard", post(writes::discard::<St>))
            .route("/deliveries/bury", post(writes::bury::<St>))
            .route("/", get(page::index))
            .route("/assets/ops.js", get(page::script))
            .route("/assets/ops.css", get(page::style))
            .method_not_allowed_fallback(error::method_not_allowed)
            .fallback(error::not_found)
            .layer(axum::middleware::map_response(secure::secure))
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
