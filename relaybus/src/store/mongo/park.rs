//! Parked backlogs: deliveries of a key that wait behind an unfinished predecessor, moved out of
//! the claim index so that claims do not scan them again and again. An append writes a new
//! delivery parked when it waits behind a pending one of its handler and key; claims park what
//! they find waiting otherwise.
//!
//! Parking is an optimisation and never fails a claim. Unparking is level-triggered: claims look
//! at the current state (the lowest parked delivery of each key, and whether anything pending
//! precedes it), never at an event, so a crash while parking, or a predecessor that finished
//! while its followers were being parked, delays a key until a later claim looks and never
//! strands it. A store instance's claims look on every claim while they find parked deliveries
//! or the instance saw some parked, and otherwise every 250 ms of claim time (see
//! `lease::ParkedLookup`).

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};

use futures::{StreamExt, TryStreamExt, stream};
use mongodb::bson::{Document, doc, oid::ObjectId};

use super::{
    MongoEventStore,
    lane::int,
    schema::{field, index, lane, path, status},
};
use crate::error::Result;

/// Lookup queries run at the same time.
pub(crate) const LOOKUP_CONCURRENCY: usize = 8;
/// Keys per lookup query.
const KEYS_PER_QUERY: usize = 500;
/// Delivery ids per parking update.
const IDS_PER_UPDATE: usize = 10_000;

/// The lowest parked delivery of one key.
#[derive(Debug, Clone)]
pub(crate) struct ParkedHead {
    pub(crate) handler: String,
    pub(crate) key: String,
    pub(crate) id: ObjectId,
    pub(crate) sequence: i64,
}

impl ParkedHead {
    /// Reads one document of [`parked_heads_stages`].
    fn from_document(doc: &Document) -> Option<ParkedHead> {
        Some(ParkedHead {
            handler: doc.get_str("parkedHandler").ok()?.to_owned(),
            key: doc.get_str("parkedKey").ok()?.to_owned(),
            id: doc.get_object_id("id").ok()?,
            sequence: int(doc, field::SEQUENCE)?,
        })
    }
}

/// An aggregation of the deliveries collection that yields the lowest parked delivery of each
/// key of `handler`: a distinct scan of the small `parked` index. Each document has
/// `parkedHandler`, `parkedKey`, `id` and `sequence`.
fn parked_heads_stages(handler: &str) -> Vec<Document> {
    vec![
        doc! { "$match": { field::LANE: lane::PARKED, field::HANDLER: handler } },
        doc! { "$sort": index::parked_keys() },
        doc! { "$group": {
            "_id": path::KEY,
            "id": { "$first": path::ID },
            field::SEQUENCE: { "$first": path::SEQUENCE },
        } },
        doc! { "$project": {
            "_id": 0,
            "parkedHandler": { "$literal": handler },
            "parkedKey": "$_id",
            "id": 1,
            field::SEQUENCE: 1,
        } },
    ]
}

impl MongoEventStore {
    /// Moves the lowest parked delivery of each key of `handler` back to the ready lane when
    /// nothing pending precedes it, but for the keys in `running` (`(handler, key)`): one of
    /// their deliveries runs, so none of the others can be claimed yet, and a later claim looks
    /// again. Returns whether it found parked deliveries, how many it moved, and the lowest
    /// pending delivery of each key it looked at (after the move: a head moved is its key's).
    ///
    /// One aggregation (a distinct scan of the small `parked` index), one predecessor probe per
    /// key (sent together, see [`lowest_pending`](Self::lowest_pending)), then one update.
    pub(crate) async fn unpark(
        &self,
        handler: &str,
        running: &HashSet<(String, String)>,
    ) -> Result<(bool, u64, HashMap<(String, String), (ObjectId, i64)>)> {
        let heads: Vec<ParkedHead> = self
            .inner
            .deliveries
            .aggregate(parked_heads_stages(handler))
            .hint(index::hint(index::PARKED))
            .await?
            .try_collect::<Vec<Document>>()
            .await?
            .iter()
            .filter_map(ParkedHead::from_document)
            .collect();
        let found = !heads.is_empty();
        let heads: Vec<ParkedHead> = heads
            .into_iter()
            .filter(|head| !running.contains(&(head.handler.clone(), head.key.clone())))
            .collect();
        if heads.is_empty() {
            return Ok((found, 0, HashMap::new()));
        }
        let keys: Vec<(String, String)> = heads
            .iter()
            .map(|head| (head.handler.clone(), head.key.clone()))
            .collect();
        let lowest = self.lowest_pending(&keys).await?;
        // A head with a lower pending sequence of its key before it stays parked.
        let free: Vec<ObjectId> = heads
            .iter()
            .filter(|head| {
                lowest
                    .get(&(head.handler.clone(), head.key.clone()))
                    .is_none_or(|(_, sequence)| *sequence >= head.sequence)
            })
            .map(|head| head.id)
            .collect();
        let moved = self.unpark_ids(free).await?;
        Ok((found, moved, lowest))
    }

    /// Sends the parked deliveries `ids` back to their lanes, those still parked and pending.
    /// Returns how many it moved.
    pub(crate) async fn unpark_ids(&self, ids: Vec<ObjectId>) -> Result<u64> {
        if ids.is_empty() {
            return Ok(0);
        }
        let moved = self
            .inner
            .deliveries
            .update_many(
                doc! {
                    field::ID: { "$in": ids },
                    field::LANE: lane::PARKED,
                    field::STATUS: status::PENDING,
                },
                doc! { "$set": { field::LANE: lane::READY } },
            )
            .await?;
        Ok(moved.modified_count)
    }

    /// The lowest pending delivery of each of `keys` (handler and key): its id and sequence.
    /// Keys with nothing pending are left out. One aggregation per handler and group of keys,
    /// the groups in parallel, each a distinct scan of the `ordering` index that reads one
    /// entry per key however long the key's backlog is.
    pub(crate) async fn lowest_pending(
        &self,
        keys: &[(String, String)],
    ) -> Result<HashMap<(String, String), (ObjectId, i64)>> {
        let mut by_handler: BTreeMap<&str, BTreeSet<&str>> = BTreeMap::new();
        for (handler, key) in keys {
            by_handler
                .entry(handler.as_str())
                .or_default()
                .insert(key.as_str());
        }
        // Owned, so that the queries' futures borrow nothing but the store.
        let mut queries: Vec<(String, Vec<String>)> = Vec::new();
        for (handler, keys) in by_handler {
            let keys: Vec<String> = keys.into_iter().map(str::to_owned).collect();
            for group in keys.chunks(KEYS_PER_QUERY) {
                queries.push((handler.to_owned(), group.to_vec()));
            }
        }
        let found: Vec<(String, Vec<Document>)> = stream::iter(queries)
            .map(|(handler, group)| async move {
                let docs: Vec<Document> = self
                    .inner
                    .deliveries
                    .aggregate([
                        doc! { "$match": {
                            field::STATUS: status::PENDING,
                            field::HANDLER: &handler,
                            field::KEY: { "$in": &group },
                        } },
                        doc! { "$sort": index::ordering_keys() },
                        doc! { "$group": {
                            "_id": path::KEY,
                            "id": { "$first": path::ID },
                            field::SEQUENCE: { "$first": path::SEQUENCE },
                        } },
                    ])
                    .hint(index::hint(index::ORDERING))
                    .await?
                    .try_collect()
                    .await?;
                Ok::<_, crate::Error>((handler, docs))
            })
            .buffer_unordered(LOOKUP_CONCURRENCY)
            .try_collect()
            .await?;
        let mut lowest = HashMap::new();
        for (handler, docs) in found {
            for doc in docs {
                if let (Ok(key), Ok(id), Some(sequence)) = (
                    doc.get_str("_id"),
                    doc.get_object_id("id"),
                    int(&doc, field::SEQUENCE),
                ) {
                    lowest.insert((handler.clone(), key.to_owned()), (id, sequence));
                }
            }
        }
        Ok(lowest)
    }

    /// Moves waiting deliveries to the parked lane. Best effort: the caller logs a failure.
    pub(crate) async fn park(&self, ids: &[ObjectId]) -> Result<u64> {
        if !ids.is_empty() {
            self.inner.claims.note_parking();
        }
        let mut parked = 0;
        for chunk in ids.chunks(IDS_PER_UPDATE) {
            let result = self
                .inner
                .deliveries
                .update_many(
                    doc! {
                        field::ID: { "$in": chunk },
                        field::LANE: lane::READY,
                        field::STATUS: status::PENDING,
                    },
                    doc! { "$set": { field::LANE: lane::PARKED } },
                )
                .await?;
            parked += result.modified_count;
        }
        Ok(parked)
    }
}

#[cfg(test)]
mod tests {
    use mongodb::bson::doc;

    use super::*;

    #[test]
    fn parked_heads_are_read_with_numbers_of_any_type() {
        let id = ObjectId::new();
        let base = doc! {
            "parkedHandler": "projector", "parkedKey": "k", "id": id, "sequence": 2.0,
        };
        let head = ParkedHead::from_document(&base).unwrap();
        assert_eq!(
            (
                head.handler.as_str(),
                head.key.as_str(),
                head.id,
                head.sequence
            ),
            ("projector", "k", id, 2)
        );
        for needed in ["parkedHandler", "parkedKey", "id", "sequence"] {
            let mut doc = base.clone();
            doc.remove(needed);
            assert!(ParkedHead::from_document(&doc).is_none(), "{needed}");
        }
    }
}
