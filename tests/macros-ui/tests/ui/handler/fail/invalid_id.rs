use relaybus::BoxError;
use serde::{Deserialize, Serialize};

#[relaybus::event("order.placed.v1")]
#[derive(Serialize, Deserialize)]
struct OrderPlaced {}

#[relaybus::handler(id = "order projector")]
async fn project(_: OrderPlaced) -> Result<(), BoxError> {
    Ok(())
}

#[relaybus::handler(id = "")]
async fn record(_: OrderPlaced) -> Result<(), BoxError> {
    Ok(())
}

fn main() {}
