//! The NATS JetStream relay: events per second from a bus's outbox to a stream, next to the
//! broker's own raw publish with the same acknowledgements in the same run; and the time from
//! a publish's commit in one service to the handler of another service that consumes the
//! stream into its own store.
//!
//! Both services use the in-memory store, so the figures are the transport's and the bus's,
//! not a database's. The relay runs as the bus runs it: one delivery per event, each completed
//! after its publish ack, `concurrency` deliveries at a time; the raw baseline publishes the
//! same envelopes with `Nats-Msg-Id`, keeping the same number of acks outstanding.
//!
//! Run with `cargo bench -p relaybus --bench nats --features nats,memory`. It uses the server
//! at `RELAYBUS_BENCH_NATS_URL` (else `RELAYBUS_TEST_NATS_URL`, else `nats://127.0.0.1:4222`),
//! which must run JetStream, in streams of its own that it deletes at the end.
//! `RELAYBUS_BENCH_EVENTS` sets the events per throughput run (default 5000),
//! `RELAYBUS_BENCH_SAMPLES` the latency samples (default 1000), `RELAYBUS_BENCH_ROUNDS` the
//! rounds (default 3; medians with min..max). Run by `cargo test` (without `--bench`), it makes
//! small runs as a smoke test. It ends with one JSON line.

use std::time::{Duration, Instant};

use async_nats::jetstream::{self, stream::StorageType};
use relaybus::{
    BoxError, Event, EventEnvelope, HandlerContext, MemoryEventStore, RelayBus, Subscription,
    transport::nats::{NatsConsumer, NatsRelay},
};
use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

/// Deliveries in flight, for the relay and the raw baseline alike.
const CONCURRENCY: usize = 32;

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

/// A stream of its own for one run, deleted when dropped.
struct Stream {
    jetstream: jetstream::Context,
    name: String,
    prefix: String,
}

impl Stream {
    async fn new(jetstream: &jetstream::Context, run: &str) -> Result<Stream, BoxError> {
        let unique = format!("{}_{:08x}", std::process::id(), rand::random::<u32>());
        let stream = Stream {
            jetstream: jetstream.clone(),
            name: format!("RBBENCH_{run}_{unique}"),
            prefix: format!("relaybus-bench.{run}.{unique}"),
        };
        jetstream
            .create_stream(jetstream::stream::Config {
                name: stream.name.clone(),
                subjects: vec![format!("{}.>", stream.prefix)],
                storage: StorageType::Memory,
                max_age: Duration::from_secs(3_600),
                duplicate_window: Duration::from_secs(120),
                ..Default::default()
            })
            .await
            .map_err(|e| format!("creating a stream failed ({e}); is JetStream on?"))?;
        Ok(stream)
    }

    async fn messages(&self) -> Result<u64, BoxError> {
        let mut stream = self.jetstream.get_stream(&self.name).await?;
        Ok(stream.info().await?.state.messages)
    }

    async fn delete(self) {
        let _ = self.jetstream.delete_stream(&self.name).await;
    }
}

/// The raw broker: `events` publishes of relay-sized envelopes with `Nats-Msg-Id`, at most
/// `CONCURRENCY` acks outstanding. Events per second.
async fn raw(jetstream: &jetstream::Context, events: usize) -> Result<f64, BoxError> {
    let stream = Stream::new(jetstream, "raw").await?;
    let body = serde_json::to_vec(&serde_json::json!({
        "relaybus": 1,
        "id": "0193a6c1-0000-7000-8000-000000000000",
        "type": Tick::TYPE,
        "created_at": "2026-12-01T08:53:53.123Z",
        "payload": { "n": 0, "note": "a tick of the benchmark" },
    }))?;
    let started = Instant::now();
    let mut pending = std::collections::VecDeque::new();
    for n in 0..events {
        if pending.len() == CONCURRENCY {
            let ack: jetstream::context::PublishAckFuture =
                pending.pop_front().ok_or("no pending ack")?;
            ack.await?;
        }
        let mut headers = async_nats::HeaderMap::new();
        headers.insert("Nats-Msg-Id", format!("raw-{n}").as_str());
        let ack = jetstream
            .publish_with_headers(format!("{}.0", stream.prefix), headers, body.clone().into())
            .await?;
        pending.push_back(ack);
    }
    for ack in pending {
        ack.await?;
    }
    let rate = events as f64 / started.elapsed().as_secs_f64();
    let stored = stream.messages().await?;
    stream.delete().await;
    if stored != events as u64 {
        return Err(format!("raw: the stream holds {stored} of {events} messages").into());
    }
    Ok(rate)
}

/// The relay: `events` published into a bus's store, then relayed by `run_until_idle` with
/// `CONCURRENCY` deliveries at a time. Events per second of the relaying alone.
async fn relay(jetstream: &jetstream::Context, events: usize) -> Result<f64, BoxError> {
    let stream = Stream::new(jetstream, "relay").await?;
    let relay = NatsRelay::builder(jetstream.clone(), &stream.prefix)
        .partitions(4)
        .build()?;
    let store = MemoryEventStore::new();
    let bus = RelayBus::builder(store)
        .without_registered_handlers()
        .batch_size(CONCURRENCY as u32)
        .concurrency(CONCURRENCY)
        .subscribe(relay.subscription::<Tick, MemoryEventStore>()?)
        .build()?;
    for chunk in (0..events as u64).collect::<Vec<_>>().chunks(500) {
        let envelopes: Vec<EventEnvelope> = chunk
            .iter()
            .map(|&n| {
                EventEnvelope::new(&Tick {
                    n,
                    note: "a tick of the benchmark".into(),
                })
            })
            .collect::<Result<_, _>>()?;
        bus.publish_all(envelopes).await?;
    }
    let started = Instant::now();
    let report = bus.run_until_idle().max_runs(events + 1).await?;
    let rate = events as f64 / started.elapsed().as_secs_f64();
    let relayed = report.succeeded().count();
    let stored = stream.messages().await?;
    stream.delete().await;
    if relayed != events || stored != events as u64 {
        return Err(format!(
            "relay: {relayed} deliveries succeeded and the stream holds {stored}, of {events}"
        )
        .into());
    }
    Ok(rate)
}

/// Commit-to-remote-handler latency: service A's started bus relays each event as it
/// commits; service B's consumer appends it to B's store, whose started bus runs the handler.
/// `samples` events one after another; milliseconds at p50 and p99.
async fn latency(jetstream: &jetstream::Context, samples: usize) -> Result<(f64, f64), BoxError> {
    let stream = Stream::new(jetstream, "latency").await?;
    let relay = NatsRelay::builder(jetstream.clone(), &stream.prefix).build()?;
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
    let consumer = NatsConsumer::builder(jetstream.clone(), &stream.name, "shipping")
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
    shop.shutdown().await?;
    shipping.shutdown().await?;
    stream.delete().await;
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
    let url = std::env::var("RELAYBUS_BENCH_NATS_URL")
        .or_else(|_| std::env::var("RELAYBUS_TEST_NATS_URL"))
        .unwrap_or_else(|_| "nats://127.0.0.1:4222".to_owned());
    let client = async_nats::connect(&url).await.map_err(|e| {
        format!("no NATS server at {url} ({e}); start one (scripts/nats start) and set RELAYBUS_BENCH_NATS_URL")
    })?;
    let jetstream = jetstream::new(client);

    println!(
        "NATS relay benchmark: {events} events per run, {CONCURRENCY} in flight, {samples} \
         latency samples, {rounds} rounds"
    );
    println!(
        "{:>6} {:>14} {:>14} {:>7} {:>10} {:>10}",
        "round", "raw ev/s", "relay ev/s", "ratio", "p50 ms", "p99 ms"
    );
    let (mut raws, mut relays, mut ratios, mut p50s, mut p99s) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for round_n in 1..=rounds {
        let raw = raw(&jetstream, events).await?;
        let ours = relay(&jetstream, events).await?;
        let (p50, p99) = latency(&jetstream, samples).await?;
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
        "benchmark": "nats",
        "events": events,
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
