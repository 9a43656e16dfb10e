//! `setup()`: collections, indexes and lane documents, created idempotently.

use std::time::Duration;

use futures::TryStreamExt;
use mongodb::{
    IndexModel,
    bson::{Bson, Document, doc},
    options::IndexOptions,
};

use super::{
    MongoEventStore, error_code,
    schema::{Index, field, index, lane, status},
};
use crate::{error::Result, event::LANE_COUNT};

/// The longest snapshot history window under which `setup()` stays quiet. Longer, and every
/// read of the claim index steps over each delivery parked or completed in that many seconds.
const QUIET_SNAPSHOT_WINDOW: Duration = Duration::from_secs(10);

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
    /// several processes at once. A store (with its clones) runs it once: after it succeeded,
    /// later calls, such as the bus's start after the service's own, return at once.
    ///
    /// With [`listing_indexes(false)`](crate::MongoEventStoreBuilder::listing_indexes) it
    /// creates seven indexes on the deliveries instead of ten, and drops the three listing
    /// indexes when an earlier setup created them.
    ///
    /// Collections are created explicitly because collections created implicitly inside
    /// concurrent transactions conflict with each other. If you manage the schema yourself, run
    /// `setup()` once from a deployment script.
    ///
    /// It moves dead deliveries it finds in the parked lane back to the ready one (burying a
    /// delivery that ran from the parked lane used to leave it there, holding back its key).
    ///
    /// It also reads the server's snapshot history window
    /// ([`snapshot_history_window`](Self::snapshot_history_window)) and logs a warning when it
    /// is longer than 10 s: see the README's "The server's snapshot history window".
    ///
    /// # Errors
    ///
    /// [`ConfigurationError::NotReplicaSet`](crate::ConfigurationError::NotReplicaSet) on a
    /// standalone server; [`Error::Database`](crate::Error::Database) when the server refuses a
    /// step.
    pub async fn setup(&self) -> Result<()> {
        self.inner
            .set_up
            .get_or_try_init(|| self.set_up())
            .await
            .map(|_| ())
    }

    async fn set_up(&self) -> Result<()> {
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
                Ok(()) => break,
                other => return other,
            }
        }
        match self.snapshot_history_window().await {
            Ok(Some(window)) if window > QUIET_SNAPSHOT_WINDOW => tracing::warn!(
                window_secs = window.as_secs(),
                "relaybus: the server keeps {} s of snapshot history, and every index entry deleted \
                 in that time: claims step over each delivery parked or completed meanwhile, \
                 which slows them under sustained load. Unless something reads at past cluster \
                 times, set `minSnapshotHistoryWindowInSeconds` to 0 (see the README's \"The \
                 server's snapshot history window\")",
                window.as_secs()
            ),
            Ok(_) => {}
            Err(error) => tracing::debug!(
                %error,
                "relaybus: could not read the server's snapshot history window"
            ),
        }
        Ok(())
    }

    /// How long the server keeps snapshot history (its `minSnapshotHistoryWindowInSeconds`,
    /// 300 s unless set): `None` when the server does not say, as a server without that
    /// parameter does.
    ///
    /// The storage engine keeps a deleted index entry at least that long, and reads step over
    /// it meanwhile: a delivery parked or completed leaves one in the claim index, which claims
    /// read lane by lane. relaybus itself never reads at a past cluster time (its transactions
    /// read at their own start), so a window of 0 suits it; see the README's "The server's
    /// snapshot history window" for what the window costs.
    ///
    /// # Errors
    ///
    /// [`Error::Database`](crate::Error::Database) when the server refuses `getParameter`, as it
    /// does for a user without the `getParameter` privilege.
    pub async fn snapshot_history_window(&self) -> Result<Option<Duration>> {
        let reply = self
            .inner
            .client
            .database("admin")
            .run_command(doc! { "getParameter": 1, "minSnapshotHistoryWindowInSeconds": 1 })
            .await?;
        let seconds = match reply.get("minSnapshotHistoryWindowInSeconds") {
            Some(Bson::Int32(s)) => i64::from(*s),
            Some(Bson::Int64(s)) => *s,
            Some(Bson::Double(s)) if s.is_finite() => *s as i64,
            _ => return Ok(None),
        };
        Ok(u64::try_from(seconds).ok().map(Duration::from_secs))
    }

    async fn setup_once(&self) -> Result<()> {
        let inner = &self.inner;
        for collection in inner.collections() {
            match inner.db.create_collection(collection.name()).await {
                Ok(()) => {}
                Err(e) if error_code(&e) == Some(NAMESPACE_EXISTS) => {}
                Err(e) => return Err(e.into()),
            }
        }

        // No lane documents: a new database, or one a 0.1.0 version left (or an upgrade that
        // stopped part-way). The lanes are seeded last and mark the upgrade as done.
        if inner.lanes.count_documents(doc! {}).await? < u64::from(LANE_COUNT) {
            self.upgrade_from_0_1().await?;
        }

        let listing = inner.listing_indexes;
        match inner
            .deliveries
            .create_indexes(delivery_indexes(listing))
            .await
        {
            Ok(_) => {}
            Err(e) if error_code(&e) == Some(INDEX_KEY_SPECS_CONFLICT) => {
                // A database set up before `parked` led with `lane` and `ordering` with `status`:
                // replace the indexes whose keys changed. A concurrent setup may have dropped
                // one first.
                let wanted = delivery_indexes(listing);
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
        if !listing {
            self.drop_listing_indexes().await?;
        }
        inner
            .events
            .create_indexes(index::of_events().into_iter().map(model))
            .await?;
        inner
            .idempotency_keys
            .create_indexes(index::of_idempotency_keys().into_iter().map(model))
            .await?;
        if inner.completion_history {
            inner
                .completed
                .create_indexes(index::of_completed_deliveries().into_iter().map(model))
                .await?;
        }
        self.unpark_ended().await?;
        self.seed_lanes().await
    }

    /// Moves deliveries that ended in the parked lane (dead ones: a delivery buried while it
    /// ran from there used to stay there) to the ready lane. The `parked` index would give such
    /// a delivery as its key's parked head and hide the key's next deliveries from unparking
    /// for good.
    async fn unpark_ended(&self) -> Result<()> {
        let moved = self
            .inner
            .deliveries
            .update_many(
                doc! { field::LANE: lane::PARKED, field::STATUS: { "$ne": status::PENDING } },
                doc! { "$set": { field::LANE: lane::READY } },
            )
            .await?;
        if moved.modified_count > 0 {
            tracing::info!(
                deliveries = moved.modified_count,
                "relaybus: moved dead deliveries out of the parked lane, where they held back \
                 their keys' next deliveries"
            );
        }
        Ok(())
    }

    /// Drops the listing indexes of the deliveries that exist: the store was set up with them
    /// before. A concurrent setup may have dropped one first.
    async fn drop_listing_indexes(&self) -> Result<()> {
        let deliveries = &self.inner.deliveries;
        let existing: Vec<String> = deliveries.list_index_names().await?;
        for name in index::LISTING {
            if !existing.iter().any(|e| e == name) {
                continue;
            }
            match deliveries.drop_index(name).await {
                Err(e) if error_code(&e) != Some(INDEX_NOT_FOUND) => return Err(e.into()),
                _ => {}
            }
        }
        Ok(())
    }

    /// Creates the lane documents that do not exist yet, in one command.
    async fn seed_lanes(&self) -> Result<()> {
        let updates: Vec<Document> = (0..LANE_COUNT as i32)
            .map(|lane| {
                doc! {
                    "q": { field::ID: lane },
                    "u": { "$setOnInsert": {
                        field::OWNER: null,
                        field::INSTANCE: null,
                        field::LEASE_EXPIRES_AT: null,
                        field::EPOCH: 0_i64,
                        field::IN_FLIGHT: [],
                        field::LOST: [],
                    } },
                    "upsert": true,
                }
            })
            .collect();
        self.update_lanes(&updates).await?;
        Ok(())
    }
}

fn index_name(model: &IndexModel) -> Option<&str> {
    model.options.as_ref()?.name.as_deref()
}

/// The model `createIndexes` takes for one of the store's indexes.
fn model(spec: Index) -> IndexModel {
    let mut options = IndexOptions::builder()
        .name(spec.name.to_owned())
        .partial_filter_expression(spec.partial)
        .build();
    if spec.unique {
        options.unique = Some(true);
    }
    IndexModel::builder()
        .keys(spec.keys)
        .options(options)
        .build()
}

/// The indexes of the deliveries collection, as the store's queries need them: with or without
/// the listing indexes.
fn delivery_indexes(listing: bool) -> Vec<IndexModel> {
    index::of_deliveries_with(listing)
        .into_iter()
        .map(model)
        .collect()
}
