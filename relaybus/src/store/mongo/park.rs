//! Parked backlogs: deliveries of a key that wait behind an unfinished predecessor, moved out of
//! the claim index so that claims do not scan them again and again.
//!
//! Parking is an optimisation and never fails a claim. Unparking is level-triggered: every claim
//! looks at the current state (the lowest parked delivery of each key, and whether anything
//! pending precedes it), never at an event, so a crash while parking, or a predecessor that
//! finished while its followers were being parked, delays a key until the next claim and never
//! strands it.

use std::collections::HashSet;

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
/// Lookup queries run at the same time.
pub(crate) const LOOKUP_CONCURRENCY: usize = 8;
/// Index probes per lookup query.
const PROBES_PER_QUERY: usize = 100;
/// Delivery ids per parking update.
const IDS_PER_UPDATE: usize = 10_000;

impl MongoEventStore {
    /// Moves the lowest parked delivery of each key of `handler` back to the ready lane when
    /// nothing pending precedes it. Returns how many it moved.
    ///
    /// One aggregation (a distinct scan of the small `parked` index), then one predecessor probe
    /// per parked key (sent together, see [`first_of_each`](Self::first_of_each)), then one
    /// update.
    ///
    /// Keys in `skip_lanes` (held by another live owner, who unparks them on its own claims) are
    /// left alone.
    pub(crate) async fn unpark(&self, handler: &str, skip_lanes: &HashSet<i32>) -> Result<u64> {
        let deliveries = &self.inner.deliveries;
        let lowest: Vec<Document> = deliveries
            .aggregate([
                doc! { "$match": { "handler": handler, "lane": "parked" } },
                doc! { "$sort": { "handler": 1, "key": 1, "sequence": 1 } },
                doc! { "$group": {
                    "_id": "$key",
                    "id": { "$first": "$_id" },
                    "sequence": { "$first": "$sequence" },
                    "laneId": { "$first": "$laneId" },
                } },
            ])
            .hint(Hint::Name("parked".to_owned()))
            .await?
            .try_collect()
            .await?;
        if lowest.is_empty() {
            return Ok(0);
        }
        // The lowest parked delivery of a key may move back when nothing pending precedes it.
        let mut candidates: Vec<(String, ObjectId)> = Vec::with_capacity(lowest.len());
        let mut probes = Vec::with_capacity(lowest.len());
        for group in &lowest {
            let lane = int(group, "laneId").and_then(|lane| i32::try_from(lane).ok());
            if lane.is_some_and(|lane| skip_lanes.contains(&lane)) {
                continue;
            }
            let (Some(Bson::String(key)), Ok(id), Some(sequence)) = (
                group.get("_id"),
                group.get_object_id("id"),
                int(group, "sequence"),
            ) else {
                continue;
            };
            probes.push(doc! {
                "handler": handler,
                "key": key,
                "status": "pending",
                "sequence": { "$lt": sequence },
            });
            candidates.push((key.clone(), id));
        }
        let blocked: HashSet<String> = self
            .first_of_each(probes, None)
            .await?
            .iter()
            .filter_map(|doc| doc.get_str("key").ok().map(str::to_owned))
            .collect();
        let free: Vec<Option<ObjectId>> = candidates
            .into_iter()
            .map(|(key, id)| (!blocked.contains(&key)).then_some(id))
            .collect();
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

    /// The first delivery matching each of `probes` (in `sort` order), `_id`, `handler` and `key`
    /// only: one index probe per filter, sent as one aggregation per group of filters, the groups
    /// in parallel. Filters that match nothing leave nothing in the result.
    pub(crate) async fn first_of_each(
        &self,
        probes: Vec<Document>,
        sort: Option<Document>,
    ) -> Result<Vec<Document>> {
        let name = self.inner.deliveries.name();
        let stages = |probe: Document| {
            let mut stages = vec![doc! { "$match": probe }];
            if let Some(sort) = &sort {
                stages.push(doc! { "$sort": sort.clone() });
            }
            stages.push(doc! { "$limit": 1 });
            stages.push(doc! { "$project": { "handler": 1, "key": 1 } });
            stages
        };
        let pipelines: Vec<Vec<Document>> = probes
            .chunks(PROBES_PER_QUERY)
            .map(|group| {
                let mut group = group.iter().cloned();
                let mut pipeline = group.next().map(stages).unwrap_or_default();
                for probe in group {
                    pipeline
                        .push(doc! { "$unionWith": { "coll": name, "pipeline": stages(probe) } });
                }
                pipeline
            })
            .filter(|pipeline| !pipeline.is_empty())
            .collect();
        let found: Vec<Vec<Document>> = stream::iter(pipelines)
            .map(|pipeline| async move {
                let docs: Vec<Document> = self
                    .inner
                    .deliveries
                    .aggregate(pipeline)
                    .await?
                    .try_collect()
                    .await?;
                Ok::<_, crate::Error>(docs)
            })
            .buffer_unordered(LOOKUP_CONCURRENCY)
            .try_collect()
            .await?;
        Ok(found.into_iter().flatten().collect())
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
