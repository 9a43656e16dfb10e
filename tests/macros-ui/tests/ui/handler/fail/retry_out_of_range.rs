use relaybus::BoxError;
use serde::{Deserialize, Serialize};

#[relaybus::event("order.placed.v1")]
#[derive(Serialize, Deserialize)]
struct OrderPlaced {}

#[relaybus::handler(id = "projector", max_attempts = 0)]
async fn project(_: OrderPlaced) -> Result<(), BoxError> {
    Ok(())
}

#[relaybus::handler(id = "recorder", initial_backoff_ms = 5_000, max_backoff_ms = 1_000)]
async fn record(_: OrderPlaced) -> Result<(), BoxError> {
    Ok(())
}

#[relaybus::handler(id = "auditor", max_attempts = "3", max_backoff_ms = -1)]
async fn audit(_: OrderPlaced) -> Result<(), BoxError> {
    Ok(())
}

#[relaybus::handler(id = "hung", timeout_ms = 0)]
async fn hang(_: OrderPlaced) -> Result<(), BoxError> {
    Ok(())
}

fn main() {}
