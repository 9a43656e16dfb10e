//! Axum and Tower integration for relaybus: a database transaction per request, on MongoDB or
//! PostgreSQL, in which routes write their data and publish their events, committed with the
//! response.
//!
//! - [`RequestTxLayer`] gives each request a transaction, started lazily on first use and
//!   committed on 1xx–3xx or aborted on 4xx/5xx, a panic or a dropped request.
//! - [`Publisher`] publishes events into it, and lends its session for the route's own writes;
//!   [`Tx`] gives the session alone.
//! - [`IdempotencyLayer`] makes requests with an `Idempotency-Key` header idempotent: the first
//!   runs, and its answer, stored in its transaction, is replayed to every repeat.
//! - [`DispatcherService`] runs the bus's dispatcher next to `axum::serve` and shuts both down
//!   gracefully on SIGINT or SIGTERM.
//! - [`ops::router`] answers operators: statistics, deliveries, requeueing dead letters.
//!
//! The store is a feature: `mongodb` (on by default), `postgres`, `memory`. The types take the
//! store as a parameter, MongoDB by default; [`postgres`], [`mongo`] and [`memory`] name them for
//! one store (`relaybus_axum::postgres::Publisher`). The [`guide`] has the
//! [Axum guide](guide::axum) and the [operator page's](guide::operator_page).
//!
//! # Example
//!
//! A route on PostgreSQL is in the [`postgres`] module's documentation, and a whole service on
//! each store in the README. On MongoDB, the default:
//!
//! ```no_run
//! use axum::{Router, http::StatusCode, routing::post};
//! use mongodb::bson::{Document, doc};
//! use relaybus::{MongoEventStore, RelayBus};
//! use relaybus_axum::{DispatcherService, Publisher, ops::NestOps};
//! use serde::{Deserialize, Serialize};
//!
//! #[derive(Serialize, Deserialize)]
//! struct OrderPlaced {
//!     order_id: String,
//! }
//!
//! impl relaybus::Event for OrderPlaced {
//!     const TYPE: &'static str = "order.placed.v1";
//! }
//!
//! async fn place_order(mut publisher: Publisher) -> Result<StatusCode, StatusCode> {
//!     let orders = publisher.bus().store().database().collection::<Document>("orders");
//!     orders
//!         .insert_one(doc! { "_id": "o-1", "total_cents": 1250 })
//!         .session(publisher.session())
//!         .await
//!         .map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?;
//!     publisher
//!         .publish(&OrderPlaced { order_id: "o-1".into() })
//!         .await
//!         .map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?;
//!     Ok(StatusCode::CREATED) // commits the order and its event together
//! }
//!
//! # async fn example() -> Result<(), Box<dyn std::error::Error>> {
//! let client = mongodb::Client::with_uri_str("mongodb://127.0.0.1:27017/?replicaSet=rs0").await?;
//! let store = MongoEventStore::builder(client).database("shop").build()?;
//! let bus = RelayBus::builder(store).build()?;
//!
//! let (state, layer) = relaybus_axum::setup(bus.clone())?;
//! let app = Router::new()
//!     .route("/orders", post(place_order))
//!     .layer(layer)
//!     .with_state(state)
//!     .nest_ops("/ops", relaybus_axum::ops::router(bus.clone())); // behind your auth
//!
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:3000").await?;
//! DispatcherService::new(bus).serve(listener, app).await?;
//! # Ok(())
//! # }
//! ```
//!
//! # Usage
//!
//! [`setup`] returns the router state and the layer of one bus; the state ([`RelayState`])
//! gives [`Publisher`] the bus, through [`FromRef`](axum::extract::FromRef) when the router
//! has a state of its own, and the layer gives it the transaction. Add the layer after the
//! routes that use the extractors (see [`RequestTxLayer`], "Ordering"). [`config`] sets the
//! options first: the [`CommitPolicy`], the `Retry-After` of a failed commit, the time budget.
//!
//! One extractor holds the request's session at a time: a handler takes one [`Publisher`]
//! (or one [`Tx`]), and a second extraction while the first is held fails with a 500 instead
//! of waiting for ever.
//!
//! # Commit and its failures
//!
//! The transaction is resolved after the handler answered and before the response leaves,
//! so a client that sees a success sees its data committed. The commit is bounded by the time
//! budget (the bus's transaction timeout by default). A commit that fails replaces the response:
//! with a 503 and `Retry-After` when trying again may work (a write conflict, a timeout), with
//! a 500 otherwise; [`transaction::error::CommitError`] lists the cases and what was committed
//! in each.
//!
//! A transaction that fails with a transient error, at commit or in the route (a response
//! marked [`RetryRequest`], as [`PublishError`] marks its 503s), does not reach the client: the
//! layer aborts it and runs the route again on a kept copy of the request, in a new
//! transaction, up to [`Config::request_attempts`] runs within one time budget. So publishers
//! of one hot ordering key wait for each other instead of answering 503. The route may
//! therefore run more than once, as the body of `RelayBus::transaction` may.
//!
//! # Error handling
//!
//! Rejections ([`rejection`]) and commit errors answer with a short text that leaves database
//! details out, and log them. A missing layer answers 500 with "no request transaction; add
//! `relaybus_axum::RequestTxLayer` to the router". To shape the rejection responses, give the
//! extractors an error type of yours: `Publisher<MyError>` where
//! `MyError: From<PublisherRejection> + IntoResponse`.

#![cfg_attr(docsrs, feature(doc_cfg))]

mod aliases;
mod config;
mod dispatcher;
pub mod guide;
pub mod idempotency;
#[doc(hidden)]
#[cfg(any(feature = "mongodb", feature = "postgres", feature = "memory"))]
pub mod instances;
pub mod ops;
mod publisher;
pub mod rejection;
pub mod transaction;
mod tx;

pub use config::{CommitPolicy, Config, RelayState};
pub use dispatcher::{DispatcherService, ServeError, serve};
pub use idempotency::IdempotencyLayer;
pub use publisher::{PublishError, Publisher};
pub use transaction::{RequestTx, RequestTxLayer, RetryRequest};
pub use tx::Tx;

#[cfg(feature = "memory")]
pub use aliases::memory;
#[cfg(feature = "mongodb")]
pub use aliases::mongo;
#[cfg(feature = "postgres")]
pub use aliases::postgres;

use relaybus::{ConfigurationError, RelayBus, Store};

/// The router state and the layer of `bus`, with the default options: commit on 1xx–3xx,
/// `Retry-After: 1` on a failed commit, the bus's transaction timeout as the budget.
///
/// # Errors
///
/// [`ConfigurationError::InvalidOption`] when the bus's transaction timeout is out of range.
pub fn setup<S: Store>(
    bus: RelayBus<S>,
) -> Result<(RelayState<S>, RequestTxLayer<S>), ConfigurationError> {
    config(bus).setup()
}

/// The options of the request transactions of `bus`, to set before [`Config::setup`].
pub fn config<S: Store>(bus: RelayBus<S>) -> Config<S> {
    Config::new(bus)
}
