//! When a schedule ticks: a cron expression in a time zone, or a fixed interval since the Unix
//! epoch. Every bus computes the same ticks from the same schedule, which is what lets the
//! event id of a tick be the same on every bus.

use std::time::Duration;

use chrono::{DateTime, TimeZone, Utc};
use chrono_tz::Tz;
use croner::{
    Cron, Direction,
    parser::{CronParser, Seconds, Year},
};

use crate::time::Timestamp;

/// The shortest interval of a schedule.
pub(crate) const MIN_INTERVAL: Duration = Duration::from_secs(1);
/// The longest interval of a schedule.
pub(crate) const MAX_INTERVAL: Duration = Duration::from_secs(366 * 86_400);

/// A schedule's ticks, parsed and checked.
#[derive(Debug, Clone)]
pub(crate) enum Cadence {
    /// Every this many milliseconds, counted from the Unix epoch.
    Every(i64),
    /// The times a cron expression matches on the wall clock of a time zone.
    Cron { cron: Box<Cron>, zone: Tz },
}

impl Cadence {
    /// A fixed interval, of 1 second to 366 days in whole milliseconds.
    pub(crate) fn every(interval: Duration) -> Result<Self, String> {
        if !(MIN_INTERVAL..=MAX_INTERVAL).contains(&interval) {
            return Err(format!(
                "the interval {interval:?} is out of range; use 1 second to 366 days"
            ));
        }
        if !interval.subsec_nanos().is_multiple_of(1_000_000) {
            return Err(format!(
                "the interval {interval:?} is not a whole number of milliseconds; round it"
            ));
        }
        Ok(Cadence::Every(interval.as_millis() as i64))
    }

    /// A cron expression of five fields (minute to weekday) or six (seconds first), read on
    /// the wall clock of `zone` (an IANA name such as `Europe/Paris`; UTC when `None`).
    pub(crate) fn cron(expression: &str, zone: Option<&str>) -> Result<Self, String> {
        let cron = CronParser::builder()
            .seconds(Seconds::Optional)
            .year(Year::Disallowed)
            .build()
            .parse(expression)
            .map_err(|error| {
                format!(
                    "the cron expression {expression:?} does not parse ({error}); write five \
                     fields (minute hour day-of-month month day-of-week) or six with the \
                     seconds first, such as \"0 */5 * * * *\""
                )
            })?;
        let zone = match zone {
            None => Tz::UTC,
            Some(name) => name.parse::<Tz>().map_err(|_| {
                format!(
                    "the time zone {name:?} is unknown; use an IANA name such as \
                     \"Europe/Paris\" or \"UTC\""
                )
            })?,
        };
        let cadence = Cadence::Cron {
            cron: Box::new(cron),
            zone,
        };
        if cadence.next_after(Timestamp::now()).is_none() {
            return Err(format!(
                "the cron expression {expression:?} matches no date to come (such as the 30th \
                 of February), so it would never tick; check its day and month fields"
            ));
        }
        Ok(cadence)
    }

    /// The ticks after `after` up to `until` included, oldest first: the latest `limit` of
    /// them when there are more.
    pub(crate) fn ticks(&self, after: Timestamp, until: Timestamp, limit: usize) -> Vec<Timestamp> {
        if limit == 0 || until <= after {
            return Vec::new();
        }
        match self {
            Cadence::Every(period) => {
                let period = *period;
                let first = (after.timestamp_millis().div_euclid(period) + 1) * period;
                let last = until.timestamp_millis().div_euclid(period) * period;
                if last < first {
                    return Vec::new();
                }
                let span = i64::try_from(limit - 1).unwrap_or(i64::MAX / 2);
                let start = first.max(last.saturating_sub(span.saturating_mul(period)));
                (0..)
                    .map(|n| start + n * period)
                    .take_while(|at| *at <= last)
                    .map(Timestamp::from_millis)
                    .collect()
            }
            Cadence::Cron { cron, zone } => {
                let Some(until) = zoned(until, zone) else {
                    return Vec::new();
                };
                let mut ticks: Vec<Timestamp> = cron
                    .iter_from(until, Direction::Backward)
                    .map(|at| Timestamp::from_millis(at.timestamp_millis()))
                    .take_while(|at| *at > after)
                    .take(limit)
                    .collect();
                ticks.reverse();
                ticks
            }
        }
    }

    /// The first tick after `after`, if the cadence has one (a cron expression may match no
    /// date, such as the 30th of February).
    pub(crate) fn next_after(&self, after: Timestamp) -> Option<Timestamp> {
        match self {
            Cadence::Every(period) => Some(Timestamp::from_millis(
                (after.timestamp_millis().div_euclid(*period) + 1) * period,
            )),
            Cadence::Cron { cron, zone } => {
                let start = zoned(after, zone)?;
                let next = cron.find_next_occurrence(&start, false).ok()?;
                Some(Timestamp::from_millis(next.timestamp_millis()))
            }
        }
    }
}

/// `at` on the wall clock of `zone`, cut to the whole second (cron matches whole seconds).
fn zoned(at: Timestamp, zone: &Tz) -> Option<DateTime<Tz>> {
    let seconds = at.timestamp_millis().div_euclid(1_000);
    let utc: DateTime<Utc> = Utc.timestamp_opt(seconds, 0).single()?;
    Some(utc.with_timezone(zone))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(text: &str) -> Timestamp {
        Timestamp::parse_rfc3339(text).expect("a valid time")
    }

    fn texts(ticks: &[Timestamp]) -> Vec<String> {
        ticks.iter().map(ToString::to_string).collect()
    }

    #[test]
    fn intervals_count_from_the_epoch() {
        let every = Cadence::every(Duration::from_secs(10)).unwrap();
        let ticks = every.ticks(t("2030-01-01T00:00:05Z"), t("2030-01-01T00:00:40Z"), 100);
        assert_eq!(
            texts(&ticks),
            [
                "2030-01-01T00:00:10.000Z",
                "2030-01-01T00:00:20.000Z",
                "2030-01-01T00:00:30.000Z",
                "2030-01-01T00:00:40.000Z"
            ]
        );
        // The latest two only, and nothing at `after` itself.
        let ticks = every.ticks(t("2030-01-01T00:00:10Z"), t("2030-01-01T00:00:40Z"), 2);
        assert_eq!(
            texts(&ticks),
            ["2030-01-01T00:00:30.000Z", "2030-01-01T00:00:40.000Z"]
        );
        assert!(
            every
                .ticks(t("2030-01-01T00:00:10Z"), t("2030-01-01T00:00:19.999Z"), 5)
                .is_empty()
        );
        assert_eq!(
            every.next_after(t("2030-01-01T00:00:10Z")),
            Some(t("2030-01-01T00:00:20Z"))
        );
        assert!(Cadence::every(Duration::from_millis(999)).is_err());
        assert!(Cadence::every(Duration::from_micros(1_000_500)).is_err());
    }

    #[test]
    fn cron_reads_seconds_and_the_zone() {
        let cron = Cadence::cron("*/20 * * * * *", None).unwrap();
        let ticks = cron.ticks(t("2030-01-01T00:00:00Z"), t("2030-01-01T00:01:00.500Z"), 10);
        assert_eq!(
            texts(&ticks),
            [
                "2030-01-01T00:00:20.000Z",
                "2030-01-01T00:00:40.000Z",
                "2030-01-01T00:01:00.000Z"
            ]
        );
        // 09:00 in Paris is 08:00 UTC in winter.
        let paris = Cadence::cron("0 9 * * *", Some("Europe/Paris")).unwrap();
        assert_eq!(
            paris.next_after(t("2030-01-01T00:00:00Z")),
            Some(t("2030-01-01T08:00:00Z"))
        );
        assert!(Cadence::cron("61 * * * * *", None).is_err());
        let never = Cadence::cron("0 0 0 30 2 *", None).unwrap_err();
        assert!(never.contains("no date"), "{never}");
        assert!(Cadence::cron("* * * * * * 2030", None).is_err());
        let unknown = Cadence::cron("* * * * *", Some("Europe/Atlantis")).unwrap_err();
        assert!(unknown.contains("IANA"), "{unknown}");
    }

    #[test]
    fn ticks_across_daylight_saving_changes() {
        // Paris: clocks go from 02:00 to 03:00 on 2030-03-31, and from 03:00 back to 02:00 on
        // 2030-10-27.
        let daily = Cadence::cron("0 30 2 * * *", Some("Europe/Paris")).unwrap();
        let spring = daily.ticks(t("2030-03-29T12:00:00Z"), t("2030-04-01T12:00:00Z"), 10);
        assert_eq!(
            texts(&spring),
            [
                "2030-03-30T01:30:00.000Z",
                // 02:30 does not exist that day: the tick comes at 03:00 local (01:00 UTC).
                "2030-03-31T01:00:00.000Z",
                "2030-04-01T00:30:00.000Z"
            ]
        );
        let autumn = daily.ticks(t("2030-10-25T12:00:00Z"), t("2030-10-28T12:00:00Z"), 10);
        assert_eq!(
            texts(&autumn),
            [
                "2030-10-26T00:30:00.000Z",
                // 02:30 happens twice that day: one tick, at the first.
                "2030-10-27T00:30:00.000Z",
                "2030-10-28T01:30:00.000Z"
            ]
        );
        // An hourly schedule ticks every real hour: 23 on the short day, 25 on the long one.
        let hourly = Cadence::cron("0 0 * * * *", Some("Europe/Paris")).unwrap();
        let short = hourly.ticks(t("2030-03-30T23:00:00Z"), t("2030-03-31T22:00:00Z"), 100);
        assert_eq!(short.len(), 23);
        let long = hourly.ticks(t("2030-10-26T22:00:00Z"), t("2030-10-27T23:00:00Z"), 100);
        assert_eq!(long.len(), 25);
        assert!(
            long.windows(2)
                .all(|w| w[1].duration_since(w[0]) == Duration::from_secs(3_600))
        );
    }
}
