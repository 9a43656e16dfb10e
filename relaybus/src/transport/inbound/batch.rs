//! A batch between its steps: fetched ([`InboundBatch`]), then appended to the local store
//! ([`AppendedBatch`]), then settled with the broker ([`AppendedBatch::ack`]).

use std::fmt;

use super::{
    append::{self, Fate},
    broker::Broker,
    report::BatchReport,
};
use crate::{
    bus::RelayBus,
    store::{Appended, Store},
};

/// Messages a consumer's `fetch` took from the broker (`NatsConsumer::fetch`,
/// `RabbitConsumer::fetch`), not yet appended.
///
/// Dropping it leaves the messages to the broker, which delivers them again: NATS stops
/// reporting them in progress and redelivers them after the ack wait; RabbitMQ gets them back
/// when the consumer closes its channel, before its next fetch.
#[must_use = "a fetched batch is delivered again unless appended and acknowledged"]
pub struct InboundBatch<B: Broker> {
    broker: B,
    messages: Vec<B::Message>,
    hold: B::Hold,
}

impl<B: Broker> fmt::Debug for InboundBatch<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("InboundBatch")
            .field("messages", &self.messages.len())
            .finish_non_exhaustive()
    }
}

impl<B: Broker> InboundBatch<B> {
    /// Takes the broker's next batch.
    pub(crate) async fn fetch(broker: &B) -> Result<Self, B::Error> {
        let (messages, hold) = broker.fetch().await?;
        Ok(InboundBatch {
            broker: broker.clone(),
            messages,
            hold,
        })
    }

    /// How many messages the batch holds.
    pub fn len(&self) -> usize {
        self.messages.len()
    }

    /// Whether the fetch found nothing.
    pub fn is_empty(&self) -> bool {
        self.messages.is_empty()
    }

    /// How many of the batch's messages the broker delivered before (and were not
    /// acknowledged).
    pub fn redelivered(&self) -> usize {
        self.messages.iter().filter(|m| B::redelivered(m)).count()
    }

    /// Reads the batch's events and appends them, in the broker's order, in one transaction
    /// of `bus`'s store ([`RelayBus::publish_all`]), with their original ids, keys, headers
    /// and creation times, and with the deliveries of `bus`'s handlers. An event the store
    /// holds already adds nothing (but the deliveries of handlers new to it).
    ///
    /// Messages that are not relaybus events are published to the consumer's dead-letter
    /// destination first (or given up, when there is none or that publish fails). When the
    /// transaction fails, the events are appended one at a time, in order: an event the store
    /// refuses for good (an invalid or oversized event) is dead-lettered too, and from the
    /// first one that fails otherwise (the store is unreachable), that event and every one
    /// after it are to be delivered again, so that a key's events are never appended out of
    /// order.
    ///
    /// Nothing is acknowledged yet: call [`AppendedBatch::ack`].
    pub async fn append<S: Store>(mut self, bus: &RelayBus<S>) -> AppendedBatch<B> {
        let (fates, last_error) =
            append::append(&self.broker, &mut self.hold, bus, &self.messages).await;
        AppendedBatch {
            broker: self.broker,
            items: self.messages.into_iter().zip(fates).collect(),
            last_error,
            hold: self.hold,
        }
    }
}

/// A batch appended to the local store, not yet acknowledged to the broker. Dropping it
/// leaves the messages to the broker, which delivers them again (as when an
/// [`InboundBatch`] is dropped); appending them again adds nothing.
#[must_use = "an appended batch is delivered again unless acknowledged"]
pub struct AppendedBatch<B: Broker> {
    broker: B,
    items: Vec<(B::Message, Fate)>,
    last_error: Option<String>,
    hold: B::Hold,
}

impl<B: Broker> fmt::Debug for AppendedBatch<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AppendedBatch")
            .field("messages", &self.items.len())
            .field("last_error", &self.last_error)
            .finish_non_exhaustive()
    }
}

impl<B: Broker> AppendedBatch<B> {
    /// The events appended (or found held already), in the broker's order.
    pub fn appended(&self) -> impl Iterator<Item = &Appended> {
        self.items.iter().filter_map(|(_, fate)| match fate {
            Fate::Appended(appended) => Some(appended),
            _ => None,
        })
    }

    /// Settles every message with the broker, in its order: acknowledges the appended and the
    /// dead-lettered ones, gives up those that could be neither (NATS terminates them,
    /// RabbitMQ rejects them without requeue), and has those whose append failed delivered
    /// again (NATS: a negative acknowledgement with the nak delay; RabbitMQ: a requeue, then
    /// the channel is reopened so that what the broker sent ahead goes back too). Returns
    /// what the batch did.
    ///
    /// # Errors
    ///
    /// The transport's error when the acknowledgements could not be sent (the connection is
    /// down); the broker then delivers those messages again, and appending them again adds
    /// nothing.
    pub async fn ack(self) -> Result<BatchReport, B::Error> {
        let AppendedBatch {
            broker,
            items,
            last_error,
            hold,
        } = self;
        let mut report = BatchReport {
            fetched: items.len(),
            last_error,
            ..BatchReport::default()
        };
        for (_, fate) in &items {
            match fate {
                Fate::Appended(appended) if appended.created => report.appended += 1,
                Fate::Appended(_) | Fate::Behind => report.duplicates += 1,
                Fate::DeadLettered => report.dead_lettered += 1,
                Fate::Discarded => report.discarded += 1,
                Fate::Decoded(_) | Fate::Retry => report.retried += 1,
            }
        }
        if report.retried == 0 && broker.position().is_some() {
            report.next_offset = items.last().map(|(message, _)| B::offset(message) + 1);
        }
        let settlements = items
            .into_iter()
            .map(|(message, fate)| (message, fate.settlement()))
            .collect();
        broker.settle(hold, settlements).await?;
        Ok(report)
    }
}
