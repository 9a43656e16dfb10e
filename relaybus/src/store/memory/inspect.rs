//! What the operator page reads besides counts and listings: one event with its deliveries,
//! who holds leases with the keys held back, and dead letters grouped by error.

use std::{cmp::Reverse, collections::BTreeMap};

use super::state::State;
use crate::{
    store::{
        BlockedKey, DeadLetterGroup, DeliveryRecord, DeliveryStatus, EventDetail, LaneReport,
        LaneStatus, MAX_BLOCKED_KEYS, MAX_DEAD_LETTER_GROUPS,
    },
    time::Timestamp,
};

/// The event with every delivery and completion record, in handler order.
pub(super) fn event_detail(state: &State, event_id: &str) -> Option<EventDetail> {
    let event = state.events.get(event_id)?;
    let heads = state.heads();
    let mut deliveries: Vec<DeliveryRecord> = state
        .deliveries
        .values()
        .filter(|d| d.event_id == event_id)
        .map(|d| d.record(d.is_parked(&heads)))
        .chain(
            state
                .completed
                .values()
                .filter(|r| r.event_id == event_id)
                .cloned(),
        )
        .collect();
    deliveries.sort_by(|a, b| a.handler.cmp(&b.handler).then(a.id.cmp(&b.id)));
    let finished = deliveries
        .iter()
        .all(|d| d.status == DeliveryStatus::Completed);
    Some(EventDetail {
        event: event.envelope.clone(),
        sequence: event.sequence,
        completed_at: event.completed_at.filter(|_| finished),
        handlers: event.handlers.clone(),
        deliveries,
    })
}

/// One entry per owner holding leases (numbered from 0 in owner order, with the handed-back
/// leases under no owner last): the memory store leases deliveries, not lanes. Then the keys
/// with parked deliveries, the most parked first, with what they wait for: their head.
pub(super) fn lanes(state: &State) -> LaneReport {
    LaneReport {
        lanes: holders(state),
        blocked: blocked_keys(state),
    }
}

/// Who holds leases: the owner (`None`: handed back), how many running deliveries, and the
/// latest expiry of their leases.
#[derive(Debug, Default)]
struct Holder {
    in_flight: u32,
    expires_at: Option<Timestamp>,
}

/// One entry per owner holding leases, in owner order, then the handed-back leases.
fn holders(state: &State) -> Vec<LaneStatus> {
    // Keyed by (handed back, owner): the owners first, in name order.
    let mut holders: BTreeMap<(bool, Option<&str>), Holder> = BTreeMap::new();
    for delivery in state.deliveries.values() {
        let Some(held) = delivery.lease.as_ref().filter(|_| delivery.is_running()) else {
            continue;
        };
        let owner = (!held.handed_back).then_some(held.owner.as_str());
        let holder = holders.entry((held.handed_back, owner)).or_default();
        holder.in_flight = holder.in_flight.saturating_add(1);
        holder.expires_at = holder.expires_at.max(Some(held.expires_at));
    }
    holders
        .into_iter()
        .enumerate()
        .map(|(number, ((handed_back, owner), holder))| {
            let mut lane = LaneStatus::new(u32::try_from(number).unwrap_or(u32::MAX));
            lane.owner = owner.map(str::to_owned);
            lane.lease_expires_at = holder.expires_at.filter(|_| !handed_back);
            lane.in_flight = holder.in_flight;
            lane
        })
        .collect()
}

/// The parked deliveries of one handler and key.
#[derive(Debug)]
struct Parked {
    count: u64,
    first: i64,
}

/// The keys with parked deliveries, the most parked first (then by handler and key), with
/// what they wait for: their head.
fn blocked_keys(state: &State) -> Vec<BlockedKey> {
    let heads = state.heads();
    let mut parked: BTreeMap<(&str, &str), Parked> = BTreeMap::new();
    for delivery in state.deliveries.values() {
        if !delivery.is_parked(&heads) {
            continue;
        }
        if let Some((handler, key, sequence)) = delivery.ordered() {
            let entry = parked.entry((handler, key)).or_insert(Parked {
                count: 0,
                first: sequence,
            });
            entry.count += 1;
            entry.first = entry.first.min(sequence);
        }
    }
    let mut groups: Vec<_> = parked.into_iter().collect();
    // Stable: equal counts stay in handler and key order.
    groups.sort_by_key(|(_, parked)| Reverse(parked.count));
    groups.truncate(MAX_BLOCKED_KEYS);
    groups
        .into_iter()
        .map(|((handler, key), parked)| {
            let head = heads.get(&(handler, key)).copied();
            let waiting_for = state
                .deliveries
                .values()
                .find(|d| {
                    d.status == DeliveryStatus::Pending
                        && d.ordered()
                            .is_some_and(|(h, k, s)| h == handler && k == key && Some(s) == head)
                })
                .map(|d| d.record(false));
            BlockedKey {
                handler: handler.to_owned(),
                key: key.to_owned(),
                parked: parked.count,
                first_parked_sequence: Some(parked.first),
                waiting_for,
            }
        })
        .collect()
}

/// Dead letters grouped by handler and last error, the largest groups first (then by handler
/// and error), at most [`MAX_DEAD_LETTER_GROUPS`]; only `handler`'s when given.
pub(super) fn dead_letter_groups(state: &State, handler: Option<&str>) -> Vec<DeadLetterGroup> {
    let mut groups: BTreeMap<(&str, Option<&str>), DeadLetterGroup> = BTreeMap::new();
    for delivery in state.deliveries.values() {
        if delivery.status != DeliveryStatus::Dead
            || handler.is_some_and(|wanted| wanted != delivery.handler)
        {
            continue;
        }
        let record = delivery.record(false);
        let group = groups
            .entry((&delivery.handler, delivery.last_error.as_deref()))
            .or_insert_with(|| DeadLetterGroup {
                handler: delivery.handler.clone(),
                error: delivery.last_error.clone(),
                count: 0,
                first_created_at: record.created_at,
                last_updated_at: record.updated_at,
                // Deliveries are visited in id order: the first is the lowest id.
                sample_id: record.id.clone(),
            });
        group.count += 1;
        group.first_created_at = group.first_created_at.min(record.created_at);
        group.last_updated_at = group.last_updated_at.max(record.updated_at);
    }
    let mut groups: Vec<DeadLetterGroup> = groups.into_values().collect();
    // Stable: equal counts stay in handler and error order.
    groups.sort_by_key(|group| Reverse(group.count));
    groups.truncate(MAX_DEAD_LETTER_GROUPS);
    groups
}
