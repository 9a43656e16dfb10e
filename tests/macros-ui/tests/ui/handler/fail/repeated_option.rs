use relaybus::BoxError;
use serde::{Deserialize, Serialize};

#[relaybus::event("order.placed.v1")]
#[derive(Serialize, Deserialize)]
struct OrderPlaced {}

#[relaybus::handler(id = "projector", transactional, transactional)]
async fn project(_: OrderPlaced) -> Result<(), BoxError> {
    Ok(())
}

#[relaybus::handler(id = "recorder", id = "audit")]
async fn record(_: OrderPlaced) -> Result<(), BoxError> {
    Ok(())
}

#[relaybus::handler(id = "notifier", unordered, max_attempts = 3, unordered)]
async fn notify(_: OrderPlaced) -> Result<(), BoxError> {
    Ok(())
}

fn main() {}
