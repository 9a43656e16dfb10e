//! The settings of a [`KafkaConsumer`], checked before it is built.

use std::{
    fmt,
    sync::{Arc, atomic::AtomicBool},
    time::Duration,
};

use rskafka::client::Client;
use tokio::sync::watch;

use super::{
    KafkaError,
    consumer::{ConsumerInner, KafkaConsumer, MAX_BATCH_RECORDS},
    error::check_topic,
};
use crate::{
    store::MAX_POSITION_NAME_BYTES,
    transport::settings::{check_batch_size, check_delay, check_range, check_timeout},
};

/// How long a process's lead on a partition lasts unless renewed, by default: 3 seconds, so that
/// a crashed process's partitions are read again about 4 seconds later.
pub const DEFAULT_LEASE: Duration = Duration::from_secs(3);

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
            lease: DEFAULT_LEASE,
            batch_records: 256,
            batch_bytes: 4 << 20,
            fetch_wait: Duration::from_millis(500),
            fetch_timeout: Duration::from_secs(10),
            retry_delay: Duration::from_secs(1),
            dead_letter_topic: None,
        }
    }
}

/// Builds a [`KafkaConsumer`]; made by [`KafkaConsumer::builder`].
#[must_use]
pub struct KafkaConsumerBuilder {
    client: Arc<Client>,
    topic: String,
    name: String,
    lease: Duration,
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
            .field("lease", &self.lease)
            .finish_non_exhaustive()
    }
}

impl KafkaConsumerBuilder {
    /// Ignored: [`run`](KafkaConsumer::run) reads the partitions the broker's metadata lists,
    /// and finds those added to the topic while it runs.
    #[deprecated(
        note = "the consumer reads the partitions the broker's metadata lists; remove the call"
    )]
    pub fn partitions(self, partitions: u32) -> Self {
        let _ = partitions;
        self
    }

    /// How long a process's lead on a partition lasts unless renewed, 3 seconds by default
    /// ([`DEFAULT_LEASE`]; 100 ms to 1 hour). The processes of one consumer (one name and topic
    /// on one database) share the topic's partitions through these leads, renewed every third
    /// of the lease: the partitions of a process that died are read by another within a lease
    /// and a third of it. Each append's transaction also keeps its reader's lead, so a reader
    /// that lost it (paused past the lease) appends nothing more. A shorter lease moves a dead
    /// process's partitions sooner, for more writes to the store: one per partition read and
    /// per process, three times a lease, and one per batch.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
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
    /// [`DEAD_LETTER_REASON_HEADER`](super::DEAD_LETTER_REASON_HEADER) and
    /// [`DEAD_LETTER_SOURCE_HEADER`](super::DEAD_LETTER_SOURCE_HEADER)) before the batch's
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
        check_range(
            "lease",
            self.lease,
            Duration::from_millis(100)..=Duration::from_secs(3600),
            "100 ms to 1 hour",
        )?;
        check_batch_size("batch_records", self.batch_records, MAX_BATCH_RECORDS)?;
        check_range(
            "batch_bytes",
            self.batch_bytes,
            1 << 10..=64 << 20,
            "1 KiB to 64 MiB",
        )?;
        check_range(
            "fetch_wait",
            self.fetch_wait,
            Duration::from_millis(1)..=Duration::from_secs(60),
            "1 ms to 1 minute",
        )?;
        check_timeout("fetch_timeout", self.fetch_timeout)?;
        check_delay("retry_delay", self.retry_delay)?;
        Ok(KafkaConsumer {
            inner: Arc::new(ConsumerInner {
                client: self.client,
                topic: self.topic,
                name: self.name,
                lease: self.lease,
                batch_records: self.batch_records,
                batch_bytes: self.batch_bytes,
                fetch_wait: self.fetch_wait,
                fetch_timeout: self.fetch_timeout,
                retry_delay: self.retry_delay,
                dead_letter_topic: self.dead_letter_topic,
                assignment: watch::Sender::new(Vec::new()),
                running: AtomicBool::new(false),
            }),
        })
    }
}
