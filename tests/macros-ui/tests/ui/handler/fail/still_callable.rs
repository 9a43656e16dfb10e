use relaybus::BoxError;
use serde::{Deserialize, Serialize};

#[relaybus::event("order.placed.v1")]
#[derive(Serialize, Deserialize)]
struct OrderPlaced {}

// After an error in the attribute, the function is still there: only the attribute is
// reported, not the test that calls the function.
#[relaybus::handler(id = "projector", transactionnal)]
async fn project(_: OrderPlaced) -> Result<(), BoxError> {
    Ok(())
}

#[allow(dead_code)]
fn call_it() {
    let _ = project(OrderPlaced {});
}

fn main() {}
