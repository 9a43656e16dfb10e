//! The committed state behind the store's mutex: events, deliveries, completion records, key
//! counters, business documents, and which open transaction wrote what.

use std::{
    collections::{BTreeMap, HashMap, HashSet},
    fmt,
};

use serde_json::Value;

use super::{
    checks::{clip_error, clip_history_error},
    claim::MemoryDeliveryId,
    deliveries::Deliveries,
};
use crate::{
    event::EventEnvelope,
    store::{AttemptError, DeliveryRecord, DeliveryStatus, MAX_ERROR_HISTORY},
    time::Timestamp,
};

/// Everything the store holds.
#[derive(Debug, Default)]
pub(super) struct State {
    /// Events by id.
    pub(super) events: HashMap<String, StoredEvent>,
    /// Pending and dead deliveries by id: id order is creation order.
    pub(super) deliveries: Deliveries,
    /// Completion records (with completion history) by delivery id.
    pub(super) completed: BTreeMap<u64, DeliveryRecord>,
    /// The last sequence taken by each ordering key.
    pub(super) sequences: HashMap<String, i64>,
    /// Business documents by collection and id.
    pub(super) documents: BTreeMap<String, BTreeMap<String, StoredDocument>>,
    /// What open transactions wrote: each thing with the transaction that holds it.
    pub(super) locks: HashMap<Target, u64>,
    /// The last delivery id given out.
    pub(super) last_delivery: u64,
    /// The last fencing token given out.
    pub(super) last_token: u64,
    /// The last transaction id given out.
    pub(super) last_transaction: u64,
    /// How many transactions committed: the version of the documents the last one wrote.
    pub(super) commits: u64,
}

impl State {
    /// A new delivery id.
    pub(super) fn next_delivery_id(&mut self) -> u64 {
        self.last_delivery += 1;
        self.last_delivery
    }

    /// A new fencing token.
    pub(super) fn next_token(&mut self) -> u64 {
        self.last_token += 1;
        self.last_token
    }

    /// The lowest pending sequence of every handler and key held to order: each key's head.
    pub(super) fn heads(&self) -> HashMap<(&str, &str), i64> {
        let mut heads: HashMap<(&str, &str), i64> = HashMap::new();
        for delivery in self.deliveries.values() {
            if delivery.status != DeliveryStatus::Pending {
                continue;
            }
            if let Some((handler, key, sequence)) = delivery.ordered() {
                heads
                    .entry((handler, key))
                    .and_modify(|head| *head = (*head).min(sequence))
                    .or_insert(sequence);
            }
        }
        heads
    }

    /// Completes a delivery: it goes (kept as a completion record with completion history),
    /// and its event records the completion time.
    pub(super) fn complete(&mut self, id: u64, now: Timestamp, history: bool) {
        let Some(delivery) = self.deliveries.remove(id) else {
            return;
        };
        if let Some(event) = self.events.get_mut(&delivery.event_id) {
            event.completed_at = event.completed_at.max(Some(now));
        }
        if history {
            self.completed.insert(id, delivery.completion_record(now));
        }
    }

    /// The ids of the events that a pending or dead delivery, or a completion record, refers
    /// to.
    pub(super) fn referenced_events(&self) -> HashSet<&str> {
        self.deliveries
            .values()
            .map(|d| d.event_id.as_str())
            .chain(self.completed.values().map(|r| r.event_id.as_str()))
            .collect()
    }
}

/// A stored event.
#[derive(Debug, Clone)]
pub(super) struct StoredEvent {
    /// The event as appended.
    pub(super) envelope: EventEnvelope,
    /// Its sequence within its key, if keyed.
    pub(super) sequence: Option<i64>,
    /// Every handler it was delivered to, in the order they were added.
    pub(super) handlers: Vec<String>,
    /// When a delivery of it last completed (or its last dead letter was discarded).
    pub(super) completed_at: Option<Timestamp>,
}

/// A business document with the number of the commit that wrote it.
#[derive(Debug, Clone)]
pub(super) struct StoredDocument {
    pub(super) value: Value,
    pub(super) version: u64,
}

/// A claim's hold on a delivery.
#[derive(Debug, Clone)]
pub(super) struct Held {
    /// The owner that claimed it.
    pub(super) owner: String,
    /// The fencing token the claim's lease carries.
    pub(super) token: u64,
    /// When the lease ends unless renewed.
    pub(super) expires_at: Timestamp,
    /// Handed back by [`relinquish`](crate::store::Queue::relinquish): honoured until a claim takes
    /// the delivery over.
    pub(super) handed_back: bool,
}

impl Held {
    /// Whether a claim may take the delivery over: the lease expired or was handed back.
    pub(super) fn is_free(&self, now: Timestamp) -> bool {
        self.handed_back || self.expires_at <= now
    }
}

/// A pending or dead delivery.
#[derive(Debug, Clone)]
pub(super) struct Delivery {
    pub(super) id: u64,
    pub(super) event_id: String,
    pub(super) handler: String,
    pub(super) event_type: String,
    pub(super) key: Option<String>,
    pub(super) sequence: Option<i64>,
    /// Ignores its key's order.
    pub(super) unordered: bool,
    /// [`DeliveryStatus::Pending`] or [`DeliveryStatus::Dead`].
    pub(super) status: DeliveryStatus,
    /// Attempts that ended since the last requeue.
    pub(super) attempts: u32,
    pub(super) due_at: Timestamp,
    pub(super) created_at: Timestamp,
    pub(super) updated_at: Option<Timestamp>,
    pub(super) last_error: Option<String>,
    /// The last [`MAX_ERROR_HISTORY`] failed attempts, oldest first.
    pub(super) errors: Vec<AttemptError>,
    pub(super) requeues: u32,
    /// The claim that runs it, while one does.
    pub(super) lease: Option<Held>,
}

impl Delivery {
    /// Its handler, key and sequence, if it is held to its key's order.
    pub(super) fn ordered(&self) -> Option<(&str, &str, i64)> {
        if self.unordered {
            return None;
        }
        Some((&self.handler, self.key.as_deref()?, self.sequence?))
    }

    /// Whether it waits behind an earlier pending delivery of its handler and key.
    pub(super) fn is_parked(&self, heads: &HashMap<(&str, &str), i64>) -> bool {
        self.status == DeliveryStatus::Pending
            && self.ordered().is_some_and(|(handler, key, sequence)| {
                heads
                    .get(&(handler, key))
                    .is_some_and(|head| *head < sequence)
            })
    }

    /// Whether a claim runs it now (its lease may have expired without anyone taking it over).
    pub(super) fn is_running(&self) -> bool {
        self.status == DeliveryStatus::Pending && self.lease.is_some()
    }

    /// Ends an attempt that failed with `error`: counted, with the error kept.
    pub(super) fn fail(&mut self, error: &str, now: Timestamp) {
        self.attempts = self.attempts.saturating_add(1);
        self.remember_error(error, Some(self.attempts), now);
    }

    /// Keeps `error` as the last error and in the history, without counting an attempt.
    pub(super) fn remember_error(&mut self, error: &str, attempt: Option<u32>, now: Timestamp) {
        self.last_error = Some(clip_error(error).to_owned());
        self.errors
            .push(AttemptError::new(now, attempt, clip_history_error(error)));
        if self.errors.len() > MAX_ERROR_HISTORY {
            let extra = self.errors.len() - MAX_ERROR_HISTORY;
            self.errors.drain(..extra);
        }
        self.updated_at = Some(now);
    }

    /// The listed form.
    pub(super) fn record(&self, parked: bool) -> DeliveryRecord {
        DeliveryRecord {
            id: MemoryDeliveryId(self.id).to_string(),
            event_id: self.event_id.clone(),
            handler: self.handler.clone(),
            event_type: self.event_type.clone(),
            key: self.key.clone(),
            sequence: self.sequence,
            unordered: self.unordered && self.key.is_some(),
            status: self.status,
            parked,
            running: self.is_running(),
            attempts: self.attempts,
            due_at: Some(self.due_at),
            created_at: Some(self.created_at),
            updated_at: self.updated_at,
            completed_at: None,
            last_error: self.last_error.clone(),
            errors: self.errors.clone(),
            requeues: self.requeues,
        }
    }

    /// The record its completion at `now` leaves, with completion history: the attempt that
    /// completed it counted.
    fn completion_record(&self, now: Timestamp) -> DeliveryRecord {
        DeliveryRecord {
            status: DeliveryStatus::Completed,
            parked: false,
            running: false,
            attempts: self.attempts.saturating_add(1),
            due_at: None,
            updated_at: None,
            completed_at: Some(now),
            ..self.record(false)
        }
    }
}

/// Something a transaction writes, which no other open transaction may write until it ends.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(super) enum Target {
    /// An event id: inserting the event, or adding handlers to it.
    Event(String),
    /// The sequence counter of an ordering key.
    Key(String),
    /// A delivery the transaction completes.
    Delivery(u64),
    /// A business document: collection and id.
    Document(String, String),
}

impl fmt::Display for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Target::Event(id) => write!(f, "event {id:?}"),
            Target::Key(key) => write!(f, "the sequence of ordering key {key:?}"),
            Target::Delivery(id) => write!(f, "delivery {}", MemoryDeliveryId(*id)),
            Target::Document(collection, id) => {
                write!(f, "document {id:?} of collection {collection:?}")
            }
        }
    }
}
