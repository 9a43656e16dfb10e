//! What operators and retention need: counts, listings, requeueing, discarding and burying by
//! id, and purging.

use std::collections::{BTreeMap, HashSet};

use super::{
    checks::{check_list_limit, clip_error, parse_after, parse_ids},
    state::{Delivery, State, Target},
};
use crate::{
    error::Result,
    store::{
        Buried, DeliveryQuery, DeliveryRecord, DeliveryStatus, Discarded, HandlerStatistics,
        PendingState, PurgeOptions, Purged, Requeued, Statistics,
    },
    time::Timestamp,
};

/// Counts deliveries by state.
pub(super) fn statistics(state: &State, history: bool) -> Statistics {
    let heads = state.heads();
    let mut stats = Statistics {
        completion_history: history,
        completed: state.completed.len() as u64,
        ..Statistics::default()
    };
    for delivery in state.deliveries.values() {
        match delivery.status {
            DeliveryStatus::Pending => {
                stats.pending += 1;
                stats.running += u64::from(delivery.is_running());
                stats.parked += u64::from(delivery.is_parked(&heads));
                stats.oldest_due_at = Some(match stats.oldest_due_at {
                    Some(oldest) => oldest.min(delivery.due_at),
                    None => delivery.due_at,
                });
            }
            _ => stats.dead += 1,
        }
    }
    stats
}

/// Counts each handler's deliveries by state, in handler order.
pub(super) fn handler_statistics(state: &State) -> Vec<HandlerStatistics> {
    let heads = state.heads();
    let mut by_handler: BTreeMap<&str, HandlerStatistics> = BTreeMap::new();
    for delivery in state.deliveries.values() {
        let entry = by_handler
            .entry(&delivery.handler)
            .or_insert_with(|| HandlerStatistics::new(&delivery.handler));
        match delivery.status {
            DeliveryStatus::Pending => {
                entry.pending += 1;
                entry.running += u64::from(delivery.is_running());
                entry.parked += u64::from(delivery.is_parked(&heads));
                entry.oldest_due_at = Some(match entry.oldest_due_at {
                    Some(oldest) => oldest.min(delivery.due_at),
                    None => delivery.due_at,
                });
            }
            _ => entry.dead += 1,
        }
    }
    by_handler.into_values().collect()
}

/// Lists deliveries and completion records, oldest first, filtered by `query`.
pub(super) fn list_deliveries(state: &State, query: &DeliveryQuery) -> Result<Vec<DeliveryRecord>> {
    check_list_limit(query.limit)?;
    let after = query.after.as_deref().map(parse_after).transpose()?;
    let start = after.map_or(0, |after| after.0.saturating_add(1));
    let heads = state.heads();
    let wants_completed = matches!(query.status, None | Some(DeliveryStatus::Completed))
        && query.pending_state.is_none();
    let mut deliveries = state
        .deliveries
        .range(start..)
        .map(|(id, delivery)| (*id, delivery.record(delivery.is_parked(&heads))))
        .filter(|(_, record)| delivery_matches(query, record))
        .peekable();
    let mut completed = state
        .completed
        .range(start..)
        .filter(|_| wants_completed)
        .filter(|(_, record)| common_matches(query, record))
        .peekable();
    let mut records = Vec::new();
    while records.len() < query.limit as usize {
        // Both are in id order: merge them.
        let take_delivery = match (deliveries.peek(), completed.peek()) {
            (Some((a, _)), Some((b, _))) => a < *b,
            (Some(_), None) => true,
            (None, Some(_)) => false,
            (None, None) => break,
        };
        let next = if take_delivery {
            deliveries.next().map(|(_, record)| record)
        } else {
            completed.next().map(|(_, record)| record.clone())
        };
        records.extend(next);
    }
    Ok(records)
}

/// Whether a pending or dead delivery's record matches the query.
fn delivery_matches(query: &DeliveryQuery, record: &DeliveryRecord) -> bool {
    let state_matches = match (query.status, query.pending_state) {
        (Some(status), None) => record.status == status,
        (None, None) => true,
        (Some(status), Some(_)) if status != DeliveryStatus::Pending => false,
        (_, Some(pending)) => {
            record.status == DeliveryStatus::Pending
                && match pending {
                    PendingState::Running => record.running,
                    PendingState::Parked => record.parked,
                    PendingState::Waiting => !record.running && !record.parked,
                }
        }
    };
    state_matches && common_matches(query, record)
}

/// Whether a record matches the query's filters other than the state.
fn common_matches(query: &DeliveryQuery, record: &DeliveryRecord) -> bool {
    let error = record.last_error.as_deref();
    query.handler.as_ref().is_none_or(|h| *h == record.handler)
        && query
            .event_type
            .as_ref()
            .is_none_or(|t| *t == record.event_type)
        && query
            .key
            .as_deref()
            .is_none_or(|k| record.key.as_deref() == Some(k))
        && query
            .event_id
            .as_ref()
            .is_none_or(|e| *e == record.event_id)
        && query
            .created_from
            .is_none_or(|from| record.created_at.is_some_and(|at| at >= from))
        && query
            .created_before
            .is_none_or(|before| record.created_at.is_some_and(|at| at < before))
        && match (&query.last_error, &query.error_contains) {
            (Some(exact), _) => error == Some(exact.as_str()),
            (None, Some(text)) => {
                error.is_some_and(|error| error.to_lowercase().contains(&text.to_lowercase()))
            }
            (None, None) => true,
        }
}

/// Makes dead deliveries pending again, unless a later delivery of their key runs.
pub(super) fn requeue(state: &mut State, ids: &[String], now: Timestamp) -> Result<Requeued> {
    let (parsed, not_found) = parse_ids(ids, "requeue")?;
    let mut outcome = Requeued {
        not_found,
        ..Requeued::default()
    };
    for id in parsed {
        let Some(dead) = state
            .deliveries
            .get(&id.0)
            .filter(|d| d.status == DeliveryStatus::Dead)
        else {
            outcome.not_found.push(id.to_string());
            continue;
        };
        if later_one_runs(state, dead) {
            outcome.blocked.push(id.to_string());
            continue;
        }
        let requeued = state.deliveries.update(id.0, |delivery| {
            delivery.status = DeliveryStatus::Pending;
            delivery.attempts = 0;
            delivery.due_at = now;
            delivery.updated_at = Some(now);
            delivery.requeues = delivery.requeues.saturating_add(1);
            delivery.lease = None;
        });
        if requeued.is_some() {
            outcome.requeued.push(id.to_string());
        }
    }
    Ok(outcome)
}

/// Whether a later delivery of the key of `dead` (held to order) runs now.
fn later_one_runs(state: &State, dead: &Delivery) -> bool {
    let Some((handler, key, sequence)) = dead.ordered() else {
        return false;
    };
    state.deliveries.values().any(|other| {
        other.is_running()
            && other
                .ordered()
                .is_some_and(|(h, k, s)| h == handler && k == key && s > sequence)
    })
}

/// Deletes dead deliveries for good; an event left with none gets its completion time.
pub(super) fn discard(state: &mut State, ids: &[String], now: Timestamp) -> Result<Discarded> {
    let (parsed, not_found) = parse_ids(ids, "discard")?;
    let mut outcome = Discarded {
        not_found,
        ..Discarded::default()
    };
    let mut events = Vec::new();
    for id in parsed {
        let dead = state
            .deliveries
            .get(&id.0)
            .is_some_and(|d| d.status == DeliveryStatus::Dead);
        match dead.then(|| state.deliveries.remove(id.0)).flatten() {
            Some(delivery) => {
                events.push(delivery.event_id);
                outcome.discarded.push(id.to_string());
            }
            None => outcome.not_found.push(id.to_string()),
        }
    }
    let still_referenced: HashSet<String> = state
        .deliveries
        .values()
        .map(|d| d.event_id.clone())
        .collect();
    for event_id in events {
        if !still_referenced.contains(&event_id)
            && let Some(event) = state.events.get_mut(&event_id)
        {
            event.completed_at = event.completed_at.max(Some(now));
        }
    }
    Ok(outcome)
}

/// Buries pending deliveries no claim runs, with `reason` as their error; running ones are
/// reported and left to their worker.
pub(super) fn bury_by_id(
    state: &mut State,
    ids: &[String],
    reason: &str,
    now: Timestamp,
) -> Result<Buried> {
    let (parsed, not_found) = parse_ids(ids, "bury")?;
    super::checks::check_reason(reason)?;
    let error = format!("buried by an operator: {}", clip_error(reason));
    let mut outcome = Buried {
        not_found,
        ..Buried::default()
    };
    for id in parsed {
        match state
            .deliveries
            .get(&id.0)
            .filter(|d| d.status == DeliveryStatus::Pending)
        {
            None => outcome.not_found.push(id.to_string()),
            Some(delivery) if delivery.lease.is_some() => outcome.running.push(id.to_string()),
            Some(_) => {
                state.deliveries.update(id.0, |delivery| {
                    delivery.status = DeliveryStatus::Dead;
                    delivery.remember_error(&error, None, now);
                });
                outcome.buried.push(id.to_string());
            }
        }
    }
    Ok(outcome)
}

/// Deletes dead letters buried before `dead_before` and completion records of completions
/// before `completed_before`, then every event nothing refers to that the options let go: one
/// that completed once when its last completion is before `completed_before`, one that never
/// did when it was created before the earliest cutoff. An event an open transaction adds
/// handlers to is kept.
pub(super) fn purge(state: &mut State, options: &PurgeOptions) -> Purged {
    let mut purged = Purged::default();
    if let Some(cutoff) = options.dead_before {
        let before = state.deliveries.len();
        state.deliveries.retain(|d| {
            !(d.status == DeliveryStatus::Dead && d.updated_at.unwrap_or(d.created_at) < cutoff)
        });
        purged.dead_deliveries = (before - state.deliveries.len()) as u64;
    }
    if let Some(cutoff) = options.completed_before {
        let before = state.completed.len();
        state
            .completed
            .retain(|_, record| record.completed_at.is_none_or(|at| at >= cutoff));
        purged.completion_records = (before - state.completed.len()) as u64;
    }
    let earliest = options.earliest();
    let gone: Vec<String> = {
        let referenced = state.referenced_events();
        state
            .events
            .iter()
            .filter(|(id, _)| !referenced.contains(id.as_str()))
            .filter(|(id, _)| !state.locks.contains_key(&Target::Event((*id).clone())))
            .filter(|(_, event)| match event.completed_at {
                Some(completed) => options
                    .completed_before
                    .is_some_and(|cutoff| completed < cutoff),
                None => earliest.is_some_and(|cutoff| event.envelope.created_at() < cutoff),
            })
            .map(|(id, _)| id.clone())
            .collect()
    };
    for id in &gone {
        state.events.remove(id);
    }
    purged.events = gone.len() as u64;
    if let Some(now) = options.request_keys_expired_at
        && let Some(keys) = state.documents.get_mut(super::IDEMPOTENCY_KEYS)
    {
        let before = keys.len();
        let locks = &state.locks;
        keys.retain(|id, document| {
            let expired = document.value["expires_at"]
                .as_i64()
                .is_none_or(|at| at <= now.timestamp_millis());
            !expired
                || locks.contains_key(&Target::Document(
                    super::IDEMPOTENCY_KEYS.to_owned(),
                    id.clone(),
                ))
        });
        purged.request_keys = (before - keys.len()) as u64;
    }
    purged
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::{MAX_ERROR_HISTORY, memory::claim::MemoryDeliveryId};

    /// The id of a delivery record, read back.
    fn id_of(record: &DeliveryRecord) -> Option<MemoryDeliveryId> {
        MemoryDeliveryId::parse(&record.id)
    }

    fn delivery(id: u64, handler: &str, key: Option<(&str, i64)>) -> Delivery {
        Delivery {
            id,
            event_id: format!("e-{id}"),
            handler: handler.to_owned(),
            event_type: "order.placed.v1".to_owned(),
            key: key.map(|(k, _)| k.to_owned()),
            sequence: key.map(|(_, s)| s),
            unordered: false,
            status: DeliveryStatus::Pending,
            attempts: 0,
            due_at: Timestamp::from_millis(0),
            created_at: Timestamp::from_millis(0),
            updated_at: None,
            last_error: None,
            errors: Vec::new(),
            requeues: 0,
            lease: None,
        }
    }

    #[test]
    fn followers_of_a_key_are_parked_and_listed_as_such() {
        let mut state = State::default();
        for (id, sequence) in [(1, 1), (2, 2), (3, 3)] {
            state
                .deliveries
                .insert(delivery(id, "p", Some(("k", sequence))));
        }
        state.deliveries.insert(delivery(4, "p", None));
        let stats = statistics(&state, false);
        assert_eq!((stats.pending, stats.parked), (4, 2));
        let parked = list_deliveries(
            &state,
            &DeliveryQuery::new().pending_state(PendingState::Parked),
        )
        .unwrap();
        let ids: Vec<_> = parked.iter().filter_map(id_of).collect();
        assert_eq!(ids, [MemoryDeliveryId(2), MemoryDeliveryId(3)]);
    }

    #[test]
    fn the_error_history_keeps_the_last_ten() {
        let mut d = delivery(1, "p", None);
        for n in 0..15 {
            d.fail(&format!("error {n}"), Timestamp::from_millis(n));
        }
        assert_eq!(d.errors.len(), MAX_ERROR_HISTORY);
        assert_eq!(d.errors[0].error, "error 5");
        assert_eq!(d.attempts, 15);
        assert_eq!(d.last_error.as_deref(), Some("error 14"));
    }
}
