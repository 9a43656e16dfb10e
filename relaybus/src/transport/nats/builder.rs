//! The settings of a [`NatsConsumer`], checked before the durable consumer is created.

use std::{
    fmt,
    sync::{Arc, atomic::AtomicBool},
    time::Duration,
};

use async_nats::jetstream;

use crate::transport::{
    Consumer, ConsumerBuilder,
    settings::{check_delay, check_range},
};

use super::{
    NatsError,
    consumer::{ConsumerInner, DEFAULT_ACK_WAIT, NatsConsumer, NatsSource},
    error::check_subject,
};

impl NatsConsumer {
    /// Starts building a consumer of `stream` under the durable name `durable`. The broker
    /// remembers what a durable consumer acknowledged, so a restarted process goes on where
    /// the last one stopped: give each consuming service its own durable name.
    pub fn builder(
        jetstream: jetstream::Context,
        stream: impl Into<String>,
        durable: impl Into<String>,
    ) -> NatsConsumerBuilder {
        ConsumerBuilder::new(NatsOptions {
            jetstream,
            stream: stream.into(),
            durable: durable.into(),
            filter_subject: None,
            ack_wait: DEFAULT_ACK_WAIT,
            nak_delay: Duration::from_secs(5),
            dead_letter_subject: None,
        })
    }
}

/// Builds a [`NatsConsumer`]; made by [`NatsConsumer::builder`].
pub type NatsConsumerBuilder = ConsumerBuilder<NatsOptions>;

/// The settings of a [`NatsConsumer`] that only NATS has.
pub struct NatsOptions {
    jetstream: jetstream::Context,
    stream: String,
    durable: String,
    filter_subject: Option<String>,
    ack_wait: Duration,
    nak_delay: Duration,
    dead_letter_subject: Option<String>,
}

impl fmt::Debug for NatsOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NatsOptions")
            .field("stream", &self.stream)
            .field("durable", &self.durable)
            .field("filter_subject", &self.filter_subject)
            .field("ack_wait", &self.ack_wait)
            .field("nak_delay", &self.nak_delay)
            .field("dead_letter_subject", &self.dead_letter_subject)
            .finish_non_exhaustive()
    }
}

impl NatsConsumerBuilder {
    /// Takes only the messages of subjects matching `subject` (wildcards allowed), for
    /// example one partition of a relay, `orders.events.3`. All of the stream's by default.
    pub fn filter_subject(mut self, subject: impl Into<String>) -> Self {
        self.options.filter_subject = Some(subject.into());
        self
    }

    /// How long the broker waits for a message's acknowledgement before it redelivers it,
    /// [`DEFAULT_ACK_WAIT`] (2 seconds) by default (100 ms to 1 hour). It bounds how long the
    /// messages a dead process had taken wait before they are delivered again. A batch is
    /// reported in progress four times per ack wait from its fetch to its acknowledgement, so
    /// an append that takes longer is not redelivered; only a process stalled for the whole
    /// ack wait (stopped, starved of CPU) has its batch redelivered while it still holds it,
    /// and appending it twice adds nothing.
    pub fn ack_wait(mut self, wait: Duration) -> Self {
        self.options.ack_wait = wait;
        self
    }

    /// How long the broker waits before it redelivers messages whose append failed, 5
    /// seconds by default (at most 1 hour).
    pub fn nak_delay(mut self, delay: Duration) -> Self {
        self.options.nak_delay = delay;
        self
    }

    /// Where messages that are not relaybus events, or fail to decode, go: published there
    /// (body and headers as they came, with [`DEAD_LETTER_REASON_HEADER`](super::DEAD_LETTER_REASON_HEADER) and the original
    /// subject and stream position), then acknowledged. Give it a subject that a stream
    /// captures, so that the dead letters are kept; the publish waits for JetStream's
    /// confirmation. Without one, or when that publish fails, such a message is terminated
    /// (`+TERM`): the broker never redelivers it, and the reason is logged at error level.
    pub fn dead_letter_subject(mut self, subject: impl Into<String>) -> Self {
        self.options.dead_letter_subject = Some(subject.into());
        self
    }

    /// Validates the settings, then creates the durable pull consumer on the stream, or
    /// updates it to these settings.
    ///
    /// # Errors
    ///
    /// [`NatsError::InvalidConfiguration`] for a setting out of range, an empty durable name
    /// or one with `.`, `*`, `>` or whitespace, or a dead-letter subject that is not a literal
    /// subject; [`NatsError::Setup`] when the stream does not exist or the server refuses the
    /// consumer.
    pub async fn build(self) -> Result<NatsConsumer, NatsError> {
        let ConsumerBuilder { batch, options } = self;
        let name_ok = |name: &str| {
            !name.is_empty()
                && !name
                    .chars()
                    .any(|c| matches!(c, '.' | '*' | '>') || c.is_whitespace() || c.is_control())
        };
        if !name_ok(&options.stream) {
            return Err(NatsError::invalid(
                "stream",
                format!(
                    "{:?} is not a stream name; use a name without `.`, `*`, `>` or whitespace",
                    options.stream
                ),
            ));
        }
        if !name_ok(&options.durable) {
            return Err(NatsError::invalid(
                "durable",
                format!(
                    "{:?} is not a durable consumer name; use a name without `.`, `*`, `>` or \
                     whitespace",
                    options.durable
                ),
            ));
        }
        batch.check()?;
        check_range(
            "ack_wait",
            options.ack_wait,
            Duration::from_millis(100)..=Duration::from_secs(3_600),
            "100 ms to 1 hour",
        )?;
        check_delay("nak_delay", options.nak_delay)?;
        if let Some(subject) = &options.dead_letter_subject {
            check_subject("dead_letter_subject", subject)?;
        }
        if options.filter_subject.as_deref() == Some("") {
            return Err(NatsError::invalid(
                "filter_subject",
                "it is empty; leave it unset to take the whole stream",
            ));
        }
        let setup = |source: async_nats::Error| NatsError::Setup {
            stream: options.stream.clone(),
            durable: options.durable.clone(),
            source,
        };
        let stream = options
            .jetstream
            .get_stream(&options.stream)
            .await
            .map_err(|e| setup(e.into()))?;
        let config = jetstream::consumer::pull::Config {
            durable_name: Some(options.durable.clone()),
            filter_subject: options.filter_subject.clone().unwrap_or_default(),
            ack_policy: jetstream::consumer::AckPolicy::Explicit,
            ack_wait: options.ack_wait,
            max_ack_pending: i64::try_from(batch.batch_size).unwrap_or(i64::MAX),
            ..Default::default()
        };
        let consumer = stream
            .create_consumer(config.clone())
            .await
            .map_err(|e| setup(e.into()))?;
        Ok(Consumer::new(NatsSource {
            inner: Arc::new(ConsumerInner {
                jetstream: options.jetstream,
                consumer,
                config,
                settled: Arc::new(AtomicBool::new(false)),
                stream: options.stream,
                durable: options.durable,
                batch,
                ack_wait: options.ack_wait,
                nak_delay: options.nak_delay,
                dead_letter_subject: options.dead_letter_subject,
            }),
        }))
    }
}
