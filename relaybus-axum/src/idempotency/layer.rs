use std::{fmt, sync::Arc, time::Duration};

use axum::http::{HeaderName, request::Parts};
use relaybus::ConfigurationError;
use tower::Layer;

use super::Idempotent;

/// The header a client sends its key in, unless the builder names another.
pub const DEFAULT_HEADER: &str = "idempotency-key";
/// How long a stored answer is replayed, unless the builder says otherwise: 24 hours.
pub const DEFAULT_RETENTION: Duration = Duration::from_secs(24 * 3_600);
/// The longest request body read to compare requests, unless the builder says otherwise: 1 MiB.
pub const DEFAULT_MAX_REQUEST_BODY: usize = 1024 * 1024;
/// The longest response body stored, unless the builder says otherwise: 64 KiB.
pub const DEFAULT_MAX_RESPONSE_BODY: usize = 64 * 1024;

/// Who sent a request, as the application identifies its callers.
type Caller = Arc<dyn Fn(&Parts) -> Option<String> + Send + Sync>;

/// The settings of one [`IdempotencyLayer`].
pub(crate) struct Settings {
    pub(crate) header: HeaderName,
    pub(crate) retention: Duration,
    pub(crate) wait: Duration,
    pub(crate) retry_after: Duration,
    pub(crate) max_request_body: usize,
    pub(crate) max_response_body: usize,
    pub(crate) caller: Option<Caller>,
}

impl fmt::Debug for Settings {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Settings")
            .field("header", &self.header)
            .field("retention", &self.retention)
            .field("wait", &self.wait)
            .field("retry_after", &self.retry_after)
            .field("max_request_body", &self.max_request_body)
            .field("max_response_body", &self.max_response_body)
            .field("caller", &self.caller.is_some())
            .finish()
    }
}

/// Makes requests that carry an idempotency key idempotent: see the
/// [module docs](crate::idempotency). Put it inside the [`RequestTxLayer`](crate::RequestTxLayer)
/// (added before it), on a router or on single routes.
///
/// ```
/// # #[cfg(feature = "memory")]
/// # fn example(bus: relaybus::RelayBus<relaybus::MemoryEventStore>) -> Result<(), relaybus::ConfigurationError> {
/// use axum::{Router, routing::{get, post}};
/// use relaybus_axum::IdempotencyLayer;
///
/// let (state, request_tx) = relaybus_axum::setup(bus)?;
/// let app: Router = Router::new()
///     // Only `POST /orders` replays: the layer is on that route alone.
///     .route("/orders", post(|| async { "placed" }).layer(IdempotencyLayer::new()))
///     .route("/orders/{id}", get(|| async { "an order" }))
///     .layer(request_tx)
///     .with_state(state);
/// # let _ = app;
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct IdempotencyLayer {
    settings: Arc<Settings>,
}

impl Default for IdempotencyLayer {
    fn default() -> Self {
        IdempotencyLayer::new()
    }
}

impl IdempotencyLayer {
    /// The layer with the default settings: the `Idempotency-Key` header, answers kept 24
    /// hours, a request that finds its key's first request running answered 409 at once.
    pub fn new() -> Self {
        IdempotencyLayer::builder()
            .build()
            .unwrap_or_else(|_| panic!("BUG: the default idempotency settings are valid"))
    }

    /// The settings, to change before [`build`](IdempotencyLayerBuilder::build).
    pub fn builder() -> IdempotencyLayerBuilder {
        IdempotencyLayerBuilder {
            header: DEFAULT_HEADER.to_owned(),
            retention: DEFAULT_RETENTION,
            wait: Duration::ZERO,
            retry_after: Duration::from_secs(1),
            max_request_body: DEFAULT_MAX_REQUEST_BODY,
            max_response_body: DEFAULT_MAX_RESPONSE_BODY,
            caller: None,
        }
    }
}

impl<S> Layer<S> for IdempotencyLayer {
    type Service = Idempotent<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Idempotent::new(inner, Arc::clone(&self.settings))
    }
}

/// The settings of an [`IdempotencyLayer`], checked by [`build`](Self::build).
#[must_use = "the settings do nothing until `build` is called"]
pub struct IdempotencyLayerBuilder {
    header: String,
    retention: Duration,
    wait: Duration,
    retry_after: Duration,
    max_request_body: usize,
    max_response_body: usize,
    caller: Option<Caller>,
}

impl fmt::Debug for IdempotencyLayerBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotencyLayerBuilder")
            .field("header", &self.header)
            .field("retention", &self.retention)
            .field("wait", &self.wait)
            .field("caller", &self.caller.is_some())
            .finish_non_exhaustive()
    }
}

impl IdempotencyLayerBuilder {
    /// The request header that carries the key: `Idempotency-Key` by default.
    pub fn header(mut self, name: impl Into<String>) -> Self {
        self.header = name.into();
        self
    }

    /// How long an answer is replayed: 24 hours by default. After it the key counts as new,
    /// and the bus's retention purge deletes the answer.
    pub fn retention(mut self, retention: Duration) -> Self {
        self.retention = retention;
        self
    }

    /// How long a request whose key's first request is still running waits for that one to
    /// end (and then gets its answer) before it is answered 409: zero by default, 409 at once.
    pub fn wait(mut self, wait: Duration) -> Self {
        self.wait = wait;
        self
    }

    /// The `Retry-After` of a 409: 1 second by default.
    pub fn retry_after(mut self, delay: Duration) -> Self {
        self.retry_after = delay;
        self
    }

    /// The longest request body read to compare a repeat with the first request: 1 MiB by
    /// default. A longer one is answered 413.
    pub fn max_request_body(mut self, bytes: usize) -> Self {
        self.max_request_body = bytes;
        self
    }

    /// The longest response body stored: 64 KiB by default. A committed response with a longer
    /// one is answered 500 and its transaction aborted
    /// ([`IdempotencyError::ResponseTooLarge`](super::error::IdempotencyError::ResponseTooLarge)).
    pub fn max_response_body(mut self, bytes: usize) -> Self {
        self.max_response_body = bytes;
        self
    }

    /// Who sent a request, as your application identifies its callers (a user id from your
    /// authentication, say), read from the request's parts: keys are scoped by it, so one
    /// caller never gets another's answer. `None` for a request of no particular caller.
    ///
    /// ```
    /// use relaybus_axum::IdempotencyLayer;
    ///
    /// # fn example() -> Result<(), relaybus::ConfigurationError> {
    /// let layer = IdempotencyLayer::builder()
    ///     .caller(|parts| {
    ///         let user = parts.headers.get("x-user-id")?;
    ///         user.to_str().ok().map(str::to_owned)
    ///     })
    ///     .build()?;
    /// # let _ = layer;
    /// # Ok(())
    /// # }
    /// ```
    pub fn caller(
        mut self,
        caller: impl Fn(&Parts) -> Option<String> + Send + Sync + 'static,
    ) -> Self {
        self.caller = Some(Arc::new(caller));
        self
    }

    /// The layer.
    ///
    /// # Errors
    ///
    /// [`ConfigurationError::InvalidOption`] for a header name that is not one, a retention
    /// of zero or over a year, a wait or `Retry-After` over an hour, or a body limit of zero.
    pub fn build(self) -> Result<IdempotencyLayer, ConfigurationError> {
        let invalid = |option: &'static str, reason: String| ConfigurationError::InvalidOption {
            option,
            reason,
        };
        let header = HeaderName::try_from(self.header.as_str()).map_err(|_| {
            invalid(
                "header",
                format!(
                    "{:?} is not a header name; use letters, digits and dashes, such as \
                     \"Idempotency-Key\"",
                    self.header
                ),
            )
        })?;
        if self.retention.is_zero() || self.retention > Duration::from_secs(366 * 86_400) {
            return Err(invalid(
                "retention",
                format!(
                    "{:?} is out of range; keep answers for more than zero and at most a year",
                    self.retention
                ),
            ));
        }
        for (option, value) in [("wait", self.wait), ("retry_after", self.retry_after)] {
            if value > Duration::from_secs(3_600) {
                return Err(invalid(
                    option,
                    format!("{value:?} is over an hour; use at most 1 hour"),
                ));
            }
        }
        for (option, value) in [
            ("max_request_body", self.max_request_body),
            ("max_response_body", self.max_response_body),
        ] {
            if value == 0 {
                return Err(invalid(option, "0 bytes; use 1 byte or more".to_owned()));
            }
        }
        Ok(IdempotencyLayer {
            settings: Arc::new(Settings {
                header,
                retention: self.retention,
                wait: self.wait,
                retry_after: self.retry_after,
                max_request_body: self.max_request_body,
                max_response_body: self.max_response_body,
                caller: self.caller,
            }),
        })
    }
}
