//! The checks of `#[event]` that need more than parsing.

use syn::{LitStr, Path};

use super::ast::{Args, Input};
use crate::{attr, ctxt::Ctxt, rules};

/// A checked `#[event]`, ready to expand.
pub(super) struct Event<'a> {
    pub(super) name: &'a LitStr,
    pub(super) input: &'a Input<'a>,
    pub(super) krate: Path,
}

/// Checks the arguments against the item, reporting every problem to `cx`; `Some` when
/// nothing is wrong with what was parsed.
pub(super) fn check<'a>(
    cx: &Ctxt,
    args: &'a Args,
    input: Option<&'a Input<'a>>,
) -> Option<Event<'a>> {
    let mut ok = true;
    match &args.name {
        Some(name) => {
            if let Err(reason) = rules::check_type_name(&name.value()) {
                cx.error_spanned_by(
                    name,
                    format_args!(
                        "invalid event type name {:?}: {reason}; use dot-separated lowercase segments of \
                         ASCII letters, digits, `_` and `-`, each starting with a letter or digit, \
                         128 bytes at most (for example \"order.placed.v1\")",
                        name.value()
                    ),
                );
                ok = false;
            }
        }
        None if args.name_given => ok = false,
        None => {
            cx.error_spanned_by(
                proc_macro2::TokenStream::new(),
                "missing the event type name: write `#[event(\"order.placed.v1\")]`",
            );
            ok = false;
        }
    }
    if let Some(input) = input
        && input.generics.lt_token.is_some()
    {
        cx.error_spanned_by(
            input.generics,
            "an event type cannot be generic: its type name stands for one payload shape; \
             declare one type per event",
        );
        ok = false;
    }
    match (ok, &args.name, input) {
        (true, Some(name), Some(input)) => Some(Event {
            name,
            input,
            krate: args.krate.clone().unwrap_or_else(attr::default_crate),
        }),
        _ => None,
    }
}
