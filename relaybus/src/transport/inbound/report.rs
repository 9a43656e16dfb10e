//! What a consumer's batches did, in the same terms for every broker.

/// What one batch of a consumer did, or, from a consumer's `run`, every batch of the run
/// added up. Every broker's consumer reports in these terms.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct BatchReport {
    /// Messages (Kafka: records) taken from the broker.
    pub fetched: usize,
    /// Events the local store did not hold, appended with their deliveries.
    pub appended: usize,
    /// Events the local store held already (a redelivery, or an event the relay sent twice):
    /// nothing new was written, except deliveries of handlers new to the event.
    pub duplicates: usize,
    /// Messages that are not relaybus events, or whose event the store refuses for good,
    /// published to the consumer's dead-letter destination with their reason.
    pub dead_lettered: usize,
    /// Messages that could not be read and could not be dead-lettered either (no dead-letter
    /// destination, or its publish failed), given up so that they never block what follows:
    /// terminated on NATS (`+TERM`), rejected without requeue on RabbitMQ (the queue's own
    /// `x-dead-letter-exchange`, if any, takes them), skipped on Kafka. The reason is logged at
    /// error level.
    pub discarded: usize,
    /// Messages whose append failed (the store was unreachable, say), with every later one of
    /// their batch: the broker delivers them again (Kafka: they are fetched again from the
    /// stored position).
    pub retried: usize,
    /// The last append error, when messages were retried.
    pub last_error: Option<String>,
    /// Kafka only: the partition's next offset after the batch, as stored; `None` when the
    /// batch was empty or retried, for a run's total, and for the brokers that keep the
    /// consumer's position themselves.
    pub next_offset: Option<i64>,
}

impl BatchReport {
    /// Adds another batch's report to this one.
    pub(crate) fn add(&mut self, other: BatchReport) {
        self.fetched += other.fetched;
        self.appended += other.appended;
        self.duplicates += other.duplicates;
        self.dead_lettered += other.dead_lettered;
        self.discarded += other.discarded;
        self.retried += other.retried;
        if other.last_error.is_some() {
            self.last_error = other.last_error;
        }
        if other.next_offset.is_some() {
            self.next_offset = other.next_offset;
        }
    }
}
