use relaybus::Event;
use serde::{Deserialize, Serialize};

#[relaybus::event("order.placed.v1")]
#[derive(Debug, Serialize, Deserialize)]
pub struct OrderPlaced {
    order_id: String,
}

#[relaybus::event("payment.settled.v2")]
#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "method")]
enum PaymentSettled {
    Card { last4: String },
    Transfer { reference: String },
}

mod nested {
    use serde::{Deserialize, Serialize};

    #[relaybus::event("order.shipped.v1")]
    #[derive(Serialize, Deserialize)]
    pub(crate) struct OrderShipped {}
}

fn main() {
    assert_eq!(OrderPlaced::TYPE, "order.placed.v1");
    assert_eq!(PaymentSettled::TYPE, "payment.settled.v2");
    assert_eq!(nested::OrderShipped::TYPE, "order.shipped.v1");
    let types: Vec<_> = relaybus::registry::events()
        .map(|e| (e.type_name(), e.rust_type()))
        .collect();
    // trybuild names the crate of each test itself.
    let path = |item: &str| format!("{}::{item}", module_path!());
    assert_eq!(
        types,
        [
            ("order.placed.v1", path("OrderPlaced").as_str()),
            ("order.shipped.v1", path("nested::OrderShipped").as_str()),
            ("payment.settled.v2", path("PaymentSettled").as_str()),
        ]
    );
    let _ = PaymentSettled::Card {
        last4: "4242".into(),
    };
    let _ = PaymentSettled::Transfer {
        reference: "r".into(),
    };
}
