//! The answers of the writes: what each id named came to.

use relaybus::{Buried, Discarded, Requeued};
use serde::Serialize;

/// `POST /deliveries/requeue`.
#[derive(Debug, Serialize)]
pub(crate) struct RequeueAnswer {
    requeued: Vec<String>,
    /// Left dead: a later delivery of their key runs.
    blocked: Vec<String>,
    not_found: Vec<String>,
    /// Whether more dead letters match than one call takes.
    more: bool,
}

impl RequeueAnswer {
    pub(crate) fn new(outcome: Requeued, more: bool) -> Self {
        RequeueAnswer {
            requeued: outcome.requeued,
            blocked: outcome.blocked,
            not_found: outcome.not_found,
            more,
        }
    }
}

/// `POST /deliveries/discard`.
#[derive(Debug, Serialize)]
pub(crate) struct DiscardAnswer {
    discarded: Vec<String>,
    not_found: Vec<String>,
    /// Whether more dead letters match than one call takes.
    more: bool,
}

impl DiscardAnswer {
    pub(crate) fn new(outcome: Discarded, more: bool) -> Self {
        DiscardAnswer {
            discarded: outcome.discarded,
            not_found: outcome.not_found,
            more,
        }
    }
}

/// `POST /deliveries/bury`.
#[derive(Debug, Serialize)]
pub(crate) struct BuryAnswer {
    buried: Vec<String>,
    /// Left alone: a worker runs them now.
    running: Vec<String>,
    not_found: Vec<String>,
}

impl From<Buried> for BuryAnswer {
    fn from(outcome: Buried) -> Self {
        BuryAnswer {
            buried: outcome.buried,
            running: outcome.running,
            not_found: outcome.not_found,
        }
    }
}
