use relaybus::{BoxError, State};
use serde::{Deserialize, Serialize};

#[relaybus::event("order.placed.v1")]
#[derive(Serialize, Deserialize)]
struct OrderPlaced {}

#[derive(Clone)]
struct Database {}

#[relaybus::handler(id = "projector")]
async fn project(_: OrderPlaced, _: &State<Database>) -> Result<(), BoxError> {
    Ok(())
}

fn main() {}
