//! The shop's own data: orders, and the totals per customer that the projector keeps. Written
//! through the event store's transactions, so that an order and its event commit together, and
//! a projection and its delivery's completion too.
//!
//! One implementation per store: [`MongoOrders`] keeps them in MongoDB collections next to the
//! events, [`PostgresOrders`] in PostgreSQL tables, [`MemoryOrders`] in the in-memory store's
//! collections (for tests and for trying the shop without a database).

use std::future::Future;

use futures::TryStreamExt;
use mongodb::{
    Database,
    bson::{Document, doc},
};
use relaybus::{
    MemoryEventStore, MongoEventStore, PostgresEventStore, PostgresSession, Store,
    store::{Transactions, memory::MemorySession},
};
use serde::{Deserialize, Serialize};
use serde_json::json;

/// An order as the shop stores it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Order {
    pub(crate) id: String,
    pub(crate) customer: String,
    pub(crate) total_cents: i64,
}

/// What the projector has counted for one customer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct CustomerTotals {
    pub(crate) customer: String,
    pub(crate) orders: i64,
    pub(crate) total_cents: i64,
}

/// The orders stored, and the projection, customers in name order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Stats {
    pub(crate) orders: u64,
    pub(crate) customers: Vec<CustomerTotals>,
}

/// Where the shop keeps its data, in the transactions of the event store `Store`.
pub(crate) trait Orders: Clone + Send + Sync + 'static {
    /// The event store whose transactions the writes join.
    type Store: Store;

    /// Stores a new order in the transaction of `session`.
    fn insert(
        &self,
        session: &mut <Self::Store as Transactions>::Session,
        order: &Order,
    ) -> impl Future<Output = relaybus::Result<()>> + Send;

    /// The committed order with this id.
    fn find(&self, id: &str) -> impl Future<Output = relaybus::Result<Option<Order>>> + Send;

    /// Counts an order of `cents` for `customer`, in the transaction of `session`.
    fn add_to_totals(
        &self,
        session: &mut <Self::Store as Transactions>::Session,
        customer: &str,
        cents: i64,
    ) -> impl Future<Output = relaybus::Result<()>> + Send;

    /// What is committed now.
    fn stats(&self) -> impl Future<Output = relaybus::Result<Stats>> + Send;
}

/// The orders in MongoDB: collections `orders` and `order_totals` of the shop's database.
#[derive(Debug, Clone)]
pub(crate) struct MongoOrders {
    pub(crate) db: Database,
}

impl Orders for MongoOrders {
    type Store = MongoEventStore;

    async fn insert(
        &self,
        session: &mut mongodb::ClientSession,
        order: &Order,
    ) -> relaybus::Result<()> {
        self.db
            .collection::<Document>("orders")
            .insert_one(doc! {
                "_id": &order.id,
                "customer": &order.customer,
                "total_cents": order.total_cents,
                "placed_at": mongodb::bson::DateTime::now(),
            })
            .session(session)
            .await?;
        Ok(())
    }

    async fn find(&self, id: &str) -> relaybus::Result<Option<Order>> {
        let found = self
            .db
            .collection::<Document>("orders")
            .find_one(doc! { "_id": id })
            .await?;
        Ok(found.map(|order| Order {
            id: id.to_owned(),
            customer: order.get_str("customer").unwrap_or_default().to_owned(),
            total_cents: order.get_i64("total_cents").unwrap_or_default(),
        }))
    }

    async fn add_to_totals(
        &self,
        session: &mut mongodb::ClientSession,
        customer: &str,
        cents: i64,
    ) -> relaybus::Result<()> {
        self.db
            .collection::<Document>("order_totals")
            .update_one(
                doc! { "_id": customer },
                doc! { "$inc": { "orders": 1_i64, "total_cents": cents } },
            )
            .upsert(true)
            .session(session)
            .await?;
        Ok(())
    }

    async fn stats(&self) -> relaybus::Result<Stats> {
        let orders = self
            .db
            .collection::<Document>("orders")
            .count_documents(doc! {})
            .await?;
        let totals: Vec<Document> = self
            .db
            .collection::<Document>("order_totals")
            .find(doc! {})
            .sort(doc! { "_id": 1 })
            .await?
            .try_collect()
            .await?;
        let customers = totals
            .iter()
            .map(|t| CustomerTotals {
                customer: t.get_str("_id").unwrap_or_default().to_owned(),
                orders: t.get_i64("orders").unwrap_or_default(),
                total_cents: t.get_i64("total_cents").unwrap_or_default(),
            })
            .collect();
        Ok(Stats { orders, customers })
    }
}

/// The orders in the in-memory store: collections `orders` and `order_totals`.
#[derive(Debug, Clone)]
pub(crate) struct MemoryOrders {
    pub(crate) store: MemoryEventStore,
}

impl Orders for MemoryOrders {
    type Store = MemoryEventStore;

    async fn insert(&self, session: &mut MemorySession, order: &Order) -> relaybus::Result<()> {
        session.insert("orders", &order.id, json!(order))
    }

    async fn find(&self, id: &str) -> relaybus::Result<Option<Order>> {
        Ok(self
            .store
            .document("orders", id)
            .and_then(|order| serde_json::from_value(order).ok()))
    }

    async fn add_to_totals(
        &self,
        session: &mut MemorySession,
        customer: &str,
        cents: i64,
    ) -> relaybus::Result<()> {
        let mut totals = match session.get("order_totals", customer)? {
            Some(found) => serde_json::from_value(found).map_err(relaybus::Error::custom)?,
            None => CustomerTotals {
                customer: customer.to_owned(),
                orders: 0,
                total_cents: 0,
            },
        };
        totals.orders += 1;
        totals.total_cents += cents;
        session.put("order_totals", customer, json!(totals))
    }

    async fn stats(&self) -> relaybus::Result<Stats> {
        let customers = self
            .store
            .documents("order_totals")
            .into_iter()
            .filter_map(|(_, totals)| serde_json::from_value(totals).ok())
            .collect();
        Ok(Stats {
            orders: self.store.count("orders") as u64,
            customers,
        })
    }
}

/// The orders in PostgreSQL: tables `orders` and `order_totals` of the shop's schema.
#[derive(Debug, Clone)]
pub(crate) struct PostgresOrders {
    pub(crate) pool: sqlx::PgPool,
    /// The schema of the shop's tables: a plain identifier, checked by [`PostgresOrders::new`].
    schema: String,
}

impl PostgresOrders {
    /// The shop's tables in `schema`, created if missing.
    pub(crate) async fn new(pool: sqlx::PgPool, schema: &str) -> relaybus::Result<Self> {
        if schema.is_empty()
            || schema.len() > 48
            || !schema
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
        {
            return Err(relaybus::Error::custom(format!(
                "shop schema {schema:?} is not usable; use 1 to 48 lowercase letters, digits and _"
            )));
        }
        let orders = PostgresOrders {
            pool,
            schema: schema.to_owned(),
        };
        // One statement at a time; an advisory lock keeps concurrent starts from racing.
        let mut tx = orders.pool.begin().await?;
        for statement in [
            "SELECT pg_advisory_xact_lock(hashtext('example-shop setup'))".to_owned(),
            format!("CREATE SCHEMA IF NOT EXISTS {schema}"),
            format!(
                "CREATE TABLE IF NOT EXISTS {schema}.orders (id text PRIMARY KEY, customer text \
                 NOT NULL, total_cents bigint NOT NULL, placed_at timestamptz NOT NULL DEFAULT now())"
            ),
            format!(
                "CREATE TABLE IF NOT EXISTS {schema}.order_totals (customer text PRIMARY KEY, \
                 orders bigint NOT NULL, total_cents bigint NOT NULL)"
            ),
        ] {
            sqlx::query(&statement).execute(&mut *tx).await?;
        }
        tx.commit().await?;
        Ok(orders)
    }
}

impl Orders for PostgresOrders {
    type Store = PostgresEventStore;

    async fn insert(&self, session: &mut PostgresSession, order: &Order) -> relaybus::Result<()> {
        sqlx::query(&format!(
            "INSERT INTO {}.orders (id, customer, total_cents) VALUES ($1, $2, $3)",
            self.schema
        ))
        .bind(&order.id)
        .bind(&order.customer)
        .bind(order.total_cents)
        .execute(&mut **session)
        .await?;
        Ok(())
    }

    async fn find(&self, id: &str) -> relaybus::Result<Option<Order>> {
        let found: Option<(String, i64)> = sqlx::query_as(&format!(
            "SELECT customer, total_cents FROM {}.orders WHERE id = $1",
            self.schema
        ))
        .bind(id)
        .fetch_optional(&self.pool)
        .await?;
        Ok(found.map(|(customer, total_cents)| Order {
            id: id.to_owned(),
            customer,
            total_cents,
        }))
    }

    async fn add_to_totals(
        &self,
        session: &mut PostgresSession,
        customer: &str,
        cents: i64,
    ) -> relaybus::Result<()> {
        sqlx::query(&format!(
            "INSERT INTO {}.order_totals (customer, orders, total_cents) VALUES ($1, 1, $2) \
             ON CONFLICT (customer) DO UPDATE SET orders = order_totals.orders + 1, \
             total_cents = order_totals.total_cents + EXCLUDED.total_cents",
            self.schema
        ))
        .bind(customer)
        .bind(cents)
        .execute(&mut **session)
        .await?;
        Ok(())
    }

    async fn stats(&self) -> relaybus::Result<Stats> {
        let orders: i64 =
            sqlx::query_scalar(&format!("SELECT count(*) FROM {}.orders", self.schema))
                .fetch_one(&self.pool)
                .await?;
        let totals: Vec<(String, i64, i64)> = sqlx::query_as(&format!(
            "SELECT customer, orders, total_cents FROM {}.order_totals ORDER BY customer",
            self.schema
        ))
        .fetch_all(&self.pool)
        .await?;
        Ok(Stats {
            orders: u64::try_from(orders).unwrap_or_default(),
            customers: totals
                .into_iter()
                .map(|(customer, orders, total_cents)| CustomerTotals {
                    customer,
                    orders,
                    total_cents,
                })
                .collect(),
        })
    }
}
