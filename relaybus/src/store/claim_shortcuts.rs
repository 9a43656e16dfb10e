//! Claim shortcuts: ways to hand out deliveries without a whole claim, and to pace wake-ups,
//! that only the MongoDB store implements. Every other store takes the defaults.

use std::{future::Future, time::Duration};

use futures::stream::BoxStream;

use super::{ClaimRequest, Claimed, Queue, WakeUp};
use crate::{error::Result, time::Timestamp};

/// Shortcuts of the dispatcher's claim loop. Each has a default that takes no shortcut (claims
/// nothing, does nothing, or ignores the pace), which is always correct: the next
/// [`claim`](Queue::claim) finds what a shortcut leaves.
pub trait ClaimShortcuts: Queue {
    /// Claims the next delivery of a key for the worker that just completed its predecessor,
    /// when the store can hand it out at once, without a whole claim: the per-key rules hold as
    /// for [`claim`](Queue::claim) (it is the key's lowest pending delivery, due, and nothing of
    /// the key runs). `None` when it cannot tell cheaply; the worker's next claim finds the
    /// delivery then. The default claims nothing.
    fn claim_next_of_key(
        &self,
        request: NextOfKey<'_, Self::Lease>,
    ) -> impl Future<Output = Result<Option<Claimed<Self::Lease>>>> + Send {
        let _ = request;
        async { Ok(None) }
    }

    /// Claims, while a [`claim`](Queue::claim) of the same worker runs, deliveries the wake-ups
    /// just told of (`request.arrivals`, up to `request.limit`), when the store can hand them
    /// out at once without waiting for that claim: a new key's delivery then need not wait for
    /// the claim in progress and the next one. The per-key rules hold as for `claim`. What it
    /// leaves is found by the worker's next claim. The default claims nothing.
    fn claim_beside(
        &self,
        request: ClaimRequest<'_>,
    ) -> impl Future<Output = Result<Vec<Claimed<Self::Lease>>>> + Send {
        let _ = request;
        async { Ok(Vec::new()) }
    }

    /// Tells the store that the transaction in which
    /// [`complete_in_transaction`](Queue::complete_in_transaction) completed `lease` has
    /// committed: a store that remembers the claims it handed out until they settle forgets
    /// this one. The default does nothing.
    fn completion_committed(&self, lease: &Self::Lease) {
        let _ = lease;
    }

    /// [`watch`](Queue::watch), told how soon the dispatcher wants its wake-ups: `pace` changes
    /// as it works. A store whose stream costs the database work for every write while it
    /// waits (a MongoDB change stream scans each new oplog entry for every open stream) may
    /// read it less often while the pace is [`WakePace::Gathered`]; every new delivery must
    /// still be reported, only later. The default ignores the pace.
    fn watch_paced(
        &self,
        handlers: &[String],
        pace: tokio::sync::watch::Receiver<WakePace>,
    ) -> impl Future<Output = Result<BoxStream<'static, Result<WakeUp>>>> + Send {
        let _ = pace;
        self.watch(handlers)
    }
}

/// What [`ClaimShortcuts::claim_next_of_key`] asks for: the next delivery of a key whose delivery
/// the worker just completed, or is completing.
#[derive(Debug, Clone, Copy)]
pub struct NextOfKey<'a, L> {
    /// The worker's owner name.
    pub owner: &'a str,
    /// The lease of the delivery that completed, or whose completion commits meanwhile (see
    /// `committing`).
    pub completed: &'a L,
    /// The completion of `completed` commits while this claim runs: the claim leaves
    /// `completed` listed as running, and the worker starts what it returns only once that
    /// commit succeeded (and says so with [`ClaimShortcuts::completion_committed`]), and
    /// [releases](Queue::release) it otherwise.
    pub committing: bool,
    /// The key's delivery that completed before `completed` started, when its lane may still
    /// list it (a claim with `committing` left it there): the claim takes it off.
    pub finished: Option<&'a L>,
    /// Its handler.
    pub handler: &'a str,
    /// Its ordering key.
    pub key: &'a str,
    /// How long the claim holds what it takes without renewal.
    pub lease_duration: Duration,
    /// The current time.
    pub now: Timestamp,
}

/// How soon a dispatcher wants to hear of new deliveries. It changes as the dispatcher works:
/// see [`ClaimShortcuts::watch_paced`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum WakePace {
    /// The dispatcher waits for wake-ups, or may soon: report each new delivery at once.
    #[default]
    Eager,
    /// The dispatcher has been claiming without a pause, and its claims find most new
    /// deliveries without being told: the store may gather wake-ups and report them up to this
    /// long after they commit, where that saves the database work per write.
    Gathered(Duration),
}
