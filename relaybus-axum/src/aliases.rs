//! The extractors and the state named for one store, so that a route on that store writes
//! `postgres::Publisher` and never names the rejection type to reach the store parameter.

/// The types of a service on the PostgreSQL store (feature `postgres`).
///
/// ```no_run,standalone_crate
/// use axum::http::StatusCode;
/// use relaybus_axum::{PublishError, postgres::Publisher};
/// # #[relaybus::event("user.registered.v1")]
/// # #[derive(serde::Serialize, serde::Deserialize)]
/// # struct UserRegistered { user_id: i64 }
///
/// async fn sign_up(mut publisher: Publisher) -> Result<StatusCode, PublishError> {
///     let (user_id,): (i64,) = sqlx::query_as("INSERT INTO users DEFAULT VALUES RETURNING id")
///         .fetch_one(publisher.session()) // the request's session is an sqlx `Executor`
///         .await?; // sqlx's errors convert into `PublishError`
///     publisher.publish(&UserRegistered { user_id }).await?;
///     Ok(StatusCode::CREATED)
/// }
/// ```
#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub mod postgres {
    use relaybus::PostgresEventStore;

    use crate::rejection::{PublisherRejection, TxRejection};

    /// Publishes into the request's transaction on the PostgreSQL store.
    pub type Publisher<E = PublisherRejection> = crate::Publisher<E, PostgresEventStore>;
    /// The request's session on the PostgreSQL store.
    pub type Tx<E = TxRejection> = crate::Tx<E, PostgresEventStore>;
    /// The router state of a bus on the PostgreSQL store.
    pub type RelayState = crate::RelayState<PostgresEventStore>;
    /// The request transaction layer of a bus on the PostgreSQL store.
    pub type RequestTxLayer = crate::RequestTxLayer<PostgresEventStore>;
    /// The options of the request transactions on the PostgreSQL store.
    pub type Config = crate::Config<PostgresEventStore>;
    /// The dispatcher service of a bus on the PostgreSQL store.
    pub type DispatcherService = crate::DispatcherService<PostgresEventStore>;
}

/// The types of a service on the MongoDB store (feature `mongodb`); also the defaults of the
/// generic types when that feature is on.
#[cfg(feature = "mongodb")]
#[cfg_attr(docsrs, doc(cfg(feature = "mongodb")))]
pub mod mongo {
    use relaybus::MongoEventStore;

    use crate::rejection::{PublisherRejection, TxRejection};

    /// Publishes into the request's transaction on the MongoDB store.
    pub type Publisher<E = PublisherRejection> = crate::Publisher<E, MongoEventStore>;
    /// The request's session on the MongoDB store.
    pub type Tx<E = TxRejection> = crate::Tx<E, MongoEventStore>;
    /// The router state of a bus on the MongoDB store.
    pub type RelayState = crate::RelayState<MongoEventStore>;
    /// The request transaction layer of a bus on the MongoDB store.
    pub type RequestTxLayer = crate::RequestTxLayer<MongoEventStore>;
    /// The options of the request transactions on the MongoDB store.
    pub type Config = crate::Config<MongoEventStore>;
    /// The dispatcher service of a bus on the MongoDB store.
    pub type DispatcherService = crate::DispatcherService<MongoEventStore>;
}

/// The types of a service on the in-memory store (feature `memory`), for tests and development.
#[cfg(feature = "memory")]
#[cfg_attr(docsrs, doc(cfg(feature = "memory")))]
pub mod memory {
    use relaybus::MemoryEventStore;

    use crate::rejection::{PublisherRejection, TxRejection};

    /// Publishes into the request's transaction on the in-memory store.
    pub type Publisher<E = PublisherRejection> = crate::Publisher<E, MemoryEventStore>;
    /// The request's session on the in-memory store.
    pub type Tx<E = TxRejection> = crate::Tx<E, MemoryEventStore>;
    /// The router state of a bus on the in-memory store.
    pub type RelayState = crate::RelayState<MemoryEventStore>;
    /// The request transaction layer of a bus on the in-memory store.
    pub type RequestTxLayer = crate::RequestTxLayer<MemoryEventStore>;
    /// The options of the request transactions on the in-memory store.
    pub type Config = crate::Config<MemoryEventStore>;
    /// The dispatcher service of a bus on the in-memory store.
    pub type DispatcherService = crate::DispatcherService<MemoryEventStore>;
}
