//! The Kafka side of the inbound driver: one partition of a topic, read from the offset the
//! local store keeps. The driver writes the offset after each batch in the transaction that
//! appends it; dead letters are produced to a topic before that transaction; settling goes on
//! from the batch's next offset, or, after a failed append, from the stored one.

use std::{
    fmt,
    sync::{Arc, Mutex},
    time::Duration,
};

use rskafka::{
    client::partition::{Compression, PartitionClient},
    record::{Record, RecordAndOffset},
};

use super::{
    KafkaConsumer, KafkaError,
    relay::partition_client,
    wire::{DEAD_LETTER_REASON_HEADER, DEAD_LETTER_SOURCE_HEADER},
};
use crate::{
    bus::RelayBus,
    error::BoxError,
    store::Store,
    transport::inbound::{Broker, Fence, Position, Settlement},
};

/// One partition of a [`KafkaConsumer`], read into the store of `bus`.
pub(super) struct PartitionReader<S: Store> {
    consumer: KafkaConsumer,
    bus: RelayBus<S>,
    position: Position,
    /// `<topic>:<partition>`, for logs.
    source: String,
    /// Where the next fetch starts without asking the store, after a batch that went through.
    resume: Arc<Mutex<Option<Resume>>>,
}

/// The connection to a partition's leader and the offset to fetch from. A batch holds it from
/// its fetch to its settlement; dropped unsettled, the next fetch reads the stored position.
pub(super) struct Resume {
    connection: PartitionClient,
    next: i64,
}

impl fmt::Debug for Resume {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Resume")
            .field("next", &self.next)
            .finish_non_exhaustive()
    }
}

impl<S: Store> PartitionReader<S> {
    /// A reader of `partition`, fenced by the lead `fence` when the processes of the consumer
    /// share the partitions.
    pub(super) fn new(
        consumer: &KafkaConsumer,
        bus: &RelayBus<S>,
        partition: u32,
        fence: Option<Fence>,
    ) -> Self {
        let inner = &consumer.inner;
        PartitionReader {
            consumer: consumer.clone(),
            bus: bus.clone(),
            position: Position {
                consumer: inner.name.clone(),
                source: inner.topic.clone(),
                partition,
                fence,
            },
            source: format!("{}:{partition}", inner.topic),
            resume: Arc::new(Mutex::new(None)),
        }
    }

    fn take_resume(&self) -> Option<Resume> {
        self.resume.lock().unwrap_or_else(|e| e.into_inner()).take()
    }
}

impl<S: Store> fmt::Debug for PartitionReader<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PartitionReader")
            .field("source", &self.source)
            .finish_non_exhaustive()
    }
}

impl<S: Store> Clone for PartitionReader<S> {
    fn clone(&self) -> Self {
        PartitionReader {
            consumer: self.consumer.clone(),
            bus: self.bus.clone(),
            position: self.position.clone(),
            source: self.source.clone(),
            resume: Arc::clone(&self.resume),
        }
    }
}

impl<S: Store> Broker for PartitionReader<S> {
    type Message = RecordAndOffset;
    type Hold = Resume;
    type Error = KafkaError;

    // Nothing a fetch takes is out at the broker: the stored position says what was taken.
    const FETCH_STOPS_ON_SHUTDOWN: bool = true;

    async fn fetch(&self) -> Result<(Vec<RecordAndOffset>, Resume), KafkaError> {
        let partition = self.position.partition;
        let resume = match self.take_resume() {
            Some(resume) => resume,
            None => {
                let next = self
                    .consumer
                    .position(&self.bus, partition)
                    .await
                    .map_err(|source| self.consumer.position_error(partition, source))?
                    .unwrap_or(0);
                let connection = self.consumer.connection(partition, next).await?;
                Resume { connection, next }
            }
        };
        let records = self
            .consumer
            .fetch(&resume.connection, partition, resume.next)
            .await?;
        Ok((records, resume))
    }

    fn body(record: &RecordAndOffset) -> Result<&[u8], &'static str> {
        record
            .record
            .value
            .as_deref()
            .ok_or("not a relaybus event: the record has no value")
    }

    fn redelivered(_record: &RecordAndOffset) -> bool {
        false
    }

    fn position(&self) -> Option<&Position> {
        Some(&self.position)
    }

    fn offset(record: &RecordAndOffset) -> i64 {
        record.offset
    }

    /// Produces the record to partition 0 of the dead-letter topic, with its reason and where
    /// it was read, and waits for the leader's acknowledgement.
    async fn dead_letter(
        &self,
        _resume: &mut Resume,
        record: &RecordAndOffset,
        reason: &str,
    ) -> Result<(), BoxError> {
        let inner = &self.consumer.inner;
        let topic = inner
            .dead_letter_topic
            .as_deref()
            .ok_or("no dead-letter topic is set (`KafkaConsumerBuilder::dead_letter_topic`)")?;
        let source = format!("{}:{}", self.source, record.offset);
        let mut headers = record.record.headers.clone();
        headers.insert(
            DEAD_LETTER_REASON_HEADER.to_owned(),
            reason.as_bytes().to_vec(),
        );
        headers.insert(
            DEAD_LETTER_SOURCE_HEADER.to_owned(),
            source.as_bytes().to_vec(),
        );
        let dead = Record {
            key: record.record.key.clone(),
            value: record.record.value.clone(),
            headers,
            timestamp: record.record.timestamp,
        };
        let produce = async {
            let connection = partition_client(&inner.client, topic, 0).await?;
            connection
                .produce(vec![dead], Compression::NoCompression)
                .await
        };
        match tokio::time::timeout(inner.fetch_timeout, produce).await {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(error)) => Err(error.into()),
            Err(_) => Err(format!("no acknowledgement within {:?}", inner.fetch_timeout).into()),
        }
    }

    /// Goes on after the batch with the same connection, unless its append failed: the next
    /// fetch then reads the stored position again.
    async fn settle(
        &self,
        resume: Resume,
        records: Vec<(RecordAndOffset, Settlement)>,
    ) -> Result<(), KafkaError> {
        if records
            .iter()
            .all(|(_, settle)| *settle != Settlement::Retry)
        {
            let next = records.last().map_or(resume.next, |(r, _)| r.offset + 1);
            *self.resume.lock().unwrap_or_else(|e| e.into_inner()) = Some(Resume {
                connection: resume.connection,
                next,
            });
        }
        Ok(())
    }

    fn pause_after_failure(&self) -> Duration {
        self.consumer.inner.retry_delay
    }

    fn pause_after_retry(&self) -> Duration {
        self.consumer.inner.retry_delay
    }

    fn source(&self) -> &str {
        &self.source
    }
}
