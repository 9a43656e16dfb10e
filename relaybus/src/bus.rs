//! The bus: subscriptions, transactions and publishing.

use std::{
    collections::HashMap,
    future::{Future, IntoFuture},
    pin::Pin,
    sync::Arc,
    time::{Duration, Instant},
};

use crate::{
    clock::Clock,
    dispatcher::{
        DEFAULT_MAX_RUNS, Handle, IdleOptions, IdleReport, Retention, RunReport, Settings, Shared,
    },
    error::{ConfigurationError, Error, Result},
    event::{Event, EventEnvelope},
    handler::{RetryPolicy, Subscription, validate_handler_id},
    schedule::{Schedule, run::Schedules},
    state::StateMap,
    store::{
        AppendRequest, Appended, DefaultStore, Purged, Store,
        transaction::{self, Attempts, Boxed},
    },
    telemetry::Operation,
    time::Timestamp,
};

/// The default time budget of a [`RelayBus::transaction`].
pub const DEFAULT_TRANSACTION_TIMEOUT: Duration = Duration::from_secs(5);

/// The event bus: publishes events into store transactions and knows which handlers subscribe to
/// which event types.
///
/// Deliveries are created when an event is published, from the subscriptions **of the bus that
/// publishes it**. A process that publishes an event type must therefore register every handler
/// of that type, even when other processes run them.
///
/// The bus is cheap to clone; clones share everything.
///
/// # Example
///
/// ```no_run
/// # use relaybus::{Event, RelayBus, MongoEventStore, Subscription, HandlerContext, BoxError};
/// # #[derive(serde::Serialize, serde::Deserialize)]
/// # struct OrderPlaced { order_id: String }
/// # impl Event for OrderPlaced { const TYPE: &'static str = "order.placed.v1"; }
/// # async fn example(client: mongodb::Client) -> Result<(), relaybus::Error> {
/// use mongodb::bson::doc;
///
/// let store = MongoEventStore::builder(client.clone()).database("shop").build()?;
/// store.setup().await?;
/// let bus = RelayBus::builder(store)
///     .subscribe(Subscription::new("send-confirmation", |_: OrderPlaced, _: HandlerContext| async {
///         Ok::<(), BoxError>(())
///     }))
///     .build()?;
///
/// let orders = client.database("shop").collection("orders");
/// bus.transaction(async |session| {
///     orders.insert_one(doc! { "_id": "o-1", "total": 10 }).session(&mut *session).await?;
///     bus.publish(&OrderPlaced { order_id: "o-1".into() })
///         .key("o-1")
///         .session(session)
///         .await?;
///     Ok(())
/// })
/// .await?;
/// # Ok(())
/// # }
/// ```
pub struct RelayBus<S: Store = DefaultStore> {
    inner: Arc<BusInner<S>>,
}

impl<S: Store> Clone for RelayBus<S> {
    fn clone(&self) -> Self {
        RelayBus {
            inner: Arc::clone(&self.inner),
        }
    }
}

pub(crate) struct BusInner<S: Store> {
    store: S,
    subscriptions: Vec<Subscription>,
    handlers_by_type: HashMap<&'static str, Vec<String>>,
    /// The unordered ones among them: their deliveries ignore the event's key.
    unordered_by_type: HashMap<&'static str, Vec<String>>,
    transaction_timeout: Duration,
    transaction_retry_limit: Duration,
    shared: Arc<Shared<S>>,
    dispatcher: tokio::sync::Mutex<DispatcherState>,
    schedules: Schedules,
}

/// Whether the background dispatcher runs.
#[derive(Debug, Default)]
enum DispatcherState {
    #[default]
    Idle,
    Running(Handle),
    ShutDown,
}

impl<S: Store> std::fmt::Debug for RelayBus<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RelayBus")
            .field("store", &self.inner.store)
            .field("subscriptions", &self.inner.subscriptions)
            .field("transaction_timeout", &self.inner.transaction_timeout)
            .finish_non_exhaustive()
    }
}

impl<S: Store> RelayBus<S> {
    /// Starts building a bus on a store.
    ///
    /// The builder starts with every handler declared with
    /// [`#[handler]`](macro@crate::handler) in the binary (see [`crate::registry`]); opt out with
    /// [`without_registered_handlers`](RelayBusBuilder::without_registered_handlers), or keep
    /// some with [`registered_handlers_where`](RelayBusBuilder::registered_handlers_where).
    pub fn builder(store: S) -> RelayBusBuilder<S> {
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

    /// Prepares the store (unless [`setup_on_start`](RelayBusBuilder::setup_on_start) is off)
    /// and starts dispatching in the background: claiming deliveries of this bus's handlers,
    /// running them, completing, retrying and burying them, renewing lane leases, and purging
    /// on the retention interval. A change stream wakes the dispatcher as soon as deliveries
    /// commit; polling at the poll interval is the safety net.
    ///
    /// Must be called inside a Tokio runtime. Calling it again while it runs does nothing.
    ///
    /// # Errors
    ///
    /// The errors of [`Store::setup`]; [`ConfigurationError::InvalidOption`] when the
    /// bus was shut down already (build a new one).
    pub async fn start(&self) -> Result<()> {
        let mut state = self.inner.dispatcher.lock().await;
        match *state {
            DispatcherState::Running(_) => return Ok(()),
            DispatcherState::ShutDown => {
                return Err(ConfigurationError::InvalidOption {
                    option: "start",
                    reason: "the bus was shut down; build a new bus to dispatch again".to_owned(),
                }
                .into());
            }
            DispatcherState::Idle => {}
        }
        if self.inner.shared.settings.setup_on_start {
            self.inner.store.setup().await?;
        }
        let mut handle = Handle::spawn(Arc::clone(&self.inner.shared));
        if !self.inner.schedules.is_empty() {
            let ticks = tokio::spawn(crate::schedule::run::publish_periodically(
                Arc::downgrade(&self.inner),
                self.inner.shared.settings.poll_interval,
                handle.token().child_token(),
            ));
            handle.also(ticks);
        }
        *state = DispatcherState::Running(handle);
        Ok(())
    }

    /// Claims one batch of deliveries of this bus's handlers, runs them concurrently, and
    /// settles them: successes completed together, failures retried later or buried. For tests
    /// and for running on a schedule instead of in the background.
    ///
    /// Lane leases are not renewed during the call: keep its handlers shorter than the lease
    /// duration.
    ///
    /// # Errors
    ///
    /// Errors of the claim or of the completion; the handlers' own errors are not errors of
    /// this call (they count as failed attempts).
    pub async fn run_once(&self) -> Result<RunReport> {
        self.inner.shared.run_once().await
    }

    /// Runs every delivery of this bus's handlers that is due, batch after batch, until a
    /// claim finds nothing due, and reports every run: what succeeded, what failed and when it
    /// is due again, and what became a dead letter. Deliveries that become due while it runs
    /// (the next event of a key, events the handlers publish, retries whose backoff has passed
    /// on the bus's clock) run too.
    ///
    /// For tests: with a [`TestClock`](crate::clock::TestClock),
    /// [`advance_clock(within)`](RunUntilIdle::advance_clock) also moves the clock to each
    /// retry or delayed delivery due within `within`, so a handler that fails twice and then
    /// succeeds runs to its success in one call, with no sleep.
    ///
    /// ```no_run
    /// # use relaybus::{RelayBus, Store};
    /// # async fn example<S: Store>(bus: RelayBus<S>) -> Result<(), relaybus::Error> {
    /// use std::time::Duration;
    ///
    /// let report = bus.run_until_idle().advance_clock(Duration::from_secs(3600)).await?;
    /// assert_eq!(report.dead().count(), 0);
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// # Errors
    ///
    /// [`ConfigurationError::InvalidOption`] when the bus dispatches in the background
    /// (after [`start`](Self::start)), or when `advance_clock` is asked of a bus on the system
    /// clock; [`Error::InvalidArgument`] when it ran more than
    /// [`max_runs`](RunUntilIdle::max_runs) deliveries ([`DEFAULT_MAX_RUNS`]
    /// by default) without becoming idle; the store's errors. The handlers' own errors are in
    /// the report.
    pub fn run_until_idle(&self) -> RunUntilIdle<'_, S> {
        RunUntilIdle {
            bus: self,
            options: IdleOptions {
                advance: None,
                max_runs: DEFAULT_MAX_RUNS,
            },
        }
    }

    /// The current time of the bus's clock (see [`RelayBusBuilder::clock`]).
    pub fn now(&self) -> Timestamp {
        self.inner.shared.now()
    }

    /// The bus's clock.
    pub(crate) fn clock(&self) -> &Clock {
        &self.inner.shared.settings.clock
    }

    /// The bus of a weak reference, if it is still alive.
    pub(crate) fn upgrade(inner: &std::sync::Weak<BusInner<S>>) -> Option<Self> {
        inner.upgrade().map(|inner| RelayBus { inner })
    }

    /// The schedules of this bus: those given to
    /// [`RelayBusBuilder::schedule`] and those declared with
    /// [`#[schedule]`](macro@crate::schedule) (see [`schedule`](mod@crate::schedule)).
    pub fn schedules(&self) -> impl Iterator<Item = &Schedule> {
        self.inner.schedules.schedules()
    }

    /// The schedules with the time up to which this bus published them.
    pub(crate) fn schedules_state(&self) -> &Schedules {
        &self.inner.schedules
    }

    /// Stops dispatching gracefully: no more claims; running handlers get the shutdown timeout
    /// to finish; deliveries still unfinished then are released without charging an attempt;
    /// every lane this bus holds is handed back, so other workers take the work at once rather
    /// than after the lease expires. Returns when all that is done. Calling it again does
    /// nothing.
    ///
    /// # Errors
    ///
    /// None so far; failures to release or hand back are logged, and the leases they concern
    /// simply run out.
    pub async fn shutdown(&self) -> Result<()> {
        let mut state = self.inner.dispatcher.lock().await;
        match std::mem::replace(&mut *state, DispatcherState::ShutDown) {
            DispatcherState::Running(handle) => handle.stop().await,
            DispatcherState::Idle => {
                // `run_once` may hold lanes.
                let owner = &self.inner.shared.settings.owner;
                if let Err(error) = self.inner.store.relinquish(owner).await {
                    tracing::warn!(%error, "could not hand the lanes back");
                }
            }
            DispatcherState::ShutDown => {}
        }
        Ok(())
    }

    /// Makes dead deliveries pending again, by id: the store's
    /// [`requeue`](crate::store::Operate::requeue), now.
    ///
    /// # Errors
    ///
    /// The store's errors.
    pub async fn requeue(&self, ids: &[String]) -> Result<crate::store::Requeued> {
        self.inner.store.requeue(ids, self.now()).await
    }

    /// Buries pending deliveries that no worker runs, by id, with `reason` as their error:
    /// frees a key stuck behind a delivery that will never succeed. The store's
    /// [`bury_by_id`](crate::store::Operate::bury_by_id), now.
    ///
    /// # Errors
    ///
    /// The store's errors, and [`Error::InvalidArgument`] for an empty reason.
    pub async fn bury(&self, ids: &[String], reason: &str) -> Result<crate::store::Buried> {
        self.inner.store.bury_by_id(ids, reason, self.now()).await
    }

    /// What this bus's handlers did in this process over the last hour, minute by minute:
    /// runs that succeeded, that failed, and deliveries dead-lettered. The counts live in
    /// memory (nothing is written per run); each process reports its own.
    pub fn activity(&self) -> Vec<crate::activity::HandlerActivity> {
        self.inner.shared.metrics.activity(self.now())
    }

    /// Samples the delivery gauges now, as a started bus does every
    /// [`gauge_interval`](RelayBusBuilder::gauge_interval), if this bus leads their sampling
    /// (see [`telemetry`](crate::telemetry)): `true` when it sampled, `false` when another bus
    /// leads. It always counts anew, where a started bus on its interval may report a count
    /// that another bus of the same store instance took less than half an interval before.
    ///
    /// # Errors
    ///
    /// The store's errors.
    pub async fn sample_gauges(&self) -> Result<bool> {
        self.inner.shared.sample_gauges(false).await
    }

    /// Deletes what the retention settings let go now, as the dispatcher does on its
    /// interval.
    ///
    /// # Errors
    ///
    /// [`ConfigurationError::InvalidOption`] when retention is off; the store's purge errors.
    pub async fn purge_expired(&self) -> Result<Purged> {
        let retention = self.inner.shared.settings.retention.ok_or_else(|| {
            ConfigurationError::InvalidOption {
                option: "retention",
                reason: "retention is off for this bus; set it with `RelayBusBuilder::retention`"
                    .to_owned(),
            }
        })?;
        self.inner.shared.purge(retention).await
    }

    /// The owner name this bus claims lanes under.
    pub fn owner(&self) -> &str {
        &self.inner.shared.settings.owner
    }

    /// The store the bus writes to.
    pub fn store(&self) -> &S {
        &self.inner.store
    }

    /// The subscriptions of this bus.
    pub fn subscriptions(&self) -> &[Subscription] {
        &self.inner.subscriptions
    }

    /// The ids of the handlers subscribed to an event type.
    pub fn handlers_for(&self, event_type: &str) -> &[String] {
        self.inner
            .handlers_by_type
            .get(event_type)
            .map(Vec::as_slice)
            .unwrap_or(&[])
    }

    /// The ids of the [unordered](Subscription::unordered) handlers subscribed to an event type.
    fn unordered_handlers_for(&self, event_type: &str) -> &[String] {
        self.inner
            .unordered_by_type
            .get(event_type)
            .map(Vec::as_slice)
            .unwrap_or(&[])
    }

    /// The time budget of [`transaction`](Self::transaction).
    pub fn transaction_timeout(&self) -> Duration {
        self.inner.transaction_timeout
    }

    /// Runs `work` in a store transaction within the bus's time budget
    /// ([`transaction_timeout`](RelayBusBuilder::transaction_timeout), 5 seconds by default).
    ///
    /// Write the business data through the session `work` gets, and publish with
    /// [`publish(..).session(session)`](Publish::session): both commit together or not at all.
    /// A publish without the session inside `work` is refused with
    /// [`ConfigurationError::SessionNotPassed`], since it would commit on its own.
    /// When `work` or the commit fails with a transient error (a write conflict, typically),
    /// the transaction is aborted and **the whole of `work` runs again**; a commit whose
    /// result is unknown is sent again. Retries stop after 120 seconds
    /// ([`transaction_retry_limit`](RelayBusBuilder::transaction_retry_limit)) with the last
    /// error.
    /// The budget covers the whole transaction, every attempt included: a transaction that
    /// ran past it is aborted with all its writes, each commit is bounded on the server by what
    /// is left of it (`maxCommitTimeMS`), and no attempt starts once it is spent.
    ///
    /// # Errors
    ///
    /// The error of `work`; [`Error::TransactionTimeout`] when the transaction ran past the
    /// budget, the server stopped its commit at the budget, or a transient error left no
    /// budget to run it again; database errors of the commit.
    pub async fn transaction<R, F>(&self, work: F) -> Result<R>
    where
        F: for<'s> AsyncFnMut(&'s mut S::Session) -> Result<R>,
    {
        transaction::run_within(
            &self.inner.store,
            Some(self.inner.transaction_timeout),
            self.inner.transaction_retry_limit,
            work,
        )
        .await
    }

    /// Publishes a typed event. Chain the options, then `.await`:
    ///
    /// - `.session(&mut session)` appends it in that session's transaction (the usual way, so
    ///   it commits with your business data); without it the event is appended in a
    ///   transaction of its own;
    /// - `.key(..)`, `.id(..)`, `.correlation_id(..)`, `.causation_id(..)`, `.header(..)`.
    ///
    /// # Errors
    ///
    /// [`Error::EventValidation`] for an event or option that cannot be stored,
    /// [`Error::Configuration`] for a session without a started transaction, or for a publish
    /// without `.session(..)` inside the body of [`transaction`](Self::transaction) (it would
    /// commit whatever becomes of the body). Nothing is written in either case.
    pub fn publish<E: Event>(&self, event: &E) -> Publish<'_, S> {
        Publish {
            bus: self,
            envelope: EventEnvelope::new(event)
                .map(|envelope| envelope.made_at(self.now()))
                .map_err(Error::from),
            session: None,
            due: Due::Now,
        }
    }

    /// Publishes a prepared envelope, as [`publish`](Self::publish) does.
    pub fn publish_envelope(&self, envelope: EventEnvelope) -> Publish<'_, S> {
        Publish {
            bus: self,
            envelope: Ok(envelope),
            session: None,
            due: Due::Now,
        }
    }

    /// Publishes several envelopes in one append: one round trip per step whatever their number.
    pub fn publish_all(
        &self,
        envelopes: impl IntoIterator<Item = EventEnvelope>,
    ) -> PublishAll<'_, S> {
        PublishAll {
            bus: self,
            envelopes: envelopes.into_iter().collect(),
            session: None,
        }
    }

    async fn append(
        &self,
        session: Option<&mut S::Session>,
        envelopes: &[EventEnvelope],
        due: Due,
    ) -> Result<Vec<Appended>> {
        let started = Instant::now();
        let appended = self.append_untimed(session, envelopes, due).await;
        let metrics = &self.inner.shared.metrics;
        metrics.operation(
            Operation::Publish,
            started.elapsed().as_secs_f64(),
            appended.is_err(),
        );
        if appended.is_ok() {
            for envelope in envelopes {
                metrics.sent(envelope.event_type(), 1);
            }
        }
        appended
    }

    async fn append_untimed(
        &self,
        session: Option<&mut S::Session>,
        envelopes: &[EventEnvelope],
        due: Due,
    ) -> Result<Vec<Appended>> {
        let now = self.now();
        let due_at = due.at(now);
        let requests: Vec<AppendRequest<'_>> = envelopes
            .iter()
            .map(|envelope| {
                let event_type = envelope.event_type();
                let request = AppendRequest::new(envelope, self.handlers_for(event_type))
                    .unordered(self.unordered_handlers_for(event_type));
                match due_at {
                    Some(at) => request.due_at(at),
                    None => request,
                }
            })
            .collect();
        let store = &self.inner.store;
        match session {
            Some(session) => store.append(session, &requests, now).await,
            None if transaction::in_transaction_body() => {
                Err(ConfigurationError::SessionNotPassed {
                    operation: "publish",
                }
                .into())
            }
            None => {
                let attempts = Attempts::new(Some(self.inner.transaction_timeout))
                    .retry_for(self.inner.transaction_retry_limit);
                let body = Boxed::new((self, &requests), |session, (bus, requests)| {
                    Box::pin(
                        bus.inner
                            .store
                            .append_in_transaction(session, requests, bus.now()),
                    )
                });
                transaction::attempt_until_committed(store, attempts, body).await
            }
        }
    }
}

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

/// A pending publish of one event; made by [`RelayBus::publish`]. Runs when awaited.
#[must_use = "a publish does nothing until it is awaited"]
pub struct Publish<'a, S: Store = DefaultStore> {
    bus: &'a RelayBus<S>,
    envelope: Result<EventEnvelope>,
    session: Option<&'a mut S::Session>,
    due: Due,
}

/// When a publish's deliveries become due.
#[derive(Debug, Clone, Copy, Default)]
enum Due {
    /// At once.
    #[default]
    Now,
    /// This long after the append.
    After(Duration),
    /// At this time.
    At(Timestamp),
}

impl Due {
    /// The due time of an append at `now`, if not at once.
    fn at(self, now: Timestamp) -> Option<Timestamp> {
        match self {
            Due::Now => None,
            Due::After(delay) => Some(now.saturating_add(delay)),
            Due::At(at) => Some(at),
        }
    }
}

impl<S: Store> std::fmt::Debug for Publish<'_, S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Publish")
            .field("envelope", &self.envelope)
            .field("session", &self.session.is_some())
            .field("due", &self.due)
            .finish_non_exhaustive()
    }
}

impl<'a, S: Store> Publish<'a, S> {
    /// Delays the event's deliveries: they become due `delay` after the publish, instead of at
    /// once. The event is stored now, with the business data; only its handlers wait. A keyed
    /// event keeps its place in its key's order, so the later events of its key wait too.
    /// Replaces an earlier [`at`](Self::at).
    pub fn delay(mut self, delay: Duration) -> Self {
        self.due = Due::After(delay);
        self
    }

    /// Makes the event's deliveries due at `at` (at once if `at` has passed), as
    /// [`delay`](Self::delay) does. Replaces an earlier `delay`.
    pub fn at(mut self, at: Timestamp) -> Self {
        self.due = Due::At(at);
        self
    }

    fn map(
        mut self,
        f: impl FnOnce(EventEnvelope) -> Result<EventEnvelope, crate::EventValidationError>,
    ) -> Self {
        self.envelope = self.envelope.and_then(|e| f(e).map_err(Error::from));
        self
    }

    /// Appends the event in this session's transaction, so it commits with the business data
    /// written through the same session.
    pub fn session(mut self, session: &'a mut S::Session) -> Self {
        self.session = Some(session);
        self
    }

    /// The ordering key: deliveries of one key run one at a time per handler, in commit order
    /// (except for [unordered](Subscription::unordered) handlers).
    pub fn key(self, key: impl Into<String>) -> Self {
        self.map(|e| e.with_key(key))
    }

    /// The event id, instead of a generated UUID v7. Publishing an id the store holds already
    /// adds nothing but deliveries of handlers new to the event.
    pub fn id(self, id: impl Into<String>) -> Self {
        self.map(|e| e.with_id(id))
    }

    /// The correlation id.
    pub fn correlation_id(self, id: impl Into<String>) -> Self {
        self.map(|e| e.with_correlation_id(id))
    }

    /// The causation id.
    pub fn causation_id(self, id: impl Into<String>) -> Self {
        self.map(|e| e.with_causation_id(id))
    }

    /// Adds a header.
    pub fn header(self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.map(|e| e.with_header(name, value))
    }
}

impl<'a, S: Store> IntoFuture for Publish<'a, S> {
    type Output = Result<Appended>;
    type IntoFuture = Pin<Box<dyn Future<Output = Self::Output> + Send + 'a>>;

    fn into_future(self) -> Self::IntoFuture {
        // The trace context of the caller's span, taken where the publish is awaited.
        let envelope = self.envelope.map(crate::trace::inject);
        Box::pin(async move {
            let envelope = envelope?;
            let mut appended = self
                .bus
                .append(self.session, std::slice::from_ref(&envelope), self.due)
                .await?;
            Ok(appended.remove(0))
        })
    }
}

/// A pending publish of several events; made by [`RelayBus::publish_all`]. Runs when awaited.
#[must_use = "a publish does nothing until it is awaited"]
pub struct PublishAll<'a, S: Store = DefaultStore> {
    bus: &'a RelayBus<S>,
    envelopes: Vec<EventEnvelope>,
    session: Option<&'a mut S::Session>,
}

impl<S: Store> std::fmt::Debug for PublishAll<'_, S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PublishAll")
            .field("envelopes", &self.envelopes.len())
            .field("session", &self.session.is_some())
            .finish_non_exhaustive()
    }
}

impl<'a, S: Store> PublishAll<'a, S> {
    /// Appends the events in this session's transaction.
    pub fn session(mut self, session: &'a mut S::Session) -> Self {
        self.session = Some(session);
        self
    }
}

impl<'a, S: Store> IntoFuture for PublishAll<'a, S> {
    type Output = Result<Vec<Appended>>;
    type IntoFuture = Pin<Box<dyn Future<Output = Self::Output> + Send + 'a>>;

    fn into_future(self) -> Self::IntoFuture {
        let envelopes: Vec<EventEnvelope> = self
            .envelopes
            .into_iter()
            .map(crate::trace::inject)
            .collect();
        Box::pin(async move { self.bus.append(self.session, &envelopes, Due::Now).await })
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

/// A pending [`RelayBus::run_until_idle`]. Runs when awaited.
#[must_use = "running until idle does nothing until it is awaited"]
pub struct RunUntilIdle<'a, S: Store = DefaultStore> {
    bus: &'a RelayBus<S>,
    options: IdleOptions,
}

impl<S: Store> std::fmt::Debug for RunUntilIdle<'_, S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RunUntilIdle")
            .field("options", &self.options)
            .finish_non_exhaustive()
    }
}

impl<S: Store> RunUntilIdle<'_, S> {
    /// Once nothing is due, moves the bus's [`TestClock`](crate::clock::TestClock) to the
    /// next due time of a delivery of its handlers (a retry after its backoff, a delayed
    /// publish), if it lies within `within` of the clock's time when the call started, and
    /// goes on running. The clock ends at the last due time it moved to.
    pub fn advance_clock(mut self, within: Duration) -> Self {
        self.options.advance = Some(within);
        self
    }

    /// Stops with an error after this many runs, rather than running on forever when handlers
    /// keep making new work; [`DEFAULT_MAX_RUNS`] by default.
    pub fn max_runs(mut self, runs: usize) -> Self {
        self.options.max_runs = runs.max(1);
        self
    }
}

impl<'a, S: Store> IntoFuture for RunUntilIdle<'a, S> {
    type Output = Result<IdleReport>;
    type IntoFuture = Pin<Box<dyn Future<Output = Self::Output> + Send + 'a>>;

    fn into_future(self) -> Self::IntoFuture {
        Box::pin(async move {
            {
                let state = self.bus.inner.dispatcher.lock().await;
                if matches!(*state, DispatcherState::Running(_)) {
                    return Err(ConfigurationError::InvalidOption {
                        option: "run_until_idle",
                        reason: "the bus dispatches in the background (`start` was called), \
                                 which would run the same deliveries; run a bus that is not \
                                 started step by step"
                            .to_owned(),
                    }
                    .into());
                }
            }
            self.bus.inner.shared.run_until_idle(self.options).await
        })
    }
}
