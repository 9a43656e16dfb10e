use relaybus::BoxError;
use serde::{Deserialize, Serialize};

#[relaybus::event("order.placed.v1")]
#[derive(Serialize, Deserialize)]
struct OrderPlaced {}

const ID: &str = "projector";

#[relaybus::handler(id = ID)]
async fn project(_: OrderPlaced) -> Result<(), BoxError> {
    Ok(())
}

#[relaybus::handler(id = 42)]
async fn record(_: OrderPlaced) -> Result<(), BoxError> {
    Ok(())
}

#[relaybus::handler(id)]
async fn audit(_: OrderPlaced) -> Result<(), BoxError> {
    Ok(())
}

fn main() {}
