//! The in-memory store behind the [`Store`] boundary. Every method takes the store's mutex for
//! one synchronous step; none holds it across an `.await`.

use std::{collections::HashSet, time::Duration};

use futures::{StreamExt, stream::BoxStream};
use tokio::sync::broadcast::error::RecvError;

use super::{
    MemoryEventStore, MemorySession, MemoryStoreError, append, claim, claim::MemoryLease, inspect,
    operator, settle, settle::Ending,
};
use crate::{
    error::Result,
    store::{
        Append, AppendRequest, Appended, Buried, ClaimRequest, Claimed, ConsumerPositions,
        DeadLetterGroup, DeliveryQuery, DeliveryRecord, Discarded, EventDetail, HandlerStatistics,
        IdempotentRequests, Inspect, LaneReport, Leadership, Operate, PurgeOptions, Purged, Queue,
        RequestKey, RequestKeyState, Requeued, Statistics, Store, StoredResponse, Transactions,
        WakeUp, position::PositionKey,
    },
    time::Timestamp,
};

/// The document collection that holds consumer positions, one document per consumer, source
/// and partition, with the id `[consumer, source, partition]` in JSON.
pub const CONSUMER_POSITIONS: &str = "relaybus.consumer_positions";

/// The document collection that holds the stored answers of idempotent requests, one
/// document per key and scope, with the id [`RequestKey::id`].
pub const IDEMPOTENCY_KEYS: &str = "relaybus.idempotency_keys";

impl MemoryEventStore {
    /// Appends validated events in the session's transaction.
    fn append_checked(
        &self,
        session: &mut MemorySession,
        requests: &[AppendRequest<'_>],
        now: Timestamp,
        operation: &'static str,
    ) -> Result<Vec<Appended>> {
        let items = crate::store::append::merge(requests)?;
        let transaction = self.open(session, operation)?;
        if items.is_empty() {
            return Ok(Vec::new());
        }
        append::append(&mut self.inner.lock(), transaction, &items, now)
    }
}

impl Store for MemoryEventStore {
    const NAME: &'static str = "memory";

    /// Nothing to create.
    async fn setup(&self) -> Result<()> {
        Ok(())
    }
}

impl Transactions for MemoryEventStore {
    type Session = MemorySession;

    async fn session(&self) -> Result<MemorySession> {
        Ok(self.new_session())
    }

    /// Starts a transaction; `budget` is enforced at its commit.
    async fn begin(&self, session: &mut MemorySession, budget: Option<Duration>) -> Result<()> {
        self.begin_on(session, budget)
    }

    async fn commit(&self, session: &mut MemorySession) -> Result<()> {
        self.commit_on(session)
    }

    async fn abort(&self, session: &mut MemorySession) {
        self.abort_on(session);
    }

    async fn ensure_in_transaction(
        &self,
        session: &mut MemorySession,
        operation: &'static str,
    ) -> Result<()> {
        self.open(session, operation).map(|_| ())
    }

    /// A [`MemoryStoreError::WriteConflict`].
    fn is_transient(error: &(dyn std::error::Error + 'static)) -> bool {
        error
            .downcast_ref::<MemoryStoreError>()
            .is_some_and(MemoryStoreError::is_transient)
    }
}

impl Append for MemoryEventStore {
    async fn append(
        &self,
        session: &mut MemorySession,
        requests: &[AppendRequest<'_>],
        now: Timestamp,
    ) -> Result<Vec<Appended>> {
        self.append_checked(session, requests, now, "MemoryEventStore.append")
    }
}

impl ConsumerPositions for MemoryEventStore {
    async fn consumer_position(
        &self,
        session: &mut MemorySession,
        key: &PositionKey<'_>,
    ) -> Result<Option<i64>> {
        key.check()?;
        let document = session.get(CONSUMER_POSITIONS, &key.joined())?;
        Ok(document.and_then(|document| document["next_offset"].as_i64()))
    }

    async fn advance_consumer_position(
        &self,
        session: &mut MemorySession,
        key: &PositionKey<'_>,
        next: i64,
        now: Timestamp,
    ) -> Result<()> {
        key.check_advance(next)?;
        let id = key.joined();
        let stored = session
            .get(CONSUMER_POSITIONS, &id)?
            .and_then(|document| document["next_offset"].as_i64());
        let next = stored.map_or(next, |stored| stored.max(next));
        session.put(
            CONSUMER_POSITIONS,
            &id,
            serde_json::json!({
                "consumer": key.consumer,
                "source": key.source,
                "partition": key.partition,
                "next_offset": next,
                "updated_at": now.timestamp_millis(),
            }),
        )
    }
}

impl IdempotentRequests for MemoryEventStore {
    async fn take_request_key(
        &self,
        session: &mut MemorySession,
        key: &RequestKey<'_>,
        now: Timestamp,
    ) -> Result<RequestKeyState> {
        key.check()?;
        let id = key.id();
        if let Some(document) = session.get(IDEMPOTENCY_KEYS, &id)?
            && let Some(response) = stored_response(&document)
            && response.expires_at > now
        {
            return Ok(RequestKeyState::Answered(response));
        }
        // Taking the document holds it against every other open transaction, which fails to
        // write it with a write conflict: that request is running.
        let taken = serde_json::json!({ "taken_at": now.timestamp_millis() });
        match session.put(IDEMPOTENCY_KEYS, &id, taken) {
            Ok(()) => Ok(RequestKeyState::Taken),
            Err(error) if error.is_transient_transaction_error() => Ok(RequestKeyState::Running),
            Err(error) => Err(error),
        }
    }

    async fn store_response(
        &self,
        session: &mut MemorySession,
        key: &RequestKey<'_>,
        response: &StoredResponse,
    ) -> Result<()> {
        key.check()?;
        let document = serde_json::json!({
            "key": key.key,
            "method": key.method,
            "route": key.route,
            "caller": key.caller,
            "fingerprint": response.fingerprint,
            "status": response.status,
            "headers": response.headers,
            "body": response.body,
            "created_at": response.created_at.timestamp_millis(),
            "expires_at": response.expires_at.timestamp_millis(),
        });
        session.put(IDEMPOTENCY_KEYS, &key.id(), document)
    }
}

/// The answer a stored document holds; `None` for a document without one.
fn stored_response(document: &serde_json::Value) -> Option<StoredResponse> {
    let status = u16::try_from(document.get("status")?.as_u64()?).ok()?;
    let headers = serde_json::from_value(document.get("headers")?.clone()).ok()?;
    let body = serde_json::from_value(document.get("body")?.clone()).ok()?;
    Some(StoredResponse::new(
        document.get("fingerprint")?.as_str()?,
        status,
        headers,
        body,
        Timestamp::from_millis(document.get("created_at")?.as_i64()?),
        Timestamp::from_millis(document.get("expires_at")?.as_i64()?),
    ))
}

impl Queue for MemoryEventStore {
    type Lease = MemoryLease;

    async fn claim(&self, request: ClaimRequest<'_>) -> Result<Vec<Claimed<MemoryLease>>> {
        // `request.reported` names lanes, which this store has not: there is nothing to look
        // at first.
        let checked = claim::check(&request)?;
        Ok(claim::claim(&mut self.inner.lock(), &request, &checked))
    }

    async fn complete(&self, leases: &[MemoryLease], now: Timestamp) -> Result<Vec<bool>> {
        let history = self.inner.completion_history;
        settle::complete(&mut self.inner.lock(), leases, now, history)
    }

    async fn complete_in_transaction(
        &self,
        session: &mut MemorySession,
        lease: &MemoryLease,
        now: Timestamp,
    ) -> Result<bool> {
        let transaction = self.open(session, "MemoryEventStore.complete_in_transaction")?;
        settle::complete_in_transaction(&mut self.inner.lock(), transaction, lease, now)
    }

    async fn release(&self, lease: &MemoryLease, now: Timestamp) -> Result<bool> {
        Ok(settle::end_claim(
            &mut self.inner.lock(),
            lease,
            Ending::Release,
            now,
        ))
    }

    async fn reschedule(
        &self,
        lease: &MemoryLease,
        due_at: Timestamp,
        error: &str,
        now: Timestamp,
    ) -> Result<bool> {
        Ok(settle::end_claim(
            &mut self.inner.lock(),
            lease,
            Ending::Reschedule { due_at, error },
            now,
        ))
    }

    async fn bury(&self, lease: &MemoryLease, error: &str, now: Timestamp) -> Result<bool> {
        Ok(settle::end_claim(
            &mut self.inner.lock(),
            lease,
            Ending::Bury { error },
            now,
        ))
    }

    async fn renew(
        &self,
        leases: &[MemoryLease],
        lease_duration: Duration,
        now: Timestamp,
    ) -> Result<usize> {
        claim::renew(&mut self.inner.lock(), leases, lease_duration, now)
    }

    /// Hands back every lease `owner` holds; returns how many deliveries it handed back.
    async fn relinquish(&self, owner: &str) -> Result<u64> {
        claim::relinquish(&mut self.inner.lock(), owner)
    }

    /// A wake-up (with no lane) each time a commit appends deliveries of `handlers`; one too
    /// when the stream fell so far behind that it may have missed some.
    async fn watch(&self, handlers: &[String]) -> Result<BoxStream<'static, Result<WakeUp>>> {
        let receiver = self.inner.wake.subscribe();
        let wanted: HashSet<String> = handlers.iter().cloned().collect();
        let stream =
            futures::stream::unfold((receiver, wanted), |(mut receiver, wanted)| async move {
                loop {
                    match receiver.recv().await {
                        Ok(appended) if appended.iter().any(|h| wanted.contains(h)) => break,
                        Ok(_) => {}
                        Err(RecvError::Lagged(_)) => break,
                        Err(RecvError::Closed) => return None,
                    }
                }
                Some((Ok(WakeUp::default()), (receiver, wanted)))
            });
        Ok(stream.boxed())
    }
}

impl Inspect for MemoryEventStore {
    async fn statistics(&self) -> Result<Statistics> {
        let history = self.inner.completion_history;
        Ok(operator::statistics(&self.inner.lock(), history))
    }

    async fn handler_statistics(&self) -> Result<Vec<HandlerStatistics>> {
        Ok(operator::handler_statistics(&self.inner.lock()))
    }

    async fn list_deliveries(&self, query: &DeliveryQuery) -> Result<Vec<DeliveryRecord>> {
        operator::list_deliveries(&self.inner.lock(), query)
    }

    async fn event_detail(&self, event_id: &str) -> Result<Option<EventDetail>> {
        Ok(inspect::event_detail(&self.inner.lock(), event_id))
    }

    /// One entry per owner holding leases, not lanes: see the
    /// [module documentation](super#what-differs-from-mongodb).
    async fn lanes(&self) -> Result<LaneReport> {
        Ok(inspect::lanes(&self.inner.lock()))
    }

    async fn dead_letter_groups(&self, handler: Option<&str>) -> Result<Vec<DeadLetterGroup>> {
        Ok(inspect::dead_letter_groups(&self.inner.lock(), handler))
    }
}

impl Operate for MemoryEventStore {
    async fn purge(&self, options: &PurgeOptions) -> Result<Purged> {
        Ok(operator::purge(&mut self.inner.lock(), options))
    }

    async fn discard(&self, ids: &[String], now: Timestamp) -> Result<Discarded> {
        operator::discard(&mut self.inner.lock(), ids, now)
    }

    async fn bury_by_id(&self, ids: &[String], reason: &str, now: Timestamp) -> Result<Buried> {
        operator::bury_by_id(&mut self.inner.lock(), ids, reason, now)
    }

    async fn requeue(&self, ids: &[String], now: Timestamp) -> Result<Requeued> {
        operator::requeue(&mut self.inner.lock(), ids, now)
    }
}

impl Leadership for MemoryEventStore {
    /// Always leads: the store lives in one process.
    async fn lead(&self, _role: &str, _period: Duration) -> Result<bool> {
        Ok(true)
    }
}
