use relaybus::BoxError;
use serde::{Deserialize, Serialize};

#[relaybus::event("order.placed.v1")]
#[derive(Serialize, Deserialize)]
struct OrderPlaced {}

#[derive(Serialize, Deserialize)]
struct OrderShipped {}

#[relaybus::handler(id = "projector")]
async fn project(_: OrderShipped) -> Result<(), BoxError> {
    Ok(())
}

#[relaybus::handler(id = "counter")]
async fn count(_: u64) -> Result<(), BoxError> {
    Ok(())
}

fn main() {}
