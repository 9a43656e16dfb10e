//! Sessions and their transactions: the buffer of what a transaction writes, the things it
//! holds against other open transactions, and the commit that applies it all at once.

use std::{
    collections::{BTreeMap, HashMap},
    fmt,
    sync::Arc,
    time::{Duration, Instant},
};

use serde_json::Value;

use super::{
    MemoryEventStore, Shared,
    claim::MemoryLease,
    error::{MemoryStoreError, conflict},
    state::{Delivery, State, StoredDocument, StoredEvent, Target},
};
use crate::{
    error::{ConfigurationError, InvalidArgumentError, Result},
    store::DeliveryStatus,
    time::Timestamp,
};

/// The session of the in-memory store,
/// [`Transactions::Session`](crate::store::Transactions::Session) of [`MemoryEventStore`]: one
/// transaction at a time, and the business documents it writes.
///
/// Take one with [`Transactions::session`](crate::store::Transactions::session), or let
/// [`MemoryEventStore::transaction`], the bus's `transaction` or a transactional handler give
/// you one in a started transaction. Its transaction's writes (events, deliveries, completions,
/// documents) are seen by the transaction itself and by nobody else until the commit, which
/// applies them all at once; an abort, or dropping the session with the transaction open,
/// discards them.
///
/// The document methods ([`insert`](Self::insert), [`put`](Self::put), [`get`](Self::get),
/// [`delete`](Self::delete), [`update`](Self::update)) work on named collections of JSON
/// documents, keyed by a string id, and need a started transaction; outside one they are
/// refused with [`ConfigurationError::NoTransaction`]. The committed documents are read with
/// [`MemoryEventStore::document`], [`documents`](MemoryEventStore::documents) and
/// [`count`](MemoryEventStore::count).
///
/// # Conflicts
///
/// A document that another open transaction wrote cannot be written (nor inserted, deleted or
/// updated) until that transaction ends: the call fails at once with the transient
/// [`MemoryStoreError::WriteConflict`], and the transaction helpers run the whole transaction
/// again. The same happens when the transaction writes a document it read before another
/// transaction committed a change to it. Reads never wait and never conflict.
pub struct MemorySession {
    pub(super) shared: Arc<Shared>,
    pub(super) transaction: Option<Transaction>,
}

impl fmt::Debug for MemorySession {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemorySession")
            .field("in_transaction", &self.transaction.is_some())
            .finish_non_exhaustive()
    }
}

impl Drop for MemorySession {
    /// A transaction still open is aborted: nothing of it is kept.
    fn drop(&mut self) {
        if let Some(transaction) = self.transaction.take() {
            release(&mut self.shared.lock(), &transaction);
        }
    }
}

/// What an open transaction wrote, not yet applied.
#[derive(Debug)]
pub(super) struct Transaction {
    pub(super) id: u64,
    started: Instant,
    budget: Option<Duration>,
    /// A write conflict hit inside the transaction: it can only abort.
    failed: Option<String>,
    /// What it holds against other open transactions.
    locked: Vec<Target>,
    /// Events it inserted or added handlers to, as it sees them.
    pub(super) events: BTreeMap<String, TxEvent>,
    /// Key counters it advanced: the committed value it started from, and its last sequence.
    pub(super) sequences: BTreeMap<String, (i64, i64)>,
    /// New deliveries.
    pub(super) deliveries: Vec<Delivery>,
    /// Deliveries it completes, with the lease each was checked under and the completion time.
    pub(super) completions: Vec<(MemoryLease, Timestamp)>,
    /// Business documents it wrote: `None` for a deletion.
    pub(super) documents: BTreeMap<(String, String), Option<Value>>,
    /// The version of each committed business document it read (`None`: absent).
    pub(super) seen: HashMap<(String, String), Option<u64>>,
}

/// An event as a transaction sees it.
#[derive(Debug)]
pub(super) struct TxEvent {
    /// The event with every handler the transaction sees.
    pub(super) event: StoredEvent,
    /// The transaction inserts it (rather than adding handlers to a committed one).
    pub(super) new: bool,
    /// The handlers it adds to a committed event.
    pub(super) added: Vec<String>,
}

impl Transaction {
    /// Takes `target` for this transaction, or fails with a write conflict when another open
    /// transaction holds it (and the transaction can then only abort).
    pub(super) fn lock(&mut self, state: &mut State, target: Target) -> Result<()> {
        match state.locks.get(&target) {
            Some(holder) if *holder == self.id => Ok(()),
            Some(_) => {
                let what = format!("another open transaction wrote {target}");
                self.failed = Some(what.clone());
                Err(conflict(what))
            }
            None => {
                state.locks.insert(target.clone(), self.id);
                self.locked.push(target);
                Ok(())
            }
        }
    }

    /// Fails the transaction with a write conflict on `what`.
    pub(super) fn fail(&mut self, what: String) -> crate::Error {
        self.failed = Some(what.clone());
        conflict(what)
    }
}

/// Lets go of what the transaction holds.
fn release(state: &mut State, transaction: &Transaction) {
    for target in &transaction.locked {
        if state.locks.get(target) == Some(&transaction.id) {
            state.locks.remove(target);
        }
    }
}

impl MemoryEventStore {
    /// A new session on this store.
    pub(super) fn new_session(&self) -> MemorySession {
        MemorySession {
            shared: Arc::clone(&self.inner),
            transaction: None,
        }
    }

    /// Refuses a session of another store.
    pub(super) fn check_session(&self, session: &MemorySession) -> Result<()> {
        if Arc::ptr_eq(&self.inner, &session.shared) {
            Ok(())
        } else {
            Err(InvalidArgumentError::new(
                "session",
                "the session belongs to another MemoryEventStore; take sessions from the store \
                 you pass them to, with `store.session()`",
            )
            .into())
        }
    }

    /// The session's open transaction, refusing a session of another store or one without a
    /// started transaction.
    pub(super) fn open<'s>(
        &self,
        session: &'s mut MemorySession,
        operation: &'static str,
    ) -> Result<&'s mut Transaction> {
        self.check_session(session)?;
        session
            .transaction
            .as_mut()
            .ok_or_else(|| ConfigurationError::NoTransaction { operation }.into())
    }

    /// Starts a transaction on `session`, within `budget` when one is given.
    pub(super) fn begin_on(
        &self,
        session: &mut MemorySession,
        budget: Option<Duration>,
    ) -> Result<()> {
        self.check_session(session)?;
        if session.transaction.is_some() {
            return Err(MemoryStoreError::TransactionInProgress.into());
        }
        let id = {
            let mut state = self.inner.lock();
            state.last_transaction += 1;
            state.last_transaction
        };
        session.transaction = Some(Transaction {
            id,
            started: Instant::now(),
            budget,
            failed: None,
            locked: Vec::new(),
            events: BTreeMap::new(),
            sequences: BTreeMap::new(),
            deliveries: Vec::new(),
            completions: Vec::new(),
            documents: BTreeMap::new(),
            seen: HashMap::new(),
        });
        Ok(())
    }

    /// Aborts the session's transaction, if it has one.
    pub(super) fn abort_on(&self, session: &mut MemorySession) {
        if let Some(transaction) = session.transaction.take() {
            release(&mut session.shared.lock(), &transaction);
        }
    }

    /// Commits the session's transaction: checks that everything it relied on still holds,
    /// then applies it in one step. On any error nothing is applied and the transaction is
    /// over.
    pub(super) fn commit_on(&self, session: &mut MemorySession) -> Result<()> {
        self.check_session(session)?;
        let Some(transaction) = session.transaction.take() else {
            return Err(ConfigurationError::NoTransaction {
                operation: "MemoryEventStore.commit",
            }
            .into());
        };
        let history = self.inner.completion_history;
        let mut state = self.inner.lock();
        let checked = check(&state, &transaction);
        let woken = match checked {
            Ok(()) => apply(&mut state, &transaction, history),
            Err(_) => Vec::new(),
        };
        release(&mut state, &transaction);
        drop(state);
        if !woken.is_empty() {
            // Nobody may be watching: then there is nobody to tell.
            let _ = self.inner.wake.send(woken.into());
        }
        checked
    }
}

/// What a commit checks before it applies anything: no conflict inside the transaction, the
/// budget, and that what the transaction relied on still holds.
fn check(state: &State, transaction: &Transaction) -> Result<()> {
    if let Some(what) = &transaction.failed {
        return Err(conflict(what.clone()));
    }
    if let Some(budget) = transaction.budget {
        let elapsed = transaction.started.elapsed();
        if elapsed > budget {
            return Err(MemoryStoreError::BudgetExceeded { budget, elapsed }.into());
        }
    }
    for (id, pending) in &transaction.events {
        let stored = state.events.contains_key(id);
        if pending.new && stored {
            return Err(conflict(format!(
                "event {id:?} was stored by another transaction since this one looked for it"
            )));
        }
        if !pending.new && !stored {
            return Err(conflict(format!(
                "event {id:?} was purged since this transaction added handlers to it"
            )));
        }
    }
    for (key, (base, _)) in &transaction.sequences {
        if state.sequences.get(key).copied().unwrap_or(0) != *base {
            return Err(conflict(format!(
                "the sequence of ordering key {key:?} moved since this transaction read it"
            )));
        }
    }
    for (lease, _) in &transaction.completions {
        if !lease.holds(state) {
            return Err(conflict(format!(
                "delivery {} was taken over or settled since this transaction completed it",
                lease.delivery_id()
            )));
        }
    }
    Ok(())
}

/// Applies a checked transaction; returns the handlers it appended deliveries for.
fn apply(state: &mut State, transaction: &Transaction, history: bool) -> Vec<String> {
    state.commits += 1;
    let version = state.commits;
    for (id, pending) in &transaction.events {
        if pending.new {
            state.events.insert(id.clone(), pending.event.clone());
        } else if let Some(event) = state.events.get_mut(id) {
            for handler in &pending.added {
                if !event.handlers.contains(handler) {
                    event.handlers.push(handler.clone());
                }
            }
        }
    }
    for (key, (_, last)) in &transaction.sequences {
        state.sequences.insert(key.clone(), *last);
    }
    let mut woken: Vec<String> = Vec::new();
    for delivery in &transaction.deliveries {
        if !woken.contains(&delivery.handler) {
            woken.push(delivery.handler.clone());
        }
        state.deliveries.insert(delivery.clone());
    }
    for (lease, now) in &transaction.completions {
        state.complete(lease.delivery_id().0, *now, history);
    }
    for ((collection, id), value) in &transaction.documents {
        match value {
            Some(value) => {
                state
                    .documents
                    .entry(collection.clone())
                    .or_default()
                    .insert(
                        id.clone(),
                        StoredDocument {
                            value: value.clone(),
                            version,
                        },
                    );
            }
            None => {
                if let Some(documents) = state.documents.get_mut(collection) {
                    documents.remove(id);
                    if documents.is_empty() {
                        state.documents.remove(collection);
                    }
                }
            }
        }
    }
    woken
}

impl MemoryLease {
    /// Whether the lease still holds: its delivery is pending and carries its token.
    pub(super) fn holds(&self, state: &State) -> bool {
        state
            .deliveries
            .get(&self.delivery_id().0)
            .is_some_and(|delivery| {
                delivery.status == DeliveryStatus::Pending
                    && delivery
                        .lease
                        .as_ref()
                        .is_some_and(|held| held.token == self.token())
            })
    }
}
