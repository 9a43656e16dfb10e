//! The next delivery of a key, claimed right after its predecessor completed.
//!
//! A worker that completed a keyed delivery holds the lane the key's next delivery waits in,
//! and knows nothing of the key runs any more. Instead of waiting for its next claim (a read of
//! every lane, the scans, the record), it asks for that one delivery: one read of the lane and
//! the key's lowest pending delivery (lane first, so that a requeue in between changes the
//! lane's requeue count under the write), then one conditional write that lists the delivery on
//! the lane, under the same epoch and requeue count, with the completed one taken off. A parked
//! delivery runs from the parked lane without being written: it is deleted when it completes,
//! and if it stops without completing (a retry, a release), the level-triggered unparking of a
//! later claim sends it back to the ready lane once nothing of its key runs.
//!
//! The worker may ask while the completion's transaction commits (`committing`), so that the
//! claim's two round trips overlap the commit's instead of following them. The completed
//! delivery may then still be pending: the read skips it when it is the key's lowest, and the
//! write leaves it listed (its transaction's fence read it so, and a transaction run again must
//! find it so); its claim stays unsettled, so that the owner's claims count its key as running
//! while it may still run. The worker starts the next delivery only once the commit succeeded
//! (and tells the store so, `completion_committed`, which settles the claim) and gives it
//! back uncharged otherwise; its next claim of the key's next delivery takes the completed one
//! off the lane (`finished`).
//!
//! It never runs beside a claim of the owner on this store instance: it waits for a running
//! claim to end, and runs beside the other claims of next deliveries. It gives up, claiming
//! nothing, whenever anything is not as the plain case has it: the lane changed hands or has
//! lost claims to charge, the next delivery is not due, lies in another lane, is unordered or
//! already runs. The worker's regular claims find it then.

use std::{collections::HashMap, sync::atomic::Ordering};

use futures::TryStreamExt;
use mongodb::bson::{Bson, DateTime, Document, RawDocumentBuf, doc, oid::ObjectId};

use super::{
    ClaimedDelivery,
    scan::{Candidate, event_lookup},
};
use crate::{
    error::Result,
    store::{
        NextOfKey,
        mongo::{
            MongoEventStore, bson_date,
            lane::{Lane, add, check_lease_duration, check_owner, listed, relisted},
            lease::Lease,
            schema::{field, index, path, status},
        },
    },
};

impl MongoEventStore {
    /// Claims the next delivery of the request's handler and key for its owner, right after
    /// the delivery of `request.completed` completed (or while it commits), when it can be
    /// handed out at once: see the module documentation. `None` when it cannot.
    pub(crate) async fn claim_next_of_key(
        &self,
        request: NextOfKey<'_, Lease>,
    ) -> Result<Option<ClaimedDelivery>> {
        let NextOfKey {
            owner,
            completed,
            lease_duration,
            ..
        } = request;
        let now = bson_date(request.now);
        check_owner(owner)?;
        check_lease_duration(lease_duration)?;
        let expires_at = add(now, lease_duration)?;
        let gate = self.inner.claims.gate(owner);
        // A claim running now may take the delivery itself, and the two must not both: wait
        // for it to end (it then finds the delivery listed or takes it first).
        let _open = gate.gate.read().await;
        // Nor beside a claim of reported deliveries beside the owner's claims.
        let _apart = gate.beside.read().await;
        // The owner's claims leave the key to this one while the completed delivery is
        // outstanding (see `Running::handing_over`): from here on, they need not. One still
        // committing stays theirs to see running until it is gone.
        if let Some(finished) = request.finished {
            self.inner.claims.settled(finished);
        }
        if !request.committing {
            self.inner.claims.settled(completed);
        }
        if gate.interrupted.load(Ordering::SeqCst) {
            // An earlier one failed half-way: the owner's next claim reconciles first.
            return Ok(None);
        }
        let next = self.next_of_key(&request, expires_at, now).await;
        if next.is_err() {
            // It may have listed the delivery without handing it out.
            gate.interrupted.store(true, Ordering::SeqCst);
        }
        next
    }

    async fn next_of_key(
        &self,
        request: &NextOfKey<'_, Lease>,
        expires_at: DateTime,
        now: DateTime,
    ) -> Result<Option<ClaimedDelivery>> {
        let NextOfKey {
            owner,
            completed,
            handler,
            key,
            ..
        } = *request;
        let inner = &self.inner;
        let instance = inner.claims.instance;
        let done = completed.delivery_id();
        let lane_id = completed.lane_i32();
        let docs: Vec<Document> = inner
            .lanes
            .aggregate([
                doc! { "$match": { field::ID: lane_id } },
                doc! { "$unionWith": {
                    "coll": inner.deliveries.name(),
                    "pipeline": [
                        { "$match": {
                            field::STATUS: status::PENDING,
                            field::HANDLER: handler,
                            field::KEY: key,
                        } },
                        { "$sort": index::ordering_keys() },
                        // The completed delivery, when its commit has not yet deleted it, then
                        // the next: only the next one's event is looked up.
                        { "$limit": 2 },
                        { "$match": { field::ID: { "$ne": done } } },
                        { "$limit": 1 },
                        event_lookup(inner.events.name()),
                    ],
                } },
            ])
            .await?
            .try_collect()
            .await?;
        let mut lane_doc = None;
        let mut next_doc = None;
        for doc in docs {
            if matches!(doc.get(field::ID), Some(Bson::ObjectId(_))) {
                next_doc = Some(doc);
            } else {
                lane_doc = Some(doc);
            }
        }
        let (Some(lane_doc), Some(next_doc)) = (lane_doc, next_doc) else {
            return Ok(None);
        };
        let Some(lane) = Lane::from_document(&lane_doc) else {
            return Ok(None);
        };
        let ours = lane_doc.get_str(field::OWNER) == Ok(owner)
            && lane_doc.get_object_id(field::INSTANCE) == Ok(instance)
            && lane.epoch == completed.epoch()
            && lane.lost.is_empty();
        let Some(next) = Candidate::from_document(&next_doc) else {
            return Ok(None);
        };
        let handable = next.key.as_deref() == Some(key)
            && next.lane == lane_id
            && next.due_at <= now
            && next.id != done
            && !lane.in_flight.contains(&next.id)
            && self.inner.claims.issued(&next.id).is_none();
        let event = match next_doc.get_array("event").ok().and_then(|e| e.first()) {
            Some(Bson::Document(event)) => RawDocumentBuf::from_document(event).ok(),
            _ => None,
        };
        let (true, true, Some(event)) = (ours, handable, event) else {
            return Ok(None);
        };
        let mut filter = lane.held_filter(owner, instance);
        filter.insert(field::IN_FLIGHT, doc! { "$ne": next.id });
        // Taken off the lane: what is known to be gone.
        let gone: Vec<ObjectId> = request
            .finished
            .map(Lease::delivery_id)
            .into_iter()
            .chain((!request.committing).then_some(done))
            .collect();
        // A parked delivery is run from the parked lane, not written back to the ready one: it
        // is deleted when it completes, and if it does not, unparking (level-triggered, once
        // nothing of its key runs) sends it back.
        let listed = self
            .update_lanes(&[doc! {
                "q": filter,
                "u": [{ "$set": {
                    field::IN_FLIGHT: relisted(&gone, listed(&[next.id])),
                    field::LEASE_EXPIRES_AT: {
                        "$max": [path::LEASE_EXPIRES_AT, expires_at],
                    },
                } }],
            }])
            .await?;
        if listed != 1 {
            return Ok(None);
        }
        let events = HashMap::from([(next.event_id.clone(), event)]);
        Ok(self
            .hand_out(vec![next], &[lane], &events, expires_at)
            .0
            .pop())
    }
}
