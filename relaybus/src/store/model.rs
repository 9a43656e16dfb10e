//! What the bus, the operator API and every store exchange: append requests and results,
//! statistics, listings, requeue and purge results. Nothing here names a database.

use crate::{event::EventEnvelope, time::Timestamp};

/// One event to append, with the ids of the handlers that should get a delivery of it.
///
/// Every handler is held to the event's key order unless it is named in
/// [`unordered`](Self::unordered) too: its delivery then ignores the key.
#[derive(Debug, Clone, Copy)]
pub struct AppendRequest<'a> {
    pub(crate) event: &'a EventEnvelope,
    pub(crate) handlers: &'a [String],
    pub(crate) unordered: &'a [String],
    pub(crate) due_at: Option<Timestamp>,
}

impl<'a> AppendRequest<'a> {
    /// An event and the handlers subscribed to it, every one held to the event's key order, its
    /// deliveries due at once.
    pub fn new(event: &'a EventEnvelope, handlers: &'a [String]) -> Self {
        AppendRequest {
            event,
            handlers,
            unordered: &[],
            due_at: None,
        }
    }

    /// Names the handlers, among [`handlers`](Self::handlers), whose deliveries ignore the
    /// event's ordering key (see [`Subscription::unordered`](crate::Subscription::unordered)):
    /// they are not held to the order of the key and hold nothing of it back. Ids that are not
    /// among the handlers are ignored; for an event without a key this changes nothing.
    ///
    /// The choice is made for the deliveries this request creates, and stays with them.
    pub fn unordered(mut self, handlers: &'a [String]) -> Self {
        self.unordered = handlers;
        self
    }

    /// Makes the new deliveries due at `at` rather than at once: a delayed publish. A keyed
    /// event keeps its place in its key's order, so the later events of its key wait for it
    /// (those of its unordered handlers excepted).
    pub fn due_at(mut self, at: Timestamp) -> Self {
        self.due_at = Some(at);
        self
    }

    /// When the new deliveries become due, if not at once.
    pub fn due(&self) -> Option<Timestamp> {
        self.due_at
    }

    /// The event.
    pub fn event(&self) -> &'a EventEnvelope {
        self.event
    }

    /// The handlers that should get a delivery of it.
    pub fn handlers(&self) -> &'a [String] {
        self.handlers
    }

    /// The handlers whose deliveries ignore the event's ordering key, as given to
    /// [`unordered`](Self::unordered).
    pub fn unordered_handlers(&self) -> &'a [String] {
        self.unordered
    }

    /// Whether `handler`'s delivery of this event is held to the key's order: `false` when the
    /// handler is named in [`unordered`](Self::unordered), or when the event has no key.
    pub fn is_ordered(&self, handler: &str) -> bool {
        self.event.key().is_some() && !self.unordered.iter().any(|h| h == handler)
    }
}

/// What appending one event did.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Appended {
    /// The event id.
    pub event_id: String,
    /// Whether the event was new; `false` when the store already held an event with this id.
    pub created: bool,
    /// The event's sequence within its ordering key, if it has a key.
    pub sequence: Option<i64>,
    /// The handlers that got a new delivery. Handlers the event already had a delivery for,
    /// completed ones included, are left out.
    pub new_deliveries: Vec<String>,
}

/// Counts of deliveries by state, from [`crate::store::Inspect::statistics`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Statistics {
    /// Deliveries waiting or running (running ones are pending documents listed by their lane),
    /// parked ones included.
    pub pending: u64,
    /// Pending deliveries a worker currently runs.
    pub running: u64,
    /// Pending deliveries parked behind an unfinished predecessor of their key.
    pub parked: u64,
    /// Dead letters.
    pub dead: u64,
    /// Completion records (with completion history), plus `completed` documents an earlier
    /// version left. Without completion history, completed deliveries are deleted and not
    /// counted: see [`completion_history`](Self::completion_history).
    pub completed: u64,
    /// Whether the store keeps completion records, so that [`completed`](Self::completed)
    /// counts completions.
    pub completion_history: bool,
    /// The due time of the oldest pending delivery, parked ones included: how far behind the
    /// workers are.
    pub oldest_due_at: Option<Timestamp>,
}

/// The deliveries of one handler by state, as
/// [`Inspect::handler_statistics`](crate::store::Inspect::handler_statistics) counts them.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct HandlerStatistics {
    /// The handler id.
    pub handler: String,
    /// Deliveries waiting or running, parked ones included.
    pub pending: u64,
    /// Pending deliveries a worker currently runs.
    pub running: u64,
    /// Pending deliveries parked behind an unfinished predecessor of their key.
    pub parked: u64,
    /// Dead letters.
    pub dead: u64,
    /// The due time of the handler's oldest pending delivery, parked ones included.
    pub oldest_due_at: Option<Timestamp>,
}

impl HandlerStatistics {
    /// A handler with no delivery counted yet.
    pub fn new(handler: impl Into<String>) -> Self {
        HandlerStatistics {
            handler: handler.into(),
            ..HandlerStatistics::default()
        }
    }
}

/// The state of a listed delivery.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum DeliveryStatus {
    /// Waiting, running, or parked.
    Pending,
    /// Buried after its last attempt failed; see [`crate::store::Operate::requeue`].
    Dead,
    /// Completed: a completion-history record.
    Completed,
}

impl DeliveryStatus {
    /// The stored name: `pending`, `dead` or `completed`.
    pub fn as_str(&self) -> &'static str {
        match self {
            DeliveryStatus::Pending => "pending",
            DeliveryStatus::Dead => "dead",
            DeliveryStatus::Completed => "completed",
        }
    }

    /// The state of a stored name, as [`as_str`](Self::as_str) writes it.
    pub fn from_stored(name: &str) -> Option<Self> {
        match name {
            "pending" => Some(DeliveryStatus::Pending),
            "dead" => Some(DeliveryStatus::Dead),
            "completed" => Some(DeliveryStatus::Completed),
            _ => None,
        }
    }
}

/// What [`crate::store::Inspect::list_deliveries`] returns: one delivery or completion record.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct DeliveryRecord {
    /// The delivery id as text (the `Display` of the lease's delivery id), as
    /// [`requeue`](crate::store::Operate::requeue) and [`DeliveryQuery::after`] take it.
    pub id: String,
    /// The event id.
    pub event_id: String,
    /// The handler id.
    pub handler: String,
    /// The event type name.
    pub event_type: String,
    /// The ordering key, if any.
    pub key: Option<String>,
    /// The sequence within the key, if keyed.
    pub sequence: Option<i64>,
    /// Whether the delivery ignores its key's order: its handler was
    /// [unordered](crate::Subscription::unordered) when the event was published. Always
    /// `false` for an event without a key.
    pub unordered: bool,
    /// The state.
    pub status: DeliveryStatus,
    /// Whether a pending delivery is parked behind an unfinished predecessor.
    pub parked: bool,
    /// Whether a worker runs the pending delivery now (its lane lists it in flight).
    pub running: bool,
    /// Attempts that ended (for a completion record: including the one that completed).
    pub attempts: u32,
    /// When a pending delivery is due.
    pub due_at: Option<Timestamp>,
    /// When the delivery was created.
    pub created_at: Option<Timestamp>,
    /// When it last changed state, if ever.
    pub updated_at: Option<Timestamp>,
    /// When it completed, for completion records.
    pub completed_at: Option<Timestamp>,
    /// The error of the last failed attempt.
    pub last_error: Option<String>,
    /// The failed attempts, oldest first: the last [`MAX_ERROR_HISTORY`] of them, kept across
    /// requeues and into the completion record.
    pub errors: Vec<AttemptError>,
    /// How many times the delivery was requeued from the dead letters.
    pub requeues: u32,
}

/// How many failed attempts a delivery remembers.
pub const MAX_ERROR_HISTORY: usize = 10;

/// One failed attempt of a delivery, in its error history.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct AttemptError {
    /// When it failed.
    pub at: Timestamp,
    /// Which attempt it was (counted since the last requeue), when known; a claim lost with
    /// its worker is charged without one.
    pub attempt: Option<u32>,
    /// What went wrong, cut to 1 KiB.
    pub error: String,
}

impl AttemptError {
    /// A failed attempt.
    pub fn new(at: Timestamp, attempt: Option<u32>, error: impl Into<String>) -> Self {
        AttemptError {
            at,
            attempt,
            error: error.into(),
        }
    }
}

/// Which deliveries [`crate::store::Inspect::list_deliveries`] returns; every filter is optional
/// and they combine with "and". Ordered by creation, oldest first.
///
/// # Example
///
/// ```
/// use relaybus::{DeliveryQuery, DeliveryStatus};
///
/// let query = DeliveryQuery::new()
///     .status(DeliveryStatus::Dead)
///     .handler("send-confirmation")
///     .limit(50);
/// # let _ = query;
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[must_use]
pub struct DeliveryQuery {
    pub(crate) status: Option<DeliveryStatus>,
    pub(crate) handler: Option<String>,
    pub(crate) event_type: Option<String>,
    pub(crate) created_from: Option<Timestamp>,
    pub(crate) created_before: Option<Timestamp>,
    pub(crate) pending_state: Option<PendingState>,
    pub(crate) key: Option<String>,
    pub(crate) event_id: Option<String>,
    pub(crate) error_contains: Option<String>,
    pub(crate) last_error: Option<String>,
    pub(crate) after: Option<String>,
    pub(crate) limit: u32,
}

/// What a pending delivery is doing, for [`DeliveryQuery::pending_state`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum PendingState {
    /// Due or scheduled, neither running nor parked.
    Waiting,
    /// A worker runs it now.
    Running,
    /// Parked behind an unfinished predecessor of its key.
    Parked,
}

impl PendingState {
    /// `waiting`, `running` or `parked`.
    pub fn as_str(&self) -> &'static str {
        match self {
            PendingState::Waiting => "waiting",
            PendingState::Running => "running",
            PendingState::Parked => "parked",
        }
    }
}

impl Default for DeliveryQuery {
    fn default() -> Self {
        DeliveryQuery::new()
    }
}

impl DeliveryQuery {
    /// Everything, the first 100 records.
    pub fn new() -> Self {
        DeliveryQuery {
            status: None,
            handler: None,
            event_type: None,
            created_from: None,
            created_before: None,
            pending_state: None,
            key: None,
            event_id: None,
            error_contains: None,
            last_error: None,
            after: None,
            limit: 100,
        }
    }

    /// Only deliveries in this state. [`DeliveryStatus::Completed`] lists completion records,
    /// which exist only with completion history.
    pub fn status(mut self, status: DeliveryStatus) -> Self {
        self.status = Some(status);
        self
    }

    /// Only deliveries of this handler.
    pub fn handler(mut self, handler: impl Into<String>) -> Self {
        self.handler = Some(handler.into());
        self
    }

    /// Only deliveries of events of this type.
    pub fn event_type(mut self, event_type: impl Into<String>) -> Self {
        self.event_type = Some(event_type.into());
        self
    }

    /// Only deliveries created at or after `from`.
    pub fn created_from(mut self, from: impl Into<Timestamp>) -> Self {
        self.created_from = Some(from.into());
        self
    }

    /// Only deliveries created before `before`.
    pub fn created_before(mut self, before: impl Into<Timestamp>) -> Self {
        self.created_before = Some(before.into());
        self
    }

    /// Only pending deliveries doing this: waiting, running or parked. Implies
    /// [`DeliveryStatus::Pending`]; with another status nothing matches.
    pub fn pending_state(mut self, state: PendingState) -> Self {
        self.pending_state = Some(state);
        self
    }

    /// Only deliveries of events with this ordering key.
    pub fn key(mut self, key: impl Into<String>) -> Self {
        self.key = Some(key.into());
        self
    }

    /// Only the deliveries of this event.
    pub fn event_id(mut self, event_id: impl Into<String>) -> Self {
        self.event_id = Some(event_id.into());
        self
    }

    /// Only deliveries whose last error contains `text`, compared without regard to case. The
    /// text is matched as it is: no pattern syntax.
    pub fn error_contains(mut self, text: impl Into<String>) -> Self {
        self.error_contains = Some(text.into());
        self
    }

    /// Only deliveries whose last error is exactly `error`: one group of
    /// [`Inspect::dead_letter_groups`](crate::store::Inspect::dead_letter_groups).
    pub fn last_error(mut self, error: impl Into<String>) -> Self {
        self.last_error = Some(error.into());
        self
    }

    /// Only records after the delivery with this id, for paging: pass the
    /// [`id`](DeliveryRecord::id) of the last record of the previous page. A page costs the
    /// same however deep it is.
    pub fn after(mut self, id: impl Into<String>) -> Self {
        self.after = Some(id.into());
        self
    }

    /// Return at most `limit` records, 1 to 1000 (100 by default).
    pub fn limit(mut self, limit: u32) -> Self {
        self.limit = limit;
        self
    }
}

/// What [`crate::store::Operate::requeue`] did with each id.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Requeued {
    /// Dead deliveries made pending again.
    pub requeued: Vec<String>,
    /// Dead deliveries left dead because a later delivery of their key is running; try again
    /// once it finished.
    pub blocked: Vec<String>,
    /// Ids that name no dead delivery (unknown, not dead, or not an id at all).
    pub not_found: Vec<String>,
}

/// What [`crate::store::Operate::discard`] did with each id.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Discarded {
    /// Dead deliveries deleted.
    pub discarded: Vec<String>,
    /// Ids that name no dead delivery (unknown, not dead, or not an id at all).
    pub not_found: Vec<String>,
}

/// What [`crate::store::Operate::bury_by_id`] did with each id.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Buried {
    /// Pending deliveries made dead letters.
    pub buried: Vec<String>,
    /// Pending deliveries left alone because a worker runs them now; its result settles them.
    pub running: Vec<String>,
    /// Ids that name no pending delivery (unknown, dead already, or not an id at all).
    pub not_found: Vec<String>,
}

/// What [`crate::store::Operate::purge`] deletes. Leave a cutoff out to keep those documents.
///
/// Cutoffs compare with the times the store recorded: when a delivery died, when an event last
/// completed, and, for an event that never completed, its own creation time
/// ([`EventEnvelope::created_at`](crate::EventEnvelope::created_at)).
///
/// # Example
///
/// ```
/// use std::time::Duration;
/// use relaybus::{PurgeOptions, Timestamp};
///
/// let week_ago = Timestamp::now().saturating_sub(Duration::from_secs(7 * 86_400));
/// let options = PurgeOptions::new().dead_before(week_ago).completed_before(week_ago);
/// # let _ = options;
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[must_use]
pub struct PurgeOptions {
    pub(crate) dead_before: Option<Timestamp>,
    pub(crate) completed_before: Option<Timestamp>,
    pub(crate) request_keys_expired_at: Option<Timestamp>,
}

impl PurgeOptions {
    /// Deletes nothing until a cutoff is set.
    pub fn new() -> Self {
        PurgeOptions::default()
    }

    /// Delete dead deliveries buried before `cutoff`.
    pub fn dead_before(mut self, cutoff: impl Into<Timestamp>) -> Self {
        self.dead_before = Some(cutoff.into());
        self
    }

    /// Delete completion records of completions before `cutoff`, and let events whose last
    /// completion was before it go.
    pub fn completed_before(mut self, cutoff: impl Into<Timestamp>) -> Self {
        self.completed_before = Some(cutoff.into());
        self
    }

    /// Delete the stored answers of idempotent requests that expired at or before `now`
    /// ([`IdempotentRequests`](crate::store::IdempotentRequests)). The bus's retention gives
    /// it the current time.
    pub fn request_keys_expired_at(mut self, now: impl Into<Timestamp>) -> Self {
        self.request_keys_expired_at = Some(now.into());
        self
    }

    /// The earliest cutoff of deliveries and events given: events that never completed go
    /// once created before it.
    pub fn earliest(&self) -> Option<Timestamp> {
        match (self.dead_before, self.completed_before) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// The latest cutoff of deliveries and events given: no event created after it can go.
    pub fn latest(&self) -> Option<Timestamp> {
        match (self.dead_before, self.completed_before) {
            (Some(a), Some(b)) => Some(a.max(b)),
            (a, b) => a.or(b),
        }
    }
}

/// What a purge deleted.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Purged {
    /// Dead deliveries.
    pub dead_deliveries: u64,
    /// Completion records, and `completed` delivery documents an earlier version left.
    pub completion_records: u64,
    /// Events.
    pub events: u64,
    /// Stored answers of idempotent requests whose retention ended.
    pub request_keys: u64,
}

/// An event with every delivery it has, from
/// [`Inspect::event_detail`](crate::store::Inspect::event_detail).
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct EventDetail {
    /// The event, payload and headers included.
    pub event: crate::EventEnvelope,
    /// Its sequence within its ordering key, if keyed.
    pub sequence: Option<i64>,
    /// When every delivery of it completed, once they have. The MongoDB store records no time
    /// for completions within a minute of a new event's creation (see the crate documentation);
    /// it gives its creation plus two minutes then, the latest they can have come.
    pub completed_at: Option<Timestamp>,
    /// The handlers it was delivered to.
    pub handlers: Vec<String>,
    /// Its deliveries, pending and dead ones and completion records, in handler order.
    pub deliveries: Vec<DeliveryRecord>,
}

/// The state of one unit of lease (MongoDB: a lane), from
/// [`Inspect::lanes`](crate::store::Inspect::lanes).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct LaneStatus {
    /// The lane number.
    pub lane: u32,
    /// The owner name of its holder, while held.
    pub owner: Option<String>,
    /// When the holder's lease ends, while held.
    pub lease_expires_at: Option<Timestamp>,
    /// Deliveries the holder claimed and has not settled.
    pub in_flight: u32,
    /// Claims of earlier holders still to be charged as failed attempts.
    pub lost: u32,
    /// How many times the lane changed hands.
    pub epoch: i64,
}

impl LaneStatus {
    /// A lane nobody holds.
    pub fn new(lane: u32) -> Self {
        LaneStatus {
            lane,
            owner: None,
            lease_expires_at: None,
            in_flight: 0,
            lost: 0,
            epoch: 0,
        }
    }
}

/// A key whose deliveries of one handler are parked, and what they wait for.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct BlockedKey {
    /// The handler.
    pub handler: String,
    /// The ordering key.
    pub key: String,
    /// How many of its deliveries are parked.
    pub parked: u64,
    /// The lowest parked sequence.
    pub first_parked_sequence: Option<i64>,
    /// What they wait for: the key's lowest pending delivery that is not parked (running,
    /// retrying later, or due); `None` when the next claim will move them on.
    pub waiting_for: Option<DeliveryRecord>,
}

/// The lanes, and the keys held back in them, from
/// [`Inspect::lanes`](crate::store::Inspect::lanes).
#[derive(Debug, Clone, Default, PartialEq)]
#[non_exhaustive]
pub struct LaneReport {
    /// Every lane, in lane order.
    pub lanes: Vec<LaneStatus>,
    /// Keys with parked deliveries, the most parked first, at most
    /// [`MAX_BLOCKED_KEYS`].
    pub blocked: Vec<BlockedKey>,
}

/// The most blocked keys a [`LaneReport`] lists.
pub const MAX_BLOCKED_KEYS: usize = 100;

/// Dead letters of one handler with one error, from
/// [`Inspect::dead_letter_groups`](crate::store::Inspect::dead_letter_groups).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct DeadLetterGroup {
    /// The handler.
    pub handler: String,
    /// The error of their last attempt, as stored (cut to 1 KiB).
    pub error: Option<String>,
    /// How many dead letters have it.
    pub count: u64,
    /// When the oldest of them was created.
    pub first_created_at: Option<Timestamp>,
    /// When the newest of them last changed (was buried).
    pub last_updated_at: Option<Timestamp>,
    /// The id of one of them, to open.
    pub sample_id: String,
}

/// The most groups [`Inspect::dead_letter_groups`](crate::store::Inspect::dead_letter_groups)
/// returns.
pub const MAX_DEAD_LETTER_GROUPS: usize = 200;
