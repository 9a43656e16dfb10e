use relaybus::BoxError;
use serde::{Deserialize, Serialize};

#[relaybus::event("order.placed.v1")]
#[derive(Serialize, Deserialize)]
struct OrderPlaced {}

struct Projector;

impl Projector {
    #[relaybus::handler(id = "projector")]
    async fn project(&self, _: OrderPlaced) -> Result<(), BoxError> {
        Ok(())
    }
}

fn main() {}
