//! Input checks, with the bounds and messages of the MongoDB store, and the small text helpers
//! the settlements share.

use std::time::Duration;

use super::claim::MemoryDeliveryId;
use crate::{
    error::{InvalidArgumentError, Result, truncate_for_message},
    handler::validate_handler_id,
    time::Timestamp,
};

/// The largest claim batch.
pub(super) const MAX_CLAIM_LIMIT: u32 = 10_000;
/// The most handlers one claim serves.
pub(super) const MAX_HANDLERS: usize = 1_000;
/// The longest lease a claim or renewal gives.
pub(super) const MAX_LEASE: Duration = Duration::from_secs(7 * 24 * 3600);
/// The longest owner name, in bytes.
const MAX_OWNER_BYTES: usize = 256;
/// The most leases one completion settles.
pub(super) const MAX_COMPLETE_BATCH: usize = 10_000;
/// The most records one listing returns.
pub(super) const MAX_LIST_LIMIT: u32 = 1_000;
/// The most ids one requeue, discard or burial takes.
pub(super) const MAX_IDS: usize = 10_000;
/// The longest error message kept on a delivery, in bytes.
const MAX_ERROR_BYTES: usize = 8 * 1024;
/// The most bytes of an error kept in a delivery's error history.
const MAX_HISTORY_ERROR_BYTES: usize = 1024;
/// The longest business collection name, in bytes.
const MAX_COLLECTION_BYTES: usize = 128;
/// The longest business document id, in bytes.
const MAX_DOCUMENT_ID_BYTES: usize = 1024;

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
pub(super) fn check_handlers(handlers: &[String]) -> Result<Vec<&str>> {
    let mut wanted: Vec<&str> = Vec::with_capacity(handlers.len());
    for handler in handlers {
        validate_handler_id(handler)?;
        if !wanted.contains(&handler.as_str()) {
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

/// The distinct delivery ids among `ids`, and the ids that name no delivery this store can
/// have made (reported as not found); refuses more than 10,000 ids, naming what `verb` does.
pub(super) fn parse_ids(
    ids: &[String],
    verb: &str,
) -> Result<(Vec<MemoryDeliveryId>, Vec<String>)> {
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
        match MemoryDeliveryId::parse(id) {
            Some(id) if !parsed.contains(&id) => parsed.push(id),
            Some(_) => {}
            None => not_found.push(id.clone()),
        }
    }
    Ok((parsed, not_found))
}

/// The listing cursor `after`, refused when it is no delivery id.
pub(super) fn parse_after(after: &str) -> Result<MemoryDeliveryId> {
    MemoryDeliveryId::parse(after).ok_or_else(|| {
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

/// Checks a business collection name and document id.
pub(super) fn check_document_name(collection: &str, id: &str) -> Result<()> {
    let collection_reason = if collection.is_empty() {
        Some("it is empty")
    } else if collection.len() > MAX_COLLECTION_BYTES {
        Some("it is longer than 128 bytes")
    } else if collection.chars().any(char::is_control) {
        Some("it contains a control character")
    } else {
        None
    };
    if let Some(reason) = collection_reason {
        return Err(InvalidArgumentError::new(
            "collection",
            format!(
                "{:?}: {reason}; name collections with 1 to 128 bytes without control characters, \
                 such as `orders`",
                truncate_for_message(collection, 64)
            ),
        )
        .into());
    }
    let id_reason = if id.is_empty() {
        Some("it is empty")
    } else if id.len() > MAX_DOCUMENT_ID_BYTES {
        Some("it is longer than 1024 bytes")
    } else {
        None
    };
    if let Some(reason) = id_reason {
        return Err(InvalidArgumentError::new(
            "id",
            format!(
                "{:?}: {reason}; use document ids of 1 to 1024 bytes",
                truncate_for_message(id, 64)
            ),
        )
        .into());
    }
    Ok(())
}

/// An error message cut to at most 8 KiB, at a character boundary: a delivery's last error.
pub(super) fn clip_error(message: &str) -> &str {
    clip_to(message, MAX_ERROR_BYTES)
}

/// An error message cut to at most 1 KiB, at a character boundary: an entry of a delivery's
/// error history.
pub(super) fn clip_history_error(message: &str) -> &str {
    clip_to(message, MAX_HISTORY_ERROR_BYTES)
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
        assert!(check_owner(&"a".repeat(257)).is_err());
        assert!(check_limit(0).is_err());
        assert!(check_limit(10_001).is_err());
        assert!(check_limit(1).is_ok());
        assert!(check_lease_duration(Duration::ZERO).is_err());
        assert!(check_lease_duration(Duration::from_secs(30)).is_ok());
        assert!(check_lease_duration(MAX_LEASE + Duration::from_secs(1)).is_err());
        assert!(add(Timestamp::from_millis(i64::MAX), Duration::from_secs(1)).is_err());
        assert_eq!(
            add(Timestamp::from_millis(1), Duration::from_secs(1)).unwrap(),
            Timestamp::from_millis(1001)
        );
        assert!(check_handlers(&[]).is_err());
        assert!(check_handlers(&["no good".to_owned()]).is_err());
        assert_eq!(
            check_handlers(&["a".to_owned(), "a".to_owned()]).unwrap(),
            ["a"]
        );
        assert!(check_document_name("orders", "o-1").is_ok());
        assert!(check_document_name("", "o-1").is_err());
        assert!(check_document_name("orders", "").is_err());
        assert!(check_document_name("a\0b", "o-1").is_err());
    }

    #[test]
    fn errors_are_cut_at_a_character_boundary() {
        let long = "\u{20ac}".repeat(MAX_ERROR_BYTES);
        let kept = clip_error(&long);
        assert!(kept.len() <= MAX_ERROR_BYTES && kept.len() > MAX_ERROR_BYTES - 3);
        assert!(clip_history_error(&long).len() <= MAX_HISTORY_ERROR_BYTES);
        assert_eq!(clip_error("short"), "short");
    }

    #[test]
    fn ids_are_parsed_and_bounded() {
        let id = MemoryDeliveryId(7).to_string();
        let (parsed, not_found) =
            parse_ids(&[id.clone(), id, "junk".to_owned()], "requeue").unwrap();
        assert_eq!(parsed, [MemoryDeliveryId(7)]);
        assert_eq!(not_found, ["junk"]);
        let many = vec![String::new(); MAX_IDS + 1];
        assert!(parse_ids(&many, "requeue").is_err());
        assert!(parse_after("junk").is_err());
    }
}
