//! Procedural macros for relaybus: `#[event]`, `#[handler]` and `#[schedule]`.
//!
//! Use them through the `relaybus` crate (`#[relaybus::event]`, `#[relaybus::handler]`), whose
//! `macros` feature, on by default, re-exports them; a crate that uses them depends on relaybus
//! alone. The generated code refers to `::relaybus::__private`, which exists only in the version
//! of relaybus this crate is released with (relaybus pins it with `=`).

mod attr;
mod ctxt;
mod event;
mod handler;
mod rules;
mod schedule;

use proc_macro::TokenStream;

/// Declares an event type: implements `relaybus::Event` with the given type name and lists the
/// type in `relaybus::registry`.
///
/// # Syntax
///
/// ```text
/// #[event("<aggregate>.<past-tense verb>.v<N>")]
/// #[event("<type name>", crate = path::to::relaybus)]
/// ```
///
/// - The **type name** comes first, as a string literal. It is checked at compile time by the rule
///   of `relaybus::event::check_type_name`: dot-separated segments of lowercase ASCII letters,
///   digits, `_` and `-`, each starting with a letter or digit, 128 bytes at most. It is the
///   name stored with every event, so it never changes: a new version of an event is a new type
///   with a new name (`order.placed.v2`).
/// - `crate = path` names the relaybus crate when it is not `::relaybus`, for example when it is
///   re-exported by another crate (`crate = ::platform::relaybus`; serde's spelling,
///   `crate = "::platform::relaybus"`, works too).
///
/// The attribute goes on a struct or an enum without generic parameters. The type must also be
/// what `Event` requires: `Serialize` and `Deserialize` (derive them; the derives may come before
/// or after the attribute), `Send`, `Sync` and `'static`; rustc reports what is missing at the
/// type's name. Its payload must serialize to a JSON object: a struct with named fields, or an
/// enum with `#[serde(tag = "...")]`.
///
/// Two types declared with one name anywhere in the binary make `RelayBusBuilder::build` (and
/// `relaybus::registry::check`) fail with `ConfigurationError::DuplicateEventType`, naming both.
///
/// # Example
///
/// ```
/// use relaybus::Event;
/// use serde::{Deserialize, Serialize};
///
/// #[relaybus::event("order.placed.v1")]
/// #[derive(Debug, Serialize, Deserialize)]
/// pub struct OrderPlaced {
///     pub order_id: String,
///     pub total_cents: u64,
/// }
///
/// #[relaybus::event("payment.settled.v1")]
/// #[derive(Debug, Serialize, Deserialize)]
/// #[serde(tag = "method", rename_all = "snake_case")]
/// pub enum PaymentSettled {
///     Card { last4: String },
///     Transfer { reference: String },
/// }
///
/// assert_eq!(OrderPlaced::TYPE, "order.placed.v1");
/// let registered = relaybus::registry::event("payment.settled.v1").unwrap();
/// assert!(registered.rust_type().ends_with("::PaymentSettled"));
/// ```
///
/// A name that breaks the rule does not compile, and the error points at the string:
///
/// ```compile_fail
/// #[relaybus::event("Order Placed")]
/// #[derive(serde::Serialize, serde::Deserialize)]
/// struct OrderPlaced {}
/// ```
#[proc_macro_attribute]
pub fn event(attr: TokenStream, item: TokenStream) -> TokenStream {
    event::expand(attr.into(), item.into()).into()
}

/// Declares a handler: an `async fn` that the bus runs once for every event of one type.
///
/// The function is left as written, so it stays a plain function that tests can call. Next to
/// it the attribute registers a `relaybus::registry::HandlerDescriptor`, and
/// `relaybus::RelayBus::builder` subscribes every registered handler unless told otherwise
/// (`without_registered_handlers`, `registered_handlers_where`).
///
/// # Syntax
///
/// ```text
/// #[handler(id = "projector")]
/// #[handler(id = "projector", transactional, unordered, max_attempts = 5,
///           initial_backoff_ms = 200, max_backoff_ms = 60_000, timeout_ms = 30_000,
///           crate = path::to::relaybus)]
/// ```
///
/// | Option | Meaning |
/// |---|---|
/// | `id = "..."` | Required. The handler id, a string literal of 1 to 128 ASCII letters, digits, `_`, `-`, `.` and `:`. Deliveries are stored under it, so keep it stable: renaming a handler orphans its pending deliveries. |
/// | `transactional` | Runs the handler in the store transaction that completes its delivery; `HandlerContext::session` gives the session, so its writes and the completion commit together or not at all. |
/// | `unordered` | Lets the handler's deliveries ignore the event's ordering key, as `Subscription::unordered` does: they run concurrently, and a slow or failing one does not hold back the next events of its key for this handler. The other handlers of the event keep the key's order. Combines with `transactional`. |
/// | `max_attempts = N` | Attempts in all before the delivery is buried, 1 to 1000. |
/// | `initial_backoff_ms = N` | The wait after the first failure, in milliseconds (at most a day). |
/// | `max_backoff_ms = N` | The longest wait, in milliseconds (at most a day). |
/// | `timeout_ms = N` | How long one attempt may run, in milliseconds (1 to a day); a longer attempt fails and is charged, as `Subscription::timeout` does. |
/// | `crate = path` | The relaybus crate, when it is not `::relaybus`. |
///
/// The retry options override the bus's retry policy for this handler; those left out keep the
/// values of `RetryPolicy::default()`. Each option may be given once.
///
/// The function must be
///
/// ```text
/// async fn name(event: E) -> Result<(), Err>
/// async fn name(event: E, context: HandlerContext) -> Result<(), Err>
/// ```
///
/// where `E` is an event type taken by value, and `Err` any error that converts into a
/// `relaybus::BoxError` (`BoxError` itself, `relaybus::Error`, `std::io::Error`, your own
/// `std::error::Error + Send + Sync + 'static` type). An `Err` fails the attempt, which is
/// retried or buried. The function is declared outside any `impl` block and is not generic,
/// `unsafe` or `const`; its future must be `Send`.
///
/// Two handlers with one id anywhere in the binary make `RelayBusBuilder::build` (and
/// `relaybus::registry::check`) fail with `ConfigurationError::DuplicateHandlerId`, naming both
/// functions.
///
/// # Example
///
/// ```no_run
/// use relaybus::mongodb::bson::{Document, doc};
/// use relaybus::{BoxError, HandlerContext, MongoEventStore, RelayBus};
/// use serde::{Deserialize, Serialize};
///
/// #[relaybus::event("order.placed.v1")]
/// #[derive(Debug, Serialize, Deserialize)]
/// pub struct OrderPlaced {
///     pub order_id: String,
/// }
///
/// /// Updates a read model in the transaction that completes the delivery.
/// #[relaybus::handler(id = "projector", transactional)]
/// async fn project(event: OrderPlaced, context: HandlerContext) -> Result<(), BoxError> {
///     let mut session = context.session().await?;
///     let orders = session.client().database("shop").collection::<Document>("order_views");
///     orders
///         .insert_one(doc! { "_id": &event.order_id, "status": "placed" })
///         .session(&mut *session)
///         .await?;
///     Ok(())
/// }
///
/// /// Sends a mail; up to 5 attempts, waiting from 1 second doubling up to 1 minute. Mails of
/// /// one order need no order among themselves.
/// #[relaybus::handler(id = "send-confirmation", unordered, max_attempts = 5, max_backoff_ms = 60_000)]
/// async fn send_confirmation(event: OrderPlaced) -> Result<(), std::io::Error> {
///     println!("confirming {}", event.order_id);
///     Ok(())
/// }
///
/// # async fn example() -> Result<(), relaybus::Error> {
/// let client = relaybus::mongodb::Client::with_uri_str("mongodb://127.0.0.1:27117/?replicaSet=relaybus-dev").await?;
/// let store = MongoEventStore::builder(client).database("shop").build()?;
/// // Both handlers are subscribed: no list to keep.
/// let bus = RelayBus::builder(store).build()?;
/// assert_eq!(bus.handlers_for("order.placed.v1"), ["projector", "send-confirmation"]);
/// bus.start().await?;
/// # Ok(())
/// # }
/// ```
///
/// # Unit tests
///
/// The function is an ordinary `async fn`; give it a context made with
/// `HandlerContext::detached` when it takes one:
///
/// ```
/// use relaybus::{BoxError, EventEnvelope, HandlerContext};
/// use serde::{Deserialize, Serialize};
///
/// #[relaybus::event("order.placed.v1")]
/// #[derive(Debug, Serialize, Deserialize)]
/// pub struct OrderPlaced {
///     pub order_id: String,
/// }
///
/// #[relaybus::handler(id = "audit")]
/// async fn audit(event: OrderPlaced, context: HandlerContext) -> Result<(), BoxError> {
///     if event.order_id.is_empty() {
///         return Err(format!("event {} has no order id", context.event_id()).into());
///     }
///     Ok(())
/// }
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), BoxError> {
/// let event = OrderPlaced { order_id: String::new() };
/// let context = HandlerContext::detached(&EventEnvelope::new(&event)?, "audit");
/// assert!(audit(event, context).await.is_err());
/// # Ok(())
/// # }
/// ```
///
/// A handler must be an `async fn`, and the error points at `fn`:
///
/// ```compile_fail
/// # #[relaybus::event("order.placed.v1")]
/// # #[derive(serde::Serialize, serde::Deserialize)]
/// # struct OrderPlaced {}
/// #[relaybus::handler(id = "projector")]
/// fn project(event: OrderPlaced) -> Result<(), relaybus::BoxError> {
///     Ok(())
/// }
/// ```
#[proc_macro_attribute]
pub fn handler(attr: TokenStream, item: TokenStream) -> TokenStream {
    handler::expand(attr.into(), item.into()).into()
}

/// Declares a schedule: a function that makes the event to publish on each tick of a cron
/// expression or a fixed interval. Every bus of the binary runs it (unless built with
/// `without_registered_schedules`), and each tick is published once across all of them (see
/// `relaybus::schedule`).
///
/// # Syntax
///
/// ```text
/// #[schedule(id = "daily-report", cron = "0 0 9 * * MON-FRI", time_zone = "Europe/Paris")]
/// #[schedule(id = "heartbeat", every_ms = 30_000, each_missed = 20, catch_up_ms = 600_000,
///            crate = path::to::relaybus)]
/// ```
///
/// | Option | Meaning |
/// |---|---|
/// | `id = "..."` | Required. The schedule id, 1 to 128 ASCII letters, digits, `_`, `-`, `.` and `:`. The ticks' event ids are made of it, so keep it stable. |
/// | `cron = "..."` | Ticks when the expression matches: five fields, or six with the seconds first. Checked when the bus is built. |
/// | `time_zone = "..."` | The IANA zone whose clock the cron expression is read on (UTC by default). |
/// | `every_ms = N` | Ticks every `N` milliseconds instead (1 second to 366 days), on the multiples of the interval since the Unix epoch. |
/// | `each_missed = N` | Publishes each tick missed while no bus ran, at most the latest `N` (1 to 1000); without it, only the latest missed tick. |
/// | `catch_up_ms = N` | How far back a bus looks for missed ticks (1 second to 30 days; 1 hour by default). |
/// | `crate = path` | The relaybus crate, when it is not `::relaybus`. |
///
/// One of `cron` and `every_ms` is required. The function is a plain `fn` taking the
/// `relaybus::Tick` and returning the event; it stays callable as written.
///
/// # Example
///
/// ```
/// use relaybus::{Tick, Timestamp};
/// use serde::{Deserialize, Serialize};
///
/// #[relaybus::event("report.due.v1")]
/// #[derive(Debug, Serialize, Deserialize)]
/// pub struct ReportDue {
///     pub at: Timestamp,
/// }
///
/// /// At 09:00 every weekday in Paris.
/// #[relaybus::schedule(id = "daily-report", cron = "0 0 9 * * MON-FRI", time_zone = "Europe/Paris")]
/// fn daily_report(tick: Tick) -> ReportDue {
///     ReportDue { at: tick.at() }
/// }
///
/// let declared = relaybus::registry::schedules()
///     .find(|s| s.id() == "daily-report")
///     .unwrap();
/// assert_eq!(declared.schedule().cron_expression(), Some("0 0 9 * * MON-FRI"));
/// assert!(declared.rust_path().ends_with("::daily_report"));
/// ```
///
/// A schedule that does not say when it ticks does not compile:
///
/// ```compile_fail
/// # #[relaybus::event("report.due.v1")]
/// # #[derive(serde::Serialize, serde::Deserialize)]
/// # struct ReportDue {}
/// #[relaybus::schedule(id = "daily-report")]
/// fn daily_report(_: relaybus::Tick) -> ReportDue {
///     ReportDue {}
/// }
/// ```
#[proc_macro_attribute]
pub fn schedule(attr: TokenStream, item: TokenStream) -> TokenStream {
    schedule::expand(attr.into(), item.into()).into()
}
