//! [`setup`](crate::setup) and its options: the state and the layer of one bus.

use std::{fmt, sync::Arc, time::Duration};

use axum::http::StatusCode;
use relaybus::{ConfigurationError, RelayBus, Store, store::DefaultStore};

use crate::transaction::RequestTxLayer;

/// How often an `UnknownTransactionCommitResult` is answered by sending the commit again, by
/// default.
pub(crate) const DEFAULT_COMMIT_RETRIES: u32 = 3;
/// The `Retry-After` of a 503 after a failed commit, by default.
pub(crate) const DEFAULT_RETRY_AFTER: Duration = Duration::from_secs(1);
/// How many times a request runs at most, by default, the first run included.
pub(crate) const DEFAULT_REQUEST_ATTEMPTS: u32 = 25;
/// The largest request body kept for running a request again, by default.
pub(crate) const DEFAULT_MAX_BUFFERED_BODY: usize = 256 * 1024;

/// Which response statuses commit the request's transaction; every other status aborts it.
///
/// The default commits on 1xx, 2xx and 3xx and aborts on 4xx and 5xx.
///
/// # Example
///
/// ```
/// use axum::http::StatusCode;
/// use relaybus_axum::CommitPolicy;
///
/// // Commit on 2xx only, and also on 409 Conflict, whose route records the attempt.
/// let policy = CommitPolicy::new(|status| status.is_success() || status == StatusCode::CONFLICT);
/// assert!(policy.commits(StatusCode::CREATED));
/// assert!(policy.commits(StatusCode::CONFLICT));
/// assert!(!policy.commits(StatusCode::SEE_OTHER));
/// assert!(CommitPolicy::default().commits(StatusCode::SEE_OTHER));
/// ```
#[derive(Clone)]
pub struct CommitPolicy {
    commits: Arc<dyn Fn(StatusCode) -> bool + Send + Sync>,
}

impl CommitPolicy {
    /// Commits when `commits` returns `true` for the response status.
    pub fn new(commits: impl Fn(StatusCode) -> bool + Send + Sync + 'static) -> Self {
        CommitPolicy {
            commits: Arc::new(commits),
        }
    }

    /// Commits on 2xx only.
    pub fn success_only() -> Self {
        CommitPolicy::new(|status| status.is_success())
    }

    /// Whether a response with this status commits.
    pub fn commits(&self, status: StatusCode) -> bool {
        (self.commits)(status)
    }
}

impl Default for CommitPolicy {
    fn default() -> Self {
        CommitPolicy::new(|status| status.as_u16() < 400)
    }
}

impl fmt::Debug for CommitPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CommitPolicy").finish_non_exhaustive()
    }
}

/// The options of the request transactions of one bus; made by [`config`](crate::config),
/// finished by [`setup`](Config::setup).
///
/// # Example
///
/// ```no_run
/// # fn example(bus: relaybus::RelayBus) -> Result<(), relaybus::ConfigurationError> {
/// use std::time::Duration;
///
/// use relaybus_axum::CommitPolicy;
///
/// let (state, layer) = relaybus_axum::config(bus)
///     .commit_policy(CommitPolicy::success_only())
///     .retry_after(Duration::from_secs(2))
///     .setup()?;
/// # let _ = (state, layer);
/// # Ok(())
/// # }
/// ```
#[must_use = "a configuration does nothing until `setup` is called"]
#[derive(Debug)]
pub struct Config<S: Store = DefaultStore> {
    bus: RelayBus<S>,
    policy: CommitPolicy,
    retry_after: Duration,
    commit_retries: u32,
    transaction_timeout: Option<Duration>,
    attempts: u32,
    max_buffered_body: usize,
}

impl<S: Store> Config<S> {
    pub(crate) fn new(bus: RelayBus<S>) -> Self {
        Config {
            bus,
            policy: CommitPolicy::default(),
            retry_after: DEFAULT_RETRY_AFTER,
            commit_retries: DEFAULT_COMMIT_RETRIES,
            transaction_timeout: None,
            attempts: DEFAULT_REQUEST_ATTEMPTS,
            max_buffered_body: DEFAULT_MAX_BUFFERED_BODY,
        }
    }

    /// How many times a request runs at most, the first run included: 25 by default, 1 to
    /// turn retries off (at most 100).
    ///
    /// A request whose transaction fails with a transient error (a write conflict on a hot
    /// ordering key, a primary that stepped down), at commit or in the route as its response
    /// says ([`RetryRequest`](crate::RetryRequest), which [`PublishError`](crate::PublishError)
    /// sets), is run again: its transaction is aborted, and after a short jittered pause the
    /// route runs again on a copy of the request, in a new transaction. All runs share the one
    /// [`transaction_timeout`](Self::transaction_timeout), counted from the first run's
    /// transaction.
    ///
    /// **The route may run more than once**, like the body of
    /// [`RelayBus::transaction`](relaybus::RelayBus::transaction): what it writes through the
    /// request's session is rolled back with each failed run, but other side effects (a call
    /// to another service, a message sent) are not. Publish an event for those instead; it is
    /// delivered once the request commits.
    pub fn request_attempts(mut self, attempts: u32) -> Self {
        self.attempts = attempts;
        self
    }

    /// The largest request body, in bytes, that is kept so that the request can run again:
    /// 256 KiB by default. A larger body, by its `Content-Length` or as it is read, is passed
    /// on as it comes, and its request runs once.
    pub fn max_buffered_body(mut self, bytes: usize) -> Self {
        self.max_buffered_body = bytes;
        self
    }

    /// Which statuses commit; see [`CommitPolicy`]. 1xx to 3xx by default.
    pub fn commit_policy(mut self, policy: CommitPolicy) -> Self {
        self.policy = policy;
        self
    }

    /// The `Retry-After` header of the 503 sent when the commit failed with a transient error
    /// or ran out of time, 1 second by default (sent in whole seconds, rounded up; at most one
    /// hour).
    pub fn retry_after(mut self, delay: Duration) -> Self {
        self.retry_after = delay;
        self
    }

    /// How many times a commit whose result is unknown (`UnknownTransactionCommitResult`, such
    /// as a connection lost during the commit) is sent again, 3 by default (at most 10). Sending
    /// a commit again is safe: the server commits a transaction once.
    pub fn commit_retries(mut self, retries: u32) -> Self {
        self.commit_retries = retries;
        self
    }

    /// The time budget of a request transaction, the bus's
    /// [`transaction_timeout`](RelayBus::transaction_timeout) by default (1 ms to 60 s).
    ///
    /// A transaction still open after the budget, counted from its first extraction, is
    /// aborted instead of committed (503). The commit is bounded on the server by the budget
    /// (MongoDB: `maxCommitTimeMS`), and a commit with no reply a second after the budget
    /// ended counts as timed out.
    pub fn transaction_timeout(mut self, timeout: Duration) -> Self {
        self.transaction_timeout = Some(timeout);
        self
    }

    /// Validates the options and returns the router state and the layer. Makes no database
    /// call.
    ///
    /// # Errors
    ///
    /// [`ConfigurationError::InvalidOption`] for an option out of range.
    pub fn setup(self) -> Result<(RelayState<S>, RequestTxLayer<S>), ConfigurationError> {
        let budget = self
            .transaction_timeout
            .unwrap_or_else(|| self.bus.transaction_timeout());
        relaybus::store::transaction::validate_budget(budget)?;
        if self.retry_after > Duration::from_secs(3_600) {
            return Err(ConfigurationError::InvalidOption {
                option: "retry_after",
                reason: format!("{:?} is over an hour; use at most 1 hour", self.retry_after),
            });
        }
        if self.commit_retries > 10 {
            return Err(ConfigurationError::InvalidOption {
                option: "commit_retries",
                reason: format!("{} is out of range; use 0 to 10", self.commit_retries),
            });
        }
        if !(1..=100).contains(&self.attempts) {
            return Err(ConfigurationError::InvalidOption {
                option: "request_attempts",
                reason: format!(
                    "{} is out of range; use 1 (no retries) to 100",
                    self.attempts
                ),
            });
        }
        let shared = Arc::new(Shared {
            bus: self.bus,
            policy: self.policy,
            retry_after: self.retry_after,
            commit_retries: self.commit_retries,
            budget,
            attempts: self.attempts,
            max_buffered_body: self.max_buffered_body,
        });
        Ok((
            RelayState {
                shared: Arc::clone(&shared),
            },
            RequestTxLayer::new(shared),
        ))
    }
}

/// What the layer, the extractors and the state of one [`setup`](crate::setup) share.
#[derive(Debug)]
pub(crate) struct Shared<S: Store> {
    pub(crate) bus: RelayBus<S>,
    pub(crate) policy: CommitPolicy,
    pub(crate) retry_after: Duration,
    pub(crate) commit_retries: u32,
    pub(crate) budget: Duration,
    /// How many times a request runs at most.
    pub(crate) attempts: u32,
    /// The largest body kept for running a request again.
    pub(crate) max_buffered_body: usize,
}

/// The router state that [`Publisher`](crate::Publisher) needs: the bus, from the same
/// [`setup`](crate::setup) call as the [`RequestTxLayer`].
///
/// Use it as the router's state, or make it part of yours with
/// [`FromRef`](axum::extract::FromRef):
///
/// ```no_run
/// use axum::extract::FromRef;
/// use relaybus_axum::RelayState;
///
/// #[derive(Clone)]
/// struct AppState {
///     relay: RelayState,
///     orders: mongodb::Collection<mongodb::bson::Document>,
/// }
///
/// impl FromRef<AppState> for RelayState {
///     fn from_ref(state: &AppState) -> Self {
///         state.relay.clone()
///     }
/// }
/// ```
#[derive(Debug)]
pub struct RelayState<S: Store = DefaultStore> {
    pub(crate) shared: Arc<Shared<S>>,
}

impl<S: Store> Clone for RelayState<S> {
    fn clone(&self) -> Self {
        RelayState {
            shared: Arc::clone(&self.shared),
        }
    }
}

impl<S: Store> RelayState<S> {
    /// The bus.
    pub fn bus(&self) -> &RelayBus<S> {
        &self.shared.bus
    }
}
