//! Strict lints and a module without the prelude: the generated code adds no warning, needs no
//! import, and names nothing the user's scope could shadow.
#![deny(warnings, missing_docs, unreachable_pub, unused_qualifications, unused_results)]

/// Events and handlers declared without the prelude.
pub mod shop {
    #![no_implicit_prelude]

    /// An event.
    #[::relaybus::event("shop.order.placed.v1")]
    #[derive(::serde::Serialize, ::serde::Deserialize)]
    pub struct OrderPlaced {}

    /// A handler.
    #[::relaybus::handler(id = "shop.projector", transactional, max_attempts = 2)]
    pub async fn project(
        _: OrderPlaced,
        _: ::relaybus::HandlerContext,
    ) -> ::core::result::Result<(), ::relaybus::BoxError> {
        ::core::result::Result::Ok(())
    }

    // Names the generated code must not pick up from the user's scope.
    #[allow(dead_code)]
    struct Subscription;
    #[allow(dead_code)]
    struct HandlerContext;
    #[allow(dead_code)]
    struct Event;
    #[allow(dead_code)]
    mod inventory {}
    #[allow(dead_code)]
    mod core {}
}

/// A handler named like the glue's own variables.
#[relaybus::handler(id = "shop.event")]
pub async fn event(
    event: shop::OrderPlaced,
    context: relaybus::HandlerContext,
) -> Result<(), relaybus::BoxError> {
    let _ = (event, context);
    Ok(())
}

fn main() {
    assert_eq!(relaybus::registry::handlers().len(), 2);
    assert_eq!(relaybus::registry::check(), Ok(()));
}
