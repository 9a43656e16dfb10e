//! The pending and dead deliveries, with the two orders a claim reads: pending deliveries by
//! `(due time, id)`, and the pending sequences of each key held to order. A claim walks the
//! first from its start and stops at the first delivery not yet due, so its cost follows what
//! it hands out and passes over, not the size of the backlog.
//!
//! Reads go through `Deref` to the map by id; every change goes through a method here, which
//! keeps both orders in step.

use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    ops::Deref,
};

use super::state::Delivery;
use crate::{store::DeliveryStatus, time::Timestamp};

/// Deliveries by id (creation order), and what claims read them by.
#[derive(Debug, Default)]
pub(super) struct Deliveries {
    by_id: BTreeMap<u64, Delivery>,
    /// Every pending delivery, as `(due_at, id)`.
    due: BTreeSet<(Timestamp, u64)>,
    /// The pending sequences of each handler and key held to order.
    keys: HashMap<String, HashMap<String, BTreeSet<i64>>>,
}

impl Deref for Deliveries {
    type Target = BTreeMap<u64, Delivery>;

    fn deref(&self) -> &Self::Target {
        &self.by_id
    }
}

impl Deliveries {
    /// Adds or replaces a delivery.
    pub(super) fn insert(&mut self, delivery: Delivery) {
        if let Some(old) = self.by_id.remove(&delivery.id) {
            self.unindex(&old);
        }
        self.index(&delivery);
        self.by_id.insert(delivery.id, delivery);
    }

    /// Removes a delivery.
    pub(super) fn remove(&mut self, id: u64) -> Option<Delivery> {
        let delivery = self.by_id.remove(&id)?;
        self.unindex(&delivery);
        Some(delivery)
    }

    /// Changes a delivery with `change`, and files it again where it now belongs.
    pub(super) fn update<R>(
        &mut self,
        id: u64,
        change: impl FnOnce(&mut Delivery) -> R,
    ) -> Option<R> {
        let mut delivery = self.by_id.remove(&id)?;
        self.unindex(&delivery);
        let result = change(&mut delivery);
        self.index(&delivery);
        self.by_id.insert(id, delivery);
        Some(result)
    }

    /// Changes every delivery's lease with `change` (leases are in neither order).
    pub(super) fn update_leases(&mut self, mut change: impl FnMut(&mut Delivery)) {
        for delivery in self.by_id.values_mut() {
            let (status, due_at) = (delivery.status, delivery.due_at);
            change(delivery);
            debug_assert!(status == delivery.status && due_at == delivery.due_at);
        }
    }

    /// Keeps only the deliveries `keep` says yes to.
    pub(super) fn retain(&mut self, mut keep: impl FnMut(&Delivery) -> bool) {
        let gone: Vec<u64> = self
            .by_id
            .values()
            .filter(|delivery| !keep(delivery))
            .map(|delivery| delivery.id)
            .collect();
        for id in gone {
            self.remove(id);
        }
    }

    /// The pending deliveries due by `now`, in `(due time, id)` order.
    pub(super) fn due_by(&self, now: Timestamp) -> impl Iterator<Item = &Delivery> + '_ {
        self.due
            .range(..=(now, u64::MAX))
            .filter_map(|(_, id)| self.by_id.get(id))
    }

    /// The lowest pending sequence of `handler` and `key`, among deliveries held to order.
    pub(super) fn head(&self, handler: &str, key: &str) -> Option<i64> {
        self.keys
            .get(handler)?
            .get(key)
            .and_then(|sequences| sequences.first().copied())
    }

    fn index(&mut self, delivery: &Delivery) {
        if delivery.status != DeliveryStatus::Pending {
            return;
        }
        self.due.insert((delivery.due_at, delivery.id));
        if let Some((handler, key, sequence)) = delivery.ordered() {
            self.keys
                .entry(handler.to_owned())
                .or_default()
                .entry(key.to_owned())
                .or_default()
                .insert(sequence);
        }
    }

    fn unindex(&mut self, delivery: &Delivery) {
        if delivery.status != DeliveryStatus::Pending {
            return;
        }
        self.due.remove(&(delivery.due_at, delivery.id));
        if let Some((handler, key, sequence)) = delivery.ordered() {
            let Some(keys) = self.keys.get_mut(handler) else {
                return;
            };
            if let Some(sequences) = keys.get_mut(key) {
                sequences.remove(&sequence);
                if sequences.is_empty() {
                    keys.remove(key);
                }
            }
            if keys.is_empty() {
                self.keys.remove(handler);
            }
        }
    }
}
