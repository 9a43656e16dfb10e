//! The limits of the in-memory store: slots and start counters in a map of their own, shared by
//! the store's clones (every bus of the store).

use std::{
    collections::HashMap,
    sync::{Mutex, MutexGuard, PoisonError},
};

use super::MemoryEventStore;
use crate::{
    error::Result,
    store::{Limits, Slot, SlotRequest, StartsRequest, rate_window},
    time::Timestamp,
};

/// The slots held, by handler and index, with holder and expiry; the start counter of each
/// rate-limited handler, with its window's start.
#[derive(Debug, Default)]
pub(super) struct LimitState {
    slots: HashMap<(String, u32), (String, Timestamp)>,
    starts: HashMap<String, (i64, u64)>,
}

impl MemoryEventStore {
    fn limits(&self) -> MutexGuard<'_, LimitState> {
        // Every step below checks before it writes: a poisoned lock holds whole state.
        self.inner
            .limits
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }
}

/// The limit state of a new store.
pub(super) fn new_state() -> Mutex<LimitState> {
    Mutex::new(LimitState::default())
}

impl Limits for MemoryEventStore {
    async fn take_slot(&self, request: SlotRequest<'_>) -> Result<Option<Slot>> {
        let mut state = self.limits();
        let free = (0..request.limit).find(|index| {
            state
                .slots
                .get(&(request.handler.to_owned(), *index))
                .is_none_or(|(_, expires_at)| *expires_at <= request.now)
        });
        Ok(free.map(|index| {
            let slot = Slot::taken(request.handler, index, request.owner);
            state.slots.insert(
                (slot.handler.clone(), index),
                (
                    slot.holder.clone(),
                    request.now.saturating_add(request.lease_duration),
                ),
            );
            slot
        }))
    }

    async fn renew_slots(&self, slots: &[Slot], until: Timestamp) -> Result<usize> {
        let mut state = self.limits();
        let mut renewed = 0;
        for slot in slots {
            if let Some((holder, expires_at)) =
                state.slots.get_mut(&(slot.handler.clone(), slot.index))
                && *holder == slot.holder
            {
                *expires_at = until;
                renewed += 1;
            }
        }
        Ok(renewed)
    }

    async fn give_back_slot(&self, slot: &Slot) -> Result<bool> {
        let mut state = self.limits();
        let key = (slot.handler.clone(), slot.index);
        if state
            .slots
            .get(&key)
            .is_some_and(|(holder, _)| *holder == slot.holder)
        {
            state.slots.remove(&key);
            return Ok(true);
        }
        Ok(false)
    }

    async fn take_starts(&self, request: StartsRequest<'_>) -> Result<(u32, Timestamp)> {
        let (start, end) = rate_window(request.interval, request.now);
        let mut state = self.limits();
        let counter = state
            .starts
            .entry(request.handler.to_owned())
            .or_insert((start, 0));
        if counter.0 < start {
            *counter = (start, 0);
        }
        let granted =
            u64::from(request.wanted).min(u64::from(request.rate).saturating_sub(counter.1));
        counter.1 += granted;
        Ok((granted as u32, end))
    }
}
