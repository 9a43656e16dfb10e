use relaybus::{BoxError, HandlerContext};
use serde::{Deserialize, Serialize};

#[relaybus::event("order.placed.v1")]
#[derive(Serialize, Deserialize)]
struct OrderPlaced {}

#[relaybus::handler(id = "projector")]
async fn project(_: &OrderPlaced, _: &HandlerContext) -> Result<(), BoxError> {
    Ok(())
}

fn main() {}
