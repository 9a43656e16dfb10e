//! Procedural macros for relaybus: `#[event]` and `#[handler]`.
//!
//! Use them through the `relaybus` crate (`relaybus::event`, `relaybus::handler`), whose
//! `macros` feature, on by default, re-exports them. The generated code refers to
//! `::relaybus::__private`, which exists only in the matching version of relaybus.

mod attr;
mod ctxt;
mod event;
mod handler;
mod rules;

use proc_macro::TokenStream;

/// Declares an event type: implements `relaybus::Event` with the given type name and
/// registers the type with `relaybus::registry`.
#[proc_macro_attribute]
pub fn event(attr: TokenStream, item: TokenStream) -> TokenStream {
    event::expand(attr.into(), item.into()).into()
}

/// Declares a handler: keeps the `async fn` as it is and registers a subscription of it with
/// `relaybus::registry`, which the bus builder subscribes.
#[proc_macro_attribute]
pub fn handler(attr: TokenStream, item: TokenStream) -> TokenStream {
    handler::expand(attr.into(), item.into()).into()
}
