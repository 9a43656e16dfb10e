//! The limits of the MongoDB store, kept in `<prefix>processes` beside the gauge leads: one
//! document per slot of a handler's global concurrency (`slot:<handler>#<index>`, with its
//! holder and expiry) and one per rate-limited handler (`rate:<handler>`, with its window and
//! count). Each write is a conditional single-document write, so no transaction is needed.

use std::collections::HashSet;

use futures::TryStreamExt;
use mongodb::{
    bson::{Bson, doc},
    options::ReturnDocument,
};
use rand::seq::SliceRandom;

use super::{MongoEventStore, bson_date, error_code, schema::field};
use crate::{
    error::Result,
    store::{Limits, Slot, SlotRequest, StartsRequest, rate_window},
    time::Timestamp,
};

/// `DuplicateKey`: an upsert met a document another writer holds.
const DUPLICATE_KEY: i32 = 11000;
/// How many free slots one take tries before it reports none free.
const TRIES: usize = 3;
/// The fields of a start counter.
const WINDOW: &str = "window";
const COUNT: &str = "count";
const GRANTED: &str = "granted";
/// The count before this write, while the write runs.
const BEFORE: &str = "before";

impl Limits for MongoEventStore {
    /// One read of the held slots, then a conditional upsert of a free one (at random, so that
    /// buses taking at once spread over the free slots); a slot another bus took in between
    /// answers with a duplicate key, and the next free one is tried.
    async fn take_slot(&self, request: SlotRequest<'_>) -> Result<Option<Slot>> {
        let processes = &self.inner.processes;
        let now = bson_date(request.now);
        let ids: Vec<String> = (0..request.limit)
            .map(|index| Slot::document_id(request.handler, index))
            .collect();
        let held: HashSet<String> = processes
            .find(doc! { field::ID: { "$in": &ids }, field::EXPIRES_AT: { "$gt": now } })
            .projection(doc! { field::ID: 1 })
            .await?
            .try_collect::<Vec<_>>()
            .await?
            .into_iter()
            .filter_map(|held| held.get_str(field::ID).ok().map(str::to_owned))
            .collect();
        let mut free: Vec<u32> = (0..request.limit)
            .filter(|index| !held.contains(&ids[*index as usize]))
            .collect();
        free.shuffle(&mut rand::rng());
        let expires_at = bson_date(request.now.saturating_add(request.lease_duration));
        for index in free.into_iter().take(TRIES) {
            let slot = Slot::taken(request.handler, index, request.owner);
            let taken = processes
                .update_one(
                    doc! { field::ID: &ids[index as usize], field::EXPIRES_AT: { "$lte": now } },
                    doc! { "$set": {
                        field::HOLDER: &slot.holder,
                        field::OWNER: request.owner,
                        field::EXPIRES_AT: expires_at,
                    } },
                )
                .upsert(true)
                .await;
            match taken {
                Ok(_) => return Ok(Some(slot)),
                Err(error) if error_code(&error) == Some(DUPLICATE_KEY) => continue,
                Err(error) => return Err(error.into()),
            }
        }
        Ok(None)
    }

    async fn renew_slots(&self, slots: &[Slot], until: Timestamp) -> Result<usize> {
        if slots.is_empty() {
            return Ok(0);
        }
        let held: Vec<_> = slots
            .iter()
            .map(|slot| {
                doc! {
                    field::ID: Slot::document_id(&slot.handler, slot.index),
                    field::HOLDER: &slot.holder,
                }
            })
            .collect();
        let renewed = self
            .inner
            .processes
            .update_many(
                doc! { "$or": held },
                doc! { "$set": { field::EXPIRES_AT: bson_date(until) } },
            )
            .await?;
        Ok(renewed.matched_count as usize)
    }

    async fn give_back_slot(&self, slot: &Slot) -> Result<bool> {
        let deleted = self
            .inner
            .processes
            .delete_one(doc! {
                field::ID: Slot::document_id(&slot.handler, slot.index),
                field::HOLDER: &slot.holder,
            })
            .await?;
        Ok(deleted.deleted_count == 1)
    }

    /// One pipeline upsert of `rate:<handler>`: a newer window starts the count afresh, the
    /// current one (or an older one, from a bus whose clock is behind) adds what it grants;
    /// `granted` keeps what this write granted.
    async fn take_starts(&self, request: StartsRequest<'_>) -> Result<(u32, Timestamp)> {
        let StartsRequest {
            handler,
            wanted,
            rate,
            interval,
            now,
        } = request;
        let (start, end) = rate_window(interval, now);
        let window = format!("${WINDOW}");
        let before = format!("${BEFORE}");
        let granted = format!("${GRANTED}");
        let update = vec![
            doc! { "$set": { BEFORE: { "$cond": [
                { "$gte": [&window, start] },
                { "$ifNull": [format!("${COUNT}"), 0_i64] },
                0_i64,
            ] } } },
            doc! { "$set": { GRANTED: { "$min": [
                i64::from(wanted),
                { "$max": [0_i64, { "$subtract": [i64::from(rate), &before] }] },
            ] } } },
            doc! { "$set": {
                COUNT: { "$add": [&before, &granted] },
                WINDOW: { "$max": [&window, start] },
            } },
            doc! { "$unset": BEFORE },
        ];
        let mut tries = 0;
        let counter = loop {
            tries += 1;
            let counted = self
                .inner
                .processes
                .find_one_and_update(
                    doc! { field::ID: format!("rate:{handler}") },
                    update.clone(),
                )
                .upsert(true)
                .return_document(ReturnDocument::After)
                .await;
            match counted {
                Ok(counter) => break counter,
                // Two buses created the counter at once; the other one did: count again.
                Err(error) if error_code(&error) == Some(DUPLICATE_KEY) && tries < 3 => {}
                Err(error) => return Err(error.into()),
            }
        };
        let granted = match counter.as_ref().and_then(|c| c.get(GRANTED)) {
            Some(Bson::Int64(n)) => *n,
            Some(Bson::Int32(n)) => i64::from(*n),
            _ => 0,
        };
        Ok((u32::try_from(granted).unwrap_or(0), end))
    }
}
