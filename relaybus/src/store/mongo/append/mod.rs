//! Appending events and their deliveries inside the caller's transaction.

mod keys;

use std::collections::{HashMap, HashSet};

use mongodb::{
    ClientSession,
    bson::{Bson, DateTime, Document, RawDocumentBuf, doc, oid::ObjectId},
    error::{CommandError, ErrorKind},
};

use super::{
    MongoEventStore,
    bson_json::object_to_document,
    schema::{FRESH_BY, field, lane, status},
};
use crate::store::{AppendRequest, Appended};
use crate::{
    error::{EventValidationError, Result},
    event::{EventEnvelope, lane_of},
};

/// MongoDB's largest document, in bytes.
pub(crate) const MAX_DOCUMENT_BYTES: usize = 16 * 1024 * 1024;

/// An event as this append sees it: the envelope and the handlers asked for.
struct Item<'a> {
    event: &'a EventEnvelope,
    handlers: Vec<&'a str>,
    /// The handlers among them whose deliveries ignore the key: those that every request of
    /// the event named unordered.
    unordered: Vec<&'a str>,
    document: Document,
    sequence: Option<i64>,
    /// When its new deliveries are due, if not at the append's time.
    due_at: Option<DateTime>,
}

/// What the store already holds of an event.
struct Stored {
    handlers: HashSet<String>,
    event_type: String,
    key: Option<String>,
    sequence: Option<i64>,
}

impl MongoEventStore {
    /// Appends events and their deliveries in the transaction of `session`.
    ///
    /// Each event gets one delivery per handler in its request that the event never had a
    /// delivery for. An event id the store already holds is not written again: a retried publish
    /// or a redelivered message adds only the deliveries of handlers that are new to the event,
    /// so a handler that completed never runs twice for it. A keyed event takes the next
    /// sequence number of its key in the same transaction; sequence order is commit order.
    ///
    /// The delivery of a keyed event for a handler its request names
    /// [unordered](AppendRequest::unordered) (an added handler of a known event included) keeps
    /// the key and sequence, is marked `unordered: true` and goes to the lane of the event id:
    /// claims treat it as unkeyed. An event named twice in one batch gets an unordered delivery
    /// only for the handlers both requests name unordered.
    ///
    /// `now` is the time the deliveries become due and are recorded as created.
    ///
    /// # Errors
    ///
    /// - [`ConfigurationError::NoTransaction`](crate::ConfigurationError::NoTransaction) when
    ///   `session` has no started transaction; nothing is written.
    /// - [`EventValidationError::IdReused`] when an event id names an event of another type,
    ///   earlier in the batch (nothing is written) or in the store (found inside the
    ///   transaction, which must then be aborted).
    /// - [`EventValidationError::TooLarge`] when an event document would exceed 16 MiB;
    ///   [`ConfigurationError::InvalidHandlerId`](crate::ConfigurationError::InvalidHandlerId)
    ///   for a malformed handler id. Both are checked before anything is written.
    /// - [`Error::Database`](crate::Error::Database), for example a write conflict with a
    ///   concurrent append of the same key or id; it carries the `TransientTransactionError`
    ///   label, and the transaction helpers run the whole transaction again.
    pub async fn append(
        &self,
        session: &mut ClientSession,
        events: &[AppendRequest<'_>],
        now: DateTime,
    ) -> Result<Vec<Appended>> {
        let items = prepare(events)?;
        self.ensure_in_transaction(session, "MongoEventStore.append")
            .await?;
        self.append_prepared(session, items, now).await
    }

    /// Appends with a session known to be in a transaction (the bus's own).
    pub(crate) async fn append_in_transaction(
        &self,
        session: &mut ClientSession,
        events: &[AppendRequest<'_>],
        now: DateTime,
    ) -> Result<Vec<Appended>> {
        self.append_prepared(session, prepare(events)?, now).await
    }

    async fn append_prepared(
        &self,
        session: &mut ClientSession,
        mut items: Vec<Item<'_>>,
        now: DateTime,
    ) -> Result<Vec<Appended>> {
        if items.is_empty() {
            return Ok(Vec::new());
        }
        let inner = &self.inner;

        // 1. Sequences for every keyed event, taken from each key's counter. An event that turns
        //    out to exist gives its number back below, so the common path (new events) costs no
        //    read before the writes.
        let mut per_key: Vec<(&str, i64)> = Vec::new();
        for item in &items {
            if let Some(key) = item.event.key.as_deref() {
                match per_key.iter_mut().find(|(k, _)| *k == key) {
                    Some((_, n)) => *n += 1,
                    None => per_key.push((key, 1)),
                }
            }
        }
        self.take_key_gates(session, &per_key)?;
        let base = self.take_sequences(session, &per_key).await?;
        let mut last: HashMap<&str, i64> = base.clone();
        for item in &mut items {
            if let Some(key) = item.event.key.as_deref() {
                let slot = last.get_mut(key).expect("every key was counted");
                *slot += 1;
                item.sequence = Some(*slot);
                insert_after(
                    &mut item.document,
                    field::KEY,
                    field::SEQUENCE,
                    Bson::Int64(*slot),
                );
            }
        }

        // A new event created just now is fresh: the first completions of the deliveries
        // appended with it need not stamp it (see `field::FRESH`).
        let fresh_by = u64::try_from(FRESH_BY.as_millis()).unwrap_or(u64::MAX);
        for item in &mut items {
            let created = item.event.created_at.timestamp_millis();
            if now.timestamp_millis().abs_diff(created) <= fresh_by {
                item.document.insert(field::FRESH, true);
            }
        }

        // 2. Every event upserted in one command. An id that exists is left as it is; one
        //    inserted meanwhile by a concurrent transaction makes this a write conflict, which
        //    restarts the transaction, instead of a duplicate-key error, which would not.
        let upserts: Vec<Document> = items
            .iter()
            .map(|item| {
                doc! {
                    "q": { field::ID: &item.event.id },
                    "u": { "$setOnInsert": &item.document },
                    "upsert": true,
                }
            })
            .collect();
        let reply = inner
            .db
            .run_command(
                doc! { "update": inner.events.name(), "updates": upserts, "ordered": true },
            )
            .session(&mut *session)
            .await?;
        check_write_reply(&reply)?;
        let mut created = vec![false; items.len()];
        if let Ok(upserted) = reply.get_array("upserted") {
            for entry in upserted {
                let index = entry
                    .as_document()
                    .and_then(|e| e.get("index"))
                    .and_then(bson_i64);
                if let Some(flag) = index.and_then(|i| created.get_mut(i as usize)) {
                    *flag = true;
                }
            }
        }

        // 3. Events the store held already: read them, give back the sequence numbers they took,
        //    and extend them with the handlers they never had.
        let mut stored: HashMap<String, Stored> = HashMap::new();
        if created.iter().any(|c| !c) {
            let known: Vec<&str> = items
                .iter()
                .zip(&created)
                .filter(|(_, created)| !**created)
                .map(|(item, _)| item.event.id.as_str())
                .collect();
            stored = self.read_stored(session, &known).await?;
            check_types(&items, &created, &stored)?;
            self.give_back_sequences(session, &mut items, &created, &per_key, &base)
                .await?;
            let extend: Vec<Document> = items
                .iter()
                .zip(&created)
                .filter(|(_, created)| !**created)
                .filter_map(|(item, _)| {
                    let known = stored.get(&item.event.id)?;
                    let fresh: Vec<&str> = item
                        .handlers
                        .iter()
                        .copied()
                        .filter(|h| !known.handlers.contains(*h))
                        .collect();
                    (!fresh.is_empty()).then(|| {
                        doc! {
                            "q": { field::ID: &item.event.id },
                            "u": {
                                "$addToSet": { field::HANDLERS: { "$each": fresh } },
                                "$inc": { field::REVISION: 1_i64 },
                            },
                        }
                    })
                })
                .collect();
            if !extend.is_empty() {
                let reply = inner
                    .db
                    .run_command(doc! { "update": inner.events.name(), "updates": extend })
                    .session(&mut *session)
                    .await?;
                check_write_reply(&reply)?;
            }
        }

        // 4. The deliveries, in one insert.
        let mut deliveries = Vec::new();
        // Whether each delivery is of an event this append created.
        let mut born = Vec::new();
        let mut outcomes = Vec::with_capacity(items.len());
        for (item, created) in items.iter().zip(created) {
            let event = item.event;
            let (sequence, handlers, event_type, key) = match stored.get(&event.id) {
                Some(known) if !created => (
                    known.sequence,
                    item.handlers
                        .iter()
                        .filter(|h| !known.handlers.contains(**h))
                        .map(|h| (*h).to_owned())
                        .collect::<Vec<_>>(),
                    known.event_type.as_str(),
                    known.key.as_deref(),
                ),
                _ => (
                    item.sequence,
                    item.handlers.iter().map(|h| (*h).to_owned()).collect(),
                    event.event_type.as_str(),
                    event.key.as_deref(),
                ),
            };
            let lane = lane_of(key, &event.id) as i32;
            born.extend(std::iter::repeat_n(created, handlers.len()));
            for handler in &handlers {
                // An unordered delivery keeps the key and sequence for operators; the flag
                // makes claims treat it as unkeyed, in the lane of its event id.
                let unordered = key.is_some() && item.unordered.contains(&handler.as_str());
                let lane = if unordered {
                    lane_of(None, &event.id) as i32
                } else {
                    lane
                };
                let mut delivery = doc! {
                    field::ID: ObjectId::new(),
                    field::EVENT_ID: &event.id,
                    field::HANDLER: handler,
                    field::EVENT_TYPE: event_type,
                };
                if let Some(key) = key {
                    delivery.insert(field::KEY, key);
                }
                if let Some(sequence) = sequence {
                    delivery.insert(field::SEQUENCE, sequence);
                }
                if unordered {
                    delivery.insert(field::UNORDERED, true);
                }
                delivery.insert(field::LANE_ID, lane);
                delivery.insert(field::LANE, lane::READY);
                delivery.insert(field::STATUS, status::PENDING);
                delivery.insert(field::ATTEMPTS, 0_i32);
                delivery.insert(field::DUE_AT, item.due_at.unwrap_or(now));
                delivery.insert(field::CREATED_AT, now);
                if created && item.document.get_bool(field::FRESH) == Ok(true) {
                    delivery.insert(field::FRESH, true);
                }
                deliveries.push(delivery);
            }
            outcomes.push(Appended {
                event_id: event.id.clone(),
                created,
                sequence,
                new_deliveries: handlers,
            });
        }
        if !deliveries.is_empty() {
            self.park_born_behind(session, &mut deliveries, &born)
                .await?;
            inner
                .deliveries
                .insert_many(deliveries)
                .session(&mut *session)
                .await?;
        }
        Ok(outcomes)
    }
}

/// Refuses an event whose id the store holds for an event of another type: its handlers would
/// get deliveries of an event they cannot read. Returned inside the transaction, which the
/// caller aborts.
fn check_types(
    items: &[Item<'_>],
    created: &[bool],
    stored: &HashMap<String, Stored>,
) -> Result<()> {
    for (item, created) in items.iter().zip(created) {
        if *created {
            continue;
        }
        if let Some(known) = stored.get(&item.event.id)
            && !known.event_type.is_empty()
            && known.event_type != item.event.event_type
        {
            return Err(EventValidationError::IdReused {
                id: item.event.id.clone(),
                existing_type: known.event_type.clone(),
                event_type: item.event.event_type.clone(),
            }
            .into());
        }
    }
    Ok(())
}

/// Validates a batch and builds the event documents, before anything touches the database.
fn prepare<'a>(events: &[AppendRequest<'a>]) -> Result<Vec<Item<'a>>> {
    let mut items: Vec<Item<'a>> = crate::store::append::merge(events)?
        .into_iter()
        .map(|merged| Item {
            event: merged.event,
            handlers: merged.handlers,
            unordered: merged.unordered,
            document: Document::new(),
            sequence: None,
            due_at: merged.due_at.map(super::bson_date),
        })
        .collect();
    for item in &mut items {
        item.document = event_document(item.event, &item.handlers);
        // Count the sequence a keyed event will get, and the mark of a fresh one, so the size
        // check is exact.
        let mut sized = item.document.clone();
        sized.insert(field::FRESH, true);
        if item.event.key.is_some() {
            sized.insert(field::SEQUENCE, i64::MAX);
        }
        let size = RawDocumentBuf::from_document(&sized)
            .map(|raw| raw.as_bytes().len())
            .unwrap_or(usize::MAX);
        if size > MAX_DOCUMENT_BYTES {
            return Err(EventValidationError::TooLarge {
                id: item.event.id.clone(),
                size,
                limit: MAX_DOCUMENT_BYTES,
            }
            .into());
        }
    }
    Ok(items)
}

/// The stored form of a new event. Absent values are left out rather than stored as null.
fn event_document(event: &EventEnvelope, handlers: &[&str]) -> Document {
    let mut document = doc! {
        field::ID: &event.id,
        field::TYPE: &event.event_type,
        field::PAYLOAD: object_to_document(&event.payload),
    };
    if let Some(key) = &event.key {
        document.insert(field::KEY, key);
    }
    if let Some(id) = &event.correlation_id {
        document.insert(field::CORRELATION_ID, id);
    }
    if let Some(id) = &event.causation_id {
        document.insert(field::CAUSATION_ID, id);
    }
    if !event.headers.is_empty() {
        let headers: Document = event
            .headers
            .iter()
            .map(|(k, v)| (k.clone(), Bson::String(v.clone())))
            .collect();
        document.insert(field::HEADERS, headers);
    }
    document.insert(
        field::CREATED_AT,
        DateTime::from_millis(event.created_at.timestamp_millis()),
    );
    document.insert(field::HANDLERS, handlers.to_vec());
    document
}

/// Inserts `name` right after `after` (or at the end), keeping the document's field order stable.
fn insert_after(document: &mut Document, after: &str, name: &str, value: Bson) {
    let mut rebuilt = Document::new();
    let mut placed = false;
    for (k, v) in std::mem::take(document) {
        let is_anchor = k == after;
        rebuilt.insert(k, v);
        if is_anchor {
            rebuilt.insert(name, value.clone());
            placed = true;
        }
    }
    if !placed {
        rebuilt.insert(name, value);
    }
    *document = rebuilt;
}

fn bson_i64(value: &Bson) -> Option<i64> {
    match value {
        Bson::Int32(i) => Some(i64::from(*i)),
        Bson::Int64(i) => Some(*i),
        Bson::Double(f) => Some(*f as i64),
        _ => None,
    }
}

/// Turns the write errors of a raw `update`/`delete` reply into an error: `run_command` reports
/// them as a successful reply.
pub(crate) fn check_write_reply(reply: &Document) -> Result<()> {
    if let Ok(errors) = reply.get_array("writeErrors")
        && let Some(Bson::Document(first)) = errors.first()
    {
        return Err(command_error(first).into());
    }
    if let Ok(concern) = reply.get_document("writeConcernError") {
        return Err(command_error(concern).into());
    }
    Ok(())
}

fn command_error(reply: &Document) -> mongodb::error::Error {
    match mongodb::bson::from_document::<CommandError>(reply.clone()) {
        Ok(error) => ErrorKind::Command(error).into(),
        Err(_) => mongodb::error::Error::custom(format!("unexpected write error reply: {reply}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(ids: &[&str]) -> Vec<String> {
        ids.iter().map(|id| (*id).to_owned()).collect()
    }

    #[test]
    fn a_handler_is_unordered_only_when_every_request_of_its_event_says_so() {
        let event = EventEnvelope::from_json("order.placed.v1", serde_json::json!({}))
            .unwrap()
            .with_key("k")
            .unwrap();
        let (all, loose, tight, new) = (
            names(&["a", "b", "c", "a"]),
            names(&["a", "b", "x"]),
            names(&["b", "d"]),
            names(&["d"]),
        );
        let items = prepare(&[AppendRequest::new(&event, &all).unordered(&loose)]).unwrap();
        assert_eq!(items[0].handlers, ["a", "b", "c"]);
        assert_eq!(
            items[0].unordered,
            ["a", "b"],
            "ids not subscribed are ignored"
        );

        // The same event again in the batch: `b` is held to order there, `d` is new.
        let items = prepare(&[
            AppendRequest::new(&event, &all).unordered(&loose),
            AppendRequest::new(&event, &tight).unordered(&new),
        ])
        .unwrap();
        assert_eq!(items.len(), 1);
        assert_eq!(items[0].handlers, ["a", "b", "c", "d"]);
        assert_eq!(items[0].unordered, ["a", "d"]);

        let plain = prepare(&[AppendRequest::new(&event, &all)]).unwrap();
        assert!(plain[0].unordered.is_empty());
    }
}
