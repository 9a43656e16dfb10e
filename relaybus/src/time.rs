//! Points in time as every store records them: milliseconds since the Unix epoch, in UTC.

use std::{
    fmt,
    time::{Duration, SystemTime, UNIX_EPOCH},
};

/// A point in time with millisecond precision: when an event was made, when a delivery is due,
/// when a lease ends.
///
/// Millisecond precision is what every store keeps (MongoDB's dates hold milliseconds), so a
/// timestamp reads back equal to what was written, whichever store holds it.
///
/// ```
/// use std::time::Duration;
/// use relaybus::Timestamp;
///
/// let t = Timestamp::from_millis(1_000);
/// assert_eq!(t.saturating_add(Duration::from_millis(500)).timestamp_millis(), 1_500);
/// assert!(Timestamp::now() > t);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Timestamp(i64);

impl Timestamp {
    /// The Unix epoch, 1970-01-01T00:00:00Z.
    pub const EPOCH: Timestamp = Timestamp(0);

    /// The current time of the system clock.
    pub fn now() -> Self {
        Timestamp::from(SystemTime::now())
    }

    /// A timestamp `millis` milliseconds after the Unix epoch (before it, when negative).
    pub const fn from_millis(millis: i64) -> Self {
        Timestamp(millis)
    }

    /// Milliseconds since the Unix epoch.
    pub const fn timestamp_millis(self) -> i64 {
        self.0
    }

    /// This time plus `duration`, at the latest representable time on overflow.
    pub fn saturating_add(self, duration: Duration) -> Self {
        let millis = i64::try_from(duration.as_millis()).unwrap_or(i64::MAX);
        Timestamp(self.0.saturating_add(millis))
    }

    /// This time minus `duration`, at the earliest representable time on overflow.
    pub fn saturating_sub(self, duration: Duration) -> Self {
        let millis = i64::try_from(duration.as_millis()).unwrap_or(i64::MAX);
        Timestamp(self.0.saturating_sub(millis))
    }

    /// How long after `earlier` this is; zero when it is not later.
    pub fn duration_since(self, earlier: Timestamp) -> Duration {
        Duration::from_millis(u64::try_from(self.0.saturating_sub(earlier.0)).unwrap_or(0))
    }
}

impl From<SystemTime> for Timestamp {
    fn from(time: SystemTime) -> Self {
        match time.duration_since(UNIX_EPOCH) {
            Ok(after) => Timestamp(i64::try_from(after.as_millis()).unwrap_or(i64::MAX)),
            Err(before) => Timestamp(
                i64::try_from(before.duration().as_millis()).map_or(i64::MIN, |millis| -millis),
            ),
        }
    }
}

impl From<Timestamp> for SystemTime {
    fn from(time: Timestamp) -> Self {
        let magnitude = Duration::from_millis(time.0.unsigned_abs());
        if time.0 >= 0 {
            UNIX_EPOCH
                .checked_add(magnitude)
                .unwrap_or(UNIX_EPOCH + Duration::from_secs(i64::MAX as u64 / 1000))
        } else {
            UNIX_EPOCH.checked_sub(magnitude).unwrap_or(UNIX_EPOCH)
        }
    }
}

impl fmt::Display for Timestamp {
    /// RFC 3339 in UTC with milliseconds, such as `2026-12-01T07:53:53.123Z`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let millis = self.0.rem_euclid(1000);
        let seconds = self.0.div_euclid(1000);
        let days = seconds.div_euclid(86_400);
        let of_day = seconds.rem_euclid(86_400);
        let (year, month, day) = civil_from_days(days);
        write!(
            f,
            "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{millis:03}Z",
            of_day / 3600,
            of_day / 60 % 60,
            of_day % 60
        )
    }
}

/// The proleptic Gregorian date of a day count since 1970-01-01 (Howard Hinnant's algorithm).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn displays_as_rfc3339() {
        assert_eq!(Timestamp::EPOCH.to_string(), "1970-01-01T00:00:00.000Z");
        assert_eq!(
            Timestamp::from_millis(1_796_111_633_123).to_string(),
            "2026-12-01T07:53:53.123Z"
        );
        assert_eq!(
            Timestamp::from_millis(-1).to_string(),
            "1969-12-31T23:59:59.999Z"
        );
    }

    #[test]
    fn converts_with_system_time() {
        let t = Timestamp::from_millis(1_796_111_633_123);
        assert_eq!(Timestamp::from(SystemTime::from(t)), t);
        let before = Timestamp::from_millis(-5);
        assert_eq!(Timestamp::from(SystemTime::from(before)), before);
    }

    #[test]
    fn arithmetic_saturates() {
        let max = Timestamp::from_millis(i64::MAX);
        assert_eq!(max.saturating_add(Duration::from_secs(1)), max);
        assert_eq!(
            Timestamp::from_millis(10).duration_since(Timestamp::from_millis(30)),
            Duration::ZERO
        );
    }
}
