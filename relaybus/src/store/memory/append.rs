//! Appending events and their deliveries to a transaction.

use super::{
    session::{Transaction, TxEvent},
    state::{Delivery, State, StoredEvent, Target},
};
use crate::{
    error::{EventValidationError, Result},
    store::{Appended, DeliveryStatus, append::Merged},
    time::Timestamp,
};

/// What the transaction sees of an event it appends.
struct Visible {
    event_type: String,
    key: Option<String>,
    sequence: Option<i64>,
    handlers: Vec<String>,
}

/// Appends prepared events to the transaction: a new event takes the next sequence of its key
/// and gets a delivery per handler; a known one (committed, or appended earlier in the
/// transaction) gets deliveries only for the handlers new to it. Every event is checked
/// against what the store holds before anything is written.
pub(super) fn append(
    state: &mut State,
    transaction: &mut Transaction,
    items: &[Merged<'_>],
    now: Timestamp,
) -> Result<Vec<Appended>> {
    // 1. What the transaction sees of each event, and the type check.
    let mut visible = Vec::with_capacity(items.len());
    for item in items {
        let id = item.event.id();
        let seen = match transaction.events.get(id) {
            Some(pending) => Some(visible_of(&pending.event)),
            None => state.events.get(id).map(visible_of),
        };
        if let Some(seen) = &seen
            && seen.event_type != item.event.event_type()
        {
            return Err(EventValidationError::IdReused {
                id: id.to_owned(),
                existing_type: seen.event_type.clone(),
                event_type: item.event.event_type().to_owned(),
            }
            .into());
        }
        visible.push(seen);
    }

    // 2. The writes.
    let mut outcomes = Vec::with_capacity(items.len());
    for (item, seen) in items.iter().zip(visible) {
        let event = item.event;
        let id = event.id();
        let (created, sequence, key, handlers) = match seen {
            Some(seen) => {
                let fresh: Vec<String> = item
                    .handlers
                    .iter()
                    .filter(|h| !seen.handlers.iter().any(|known| known == *h))
                    .map(|h| (*h).to_owned())
                    .collect();
                if !fresh.is_empty() {
                    transaction.lock(state, Target::Event(id.to_owned()))?;
                    extend(state, transaction, id, &fresh);
                }
                (false, seen.sequence, seen.key, fresh)
            }
            None => {
                transaction.lock(state, Target::Event(id.to_owned()))?;
                let sequence = match event.key() {
                    Some(key) => Some(next_sequence(state, transaction, key)?),
                    None => None,
                };
                let handlers: Vec<String> = item.handlers.iter().map(|h| (*h).to_owned()).collect();
                transaction.events.insert(
                    id.to_owned(),
                    TxEvent {
                        event: StoredEvent {
                            envelope: event.clone(),
                            sequence,
                            handlers: handlers.clone(),
                            completed_at: None,
                        },
                        new: true,
                        added: Vec::new(),
                    },
                );
                (true, sequence, event.key().map(str::to_owned), handlers)
            }
        };
        for handler in &handlers {
            let unordered = key.is_some() && item.unordered.contains(&handler.as_str());
            let delivery = Delivery {
                id: state.next_delivery_id(),
                event_id: id.to_owned(),
                handler: handler.clone(),
                event_type: event.event_type().to_owned(),
                key: key.clone(),
                sequence,
                unordered,
                status: DeliveryStatus::Pending,
                attempts: 0,
                due_at: item.due_at.unwrap_or(now),
                created_at: now,
                updated_at: None,
                last_error: None,
                errors: Vec::new(),
                requeues: 0,
                lease: None,
            };
            transaction.deliveries.push(delivery);
        }
        outcomes.push(Appended {
            event_id: id.to_owned(),
            created,
            sequence,
            new_deliveries: handlers,
        });
    }
    Ok(outcomes)
}

fn visible_of(event: &StoredEvent) -> Visible {
    Visible {
        event_type: event.envelope.event_type().to_owned(),
        key: event.envelope.key().map(str::to_owned),
        sequence: event.sequence,
        handlers: event.handlers.clone(),
    }
}

/// Adds `fresh` handlers to an event the transaction sees: one it inserts, or a committed one
/// (remembered with its handlers so far, the additions applied at the commit).
fn extend(state: &State, transaction: &mut Transaction, id: &str, fresh: &[String]) {
    if let Some(pending) = transaction.events.get_mut(id) {
        pending.event.handlers.extend(fresh.iter().cloned());
        if !pending.new {
            pending.added.extend(fresh.iter().cloned());
        }
        return;
    }
    if let Some(committed) = state.events.get(id) {
        let mut event = committed.clone();
        event.handlers.extend(fresh.iter().cloned());
        transaction.events.insert(
            id.to_owned(),
            TxEvent {
                event,
                new: false,
                added: fresh.to_vec(),
            },
        );
    }
}

/// Takes the next sequence of `key` for the transaction: the key's counter is held until the
/// transaction ends and advanced only at its commit.
fn next_sequence(state: &mut State, transaction: &mut Transaction, key: &str) -> Result<i64> {
    transaction.lock(state, Target::Key(key.to_owned()))?;
    let committed = state.sequences.get(key).copied().unwrap_or(0);
    let (_, last) = transaction
        .sequences
        .entry(key.to_owned())
        .or_insert((committed, committed));
    *last += 1;
    Ok(*last)
}
