//! Handlers and their subscriptions.

use std::{fmt, future::Future, sync::Arc};

use futures::future::BoxFuture;

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

/// What a handler learns about the delivery it runs for, besides the event itself.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct HandlerContext {
    /// The event id.
    pub event_id: String,
    /// The event type name.
    pub event_type: String,
    /// The ordering key, if the event has one.
    pub key: Option<String>,
    /// The handler's id.
    pub handler: String,
    /// Which attempt this is, starting at 1.
    pub attempt: u32,
}

/// An async function that handles events of type `E`.
///
/// Implemented for every `Fn(E, HandlerContext) -> impl Future<Output = Result<(), BoxError>>`
/// that is `Send + Sync + 'static`.
pub trait Handler<E: Event>: Send + Sync + 'static {
    /// Handles one event. An error fails the attempt; the delivery is retried or buried.
    fn call(&self, event: E, context: HandlerContext) -> BoxFuture<'static, Result<(), BoxError>>;
}

impl<E, F, Fut> Handler<E> for F
where
    E: Event,
    F: Fn(E, HandlerContext) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<(), BoxError>> + Send + 'static,
{
    fn call(&self, event: E, context: HandlerContext) -> BoxFuture<'static, Result<(), BoxError>> {
        Box::pin((self)(event, context))
    }
}

type ErasedHandler = dyn Fn(serde_json::Value, HandlerContext) -> BoxFuture<'static, Result<(), BoxError>>
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
    #[allow(dead_code)] // run by the dispatcher
    pub(crate) handler: Arc<ErasedHandler>,
}

impl Subscription {
    /// Subscribes `handler` to the events of type `E` under the id `id`.
    ///
    /// The id is checked when the bus is built.
    pub fn new<E: Event, H: Handler<E>>(id: impl Into<String>, handler: H) -> Self {
        let handler = Arc::new(handler);
        let erased = move |payload: serde_json::Value, context: HandlerContext| {
            let handler = Arc::clone(&handler);
            let event: Result<E, _> = serde_json::from_value(payload);
            match event {
                Ok(event) => handler.call(event, context),
                Err(error) => {
                    let message = format!(
                        "the stored payload of {} no longer deserializes into {}: {error}",
                        E::TYPE,
                        std::any::type_name::<E>()
                    );
                    Box::pin(async move { Err(BoxError::from(message)) })
                        as BoxFuture<'static, Result<(), BoxError>>
                }
            }
        };
        Subscription {
            id: id.into(),
            event_type: E::TYPE,
            rust_type: std::any::type_name::<E>(),
            transactional: false,
            handler: Arc::new(erased),
        }
    }

    /// Runs the handler inside a store transaction that also completes its delivery, so its
    /// writes and the completion commit together or not at all.
    pub fn transactional(mut self) -> Self {
        self.transactional = true;
        self
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
}

impl fmt::Debug for Subscription {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Subscription")
            .field("id", &self.id)
            .field("event_type", &self.event_type)
            .field("rust_type", &self.rust_type)
            .field("transactional", &self.transactional)
            .finish_non_exhaustive()
    }
}
