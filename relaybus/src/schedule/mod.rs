//! Scheduled events: a schedule publishes an event on every tick of a cron expression or a
//! fixed interval, once per tick across every bus of a database.
//!
//! A [`Schedule`] names an id, when it ticks ([`Schedule::cron`], with seconds and a time zone,
//! or [`Schedule::every`]) and what to publish for a tick (a function of the [`Tick`]). Give it
//! to [`RelayBusBuilder::schedule`](crate::RelayBusBuilder::schedule), or declare it with
//! [`#[schedule]`](macro@crate::schedule), which every bus of the binary picks up as it does
//! `#[handler]` functions. A started bus publishes each tick when it comes;
//! [`RelayBus::publish_ticks`](crate::RelayBus::publish_ticks) does it on demand, for tests with
//! a [`TestClock`](crate::clock::TestClock).
//!
//! # Once per tick
//!
//! Every bus that has the schedule publishes its ticks; the event of a tick has an id made of
//! the schedule id and the tick's time ([`Tick::event_id`]), the same on every bus and after
//! every restart. The append of an id the store holds already adds nothing, so whichever bus
//! gets there first publishes the tick and the others' appends are absorbed: one event per
//! tick, however many processes run the schedule, crash or restart in the middle of one.
//!
//! # Missed ticks
//!
//! A bus looks at the ticks since it last looked. Ticks that came while no bus ran (every
//! process down, or one stalled) follow the schedule's [`MissedTicks`] policy:
//! [`Latest`](MissedTicks::Latest) (the default) publishes only the latest of them,
//! [`Each`](MissedTicks::Each) publishes each, up to a bound, the latest ones. A starting bus
//! does not know what the others published, so it looks back over the schedule's
//! [catch-up window](Schedule::catch_up_within) (1 hour by default) and appends what the policy
//! picks there; the ticks that were published already are absorbed. Ticks older than the
//! window are never published late.
//!
//! An event id is a deduplication record only while the store keeps the event: completed
//! events are purged after [`Retention::completed`](crate::Retention) (7 days by default). The
//! bus builder refuses a catch-up window that reaches past it, since a tick purged could then be
//! published a second time.
//!
//! # Example
//!
//! ```
//! use std::time::Duration;
//! use relaybus::{Event, MissedTicks, RelayBus, Schedule, Store, Tick, Timestamp};
//! use serde::{Deserialize, Serialize};
//!
//! #[derive(Serialize, Deserialize)]
//! struct ReportDue {
//!     at: Timestamp,
//! }
//!
//! impl Event for ReportDue {
//!     const TYPE: &'static str = "report.due.v1";
//! }
//!
//! fn bus<S: Store>(store: S) -> Result<RelayBus<S>, relaybus::ConfigurationError> {
//!     RelayBus::builder(store)
//!         // At 09:00 every weekday, on the clock of Paris.
//!         .schedule(
//!             Schedule::cron("daily-report", "0 0 9 * * MON-FRI", |tick: Tick| ReportDue {
//!                 at: tick.at(),
//!             })
//!             .time_zone("Europe/Paris")
//!             .missed(MissedTicks::Latest),
//!         )
//!         // Every 30 seconds, each missed tick of the last 10 minutes published late.
//!         .schedule(
//!             Schedule::every("heartbeat", Duration::from_secs(30), |tick: Tick| ReportDue {
//!                 at: tick.at(),
//!             })
//!             .missed(MissedTicks::Each { max: 20 })
//!             .catch_up_within(Duration::from_secs(600)),
//!         )
//!         .build()
//! }
//! ```
//!
//! The [scheduled events guide](crate::guide::schedules) has the macro, tests with the test
//! clock, and what the operator page shows.

mod cadence;
pub(crate) mod run;

use std::{fmt, sync::Arc, time::Duration};

use crate::{
    error::{ConfigurationError, EventValidationError},
    event::{Event, EventEnvelope},
    time::Timestamp,
};

pub(crate) use cadence::Cadence;
pub use run::{PublishedTick, ScheduleStatus, TickReport};

/// The catch-up window of a schedule unless set: 1 hour.
pub const DEFAULT_CATCH_UP: Duration = Duration::from_secs(3_600);
/// The most missed ticks [`MissedTicks::Each`] may publish at once.
pub const MAX_MISSED_TICKS: u32 = 1_000;
/// The longest schedule id, in bytes.
pub const MAX_SCHEDULE_ID_BYTES: usize = 128;

/// Makes the event of a tick.
type MakeEvent = Arc<dyn Fn(&Tick) -> Result<EventEnvelope, EventValidationError> + Send + Sync>;

/// A schedule: an id, when it ticks, and the event it publishes for a tick.
///
/// Made by [`Schedule::cron`] or [`Schedule::every`], tuned with [`time_zone`](Self::time_zone),
/// [`missed`](Self::missed) and [`catch_up_within`](Self::catch_up_within), and checked by
/// [`RelayBusBuilder::build`](crate::RelayBusBuilder::build) (see the
/// [module documentation](self)).
#[derive(Clone)]
pub struct Schedule {
    id: String,
    when: When,
    time_zone: Option<String>,
    missed: MissedTicks,
    catch_up: Duration,
    event_type: &'static str,
    rust_type: &'static str,
    make: MakeEvent,
}

/// When a schedule ticks, as given.
#[derive(Debug, Clone, PartialEq, Eq)]
enum When {
    Cron(String),
    Every(Duration),
}

impl Schedule {
    /// A schedule that ticks whenever `expression` matches, and publishes what `make` returns
    /// for the tick.
    ///
    /// The expression has five fields (`minute hour day-of-month month day-of-week`) or six,
    /// the seconds first (`"*/10 * * * * *"`: every 10 seconds); names (`MON-FRI`, `JAN`),
    /// ranges, steps, `L`, `W`, `#` and the nicknames `@hourly`, `@daily`, .. are understood, as
    /// the `croner` crate reads them. It is read on the clock of UTC unless
    /// [`time_zone`](Self::time_zone) names another zone.
    pub fn cron<E, F>(id: impl Into<String>, expression: impl Into<String>, make: F) -> Self
    where
        E: Event,
        F: Fn(Tick) -> E + Send + Sync + 'static,
    {
        Schedule::new(id, When::Cron(expression.into()), make)
    }

    /// A schedule that ticks every `interval` (1 second to 366 days), at the multiples of the
    /// interval since the Unix epoch (every minute: on the minute), and publishes what `make`
    /// returns for the tick.
    pub fn every<E, F>(id: impl Into<String>, interval: Duration, make: F) -> Self
    where
        E: Event,
        F: Fn(Tick) -> E + Send + Sync + 'static,
    {
        Schedule::new(id, When::Every(interval), make)
    }

    fn new<E, F>(id: impl Into<String>, when: When, make: F) -> Self
    where
        E: Event,
        F: Fn(Tick) -> E + Send + Sync + 'static,
    {
        Schedule {
            id: id.into(),
            when,
            time_zone: None,
            missed: MissedTicks::default(),
            catch_up: DEFAULT_CATCH_UP,
            event_type: E::TYPE,
            rust_type: std::any::type_name::<E>(),
            make: Arc::new(move |tick: &Tick| EventEnvelope::new(&make(tick.clone()))),
        }
    }

    /// The time zone whose clock a cron expression is read on: an IANA name such as
    /// `"Europe/Paris"`; UTC by default. Across a change to daylight saving time, a time that
    /// does not exist that day ticks at the first time after the gap, and a time that happens
    /// twice ticks once, at the first; an expression that matches every hour (or minute, or
    /// second) ticks in every real one. Only for cron schedules.
    pub fn time_zone(mut self, zone: impl Into<String>) -> Self {
        self.time_zone = Some(zone.into());
        self
    }

    /// What to publish of the ticks that came while no bus ran:
    /// [`MissedTicks::Latest`] by default.
    pub fn missed(mut self, policy: MissedTicks) -> Self {
        self.missed = policy;
        self
    }

    /// How far back a bus looks for missed ticks, [`DEFAULT_CATCH_UP`] (1 hour) by default, 1
    /// second to 30 days and shorter than the retention of completed events: ticks older than
    /// this are never published late.
    pub fn catch_up_within(mut self, window: Duration) -> Self {
        self.catch_up = window;
        self
    }

    /// The schedule id: the prefix of its ticks' event ids.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The type name of the events it publishes.
    pub fn event_type(&self) -> &'static str {
        self.event_type
    }

    /// The cron expression, if it is a cron schedule.
    pub fn cron_expression(&self) -> Option<&str> {
        match &self.when {
            When::Cron(expression) => Some(expression),
            When::Every(_) => None,
        }
    }

    /// The interval, if it is an interval schedule.
    pub fn interval(&self) -> Option<Duration> {
        match self.when {
            When::Every(interval) => Some(interval),
            When::Cron(_) => None,
        }
    }

    /// The time zone of a cron schedule, if one was given.
    pub fn zone(&self) -> Option<&str> {
        self.time_zone.as_deref()
    }

    /// Its missed-ticks policy.
    pub fn missed_ticks(&self) -> MissedTicks {
        self.missed
    }

    /// Its catch-up window.
    pub fn catch_up_window(&self) -> Duration {
        self.catch_up
    }

    /// When it ticks, in words: `every 30s`, `cron "0 0 9 * * *" in Europe/Paris`.
    pub fn describe(&self) -> String {
        match &self.when {
            When::Every(interval) => format!("every {interval:?}"),
            When::Cron(expression) => format!(
                "cron {expression:?} in {}",
                self.time_zone.as_deref().unwrap_or("UTC")
            ),
        }
    }

    /// The event of a tick, with the tick's event id.
    pub(crate) fn envelope(&self, tick: &Tick) -> Result<EventEnvelope, EventValidationError> {
        (self.make)(tick)?.with_id(tick.event_id())
    }

    /// Checks the schedule and computes its cadence. `completed`: how long the bus keeps
    /// completed events, if it purges them.
    pub(crate) fn compile(
        &self,
        completed: Option<Duration>,
    ) -> Result<Cadence, ConfigurationError> {
        let invalid = |reason: String| ConfigurationError::InvalidSchedule {
            id: self.id.clone(),
            reason,
        };
        validate_schedule_id(&self.id).map_err(|reason| invalid(reason.to_owned()))?;
        let cadence = match &self.when {
            When::Cron(expression) => Cadence::cron(expression, self.time_zone.as_deref()),
            When::Every(interval) => match &self.time_zone {
                Some(zone) => Err(format!(
                    "it has the time zone {zone:?}, which only a cron schedule reads; an \
                     interval counts real time, so leave the zone out"
                )),
                None => Cadence::every(*interval),
            },
        }
        .map_err(invalid)?;
        if let MissedTicks::Each { max } = self.missed
            && !(1..=MAX_MISSED_TICKS).contains(&max)
        {
            return Err(invalid(format!(
                "`MissedTicks::Each {{ max: {max} }}` is out of range; publish 1 to \
                 {MAX_MISSED_TICKS} missed ticks, or use `MissedTicks::Latest`"
            )));
        }
        if !(Duration::from_secs(1)..=Duration::from_secs(30 * 86_400)).contains(&self.catch_up) {
            return Err(invalid(format!(
                "the catch-up window {:?} is out of range; use 1 second to 30 days",
                self.catch_up
            )));
        }
        if let Some(completed) = completed
            && self.catch_up >= completed
        {
            return Err(invalid(format!(
                "the catch-up window {:?} reaches past the {completed:?} completed events are \
                 kept, so a tick purged could be published again; shorten the window with \
                 `catch_up_within` or keep completed events longer (`Retention::completed`)",
                self.catch_up
            )));
        }
        Ok(cadence)
    }
}

impl fmt::Debug for Schedule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Schedule")
            .field("id", &self.id)
            .field("when", &self.when)
            .field("time_zone", &self.time_zone)
            .field("missed", &self.missed)
            .field("catch_up", &self.catch_up)
            .field("event_type", &self.event_type)
            .field("rust_type", &self.rust_type)
            .finish_non_exhaustive()
    }
}

/// Checks a schedule id: 1 to 128 bytes of ASCII letters, digits, `_`, `-`, `.` and `:`.
fn validate_schedule_id(id: &str) -> Result<(), &'static str> {
    if id.is_empty() {
        Err(
            "its id is empty; use 1 to 128 characters of ASCII letters, digits, `_`, `-`, `.` and `:`",
        )
    } else if id.len() > MAX_SCHEDULE_ID_BYTES {
        Err(
            "its id is longer than 128 bytes; use 1 to 128 characters of ASCII letters, digits, `_`, `-`, `.` and `:`",
        )
    } else if !id
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.' | b':'))
    {
        Err("its id contains a character other than ASCII letters, digits, `_`, `-`, `.` and `:`")
    } else {
        Ok(())
    }
}

/// What a schedule publishes of the ticks that came while no bus of it ran.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum MissedTicks {
    /// Only the latest missed tick: a report that is due once, however long it waited.
    #[default]
    Latest,
    /// Each missed tick, oldest first, but at most the latest `max` of them (1 to
    /// [`MAX_MISSED_TICKS`]): the ticks that each stand for something, such as a period to
    /// close.
    Each {
        /// The most missed ticks published at once.
        max: u32,
    },
}

impl MissedTicks {
    /// How many of the ticks found a bus publishes at most.
    pub(crate) fn limit(self) -> usize {
        match self {
            MissedTicks::Latest => 1,
            MissedTicks::Each { max } => max as usize,
        }
    }
}

impl fmt::Display for MissedTicks {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MissedTicks::Latest => f.write_str("latest"),
            MissedTicks::Each { max } => write!(f, "each, at most {max}"),
        }
    }
}

/// One tick of a schedule: what the schedule's function gets to make the tick's event.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Tick {
    schedule: Arc<str>,
    at: Timestamp,
}

impl Tick {
    /// The tick of `schedule` at `at`.
    pub fn new(schedule: &str, at: Timestamp) -> Self {
        Tick {
            schedule: Arc::from(schedule),
            at,
        }
    }

    /// The schedule id.
    pub fn schedule(&self) -> &str {
        &self.schedule
    }

    /// When the tick is due (not when it was published, which a missed tick is later).
    pub fn at(&self) -> Timestamp {
        self.at
    }

    /// The id of the tick's event: `schedule:<schedule id>:<tick time in RFC 3339, UTC>`, the
    /// same on every bus, which makes each tick one event.
    ///
    /// ```
    /// use relaybus::{Tick, Timestamp};
    ///
    /// let tick = Tick::new("daily-report", Timestamp::parse_rfc3339("2030-01-01T08:00:00Z").unwrap());
    /// assert_eq!(tick.event_id(), "schedule:daily-report:2030-01-01T08:00:00.000Z");
    /// ```
    pub fn event_id(&self) -> String {
        format!("schedule:{}:{}", self.schedule, self.at)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schedule::run::Schedules;

    #[derive(serde::Serialize, serde::Deserialize)]
    struct Beat {}

    impl Event for Beat {
        const TYPE: &'static str = "schedule.beat.v1";
    }

    fn beat(_: Tick) -> Beat {
        Beat {}
    }

    const WEEK: Option<Duration> = Some(Duration::from_secs(7 * 86_400));

    /// The reason `build` gives for `schedule`, which must be about schedule `id`.
    fn refused(schedule: Schedule) -> String {
        let id = schedule.id().to_owned();
        match Schedules::new(vec![schedule], WEEK) {
            Err(ConfigurationError::InvalidSchedule { id: named, reason }) => {
                assert_eq!(named, id);
                reason
            }
            other => panic!("expected an invalid schedule, got {other:?}"),
        }
    }

    #[test]
    fn bad_schedules_are_refused_with_what_to_do() {
        let cases = [
            (Schedule::cron("s", "every day", beat), "five"),
            (
                Schedule::cron("s", "0 9 * * *", beat).time_zone("Mars/Olympus"),
                "IANA",
            ),
            (
                Schedule::every("s", Duration::from_secs(60), beat).time_zone("UTC"),
                "only a cron schedule",
            ),
            (
                Schedule::every("s", Duration::from_millis(10), beat),
                "1 second",
            ),
            (
                Schedule::every("s", Duration::from_secs(60), beat)
                    .missed(MissedTicks::Each { max: 0 }),
                "1 to 1000",
            ),
            (
                Schedule::every("s", Duration::from_secs(60), beat)
                    .catch_up_within(Duration::from_secs(8 * 86_400)),
                "Retention::completed",
            ),
            (
                Schedule::every("s", Duration::from_secs(60), beat).catch_up_within(Duration::ZERO),
                "1 second to 30 days",
            ),
            (
                Schedule::every("a b", Duration::from_secs(60), beat),
                "ASCII",
            ),
            (Schedule::every("", Duration::from_secs(60), beat), "empty"),
        ];
        for (schedule, hint) in cases {
            let described = format!("{schedule:?}");
            let reason = refused(schedule);
            assert!(reason.contains(hint), "{described}: {reason}");
        }
        // Without retention, a long window is fine.
        let long = Schedule::every("s", Duration::from_secs(60), beat)
            .catch_up_within(Duration::from_secs(20 * 86_400));
        assert!(Schedules::new(vec![long], None).is_ok());
    }

    #[test]
    fn two_schedules_with_one_id_are_refused() {
        let error = Schedules::new(
            vec![
                Schedule::every("report", Duration::from_secs(60), beat),
                Schedule::cron("report", "0 9 * * *", beat),
            ],
            WEEK,
        )
        .unwrap_err();
        assert!(
            matches!(&error, ConfigurationError::DuplicateScheduleId { id, .. } if id == "report"),
            "{error}"
        );
        assert!(error.to_string().contains("every 60s"), "{error}");
    }
}
