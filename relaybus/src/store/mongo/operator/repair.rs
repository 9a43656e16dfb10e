//! Operator writes: requeueing and discarding dead letters, burying pending deliveries, and
//! handing lanes back at shutdown. Each runs in one transaction, so a claim running beside it
//! either sees all of it or records nothing it read.

use std::collections::{HashMap, HashSet};

use futures::TryStreamExt;
use mongodb::{
    ClientSession,
    bson::{Bson, DateTime, Document, doc, oid::ObjectId},
};

use super::super::{
    MongoEventStore,
    lane::{ids_of, int, int32, object_ids, string},
    schema,
    schema::{field, path, status},
    transaction::documents_in,
};
use crate::error::Result;
use crate::store::checks::{self, check_owner};
use crate::store::{Buried, Discarded, Requeued};

/// The handler and ordering key of a delivery document, if it is held to its key's order: a
/// delivery marked `unordered` keeps its key for operators only.
fn ordered_key_of(doc: &Document) -> Option<(String, String)> {
    if doc.get_bool(field::UNORDERED) == Ok(true) {
        return None;
    }
    Some((string(doc, field::HANDLER)?, string(doc, field::KEY)?))
}

/// The distinct ObjectIds among `ids`, and the ids that are not ObjectIds (which never reach a
/// query); refuses more than 10,000 ids, naming what `verb` does.
fn parse_ids<S: AsRef<str>>(ids: &[S], verb: &str) -> Result<(Vec<ObjectId>, Vec<String>)> {
    checks::parse_ids(ids, verb, parse_id)
}

/// A delivery id, when it is one this store can have made.
pub(super) fn parse_id(id: &str) -> Option<ObjectId> {
    ObjectId::parse_str(id).ok()
}

/// What a requeue did, with the ids as the database holds them.
#[derive(Debug, Default)]
struct RequeueOutcome {
    requeued: Vec<ObjectId>,
    blocked: Vec<ObjectId>,
    not_found: Vec<String>,
}

impl MongoEventStore {
    /// Makes dead deliveries pending again, due at `now`, with their attempts counted from 0:
    /// an operator action for dead letters whose cause was fixed.
    ///
    /// A requeued keyed delivery goes before the later deliveries of its key that have not been
    /// claimed yet (they wait for it), even if some later ones already ran. It cannot start
    /// while a later delivery of its key runs: such ids come back in [`Requeued::blocked`].
    /// Ids are taken as text and compared as ObjectIds; anything else is reported in
    /// [`Requeued::not_found`] and never reaches a query.
    ///
    /// The requeue writes the lanes of the keys it requeues, so a claim running at the same time
    /// either sees the requeued delivery or does not record what it read from that lane.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`](crate::Error::InvalidArgument) for more than 10,000 ids;
    /// [`Error::Database`](crate::Error::Database).
    ///
    /// # Cancel safety
    ///
    /// Dropping the future may or may not have requeued the deliveries (it is one transaction).
    pub async fn requeue<S: AsRef<str>>(&self, ids: &[S], now: DateTime) -> Result<Requeued> {
        let (parsed, not_found) = parse_ids(ids, "requeue")?;
        if parsed.is_empty() {
            return Ok(Requeued {
                not_found,
                ..Requeued::default()
            });
        }
        let mut outcome = self
            .own_transaction((self, &parsed, now), |session, (store, ids, now)| {
                Box::pin(store.requeue_in(session, ids, *now))
            })
            .await?;
        outcome.not_found.extend(not_found);
        Ok(Requeued {
            requeued: outcome.requeued.iter().map(|id| id.to_hex()).collect(),
            blocked: outcome.blocked.iter().map(|id| id.to_hex()).collect(),
            not_found: outcome.not_found,
        })
    }

    async fn requeue_in(
        &self,
        session: &mut ClientSession,
        ids: &[ObjectId],
        now: DateTime,
    ) -> Result<RequeueOutcome> {
        let inner = &self.inner;
        let dead: Vec<Document> = inner
            .deliveries
            .find(doc! { field::ID: { "$in": ids }, field::STATUS: status::DEAD })
            .projection(doc! {
                field::HANDLER: 1, field::KEY: 1, field::SEQUENCE: 1, field::UNORDERED: 1,
                field::LANE_ID: 1,
            })
            .session(&mut *session)
            .await?
            .stream(&mut *session)
            .try_collect()
            .await?;
        let found: HashSet<ObjectId> = dead
            .iter()
            .filter_map(|doc| doc.get_object_id(field::ID).ok())
            .collect();
        let mut outcome = RequeueOutcome {
            not_found: ids
                .iter()
                .filter(|id| !found.contains(id))
                .map(|id| id.to_hex())
                .collect(),
            ..RequeueOutcome::default()
        };

        // What runs in the lanes of the ones held to their key's order (an unordered one is
        // requeued as an unkeyed one is).
        let mut lane_ids: Vec<i32> = dead
            .iter()
            .filter(|doc| ordered_key_of(doc).is_some())
            .filter_map(|doc| int32(doc, field::LANE_ID))
            .collect();
        lane_ids.sort_unstable();
        lane_ids.dedup();
        let mut running: HashMap<(String, String), Vec<i64>> = HashMap::new();
        if !lane_ids.is_empty() {
            let lanes: Vec<Document> = inner
                .lanes
                .find(doc! { field::ID: { "$in": &lane_ids } })
                .projection(doc! { field::IN_FLIGHT: 1 })
                .session(&mut *session)
                .await?
                .stream(&mut *session)
                .try_collect()
                .await?;
            let listed: Vec<ObjectId> = lanes
                .iter()
                .flat_map(|lane| object_ids(lane, field::IN_FLIGHT))
                .collect();
            if !listed.is_empty() {
                let docs: Vec<Document> = inner
                    .deliveries
                    .find(doc! { field::ID: { "$in": listed }, field::STATUS: status::PENDING })
                    .projection(doc! {
                        field::HANDLER: 1, field::KEY: 1, field::SEQUENCE: 1, field::UNORDERED: 1,
                    })
                    .session(&mut *session)
                    .await?
                    .stream(&mut *session)
                    .try_collect()
                    .await?;
                for doc in &docs {
                    if let (Some(key_of), Some(sequence)) =
                        (ordered_key_of(doc), int(doc, field::SEQUENCE))
                    {
                        running.entry(key_of).or_default().push(sequence);
                    }
                }
            }
        }
        for doc in &dead {
            let Ok(id) = doc.get_object_id(field::ID) else {
                continue;
            };
            let later_runs = match ordered_key_of(doc) {
                Some(key_of) => {
                    let sequence = int(doc, field::SEQUENCE).unwrap_or(i64::MIN);
                    running
                        .get(&key_of)
                        .is_some_and(|runs| runs.iter().any(|&s| s > sequence))
                }
                None => false,
            };
            if later_runs {
                outcome.blocked.push(id);
            } else {
                outcome.requeued.push(id);
            }
        }
        if outcome.requeued.is_empty() {
            return Ok(outcome);
        }
        inner
            .deliveries
            .update_many(
                doc! { field::ID: { "$in": &outcome.requeued }, field::STATUS: status::DEAD },
                doc! {
                    "$set": {
                        field::STATUS: status::PENDING,
                        field::LANE: schema::lane::READY,
                        field::ATTEMPTS: 0,
                        field::DUE_AT: now,
                        field::UPDATED_AT: now,
                    },
                    // `lastError` and `errors` stay: the history goes on across the requeue.
                    "$inc": { field::CLAIMS: 1_i64, field::REQUEUED: 1_i64 },
                },
            )
            .session(&mut *session)
            .await?;
        // A claim that read one of these lanes before this commits no longer matches it when it
        // records, and one that records first makes this transaction conflict.
        self.move_requeue_counts(session, &lane_ids).await?;
        Ok(outcome)
    }

    /// Deletes dead deliveries for good, in one transaction: the dead letters an operator gave
    /// up on. An event with no delivery left gets its completion time, `now`, so that it stays
    /// as a deduplication record until the completed events' retention purges it. Pending
    /// deliveries are never touched: their ids come back in [`Discarded::not_found`], as do
    /// ids that are not ObjectIds (which never reach a query).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`](crate::Error::InvalidArgument) for more than 10,000 ids;
    /// [`Error::Database`](crate::Error::Database).
    pub async fn discard<S: AsRef<str>>(&self, ids: &[S], now: DateTime) -> Result<Discarded> {
        let (parsed, mut not_found) = parse_ids(ids, "discard")?;
        if parsed.is_empty() {
            return Ok(Discarded {
                not_found,
                ..Discarded::default()
            });
        }
        let discarded = self
            .own_transaction((self, &parsed, now), |session, (store, ids, now)| {
                Box::pin(store.discard_in(session, ids, *now))
            })
            .await?;
        let found: HashSet<&ObjectId> = discarded.iter().collect();
        not_found.extend(
            parsed
                .iter()
                .filter(|id| !found.contains(id))
                .map(|id| id.to_hex()),
        );
        Ok(Discarded {
            discarded: discarded.iter().map(|id| id.to_hex()).collect(),
            not_found,
        })
    }

    async fn discard_in(
        &self,
        session: &mut ClientSession,
        ids: &[ObjectId],
        now: DateTime,
    ) -> Result<Vec<ObjectId>> {
        let inner = &self.inner;
        let dead = documents_in(
            session,
            &inner.deliveries,
            doc! { field::ID: { "$in": ids }, field::STATUS: status::DEAD },
            doc! { field::ID: 1, field::EVENT_ID: 1 },
        )
        .await?;
        if dead.is_empty() {
            return Ok(Vec::new());
        }
        let found = ids_of(&dead);
        inner
            .deliveries
            .delete_many(doc! { field::ID: { "$in": &found }, field::STATUS: status::DEAD })
            .session(&mut *session)
            .await?;
        let mut events: Vec<String> = dead
            .iter()
            .filter_map(|doc| string(doc, field::EVENT_ID))
            .collect();
        events.sort_unstable();
        events.dedup();
        let still_referenced: Vec<String> = inner
            .deliveries
            .distinct(
                field::EVENT_ID,
                doc! { field::EVENT_ID: { "$in": &events } },
            )
            .session(&mut *session)
            .await?
            .into_iter()
            .filter_map(|id| id.as_str().map(str::to_owned))
            .collect();
        let finished: Vec<&String> = events
            .iter()
            .filter(|id| !still_referenced.contains(id))
            .collect();
        if !finished.is_empty() {
            inner
                .events
                .update_many(
                    doc! { field::ID: { "$in": finished } },
                    doc! { "$max": { field::COMPLETED_AT: now } },
                )
                .session(&mut *session)
                .await?;
        }
        Ok(found)
    }

    /// Buries pending deliveries by id, in one transaction, with `reason` as their error (cut
    /// to 8 KiB; it joins their error history, not counted as an attempt). A delivery a lane
    /// lists as running is left to its worker and reported in [`Buried::running`]; ids that are
    /// not ObjectIds never reach a query. The claim generation moves on, so a lease of an
    /// earlier claim can no longer settle a buried delivery, and so does the requeue count of
    /// the buried deliveries' lanes, so a claim that read one of them as pending before cannot
    /// record it after.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`](crate::Error::InvalidArgument) for more than 10,000 ids or an
    /// empty reason; [`Error::Database`](crate::Error::Database).
    pub async fn bury_by_id<S: AsRef<str>>(
        &self,
        ids: &[S],
        reason: &str,
        now: DateTime,
    ) -> Result<Buried> {
        let (parsed, mut not_found) = parse_ids(ids, "bury")?;
        checks::check_reason(reason)?;
        if parsed.is_empty() {
            return Ok(Buried {
                not_found,
                ..Buried::default()
            });
        }
        let (buried, running) = self
            .own_transaction(
                (self, &parsed, reason, now),
                |session, (store, ids, reason, now)| {
                    Box::pin(store.bury_by_id_in(session, ids, reason, *now))
                },
            )
            .await?;
        let known: HashSet<&ObjectId> = buried.iter().chain(running.iter()).collect();
        not_found.extend(
            parsed
                .iter()
                .filter(|id| !known.contains(id))
                .map(|id| id.to_hex()),
        );
        Ok(Buried {
            buried: buried.iter().map(|id| id.to_hex()).collect(),
            running: running.iter().map(|id| id.to_hex()).collect(),
            not_found,
        })
    }

    async fn bury_by_id_in(
        &self,
        session: &mut ClientSession,
        ids: &[ObjectId],
        reason: &str,
        now: DateTime,
    ) -> Result<(Vec<ObjectId>, Vec<ObjectId>)> {
        let inner = &self.inner;
        let pending = documents_in(
            session,
            &inner.deliveries,
            doc! { field::ID: { "$in": ids }, field::STATUS: status::PENDING },
            doc! { field::ID: 1, field::LANE_ID: 1 },
        )
        .await?;
        if pending.is_empty() {
            return Ok((Vec::new(), Vec::new()));
        }
        let found = ids_of(&pending);
        // Read in the transaction: a claim that lists one of them later conflicts with it.
        let listed = documents_in(
            session,
            &inner.lanes,
            doc! { field::IN_FLIGHT: { "$in": &found } },
            doc! { field::IN_FLIGHT: 1 },
        )
        .await?;
        let running: HashSet<ObjectId> = listed
            .iter()
            .filter_map(|lane| lane.get_array(field::IN_FLIGHT).ok())
            .flatten()
            .filter_map(|id| id.as_object_id())
            .filter(|id| found.contains(id))
            .collect();
        let buried: Vec<ObjectId> = found
            .iter()
            .filter(|id| !running.contains(id))
            .copied()
            .collect();
        if !buried.is_empty() {
            let error = format!("buried by an operator: {reason}");
            inner
                .deliveries
                .update_many(
                    doc! { field::ID: { "$in": &buried }, field::STATUS: status::PENDING },
                    vec![doc! { "$set": {
                        field::STATUS: status::DEAD,
                        field::LANE: schema::lane::READY,
                        field::LAST_ERROR: { "$literal": super::super::lane::clip_error(&error) },
                        field::ERRORS: super::super::lane::push_error(&error, now),
                        field::CLAIMS: { "$add": [{ "$ifNull": [path::CLAIMS, 0_i64] }, 1_i64] },
                        field::UPDATED_AT: now,
                    } }],
                )
                .session(&mut *session)
                .await?;
            let mut lane_ids: Vec<i32> = pending
                .iter()
                .filter(|doc| {
                    doc.get_object_id(field::ID)
                        .is_ok_and(|id| buried.contains(&id))
                })
                .filter_map(|doc| super::super::lane::int(doc, field::LANE_ID))
                .filter_map(|lane| i32::try_from(lane).ok())
                .collect();
            lane_ids.sort_unstable();
            lane_ids.dedup();
            // A claim that read one of these deliveries as pending before this commits, and
            // records it after, must not hand it out dead: its record is conditioned on the
            // requeue count it read, which moves on here. One that records first makes this
            // transaction conflict, and the delivery is then found running.
            self.move_requeue_counts(session, &lane_ids).await?;
        }
        Ok((buried, running.into_iter().collect()))
    }

    /// Increments, in `session`'s transaction, the requeue count of the lanes `lane_ids`, on
    /// which every record of a claim is conditioned.
    async fn move_requeue_counts(
        &self,
        session: &mut ClientSession,
        lane_ids: &[i32],
    ) -> Result<()> {
        if !lane_ids.is_empty() {
            self.inner
                .lanes
                .update_many(
                    doc! { field::ID: { "$in": lane_ids } },
                    doc! { "$inc": { field::REQUEUES: 1_i64 } },
                )
                .session(&mut *session)
                .await?;
        }
        Ok(())
    }

    /// Hands back every lane `owner` holds on this store instance, for a worker that stops.
    /// Returns how many lanes it handed back. The instance's other owners stop counting `owner`
    /// among the claimers they share free lanes with.
    ///
    /// Release or complete the deliveries still running first: whatever the lanes still list
    /// counts as a lost attempt for whoever takes them next. Their leases are honoured until
    /// then.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`](crate::Error::InvalidArgument) for a malformed owner (nothing
    /// is sent); [`Error::Database`](crate::Error::Database).
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: the lanes are handed back or not, and calling again finishes the job.
    pub async fn relinquish(&self, owner: &str) -> Result<u64> {
        check_owner(owner)?;
        let lock = self.inner.claims.owner(owner);
        let _claims = lock.lock().await;
        let result = self
            .inner
            .lanes
            .update_many(
                doc! { field::OWNER: owner, field::INSTANCE: self.inner.claims.instance },
                doc! { "$set": {
                    field::OWNER: Bson::Null,
                    field::INSTANCE: Bson::Null,
                    field::LEASE_EXPIRES_AT: Bson::Null,
                } },
            )
            .await?;
        // A stopped worker no longer ranks free lanes: the others share its slot's lanes.
        self.inner.members.forget(owner);
        Ok(result.modified_count)
    }
}
