//! What an append does per key: the keys' sequence numbers taken and given back, and the
//! deliveries written parked behind a pending predecessor of their key.

use std::collections::{HashMap, hash_map::Entry};

use futures::TryStreamExt;
use mongodb::{
    ClientSession,
    bson::{Bson, Document, doc},
    options::ReturnDocument,
};

use super::super::{
    MongoEventStore,
    key_gate::{KeysBusy, KeysTaken},
    schema::{field, lane, status},
    sessions::session_key,
};
use super::{Item, Stored, bson_i64, check_write_reply};
use crate::error::{DatabaseError, Result};
use crate::store::transaction;

/// Keys one read of [`MongoEventStore::park_born_behind`] looks up.
const BORN_PARKED_KEYS_PER_READ: usize = 1_000;

/// Reads one append makes at most to find the keys whose new deliveries wait.
const BORN_PARKED_READS: usize = 5;

impl MongoEventStore {
    /// Writes to the parked lane the new keyed deliveries that wait behind a pending
    /// predecessor: of the deliveries of new events (`created`), every delivery of a handler and
    /// key but the lowest, and, with `park_behind_pending`, the lowest when the store holds a
    /// pending delivery of the same handler and key, whose sequence number is lower (the
    /// numbers were just taken): one read, of the keys' counters with their pending deliveries
    /// looked up, for up to [`BORN_PARKED_KEYS_PER_READ`] keys. A claim would park them once it
    /// found them waiting; written parked, they cost no write of their own. Unparking is
    /// level-triggered (see `park`): a delivery written parked whose predecessor completes
    /// before this transaction commits goes back to its lane with the next claim.
    pub(super) async fn park_born_behind(
        &self,
        session: &mut ClientSession,
        deliveries: &mut [Document],
        created: &[bool],
    ) -> Result<()> {
        if self.inner.park_threshold == u32::MAX {
            // Parking is off.
            return Ok(());
        }
        // The lowest sequence number of each handler and key, and where it is.
        let mut lowest: HashMap<(&str, &str), (i64, usize)> = HashMap::new();
        let mut behind = Vec::new();
        for (index, delivery) in deliveries.iter().enumerate() {
            let (true, Ok(handler), Ok(key), Ok(sequence)) = (
                created[index],
                delivery.get_str(field::HANDLER),
                delivery.get_str(field::KEY),
                delivery.get_i64(field::SEQUENCE),
            ) else {
                continue;
            };
            if delivery.get_bool(field::UNORDERED) == Ok(true) {
                continue;
            }
            match lowest.entry((handler, key)) {
                Entry::Vacant(entry) => {
                    entry.insert((sequence, index));
                }
                Entry::Occupied(mut entry) => {
                    let (low, at) = *entry.get();
                    if sequence < low {
                        behind.push(at);
                        entry.insert((sequence, index));
                    } else {
                        behind.push(index);
                    }
                }
            }
        }
        if self.inner.park_behind_pending {
            self.look_up_pending(session, &lowest, &mut behind).await?;
        }
        if !behind.is_empty() {
            // Lane reads of this instance look for parked deliveries again (see `ParkedLookup`).
            self.inner.claims.note_parking();
        }
        for index in behind {
            deliveries[index].insert(field::LANE, lane::PARKED);
        }
        Ok(())
    }

    /// Adds to `behind` the index of each of the `lowest` new deliveries of a handler and key
    /// for which a delivery of the same handler and key is pending: one read per
    /// [`BORN_PARKED_KEYS_PER_READ`] keys, [`BORN_PARKED_READS`] at most.
    pub(super) async fn look_up_pending(
        &self,
        session: &mut ClientSession,
        lowest: &HashMap<(&str, &str), (i64, usize)>,
        behind: &mut Vec<usize>,
    ) -> Result<()> {
        let mut keys: Vec<&str> = lowest.keys().map(|(_, key)| *key).collect();
        keys.sort_unstable();
        keys.dedup();
        let mut handlers: Vec<&str> = lowest.keys().map(|(handler, _)| *handler).collect();
        handlers.sort_unstable();
        handlers.dedup();
        for chunk in keys
            .chunks(BORN_PARKED_KEYS_PER_READ)
            .take(BORN_PARKED_READS)
        {
            let mut pipeline = vec![doc! { "$match": { field::ID: { "$in": chunk } } }];
            for (at, handler) in handlers.iter().enumerate() {
                pipeline.push(doc! { "$lookup": {
                    "from": self.inner.deliveries.name(),
                    "localField": field::ID,
                    "foreignField": field::KEY,
                    "pipeline": [
                        { "$match": { field::STATUS: status::PENDING, field::HANDLER: *handler } },
                        { "$limit": 1 },
                        { "$project": { field::ID: 1 } },
                    ],
                    "as": format!("h{at}"),
                } });
            }
            let found: Vec<Document> = self
                .inner
                .key_sequences
                .aggregate(pipeline)
                .session(&mut *session)
                .await?
                .stream(&mut *session)
                .try_collect()
                .await?;
            for doc in &found {
                let Ok(key) = doc.get_str(field::ID) else {
                    continue;
                };
                for (at, handler) in handlers.iter().enumerate() {
                    let waits = doc
                        .get_array(format!("h{at}"))
                        .is_ok_and(|pending| !pending.is_empty());
                    if waits && let Some((_, index)) = lowest.get(&(*handler, key)) {
                        behind.push(*index);
                    }
                }
            }
        }
        Ok(())
    }

    /// Takes the in-process gates of `per_key`'s keys before their counters are written (see
    /// `key_gate`): an attempt that finds one taken by another transaction of this instance
    /// gives up with a transient error, and its next attempt waits for the key before it
    /// starts.
    pub(super) fn take_key_gates(
        &self,
        session: &ClientSession,
        per_key: &[(&str, i64)],
    ) -> Result<()> {
        if per_key.is_empty() {
            return Ok(());
        }
        let Some(id) = session_key(session.id()) else {
            return Ok(());
        };
        let keys: Vec<&str> = per_key.iter().map(|(key, _)| *key).collect();
        let may_queue = transaction::queues_on_keys();
        match self.inner.key_gates.take(&id, &keys, may_queue) {
            Ok(()) => Ok(()),
            Err(KeysBusy(keys)) => {
                transaction::note_contended_keys(keys.iter().cloned());
                Err(DatabaseError::new(KeysTaken(keys))
                    .with_transient(true)
                    .into())
            }
        }
    }

    /// Takes `count` sequence numbers from the counter of each key, returning the value each
    /// counter had before: the numbers taken are `base + 1 ..= base + count`.
    pub(super) async fn take_sequences<'k>(
        &self,
        session: &mut ClientSession,
        per_key: &[(&'k str, i64)],
    ) -> Result<HashMap<&'k str, i64>> {
        let inner = &self.inner;
        let mut base = HashMap::with_capacity(per_key.len());
        match per_key {
            [] => {}
            [(key, count)] => {
                let counter = inner
                    .key_sequences
                    .find_one_and_update(
                        doc! { field::ID: *key },
                        doc! { "$inc": { field::VALUE: *count } },
                    )
                    .upsert(true)
                    .return_document(ReturnDocument::After)
                    .session(&mut *session)
                    .await?;
                let value = counter
                    .as_ref()
                    .and_then(|c| c.get(field::VALUE).and_then(bson_i64))
                    .unwrap_or(*count);
                base.insert(*key, value - count);
            }
            _ => {
                let updates: Vec<Document> = per_key
                    .iter()
                    .map(|(key, count)| {
                        doc! { "q": { field::ID: *key }, "u": { "$inc": { field::VALUE: *count } }, "upsert": true }
                    })
                    .collect();
                let reply = inner
                    .db
                    .run_command(doc! { "update": inner.key_sequences.name(), "updates": updates })
                    .session(&mut *session)
                    .await?;
                check_write_reply(&reply)?;
                let keys: Vec<&str> = per_key.iter().map(|(k, _)| *k).collect();
                let counters: Vec<Document> = inner
                    .key_sequences
                    .find(doc! { field::ID: { "$in": &keys } })
                    .session(&mut *session)
                    .await?
                    .stream(&mut *session)
                    .try_collect()
                    .await?;
                for (key, count) in per_key {
                    let value = counters
                        .iter()
                        .find(|c| c.get_str(field::ID) == Ok(*key))
                        .and_then(|c| c.get(field::VALUE).and_then(bson_i64))
                        .unwrap_or(*count);
                    base.insert(*key, value - count);
                }
            }
        }
        Ok(base)
    }

    /// Reads what the store holds of the events with these ids.
    pub(super) async fn read_stored(
        &self,
        session: &mut ClientSession,
        ids: &[&str],
    ) -> Result<HashMap<String, Stored>> {
        let mut stored = HashMap::with_capacity(ids.len());
        let mut cursor = self
            .inner
            .events
            .find(doc! { field::ID: { "$in": ids } })
            .projection(
                doc! { field::HANDLERS: 1, field::TYPE: 1, field::KEY: 1, field::SEQUENCE: 1 },
            )
            .session(&mut *session)
            .await?;
        while let Some(found) = cursor.next(&mut *session).await.transpose()? {
            let Some(Bson::String(id)) = found.get(field::ID) else {
                continue;
            };
            let handlers = found
                .get_array(field::HANDLERS)
                .map(|list| {
                    list.iter()
                        .filter_map(|h| h.as_str().map(str::to_owned))
                        .collect()
                })
                .unwrap_or_default();
            stored.insert(
                id.clone(),
                Stored {
                    handlers,
                    event_type: found.get_str(field::TYPE).unwrap_or_default().to_owned(),
                    key: found.get_str(field::KEY).ok().map(str::to_owned),
                    sequence: found.get(field::SEQUENCE).and_then(bson_i64),
                },
            );
        }
        Ok(stored)
    }

    /// Events that existed already took sequence numbers they do not use: number the new events
    /// of those keys again from the counter's old value and set the counter back, so that
    /// duplicates leave no gap. This transaction holds the counters, so nobody took a number
    /// meanwhile.
    pub(super) async fn give_back_sequences(
        &self,
        session: &mut ClientSession,
        items: &mut [Item<'_>],
        created: &[bool],
        per_key: &[(&str, i64)],
        base: &HashMap<&str, i64>,
    ) -> Result<()> {
        let inner = &self.inner;
        let mut counter_updates = Vec::new();
        let mut event_updates = Vec::new();
        for (key, count) in per_key {
            let mut next = base[key];
            let mut used = 0;
            for (item, created) in items.iter_mut().zip(created) {
                if !*created || item.event.key.as_deref() != Some(*key) {
                    continue;
                }
                next += 1;
                used += 1;
                if item.sequence != Some(next) {
                    item.sequence = Some(next);
                    event_updates.push(doc! {
                        "q": { field::ID: &item.event.id },
                        "u": { "$set": { field::SEQUENCE: next } },
                    });
                }
            }
            if used < *count {
                counter_updates.push(doc! {
                    "q": { field::ID: *key },
                    "u": { "$inc": { field::VALUE: used - count } },
                });
            }
        }
        for (collection, updates) in [
            (inner.key_sequences.name(), counter_updates),
            (inner.events.name(), event_updates),
        ] {
            if updates.is_empty() {
                continue;
            }
            let reply = inner
                .db
                .run_command(doc! { "update": collection, "updates": updates })
                .session(&mut *session)
                .await?;
            check_write_reply(&reply)?;
        }
        Ok(())
    }
}
