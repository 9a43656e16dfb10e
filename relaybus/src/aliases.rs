//! Short names for one store's types, in the manner of sqlx's `PgPool`: a service on one store
//! writes `postgres::Bus` and `postgres::Context` instead of naming the store in every type.

/// The PostgreSQL store's types: `relaybus::postgres::{Bus, Context, Session}`.
///
/// ```no_run,standalone_crate
/// use relaybus::{BoxError, postgres::{Bus, Context}};
///
/// #[relaybus::event("user.registered.v1")]
/// #[derive(Debug, serde::Serialize, serde::Deserialize)]
/// struct UserRegistered {
///     user_id: i64,
/// }
///
/// #[relaybus::handler(id = "directory", transactional)]
/// async fn add_to_directory(event: UserRegistered, ctx: Context) -> Result<(), BoxError> {
///     let mut session = ctx.session().await?;
///     sqlx::query("INSERT INTO directory (user_id) VALUES ($1)")
///         .bind(event.user_id)
///         .execute(&mut *session) // a session is an sqlx `Executor`
///         .await?;
///     Ok(())
/// }
///
/// # async fn example(pool: sqlx::PgPool) -> Result<(), relaybus::Error> {
/// let store = relaybus::PostgresEventStore::builder(pool).build()?;
/// let bus = Bus::builder(store).build()?;
/// # Ok(())
/// # }
/// ```
#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub mod postgres {
    use crate::store::postgres::{PostgresEventStore, PostgresSession};

    /// The PostgreSQL store.
    pub type Store = PostgresEventStore;
    /// A bus on the PostgreSQL store.
    pub type Bus = crate::RelayBus<PostgresEventStore>;
    /// The builder of a bus on the PostgreSQL store.
    pub type Builder = crate::RelayBusBuilder<PostgresEventStore>;
    /// The context of a handler that runs on the PostgreSQL store.
    pub type Context = crate::HandlerContext<PostgresEventStore>;
    /// A transaction's session: an sqlx `Executor`, and a `PgConnection` through `Deref`.
    pub type Session = PostgresSession;
    /// A transactional handler's hold on its session (`ctx.session().await?`).
    pub type SessionGuard = crate::SessionGuard<PostgresEventStore>;
}

/// The MongoDB store's types: `relaybus::mongo::{Bus, Context, Session}`. They are also the
/// defaults of the generic types when the `mongodb` feature is on.
#[cfg(feature = "mongodb")]
#[cfg_attr(docsrs, doc(cfg(feature = "mongodb")))]
pub mod mongo {
    use crate::store::mongo::MongoEventStore;

    /// The MongoDB store.
    pub type Store = MongoEventStore;
    /// A bus on the MongoDB store.
    pub type Bus = crate::RelayBus<MongoEventStore>;
    /// The builder of a bus on the MongoDB store.
    pub type Builder = crate::RelayBusBuilder<MongoEventStore>;
    /// The context of a handler that runs on the MongoDB store.
    pub type Context = crate::HandlerContext<MongoEventStore>;
    /// A transaction's session: the driver's `ClientSession`.
    pub type Session = mongodb::ClientSession;
    /// A transactional handler's hold on its session (`ctx.session().await?`).
    pub type SessionGuard = crate::SessionGuard<MongoEventStore>;
}

/// The in-memory store's types: `relaybus::memory::{Bus, Context, Session}`.
#[cfg(feature = "memory")]
#[cfg_attr(docsrs, doc(cfg(feature = "memory")))]
pub mod memory {
    use crate::store::memory::{MemoryEventStore, MemorySession};

    /// The in-memory store.
    pub type Store = MemoryEventStore;
    /// A bus on the in-memory store.
    pub type Bus = crate::RelayBus<MemoryEventStore>;
    /// The builder of a bus on the in-memory store.
    pub type Builder = crate::RelayBusBuilder<MemoryEventStore>;
    /// The context of a handler that runs on the in-memory store.
    pub type Context = crate::HandlerContext<MemoryEventStore>;
    /// A transaction's session.
    pub type Session = MemorySession;
    /// A transactional handler's hold on its session (`ctx.session().await?`).
    pub type SessionGuard = crate::SessionGuard<MemoryEventStore>;
}
