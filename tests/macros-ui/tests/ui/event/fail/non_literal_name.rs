use serde::{Deserialize, Serialize};

#[relaybus::event(order.placed.v1)]
#[derive(Serialize, Deserialize)]
struct OrderPlaced {}

const NAME: &str = "order.shipped.v1";

#[relaybus::event(NAME)]
#[derive(Serialize, Deserialize)]
struct OrderShipped {}

fn main() {}
