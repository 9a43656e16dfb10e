//! Input checks every store uses, with their bounds and messages in one place. Everything here
//! runs before a store writes, so refused input writes nothing.

use std::time::Duration;

use crate::{
    error::{InvalidArgumentError, Result, truncate_for_message},
    handler::validate_handler_id,
    time::Timestamp,
};

/// The largest claim batch.
pub(crate) const MAX_CLAIM_LIMIT: u32 = 10_000;
/// The most handlers one claim serves.
pub(crate) const MAX_HANDLERS: usize = 1_000;
/// The longest lease a claim or renewal gives.
pub(crate) const MAX_LEASE: Duration = Duration::from_secs(7 * 24 * 3600);
/// The longest owner name, in bytes.
const MAX_OWNER_BYTES: usize = 256;
/// The most leases one completion or renewal settles.
pub(crate) const MAX_BATCH: usize = 10_000;
/// The most records one listing returns.
pub(crate) const MAX_LIST_LIMIT: u32 = 1_000;
/// The most ids one requeue, discard or burial takes.
pub(crate) const MAX_IDS: usize = 10_000;
/// The longest error message kept on a delivery, in bytes.
pub(crate) const MAX_ERROR_BYTES: usize = 8 * 1024;
/// The most bytes of an error kept in a delivery's error history.
pub(crate) const MAX_HISTORY_ERROR_BYTES: usize = 1024;

/// Checks an owner name: 1 to 256 bytes without control characters.
pub(crate) fn check_owner(owner: &str) -> Result<()> {
    let reason = if owner.is_empty() {
        "it is empty"
    } else if owner.len() > MAX_OWNER_BYTES {
        "it is longer than 256 bytes"
    } else if owner.chars().any(char::is_control) {
        "it contains a control character"
    } else {
        return Ok(());
    };
    Err(InvalidArgumentError::new(
        "owner",
        format!("{reason}; use 1 to 256 bytes without control characters, such as `host-1:4711`"),
    )
    .into())
}

/// The distinct handler ids of a claim, checked: each well-formed, 1 to 1000 of them.
pub(crate) fn check_handlers<H: AsRef<str>>(handlers: &[H]) -> Result<Vec<&str>> {
    let mut wanted: Vec<&str> = Vec::with_capacity(handlers.len());
    for handler in handlers {
        let handler = handler.as_ref();
        validate_handler_id(handler)?;
        if !wanted.contains(&handler) {
            wanted.push(handler);
        }
    }
    if wanted.is_empty() || wanted.len() > MAX_HANDLERS {
        return Err(InvalidArgumentError::new(
            "handlers",
            format!(
                "{} handlers given; claim for 1 to 1000 handlers",
                wanted.len()
            ),
        )
        .into());
    }
    Ok(wanted)
}

/// Checks a claim's limit: 1 to 10,000.
pub(crate) fn check_limit(limit: u32) -> Result<()> {
    if !(1..=MAX_CLAIM_LIMIT).contains(&limit) {
        return Err(InvalidArgumentError::new(
            "limit",
            format!("{limit} is out of range; claim 1 to 10000 deliveries at a time"),
        )
        .into());
    }
    Ok(())
}

/// Checks a lease duration: 1 ms to 7 days.
pub(crate) fn check_lease_duration(duration: Duration) -> Result<()> {
    if duration.as_millis() < 1 || duration > MAX_LEASE {
        return Err(InvalidArgumentError::new(
            "lease_duration",
            format!("{duration:?} is out of range; use 1 ms to 7 days"),
        )
        .into());
    }
    Ok(())
}

/// Checks a lead role: 1 to 128 bytes without control characters, and a period of 1 ms to 7
/// days.
#[cfg(any(feature = "mongodb", feature = "postgres"))]
pub(crate) fn check_role(role: &str, period: Duration) -> Result<()> {
    if role.is_empty() {
        return Err(role_error(role));
    }
    check_role_prefix(role)?;
    if period < Duration::from_millis(1) || period > MAX_LEASE {
        return Err(InvalidArgumentError::new(
            "period",
            format!("{period:?} is out of range; use 1 ms to 7 days"),
        )
        .into());
    }
    Ok(())
}

/// Checks the start of a lead role, as a listing takes it: at most 128 bytes without control
/// characters (an empty one lists every lead).
#[cfg(any(feature = "mongodb", feature = "postgres"))]
pub(crate) fn check_role_prefix(prefix: &str) -> Result<()> {
    if prefix.len() > super::MAX_ROLE_BYTES || prefix.chars().any(char::is_control) {
        return Err(role_error(prefix));
    }
    Ok(())
}

#[cfg(any(feature = "mongodb", feature = "postgres"))]
fn role_error(role: &str) -> crate::Error {
    InvalidArgumentError::new(
        "role",
        format!(
            "{:?} is not a role name; use 1 to 128 bytes without control characters",
            truncate_for_message(role, 64)
        ),
    )
    .into()
}

/// `now + duration`, refused when it leaves the range of a timestamp.
pub(crate) fn add(now: Timestamp, duration: Duration) -> Result<Timestamp> {
    i64::try_from(duration.as_millis())
        .ok()
        .and_then(|ms| now.timestamp_millis().checked_add(ms))
        .map(Timestamp::from_millis)
        .ok_or_else(|| {
            InvalidArgumentError::new(
                "now",
                "now plus the lease duration is past the year 292 million",
            )
            .into()
        })
}

/// Checks a batch of leases: at most 10,000.
pub(crate) fn check_batch(count: usize, verb: &str) -> Result<()> {
    if count > MAX_BATCH {
        return Err(InvalidArgumentError::new(
            "leases",
            format!("{count} leases given; {verb} at most 10000 at a time"),
        )
        .into());
    }
    Ok(())
}

/// The distinct delivery ids among `ids` as `parse` reads them, and the ids that name no
/// delivery the store can have made (reported as not found); refuses more than 10,000 ids,
/// naming what `verb` does.
pub(crate) fn parse_ids<S: AsRef<str>, I: PartialEq>(
    ids: &[S],
    verb: &str,
    parse: impl Fn(&str) -> Option<I>,
) -> Result<(Vec<I>, Vec<String>)> {
    if ids.len() > MAX_IDS {
        return Err(InvalidArgumentError::new(
            "ids",
            format!("{} ids given; {verb} at most 10000 at a time", ids.len()),
        )
        .into());
    }
    let mut parsed = Vec::new();
    let mut not_found = Vec::new();
    for id in ids {
        let id = id.as_ref();
        match parse(id) {
            Some(id) if !parsed.contains(&id) => parsed.push(id),
            Some(_) => {}
            None => not_found.push(id.to_owned()),
        }
    }
    Ok((parsed, not_found))
}

/// The listing cursor `after` as `parse` reads it, refused when it is no delivery id.
pub(crate) fn parse_after<I>(after: &str, parse: impl Fn(&str) -> Option<I>) -> Result<I> {
    parse(after).ok_or_else(|| {
        InvalidArgumentError::new(
            "after",
            format!(
                "{:?} is not a delivery id; pass the `id` of the last record of the previous page",
                truncate_for_message(after, 64)
            ),
        )
        .into()
    })
}

/// Checks a listing's limit: 1 to 1000.
pub(crate) fn check_list_limit(limit: u32) -> Result<()> {
    if !(1..=MAX_LIST_LIMIT).contains(&limit) {
        return Err(InvalidArgumentError::new(
            "limit",
            format!("{limit} is out of range; list 1 to 1000 records at a time"),
        )
        .into());
    }
    Ok(())
}

/// Checks the reason of a burial, which becomes the deliveries' error: not blank.
pub(crate) fn check_reason(reason: &str) -> Result<()> {
    if reason.trim().is_empty() {
        return Err(InvalidArgumentError::new(
            "reason",
            "the reason is empty; say why the deliveries are buried, it becomes their error",
        )
        .into());
    }
    Ok(())
}

/// Checks the budget of a store's `transaction_within`: 1 ms to 60 s, as the bus's.
#[cfg(any(feature = "memory", feature = "mongodb"))]
pub(crate) fn check_budget(budget: Duration) -> Result<()> {
    crate::store::transaction::validate_budget(budget).map_err(|error| match error {
        crate::error::ConfigurationError::InvalidOption { reason, .. } => {
            InvalidArgumentError::new("budget", reason).into()
        }
        error => error.into(),
    })
}

/// `message`, cut at a character boundary to at most `limit` bytes.
pub(crate) fn clip_to(message: &str, limit: usize) -> &str {
    if message.len() <= limit {
        return message;
    }
    let mut end = limit;
    while !message.is_char_boundary(end) {
        end -= 1;
    }
    &message[..end]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arguments_are_checked() {
        assert!(check_owner("host-1:4711").is_ok());
        assert!(check_owner("").is_err());
        assert!(check_owner("a\nb").is_err());
        assert!(check_owner(&"a".repeat(257)).is_err());
        assert!(check_limit(0).is_err());
        assert!(check_limit(10_001).is_err());
        assert!(check_limit(1).is_ok());
        assert!(check_list_limit(0).is_err());
        assert!(check_list_limit(1_001).is_err());
        assert!(check_batch(MAX_BATCH + 1, "complete").is_err());
        assert!(check_lease_duration(Duration::ZERO).is_err());
        assert!(check_lease_duration(Duration::from_secs(30)).is_ok());
        assert!(check_lease_duration(MAX_LEASE + Duration::from_secs(1)).is_err());
        assert!(add(Timestamp::from_millis(i64::MAX), Duration::from_secs(1)).is_err());
        assert_eq!(
            add(Timestamp::from_millis(1), Duration::from_secs(1)).unwrap(),
            Timestamp::from_millis(1001)
        );
        assert!(check_handlers::<String>(&[]).is_err());
        assert!(check_reason(" ").is_err());
        assert!(check_reason("poison").is_ok());
        assert!(check_budget(Duration::ZERO).is_err());
        assert!(check_budget(Duration::from_secs(1)).is_ok());
        assert!(check_handlers(&["no good".to_owned()]).is_err());
        assert_eq!(
            check_handlers(&["a".to_owned(), "a".to_owned()]).unwrap(),
            ["a"]
        );
    }

    #[test]
    fn ids_are_parsed_and_bounded() {
        let number = |id: &str| id.parse::<u32>().ok();
        let (parsed, not_found) = parse_ids(
            &["7".to_owned(), "7".to_owned(), "junk".to_owned()],
            "requeue",
            number,
        )
        .unwrap();
        assert_eq!(parsed, [7]);
        assert_eq!(not_found, ["junk"]);
        let many = vec![String::new(); MAX_IDS + 1];
        assert!(parse_ids(&many, "requeue", number).is_err());
        assert!(parse_after("junk", number).is_err());
        assert_eq!(parse_after("3", number).unwrap(), 3);
    }

    #[test]
    fn messages_are_cut_at_a_character_boundary() {
        let long = "\u{20ac}".repeat(MAX_ERROR_BYTES);
        let kept = clip_to(&long, MAX_ERROR_BYTES);
        assert!(kept.len() <= MAX_ERROR_BYTES && kept.len() > MAX_ERROR_BYTES - 3);
        assert_eq!(clip_to("short", 3), "sho");
    }
}
