//! Crash recovery: the server sessions a store instance runs transactions on, recorded with a
//! heartbeat, so that the transactions of a process that died are aborted at once.
//!
//! A process killed inside a transaction cannot abort it, and MongoDB aborts it only after
//! `transactionLifetimeLimitSeconds` (60 s by default). Until then it holds the documents it
//! wrote (a key's sequence counter, business documents), and every transaction that writes them
//! conflicts: a hot key refuses work for a minute.
//!
//! Each store instance keeps one document in the `processes` collection: its id, the ids of the
//! server sessions (`lsid`) it started transactions on, and `expiresAt`, which its heartbeat
//! moves forward every quarter of the expiry. A session id is written there before the first
//! transaction on it starts, so a transaction can never be open on a session the document does
//! not name. The driver pools its server sessions, so a new id (one more write) is rare.
//!
//! Every instance also sweeps: a document whose `expiresAt` passed belongs to a process that
//! stopped beating, and its sessions are killed (`killSessions`), which aborts their open
//! transactions and frees what they held; then the document is deleted, if it did not beat
//! meanwhile. Times are the server's (`$$NOW`), so the processes' clocks do not matter.
//!
//! A dead process of the same host is known sooner (see `process`): the document names its
//! host, process id and start time, and a sweep also kills the sessions of a same-host document
//! whose process is gone, whatever its expiry says. A restarted process sweeps as it starts, so
//! its dead predecessor's keys come back at once, not after the expiry.
//!
//! A process that was only paused past its expiry loses its open transactions (they fail with a
//! transient error and run again) and writes its document anew at its next beat.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex, Weak},
    time::{Duration, Instant},
};

use futures::TryStreamExt;
use mongodb::{
    Collection,
    bson::{Document, doc, oid::ObjectId},
};
use tokio::sync::OnceCell;

use super::{
    StoreInner,
    process::ProcessIdentity,
    schema::{field, path},
};
use crate::error::Result;

/// The default expiry of a heartbeat.
pub const DEFAULT_HEARTBEAT_EXPIRY: Duration = Duration::from_secs(10);

/// How long the driver keeps an idle server session before it discards it: MongoDB's
/// `logicalSessionTimeoutMinutes` (30) and a margin. A session unused for longer is dropped
/// from the document.
const SESSION_IDLE_LIMIT: Duration = Duration::from_secs(31 * 60);

/// The sessions of one store instance and its heartbeat.
#[derive(Debug)]
pub(crate) struct SessionRegistry {
    /// The id of this instance's document, and the holder of its leads.
    pub(super) id: ObjectId,
    /// `None` when crash recovery is off.
    expiry: Option<Duration>,
    /// Session ids by their `id` bytes: the id document and when it was last used.
    known: Mutex<HashMap<Vec<u8>, (Document, Instant)>>,
    /// Serialises the writes of the document, so that a heartbeat never writes an older list
    /// over a newer one.
    writes: tokio::sync::Mutex<()>,
    /// Set once the heartbeat runs.
    heartbeat: OnceCell<()>,
}

impl SessionRegistry {
    pub(crate) fn new(expiry: Option<Duration>) -> Self {
        SessionRegistry {
            id: ObjectId::new(),
            expiry,
            known: Mutex::default(),
            writes: tokio::sync::Mutex::new(()),
            heartbeat: OnceCell::new(),
        }
    }

    /// The heartbeat's expiry; `None` when crash recovery is off.
    pub(crate) fn expiry(&self) -> Option<Duration> {
        self.expiry
    }

    /// Records `lsid` before a transaction starts on it: a write for a session id seen for the
    /// first time, nothing otherwise. Starts the heartbeat.
    pub(crate) async fn record(&self, store: &Arc<StoreInner>, lsid: &Document) -> Result<()> {
        let Some(expiry) = self.expiry else {
            return Ok(());
        };
        self.start(store).await;
        let Some(key) = session_key(lsid) else {
            return Ok(());
        };
        {
            let mut known = lock(&self.known);
            if let Some((_, used)) = known.get_mut(&key) {
                *used = Instant::now();
                return Ok(());
            }
            known.insert(key.clone(), (lsid.clone(), Instant::now()));
        }
        if let Err(error) = self.beat(&store.processes, expiry).await {
            // Not recorded: forget it, so that the next transaction on it tries again.
            lock(&self.known).remove(&key);
            return Err(error);
        }
        Ok(())
    }

    /// Starts the heartbeat and the sweep of this instance, once; a dispatcher that runs no
    /// transaction of its own still sweeps.
    pub(crate) async fn start(&self, store: &Arc<StoreInner>) {
        let Some(expiry) = self.expiry else {
            return;
        };
        self.heartbeat
            .get_or_init(|| async {
                tokio::spawn(heartbeat(Arc::downgrade(store), expiry));
            })
            .await;
    }

    /// Writes this instance's document: its live sessions and an expiry from the server's
    /// clock.
    async fn beat(&self, processes: &Collection<Document>, expiry: Duration) -> Result<()> {
        let _writing = self.writes.lock().await;
        let sessions: Vec<Document> = {
            let mut known = lock(&self.known);
            known.retain(|_, (_, used)| used.elapsed() < SESSION_IDLE_LIMIT);
            known.values().map(|(lsid, _)| lsid.clone()).collect()
        };
        let expiry_ms = i64::try_from(expiry.as_millis()).unwrap_or(i64::MAX);
        let mut set = doc! {
            field::SESSIONS: sessions,
            field::EXPIRES_AT: { "$add": ["$$NOW", expiry_ms] },
        };
        ProcessIdentity::stamp(&mut set);
        processes
            .update_one(doc! { field::ID: self.id }, vec![doc! { "$set": set }])
            .upsert(true)
            .await?;
        Ok(())
    }
}

/// Beats and sweeps every quarter of `expiry` while the store instance lives, then deletes its
/// document.
async fn heartbeat(store: Weak<StoreInner>, expiry: Duration) {
    let interval = (expiry / 4).max(Duration::from_millis(50));
    let (processes, id) = match store.upgrade() {
        Some(store) => (store.processes.clone(), store.sessions.id),
        None => return,
    };
    let mut ticks = tokio::time::interval(interval);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticks.tick().await;
        let Some(store) = store.upgrade() else {
            break;
        };
        if let Err(error) = store.sessions.beat(&store.processes, expiry).await {
            tracing::warn!(%error, "relaybus could not renew its session heartbeat");
        }
        if let Err(error) = sweep(&store).await {
            tracing::warn!(%error, "relaybus could not look for the sessions of dead processes");
        }
    }
    // The instance was dropped: its sessions went back to the driver's pool, where another
    // instance on the same client may take them, so nobody may kill them later.
    let _ = processes.delete_one(doc! { field::ID: id }).await;
}

/// Whether a document found by a sweep expired by the server's clock (computed, never stored).
const EXPIRED: &str = "expired";

/// Kills the sessions of every process whose heartbeat expired, or that ran on this host and is
/// gone, and deletes its document.
async fn sweep(store: &StoreInner) -> Result<u64> {
    let expired = doc! { "$expr": { "$lt": [path::EXPIRES_AT, "$$NOW"] } };
    let mut filter = doc! {
        field::ID: { "$ne": store.sessions.id },
        field::SESSIONS: { "$exists": true },
    };
    let here = ProcessIdentity::current();
    match here {
        Some(here) => filter.insert("$or", vec![expired, doc! { field::HOST: &here.host }]),
        None => filter.insert("$and", vec![expired]),
    };
    let mut found = store
        .processes
        .aggregate(vec![
            doc! { "$match": filter },
            doc! { "$set": { EXPIRED: { "$lt": [path::EXPIRES_AT, "$$NOW"] } } },
        ])
        .await?;
    let mut killed = 0;
    while let Some(process) = found.try_next().await? {
        let Ok(sessions) = process.get_array(field::SESSIONS) else {
            continue;
        };
        let dead = process.get_bool(EXPIRED) == Ok(true) || gone(&process);
        if !dead {
            // Beating, on this host, and its process still runs (a stopped one too).
            continue;
        }
        if !sessions.is_empty() {
            store
                .client
                .database("admin")
                .run_command(doc! { "killSessions": sessions.clone() })
                .await?;
        }
        let deleted = store
            .processes
            .delete_one(doc! {
                field::ID: process.get(field::ID).cloned(),
                field::EXPIRES_AT: process.get(field::EXPIRES_AT).cloned(),
            })
            .await?;
        if deleted.deleted_count == 1 {
            killed += sessions.len() as u64;
            tracing::warn!(
                process = %process.get(field::ID).map(ToString::to_string).unwrap_or_default(),
                sessions = sessions.len(),
                "relaybus killed the sessions of a process that stopped (its heartbeat expired, \
                 or it ran on this host and is gone), aborting its open transactions"
            );
        }
    }
    Ok(killed)
}

/// Whether the process a document names (host, process id, start time) ran on this host and
/// is gone.
pub(crate) fn gone(process: &Document) -> bool {
    let Some(here) = ProcessIdentity::current() else {
        return false;
    };
    let (Ok(host), Ok(pid), Ok(started)) = (
        process.get_str(field::HOST),
        process.get_i64(field::PID),
        process.get_i64(field::STARTED),
    ) else {
        return false;
    };
    let (Ok(pid), Ok(started)) = (u32::try_from(pid), u64::try_from(started)) else {
        return false;
    };
    host == here.host && ProcessIdentity::is_gone(pid, started)
}

/// The bytes of a session id document's `id`, the UUID that names it.
pub(crate) fn session_key(lsid: &Document) -> Option<Vec<u8>> {
    match lsid.get("id")? {
        mongodb::bson::Bson::Binary(binary) => Some(binary.bytes.clone()),
        _ => None,
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}
