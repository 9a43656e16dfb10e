use relaybus::{BoxError, HandlerContext, State};
use serde::{Deserialize, Serialize};

#[relaybus::event("order.placed.v1")]
#[derive(Serialize, Deserialize)]
struct OrderPlaced {}

#[relaybus::handler(id = "projector")]
async fn project(
    _: OrderPlaced,
    _: HandlerContext,
    _: State<u8>,
    _: State<u16>,
    _: State<u32>,
    _: State<u64>,
) -> Result<(), BoxError> {
    Ok(())
}

fn main() {}
