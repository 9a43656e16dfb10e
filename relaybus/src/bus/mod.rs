//! The bus: subscriptions, transactions and publishing.
//!
//! [`RelayBus`] lives here; [`RelayBusBuilder`] builds it (`builder`), [`Publish`] and
//! [`PublishAll`] publish through it (`publish`), and [`RunUntilIdle`] runs its deliveries step
//! by step (`idle`).

mod builder;
mod idle;
mod publish;

use std::{collections::HashMap, sync::Arc, time::Duration};

pub use self::{
    builder::RelayBusBuilder,
    idle::RunUntilIdle,
    publish::{Publish, PublishAll},
};
use crate::{
    clock::Clock,
    dispatcher::{Handle, RunReport, Shared},
    error::{ConfigurationError, Result},
    handler::Subscription,
    schedule::{Schedule, run::Schedules},
    store::{DefaultStore, Purged, Store, transaction},
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
        RelayBusBuilder::new(store)
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
    /// The store's errors, and [`Error::InvalidArgument`](crate::Error::InvalidArgument) for an
    /// empty reason.
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
    /// The error of `work`; [`Error::TransactionTimeout`](crate::Error::TransactionTimeout) when
    /// the transaction ran past the budget, the server stopped its commit at the budget, or a
    /// transient error left no budget to run it again; database errors of the commit.
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
}
