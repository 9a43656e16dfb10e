//! A store for the transports' tests: the in-memory store with hooks on its appends, to make
//! them fail or to cancel a consumer in the middle of one.

use std::{
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicUsize, Ordering},
    },
    time::Duration,
};

use futures::stream::BoxStream;
use relaybus::{
    AppendRequest, Appended, Buried, DeadLetterGroup, DeliveryQuery, DeliveryRecord, Discarded,
    Error, EventDetail, HandlerStatistics, LaneReport, MemoryEventStore, MemorySession,
    PurgeOptions, Purged, Requeued, Statistics, Store, Timestamp,
    store::{
        Append, ClaimRequest, Claimed, ConsumerPositions, IdempotentRequests, Inspect, Leadership,
        Operate, PositionKey, Queue, RequestKey, RequestKeyState, StoredResponse, Transactions,
        WakeUp, memory::MemoryLease,
    },
};
use tokio_util::sync::CancellationToken;

/// Hooks into the consuming service's store: make appends fail, or cancel a token during an
/// append.
#[derive(Debug, Default)]
pub struct Hooks {
    /// Appends fail while set.
    pub down: AtomicBool,
    /// The appends so far.
    appends: AtomicUsize,
    /// Cancel this token during the append of this number (from 1).
    cancel: Mutex<Option<(usize, CancellationToken)>>,
}

impl Hooks {
    /// Cancels `token` during the append of this `number` (from 1).
    pub fn cancel_on_append(&self, number: usize, token: CancellationToken) {
        *self.cancel.lock().unwrap() = Some((number, token));
    }

    fn on_append(&self) -> Result<(), Error> {
        let number = self.appends.fetch_add(1, Ordering::SeqCst) + 1;
        if let Some((at, token)) = &*self.cancel.lock().unwrap()
            && *at == number
        {
            token.cancel();
        }
        if self.down.load(Ordering::SeqCst) {
            return Err(Error::custom("the store is down (test)"));
        }
        Ok(())
    }
}

/// The in-memory store with [`Hooks`] on its appends.
#[derive(Debug, Clone)]
pub struct HookedStore {
    /// The store the hooks wrap, to read it directly.
    pub inner: MemoryEventStore,
    /// The hooks, shared by the store's clones.
    pub hooks: Arc<Hooks>,
}

impl HookedStore {
    /// A new, empty store with no hook set.
    pub fn new() -> Self {
        HookedStore {
            inner: MemoryEventStore::new(),
            hooks: Arc::default(),
        }
    }
}

impl Default for HookedStore {
    fn default() -> Self {
        HookedStore::new()
    }
}

impl Store for HookedStore {
    const NAME: &'static str = "hooked memory";

    async fn setup(&self) -> Result<(), Error> {
        self.inner.setup().await
    }
}

impl Transactions for HookedStore {
    type Session = MemorySession;

    async fn session(&self) -> Result<MemorySession, Error> {
        self.inner.session().await
    }

    async fn begin(
        &self,
        session: &mut MemorySession,
        budget: Option<Duration>,
    ) -> Result<(), Error> {
        self.inner.begin(session, budget).await
    }

    async fn commit(&self, session: &mut MemorySession) -> Result<(), Error> {
        self.inner.commit(session).await
    }

    async fn abort(&self, session: &mut MemorySession) {
        self.inner.abort(session).await
    }

    async fn ensure_in_transaction(
        &self,
        session: &mut MemorySession,
        operation: &'static str,
    ) -> Result<(), Error> {
        self.inner.ensure_in_transaction(session, operation).await
    }

    fn is_transient(error: &(dyn std::error::Error + 'static)) -> bool {
        MemoryEventStore::is_transient(error)
    }
}

impl Append for HookedStore {
    async fn append(
        &self,
        session: &mut MemorySession,
        requests: &[AppendRequest<'_>],
        now: Timestamp,
    ) -> Result<Vec<Appended>, Error> {
        self.hooks.on_append()?;
        self.inner.append(session, requests, now).await
    }

    async fn append_in_transaction(
        &self,
        session: &mut MemorySession,
        requests: &[AppendRequest<'_>],
        now: Timestamp,
    ) -> Result<Vec<Appended>, Error> {
        self.hooks.on_append()?;
        self.inner
            .append_in_transaction(session, requests, now)
            .await
    }
}

impl ConsumerPositions for HookedStore {
    async fn consumer_position(
        &self,
        session: &mut MemorySession,
        key: &PositionKey<'_>,
    ) -> Result<Option<i64>, Error> {
        self.inner.consumer_position(session, key).await
    }

    async fn advance_consumer_position(
        &self,
        session: &mut MemorySession,
        key: &PositionKey<'_>,
        next: i64,
        now: Timestamp,
    ) -> Result<(), Error> {
        self.inner
            .advance_consumer_position(session, key, next, now)
            .await
    }
}

impl IdempotentRequests for HookedStore {
    async fn take_request_key(
        &self,
        session: &mut MemorySession,
        key: &RequestKey<'_>,
        now: Timestamp,
    ) -> Result<RequestKeyState, Error> {
        self.inner.take_request_key(session, key, now).await
    }

    async fn store_response(
        &self,
        session: &mut MemorySession,
        key: &RequestKey<'_>,
        response: &StoredResponse,
    ) -> Result<(), Error> {
        self.inner.store_response(session, key, response).await
    }
}

impl Queue for HookedStore {
    type Lease = MemoryLease;

    async fn claim(&self, request: ClaimRequest<'_>) -> Result<Vec<Claimed<MemoryLease>>, Error> {
        self.inner.claim(request).await
    }

    async fn complete(&self, leases: &[MemoryLease], now: Timestamp) -> Result<Vec<bool>, Error> {
        self.inner.complete(leases, now).await
    }

    async fn complete_in_transaction(
        &self,
        session: &mut MemorySession,
        lease: &MemoryLease,
        now: Timestamp,
    ) -> Result<bool, Error> {
        self.inner
            .complete_in_transaction(session, lease, now)
            .await
    }

    async fn release(&self, lease: &MemoryLease, now: Timestamp) -> Result<bool, Error> {
        self.inner.release(lease, now).await
    }

    async fn reschedule(
        &self,
        lease: &MemoryLease,
        due_at: Timestamp,
        error: &str,
        now: Timestamp,
    ) -> Result<bool, Error> {
        self.inner.reschedule(lease, due_at, error, now).await
    }

    async fn bury(&self, lease: &MemoryLease, error: &str, now: Timestamp) -> Result<bool, Error> {
        self.inner.bury(lease, error, now).await
    }

    async fn renew(
        &self,
        leases: &[MemoryLease],
        lease_duration: Duration,
        now: Timestamp,
    ) -> Result<usize, Error> {
        self.inner.renew(leases, lease_duration, now).await
    }

    async fn relinquish(&self, owner: &str) -> Result<u64, Error> {
        self.inner.relinquish(owner).await
    }

    async fn watch(
        &self,
        handlers: &[String],
    ) -> Result<BoxStream<'static, Result<WakeUp, Error>>, Error> {
        self.inner.watch(handlers).await
    }
}

impl Inspect for HookedStore {
    async fn statistics(&self) -> Result<Statistics, Error> {
        self.inner.statistics().await
    }

    async fn handler_statistics(&self) -> Result<Vec<HandlerStatistics>, Error> {
        self.inner.handler_statistics().await
    }

    async fn list_deliveries(&self, query: &DeliveryQuery) -> Result<Vec<DeliveryRecord>, Error> {
        self.inner.list_deliveries(query).await
    }

    async fn event_detail(&self, event_id: &str) -> Result<Option<EventDetail>, Error> {
        self.inner.event_detail(event_id).await
    }

    async fn lanes(&self) -> Result<LaneReport, Error> {
        self.inner.lanes().await
    }

    async fn dead_letter_groups(
        &self,
        handler: Option<&str>,
    ) -> Result<Vec<DeadLetterGroup>, Error> {
        self.inner.dead_letter_groups(handler).await
    }
}

impl Operate for HookedStore {
    async fn purge(&self, options: &PurgeOptions) -> Result<Purged, Error> {
        self.inner.purge(options).await
    }

    async fn discard(&self, ids: &[String], now: Timestamp) -> Result<Discarded, Error> {
        self.inner.discard(ids, now).await
    }

    async fn bury_by_id(
        &self,
        ids: &[String],
        reason: &str,
        now: Timestamp,
    ) -> Result<Buried, Error> {
        self.inner.bury_by_id(ids, reason, now).await
    }

    async fn requeue(&self, ids: &[String], now: Timestamp) -> Result<Requeued, Error> {
        self.inner.requeue(ids, now).await
    }
}

impl Leadership for HookedStore {}

impl relaybus::store::Limits for HookedStore {
    async fn take_slot(
        &self,
        request: relaybus::store::SlotRequest<'_>,
    ) -> Result<Option<relaybus::store::Slot>, Error> {
        self.inner.take_slot(request).await
    }

    async fn renew_slots(
        &self,
        slots: &[relaybus::store::Slot],
        until: Timestamp,
    ) -> Result<usize, Error> {
        self.inner.renew_slots(slots, until).await
    }

    async fn give_back_slot(&self, slot: &relaybus::store::Slot) -> Result<bool, Error> {
        self.inner.give_back_slot(slot).await
    }

    async fn take_starts(
        &self,
        request: relaybus::store::StartsRequest<'_>,
    ) -> Result<(u32, Timestamp), Error> {
        self.inner.take_starts(request).await
    }
}
