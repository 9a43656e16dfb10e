//! What this process's handlers did in the last hour, minute by minute, counted in memory: the
//! operator page's throughput and failures, at the cost of one uncontended lock per handler
//! run and no write to the store.

use std::sync::Mutex;

use crate::time::Timestamp;

/// How many minutes the log keeps.
pub const ACTIVITY_MINUTES: usize = 60;

/// What one handler did in this process over the last hour, from [`RelayBus::activity`](crate::RelayBus::activity).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct HandlerActivity {
    /// The handler id.
    pub handler: String,
    /// Runs that succeeded in the last hour.
    pub succeeded: u64,
    /// Runs that failed (retried later or dead-lettered) in the last hour.
    pub failed: u64,
    /// Deliveries this process dead-lettered in the last hour.
    pub dead_lettered: u64,
    /// The minutes with any run, oldest first.
    pub minutes: Vec<ActivityMinute>,
}

/// One minute of a [`HandlerActivity`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct ActivityMinute {
    /// The start of the minute.
    pub start: Timestamp,
    /// Runs that succeeded.
    pub succeeded: u64,
    /// Runs that failed.
    pub failed: u64,
    /// Deliveries dead-lettered.
    pub dead_lettered: u64,
}

/// What happened to a run, for [`ActivityLog::record`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Outcome {
    Succeeded,
    Failed,
    DeadLettered,
}

#[derive(Debug, Clone, Copy, Default)]
struct Bucket {
    /// Minutes since the Unix epoch.
    minute: u64,
    succeeded: u64,
    failed: u64,
    dead_lettered: u64,
}

/// A ring of per-minute counts, one slot per minute of the last hour.
#[derive(Debug)]
pub(crate) struct ActivityLog {
    buckets: Mutex<[Bucket; ACTIVITY_MINUTES]>,
}

impl Default for ActivityLog {
    fn default() -> Self {
        ActivityLog {
            buckets: Mutex::new([Bucket::default(); ACTIVITY_MINUTES]),
        }
    }
}

fn minute_of(now: Timestamp) -> u64 {
    u64::try_from(now.timestamp_millis().max(0)).unwrap_or(0) / 60_000
}

impl ActivityLog {
    /// Counts one outcome in the current minute.
    pub(crate) fn record(&self, outcome: Outcome, now: Timestamp) {
        let minute = minute_of(now);
        let mut buckets = self.buckets.lock().unwrap_or_else(|e| e.into_inner());
        let bucket = &mut buckets[(minute % ACTIVITY_MINUTES as u64) as usize];
        if bucket.minute != minute {
            *bucket = Bucket {
                minute,
                ..Bucket::default()
            };
        }
        match outcome {
            Outcome::Succeeded => bucket.succeeded += 1,
            Outcome::Failed => bucket.failed += 1,
            Outcome::DeadLettered => bucket.dead_lettered += 1,
        }
    }

    /// The last hour, up to `now`.
    pub(crate) fn report(&self, handler: &str, now: Timestamp) -> HandlerActivity {
        let current = minute_of(now);
        let buckets = *self.buckets.lock().unwrap_or_else(|e| e.into_inner());
        let mut minutes: Vec<Bucket> = buckets
            .into_iter()
            .filter(|b| {
                b.minute <= current
                    && current - b.minute < ACTIVITY_MINUTES as u64
                    && b.succeeded + b.failed + b.dead_lettered > 0
            })
            .collect();
        minutes.sort_by_key(|b| b.minute);
        HandlerActivity {
            handler: handler.to_owned(),
            succeeded: minutes.iter().map(|b| b.succeeded).sum(),
            failed: minutes.iter().map(|b| b.failed).sum(),
            dead_lettered: minutes.iter().map(|b| b.dead_lettered).sum(),
            minutes: minutes
                .iter()
                .map(|b| ActivityMinute {
                    start: Timestamp::from_millis((b.minute * 60_000) as i64),
                    succeeded: b.succeeded,
                    failed: b.failed,
                    dead_lettered: b.dead_lettered,
                })
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_log_keeps_the_last_hour_by_minute() {
        let log = ActivityLog::default();
        let start = Timestamp::from_millis(1_700_000_000_000 / 60_000 * 60_000);
        let at = |minutes: i64| Timestamp::from_millis(start.timestamp_millis() + minutes * 60_000);
        log.record(Outcome::Succeeded, at(0));
        log.record(Outcome::Succeeded, at(0));
        log.record(Outcome::Failed, at(1));
        log.record(Outcome::DeadLettered, at(1));
        let report = log.report("h", at(1));
        assert_eq!(
            (report.succeeded, report.failed, report.dead_lettered),
            (2, 1, 1)
        );
        assert_eq!(report.minutes.len(), 2);
        assert_eq!(report.minutes[0].start, at(0));
        // An hour later the first minute has left the window, and its slot is reused.
        assert_eq!(log.report("h", at(60)).succeeded, 0);
        assert_eq!(log.report("h", at(60)).failed, 1);
        log.record(Outcome::Succeeded, at(60));
        let report = log.report("h", at(60));
        assert_eq!((report.succeeded, report.failed), (1, 1));
    }
}
