use serde::{Deserialize, Serialize};

// Every problem is reported, not only the first.
#[relaybus::event("Order.Placed", verbose, crate = 42)]
#[derive(Serialize, Deserialize)]
struct OrderPlaced<T>(T);

fn main() {}
