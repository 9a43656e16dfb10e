//! What every relay is: one subscription per event type, under the handler id
//! `<handler_id>:<type>`, whose deliveries send the event to the broker and complete once the
//! broker confirmed it; its settings shared by every broker (the handler id prefix, the
//! partitions keys are spread over), and its counts.

use std::{
    future::Future,
    sync::atomic::{AtomicU64, Ordering},
    time::Duration,
};

use super::forward::Forwarded;
use crate::{
    error::BoxError,
    event::{Event, EventEnvelope},
    handler::{HandlerContext, Subscription, validate_handler_id},
    store::Store,
};

/// The most partitions a relay spreads keys over.
pub const MAX_PARTITIONS: u32 = 1_024;

/// The longest a relay waits for a broker (its confirmation, a connection): 10 minutes.
const MAX_TIMEOUT: Duration = Duration::from_secs(600);

/// A relay or consumer setting that cannot work: which one, and what to do. Each transport
/// turns it into its own error's `InvalidConfiguration`.
#[derive(Debug)]
pub(crate) struct InvalidSetting {
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

    /// Checks the handler id prefix, the partitions, and each of the relay's `timeouts` (1 ms
    /// to 10 minutes).
    pub(crate) fn check(
        &self,
        timeouts: &[(&'static str, Duration)],
    ) -> Result<(), InvalidSetting> {
        if !(1..=MAX_PARTITIONS).contains(&self.partitions) {
            return Err(InvalidSetting::new(
                "partitions",
                format!(
                    "{} is out of range; use 1 to {MAX_PARTITIONS}",
                    self.partitions
                ),
            ));
        }
        for &(option, timeout) in timeouts {
            if !(Duration::from_millis(1)..=MAX_TIMEOUT).contains(&timeout) {
                return Err(InvalidSetting::new(
                    option,
                    format!("{timeout:?} is out of range; use 1 ms to 10 minutes"),
                ));
            }
        }
        validate_handler_id(&self.handler_id)
            .map_err(|error| InvalidSetting::new("handler_id", error.to_string()))
    }
}

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

/// A broker's relay, as its subscriptions use it.
pub(crate) trait Outbound: Clone + Send + Sync + 'static {
    /// The relay's settings.
    fn settings(&self) -> &RelaySettings;

    /// Sends one event and waits for the broker's confirmation: what each delivery of the
    /// relay's subscriptions does.
    fn forward(
        &self,
        envelope: EventEnvelope,
        sequence: Option<i64>,
    ) -> impl Future<Output = Result<(), BoxError>> + Send;
}

/// The subscription of `relay` that forwards every event of type `E` on a bus of store `S`,
/// under the handler id `<handler_id>:<E::TYPE>`. The payload is forwarded as stored, fields
/// that `E` does not know included.
pub(crate) fn subscription<E: Event, S: Store, R: Outbound>(
    relay: &R,
) -> Result<Subscription, InvalidSetting> {
    let id = format!("{}:{}", relay.settings().handler_id, E::TYPE);
    validate_handler_id(&id).map_err(|error| {
        InvalidSetting::new(
            "handler_id",
            format!("{error}; choose a shorter handler id for the relay"),
        )
    })?;
    let relay = relay.clone();
    Ok(Subscription::new(
        id,
        move |event: Forwarded<E>, context: HandlerContext<S>| {
            let relay = relay.clone();
            async move {
                let envelope = event.envelope(&context);
                relay.forward(envelope, context.sequence()).await
            }
        },
    ))
}
