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
use mongodb::bson::{DateTime, Document, RawDocument, RawDocumentBuf, doc, oid::ObjectId};

use super::{
    MongoEventStore,
    claim::DeliveryFields,
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
    pub(crate) lane: Option<i32>,
    /// What a claim needs to pick it without reading it again; absent when the document was
    /// read without them.
    pub(crate) event_id: Option<String>,
    pub(crate) attempts: i64,
    pub(crate) claims: i64,
    pub(crate) due_at: Option<DateTime>,
    /// Whether a completion may leave its event unstamped (see `scan::quick_since`).
    pub(crate) quick_since: Option<Option<DateTime>>,
}

impl ParkedHead {
    /// Reads one document of [`parked_heads_stages`].
    pub(crate) fn from_document(doc: &Document) -> Option<ParkedHead> {
        ParkedHead::from_raw(&RawDocumentBuf::from_document(doc).ok()?)
    }

    /// Reads one document of [`parked_heads_stages`] as the reply brought it, in one pass over
    /// its fields ([`DeliveryFields`]).
    pub(crate) fn from_raw(doc: &RawDocument) -> Option<ParkedHead> {
        let read = DeliveryFields::of(doc);
        Some(ParkedHead {
            handler: read.parked_handler?.to_owned(),
            key: read.parked_key?.to_owned(),
            id: read.parked_id?,
            sequence: read.sequence?,
            lane: read.lane_id(),
            event_id: read.event_id.map(str::to_owned),
            attempts: read.attempts.unwrap_or(0),
            claims: read.claims.unwrap_or(0),
            due_at: read.due_at,
            quick_since: read.quick_since(),
        })
    }
}

/// What unparking looked up of one key.
#[derive(Debug, Clone)]
pub(crate) struct SeenKey {
    /// The handler and the key.
    pub(crate) key: (String, String),
    /// The lane of the key's parked head.
    pub(crate) lane: Option<i32>,
    /// The key's lowest pending delivery; `None` when nothing of it was pending.
    pub(crate) lowest: Option<ObjectId>,
    /// Its parked head was sent back to its lane (no lower pending delivery held it back).
    pub(crate) unparked: bool,
}

/// An aggregation of the deliveries collection that yields the lowest parked delivery of each
/// key of `handler`: a distinct scan of the small `parked` index. Each document has
/// `parkedHandler`, `parkedKey`, `id`, `sequence` and `laneId`.
pub(crate) fn parked_heads_stages(handler: &str) -> Vec<Document> {
    vec![
        doc! { "$match": { field::LANE: lane::PARKED, field::HANDLER: handler } },
        doc! { "$sort": index::parked_keys() },
        doc! { "$group": {
            "_id": path::KEY,
            "id": { "$first": path::ID },
            field::SEQUENCE: { "$first": path::SEQUENCE },
            field::LANE_ID: { "$first": path::LANE_ID },
            field::EVENT_ID: { "$first": path::EVENT_ID },
            field::ATTEMPTS: { "$first": path::ATTEMPTS },
            field::CLAIMS: { "$first": path::CLAIMS },
            field::DUE_AT: { "$first": path::DUE_AT },
            field::FRESH: { "$first": path::FRESH },
            field::REQUEUED: { "$first": path::REQUEUED },
            field::CREATED_AT: { "$first": path::CREATED_AT },
        } },
        doc! { "$project": {
            "_id": 0,
            "parkedHandler": { "$literal": handler },
            "parkedKey": "$_id",
            "id": 1,
            field::SEQUENCE: 1,
            field::LANE_ID: 1,
            field::EVENT_ID: 1,
            field::ATTEMPTS: 1,
            field::CLAIMS: 1,
            field::DUE_AT: 1,
            field::FRESH: 1,
            field::REQUEUED: 1,
            field::CREATED_AT: 1,
        } },
    ]
}

/// The most parked keys whose lowest pending delivery the claim's first read looks up, per
/// handler; unparking looks up the others itself.
pub(crate) const LOWEST_IN_LANE_READ: i32 = 500;

/// An aggregation of the deliveries collection that yields one document: the keys of `handler`
/// with parked deliveries (up to [`LOWEST_IN_LANE_READ`] of them, `lowestKeys`) and the lowest
/// pending delivery of each of those that has one (`lowest`: `_id` the key, `id`, `sequence`).
/// The keys are gathered first so that the lookup runs once: a `$lookup` runs its query once
/// per input document. Nothing when nothing is parked.
pub(crate) fn lowest_of_parked_stages(handler: &str, deliveries: &str) -> Vec<Document> {
    vec![
        doc! { "$match": { field::LANE: lane::PARKED, field::HANDLER: handler } },
        doc! { "$sort": index::parked_keys() },
        doc! { "$group": { "_id": path::KEY } },
        doc! { "$limit": LOWEST_IN_LANE_READ },
        doc! { "$group": { "_id": null, "lowestKeys": { "$push": path::ID } } },
        doc! { "$lookup": {
            "from": deliveries,
            "localField": "lowestKeys",
            "foreignField": field::KEY,
            "pipeline": [
                { "$match": { field::STATUS: status::PENDING, field::HANDLER: handler } },
                { "$sort": index::ordering_keys() },
                { "$group": {
                    "_id": path::KEY,
                    "id": { "$first": path::ID },
                    field::SEQUENCE: { "$first": path::SEQUENCE },
                } },
            ],
            "as": "lowest",
        } },
        doc! { "$project": {
            "_id": 0,
            "lowestHandler": { "$literal": handler },
            "lowestKeys": 1,
            "lowest": 1,
        } },
    ]
}

/// The lowest pending delivery of each of a set of keys, as looked up; keys looked up with
/// nothing pending are in `looked_up` and not in `lowest`.
#[derive(Debug, Default)]
pub(crate) struct LowestPending {
    pub(crate) looked_up: HashSet<(String, String)>,
    pub(crate) lowest: HashMap<(String, String), (ObjectId, i64)>,
}

impl LowestPending {
    /// Adds one document of [`lowest_of_parked_stages`], as the reply brought it (each of its
    /// documents read in one pass over its fields); `false` if it is not one.
    pub(crate) fn add(&mut self, doc: &RawDocument) -> bool {
        let Ok(handler) = doc.get_str("lowestHandler") else {
            return false;
        };
        let array = |name: &str| doc.get_array(name).ok().into_iter().flatten();
        for key in array("lowestKeys").filter_map(Result::ok) {
            if let Some(key) = key.as_str() {
                self.looked_up.insert((handler.to_owned(), key.to_owned()));
            }
        }
        for found in array("lowest").filter_map(Result::ok) {
            let Some(found) = found.as_document() else {
                continue;
            };
            // `_id` the key, `id` the delivery.
            let read = DeliveryFields::of(found);
            let key = found.get_str(field::ID).ok();
            if let (Some(key), Some(id), Some(sequence)) = (key, read.parked_id, read.sequence) {
                self.lowest
                    .insert((handler.to_owned(), key.to_owned()), (id, sequence));
            }
        }
        true
    }
}

impl MongoEventStore {
    /// Moves the lowest parked delivery of each key of `handler` back to the ready lane when
    /// nothing pending precedes it. Returns how many it moved.
    ///
    /// One aggregation (a distinct scan of the small `parked` index), then
    /// [`unpark_heads`](Self::unpark_heads).
    ///
    /// Keys in `skip_lanes` (held by another live owner, who unparks them on its own claims) are
    /// left alone.
    pub(crate) async fn unpark(&self, handler: &str, skip_lanes: &HashSet<i32>) -> Result<u64> {
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
        self.unpark_heads(heads, skip_lanes, &HashSet::new()).await
    }

    /// Moves each of `heads` (the lowest parked delivery of its key) back to the ready lane when
    /// nothing pending precedes it: one predecessor probe per key (sent together, see
    /// [`lowest_pending`](Self::lowest_pending)), then one update. Heads in `skip_lanes` are left
    /// alone, and so are the keys in `running` (`(handler, key)`): one of their deliveries runs,
    /// so none of the others can be claimed yet, and a later claim looks again. Returns how many
    /// it moved.
    pub(crate) async fn unpark_heads(
        &self,
        heads: Vec<ParkedHead>,
        skip_lanes: &HashSet<i32>,
        running: &HashSet<(String, String)>,
    ) -> Result<u64> {
        let (free, _) = self.plan_unpark(heads, skip_lanes, running, None).await?;
        self.unpark_ids(free.iter().map(|head| head.id).collect())
            .await
    }

    /// What [`unpark_heads`](Self::unpark_heads) decides, without the update: the heads that
    /// may go back to their lanes, and what it looked up of each key (the lane of its parked
    /// head and its lowest pending delivery, `None`: nothing pending, as read before the
    /// update; unparking leaves that delivery the key's lowest). `known` holds lookups made
    /// already; the other keys are looked up here.
    pub(crate) async fn plan_unpark(
        &self,
        heads: Vec<ParkedHead>,
        skip_lanes: &HashSet<i32>,
        running: &HashSet<(String, String)>,
        known: Option<LowestPending>,
    ) -> Result<(Vec<ParkedHead>, Vec<SeenKey>)> {
        let heads: Vec<ParkedHead> = heads
            .into_iter()
            .filter(|head| !head.lane.is_some_and(|lane| skip_lanes.contains(&lane)))
            .filter(|head| !running.contains(&(head.handler.clone(), head.key.clone())))
            .collect();
        if heads.is_empty() {
            return Ok((Vec::new(), Vec::new()));
        }
        let known = known.unwrap_or_default();
        let keys: Vec<(String, String)> = heads
            .iter()
            .map(|head| (head.handler.clone(), head.key.clone()))
            .filter(|key| !known.looked_up.contains(key))
            .collect();
        let mut lowest = known.lowest;
        if !keys.is_empty() {
            lowest.extend(self.lowest_pending(&keys).await?);
        }
        let mut free = Vec::new();
        let mut seen = Vec::with_capacity(heads.len());
        for head in heads {
            let key = (head.handler.clone(), head.key.clone());
            let found = lowest.get(&key).copied();
            // A head with a lower pending sequence of its key before it stays parked.
            let unparked = found.is_none_or(|(_, sequence)| sequence >= head.sequence);
            seen.push(SeenKey {
                key,
                lane: head.lane,
                lowest: found.map(|(id, _)| id),
                unparked,
            });
            if unparked {
                free.push(head);
            }
        }
        Ok((free, seen))
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
    fn a_parked_head_is_read_with_what_its_completion_needs() {
        let created = DateTime::from_millis(7_000);
        let stages = parked_heads_stages("projector");
        let group = stages[2].get_document("$group").unwrap();
        let project = stages[3].get_document("$project").unwrap();
        for field in [field::FRESH, field::REQUEUED, field::CREATED_AT] {
            assert!(
                group.contains_key(field) && project.contains_key(field),
                "{field}"
            );
        }
        let head = |extra: Document| {
            let mut doc = doc! {
                "parkedHandler": "projector", "parkedKey": "k", "id": ObjectId::new(),
                "sequence": 2_i64, "laneId": 4, "eventId": "e", "createdAt": created,
            };
            doc.extend(extra);
            ParkedHead::from_document(&doc).unwrap().quick_since
        };
        assert_eq!(head(doc! { "fresh": true }), Some(Some(created)));
        assert_eq!(head(doc! { "fresh": true, "requeued": 1 }), Some(None));
        assert_eq!(head(doc! {}), Some(None));
    }

    /// The parked keys' documents are read as the reply brought them: what a lookup by name
    /// would find, numbers of any type, a field of another type as absent.
    #[test]
    fn parked_keys_are_read_raw() {
        let (id, lowest_id) = (ObjectId::new(), ObjectId::new());
        let due = DateTime::from_millis(9_000);
        let base = doc! {
            "parkedHandler": "projector", "parkedKey": "k", "id": id, "sequence": 2.0,
            "laneId": 4_i64, "eventId": "e", "attempts": 1, "claims": 3_i64, "dueAt": due,
        };
        let raw = |doc: &Document| RawDocumentBuf::from_document(doc).unwrap();
        let head = ParkedHead::from_raw(&raw(&base)).unwrap();
        assert_eq!(
            (
                head.handler.as_str(),
                head.key.as_str(),
                head.id,
                head.sequence,
                head.lane
            ),
            ("projector", "k", id, 2, Some(4))
        );
        assert_eq!((head.attempts, head.claims, head.due_at), (1, 3, Some(due)));
        assert_eq!(head.event_id.as_deref(), Some("e"));
        let mut odd = base.clone();
        odd.extend(doc! { "eventId": 5, "laneId": 5_000_000_000_i64, "attempts": "x" });
        let head = ParkedHead::from_raw(&raw(&odd)).unwrap();
        assert_eq!((head.event_id, head.lane, head.attempts), (None, None, 0));
        for needed in ["parkedHandler", "parkedKey", "id", "sequence"] {
            let mut doc = base.clone();
            doc.remove(needed);
            assert!(ParkedHead::from_raw(&raw(&doc)).is_none(), "{needed}");
        }

        let mut lowest = LowestPending::default();
        let found = doc! {
            "lowestHandler": "projector",
            "lowestKeys": ["a", "b", 7],
            "lowest": [
                { "_id": "a", "id": lowest_id, "sequence": 3_i64 },
                { "_id": "b", "id": "not an id", "sequence": 1 },
                "not a document",
            ],
        };
        assert!(lowest.add(&raw(&found)));
        let key = |k: &str| ("projector".to_owned(), k.to_owned());
        assert_eq!(lowest.looked_up, HashSet::from([key("a"), key("b")]));
        assert_eq!(lowest.lowest, HashMap::from([(key("a"), (lowest_id, 3))]));
        assert!(!lowest.add(&raw(&doc! { "parkedKey": "k" })));
    }
}
