//! Runs: a key's next deliveries, handed out with the delivery a claim picked for the key.
//!
//! A worker that asks for runs (the dispatcher does) runs the deliveries of one key one after
//! the other, each only once its predecessor's completion is durable, and gives the rest of a
//! run back when one does not complete. A claim may then hand out, behind each keyed delivery
//! it picked (the key's lowest pending delivery, nothing of the key running), the deliveries
//! that follow it in sequence order: one more read, for every picked key at once, finds the
//! key's pending deliveries with the next sequence numbers. A run is the
//! longest chain of them without a gap in the numbers: nothing of the key can lie between two
//! consecutive numbers, so each is the key's lowest pending delivery once its predecessor
//! completed. A member must be due, in the key's lane (ready or parked: a parked one runs from
//! the parked lane, as a key's next delivery does) and not handed out already. Their events are
//! read with those of the other picks the scans did not bring, beside the record (a `$lookup`
//! per member cost the server more than the rest of the read); a member whose event is missing
//! is given back with the rest of its run. The record lists the members on the lane with the
//! head, so the whole run is kept or given up together when the lane changed hands.
//!
//! A handler that takes only some of a key's event types sees gaps in its numbers, and its runs
//! end at them; its next deliveries come with later claims, as without runs.

use std::collections::HashMap;

use futures::TryStreamExt;
use mongodb::bson::{Document, RawDocumentBuf, doc, oid::ObjectId};

use super::{
    Request,
    scan::{Candidate, candidate_fields},
};
use crate::{
    error::Result,
    store::mongo::{
        MongoEventStore,
        schema::{field, index, lane, status},
    },
};

/// The most deliveries of one key a run holds, its head included.
pub(crate) const MAX_RUN: u32 = 1_000;

impl MongoEventStore {
    /// The runs behind the keyed picks: for each of the first `runs` keyed picks, the
    /// deliveries of its handler and key that follow it, up to `run - 1`. Deliveries for which
    /// `taken` holds (running, handed out, picked) end a run. Nothing for a `run` of 1, no
    /// `runs` or no keyed picks, without a read.
    pub(super) async fn runs_behind(
        &self,
        request: &Request<'_>,
        picks: &[Candidate],
        (run, runs): (u32, u32),
        taken: impl Fn(&ObjectId) -> bool,
    ) -> Result<Vec<Candidate>> {
        if run <= 1 {
            return Ok(Vec::new());
        }
        let heads: Vec<(&Candidate, &str, i64)> = picks
            .iter()
            .filter_map(|pick| Some((pick, pick.key.as_deref()?, pick.sequence?)))
            .take(runs as usize)
            .collect();
        if heads.is_empty() {
            return Ok(Vec::new());
        }
        let branches: Vec<Document> = heads
            .iter()
            .map(|(pick, key, sequence)| {
                doc! {
                    field::HANDLER: &pick.handler,
                    field::KEY: *key,
                    field::SEQUENCE: {
                        "$gt": *sequence,
                        "$lt": sequence.saturating_add(i64::from(run)),
                    },
                }
            })
            .collect();
        let mut fields = candidate_fields();
        fields.insert(field::LANE, 1);
        let found: Vec<RawDocumentBuf> = self
            .inner
            .deliveries
            .aggregate([
                doc! { "$match": {
                    field::STATUS: status::PENDING,
                    field::KEY: { "$exists": true },
                    "$or": branches,
                } },
                doc! { "$project": fields },
            ])
            .hint(index::hint(index::ORDERING))
            // One batch, so that no `getMore` follows.
            .batch_size(
                u32::try_from(heads.len().saturating_mul(run as usize - 1) + 1).unwrap_or(u32::MAX),
            )
            .await?
            .with_type::<RawDocumentBuf>()
            .try_collect()
            .await?;
        // Each head by its handler and key, and what each head's run may take by head and
        // sequence.
        let head_of: HashMap<(&str, &str), usize> = heads
            .iter()
            .enumerate()
            .map(|(at, (pick, key, _))| ((pick.handler.as_str(), *key), at))
            .collect();
        let mut following: HashMap<(usize, i64), Candidate> = HashMap::new();
        for doc in &found {
            let in_a_lane = matches!(doc.get_str(field::LANE), Ok(lane::READY) | Ok(lane::PARKED));
            let Some(candidate) = Candidate::from_raw(doc) else {
                continue;
            };
            let (true, Some(key), Some(sequence)) =
                (in_a_lane, candidate.key.as_deref(), candidate.sequence)
            else {
                continue;
            };
            let Some(&at) = head_of.get(&(candidate.handler.as_str(), key)) else {
                continue;
            };
            following.insert((at, sequence), candidate);
        }
        let mut members = Vec::new();
        for (at, (head, _, sequence)) in heads.iter().enumerate() {
            let mut next = *sequence;
            for _ in 1..run {
                next += 1;
                let Some(candidate) = following.remove(&(at, next)) else {
                    break;
                };
                if candidate.lane != head.lane
                    || candidate.due_at > request.now
                    || taken(&candidate.id)
                {
                    break;
                }
                members.push(candidate);
            }
        }
        Ok(members)
    }
}
