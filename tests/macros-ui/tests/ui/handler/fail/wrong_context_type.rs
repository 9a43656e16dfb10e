use relaybus::BoxError;
use serde::{Deserialize, Serialize};

#[relaybus::event("order.placed.v1")]
#[derive(Serialize, Deserialize)]
struct OrderPlaced {}

#[relaybus::handler(id = "projector")]
async fn project(_: OrderPlaced, attempt: u32) -> Result<(), BoxError> {
    let _ = attempt;
    Ok(())
}

fn main() {}
