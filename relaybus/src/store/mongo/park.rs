//! Parked backlogs: deliveries of a key that wait behind an unfinished predecessor, moved out of
//! the claim index so that claims do not scan them again and again.
//!
//! Parking is an optimisation and never fails a claim. Unparking is level-triggered: every claim
//! looks at the current state (the lowest parked delivery of each key, and whether anything
//! pending precedes it), never at an event, so a crash while parking, or a predecessor that
//! finished while its followers were being parked, delays a key until the next claim and never
//! strands it.

use futures::{StreamExt, TryStreamExt, stream};
use mongodb::{
    bson::{Bson, Document, doc, oid::ObjectId},
    options::Hint,
};

use super::{MongoEventStore, lane::int};
use crate::error::Result;

/// A claim that finds this many deliveries of one key waiting behind an unfinished predecessor
/// parks them.
pub(crate) const PARK_THRESHOLD: usize = 32;
/// Predecessor lookups run at the same time.
pub(crate) const LOOKUP_CONCURRENCY: usize = 16;
/// Delivery ids per parking update.
const IDS_PER_UPDATE: usize = 10_000;

impl MongoEventStore {
    /// Moves the lowest parked delivery of each key of `handler` back to the ready lane when
    /// nothing pending precedes it. Returns how many it moved.
    ///
    /// One aggregation (a distinct scan of the small `parked` index), then one predecessor lookup
    /// per parked key in parallel, then one update.
    pub(crate) async fn unpark(&self, handler: &str) -> Result<u64> {
        let deliveries = &self.inner.deliveries;
        let lowest: Vec<Document> = deliveries
            .aggregate([
                doc! { "$match": { "handler": handler, "lane": "parked" } },
                doc! { "$sort": { "handler": 1, "key": 1, "sequence": 1 } },
                doc! { "$group": {
                    "_id": "$key",
                    "id": { "$first": "$_id" },
                    "sequence": { "$first": "$sequence" },
                } },
            ])
            .hint(Hint::Name("parked".to_owned()))
            .await?
            .try_collect()
            .await?;
        if lowest.is_empty() {
            return Ok(0);
        }
        let free: Vec<Option<ObjectId>> = stream::iter(lowest)
            .map(|group| async move {
                let (Some(Bson::String(key)), Ok(id)) =
                    (group.get("_id"), group.get_object_id("id"))
                else {
                    return Ok(None);
                };
                let Some(sequence) = int(&group, "sequence") else {
                    return Ok(None);
                };
                let predecessor = self
                    .inner
                    .deliveries
                    .find_one(doc! {
                        "handler": handler,
                        "key": key,
                        "status": "pending",
                        "sequence": { "$lt": sequence },
                    })
                    .projection(doc! { "_id": 1 })
                    .hint(Hint::Name("ordering".to_owned()))
                    .await?;
                Ok::<_, crate::Error>(predecessor.is_none().then_some(id))
            })
            .buffer_unordered(LOOKUP_CONCURRENCY)
            .try_collect()
            .await?;
        let ids: Vec<ObjectId> = free.into_iter().flatten().collect();
        if ids.is_empty() {
            return Ok(0);
        }
        let moved = deliveries
            .update_many(
                doc! { "_id": { "$in": ids }, "lane": "parked", "status": "pending" },
                doc! { "$set": { "lane": "ready" } },
            )
            .await?;
        Ok(moved.modified_count)
    }

    /// Moves waiting deliveries to the parked lane. Best effort: the caller logs a failure.
    pub(crate) async fn park(&self, ids: &[ObjectId]) -> Result<u64> {
        let mut parked = 0;
        for chunk in ids.chunks(IDS_PER_UPDATE) {
            let result = self
                .inner
                .deliveries
                .update_many(
                    doc! { "_id": { "$in": chunk }, "lane": "ready", "status": "pending" },
                    doc! { "$set": { "lane": "parked" } },
                )
                .await?;
            parked += result.modified_count;
        }
        Ok(parked)
    }
}
