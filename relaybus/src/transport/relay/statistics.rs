//! What a relay sent, counted as it goes.

use std::sync::atomic::{AtomicU64, Ordering};

/// What a relay sent so far, in this process. Every broker's relay reports in these terms.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct RelayStatistics {
    /// Sends the broker confirmed (NATS: publishes JetStream acknowledged; RabbitMQ:
    /// publisher confirms; Kafka: produces the partition leader acknowledged), duplicates
    /// included. An event sent again (its relay crashed between the confirmation and the
    /// delivery's completion, or a confirmation timed out) counts each time.
    pub published: u64,
    /// Confirmed sends that the broker reported as duplicates and kept one copy of: NATS,
    /// when the stream held a message with the same `Nats-Msg-Id` within its duplicate
    /// window. RabbitMQ and Kafka do not deduplicate (their queues and topics then hold two
    /// copies, which the consuming store appends once), so it stays 0 there.
    pub duplicates: u64,
    /// Connections the relay opened: the first one, and one after each loss (NATS: the
    /// client's connects and reconnects; Kafka: connections to partition leaders).
    pub connections: u64,
}

/// The counts behind a relay's [`RelayStatistics`].
#[derive(Debug, Default)]
pub(crate) struct Counters {
    published: AtomicU64,
    duplicates: AtomicU64,
    connections: AtomicU64,
}

impl Counters {
    /// Counts a send the broker confirmed, and whether it reported it as a duplicate.
    pub(crate) fn published(&self, duplicate: bool) {
        self.published.fetch_add(1, Ordering::Relaxed);
        if duplicate {
            self.duplicates.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Counts a connection opened.
    #[cfg_attr(not(any(feature = "rabbitmq", feature = "kafka")), allow(dead_code))]
    pub(crate) fn connected(&self) {
        self.connections.fetch_add(1, Ordering::Relaxed);
    }

    /// The counts so far; `connections` when the client counts them itself.
    pub(crate) fn statistics(&self, connections: Option<u64>) -> RelayStatistics {
        RelayStatistics {
            published: self.published.load(Ordering::Relaxed),
            duplicates: self.duplicates.load(Ordering::Relaxed),
            connections: connections.unwrap_or_else(|| self.connections.load(Ordering::Relaxed)),
        }
    }
}
