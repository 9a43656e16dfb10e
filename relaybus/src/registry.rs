//! The events and handlers declared with [`#[event]`](macro@crate::event) and
//! [`#[handler]`](macro@crate::handler) anywhere in the binary.
//!
//! The macros register a descriptor for each item at link time (through the `inventory` crate),
//! so no central list has to be kept: linking the crate that declares a handler is enough for
//! [`RelayBus::builder`](crate::RelayBus::builder) to subscribe it.
//!
//! [`events`] and [`handlers`] list what is registered, sorted by type name and by handler id.
//! [`check`] refuses two events with one type name, or two handlers with one id, and names both
//! Rust items; [`RelayBusBuilder::build`](crate::RelayBusBuilder::build) runs it.
//!
//! # Example
//!
//! ```
//! for event in relaybus::registry::events() {
//!     println!("{} is {}", event.type_name(), event.rust_type());
//! }
//! for handler in relaybus::registry::handlers() {
//!     println!("{} handles {} ({})", handler.id(), handler.event_type(), handler.rust_path());
//! }
//! relaybus::registry::check()?;
//! # Ok::<(), relaybus::ConfigurationError>(())
//! ```

use std::{fmt, time::Duration};

use crate::{
    error::ConfigurationError,
    handler::{RetryPolicy, Subscription},
    schedule::Schedule,
};

/// An event type declared with [`#[event]`](macro@crate::event).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EventDescriptor {
    type_name: &'static str,
    rust_type: &'static str,
}

impl EventDescriptor {
    /// Describes an event type. Made by `#[event]`; not meant to be called by hand.
    #[doc(hidden)]
    pub const fn new(type_name: &'static str, rust_type: &'static str) -> Self {
        EventDescriptor {
            type_name,
            rust_type,
        }
    }

    /// The wire name, such as `order.placed.v1`.
    pub fn type_name(&self) -> &'static str {
        self.type_name
    }

    /// The path of the Rust type, such as `shop::orders::OrderPlaced`.
    pub fn rust_type(&self) -> &'static str {
        self.rust_type
    }
}

/// A handler declared with [`#[handler]`](macro@crate::handler).
#[derive(Clone, Copy)]
pub struct HandlerDescriptor {
    id: &'static str,
    event_type: &'static str,
    rust_path: &'static str,
    transactional: bool,
    unordered: bool,
    max_attempts: Option<u32>,
    initial_backoff: Option<Duration>,
    max_backoff: Option<Duration>,
    timeout: Option<Duration>,
    global_concurrency: Option<u32>,
    rate_limit: Option<(u32, Duration)>,
    subscribe: fn() -> Subscription,
}

impl HandlerDescriptor {
    /// Describes a handler. Made by `#[handler]`; not meant to be called by hand.
    ///
    /// `subscribe` makes the plain subscription (id, event type, glue); the settings of the
    /// descriptor are applied by [`subscription`](Self::subscription).
    #[doc(hidden)]
    pub const fn new(
        id: &'static str,
        event_type: &'static str,
        rust_path: &'static str,
        subscribe: fn() -> Subscription,
    ) -> Self {
        HandlerDescriptor {
            id,
            event_type,
            rust_path,
            transactional: false,
            unordered: false,
            max_attempts: None,
            initial_backoff: None,
            max_backoff: None,
            timeout: None,
            global_concurrency: None,
            rate_limit: None,
            subscribe,
        }
    }

    #[doc(hidden)]
    pub const fn with_transactional(mut self) -> Self {
        self.transactional = true;
        self
    }

    #[doc(hidden)]
    pub const fn with_unordered(mut self) -> Self {
        self.unordered = true;
        self
    }

    #[doc(hidden)]
    pub const fn with_max_attempts(mut self, max_attempts: u32) -> Self {
        self.max_attempts = Some(max_attempts);
        self
    }

    #[doc(hidden)]
    pub const fn with_initial_backoff(mut self, wait: Duration) -> Self {
        self.initial_backoff = Some(wait);
        self
    }

    #[doc(hidden)]
    pub const fn with_max_backoff(mut self, wait: Duration) -> Self {
        self.max_backoff = Some(wait);
        self
    }

    #[doc(hidden)]
    pub const fn with_timeout(mut self, limit: Duration) -> Self {
        self.timeout = Some(limit);
        self
    }

    #[doc(hidden)]
    pub const fn with_global_concurrency(mut self, n: u32) -> Self {
        self.global_concurrency = Some(n);
        self
    }

    #[doc(hidden)]
    pub const fn with_rate_limit(mut self, rate: u32, interval: Duration) -> Self {
        self.rate_limit = Some((rate, interval));
        self
    }

    /// Its global concurrency (`global_concurrency`), if limited; see
    /// [`Subscription::global_concurrency`].
    pub fn global_concurrency(&self) -> Option<u32> {
        self.global_concurrency
    }

    /// Its rate limit (`rate_limit`, per `rate_interval_ms` or 1 s), if any; see
    /// [`Subscription::rate_limit`].
    pub fn rate_limit(&self) -> Option<(u32, Duration)> {
        self.rate_limit
    }

    /// How long one attempt may run (`timeout_ms`), if limited.
    pub fn timeout(&self) -> Option<Duration> {
        self.timeout
    }

    /// The handler id, the key its deliveries are stored under.
    pub fn id(&self) -> &'static str {
        self.id
    }

    /// The type name of the events it handles.
    pub fn event_type(&self) -> &'static str {
        self.event_type
    }

    /// The path of the Rust function, such as `shop::projections::project_order`.
    pub fn rust_path(&self) -> &'static str {
        self.rust_path
    }

    /// Whether the handler runs on store `S` (see [`Subscription::runs_on`]): the filter that
    /// picks the registered handlers a test bus on the memory store can run.
    ///
    /// ```no_run
    /// use relaybus::{ConfigurationError, RelayBus, Store};
    ///
    /// /// A bus of every registered handler that can run on `store`.
    /// fn test_bus<S: Store>(store: S) -> Result<RelayBus<S>, ConfigurationError> {
    ///     RelayBus::builder(store)
    ///         .registered_handlers_where(|handler| handler.runs_on::<S>())
    ///         .build()
    /// }
    /// ```
    pub fn runs_on<S: crate::Store>(&self) -> bool {
        (self.subscribe)().runs_on::<S>()
    }

    /// Whether it runs in the transaction that completes its delivery (`transactional`).
    pub fn is_transactional(&self) -> bool {
        self.transactional
    }

    /// Whether its deliveries ignore the event's ordering key (`unordered`); see
    /// [`Subscription::unordered`].
    pub fn is_unordered(&self) -> bool {
        self.unordered
    }

    /// Its own retry policy, when the attribute overrides any of `max_attempts`,
    /// `initial_backoff_ms` or `max_backoff_ms`; the settings it leaves out keep the values of
    /// [`RetryPolicy::default`].
    pub fn retry_policy(&self) -> Option<RetryPolicy> {
        if self.max_attempts.is_none()
            && self.initial_backoff.is_none()
            && self.max_backoff.is_none()
        {
            return None;
        }
        let mut policy = self.max_attempts.map(RetryPolicy::new).unwrap_or_default();
        if let Some(wait) = self.initial_backoff {
            policy = policy.initial_backoff(wait);
        }
        if let Some(wait) = self.max_backoff {
            policy = policy.max_backoff(wait);
        }
        Some(policy)
    }

    /// A subscription of the handler with the settings of its attribute, ready for
    /// [`RelayBusBuilder::subscribe`](crate::RelayBusBuilder::subscribe).
    ///
    /// The bus builder does this for every registered handler unless told otherwise; call it
    /// yourself after
    /// [`without_registered_handlers`](crate::RelayBusBuilder::without_registered_handlers) to
    /// pick handlers one by one.
    pub fn subscription(&self) -> Subscription {
        let mut subscription = (self.subscribe)();
        if self.transactional {
            subscription = subscription.transactional();
        }
        if self.unordered {
            subscription = subscription.unordered();
        }
        if let Some(policy) = self.retry_policy() {
            subscription = subscription.retry(policy);
        }
        if let Some(limit) = self.timeout {
            subscription = subscription.timeout(limit);
        }
        if let Some(n) = self.global_concurrency {
            subscription = subscription.global_concurrency(n);
        }
        if let Some((rate, interval)) = self.rate_limit {
            subscription = subscription.rate_limit(rate, interval);
        }
        subscription
    }

    /// How errors name the handler: its Rust path and event type.
    pub(crate) fn describe(&self) -> String {
        format!("#[handler] {} for {}", self.rust_path, self.event_type)
    }
}

impl fmt::Debug for HandlerDescriptor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HandlerDescriptor")
            .field("id", &self.id)
            .field("event_type", &self.event_type)
            .field("rust_path", &self.rust_path)
            .field("transactional", &self.transactional)
            .field("unordered", &self.unordered)
            .field("retry_policy", &self.retry_policy())
            .field("timeout", &self.timeout)
            .field("global_concurrency", &self.global_concurrency)
            .field("rate_limit", &self.rate_limit)
            .finish_non_exhaustive()
    }
}

/// A schedule declared with [`#[schedule]`](macro@crate::schedule).
#[derive(Clone, Copy)]
pub struct ScheduleDescriptor {
    id: &'static str,
    rust_path: &'static str,
    make: fn() -> Schedule,
}

impl ScheduleDescriptor {
    /// Describes a schedule. Made by `#[schedule]`; not meant to be called by hand.
    #[doc(hidden)]
    pub const fn new(id: &'static str, rust_path: &'static str, make: fn() -> Schedule) -> Self {
        ScheduleDescriptor {
            id,
            rust_path,
            make,
        }
    }

    /// The schedule id.
    pub fn id(&self) -> &'static str {
        self.id
    }

    /// The path of the Rust function that makes the tick's event, such as
    /// `shop::reports::report_due`.
    pub fn rust_path(&self) -> &'static str {
        self.rust_path
    }

    /// The schedule, ready for [`RelayBusBuilder::schedule`](crate::RelayBusBuilder::schedule).
    pub fn schedule(&self) -> Schedule {
        (self.make)()
    }

    /// How errors name the schedule.
    pub(crate) fn describe(&self) -> String {
        format!("#[schedule] {}", self.rust_path)
    }
}

impl fmt::Debug for ScheduleDescriptor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ScheduleDescriptor")
            .field("id", &self.id)
            .field("rust_path", &self.rust_path)
            .finish_non_exhaustive()
    }
}

inventory::collect!(EventDescriptor);
inventory::collect!(HandlerDescriptor);
inventory::collect!(ScheduleDescriptor);

/// Every schedule declared with `#[schedule]` in the binary, sorted by id, then by Rust path.
pub fn schedules() -> impl ExactSizeIterator<Item = &'static ScheduleDescriptor> {
    let mut schedules: Vec<&'static ScheduleDescriptor> =
        inventory::iter::<ScheduleDescriptor>.into_iter().collect();
    schedules.sort_by_key(|s| (s.id, s.rust_path));
    schedules.into_iter()
}

/// The schedules of a bus: every registered one unless `registered` is off, sorted by id, then
/// those given by hand.
///
/// # Errors
///
/// [`ConfigurationError::DuplicateScheduleId`] when two registered schedules share an id, or a
/// schedule given by hand has the id of a registered one it runs.
pub(crate) fn bus_schedules(
    registered: bool,
    manual: Vec<Schedule>,
) -> Result<Vec<Schedule>, ConfigurationError> {
    let declared: Vec<_> = schedules().collect();
    if let Some(pair) = declared.windows(2).find(|w| w[0].id == w[1].id) {
        return Err(ConfigurationError::DuplicateScheduleId {
            id: pair[0].id.to_owned(),
            first: pair[0].describe(),
            second: pair[1].describe(),
        });
    }
    if !registered {
        return Ok(manual);
    }
    for schedule in &manual {
        if let Some(declared) = declared.iter().find(|d| d.id == schedule.id()) {
            return Err(ConfigurationError::DuplicateScheduleId {
                id: schedule.id().to_owned(),
                first: declared.describe(),
                second: format!("a schedule {} given to the bus", schedule.describe()),
            });
        }
    }
    let mut all: Vec<Schedule> = declared.iter().map(|d| d.schedule()).collect();
    all.extend(manual);
    Ok(all)
}

/// Every event type declared with `#[event]` in the binary, sorted by type name, then by Rust
/// type.
pub fn events() -> impl ExactSizeIterator<Item = &'static EventDescriptor> {
    let mut events: Vec<&'static EventDescriptor> =
        inventory::iter::<EventDescriptor>.into_iter().collect();
    events.sort_by_key(|e| (e.type_name, e.rust_type));
    events.into_iter()
}

/// Every handler declared with `#[handler]` in the binary, sorted by id, then by Rust path.
pub fn handlers() -> impl ExactSizeIterator<Item = &'static HandlerDescriptor> {
    let mut handlers: Vec<&'static HandlerDescriptor> =
        inventory::iter::<HandlerDescriptor>.into_iter().collect();
    handlers.sort_by_key(|h| (h.id, h.rust_path));
    handlers.into_iter()
}

/// The registered event of a type name, if any.
pub fn event(type_name: &str) -> Option<&'static EventDescriptor> {
    inventory::iter::<EventDescriptor>
        .into_iter()
        .find(|e| e.type_name == type_name)
}

/// Checks the registry: no two events share a type name, no two handlers share an id.
///
/// [`RelayBusBuilder::build`](crate::RelayBusBuilder::build) runs this check whatever handlers
/// it subscribes, since both mistakes break the binary as a whole: two event types under one
/// name would each read the other's payloads, and two handlers under one id share their deliveries.
///
/// # Errors
///
/// [`ConfigurationError::DuplicateEventType`] naming both Rust types, or
/// [`ConfigurationError::DuplicateHandlerId`] naming both functions. When there are several
/// duplicates, the first in sorted order is reported.
pub fn check() -> Result<(), ConfigurationError> {
    let events: Vec<_> = events().collect();
    if let Some(pair) = events.windows(2).find(|w| w[0].type_name == w[1].type_name) {
        return Err(ConfigurationError::DuplicateEventType {
            type_name: pair[0].type_name.to_owned(),
            first: pair[0].rust_type.to_owned(),
            second: pair[1].rust_type.to_owned(),
        });
    }
    let handlers: Vec<_> = handlers().collect();
    if let Some(pair) = handlers.windows(2).find(|w| w[0].id == w[1].id) {
        return Err(ConfigurationError::DuplicateHandlerId {
            id: pair[0].id.to_owned(),
            first: pair[0].describe(),
            second: pair[1].describe(),
        });
    }
    Ok(())
}

/// Which registered handlers a bus subscribes; chosen on the bus builder.
pub(crate) enum Selection {
    All,
    None,
    Where(Box<dyn Fn(&HandlerDescriptor) -> bool + Send + Sync>),
}

impl fmt::Debug for Selection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Selection::All => "All",
            Selection::None => "None",
            Selection::Where(_) => "Where(..)",
        })
    }
}

/// The subscriptions of a bus: the selected registered handlers, sorted by id, then the
/// subscriptions passed by hand.
///
/// # Errors
///
/// The errors of [`check`]; [`ConfigurationError::DuplicateHandlerId`] when a subscription
/// passed by hand has the id of a selected registered handler.
pub(crate) fn subscriptions(
    selection: &Selection,
    manual: Vec<Subscription>,
) -> Result<Vec<Subscription>, ConfigurationError> {
    check()?;
    let registered: Vec<&HandlerDescriptor> = handlers()
        .filter(|handler| match selection {
            Selection::All => true,
            Selection::None => false,
            Selection::Where(filter) => filter(handler),
        })
        .collect();
    for subscription in &manual {
        if let Some(handler) = registered.iter().find(|h| h.id == subscription.id) {
            return Err(ConfigurationError::DuplicateHandlerId {
                id: subscription.id.clone(),
                first: handler.describe(),
                second: format!(
                    "a subscription for {} ({})",
                    subscription.event_type, subscription.rust_type
                ),
            });
        }
    }
    let mut all: Vec<Subscription> = registered.iter().map(|h| h.subscription()).collect();
    all.extend(manual);
    Ok(all)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{error::BoxError, event::Event, handler::HandlerContext};

    #[derive(serde::Serialize, serde::Deserialize)]
    struct Pinged {}

    impl Event for Pinged {
        const TYPE: &'static str = "registry.pinged.v1";
    }

    fn subscribe() -> Subscription {
        Subscription::new("registry-test", |_: Pinged, _: HandlerContext| async {
            Ok::<(), BoxError>(())
        })
    }

    const PLAIN: HandlerDescriptor = HandlerDescriptor::new(
        "registry-test",
        Pinged::TYPE,
        "registry::tests::h",
        subscribe,
    );

    #[test]
    fn descriptor_settings_reach_the_subscription() {
        assert_eq!(PLAIN.retry_policy(), None);
        let plain = PLAIN.subscription();
        assert!(!plain.is_transactional());
        assert!(!plain.is_unordered());
        assert_eq!(plain.retry_policy(), None);
        assert_eq!(plain.id(), "registry-test");
        assert_eq!(plain.event_type(), "registry.pinged.v1");

        const TUNED: HandlerDescriptor = PLAIN
            .with_transactional()
            .with_max_backoff(Duration::from_secs(9));
        let tuned = TUNED.subscription();
        assert!(tuned.is_transactional());
        assert!(!tuned.is_unordered());

        const LOOSE: HandlerDescriptor = PLAIN.with_unordered().with_transactional();
        assert!(LOOSE.is_unordered());
        let loose = LOOSE.subscription();
        assert!(loose.is_unordered());
        assert!(loose.is_transactional());
        assert_eq!(
            tuned.retry_policy(),
            Some(&RetryPolicy::default().max_backoff(Duration::from_secs(9)))
        );

        const COUNTED: HandlerDescriptor = PLAIN
            .with_max_attempts(3)
            .with_initial_backoff(Duration::from_millis(5));
        assert_eq!(
            COUNTED.retry_policy(),
            Some(RetryPolicy::new(3).initial_backoff(Duration::from_millis(5)))
        );
    }

    #[test]
    fn nothing_is_registered_in_the_library_itself() {
        assert_eq!(events().len(), 0);
        assert_eq!(handlers().len(), 0);
        assert_eq!(event("registry.pinged.v1"), None);
        assert_eq!(check(), Ok(()));
    }
}
