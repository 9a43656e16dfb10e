//! The settings relays and consumers share, and how a setting that cannot work is refused.

use std::{fmt, ops::RangeInclusive, time::Duration};

use crate::handler::validate_handler_id;

/// The most partitions a relay spreads keys over.
pub const MAX_PARTITIONS: u32 = 1_024;

/// The most messages one batch of a NATS or RabbitMQ consumer takes (and the most a RabbitMQ
/// broker sends ahead).
pub const MAX_BATCH_SIZE: usize = 1_000;

/// A relay or consumer setting that cannot work: which one, and what to do. Each transport
/// turns it into its own error's `InvalidConfiguration`.
#[derive(Debug)]
pub struct InvalidSetting {
    pub(crate) option: &'static str,
    pub(crate) reason: String,
}

impl InvalidSetting {
    pub(crate) fn new(option: &'static str, reason: impl Into<String>) -> Self {
        InvalidSetting {
            option,
            reason: reason.into(),
        }
    }
}

/// Refuses `value` for `option` unless it is within `allowed`, which `said` puts in words
/// ("1 to 1,000").
pub(crate) fn check_range<T: PartialOrd + fmt::Debug>(
    option: &'static str,
    value: T,
    allowed: RangeInclusive<T>,
    said: &str,
) -> Result<(), InvalidSetting> {
    if allowed.contains(&value) {
        Ok(())
    } else {
        Err(InvalidSetting::new(
            option,
            format!("{value:?} is out of range; use {said}"),
        ))
    }
}

/// Refuses a timeout for a broker's answer (a confirmation, a connection) outside 1 ms to 10
/// minutes.
pub(crate) fn check_timeout(option: &'static str, timeout: Duration) -> Result<(), InvalidSetting> {
    check_range(
        option,
        timeout,
        Duration::from_millis(1)..=Duration::from_secs(600),
        "1 ms to 10 minutes",
    )
}

/// Refuses a delay before trying again over an hour.
pub(crate) fn check_delay(option: &'static str, delay: Duration) -> Result<(), InvalidSetting> {
    check_range(
        option,
        delay,
        Duration::ZERO..=Duration::from_secs(3_600),
        "at most 1 hour",
    )
}

/// Refuses a batch size outside 1 to `max`.
pub(crate) fn check_batch_size(
    option: &'static str,
    size: usize,
    max: usize,
) -> Result<(), InvalidSetting> {
    check_range(option, size, 1..=max, &format!("1 to {max}"))
}

/// Refuses a number of partitions outside 1 to [`MAX_PARTITIONS`].
pub(crate) fn check_partitions(partitions: u32) -> Result<(), InvalidSetting> {
    check_range("partitions", partitions, 1..=MAX_PARTITIONS, "1 to 1,024")
}

/// The settings of a NATS or RabbitMQ consumer's batches: how many messages one takes, and how
/// long a fetch waits for a first one.
#[derive(Debug, Clone)]
pub(crate) struct BatchSettings {
    pub(crate) batch_size: usize,
    pub(crate) fetch_wait: Duration,
}

impl Default for BatchSettings {
    fn default() -> Self {
        BatchSettings {
            batch_size: 64,
            fetch_wait: Duration::from_secs(1),
        }
    }
}

impl BatchSettings {
    /// Checks the batch size (1 to [`MAX_BATCH_SIZE`]) and the fetch wait (10 ms to 1 minute).
    // The Kafka consumer reads partitions with a driver of its own; NATS and RabbitMQ use it.
    #[cfg(any(feature = "nats", feature = "rabbitmq"))]
    pub(crate) fn check(&self) -> Result<(), InvalidSetting> {
        check_batch_size("batch_size", self.batch_size, MAX_BATCH_SIZE)?;
        check_range(
            "fetch_wait",
            self.fetch_wait,
            Duration::from_millis(10)..=Duration::from_secs(60),
            "10 ms to 1 minute",
        )
    }
}

/// The settings every relay has: the prefix of its handler ids, and how many partitions keys
/// are spread over.
#[derive(Debug, Clone)]
pub(crate) struct RelaySettings {
    pub(crate) handler_id: String,
    pub(crate) partitions: u32,
}

impl RelaySettings {
    /// One partition, and the broker's default handler id prefix.
    pub(crate) fn new(handler_id: &str) -> Self {
        RelaySettings {
            handler_id: handler_id.to_owned(),
            partitions: 1,
        }
    }

    /// Checks the partitions, each of the relay's `timeouts` (1 ms to 10 minutes) and the
    /// handler id prefix.
    pub(crate) fn check(
        &self,
        timeouts: &[(&'static str, Duration)],
    ) -> Result<(), InvalidSetting> {
        check_partitions(self.partitions)?;
        for &(option, timeout) in timeouts {
            check_timeout(option, timeout)?;
        }
        validate_handler_id(&self.handler_id)
            .map_err(|error| InvalidSetting::new("handler_id", error.to_string()))
    }
}
