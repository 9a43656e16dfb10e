//! [`Administration`] for MongoDB: `setup()`'s plan, read from what the database holds.

use futures::TryStreamExt;
use mongodb::{
    IndexModel,
    bson::{Document, doc},
};

use super::{
    MongoEventStore,
    schema::{Index, field, index, lane, status},
    upgrade::{LEASE_FIELDS, PROCESSING, is_0_1_index},
};
use crate::{
    error::Result,
    event::LANE_COUNT,
    store::administration::{Administration, SetupStep, SetupStepKind},
};

impl Administration for MongoEventStore {
    async fn setup_plan(&self) -> Result<Vec<SetupStep>> {
        self.ensure_transactions_supported().await?;
        let inner = &self.inner;
        let mut steps = Vec::new();
        let existing: Vec<String> = inner.db.list_collection_names().await?;
        let exists = |name: &str| existing.iter().any(|e| e == name);
        for collection in inner.collections() {
            if !exists(collection.name()) {
                steps.push(SetupStep::new(
                    SetupStepKind::Create,
                    format!("create the collection {}", collection.name()),
                ));
            }
        }

        let lanes = inner.lanes.count_documents(doc! {}).await?;
        let upgrade = lanes < u64::from(LANE_COUNT);
        if upgrade {
            self.plan_upgrade(&mut steps).await?;
        }

        let deliveries = inner.deliveries.name();
        let existing = indexes_of(&inner.deliveries).await?;
        // The upgrade drops a claim index of 0.1.0, and reports it.
        let planned_in_upgrade = |name: &str| upgrade && name == index::CLAIM;
        for wanted in index::of_deliveries_with(inner.listing_indexes) {
            match existing.iter().find(|m| index_name(m) == Some(wanted.name)) {
                None => steps.push(create_index(deliveries, &wanted)),
                Some(model) if model.keys != wanted.keys && !planned_in_upgrade(wanted.name) => {
                    steps.push(SetupStep::new(
                        SetupStepKind::Replace,
                        format!(
                            "replace the index {} of {deliveries}: its keys changed",
                            wanted.name
                        ),
                    ))
                }
                Some(_) => {}
            }
        }
        if !inner.listing_indexes {
            for name in index::LISTING {
                if existing.iter().any(|m| index_name(m) == Some(name)) {
                    steps.push(SetupStep::new(
                        SetupStepKind::Replace,
                        format!(
                            "drop the listing index {name} of {deliveries} (listing indexes are off)"
                        ),
                    ));
                }
            }
        }
        let mut others = vec![
            (&inner.events, index::of_events()),
            (&inner.idempotency_keys, index::of_idempotency_keys()),
        ];
        if inner.completion_history {
            others.push((&inner.completed, index::of_completed_deliveries()));
        }
        for (collection, wanted) in others {
            let existing = indexes_of(collection).await?;
            for wanted in wanted {
                if !existing.iter().any(|m| index_name(m) == Some(wanted.name)) {
                    steps.push(create_index(collection.name(), &wanted));
                }
            }
        }

        let parked_dead = inner
            .deliveries
            .count_documents(
                doc! { field::LANE: lane::PARKED, field::STATUS: { "$ne": status::PENDING } },
            )
            .await?;
        if parked_dead > 0 {
            steps.push(SetupStep::new(
                SetupStepKind::Upgrade,
                format!(
                    "move {parked_dead} dead deliveries out of the parked lane, where they hold \
                     back their keys"
                ),
            ));
        }
        if upgrade {
            steps.push(SetupStep::new(
                SetupStepKind::Create,
                format!(
                    "create {} lane documents in {}",
                    u64::from(LANE_COUNT) - lanes,
                    inner.lanes.name()
                ),
            ));
        }
        Ok(steps)
    }

    async fn handler_ids(&self) -> Result<Vec<String>> {
        let inner = &self.inner;
        let mut handlers = distinct_handlers(&inner.deliveries).await?;
        if inner.completion_history {
            handlers.extend(distinct_handlers(&inner.completed).await?);
        }
        handlers.sort();
        handlers.dedup();
        Ok(handlers)
    }

    fn is_delivery_id(&self, id: &str) -> bool {
        id.len() == 24 && id.bytes().all(|b| b.is_ascii_hexdigit())
    }

    fn delivery_id_form(&self) -> &'static str {
        "a MongoDB delivery id is 24 hexadecimal digits"
    }
}

impl MongoEventStore {
    /// The steps of the upgrade of a 0.1.0 database (see `upgrade.rs`), each with how many
    /// documents it would change.
    async fn plan_upgrade(&self, steps: &mut Vec<SetupStep>) -> Result<()> {
        let inner = &self.inner;
        let deliveries = &inner.deliveries;
        let mut upgrade = |count: u64, what: &str| {
            if count > 0 {
                steps.push(SetupStep::new(
                    SetupStepKind::Upgrade,
                    format!("upgrade from 0.1.0: {what}").replace("{n}", &count.to_string()),
                ));
            }
        };
        let processing = deliveries
            .count_documents(doc! { field::STATUS: PROCESSING })
            .await?;
        upgrade(
            processing,
            "make {n} claimed (`processing`) deliveries pending and due again",
        );
        let any_lease: Vec<Document> = LEASE_FIELDS
            .iter()
            .map(|name| doc! { *name: { "$exists": true } })
            .collect();
        let leases = deliveries
            .count_documents(doc! { "$or": any_lease })
            .await?;
        upgrade(
            leases,
            "remove the per-delivery lease fields of {n} deliveries",
        );
        let unlaned = deliveries
            .count_documents(
                doc! { field::STATUS: status::PENDING, field::LANE: { "$exists": false } },
            )
            .await?;
        upgrade(unlaned, "make {n} pending deliveries claimable");
        let lane_ids = deliveries
            .count_documents(doc! { field::LANE_ID: { "$exists": false } })
            .await?;
        upgrade(lane_ids, "give {n} deliveries the lane of their key");
        let events = inner
            .events
            .count_documents(doc! { "$or": [
                { field::HANDLERS: { "$exists": false } },
                { field::CREATED_AT: { "$exists": false } },
            ] })
            .await?;
        upgrade(events, "give {n} events their handlers and creation time");
        for model in indexes_of(deliveries).await? {
            if is_0_1_index(&model) {
                let name = index_name(&model).unwrap_or_default();
                upgrade(
                    1,
                    &format!("drop the 0.1.0 index `{name}` of {}", deliveries.name()),
                );
            }
        }
        Ok(())
    }
}

/// The indexes of `collection`; none when it does not exist.
async fn indexes_of(collection: &mongodb::Collection<Document>) -> Result<Vec<IndexModel>> {
    match collection.list_indexes().await {
        Ok(cursor) => Ok(cursor.try_collect().await?),
        // `NamespaceNotFound`: setup creates the collection first.
        Err(e) if super::error_code(&e) == Some(26) => Ok(Vec::new()),
        Err(e) => Err(e.into()),
    }
}

fn index_name(model: &IndexModel) -> Option<&str> {
    model.options.as_ref()?.name.as_deref()
}

fn create_index(collection: &str, index: &Index) -> SetupStep {
    SetupStep::new(
        SetupStepKind::Create,
        format!("create the index {} of {collection}", index.name),
    )
}

async fn distinct_handlers(collection: &mongodb::Collection<Document>) -> Result<Vec<String>> {
    Ok(collection
        .distinct(field::HANDLER, doc! {})
        .await?
        .into_iter()
        .filter_map(|h| h.as_str().map(str::to_owned))
        .collect())
}
