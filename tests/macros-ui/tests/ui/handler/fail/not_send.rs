use relaybus::BoxError;
use serde::{Deserialize, Serialize};

#[relaybus::event("order.placed.v1")]
#[derive(Serialize, Deserialize)]
struct OrderPlaced {}

#[relaybus::handler(id = "projector")]
async fn project(_: OrderPlaced) -> Result<(), BoxError> {
    let local = std::rc::Rc::new(1);
    std::future::ready(()).await;
    let _ = local;
    Ok(())
}

fn main() {}
