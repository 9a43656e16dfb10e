//! The naming rules of relaybus, checked at compile time.
//!
//! They repeat `relaybus::event::check_type_name` and `relaybus::validate_handler_id`, which this
//! crate cannot call (relaybus depends on it). The generated code also asserts the type name
//! with relaybus's own `const fn`, so the two copies cannot drift apart unnoticed.

/// The longest event type name, in bytes.
const MAX_TYPE_NAME_BYTES: usize = 128;
/// The longest handler id, in bytes.
const MAX_HANDLER_ID_BYTES: usize = 128;

/// What is wrong with an event type name, if anything.
pub(crate) fn check_type_name(name: &str) -> Result<(), &'static str> {
    if name.is_empty() {
        return Err("it is empty");
    }
    if name.len() > MAX_TYPE_NAME_BYTES {
        return Err("it is longer than 128 bytes");
    }
    for segment in name.split('.') {
        let Some(first) = segment.bytes().next() else {
            return Err("it has an empty segment (a leading, trailing or doubled `.`)");
        };
        if !(first.is_ascii_lowercase() || first.is_ascii_digit()) {
            return Err("a segment starts with a character other than a lowercase letter or digit");
        }
        if !segment
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'-')
        {
            return Err(
                "it contains a character other than lowercase letters, digits, `_`, `-` and `.`",
            );
        }
    }
    Ok(())
}

/// What is wrong with a handler id, if anything.
pub(crate) fn check_handler_id(id: &str) -> Result<(), &'static str> {
    if id.is_empty() {
        Err("it is empty")
    } else if id.len() > MAX_HANDLER_ID_BYTES {
        Err("it is longer than 128 bytes")
    } else if !id
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.' | b':'))
    {
        Err("it contains a character other than ASCII letters, digits, `_`, `-`, `.` and `:`")
    } else {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // The same cases as relaybus's own tests of the rule.
    #[test]
    fn type_names() {
        for good in ["order.placed.v1", "a", "x-y_z.0", "9.lives"] {
            assert_eq!(check_type_name(good), Ok(()), "{good}");
        }
        for bad in [
            "",
            ".a",
            "a.",
            "a..b",
            "Order.placed",
            "order placed",
            "_a",
            "a.-b",
            "ordér",
        ] {
            assert!(check_type_name(bad).is_err(), "{bad}");
        }
        assert!(check_type_name(&"a".repeat(129)).is_err());
        assert!(check_type_name(&"a".repeat(128)).is_ok());
    }

    #[test]
    fn handler_ids() {
        for good in ["projector", "billing:invoice.v2", "A_b-c"] {
            assert_eq!(check_handler_id(good), Ok(()), "{good}");
        }
        for bad in ["", "has space", "ünï", "a/b"] {
            assert!(check_handler_id(bad).is_err(), "{bad}");
        }
        assert!(check_handler_id(&"a".repeat(129)).is_err());
    }
}
