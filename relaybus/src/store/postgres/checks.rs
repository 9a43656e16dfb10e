//! Input checks, with the bounds and messages of the MongoDB store, and the text helpers the
//! writes share. Everything here runs before a query, so refused input writes nothing.

use std::time::Duration;

use crate::{
    error::{EventValidationError, InvalidArgumentError, Result, truncate_for_message},
    handler::validate_handler_id,
    store::AppendRequest,
    time::Timestamp,
};

/// The largest claim batch.
pub(super) const MAX_CLAIM_LIMIT: u32 = 10_000;
/// The most handlers one claim serves.
const MAX_HANDLERS: usize = 1_000;
/// The longest lease a claim or renewal gives.
const MAX_LEASE: Duration = Duration::from_secs(7 * 24 * 3600);
/// The longest owner name, in bytes.
const MAX_OWNER_BYTES: usize = 256;
/// The most leases one completion or renewal settles.
pub(super) const MAX_BATCH: usize = 10_000;
/// The most records one listing returns.
pub(super) const MAX_LIST_LIMIT: u32 = 1_000;
/// The most ids one requeue, discard or burial takes.
const MAX_IDS: usize = 10_000;
/// The longest error message kept on a delivery, in bytes.
const MAX_ERROR_BYTES: usize = 8 * 1024;
/// The most bytes of an error kept in a delivery's error history.
const MAX_HISTORY_ERROR_BYTES: usize = 1024;
/// The longest lead role name, in bytes.
const MAX_ROLE_BYTES: usize = 128;

/// Checks an owner name: 1 to 256 bytes without control characters.
pub(super) fn check_owner(owner: &str) -> Result<()> {
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
pub(super) fn check_handlers(handlers: &[String]) -> Result<Vec<String>> {
    let mut wanted: Vec<String> = Vec::with_capacity(handlers.len());
    for handler in handlers {
        validate_handler_id(handler)?;
        if !wanted.contains(handler) {
            wanted.push(handler.clone());
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
pub(super) fn check_limit(limit: u32) -> Result<()> {
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
pub(super) fn check_lease_duration(duration: Duration) -> Result<()> {
    if duration.as_millis() < 1 || duration > MAX_LEASE {
        return Err(InvalidArgumentError::new(
            "lease_duration",
            format!("{duration:?} is out of range; use 1 ms to 7 days"),
        )
        .into());
    }
    Ok(())
}

/// `now + duration`, refused when it leaves the range of a timestamp.
pub(super) fn add(now: Timestamp, duration: Duration) -> Result<Timestamp> {
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
pub(super) fn check_batch(count: usize, verb: &str) -> Result<()> {
    if count > MAX_BATCH {
        return Err(InvalidArgumentError::new(
            "leases",
            format!("{count} leases given; {verb} at most 10000 at a time"),
        )
        .into());
    }
    Ok(())
}

/// A delivery id as text, when it is one this store can have made.
pub(super) fn parse_id(id: &str) -> Option<i64> {
    if id.is_empty() || id.len() > 19 || !id.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    id.parse::<i64>().ok().filter(|id| *id > 0)
}

/// The distinct delivery ids among `ids`, and the ids that name no delivery this store can
/// have made (reported as not found); refuses more than 10,000 ids, naming what `verb` does.
pub(super) fn parse_ids(ids: &[String], verb: &str) -> Result<(Vec<i64>, Vec<String>)> {
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
        match parse_id(id) {
            Some(id) if !parsed.contains(&id) => parsed.push(id),
            Some(_) => {}
            None => not_found.push(id.clone()),
        }
    }
    Ok((parsed, not_found))
}

/// The listing cursor `after`, refused when it is no delivery id.
pub(super) fn parse_after(after: &str) -> Result<i64> {
    parse_id(after).ok_or_else(|| {
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
pub(super) fn check_list_limit(limit: u32) -> Result<()> {
    if !(1..=MAX_LIST_LIMIT).contains(&limit) {
        return Err(InvalidArgumentError::new(
            "limit",
            format!("{limit} is out of range; list 1 to 1000 deliveries at a time"),
        )
        .into());
    }
    Ok(())
}

/// Checks a lead role: 1 to 128 bytes without control characters.
pub(super) fn check_role(role: &str, period: Duration) -> Result<()> {
    if role.is_empty() || role.len() > MAX_ROLE_BYTES || role.chars().any(char::is_control) {
        return Err(InvalidArgumentError::new(
            "role",
            format!(
                "{:?} is not a role name; use 1 to 128 bytes without control characters",
                truncate_for_message(role, 64)
            ),
        )
        .into());
    }
    if period < Duration::from_millis(1) || period > MAX_LEASE {
        return Err(InvalidArgumentError::new(
            "period",
            format!("{period:?} is out of range; use 1 ms to 7 days"),
        )
        .into());
    }
    Ok(())
}

/// Refuses text PostgreSQL cannot store: `text` columns take no NUL character.
fn check_text(field: &'static str, value: &str) -> Result<(), EventValidationError> {
    if value.contains('\0') {
        return Err(EventValidationError::InvalidField {
            field,
            reason: "it contains a NUL character, which PostgreSQL text cannot hold; remove it"
                .to_owned(),
        });
    }
    Ok(())
}

/// Checks the parts of an append request the envelope does not check for PostgreSQL: handler
/// ids, and NUL characters in the key, the correlation and causation ids and the headers.
pub(super) fn check_request(request: &AppendRequest<'_>) -> Result<()> {
    for handler in request.handlers() {
        validate_handler_id(handler)?;
    }
    let event = request.event();
    if let Some(key) = event.key()
        && key.contains('\0')
    {
        return Err(EventValidationError::InvalidKey {
            key: truncate_for_message(&key.replace('\0', "\\0"), 64),
            reason: "it contains a NUL character, which PostgreSQL text cannot hold",
        }
        .into());
    }
    if let Some(id) = event.correlation_id() {
        check_text("correlation id", id)?;
    }
    if let Some(id) = event.causation_id() {
        check_text("causation id", id)?;
    }
    for (name, value) in event.headers() {
        check_text("header", name)?;
        check_text("header", value)?;
    }
    Ok(())
}

/// An error message as it is kept: NUL characters replaced, cut to 8 KiB.
pub(super) fn clip_error(message: &str) -> String {
    clip_to(&message.replace('\0', "\u{fffd}"), MAX_ERROR_BYTES).to_owned()
}

/// An error message as an entry of the error history keeps it: cut to 1 KiB.
pub(super) fn clip_history_error(message: &str) -> String {
    clip_to(&message.replace('\0', "\u{fffd}"), MAX_HISTORY_ERROR_BYTES).to_owned()
}

/// `message`, cut at a character boundary to at most `limit` bytes.
fn clip_to(message: &str, limit: usize) -> &str {
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
        assert!(check_limit(0).is_err());
        assert!(check_limit(10_001).is_err());
        assert!(check_lease_duration(Duration::ZERO).is_err());
        assert!(add(Timestamp::from_millis(i64::MAX), Duration::from_secs(1)).is_err());
        assert!(check_handlers(&[]).is_err());
        assert_eq!(
            check_handlers(&["a".to_owned(), "a".to_owned()]).unwrap(),
            ["a"]
        );
        assert!(check_role("gauges", Duration::from_secs(1)).is_ok());
        assert!(check_role("", Duration::from_secs(1)).is_err());
    }

    #[test]
    fn ids_are_parsed() {
        assert_eq!(parse_id("17"), Some(17));
        for bad in ["", "0", "-1", "+1", "1e3", "99999999999999999999", "a"] {
            assert_eq!(parse_id(bad), None, "{bad}");
        }
        let (parsed, not_found) =
            parse_ids(&["7".into(), "7".into(), "junk".into()], "requeue").unwrap();
        assert_eq!(parsed, [7]);
        assert_eq!(not_found, ["junk"]);
        assert!(parse_after("junk").is_err());
    }

    #[test]
    fn errors_are_cut_and_cleaned() {
        let long = "\u{20ac}".repeat(MAX_ERROR_BYTES);
        assert!(clip_error(&long).len() <= MAX_ERROR_BYTES);
        assert!(clip_history_error(&long).len() <= MAX_HISTORY_ERROR_BYTES);
        assert_eq!(clip_error("a\0b"), "a\u{fffd}b");
    }
}
