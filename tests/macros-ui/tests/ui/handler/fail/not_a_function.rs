use serde::{Deserialize, Serialize};

#[relaybus::event("order.placed.v1")]
#[derive(Serialize, Deserialize)]
struct OrderPlaced {}

#[relaybus::handler(id = "projector")]
struct Projector;

fn main() {}
