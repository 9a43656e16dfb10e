//! Handlers and their subscriptions.

use std::{
    any::TypeId, collections::BTreeMap, fmt, future::Future, marker::PhantomData, sync::Arc,
    time::Duration,
};

use futures::future::BoxFuture;
use tokio::sync::{Mutex, OwnedMutexGuard};

use crate::{
    error::{BoxError, ConfigurationError},
    event::{Event, EventEnvelope},
    state::{State, StateMap},
    store::{DefaultStore, Store},
    time::Timestamp,
};

/// The longest handler id, in bytes.
pub(crate) const MAX_HANDLER_ID_BYTES: usize = 128;

/// Checks a handler id: 1 to 128 bytes of ASCII letters, digits, `_`, `-`, `.` and `:`.
///
/// Handler ids are stored with every delivery, so renaming a handler orphans its pending
/// deliveries: keep ids stable.
pub fn validate_handler_id(id: &str) -> Result<(), ConfigurationError> {
    let reason = if id.is_empty() {
        Some("it is empty")
    } else if id.len() > MAX_HANDLER_ID_BYTES {
        Some("it is longer than 128 bytes")
    } else if !id
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.' | b':'))
    {
        Some("it contains a character other than ASCII letters, digits, `_`, `-`, `.` and `:`")
    } else {
        None
    };
    match reason {
        Some(reason) => Err(ConfigurationError::InvalidHandlerId {
            id: id.to_owned(),
            reason,
        }),
        None => Ok(()),
    }
}

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

/// A handler error that no retry can fix (a payload the handler can never process, a failed
/// validation): the delivery is buried at once as a dead letter with this error, instead of
/// spending its remaining attempts.
///
/// ```
/// # use relaybus::{BoxError, HandlerContext, Permanent};
/// # #[derive(serde::Serialize, serde::Deserialize)]
/// # struct OrderPlaced { total_cents: i64 }
/// # impl relaybus::Event for OrderPlaced { const TYPE: &'static str = "order.placed.v1"; }
/// async fn bill(event: OrderPlaced, _: HandlerContext) -> Result<(), BoxError> {
///     if event.total_cents < 0 {
///         return Err(Permanent::new("a negative total cannot be billed").into());
///     }
///     Ok(())
/// }
/// ```
#[derive(Debug, thiserror::Error)]
#[error(transparent)]
pub struct Permanent(BoxError);

impl Permanent {
    /// Marks `error` as permanent.
    pub fn new(error: impl Into<BoxError>) -> Self {
        Permanent(error.into())
    }

    /// The error itself.
    pub fn into_inner(self) -> BoxError {
        self.0
    }
}

/// A handler asked for a transaction it does not have.
#[derive(Debug, Clone, thiserror::Error)]
#[error("handler {handler:?} has no transaction session: {reason}")]
pub struct NotTransactional {
    handler: String,
    reason: &'static str,
}

/// An async function that handles events of type `E`, taking the arguments `Args` after the
/// event.
///
/// Implemented for every `Fn(E, A1, .., An) -> impl Future<Output = Result<(), BoxError>>` that
/// is `Send + Sync + 'static`, with up to four arguments after the event, each a
/// [`HandlerArgument`]: a [`HandlerContext`] or a [`State`], in any order.
pub trait Handler<E: Event, Args>: Send + Sync + 'static {
    /// Handles one event. An error fails the attempt; the delivery is retried or buried.
    fn call(&self, event: E, args: Args) -> BoxFuture<'static, Result<(), BoxError>>;
}

/// What a handler may take after the event: its [`HandlerContext`], of the store it runs on,
/// or a [`State`] value given to the bus.
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot be an argument of a handler",
    label = "not a handler argument",
    note = "a handler takes the event, then any of `HandlerContext` and `State<T>` (for a `T` given with `RelayBusBuilder::state`)"
)]
pub trait HandlerArgument: seal::Argument + Send + 'static {}

/// The arguments of a handler after the event, as a tuple of [`HandlerArgument`]s.
pub trait HandlerArguments: seal::Arguments + Send + 'static {}

/// What the argument traits do, out of users' reach so that they can grow.
#[allow(unreachable_pub)]
pub(crate) mod seal {
    use std::any::{Any, TypeId};

    use super::StateMap;
    use crate::store::Store;

    /// What an argument of a handler needs from the bus it is subscribed to.
    #[derive(Debug, Clone, Copy)]
    pub enum Need {
        /// A context of this store.
        Context(StoreTag),
        /// A state value of this type.
        State {
            type_id: fn() -> TypeId,
            type_name: &'static str,
        },
    }

    /// The store a subscription's handler is written for.
    #[derive(Clone, Copy)]
    pub struct StoreTag {
        pub(crate) type_id: fn() -> TypeId,
        pub(crate) name: &'static str,
    }

    impl StoreTag {
        pub(crate) fn of<S: Store>() -> Self {
            StoreTag {
                type_id: TypeId::of::<S>,
                name: S::NAME,
            }
        }
    }

    /// What one run hands the arguments: the context, boxed, and the bus's state.
    pub struct Parts<'a> {
        pub(crate) context: &'a (dyn Any + Send),
        pub(crate) state: &'a StateMap,
    }

    impl std::fmt::Debug for Parts<'_> {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.debug_struct("Parts")
                .field("state", &self.state)
                .finish_non_exhaustive()
        }
    }

    impl std::fmt::Debug for StoreTag {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str(self.name)
        }
    }

    pub trait Argument: Sized {
        /// What the argument needs from the bus, checked when the bus is built.
        fn need() -> Option<Need>;
        /// The argument for one run.
        fn take(parts: &Parts<'_>) -> Result<Self, String>;
    }

    pub trait Arguments: Sized {
        fn needs() -> Vec<Need>;
        fn take(parts: &Parts<'_>) -> Result<Self, String>;
    }
}

impl<S: Store> seal::Argument for HandlerContext<S> {
    fn need() -> Option<Need> {
        Some(Need::Context(StoreTag::of::<S>()))
    }

    fn take(parts: &seal::Parts<'_>) -> Result<Self, String> {
        // `build` refuses a subscription of another store, so the context is of `S`.
        parts
            .context
            .downcast_ref::<HandlerContext<S>>()
            .cloned()
            .ok_or_else(|| {
                format!(
                    "handler context of another store than {}; subscribe the handler to a bus \
                     of that store",
                    S::NAME
                )
            })
    }
}

impl<S: Store> HandlerArgument for HandlerContext<S> {}

impl<T: Clone + Send + Sync + 'static> seal::Argument for State<T> {
    fn need() -> Option<Need> {
        Some(Need::State {
            type_id: TypeId::of::<T>,
            type_name: std::any::type_name::<T>(),
        })
    }

    fn take(parts: &seal::Parts<'_>) -> Result<Self, String> {
        // `build` refuses a handler whose state is missing, so the value is there.
        parts.state.get::<T>().map(State).ok_or_else(|| {
            format!(
                "no state of type {} was given to the bus; add it with `RelayBusBuilder::state`",
                std::any::type_name::<T>()
            )
        })
    }
}

impl<T: Clone + Send + Sync + 'static> HandlerArgument for State<T> {}

macro_rules! handler_arities {
    ($($arg:ident),*) => {
        impl<E, F, Fut, $($arg,)*> Handler<E, ($($arg,)*)> for F
        where
            E: Event,
            F: Fn(E, $($arg,)*) -> Fut + Send + Sync + 'static,
            Fut: Future<Output = Result<(), BoxError>> + Send + 'static,
            $($arg: HandlerArgument,)*
        {
            #[allow(non_snake_case)]
            fn call(
                &self,
                event: E,
                ($($arg,)*): ($($arg,)*),
            ) -> BoxFuture<'static, Result<(), BoxError>> {
                Box::pin((self)(event, $($arg,)*))
            }
        }

        impl<$($arg: HandlerArgument,)*> seal::Arguments for ($($arg,)*) {
            fn needs() -> Vec<Need> {
                let needs: [Option<Need>; 0 $(+ { let _ = stringify!($arg); 1 })*] =
                    [$(<$arg as seal::Argument>::need(),)*];
                needs.into_iter().flatten().collect()
            }

            #[allow(clippy::unused_unit)]
            fn take(_parts: &seal::Parts<'_>) -> Result<Self, String> {
                Ok(($(<$arg as seal::Argument>::take(_parts)?,)*))
            }
        }

        impl<$($arg: HandlerArgument,)*> HandlerArguments for ($($arg,)*) {}
    };
}

use seal::{Need, StoreTag};

handler_arities!();
handler_arities!(A1);
handler_arities!(A1, A2);
handler_arities!(A1, A2, A3);
handler_arities!(A1, A2, A3, A4);

/// A handler with its event and argument types erased: it takes the payload, the
/// `HandlerContext<S>` boxed as `Any` (of the store the bus runs on) and the bus's state.
type ErasedHandler = dyn Fn(serde_json::Value, &seal::Parts<'_>) -> BoxFuture<'static, Result<(), BoxError>>
    + Send
    + Sync;

/// A handler subscribed to one event type under a stable id.
///
/// # Example
///
/// ```
/// # use relaybus::{Event, Subscription, HandlerContext, BoxError};
/// # #[derive(serde::Serialize, serde::Deserialize)]
/// # struct OrderPlaced { order_id: String }
/// # impl Event for OrderPlaced { const TYPE: &'static str = "order.placed.v1"; }
/// let subscription = Subscription::new("send-confirmation", |event: OrderPlaced, _ctx: HandlerContext| async move {
///     println!("order {} placed", event.order_id);
///     Ok::<(), BoxError>(())
/// });
/// assert_eq!(subscription.event_type(), "order.placed.v1");
/// ```
#[derive(Clone)]
pub struct Subscription {
    pub(crate) id: String,
    pub(crate) event_type: &'static str,
    pub(crate) rust_type: &'static str,
    pub(crate) transactional: bool,
    /// Whether the handler's deliveries ignore the event's ordering key.
    pub(crate) unordered: bool,
    pub(crate) retry: Option<RetryPolicy>,
    /// How long one attempt may run; `None` for no limit.
    pub(crate) timeout: Option<Duration>,
    /// At most this many runs at once across every bus of the database.
    pub(crate) global_concurrency: Option<u32>,
    /// Names the partition of the global concurrency a delivery runs in, from its payload;
    /// `None` for one partition.
    pub(crate) concurrency_partition: Option<ConcurrencyPartition>,
    /// At most this many starts per interval across every bus of the database.
    pub(crate) rate_limit: Option<(u32, Duration)>,
    /// A batch handler's settings and handler; `None` for one delivery at a time.
    pub(crate) batch: Option<crate::batch::BatchSpec>,
    pub(crate) handler: Arc<ErasedHandler>,
    /// What the handler's arguments need from the bus: the store their context names (a
    /// handler without a context runs on any store), the state they take.
    pub(crate) needs: Arc<[Need]>,
}

impl Subscription {
    /// Subscribes `handler` to the events of type `E` under the id `id`.
    ///
    /// After the event, the handler takes up to four [`HandlerArgument`]s, in any order:
    /// - a [`HandlerContext`], whose type names the store the handler runs on
    ///   (`HandlerContext` alone is the MongoDB store's); a handler without one runs on a bus
    ///   of any store;
    /// - a [`State<T>`](State), a clone of the value of type `T` given to the bus with
    ///   [`RelayBusBuilder::state`](crate::RelayBusBuilder::state).
    ///
    /// The id is checked when the bus is built, and so are the store and the state: a bus of
    /// another store, or without a value of each state type asked for, refuses the
    /// subscription.
    ///
    /// ```
    /// # use relaybus::{BoxError, Event, Subscription};
    /// # #[derive(serde::Serialize, serde::Deserialize)]
    /// # struct UserSignedUp { email: String }
    /// # impl Event for UserSignedUp { const TYPE: &'static str = "user.signed-up.v1"; }
    /// let welcome = Subscription::new("welcome-mail", |event: UserSignedUp| async move {
    ///     println!("welcome, {}", event.email);
    ///     Ok::<(), BoxError>(())
    /// });
    /// assert_eq!(welcome.event_type(), "user.signed-up.v1");
    /// ```
    pub fn new<E, Args, H>(id: impl Into<String>, handler: H) -> Self
    where
        E: Event,
        Args: HandlerArguments,
        H: Handler<E, Args>,
    {
        let handler = Arc::new(handler);
        let erased = move |payload: serde_json::Value, parts: &seal::Parts<'_>| {
            let event = match decode::<E>(payload) {
                Ok(event) => event,
                Err(error) => return failed(error),
            };
            match <Args as seal::Arguments>::take(parts) {
                Ok(args) => handler.call(event, args),
                Err(error) => failed(error),
            }
        };
        Subscription {
            id: id.into(),
            event_type: E::TYPE,
            rust_type: std::any::type_name::<E>(),
            transactional: false,
            unordered: false,
            retry: None,
            timeout: None,
            global_concurrency: None,
            concurrency_partition: None,
            rate_limit: None,
            batch: None,
            handler: Arc::new(erased),
            needs: <Args as seal::Arguments>::needs().into(),
        }
    }

    /// Subscribes a handler that takes the event alone: the same as [`Subscription::new`]
    /// with such a handler, kept for the code that names it.
    pub fn without_context<E, F, Fut>(id: impl Into<String>, handler: F) -> Self
    where
        E: Event,
        F: Fn(E) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<(), BoxError>> + Send + 'static,
    {
        Subscription::new::<E, (), F>(id, handler)
    }

    /// Whether the handler runs on store `S`: it takes no context, a context of `S`, or is
    /// generic over the store. A bus on `S` refuses the others
    /// ([`ConfigurationError::HandlerOfAnotherStore`]).
    pub fn runs_on<S: Store>(&self) -> bool {
        self.needs.iter().all(|need| match need {
            Need::Context(tag) => (tag.type_id)() == TypeId::of::<S>(),
            Need::State { .. } => true,
        })
    }

    /// Refuses a subscription whose handler is written for another store than `S`, or takes
    /// a state the bus was not given.
    pub(crate) fn check_needs<S: Store>(&self, state: &StateMap) -> Result<(), ConfigurationError> {
        for need in self.needs.iter() {
            match *need {
                Need::Context(tag) if (tag.type_id)() != TypeId::of::<S>() => {
                    return Err(ConfigurationError::HandlerOfAnotherStore {
                        handler: self.id.clone(),
                        handler_store: tag.name,
                        bus_store: S::NAME,
                        bus_type: std::any::type_name::<S>(),
                    });
                }
                Need::State { type_id, type_name } if !state.contains(type_id()) => {
                    return Err(ConfigurationError::MissingState {
                        handler: self.id.clone(),
                        type_name,
                    });
                }
                _ => {}
            }
        }
        Ok(())
    }

    /// Runs the handler on a stored payload with the context of store `S` and the bus's state.
    pub(crate) fn call<S: Store>(
        &self,
        payload: serde_json::Value,
        context: HandlerContext<S>,
        state: &StateMap,
    ) -> BoxFuture<'static, Result<(), BoxError>> {
        let parts = seal::Parts {
            context: &context,
            state,
        };
        (self.handler)(payload, &parts)
    }

    /// Runs the handler inside a store transaction that also completes its delivery, so its
    /// writes and the completion commit together or not at all.
    pub fn transactional(mut self) -> Self {
        self.transactional = true;
        self
    }

    /// Lets the handler's deliveries ignore the event's ordering key: they spread over the lanes
    /// like those of unkeyed events, run concurrently with each other, and neither wait for
    /// nor hold back any other delivery of their key. A failed one retries without blocking
    /// the next events of its key for this handler. For a handler that does not care about
    /// order (sending a notification, feeding a search index that compares versions), where
    /// one slow or failing event should not stall its key.
    ///
    /// Only this handler is affected: the other handlers of the same event keep their key's
    /// order. The handler still sees the key and the sequence in its
    /// [`HandlerContext`]. It combines with [`transactional`](Self::transactional).
    ///
    /// The choice is recorded with each delivery when the event is published, so it is the
    /// publishing process's subscription that counts: register the handler as unordered
    /// wherever its event is published. Deliveries published before the switch keep the
    /// order they were published with.
    ///
    /// ```
    /// # use relaybus::{BoxError, Event, Subscription};
    /// # #[derive(serde::Serialize, serde::Deserialize)]
    /// # struct OrderPlaced { order_id: String }
    /// # impl Event for OrderPlaced { const TYPE: &'static str = "order.placed.v1"; }
    /// let notify = Subscription::without_context("notify-warehouse", |event: OrderPlaced| async move {
    ///     println!("order {} placed", event.order_id);
    ///     Ok::<(), BoxError>(())
    /// })
    /// .unordered();
    /// assert!(notify.is_unordered());
    /// ```
    pub fn unordered(mut self) -> Self {
        self.unordered = true;
        self
    }

    /// Overrides the bus's default retry policy for this handler.
    pub fn retry(mut self, policy: RetryPolicy) -> Self {
        self.retry = Some(policy);
        self
    }

    /// Fails an attempt that runs longer than `limit`: the handler is stopped, the attempt is
    /// charged with a timeout error and retried (or buried) like any failure, and its lease is
    /// no longer renewed. Without it, a hung handler holds its delivery, and its key, for as
    /// long as the process lives. At least 1 ms; checked when the bus is built.
    pub fn timeout(mut self, limit: Duration) -> Self {
        self.timeout = Some(limit);
        self
    }

    /// Runs at most `n` deliveries of this handler at once across every bus of the database,
    /// on every store: for a handler that calls a service which takes only so many requests
    /// at a time. (The bus's [`concurrency`](crate::RelayBusBuilder::concurrency) is per bus,
    /// so four buses make four times its load.) 1 to
    /// [`MAX_GLOBAL_CONCURRENCY`](crate::store::MAX_GLOBAL_CONCURRENCY); checked when the bus
    /// is built.
    ///
    /// A bus takes one of the handler's `n` slots in the store before it runs a delivery and
    /// gives it back after. A slot is a lease renewed with the bus's delivery leases, so a bus
    /// that dies holding slots gives them back within its
    /// [`lease_duration`](crate::RelayBusBuilder::lease_duration). A claimed delivery that
    /// finds every slot held waits for one, holding its delivery (and its key) but neither
    /// a handler slot of its bus nor an attempt; each bus keeps at most `n` such deliveries
    /// and gives the others back uncharged. Waits count in `relaybus.limit.waits`.
    ///
    /// ```
    /// # use relaybus::{BoxError, Event, Subscription};
    /// # #[derive(serde::Serialize, serde::Deserialize)]
    /// # struct OrderPlaced { order_id: String }
    /// # impl Event for OrderPlaced { const TYPE: &'static str = "order.placed.v1"; }
    /// let charge = Subscription::without_context("charge-card", |event: OrderPlaced| async move {
    ///     println!("charging for {}", event.order_id);
    ///     Ok::<(), BoxError>(())
    /// })
    /// .global_concurrency(4);
    /// assert_eq!(charge.global_concurrency_limit(), Some(4));
    /// ```
    pub fn global_concurrency(mut self, n: u32) -> Self {
        self.global_concurrency = Some(n);
        self
    }

    /// Partitions the handler's [`global_concurrency`](Self::global_concurrency): at most `n`
    /// runs at once per partition (a tenant, say) across every bus of the database, where
    /// `partition` names the partition of a delivery from its event. Each partition has `n`
    /// slots of its own in the store, and deliveries of one partition never wait for those
    /// of another.
    ///
    /// A payload that no longer deserializes as `E` runs in the partition `""`. The bus
    /// refuses a partition without a global concurrency when it is built.
    ///
    /// ```
    /// use relaybus::{BoxError, Event, Subscription};
    /// # #[derive(serde::Serialize, serde::Deserialize)]
    /// # struct OrderPlaced { tenant: String }
    /// # impl Event for OrderPlaced { const TYPE: &'static str = "order.placed.v1"; }
    /// let charge = Subscription::without_context("charge-card", |event: OrderPlaced| async move {
    ///     println!("charging for {}", event.tenant);
    ///     Ok::<(), BoxError>(())
    /// })
    /// .global_concurrency(2)
    /// .partition_concurrency_by(|event: &OrderPlaced| event.tenant.clone());
    /// assert!(charge.is_concurrency_partitioned());
    /// ```
    pub fn partition_concurrency_by<E, F>(mut self, partition: F) -> Self
    where
        E: Event,
        F: Fn(&E) -> String + Send + Sync + 'static,
    {
        self.concurrency_partition = Some(Arc::new(move |payload| {
            serde_json::from_value::<E>(serde_json::Value::Object(payload.clone()))
                .map(|event| partition(&event))
                .unwrap_or_default()
        }));
        self
    }

    /// Whether the handler's global concurrency is partitioned (see
    /// [`partition_concurrency_by`](Self::partition_concurrency_by)).
    pub fn is_concurrency_partitioned(&self) -> bool {
        self.concurrency_partition.is_some()
    }

    /// Starts at most `rate` deliveries of this handler per `interval` across every bus of
    /// the database: for a handler that calls a rate-limited API. `rate` at least 1,
    /// `interval` at least 1 ms; checked when the bus is built.
    ///
    /// The store keeps one counter per handler for fixed windows of `interval` (aligned on
    /// the Unix epoch); a start adds one, and goes while the window holds at most `rate`.
    /// A delivery refused waits for the next window, holding its delivery but neither a
    /// handler slot of its bus nor an attempt, so other handlers run meanwhile; waits count in
    /// `relaybus.limit.waits`. Every window of `interval` starts at most `rate`; a span of
    /// `interval` across a window boundary may start up to `2 * rate`, and one of `k`
    /// intervals at most `(k + 1) * rate`. This design costs one single-row write per bus and
    /// window for all the deliveries waiting there, holds across processes and crashes
    /// without dividing the rate among the live buses, and needs no token refill arithmetic.
    ///
    /// ```
    /// # use std::time::Duration;
    /// # use relaybus::{BoxError, Event, Subscription};
    /// # #[derive(serde::Serialize, serde::Deserialize)]
    /// # struct UserSignedUp { email: String }
    /// # impl Event for UserSignedUp { const TYPE: &'static str = "user.signed-up.v1"; }
    /// let mail = Subscription::without_context("welcome-mail", |event: UserSignedUp| async move {
    ///     println!("mailing {}", event.email);
    ///     Ok::<(), BoxError>(())
    /// })
    /// .rate_limit(50, Duration::from_secs(1));
    /// assert_eq!(mail.rate(), Some((50, Duration::from_secs(1))));
    /// ```
    pub fn rate_limit(mut self, rate: u32, interval: Duration) -> Self {
        self.rate_limit = Some((rate, interval));
        self
    }

    /// The handler's global concurrency, if limited (see
    /// [`global_concurrency`](Self::global_concurrency)).
    pub fn global_concurrency_limit(&self) -> Option<u32> {
        self.global_concurrency
    }

    /// The handler's rate limit, if any: starts per interval (see
    /// [`rate_limit`](Self::rate_limit)).
    pub fn rate(&self) -> Option<(u32, Duration)> {
        self.rate_limit
    }

    /// Refuses limits no delivery could pass, or that the store cannot keep.
    pub(crate) fn check_limits(&self) -> Result<(), ConfigurationError> {
        let max = crate::store::MAX_GLOBAL_CONCURRENCY;
        if let Some(n) = self.global_concurrency
            && !(1..=max).contains(&n)
        {
            return Err(ConfigurationError::InvalidOption {
                option: "global_concurrency",
                reason: format!(
                    "handler {:?} has a global concurrency of {n}; use 1 to {max}, or no limit",
                    self.id
                ),
            });
        }
        if self.concurrency_partition.is_some() && self.global_concurrency.is_none() {
            return Err(ConfigurationError::InvalidOption {
                option: "partition_concurrency_by",
                reason: format!(
                    "handler {:?} partitions a global concurrency it does not have; add \
                     `global_concurrency(n)`, or drop the partition",
                    self.id
                ),
            });
        }
        if let Some((rate, interval)) = self.rate_limit
            && (rate == 0 || interval < Duration::from_millis(1))
        {
            return Err(ConfigurationError::InvalidOption {
                option: "rate_limit",
                reason: format!(
                    "handler {:?} has a rate limit of {rate} per {interval:?}, which lets no \
                     delivery start; use a rate of at least 1 per at least 1 ms, or no limit",
                    self.id
                ),
            });
        }
        if let Some(batch) = &self.batch {
            if !(1..=crate::batch::MAX_BATCH).contains(&batch.max) {
                return Err(ConfigurationError::InvalidOption {
                    option: "max_batch",
                    reason: format!(
                        "batch handler {:?} takes batches of at most {}; use 1 to {}",
                        self.id,
                        batch.max,
                        crate::batch::MAX_BATCH
                    ),
                });
            }
            if batch.wait > Duration::from_secs(60) {
                return Err(ConfigurationError::InvalidOption {
                    option: "batch_wait",
                    reason: format!(
                        "batch handler {:?} gathers its batches for {:?}, which holds their \
                         deliveries too long; use at most 1 minute",
                        self.id, batch.wait
                    ),
                });
            }
            if self.is_limited() {
                return Err(ConfigurationError::InvalidOption {
                    option: "global_concurrency",
                    reason: format!(
                        "batch handler {:?} has a global concurrency or a rate limit, which \
                         batch handlers do not take; drop the limit, or handle one delivery \
                         at a time",
                        self.id
                    ),
                });
            }
        }
        Ok(())
    }

    /// Whether a delivery of the handler has to pass a limit before it runs.
    pub(crate) fn is_limited(&self) -> bool {
        self.global_concurrency.is_some() || self.rate_limit.is_some()
    }

    /// How long one attempt may run, if limited.
    pub fn attempt_timeout(&self) -> Option<Duration> {
        self.timeout
    }

    /// The handler's own retry policy, if it overrides the bus's default.
    pub fn retry_policy(&self) -> Option<&RetryPolicy> {
        self.retry.as_ref()
    }

    /// The handler id.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The event type name the handler subscribes to.
    pub fn event_type(&self) -> &'static str {
        self.event_type
    }

    /// Whether the handler is transactional.
    pub fn is_transactional(&self) -> bool {
        self.transactional
    }

    /// Whether the handler's deliveries ignore the event's ordering key (see
    /// [`unordered`](Self::unordered)).
    pub fn is_unordered(&self) -> bool {
        self.unordered
    }
}

/// The event of a stored payload.
fn decode<E: Event>(payload: serde_json::Value) -> Result<E, String> {
    serde_json::from_value(payload).map_err(|error| {
        format!(
            "the stored payload of {} no longer deserializes into {}: {error}",
            E::TYPE,
            std::any::type_name::<E>()
        )
    })
}

/// A handler run that failed before the handler was called.
fn failed(message: String) -> BoxFuture<'static, Result<(), BoxError>> {
    Box::pin(async move { Err(BoxError::from(message)) })
}

/// Names the partition of a handler's global concurrency that a delivery runs in, from its
/// event's payload (see [`Subscription::partition_concurrency_by`]).
pub(crate) type ConcurrencyPartition =
    Arc<dyn Fn(&serde_json::Map<String, serde_json::Value>) -> String + Send + Sync>;

impl fmt::Debug for Subscription {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Subscription")
            .field("id", &self.id)
            .field("event_type", &self.event_type)
            .field("rust_type", &self.rust_type)
            .field("transactional", &self.transactional)
            .field("unordered", &self.unordered)
            .field("retry", &self.retry)
            .field("timeout", &self.timeout)
            .field("global_concurrency", &self.global_concurrency)
            .field(
                "concurrency_partitioned",
                &self.concurrency_partition.is_some(),
            )
            .field("rate_limit", &self.rate_limit)
            .field("batch", &self.batch)
            .finish_non_exhaustive()
    }
}

/// How often a failed delivery is tried again, and how long to wait in between.
///
/// The wait before attempt `n + 1` is `initial_backoff * 2^(n - 1)`, capped at `max_backoff`,
/// with up to a quarter of it taken off at random so that failures of many deliveries do not
/// retry in lock step. After `max_attempts` failed attempts the delivery is buried as a dead
/// letter, kept with its last error until an operator requeues it.
///
/// # Example
///
/// ```
/// use std::time::Duration;
/// use relaybus::RetryPolicy;
///
/// let policy = RetryPolicy::new(8)
///     .initial_backoff(Duration::from_millis(200))
///     .max_backoff(Duration::from_secs(30));
/// assert_eq!(policy.max_attempts(), 8);
/// assert_eq!(policy.backoff(1), Duration::from_millis(200));
/// assert_eq!(policy.backoff(4), Duration::from_millis(1600));
/// assert_eq!(policy.backoff(20), Duration::from_secs(30));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryPolicy {
    max_attempts: u32,
    initial_backoff: Duration,
    max_backoff: Duration,
}

impl Default for RetryPolicy {
    /// 10 attempts, waits from 1 second doubling up to 5 minutes.
    fn default() -> Self {
        RetryPolicy {
            max_attempts: 10,
            initial_backoff: Duration::from_secs(1),
            max_backoff: Duration::from_secs(300),
        }
    }
}

impl RetryPolicy {
    /// A policy of `max_attempts` attempts in all (the first run included), with the default
    /// waits.
    pub fn new(max_attempts: u32) -> Self {
        RetryPolicy {
            max_attempts,
            ..RetryPolicy::default()
        }
    }

    /// The wait after the first failure.
    pub fn initial_backoff(mut self, wait: Duration) -> Self {
        self.initial_backoff = wait;
        self
    }

    /// The longest wait.
    pub fn max_backoff(mut self, wait: Duration) -> Self {
        self.max_backoff = wait;
        self
    }

    /// The number of attempts in all.
    pub fn max_attempts(&self) -> u32 {
        self.max_attempts
    }

    /// The wait after failed attempt `attempt` (1-based), before jitter.
    pub fn backoff(&self, attempt: u32) -> Duration {
        let doublings = attempt.saturating_sub(1).min(40);
        self.initial_backoff
            .checked_mul(1_u32 << doublings.min(31))
            .unwrap_or(self.max_backoff)
            .min(self.max_backoff)
    }

    /// Checks the policy: at least one attempt, at most 1000; waits ordered and under a day.
    pub fn validate(&self) -> Result<(), ConfigurationError> {
        let problem = if !(1..=1000).contains(&self.max_attempts) {
            Some(format!(
                "max_attempts {} is out of range; use 1 to 1000",
                self.max_attempts
            ))
        } else if self.initial_backoff.is_zero() {
            Some("initial_backoff is zero; use at least 1 ms".to_owned())
        } else if self.max_backoff < self.initial_backoff {
            Some(format!(
                "max_backoff {:?} is shorter than initial_backoff {:?}; make it at least as long \
                 (initial_backoff is 1 s unless set)",
                self.max_backoff, self.initial_backoff
            ))
        } else if self.max_backoff > Duration::from_secs(86_400) {
            Some(format!(
                "max_backoff {:?} is over a day; use at most 24 hours",
                self.max_backoff
            ))
        } else {
            None
        };
        match problem {
            Some(reason) => Err(ConfigurationError::InvalidOption {
                option: "retry",
                reason,
            }),
            None => Ok(()),
        }
    }
}
