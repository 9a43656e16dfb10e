//! Times on the command line: RFC 3339, or an age counted back from now.

use std::time::Duration;

use relaybus::Timestamp;

use crate::failure::{Failure, bad};

/// `text` as a time: `2025-01-31T12:00:00Z`, or an age such as `90s`, `15m`, `2h` or `7d`.
pub(crate) fn parse_time(option: &str, text: &str) -> Result<Timestamp, Failure> {
    if let Some(time) = Timestamp::parse_rfc3339(text) {
        return Ok(time);
    }
    if let Some(age) = parse_age(text) {
        return Ok(Timestamp::now().saturating_sub(age));
    }
    bad(format!(
        "--{option} {text:?} is not a time: give an RFC 3339 time such as 2025-01-31T12:00:00Z, \
         or an age such as 90s, 15m, 2h or 7d"
    ))
}

fn parse_age(text: &str) -> Option<Duration> {
    let unit_at = text.find(|c: char| !c.is_ascii_digit())?;
    let (number, unit) = text.split_at(unit_at);
    let number: u64 = number.parse().ok()?;
    let seconds = match unit {
        "s" => 1,
        "m" => 60,
        "h" => 3_600,
        "d" => 86_400,
        _ => return None,
    };
    number.checked_mul(seconds).map(Duration::from_secs)
}
