//! Publishing: [`RelayBus::publish`] and its options ([`Publish`]), several events at once
//! ([`PublishAll`]), and the append both run.

use std::{
    future::{Future, IntoFuture},
    pin::Pin,
    time::{Duration, Instant},
};

use super::RelayBus;
use crate::{
    error::{ConfigurationError, Error, Result},
    event::{Event, EventEnvelope},
    store::{
        AppendRequest, Appended, DefaultStore, Store,
        transaction::{self, Attempts, Boxed},
    },
    telemetry::Operation,
    time::Timestamp,
};

impl<S: Store> RelayBus<S> {
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

    /// The ids of the [unordered](crate::Subscription::unordered) handlers subscribed to an
    /// event type.
    fn unordered_handlers_for(&self, event_type: &str) -> &[String] {
        self.inner
            .unordered_by_type
            .get(event_type)
            .map(Vec::as_slice)
            .unwrap_or(&[])
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
    /// (except for [unordered](crate::Subscription::unordered) handlers).
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
