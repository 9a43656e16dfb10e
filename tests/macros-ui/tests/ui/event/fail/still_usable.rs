use serde::{Deserialize, Serialize};

// After an error in the attribute, the type is still there and still an Event: only the
// attribute's own error is reported, not one at every use.
#[relaybus::event("Order Placed")]
#[derive(Serialize, Deserialize)]
struct OrderPlaced {
    order_id: String,
}

fn publish<E: relaybus::Event>(_: &E) {}

fn main() {
    publish(&OrderPlaced { order_id: "o-1".into() });
}
