//! Claims and leases: handing out due deliveries under per-key order, fencing tokens, renewal,
//! and handing leases back.

use std::{collections::HashSet, fmt, time::Duration};

use super::{
    checks::{add, check_handlers, check_lease_duration, check_limit, check_owner},
    state::{Held, State},
};
use crate::{
    error::Result,
    store::{ClaimRequest, Claimed, StoreLease},
    time::Timestamp,
};

/// The error of an attempt charged because its claim was lost: the lease expired, or was
/// handed back, and another claim took the delivery over.
const LOST_ERROR: &str =
    "the worker running this delivery stopped or lost its lease before it finished";

/// The id of a delivery of the in-memory store: 16 hexadecimal digits, growing with creation
/// time. Its text (`Display`) is what listings show and the operator calls take.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct MemoryDeliveryId(pub(super) u64);

impl MemoryDeliveryId {
    /// Reads an id back from its text; `None` for anything else.
    pub(super) fn parse(text: &str) -> Option<Self> {
        if text.len() != 16 || !text.bytes().all(|b| b.is_ascii_hexdigit()) {
            return None;
        }
        u64::from_str_radix(text, 16).ok().map(MemoryDeliveryId)
    }
}

impl fmt::Display for MemoryDeliveryId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:016x}", self.0)
    }
}

/// The lease of a delivery claimed from the in-memory store: the delivery id and a fencing
/// token that no other claim gets. It settles the delivery only while the delivery still
/// carries its token: after a takeover, a settlement or a release, it changes nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MemoryLease {
    delivery: MemoryDeliveryId,
    token: u64,
}

impl MemoryLease {
    /// The id of the leased delivery.
    pub fn delivery_id(&self) -> MemoryDeliveryId {
        self.delivery
    }

    /// The fencing token: the claim's number, unique in the store.
    pub fn token(&self) -> u64 {
        self.token
    }
}

impl StoreLease for MemoryLease {
    type DeliveryId = MemoryDeliveryId;

    fn delivery_id(&self) -> MemoryDeliveryId {
        self.delivery
    }
}

/// A claim's arguments, checked: the distinct handlers, and when the leases it gives end.
#[derive(Debug)]
pub(super) struct Checked<'a> {
    handlers: Vec<&'a str>,
    expires_at: Timestamp,
}

/// Checks a claim's arguments as the MongoDB store does: owner, handlers, limit, lease
/// duration, and the expiry they make.
pub(super) fn check<'a>(request: &ClaimRequest<'a>) -> Result<Checked<'a>> {
    check_owner(request.owner)?;
    let handlers = check_handlers(request.handlers)?;
    check_limit(request.limit)?;
    check_lease_duration(request.lease_duration)?;
    let expires_at = add(request.now, request.lease_duration)?;
    Ok(Checked {
        handlers,
        expires_at,
    })
}

/// Claims up to `limit` due deliveries of the handlers, in `(due time, id)` order: a delivery
/// held to its key's order only while it is its key's head, others whenever due. A delivery
/// whose lease expired (held by another owner) or was handed back is taken over, its lost
/// attempt charged. An owner is never handed what it runs already, expired or not, as a
/// MongoDB lane stays with its holder until another owner takes it.
pub(super) fn claim(
    state: &mut State,
    request: &ClaimRequest<'_>,
    checked: &Checked<'_>,
) -> Vec<Claimed<MemoryLease>> {
    let now = request.now;
    let wanted: HashSet<&str> = checked.handlers.iter().copied().collect();
    // Walks the pending deliveries in due order: what it passes over is what runs under a live
    // lease, waits behind its key, or belongs to other handlers.
    let picked: Vec<u64> = state
        .deliveries
        .due_by(now)
        .filter(|d| {
            wanted.contains(d.handler.as_str())
                && d.lease.as_ref().is_none_or(|held| {
                    held.is_free(now) && (held.handed_back || held.owner != request.owner)
                })
                && d.ordered().is_none_or(|(handler, key, sequence)| {
                    state.deliveries.head(handler, key) == Some(sequence)
                })
                && state.events.contains_key(&d.event_id)
        })
        .map(|d| d.id)
        .take(request.limit as usize)
        .collect();

    let mut claimed = Vec::with_capacity(picked.len());
    let mut taken_over: u64 = 0;
    for id in picked {
        let token = state.next_token();
        let Some(lost) = state.deliveries.update(id, |delivery| {
            let lost = delivery.lease.is_some();
            if lost {
                // The previous claim is lost: its attempt counts.
                delivery.fail(LOST_ERROR, now);
            }
            delivery.lease = Some(Held {
                owner: request.owner.to_owned(),
                token,
                expires_at: checked.expires_at,
                handed_back: false,
            });
            lost
        }) else {
            continue;
        };
        taken_over += u64::from(lost);
        let Some(delivery) = state.deliveries.get(&id) else {
            continue;
        };
        let Some(event) = state.events.get(&delivery.event_id) else {
            continue;
        };
        claimed.push(Claimed {
            lease: MemoryLease {
                delivery: MemoryDeliveryId(id),
                token,
            },
            lease_expires_at: checked.expires_at,
            handler: delivery.handler.clone(),
            attempt: delivery.attempts.saturating_add(1),
            sequence: delivery.sequence,
            // This store hands out one delivery of a key at a time, never a run.
            ordered: false,
            event: event.envelope.clone(),
        });
    }
    crate::telemetry::record_takeovers(taken_over, taken_over);
    claimed
}

/// Extends the leases that still hold to at least `now + lease_duration`; returns how many of
/// `leases` are covered.
pub(super) fn renew(
    state: &mut State,
    leases: &[MemoryLease],
    lease_duration: Duration,
    now: Timestamp,
) -> Result<usize> {
    check_lease_duration(lease_duration)?;
    let expires_at = add(now, lease_duration)?;
    let mut covered = 0;
    for lease in leases {
        if !lease.holds(state) {
            continue;
        }
        let renewed = state.deliveries.update(lease.delivery.0, |d| {
            d.lease.as_mut().map(|held| {
                held.expires_at = held.expires_at.max(expires_at);
            })
        });
        if renewed.flatten().is_some() {
            covered += 1;
        }
    }
    Ok(covered)
}

/// Hands back every lease `owner` holds: the next claim of any owner takes those deliveries
/// over at once (charging the attempt of the ones still running), and until then their leases
/// still settle them. Returns how many it handed back.
pub(super) fn relinquish(state: &mut State, owner: &str) -> Result<u64> {
    check_owner(owner)?;
    let mut handed_back = 0;
    state.deliveries.update_leases(|delivery| {
        if let Some(held) = delivery.lease.as_mut()
            && held.owner == owner
            && !held.handed_back
        {
            held.handed_back = true;
            handed_back += 1;
        }
    });
    Ok(handed_back)
}
