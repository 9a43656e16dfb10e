use serde::{Deserialize, Serialize};

#[relaybus::event("order.placed.v1", crate = ::relaybus, crate = ::relaybus)]
#[derive(Serialize, Deserialize)]
struct OrderPlaced {}

fn main() {}
