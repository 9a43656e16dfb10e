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
//! | `relaybus.deliveries` | gauge | consumer group, `relaybus.state` | unfinished deliveries: `waiting`, `running`, `parked`, `dead` |
//! | `relaybus.delivery.oldest_due.age` | gauge, s | consumer group | how long the handler's oldest pending delivery has been due |
//! | `relaybus.lane.takeovers` | counter | | lanes taken over from a holder whose lease ended with deliveries unfinished |
//! | `relaybus.delivery.lost_attempts` | counter | | attempts charged to deliveries their worker lost |
//! | `relaybus.batch.size` | histogram | destination, consumer group | deliveries in each batch a batch handler ran |
//! | `relaybus.limit.waits` | counter | destination, consumer group, `relaybus.limit` | deliveries that waited for a limit before they started: `concurrency` (every slot of the handler's global concurrency held), `rate` (its rate limit's window full), `bus` (the bus held as many as the limit lets run, so it gave it back uncharged) |
//! | `relaybus.lane.conflicts` | counter | | lanes a claim picked from that changed before its record (MongoDB: another claimer took them first, or a requeue touched them; the picks there go back) |
//!
//! The two gauges come from one aggregation of the store
//! ([`Inspect::handler_statistics`](crate::store::Inspect::handler_statistics)) every
//! `RelayBusBuilder::gauge_interval` (15 s by default), run by one started bus of the deployment at
//! a time, the one that holds the store's `gauges` lead
//! ([`Leadership::lead`](crate::store::Leadership::lead)), so that N processes do not report N
//! copies. A bus that loses the lead sets its gauges to zero, so summing them across processes
//! counts each delivery once. Buses that share a store instance share its lead, and sample with one
//! count ([`Inspect::gauge_statistics`](crate::store::Inspect::gauge_statistics)).
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

use std::collections::{HashMap, HashSet};

use metrics::{Counter, Histogram, Label, counter, gauge, histogram};

use crate::{handler::Subscription, store::HandlerStatistics, time::Timestamp};

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
/// `relaybus.deliveries`: unfinished deliveries by handler and state (`waiting`, `running`,
/// `parked`, `dead`), a gauge sampled by one process of the deployment at a time.
pub const DELIVERIES: &str = "relaybus.deliveries";
/// `relaybus.delivery.oldest_due.age`: how long the oldest pending delivery of a handler has
/// been due, in seconds (0 when none is due), sampled with [`DELIVERIES`].
pub const OLDEST_DUE_AGE: &str = "relaybus.delivery.oldest_due.age";
/// `relaybus.lane.takeovers`: lanes taken over from a holder whose lease ended with deliveries
/// unfinished.
pub const TAKEOVERS: &str = "relaybus.lane.takeovers";
/// `relaybus.delivery.lost_attempts`: attempts charged to deliveries whose worker lost them
/// (it died, or stalled past its lease).
pub const LOST_ATTEMPTS: &str = "relaybus.delivery.lost_attempts";
/// `relaybus.lane.conflicts`: lanes a claim picked deliveries from that changed before its
/// record (the MongoDB store: another claimer took them first, or a requeue touched them; the
/// claim gives those picks up). A steady count says claimers compete for the same free lanes.
pub const LANE_CONFLICTS: &str = "relaybus.lane.conflicts";
/// `relaybus.batch.size`: how many deliveries each batch of a batch handler held.
pub const BATCH_SIZE: &str = "relaybus.batch.size";
/// `relaybus.limit.waits`: deliveries that waited for a handler's global concurrency or rate
/// limit before they started, by `relaybus.limit`.
pub const LIMIT_WAITS: &str = "relaybus.limit.waits";
/// The attribute naming the limit a delivery waited for: `concurrency`, `rate` or `bus`.
pub const LIMIT_ATTRIBUTE: &str = "relaybus.limit";
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
/// The attribute naming the state of counted deliveries.
pub const STATE_ATTRIBUTE: &str = "relaybus.state";

/// The role whose lead samples the gauges.
pub(crate) const GAUGE_ROLE: &str = "gauges";

/// Records one sample of the delivery gauges. Handlers in `reported` that no longer have a
/// delivery are set to zero, so that a gauge does not keep its last count once its handler is
/// done.
pub(crate) fn record_gauges(
    statistics: &[HandlerStatistics],
    now: Timestamp,
    reported: &mut HashSet<String>,
) {
    let mut seen = HashSet::with_capacity(statistics.len());
    for handler in statistics {
        let waiting = handler
            .pending
            .saturating_sub(handler.running)
            .saturating_sub(handler.parked);
        for (state, count) in [
            ("waiting", waiting),
            ("running", handler.running),
            ("parked", handler.parked),
            ("dead", handler.dead),
        ] {
            deliveries_gauge(&handler.handler, state).set(count as f64);
        }
        let age = handler
            .oldest_due_at
            .map_or(0.0, |due| now.duration_since(due).as_secs_f64());
        age_gauge(&handler.handler).set(age);
        seen.insert(handler.handler.clone());
    }
    for gone in reported.difference(&seen) {
        for state in ["waiting", "running", "parked", "dead"] {
            deliveries_gauge(gone, state).set(0.0);
        }
        age_gauge(gone).set(0.0);
    }
    *reported = seen;
}

fn deliveries_gauge(handler: &str, state: &'static str) -> metrics::Gauge {
    gauge!(
        DELIVERIES,
        SYSTEM_ATTRIBUTE => SYSTEM,
        CONSUMER_GROUP_ATTRIBUTE => handler.to_owned(),
        STATE_ATTRIBUTE => state,
    )
}

fn age_gauge(handler: &str) -> metrics::Gauge {
    gauge!(
        OLDEST_DUE_AGE,
        SYSTEM_ATTRIBUTE => SYSTEM,
        CONSUMER_GROUP_ATTRIBUTE => handler.to_owned(),
    )
}

/// Counts lanes taken over and the lost attempts charged with them (store side).
#[cfg_attr(not(feature = "mongodb"), allow(dead_code))]
pub(crate) fn record_takeovers(lanes: u64, lost_attempts: u64) {
    if lanes > 0 {
        counter!(TAKEOVERS, SYSTEM_ATTRIBUTE => SYSTEM).increment(lanes);
    }
    if lost_attempts > 0 {
        counter!(LOST_ATTEMPTS, SYSTEM_ATTRIBUTE => SYSTEM).increment(lost_attempts);
    }
}

/// Counts lanes a claim picked from that changed before its record (store side).
#[cfg_attr(not(feature = "mongodb"), allow(dead_code))]
pub(crate) fn record_lane_conflicts(lanes: u64) {
    if lanes > 0 {
        counter!(LANE_CONFLICTS, SYSTEM_ATTRIBUTE => SYSTEM).increment(lanes);
    }
}

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
    /// How many deliveries each batch of a batch handler held.
    pub(crate) batch_size: Histogram,
    /// The last hour's runs, for the operator page.
    pub(crate) activity: crate::activity::ActivityLog,
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
            batch_size: histogram!(BATCH_SIZE, labels.iter()),
            activity: crate::activity::ActivityLog::default(),
            labels,
        }
    }

    /// Counts a delivery that waited for a limit (`concurrency`, `rate` or `bus`).
    pub(crate) fn limit_wait(&self, limit: &'static str) {
        let mut labels = self.labels.clone();
        labels.push(Label::from_static_parts(LIMIT_ATTRIBUTE, limit));
        counter!(LIMIT_WAITS, labels).increment(1);
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

    /// The last hour of every handler of the bus, in handler order.
    pub(crate) fn activity(&self, now: crate::Timestamp) -> Vec<crate::activity::HandlerActivity> {
        let mut activity: Vec<_> = self
            .handlers
            .iter()
            .map(|(id, metrics)| metrics.activity.report(id, now))
            .collect();
        activity.sort_by(|a, b| a.handler.cmp(&b.handler));
        activity
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
