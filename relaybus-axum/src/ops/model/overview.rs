//! The answers of the overview: counts by state, handlers, this process's runs, schedules.

use relaybus::{
    HandlerStatistics, Statistics, Subscription, Timestamp, activity::ActivityMinute,
    schedule::ScheduleStatus,
};
use serde::Serialize;

/// `GET /statistics`.
#[derive(Debug, Serialize)]
pub(crate) struct StatisticsAnswer {
    pending: u64,
    running: u64,
    parked: u64,
    dead: u64,
    /// `null` without completion history, which deletes completed deliveries.
    completed: Option<u64>,
    completion_history: bool,
    oldest_due_at: Option<Timestamp>,
    /// Why `completed` is `null`; left out when it is not.
    #[serde(skip_serializing_if = "Option::is_none")]
    completed_note: Option<&'static str>,
}

/// Why `completed` is `null`.
const COMPLETED_NOTE: &str = "completed deliveries are deleted and not counted: turn on \
                              completion history on the store to count and list them";

impl From<Statistics> for StatisticsAnswer {
    fn from(stats: Statistics) -> Self {
        let history = stats.completion_history;
        StatisticsAnswer {
            pending: stats.pending,
            running: stats.running,
            parked: stats.parked,
            dead: stats.dead,
            completed: history.then_some(stats.completed),
            completed_note: (!history).then_some(COMPLETED_NOTE),
            completion_history: history,
            oldest_due_at: stats.oldest_due_at,
        }
    }
}

/// `GET /handlers`.
#[derive(Debug, Serialize)]
pub(crate) struct HandlersAnswer {
    pub(crate) handlers: Vec<HandlerOverview>,
}

/// One handler's deliveries by state, its limits and this process's runs of the last hour.
#[derive(Debug, Serialize)]
pub(crate) struct HandlerOverview {
    handler: String,
    /// `null` for a handler this bus does not run.
    limits: Option<Limits>,
    /// Pending deliveries neither running nor parked.
    waiting: u64,
    running: u64,
    parked: u64,
    dead: u64,
    oldest_due_at: Option<Timestamp>,
    oldest_due_age_seconds: Option<f64>,
    last_hour: Runs,
}

impl HandlerOverview {
    /// Handler `name` at `now`: its `counts` in the store (none once all its work finished),
    /// its `recent` runs in this process and, when the bus runs it, its `subscription`.
    pub(crate) fn new(
        name: &str,
        counts: Option<&HandlerStatistics>,
        recent: Option<&relaybus::activity::HandlerActivity>,
        subscription: Option<&Subscription>,
        now: Timestamp,
    ) -> Self {
        let pending = counts.map_or(0, |h| h.pending);
        let running = counts.map_or(0, |h| h.running);
        let parked = counts.map_or(0, |h| h.parked);
        let oldest_due_at = counts.and_then(|h| h.oldest_due_at);
        HandlerOverview {
            handler: name.to_owned(),
            limits: subscription.map(Limits::from),
            waiting: pending.saturating_sub(running).saturating_sub(parked),
            running,
            parked,
            dead: counts.map_or(0, |h| h.dead),
            oldest_due_at,
            oldest_due_age_seconds: oldest_due_at.map(|due| now.duration_since(due).as_secs_f64()),
            last_hour: recent.map_or_else(Runs::default, |h| Runs {
                succeeded: h.succeeded,
                failed: h.failed,
                dead_lettered: h.dead_lettered,
            }),
        }
    }
}

/// The limits of a handler the bus runs.
#[derive(Debug, Serialize)]
struct Limits {
    global_concurrency: Option<u32>,
    concurrency_partitioned: bool,
    rate_limit: Option<RateLimit>,
    batch: Option<BatchLimits>,
}

/// At most `starts` runs begin per `interval_ms`.
#[derive(Debug, Serialize)]
struct RateLimit {
    starts: u32,
    interval_ms: u64,
}

/// A batch handler's batches: at most `max` deliveries, gathered for at most `wait_ms`.
#[derive(Debug, Serialize)]
struct BatchLimits {
    max: usize,
    wait_ms: u64,
}

impl From<&Subscription> for Limits {
    fn from(subscription: &Subscription) -> Self {
        Limits {
            global_concurrency: subscription.global_concurrency_limit(),
            concurrency_partitioned: subscription.is_concurrency_partitioned(),
            rate_limit: subscription.rate().map(|(starts, interval)| RateLimit {
                starts,
                interval_ms: millis(interval),
            }),
            batch: subscription.batch_limits().map(|(max, wait)| BatchLimits {
                max,
                wait_ms: millis(wait),
            }),
        }
    }
}

fn millis(duration: std::time::Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}

/// A handler's runs in this process over the last hour.
#[derive(Debug, Default, Serialize)]
struct Runs {
    succeeded: u64,
    failed: u64,
    dead_lettered: u64,
}

/// `GET /activity`.
#[derive(Debug, Serialize)]
pub(crate) struct ActivityAnswer {
    /// What is counted: always [`ACTIVITY_SCOPE`].
    scope: &'static str,
    handlers: Vec<HandlerActivity>,
}

/// The scope of `GET /activity`.
const ACTIVITY_SCOPE: &str = "this process, the last hour";

/// One handler's runs of the last hour, minute by minute.
#[derive(Debug, Serialize)]
struct HandlerActivity {
    handler: String,
    succeeded: u64,
    failed: u64,
    dead_lettered: u64,
    minutes: Vec<Minute>,
}

/// One minute of a [`HandlerActivity`].
#[derive(Debug, Serialize)]
struct Minute {
    start: Timestamp,
    succeeded: u64,
    failed: u64,
    dead_lettered: u64,
}

impl From<Vec<relaybus::activity::HandlerActivity>> for ActivityAnswer {
    fn from(handlers: Vec<relaybus::activity::HandlerActivity>) -> Self {
        let handlers = handlers
            .into_iter()
            .map(|handler| HandlerActivity {
                handler: handler.handler,
                succeeded: handler.succeeded,
                failed: handler.failed,
                dead_lettered: handler.dead_lettered,
                minutes: handler.minutes.iter().map(Minute::from).collect(),
            })
            .collect();
        ActivityAnswer {
            scope: ACTIVITY_SCOPE,
            handlers,
        }
    }
}

impl From<&ActivityMinute> for Minute {
    fn from(minute: &ActivityMinute) -> Self {
        Minute {
            start: minute.start,
            succeeded: minute.succeeded,
            failed: minute.failed,
            dead_lettered: minute.dead_lettered,
        }
    }
}

/// `GET /schedules`.
#[derive(Debug, Serialize)]
pub(crate) struct SchedulesAnswer {
    schedules: Vec<Schedule>,
}

/// One schedule of the bus.
#[derive(Debug, Serialize)]
struct Schedule {
    id: String,
    event_type: String,
    /// When it ticks, in words.
    cadence: String,
    /// Its missed-ticks policy, by name.
    missed: String,
    last_tick: Option<Timestamp>,
    next_tick: Option<Timestamp>,
}

impl From<Vec<ScheduleStatus>> for SchedulesAnswer {
    fn from(statuses: Vec<ScheduleStatus>) -> Self {
        let schedules = statuses
            .into_iter()
            .map(|status| Schedule {
                missed: status.missed.to_string(),
                id: status.id,
                event_type: status.event_type,
                cadence: status.cadence,
                last_tick: status.last_tick,
                next_tick: status.next_tick,
            })
            .collect();
        SchedulesAnswer { schedules }
    }
}
