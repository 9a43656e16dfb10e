//! Reconciliation: the owner's lanes put back in order after a failed or interrupted claim.

use std::collections::HashMap;

use mongodb::{
    ClientSession,
    bson::{DateTime, doc, oid::ObjectId},
    options::ReadConcern,
};

use crate::{
    error::Result,
    store::mongo::{
        MongoEventStore,
        lane::{Lane, int},
        lease::Issued,
        schema::field,
        transaction::documents_in,
    },
    store::transaction::Boxed,
};

impl MongoEventStore {
    /// Puts the owner's lanes on this instance back in order after a failed or interrupted
    /// claim, in one transaction. A listed delivery stays listed only if this instance handed
    /// out its current claim (same lane epoch and claim generation) and has not seen it settled;
    /// every other one is taken out of the lane and its claim generation moves on, so no lease
    /// of it can match a later claim. A lane taken over meanwhile conflicts with the
    /// transaction, which then runs again and leaves the new holder's lane alone.
    pub(crate) async fn reconcile(&self, owner: &str, now: DateTime) -> Result<()> {
        let dropped = self
            // The failed claim's record may have been applied without being majority-committed
            // yet (a write concern error): read the latest data, or the record could be missed.
            .own_transaction_with(
                Some(ReadConcern::local()),
                Boxed::new((self, owner, now), |session, (store, owner, now)| {
                    Box::pin(store.reconcile_in(session, owner, *now))
                }),
            )
            .await?;
        self.inner.claims.forget(dropped);
        Ok(())
    }

    async fn reconcile_in(
        &self,
        session: &mut ClientSession,
        owner: &str,
        now: DateTime,
    ) -> Result<Vec<ObjectId>> {
        let inner = &self.inner;
        let instance = inner.claims.instance;
        let lanes: Vec<Lane> = documents_in(
            session,
            &inner.lanes,
            doc! { field::OWNER: owner, field::INSTANCE: instance },
            doc! {},
        )
        .await?
        .iter()
        .filter_map(Lane::from_document)
        .collect();
        let listed: Vec<ObjectId> = lanes
            .iter()
            .flat_map(|lane| lane.in_flight.iter().copied())
            .collect();
        if listed.is_empty() {
            return Ok(Vec::new());
        }
        let generations: HashMap<ObjectId, i64> = documents_in(
            session,
            &inner.deliveries,
            doc! { field::ID: { "$in": &listed } },
            doc! { field::CLAIMS: 1 },
        )
        .await?
        .iter()
        .filter_map(|doc| {
            Some((
                doc.get_object_id(field::ID).ok()?,
                int(doc, field::CLAIMS).unwrap_or(0),
            ))
        })
        .collect();
        let mut dropped = Vec::new();
        for lane in &lanes {
            let (keep, drop): (Vec<ObjectId>, Vec<ObjectId>) =
                lane.in_flight.iter().partition(|id| {
                    let current = generations.get(id).map(|&claims| Issued {
                        lane: lane.id,
                        epoch: lane.epoch,
                        claims,
                    });
                    current.is_some() && inner.claims.issued(id) == current
                });
            if drop.is_empty() {
                continue;
            }
            inner
                .lanes
                .update_one(
                    doc! { field::ID: lane.id, field::EPOCH: lane.epoch },
                    doc! { "$set": { field::IN_FLIGHT: keep } },
                )
                .session(&mut *session)
                .await?;
            dropped.extend(drop);
        }
        let existing: Vec<ObjectId> = dropped
            .iter()
            .filter(|id| generations.contains_key(id))
            .copied()
            .collect();
        if !existing.is_empty() {
            inner
                .deliveries
                .update_many(
                    doc! { field::ID: { "$in": existing } },
                    doc! { "$inc": { field::CLAIMS: 1_i64 }, "$set": { field::UPDATED_AT: now } },
                )
                .session(&mut *session)
                .await?;
        }
        Ok(dropped)
    }
}
