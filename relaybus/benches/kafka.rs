//! The Kafka relay: events per second from a bus's outbox to a topic's partitions, next to
//! rskafka's own raw produce of the same envelopes to the same partitions in the same run; and
//! the time from a publish's commit in one service to the handler of another service that
//! consumes the topic into its own store.
//!
//! Both services use the in-memory store, so the figures are the transport's and the bus's,
//! not a database's. The relay runs as the bus runs it: one delivery per event, each completed
//! after the partition leader's acknowledgement, `concurrency` deliveries at a time, over a
//! topic of four partitions; the raw baseline produces the same envelopes as the relay's
//! records (key, JSON value, headers, timestamp), one record per produce, each to the partition
//! the relay picks for it, in the same topic, keeping the same number of produces outstanding.
//! The two take turns going first, round by round. The consumer of the latency run fetches
//! with a wait of 50 ms (its default is 500 ms): a broker that answers a waiting fetch only
//! when its wait runs out, not when a record arrives, puts up to that wait into the latency
//! (with Tansu the latency follows the wait), and 1,000 samples of up to 500 ms each would not
//! fit three rounds into five minutes.
//!
//! Run with `cargo bench -p relaybus --bench kafka --features kafka,memory`. It uses the broker
//! at `RELAYBUS_BENCH_KAFKA_URL` (else `RELAYBUS_TEST_KAFKA_URL`; `host:port`), else starts a
//! private Tansu broker with `scripts/kafka start --port 0` and stops it at the end. Each
//! round makes topics of its own, deleted at the end. `RELAYBUS_BENCH_EVENTS` sets the events
//! per throughput run (default 5000), `RELAYBUS_BENCH_SAMPLES` the latency samples (default
//! 1000), `RELAYBUS_BENCH_ROUNDS` the rounds (default 3; medians with min..max). Run by
//! `cargo test` (without `--bench`), it makes small runs as a smoke test. It ends with one JSON
//! line.

use std::{
    collections::BTreeMap,
    sync::Arc,
    time::{Duration, Instant},
};

use futures::{StreamExt, stream::FuturesUnordered};
use relaybus::{
    BoxError, Event, EventEnvelope, HandlerContext, MemoryEventStore, RelayBus, Subscription,
    transport::kafka::{
        EVENT_ID_HEADER, EVENT_TYPE_HEADER, KafkaConsumer, KafkaRelay,
        rskafka::{
            chrono::DateTime,
            client::{
                Client, ClientBuilder,
                partition::{Compression, OffsetAt, PartitionClient, UnknownTopicHandling},
            },
            record::Record,
        },
    },
};
use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

/// Deliveries in flight, for the relay and the raw baseline alike.
const CONCURRENCY: usize = 32;
/// Partitions of the throughput topic, for the relay and the raw baseline alike.
const PARTITIONS: u32 = 4;
/// How long the latency run's consumer lets the broker hold a fetch when there are no records.
const FETCH_WAIT: Duration = Duration::from_millis(50);

#[derive(Debug, Serialize, Deserialize)]
struct Tick {
    n: u64,
    note: String,
}

impl Event for Tick {
    const TYPE: &'static str = "bench.tick.v1";
}

fn env_number(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn tick(n: u64) -> Result<EventEnvelope, BoxError> {
    Ok(EventEnvelope::new(&Tick {
        n,
        note: "a tick of the benchmark".into(),
    })?)
}

/// The private broker the benchmark started with `scripts/kafka`, stopped when dropped.
struct PrivateBroker {
    name: String,
}

impl PrivateBroker {
    /// Starts one and returns it with its URL.
    fn start() -> Result<(PrivateBroker, String), BoxError> {
        let name = format!("bench-{}-{:08x}", std::process::id(), rand::random::<u32>());
        let output = std::process::Command::new(script())
            .args(["start", "--name", &name, "--port", "0"])
            .output()
            .map_err(|e| format!("could not run {} ({e})", script().display()))?;
        // Whatever happened, the script may have left a directory behind: the guard removes it.
        let broker = PrivateBroker { name };
        if !output.status.success() {
            return Err(format!(
                "no broker in RELAYBUS_BENCH_KAFKA_URL or RELAYBUS_TEST_KAFKA_URL, and \
                 `scripts/kafka start --port 0` failed: {}; start a Kafka broker and set \
                 RELAYBUS_BENCH_KAFKA_URL to its host:port",
                String::from_utf8_lossy(&output.stderr).trim()
            )
            .into());
        }
        let stdout = String::from_utf8_lossy(&output.stdout);
        let url = stdout
            .lines()
            .last()
            .map(str::trim)
            .filter(|line| !line.is_empty())
            .ok_or("`scripts/kafka start` printed no URL")?
            .to_owned();
        Ok((broker, url))
    }
}

impl Drop for PrivateBroker {
    fn drop(&mut self) {
        let stopped = std::process::Command::new(script())
            .args(["stop", "--name", &self.name, "--rm"])
            .status();
        if !matches!(stopped, Ok(status) if status.success()) {
            eprintln!(
                "the benchmark's broker {} may still run: stop it with \
                 `scripts/kafka stop --name {} --rm`",
                self.name, self.name
            );
        }
    }
}

fn script() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/kafka")
}

/// Connects to the broker at `url`, or says how to get one.
async fn connect(url: &str) -> Result<Arc<Client>, BoxError> {
    let connecting = ClientBuilder::new(vec![url.to_owned()]).build();
    match tokio::time::timeout(Duration::from_secs(10), connecting).await {
        Ok(Ok(client)) => Ok(Arc::new(client)),
        Ok(Err(e)) => Err(format!(
            "no Kafka broker answers at {url} ({e}); start one (scripts/kafka start) and set \
             RELAYBUS_BENCH_KAFKA_URL to its host:port"
        )
        .into()),
        Err(_) => Err(format!(
            "the Kafka broker at {url} did not answer within 10 s; start one (scripts/kafka \
             start) and set RELAYBUS_BENCH_KAFKA_URL to its host:port"
        )
        .into()),
    }
}

/// The topics of one round, deleted by [`Topics::delete`].
struct Topics {
    client: Arc<Client>,
    made: Vec<String>,
    unique: String,
}

impl Topics {
    fn new(client: &Arc<Client>) -> Topics {
        Topics {
            client: Arc::clone(client),
            made: Vec::new(),
            unique: format!("{}-{:08x}", std::process::id(), rand::random::<u32>()),
        }
    }

    /// A new topic named after `run`, with a relay of `partitions` partitions producing to it.
    async fn relay(&mut self, run: &str, partitions: u32) -> Result<KafkaRelay, BoxError> {
        let topic = format!("relaybus-bench.{run}.{}", self.unique);
        let relay = KafkaRelay::builder(Arc::clone(&self.client), &topic)
            .partitions(partitions)
            .build()?;
        relay.create_topic(1).await?;
        self.made.push(topic);
        Ok(relay)
    }

    /// The records a topic holds, over `partitions` partitions.
    async fn records(&self, topic: &str, partitions: u32) -> Result<i64, BoxError> {
        let mut total = 0;
        for partition in 0..partitions {
            total += self
                .partition(topic, partition)
                .await?
                .get_offset(OffsetAt::Latest)
                .await?;
        }
        Ok(total)
    }

    async fn partition(&self, topic: &str, partition: u32) -> Result<PartitionClient, BoxError> {
        Ok(self
            .client
            .partition_client(
                topic,
                i32::try_from(partition)?,
                UnknownTopicHandling::Error,
            )
            .await?)
    }

    async fn delete(self) {
        let Ok(controller) = self.client.controller_client() else {
            return;
        };
        for topic in &self.made {
            let _ = controller.delete_topic(topic.as_str(), 10_000).await;
        }
    }
}

/// The record the relay makes of an unkeyed, unsequenced envelope.
fn record(envelope: &EventEnvelope) -> Result<Record, BoxError> {
    let value = serde_json::to_vec(&serde_json::json!({
        "relaybus": 1,
        "id": envelope.id(),
        "type": envelope.event_type(),
        "key": envelope.key(),
        "sequence": null,
        "correlation_id": envelope.correlation_id(),
        "causation_id": envelope.causation_id(),
        "headers": envelope.headers(),
        "created_at": envelope.created_at().to_string(),
        "payload": envelope.payload(),
    }))?;
    let mut headers = BTreeMap::new();
    headers.insert(
        EVENT_ID_HEADER.to_owned(),
        envelope.id().as_bytes().to_vec(),
    );
    headers.insert(
        EVENT_TYPE_HEADER.to_owned(),
        envelope.event_type().as_bytes().to_vec(),
    );
    headers.insert("content-type".to_owned(), b"application/json".to_vec());
    Ok(Record {
        key: envelope.key().map(|key| key.as_bytes().to_vec()),
        value: Some(value),
        headers,
        timestamp: DateTime::from_timestamp_millis(envelope.created_at().timestamp_millis())
            .unwrap_or_default(),
    })
}

/// rskafka on its own: the `envelopes` as the relay's records, one produce each to the
/// partition the relay picks for it, at most `CONCURRENCY` outstanding. Events per second.
async fn raw(
    topics: &Topics,
    relay: &KafkaRelay,
    envelopes: &[EventEnvelope],
) -> Result<f64, BoxError> {
    let mut partitions = Vec::new();
    for partition in 0..relay.partitions() {
        partitions.push(Arc::new(topics.partition(relay.topic(), partition).await?));
    }
    let records = envelopes
        .iter()
        .map(|envelope| {
            let partition = relay.partition_of(envelope) as usize;
            Ok((Arc::clone(&partitions[partition]), record(envelope)?))
        })
        .collect::<Result<Vec<_>, BoxError>>()?;
    let before = topics.records(relay.topic(), relay.partitions()).await?;

    let started = Instant::now();
    let mut pending = FuturesUnordered::new();
    for (partition, record) in records {
        if pending.len() == CONCURRENCY {
            pending.next().await.ok_or("no pending produce")??;
        }
        pending.push(async move {
            partition
                .produce(vec![record], Compression::NoCompression)
                .await
        });
    }
    while let Some(produced) = pending.next().await {
        produced?;
    }
    let rate = envelopes.len() as f64 / started.elapsed().as_secs_f64();

    let stored = topics.records(relay.topic(), relay.partitions()).await? - before;
    if stored != envelopes.len() as i64 {
        return Err(format!(
            "raw: the topic took {stored} of {} records",
            envelopes.len()
        )
        .into());
    }
    Ok(rate)
}

/// The relay: the `envelopes` published into a bus's store, then relayed by `run_until_idle`
/// with `CONCURRENCY` deliveries at a time. Events per second of the relaying alone.
async fn relay(
    topics: &Topics,
    relay: &KafkaRelay,
    envelopes: &[EventEnvelope],
) -> Result<f64, BoxError> {
    let store = MemoryEventStore::new();
    let bus = RelayBus::builder(store)
        .without_registered_handlers()
        .batch_size(CONCURRENCY as u32)
        .concurrency(CONCURRENCY)
        .subscribe(relay.subscription::<Tick, MemoryEventStore>()?)
        .build()?;
    for chunk in envelopes.chunks(500) {
        bus.publish_all(chunk.to_vec()).await?;
    }
    let before = topics.records(relay.topic(), relay.partitions()).await?;

    let started = Instant::now();
    let report = bus.run_until_idle().max_runs(envelopes.len() + 1).await?;
    let rate = envelopes.len() as f64 / started.elapsed().as_secs_f64();

    let relayed = report.succeeded().count();
    let stored = topics.records(relay.topic(), relay.partitions()).await? - before;
    if relayed != envelopes.len() || stored != envelopes.len() as i64 {
        return Err(format!(
            "relay: {relayed} deliveries succeeded and the topic took {stored} records, of {}",
            envelopes.len()
        )
        .into());
    }
    Ok(rate)
}

/// Commit-to-remote-handler latency: service A's started bus relays each event as it
/// commits; service B's consumer appends it to B's store, whose started bus runs the handler.
/// `samples` events one after another; milliseconds at p50 and p99.
async fn latency(
    client: &Arc<Client>,
    topics: &mut Topics,
    samples: usize,
) -> Result<(f64, f64), BoxError> {
    let relay = topics.relay("latency", 1).await?;
    let shop = RelayBus::builder(MemoryEventStore::new())
        .without_registered_handlers()
        .subscribe(relay.subscription::<Tick, MemoryEventStore>()?)
        .build()?;
    let (seen, mut arrivals) = mpsc::unbounded_channel::<(u64, Instant)>();
    let shipping = RelayBus::builder(MemoryEventStore::new())
        .without_registered_handlers()
        .subscribe(Subscription::new(
            "ship",
            move |tick: Tick, _: HandlerContext<MemoryEventStore>| {
                let at = Instant::now();
                let seen = seen.clone();
                async move {
                    let _ = seen.send((tick.n, at));
                    Ok::<(), BoxError>(())
                }
            },
        ))
        .build()?;
    shop.start().await?;
    shipping.start().await?;
    let consumer = KafkaConsumer::builder(Arc::clone(client), relay.topic(), "shipping")
        .fetch_wait(FETCH_WAIT)
        .build()?;
    let stop = CancellationToken::new();
    let consuming = {
        let (consumer, shipping, stop) = (consumer.clone(), shipping.clone(), stop.clone());
        tokio::spawn(async move { consumer.run(&shipping, stop).await })
    };

    let mut waits = Vec::with_capacity(samples);
    for n in 0..samples as u64 {
        shop.publish(&Tick {
            n,
            note: "a tick of the benchmark".into(),
        })
        .await?;
        let committed = Instant::now();
        let (seen_n, at) = tokio::time::timeout(Duration::from_secs(10), arrivals.recv())
            .await
            .map_err(|_| format!("event {n} did not reach the remote handler within 10 s"))?
            .ok_or("the remote handler is gone")?;
        if seen_n != n {
            return Err(format!("the remote handler saw event {seen_n}, expected {n}").into());
        }
        waits.push(at.saturating_duration_since(committed).as_secs_f64() * 1000.0);
    }
    stop.cancel();
    let consumed = consuming.await?;
    shop.shutdown().await?;
    shipping.shutdown().await?;
    if consumed.appended != samples {
        return Err(format!(
            "latency: the consumer appended {} events, of {samples}",
            consumed.appended
        )
        .into());
    }
    waits.sort_by(f64::total_cmp);
    Ok((percentile(&waits, 0.50), percentile(&waits, 0.99)))
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = ((sorted.len() as f64) * p).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// The median and the range of repeated figures.
fn spread(values: &[f64]) -> (f64, f64, f64) {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    (
        sorted[sorted.len() / 2],
        sorted[0],
        sorted[sorted.len() - 1],
    )
}

fn round(value: f64, places: i32) -> f64 {
    let scale = 10_f64.powi(places);
    (value * scale).round() / scale
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let smoke = !std::env::args().any(|arg| arg == "--bench");
    let (events, samples, rounds) = if smoke {
        (50, 5, 1)
    } else {
        (
            env_number("RELAYBUS_BENCH_EVENTS", 5_000),
            env_number("RELAYBUS_BENCH_SAMPLES", 1_000),
            env_number("RELAYBUS_BENCH_ROUNDS", 3).max(1),
        )
    };
    let given = std::env::var("RELAYBUS_BENCH_KAFKA_URL")
        .or_else(|_| std::env::var("RELAYBUS_TEST_KAFKA_URL"))
        .ok();
    // Dropped last, so the broker stops after everything that uses it, also on an error.
    let (_broker, url) = match given {
        Some(url) => (None, url),
        None => {
            let (broker, url) = PrivateBroker::start()?;
            (Some(broker), url)
        }
    };
    let client = connect(&url).await?;

    println!(
        "Kafka relay benchmark at {url}: {events} events per run over {PARTITIONS} partitions, \
         {CONCURRENCY} in flight, {samples} latency samples (fetch wait {FETCH_WAIT:?}), \
         {rounds} rounds"
    );
    println!(
        "{:>6} {:>14} {:>14} {:>7} {:>10} {:>10}",
        "round", "raw ev/s", "relay ev/s", "ratio", "p50 ms", "p99 ms"
    );
    let (mut raws, mut relays, mut ratios, mut p50s, mut p99s) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for round_n in 1..=rounds {
        let mut topics = Topics::new(&client);
        let measured = async {
            let target = topics.relay("throughput", PARTITIONS).await?;
            let envelopes = (0..events as u64)
                .map(tick)
                .collect::<Result<Vec<_>, _>>()?;
            // The topic grows with each run: the two take turns going first.
            let (raw, ours) = if round_n % 2 == 1 {
                let raw = raw(&topics, &target, &envelopes).await?;
                (raw, relay(&topics, &target, &envelopes).await?)
            } else {
                let ours = relay(&topics, &target, &envelopes).await?;
                (raw(&topics, &target, &envelopes).await?, ours)
            };
            let (p50, p99) = latency(&client, &mut topics, samples).await?;
            Ok::<_, BoxError>((raw, ours, p50, p99))
        }
        .await;
        topics.delete().await;
        let (raw, ours, p50, p99) = measured?;
        println!(
            "{round_n:>6} {raw:>14.0} {ours:>14.0} {:>7.3} {p50:>10.2} {p99:>10.2}",
            ours / raw
        );
        raws.push(raw);
        relays.push(ours);
        ratios.push(ours / raw);
        p50s.push(p50);
        p99s.push(p99);
    }
    let figure = |values: &[f64], places: i32| {
        let (median, min, max) = spread(values);
        serde_json::json!({
            "median": round(median, places),
            "min": round(min, places),
            "max": round(max, places),
        })
    };
    let line = serde_json::json!({
        "benchmark": "kafka",
        "events": events,
        "partitions": PARTITIONS,
        "concurrency": CONCURRENCY,
        "samples": samples,
        "fetch_wait_ms": FETCH_WAIT.as_millis(),
        "rounds": rounds,
        "raw_per_sec": figure(&raws, 0),
        "relay_per_sec": figure(&relays, 0),
        "ratio": figure(&ratios, 3),
        "latency_p50_ms": figure(&p50s, 2),
        "latency_p99_ms": figure(&p99s, 2),
    });
    println!("{line}");
    Ok(())
}
