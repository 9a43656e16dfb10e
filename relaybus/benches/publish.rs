//! Publish throughput: events per second committed with their business documents, next to the
//! raw driver doing the same transaction with one plain outbox document per event.
//!
//! A third subject, the floor, is the raw driver writing what the store's document model needs
//! and nothing more: the event document, written by upsert so that an id is stored once, and one
//! delivery document in the deliveries collection with the indexes `setup()` creates. Relaybus
//! against the floor is the cost of the library's own work; the floor against the baseline is the
//! cost of the document model.
//!
//! Keyed, over 100 keys, three stores of the same database publish: as configured by default
//! (a delivery behind one of the same transaction is written parked), with
//! `park_behind_pending(true)` (also one behind a pending one written before, found by one read
//! in the transaction), and with parking off (`park_threshold(u32::MAX)`). The keyed rows set
//! the first two against the third.
//!
//! Run with `cargo bench -p relaybus --bench publish`. It uses the replica set at
//! `RELAYBUS_BENCH_MONGODB_URI`, or starts a local one. `RELAYBUS_BENCH_SECONDS` sets the length
//! of each measured run (default 2); `RELAYBUS_BENCH_ROUNDS` the number of alternating rounds
//! (default 3; the median is reported). Run by `cargo test` (without `--bench`), it makes one
//! short round as a smoke test.

use std::{
    sync::Arc,
    sync::atomic::{AtomicBool, AtomicU64, Ordering},
    time::{Duration, Instant},
};

use mongodb::{
    Client, Collection,
    bson::{Document, doc},
    options::{ReadConcern, TransactionOptions, WriteConcern},
};
use relaybus::{
    BoxError, Event, EventEnvelope, HandlerContext, MongoEventStore, RelayBus, Subscription,
};
use serde::{Deserialize, Serialize};

#[derive(Debug, Serialize, Deserialize)]
struct OrderPlaced {
    order_id: String,
    total_cents: u64,
}

impl Event for OrderPlaced {
    const TYPE: &'static str = "order.placed.v1";
}

#[derive(Clone, Copy, PartialEq)]
enum Subject {
    Relaybus,
    Baseline,
    Floor,
    /// Relaybus publishing events keyed over [`KEYS`] keys, as configured by default: a new
    /// delivery that waits behind one of the same transaction is written parked.
    Keyed,
    /// The same with `park_behind_pending(true)`: also a delivery that waits behind a pending
    /// one written before, found by one read in the transaction.
    KeyedLookup,
    /// The same with parking off (`park_threshold(u32::MAX)`): every delivery ready.
    KeyedUnparked,
}

/// The keys of the keyed subjects.
const KEYS: u64 = 100;

impl Subject {
    fn name(self) -> &'static str {
        match self {
            Subject::Relaybus => "relaybus",
            Subject::Baseline => "baseline",
            Subject::Floor => "floor",
            Subject::Keyed => "keyed",
            Subject::KeyedLookup => "keyed-lookup",
            Subject::KeyedUnparked => "keyed-unparked",
        }
    }
}

#[derive(Clone)]
struct Target {
    bus: RelayBus,
    /// A bus on a store of the same database that looks up what is pending.
    lookup_bus: RelayBus,
    /// A bus on a store of the same database with parking off.
    unparked_bus: RelayBus,
    client: Client,
    orders: Collection<Document>,
    outbox: Collection<Document>,
    events: Collection<Document>,
    deliveries: Collection<Document>,
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
    let seconds = if smoke {
        0
    } else {
        env_number("RELAYBUS_BENCH_SECONDS", 2)
    };
    let rounds = if smoke {
        1
    } else {
        env_number("RELAYBUS_BENCH_ROUNDS", 3).max(1)
    };
    let uri = relaybus_harness::shared_uri("RELAYBUS_BENCH_MONGODB_URI").await?;
    let client = Client::with_uri_str(&uri).await?;
    let db_name = format!("bench_publish_{}", std::process::id());
    let db = client.database(&db_name);
    db.drop().await?;
    let store = MongoEventStore::builder(client.clone())
        .database(&db_name)
        .build()?;
    store.setup().await?;
    db.create_collection("orders").await?;
    db.create_collection("outbox").await?;
    let events = db.collection(&store.collection_name("events"));
    let deliveries = db.collection(&store.collection_name("deliveries"));
    let lookup = MongoEventStore::builder(client.clone())
        .database(&db_name)
        .park_behind_pending(true)
        .build()?;
    let unparked = MongoEventStore::builder(client.clone())
        .database(&db_name)
        .park_threshold(u32::MAX)
        .build()?;
    let bus_of = |store: MongoEventStore| {
        RelayBus::builder(store)
            .subscribe(Subscription::new(
                "send-confirmation",
                |_: OrderPlaced, _: HandlerContext| async { Ok::<(), BoxError>(()) },
            ))
            .build()
    };
    let bus = bus_of(store)?;
    let lookup_bus = bus_of(lookup)?;
    let unparked_bus = bus_of(unparked)?;
    let target = Target {
        bus,
        lookup_bus,
        unparked_bus,
        client: client.clone(),
        orders: db.collection("orders"),
        outbox: db.collection("outbox"),
        events,
        deliveries,
    };

    println!(
        "publish benchmark: {seconds} s per run, {rounds} alternating rounds, median reported"
    );
    println!(
        "{:<10} {:>8} {:>10} {:>12} {:>12} {:>12} {:>7} {:>7}",
        "subject", "per tx", "publishers", "events/s", "baseline/s", "floor/s", "ratio", "floor"
    );
    let mut results = Vec::new();
    for per_tx in [1_usize, 100] {
        for publishers in [1_usize, 8] {
            let mut ours = Vec::new();
            let mut theirs = Vec::new();
            let mut floors = Vec::new();
            for _ in 0..rounds {
                theirs.push(run(&target, Subject::Baseline, per_tx, publishers, seconds).await?);
                ours.push(run(&target, Subject::Relaybus, per_tx, publishers, seconds).await?);
                floors.push(run(&target, Subject::Floor, per_tx, publishers, seconds).await?);
            }
            let figures = Figures {
                per_tx,
                publishers,
                ours: median(ours),
                theirs: median(theirs),
                floor: median(floors),
            };
            println!(
                "{:<10} {:>8} {:>10} {:>12.0} {:>12.0} {:>12.0} {:>7.2} {:>7.2}",
                Subject::Relaybus.name(),
                per_tx,
                publishers,
                figures.ours,
                figures.theirs,
                figures.floor,
                figures.ratio(),
                figures.floor_ratio(),
            );
            results.push(figures);
        }
    }
    // Keyed: as configured by default, and with the read that writes parked a delivery behind
    // a pending one, against parking off. Nothing consumes the deliveries, so after the first
    // events of a key every new one waits.
    println!(
        "{:<10} {:>8} {:>10} {:>12} {:>12} {:>12} {:>7} {:>7}",
        "keyed", "per tx", "publishers", "default/s", "lookup/s", "off/s", "default", "lookup"
    );
    let mut keyed = Vec::new();
    for per_tx in [1_usize, 100] {
        for publishers in [1_usize, 8] {
            let mut default = Vec::new();
            let mut lookup = Vec::new();
            let mut unparked = Vec::new();
            for _ in 0..rounds {
                unparked
                    .push(run(&target, Subject::KeyedUnparked, per_tx, publishers, seconds).await?);
                default.push(run(&target, Subject::Keyed, per_tx, publishers, seconds).await?);
                lookup.push(run(&target, Subject::KeyedLookup, per_tx, publishers, seconds).await?);
            }
            let (default, lookup, unparked) = (median(default), median(lookup), median(unparked));
            println!(
                "{:<10} {:>8} {:>10} {:>12.0} {:>12.0} {:>12.0} {:>7.2} {:>7.2}",
                "keyed",
                per_tx,
                publishers,
                default,
                lookup,
                unparked,
                default / unparked,
                lookup / unparked
            );
            keyed.push(serde_json::json!({
                "events_per_transaction": per_tx,
                "publishers": publishers,
                "keys": KEYS,
                "default_events_per_sec": default.round(),
                "park_behind_pending_events_per_sec": lookup.round(),
                "parking_off_events_per_sec": unparked.round(),
                "default_ratio": round3(default / unparked),
                "park_behind_pending_ratio": round3(lookup / unparked),
            }));
        }
    }
    db.drop().await?;

    let headline = results.iter().find(|r| r.per_tx == 1 && r.publishers == 8);
    let (ratio, floor_ratio) = headline
        .map(|r| (r.ratio(), r.floor_ratio()))
        .unwrap_or((f64::NAN, f64::NAN));
    let runs: Vec<serde_json::Value> = results
        .iter()
        .map(|r| {
            serde_json::json!({
                "events_per_transaction": r.per_tx,
                "publishers": r.publishers,
                "relaybus_events_per_sec": r.ours.round(),
                "baseline_events_per_sec": r.theirs.round(),
                "floor_events_per_sec": r.floor.round(),
                "ratio": round3(r.ratio()),
                "floor_ratio": round3(r.floor_ratio()),
            })
        })
        .collect();
    println!(
        "ratio (relaybus / baseline, 1 event per transaction, 8 publishers): {ratio:.3}; \
         the floor of the document model: {floor_ratio:.3}"
    );
    println!(
        "{}",
        serde_json::json!({
            "bench": "publish",
            "seconds_per_run": seconds,
            "rounds": rounds,
            "runs": runs,
            "keyed_runs": keyed,
            "floor_ratio": round3(floor_ratio),
            "ratio": round3(ratio),
        })
    );
    Ok(())
}

/// The medians of one configuration, in events per second.
struct Figures {
    per_tx: usize,
    publishers: usize,
    ours: f64,
    theirs: f64,
    floor: f64,
}

impl Figures {
    fn ratio(&self) -> f64 {
        self.ours / self.theirs
    }

    fn floor_ratio(&self) -> f64 {
        self.floor / self.theirs
    }
}

fn round3(value: f64) -> f64 {
    (value * 1000.0).round() / 1000.0
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(|a, b| a.total_cmp(b));
    values[values.len() / 2]
}

/// Runs `publishers` concurrent loops for `seconds` and returns committed events per second.
async fn run(
    target: &Target,
    subject: Subject,
    per_tx: usize,
    publishers: usize,
    seconds: u64,
) -> Result<f64, BoxError> {
    let stop = Arc::new(AtomicBool::new(false));
    let committed = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for publisher in 0..publishers {
        let target = target.clone();
        let stop = Arc::clone(&stop);
        let committed = Arc::clone(&committed);
        tasks.push(tokio::spawn(async move {
            let mut n = 0_u64;
            while !stop.load(Ordering::Relaxed) {
                n += 1;
                let prefix = format!("{}-{publisher}-{n}-{}", subject.name(), uuid_ish());
                match subject {
                    Subject::Relaybus => relaybus_tx(&target, &prefix, per_tx, None).await?,
                    Subject::Keyed | Subject::KeyedLookup | Subject::KeyedUnparked => {
                        let bus = match subject {
                            Subject::Keyed => &target.bus,
                            Subject::KeyedLookup => &target.lookup_bus,
                            _ => &target.unparked_bus,
                        };
                        let keyed = Keyed {
                            bus,
                            first: publisher as u64 * 37 + n,
                        };
                        relaybus_tx(&target, &prefix, per_tx, Some(keyed)).await?
                    }
                    Subject::Baseline => baseline_tx(&target, &prefix, per_tx).await?,
                    Subject::Floor => floor_tx(&target, &prefix, per_tx).await?,
                }
                committed.fetch_add(per_tx as u64, Ordering::Relaxed);
            }
            Ok::<(), BoxError>(())
        }));
    }
    let started = Instant::now();
    tokio::time::sleep(Duration::from_secs(seconds).max(Duration::from_millis(200))).await;
    stop.store(true, Ordering::Relaxed);
    let count_at_stop = committed.load(Ordering::Relaxed);
    let elapsed = started.elapsed();
    for task in tasks {
        task.await??;
    }
    Ok(count_at_stop as f64 / elapsed.as_secs_f64())
}

fn uuid_ish() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or_default()
}

fn orders_for(prefix: &str, per_tx: usize) -> Vec<Document> {
    (0..per_tx)
        .map(|i| doc! { "_id": format!("{prefix}-{i}"), "total_cents": 1250 })
        .collect()
}

/// How a keyed subject publishes: with which bus, its events keyed from `first` on.
struct Keyed<'a> {
    bus: &'a RelayBus,
    first: u64,
}

async fn relaybus_tx(
    target: &Target,
    prefix: &str,
    per_tx: usize,
    keyed: Option<Keyed<'_>>,
) -> Result<(), BoxError> {
    let orders = orders_for(prefix, per_tx);
    let envelopes = (0..per_tx)
        .map(|i| {
            let envelope = EventEnvelope::new(&OrderPlaced {
                order_id: format!("{prefix}-{i}"),
                total_cents: 1250,
            })?;
            match &keyed {
                Some(keyed) => {
                    envelope.with_key(format!("customer-{}", (keyed.first + i as u64) % KEYS))
                }
                None => Ok(envelope),
            }
        })
        .collect::<Result<Vec<_>, _>>()?;
    let bus = keyed.map_or(&target.bus, |keyed| keyed.bus);
    let body = {
        let (bus, collection) = (bus.clone(), target.orders.clone());
        async move |session: &mut mongodb::ClientSession| {
            collection
                .insert_many(orders.clone())
                .session(&mut *session)
                .await?;
            bus.publish_all(envelopes.clone()).session(session).await?;
            Ok(())
        }
    };
    bus.transaction(body).await?;
    Ok(())
}

/// The same transaction with the raw driver: the business documents plus one plain outbox
/// document per event.
async fn baseline_tx(target: &Target, prefix: &str, per_tx: usize) -> Result<(), BoxError> {
    let outbox: Vec<Document> = (0..per_tx)
        .map(|i| {
            doc! {
                "_id": mongodb::bson::oid::ObjectId::new(),
                "type": "order.placed.v1",
                "payload": { "order_id": format!("{prefix}-{i}"), "total_cents": 1250 },
                "createdAt": mongodb::bson::DateTime::now(),
            }
        })
        .collect();
    raw_transaction(
        target,
        vec![
            doc! { "insert": target.orders.name(), "documents": orders_for(prefix, per_tx) },
            doc! { "insert": target.outbox.name(), "documents": outbox },
        ],
    )
    .await
}

/// The floor: the same transaction with the raw driver writing what the store's document model
/// needs, the event documents by upsert (in one command) and one delivery document per event, with
/// none of the store's reads, checks or sequence counters.
async fn floor_tx(target: &Target, prefix: &str, per_tx: usize) -> Result<(), BoxError> {
    let now = mongodb::bson::DateTime::now();
    let event_id = |i: usize| format!("{prefix}-{i}-event");
    let upserts: Vec<Document> = (0..per_tx)
        .map(|i| {
            doc! {
                "q": { "_id": event_id(i) },
                "u": { "$setOnInsert": {
                    "type": "order.placed.v1",
                    "payload": { "order_id": format!("{prefix}-{i}"), "total_cents": 1250 },
                    "handlers": ["send-confirmation"],
                    "createdAt": now,
                } },
                "upsert": true,
            }
        })
        .collect();
    let deliveries: Vec<Document> = (0..per_tx)
        .map(|i| {
            doc! {
                "_id": mongodb::bson::oid::ObjectId::new(),
                "eventId": event_id(i),
                "handler": "send-confirmation",
                "eventType": "order.placed.v1",
                "laneId": (i % 256) as i32,
                "lane": "ready",
                "status": "pending",
                "attempts": 0,
                "dueAt": now,
                "createdAt": now,
            }
        })
        .collect();
    raw_transaction(
        target,
        vec![
            doc! { "insert": target.orders.name(), "documents": orders_for(prefix, per_tx) },
            doc! { "update": target.events.name(), "updates": upserts },
            doc! { "insert": target.deliveries.name(), "documents": deliveries },
        ],
    )
    .await
}

/// Runs `commands` one after the other in one transaction of the raw driver, with the options
/// relaybus uses (snapshot reads, majority commit), the whole transaction run again on a
/// transient error.
async fn raw_transaction(target: &Target, commands: Vec<Document>) -> Result<(), BoxError> {
    let db = target.client.database(&target.orders.namespace().db);
    let mut session = target.client.start_session().await?;
    let options = TransactionOptions::builder()
        .read_concern(ReadConcern::snapshot())
        .write_concern(WriteConcern::majority())
        .build();
    session
        .start_transaction()
        .with_options(options)
        .and_run2(async move |session| {
            for command in &commands {
                let reply = db
                    .run_command(command.clone())
                    .session(&mut *session)
                    .await?;
                if let Ok(errors) = reply.get_array("writeErrors") {
                    return Err(mongodb::error::Error::custom(format!("{errors:?}")));
                }
            }
            Ok(())
        })
        .await?;
    Ok(())
}
