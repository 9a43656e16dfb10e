//! The PostgreSQL store behind the [`Store`] boundary.

use std::time::Duration;

use futures::{StreamExt, stream::BoxStream};
use sqlx::postgres::PgListener;

use super::{
    PostgresEventStore, PostgresLease, PostgresSession, append::NOTIFY_ALL, db_error,
    settle::Ending,
};
use crate::{
    error::Result,
    store::{
        Append, AppendRequest, Appended, Buried, ClaimRequest, Claimed, ConsumerPositions,
        DeadLetterGroup, DeliveryQuery, DeliveryRecord, Discarded, EventDetail, HandlerStatistics,
        Inspect, LaneReport, Operate, PurgeOptions, Purged, Queue, Requeued, Statistics, Store,
        Transactions, WakeUp, position::PositionKey,
    },
    time::Timestamp,
};

impl Store for PostgresEventStore {
    const NAME: &'static str = "PostgreSQL";

    async fn setup(&self) -> Result<()> {
        PostgresEventStore::setup(self).await
    }
}

impl Transactions for PostgresEventStore {
    type Session = PostgresSession;

    async fn session(&self) -> Result<PostgresSession> {
        self.new_session().await
    }

    async fn begin(&self, session: &mut PostgresSession, budget: Option<Duration>) -> Result<()> {
        session.begin(budget).await
    }

    async fn commit(&self, session: &mut PostgresSession) -> Result<()> {
        session.commit().await
    }

    async fn abort(&self, session: &mut PostgresSession) {
        session.abort().await;
    }

    async fn ensure_in_transaction(
        &self,
        session: &mut PostgresSession,
        operation: &'static str,
    ) -> Result<()> {
        session.ensure_in_transaction(operation)
    }

    fn is_transient(error: &(dyn std::error::Error + 'static)) -> bool {
        error
            .downcast_ref::<sqlx::Error>()
            .is_some_and(super::is_transient)
    }
}

impl Append for PostgresEventStore {
    async fn append(
        &self,
        session: &mut PostgresSession,
        requests: &[AppendRequest<'_>],
        now: Timestamp,
    ) -> Result<Vec<Appended>> {
        Self::check_requests(requests)?;
        session.ensure_in_transaction("PostgresEventStore.append")?;
        self.append_on(session, requests, now).await
    }

    async fn append_in_transaction(
        &self,
        session: &mut PostgresSession,
        requests: &[AppendRequest<'_>],
        now: Timestamp,
    ) -> Result<Vec<Appended>> {
        self.append_on(session, requests, now).await
    }
}

impl ConsumerPositions for PostgresEventStore {
    async fn consumer_position(
        &self,
        session: &mut PostgresSession,
        key: &PositionKey<'_>,
    ) -> Result<Option<i64>> {
        key.check()?;
        session.ensure_in_transaction("PostgresEventStore.consumer_position")?;
        let row: Option<(i64,)> = sqlx::query_as(&self.sql(
            "SELECT next_offset FROM {s}.consumer_positions \
             WHERE consumer = $1 AND source = $2 AND partition = $3",
        ))
        .bind(key.consumer)
        .bind(key.source)
        .bind(i64::from(key.partition))
        .fetch_optional(session.connection())
        .await
        .map_err(db_error)?;
        Ok(row.map(|(next,)| next))
    }

    async fn advance_consumer_position(
        &self,
        session: &mut PostgresSession,
        key: &PositionKey<'_>,
        next: i64,
        now: Timestamp,
    ) -> Result<()> {
        key.check_advance(next)?;
        session.ensure_in_transaction("PostgresEventStore.advance_consumer_position")?;
        sqlx::query(&self.sql(
            "INSERT INTO {s}.consumer_positions \
                 (consumer, source, partition, next_offset, updated_at) \
             VALUES ($1, $2, $3, $4, $5) \
             ON CONFLICT (consumer, source, partition) DO UPDATE SET \
                 next_offset = greatest({s}.consumer_positions.next_offset, excluded.next_offset), \
                 updated_at = excluded.updated_at",
        ))
        .bind(key.consumer)
        .bind(key.source)
        .bind(i64::from(key.partition))
        .bind(next)
        .bind(now.timestamp_millis())
        .execute(session.connection())
        .await
        .map_err(db_error)?;
        Ok(())
    }
}

impl Queue for PostgresEventStore {
    type Lease = PostgresLease;

    async fn claim(&self, request: ClaimRequest<'_>) -> Result<Vec<Claimed<PostgresLease>>> {
        self.claim_deliveries(request).await
    }

    async fn complete(&self, leases: &[PostgresLease], now: Timestamp) -> Result<Vec<bool>> {
        self.complete_leases(leases, now).await
    }

    async fn complete_in_transaction(
        &self,
        session: &mut PostgresSession,
        lease: &PostgresLease,
        now: Timestamp,
    ) -> Result<bool> {
        session.ensure_in_transaction("PostgresEventStore.complete_in_transaction")?;
        let done = self
            .complete_on(session, std::slice::from_ref(lease), now)
            .await?;
        Ok(done.first().copied().unwrap_or(false))
    }

    async fn release(&self, lease: &PostgresLease, now: Timestamp) -> Result<bool> {
        self.end_claim(lease, Ending::Release, now).await
    }

    async fn reschedule(
        &self,
        lease: &PostgresLease,
        due_at: Timestamp,
        error: &str,
        now: Timestamp,
    ) -> Result<bool> {
        self.end_claim(lease, Ending::Reschedule { due_at, error }, now)
            .await
    }

    async fn bury(&self, lease: &PostgresLease, error: &str, now: Timestamp) -> Result<bool> {
        self.end_claim(lease, Ending::Bury { error }, now).await
    }

    async fn renew(
        &self,
        leases: &[PostgresLease],
        lease_duration: Duration,
        now: Timestamp,
    ) -> Result<usize> {
        self.renew_leases(leases, lease_duration, now).await
    }

    async fn relinquish(&self, owner: &str) -> Result<u64> {
        self.relinquish_owner(owner).await
    }

    /// `LISTEN` on the store's channel, on a connection of its own; a notification names the
    /// handlers an append added deliveries for, and wakes the watcher of any of them.
    async fn watch(&self, handlers: &[String]) -> Result<BoxStream<'static, Result<WakeUp>>> {
        let mut listener = PgListener::connect_with(&self.inner.pool)
            .await
            .map_err(db_error)?;
        listener.listen(&self.channel()).await.map_err(db_error)?;
        let handlers: Vec<String> = handlers.to_vec();
        Ok(listener
            .into_stream()
            .filter_map(move |notification| {
                let wake = match notification {
                    Ok(notification) => {
                        let payload = notification.payload();
                        (payload == NOTIFY_ALL
                            || payload.split(',').any(|h| handlers.iter().any(|w| w == h)))
                        .then_some(Ok(WakeUp::default()))
                    }
                    Err(error) => Some(Err(db_error(error))),
                };
                std::future::ready(wake)
            })
            .boxed())
    }
}

impl Inspect for PostgresEventStore {
    async fn statistics(&self) -> Result<Statistics> {
        self.count_statistics().await
    }

    async fn handler_statistics(&self) -> Result<Vec<HandlerStatistics>> {
        self.count_handler_statistics().await
    }

    async fn gauge_statistics(&self, max_age: Duration) -> Result<Vec<HandlerStatistics>> {
        self.inner
            .gauge_sample
            .get_or_count(max_age, self.count_handler_statistics())
            .await
    }

    async fn list_deliveries(&self, query: &DeliveryQuery) -> Result<Vec<DeliveryRecord>> {
        self.list(query).await
    }

    async fn event_detail(&self, event_id: &str) -> Result<Option<EventDetail>> {
        self.detail(event_id).await
    }

    async fn lanes(&self) -> Result<LaneReport> {
        self.lane_report().await
    }

    async fn dead_letter_groups(&self, handler: Option<&str>) -> Result<Vec<DeadLetterGroup>> {
        self.dead_groups(handler).await
    }
}

impl Operate for PostgresEventStore {
    async fn purge(&self, options: &PurgeOptions) -> Result<Purged> {
        self.purge_by(options).await
    }

    async fn discard(&self, ids: &[String], now: Timestamp) -> Result<Discarded> {
        self.discard_ids(ids, now).await
    }

    async fn bury_by_id(&self, ids: &[String], reason: &str, now: Timestamp) -> Result<Buried> {
        self.bury_ids(ids, reason, now).await
    }

    async fn requeue(&self, ids: &[String], now: Timestamp) -> Result<Requeued> {
        self.requeue_ids(ids, now).await
    }
}
