//! Retention: deleting dead letters, completion records, and the events nothing needs any more.
//!
//! Every batch deletes its documents together with the events they leave unreferenced, in one
//! transaction, so a crash never leaves a delivery without its event. An event that ever
//! completed (it has `completedAt`, or the `completingAt` mark a completion writes before its
//! deliveries go) stays as the record that deduplicates a later publish of the same id until
//! `completed_before` passes its last completion, however old it is.

use std::collections::HashSet;

use futures::TryStreamExt;
use mongodb::{
    ClientSession, Collection,
    bson::{Bson, DateTime, Document, doc},
    options::Hint,
};

use super::{
    MongoEventStore, bson_date,
    lane::add,
    operator::is_missing_index,
    schema::{UNSTAMPED_BY, field, index, status},
};
use crate::error::Result;
use crate::store::{PurgeOptions, Purged};

/// Which kind of document a batch deletes.
#[derive(Debug, Clone, Copy)]
enum Kind {
    Dead,
    History,
    LegacyCompleted,
}

/// For a fresh event with deliveries ([`field::FRESH`]), the latest its completions that
/// stamped nothing can have come: its creation plus [`UNSTAMPED_BY`] (`None` inside when it has
/// no creation time). `None` for any other event: every completion of it stamped it.
pub(crate) fn unstamped_by(event: &Document) -> Option<Option<DateTime>> {
    let with_deliveries = event
        .get_array(field::HANDLERS)
        .is_ok_and(|handlers| !handlers.is_empty());
    if event.get_bool(field::FRESH) != Ok(true) || !with_deliveries {
        return None;
    }
    Some(
        event
            .get_datetime(field::CREATED_AT)
            .ok()
            .and_then(|created| add(*created, UNSTAMPED_BY).ok()),
    )
}

impl MongoEventStore {
    /// Deletes, in batches of [`purge_batch_size`](crate::MongoEventStoreBuilder::purge_batch_size),
    /// the dead deliveries buried before `dead_before` and the completion records of
    /// completions before `completed_before`, each batch together with the events nothing
    /// references any more, in one transaction. Then it deletes the remaining events nothing
    /// references: an event that completed once goes when its last completion is before
    /// `completed_before` (`dead_before` alone never removes it); an event that never completed
    /// (no subscribers, or only dead letters) goes when it was created before the earliest
    /// cutoff given.
    ///
    /// A deleted event takes its list of handlers with it: a publish of the same event id after
    /// the purge is a new event and runs its handlers again. Keep completed retention longer
    /// than any redelivery window.
    ///
    /// # Errors
    ///
    /// [`Error::Database`](crate::Error::Database). What earlier batches deleted stays deleted;
    /// running the purge again continues.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe in the same sense: every batch is one transaction.
    pub async fn purge(&self, options: &PurgeOptions) -> Result<Purged> {
        let mut purged = Purged::default();
        if let Some(cutoff) = options.dead_before.map(bson_date) {
            let (documents, events) = self.purge_kind(Kind::Dead, cutoff, options).await?;
            purged.dead_deliveries += documents;
            purged.events += events;
        }
        if let Some(cutoff) = options.completed_before.map(bson_date) {
            let mut kinds = vec![Kind::LegacyCompleted];
            if self.inner.completion_history {
                kinds.push(Kind::History);
            }
            for kind in kinds {
                let (documents, events) = self.purge_kind(kind, cutoff, options).await?;
                purged.completion_records += documents;
                purged.events += events;
            }
        }
        purged.events += self.purge_events(options).await?;
        purged.request_keys = self.purge_request_keys(options).await?;
        Ok(purged)
    }

    /// The collection, filter and index (if one is hinted) of the documents of one kind before
    /// `cutoff`. Without the listing indexes, dead deliveries are found by the planner (through
    /// `status_created`).
    fn purge_source(
        &self,
        kind: Kind,
        cutoff: DateTime,
    ) -> (&Collection<Document>, Document, Option<&'static str>) {
        match kind {
            Kind::Dead => (
                &self.inner.deliveries,
                doc! { field::STATUS: status::DEAD, field::UPDATED_AT: { "$lt": cutoff } },
                self.inner.listing_indexes.then_some(index::STATUS_UPDATED),
            ),
            Kind::History => (
                &self.inner.completed,
                doc! { field::COMPLETED_AT: { "$lt": cutoff } },
                Some(index::COMPLETED),
            ),
            Kind::LegacyCompleted => (
                &self.inner.deliveries,
                doc! { field::STATUS: status::COMPLETED, field::COMPLETED_AT: { "$lt": cutoff } },
                Some(index::COMPLETED),
            ),
        }
    }

    /// The ids and event ids of at most `batch` documents `filter` matches, through `index`
    /// when given and it exists (the specification lets a deployment drop the listing indexes
    /// by hand).
    async fn purge_candidates(
        collection: &Collection<Document>,
        filter: Document,
        index: Option<&str>,
        batch: i64,
    ) -> Result<Vec<Document>> {
        let projection = doc! { field::ID: 1, field::EVENT_ID: 1 };
        let find = |filter: Document| {
            collection
                .find(filter)
                .projection(projection.clone())
                .limit(batch)
        };
        let cursor = match index {
            Some(index) => match find(filter.clone())
                .hint(Hint::Name(index.to_owned()))
                .await
            {
                Err(error) if is_missing_index(&error) => find(filter).await?,
                cursor => cursor?,
            },
            None => find(filter).await?,
        };
        Ok(cursor.try_collect().await?)
    }

    /// Deletes the documents of one kind before `cutoff`, batch by batch; returns how many
    /// documents and how many events went.
    async fn purge_kind(
        &self,
        kind: Kind,
        cutoff: DateTime,
        options: &PurgeOptions,
    ) -> Result<(u64, u64)> {
        let batch = i64::from(self.inner.purge_batch_size);
        let mut deleted = (0, 0);
        loop {
            let (collection, filter, index) = self.purge_source(kind, cutoff);
            let found = Self::purge_candidates(collection, filter, index, batch).await?;
            if found.is_empty() {
                return Ok(deleted);
            }
            let ids: Vec<Bson> = found
                .iter()
                .filter_map(|d| d.get(field::ID).cloned())
                .collect();
            let events: Vec<String> = found
                .iter()
                .filter_map(|d| d.get_str(field::EVENT_ID).ok().map(str::to_owned))
                .collect();
            let (documents, events) = self
                .own_transaction(
                    (self, kind, cutoff, options, &ids, &events),
                    |session, (store, kind, cutoff, options, ids, events)| {
                        Box::pin(
                            store.purge_batch_in(session, *kind, *cutoff, options, ids, events),
                        )
                    },
                )
                .await?;
            deleted.0 += documents;
            deleted.1 += events;
            if (found.len() as i64) < batch {
                return Ok(deleted);
            }
            if documents == 0 {
                // Everything found changed meanwhile; a later purge finds the rest.
                return Ok(deleted);
            }
        }
    }

    async fn purge_batch_in(
        &self,
        session: &mut ClientSession,
        kind: Kind,
        cutoff: DateTime,
        options: &PurgeOptions,
        ids: &[Bson],
        events: &[String],
    ) -> Result<(u64, u64)> {
        let (collection, mut filter, _) = self.purge_source(kind, cutoff);
        filter.insert(field::ID, doc! { "$in": ids });
        let deleted = collection
            .delete_many(filter)
            .session(&mut *session)
            .await?
            .deleted_count;
        let events = self
            .delete_unreferenced_events_in(session, events, options)
            .await?;
        Ok((deleted, events))
    }

    /// Deletes the events of `ids` that nothing references and that the options let go.
    async fn delete_unreferenced_events_in(
        &self,
        session: &mut ClientSession,
        ids: &[String],
        options: &PurgeOptions,
    ) -> Result<u64> {
        if ids.is_empty() {
            return Ok(0);
        }
        let inner = &self.inner;
        let events: Vec<Document> = inner
            .events
            .find(doc! { field::ID: { "$in": ids } })
            .projection(doc! {
                field::CREATED_AT: 1, field::COMPLETED_AT: 1, field::COMPLETING_AT: 1,
                field::FRESH: 1, field::HANDLERS: 1,
            })
            .session(&mut *session)
            .await?
            .stream(&mut *session)
            .try_collect()
            .await?;
        let mut referenced: HashSet<String> = HashSet::new();
        for collection in [&inner.deliveries, &inner.completed] {
            let refs: Vec<Document> = collection
                .find(doc! { field::EVENT_ID: { "$in": ids } })
                .projection(doc! { field::ID: 0, field::EVENT_ID: 1 })
                .session(&mut *session)
                .await?
                .stream(&mut *session)
                .try_collect()
                .await?;
            referenced.extend(
                refs.iter()
                    .filter_map(|r| r.get_str(field::EVENT_ID).ok().map(str::to_owned)),
            );
        }
        let earliest = options.earliest().map(bson_date);
        let gone: Vec<&str> = events
            .iter()
            .filter_map(|event| {
                let id = event.get_str(field::ID).ok()?;
                if referenced.contains(id) {
                    return None;
                }
                // Earlier releases marked an event as completing before its deliveries went,
                // and stamped it completed after: the later of the two is when it last
                // completed. A completion now stamps it before, and writes no mark.
                let completed = [field::COMPLETED_AT, field::COMPLETING_AT]
                    .iter()
                    .filter_map(|name| event.get_datetime(name).ok().copied())
                    .max();
                let created = event.get_datetime(field::CREATED_AT).ok().copied();
                // A fresh event with deliveries may have completed quickly, unstamped: by its
                // creation plus `UNSTAMPED_BY` at the latest.
                let quickly = unstamped_by(event);
                let completed_before = |at: DateTime| {
                    options
                        .completed_before
                        .is_some_and(|cut| at < bson_date(cut))
                };
                let expired = match (completed, quickly) {
                    (Some(completed), None) => completed_before(completed),
                    (Some(completed), Some(bound)) => {
                        completed_before(completed.max(bound.unwrap_or(completed)))
                    }
                    // Fresh, unreferenced and unstamped: it completed quickly, or its deliveries
                    // all died and went with the dead letters' purge (which the dead cutoff
                    // allowed: created before it). Kept as a completed event, never by the dead
                    // cutoff alone.
                    (None, Some(bound)) => bound.is_some_and(completed_before),
                    (None, None) => match (created, earliest) {
                        (Some(created), Some(cut)) => created < cut,
                        _ => false,
                    },
                };
                expired.then_some(id)
            })
            .collect();
        if gone.is_empty() {
            return Ok(0);
        }
        Ok(inner
            .events
            .delete_many(doc! { field::ID: { "$in": gone } })
            .session(&mut *session)
            .await?
            .deleted_count)
    }

    /// The events left unreferenced by earlier purges or never referenced at all, oldest first.
    async fn purge_events(&self, options: &PurgeOptions) -> Result<u64> {
        let Some(latest) = options.latest().map(bson_date) else {
            return Ok(0);
        };
        let batch = i64::from(self.inner.purge_batch_size);
        let mut after: Option<(DateTime, Bson)> = None;
        let mut deleted = 0;
        loop {
            let mut filter = doc! { field::CREATED_AT: { "$lt": latest } };
            if let Some((created, id)) = &after {
                filter = doc! { "$and": [filter, { "$or": [
                    { field::CREATED_AT: { "$gt": created } },
                    { field::CREATED_AT: created, field::ID: { "$gt": id.clone() } },
                ] }] };
            }
            let found: Vec<Document> = self
                .inner
                .events
                .find(filter)
                .projection(doc! { field::ID: 1, field::CREATED_AT: 1 })
                .sort(doc! { field::CREATED_AT: 1, field::ID: 1 })
                .hint(index::hint(index::CREATED))
                .limit(batch)
                .await?
                .try_collect()
                .await?;
            let Some(last) = found.last() else {
                return Ok(deleted);
            };
            let (Ok(created), Some(id)) =
                (last.get_datetime(field::CREATED_AT), last.get(field::ID))
            else {
                // The filter on `createdAt` only matches events that have one.
                return Ok(deleted);
            };
            after = Some((*created, id.clone()));
            let ids: Vec<String> = found
                .iter()
                .filter_map(|d| d.get_str(field::ID).ok().map(str::to_owned))
                .collect();
            deleted += self
                .own_transaction((self, &ids, options), |session, (store, ids, options)| {
                    Box::pin(store.delete_unreferenced_events_in(session, ids, options))
                })
                .await?;
            if (found.len() as i64) < batch {
                return Ok(deleted);
            }
        }
    }
}
