//! Batch handlers: a handler that takes up to `max` deliveries of its event at once, as a
//! [`Batch`], and says how each of them went with a [`BatchOutcome`].

use std::{fmt, future::Future, sync::Arc, time::Duration};

use futures::future::BoxFuture;

use crate::{
    error::BoxError,
    event::Event,
    handler::{HandlerArguments, Permanent, Subscription, seal},
};

/// The most deliveries one batch may hold.
pub const MAX_BATCH: usize = 1_000;
/// How many deliveries a batch holds at most unless told otherwise.
pub const DEFAULT_MAX_BATCH: usize = 100;
/// How long a batch gathers deliveries at most unless told otherwise.
pub const DEFAULT_BATCH_WAIT: Duration = Duration::from_millis(50);

/// Up to `max` deliveries of one handler, gathered for at most its wait (see
/// [`Subscription::batch`]), in claim order.
///
/// A batch holds at most one delivery of each ordering key: the next delivery of a key is
/// handed out only once the one before it is settled, so the key's order holds across batches.
pub struct Batch<E> {
    items: Vec<BatchItem<E>>,
}

/// One delivery of a [`Batch`]: the event and what the handler may want to know about it.
pub struct BatchItem<E> {
    event: E,
    position: usize,
    event_id: String,
    key: Option<String>,
    sequence: Option<i64>,
    attempt: u32,
}

impl<E> Batch<E> {
    /// How many deliveries the batch holds (at least one).
    pub fn len(&self) -> usize {
        self.items.len()
    }

    /// Whether the batch is empty: never, for a batch the dispatcher hands out.
    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    /// The deliveries, in claim order.
    pub fn iter(&self) -> std::slice::Iter<'_, BatchItem<E>> {
        self.items.iter()
    }

    /// The events, in claim order.
    pub fn events(&self) -> impl Iterator<Item = &E> {
        self.items.iter().map(|item| &item.event)
    }
}

impl<E> IntoIterator for Batch<E> {
    type Item = BatchItem<E>;
    type IntoIter = std::vec::IntoIter<BatchItem<E>>;

    fn into_iter(self) -> Self::IntoIter {
        self.items.into_iter()
    }
}

impl<'a, E> IntoIterator for &'a Batch<E> {
    type Item = &'a BatchItem<E>;
    type IntoIter = std::slice::Iter<'a, BatchItem<E>>;

    fn into_iter(self) -> Self::IntoIter {
        self.items.iter()
    }
}

impl<E> fmt::Debug for Batch<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Batch")
            .field("len", &self.items.len())
            .finish_non_exhaustive()
    }
}

impl<E> BatchItem<E> {
    /// The event.
    pub fn event(&self) -> &E {
        &self.event
    }

    /// The event, taken out of the item (say what became of it with
    /// [`BatchOutcome::fail_at`] and [`position`](Self::position)).
    pub fn into_event(self) -> E {
        self.event
    }

    /// Where the delivery is in its batch, from 0.
    pub fn position(&self) -> usize {
        self.position
    }

    /// The event id.
    pub fn event_id(&self) -> &str {
        &self.event_id
    }

    /// The event's ordering key, if any.
    pub fn key(&self) -> Option<&str> {
        self.key.as_deref()
    }

    /// The event's sequence within its key, if keyed.
    pub fn sequence(&self) -> Option<i64> {
        self.sequence
    }

    /// Which attempt this is for the delivery, from 1.
    pub fn attempt(&self) -> u32 {
        self.attempt
    }
}

impl<E> fmt::Debug for BatchItem<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BatchItem")
            .field("position", &self.position)
            .field("event_id", &self.event_id)
            .field("key", &self.key)
            .field("sequence", &self.sequence)
            .field("attempt", &self.attempt)
            .finish_non_exhaustive()
    }
}

/// How each delivery of a batch went: every delivery succeeded unless marked failed.
///
/// A failed delivery is retried (or buried after its last attempt, or at once when failed
/// with [`Permanent`]) on its own, while the others complete: one poison event goes dead alone.
/// A batch handler that returns `Err` fails the whole batch: the shorthand for marking every
/// delivery failed with that error.
///
/// ```
/// use relaybus::{Batch, BatchOutcome, BoxError, Event};
/// # #[derive(serde::Serialize, serde::Deserialize)]
/// # struct OrderPlaced { total_cents: i64 }
/// # impl Event for OrderPlaced { const TYPE: &'static str = "order.placed.v1"; }
///
/// async fn bill_all(batch: Batch<OrderPlaced>) -> Result<BatchOutcome, BoxError> {
///     let mut outcome = BatchOutcome::succeeded();
///     for item in &batch {
///         if item.event().total_cents < 0 {
///             outcome.fail_permanently(item, "a negative total cannot be billed");
///         }
///     }
///     Ok(outcome)
/// }
/// ```
#[derive(Debug, Default)]
pub struct BatchOutcome {
    failures: Vec<(usize, String, bool)>,
}

impl BatchOutcome {
    /// Every delivery succeeded (until marked failed).
    pub fn succeeded() -> Self {
        BatchOutcome::default()
    }

    /// Marks `item`'s delivery failed with `error`: its attempt is charged, and it is retried
    /// after its backoff, or buried after its last attempt.
    pub fn fail<E>(&mut self, item: &BatchItem<E>, error: impl Into<BoxError>) -> &mut Self {
        self.fail_at(item.position, error)
    }

    /// Marks `item`'s delivery failed for good: it is buried at once (see [`Permanent`]).
    pub fn fail_permanently<E>(
        &mut self,
        item: &BatchItem<E>,
        error: impl Into<BoxError>,
    ) -> &mut Self {
        self.fail_at(item.position, Permanent::new(error))
    }

    /// Marks the delivery at `position` failed (a [`Permanent`] error buries it at once).
    /// Positions outside the batch are ignored.
    pub fn fail_at(&mut self, position: usize, error: impl Into<BoxError>) -> &mut Self {
        let error: BoxError = error.into();
        let permanent = error.downcast_ref::<Permanent>().is_some();
        self.failures.retain(|(at, _, _)| *at != position);
        self.failures
            .push((position, crate::error::chain(error.as_ref()), permanent));
        self
    }

    /// How many deliveries were marked failed.
    pub fn failures(&self) -> usize {
        self.failures.len()
    }

    /// The failure marked for the delivery at `position`: its message, and whether it is
    /// permanent.
    pub(crate) fn failure(&self, position: usize) -> Option<(&str, bool)> {
        self.failures
            .iter()
            .find(|(at, _, _)| *at == position)
            .map(|(_, message, permanent)| (message.as_str(), *permanent))
    }
}

impl From<()> for BatchOutcome {
    /// Every delivery succeeded: what `Ok(())` of a batch handler means.
    fn from((): ()) -> Self {
        BatchOutcome::succeeded()
    }
}

/// An async function that handles a batch of events of type `E`, taking the arguments `Args`
/// after the batch.
///
/// Implemented for every `Fn(Batch<E>, A1, .., An) -> impl Future<Output = Result<O, BoxError>>`
/// that is `Send + Sync + 'static`, where `O` is `()` or a [`BatchOutcome`], with up to four
/// arguments after the batch, each a [`HandlerArgument`](crate::HandlerArgument). A
/// [`HandlerContext`](crate::HandlerContext) taken by a batch handler describes the batch's
/// first delivery; its [`session`](crate::HandlerContext::session) is the batch's transaction.
pub trait BatchHandler<E: Event, Args>: Send + Sync + 'static {
    /// Handles one batch.
    fn call(
        &self,
        batch: Batch<E>,
        args: Args,
    ) -> BoxFuture<'static, Result<BatchOutcome, BoxError>>;
}

macro_rules! batch_arities {
    ($($arg:ident),*) => {
        impl<E, F, Fut, O, $($arg,)*> BatchHandler<E, ($($arg,)*)> for F
        where
            E: Event,
            F: Fn(Batch<E>, $($arg,)*) -> Fut + Send + Sync + 'static,
            Fut: Future<Output = Result<O, BoxError>> + Send + 'static,
            O: Into<BatchOutcome> + 'static,
            $($arg: crate::HandlerArgument,)*
        {
            #[allow(non_snake_case)]
            fn call(
                &self,
                batch: Batch<E>,
                ($($arg,)*): ($($arg,)*),
            ) -> BoxFuture<'static, Result<BatchOutcome, BoxError>> {
                let run = (self)(batch, $($arg,)*);
                Box::pin(async move { run.await.map(Into::into) })
            }
        }
    };
}

batch_arities!();
batch_arities!(A1);
batch_arities!(A1, A2);
batch_arities!(A1, A2, A3);
batch_arities!(A1, A2, A3, A4);

/// What the dispatcher knows of a delivery in a batch besides its payload.
#[derive(Debug, Clone)]
pub(crate) struct ItemMeta {
    pub(crate) event_id: String,
    pub(crate) key: Option<String>,
    pub(crate) sequence: Option<i64>,
    pub(crate) attempt: u32,
}

/// A batch handler with its event and argument types erased: it takes the payloads with their
/// metadata and the arguments' parts; payloads that no longer decode come back as failures
/// by position, without reaching the handler.
pub(crate) type ErasedBatchHandler = dyn Fn(
        Vec<(serde_json::Value, ItemMeta)>,
        &seal::Parts<'_>,
    ) -> BoxFuture<'static, Result<BatchOutcome, BoxError>>
    + Send
    + Sync;

/// A batch subscription's settings and handler.
#[derive(Clone)]
pub(crate) struct BatchSpec {
    pub(crate) max: usize,
    pub(crate) wait: Duration,
    pub(crate) handler: Arc<ErasedBatchHandler>,
}

impl fmt::Debug for BatchSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BatchSpec")
            .field("max", &self.max)
            .field("wait", &self.wait)
            .finish_non_exhaustive()
    }
}

impl Subscription {
    /// Subscribes a batch handler to the events of type `E` under the id `id`: the dispatcher
    /// gathers up to [`max_batch`](Self::max_batch) claimed deliveries of the handler (100 by
    /// default) for at most [`batch_wait`](Self::batch_wait) (50 ms by default) and hands them
    /// to one call. For a projection that inserts many rows at once, or a relay with a bulk
    /// endpoint.
    ///
    /// The handler says how each delivery went with a [`BatchOutcome`] (`Ok(())`: all
    /// succeeded; `Err`: all failed); failed deliveries are retried or buried one by one, so
    /// a poison event goes dead alone. [`transactional`](Self::transactional) runs the handler
    /// in one transaction that also completes every delivery that succeeded. A batch holds at
    /// most one delivery of each ordering key, so per-key order holds across batches. A batch
    /// takes one of its bus's handler slots. Batch handlers take no
    /// [`global_concurrency`](Self::global_concurrency) or [`rate_limit`](Self::rate_limit).
    ///
    /// ```
    /// use relaybus::{Batch, BoxError, Event, Subscription};
    /// # #[derive(serde::Serialize, serde::Deserialize)]
    /// # struct OrderPlaced { order_id: String }
    /// # impl Event for OrderPlaced { const TYPE: &'static str = "order.placed.v1"; }
    ///
    /// let project = Subscription::batch("project-orders", |batch: Batch<OrderPlaced>| async move {
    ///     let ids: Vec<&str> = batch.events().map(|e| e.order_id.as_str()).collect();
    ///     println!("inserting {} rows at once", ids.len());
    ///     Ok::<(), BoxError>(())
    /// })
    /// .max_batch(200);
    /// assert_eq!(project.batch_limits(), Some((200, std::time::Duration::from_millis(50))));
    /// ```
    pub fn batch<E, Args, H>(id: impl Into<String>, handler: H) -> Self
    where
        E: Event,
        Args: HandlerArguments,
        H: BatchHandler<E, Args>,
    {
        let handler = Arc::new(handler);
        let erased = move |items: Vec<(serde_json::Value, ItemMeta)>, parts: &seal::Parts<'_>| {
            let mut undecodable = Vec::new();
            let mut decoded = Vec::with_capacity(items.len());
            for (position, (payload, meta)) in items.into_iter().enumerate() {
                match serde_json::from_value::<E>(payload) {
                    Ok(event) => decoded.push(BatchItem {
                        event,
                        position,
                        event_id: meta.event_id,
                        key: meta.key,
                        sequence: meta.sequence,
                        attempt: meta.attempt,
                    }),
                    Err(error) => undecodable.push((
                        position,
                        format!(
                            "the stored payload of {} no longer deserializes into {}: {error}",
                            E::TYPE,
                            std::any::type_name::<E>()
                        ),
                    )),
                }
            }
            let args = match <Args as seal::Arguments>::take(parts) {
                Ok(args) => args,
                Err(error) => {
                    return Box::pin(async move { Err(BoxError::from(error)) })
                        as BoxFuture<'static, _>;
                }
            };
            let run = (!decoded.is_empty()).then(|| handler.call(Batch { items: decoded }, args));
            Box::pin(async move {
                let mut outcome = match run {
                    Some(run) => run.await?,
                    None => BatchOutcome::succeeded(),
                };
                for (position, error) in undecodable {
                    outcome.fail_at(position, Permanent::new(error));
                }
                Ok(outcome)
            }) as BoxFuture<'static, _>
        };
        let mut subscription = Subscription::new::<E, (), _>(id, |_: E| async {
            Err::<(), BoxError>("a batch handler runs only in batches".into())
        });
        subscription.needs = <Args as seal::Arguments>::needs().into();
        subscription.batch = Some(BatchSpec {
            max: DEFAULT_MAX_BATCH,
            wait: DEFAULT_BATCH_WAIT,
            handler: Arc::new(erased),
        });
        subscription
    }

    /// The most deliveries one batch of a batch handler holds, 100 by default (1 to 1,000;
    /// checked when the bus is built). No effect on other handlers.
    pub fn max_batch(mut self, max: usize) -> Self {
        if let Some(batch) = &mut self.batch {
            batch.max = max;
        }
        self
    }

    /// How long a batch handler's batch gathers deliveries at most after its first, 50 ms by
    /// default (at most 1 minute; checked when the bus is built): a full batch goes at once.
    /// No effect on other handlers.
    pub fn batch_wait(mut self, wait: Duration) -> Self {
        if let Some(batch) = &mut self.batch {
            batch.wait = wait;
        }
        self
    }

    /// A batch handler's most deliveries per batch and longest gathering wait; `None` for a
    /// handler of one delivery at a time.
    pub fn batch_limits(&self) -> Option<(usize, Duration)> {
        self.batch.as_ref().map(|batch| (batch.max, batch.wait))
    }
}
