//! [`RetryPolicy`]: how often a failed delivery is tried again, and how long to wait in between.

use std::time::Duration;

use crate::error::ConfigurationError;

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
