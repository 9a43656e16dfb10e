//! Shipping's own data: one shipment per order, written in the event store's transactions so
//! that a shipment and the completion of its delivery commit together.
//!
//! [`PostgresShipments`] keeps them in a PostgreSQL table next to the events,
//! [`MemoryShipments`] in the in-memory store's collections (for tests and for trying the
//! service without a database).

use std::future::Future;

use relaybus::{
    MemoryEventStore, PostgresEventStore, PostgresSession, Store,
    store::{Transactions, memory::MemorySession},
};
use serde::{Deserialize, Serialize};
use serde_json::json;

/// A shipment, made of one order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Shipment {
    /// The shop's order id, which names the shipment too.
    pub order_id: String,
    /// Who receives it.
    pub customer: String,
    /// The order's total, in cents.
    pub total_cents: i64,
}

/// Where shipping keeps its shipments, in the transactions of the event store `Store`.
pub trait Shipments: Clone + Send + Sync + 'static {
    /// The event store whose transactions the writes join.
    type Store: Store;

    /// Stores a new shipment in the transaction of `session`; a second one of the same order
    /// fails.
    fn insert(
        &self,
        session: &mut <Self::Store as Transactions>::Session,
        shipment: &Shipment,
    ) -> impl Future<Output = relaybus::Result<()>> + Send;

    /// Every committed shipment, in order id order.
    fn list(&self) -> impl Future<Output = relaybus::Result<Vec<Shipment>>> + Send;
}

/// The shipments in the in-memory store's collection `shipments`.
#[derive(Debug, Clone)]
pub struct MemoryShipments {
    /// The store whose collections hold them.
    pub store: MemoryEventStore,
}

impl Shipments for MemoryShipments {
    type Store = MemoryEventStore;

    async fn insert(
        &self,
        session: &mut MemorySession,
        shipment: &Shipment,
    ) -> relaybus::Result<()> {
        session.insert("shipments", &shipment.order_id, json!(shipment))
    }

    async fn list(&self) -> relaybus::Result<Vec<Shipment>> {
        Ok(self
            .store
            .documents("shipments")
            .into_iter()
            .filter_map(|(_, shipment)| serde_json::from_value(shipment).ok())
            .collect())
    }
}

/// The shipments in the PostgreSQL table `<schema>.shipments`.
#[derive(Debug, Clone)]
pub struct PostgresShipments {
    pool: sqlx::PgPool,
    /// The schema of the table: a plain identifier, checked by [`PostgresShipments::new`].
    schema: String,
}

impl PostgresShipments {
    /// The shipments in `schema` of the pool's database, their table created if missing.
    ///
    /// # Errors
    ///
    /// A schema name that is not 1 to 48 lowercase letters, digits and `_` (nothing is
    /// created then); database errors.
    pub async fn new(pool: sqlx::PgPool, schema: &str) -> relaybus::Result<Self> {
        if schema.is_empty()
            || schema.len() > 48
            || !schema
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
        {
            return Err(relaybus::Error::custom(format!(
                "shipping schema {schema:?} is not usable; use 1 to 48 lowercase letters, digits and _"
            )));
        }
        let shipments = PostgresShipments {
            pool,
            schema: schema.to_owned(),
        };
        // One statement at a time; an advisory lock keeps concurrent starts from racing.
        let mut tx = shipments.pool.begin().await?;
        for statement in [
            "SELECT pg_advisory_xact_lock(hashtext('example-shipping setup'))".to_owned(),
            format!("CREATE SCHEMA IF NOT EXISTS {schema}"),
            format!(
                "CREATE TABLE IF NOT EXISTS {schema}.shipments (order_id text PRIMARY KEY, \
                 customer text NOT NULL, total_cents bigint NOT NULL, \
                 created_at timestamptz NOT NULL DEFAULT now())"
            ),
        ] {
            sqlx::query(&statement).execute(&mut *tx).await?;
        }
        tx.commit().await?;
        Ok(shipments)
    }
}

impl Shipments for PostgresShipments {
    type Store = PostgresEventStore;

    async fn insert(
        &self,
        session: &mut PostgresSession,
        shipment: &Shipment,
    ) -> relaybus::Result<()> {
        sqlx::query(&format!(
            "INSERT INTO {}.shipments (order_id, customer, total_cents) VALUES ($1, $2, $3)",
            self.schema
        ))
        .bind(&shipment.order_id)
        .bind(&shipment.customer)
        .bind(shipment.total_cents)
        .execute(&mut **session)
        .await?;
        Ok(())
    }

    async fn list(&self) -> relaybus::Result<Vec<Shipment>> {
        let rows: Vec<(String, String, i64)> = sqlx::query_as(&format!(
            "SELECT order_id, customer, total_cents FROM {}.shipments ORDER BY order_id",
            self.schema
        ))
        .fetch_all(&self.pool)
        .await?;
        Ok(rows
            .into_iter()
            .map(|(order_id, customer, total_cents)| Shipment {
                order_id,
                customer,
                total_cents,
            })
            .collect())
    }
}
