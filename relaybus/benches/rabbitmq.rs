//! The RabbitMQ relay: events per second from a bus's outbox to a broker's queues, next to the
//! broker's own raw publish of the same messages with the same confirms in the same run; and
//! the time from a publish's commit in one service to the handler of another service that
//! consumes the queue into its own store.
//!
//! Both services use the in-memory store, so the figures are the transport's and the bus's,
//! not a database's. The relay runs as the bus runs it: one delivery per event, each completed
//! after its publisher confirm, `concurrency` deliveries at a time, over four durable queues;
//! the raw baseline publishes the same envelopes with the relay's properties (persistent,
//! mandatory, `message_id`) on one confirming channel to the same four queues, keeping the same
//! number of confirms outstanding.
//!
//! Run with `cargo bench -p relaybus --bench rabbitmq --features rabbitmq,memory`. It uses the
//! broker at `RELAYBUS_BENCH_AMQP_URL` (default `amqp://guest:guest@127.0.0.1:5672`) in a
//! virtual host of its own, made with `rabbitmqctl add_vhost` and `set_permissions` (run on
//! this machine as a user allowed to, such as root) and deleted at the end.
//! `RELAYBUS_BENCH_EVENTS` sets the events per throughput run (default 5000),
//! `RELAYBUS_BENCH_SAMPLES` the latency samples (default 1000), `RELAYBUS_BENCH_ROUNDS` the
//! rounds (default 3; medians with min..max). Run by `cargo test` (without `--bench`), it makes
//! small runs as a smoke test. It ends with one JSON line.

use std::{
    collections::VecDeque,
    time::{Duration, Instant},
};

use lapin::{
    BasicProperties, Confirmation, Connection, ConnectionProperties,
    options::{BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions},
    types::{AMQPValue, FieldTable},
};
use relaybus::{
    BoxError, Event, EventEnvelope, HandlerContext, MemoryEventStore, RelayBus, Subscription,
    transport::rabbitmq::{EVENT_ID_HEADER, EVENT_TYPE_HEADER, RabbitConsumer, RabbitRelay},
};
use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

/// Deliveries in flight, for the relay and the raw baseline alike.
const CONCURRENCY: usize = 32;
/// Queues of the throughput runs, for the relay and the raw baseline alike.
const PARTITIONS: u32 = 4;

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

/// Runs `rabbitmqctl` with `args`, or says what is missing.
fn rabbitmqctl(args: &[&str]) -> Result<(), BoxError> {
    let output = std::process::Command::new("rabbitmqctl")
        .args(args)
        .output()
        .map_err(|e| {
            format!(
                "could not run rabbitmqctl ({e}): the benchmark makes a virtual host of its own \
                 with it; run it where RabbitMQ's command line tools are, as a user allowed to"
            )
        })?;
    if !output.status.success() {
        return Err(format!(
            "rabbitmqctl {args:?} failed: {}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        )
        .into());
    }
    Ok(())
}

/// The benchmark's own virtual host, deleted when dropped.
struct Vhost {
    name: String,
    /// The URI of the virtual host.
    uri: String,
}

impl Vhost {
    async fn new(base: &str) -> Result<Vhost, BoxError> {
        // The broker must answer before anything is made on it.
        let probe = tokio::time::timeout(
            Duration::from_secs(10),
            Connection::connect(base, ConnectionProperties::default()),
        )
        .await
        .map_err(|_| format!("the RabbitMQ broker at {base} did not answer within 10 s"))?
        .map_err(|e| {
            format!("no RabbitMQ broker at {base} ({e}); start one or set RELAYBUS_BENCH_AMQP_URL")
        })?;
        let _ = probe.close(200, "probe".into()).await;
        let name = format!(
            "relaybus-bench-{}-{:08x}",
            std::process::id(),
            rand::random::<u32>()
        );
        rabbitmqctl(&["-q", "add_vhost", &name])?;
        let vhost = Vhost {
            uri: with_vhost(base, &name),
            name,
        };
        rabbitmqctl(&[
            "-q",
            "set_permissions",
            "-p",
            &vhost.name,
            &url_user(base),
            ".*",
            ".*",
            ".*",
        ])?;
        Ok(vhost)
    }

    /// The messages ready in `queues` together.
    async fn ready(&self, queues: &[String]) -> Result<u64, BoxError> {
        let connection = Connection::connect(&self.uri, ConnectionProperties::default()).await?;
        let channel = connection.create_channel().await?;
        let mut ready = 0;
        for queue in queues {
            let declared = channel
                .queue_declare(
                    queue.as_str().into(),
                    QueueDeclareOptions {
                        passive: true,
                        ..Default::default()
                    },
                    FieldTable::default(),
                )
                .await?;
            ready += u64::from(declared.message_count());
        }
        let _ = connection.close(200, "counted".into()).await;
        Ok(ready)
    }
}

impl Drop for Vhost {
    fn drop(&mut self) {
        if let Err(error) = rabbitmqctl(&["-q", "delete_vhost", &self.name]) {
            eprintln!(
                "the benchmark's virtual host {} is left: {error}",
                self.name
            );
        }
    }
}

/// `url` with its virtual host replaced by `vhost`.
fn with_vhost(url: &str, vhost: &str) -> String {
    let authority_at = url.find("://").map_or(0, |at| at + 3);
    let path_at = url[authority_at..]
        .find('/')
        .map_or(url.len(), |at| authority_at + at);
    format!("{}/{vhost}", &url[..path_at])
}

/// The user of `url`, `guest` when it names none.
fn url_user(url: &str) -> String {
    let authority = url.split("://").nth(1).unwrap_or(url);
    match authority.split_once('@') {
        Some((credentials, _)) => credentials.split(':').next().unwrap_or("guest").to_owned(),
        None => "guest".to_owned(),
    }
}

fn tick(n: u64) -> Result<EventEnvelope, BoxError> {
    Ok(EventEnvelope::new(&Tick {
        n,
        note: "a tick of the benchmark".into(),
    })?)
}

/// The raw broker: `events` persistent, mandatory publishes of relay-sized envelopes with the
/// relay's properties over the same four queues, at most `CONCURRENCY` confirms outstanding.
/// Events per second.
async fn raw(vhost: &Vhost, events: usize) -> Result<f64, BoxError> {
    // The relay's topology, declared the relay's way; the publishing is the driver's own.
    let topology = RabbitRelay::builder(&vhost.uri, "raw")
        .partitions(PARTITIONS)
        .build()?;
    topology.declare_topology().await?;
    topology.close().await;
    let connection = Connection::connect(&vhost.uri, ConnectionProperties::default()).await?;
    let channel = connection.create_channel().await?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    let routing_keys = topology.routing_keys();
    let envelopes = (0..events as u64)
        .map(tick)
        .collect::<Result<Vec<_>, _>>()?;

    let started = Instant::now();
    let mut pending = VecDeque::with_capacity(CONCURRENCY);
    for (n, envelope) in envelopes.iter().enumerate() {
        if pending.len() == CONCURRENCY {
            let confirm = pending.pop_front().ok_or("no pending confirm")?;
            confirmed(confirm.await?)?;
        }
        let body = serde_json::to_vec(&serde_json::json!({
            "relaybus": 1,
            "id": envelope.id(),
            "type": envelope.event_type(),
            "created_at": "2026-12-01T08:53:53.123Z",
            "payload": envelope.payload(),
        }))?;
        let mut headers = FieldTable::default();
        headers.insert(
            EVENT_ID_HEADER.into(),
            AMQPValue::LongString(envelope.id().into()),
        );
        headers.insert(
            EVENT_TYPE_HEADER.into(),
            AMQPValue::LongString(envelope.event_type().into()),
        );
        let properties = BasicProperties::default()
            .with_delivery_mode(2)
            .with_content_type("application/json".into())
            .with_app_id("relaybus".into())
            .with_message_id(envelope.id().into())
            .with_type(envelope.event_type().into())
            .with_headers(headers);
        let confirm = channel
            .basic_publish(
                "raw".into(),
                routing_keys[n % routing_keys.len()].as_str().into(),
                BasicPublishOptions {
                    mandatory: true,
                    ..Default::default()
                },
                &body,
                properties,
            )
            .await?;
        pending.push_back(confirm);
    }
    for confirm in pending {
        confirmed(confirm.await?)?;
    }
    let rate = events as f64 / started.elapsed().as_secs_f64();
    let _ = connection.close(200, "done".into()).await;
    let stored = vhost.ready(&routing_keys).await?;
    if stored != events as u64 {
        return Err(format!("raw: the queues hold {stored} of {events} messages").into());
    }
    Ok(rate)
}

/// A confirm that is a plain ack, or why not.
fn confirmed(confirmation: Confirmation) -> Result<(), BoxError> {
    match confirmation {
        Confirmation::Ack(None) => Ok(()),
        other => Err(format!("raw: the broker did not take a message: {other:?}").into()),
    }
}

/// The relay: `events` published into a bus's store, then relayed by `run_until_idle` with
/// `CONCURRENCY` deliveries at a time. Events per second of the relaying alone.
async fn relay(vhost: &Vhost, events: usize) -> Result<f64, BoxError> {
    let relay = RabbitRelay::builder(&vhost.uri, "relay")
        .partitions(PARTITIONS)
        .build()?;
    relay.declare_topology().await?;
    let store = MemoryEventStore::new();
    let bus = RelayBus::builder(store)
        .without_registered_handlers()
        .batch_size(CONCURRENCY as u32)
        .concurrency(CONCURRENCY)
        .subscribe(relay.subscription::<Tick, MemoryEventStore>()?)
        .build()?;
    for chunk in (0..events as u64).collect::<Vec<_>>().chunks(500) {
        let envelopes = chunk
            .iter()
            .map(|&n| tick(n))
            .collect::<Result<Vec<_>, _>>()?;
        bus.publish_all(envelopes).await?;
    }
    let started = Instant::now();
    let report = bus.run_until_idle().max_runs(events + 1).await?;
    let rate = events as f64 / started.elapsed().as_secs_f64();
    relay.close().await;
    let relayed = report.succeeded().count();
    let stored = vhost.ready(&relay.routing_keys()).await?;
    if relayed != events || stored != events as u64 {
        return Err(format!(
            "relay: {relayed} deliveries succeeded and the queues hold {stored}, of {events}"
        )
        .into());
    }
    Ok(rate)
}

/// Commit-to-remote-handler latency: service A's started bus relays each event as it
/// commits; service B's consumer appends it to B's store, whose started bus runs the handler.
/// `samples` events one after another; milliseconds at p50 and p99.
async fn latency(vhost: &Vhost, samples: usize) -> Result<(f64, f64), BoxError> {
    let relay = RabbitRelay::builder(&vhost.uri, "latency").build()?;
    relay.declare_topology().await?;
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
    let queue = relay.routing_keys().remove(0);
    let consumer = RabbitConsumer::builder(&vhost.uri, &queue)
        .fetch_wait(Duration::from_millis(500))
        .build()
        .await?;
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
    let _ = consuming.await;
    consumer.close().await;
    shop.shutdown().await?;
    shipping.shutdown().await?;
    relay.close().await;
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
    let base = std::env::var("RELAYBUS_BENCH_AMQP_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672".to_owned());

    println!(
        "RabbitMQ relay benchmark: {events} events per run over {PARTITIONS} queues, \
         {CONCURRENCY} in flight, {samples} latency samples, {rounds} rounds"
    );
    println!(
        "{:>6} {:>14} {:>14} {:>7} {:>10} {:>10}",
        "round", "raw ev/s", "relay ev/s", "ratio", "p50 ms", "p99 ms"
    );
    let (mut raws, mut relays, mut ratios, mut p50s, mut p99s) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for round_n in 1..=rounds {
        // A fresh virtual host each round, so that no round reads another's queues.
        let vhost = Vhost::new(&base).await?;
        let raw = raw(&vhost, events).await?;
        let ours = relay(&vhost, events).await?;
        let (p50, p99) = latency(&vhost, samples).await?;
        drop(vhost);
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
        "benchmark": "rabbitmq",
        "events": events,
        "partitions": PARTITIONS,
        "concurrency": CONCURRENCY,
        "samples": samples,
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
