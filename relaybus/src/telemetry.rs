//! Metrics, through the [`metrics`](https://docs.rs/metrics) facade, named after the
//! OpenTelemetry messaging conventions where one fits.
//!
//! relaybus records into whatever recorder the application installs (Prometheus, OpenTelemetry,
//! StatsD, ...). Install it **before building the bus**: the bus registers its metrics once,
//! when it is built, so that recording costs an increment on a handle, and nothing but a
//! branch while no recorder is installed.
//!
//! | name | kind | attributes | what |
//! |---|---|---|---|
//! | `messaging.client.sent.messages` | counter | destination | events appended by a publish (counted when appended in the transaction, so a publish whose transaction then aborts counts too) |
//! | `messaging.client.consumed.messages` | counter | destination, consumer group | deliveries claimed |
//! | `messaging.process.duration` | histogram, s | destination, consumer group, `error.type` on failure | one handler run |
//! | `messaging.client.operation.duration` | histogram, s | operation, `error.type` on failure | a publish (`publish`), a claim (`receive`), a batch completion (`settle`) |
//! | `relaybus.delivery.attempts` | counter | destination, consumer group | handler runs started |
//! | `relaybus.delivery.retries` | counter | destination, consumer group | failed runs rescheduled for a retry |
//! | `relaybus.delivery.dead_letters` | counter | destination, consumer group | deliveries buried as dead letters |
//! | `relaybus.delivery.latency` | histogram, s | destination, consumer group | from the event's creation to the start of its first run |
//!
//! The attributes: `messaging.system` is always `relaybus`; the destination
//! (`messaging.destination.name`) is the event type; the consumer group
//! (`messaging.consumer.group.name`) is the handler id; the operation
//! (`messaging.operation.name`) is `publish`, `receive` or `settle`; `error.type` is `error`
//! (the handler returned an error), `panic`, `timeout` or `permanent`, or for an operation
//! `database`. No metric carries an event id or an ordering key, whose number has no bound.
//!
//! `relaybus-axum` adds `relaybus.request.transactions`, a counter by `relaybus.outcome`:
//! `committed`, `aborted` (a status that rolls back, a budget spent, a failed commit),
//! `unacknowledged` (committed on the primary, its write concern failed) and `retried` (run
//! again after a transient error; the run that follows counts again).

use std::collections::HashMap;

use metrics::{Counter, Histogram, Label, counter, histogram};

use crate::handler::Subscription;

/// `messaging.client.sent.messages`: events appended by a publish.
pub const SENT_MESSAGES: &str = "messaging.client.sent.messages";
/// `messaging.client.consumed.messages`: deliveries claimed.
pub const CONSUMED_MESSAGES: &str = "messaging.client.consumed.messages";
/// `messaging.process.duration`: one handler run, in seconds.
pub const PROCESS_DURATION: &str = "messaging.process.duration";
/// `messaging.client.operation.duration`: a publish, claim or completion, in seconds.
pub const OPERATION_DURATION: &str = "messaging.client.operation.duration";
/// `relaybus.delivery.attempts`: handler runs started.
pub const ATTEMPTS: &str = "relaybus.delivery.attempts";
/// `relaybus.delivery.retries`: failed runs rescheduled for another attempt.
pub const RETRIES: &str = "relaybus.delivery.retries";
/// `relaybus.delivery.dead_letters`: deliveries buried after their last attempt, or at once
/// for a permanent failure.
pub const DEAD_LETTERS: &str = "relaybus.delivery.dead_letters";
/// `relaybus.delivery.latency`: from an event's creation to the start of its first run, in
/// seconds.
pub const LATENCY: &str = "relaybus.delivery.latency";
/// `relaybus.request.transactions`: request transactions of `relaybus-axum`, by outcome.
pub const REQUEST_TRANSACTIONS: &str = "relaybus.request.transactions";

/// The attribute naming the messaging system, always [`SYSTEM`].
pub const SYSTEM_ATTRIBUTE: &str = "messaging.system";
/// The value of [`SYSTEM_ATTRIBUTE`].
pub const SYSTEM: &str = "relaybus";
/// The attribute naming the event type.
pub const DESTINATION_ATTRIBUTE: &str = "messaging.destination.name";
/// The attribute naming the handler.
pub const CONSUMER_GROUP_ATTRIBUTE: &str = "messaging.consumer.group.name";
/// The attribute naming the operation: `publish`, `receive` or `settle`.
pub const OPERATION_ATTRIBUTE: &str = "messaging.operation.name";
/// The attribute naming the kind of failure.
pub const ERROR_TYPE_ATTRIBUTE: &str = "error.type";
/// The attribute naming the outcome of a request transaction.
pub const OUTCOME_ATTRIBUTE: &str = "relaybus.outcome";

/// How a handler run failed, as `error.type` says it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum FailureKind {
    Error,
    Panic,
    Timeout,
    Permanent,
}

impl FailureKind {
    fn as_str(self) -> &'static str {
        match self {
            FailureKind::Error => "error",
            FailureKind::Panic => "panic",
            FailureKind::Timeout => "timeout",
            FailureKind::Permanent => "permanent",
        }
    }
}

/// The metrics of one handler, registered when the bus is built.
#[derive(Debug)]
pub(crate) struct HandlerMetrics {
    labels: Vec<Label>,
    pub(crate) consumed: Counter,
    pub(crate) attempts: Counter,
    pub(crate) retries: Counter,
    pub(crate) dead_letters: Counter,
    pub(crate) succeeded: Histogram,
    pub(crate) latency: Histogram,
}

impl HandlerMetrics {
    fn new(subscription: &Subscription) -> Self {
        let labels = vec![
            Label::from_static_parts(SYSTEM_ATTRIBUTE, SYSTEM),
            Label::from_static_parts(DESTINATION_ATTRIBUTE, subscription.event_type),
            Label::new(CONSUMER_GROUP_ATTRIBUTE, subscription.id.clone()),
        ];
        HandlerMetrics {
            consumed: counter!(CONSUMED_MESSAGES, labels.iter()),
            attempts: counter!(ATTEMPTS, labels.iter()),
            retries: counter!(RETRIES, labels.iter()),
            dead_letters: counter!(DEAD_LETTERS, labels.iter()),
            succeeded: histogram!(PROCESS_DURATION, labels.iter()),
            latency: histogram!(LATENCY, labels.iter()),
            labels,
        }
    }

    /// Records a failed run: rare, so its handle is looked up each time.
    pub(crate) fn failed(&self, kind: FailureKind, seconds: f64) {
        let mut labels = self.labels.clone();
        labels.push(Label::from_static_parts(
            ERROR_TYPE_ATTRIBUTE,
            kind.as_str(),
        ));
        histogram!(PROCESS_DURATION, labels).record(seconds);
    }
}

/// The metrics of a bus: its handlers', its publishes', its claims' and completions'.
#[derive(Debug)]
pub(crate) struct BusMetrics {
    handlers: HashMap<String, HandlerMetrics>,
    sent: HashMap<&'static str, Counter>,
    publish: Histogram,
    receive: Histogram,
    settle: Histogram,
}

impl BusMetrics {
    /// Registers the metrics of these subscriptions, with the recorder installed now.
    pub(crate) fn new(subscriptions: &[Subscription]) -> Self {
        let handlers = subscriptions
            .iter()
            .map(|s| (s.id.clone(), HandlerMetrics::new(s)))
            .collect();
        let sent = subscriptions
            .iter()
            .map(|s| (s.event_type, sent_counter(s.event_type.to_owned())))
            .collect();
        BusMetrics {
            handlers,
            sent,
            publish: operation("publish"),
            receive: operation("receive"),
            settle: operation("settle"),
        }
    }

    /// A handler's metrics; `None` for a handler the bus does not run.
    pub(crate) fn handler(&self, id: &str) -> Option<&HandlerMetrics> {
        self.handlers.get(id)
    }

    /// Counts published events of a type.
    pub(crate) fn sent(&self, event_type: &str, events: u64) {
        match self.sent.get(event_type) {
            Some(counter) => counter.increment(events),
            // A type no handler of this bus subscribes to: rare, looked up each time.
            None => sent_counter(event_type.to_owned()).increment(events),
        }
    }

    /// Records how long a publish, claim or completion took.
    pub(crate) fn operation(&self, operation: Operation, seconds: f64, failed: bool) {
        if failed {
            histogram!(
                OPERATION_DURATION,
                SYSTEM_ATTRIBUTE => SYSTEM,
                OPERATION_ATTRIBUTE => operation.as_str(),
                ERROR_TYPE_ATTRIBUTE => "database",
            )
            .record(seconds);
            return;
        }
        match operation {
            Operation::Publish => &self.publish,
            Operation::Receive => &self.receive,
            Operation::Settle => &self.settle,
        }
        .record(seconds);
    }
}

/// A store operation timed by `messaging.client.operation.duration`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Operation {
    Publish,
    Receive,
    Settle,
}

impl Operation {
    fn as_str(self) -> &'static str {
        match self {
            Operation::Publish => "publish",
            Operation::Receive => "receive",
            Operation::Settle => "settle",
        }
    }
}

fn sent_counter(event_type: String) -> Counter {
    counter!(SENT_MESSAGES, SYSTEM_ATTRIBUTE => SYSTEM, DESTINATION_ATTRIBUTE => event_type)
}

fn operation(name: &'static str) -> Histogram {
    histogram!(OPERATION_DURATION, SYSTEM_ATTRIBUTE => SYSTEM, OPERATION_ATTRIBUTE => name)
}
