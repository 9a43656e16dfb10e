//! [`RelayBusBuilder`]: the settings of a bus, checked when it is built.

use std::{collections::HashMap, sync::Arc, time::Duration};

use super::{BusInner, DEFAULT_TRANSACTION_TIMEOUT, DispatcherState, RelayBus};
use crate::{
    clock::Clock,
    dispatcher::{Retention, Settings, Shared},
    error::ConfigurationError,
    handler::{RetryPolicy, Subscription, validate_handler_id},
    schedule::{Schedule, run::Schedules},
    state::StateMap,
    store::{DefaultStore, Store, transaction},
};

/// Builds a [`RelayBus`]; made by [`RelayBus::builder`].
#[must_use]
pub struct RelayBusBuilder<S: Store = DefaultStore> {
    store: S,
    subscriptions: Vec<Subscription>,
    registered: crate::registry::Selection,
    schedules: Vec<Schedule>,
    registered_schedules: bool,
    transaction_timeout: Duration,
    transaction_retry_limit: Duration,
    owner: Option<String>,
    batch_size: u32,
    concurrency: usize,
    lease_duration: Duration,
    poll_interval: Duration,
    retry: RetryPolicy,
    shutdown_timeout: Duration,
    setup_on_start: bool,
    change_stream: bool,
    claim_ahead: bool,
    retention: Option<Retention>,
    gauge_interval: Option<Duration>,
    state: StateMap,
    /// The first type given twice to `state`, reported by `build`.
    duplicate_state: Option<&'static str>,
    clock: Clock,
}

impl<S: Store> std::fmt::Debug for RelayBusBuilder<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RelayBusBuilder")
            .field("store", &self.store)
            .field("subscriptions", &self.subscriptions)
            .field("registered", &self.registered)
            .field("transaction_timeout", &self.transaction_timeout)
            .field("owner", &self.owner)
            .field("state", &self.state)
            .finish_non_exhaustive()
    }
}

impl<S: Store> RelayBusBuilder<S> {
    /// A builder on `store` with the default settings, each documented on its method.
    pub(super) fn new(store: S) -> Self {
        RelayBusBuilder {
            store,
            subscriptions: Vec::new(),
            registered: crate::registry::Selection::All,
            schedules: Vec::new(),
            registered_schedules: true,
            transaction_timeout: DEFAULT_TRANSACTION_TIMEOUT,
            transaction_retry_limit: transaction::RETRY_LIMIT,
            owner: None,
            batch_size: 32,
            concurrency: 32,
            lease_duration: Duration::from_secs(30),
            poll_interval: Duration::from_secs(1),
            retry: RetryPolicy::default(),
            shutdown_timeout: Duration::from_secs(10),
            setup_on_start: true,
            change_stream: true,
            claim_ahead: true,
            retention: Some(Retention::default()),
            gauge_interval: Some(crate::dispatcher::DEFAULT_GAUGE_INTERVAL),
            state: StateMap::default(),
            duplicate_state: None,
            clock: Clock::system(),
        }
    }

    /// The clock the bus reads the time from: the system clock by default, or a
    /// [`TestClock`](crate::clock::TestClock) that a test moves, so that backoff, delayed
    /// publishes, lease expiry and retention wait for nothing (see [`crate::clock`]).
    pub fn clock(mut self, clock: impl Into<Clock>) -> Self {
        self.clock = clock.into();
        self
    }

    /// Gives the handlers a value of the application's state, which a handler takes as a
    /// [`State<T>`](crate::State) argument: a database handle, an HTTP client, a
    /// configuration. Call it once per type; to hand out a part of a larger state, give the
    /// part too (`.state(app.clone()).state(app.db.clone())`).
    ///
    /// `build` refuses a handler that takes a state type never given
    /// ([`ConfigurationError::MissingState`]), and a type given twice
    /// ([`ConfigurationError::DuplicateState`]).
    pub fn state<T: Clone + Send + Sync + 'static>(mut self, value: T) -> Self {
        if let Err(type_name) = self.state.insert(value) {
            self.duplicate_state.get_or_insert(type_name);
        }
        self
    }

    /// Adds a subscription.
    pub fn subscribe(mut self, subscription: Subscription) -> Self {
        self.subscriptions.push(subscription);
        self
    }

    /// Adds a schedule: once started, the bus publishes its event on every tick, once per
    /// tick across every bus of the database (see [`schedule`](mod@crate::schedule)).
    /// [`build`](Self::build) checks it.
    ///
    /// The tick's event gets deliveries for the handlers of this bus, as any publish of the
    /// bus does: every bus that runs the schedule must subscribe every handler of its event
    /// type.
    pub fn schedule(mut self, schedule: Schedule) -> Self {
        self.schedules.push(schedule);
        self
    }

    /// Leaves out the schedules declared with [`#[schedule]`](macro@crate::schedule): the bus
    /// runs only those passed to [`schedule`](Self::schedule). A bus that only serves requests,
    /// for example, may leave the schedules to the workers (each tick is published once
    /// whichever bus runs it).
    pub fn without_registered_schedules(mut self) -> Self {
        self.registered_schedules = false;
        self
    }

    /// Leaves out the handlers declared with [`#[handler]`](macro@crate::handler): the bus
    /// subscribes only what is passed to [`subscribe`](Self::subscribe).
    ///
    /// [`build`](Self::build) still refuses a registry with duplicate event type names or
    /// handler ids, since they break the binary whichever handlers this bus runs. Replaces an
    /// earlier [`registered_handlers_where`](Self::registered_handlers_where).
    pub fn without_registered_handlers(mut self) -> Self {
        self.registered = crate::registry::Selection::None;
        self
    }

    /// Subscribes only the handlers declared with [`#[handler]`](macro@crate::handler) for
    /// which `filter` returns `true`, for example those of one service when several share a
    /// binary. Replaces an earlier filter or
    /// [`without_registered_handlers`](Self::without_registered_handlers).
    ///
    /// The handlers of a bus are also those whose deliveries its publishes create: a bus that
    /// publishes an event type must subscribe every handler of that type, even those another
    /// process runs.
    ///
    /// ```no_run
    /// # use relaybus::{MongoEventStore, RelayBus};
    /// # fn example(store: MongoEventStore) -> Result<(), relaybus::ConfigurationError> {
    /// let bus = RelayBus::builder(store)
    ///     .registered_handlers_where(|handler| handler.rust_path().starts_with("shop::billing::"))
    ///     .build()?;
    /// # Ok(())
    /// # }
    /// ```
    pub fn registered_handlers_where<F>(mut self, filter: F) -> Self
    where
        F: Fn(&crate::registry::HandlerDescriptor) -> bool + Send + Sync + 'static,
    {
        self.registered = crate::registry::Selection::Where(Box::new(filter));
        self
    }

    /// The time budget of [`RelayBus::transaction`], 5 seconds by default (1 ms to 60 s, the
    /// longest a MongoDB transaction may live).
    pub fn transaction_timeout(mut self, timeout: Duration) -> Self {
        self.transaction_timeout = timeout;
        self
    }

    /// How long [`RelayBus::transaction`] and publishes without a session run their
    /// transaction again after transient errors: 120 seconds by default, as MongoDB's drivers
    /// do (1 ms to 10 minutes). The time budget ends the retries sooner when it runs out first.
    pub fn transaction_retry_limit(mut self, limit: Duration) -> Self {
        self.transaction_retry_limit = limit;
        self
    }

    /// The name this bus claims lanes under. Defaults to a name unique to the process
    /// (`<host>-<pid>-<random>`). Lanes are held per bus as well: a restarted process with a
    /// fixed name does not adopt the lanes of its predecessor, it takes them over once their
    /// leases end.
    pub fn owner(mut self, owner: impl Into<String>) -> Self {
        self.owner = Some(owner.into());
        self
    }

    /// How many deliveries one claim takes at most, 32 by default (1 to 1,000).
    pub fn batch_size(mut self, size: u32) -> Self {
        self.batch_size = size;
        self
    }

    /// How many handlers run at once, 32 by default (1 to 10,000).
    pub fn concurrency(mut self, handlers: usize) -> Self {
        self.concurrency = handlers;
        self
    }

    /// How long a claim holds its lanes without renewal, 30 seconds by default. The dispatcher
    /// renews the lanes of running non-transactional handlers every third of it; a lane whose
    /// worker died is free again after at most this long. Keep it well above handler run times,
    /// and above the run time of transactional handlers, which are not renewed.
    pub fn lease_duration(mut self, duration: Duration) -> Self {
        self.lease_duration = duration;
        self
    }

    /// How long an idle dispatcher waits before it looks for work again, 1 second by default.
    /// The change stream usually wakes it sooner.
    pub fn poll_interval(mut self, interval: Duration) -> Self {
        self.poll_interval = interval;
        self
    }

    /// The retry policy of handlers that have none of their own.
    pub fn retry(mut self, policy: RetryPolicy) -> Self {
        self.retry = policy;
        self
    }

    /// How long [`shutdown`](RelayBus::shutdown) waits for running handlers, 10 seconds by
    /// default.
    pub fn shutdown_timeout(mut self, timeout: Duration) -> Self {
        self.shutdown_timeout = timeout;
        self
    }

    /// Whether [`start`](RelayBus::start) runs [`Store::setup`] first (the default).
    pub fn setup_on_start(mut self, enabled: bool) -> Self {
        self.setup_on_start = enabled;
        self
    }

    /// Whether a change stream wakes the dispatcher when deliveries commit (the default).
    /// Without it, new work waits for the next poll.
    pub fn change_stream(mut self, enabled: bool) -> Self {
        self.change_stream = enabled;
        self
    }

    /// Whether a busy bus whose handlers finish quickly claims up to one batch beyond its free
    /// handler slots (the default), so that its next claim runs while its handlers do instead
    /// of after them. A claim costs the database about the same whatever its size, and a bus
    /// that claims only for free slots makes small claims once its handlers finish one by one.
    ///
    /// Only while the bus's handlers have taken 20 ms or less on average: deliveries claimed
    /// ahead wait in the bus for a slot, at most one batch of them; their lanes are renewed
    /// while they wait, and a shutdown gives them back uncharged. Concurrency stays as set.
    pub fn claim_ahead(mut self, enabled: bool) -> Self {
        self.claim_ahead = enabled;
        self
    }

    /// How long completed and dead deliveries are kept, and how often the dispatcher purges;
    /// `None` turns purging off. See [`Retention`] for the defaults.
    pub fn retention(mut self, retention: Option<Retention>) -> Self {
        self.retention = retention;
        self
    }

    /// How often the started bus samples the delivery gauges (`relaybus.deliveries`,
    /// `relaybus.delivery.oldest_due.age`) when it leads their sampling, 15 s by default, 100
    /// ms to 1 hour; `None` never. One started bus of the deployment samples at a time (see
    /// [`telemetry`](crate::telemetry)), with one aggregation of the store's deliveries.
    pub fn gauge_interval(mut self, interval: Option<Duration>) -> Self {
        self.gauge_interval = interval;
        self
    }

    /// Validates the settings and builds the bus. Makes no database call.
    ///
    /// # Errors
    ///
    /// [`ConfigurationError`] for an invalid or duplicate handler id, a setting out of range, a
    /// subscription's retry policy out of range (the message names the handler), a
    /// subscription to an event type whose name breaks the naming rule, a schedule that cannot
    /// be used ([`ConfigurationError::InvalidSchedule`], naming it) or two schedules with one
    /// id ([`ConfigurationError::DuplicateScheduleId`]).
    /// Duplicates are looked for among the subscriptions of this bus and in the whole
    /// [`registry`](crate::registry) ([`ConfigurationError::DuplicateEventType`] too), and the
    /// error names both items.
    pub fn build(mut self) -> Result<RelayBus<S>, ConfigurationError> {
        self.subscriptions = crate::registry::subscriptions(
            &self.registered,
            std::mem::take(&mut self.subscriptions),
        )?;
        transaction::validate_budget(self.transaction_timeout)?;
        if self.transaction_retry_limit < Duration::from_millis(1)
            || self.transaction_retry_limit > Duration::from_secs(600)
        {
            return Err(ConfigurationError::InvalidOption {
                option: "transaction_retry_limit",
                reason: format!(
                    "{:?} is out of range; use 1 ms to 10 minutes",
                    self.transaction_retry_limit
                ),
            });
        }
        self.check_dispatch_settings()?;
        let schedules = Schedules::new(
            crate::registry::bus_schedules(
                self.registered_schedules,
                std::mem::take(&mut self.schedules),
            )?,
            self.retention.map(|retention| retention.completed),
        )?;
        if let Some(type_name) = self.duplicate_state {
            return Err(ConfigurationError::DuplicateState { type_name });
        }
        let mut handlers_by_type: HashMap<&'static str, Vec<String>> = HashMap::new();
        let mut unordered_by_type: HashMap<&'static str, Vec<String>> = HashMap::new();
        for (at, subscription) in self.subscriptions.iter().enumerate() {
            validate_handler_id(&subscription.id)?;
            subscription.check_needs::<S>(&self.state)?;
            if let Err(reason) = crate::event::check_type_name(subscription.event_type) {
                // Publishing such a type is refused, so the handler could never run.
                return Err(ConfigurationError::InvalidOption {
                    option: "subscribe",
                    reason: format!(
                        "handler {:?} subscribes to {} under the event type name {:?}, which no \
                         event can be published under: {reason}; name the type like \
                         \"order.placed.v1\"",
                        subscription.id, subscription.rust_type, subscription.event_type
                    ),
                });
            }
            if subscription
                .timeout
                .is_some_and(|limit| limit < Duration::from_millis(1))
            {
                return Err(ConfigurationError::InvalidOption {
                    option: "timeout",
                    reason: format!(
                        "handler {:?} has an attempt timeout of {:?}, which no attempt can \
                         meet; use at least 1 ms, or no timeout",
                        subscription.id,
                        subscription.timeout.unwrap_or_default()
                    ),
                });
            }
            subscription.check_limits()?;
            if let Some(policy) = &subscription.retry {
                policy.validate().map_err(|error| match error {
                    ConfigurationError::InvalidOption { option, reason } => {
                        ConfigurationError::InvalidOption {
                            option,
                            reason: format!(
                                "the retry policy of handler {:?}: {reason}",
                                subscription.id
                            ),
                        }
                    }
                    other => other,
                })?;
            }
            if let Some(first) = self.subscriptions[..at]
                .iter()
                .find(|s| s.id == subscription.id)
            {
                return Err(ConfigurationError::DuplicateHandlerId {
                    id: subscription.id.clone(),
                    first: format!("{} ({})", first.event_type, first.rust_type),
                    second: format!("{} ({})", subscription.event_type, subscription.rust_type),
                });
            }
            handlers_by_type
                .entry(subscription.event_type)
                .or_default()
                .push(subscription.id.clone());
            if subscription.unordered {
                unordered_by_type
                    .entry(subscription.event_type)
                    .or_default()
                    .push(subscription.id.clone());
            }
        }
        let settings = Settings {
            owner: self.owner.clone().unwrap_or_else(default_owner),
            batch_size: self.batch_size,
            concurrency: self.concurrency,
            lease_duration: self.lease_duration,
            poll_interval: self.poll_interval,
            retry: self.retry,
            shutdown_timeout: self.shutdown_timeout,
            setup_on_start: self.setup_on_start,
            change_stream: self.change_stream,
            claim_ahead: self.claim_ahead,
            retention: self.retention,
            gauge_interval: self.gauge_interval,
            state: self.state,
            clock: self.clock,
        };
        let shared = Arc::new(Shared::new(
            self.store.clone(),
            &self.subscriptions,
            settings,
        ));
        Ok(RelayBus {
            inner: Arc::new(BusInner {
                store: self.store,
                subscriptions: self.subscriptions,
                handlers_by_type,
                unordered_by_type,
                transaction_timeout: self.transaction_timeout,
                transaction_retry_limit: self.transaction_retry_limit,
                shared,
                dispatcher: tokio::sync::Mutex::new(DispatcherState::Idle),
                schedules,
            }),
        })
    }

    fn check_dispatch_settings(&self) -> Result<(), ConfigurationError> {
        let invalid = |option: &'static str, reason: String| {
            Err(ConfigurationError::InvalidOption { option, reason })
        };
        if let Some(owner) = &self.owner
            && (owner.is_empty() || owner.len() > 256 || owner.chars().any(char::is_control))
        {
            return invalid(
                "owner",
                format!("{owner:?} is not usable; use 1 to 256 bytes without control characters"),
            );
        }
        if !(1..=1_000).contains(&self.batch_size) {
            return invalid(
                "batch_size",
                format!("{} is out of range; use 1 to 1000", self.batch_size),
            );
        }
        if !(1..=10_000).contains(&self.concurrency) {
            return invalid(
                "concurrency",
                format!("{} is out of range; use 1 to 10000", self.concurrency),
            );
        }
        if self.poll_interval < Duration::from_millis(1)
            || self.poll_interval > Duration::from_secs(3_600)
        {
            return invalid(
                "poll_interval",
                format!(
                    "{:?} is out of range; use 1 ms to 1 hour",
                    self.poll_interval
                ),
            );
        }
        if let Some(interval) = self.gauge_interval
            && !(Duration::from_millis(100)..=Duration::from_secs(3_600)).contains(&interval)
        {
            return invalid(
                "gauge_interval",
                format!("{interval:?} is out of range; use 100 ms to 1 hour, or None"),
            );
        }
        if self.lease_duration <= self.poll_interval
            || self.lease_duration > Duration::from_secs(7 * 86_400)
        {
            return invalid(
                "lease_duration",
                format!(
                    "{:?} must be longer than the poll interval ({:?}) and at most 7 days",
                    self.lease_duration, self.poll_interval
                ),
            );
        }
        if self.shutdown_timeout > Duration::from_secs(3_600) {
            return invalid(
                "shutdown_timeout",
                format!(
                    "{:?} is over an hour; use at most 1 hour",
                    self.shutdown_timeout
                ),
            );
        }
        if let Some(retention) = &self.retention
            && retention.interval < Duration::from_secs(1)
        {
            return invalid(
                "retention",
                format!(
                    "purge interval {:?} is under a second; purge at most once a second",
                    retention.interval
                ),
            );
        }
        self.retry.validate()
    }
}

/// A lane owner name unique to this process: host, process id and a random part.
///
/// The host name comes from `HOSTNAME` alone: `build()` makes no blocking call.
fn default_owner() -> String {
    let host = std::env::var("HOSTNAME")
        .ok()
        .map(|h| h.trim().to_owned())
        .filter(|h| !h.is_empty() && h.len() <= 200 && !h.chars().any(char::is_control))
        .unwrap_or_else(|| "worker".to_owned());
    let random: u32 = rand::random();
    format!("{host}-{}-{random:08x}", std::process::id())
}
