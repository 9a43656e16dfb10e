use serde::{Deserialize, Serialize};

#[relaybus::event("Order Placed")]
#[derive(Serialize, Deserialize)]
struct OrderPlaced {}

#[relaybus::event("order..shipped.v1")]
#[derive(Serialize, Deserialize)]
struct OrderShipped {}

fn main() {}
