//! The inbound consumer: reads a topic's partitions and appends their events to the local
//! store, each batch in one transaction together with the partition's next offset.

use std::{
    fmt,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use rskafka::{
    client::{Client, partition::PartitionClient},
    record::RecordAndOffset,
};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use super::{
    KafkaError,
    assignment::Assignment,
    partition::PartitionReader,
    relay::{create_topic, partition_client},
};
use crate::{
    bus::RelayBus,
    error::BoxError,
    store::{PositionKey, Store},
    transport::{
        BatchReport,
        inbound::{self, owned_work},
    },
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
/// The partitions come from the broker's metadata, and the processes that run the consumer (one
/// name and topic on one database) share them through leads of the local store
/// ([`Leadership`](crate::store::Leadership)), each partition read by one process at a time:
/// see [`run`](Self::run).
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
    pub(super) inner: Arc<ConsumerInner>,
}

pub(super) struct ConsumerInner {
    pub(super) client: Arc<Client>,
    pub(super) topic: String,
    pub(super) name: String,
    pub(super) lease: Duration,
    pub(super) batch_records: usize,
    pub(super) batch_bytes: i32,
    pub(super) fetch_wait: Duration,
    pub(super) fetch_timeout: Duration,
    pub(super) retry_delay: Duration,
    pub(super) dead_letter_topic: Option<String>,
    /// The partitions the running [`run`](KafkaConsumer::run) reads.
    pub(super) assignment: watch::Sender<Vec<u32>>,
    /// Whether a [`run`](KafkaConsumer::run) runs.
    pub(super) running: AtomicBool,
}

impl fmt::Debug for KafkaConsumer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let inner = &self.inner;
        f.debug_struct("KafkaConsumer")
            .field("topic", &inner.topic)
            .field("name", &inner.name)
            .field("lease", &inner.lease)
            .field("batch_records", &inner.batch_records)
            .field("dead_letter_topic", &inner.dead_letter_topic)
            .finish_non_exhaustive()
    }
}

impl KafkaConsumer {
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
    /// of records (waiting up to the [fetch wait](super::KafkaConsumerBuilder::fetch_wait)
    /// when there are none), dead-letters those that are not relaybus events, and appends the
    /// events with the partition's next offset in one transaction. When that transaction
    /// fails, nothing of the batch was written: the report counts its records as retried,
    /// and the next poll takes them again from the stored position.
    ///
    /// # Errors
    ///
    /// [`KafkaError::Position`] when the stored position could not be read;
    /// [`KafkaError::Fetch`] when the fetch failed.
    pub async fn poll<S: Store>(
        &self,
        bus: &RelayBus<S>,
        partition: u32,
    ) -> Result<BatchReport, KafkaError> {
        inbound::run_once(&PartitionReader::new(self, bus, partition, None), bus).await
    }

    /// The connection to a partition's leader, for a fetch from `offset`.
    pub(super) async fn connection(
        &self,
        partition: u32,
        offset: i64,
    ) -> Result<PartitionClient, KafkaError> {
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

    pub(super) fn position_error(&self, partition: u32, source: crate::Error) -> KafkaError {
        KafkaError::Position {
            topic: self.inner.topic.clone(),
            partition,
            source,
        }
    }

    /// Fetches the records from `offset` on, at most the batch size of them.
    pub(super) async fn fetch(
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

    /// Consumes the topic's partitions until `shutdown` is cancelled, sharing them with the
    /// other processes that run this consumer (its name and topic, on the same database): each
    /// partition is read by one process at a time, in a task of its own that starts from the
    /// stored position and takes batch after batch, each appended in one transaction of `bus`'s
    /// store together with the partition's next offset. Returns every batch's report added up.
    ///
    /// The partitions are those the broker's metadata lists for the topic, looked up again
    /// every third of the [lease](super::KafkaConsumerBuilder::lease), so partitions added to
    /// the topic are read too. Each process holds a lead of the store
    /// ([`Leadership`](crate::store::Leadership)) on each partition it reads and one as a
    /// member, renewed every third of the lease, and reads an even share of the partitions; the
    /// share moves only when processes come or go. The partitions of a process that died are
    /// read by another once its leads expired: within the lease and a third. Each append's
    /// transaction keeps its reader's lead
    /// ([`keep_lead`](crate::store::Leadership::keep_lead)), so a reader whose lead another
    /// process took appends nothing more and stops; the new reader goes on from the last
    /// committed offset. [`assignment`](Self::assignment) tells which partitions this process
    /// reads.
    ///
    /// A store that lives in one process (the in-memory store) leads every role: its consumer
    /// reads every partition. Leads belong to a store instance, so run one consumer of a name
    /// and topic per store instance; a second `run` of this consumer while one runs returns at
    /// once with an empty report (and an error in the log).
    ///
    /// On shutdown each reader stops fetching, finishes the batch it holds (dead-letters,
    /// appends, commits), and the leads are given up, so another process takes the partitions
    /// at once. A fetch or append that fails (the broker or the store is unreachable) is
    /// logged, and the reader tries again from the stored position after the
    /// [retry delay](super::KafkaConsumerBuilder::retry_delay).
    ///
    /// # Cancel safety
    ///
    /// Dropping the future instead of cancelling the token loses nothing: a batch whose
    /// transaction did not commit is taken again from the stored position. The readers stop
    /// with the token only, and the leads then expire by themselves.
    pub async fn run<S: Store>(
        &self,
        bus: &RelayBus<S>,
        shutdown: CancellationToken,
    ) -> BatchReport {
        if self.inner.running.swap(true, Ordering::AcqRel) {
            tracing::error!(
                topic = self.inner.topic,
                name = self.inner.name,
                "this Kafka consumer runs already; a second run would read the same partitions"
            );
            return BatchReport::default();
        }
        let _running = Running(&self.inner.running);
        Assignment::new(self, bus, shutdown).run().await
    }

    /// The partitions this process reads, as [`run`](Self::run) takes and gives them up: a
    /// receiver whose value changes with each, sorted (empty while the consumer does not run).
    pub fn assignment(&self) -> watch::Receiver<Vec<u32>> {
        self.inner.assignment.subscribe()
    }

    /// The partitions of the topic, as the broker's metadata lists them.
    ///
    /// # Errors
    ///
    /// [`KafkaError::Topic`] when the broker could not be reached or answered within the
    /// [fetch timeout](super::KafkaConsumerBuilder::fetch_timeout), or lists no such topic.
    pub async fn discover_partitions(&self) -> Result<Vec<u32>, KafkaError> {
        let inner = &self.inner;
        let failed = |source: BoxError| KafkaError::Topic {
            topic: inner.topic.clone(),
            what: "listing its partitions",
            source,
        };
        let topics =
            match tokio::time::timeout(inner.fetch_timeout, inner.client.list_topics()).await {
                Ok(Ok(topics)) => topics,
                Ok(Err(error)) => return Err(failed(error.into())),
                Err(_) => {
                    return Err(failed(
                        format!("no answer within {:?}", inner.fetch_timeout).into(),
                    ));
                }
            };
        let topic = topics
            .into_iter()
            .find(|topic| topic.name == inner.topic)
            .ok_or_else(|| failed("the broker lists no such topic".into()))?;
        Ok(topic
            .partitions
            .into_iter()
            .filter_map(|partition| u32::try_from(partition).ok())
            .collect())
    }

    /// Consumes one partition until `shutdown` is cancelled, as each reader of
    /// [`run`](Self::run) does, but without a lead: for a partition this process alone reads.
    pub async fn run_partition<S: Store>(
        &self,
        bus: &RelayBus<S>,
        partition: u32,
        shutdown: CancellationToken,
    ) -> BatchReport {
        inbound::run(
            &PartitionReader::new(self, bus, partition, None),
            bus,
            shutdown,
        )
        .await
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
}

/// Marks a consumer as not running when its run ends or is dropped.
struct Running<'a>(&'a AtomicBool);

impl Drop for Running<'_> {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
    }
}
