//! Lane documents and the small readers shared by the lifecycle operations.
//!
//! A lane document is `{_id: 0..255, owner, instance, leaseExpiresAt, epoch, inFlight, lost,
//! requeues?}`. `inFlight` lists the deliveries the holder claimed and has not settled;
//! `lost` lists `{d: <delivery id>, e: <epoch>}` for claims of an earlier holder that still have
//! to be charged; `requeues` counts the requeues of dead deliveries of the lane and is absent
//! until the first one.

use mongodb::bson::{Bson, DateTime, Document, RawBsonRef, doc, oid::ObjectId};

use super::{
    MongoEventStore,
    append::check_write_reply,
    schema::{field, path},
};
use crate::{
    error::Result,
    store::checks::{self, MAX_ERROR_BYTES, MAX_HISTORY_ERROR_BYTES, clip_to},
};

/// Write statements per `update` command.
pub(crate) const STATEMENTS_PER_COMMAND: usize = 1_000;

/// A claim of an earlier holder that still has to be charged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct LostClaim {
    pub(crate) delivery: ObjectId,
    pub(crate) epoch: i64,
}

/// A lane document as the lifecycle reads it.
#[derive(Debug, Clone)]
pub(crate) struct Lane {
    pub(crate) id: i32,
    pub(crate) epoch: i64,
    pub(crate) lease_expires_at: Option<DateTime>,
    pub(crate) in_flight: Vec<ObjectId>,
    pub(crate) lost: Vec<LostClaim>,
    /// The requeue counter as stored (`Null` when absent), matched when recording a claim.
    pub(crate) requeues: Bson,
}

impl Lane {
    pub(crate) fn from_document(doc: &Document) -> Option<Lane> {
        let id = int32(doc, field::ID)?;
        let lost = match doc.get(field::LOST) {
            Some(Bson::Array(items)) => items
                .iter()
                .filter_map(|item| {
                    let item = item.as_document()?;
                    Some(LostClaim {
                        delivery: item.get_object_id(field::LOST_DELIVERY).ok()?,
                        epoch: int(item, field::LOST_EPOCH)?,
                    })
                })
                .collect(),
            _ => Vec::new(),
        };
        Some(Lane {
            id,
            epoch: int(doc, field::EPOCH).unwrap_or(0),
            lease_expires_at: doc.get_datetime(field::LEASE_EXPIRES_AT).ok().copied(),
            in_flight: object_ids(doc, field::IN_FLIGHT),
            lost,
            requeues: doc.get(field::REQUEUES).cloned().unwrap_or(Bson::Null),
        })
    }

    /// The condition under which a write may change the lane: still held by this owner and
    /// instance, in the same epoch, with no requeue since it was read.
    pub(crate) fn held_filter(&self, owner: &str, instance: ObjectId) -> Document {
        doc! {
            field::ID: self.id,
            field::OWNER: owner,
            field::INSTANCE: instance,
            field::EPOCH: self.epoch,
            field::REQUEUES: self.requeues.clone(),
        }
    }
}

/// The condition on a lane document that it is free and clean at `now`: no holder or an
/// expired lease, nothing in flight, no lost claim.
pub(crate) fn free_and_clean(now: DateTime) -> Document {
    doc! {
        field::IN_FLIGHT: { "$in": [Bson::Null, []] },
        field::LOST: { "$in": [Bson::Null, []] },
        "$or": [
            { field::OWNER: Bson::Null },
            { field::LEASE_EXPIRES_AT: { "$lte": now } },
        ],
    }
}

impl MongoEventStore {
    /// Sends `statements` (`{q, u, upsert?}`) to the lanes as one unordered `update` command
    /// with majority write concern; how many lane documents they matched.
    pub(crate) async fn update_lanes(&self, statements: &[Document]) -> Result<u64> {
        let reply = self
            .update_statements(self.inner.lanes.name(), statements)
            .await?;
        Ok(reply_count(&reply))
    }

    /// Sends `statements` (`q`/`u` pairs, at most `STATEMENTS_PER_COMMAND`) to `collection`
    /// in one unordered `update` command with majority write concern; its checked reply.
    pub(crate) async fn update_statements(
        &self,
        collection: &str,
        statements: &[Document],
    ) -> Result<Document> {
        let reply = self
            .inner
            .db
            .run_command(doc! {
                "update": collection,
                "updates": statements,
                "ordered": false,
                "writeConcern": { "w": "majority" },
            })
            .await?;
        check_write_reply(&reply)?;
        Ok(reply)
    }
}

/// A lane's in-flight list, as an update pipeline computes it: without the ids `gone`, then
/// with the ids the expression `added` gives at the end.
pub(crate) fn relisted(gone: &[ObjectId], added: impl Into<Bson>) -> Document {
    doc! { "$concatArrays": [
        { "$filter": {
            "input": { "$ifNull": [path::IN_FLIGHT, []] },
            "cond": { "$not": [{ "$in": ["$$this", { "$literal": gone }] }] },
        } },
        added.into(),
    ] }
}

/// The expression for the ids `ids`, taken as they are.
pub(crate) fn listed(ids: &[ObjectId]) -> Document {
    doc! { "$literal": ids }
}

/// A lane a claim lists new picks on, or takes gone deliveries off, under its held condition.
#[derive(Debug)]
pub(crate) struct Relist {
    pub(crate) lane: i32,
    /// The condition on the lane document ([`Lane::held_filter`]), which names the lane.
    pub(crate) filter: Document,
    /// Deliveries to take off its list.
    pub(crate) gone: Vec<ObjectId>,
    /// Deliveries to add at the end of its list.
    pub(crate) added: Vec<ObjectId>,
}

/// The update statements that relist `relists`, extending each lane's lease to at least
/// `expires_at` and clearing its lost claims, with the number of lane documents they match when
/// every condition holds. Several lanes go in one multi-document statement: its filter is the
/// lanes' `_id`s, then their conditions joined by `$or`, and the lane's `_id` picks what it
/// adds, so that the server parses and plans one statement instead of one per lane (a keyed
/// claim writes about one lane per delivery), and reads the lanes with one scan of `_id`. A delivery is listed in one lane only, so the ids to take off can be
/// taken off every lane.
pub(crate) fn relist_statements(relists: &[Relist], expires_at: DateTime) -> (Vec<Document>, u64) {
    let set = |in_flight: Document| {
        vec![doc! { "$set": {
            field::IN_FLIGHT: in_flight,
            field::LEASE_EXPIRES_AT: { "$max": [path::LEASE_EXPIRES_AT, expires_at] },
            field::LOST: { "$literal": [] },
        } }]
    };
    match relists {
        [] => (Vec::new(), 0),
        [one] => (
            vec![
                doc! { "q": one.filter.clone(), "u": set(relisted(&one.gone, listed(&one.added))) },
            ],
            1,
        ),
        many => {
            let gone: Vec<ObjectId> = many.iter().flat_map(|r| r.gone.iter().copied()).collect();
            let filters: Vec<Document> = many.iter().map(|r| r.filter.clone()).collect();
            let branches: Vec<Document> = many
                .iter()
                .filter(|r| !r.added.is_empty())
                .map(|r| {
                    doc! {
                        "case": { "$eq": [path::ID, r.lane] },
                        "then": listed(&r.added),
                    }
                })
                .collect();
            let added = if branches.is_empty() {
                Bson::Array(Vec::new())
            } else {
                Bson::Document(doc! { "$switch": { "branches": branches, "default": [] } })
            };
            // The lanes' ids lead the filter, so that the server reads them by `_id` as one
            // index scan: an `$or` at the root would have it plan each branch on its own.
            let ids: Vec<i32> = many.iter().map(|r| r.lane).collect();
            let statement = doc! {
                "q": { field::ID: { "$in": ids }, "$or": filters },
                "u": set(relisted(&gone, added)),
                "multi": true,
            };
            (vec![statement], many.len() as u64)
        }
    }
}

/// An integer field, whatever numeric type it was stored as.
pub(crate) fn int(doc: &Document, key: &str) -> Option<i64> {
    match doc.get(key)? {
        Bson::Int32(i) => Some(i64::from(*i)),
        Bson::Int64(i) => Some(*i),
        Bson::Double(f) if f.fract() == 0.0 && f.is_finite() => Some(*f as i64),
        _ => None,
    }
}

/// A lane id or another 32-bit integer field, whatever numeric type it was stored as; `None`
/// when it does not fit.
pub(crate) fn int32(doc: &Document, key: &str) -> Option<i32> {
    int(doc, key).and_then(|n| i32::try_from(n).ok())
}

/// A whole number stored as any of BSON's number types.
pub(crate) fn whole_number(value: RawBsonRef<'_>) -> Option<i64> {
    match value {
        RawBsonRef::Int32(i) => Some(i64::from(i)),
        RawBsonRef::Int64(i) => Some(i),
        RawBsonRef::Double(f) if f.fract() == 0.0 && f.is_finite() => Some(f as i64),
        _ => None,
    }
}

/// The ObjectIds of an array field; other values are skipped.
pub(crate) fn object_ids(doc: &Document, key: &str) -> Vec<ObjectId> {
    match doc.get(key) {
        Some(Bson::Array(items)) => items.iter().filter_map(Bson::as_object_id).collect(),
        _ => Vec::new(),
    }
}

/// The ids (`_id`) of `docs`.
pub(crate) fn ids_of(docs: &[Document]) -> Vec<ObjectId> {
    docs.iter()
        .filter_map(|doc| doc.get_object_id(field::ID).ok())
        .collect()
}

/// A string field.
pub(crate) fn string(doc: &Document, key: &str) -> Option<String> {
    doc.get_str(key).ok().map(str::to_owned)
}

/// The strings of the array `key` of `doc`; none when it is missing.
pub(crate) fn strings(doc: &Document, key: &str) -> Vec<String> {
    doc.get_array(key)
        .map(|values| {
            values
                .iter()
                .filter_map(|value| value.as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}

/// `now + duration`, refused when it leaves the range of a BSON date.
pub(crate) fn add(now: DateTime, duration: std::time::Duration) -> Result<DateTime> {
    checks::add(now.into(), duration).map(DateTime::from)
}

/// An error message cut to at most 8 KiB, at a character boundary.
pub(crate) fn clip_error(message: &str) -> &str {
    clip_to(message, MAX_ERROR_BYTES)
}

/// The failed attempt appended to a delivery's error history, the last
/// [`MAX_ERROR_HISTORY`](crate::store::MAX_ERROR_HISTORY) kept: an aggregation expression for a
/// pipeline update, evaluated against the delivery before the update (its attempt is
/// `attempts + 1`).
pub(crate) fn push_error(error: &str, now: DateTime) -> Bson {
    let attempt = doc! { "$add": [{ "$ifNull": [format!("${}", field::ATTEMPTS), 0] }, 1] };
    let entry = doc! {
        field::ERROR_AT: now,
        field::ERROR_ATTEMPT: attempt,
        field::ERROR_TEXT: { "$literal": clip_to(error, MAX_HISTORY_ERROR_BYTES) },
    };
    let limit = i64::try_from(crate::store::MAX_ERROR_HISTORY).unwrap_or(10);
    Bson::Document(doc! { "$slice": [
        { "$concatArrays": [{ "$ifNull": [format!("${}", field::ERRORS), []] }, [entry]] },
        -limit,
    ] })
}

/// The number of documents an `update` or `delete` command reply says it matched.
pub(crate) fn reply_count(reply: &Document) -> u64 {
    int(reply, "n").map_or(0, |n| n.max(0) as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lanes_relisted_together_are_read_by_id_first() {
        let relist = |lane: i32| Relist {
            lane,
            filter: doc! { "_id": lane, "owner": "worker", "epoch": 2_i64 },
            gone: Vec::new(),
            added: vec![ObjectId::new()],
        };
        let (statements, matched) =
            relist_statements(&[relist(3), relist(7)], DateTime::from_millis(1_000));
        assert_eq!((statements.len(), matched), (1, 2));
        let filter = statements[0].get_document("q").unwrap();
        // The `_id`s lead: a filter whose root is the `$or` is planned branch by branch.
        assert_eq!(filter.keys().next().map(String::as_str), Some("_id"));
        assert_eq!(filter.get_document("_id").unwrap(), &doc! { "$in": [3, 7] });
        let branches = filter.get_array("$or").unwrap();
        assert_eq!(branches.len(), 2);
        assert_eq!(branches[1].as_document().unwrap(), &relist(7).filter);
    }

    #[test]
    fn lane_documents_parse() {
        let d = ObjectId::new();
        let lane = Lane::from_document(&doc! {
            "_id": 7, "owner": "w", "epoch": 3_i64, "inFlight": [d, "junk"],
            "lost": [{ "d": d, "e": 2_i64 }, { "x": 1 }], "leaseExpiresAt": DateTime::from_millis(5),
        })
        .unwrap();
        assert_eq!(lane.id, 7);
        assert_eq!(lane.epoch, 3);
        assert_eq!(lane.in_flight, vec![d]);
        assert_eq!(
            lane.lost,
            vec![LostClaim {
                delivery: d,
                epoch: 2
            }]
        );
        assert_eq!(lane.requeues, Bson::Null);
        assert_eq!(lane.lease_expires_at, Some(DateTime::from_millis(5)));
        assert!(Lane::from_document(&doc! { "_id": "x" }).is_none());
    }

    #[test]
    fn arguments_are_checked() {
        assert!(add(DateTime::MAX, std::time::Duration::from_secs(1)).is_err());
        assert_eq!(
            add(DateTime::from_millis(1), std::time::Duration::from_secs(1)).unwrap(),
            DateTime::from_millis(1001)
        );
        let long = "é".repeat(MAX_ERROR_BYTES);
        assert!(clip_error(&long).len() <= MAX_ERROR_BYTES);
        assert_eq!(clip_error("short"), "short");
    }
}
