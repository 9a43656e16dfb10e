//! Two `#[handler]` functions with one id, in two modules of one binary: the bus refuses to
//! build, naming both. (A binary of its own, so that the duplicate breaks no other test.)

use relaybus::{BoxError, ConfigurationError, MongoEventStore, RelayBus, registry};

mod billing {
    use serde::{Deserialize, Serialize};

    #[relaybus::event("duplicate.invoice.sent.v1")]
    #[derive(Serialize, Deserialize)]
    pub(crate) struct InvoiceSent {}

    #[relaybus::handler(id = "duplicate.projector")]
    pub(crate) async fn project(_: InvoiceSent) -> Result<(), super::BoxError> {
        Ok(())
    }
}

mod shipping {
    use serde::{Deserialize, Serialize};

    #[relaybus::event("duplicate.parcel.sent.v1")]
    #[derive(Serialize, Deserialize)]
    pub(crate) struct ParcelSent {}

    #[relaybus::handler(id = "duplicate.projector", transactional)]
    pub(crate) async fn project(_: ParcelSent) -> Result<(), super::BoxError> {
        Ok(())
    }
}

/// A store on a client that never connects: building a bus makes no database call.
async fn store() -> MongoEventStore {
    let client = mongodb::Client::with_uri_str("mongodb://127.0.0.1:9/?replicaSet=unused")
        .await
        .unwrap();
    MongoEventStore::builder(client)
        .database("unused")
        .build()
        .unwrap()
}

fn assert_names_both(error: &ConfigurationError) {
    match error {
        ConfigurationError::DuplicateHandlerId { id, first, second } => {
            assert_eq!(id, "duplicate.projector");
            assert!(
                first.contains("macros_duplicate_handler::billing::project"),
                "{first}"
            );
            assert!(
                second.contains("macros_duplicate_handler::shipping::project"),
                "{second}"
            );
        }
        other => panic!("expected a duplicate handler id, got {other:?}"),
    }
    let message = error.to_string();
    assert!(message.contains("billing::project"), "{message}");
    assert!(message.contains("shipping::project"), "{message}");
}

#[tokio::test]
async fn a_duplicate_handler_id_is_refused_at_build_naming_both() {
    assert_names_both(&registry::check().unwrap_err());
    assert_names_both(&RelayBus::builder(store().await).build().unwrap_err());
    // The duplicate breaks the binary whichever handlers a bus subscribes.
    assert_names_both(
        &RelayBus::builder(store().await)
            .without_registered_handlers()
            .build()
            .unwrap_err(),
    );
    // Both functions are still there to call.
    billing::project(billing::InvoiceSent {}).await.unwrap();
    shipping::project(shipping::ParcelSent {}).await.unwrap();
}
