//! [`Subscription`]: a handler subscribed to one event type under a stable id, with its
//! options and limits.

use std::{any::TypeId, fmt, future::Future, sync::Arc, time::Duration};

use futures::future::BoxFuture;

use super::{
    Handler, HandlerArguments, HandlerContext, RetryPolicy,
    seal::{self, Need},
};
use crate::{
    error::{BoxError, ConfigurationError},
    event::Event,
    state::StateMap,
    store::Store,
};

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
    /// After the event, the handler takes up to four
    /// [`HandlerArgument`](super::HandlerArgument)s, in any order:
    /// - a [`HandlerContext`], whose type names the store the handler runs on
    ///   (`HandlerContext` alone is the MongoDB store's); a handler without one runs on a bus
    ///   of any store;
    /// - a [`State<T>`](crate::State), a clone of the value of type `T` given to the bus with
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
