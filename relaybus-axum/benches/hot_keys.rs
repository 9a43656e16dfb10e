//! Hot keys through the request layer: how many requests that publish on the same ordering key
//! answer 201 rather than 503, and how long they take, with the layer's retries (the default)
//! next to the same router with retries turned off (`request_attempts(1)`), in the same run.
//!
//! Each request does what the shop example's `POST /orders` does: it inserts an order and
//! publishes an `order.placed.v1` event keyed by its customer, in the request's transaction.
//! Publishers of one key take the key's sequence counter, so their transactions conflict.
//!
//! Two loads, each on a fresh database:
//! - **burst**: 20 requests of one key at once, `RELAYBUS_BENCH_ROUNDS` times (default 5);
//! - **mixed**: 8 clients, each sending requests back to back over 12 keys (a key at random per
//!   request) for `RELAYBUS_BENCH_SECONDS` (default 10).
//!
//! Run with `cargo bench -p relaybus-axum --bench hot_keys`. It uses the replica set at
//! `RELAYBUS_BENCH_MONGODB_URI`, or starts a local one. Run by `cargo test` (without `--bench`),
//! it makes one short round as a smoke test.

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
use relaybus::{BoxError, Event, MongoEventStore, RelayBus, Subscription};
use relaybus_axum::{PublishError, Publisher, RelayState};
use serde::{Deserialize, Serialize};
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

/// The shop's `POST /orders/{customer}`: an order and its event, keyed by the customer.
async fn place_order(
    State(orders): State<Collection<Document>>,
    Path(customer): Path<String>,
    mut publisher: Publisher,
) -> Result<StatusCode, PublishError> {
    let order_id = mongodb::bson::oid::ObjectId::new().to_hex();
    orders
        .insert_one(doc! { "_id": &order_id, "customer": &customer, "total_cents": 1250 })
        .session(publisher.session())
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

/// A router on a fresh database, with the layer's retries or without.
async fn shop(client: &Client, name: &str, retries: bool) -> Result<Router, BoxError> {
    let db = client.database(name);
    db.drop().await?;
    let store = MongoEventStore::builder(client.clone())
        .database(name)
        .build()?;
    store.setup().await?;
    let bus = RelayBus::builder(store)
        .without_registered_handlers()
        .subscribe(Subscription::new("projector", |_: OrderPlaced| async {
            Ok::<(), BoxError>(())
        }))
        .build()?;
    let config = relaybus_axum::config(bus);
    let config = if retries {
        config
    } else {
        config.request_attempts(1)
    };
    let (relay, layer) = config.setup()?;
    let orders = db.collection::<Document>("orders");
    Ok(Router::new()
        .route("/orders/{customer}", post(place_order))
        .layer(layer)
        .with_state(Shop { relay, orders }))
}

/// The router's state.
#[derive(Clone)]
struct Shop {
    relay: RelayState,
    orders: Collection<Document>,
}

impl FromRef<Shop> for RelayState {
    fn from_ref(shop: &Shop) -> Self {
        shop.relay.clone()
    }
}

impl FromRef<Shop> for Collection<Document> {
    fn from_ref(shop: &Shop) -> Self {
        shop.orders.clone()
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
    for (subject, retries) in [("retries", true), ("no retry", false)] {
        let name = format!("{base}_{}", if retries { "r" } else { "n" });
        let router = shop(&client, &name, retries).await?;
        let mut bursts = Tally::default();
        for round in 0..rounds {
            bursts.merge(burst(&router, round).await?);
        }
        bursts.row("burst", subject);
        mixed(&router, length).await?.row("mixed", subject);
        client.database(&name).drop().await?;
    }
    Ok(())
}
