//! The inbound consumer: reads a topic's partitions and appends their events to the local
//! store, each batch in one transaction together with the partition's next offset.

use std::{collections::HashSet, fmt, sync::Arc, time::Duration};

use futures::future::BoxFuture;
use rskafka::{
    client::{
        Client,
        partition::{Compression, PartitionClient},
    },
    record::{Record, RecordAndOffset},
};
use tokio_util::sync::CancellationToken;

use super::{
    KafkaError,
    error::check_topic,
    relay::{create_topic, partition_client},
    wire::{self, DEAD_LETTER_REASON_HEADER, DEAD_LETTER_SOURCE_HEADER},
};
use crate::{
    bus::RelayBus,
    error::{BoxError, Error},
    event::EventEnvelope,
    store::{Appended, MAX_POSITION_NAME_BYTES, PositionKey, Store},
    transport::wire::decode,
};

/// The most records one batch takes.
pub const MAX_BATCH_RECORDS: usize = 1_000;

/// Reads the partitions of a Kafka topic and appends their events to the local store with
/// their original ids, so that the local bus's handlers run them through the normal
/// dispatcher.
///
/// Kafka keeps no position for it (rskafka has no consumer groups): the consumer keeps each
/// partition's next offset in the local store
/// ([`advance_consumer_position`](crate::store::ConsumerPositions::advance_consumer_position)),
/// written in the transaction that appends the batch, and starts from it. A batch's events and the
/// offset after them commit together or not at all, so each record is taken into the store exactly
/// once, whenever the consumer stops.
///
/// Cheap to clone.
///
/// See the [module documentation](super) for the record format and the guarantees.
///
/// # Example
///
/// ```no_run
/// # use relaybus::{RelayBus, Store};
/// use std::sync::Arc;
/// use relaybus::transport::kafka::{KafkaConsumer, rskafka};
/// use tokio_util::sync::CancellationToken;
///
/// # async fn example<S: Store>(bus: RelayBus<S>) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// let client = rskafka::client::ClientBuilder::new(vec!["127.0.0.1:9092".to_owned()])
///     .build()
///     .await?;
/// let consumer = KafkaConsumer::builder(Arc::new(client), "orders.events", "shipping")
///     .partitions(16)
///     .dead_letter_topic("orders.dead")
///     .build()?;
/// let shutdown = CancellationToken::new();
/// bus.start().await?;
/// let report = consumer.run(&bus, shutdown.child_token()).await;
/// println!("appended {} events", report.appended);
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct KafkaConsumer {
    inner: Arc<ConsumerInner>,
}

struct ConsumerInner {
    client: Arc<Client>,
    topic: String,
    name: String,
    partitions: u32,
    batch_records: usize,
    batch_bytes: i32,
    fetch_wait: Duration,
    fetch_timeout: Duration,
    retry_delay: Duration,
    dead_letter_topic: Option<String>,
}

impl fmt::Debug for KafkaConsumer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let inner = &self.inner;
        f.debug_struct("KafkaConsumer")
            .field("topic", &inner.topic)
            .field("name", &inner.name)
            .field("partitions", &inner.partitions)
            .field("batch_records", &inner.batch_records)
            .field("dead_letter_topic", &inner.dead_letter_topic)
            .finish_non_exhaustive()
    }
}

/// What one batch did, or, from [`KafkaConsumer::run`], every batch of the run added up.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct BatchReport {
    /// Records taken from the broker.
    pub fetched: usize,
    /// Events the local store did not hold, appended with their deliveries.
    pub appended: usize,
    /// Events the local store held already (the relay produced the event twice, or another
    /// consumer of the store took it): nothing new was written.
    pub duplicates: usize,
    /// Records that are not relaybus events, or whose event the store refuses, produced to the
    /// dead-letter topic with their reason.
    pub dead_lettered: usize,
    /// Records that could not be read and could not be dead-lettered (no dead-letter topic,
    /// or its produce failed): skipped, with the reason logged at error level.
    pub skipped: usize,
    /// The partition's next offset after the batch, as stored (`None` when nothing was taken).
    pub next_offset: Option<i64>,
}

impl BatchReport {
    fn add(&mut self, other: &BatchReport) {
        self.fetched += other.fetched;
        self.appended += other.appended;
        self.duplicates += other.duplicates;
        self.dead_lettered += other.dead_lettered;
        self.skipped += other.skipped;
        if other.next_offset.is_some() {
            self.next_offset = other.next_offset;
        }
    }
}

/// One record of a batch, read.
enum Item {
    Event(EventEnvelope),
    Unreadable(String),
}

impl KafkaConsumer {
    /// Starts building a consumer of `topic` named `name`: the name keys its stored offsets,
    /// so give each consuming service its own and keep it stable.
    pub fn builder(
        client: Arc<Client>,
        topic: impl Into<String>,
        name: impl Into<String>,
    ) -> KafkaConsumerBuilder {
        KafkaConsumerBuilder {
            client,
            topic: topic.into(),
            name: name.into(),
            partitions: 1,
            batch_records: 256,
            batch_bytes: 4 << 20,
            fetch_wait: Duration::from_millis(500),
            fetch_timeout: Duration::from_secs(10),
            retry_delay: Duration::from_secs(1),
            dead_letter_topic: None,
        }
    }

    /// The stored next offset of `partition`: where the consumer goes on from, or `None` when
    /// it took nothing there yet (it then starts at offset 0).
    ///
    /// # Errors
    ///
    /// The store's errors.
    pub async fn position<S: Store>(
        &self,
        bus: &RelayBus<S>,
        partition: u32,
    ) -> crate::Result<Option<i64>> {
        let inner = Arc::clone(&self.inner);
        let store = bus.store().clone();
        bus.transaction(owned_work::<S, _, _>(move |session| {
            let inner = Arc::clone(&inner);
            let store = store.clone();
            Box::pin(async move {
                let key = PositionKey::new(&inner.name, &inner.topic, partition);
                store.consumer_position(session, &key).await
            })
        }))
        .await
    }

    /// Takes one batch of `partition` from its stored position: fetches up to the batch size
    /// of records (waiting up to the [fetch wait](KafkaConsumerBuilder::fetch_wait) when
    /// there are none), dead-letters those that are not relaybus events, and appends the
    /// events with the partition's next offset in one transaction.
    ///
    /// # Errors
    ///
    /// [`KafkaError::Fetch`] when the fetch failed; [`KafkaError::Append`] when the
    /// transaction failed (nothing of the batch was written).
    pub async fn poll<S: Store>(
        &self,
        bus: &RelayBus<S>,
        partition: u32,
    ) -> Result<BatchReport, KafkaError> {
        let from = self
            .position(bus, partition)
            .await
            .map_err(|source| self.append_error(partition, source))?
            .unwrap_or(0);
        let connection = self.connection(partition, from).await?;
        let records = self.fetch(&connection, partition, from).await?;
        self.take(bus, partition, records).await
    }

    async fn connection(&self, partition: u32, offset: i64) -> Result<PartitionClient, KafkaError> {
        partition_client(&self.inner.client, &self.inner.topic, partition)
            .await
            .map_err(|error| self.fetch_error(partition, offset, error.into()))
    }

    fn fetch_error(&self, partition: u32, offset: i64, source: BoxError) -> KafkaError {
        KafkaError::Fetch {
            topic: self.inner.topic.clone(),
            partition,
            offset,
            source,
        }
    }

    fn append_error(&self, partition: u32, source: Error) -> KafkaError {
        KafkaError::Append {
            topic: self.inner.topic.clone(),
            partition,
            source,
        }
    }

    /// Fetches the records from `offset` on, at most the batch size of them.
    async fn fetch(
        &self,
        connection: &PartitionClient,
        partition: u32,
        offset: i64,
    ) -> Result<Vec<RecordAndOffset>, KafkaError> {
        let inner = &self.inner;
        let wait_ms = i32::try_from(inner.fetch_wait.as_millis()).unwrap_or(i32::MAX);
        let fetch = connection.fetch_records(offset, 1..inner.batch_bytes, wait_ms);
        let (mut records, _high_watermark) =
            match tokio::time::timeout(inner.fetch_wait + inner.fetch_timeout, fetch).await {
                Ok(Ok(fetched)) => fetched,
                Ok(Err(error)) => return Err(self.fetch_error(partition, offset, error.into())),
                Err(_) => {
                    return Err(self.fetch_error(
                        partition,
                        offset,
                        format!(
                            "no answer within {:?}",
                            inner.fetch_wait + inner.fetch_timeout
                        )
                        .into(),
                    ));
                }
            };
        records.retain(|record| record.offset >= offset);
        records.sort_by_key(|record| record.offset);
        records.truncate(inner.batch_records);
        Ok(records)
    }

    /// Dead-letters the unreadable records, then appends the events with the next offset in
    /// one transaction; when the store refuses the batch for an event's sake, one record per
    /// transaction, dead-lettering the refused ones.
    async fn take<S: Store>(
        &self,
        bus: &RelayBus<S>,
        partition: u32,
        records: Vec<RecordAndOffset>,
    ) -> Result<BatchReport, KafkaError> {
        let mut report = BatchReport {
            fetched: records.len(),
            ..BatchReport::default()
        };
        let Some(last) = records.last().map(|record| record.offset) else {
            return Ok(report);
        };
        let items: Vec<(i64, Item)> = records
            .iter()
            .map(|record| {
                let item = match record.record.value.as_deref() {
                    None => {
                        Item::Unreadable("not a relaybus event: the record has no value".to_owned())
                    }
                    Some(value) => match decode(value) {
                        Ok(decoded) => Item::Event(decoded.envelope),
                        Err(reason) => Item::Unreadable(reason),
                    },
                };
                (record.offset, item)
            })
            .collect();
        for (offset, item) in &items {
            if let Item::Unreadable(reason) = item {
                let record = records.iter().find(|r| r.offset == *offset);
                self.dead_letter(
                    partition,
                    *offset,
                    record.map(|r| &r.record),
                    reason,
                    &mut report,
                )
                .await;
            }
        }
        let events: Vec<(i64, EventEnvelope)> = items
            .into_iter()
            .filter_map(|(offset, item)| match item {
                Item::Event(envelope) => Some((offset, envelope)),
                Item::Unreadable(_) => None,
            })
            .collect();
        match self.commit(bus, partition, &events, last + 1).await {
            Ok(appended) => count(&appended, &mut report),
            Err(error @ (Error::EventValidation(_) | Error::InvalidArgument(_))) => {
                tracing::debug!(%error, "the store refused the batch; appending one by one");
                let mut next = events.first().map_or(last + 1, |(offset, _)| *offset);
                for (offset, envelope) in &events {
                    let one = [(*offset, envelope.clone())];
                    match self.commit(bus, partition, &one, offset + 1).await {
                        Ok(appended) => count(&appended, &mut report),
                        Err(error @ (Error::EventValidation(_) | Error::InvalidArgument(_))) => {
                            let reason = format!(
                                "the local store refuses event {:?} for good: {error}",
                                envelope.id()
                            );
                            let record = records.iter().find(|r| r.offset == *offset);
                            self.dead_letter(
                                partition,
                                *offset,
                                record.map(|r| &r.record),
                                &reason,
                                &mut report,
                            )
                            .await;
                            self.commit(bus, partition, &[], offset + 1)
                                .await
                                .map_err(|source| self.append_error(partition, source))?;
                        }
                        Err(source) => return Err(self.append_error(partition, source)),
                    }
                    next = offset + 1;
                }
                if next <= last {
                    self.commit(bus, partition, &[], last + 1)
                        .await
                        .map_err(|source| self.append_error(partition, source))?;
                }
            }
            Err(source) => return Err(self.append_error(partition, source)),
        }
        report.next_offset = Some(last + 1);
        Ok(report)
    }

    /// One transaction: the events at or past the stored position, appended, and the position
    /// moved to `next`. Returns the appends and how many events the batch held twice.
    async fn commit<S: Store>(
        &self,
        bus: &RelayBus<S>,
        partition: u32,
        events: &[(i64, EventEnvelope)],
        next: i64,
    ) -> crate::Result<(Vec<Appended>, usize)> {
        let inner = Arc::clone(&self.inner);
        let owned_bus = bus.clone();
        let events = events.to_vec();
        bus.transaction(owned_work::<S, _, _>(move |session| {
            let inner = Arc::clone(&inner);
            let bus = owned_bus.clone();
            let events = events.clone();
            Box::pin(async move {
                let key = PositionKey::new(&inner.name, &inner.topic, partition);
                let store = bus.store();
                let stored = store.consumer_position(session, &key).await?.unwrap_or(0);
                // A batch may hold one event twice (the relay produced it twice): append it
                // once.
                let mut ids = HashSet::new();
                let envelopes: Vec<EventEnvelope> = events
                    .iter()
                    .filter(|(offset, envelope)| *offset >= stored && ids.insert(envelope.id()))
                    .map(|(_, envelope)| envelope.clone())
                    .collect();
                let repeats = events
                    .iter()
                    .filter(|(offset, _)| *offset >= stored)
                    .count()
                    - envelopes.len();
                let appended = if envelopes.is_empty() {
                    Vec::new()
                } else {
                    bus.publish_all(envelopes).session(session).await?
                };
                store
                    .advance_consumer_position(session, &key, next, bus.now())
                    .await?;
                Ok((appended, repeats))
            })
        }))
        .await
    }

    /// Produces an unreadable record to the dead-letter topic with its reason and source; logs
    /// it when there is no such topic or the produce fails.
    async fn dead_letter(
        &self,
        partition: u32,
        offset: i64,
        record: Option<&Record>,
        reason: &str,
        report: &mut BatchReport,
    ) {
        let inner = &self.inner;
        let source = format!("{}:{partition}:{offset}", inner.topic);
        let Some(topic) = &inner.dead_letter_topic else {
            tracing::error!(
                source,
                reason,
                "skipping a record that is not a relaybus event"
            );
            report.skipped += 1;
            return;
        };
        let mut headers = record.map(|r| r.headers.clone()).unwrap_or_default();
        headers.insert(
            DEAD_LETTER_REASON_HEADER.to_owned(),
            reason.as_bytes().to_vec(),
        );
        headers.insert(
            DEAD_LETTER_SOURCE_HEADER.to_owned(),
            source.as_bytes().to_vec(),
        );
        let dead = Record {
            key: record.and_then(|r| r.key.clone()),
            value: record.and_then(|r| r.value.clone()),
            headers,
            timestamp: record.map_or_else(|| wire::timestamp(0), |r| r.timestamp),
        };
        let produce = async {
            let connection = partition_client(&inner.client, topic, 0).await?;
            connection
                .produce(vec![dead], Compression::NoCompression)
                .await
        };
        match tokio::time::timeout(inner.fetch_timeout, produce).await {
            Ok(Ok(_)) => report.dead_lettered += 1,
            outcome => {
                let error = match outcome {
                    Ok(Err(error)) => error.to_string(),
                    _ => format!("no acknowledgement within {:?}", inner.fetch_timeout),
                };
                tracing::error!(
                    source,
                    reason,
                    dead_letter_topic = topic,
                    error,
                    "dead-lettering a record that is not a relaybus event failed; skipping it"
                );
                report.skipped += 1;
            }
        }
    }

    /// Consumes every partition until `shutdown` is cancelled, one task per partition: each
    /// starts from its stored position and takes batch after batch, each appended in one
    /// transaction of `bus`'s store together with the partition's next offset. Returns every
    /// batch's report added up.
    ///
    /// On shutdown each task stops fetching, finishes the batch it holds (dead-letters,
    /// appends, commits) and returns; it notices the token at once while it waits for
    /// records. A fetch or append that fails (the broker or the store is unreachable) is
    /// logged, and the task tries again from the stored position after the
    /// [retry delay](KafkaConsumerBuilder::retry_delay).
    ///
    /// # Cancel safety
    ///
    /// Dropping the future instead of cancelling the token loses nothing: a batch whose
    /// transaction did not commit is taken again from the stored position.
    pub async fn run<S: Store>(
        &self,
        bus: &RelayBus<S>,
        shutdown: CancellationToken,
    ) -> BatchReport {
        let mut tasks = tokio::task::JoinSet::new();
        for partition in 0..self.inner.partitions {
            let consumer = self.clone();
            let bus = bus.clone();
            let shutdown = shutdown.clone();
            tasks.spawn(async move { consumer.run_partition(&bus, partition, shutdown).await });
        }
        let mut total = BatchReport::default();
        while let Some(done) = tasks.join_next().await {
            match done {
                Ok(report) => total.add(&report),
                Err(error) => {
                    tracing::error!(%error, "a partition task of the Kafka consumer failed")
                }
            }
        }
        total.next_offset = None;
        total
    }

    /// Consumes one partition until `shutdown` is cancelled: what each task of
    /// [`run`](Self::run) does.
    pub async fn run_partition<S: Store>(
        &self,
        bus: &RelayBus<S>,
        partition: u32,
        shutdown: CancellationToken,
    ) -> BatchReport {
        let mut total = BatchReport::default();
        let mut state: Option<(PartitionClient, i64)> = None;
        while !shutdown.is_cancelled() {
            let step = async {
                let (connection, from) = match state.take() {
                    Some(state) => state,
                    None => {
                        let from = self
                            .position(bus, partition)
                            .await
                            .map_err(|source| self.append_error(partition, source))?
                            .unwrap_or(0);
                        (self.connection(partition, from).await?, from)
                    }
                };
                let records = self.fetch(&connection, partition, from).await?;
                Ok::<_, KafkaError>((connection, from, records))
            };
            let fetched = tokio::select! {
                fetched = step => fetched,
                () = shutdown.cancelled() => break,
            };
            let outcome = match fetched {
                Ok((connection, from, records)) => match self.take(bus, partition, records).await {
                    Ok(report) => {
                        let next = report.next_offset.unwrap_or(from);
                        total.add(&report);
                        state = Some((connection, next));
                        Ok(())
                    }
                    Err(error) => Err(error),
                },
                Err(error) => Err(error),
            };
            if let Err(error) = outcome {
                tracing::warn!(%error, "the Kafka consumer tries again from its stored position");
                tokio::select! {
                    () = tokio::time::sleep(self.inner.retry_delay) => {}
                    () = shutdown.cancelled() => break,
                }
            }
        }
        total
    }

    /// Creates the dead-letter topic (one partition, replication factor `replication_factor`)
    /// when the consumer has one; a topic that exists is left as it is.
    ///
    /// # Errors
    ///
    /// [`KafkaError::Topic`] when the broker refused or could not be reached.
    pub async fn create_dead_letter_topic(
        &self,
        replication_factor: i16,
    ) -> Result<(), KafkaError> {
        match &self.inner.dead_letter_topic {
            Some(topic) => create_topic(&self.inner.client, topic, 1, replication_factor).await,
            None => Ok(()),
        }
    }

    /// The topic consumed.
    pub fn topic(&self) -> &str {
        &self.inner.topic
    }

    /// The consumer's name, which keys its stored positions.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// The number of partitions read.
    pub fn partitions(&self) -> u32 {
        self.inner.partitions
    }
}

/// The body of a transaction whose futures own what they use (besides the session), so that
/// they are `Send` and a consumer's tasks can be spawned.
fn owned_work<S, R, F>(work: F) -> F
where
    S: Store,
    F: for<'s> FnMut(&'s mut S::Session) -> BoxFuture<'s, crate::Result<R>>,
{
    work
}

/// Adds the appends of one transaction to a report.
fn count((appended, repeats): &(Vec<Appended>, usize), report: &mut BatchReport) {
    report.duplicates += repeats;
    for appended in appended {
        if appended.created {
            report.appended += 1;
        } else {
            report.duplicates += 1;
        }
    }
}

/// Builds a [`KafkaConsumer`]; made by [`KafkaConsumer::builder`].
#[must_use]
pub struct KafkaConsumerBuilder {
    client: Arc<Client>,
    topic: String,
    name: String,
    partitions: u32,
    batch_records: usize,
    batch_bytes: i32,
    fetch_wait: Duration,
    fetch_timeout: Duration,
    retry_delay: Duration,
    dead_letter_topic: Option<String>,
}

impl fmt::Debug for KafkaConsumerBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KafkaConsumerBuilder")
            .field("topic", &self.topic)
            .field("name", &self.name)
            .field("partitions", &self.partitions)
            .finish_non_exhaustive()
    }
}

impl KafkaConsumerBuilder {
    /// How many partitions the topic has, 1 by default (1 to 1,024): [`run`](KafkaConsumer::run)
    /// reads partitions `0..partitions`, one task each.
    pub fn partitions(mut self, partitions: u32) -> Self {
        self.partitions = partitions;
        self
    }

    /// How many records one batch (one transaction) takes at most, 256 by default (1 to
    /// 1,000).
    pub fn batch_records(mut self, records: usize) -> Self {
        self.batch_records = records;
        self
    }

    /// How many bytes one fetch asks the broker for at most, 4 MiB by default (1 KiB to
    /// 64 MiB). A record larger than this is still returned whole.
    pub fn batch_bytes(mut self, bytes: i32) -> Self {
        self.batch_bytes = bytes;
        self
    }

    /// How long the broker holds a fetch when there are no records, 500 ms by default (1 ms
    /// to 1 minute).
    pub fn fetch_wait(mut self, wait: Duration) -> Self {
        self.fetch_wait = wait;
        self
    }

    /// How long a fetch may take beyond the [fetch wait](Self::fetch_wait) before it fails,
    /// and a dead letter's produce in all, 10 seconds by default (1 ms to 10 minutes): rskafka
    /// retries a failed request by itself, this bounds the whole.
    pub fn fetch_timeout(mut self, timeout: Duration) -> Self {
        self.fetch_timeout = timeout;
        self
    }

    /// How long a partition's task waits after a failed fetch or append before it tries
    /// again, 1 second by default (at most 1 hour).
    pub fn retry_delay(mut self, delay: Duration) -> Self {
        self.retry_delay = delay;
        self
    }

    /// Where records that are not relaybus events, or whose event the store refuses, go:
    /// produced to partition 0 of this topic (key, value and headers as they came, with
    /// [`DEAD_LETTER_REASON_HEADER`] and [`DEAD_LETTER_SOURCE_HEADER`]) before the batch's
    /// transaction. Without one, or when that produce fails, such a record is skipped and the
    /// reason logged at error level. Either way the records behind it are appended.
    pub fn dead_letter_topic(mut self, topic: impl Into<String>) -> Self {
        self.dead_letter_topic = Some(topic.into());
        self
    }

    /// Validates the settings and builds the consumer. Makes no broker or store call.
    ///
    /// # Errors
    ///
    /// [`KafkaError::InvalidConfiguration`] for an invalid topic or dead-letter topic name,
    /// an empty consumer name or one over 255 bytes or with a control character, or a setting
    /// out of range.
    pub fn build(self) -> Result<KafkaConsumer, KafkaError> {
        check_topic("topic", &self.topic)?;
        if let Some(topic) = &self.dead_letter_topic {
            check_topic("dead_letter_topic", topic)?;
            if *topic == self.topic {
                return Err(KafkaError::invalid(
                    "dead_letter_topic",
                    "it is the topic consumed; give the dead letters a topic of their own",
                ));
            }
        }
        if self.name.is_empty()
            || self.name.len() > MAX_POSITION_NAME_BYTES
            || self.name.chars().any(char::is_control)
        {
            return Err(KafkaError::invalid(
                "name",
                format!(
                    "{:?} cannot name a consumer; use 1 to 255 bytes without control characters",
                    self.name
                ),
            ));
        }
        let range = |option: &'static str, ok: bool, what: String| {
            if ok {
                Ok(())
            } else {
                Err(KafkaError::invalid(option, what))
            }
        };
        range(
            "partitions",
            (1..=super::MAX_PARTITIONS).contains(&self.partitions),
            format!("{} is out of range; use 1 to 1,024", self.partitions),
        )?;
        range(
            "batch_records",
            (1..=MAX_BATCH_RECORDS).contains(&self.batch_records),
            format!(
                "{} is out of range; use 1 to {MAX_BATCH_RECORDS}",
                self.batch_records
            ),
        )?;
        range(
            "batch_bytes",
            (1 << 10..=64 << 20).contains(&self.batch_bytes),
            format!("{} is out of range; use 1 KiB to 64 MiB", self.batch_bytes),
        )?;
        range(
            "fetch_wait",
            (Duration::from_millis(1)..=Duration::from_secs(60)).contains(&self.fetch_wait),
            format!(
                "{:?} is out of range; use 1 ms to 1 minute",
                self.fetch_wait
            ),
        )?;
        range(
            "fetch_timeout",
            (Duration::from_millis(1)..=Duration::from_secs(600)).contains(&self.fetch_timeout),
            format!(
                "{:?} is out of range; use 1 ms to 10 minutes",
                self.fetch_timeout
            ),
        )?;
        range(
            "retry_delay",
            self.retry_delay <= Duration::from_secs(3600),
            format!("{:?} is out of range; use at most 1 hour", self.retry_delay),
        )?;
        Ok(KafkaConsumer {
            inner: Arc::new(ConsumerInner {
                client: self.client,
                topic: self.topic,
                name: self.name,
                partitions: self.partitions,
                batch_records: self.batch_records,
                batch_bytes: self.batch_bytes,
                fetch_wait: self.fetch_wait,
                fetch_timeout: self.fetch_timeout,
                retry_delay: self.retry_delay,
                dead_letter_topic: self.dead_letter_topic,
            }),
        })
    }
}
