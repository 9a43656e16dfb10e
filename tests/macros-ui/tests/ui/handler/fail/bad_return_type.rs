use relaybus::BoxError;
use serde::{Deserialize, Serialize};

#[relaybus::event("order.placed.v1")]
#[derive(Serialize, Deserialize)]
struct OrderPlaced {}

#[relaybus::handler(id = "projector")]
async fn project(_: OrderPlaced) -> Result<u32, BoxError> {
    Ok(1)
}

#[relaybus::handler(id = "recorder")]
async fn record(_: OrderPlaced) -> Result<(), std::rc::Rc<str>> {
    Ok(())
}

fn main() {}
