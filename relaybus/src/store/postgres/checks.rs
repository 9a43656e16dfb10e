//! Input checks of the PostgreSQL store: those all stores share, lead roles, the text
//! PostgreSQL cannot hold, and the text helpers the writes share. Everything here runs before a
//! query, so refused input writes nothing.

pub(super) use crate::store::checks::{
    add, check_batch, check_handlers, check_lease_duration, check_limit, check_list_limit,
    check_owner, check_reason, check_role,
};
use crate::{
    error::{EventValidationError, Result, truncate_for_message},
    handler::validate_handler_id,
    store::{
        AppendRequest,
        checks::{self, MAX_ERROR_BYTES, MAX_HISTORY_ERROR_BYTES, clip_to},
    },
};

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
    checks::parse_ids(ids, verb, parse_id)
}

/// The listing cursor `after`, refused when it is no delivery id.
pub(super) fn parse_after(after: &str) -> Result<i64> {
    checks::parse_after(after, parse_id)
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

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn arguments_are_checked() {
        assert!(check_role("gauges", Duration::from_secs(1)).is_ok());
        assert!(check_role("", Duration::from_secs(1)).is_err());
        assert!(check_role("gauges", Duration::ZERO).is_err());
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
