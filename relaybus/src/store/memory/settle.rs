//! Settling claims: completing (at once, or in the caller's transaction), releasing,
//! rescheduling and burying. Each changes something only while the lease holds.

use super::{
    checks::check_batch,
    claim::MemoryLease,
    session::Transaction,
    state::{State, Target},
};
use crate::{error::Result, store::DeliveryStatus, time::Timestamp};

/// How a claim ends, other than by completion.
#[derive(Debug, Clone, Copy)]
pub(super) enum Ending<'a> {
    /// A failed attempt, due again at `due_at`.
    Reschedule { due_at: Timestamp, error: &'a str },
    /// Given back without charging the attempt, due at once.
    Release,
    /// The last failed attempt: a dead letter.
    Bury { error: &'a str },
}

/// Completes the deliveries whose leases hold: one flag per lease, in order.
pub(super) fn complete(
    state: &mut State,
    leases: &[MemoryLease],
    now: Timestamp,
    history: bool,
) -> Result<Vec<bool>> {
    check_batch(leases.len(), "complete")?;
    Ok(leases
        .iter()
        .map(|lease| {
            let holds = lease.holds(state);
            if holds {
                state.complete(lease.delivery_id().0, now, history);
            }
            holds
        })
        .collect())
}

/// Records the completion of a delivery in the transaction, if its lease holds now; the commit
/// checks it again. A delivery another open transaction completes is a write conflict.
pub(super) fn complete_in_transaction(
    state: &mut State,
    transaction: &mut Transaction,
    lease: &MemoryLease,
    now: Timestamp,
) -> Result<bool> {
    let completing = transaction
        .completions
        .iter()
        .any(|(pending, _)| pending.delivery_id() == lease.delivery_id());
    if completing || !lease.holds(state) {
        return Ok(false);
    }
    transaction.lock(state, Target::Delivery(lease.delivery_id().0))?;
    transaction.completions.push((*lease, now));
    Ok(true)
}

/// Ends the claim of `lease`, if it holds.
pub(super) fn end_claim(
    state: &mut State,
    lease: &MemoryLease,
    ending: Ending<'_>,
    now: Timestamp,
) -> bool {
    if !lease.holds(state) {
        return false;
    }
    state
        .deliveries
        .update(lease.delivery_id().0, |delivery| {
            delivery.lease = None;
            delivery.updated_at = Some(now);
            match ending {
                Ending::Reschedule { due_at, error } => {
                    delivery.fail(error, now);
                    delivery.due_at = due_at;
                }
                Ending::Release => {
                    delivery.due_at = delivery.due_at.min(now);
                }
                Ending::Bury { error } => {
                    delivery.fail(error, now);
                    delivery.status = DeliveryStatus::Dead;
                }
            }
        })
        .is_some()
}
