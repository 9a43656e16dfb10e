//! The owner's held lanes at the start of a claim: read from the database, or known from the
//! last claim and judged against what this instance handed out; and the parked deliveries a
//! claim sends back to their lanes.

use std::collections::{HashMap, HashSet};

use futures::{TryStreamExt, future};
use mongodb::bson::{DateTime, Document, doc, oid::ObjectId};

use super::super::{
    MongoEventStore,
    lane::Lane,
    schema::{field, status},
};
use super::pick::KeyOf;
use crate::error::Result;

/// What the owner's lanes list, judged against what this instance handed out.
#[derive(Debug, Default)]
pub(super) struct Listed {
    pub(super) running: HashSet<ObjectId>,
    pub(super) running_keys: HashSet<KeyOf>,
}

impl MongoEventStore {
    /// The lanes `owner` holds on this instance, with what they list that still exists: one
    /// aggregation that gathers the lanes' lists first and looks them up by id once (a
    /// `$lookup` runs its query once per input document).
    pub(super) async fn own_lanes(&self, owner: &str) -> Result<(Vec<Lane>, Vec<Document>)> {
        let found: Option<Document> = self
            .inner
            .lanes
            .aggregate(vec![
                doc! { "$match": {
                    field::OWNER: owner,
                    field::INSTANCE: self.inner.claims.instance,
                } },
                doc! { "$group": {
                    "_id": null,
                    "lanes": { "$push": "$$ROOT" },
                    "ids": { "$push": { "$ifNull": [format!("${}", field::IN_FLIGHT), []] } },
                } },
                doc! { "$project": {
                    "lanes": 1,
                    "ids": { "$reduce": {
                        "input": "$ids",
                        "initialValue": [],
                        "in": { "$concatArrays": ["$$value", "$$this"] },
                    } },
                } },
                doc! { "$lookup": {
                    "from": self.inner.deliveries.name(),
                    "localField": "ids",
                    "foreignField": field::ID,
                    "pipeline": [{ "$project": {
                        field::CLAIMS: 1, field::STATUS: 1, field::HANDLER: 1, field::KEY: 1,
                        field::UNORDERED: 1,
                    } }],
                    "as": "listed",
                } },
                doc! { "$project": { "ids": 0 } },
            ])
            .await?
            .try_next()
            .await?;
        let Some(found) = found else {
            return Ok((Vec::new(), Vec::new()));
        };
        let documents = |name: &str| -> Vec<Document> {
            found
                .get_array(name)
                .map(|items| {
                    items
                        .iter()
                        .filter_map(|item| item.as_document().cloned())
                        .collect()
                })
                .unwrap_or_default()
        };
        let lanes = documents("lanes")
            .iter()
            .filter_map(Lane::from_document)
            .collect();
        Ok((lanes, documents("listed")))
    }

    /// What the held lanes list, judged by the deliveries that still exist (`found`): those
    /// this instance handed out under the lane's epoch and claim generation run, the missing
    /// ones are gone. `None` when a lane lists a delivery that exists and this instance did not
    /// hand out as it stands.
    pub(super) fn judge_listed(
        &self,
        held: &[Lane],
        found: &[Document],
        issued: &HashMap<ObjectId, super::super::lease::Issued>,
    ) -> Option<Listed> {
        let found: HashMap<ObjectId, &Document> = found
            .iter()
            .filter_map(|doc| Some((doc.get_object_id(field::ID).ok()?, doc)))
            .collect();
        let mut listed = Listed::default();
        for lane in held {
            for id in &lane.in_flight {
                // Gone, or ended meanwhile: the record takes it off.
                let Some(doc) = found
                    .get(id)
                    .filter(|doc| doc.get_str(field::STATUS) == Ok(status::PENDING))
                else {
                    continue;
                };
                let current = super::super::lease::Issued {
                    lane: lane.id,
                    epoch: lane.epoch,
                    claims: super::super::lane::int(doc, field::CLAIMS).unwrap_or(0),
                };
                if issued.get(id) != Some(&current) {
                    return None;
                }
                listed.running.insert(*id);
                let ordered = doc.get_bool(field::UNORDERED) != Ok(true);
                if let (Ok(handler), Ok(key), true) = (
                    doc.get_str(field::HANDLER),
                    doc.get_str(field::KEY),
                    ordered,
                ) {
                    listed
                        .running_keys
                        .insert((handler.to_owned(), key.to_owned()));
                }
            }
        }
        Some(listed)
    }

    /// Sends the lowest parked delivery of each key of `handlers` back to its lane when nothing
    /// pending precedes it, for the handlers whose parked deliveries are looked up now (see
    /// `ParkedLookup`). Keys with a delivery running are left: their next claims look again.
    /// Best effort. Whether it moved any, and the lowest pending delivery of each key it
    /// looked at.
    pub(super) async fn unpark_for_claim(
        &self,
        handlers: &[&str],
        running_keys: &HashSet<KeyOf>,
        now: DateTime,
    ) -> (bool, HashMap<KeyOf, (ObjectId, i64)>) {
        let claims = &self.inner.claims;
        let parkings = claims.parkings();
        let looked: Vec<&str> = handlers
            .iter()
            .copied()
            .filter(|handler| {
                !matches!(
                    claims.parked_lookup(handler, now),
                    super::super::lease::ParkedLookup::Skip
                )
            })
            .collect();
        let unparked = future::join_all(
            looked
                .iter()
                .map(|handler| self.unpark(handler, running_keys)),
        )
        .await;
        let mut found_for = HashSet::new();
        let mut moved = 0;
        let mut lowest = HashMap::new();
        for (handler, unparked) in looked.iter().zip(unparked) {
            match unparked {
                Ok((found, count, looked_up)) => {
                    if found {
                        found_for.insert(*handler);
                    }
                    moved += count;
                    lowest.extend(looked_up);
                }
                Err(error) => {
                    // A later claim looks again.
                    tracing::warn!(%error, "relaybus: unparking deliveries failed");
                    return (false, HashMap::new());
                }
            }
        }
        claims.note_parked_lookup(looked.iter().copied(), &found_for, now, parkings);
        (moved > 0, lowest)
    }
}

/// What the known lanes list, judged by what this instance handed out: a listed delivery it
/// handed out under the lane's epoch and has not seen settled runs, with its key when it has
/// one (from `keys`, which forgets the rest); any other is gone, and the record takes it off.
pub(super) fn listed_from_memory(
    held: &[Lane],
    issued: &HashMap<ObjectId, super::super::lease::Issued>,
    keys: &mut HashMap<ObjectId, KeyOf>,
) -> Listed {
    let mut listed = Listed::default();
    for lane in held {
        for id in &lane.in_flight {
            if issued
                .get(id)
                .is_some_and(|claim| claim.lane == lane.id && claim.epoch == lane.epoch)
            {
                listed.running.insert(*id);
            }
        }
    }
    keys.retain(|id, _| listed.running.contains(id));
    listed.running_keys = keys.values().cloned().collect();
    listed
}
