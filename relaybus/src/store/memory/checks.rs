//! Input checks of the memory store: those all stores share, the business documents' names,
//! and the small text helpers the settlements share.

use super::claim::MemoryDeliveryId;
pub(super) use crate::store::checks::{
    add, check_batch, check_budget, check_handlers, check_lease_duration, check_limit,
    check_list_limit, check_owner, check_reason,
};
use crate::{
    error::{InvalidArgumentError, Result, truncate_for_message},
    store::checks::{self, MAX_ERROR_BYTES, MAX_HISTORY_ERROR_BYTES, clip_to},
};

/// The longest business collection name, in bytes.
const MAX_COLLECTION_BYTES: usize = 128;
/// The longest business document id, in bytes.
const MAX_DOCUMENT_ID_BYTES: usize = 1024;

/// The distinct delivery ids among `ids`, and the ids that name no delivery this store can
/// have made (reported as not found); refuses more than 10,000 ids, naming what `verb` does.
pub(super) fn parse_ids(
    ids: &[String],
    verb: &str,
) -> Result<(Vec<MemoryDeliveryId>, Vec<String>)> {
    checks::parse_ids(ids, verb, MemoryDeliveryId::parse)
}

/// The listing cursor `after`, refused when it is no delivery id.
pub(super) fn parse_after(after: &str) -> Result<MemoryDeliveryId> {
    checks::parse_after(after, MemoryDeliveryId::parse)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn document_names_are_checked() {
        assert!(check_document_name("orders", "o-1").is_ok());
        assert!(check_document_name("", "o-1").is_err());
        assert!(check_document_name("orders", "").is_err());
        assert!(check_document_name("a\0b", "o-1").is_err());
        assert!(check_document_name(&"c".repeat(129), "o-1").is_err());
        assert!(check_document_name("orders", &"i".repeat(1025)).is_err());
    }

    #[test]
    fn ids_are_parsed_and_bounded() {
        let id = MemoryDeliveryId(7).to_string();
        let (parsed, not_found) =
            parse_ids(&[id.clone(), id, "junk".to_owned()], "requeue").unwrap();
        assert_eq!(parsed, [MemoryDeliveryId(7)]);
        assert_eq!(not_found, ["junk"]);
        assert!(parse_after("junk").is_err());
    }

    #[test]
    fn errors_are_cut() {
        let long = "\u{20ac}".repeat(MAX_ERROR_BYTES);
        assert!(clip_error(&long).len() <= MAX_ERROR_BYTES);
        assert!(clip_history_error(&long).len() <= MAX_HISTORY_ERROR_BYTES);
        assert_eq!(clip_error("short"), "short");
    }
}
