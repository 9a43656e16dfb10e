//! Hot keys: the transactions of one store instance that publish on the same ordering key queue
//! for it in the process, instead of conflicting on its sequence counter on the server.
//!
//! MongoDB does not make a transaction wait for a document another one wrote: the second writer
//! fails with a write conflict, and runs again. Worse, a transaction conflicts with every write
//! committed after its snapshot, which its first operation takes; so waiting for a key in the
//! middle of a transaction does not help, it must happen before the transaction reads anything.
//!
//! So each key has a gate here, a semaphore of one permit. A transaction this instance started
//! takes the gates of its keys as it appends, without waiting: when a gate is taken by another
//! transaction, the attempt gives up at once with a transient error and notes its keys (see
//! [`queue_on_keys`](crate::store::transaction::queue_on_keys)); the next attempt waits for those
//! gates when it starts, in key order, and runs with them. A transaction that aborts notes the
//! keys it held too, so that its next attempt takes them before it starts. Gates are released at
//! commit and abort.
//!
//! The gates are an optimisation only: the counter's write conflicts still decide between
//! transactions of different processes, and between one that waited too long and the holder.
//! Waits are bounded ([`WAIT_LIMIT`], and the transaction's budget), and a gate held for longer
//! than [`HOLD_LIMIT`] stops counting: the transaction that took it may have been dropped without
//! ending (its session aborts on the server in the background), and nothing here would learn it.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// The longest a transaction waits for the gates of its keys before it starts without them.
pub(crate) const WAIT_LIMIT: Duration = Duration::from_secs(3);
/// How long a gate counts as held: longer than a request's transaction takes, short enough that
/// a transaction dropped while holding one costs the key's next publishers one such wait.
pub(crate) const HOLD_LIMIT: Duration = Duration::from_secs(1);
/// How often a waiter looks for a holder past [`HOLD_LIMIT`].
const WAIT_STEP: Duration = Duration::from_millis(100);

/// The gates of one store instance's keys and who holds them.
#[derive(Debug, Default)]
pub(crate) struct KeyGates {
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    /// One gate per key that is held or waited for.
    gates: HashMap<String, Arc<Semaphore>>,
    /// The transactions this instance started and has not seen end, by session id.
    open: HashMap<Vec<u8>, Open>,
}

/// What one open transaction holds.
#[derive(Debug, Default)]
struct Open {
    held: Vec<Held>,
    /// Keys whose gates it stopped waiting for: it writes them without, as before gates.
    passed: Vec<String>,
}

#[derive(Debug)]
struct Held {
    key: String,
    since: Instant,
    _permit: OwnedSemaphorePermit,
}

/// An attempt found keys held by other transactions of this instance.
#[derive(Debug)]
pub(crate) struct KeysBusy(pub(crate) Vec<String>);

/// The transient error of an attempt that gave up for keys other transactions of this process
/// hold: the transaction runs again, and its next attempt waits for them first.
#[derive(Debug, thiserror::Error)]
#[error(
    "ordering keys {0:?} are taken by another transaction of this process; the transaction runs \
     again once they are free"
)]
pub(crate) struct KeysTaken(pub(crate) Vec<String>);

impl KeyGates {
    /// A transaction starts on `session`: waits for the gates of `keys` (those its last attempt
    /// noted), in key order, for at most [`WAIT_LIMIT`] or `budget`, and holds them.
    pub(crate) async fn begin(
        &self,
        session: Vec<u8>,
        mut keys: Vec<String>,
        budget: Option<Duration>,
    ) {
        // A transaction left open on this session was dropped: what it held is free.
        let stale = lock(&self.state).open.remove(&session);
        drop(stale);
        keys.sort_unstable();
        keys.dedup();
        let deadline = Instant::now() + budget.map_or(WAIT_LIMIT, |b| b.min(WAIT_LIMIT));
        let mut open = Open::default();
        for key in keys {
            match self.wait_for(&key, deadline).await {
                Some(permit) => open.held.push(Held {
                    key,
                    since: Instant::now(),
                    _permit: permit,
                }),
                None => open.passed.push(key),
            }
        }
        let mut state = lock(&self.state);
        state.open.insert(session, open);
        state.forget_idle_gates();
    }

    /// The gate of `key`, once free or once its holder is past [`HOLD_LIMIT`]; `None` at
    /// `deadline`.
    async fn wait_for(&self, key: &str, deadline: Instant) -> Option<OwnedSemaphorePermit> {
        let gate = lock(&self.state).gate(key);
        loop {
            let step = WAIT_STEP.min(deadline.saturating_duration_since(Instant::now()));
            if let Ok(Ok(permit)) =
                tokio::time::timeout(step, Arc::clone(&gate).acquire_owned()).await
            {
                return Some(permit);
            }
            if Instant::now() >= deadline {
                return None;
            }
            lock(&self.state).expire_holder(key);
        }
    }

    /// The transaction on `session` appends on `keys`: takes the gates it does not hold yet,
    /// without waiting. A gate held by another transaction of this instance is
    /// [`KeysBusy`] when `may_queue` (the next attempt will wait for it); without, or for a
    /// transaction this instance did not start, the keys are written ungated.
    pub(crate) fn take(
        &self,
        session: &[u8],
        keys: &[&str],
        may_queue: bool,
    ) -> Result<(), KeysBusy> {
        let mut state = lock(&self.state);
        let State { gates, open } = &mut *state;
        let Some(transaction) = open.get_mut(session) else {
            return Ok(());
        };
        let mut busy = false;
        for key in keys {
            if transaction.held.iter().any(|h| h.key == *key)
                || transaction.passed.iter().any(|p| p == key)
            {
                continue;
            }
            let gate = Arc::clone(gates.entry((*key).to_owned()).or_insert_with(new_gate));
            match gate.try_acquire_owned() {
                Ok(permit) => transaction.held.push(Held {
                    key: (*key).to_owned(),
                    since: Instant::now(),
                    _permit: permit,
                }),
                Err(_) => busy = true,
            }
        }
        if busy && may_queue {
            let mut wanted: Vec<String> = transaction.held.iter().map(|h| h.key.clone()).collect();
            wanted.extend(keys.iter().map(|k| (*k).to_owned()));
            return Err(KeysBusy(wanted));
        }
        Ok(())
    }

    /// The transaction on `session` ended: releases its gates, and returns its keys for the
    /// next attempt when one may follow.
    pub(crate) fn end(&self, session: &[u8]) -> Vec<String> {
        let mut state = lock(&self.state);
        let Some(open) = state.open.remove(session) else {
            return Vec::new();
        };
        let keys = open.held.iter().map(|h| h.key.clone()).collect();
        drop(open);
        state.forget_idle_gates();
        keys
    }
}

impl State {
    fn gate(&mut self, key: &str) -> Arc<Semaphore> {
        Arc::clone(self.gates.entry(key.to_owned()).or_insert_with(new_gate))
    }

    /// Releases the gate of `key` when its holder took it more than [`HOLD_LIMIT`] ago.
    fn expire_holder(&mut self, key: &str) {
        for open in self.open.values_mut() {
            open.held
                .retain(|held| held.key != key || held.since.elapsed() < HOLD_LIMIT);
        }
    }

    /// Drops the gates nobody holds or waits for, so that the map does not grow with every key
    /// ever published.
    fn forget_idle_gates(&mut self) {
        self.gates
            .retain(|_, gate| Arc::strong_count(gate) > 1 || gate.available_permits() == 0);
    }
}

fn new_gate() -> Arc<Semaphore> {
    Arc::new(Semaphore::new(1))
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn session(n: u8) -> Vec<u8> {
        vec![n; 16]
    }

    #[tokio::test]
    async fn a_held_key_sends_the_next_transaction_to_wait_before_it_starts() {
        let gates = KeyGates::default();
        gates.begin(session(1), Vec::new(), None).await;
        gates.begin(session(2), Vec::new(), None).await;
        assert!(gates.take(&session(1), &["k", "j"], true).is_ok());
        let busy = gates.take(&session(2), &["k"], true).unwrap_err();
        assert_eq!(busy.0, ["k"]);
        // Without a next attempt to queue, the key is written ungated.
        assert!(gates.take(&session(2), &["k"], false).is_ok());
        // A transaction this instance did not start is never gated.
        assert!(gates.take(&session(9), &["k"], true).is_ok());

        // The next attempt waits until the holder ends, then holds the key.
        let waiter = async {
            gates.end(&session(2));
            gates.begin(session(2), busy.0, None).await;
            assert!(gates.take(&session(2), &["k"], true).is_ok());
        };
        let holder = async {
            tokio::time::sleep(Duration::from_millis(50)).await;
            assert_eq!(gates.end(&session(1)), ["k", "j"]);
        };
        let started = Instant::now();
        tokio::join!(waiter, holder);
        assert!(started.elapsed() >= Duration::from_millis(50));
        assert!(started.elapsed() < HOLD_LIMIT);
        gates.begin(session(3), Vec::new(), None).await;
        assert!(
            gates.take(&session(3), &["k"], true).is_err(),
            "session 2 holds it"
        );
        assert!(
            gates.take(&session(3), &["j"], true).is_ok(),
            "session 1 released it"
        );
    }

    #[tokio::test]
    async fn a_gate_whose_holder_never_ends_is_taken_after_the_hold_limit() {
        let gates = KeyGates::default();
        gates.begin(session(1), vec!["k".to_owned()], None).await;
        // Session 1 is dropped without ending; session 2 waits for its gate.
        let started = Instant::now();
        gates.begin(session(2), vec!["k".to_owned()], None).await;
        let waited = started.elapsed();
        assert!(waited >= HOLD_LIMIT, "{waited:?}");
        assert!(waited < WAIT_LIMIT, "{waited:?}");
        gates.begin(session(3), Vec::new(), None).await;
        assert!(
            gates.take(&session(3), &["k"], true).is_err(),
            "session 2 holds it"
        );
        // A wait is bounded by the transaction's budget.
        let started = Instant::now();
        gates
            .begin(
                session(3),
                vec!["k".to_owned()],
                Some(Duration::from_millis(30)),
            )
            .await;
        assert!(started.elapsed() < HOLD_LIMIT);
        assert!(
            gates.take(&session(3), &["k"], true).is_ok(),
            "passed, written ungated"
        );
    }

    #[tokio::test]
    async fn gates_nobody_holds_are_forgotten() {
        let gates = KeyGates::default();
        gates.begin(session(1), Vec::new(), None).await;
        assert!(gates.take(&session(1), &["a", "b"], true).is_ok());
        assert_eq!(lock(&gates.state).gates.len(), 2);
        gates.end(&session(1));
        assert!(lock(&gates.state).gates.is_empty());
    }
}
