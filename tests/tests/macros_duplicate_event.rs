//! Two `#[event]` types with one type name, in two modules of one binary: the bus refuses to
//! build, naming both. (A binary of its own, so that the duplicate breaks no other test.)

use relaybus::{ConfigurationError, Event, MongoEventStore, RelayBus, registry};

mod v1 {
    use serde::{Deserialize, Serialize};

    #[relaybus::event("duplicate.order.placed.v1")]
    #[derive(Serialize, Deserialize)]
    pub(crate) struct OrderPlaced {
        pub(crate) order_id: String,
    }
}

mod v2 {
    use serde::{Deserialize, Serialize};

    /// Meant as the next version, but still named v1.
    #[relaybus::event("duplicate.order.placed.v1")]
    #[derive(Serialize, Deserialize)]
    pub(crate) struct OrderPlaced {
        pub(crate) order_id: String,
        pub(crate) currency: String,
    }
}

#[tokio::test]
async fn a_duplicate_event_type_name_is_refused_at_build_naming_both() {
    assert_eq!(v1::OrderPlaced::TYPE, v2::OrderPlaced::TYPE);
    let client = mongodb::Client::with_uri_str("mongodb://127.0.0.1:9/?replicaSet=unused")
        .await
        .unwrap();
    let store = MongoEventStore::builder(client)
        .database("unused")
        .build()
        .unwrap();
    for error in [
        registry::check().unwrap_err(),
        RelayBus::builder(store).build().unwrap_err(),
    ] {
        match &error {
            ConfigurationError::DuplicateEventType {
                type_name,
                first,
                second,
            } => {
                assert_eq!(type_name, "duplicate.order.placed.v1");
                assert_eq!(first, "macros_duplicate_event::v1::OrderPlaced");
                assert_eq!(second, "macros_duplicate_event::v2::OrderPlaced");
            }
            other => panic!("expected a duplicate event type, got {other:?}"),
        }
        assert!(error.to_string().contains("order.placed.v2"), "{error}");
    }
}
