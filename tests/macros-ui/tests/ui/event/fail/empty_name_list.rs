use serde::{Deserialize, Serialize};

#[relaybus::event()]
#[derive(Serialize, Deserialize)]
struct OrderPlaced {}

fn main() {}
