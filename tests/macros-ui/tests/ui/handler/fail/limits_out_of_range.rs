use relaybus::BoxError;
use serde::{Deserialize, Serialize};

#[relaybus::event("order.placed.v1")]
#[derive(Serialize, Deserialize)]
struct OrderPlaced {}

#[relaybus::handler(id = "charger", global_concurrency = 0)]
async fn charge(_: OrderPlaced) -> Result<(), BoxError> {
    Ok(())
}

#[relaybus::handler(id = "mailer", rate_limit = 0)]
async fn mail(_: OrderPlaced) -> Result<(), BoxError> {
    Ok(())
}

#[relaybus::handler(id = "notifier", rate_interval_ms = 1_000)]
async fn notify(_: OrderPlaced) -> Result<(), BoxError> {
    Ok(())
}

#[relaybus::handler(id = "projector", max_batch = 10)]
async fn project(_: OrderPlaced) -> Result<(), BoxError> {
    Ok(())
}

fn main() {}
