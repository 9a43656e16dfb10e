//! The MongoDB store behind the [`Store`] boundary: each method calls the store's own API,
//! converting timestamps and ids at the edge.

use std::{collections::BTreeMap, time::Duration};

use futures::{StreamExt, TryStreamExt, stream::BoxStream};
use mongodb::{ClientSession, bson::doc};

use super::{Lease, MongoEventStore, bson_date, schema::field, timestamp};
use crate::{
    error::Result,
    store::{
        Append, AppendRequest, Appended, Buried, ClaimRequest, Claimed, ConsumerPositions,
        DeadLetterGroup, DeliveryQuery, DeliveryRecord, Discarded, EventDetail, HandlerStatistics,
        Inspect, LaneReport, Operate, PurgeOptions, Purged, Queue, Requeued, Statistics, Store,
        StoreLease, Transactions, WakeUp, position::PositionKey,
    },
    time::Timestamp,
};

impl StoreLease for Lease {
    type DeliveryId = mongodb::bson::oid::ObjectId;

    fn delivery_id(&self) -> Self::DeliveryId {
        Lease::delivery_id(self)
    }
}

impl Store for MongoEventStore {
    const NAME: &'static str = "MongoDB";

    async fn setup(&self) -> Result<()> {
        MongoEventStore::setup(self).await
    }
}

impl Transactions for MongoEventStore {
    type Session = ClientSession;

    async fn session(&self) -> Result<ClientSession> {
        self.new_session().await
    }

    async fn begin(&self, session: &mut ClientSession, budget: Option<Duration>) -> Result<()> {
        self.start_transaction(session, budget, None).await
    }

    async fn commit(&self, session: &mut ClientSession) -> Result<()> {
        self.commit_once(session).await
    }

    async fn abort(&self, session: &mut ClientSession) {
        self.abort_once(session).await;
    }

    async fn ensure_in_transaction(
        &self,
        session: &mut ClientSession,
        operation: &'static str,
    ) -> Result<()> {
        MongoEventStore::ensure_in_transaction(self, session, operation).await
    }

    fn is_transient(error: &(dyn std::error::Error + 'static)) -> bool {
        error
            .downcast_ref::<mongodb::error::Error>()
            .is_some_and(|e| e.contains_label(mongodb::error::TRANSIENT_TRANSACTION_ERROR))
    }
}

impl Append for MongoEventStore {
    async fn append(
        &self,
        session: &mut ClientSession,
        requests: &[AppendRequest<'_>],
        now: Timestamp,
    ) -> Result<Vec<Appended>> {
        MongoEventStore::append(self, session, requests, bson_date(now)).await
    }

    async fn append_in_transaction(
        &self,
        session: &mut ClientSession,
        requests: &[AppendRequest<'_>],
        now: Timestamp,
    ) -> Result<Vec<Appended>> {
        MongoEventStore::append_in_transaction(self, session, requests, bson_date(now)).await
    }
}

impl ConsumerPositions for MongoEventStore {
    async fn consumer_position(
        &self,
        session: &mut ClientSession,
        key: &PositionKey<'_>,
    ) -> Result<Option<i64>> {
        key.check()?;
        self.ensure_in_transaction(session, "MongoEventStore.consumer_position")
            .await?;
        let found = self
            .inner
            .consumer_positions
            .find_one(doc! { "_id": position_id(key) })
            .session(&mut *session)
            .await?;
        Ok(found.and_then(|document| document.get_i64("next_offset").ok()))
    }

    async fn advance_consumer_position(
        &self,
        session: &mut ClientSession,
        key: &PositionKey<'_>,
        next: i64,
        now: Timestamp,
    ) -> Result<()> {
        key.check_advance(next)?;
        self.ensure_in_transaction(session, "MongoEventStore.advance_consumer_position")
            .await?;
        self.inner
            .consumer_positions
            .update_one(
                doc! { "_id": position_id(key) },
                doc! {
                    "$max": { "next_offset": next },
                    "$set": { "updated_at": bson_date(now) },
                },
            )
            .upsert(true)
            .session(&mut *session)
            .await?;
        Ok(())
    }
}

impl Queue for MongoEventStore {
    type Lease = Lease;

    async fn claim(&self, request: ClaimRequest<'_>) -> Result<Vec<Claimed<Lease>>> {
        let claimed = MongoEventStore::claim(
            self,
            request.owner,
            request.handlers,
            request.limit,
            request.lease_duration,
            bson_date(request.now),
        )
        .await?;
        Ok(claimed.into_iter().map(claimed_of).collect())
    }

    async fn complete(&self, leases: &[Lease], now: Timestamp) -> Result<Vec<bool>> {
        self.complete_many(leases, bson_date(now)).await
    }

    async fn complete_in_transaction(
        &self,
        session: &mut ClientSession,
        lease: &Lease,
        now: Timestamp,
    ) -> Result<bool> {
        MongoEventStore::complete_in_transaction(self, session, lease, bson_date(now)).await
    }

    async fn complete_many_in_transaction(
        &self,
        session: &mut ClientSession,
        leases: &[Lease],
        now: Timestamp,
    ) -> Result<Vec<bool>> {
        MongoEventStore::complete_many_in_transaction(self, session, leases, bson_date(now)).await
    }

    async fn release(&self, lease: &Lease, now: Timestamp) -> Result<bool> {
        MongoEventStore::release(self, lease, bson_date(now)).await
    }

    async fn reschedule(
        &self,
        lease: &Lease,
        due_at: Timestamp,
        error: &str,
        now: Timestamp,
    ) -> Result<bool> {
        MongoEventStore::reschedule(self, lease, bson_date(due_at), error, bson_date(now)).await
    }

    async fn bury(&self, lease: &Lease, error: &str, now: Timestamp) -> Result<bool> {
        MongoEventStore::bury(self, lease, error, bson_date(now)).await
    }

    /// A lease covers its whole lane, so one renewal per lane is enough. A renewal goes
    /// through one delivery the lane lists; when that one has just been completed or settled,
    /// the next delivery of the lane is tried, so that a lane whose other deliveries still run
    /// is never skipped for a round.
    async fn renew(
        &self,
        leases: &[Lease],
        lease_duration: Duration,
        now: Timestamp,
    ) -> Result<usize> {
        let mut per_lane: BTreeMap<u32, Vec<&Lease>> = BTreeMap::new();
        for lease in leases {
            per_lane.entry(lease.lane()).or_default().push(lease);
        }
        let now = bson_date(now);
        let renewals = per_lane.values().map(|lane| async move {
            for lease in lane {
                if self
                    .extend_lease(lease, lease_duration, now)
                    .await?
                    .is_some()
                {
                    return Ok(lane.len());
                }
            }
            Ok(0)
        });
        let mut covered = 0;
        let mut failure = None;
        for result in futures::future::join_all(renewals).await {
            match result {
                Ok(count) => covered += count,
                Err(error) => failure = Some(error),
            }
        }
        match failure {
            Some(error) if covered == 0 => Err(error),
            _ => Ok(covered),
        }
    }

    async fn relinquish(&self, owner: &str) -> Result<u64> {
        MongoEventStore::relinquish(self, owner).await
    }

    /// A change stream on inserted deliveries of the handlers, projected down to their lanes
    /// and whether they were written parked.
    async fn watch(&self, handlers: &[String]) -> Result<BoxStream<'static, Result<WakeUp>>> {
        // The resume token (`_id`) stays, and `operationType` (the driver requires it).
        let pipeline = vec![
            doc! { "$match": {
                "operationType": "insert",
                "fullDocument.handler": { "$in": handlers },
            } },
            doc! { "$project": {
                "operationType": 1,
                "fullDocument.laneId": 1,
                "fullDocument.lane": 1,
            } },
        ];
        let stream = self.inner.deliveries.watch().pipeline(pipeline).await?;
        let store = self.clone();
        Ok(stream
            .map_ok(move |change| {
                let document = change.full_document;
                // A delivery written parked, by any store instance: this one's claims look
                // for parked deliveries again (see `ParkedLookup`).
                if document
                    .as_ref()
                    .is_some_and(|doc| doc.get_str(field::LANE) == Ok(super::schema::lane::PARKED))
                {
                    store.inner.claims.note_parking();
                }
                WakeUp {
                    at: document
                        .as_ref()
                        .and_then(|doc| doc.get_i32(field::LANE_ID).ok())
                        .and_then(|lane| u32::try_from(lane).ok()),
                }
            })
            .map_err(crate::Error::from)
            .boxed())
    }
}

impl Inspect for MongoEventStore {
    async fn statistics(&self) -> Result<Statistics> {
        MongoEventStore::statistics(self).await
    }

    async fn handler_statistics(&self) -> Result<Vec<HandlerStatistics>> {
        MongoEventStore::handler_statistics(self).await
    }

    async fn gauge_statistics(&self, max_age: Duration) -> Result<Vec<HandlerStatistics>> {
        self.inner
            .gauge_sample
            .get_or_count(max_age, MongoEventStore::handler_statistics(self))
            .await
    }

    async fn list_deliveries(&self, query: &DeliveryQuery) -> Result<Vec<DeliveryRecord>> {
        MongoEventStore::list_deliveries(self, query).await
    }

    async fn event_detail(&self, event_id: &str) -> Result<Option<EventDetail>> {
        MongoEventStore::event_detail(self, event_id).await
    }

    async fn lanes(&self) -> Result<LaneReport> {
        MongoEventStore::lanes(self).await
    }

    async fn dead_letter_groups(&self, handler: Option<&str>) -> Result<Vec<DeadLetterGroup>> {
        MongoEventStore::dead_letter_groups(self, handler).await
    }
}

impl Operate for MongoEventStore {
    async fn purge(&self, options: &PurgeOptions) -> Result<Purged> {
        MongoEventStore::purge(self, options).await
    }

    async fn bury_by_id(&self, ids: &[String], reason: &str, now: Timestamp) -> Result<Buried> {
        MongoEventStore::bury_by_id(self, ids, reason, bson_date(now)).await
    }

    async fn discard(&self, ids: &[String], now: Timestamp) -> Result<Discarded> {
        MongoEventStore::discard(self, ids, bson_date(now)).await
    }

    async fn requeue(&self, ids: &[String], now: Timestamp) -> Result<Requeued> {
        MongoEventStore::requeue(self, ids, bson_date(now)).await
    }
}

/// The `_id` of a consumer position: `{consumer, source, partition}`.
fn position_id(key: &PositionKey<'_>) -> mongodb::bson::Document {
    doc! {
        "consumer": key.consumer,
        "source": key.source,
        "partition": i64::from(key.partition),
    }
}

/// A claimed delivery at the boundary.
fn claimed_of(delivery: super::ClaimedDelivery) -> Claimed<Lease> {
    Claimed {
        lease: *delivery.lease(),
        lease_expires_at: timestamp(delivery.lease_expires_at()),
        handler: delivery.handler().to_owned(),
        attempt: delivery.attempt(),
        sequence: delivery.sequence(),
        ordered: delivery.ordered,
        event: delivery.into_event(),
    }
}
