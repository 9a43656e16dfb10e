//! The store's schema: the names of the fields of its documents, the values of the `status`
//! and `lane` fields of a delivery, and its indexes (name, keys and partial filter).
//!
//! Queries take their names from here, so that a hint names an index that `setup()` creates, and
//! a sort that must follow an index's keys to be a distinct scan is that index's key document.
//! `doc!` takes a constant key as it is: `doc! { field::STATUS: status::PENDING }`.

use std::time::Duration;

use mongodb::bson::Document;

/// An event is fresh ([`field::FRESH`]) when its creation time is within this of the time it is
/// appended, either way (clocks differ a little).
pub(crate) const FRESH_BY: Duration = Duration::from_secs(10);

/// A fresh delivery completed within this of its creation, never requeued, leaves the event's
/// `completedAt` as it is: stamping every event costs the server a write per delivery.
pub(crate) const QUICK_COMPLETION: Duration = Duration::from_secs(60);

/// The latest, after its creation, that a fresh event's completions without a stamp came:
/// [`FRESH_BY`] plus [`QUICK_COMPLETION`], with room for the clocks of the processes that
/// appended and completed to differ by most of a minute.
pub(crate) const UNSTAMPED_BY: Duration = Duration::from_secs(120);

/// Field names, shared by the collections whose documents have the field.
pub(crate) mod field {
    /// The document id: an ObjectId for deliveries and completion records, the event id for
    /// events, the lane number for lanes, the ordering key for key sequences.
    pub(crate) const ID: &str = "_id";

    // Deliveries (and completion records, which keep a delivery's fields).

    /// The id of the delivery's event.
    pub(crate) const EVENT_ID: &str = "eventId";
    /// The handler that runs the delivery.
    pub(crate) const HANDLER: &str = "handler";
    /// The event's type name.
    pub(crate) const EVENT_TYPE: &str = "eventType";
    /// The ordering key, if the event has one (on events too).
    pub(crate) const KEY: &str = "key";
    /// The event's sequence within its key (on events too).
    pub(crate) const SEQUENCE: &str = "sequence";
    /// `true` on a delivery of a keyed event whose handler is unordered: it keeps the key and
    /// sequence for operators, but claims treat it as unkeyed (its lane comes from the event
    /// id). Absent otherwise.
    pub(crate) const UNORDERED: &str = "unordered";
    /// The lane of the delivery, 0 to 255: the lane document that leases it.
    pub(crate) const LANE_ID: &str = "laneId";
    /// Where a pending delivery waits: [`lane::READY`](super::lane::READY) or
    /// [`lane::PARKED`](super::lane::PARKED).
    pub(crate) const LANE: &str = "lane";
    /// One of the values in [`status`](super::status).
    pub(crate) const STATUS: &str = "status";
    /// The attempts that ended.
    pub(crate) const ATTEMPTS: &str = "attempts";
    /// The claim generation: every claim that ends, however it ends, increments it.
    pub(crate) const CLAIMS: &str = "claims";
    /// The epoch of the last lost claim charged.
    pub(crate) const LOST_AT: &str = "lostAt";
    /// When the delivery is due.
    pub(crate) const DUE_AT: &str = "dueAt";
    /// When the document was written (on events and completion records too).
    pub(crate) const CREATED_AT: &str = "createdAt";
    /// When the delivery last changed.
    pub(crate) const UPDATED_AT: &str = "updatedAt";
    /// When the delivery, or every delivery of an event, completed.
    pub(crate) const COMPLETED_AT: &str = "completedAt";
    /// On events written by relaybus 0.1 releases before this one: when a completion of one of
    /// its deliveries last began (a mark written before the deliveries went, with `completedAt`
    /// stamped after them). Completions now stamp `completedAt` before the delete and write
    /// this no more; purge and the event detail still read it, for such events.
    pub(crate) const COMPLETING_AT: &str = "completingAt";
    /// The error of the last failed attempt.
    pub(crate) const LAST_ERROR: &str = "lastError";
    /// The failed attempts, the last ten: `{at, attempt?, error}`, kept across requeues.
    pub(crate) const ERRORS: &str = "errors";
    /// The times a dead delivery was requeued; absent until the first.
    pub(crate) const REQUEUED: &str = "requeued";
    /// On an event, and on the deliveries appended with it: the event was new, and created
    /// just before it was appended (see [`super::FRESH_BY`]). A completion of such a delivery
    /// within [`super::QUICK_COMPLETION`] of its creation, never requeued, does not stamp
    /// `completedAt` on the event: purge and the event detail take such an event as completed
    /// by its creation plus [`super::UNSTAMPED_BY`] at the latest.
    pub(crate) const FRESH: &str = "fresh";
    /// An entry of `errors`: when the attempt failed.
    pub(crate) const ERROR_AT: &str = "at";
    /// An entry of `errors`: the attempt.
    pub(crate) const ERROR_ATTEMPT: &str = "attempt";
    /// An entry of `errors`: the error, cut to 1 KiB.
    pub(crate) const ERROR_TEXT: &str = "error";

    // Events.

    /// The event's type name.
    pub(crate) const TYPE: &str = "type";
    /// The event's payload.
    pub(crate) const PAYLOAD: &str = "payload";
    /// The correlation id, if any.
    pub(crate) const CORRELATION_ID: &str = "correlationId";
    /// The causation id, if any.
    pub(crate) const CAUSATION_ID: &str = "causationId";
    /// The event's headers, if any.
    pub(crate) const HEADERS: &str = "headers";
    /// The handlers the event has deliveries for.
    pub(crate) const HANDLERS: &str = "handlers";
    /// How often handlers were added to the event.
    pub(crate) const REVISION: &str = "revision";

    // Key sequences.

    /// The last sequence taken in the key.
    pub(crate) const VALUE: &str = "value";

    // Lanes.

    /// The owner name of the holder, or null.
    pub(crate) const OWNER: &str = "owner";
    /// The store instance of the holder, or null.
    pub(crate) const INSTANCE: &str = "instance";
    /// When the holder's lease expires, or null.
    pub(crate) const LEASE_EXPIRES_AT: &str = "leaseExpiresAt";
    /// Incremented by every take of the lane.
    pub(crate) const EPOCH: &str = "epoch";
    /// The deliveries the holder claimed and has not settled.
    pub(crate) const IN_FLIGHT: &str = "inFlight";
    /// Claims of earlier holders still to be charged: `{d: <delivery id>, e: <epoch>}`.
    pub(crate) const LOST: &str = "lost";
    /// The delivery of a lost claim.
    pub(crate) const LOST_DELIVERY: &str = "d";
    /// The lane epoch a lost claim was made in.
    pub(crate) const LOST_EPOCH: &str = "e";
    /// The requeues of dead deliveries of the lane; absent until the first one.
    pub(crate) const REQUEUES: &str = "requeues";

    // Processes (crash recovery).

    /// The server session ids a store instance starts its transactions on.
    pub(crate) const SESSIONS: &str = "sessions";
    /// When a store instance's heartbeat, or a lead, expires, by the server's clock.
    pub(crate) const EXPIRES_AT: &str = "expiresAt";
    /// The store instance that holds a lead (`_id: "lead:<role>"`).
    pub(crate) const HOLDER: &str = "holder";
    /// A store instance's member list (`members:<instance>`): `{owner, handlers}` each.
    pub(crate) const MEMBERS: &str = "members";
    /// Where a store instance's process runs: host, boot, process id namespace and user, so
    /// that another process of the same host can tell whether it still runs.
    pub(crate) const HOST: &str = "host";
    /// The process id of a store instance's process.
    pub(crate) const PID: &str = "pid";
    /// When that process started, in the kernel's clock ticks since boot: a process id used
    /// again by a later process names another process.
    pub(crate) const STARTED: &str = "started";
}

/// Field paths, `$<field>`: the value of a field of the current document in an aggregation
/// expression.
pub(crate) mod path {
    /// `$_id`.
    pub(crate) const ID: &str = "$_id";
    /// `$key`.
    pub(crate) const KEY: &str = "$key";
    /// `$sequence`.
    pub(crate) const SEQUENCE: &str = "$sequence";
    /// `$leaseExpiresAt`.
    pub(crate) const LEASE_EXPIRES_AT: &str = "$leaseExpiresAt";
    /// `$epoch`.
    pub(crate) const EPOCH: &str = "$epoch";
    /// `$inFlight`.
    pub(crate) const IN_FLIGHT: &str = "$inFlight";
    /// `$lost`.
    pub(crate) const LOST: &str = "$lost";
    /// `$expiresAt`.
    pub(crate) const EXPIRES_AT: &str = "$expiresAt";
    /// `$attempts`.
    pub(crate) const ATTEMPTS: &str = "$attempts";
    /// `$claims`.
    pub(crate) const CLAIMS: &str = "$claims";
}

/// The values of a delivery's `status`.
pub(crate) mod status {
    /// Waiting to run, or running.
    pub(crate) const PENDING: &str = "pending";
    /// Out of attempts: a dead letter, until requeued.
    pub(crate) const DEAD: &str = "dead";
    /// Completed (completion records, and delivery documents written before completions
    /// deleted them).
    pub(crate) const COMPLETED: &str = "completed";
}

/// The values of a pending delivery's `lane`: whether claims scan it.
pub(crate) mod lane {
    /// In the claim index: claims scan it.
    pub(crate) const READY: &str = "ready";
    /// Waiting behind an unfinished predecessor of its key, out of the claim index, until a
    /// claim moves it back.
    pub(crate) const PARKED: &str = "parked";
}

/// An index of one of the store's collections.
#[derive(Debug, Clone)]
pub(crate) struct Index {
    pub(crate) name: &'static str,
    pub(crate) keys: Document,
    /// The filter of a partial index: only the documents it matches have entries.
    pub(crate) partial: Option<Document>,
    pub(crate) unique: bool,
}

impl Index {
    fn new(name: &'static str, keys: Document) -> Index {
        Index {
            name,
            keys,
            partial: None,
            unique: false,
        }
    }

    fn partial(self, filter: Document) -> Index {
        Index {
            partial: Some(filter),
            ..self
        }
    }

    fn unique(self) -> Index {
        Index {
            unique: true,
            ..self
        }
    }
}

/// The indexes: their names (for hints), their keys, and the lists `setup()` creates.
pub(crate) mod index {
    use mongodb::{
        bson::{Document, doc},
        options::Hint,
    };

    use super::{Index, field, lane, status};

    /// Deliveries: one per event and handler. A backstop: the code never relies on it.
    pub(crate) const EVENT_HANDLER: &str = "event_handler";
    /// Deliveries: claims and free-lane discovery, ready deliveries only.
    pub(crate) const CLAIM: &str = "claim";
    /// Deliveries: the lowest pending delivery of each key.
    pub(crate) const ORDERING: &str = "ordering";
    /// Deliveries: the lowest parked delivery of each key.
    pub(crate) const PARKED: &str = "parked";
    /// Deliveries: the oldest due delivery, for statistics.
    pub(crate) const DUE: &str = "due";
    /// Deliveries: purge of completed delivery documents. Completion records: by completion
    /// time.
    pub(crate) const COMPLETED: &str = "completed";
    /// Deliveries: counts and listings by status; purge of the dead.
    pub(crate) const STATUS_CREATED: &str = "status_created";
    /// Deliveries: by status and last change.
    pub(crate) const STATUS_UPDATED: &str = "status_updated";
    /// Deliveries: listings by handler.
    pub(crate) const HANDLER_CREATED: &str = "handler_created";
    /// Deliveries: listings by event type.
    pub(crate) const TYPE_CREATED: &str = "type_created";
    /// Events and completion records: by creation time.
    pub(crate) const CREATED: &str = "created";
    /// Of the stored answers of idempotent requests, by expiry.
    pub(crate) const EXPIRES: &str = "expires";
    /// Completion records: by event.
    pub(crate) const EVENT: &str = "event";

    /// Deliveries: the indexes that serve only operator listings and the purge of dead letters,
    /// which `MongoEventStoreBuilder::listing_indexes(false)` leaves out.
    pub(crate) const LISTING: [&str; 3] = [STATUS_UPDATED, HANDLER_CREATED, TYPE_CREATED];

    /// Tells a query to use the index `name`.
    pub(crate) fn hint(name: &str) -> Hint {
        Hint::Name(name.to_owned())
    }

    /// The indexes of the deliveries collection `setup()` creates: all of them, or without the
    /// [`LISTING`] ones.
    pub(crate) fn of_deliveries_with(listing: bool) -> Vec<Index> {
        of_deliveries()
            .into_iter()
            .filter(|index| listing || !LISTING.contains(&index.name))
            .collect()
    }

    /// The indexes of the deliveries collection, in the order `setup()` creates them.
    pub(crate) fn of_deliveries() -> Vec<Index> {
        vec![
            // Idempotent append, lookup by event.
            Index::new(
                EVENT_HANDLER,
                doc! { field::EVENT_ID: 1, field::HANDLER: 1 },
            )
            .unique(),
            // It ends with `handler` so that a query over many lanes stays a merge of one scan
            // per lane.
            Index::new(
                CLAIM,
                doc! { field::LANE_ID: 1, field::DUE_AT: 1, field::ID: 1, field::HANDLER: 1 },
            )
            .partial(doc! { field::STATUS: status::PENDING, field::LANE: lane::READY }),
            Index::new(ORDERING, ordering_keys())
                .partial(doc! { field::STATUS: status::PENDING, field::KEY: { "$exists": true } }),
            Index::new(PARKED, parked_keys()).partial(doc! { field::LANE: lane::PARKED }),
            Index::new(DUE, doc! { field::DUE_AT: 1 })
                .partial(doc! { field::STATUS: status::PENDING }),
            Index::new(COMPLETED, doc! { field::COMPLETED_AT: 1 })
                .partial(doc! { field::STATUS: status::COMPLETED }),
            Index::new(
                STATUS_CREATED,
                doc! { field::STATUS: 1, field::CREATED_AT: 1 },
            ),
            Index::new(
                STATUS_UPDATED,
                doc! { field::STATUS: 1, field::UPDATED_AT: 1 },
            ),
            Index::new(
                HANDLER_CREATED,
                doc! { field::HANDLER: 1, field::CREATED_AT: 1 },
            ),
            Index::new(
                TYPE_CREATED,
                doc! { field::EVENT_TYPE: 1, field::CREATED_AT: 1 },
            ),
        ]
    }

    /// The keys of the [`ORDERING`] index, pending keyed deliveries only. `status` leads
    /// although it is the same in every entry: with it in the key, the query for the lowest
    /// pending delivery of each key, sorted by these keys, is a distinct scan that reads one
    /// entry per key.
    pub(crate) fn ordering_keys() -> Document {
        doc! { field::STATUS: 1, field::HANDLER: 1, field::KEY: 1, field::SEQUENCE: 1 }
    }

    /// The keys of the [`PARKED`] index, parked deliveries only. `lane` leads although it is
    /// the same in every entry: with it in the key, the query for the lowest parked delivery of
    /// each key, sorted by these keys, is a distinct scan that reads one entry per key, however
    /// long a key's backlog is.
    pub(crate) fn parked_keys() -> Document {
        doc! { field::LANE: 1, field::HANDLER: 1, field::KEY: 1, field::SEQUENCE: 1 }
    }

    /// The indexes of the events collection.
    pub(crate) fn of_events() -> Vec<Index> {
        vec![Index::new(
            CREATED,
            doc! { field::CREATED_AT: 1, field::ID: 1 },
        )]
    }

    /// The indexes of the stored answers of idempotent requests: by expiry, for purge.
    pub(crate) fn of_idempotency_keys() -> Vec<Index> {
        vec![Index::new(EXPIRES, doc! { field::EXPIRES_AT: 1 })]
    }

    /// The indexes of the completion records, kept with completion history on.
    pub(crate) fn of_completed_deliveries() -> Vec<Index> {
        vec![
            Index::new(COMPLETED, doc! { field::COMPLETED_AT: 1, field::ID: 1 }),
            Index::new(EVENT, doc! { field::EVENT_ID: 1 }),
            Index::new(CREATED, doc! { field::CREATED_AT: 1, field::ID: 1 }),
        ]
    }
}

#[cfg(test)]
mod tests {
    use mongodb::bson::doc;

    use super::*;

    #[test]
    fn paths_name_fields() {
        for (path, field) in [
            (path::ID, field::ID),
            (path::KEY, field::KEY),
            (path::SEQUENCE, field::SEQUENCE),
            (path::LEASE_EXPIRES_AT, field::LEASE_EXPIRES_AT),
            (path::EPOCH, field::EPOCH),
            (path::IN_FLIGHT, field::IN_FLIGHT),
            (path::LOST, field::LOST),
            (path::EXPIRES_AT, field::EXPIRES_AT),
            (path::ATTEMPTS, field::ATTEMPTS),
            (path::CLAIMS, field::CLAIMS),
        ] {
            assert_eq!(path, format!("${field}"));
        }
    }

    #[test]
    fn index_names_are_unique_per_collection() {
        for indexes in [
            index::of_deliveries(),
            index::of_events(),
            index::of_completed_deliveries(),
        ] {
            let mut names: Vec<&str> = indexes.iter().map(|index| index.name).collect();
            names.sort_unstable();
            names.dedup();
            assert_eq!(names.len(), indexes.len());
        }
    }

    #[test]
    fn the_listing_indexes_can_be_left_out() {
        let all: Vec<&str> = index::of_deliveries().iter().map(|i| i.name).collect();
        assert_eq!(all.len(), 10);
        for name in index::LISTING {
            assert!(
                all.contains(&name),
                "{name} is one of the deliveries' indexes"
            );
        }
        let with: Vec<&str> = index::of_deliveries_with(true)
            .iter()
            .map(|i| i.name)
            .collect();
        assert_eq!(with, all);
        let without: Vec<&str> = index::of_deliveries_with(false)
            .iter()
            .map(|i| i.name)
            .collect();
        assert_eq!(
            without,
            [
                "event_handler",
                "claim",
                "ordering",
                "parked",
                "due",
                "completed",
                "status_created"
            ]
        );
    }

    #[test]
    fn keys_are_the_stored_documents() {
        let claim = index::of_deliveries().swap_remove(1);
        assert_eq!(claim.name, "claim");
        assert_eq!(
            claim.keys,
            doc! { "laneId": 1, "dueAt": 1, "_id": 1, "handler": 1 }
        );
        assert_eq!(
            claim.partial,
            Some(doc! { "status": "pending", "lane": "ready" })
        );
        assert_eq!(
            index::parked_keys(),
            doc! { "lane": 1, "handler": 1, "key": 1, "sequence": 1 }
        );
    }
}
