//! The event shipping consumes and the handler that makes a shipment of it.

use relaybus::{BoxError, Event, HandlerContext, State, Subscription};
use serde::{Deserialize, Serialize};

use crate::shipments::{Shipment, Shipments};

/// A customer placed an order: the shop's `order.placed.v1`, as shipping reads it. The two
/// services share the event's name and fields, not its Rust type.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OrderPlaced {
    /// The shop's order id.
    pub order_id: String,
    /// Who placed it.
    pub customer: String,
    /// Its total, in cents.
    pub total_cents: i64,
}

// Implemented by hand rather than with `#[event]`, which registers the type name for the whole
// program: the shop's tests link both services into one process, where the shop registers
// `order.placed.v1` already and a second registration is refused.
impl Event for OrderPlaced {
    const TYPE: &'static str = "order.placed.v1";
}

/// The handler id of `create_shipment`'s subscription: the key of its deliveries in the
/// store, so renaming it means migrating its pending deliveries.
pub const CREATE_SHIPMENT: &str = "create-shipment";

/// Shipping's subscriptions, for a bus whose state holds the [`Shipments`].
pub fn subscriptions<H: Shipments>() -> [Subscription; 1] {
    [Subscription::new(CREATE_SHIPMENT, create_shipment::<H>).transactional()]
}

/// Makes the order's shipment. Transactional: the shipment and the completion of the delivery
/// commit together, so each order gets one shipment even when the event is handled again.
async fn create_shipment<H: Shipments>(
    event: OrderPlaced,
    ctx: HandlerContext<H::Store>,
    State(shipments): State<H>,
) -> Result<(), BoxError> {
    let shipment = Shipment {
        order_id: event.order_id,
        customer: event.customer,
        total_cents: event.total_cents,
    };
    let mut session = ctx.session().await?;
    shipments.insert(&mut session, &shipment).await?;
    println!(
        "  [{CREATE_SHIPMENT}] shipment for order {} of {} (event {})",
        shipment.order_id,
        shipment.customer,
        ctx.event_id()
    );
    Ok(())
}
