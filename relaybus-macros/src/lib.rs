//! Procedural macros for relaybus: `#[event]`, `#[handler]` and `#[schedule]`.
//!
//! Use them through the `relaybus` crate (`#[relaybus::event]`, `#[relaybus::handler]`), whose
//! `macros` feature, on by default, re-exports them; a crate that uses them depends on relaybus
//! alone. The generated code refers to `::relaybus::__private`, which exists only in the version
//! of relaybus this crate is released with (relaybus pins it with `=`).

mod attr;
mod ctxt;
mod event;
mod handler;
mod rules;
mod schedule;

use proc_macro::TokenStream;

/// Expanded by `relaybus-macros`; documented, with its examples, as `relaybus::event`.
#[proc_macro_attribute]
pub fn event(attr: TokenStream, item: TokenStream) -> TokenStream {
    event::expand(attr.into(), item.into()).into()
}

/// Expanded by `relaybus-macros`; documented, with its examples, as `relaybus::handler`.
#[proc_macro_attribute]
pub fn handler(attr: TokenStream, item: TokenStream) -> TokenStream {
    handler::expand(attr.into(), item.into()).into()
}

/// Expanded by `relaybus-macros`; documented, with its examples, as `relaybus::schedule`.
#[proc_macro_attribute]
pub fn schedule(attr: TokenStream, item: TokenStream) -> TokenStream {
    schedule::expand(attr.into(), item.into()).into()
}
