//! [`HandlerContext`]: what a handler learns about the delivery it runs for, and the session
//! of a transactional handler.

use std::{collections::BTreeMap, fmt, marker::PhantomData, sync::Arc};

use tokio::sync::{Mutex, OwnedMutexGuard};

use crate::{
    event::EventEnvelope,
    store::{DefaultStore, Store},
    time::Timestamp,
};

/// What a handler learns about the delivery it runs for, besides the event itself, and, for a
/// transactional handler, the session of the transaction its delivery completes in.
///
/// `S` is the store the handler runs on, the MongoDB store unless named: a handler that asks
/// for `HandlerContext<S>` can only be subscribed to a bus of that store (its session is
/// `S::Session`).
pub struct HandlerContext<S: Store = DefaultStore> {
    event_id: String,
    event_type: String,
    key: Option<String>,
    sequence: Option<i64>,
    correlation_id: Option<String>,
    causation_id: Option<String>,
    headers: BTreeMap<String, String>,
    created_at: Timestamp,
    handler: String,
    attempt: u32,
    session: Option<Arc<Mutex<S::Session>>>,
    store: PhantomData<fn() -> S>,
}

impl<S: Store> Clone for HandlerContext<S> {
    fn clone(&self) -> Self {
        HandlerContext {
            event_id: self.event_id.clone(),
            event_type: self.event_type.clone(),
            key: self.key.clone(),
            sequence: self.sequence,
            correlation_id: self.correlation_id.clone(),
            causation_id: self.causation_id.clone(),
            headers: self.headers.clone(),
            created_at: self.created_at,
            handler: self.handler.clone(),
            attempt: self.attempt,
            session: self.session.clone(),
            store: PhantomData,
        }
    }
}

impl<S: Store> fmt::Debug for HandlerContext<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HandlerContext")
            .field("event_id", &self.event_id)
            .field("event_type", &self.event_type)
            .field("key", &self.key)
            .field("sequence", &self.sequence)
            .field("handler", &self.handler)
            .field("attempt", &self.attempt)
            .field("transactional", &self.session.is_some())
            .finish_non_exhaustive()
    }
}

impl<S: Store> HandlerContext<S> {
    /// A context for calling a handler outside the dispatcher, in unit tests for example: the
    /// event's metadata, attempt 1, and no transaction.
    pub fn detached(event: &EventEnvelope, handler: impl Into<String>) -> Self {
        HandlerContext {
            event_id: event.id().to_owned(),
            event_type: event.event_type().to_owned(),
            key: event.key().map(str::to_owned),
            sequence: None,
            correlation_id: event.correlation_id().map(str::to_owned),
            causation_id: event.causation_id().map(str::to_owned),
            headers: event.headers().clone(),
            created_at: event.created_at(),
            handler: handler.into(),
            attempt: 1,
            session: None,
            store: PhantomData,
        }
    }

    pub(crate) fn for_delivery(
        event: &EventEnvelope,
        handler: &str,
        sequence: Option<i64>,
        attempt: u32,
        session: Option<Arc<Mutex<S::Session>>>,
    ) -> Self {
        HandlerContext {
            sequence,
            attempt,
            session,
            ..HandlerContext::detached(event, handler)
        }
    }

    /// The event id.
    pub fn event_id(&self) -> &str {
        &self.event_id
    }

    /// The event type name.
    pub fn event_type(&self) -> &str {
        &self.event_type
    }

    /// The ordering key, if the event has one.
    pub fn key(&self) -> Option<&str> {
        self.key.as_deref()
    }

    /// The event's sequence within its key, if it has a key.
    pub fn sequence(&self) -> Option<i64> {
        self.sequence
    }

    /// The correlation id, if any.
    pub fn correlation_id(&self) -> Option<&str> {
        self.correlation_id.as_deref()
    }

    /// The causation id, if any.
    pub fn causation_id(&self) -> Option<&str> {
        self.causation_id.as_deref()
    }

    /// The event's headers.
    pub fn headers(&self) -> &BTreeMap<String, String> {
        &self.headers
    }

    /// When the event was made.
    pub fn created_at(&self) -> Timestamp {
        self.created_at
    }

    /// The id of the handler running.
    pub fn handler(&self) -> &str {
        &self.handler
    }

    /// Which attempt this is, starting at 1.
    pub fn attempt(&self) -> u32 {
        self.attempt
    }

    /// Whether the handler runs in a transaction that completes its delivery.
    pub fn is_transactional(&self) -> bool {
        self.session.is_some()
    }

    /// The session of the transaction a transactional handler runs in. Pass it to every write
    /// that must commit together with the delivery's completion:
    ///
    /// ```no_run
    /// # use relaybus::{BoxError, HandlerContext};
    /// # async fn projector(ctx: HandlerContext, projections: mongodb::Collection<mongodb::bson::Document>) -> Result<(), BoxError> {
    /// let mut session = ctx.session().await?;
    /// projections
    ///     .insert_one(mongodb::bson::doc! { "event": ctx.event_id() })
    ///     .session(&mut *session)
    ///     .await?;
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// Drop the guard before the handler returns; the dispatcher needs the session back to
    /// complete the delivery and commit.
    ///
    /// # Errors
    ///
    /// [`NotTransactional`] when the handler was not subscribed as transactional, or when the
    /// session is held already (two guards at once would deadlock).
    pub async fn session(&self) -> Result<SessionGuard<S>, NotTransactional> {
        let session = self.session.as_ref().ok_or_else(|| NotTransactional {
            handler: self.handler.clone(),
            reason: "it is not subscribed as transactional; use `Subscription::transactional()` \
                     or `#[handler(.., transactional)]`",
        })?;
        let guard = Arc::clone(session)
            .try_lock_owned()
            .map_err(|_| NotTransactional {
                handler: self.handler.clone(),
                reason: "the session is held by another guard of this handler; drop it first",
            })?;
        Ok(SessionGuard { guard })
    }
}

/// The session of a transactional handler's transaction; derefs to the store's session (the
/// driver's `ClientSession` for MongoDB). Made by [`HandlerContext::session`].
pub struct SessionGuard<S: Store = DefaultStore> {
    guard: OwnedMutexGuard<S::Session>,
}

impl<S: Store> fmt::Debug for SessionGuard<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SessionGuard").finish_non_exhaustive()
    }
}

impl<S: Store> std::ops::Deref for SessionGuard<S> {
    type Target = S::Session;
    fn deref(&self) -> &S::Session {
        &self.guard
    }
}

impl<S: Store> std::ops::DerefMut for SessionGuard<S> {
    fn deref_mut(&mut self) -> &mut S::Session {
        &mut self.guard
    }
}

/// A handler asked for a transaction it does not have.
#[derive(Debug, Clone, thiserror::Error)]
#[error("handler {handler:?} has no transaction session: {reason}")]
pub struct NotTransactional {
    handler: String,
    reason: &'static str,
}
