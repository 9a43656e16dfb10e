#[relaybus::event("order.placed.v1")]
fn order_placed() {}

#[relaybus::event("order.shipped.v1")]
union OrderShipped {
    id: u64,
}

fn main() {}
