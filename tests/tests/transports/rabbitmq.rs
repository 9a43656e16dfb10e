//! The RabbitMQ transport against a real broker: two services, each with its own in-memory
//! store, the first relaying its events to an exchange, the second appending a queue's events
//! to its store.
//!
//! The broker comes from `RELAYBUS_TEST_AMQP_URL` (default
//! `amqp://guest:guest@127.0.0.1:5672/%2f`). Each test makes a virtual host of its own with
//! `rabbitmqctl` (run on this machine, as a user allowed to), named after the test, the
//! process and a random part, so tests run in parallel, and deletes it when it ends, passed
//! or failed. A lost connection is made by closing, from the server side, only the
//! connections of the test's own virtual host.

use std::{
    collections::{BTreeMap, HashMap},
    sync::{Arc, Mutex, atomic::Ordering},
    time::{Duration, Instant},
};

use relaybus::{
    BoxError, Event, EventEnvelope, HandlerContext, MemoryEventStore, MemorySession, RelayBus,
    Store, Subscription,
    clock::TestClock,
    store::{ClaimRequest, Claimed, Inspect, Queue, memory::MemoryLease},
    transport::BatchReport,
    transport::rabbitmq::{
        DEAD_LETTER_QUEUE_HEADER, DEAD_LETTER_REASON_HEADER, RabbitConsumer, RabbitError,
        RabbitRelay,
        lapin::{
            BasicProperties, Connection, ConnectionProperties, ExchangeKind,
            options::{
                BasicGetOptions, BasicPublishOptions, ConfirmSelectOptions, ExchangeDeclareOptions,
                QueueBindOptions, QueueDeclareOptions,
            },
            types::{AMQPValue, FieldTable},
        },
    },
};
use relaybus_tests::consumer_crash::{self, ConsumerCrash};
use relaybus_tests::hooked::HookedStore;
use serde::{Deserialize, Serialize};
use serde_json::json;
use tokio_util::sync::CancellationToken;

const DEFAULT_AMQP_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";

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

fn base_url() -> String {
    std::env::var("RELAYBUS_TEST_AMQP_URL").unwrap_or_else(|_| DEFAULT_AMQP_URL.to_owned())
}

/// `url` with its virtual host replaced by `vhost`.
fn with_vhost(url: &str, vhost: &str) -> String {
    let authority_at = url.find("://").map_or(0, |at| at + 3);
    let path_at = url[authority_at..]
        .find('/')
        .map_or(url.len(), |at| authority_at + at);
    format!("{}/{vhost}", &url[..path_at])
}

/// Runs `rabbitmqctl` with `args`; fails saying what to do.
async fn rabbitmqctl(args: &[&str]) -> String {
    let output = tokio::process::Command::new("rabbitmqctl")
        .args(args)
        .output()
        .await
        .unwrap_or_else(|error| {
            panic!(
                "could not run rabbitmqctl ({error}): the RabbitMQ tests make a virtual host \
                 each with it; install RabbitMQ's command line tools on this machine"
            )
        });
    assert!(
        output.status.success(),
        "rabbitmqctl {args:?} failed: {}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// Connects to `url`, or fails naming the variable to set.
async fn connect(url: &str) -> Connection {
    let connecting = Connection::connect(url, ConnectionProperties::default());
    match tokio::time::timeout(Duration::from_secs(10), connecting).await {
        Ok(Ok(connection)) => connection,
        Ok(Err(error)) => panic!(
            "no RabbitMQ broker answers at RELAYBUS_TEST_AMQP_URL ({}, {error}): start one, or \
             set RELAYBUS_TEST_AMQP_URL to the URL of one",
            base_url()
        ),
        Err(_) => panic!(
            "the RabbitMQ broker at RELAYBUS_TEST_AMQP_URL ({}) did not answer within 10 s: \
             start one, or set RELAYBUS_TEST_AMQP_URL to the URL of one",
            base_url()
        ),
    }
}

/// A test's own virtual host on the broker, deleted when it is dropped, with the relay's
/// exchange name and a dead-letter exchange and queue.
struct Broker {
    vhost: String,
    /// The URI of the virtual host.
    uri: String,
    exchange: String,
    dead_exchange: String,
    dead_queue: String,
}

impl Broker {
    async fn new(test: &str) -> Broker {
        // The broker must answer before anything else.
        let probe = connect(&base_url()).await;
        let _ = probe.close(200, "probe".into()).await;
        let vhost = format!(
            "relaybus-test-{test}-{}-{:08x}",
            std::process::id(),
            rand::random::<u32>()
        );
        rabbitmqctl(&["-q", "add_vhost", &vhost]).await;
        let broker = Broker {
            uri: with_vhost(&base_url(), &vhost),
            vhost,
            exchange: "orders".to_owned(),
            dead_exchange: "orders.dead".to_owned(),
            dead_queue: "orders.dead".to_owned(),
        };
        let user = url_user(&base_url());
        rabbitmqctl(&[
            "-q",
            "set_permissions",
            "-p",
            &broker.vhost,
            &user,
            ".*",
            ".*",
            ".*",
        ])
        .await;
        let connection = connect(&broker.uri).await;
        let channel = connection.create_channel().await.unwrap();
        channel
            .exchange_declare(
                broker.dead_exchange.as_str().into(),
                ExchangeKind::Direct,
                ExchangeDeclareOptions {
                    durable: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .unwrap();
        channel
            .queue_declare(
                broker.dead_queue.as_str().into(),
                QueueDeclareOptions {
                    durable: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .unwrap();
        channel
            .queue_bind(
                broker.dead_queue.as_str().into(),
                broker.dead_exchange.as_str().into(),
                "dead".into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await
            .unwrap();
        let _ = connection.close(200, "set up".into()).await;
        broker
    }

    /// A relay over `partitions` queues, its topology declared.
    async fn relay(&self, partitions: u32) -> RabbitRelay {
        let relay = RabbitRelay::builder(&self.uri, &self.exchange)
            .partitions(partitions)
            .confirm_timeout(Duration::from_secs(2))
            .build()
            .expect("valid relay settings");
        relay
            .declare_topology()
            .await
            .expect("declare the topology");
        relay
    }

    async fn consumer(&self, queue: &str, batch_size: usize) -> RabbitConsumer {
        RabbitConsumer::builder(&self.uri, queue)
            .batch_size(batch_size)
            .fetch_wait(Duration::from_millis(200))
            .retry_delay(Duration::from_millis(100))
            .dead_letter_exchange(&self.dead_exchange, "dead")
            .build()
            .await
            .expect("consume the queue")
    }

    /// The messages ready in `queue` (not delivered to a consumer).
    async fn ready(&self, queue: &str) -> u32 {
        let connection = connect(&self.uri).await;
        let channel = connection.create_channel().await.unwrap();
        let declared = channel
            .queue_declare(
                queue.into(),
                QueueDeclareOptions {
                    passive: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .expect("the queue exists");
        let _ = connection.close(200, "counted".into()).await;
        declared.message_count()
    }

    /// Waits until `queue` has `count` messages ready (acknowledgements have no reply, so the
    /// broker takes them a little after they are sent).
    async fn wait_ready(&self, queue: &str, count: u32) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let ready = self.ready(queue).await;
            if ready == count {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{queue} has {ready} messages ready, not {count}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Closes, from the server side, every connection of this test's virtual host, and no
    /// other; returns how many.
    async fn close_connections(&self) -> usize {
        let listing = rabbitmqctl(&["-q", "list_connections", "pid", "vhost"]).await;
        let ours: Vec<String> = listing
            .lines()
            .filter_map(|line| line.split_once('\t'))
            .filter(|(pid, vhost)| pid.starts_with('<') && vhost.trim() == self.vhost)
            .map(|(pid, _)| pid.to_owned())
            .collect();
        for pid in &ours {
            rabbitmqctl(&[
                "-q",
                "close_connection",
                pid,
                "relaybus test: connection lost",
            ])
            .await;
        }
        ours.len()
    }
}

/// The user of an AMQP URL (`guest` when it names none).
fn url_user(url: &str) -> String {
    let authority = url.split_once("://").map_or(url, |(_, rest)| rest);
    authority
        .split_once('@')
        .map(|(userinfo, _)| userinfo.split(':').next().unwrap_or("guest").to_owned())
        .unwrap_or_else(|| "guest".to_owned())
}

impl Drop for Broker {
    fn drop(&mut self) {
        let _ = std::process::Command::new("rabbitmqctl")
            .args(["-q", "delete_vhost", &self.vhost])
            .output();
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
fn shop(relay: &RabbitRelay) -> (MemoryEventStore, RelayBus<MemoryEventStore>) {
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
    consumer: &RabbitConsumer,
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

/// The handler's runs per key, in order.
fn by_key(log: &Log) -> HashMap<String, Vec<u32>> {
    let mut by_key: HashMap<String, Vec<u32>> = HashMap::new();
    for seen in log.lock().unwrap().iter() {
        by_key
            .entry(seen.key.clone().unwrap())
            .or_default()
            .push(seen.n);
    }
    by_key
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_crosses_from_one_store_to_another() {
    let broker = Broker::new("end-to-end").await;
    let relay = broker.relay(1).await;
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
    assert_eq!(broker.ready("orders.0").await, 1);
    assert_eq!(relay.statistics().published, 1);

    let log = Log::default();
    let shipping_store = MemoryEventStore::new();
    let shipping_bus = shipping(shipping_store.clone(), &log);
    let consumer = broker.consumer("orders.0", 16).await;
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
    // Acknowledged: nothing comes back, even once the consumer is gone.
    consumer.close().await;
    broker.wait_ready("orders.0", 0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redelivered_message_has_one_local_effect() {
    let broker = Broker::new("redelivery").await;
    let relay = broker.relay(1).await;
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
    let consumer = broker.consumer("orders.0", 16).await;

    // The consumer appends, commits, and dies before its ack.
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
    consumer.close().await;
    broker.wait_ready("orders.0", 3).await;

    // The broker redelivers to the next consumer; the appends add nothing.
    let consumer = broker.consumer("orders.0", 16).await;
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut batch = consumer.fetch().await.unwrap();
    while batch.len() < 3 {
        assert!(Instant::now() < deadline, "fetched {} of 3", batch.len());
        drop(batch);
        batch = consumer.fetch().await.unwrap();
    }
    assert_eq!(batch.redelivered(), 3);
    let report = batch.append(&shipping_bus).await.ack().await.unwrap();
    assert_eq!((report.appended, report.duplicates), (0, 3), "{report:?}");
    consumer.close().await;
    broker.wait_ready("orders.0", 0).await;

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
async fn a_relay_that_crashed_after_the_confirm_sends_again_and_the_consumer_keeps_one() {
    let broker = Broker::new("relay-crash").await;
    let relay = broker.relay(1).await;
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

    // A relay process claims the delivery, publishes, gets the confirm, and dies before it
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
    relay
        .send(&claimed[0].event, claimed[0].sequence)
        .await
        .unwrap();

    // Its lease runs out; the bus takes the delivery over and the relay sends the event again.
    clock.advance(Duration::from_secs(10));
    let relayed = shop_bus.run_until_idle().await.unwrap();
    let runs: Vec<_> = relayed.succeeded().collect();
    assert_eq!(runs.len(), 1, "{relayed:?}");
    assert_eq!(runs[0].event_id, appended.event_id);
    assert_eq!(runs[0].attempt, 2, "the lost attempt is charged");
    assert_eq!(relay.statistics().published, 2);
    // RabbitMQ does not deduplicate: the queue holds both copies.
    assert_eq!(broker.ready("orders.0").await, 2);

    let log = Log::default();
    let shipping_store = MemoryEventStore::new();
    let shipping_bus = shipping(shipping_store.clone(), &log);
    let consumer = broker.consumer("orders.0", 16).await;
    // Both copies in one batch: the event is appended once, the second copy is a duplicate.
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut batch = consumer.fetch().await.unwrap();
    while batch.len() < 2 {
        assert!(Instant::now() < deadline, "fetched {} of 2", batch.len());
        drop(batch);
        batch = consumer.fetch().await.unwrap();
    }
    let report = batch.append(&shipping_bus).await.ack().await.unwrap();
    assert_eq!(
        (report.appended, report.duplicates, report.retried),
        (1, 1, 0),
        "{report:?}"
    );
    shipping_bus.run_until_idle().await.unwrap();
    assert_eq!(log.lock().unwrap().len(), 1, "one effect");
    assert_eq!(shipping_store.statistics().await.unwrap().pending, 0);
    consumer.close().await;
    broker.wait_ready("orders.0", 0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_key_order_holds_end_to_end() {
    const KEYS: [&str; 4] = ["k-a", "k-b", "k-c", "k-d"];
    const PER_KEY: u32 = 20;
    let broker = Broker::new("order").await;
    let relay = broker.relay(2).await;
    let (_, shop_bus) = shop(&relay);
    let mut expected: HashMap<String, usize> = HashMap::new();
    for n in 0..PER_KEY {
        for key in KEYS {
            let appended = shop_bus.publish(&placed(key, n)).key(key).await.unwrap();
            let envelope = EventEnvelope::new(&placed(key, n))
                .unwrap()
                .with_id(appended.event_id)
                .unwrap()
                .with_key(key)
                .unwrap();
            *expected.entry(relay.routing_key_of(&envelope)).or_default() += 1;
        }
    }
    let relayed = shop_bus.run_until_idle().await.unwrap();
    assert_eq!(relayed.succeeded().count(), KEYS.len() * PER_KEY as usize);

    let log = Log::default();
    let shipping_bus = shipping(MemoryEventStore::new(), &log);
    // One consumer per queue, with small batches, so that keys straddle batch boundaries.
    let mut appended = 0;
    for queue in relay.routing_keys() {
        let count = expected.get(&queue).copied().unwrap_or_default();
        assert_eq!(broker.ready(&queue).await as usize, count);
        let consumer = broker.consumer(&queue, 7).await;
        appended += consume(&consumer, &shipping_bus, count).await.appended;
        consumer.close().await;
    }
    assert_eq!(appended, KEYS.len() * PER_KEY as usize);
    let handled = shipping_bus.run_until_idle().await.unwrap();
    assert_eq!(handled.succeeded().count(), KEYS.len() * PER_KEY as usize);

    let by_key = by_key(&log);
    for key in KEYS {
        assert_eq!(
            by_key[key],
            (0..PER_KEY).collect::<Vec<_>>(),
            "order of {key}"
        );
    }
}

/// A consumer process killed with SIGKILL while its append waits inside its transaction: the
/// broker puts its unacknowledged deliveries back in the queue when its connection drops, so a
/// new process started at once appends them within seconds, every event once and each key's
/// in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_consumer_process_is_caught_up_within_seconds() {
    let broker = Broker::new("killed-consumer").await;
    let relay = broker.relay(1).await;
    let (_, shop_bus) = shop(&relay);
    let queue = relay.routing_keys().remove(0);
    let crash = ConsumerCrash::new(
        env!("CARGO_BIN_EXE_relaybus-transport-consumer"),
        "rabbitmq",
        vec!["rabbitmq".to_owned(), broker.uri.clone(), queue],
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_messages_are_dead_lettered_and_do_not_block() {
    let broker = Broker::new("malformed").await;
    let relay = broker.relay(1).await;
    let good: Vec<EventEnvelope> = (0..3)
        .map(|n| {
            EventEnvelope::new(&placed("o-1", n))
                .unwrap()
                .with_key("o-1")
                .unwrap()
        })
        .collect();
    let bad_type = json!({
        "relaybus": 1, "id": "e-bad", "type": "Not A Type",
        "created_at": "2026-12-01T00:00:00Z", "payload": {}
    });
    let bodies: [Vec<u8>; 3] = [
        b"hello, not json".to_vec(),
        br#"{"order_id":"o-9"}"#.to_vec(),
        serde_json::to_vec(&bad_type).unwrap(),
    ];
    // Good and bad interleaved: good, bad, bad, good, bad, good.
    let connection = connect(&broker.uri).await;
    let channel = connection.create_channel().await.unwrap();
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let raw = async |body: &[u8]| {
        let confirm = channel
            .basic_publish(
                broker.exchange.as_str().into(),
                "orders.0".into(),
                BasicPublishOptions::default(),
                body,
                BasicProperties::default(),
            )
            .await
            .unwrap()
            .await
            .unwrap();
        assert!(confirm.is_ack());
    };
    relay.send(&good[0], None).await.unwrap();
    raw(&bodies[0]).await;
    raw(&bodies[1]).await;
    relay.send(&good[1], None).await.unwrap();
    raw(&bodies[2]).await;
    relay.send(&good[2], None).await.unwrap();
    let _ = connection.close(200, "published".into()).await;

    let log = Log::default();
    let shipping_store = MemoryEventStore::new();
    let shipping_bus = shipping(shipping_store.clone(), &log);
    let consumer = broker.consumer("orders.0", 16).await;
    let report = consume(&consumer, &shipping_bus, 6).await;
    assert_eq!(
        (report.dead_lettered, report.discarded, report.appended),
        (3, 0, 3),
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
    consumer.close().await;
    broker.wait_ready("orders.0", 0).await;
    broker.wait_ready(&broker.dead_queue, 3).await;

    let connection = connect(&broker.uri).await;
    let channel = connection.create_channel().await.unwrap();
    let mut reasons = Vec::new();
    for body in &bodies {
        let message = channel
            .basic_get(
                broker.dead_queue.as_str().into(),
                BasicGetOptions { no_ack: true },
            )
            .await
            .unwrap()
            .expect("a dead letter");
        assert_eq!(
            &message.delivery.data, body,
            "the body as it came, in order"
        );
        let headers = message.delivery.properties.headers().clone().unwrap();
        let header = |name: &str| match headers.inner().get(name) {
            Some(AMQPValue::LongString(value)) => {
                String::from_utf8_lossy(value.as_bytes()).into_owned()
            }
            other => panic!("{name}: {other:?}"),
        };
        assert_eq!(header(DEAD_LETTER_QUEUE_HEADER), "orders.0");
        reasons.push(header(DEAD_LETTER_REASON_HEADER));
    }
    let _ = connection.close(200, "read".into()).await;
    assert!(reasons[0].contains("not JSON"), "{reasons:?}");
    assert!(
        reasons[1].contains("no `relaybus` format version"),
        "{reasons:?}"
    );
    assert!(reasons[2].contains("type name"), "{reasons:?}");
    shipping_bus.run_until_idle().await.unwrap();
    assert_eq!(
        log.lock().unwrap().iter().map(|s| s.n).collect::<Vec<_>>(),
        [0, 1, 2]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_dead_letter_exchange_unreadable_messages_are_rejected() {
    let broker = Broker::new("rejected").await;
    let relay = broker.relay(1).await;
    let connection = connect(&broker.uri).await;
    let channel = connection.create_channel().await.unwrap();
    channel
        .basic_publish(
            broker.exchange.as_str().into(),
            "orders.0".into(),
            BasicPublishOptions::default(),
            b"not an event",
            BasicProperties::default(),
        )
        .await
        .unwrap();
    let _ = connection.close(200, "published".into()).await;
    let good = EventEnvelope::new(&placed("o-1", 1)).unwrap();
    relay.send(&good, None).await.unwrap();

    let log = Log::default();
    let shipping_bus = shipping(MemoryEventStore::new(), &log);
    let consumer = RabbitConsumer::builder(&broker.uri, "orders.0")
        .fetch_wait(Duration::from_millis(200))
        .build()
        .await
        .unwrap();
    let report = consume(&consumer, &shipping_bus, 2).await;
    assert_eq!((report.discarded, report.appended), (1, 1), "{report:?}");
    consumer.close().await;
    broker.wait_ready("orders.0", 0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_finishes_the_current_batch() {
    const EVENTS: usize = 60;
    let broker = Broker::new("shutdown").await;
    let relay = broker.relay(1).await;
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
    let consumer = broker.consumer("orders.0", 10).await;
    // Let the broker fill the prefetch window, so batches are full.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let report = tokio::time::timeout(
        Duration::from_secs(30),
        consumer.run(&shipping_bus, shutdown.clone()),
    )
    .await
    .expect("the consumer stops after its batch");

    assert!(shutdown.is_cancelled());
    assert_eq!(report.fetched, report.appended, "{report:?}");
    let taken = report.appended;
    assert!((11..=20).contains(&taken), "two batches: {report:?}");
    // The batch in hand is appended and acknowledged; what the broker had sent ahead goes
    // back to the queue.
    broker.wait_ready("orders.0", (EVENTS - taken) as u32).await;
    let handled = shipping_bus.run_until_idle().await.unwrap();
    assert_eq!(handled.succeeded().count(), taken);
    assert_eq!(
        store.inner.statistics().await.unwrap().pending,
        0,
        "every appended event handled"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_append_is_redelivered_in_order() {
    let broker = Broker::new("store-down").await;
    let relay = broker.relay(1).await;
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
    let consumer = broker.consumer("orders.0", 4).await;

    store.hooks.down.store(true, Ordering::SeqCst);
    let failed = consume(&consumer, &shipping_bus, 1).await;
    assert_eq!(failed.appended, 0);
    assert_eq!(failed.retried, failed.fetched, "{failed:?}");

    store.hooks.down.store(false, Ordering::SeqCst);
    let report = consume(&consumer, &shipping_bus, 6).await;
    assert_eq!((report.appended, report.retried), (6, 0), "{report:?}");
    shipping_bus.run_until_idle().await.unwrap();
    let order: Vec<u32> = log.lock().unwrap().iter().map(|s| s.n).collect();
    assert_eq!(order, [0, 1, 2, 3, 4, 5]);
    consumer.close().await;
    broker.wait_ready("orders.0", 0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_connection_mid_stream_loses_and_doubles_nothing() {
    const KEYS: [&str; 3] = ["k-a", "k-b", "k-c"];
    let broker = Broker::new("connection-lost").await;
    let relay = broker.relay(1).await;

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
    let consumer = RabbitConsumer::builder(&broker.uri, "orders.0")
        .batch_size(4)
        .fetch_wait(Duration::from_millis(100))
        .build()
        .await
        .unwrap();
    let shutdown = CancellationToken::new();
    let consuming = tokio::spawn({
        let (consumer, bus, token) = (consumer.clone(), shipping_bus.clone(), shutdown.clone());
        async move { consumer.run(&bus, token).await }
    });

    let held = async || shipping_store.statistics().await.unwrap().pending as usize;
    // The shop publishes a round of events (one per key) every 20 ms until told to stop.
    let stop = CancellationToken::new();
    let publishing = tokio::spawn({
        let (bus, stop) = (shop_bus.clone(), stop.clone());
        async move {
            let mut rounds = 0;
            while !stop.is_cancelled() {
                for key in KEYS {
                    bus.publish(&placed(key, rounds)).key(key).await.unwrap();
                }
                rounds += 1;
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            rounds
        }
    });
    wait_until("the first events crossing", async || held().await >= 6).await;

    // The broker drops the test's connections (the relay's and the consumer's) mid-stream;
    // the shop goes on publishing into its outbox.
    let closed = broker.close_connections().await;
    assert!(closed >= 2, "closed {closed} connections");
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.cancel();
    let rounds = publishing.await.unwrap();
    let total = KEYS.len() * rounds as usize;

    wait_until("every event crossing", async || held().await >= total).await;
    wait_until("the relay finishing", async || {
        shop_store.statistics().await.unwrap().pending == 0
    })
    .await;
    shutdown.cancel();
    let report = consuming.await.unwrap();
    shop_bus.shutdown().await.unwrap();
    assert_eq!(report.appended, total, "{report:?}");
    assert_eq!(shop_store.statistics().await.unwrap().dead, 0);
    assert!(
        relay.statistics().connections >= 2,
        "{:?}",
        relay.statistics()
    );
    assert!(consumer.connections() >= 2, "the consumer connected again");

    let handled = shipping_bus.run_until_idle().await.unwrap();
    assert_eq!(handled.succeeded().count(), total, "one effect per event");
    assert_eq!(log.lock().unwrap().len(), total, "one effect per event");
    let by_key = by_key(&log);
    for key in KEYS {
        assert_eq!(
            by_key[key],
            (0..rounds).collect::<Vec<_>>(),
            "order of {key}"
        );
    }
    broker.wait_ready("orders.0", 0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_settings_are_refused_with_what_to_do() {
    let broker = Broker::new("settings").await;
    let refused = |result: Result<RabbitRelay, RabbitError>| match result {
        Err(RabbitError::InvalidConfiguration { option, reason }) => (option, reason),
        other => panic!("expected a refusal, got {other:?}"),
    };
    let relay = |exchange: &str| RabbitRelay::builder(&broker.uri, exchange);
    let (option, _) = refused(relay("").build());
    assert_eq!(option, "exchange");
    let (option, _) = refused(relay("orders").partitions(0).build());
    assert_eq!(option, "partitions");
    let (option, _) = refused(relay("orders").handler_id("no spaces").build());
    assert_eq!(option, "handler_id");
    let (option, reason) = refused(RabbitRelay::builder("http://secret@x", "orders").build());
    assert_eq!(option, "uri");
    assert!(!reason.contains("secret"), "{reason}");
    let long = relay("orders").handler_id("h".repeat(100)).build().unwrap();
    match long.subscription::<OrderPlaced, MemoryEventStore>() {
        Err(RabbitError::InvalidConfiguration { option, reason }) => {
            assert_eq!(option, "handler_id");
            assert!(reason.contains("shorter"), "{reason}");
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
    // Publishing before the queues exist: the broker returns the message as unroutable.
    let unbound = relay("orders").build().unwrap();
    let envelope = EventEnvelope::new(&placed("o-1", 1)).unwrap();
    match unbound.send(&envelope, None).await {
        Err(RabbitError::Publish { .. }) => {} // no exchange yet: the channel is closed
        other => panic!("expected a publish error, got {other:?}"),
    }
    let declared = broker.relay(1).await;
    let elsewhere = RabbitRelay::builder(&broker.uri, "orders")
        .routing_prefix("nowhere")
        .build()
        .unwrap();
    match elsewhere.send(&envelope, None).await {
        Err(error @ RabbitError::Unroutable { .. }) => {
            assert!(error.to_string().contains("declare_topology"), "{error}");
        }
        other => panic!("expected an unroutable message, got {other:?}"),
    }
    declared.send(&envelope, None).await.expect("now it goes");
    match RabbitConsumer::builder(&broker.uri, "no-such-queue")
        .build()
        .await
    {
        Err(error @ RabbitError::Setup { .. }) => {
            assert!(error.to_string().contains("declare"), "{error}");
        }
        other => panic!("expected a setup error, got {other:?}"),
    }
    match RabbitConsumer::builder(&broker.uri, "orders.0")
        .batch_size(0)
        .build()
        .await
    {
        Err(RabbitError::InvalidConfiguration { option, .. }) => assert_eq!(option, "batch_size"),
        other => panic!("expected a refusal, got {other:?}"),
    }
    let nowhere = with_vhost(&base_url(), "relaybus-no-such-vhost");
    match RabbitConsumer::builder(&nowhere, "orders.0").build().await {
        Err(error @ RabbitError::Connect { .. }) => {
            let text = error.to_string();
            assert!(text.contains("relaybus-no-such-vhost"), "{text}");
            assert!(!text.contains("guest:guest"), "no password in {text}");
        }
        other => panic!("expected a connect error, got {other:?}"),
    }
}
