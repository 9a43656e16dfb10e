//! Hot keys through the request layer: how many requests that publish on the same ordering key
//! answer 201 rather than 503, and how long they take, on MongoDB with the layer's retries (the
//! default) and with retries turned off (`request_attempts(1)`), and on PostgreSQL with the
//! default retries, in the same run.
//!
//! Each request does what the shop example's `POST /orders` does: it inserts an order and
//! publishes an `order.placed.v1` event keyed by its customer, in the request's transaction.
//! Publishers of one key take the key's sequence counter: on PostgreSQL they wait for its row
//! lock, on MongoDB they queue for the key in the process before they write it.
//!
//! Two loads, each on a fresh database (or schema):
//! - **burst**: 20 requests of one key at once, `RELAYBUS_BENCH_ROUNDS` times (default 5);
//! - **mixed**: 8 clients, each sending requests back to back over 12 keys (a key at random per
//!   request) for `RELAYBUS_BENCH_SECONDS` (default 10).
//!
//! The last line is the mixed load's requests per second on MongoDB as a share of PostgreSQL's.
//!
//! Run with `cargo bench -p relaybus-axum --bench hot_keys`. It uses the replica set at
//! `RELAYBUS_BENCH_MONGODB_URI`, or starts a local one, and the PostgreSQL server at
//! `RELAYBUS_TEST_POSTGRES_URL` (default `postgres://postgres@127.0.0.1:5432/test`). Run by
//! `cargo test` (without `--bench`), it makes one short round as a smoke test.

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use axum::{
    Router,
    body::Body,
    extract::{FromRef, Path, State},
    http::{Request, StatusCode},
    routing::post,
};
use mongodb::{
    Client, Collection,
    bson::{Document, doc},
};
use relaybus::{
    BoxError, Event, MongoEventStore, PostgresEventStore, PostgresSession, RelayBus, Store,
    Subscription,
};
use relaybus_axum::{PublishError, Publisher, RelayState, rejection::PublisherRejection};
use serde::{Deserialize, Serialize};
use sqlx::PgPool;
use tokio::sync::Barrier;
use tower::ServiceExt;

#[derive(Debug, Serialize, Deserialize)]
struct OrderPlaced {
    order_id: String,
    customer: String,
}

impl Event for OrderPlaced {
    const TYPE: &'static str = "order.placed.v1";
}

/// Where a store's orders go, written in the request's transaction.
trait Orders: Clone + Send + Sync + 'static {
    type Store: Store;

    fn insert(
        &self,
        session: &mut <Self::Store as relaybus::store::Transactions>::Session,
        id: &str,
        customer: &str,
    ) -> impl Future<Output = relaybus::Result<()>> + Send;
}

impl Orders for Collection<Document> {
    type Store = MongoEventStore;

    async fn insert(
        &self,
        session: &mut mongodb::ClientSession,
        id: &str,
        customer: &str,
    ) -> relaybus::Result<()> {
        self.insert_one(doc! { "_id": id, "customer": customer, "total_cents": 1250 })
            .session(session)
            .await?;
        Ok(())
    }
}

/// The orders table of a PostgreSQL schema.
#[derive(Clone)]
struct Table(String);

impl Orders for Table {
    type Store = PostgresEventStore;

    async fn insert(
        &self,
        session: &mut PostgresSession,
        id: &str,
        customer: &str,
    ) -> relaybus::Result<()> {
        sqlx::query(&format!(
            "INSERT INTO {}.orders (id, customer, total_cents) VALUES ($1, $2, 1250)",
            self.0
        ))
        .bind(id)
        .bind(customer)
        .execute(&mut **session)
        .await?;
        Ok(())
    }
}

/// The shop's `POST /orders/{customer}`: an order and its event, keyed by the customer.
async fn place_order<O: Orders>(
    State(Shop { orders, .. }): State<Shop<O>>,
    Path(customer): Path<String>,
    mut publisher: Publisher<PublisherRejection, O::Store>,
) -> Result<StatusCode, PublishError> {
    let order_id = mongodb::bson::oid::ObjectId::new().to_hex();
    orders
        .insert(publisher.session(), &order_id, &customer)
        .await?;
    publisher
        .publish(&OrderPlaced {
            order_id,
            customer: customer.clone(),
        })
        .key(customer)
        .await?;
    Ok(StatusCode::CREATED)
}

/// What one load gave.
#[derive(Default)]
struct Tally {
    created: usize,
    unavailable: usize,
    other: usize,
    latencies: Vec<Duration>,
    elapsed: Duration,
}

impl Tally {
    fn add(&mut self, status: StatusCode, latency: Duration) {
        match status {
            StatusCode::CREATED => self.created += 1,
            StatusCode::SERVICE_UNAVAILABLE => self.unavailable += 1,
            _ => self.other += 1,
        }
        self.latencies.push(latency);
    }

    fn merge(&mut self, other: Tally) {
        self.created += other.created;
        self.unavailable += other.unavailable;
        self.other += other.other;
        self.latencies.extend(other.latencies);
        self.elapsed += other.elapsed;
    }

    fn percentile(&mut self, p: f64) -> Duration {
        self.latencies.sort_unstable();
        if self.latencies.is_empty() {
            return Duration::ZERO;
        }
        let at = ((self.latencies.len() - 1) as f64 * p).round() as usize;
        self.latencies[at]
    }

    fn row(&mut self, load: &str, subject: &str) {
        let total = self.created + self.unavailable + self.other;
        let (p50, p99) = (self.percentile(0.5), self.percentile(0.99));
        println!(
            "{load:<6} {subject:<10} {total:>7} {:>7} {:>7} {:>6} {:>8.2}% {:>9.1} {:>9.1} {:>9.0}",
            self.created,
            self.unavailable,
            self.other,
            100.0 * self.unavailable as f64 / total.max(1) as f64,
            p50.as_secs_f64() * 1e3,
            p99.as_secs_f64() * 1e3,
            total as f64 / self.elapsed.as_secs_f64().max(1e-9),
        );
    }
}

/// The router of `bus`, with the layer's retries or without.
fn shop<O: Orders>(bus: RelayBus<O::Store>, orders: O, retries: bool) -> Result<Router, BoxError> {
    let config = relaybus_axum::config(bus);
    let config = if retries {
        config
    } else {
        config.request_attempts(1)
    };
    let (relay, layer) = config.setup()?;
    Ok(Router::new()
        .route("/orders/{customer}", post(place_order::<O>))
        .layer(layer)
        .with_state(Shop { relay, orders }))
}

/// The bus of the shop on `store`, with one handler.
fn bus<S: Store>(store: S) -> Result<RelayBus<S>, BoxError> {
    Ok(RelayBus::builder(store)
        .without_registered_handlers()
        .subscribe(Subscription::new("projector", |_: OrderPlaced| async {
            Ok::<(), BoxError>(())
        }))
        .build()?)
}

/// The shop on a fresh MongoDB database.
async fn mongo_shop(client: &Client, name: &str, retries: bool) -> Result<Router, BoxError> {
    let db = client.database(name);
    db.drop().await?;
    let store = MongoEventStore::builder(client.clone())
        .database(name)
        .build()?;
    store.setup().await?;
    shop(bus(store)?, db.collection::<Document>("orders"), retries)
}

/// The shop in fresh PostgreSQL schemas: `<name>` for the events, `<name>_shop` for the orders.
async fn postgres_shop(pool: &PgPool, name: &str) -> Result<Router, BoxError> {
    let orders = format!("{name}_shop");
    for schema in [name, orders.as_str()] {
        sqlx::query(&format!("DROP SCHEMA IF EXISTS {schema} CASCADE"))
            .execute(pool)
            .await?;
    }
    sqlx::query(&format!("CREATE SCHEMA {orders}"))
        .execute(pool)
        .await?;
    sqlx::query(&format!(
        "CREATE TABLE {orders}.orders (id text PRIMARY KEY, customer text NOT NULL, \
         total_cents bigint NOT NULL)"
    ))
    .execute(pool)
    .await?;
    let store = PostgresEventStore::builder(pool.clone())
        .schema(name)
        .build()?;
    store.setup().await?;
    shop(bus(store)?, Table(orders), true)
}

async fn drop_postgres(pool: &PgPool, name: &str) -> Result<(), BoxError> {
    for schema in [name.to_owned(), format!("{name}_shop")] {
        sqlx::query(&format!("DROP SCHEMA IF EXISTS {schema} CASCADE"))
            .execute(pool)
            .await?;
    }
    Ok(())
}

/// The router's state.
#[derive(Clone)]
struct Shop<O: Orders> {
    relay: RelayState<O::Store>,
    orders: O,
}

impl<O: Orders> FromRef<Shop<O>> for RelayState<O::Store> {
    fn from_ref(shop: &Shop<O>) -> Self {
        shop.relay.clone()
    }
}

async fn send(router: &Router, customer: &str) -> Result<(StatusCode, Duration), BoxError> {
    let request = Request::post(format!("/orders/{customer}")).body(Body::empty())?;
    let started = Instant::now();
    let response = router.clone().oneshot(request).await?;
    Ok((response.status(), started.elapsed()))
}

/// 20 requests of one key at once.
async fn burst(router: &Router, round: usize) -> Result<Tally, BoxError> {
    let barrier = Arc::new(Barrier::new(20));
    let started = Instant::now();
    let tasks: Vec<_> = (0..20)
        .map(|_| {
            let (router, barrier) = (router.clone(), Arc::clone(&barrier));
            let key = format!("hot-{round}");
            tokio::spawn(async move {
                barrier.wait().await;
                send(&router, &key).await
            })
        })
        .collect();
    let mut tally = Tally::default();
    for task in tasks {
        let (status, latency) = task.await??;
        tally.add(status, latency);
    }
    tally.elapsed = started.elapsed();
    Ok(tally)
}

/// 8 clients over 12 keys for `length`.
async fn mixed(router: &Router, length: Duration) -> Result<Tally, BoxError> {
    let started = Instant::now();
    let tasks: Vec<_> = (0..8)
        .map(|client| {
            let router = router.clone();
            tokio::spawn(async move {
                let mut tally = Tally::default();
                let mut n = client;
                while started.elapsed() < length || tally.latencies.is_empty() {
                    // A cheap spread of keys: each client walks them in its own stride.
                    n = (n * 7 + 5) % 12;
                    let (status, latency) = send(&router, &format!("customer-{n}")).await?;
                    tally.add(status, latency);
                }
                Ok::<_, BoxError>(tally)
            })
        })
        .collect();
    let mut tally = Tally::default();
    for task in tasks {
        tally.merge(task.await??);
    }
    tally.elapsed = started.elapsed();
    Ok(tally)
}

fn env_number(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let smoke = !std::env::args().any(|arg| arg == "--bench");
    let rounds = if smoke {
        1
    } else {
        env_number("RELAYBUS_BENCH_ROUNDS", 5).max(1) as usize
    };
    let length = Duration::from_secs(if smoke {
        1
    } else {
        env_number("RELAYBUS_BENCH_SECONDS", 10)
    });
    let uri = relaybus_harness::shared_uri("RELAYBUS_BENCH_MONGODB_URI").await?;
    let client = Client::with_uri_str(&uri).await?;
    let base = format!("bench_hot_keys_{}", std::process::id());

    println!(
        "hot keys: burst = 20 requests of one key at once, {rounds} rounds; mixed = 8 clients \
         over 12 keys for {length:?}"
    );
    println!(
        "{:<6} {:<10} {:>7} {:>7} {:>7} {:>6} {:>9} {:>9} {:>9} {:>9}",
        "load", "subject", "sent", "201", "503", "other", "503 %", "p50 ms", "p99 ms", "req/s"
    );
    let mut mixed_rates = Vec::new();
    for (subject, retries) in [("mongodb", true), ("mongodb 1x", false)] {
        let name = format!("{base}_{}", if retries { "r" } else { "n" });
        let router = mongo_shop(&client, &name, retries).await?;
        let rate = run_loads(&router, subject, rounds, length).await?;
        if retries {
            mixed_rates.push(rate);
        }
        client.database(&name).drop().await?;
    }
    let url = std::env::var("RELAYBUS_TEST_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned());
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(20)
        .connect(&url)
        .await?;
    let router = postgres_shop(&pool, &base).await?;
    mixed_rates.push(run_loads(&router, "postgres", rounds, length).await?);
    drop_postgres(&pool, &base).await?;
    println!(
        "mixed requests/s, MongoDB / PostgreSQL: {:.2}",
        mixed_rates[0] / mixed_rates[1].max(1e-9)
    );
    Ok(())
}

/// The burst rounds and the mixed load on `router`, a row each; returns the mixed load's
/// requests per second.
async fn run_loads(
    router: &Router,
    subject: &str,
    rounds: usize,
    length: Duration,
) -> Result<f64, BoxError> {
    let mut bursts = Tally::default();
    for round in 0..rounds {
        bursts.merge(burst(router, round).await?);
    }
    bursts.row("burst", subject);
    let mut mixed = mixed(router, length).await?;
    mixed.row("mixed", subject);
    let total = mixed.created + mixed.unavailable + mixed.other;
    Ok(total as f64 / mixed.elapsed.as_secs_f64().max(1e-9))
}
