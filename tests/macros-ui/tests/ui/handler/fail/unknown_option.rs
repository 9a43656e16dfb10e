use relaybus::BoxError;
use serde::{Deserialize, Serialize};

#[relaybus::event("order.placed.v1")]
#[derive(Serialize, Deserialize)]
struct OrderPlaced {}

#[relaybus::handler(id = "projector", transactionnal, retries = 3)]
async fn project(_: OrderPlaced) -> Result<(), BoxError> {
    Ok(())
}

fn main() {}
