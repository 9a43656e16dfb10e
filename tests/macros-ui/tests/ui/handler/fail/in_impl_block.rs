use relaybus::BoxError;
use serde::{Deserialize, Serialize};

#[relaybus::event("order.placed.v1")]
#[derive(Serialize, Deserialize)]
struct OrderPlaced {}

struct Projector;

// Without a receiver the attribute cannot tell it is in an `impl` block; rustc refuses the
// registration there.
impl Projector {
    #[relaybus::handler(id = "projector")]
    async fn project(_: OrderPlaced) -> Result<(), BoxError> {
        Ok(())
    }
}

fn main() {}
