//! The answers that list deliveries: a page of them, an event with its deliveries, and dead
//! letters grouped by error.

use std::collections::BTreeMap;

use relaybus::{DeliveryRecord, Timestamp};
use serde::Serialize;

/// `GET /deliveries`: a page, oldest first.
#[derive(Debug, Serialize)]
pub(crate) struct DeliveriesAnswer {
    deliveries: Vec<Delivery>,
    limit: u32,
    /// The `after` of the next page; `null` on the last one.
    next_after: Option<String>,
}

impl DeliveriesAnswer {
    /// The page of `records` asked for with `limit`: a full page may have another after it.
    pub(crate) fn new(records: Vec<DeliveryRecord>, limit: u32) -> Self {
        let full = records.len() == limit as usize;
        let next_after = records.last().filter(|_| full).map(|last| last.id.clone());
        DeliveriesAnswer {
            deliveries: records.into_iter().map(Delivery::from).collect(),
            limit,
            next_after,
        }
    }
}

/// A delivery or completion record, wherever an answer lists one.
#[derive(Debug, Serialize)]
pub(crate) struct Delivery {
    id: String,
    event_id: String,
    handler: String,
    event_type: String,
    key: Option<String>,
    sequence: Option<i64>,
    unordered: bool,
    /// `pending`, `dead` or `completed`.
    status: &'static str,
    parked: bool,
    running: bool,
    attempts: u32,
    due_at: Option<Timestamp>,
    created_at: Option<Timestamp>,
    updated_at: Option<Timestamp>,
    completed_at: Option<Timestamp>,
    last_error: Option<String>,
    /// The last failed attempts, oldest first.
    errors: Vec<FailedAttempt>,
    requeues: u32,
}

/// One failed attempt in a [`Delivery`]'s error history.
#[derive(Debug, Serialize)]
struct FailedAttempt {
    at: Timestamp,
    attempt: Option<u32>,
    error: String,
}

impl From<DeliveryRecord> for Delivery {
    fn from(record: DeliveryRecord) -> Self {
        Delivery {
            id: record.id,
            event_id: record.event_id,
            handler: record.handler,
            event_type: record.event_type,
            key: record.key,
            sequence: record.sequence,
            unordered: record.unordered,
            status: record.status.as_str(),
            parked: record.parked,
            running: record.running,
            attempts: record.attempts,
            due_at: record.due_at,
            created_at: record.created_at,
            updated_at: record.updated_at,
            completed_at: record.completed_at,
            last_error: record.last_error,
            errors: record
                .errors
                .into_iter()
                .map(|failed| FailedAttempt {
                    at: failed.at,
                    attempt: failed.attempt,
                    error: failed.error,
                })
                .collect(),
            requeues: record.requeues,
        }
    }
}

/// `GET /events/{event_id}`.
#[derive(Debug, Serialize)]
pub(crate) struct EventAnswer {
    event: Event,
    /// Every handler's delivery of it.
    deliveries: Vec<Delivery>,
}

/// An event, payload and headers included.
#[derive(Debug, Serialize)]
struct Event {
    id: String,
    #[serde(rename = "type")]
    event_type: String,
    key: Option<String>,
    sequence: Option<i64>,
    correlation_id: Option<String>,
    causation_id: Option<String>,
    headers: BTreeMap<String, String>,
    payload: serde_json::Map<String, serde_json::Value>,
    created_at: Timestamp,
    /// When every delivery of it completed, once they have.
    completed_at: Option<Timestamp>,
    handlers: Vec<String>,
}

impl From<relaybus::EventDetail> for EventAnswer {
    fn from(detail: relaybus::EventDetail) -> Self {
        let event = &detail.event;
        EventAnswer {
            event: Event {
                id: event.id().to_owned(),
                event_type: event.event_type().to_owned(),
                key: event.key().map(str::to_owned),
                sequence: detail.sequence,
                correlation_id: event.correlation_id().map(str::to_owned),
                causation_id: event.causation_id().map(str::to_owned),
                headers: event.headers().clone(),
                payload: event.payload().clone(),
                created_at: event.created_at(),
                completed_at: detail.completed_at,
                handlers: detail.handlers,
            },
            deliveries: detail.deliveries.into_iter().map(Delivery::from).collect(),
        }
    }
}

/// `GET /dead-letters`: the largest group first.
#[derive(Debug, Serialize)]
pub(crate) struct DeadLettersAnswer {
    groups: Vec<DeadLetterGroup>,
}

/// Dead letters of one handler with one last error.
#[derive(Debug, Serialize)]
struct DeadLetterGroup {
    handler: String,
    error: Option<String>,
    count: u64,
    first_created_at: Option<Timestamp>,
    last_updated_at: Option<Timestamp>,
    /// One of them, to open.
    sample_id: String,
}

impl From<Vec<relaybus::DeadLetterGroup>> for DeadLettersAnswer {
    fn from(groups: Vec<relaybus::DeadLetterGroup>) -> Self {
        let groups = groups
            .into_iter()
            .map(|group| DeadLetterGroup {
                handler: group.handler,
                error: group.error,
                count: group.count,
                first_created_at: group.first_created_at,
                last_updated_at: group.last_updated_at,
                sample_id: group.sample_id,
            })
            .collect();
        DeadLettersAnswer { groups }
    }
}
