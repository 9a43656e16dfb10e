//! Handlers and their subscriptions: the [`Handler`] functions, what they take after the event
//! ([`HandlerContext`] in `context`, the argument traits in `arguments`), how they are
//! subscribed ([`Subscription`], in `subscription`) and retried ([`RetryPolicy`], in `retry`).

mod arguments;
mod context;
mod retry;
mod subscription;

use futures::future::BoxFuture;

pub(crate) use self::{arguments::seal, subscription::ConcurrencyPartition};
pub use self::{
    arguments::{HandlerArgument, HandlerArguments},
    context::{HandlerContext, NotTransactional, SessionGuard},
    retry::RetryPolicy,
    subscription::Subscription,
};
use crate::{
    error::{BoxError, ConfigurationError},
    event::Event,
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

/// An async function that handles events of type `E`, taking the arguments `Args` after the
/// event.
///
/// Implemented for every `Fn(E, A1, .., An) -> impl Future<Output = Result<(), BoxError>>` that
/// is `Send + Sync + 'static`, with up to four arguments after the event, each a
/// [`HandlerArgument`]: a [`HandlerContext`] or a [`State`](crate::State), in any order.
pub trait Handler<E: Event, Args>: Send + Sync + 'static {
    /// Handles one event. An error fails the attempt; the delivery is retried or buried.
    fn call(&self, event: E, args: Args) -> BoxFuture<'static, Result<(), BoxError>>;
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
