//! The bus: subscriptions, transactions and publishing.

use std::{
    collections::HashMap,
    future::{Future, IntoFuture},
    pin::Pin,
    sync::Arc,
    time::Duration,
};

use mongodb::{ClientSession, bson::DateTime};

use crate::{
    error::{ConfigurationError, Error, Result},
    event::{Event, EventEnvelope},
    handler::{Subscription, validate_handler_id},
    store::mongo::{AppendRequest, Appended, MongoEventStore},
};

/// The default time budget of a [`RelayBus::transaction`].
pub const DEFAULT_TRANSACTION_TIMEOUT: Duration = Duration::from_secs(5);

/// The event bus: publishes events into MongoDB transactions and knows which handlers subscribe to
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
#[derive(Clone)]
pub struct RelayBus {
    inner: Arc<BusInner>,
}

struct BusInner {
    store: MongoEventStore,
    subscriptions: Vec<Subscription>,
    handlers_by_type: HashMap<&'static str, Vec<String>>,
    transaction_timeout: Duration,
}

impl std::fmt::Debug for RelayBus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RelayBus")
            .field("store", &self.inner.store)
            .field("subscriptions", &self.inner.subscriptions)
            .field("transaction_timeout", &self.inner.transaction_timeout)
            .finish_non_exhaustive()
    }
}

impl RelayBus {
    /// Starts building a bus on a store.
    pub fn builder(store: MongoEventStore) -> RelayBusBuilder {
        RelayBusBuilder {
            store,
            subscriptions: Vec::new(),
            transaction_timeout: DEFAULT_TRANSACTION_TIMEOUT,
        }
    }

    /// The store the bus writes to.
    pub fn store(&self) -> &MongoEventStore {
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

    /// Runs `work` in a MongoDB transaction within the bus's time budget
    /// ([`transaction_timeout`](RelayBusBuilder::transaction_timeout), 5 seconds by default).
    ///
    /// Write the business data through the session `work` gets, and publish with
    /// [`publish(..).session(session)`](Publish::session): both commit together or not at all.
    /// Retries and the time budget work as in
    /// [`MongoEventStore::transaction_within`]: **`work` may run more than once**.
    ///
    /// # Errors
    ///
    /// The error of `work`; [`Error::TransactionTimeout`] when an attempt ran past the budget;
    /// database errors of the commit.
    pub async fn transaction<R, F>(&self, work: F) -> Result<R>
    where
        F: for<'s> AsyncFnMut(&'s mut ClientSession) -> Result<R>,
    {
        self.inner
            .store
            .transaction_within(self.inner.transaction_timeout, work)
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
    /// [`Error::Configuration`] for a session without a started transaction. Nothing is written
    /// in either case.
    pub fn publish<E: Event>(&self, event: &E) -> Publish<'_> {
        Publish {
            bus: self,
            envelope: EventEnvelope::new(event).map_err(Error::from),
            session: None,
        }
    }

    /// Publishes a prepared envelope, as [`publish`](Self::publish) does.
    pub fn publish_envelope(&self, envelope: EventEnvelope) -> Publish<'_> {
        Publish {
            bus: self,
            envelope: Ok(envelope),
            session: None,
        }
    }

    /// Publishes several envelopes in one append: one round trip per step whatever their number.
    pub fn publish_all(
        &self,
        envelopes: impl IntoIterator<Item = EventEnvelope>,
    ) -> PublishAll<'_> {
        PublishAll {
            bus: self,
            envelopes: envelopes.into_iter().collect(),
            session: None,
        }
    }

    async fn append(
        &self,
        session: Option<&mut ClientSession>,
        envelopes: &[EventEnvelope],
    ) -> Result<Vec<Appended>> {
        let requests: Vec<AppendRequest<'_>> = envelopes
            .iter()
            .map(|envelope| AppendRequest::new(envelope, self.handlers_for(envelope.event_type())))
            .collect();
        let store = &self.inner.store;
        match session {
            Some(session) => store.append(session, &requests, DateTime::now()).await,
            None => {
                store
                    .append_in_own_transaction(self.inner.transaction_timeout, &requests)
                    .await
            }
        }
    }
}

/// Builds a [`RelayBus`]; made by [`RelayBus::builder`].
#[must_use]
#[derive(Debug)]
pub struct RelayBusBuilder {
    store: MongoEventStore,
    subscriptions: Vec<Subscription>,
    transaction_timeout: Duration,
}

impl RelayBusBuilder {
    /// Adds a subscription.
    pub fn subscribe(mut self, subscription: Subscription) -> Self {
        self.subscriptions.push(subscription);
        self
    }

    /// The time budget of [`RelayBus::transaction`], 5 seconds by default (1 ms to 60 s, the
    /// longest a MongoDB transaction may live).
    pub fn transaction_timeout(mut self, timeout: Duration) -> Self {
        self.transaction_timeout = timeout;
        self
    }

    /// Validates the settings and builds the bus. Makes no database call.
    ///
    /// # Errors
    ///
    /// [`ConfigurationError`] for an invalid or duplicate handler id, or a setting out of range.
    pub fn build(self) -> Result<RelayBus, ConfigurationError> {
        if self.transaction_timeout < Duration::from_millis(1)
            || self.transaction_timeout > Duration::from_secs(60)
        {
            return Err(ConfigurationError::InvalidOption {
                option: "transaction_timeout",
                reason: format!(
                    "{:?} is out of range; use 1 ms to 60 s (MongoDB aborts longer transactions)",
                    self.transaction_timeout
                ),
            });
        }
        let mut handlers_by_type: HashMap<&'static str, Vec<String>> = HashMap::new();
        for (at, subscription) in self.subscriptions.iter().enumerate() {
            validate_handler_id(&subscription.id)?;
            if let Some(policy) = &subscription.retry {
                policy.validate()?;
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
        }
        Ok(RelayBus {
            inner: Arc::new(BusInner {
                store: self.store,
                subscriptions: self.subscriptions,
                handlers_by_type,
                transaction_timeout: self.transaction_timeout,
            }),
        })
    }
}

/// A pending publish of one event; made by [`RelayBus::publish`]. Runs when awaited.
#[must_use = "a publish does nothing until it is awaited"]
pub struct Publish<'a> {
    bus: &'a RelayBus,
    envelope: Result<EventEnvelope>,
    session: Option<&'a mut ClientSession>,
}

impl std::fmt::Debug for Publish<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Publish")
            .field("envelope", &self.envelope)
            .field("session", &self.session.is_some())
            .finish_non_exhaustive()
    }
}

impl<'a> Publish<'a> {
    fn map(
        mut self,
        f: impl FnOnce(EventEnvelope) -> Result<EventEnvelope, crate::EventValidationError>,
    ) -> Self {
        self.envelope = self.envelope.and_then(|e| f(e).map_err(Error::from));
        self
    }

    /// Appends the event in this session's transaction, so it commits with the business data
    /// written through the same session.
    pub fn session(mut self, session: &'a mut ClientSession) -> Self {
        self.session = Some(session);
        self
    }

    /// The ordering key: deliveries of one key run one at a time per handler, in commit order.
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

impl<'a> IntoFuture for Publish<'a> {
    type Output = Result<Appended>;
    type IntoFuture = Pin<Box<dyn Future<Output = Self::Output> + Send + 'a>>;

    fn into_future(self) -> Self::IntoFuture {
        Box::pin(async move {
            let envelope = self.envelope?;
            let mut appended = self
                .bus
                .append(self.session, std::slice::from_ref(&envelope))
                .await?;
            Ok(appended.remove(0))
        })
    }
}

/// A pending publish of several events; made by [`RelayBus::publish_all`]. Runs when awaited.
#[must_use = "a publish does nothing until it is awaited"]
pub struct PublishAll<'a> {
    bus: &'a RelayBus,
    envelopes: Vec<EventEnvelope>,
    session: Option<&'a mut ClientSession>,
}

impl std::fmt::Debug for PublishAll<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PublishAll")
            .field("envelopes", &self.envelopes.len())
            .field("session", &self.session.is_some())
            .finish_non_exhaustive()
    }
}

impl<'a> PublishAll<'a> {
    /// Appends the events in this session's transaction.
    pub fn session(mut self, session: &'a mut ClientSession) -> Self {
        self.session = Some(session);
        self
    }
}

impl<'a> IntoFuture for PublishAll<'a> {
    type Output = Result<Vec<Appended>>;
    type IntoFuture = Pin<Box<dyn Future<Output = Self::Output> + Send + 'a>>;

    fn into_future(self) -> Self::IntoFuture {
        Box::pin(async move { self.bus.append(self.session, &self.envelopes).await })
    }
}
