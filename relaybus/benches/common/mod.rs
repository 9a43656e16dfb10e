//! What the benchmarks share: a store on a fresh database, the raw-driver baseline and the
//! floor of the document model; latency summaries and the process's memory.

use std::{
    collections::BTreeMap,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use futures::TryStreamExt;
use metrics::{Counter, Gauge, Histogram, Key, KeyName, Metadata, SharedString, Unit};
use mongodb::{
    Client, Collection, Database,
    bson::{Bson, DateTime, Document, doc, oid::ObjectId},
};
use relaybus::{BoxError, MongoEventStore, telemetry};

/// A store on `db`, set up.
pub(crate) async fn store(client: &Client, db: &Database) -> Result<MongoEventStore, BoxError> {
    store_with(client, db, true).await
}

/// A store on `db`, set up with or without the listing indexes.
pub(crate) async fn store_with(
    client: &Client,
    db: &Database,
    listing_indexes: bool,
) -> Result<MongoEventStore, BoxError> {
    let store = MongoEventStore::builder(client.clone())
        .database(db.name())
        .listing_indexes(listing_indexes)
        .build()?;
    store.setup().await?;
    Ok(store)
}

/// The raw driver: insert plain documents (not timed), then read and delete them in batches of
/// `batch`, each worker in its own partition so that workers never read each other's documents.
pub(crate) async fn baseline(
    db: &Database,
    deliveries: usize,
    batch: u32,
    workers: usize,
) -> Result<f64, BoxError> {
    let outbox: Collection<Document> = db.collection("outbox");
    outbox
        .create_index(
            mongodb::IndexModel::builder()
                .keys(doc! { "w": 1, "_id": 1 })
                .build(),
        )
        .await?;
    let documents: Vec<Document> = (0..deliveries)
        .map(|i| {
            doc! {
                "_id": ObjectId::new(),
                "w": (i % workers) as i32,
                "type": "order.placed.v1",
                "payload": { "order": i as i64, "total_cents": 1250 },
                "createdAt": DateTime::now(),
            }
        })
        .collect();
    for chunk in documents.chunks(1_000) {
        outbox.insert_many(chunk.to_vec()).await?;
    }
    let started = Instant::now();
    let mut tasks = Vec::new();
    for w in 0..workers {
        let outbox = outbox.clone();
        tasks.push(tokio::spawn(async move {
            loop {
                let found = read_batch(
                    &outbox,
                    doc! { "w": w as i32 },
                    Some(doc! { "_id": 1 }),
                    batch,
                )
                .await?;
                if found.is_empty() {
                    return Ok::<(), mongodb::error::Error>(());
                }
                let ids = ids_of(&found);
                outbox.delete_many(doc! { "_id": { "$in": ids } }).await?;
            }
        }));
    }
    for task in tasks {
        task.await??;
    }
    Ok(deliveries as f64 / started.elapsed().as_secs_f64())
}

/// The floor of the document model: `workers` workers, each with its own share of the lanes,
/// drain the `deliveries` unkeyed deliveries the caller published to `store`, with the raw
/// driver. Per batch they do only what the document model needs: read the due deliveries of
/// their lanes and their events, record the batch on a lane document, then record the completion
/// time on the events (of the deliveries that do not complete quickly, as the store) and delete
/// the deliveries. Everything the store does to be safe is left
/// out: ranking and taking lanes, fencing, per-key rules. Returns deliveries/s.
pub(crate) async fn floor(
    store: &MongoEventStore,
    deliveries: usize,
    batch: u32,
    workers: usize,
) -> Result<f64, BoxError> {
    let started = Instant::now();
    let mut tasks = Vec::new();
    for w in 0..workers {
        let own: Vec<i32> = (0..256)
            .filter(|lane| *lane as usize % workers == w)
            .collect();
        let floor = Floor::of(store);
        tasks.push(tokio::spawn(async move {
            floor.drain(&own, batch, |_| {}).await
        }));
    }
    for task in tasks {
        task.await??;
    }
    Ok(deliveries as f64 / started.elapsed().as_secs_f64())
}

/// The floor's collections.
#[derive(Clone)]
pub(crate) struct Floor {
    deliveries: Collection<Document>,
    events: Collection<Document>,
    lanes: Collection<Document>,
}

impl Floor {
    /// The collections of `store`.
    pub(crate) fn of(store: &MongoEventStore) -> Floor {
        let db = store.database();
        Floor {
            deliveries: db.collection(&store.collection_name("deliveries")),
            events: db.collection(&store.collection_name("events")),
            lanes: db.collection(&store.collection_name("lanes")),
        }
    }

    /// One worker of [`floor`]: drains the `own` lanes in batches of `batch`, calling `read`
    /// with the size of each batch once it is read (its deliveries would start then).
    pub(crate) async fn drain(
        &self,
        own: &[i32],
        batch: u32,
        mut read: impl FnMut(usize),
    ) -> Result<(), mongodb::error::Error> {
        loop {
            let due = doc! { "laneId": { "$in": own }, "status": "pending", "lane": "ready" };
            let found = read_batch(&self.deliveries, due, None, batch).await?;
            if found.is_empty() {
                return Ok(());
            }
            read(found.len());
            let ids = ids_of(&found);
            let event_ids: Vec<&str> = found
                .iter()
                .filter_map(|d| d.get_str("eventId").ok())
                .collect();
            let _payloads: Vec<Document> = self
                .events
                .find(doc! { "_id": { "$in": &event_ids } })
                .batch_size(batch)
                .await?
                .try_collect()
                .await?;
            self.lanes
                .update_one(
                    doc! { "_id": own[0] },
                    doc! { "$set": { "owner": "floor", "inFlight": &ids }, "$inc": { "epoch": 1 } },
                )
                .await?;
            // The documents require a stamp only for what does not complete quickly: a
            // delivery appended with its fresh event completed within a minute leaves the event
            // as it is.
            let now = DateTime::now();
            let stamped: Vec<&str> = found
                .iter()
                .filter(|d| !completes_quickly(d, now))
                .filter_map(|d| d.get_str("eventId").ok())
                .collect();
            if !stamped.is_empty() {
                self.events
                    .update_many(
                        doc! { "_id": { "$in": &stamped } },
                        doc! { "$max": { "completedAt": now } },
                    )
                    .await?;
            }
            self.deliveries
                .delete_many(doc! { "_id": { "$in": ids } })
                .await?;
        }
    }
}

#[allow(
    dead_code,
    reason = "only the dispatch benchmark runs keys one delivery at a time"
)]
impl Floor {
    /// The lowest pending delivery of `handler` and `key` with its event read, recorded on its
    /// lane; `None` when the key has nothing pending. Ready or parked: an append writes parked
    /// what waits behind a delivery of the same append.
    pub(crate) async fn next_of_key(
        &self,
        handler: &str,
        key: &str,
    ) -> Result<Option<Document>, mongodb::error::Error> {
        let next = self
            .deliveries
            .find_one(doc! { "status": "pending", "handler": handler, "key": key })
            .sort(doc! { "sequence": 1 })
            .await?;
        let Some(next) = next else {
            return Ok(None);
        };
        let _event = self
            .events
            .find_one(doc! { "_id": next.get_str("eventId").unwrap_or_default() })
            .await?;
        self.lanes
            .update_one(
                doc! { "_id": next.get("laneId").cloned() },
                doc! { "$set": { "owner": "floor", "inFlight": [next.get_object_id("_id").ok()] } },
            )
            .await?;
        Ok(Some(next))
    }

    /// The completion of `delivery` in the transaction of `session`: the delivery deleted, its
    /// event stamped unless the completion is quick, as the store's.
    pub(crate) async fn complete_in(
        &self,
        session: &mut mongodb::ClientSession,
        delivery: &Document,
    ) -> Result<(), mongodb::error::Error> {
        self.deliveries
            .delete_one(doc! { "_id": delivery.get_object_id("_id").ok() })
            .session(&mut *session)
            .await?;
        let now = DateTime::now();
        if !completes_quickly(delivery, now) {
            self.events
                .update_one(
                    doc! { "_id": delivery.get_str("eventId").unwrap_or_default() },
                    doc! { "$max": { "completedAt": now } },
                )
                .session(&mut *session)
                .await?;
        }
        Ok(())
    }
}

/// Whether a completion of `delivery` at `now` needs no stamp on its event: it is marked
/// `fresh`, was never requeued, and was created less than a minute before `now`.
fn completes_quickly(delivery: &Document, now: DateTime) -> bool {
    delivery.get_bool("fresh") == Ok(true)
        && !delivery.contains_key("requeued")
        && delivery.get_datetime("createdAt").is_ok_and(|created| {
            (0..60_000).contains(&(now.timestamp_millis() - created.timestamp_millis()))
        })
}

/// Up to `batch` documents of `collection` matching `filter`, in `sort` order if given.
async fn read_batch(
    collection: &Collection<Document>,
    filter: Document,
    sort: Option<Document>,
    batch: u32,
) -> Result<Vec<Document>, mongodb::error::Error> {
    let mut find = collection
        .find(filter)
        .limit(i64::from(batch))
        .batch_size(batch);
    if let Some(sort) = sort {
        find = find.sort(sort);
    }
    find.await?.try_collect().await
}

/// The `_id`s of documents read.
fn ids_of(found: &[Document]) -> Vec<ObjectId> {
    found
        .iter()
        .filter_map(|d| d.get_object_id("_id").ok())
        .collect()
}

/// Percentiles of a set of latencies in milliseconds.
#[allow(
    dead_code,
    reason = "not every benchmark sharing this module measures latency"
)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct Summary {
    pub(crate) p50: f64,
    pub(crate) p99: f64,
    pub(crate) max: f64,
    pub(crate) samples: usize,
}

#[allow(
    dead_code,
    reason = "not every benchmark sharing this module measures latency"
)]
impl Summary {
    /// The nearest-rank percentiles of `ms`; NaN for an empty set.
    pub(crate) fn of(mut ms: Vec<f64>) -> Summary {
        ms.sort_by(f64::total_cmp);
        let at = |q: f64| {
            let last = ms.len().saturating_sub(1);
            ms.get((last as f64 * q).round() as usize)
                .copied()
                .unwrap_or(f64::NAN)
        };
        Summary {
            p50: at(0.5),
            p99: at(0.99),
            max: at(1.0),
            samples: ms.len(),
        }
    }

    /// `p50_ms`, `p99_ms`, `max_ms` (to 0.1 ms; null when there were no samples) and `samples`.
    pub(crate) fn json(&self) -> serde_json::Value {
        let ms = |v: f64| (v * 10.0).round() / 10.0;
        serde_json::json!({
            "p50_ms": ms(self.p50),
            "p99_ms": ms(self.p99),
            "max_ms": ms(self.max),
            "samples": self.samples,
        })
    }
}

/// The process's resident set and its high-water mark, in kB.
#[allow(
    dead_code,
    reason = "not every benchmark sharing this module measures memory"
)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct Memory {
    pub(crate) rss_kb: u64,
    pub(crate) hwm_kb: u64,
}

#[allow(
    dead_code,
    reason = "not every benchmark sharing this module measures memory"
)]
impl Memory {
    /// `VmRSS` and `VmHWM` from `/proc/self/status`; `None` where there is no such file.
    pub(crate) fn now() -> Option<Memory> {
        let status = std::fs::read_to_string("/proc/self/status").ok()?;
        let field = |name: &str| {
            status
                .lines()
                .find_map(|line| line.strip_prefix(name))
                .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse().ok())
        };
        Some(Memory {
            rss_kb: field("VmRSS:")?,
            hwm_kb: field("VmHWM:")?,
        })
    }

    /// The larger of each figure.
    pub(crate) fn max(self, other: Memory) -> Memory {
        Memory {
            rss_kb: self.rss_kb.max(other.rss_kb),
            hwm_kb: self.hwm_kb.max(other.hwm_kb),
        }
    }
}

/// The server's work so far, as `serverStatus` reports it: its CPU time, user and system (on
/// Linux, `extra_info`; `None` elsewhere), the commands it ran, the index keys and documents its
/// queries and writes examined, and the documents it inserted, updated or deleted. Read before
/// and after a run, it gives the server's work for the run ([`ServerWork::per_thousand`]): the
/// CPU time is moved less by the scheduling noise of a shared machine than rates are, and the
/// counts say where it goes.
#[derive(Debug, Clone, Default)]
pub(crate) struct ServerWork {
    cpu: Option<Duration>,
    /// This process's own CPU time (the buses or the floor's workers, and the driver): on a
    /// small machine it shares the cores with the server.
    client_cpu: Option<Duration>,
    commands: u64,
    /// The commands by name, for those the server ran at all.
    commands_by_name: BTreeMap<String, u64>,
    keys_examined: u64,
    docs_examined: u64,
    docs_written: u64,
    /// The claims this process's buses made ([`ClaimCounter`]).
    claims: u64,
    /// The lanes their claims picked from that changed before the record ([`ClaimCounter`]).
    lane_conflicts: u64,
}

/// Commands of the server's own upkeep and of the driver's monitoring, left out of the counts.
const UPKEEP: [&str; 8] = [
    "serverStatus",
    "hello",
    "isMaster",
    "ping",
    "endSessions",
    "replSetHeartbeat",
    "replSetUpdatePosition",
    "<UNKNOWN>",
];

#[allow(
    dead_code,
    reason = "not every benchmark sharing this module measures the server's work"
)]
impl ServerWork {
    /// The server's work so far; `None` when `serverStatus` fails.
    pub(crate) async fn now(client: &Client) -> Option<ServerWork> {
        let status = client
            .database("admin")
            .run_command(doc! { "serverStatus": 1 })
            .await
            .ok()?;
        let number = |value: Option<&Bson>| match value? {
            Bson::Int64(n) => u64::try_from(*n).ok(),
            Bson::Int32(n) => u64::try_from(*n).ok(),
            Bson::Double(n) if *n >= 0.0 => Some(*n as u64),
            _ => None,
        };
        let at = |path: &[&str]| {
            let (last, parents) = path.split_last()?;
            let mut document = &status;
            for name in parents {
                document = document.get_document(name).ok()?;
            }
            number(document.get(last))
        };
        let cpu = at(&["extra_info", "user_time_us"])
            .zip(at(&["extra_info", "system_time_us"]))
            .map(|(user, system)| Duration::from_micros(user + system));
        let commands_by_name: BTreeMap<String, u64> = status
            .get_document("metrics")
            .and_then(|metrics| metrics.get_document("commands"))
            .map(|commands| {
                commands
                    .iter()
                    .filter(|(name, _)| !UPKEEP.contains(&name.as_str()))
                    .filter_map(|(name, counts)| {
                        Some((name.clone(), number(counts.as_document()?.get("total"))?))
                    })
                    .filter(|(_, total)| *total > 0)
                    .collect()
            })
            .unwrap_or_default();
        let commands = commands_by_name.values().sum();
        let written = ["inserted", "updated", "deleted"]
            .iter()
            .filter_map(|name| at(&["metrics", "document", name]))
            .sum();
        Some(ServerWork {
            cpu,
            client_cpu: process_cpu(),
            commands,
            commands_by_name,
            keys_examined: at(&["metrics", "queryExecutor", "scanned"]).unwrap_or(0),
            docs_examined: at(&["metrics", "queryExecutor", "scannedObjects"]).unwrap_or(0),
            docs_written: written,
            claims: CLAIMS.load(Ordering::Relaxed),
            lane_conflicts: LANE_CONFLICTS.load(Ordering::Relaxed),
        })
    }

    /// The work between two readings per 1,000 deliveries, as JSON: `cpu_ms` (to 0.1 ms, `null`
    /// where the server does not report its CPU time), `commands` (and `commands_by_name`, those
    /// of each name the run sent), `keys_examined`,
    /// `docs_examined`, `docs_written`, `claims` (the buses' claims, counted by
    /// [`ClaimCounter`]; `null` when they made none) and `lane_conflicts` (the lanes those
    /// claims picked from that changed before their record, to 0.1; `null` without claims);
    /// `null` without both readings.
    pub(crate) fn per_thousand(
        before: Option<ServerWork>,
        after: Option<ServerWork>,
        deliveries: usize,
    ) -> serde_json::Value {
        let (Some(before), Some(after)) = (before, after) else {
            return serde_json::Value::Null;
        };
        let scale = 1000.0 / deliveries.max(1) as f64;
        let count = |a: u64, b: u64| (a.saturating_sub(b) as f64 * scale).round();
        let cpu_ms = after
            .cpu
            .zip(before.cpu)
            .and_then(|(a, b)| a.checked_sub(b))
            .map(|spent| (spent.as_secs_f64() * 1000.0 * scale * 10.0).round() / 10.0);
        let client_cpu_ms = after
            .client_cpu
            .zip(before.client_cpu)
            .and_then(|(a, b)| a.checked_sub(b))
            .map(|spent| (spent.as_secs_f64() * 1000.0 * scale * 10.0).round() / 10.0);
        let by_name: serde_json::Map<String, serde_json::Value> = after
            .commands_by_name
            .iter()
            .map(|(name, total)| {
                let earlier = before.commands_by_name.get(name).copied().unwrap_or(0);
                (name.clone(), count(*total, earlier))
            })
            .filter(|(_, per_thousand)| *per_thousand > 0.0)
            .map(|(name, per_thousand)| (name, per_thousand.into()))
            .collect();
        serde_json::json!({
            "cpu_ms": cpu_ms,
            "client_cpu_ms": client_cpu_ms,
            "commands": count(after.commands, before.commands),
            "commands_by_name": by_name,
            "keys_examined": count(after.keys_examined, before.keys_examined),
            "docs_examined": count(after.docs_examined, before.docs_examined),
            "docs_written": count(after.docs_written, before.docs_written),
            "claims": (after.claims > before.claims)
                .then(|| (count(after.claims, before.claims) * 10.0).round() / 10.0),
            "lane_conflicts": (after.claims > before.claims).then(|| {
                let lost = after.lane_conflicts.saturating_sub(before.lane_conflicts);
                (lost as f64 * scale * 10.0).round() / 10.0
            }),
        })
    }
}

/// The claims made in this process so far, by every bus: [`ClaimCounter`] counts them.
static CLAIMS: AtomicU64 = AtomicU64::new(0);

/// The lanes those claims picked from that changed before their record
/// ([`telemetry::LANE_CONFLICTS`]), counted by [`ClaimCounter`].
static LANE_CONFLICTS: AtomicU64 = AtomicU64::new(0);

/// A metrics recorder that counts the buses' claims (the records of the receive operation's
/// duration, [`telemetry::OPERATION_DURATION`], that carry no error) and their lane conflicts
/// ([`telemetry::LANE_CONFLICTS`]), and drops every other metric, as no recorder would: a
/// claim costs one atomic increment more. A claim's commands
/// are the same whatever it hands out, so deliveries per claim tell how well a run amortizes
/// them. Installed before any bus is built ([`ClaimCounter::install`]).
#[derive(Debug)]
pub(crate) struct ClaimCounter;

#[allow(
    dead_code,
    reason = "not every benchmark sharing this module counts the buses' claims"
)]
impl ClaimCounter {
    /// Installs the counter as the process's metrics recorder; a second call changes nothing.
    pub(crate) fn install() {
        let _ = metrics::set_global_recorder(ClaimCounter);
    }
}

/// One claim per record.
struct CountClaims;

impl metrics::HistogramFn for CountClaims {
    fn record(&self, _: f64) {
        CLAIMS.fetch_add(1, Ordering::Relaxed);
    }
}

/// The lane conflicts, as counted.
struct CountConflicts;

impl metrics::CounterFn for CountConflicts {
    fn increment(&self, value: u64) {
        LANE_CONFLICTS.fetch_add(value, Ordering::Relaxed);
    }

    fn absolute(&self, _: u64) {}
}

impl metrics::Recorder for ClaimCounter {
    fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}

    fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}

    fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}

    fn register_counter(&self, key: &Key, _: &Metadata<'_>) -> Counter {
        if key.name() == telemetry::LANE_CONFLICTS {
            Counter::from_arc(Arc::new(CountConflicts))
        } else {
            Counter::noop()
        }
    }

    fn register_gauge(&self, _: &Key, _: &Metadata<'_>) -> Gauge {
        Gauge::noop()
    }

    fn register_histogram(&self, key: &Key, _: &Metadata<'_>) -> Histogram {
        let label = |name: &str| {
            key.labels()
                .find(|label| label.key() == name)
                .map(|label| label.value().to_owned())
        };
        let claims = key.name() == telemetry::OPERATION_DURATION
            && label(telemetry::OPERATION_ATTRIBUTE).as_deref() == Some("receive")
            && label(telemetry::ERROR_TYPE_ATTRIBUTE).is_none();
        if claims {
            Histogram::from_arc(Arc::new(CountClaims))
        } else {
            Histogram::noop()
        }
    }
}

/// This process's CPU time so far, user and system, from `/proc/self/stat` (in the kernel's
/// fixed 100 ticks a second); `None` where there is no such file.
fn process_cpu() -> Option<Duration> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // The fields after the command name, which is in parentheses and may hold spaces.
    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    let ticks = |at: usize| fields.get(at)?.parse::<u64>().ok();
    // utime and stime: fields 14 and 15 of the line, 12 and 13 after the name.
    Some(Duration::from_millis((ticks(11)? + ticks(12)?) * 10))
}

/// The server's snapshot history window, in seconds, for the run: set first from
/// `RELAYBUS_BENCH_SNAPSHOT_WINDOW` when that is given (the server keeps it afterwards), then
/// read back. `None` when the server does not say. The window decides how long deleted index
/// entries stay in the claim index's lanes (see the README's "The server's snapshot history
/// window"), so every figure is read with it.
pub(crate) async fn snapshot_window(
    client: &Client,
    store: &MongoEventStore,
) -> Result<Option<u64>, BoxError> {
    if let Ok(text) = std::env::var("RELAYBUS_BENCH_SNAPSHOT_WINDOW") {
        let seconds: i64 = text.trim().parse().map_err(|_| {
            format!(
                "RELAYBUS_BENCH_SNAPSHOT_WINDOW={text:?}: give the server's snapshot history \
                 window in whole seconds, such as 0 or 300"
            )
        })?;
        client
            .database("admin")
            .run_command(doc! {
                "setParameter": 1,
                "minSnapshotHistoryWindowInSeconds": seconds,
            })
            .await?;
    }
    Ok(store
        .snapshot_history_window()
        .await?
        .map(|window| window.as_secs()))
}
