//! Where a bus reads the time: the system clock, or a [`TestClock`] that a test moves.
//!
//! Every time a bus hands to its store comes from its clock: when a publish is made and when
//! its delayed deliveries become due, the `now` of each claim (so which deliveries are due and
//! when leases end), when a failed attempt is retried (the backoff), when a dead letter died,
//! and the cutoffs of the retention purge. With a [`TestClock`], all of them stand still until
//! the test moves the clock: a test of backoff, delays, lease expiry or retention waits for
//! nothing.
//!
//! ```
//! use std::time::Duration;
//! use relaybus::{Timestamp, clock::TestClock};
//!
//! let clock = TestClock::new(Timestamp::from_millis(1_000));
//! clock.advance(Duration::from_secs(2));
//! assert_eq!(clock.now(), Timestamp::from_millis(3_000));
//! // A clone is the same clock: hand one to the bus, keep one to move it.
//! let handle = clock.clone();
//! handle.advance(Duration::from_millis(500));
//! assert_eq!(clock.now().timestamp_millis(), 3_500);
//! ```
//!
//! Timers that only pace the dispatcher (the poll interval, lease renewal, the shutdown
//! timeout, a handler's attempt timeout) run on Tokio's time, which `tokio::time::pause`
//! controls.

use std::{
    fmt,
    sync::{
        Arc,
        atomic::{AtomicI64, Ordering},
    },
    time::Duration,
};

use crate::time::Timestamp;

/// The clock of a bus: the system clock unless a [`TestClock`] is given to
/// [`RelayBusBuilder::clock`](crate::RelayBusBuilder::clock).
#[derive(Clone, Default)]
pub struct Clock {
    test: Option<TestClock>,
}

impl Clock {
    /// The system clock.
    pub fn system() -> Self {
        Clock::default()
    }

    /// The current time.
    pub fn now(&self) -> Timestamp {
        match &self.test {
            Some(test) => test.now(),
            None => Timestamp::now(),
        }
    }

    /// The test clock behind this clock, if it is one.
    pub fn as_test(&self) -> Option<&TestClock> {
        self.test.as_ref()
    }
}

impl From<TestClock> for Clock {
    fn from(test: TestClock) -> Self {
        Clock { test: Some(test) }
    }
}

impl fmt::Debug for Clock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.test {
            Some(test) => test.fmt(f),
            None => f.write_str("Clock::System"),
        }
    }
}

/// A clock that moves only when told to, shared by its clones.
///
/// It never runs backwards: [`advance_to`](Self::advance_to) a time already passed leaves it
/// where it is.
#[derive(Clone)]
pub struct TestClock {
    millis: Arc<AtomicI64>,
}

impl TestClock {
    /// A clock standing at `start`.
    pub fn new(start: Timestamp) -> Self {
        TestClock {
            millis: Arc::new(AtomicI64::new(start.timestamp_millis())),
        }
    }

    /// A clock standing at the current time of the system clock.
    pub fn starting_now() -> Self {
        TestClock::new(Timestamp::now())
    }

    /// The time it shows.
    pub fn now(&self) -> Timestamp {
        Timestamp::from_millis(self.millis.load(Ordering::SeqCst))
    }

    /// Moves the clock `by` forward, and returns the new time.
    pub fn advance(&self, by: Duration) -> Timestamp {
        let by = i64::try_from(by.as_millis()).unwrap_or(i64::MAX);
        let before = self
            .millis
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |now| {
                Some(now.saturating_add(by))
            })
            .unwrap_or_else(|now| now);
        Timestamp::from_millis(before.saturating_add(by))
    }

    /// Moves the clock forward to `at`, if it shows an earlier time, and returns the time it
    /// shows then.
    pub fn advance_to(&self, at: Timestamp) -> Timestamp {
        let before = self
            .millis
            .fetch_max(at.timestamp_millis(), Ordering::SeqCst);
        Timestamp::from_millis(before.max(at.timestamp_millis()))
    }
}

impl Default for TestClock {
    /// [`TestClock::starting_now`].
    fn default() -> Self {
        TestClock::starting_now()
    }
}

impl fmt::Debug for TestClock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("TestClock").field(&self.now()).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn never_runs_backwards() {
        let clock = TestClock::new(Timestamp::from_millis(10_000));
        assert_eq!(
            clock.advance_to(Timestamp::from_millis(5_000)),
            Timestamp::from_millis(10_000)
        );
        assert_eq!(
            clock.advance_to(Timestamp::from_millis(12_000)),
            Timestamp::from_millis(12_000)
        );
        assert_eq!(
            clock.advance(Duration::from_millis(1)),
            Timestamp::from_millis(12_001)
        );
        let bus_clock = Clock::from(clock.clone());
        assert_eq!(bus_clock.now(), clock.now());
        assert!(Clock::system().as_test().is_none());
    }
}
