//! `crate = path` names the runtime crate when it is reached through a re-export.

mod platform {
    pub use ::relaybus as bus;
}

mod orders {
    use serde::{Deserialize, Serialize};

    #[crate::platform::bus::event("order.placed.v1", crate = crate::platform::bus)]
    #[derive(Serialize, Deserialize)]
    pub struct OrderPlaced {}

    // serde's spelling, a string, is accepted too.
    #[crate::platform::bus::event("order.cancelled.v1", crate = "crate::platform::bus")]
    #[derive(Serialize, Deserialize)]
    pub struct OrderCancelled {}

    #[crate::platform::bus::handler(id = "projector", crate = crate::platform::bus)]
    pub async fn project(_: OrderPlaced) -> Result<(), crate::platform::bus::BoxError> {
        Ok(())
    }
}

fn main() {
    use relaybus::Event;
    assert_eq!(orders::OrderPlaced::TYPE, "order.placed.v1");
    assert_eq!(orders::OrderCancelled::TYPE, "order.cancelled.v1");
    assert_eq!(relaybus::registry::handlers().len(), 1);
    let _ = orders::project;
}
