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

    /// Parses an RFC 3339 time such as `2025-01-31T12:00:00Z`, `2025-01-31T12:00:00.250Z` or
    /// `2025-01-31T13:00:00+01:00`; digits past the milliseconds are cut off.
    ///
    /// ```
    /// use relaybus::Timestamp;
    ///
    /// let t = Timestamp::parse_rfc3339("2026-12-01T08:53:53.123+01:00").unwrap();
    /// assert_eq!(t.to_string(), "2026-12-01T07:53:53.123Z");
    /// assert!(Timestamp::parse_rfc3339("yesterday").is_none());
    /// ```
    pub fn parse_rfc3339(text: &str) -> Option<Self> {
        let b = text.as_bytes();
        let number = |range: std::ops::Range<usize>| -> Option<i64> {
            let digits = b.get(range)?;
            digits.iter().all(u8::is_ascii_digit).then(|| {
                digits
                    .iter()
                    .fold(0_i64, |n, d| n * 10 + i64::from(d - b'0'))
            })
        };
        let separators = [(4, b'-'), (7, b'-'), (13, b':'), (16, b':')];
        if separators.iter().any(|&(at, c)| b.get(at) != Some(&c))
            || !matches!(b.get(10), Some(b'T' | b't' | b' '))
        {
            return None;
        }
        let (year, month, day) = (number(0..4)?, number(5..7)?, number(8..10)?);
        let (hour, minute, second) = (number(11..13)?, number(14..16)?, number(17..19)?);
        let mut at = 19;
        let mut millis = 0;
        if b.get(at) == Some(&b'.') {
            let start = at + 1;
            at = start;
            while b.get(at).is_some_and(u8::is_ascii_digit) {
                at += 1;
            }
            if at == start {
                return None;
            }
            let kept = &text[start..at.min(start + 3)];
            millis = kept.parse::<i64>().ok()? * 10_i64.pow(3 - kept.len() as u32);
        }
        let offset_minutes = match b.get(at)? {
            b'Z' | b'z' if at + 1 == b.len() => 0,
            sign @ (b'+' | b'-') if at + 6 == b.len() && b[at + 3] == b':' => {
                let minutes = number(at + 1..at + 3)? * 60 + number(at + 4..at + 6)?;
                if *sign == b'+' { minutes } else { -minutes }
            }
            _ => return None,
        };
        let days_in_month = match month {
            1 | 3 | 5 | 7 | 8 | 10 | 12 => 31,
            4 | 6 | 9 | 11 => 30,
            2 if year % 4 == 0 && (year % 100 != 0 || year % 400 == 0) => 29,
            2 => 28,
            _ => return None,
        };
        if !(1..=days_in_month).contains(&day) || hour > 23 || minute > 59 || second > 60 {
            return None;
        }
        let days = days_from_civil(year, month as u32, day as u32);
        let seconds =
            days * 86_400 + hour * 3_600 + minute * 60 + second.min(59) - offset_minutes * 60;
        Some(Timestamp(seconds * 1_000 + millis))
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

/// An RFC 3339 string in UTC with milliseconds, as [`Display`](fmt::Display) writes it, so that
/// an event can carry a time (a schedule's tick, say) that reads the same in every store.
impl serde::Serialize for Timestamp {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

/// An RFC 3339 string, as [`Timestamp::parse_rfc3339`] reads it.
impl<'de> serde::Deserialize<'de> for Timestamp {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = <std::borrow::Cow<'de, str>>::deserialize(deserializer)?;
        Timestamp::parse_rfc3339(&text).ok_or_else(|| {
            serde::de::Error::custom(format!(
                "{text:?} is not an RFC 3339 time such as \"2030-01-01T08:00:00.000Z\""
            ))
        })
    }
}

/// The day count since 1970-01-01 of a proleptic Gregorian date (Howard Hinnant's algorithm).
fn days_from_civil(year: i64, month: u32, day: u32) -> i64 {
    let year = if month <= 2 { year - 1 } else { year };
    let era = year.div_euclid(400);
    let yoe = year.rem_euclid(400);
    let mp = i64::from((month + 9) % 12);
    let doy = (153 * mp + 2) / 5 + i64::from(day) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
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
    fn parses_rfc3339() {
        for text in [
            "1970-01-01T00:00:00.000Z",
            "2026-12-01T07:53:53.123Z",
            "2000-02-29T23:59:59.999Z",
            "1969-12-31T23:59:59.999Z",
        ] {
            assert_eq!(
                Timestamp::parse_rfc3339(text)
                    .map(|t| t.to_string())
                    .as_deref(),
                Some(text)
            );
        }
        assert_eq!(
            Timestamp::parse_rfc3339("2025-01-01T00:00:00-00:30"),
            Timestamp::parse_rfc3339("2025-01-01T00:30:00Z")
        );
        assert_eq!(
            Timestamp::parse_rfc3339("2025-01-01T00:00:00.5Z"),
            Some(Timestamp::from_millis(1_735_689_600_500))
        );
        for bad in [
            "",
            "2025-01-01",
            "2025-13-01T00:00:00Z",
            "2025-02-29T00:00:00Z",
            "2025-01-01T24:00:00Z",
            "2025-01-01T00:00:00",
            "2025-01-01T00:00:00.Z",
            "2025-01-01T00:00:00+0100",
        ] {
            assert_eq!(Timestamp::parse_rfc3339(bad), None, "{bad}");
        }
    }

    #[test]
    fn converts_with_system_time() {
        let t = Timestamp::from_millis(1_796_111_633_123);
        assert_eq!(Timestamp::from(SystemTime::from(t)), t);
        let before = Timestamp::from_millis(-5);
        assert_eq!(Timestamp::from(SystemTime::from(before)), before);
    }

    #[test]
    fn serializes_as_rfc3339() {
        let t = Timestamp::from_millis(1_796_111_633_123);
        let json = serde_json::to_value(t).unwrap();
        assert_eq!(json, serde_json::json!("2026-12-01T07:53:53.123Z"));
        assert_eq!(serde_json::from_value::<Timestamp>(json).unwrap(), t);
        let wrong = serde_json::from_value::<Timestamp>(serde_json::json!("noon")).unwrap_err();
        assert!(wrong.to_string().contains("RFC 3339"), "{wrong}");
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
