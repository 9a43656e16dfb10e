use serde::{Deserialize, Serialize};

#[relaybus::event("order.placed.v1")]
#[derive(Serialize, Deserialize)]
struct OrderPlaced {}

// Every problem is reported, not only the first.
#[relaybus::handler(id = "my projector", retries = 3, transactional, transactional)]
fn project(_: &OrderPlaced) {}

fn main() {}
