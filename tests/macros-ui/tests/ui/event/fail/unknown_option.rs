use serde::{Deserialize, Serialize};

#[relaybus::event("order.placed.v1", version = 2)]
#[derive(Serialize, Deserialize)]
struct OrderPlaced {}

fn main() {}
