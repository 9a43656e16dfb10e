//! `setup()`: collections, indexes and lane documents, created idempotently.

use std::time::Duration;

use futures::TryStreamExt;
use mongodb::{
    IndexModel,
    bson::{Document, doc},
    options::IndexOptions,
};

use super::{MongoEventStore, error_code};
use crate::{error::Result, event::LANE_COUNT};

/// `NamespaceExists`.
const NAMESPACE_EXISTS: i32 = 48;
/// `IndexKeySpecsConflict`: an index of that name exists with other keys.
const INDEX_KEY_SPECS_CONFLICT: i32 = 86;
/// `IndexNotFound`.
const INDEX_NOT_FOUND: i32 = 27;
/// Codes a concurrent, identical `setup()` can provoke; trying again settles them.
const SETUP_RACE_CODES: [i32; 4] = [
    11000, // duplicate key: two upserts of one lane document
    112,   // write conflict
    276,   // IndexBuildAlreadyInProgress
    85,    // IndexOptionsConflict while another build of the same index finishes
];

impl MongoEventStore {
    /// Creates the store's collections, indexes and lane documents. Idempotent: it creates what
    /// is missing and leaves the rest alone, so it is safe to run at every start, and from
    /// several processes at once.
    ///
    /// Collections are created explicitly because collections created implicitly inside
    /// concurrent transactions conflict with each other. If you manage the schema yourself, run
    /// `setup()` once from a deployment script.
    ///
    /// # Errors
    ///
    /// [`ConfigurationError::NotReplicaSet`](crate::ConfigurationError::NotReplicaSet) on a
    /// standalone server; [`Error::Database`](crate::Error::Database) when the server refuses a
    /// step.
    pub async fn setup(&self) -> Result<()> {
        self.ensure_transactions_supported().await?;
        let mut attempt = 0;
        loop {
            attempt += 1;
            match self.setup_once().await {
                Err(crate::Error::Database(e))
                    if attempt < 5
                        && error_code(&e).is_some_and(|c| SETUP_RACE_CODES.contains(&c)) =>
                {
                    tokio::time::sleep(Duration::from_millis(50 * attempt)).await;
                }
                other => return other,
            }
        }
    }

    async fn setup_once(&self) -> Result<()> {
        let inner = &self.inner;
        let mut collections = vec![
            &inner.events,
            &inner.deliveries,
            &inner.key_sequences,
            &inner.lanes,
        ];
        if inner.completion_history {
            collections.push(&inner.completed);
        }
        for collection in collections {
            match inner.db.create_collection(collection.name()).await {
                Ok(()) => {}
                Err(e) if error_code(&e) == Some(NAMESPACE_EXISTS) => {}
                Err(e) => return Err(e.into()),
            }
        }

        match inner.deliveries.create_indexes(delivery_indexes()).await {
            Ok(_) => {}
            Err(e) if error_code(&e) == Some(INDEX_KEY_SPECS_CONFLICT) => {
                // A database set up before `parked` led with `lane` and `ordering` with `status`:
                // replace the indexes whose keys changed. A concurrent setup may have dropped
                // one first.
                let wanted = delivery_indexes();
                let existing: Vec<IndexModel> =
                    inner.deliveries.list_indexes().await?.try_collect().await?;
                for model in &existing {
                    let Some(name) = index_name(model) else {
                        continue;
                    };
                    let changed = wanted
                        .iter()
                        .any(|w| index_name(w) == Some(name) && w.keys != model.keys);
                    if changed {
                        match inner.deliveries.drop_index(name).await {
                            Err(e) if error_code(&e) != Some(INDEX_NOT_FOUND) => {
                                return Err(e.into());
                            }
                            _ => {}
                        }
                    }
                }
                inner.deliveries.create_indexes(wanted).await?;
            }
            Err(e) => return Err(e.into()),
        }
        inner
            .events
            .create_index(index(doc! { "createdAt": 1, "_id": 1 }, "created", None))
            .await?;
        if inner.completion_history {
            inner
                .completed
                .create_indexes([
                    index(doc! { "completedAt": 1, "_id": 1 }, "completed", None),
                    index(doc! { "eventId": 1 }, "event", None),
                    index(doc! { "createdAt": 1, "_id": 1 }, "created", None),
                ])
                .await?;
        }
        self.seed_lanes().await
    }

    /// Creates the lane documents that do not exist yet, in one command.
    async fn seed_lanes(&self) -> Result<()> {
        let updates: Vec<Document> = (0..LANE_COUNT as i32)
            .map(|lane| {
                doc! {
                    "q": { "_id": lane },
                    "u": { "$setOnInsert": {
                        "owner": null,
                        "instance": null,
                        "leaseExpiresAt": null,
                        "epoch": 0_i64,
                        "inFlight": [],
                        "lost": [],
                    } },
                    "upsert": true,
                }
            })
            .collect();
        let reply = self
            .inner
            .db
            .run_command(doc! {
                "update": self.inner.lanes.name(),
                "updates": updates,
                "ordered": false,
                "writeConcern": { "w": "majority" },
            })
            .await?;
        super::append::check_write_reply(&reply)
    }
}

fn index_name(model: &IndexModel) -> Option<&str> {
    model.options.as_ref()?.name.as_deref()
}

fn index(keys: Document, name: &str, partial: Option<Document>) -> IndexModel {
    let options = IndexOptions::builder()
        .name(name.to_owned())
        .partial_filter_expression(partial)
        .build();
    IndexModel::builder().keys(keys).options(options).build()
}

/// The indexes of the deliveries collection, as the store's queries need them.
fn delivery_indexes() -> Vec<IndexModel> {
    let mut unique = index(doc! { "eventId": 1, "handler": 1 }, "event_handler", None);
    if let Some(options) = unique.options.as_mut() {
        options.unique = Some(true);
    }
    vec![
        // Idempotent append, lookup by event. A backstop: the code never relies on it.
        unique,
        // Claims and free-lane discovery, ready deliveries only. It ends with `handler` so that
        // a query over many lanes stays a merge of one scan per lane.
        index(
            doc! { "laneId": 1, "dueAt": 1, "_id": 1, "handler": 1 },
            "claim",
            Some(doc! { "status": "pending", "lane": "ready" }),
        ),
        // Predecessor check of keyed deliveries. `status` leads although it is the same in every
        // entry: with it in the key, the query for the lowest pending delivery of each key is a
        // distinct scan that reads one entry per key.
        index(
            doc! { "status": 1, "handler": 1, "key": 1, "sequence": 1 },
            "ordering",
            Some(doc! { "status": "pending", "key": { "$exists": true } }),
        ),
        // The lowest parked delivery of each key. `lane` leads although it is the same in every
        // entry: with it in the key, the query for the lowest delivery of each key is a distinct
        // scan that reads one entry per key, however long a key's backlog is.
        index(
            doc! { "lane": 1, "handler": 1, "key": 1, "sequence": 1 },
            "parked",
            Some(doc! { "lane": "parked" }),
        ),
        // The oldest due delivery, for statistics.
        index(
            doc! { "dueAt": 1 },
            "due",
            Some(doc! { "status": "pending" }),
        ),
        // Purge of `completed` delivery documents.
        index(
            doc! { "completedAt": 1 },
            "completed",
            Some(doc! { "status": "completed" }),
        ),
        // Operator queries: counts and listings by status, handler and event type; purge of the
        // dead.
        index(doc! { "status": 1, "createdAt": 1 }, "status_created", None),
        index(doc! { "status": 1, "updatedAt": 1 }, "status_updated", None),
        index(
            doc! { "handler": 1, "createdAt": 1 },
            "handler_created",
            None,
        ),
        index(
            doc! { "eventType": 1, "createdAt": 1 },
            "type_created",
            None,
        ),
    ]
}
