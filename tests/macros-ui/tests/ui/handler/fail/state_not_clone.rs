use relaybus::{BoxError, State};
use serde::{Deserialize, Serialize};

#[relaybus::event("order.placed.v1")]
#[derive(Serialize, Deserialize)]
struct OrderPlaced {}

/// A state type must be `Clone`: each attempt gets a clone.
struct Database {}

#[relaybus::handler(id = "projector")]
async fn project(_: OrderPlaced, _: State<Database>) -> Result<(), BoxError> {
    Ok(())
}

fn main() {}
