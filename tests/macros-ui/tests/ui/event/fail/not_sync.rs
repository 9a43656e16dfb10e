use std::cell::Cell;

use serde::{Deserialize, Serialize};

// What `Event` requires besides the name (serde, `Send`, `Sync`) is checked by rustc, at the type.
#[relaybus::event("order.placed.v1")]
#[derive(Serialize, Deserialize)]
struct OrderPlaced {
    retries: Cell<u32>,
}

fn main() {}
