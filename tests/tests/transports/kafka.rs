//! The Kafka transport against a real broker (Tansu, a Kafka-compatible broker): two
//! services, each with its own store, the first relaying its events to a topic, the second
//! appending them to its store with each partition's offset kept in that store.
//!
//! The broker comes from `RELAYBUS_TEST_KAFKA_URL` (`host:port`, default `127.0.0.1:19092`,
//! what `scripts/kafka start` runs; `scripts/test` starts a private one). Each test makes its
//! own topics, named after the test, the process and a random part. The test of a lost
//! connection starts a broker of its own, which it pauses.

use std::{
    collections::{BTreeMap, HashMap, HashSet},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use relaybus::store::prelude::*;
use relaybus::{
    BoxError, Error, Event, EventEnvelope, HandlerContext, MemoryEventStore, MemorySession,
    RelayBus, Store, Subscription, Timestamp,
    clock::TestClock,
    store::PositionKey,
    transport::BatchReport,
    transport::kafka::{
        DEAD_LETTER_REASON_HEADER, DEAD_LETTER_SOURCE_HEADER, KafkaConsumer, KafkaError,
        KafkaRelay,
        rskafka::{
            self,
            client::{
                Client, ClientBuilder,
                partition::{Compression, UnknownTopicHandling},
            },
            record::{Record, RecordAndOffset},
        },
    },
};
use relaybus_tests::consumer_crash::{self, ConsumerCrash};
use serde::{Deserialize, Serialize};
use serde_json::json;
use tokio_util::sync::CancellationToken;

mod share;

const DEFAULT_KAFKA_URL: &str = "127.0.0.1:19092";

#[derive(Debug, Clone, Serialize, Deserialize)]
struct OrderPlaced {
    order_id: String,
    n: u32,
}

impl Event for OrderPlaced {
    const TYPE: &'static str = "transport-test.order-placed.v1";
}

fn placed(order_id: &str, n: u32) -> OrderPlaced {
    OrderPlaced {
        order_id: order_id.to_owned(),
        n,
    }
}

fn broker_url() -> String {
    std::env::var("RELAYBUS_TEST_KAFKA_URL").unwrap_or_else(|_| DEFAULT_KAFKA_URL.to_owned())
}

/// Connects to the broker at `url`, or fails saying how to get one.
async fn connect_to(url: &str) -> Arc<Client> {
    let connecting = ClientBuilder::new(vec![url.to_owned()]).build();
    match tokio::time::timeout(Duration::from_secs(10), connecting).await {
        Ok(Ok(client)) => Arc::new(client),
        Ok(Err(error)) => panic!(
            "no Kafka broker answers at {url} ({error}): start one with `scripts/kafka start`, \
             or set RELAYBUS_TEST_KAFKA_URL to the host:port of one"
        ),
        Err(_) => panic!(
            "the Kafka broker at {url} did not answer within 10 s: start one with \
             `scripts/kafka start`, or set RELAYBUS_TEST_KAFKA_URL to the host:port of one"
        ),
    }
}

/// A test's own topic and dead-letter topic.
struct Topics {
    client: Arc<Client>,
    topic: String,
    dead: String,
    partitions: u32,
}

impl Topics {
    async fn new(test: &str, partitions: u32) -> Topics {
        Topics::on(connect_to(&broker_url()).await, test, partitions).await
    }

    async fn on(client: Arc<Client>, test: &str, partitions: u32) -> Topics {
        let unique = format!("{}-{:08x}", std::process::id(), rand::random::<u32>());
        let topics = Topics {
            topic: format!("relaybus-test.{test}.{unique}"),
            dead: format!("relaybus-test-dead.{test}.{unique}"),
            partitions,
            client,
        };
        topics
            .relay()
            .create_topic(1)
            .await
            .expect("create the topic");
        topics
            .consumer("setup")
            .create_dead_letter_topic(1)
            .await
            .expect("create the dead-letter topic");
        topics
    }

    fn relay(&self) -> KafkaRelay {
        KafkaRelay::builder(Arc::clone(&self.client), &self.topic)
            .partitions(self.partitions)
            .produce_timeout(Duration::from_secs(2))
            .build()
            .expect("valid relay settings")
    }

    fn consumer(&self, name: &str) -> KafkaConsumer {
        KafkaConsumer::builder(Arc::clone(&self.client), &self.topic, name)
            .batch_records(16)
            .fetch_wait(Duration::from_millis(100))
            .fetch_timeout(Duration::from_secs(2))
            .retry_delay(Duration::from_millis(100))
            .dead_letter_topic(&self.dead)
            .build()
            .expect("valid consumer settings")
    }

    /// Every record of a partition of `topic`, read from offset 0 until `count` came.
    async fn records(&self, topic: &str, partition: i32, count: usize) -> Vec<RecordAndOffset> {
        let client = self
            .client
            .partition_client(topic, partition, UnknownTopicHandling::Error)
            .await
            .expect("partition client");
        let mut records: Vec<RecordAndOffset> = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(30);
        while records.len() < count {
            assert!(
                Instant::now() < deadline,
                "{topic}/{partition}: {} of {count} records",
                records.len()
            );
            let next = records.last().map_or(0, |r| r.offset + 1);
            let (fetched, _) = client
                .fetch_records(next, 1..1_000_000, 200)
                .await
                .expect("fetch");
            records.extend(fetched.into_iter().filter(|r| r.offset >= next));
        }
        records
    }
}

/// What the consuming service's handler saw of one event.
#[derive(Debug, Clone, PartialEq)]
struct Seen {
    event_id: String,
    key: Option<String>,
    n: u32,
    headers: BTreeMap<String, String>,
}

type Log = Arc<Mutex<Vec<Seen>>>;

/// The consuming service's handler: records every run.
fn recorder<S: Store>(log: &Log) -> Subscription {
    let log = Arc::clone(log);
    Subscription::new(
        "ship",
        move |event: OrderPlaced, context: HandlerContext<S>| {
            let log = Arc::clone(&log);
            async move {
                log.lock().unwrap().push(Seen {
                    event_id: context.event_id().to_owned(),
                    key: context.key().map(str::to_owned),
                    n: event.n,
                    headers: context.headers().clone(),
                });
                Ok::<(), BoxError>(())
            }
        },
    )
}

/// The publishing service on the memory store, with the relay subscribed.
fn shop(relay: &KafkaRelay) -> (MemoryEventStore, RelayBus<MemoryEventStore>) {
    let store = MemoryEventStore::new();
    let bus = RelayBus::builder(store.clone())
        .clock(TestClock::new(Timestamp::now()))
        .without_registered_handlers()
        .subscribe(
            relay
                .subscription::<OrderPlaced, MemoryEventStore>()
                .expect("relay subscription"),
        )
        .build()
        .expect("shop bus");
    (store, bus)
}

/// The consuming service's bus on `store`, with the recorder.
fn shipping<S: Store>(store: S, log: &Log) -> RelayBus<S> {
    RelayBus::builder(store)
        .without_registered_handlers()
        .subscribe(recorder::<S>(log))
        .build()
        .expect("shipping bus")
}

/// Polls the consumer's partitions until it has taken `count` records in all; fails after
/// 30 s.
async fn consume<S: Store>(
    consumer: &KafkaConsumer,
    bus: &RelayBus<S>,
    count: usize,
) -> BatchReport {
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut total = BatchReport::default();
    while total.fetched < count {
        assert!(
            Instant::now() < deadline,
            "the consumer took {} of {count} records in 30 s: {total:?}",
            total.fetched
        );
        for partition in consumer.discover_partitions().await.expect("partitions") {
            let report = consumer
                .poll(bus, partition)
                .await
                .expect("consume a batch");
            total.fetched += report.fetched;
            total.appended += report.appended;
            total.duplicates += report.duplicates;
            total.dead_lettered += report.dead_lettered;
            total.discarded += report.discarded;
        }
    }
    total
}

/// The stored positions of the consumer's partitions of `topics`, added up; asks the store only.
async fn positions<S: Store>(topics: &Topics, consumer: &KafkaConsumer, bus: &RelayBus<S>) -> i64 {
    let mut sum = 0;
    for partition in 0..topics.partitions {
        sum += consumer
            .position(bus, partition)
            .await
            .expect("position")
            .unwrap_or(0);
    }
    sum
}

/// Polls `done` until it holds; fails after 60 s with `what`.
async fn wait_until<F: AsyncFnMut() -> bool>(what: &str, done: F) {
    wait_until_every(what, Duration::from_millis(20), done).await;
}

/// [`wait_until`], looking every `every`.
async fn wait_until_every<F: AsyncFnMut() -> bool>(what: &str, every: Duration, mut done: F) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !done().await {
        assert!(
            Instant::now() < deadline,
            "{what} did not happen within 60 s"
        );
        tokio::time::sleep(every).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_crosses_from_one_store_to_another() {
    let topics = Topics::new("end-to-end", 1).await;
    let relay = topics.relay();
    let (shop_store, shop_bus) = shop(&relay);

    let appended = shop_bus
        .transaction(async |session: &mut MemorySession| {
            session.insert("orders", "o-1", json!({ "total_cents": 1250 }))?;
            shop_bus
                .publish(&placed("o-1", 1))
                .key("o-1")
                .correlation_id("req-42")
                .causation_id("cmd-7")
                .header("tenant", "acme")
                .header("odd: name", "with\nline break")
                .session(session)
                .await
        })
        .await
        .expect("publish in the shop's transaction");
    let relayed = shop_bus.run_until_idle().await.expect("relay");
    assert_eq!(relayed.succeeded().count(), 1, "{relayed:?}");
    assert_eq!(relay.statistics().published, 1);

    // The record: key = the ordering key, value = the envelope, headers for tools.
    let records = topics.records(&topics.topic, 0, 1).await;
    assert_eq!(records[0].record.key.as_deref(), Some(&b"o-1"[..]));
    assert_eq!(
        records[0].record.headers["relaybus-event-id"],
        appended.event_id.as_bytes()
    );

    let log = Log::default();
    let shipping_store = MemoryEventStore::new();
    let shipping_bus = shipping(shipping_store.clone(), &log);
    let consumer = topics.consumer("shipping");
    let report = consume(&consumer, &shipping_bus, 1).await;
    assert_eq!(
        (report.appended, report.duplicates, report.dead_lettered),
        (1, 0, 0)
    );
    assert_eq!(consumer.position(&shipping_bus, 0).await.unwrap(), Some(1));

    let handled = shipping_bus.run_until_idle().await.expect("handle");
    assert_eq!(handled.succeeded().count(), 1, "{handled:?}");
    let seen = log.lock().unwrap().clone();
    assert_eq!(
        seen,
        [Seen {
            event_id: appended.event_id.clone(),
            key: Some("o-1".to_owned()),
            n: 1,
            headers: BTreeMap::from([
                ("odd: name".to_owned(), "with\nline break".to_owned()),
                ("tenant".to_owned(), "acme".to_owned()),
            ]),
        }]
    );
    let sent = shop_store
        .event_detail(&appended.event_id)
        .await
        .unwrap()
        .unwrap();
    let received = shipping_store
        .event_detail(&appended.event_id)
        .await
        .unwrap()
        .expect("the event is in the consuming store under its id");
    assert_eq!(received.event, sent.event);

    // Nothing more to take: the next poll fetches nothing and keeps the position.
    let report = consumer.poll(&shipping_bus, 0).await.expect("poll");
    assert_eq!((report.fetched, report.next_offset), (0, None));
    assert_eq!(consumer.position(&shipping_bus, 0).await.unwrap(), Some(1));
}

/// The production shape: the shop publishes in its MongoDB transaction, the event crosses
/// the broker, and the shipping service appends it to its PostgreSQL store with the offset.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_crosses_from_mongodb_to_postgresql() {
    use mongodb::bson::{Document, doc};
    use relaybus::{MongoEventStore, PostgresEventStore};

    let topics = Topics::new("mongo-to-postgres", 2).await;
    let relay = topics.relay();
    let db = relaybus_harness::test_db("kafka_mongo_to_pg").await;
    let shop_store = MongoEventStore::builder(db.client.clone())
        .database(&db.name)
        .build()
        .expect("valid options");
    shop_store.setup().await.expect("setup");
    let shop_bus = RelayBus::builder(shop_store)
        .without_registered_handlers()
        .subscribe(
            relay
                .subscription::<OrderPlaced, MongoEventStore>()
                .expect("relay subscription"),
        )
        .build()
        .expect("shop bus");
    let orders = db.db().collection::<Document>("orders");
    let appended = shop_bus
        .transaction(async |session| {
            orders
                .insert_one(doc! { "_id": "o-9", "total_cents": 990 })
                .session(&mut *session)
                .await?;
            shop_bus
                .publish(&placed("o-9", 9))
                .key("o-9")
                .session(session)
                .await
        })
        .await
        .expect("publish in the shop's MongoDB transaction");
    let relayed = shop_bus.run_until_idle().await.expect("relay");
    assert_eq!(relayed.succeeded().count(), 1, "{relayed:?}");

    let url = std::env::var("RELAYBUS_TEST_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned());
    let pool = sqlx::PgPool::connect(&url).await.unwrap_or_else(|error| {
        panic!("no PostgreSQL at {url} ({error}); set RELAYBUS_TEST_POSTGRES_URL to one")
    });
    let schema = format!(
        "kafka_shipping_{}_{:08x}",
        std::process::id(),
        rand::random::<u32>()
    );
    let shipping_store = PostgresEventStore::builder(pool.clone())
        .schema(schema.clone())
        .build()
        .expect("valid schema");
    shipping_store.setup().await.expect("setup");
    let log = Log::default();
    let shipping_bus = shipping(shipping_store.clone(), &log);
    let consumer = topics.consumer("shipping");
    let report = consume(&consumer, &shipping_bus, 1).await;
    assert_eq!((report.appended, report.duplicates), (1, 0));
    let handled = shipping_bus.run_until_idle().await.expect("handle");
    assert_eq!(handled.succeeded().count(), 1, "{handled:?}");
    let seen = log.lock().unwrap().clone();
    assert_eq!(
        (
            seen.len(),
            seen[0].event_id.as_str(),
            seen[0].key.as_deref(),
            seen[0].n
        ),
        (1, appended.event_id.as_str(), Some("o-9"), 9)
    );
    // The offset is a row of the store, written with the event.
    let partition = relay.partition_of(
        &shipping_store
            .event_detail(&appended.event_id)
            .await
            .unwrap()
            .unwrap()
            .event,
    );
    let (next,): (i64,) = sqlx::query_as(&format!(
        "SELECT next_offset FROM {schema}.consumer_positions \
         WHERE consumer = 'shipping' AND source = $1 AND partition = $2"
    ))
    .bind(&topics.topic)
    .bind(i32::try_from(partition).unwrap())
    .fetch_one(&pool)
    .await
    .expect("the partition's position is stored");
    assert_eq!(next, 1);
    sqlx::query(&format!("DROP SCHEMA {schema} CASCADE"))
        .execute(&pool)
        .await
        .expect("drop the test's schema");
}

/// Publishes `count` events over `keys` keys, `n` counting up within each key, and relays
/// them.
async fn publish_and_relay(bus: &RelayBus<MemoryEventStore>, keys: u32, count: u32) -> Vec<String> {
    let mut ids = Vec::new();
    for i in 0..count {
        let key = format!("o-{}", i % keys);
        let appended = bus
            .publish(&placed(&key, i / keys))
            .key(key.clone())
            .await
            .expect("publish");
        ids.push(appended.event_id);
    }
    let relayed = bus.run_until_idle().await.expect("relay");
    assert_eq!(relayed.succeeded().count(), count as usize, "{relayed:?}");
    ids
}

/// A consumer stopped anywhere (while fetching, appending, committing, or right after a
/// commit) goes on from its stored offset: one local effect per event. A second consumer
/// (another name, so no stored position) reads every record again into the same store and
/// appends nothing new.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_stopped_anywhere_resumes_with_one_effect_per_event() {
    let topics = Topics::new("kill-consumer", 3).await;
    let relay = topics.relay();
    let (_, shop_bus) = shop(&relay);
    let ids = publish_and_relay(&shop_bus, 7, 90).await;

    let log = Log::default();
    let shipping_bus = shipping(MemoryEventStore::new(), &log);
    let consumer = KafkaConsumer::builder(Arc::clone(&topics.client), &topics.topic, "shipping")
        .batch_records(4)
        .fetch_wait(Duration::from_millis(50))
        .retry_delay(Duration::from_millis(20))
        .build()
        .unwrap();
    let (mut kills, mut stopped_midway) = (0, 0);
    while positions(&topics, &consumer, &shipping_bus).await < 90 {
        let before = positions(&topics, &consumer, &shipping_bus).await;
        let running = tokio::spawn({
            let consumer = consumer.clone();
            let bus = shipping_bus.clone();
            async move { consumer.run(&bus, CancellationToken::new()).await }
        });
        // Kill it as soon as a commit moved a position: the next batch is then anywhere
        // between its fetch and its commit. Looked at every millisecond: a consumer left
        // alone for longer may commit every batch before it is stopped a second time.
        wait_until_every("a commit", Duration::from_millis(1), async || {
            positions(&topics, &consumer, &shipping_bus).await > before
        })
        .await;
        running.abort();
        let _ = running.await;
        kills += 1;
        if positions(&topics, &consumer, &shipping_bus).await < 90 {
            stopped_midway += 1;
        }
    }
    assert!(
        stopped_midway >= 1,
        "the consumer was stopped {kills} times, never before the last record"
    );
    shipping_bus.run_until_idle().await.expect("handle");
    let seen = log.lock().unwrap().clone();
    let seen_ids: HashSet<&str> = seen.iter().map(|s| s.event_id.as_str()).collect();
    assert_eq!(seen.len(), 90, "one local effect per event");
    assert_eq!(seen_ids, ids.iter().map(String::as_str).collect());

    // Records read again into the same store append nothing new.
    let again = KafkaConsumer::builder(Arc::clone(&topics.client), &topics.topic, "audit")
        .build()
        .unwrap();
    let report = consume(&again, &shipping_bus, 90).await;
    assert_eq!((report.appended, report.duplicates), (0, 90));
    assert_eq!(
        shipping_bus
            .run_until_idle()
            .await
            .unwrap()
            .succeeded()
            .count(),
        0
    );
    assert_eq!(log.lock().unwrap().len(), 90);
}

/// A relay that crashed between the broker's acknowledgement and the delivery's completion
/// produces the event again: the topic holds it twice (no idempotent producer), the consumer
/// appends it once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_crash_after_the_ack_produces_twice_and_the_consumer_appends_once() {
    let topics = Topics::new("relay-crash", 1).await;
    let relay = topics.relay();
    let crashed = Arc::new(AtomicBool::new(false));
    let store = MemoryEventStore::new();
    let shop_bus = RelayBus::builder(store)
        .clock(TestClock::new(Timestamp::now()))
        .without_registered_handlers()
        .subscribe(Subscription::new("kafka-relay", {
            let relay = relay.clone();
            let crashed = Arc::clone(&crashed);
            move |event: OrderPlaced, context: HandlerContext<MemoryEventStore>| {
                let relay = relay.clone();
                let crashed = Arc::clone(&crashed);
                async move {
                    let envelope = EventEnvelope::new(&event)?
                        .with_id(context.event_id())?
                        .with_key(context.key().unwrap_or("none"))?;
                    relay.send(&envelope, context.sequence()).await?;
                    // The first attempt dies after the acknowledgement, before completing.
                    if !crashed.swap(true, Ordering::SeqCst) {
                        return Err::<(), BoxError>("crashed after the ack".into());
                    }
                    Ok(())
                }
            }
        }))
        .build()
        .unwrap();
    let appended = shop_bus
        .publish(&placed("o-1", 1))
        .key("o-1")
        .await
        .unwrap();
    let run = shop_bus
        .run_until_idle()
        .advance_clock(Duration::from_secs(3600))
        .await;
    assert!(run.is_ok(), "{run:?}");
    assert_eq!(relay.statistics().published, 2);
    let records = topics.records(&topics.topic, 0, 2).await;
    assert!(
        records
            .iter()
            .all(|r| r.record.headers["relaybus-event-id"] == appended.event_id.as_bytes()),
        "the topic holds the event twice"
    );

    let log = Log::default();
    let shipping_bus = shipping(MemoryEventStore::new(), &log);
    let consumer = topics.consumer("shipping");
    let report = consume(&consumer, &shipping_bus, 2).await;
    assert_eq!((report.appended, report.duplicates), (1, 1));
    shipping_bus.run_until_idle().await.unwrap();
    assert_eq!(log.lock().unwrap().len(), 1);
    assert_eq!(consumer.position(&shipping_bus, 0).await.unwrap(), Some(2));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_key_order_holds_end_to_end_over_partitions() {
    let topics = Topics::new("order", 4).await;
    let relay = topics.relay();
    let (_, shop_bus) = shop(&relay);
    publish_and_relay(&shop_bus, 20, 300).await;

    let log = Log::default();
    let shipping_bus = shipping(MemoryEventStore::new(), &log);
    let consumer = topics.consumer("shipping");
    let shutdown = CancellationToken::new();
    let running = tokio::spawn({
        let consumer = consumer.clone();
        let bus = shipping_bus.clone();
        let shutdown = shutdown.clone();
        async move { consumer.run(&bus, shutdown).await }
    });
    wait_until("300 records taken", async || {
        positions(&topics, &consumer, &shipping_bus).await == 300
    })
    .await;
    shutdown.cancel();
    let report = running.await.unwrap();
    assert_eq!((report.appended, report.duplicates), (300, 0));
    shipping_bus.run_until_idle().await.expect("handle");
    let seen = log.lock().unwrap().clone();
    assert_eq!(seen.len(), 300);
    let mut by_key: HashMap<String, Vec<u32>> = HashMap::new();
    for s in &seen {
        by_key.entry(s.key.clone().unwrap()).or_default().push(s.n);
    }
    assert_eq!(by_key.len(), 20);
    for (key, ns) in by_key {
        assert_eq!(ns, (0..15).collect::<Vec<_>>(), "key {key} out of order");
    }
    // The keys were spread over every partition.
    let spread: HashSet<u32> = (0..20)
        .map(|k| {
            relay.partition_of(
                &EventEnvelope::new(&placed("x", 0))
                    .unwrap()
                    .with_key(format!("o-{k}"))
                    .unwrap(),
            )
        })
        .collect();
    assert_eq!(spread.len(), 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_records_are_dead_lettered_and_do_not_block() {
    let topics = Topics::new("malformed", 1).await;
    let relay = topics.relay();
    let (_, shop_bus) = shop(&relay);
    let first = shop_bus
        .publish(&placed("o-1", 1))
        .key("o-1")
        .await
        .unwrap();
    shop_bus.run_until_idle().await.unwrap();
    let raw = topics
        .client
        .partition_client(&topics.topic, 0, UnknownTopicHandling::Error)
        .await
        .unwrap();
    let record = |value: Option<&[u8]>| Record {
        key: Some(b"k".to_vec()),
        value: value.map(<[u8]>::to_vec),
        headers: BTreeMap::new(),
        timestamp: rskafka::chrono::DateTime::from_timestamp_millis(1_764_000_000_000).unwrap(),
    };
    for value in [Some(&b"hello"[..]), None, Some(&br#"{"relaybus":2}"#[..])] {
        raw.produce(vec![record(value)], Compression::NoCompression)
            .await
            .unwrap();
    }
    let last = shop_bus
        .publish(&placed("o-1", 2))
        .key("o-1")
        .await
        .unwrap();
    shop_bus.run_until_idle().await.unwrap();

    let log = Log::default();
    let shipping_bus = shipping(MemoryEventStore::new(), &log);
    let consumer = topics.consumer("shipping");
    let report = consume(&consumer, &shipping_bus, 5).await;
    assert_eq!(
        (report.appended, report.dead_lettered, report.discarded),
        (2, 3, 0)
    );
    assert_eq!(consumer.position(&shipping_bus, 0).await.unwrap(), Some(5));
    shipping_bus.run_until_idle().await.unwrap();
    let seen: Vec<String> = log
        .lock()
        .unwrap()
        .iter()
        .map(|s| s.event_id.clone())
        .collect();
    assert_eq!(seen, [first.event_id, last.event_id]);

    let dead = topics.records(&topics.dead, 0, 3).await;
    let reason = |i: usize| {
        String::from_utf8(dead[i].record.headers[DEAD_LETTER_REASON_HEADER].clone()).unwrap()
    };
    let source = |i: usize| {
        String::from_utf8(dead[i].record.headers[DEAD_LETTER_SOURCE_HEADER].clone()).unwrap()
    };
    assert!(reason(0).contains("not JSON"), "{}", reason(0));
    assert!(reason(1).contains("no value"), "{}", reason(1));
    assert!(reason(2).contains("version 2"), "{}", reason(2));
    assert_eq!(source(0), format!("{}:0:1", topics.topic));
    assert_eq!(dead[0].record.value.as_deref(), Some(&b"hello"[..]));

    // Without a dead-letter topic they are skipped, and still do not block.
    let plain = KafkaConsumer::builder(Arc::clone(&topics.client), &topics.topic, "plain")
        .build()
        .unwrap();
    let other = shipping(MemoryEventStore::new(), &Log::default());
    let report = consume(&plain, &other, 5).await;
    assert_eq!(
        (report.appended, report.dead_lettered, report.discarded),
        (2, 0, 3)
    );
}

/// A private broker, paused with SIGSTOP past the clients' timeouts and resumed: the relay's
/// attempts fail and are retried, the consumer's fetches fail and are tried again, and every
/// event arrives once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_broker_delays_but_loses_nothing() {
    let broker = PrivateBroker::start("pause");
    let topics = Topics::on(connect_to(&broker.url).await, "pause", 2).await;
    let relay = KafkaRelay::builder(Arc::clone(&topics.client), &topics.topic)
        .partitions(2)
        .produce_timeout(Duration::from_millis(300))
        .build()
        .unwrap();
    let (_, shop_bus) = shop(&relay);
    let log = Log::default();
    let shipping_bus = shipping(MemoryEventStore::new(), &log);
    let consumer = KafkaConsumer::builder(Arc::clone(&topics.client), &topics.topic, "shipping")
        .fetch_wait(Duration::from_millis(50))
        .fetch_timeout(Duration::from_millis(300))
        .retry_delay(Duration::from_millis(50))
        .build()
        .unwrap();
    let shutdown = CancellationToken::new();
    let consuming = tokio::spawn({
        let consumer = consumer.clone();
        let bus = shipping_bus.clone();
        let shutdown = shutdown.clone();
        async move { consumer.run(&bus, shutdown).await }
    });
    let first = publish_and_relay(&shop_bus, 5, 10).await;
    wait_until("the first events taken", async || {
        positions(&topics, &consumer, &shipping_bus).await >= 10
    })
    .await;

    broker.pause().await;
    for i in 0..10 {
        shop_bus
            .publish(&placed("o-late", i))
            .key("o-late")
            .await
            .unwrap();
    }
    // Every attempt fails while the broker is paused, each after the produce timeout.
    let run = shop_bus.run_once().await.expect("run");
    assert!(run.other >= 1 && run.completed == 0, "{run:?}");
    let paused = positions(&topics, &consumer, &shipping_bus).await;
    broker.resume();

    let relayed = shop_bus
        .run_until_idle()
        .advance_clock(Duration::from_secs(3600))
        .await;
    assert!(relayed.is_ok(), "{relayed:?}");
    wait_until("every event taken", async || {
        shipping_bus.run_until_idle().await.unwrap();
        log.lock()
            .unwrap()
            .iter()
            .map(|s| s.event_id.clone())
            .collect::<HashSet<_>>()
            .len()
            == 20
    })
    .await;
    shutdown.cancel();
    consuming.await.unwrap();
    assert!(paused >= 10);
    let seen = log.lock().unwrap().clone();
    assert_eq!(seen.len(), 20, "one local effect per event");
    assert!(
        first
            .iter()
            .all(|id| seen.iter().any(|s| &s.event_id == id))
    );
    let late: Vec<u32> = seen
        .iter()
        .filter(|s| s.key.as_deref() == Some("o-late"))
        .map(|s| s.n)
        .collect();
    assert_eq!(late, (0..10).collect::<Vec<_>>());
}

/// A broker of the test's own, started with `scripts/kafka`, stopped when dropped.
struct PrivateBroker {
    name: String,
    url: String,
    pid: String,
}

impl PrivateBroker {
    fn start(test: &str) -> PrivateBroker {
        let name = format!(
            "test-{test}-{}-{:08x}",
            std::process::id(),
            rand::random::<u32>()
        );
        let output = std::process::Command::new(script())
            .args(["start", "--name", &name, "--port", "0"])
            .output()
            .expect("run scripts/kafka");
        assert!(
            output.status.success(),
            "scripts/kafka start failed: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        let url = String::from_utf8(output.stdout)
            .unwrap()
            .trim()
            .lines()
            .last()
            .unwrap()
            .to_owned();
        let pid = std::process::Command::new(script())
            .args(["pid", "--name", &name])
            .output()
            .expect("run scripts/kafka");
        let pid = String::from_utf8(pid.stdout).unwrap().trim().to_owned();
        assert!(
            pid.parse::<u32>().is_ok(),
            "no pid for broker {name}: {pid:?}"
        );
        PrivateBroker { name, url, pid }
    }

    /// Stops the broker with SIGSTOP and returns once all its threads have stopped: until
    /// then a worker of it may still answer a request sent after the signal.
    async fn pause(&self) {
        let pid = self.pid.parse().expect("a pid");
        relaybus_harness::pause_process(pid, Duration::from_secs(10))
            .await
            .unwrap_or_else(|e| panic!("pausing broker {}: {e}", self.name));
    }

    fn resume(&self) {
        let status = std::process::Command::new("kill")
            .args(["-CONT", &self.pid])
            .status()
            .expect("kill");
        assert!(status.success(), "kill -CONT {}", self.pid);
    }
}

impl Drop for PrivateBroker {
    fn drop(&mut self) {
        let _ = std::process::Command::new(script())
            .args(["stop", "--name", &self.name, "--rm"])
            .status();
    }
}

fn script() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/kafka")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_settings_are_refused_with_what_to_do() {
    let client = connect_to(&broker_url()).await;
    let relay = |topic: &str, partitions: u32| {
        KafkaRelay::builder(Arc::clone(&client), topic)
            .partitions(partitions)
            .build()
    };
    let invalid = |result: Result<_, KafkaError>, option: &str| match result {
        Err(KafkaError::InvalidConfiguration {
            option: got,
            reason,
        }) => {
            assert_eq!(got, option, "{reason}");
        }
        Err(other) => panic!("{option}: {other}"),
        Ok(_) => panic!("{option}: accepted"),
    };
    invalid(relay("", 1).map(|_| ()), "topic");
    invalid(relay("a b", 1).map(|_| ()), "topic");
    invalid(relay("t", 0).map(|_| ()), "partitions");
    invalid(relay("t", 5_000).map(|_| ()), "partitions");
    let consumer = |name: &str| KafkaConsumer::builder(Arc::clone(&client), "t", name);
    invalid(consumer("").build().map(|_| ()), "name");
    invalid(
        consumer("c").batch_records(0).build().map(|_| ()),
        "batch_records",
    );
    invalid(
        consumer("c").dead_letter_topic("t").build().map(|_| ()),
        "dead_letter_topic",
    );
    invalid(
        consumer("c").fetch_wait(Duration::ZERO).build().map(|_| ()),
        "fetch_wait",
    );
    invalid(
        consumer("c")
            .lease(Duration::from_millis(10))
            .build()
            .map(|_| ()),
        "lease",
    );
}

/// The store boundary's consumer positions, on every store: written in the caller's
/// transaction (gone with its abort), forward only, and refused with a reason when bad.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consumer_positions_commit_with_the_transaction_on_every_store() {
    use relaybus::{MongoEventStore, PostgresEventStore};

    async fn check<S: Store>(store: S) {
        store.setup().await.unwrap();
        let key = PositionKey::new("shipping", "orders", 3);
        let other = PositionKey::new("shipping", "orders", 4);
        let now = Timestamp::from_millis(1_764_000_000_000);
        let read = async |key: PositionKey<'_>| {
            let mut session = store.session().await.unwrap();
            store.begin(&mut session, None).await.unwrap();
            let position = store.consumer_position(&mut session, &key).await.unwrap();
            store.commit(&mut session).await.unwrap();
            position
        };
        assert_eq!(read(key).await, None, "{}", S::NAME);

        let mut session = store.session().await.unwrap();
        store.begin(&mut session, None).await.unwrap();
        store
            .advance_consumer_position(&mut session, &key, 7, now)
            .await
            .unwrap();
        assert_eq!(
            store.consumer_position(&mut session, &key).await.unwrap(),
            Some(7)
        );
        store.abort(&mut session).await;
        assert_eq!(
            read(key).await,
            None,
            "{}: an aborted position is gone",
            S::NAME
        );

        for next in [7, 5] {
            let mut session = store.session().await.unwrap();
            store.begin(&mut session, None).await.unwrap();
            store
                .advance_consumer_position(&mut session, &key, next, now)
                .await
                .unwrap();
            store.commit(&mut session).await.unwrap();
        }
        assert_eq!(
            read(key).await,
            Some(7),
            "{}: a position never moves back",
            S::NAME
        );
        assert_eq!(
            read(other).await,
            None,
            "{}: one position per partition",
            S::NAME
        );

        let mut session = store.session().await.unwrap();
        store.begin(&mut session, None).await.unwrap();
        let negative = store
            .advance_consumer_position(&mut session, &key, -1, now)
            .await;
        assert!(
            matches!(negative, Err(Error::InvalidArgument(_))),
            "{}: {negative:?}",
            S::NAME
        );
        let empty = store
            .consumer_position(&mut session, &PositionKey::new("", "orders", 0))
            .await;
        assert!(
            matches!(empty, Err(Error::InvalidArgument(_))),
            "{}: {empty:?}",
            S::NAME
        );
        store.abort(&mut session).await;
        let mut outside = store.session().await.unwrap();
        let refused = store
            .advance_consumer_position(&mut outside, &key, 9, now)
            .await;
        assert!(
            matches!(refused, Err(Error::Configuration(_))),
            "{}: {refused:?}",
            S::NAME
        );
        assert_eq!(
            read(key).await,
            Some(7),
            "{}: nothing written by refusals",
            S::NAME
        );
    }

    check(MemoryEventStore::new()).await;

    let db = relaybus_harness::test_db("kafka_positions").await;
    check(
        MongoEventStore::builder(db.client.clone())
            .database(&db.name)
            .build()
            .unwrap(),
    )
    .await;

    let url = std::env::var("RELAYBUS_TEST_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned());
    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    let schema = format!(
        "kafka_positions_{}_{:08x}",
        std::process::id(),
        rand::random::<u32>()
    );
    check(
        PostgresEventStore::builder(pool.clone())
            .schema(schema.clone())
            .build()
            .unwrap(),
    )
    .await;
    sqlx::query(&format!("DROP SCHEMA {schema} CASCADE"))
        .execute(&pool)
        .await
        .unwrap();
}

/// The lease of the consumer processes of the kill test: the killed process's partitions are
/// free once its leads expired, well within the recovery the test asks for.
const KILLED_CONSUMER_LEASE_MS: u64 = 1_000;

/// A consumer process killed with SIGKILL while its appends wait inside their transactions:
/// each partition's offset is written in the transaction of its batch, so a new process
/// started at once goes on from the last committed one once the killed process's leads
/// expired, within seconds; every event once and each key's in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_consumer_process_is_caught_up_within_seconds() {
    let topics = Topics::new("killed-consumer", 4).await;
    let relay = topics.relay();
    let (_, shop_bus) = shop(&relay);
    let crash = ConsumerCrash::new(
        env!("CARGO_BIN_EXE_relaybus-transport-consumer"),
        "kafka",
        vec![
            "kafka".to_owned(),
            broker_url(),
            topics.topic.clone(),
            "shipping".to_owned(),
            KILLED_CONSUMER_LEASE_MS.to_string(),
        ],
    )
    .await;
    let took = consumer_crash::drill(&crash, async |from, to| {
        for i in from..to {
            let (key, n) = consumer_crash::key_and_number(i);
            shop_bus.publish(&placed(&key, n)).key(key).await.unwrap();
        }
        let relayed = shop_bus.run_until_idle().await.unwrap();
        assert_eq!(relayed.succeeded().count(), (to - from) as usize);
    })
    .await;
    eprintln!("caught up {took:?} after the new consumer started");
    crash.drop_schema().await;
}
