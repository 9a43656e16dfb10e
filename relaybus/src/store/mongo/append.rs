//! Appending events and their deliveries inside the caller's transaction.

use std::collections::{HashMap, HashSet};

use futures::TryStreamExt;
use mongodb::{
    ClientSession,
    bson::{Bson, DateTime, Document, RawDocumentBuf, doc, oid::ObjectId},
    error::{CommandError, ErrorKind},
    options::ReturnDocument,
};

use super::{MongoEventStore, bson_json::object_to_document};
use crate::{
    error::{EventValidationError, Result},
    event::{EventEnvelope, lane_of},
    handler::validate_handler_id,
};

/// MongoDB's largest document, in bytes.
pub(crate) const MAX_DOCUMENT_BYTES: usize = 16 * 1024 * 1024;

/// One event to append, with the ids of the handlers that should get a delivery of it.
#[derive(Debug, Clone, Copy)]
pub struct AppendRequest<'a> {
    event: &'a EventEnvelope,
    handlers: &'a [String],
}

impl<'a> AppendRequest<'a> {
    /// An event and the handlers subscribed to it.
    pub fn new(event: &'a EventEnvelope, handlers: &'a [String]) -> Self {
        AppendRequest { event, handlers }
    }
}

/// What appending one event did.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Appended {
    /// The event id.
    pub event_id: String,
    /// Whether the event was new; `false` when the store already held an event with this id.
    pub created: bool,
    /// The event's sequence within its ordering key, if it has a key.
    pub sequence: Option<i64>,
    /// The handlers that got a new delivery. Handlers the event already had a delivery for,
    /// completed ones included, are left out.
    pub new_deliveries: Vec<String>,
}

/// An event as this append sees it: the envelope and the handlers asked for.
struct Item<'a> {
    event: &'a EventEnvelope,
    handlers: Vec<&'a str>,
    document: Document,
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
    /// `now` is the time the deliveries become due and are recorded as created.
    ///
    /// # Errors
    ///
    /// - [`ConfigurationError::NoTransaction`](crate::ConfigurationError::NoTransaction) when
    ///   `session` has no started transaction; nothing is written.
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
        self.ensure_in_transaction(session, "append").await?;
        self.append_prepared(session, items, now).await
    }

    /// Appends with a session known to be in a transaction (the bus's own).
    pub(crate) async fn append_in_transaction(
        &self,
        session: &mut ClientSession,
        events: &[AppendRequest<'_>],
        now: DateTime,
    ) -> Result<Vec<Appended>> {
        let items = prepare(events)?;
        self.append_prepared(session, items, now).await
    }

    async fn append_prepared(
        &self,
        session: &mut ClientSession,
        items: Vec<Item<'_>>,
        now: DateTime,
    ) -> Result<Vec<Appended>> {
        if items.is_empty() {
            return Ok(Vec::new());
        }
        let inner = &self.inner;

        // 1. What exists already, read inside the transaction.
        let ids: Vec<&str> = items.iter().map(|item| item.event.id.as_str()).collect();
        let mut stored: HashMap<String, Stored> = HashMap::new();
        let mut cursor = inner
            .events
            .find(doc! { "_id": { "$in": &ids } })
            .projection(doc! { "handlers": 1, "type": 1, "key": 1, "sequence": 1 })
            .session(&mut *session)
            .await?;
        while let Some(found) = cursor.next(&mut *session).await.transpose()? {
            let id = match found.get("_id") {
                Some(Bson::String(id)) => id.clone(),
                _ => continue,
            };
            let handlers = found
                .get_array("handlers")
                .map(|list| {
                    list.iter()
                        .filter_map(|h| h.as_str().map(str::to_owned))
                        .collect()
                })
                .unwrap_or_default();
            stored.insert(
                id,
                Stored {
                    handlers,
                    event_type: found.get_str("type").unwrap_or_default().to_owned(),
                    key: found.get_str("key").ok().map(str::to_owned),
                    sequence: found.get("sequence").and_then(bson_i64),
                },
            );
        }
        drop(cursor);

        // 2. Sequences of the new keyed events, from each key's counter.
        let mut per_key: Vec<(&str, i64)> = Vec::new();
        for item in &items {
            if stored.contains_key(&item.event.id) {
                continue;
            }
            if let Some(key) = item.event.key.as_deref() {
                match per_key.iter_mut().find(|(k, _)| *k == key) {
                    Some((_, n)) => *n += 1,
                    None => per_key.push((key, 1)),
                }
            }
        }
        let mut next_sequence: HashMap<&str, i64> = HashMap::new();
        if per_key.len() == 1 {
            let (key, count) = per_key[0];
            let counter = inner
                .key_sequences
                .find_one_and_update(doc! { "_id": key }, doc! { "$inc": { "value": count } })
                .upsert(true)
                .return_document(ReturnDocument::After)
                .session(&mut *session)
                .await?;
            let last = counter
                .as_ref()
                .and_then(|c| c.get("value").and_then(bson_i64))
                .unwrap_or(count);
            next_sequence.insert(key, last - count + 1);
        } else if !per_key.is_empty() {
            let updates: Vec<Document> = per_key
                .iter()
                .map(|(key, count)| {
                    doc! { "q": { "_id": *key }, "u": { "$inc": { "value": *count } }, "upsert": true }
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
                .find(doc! { "_id": { "$in": &keys } })
                .session(&mut *session)
                .await?
                .stream(&mut *session)
                .try_collect()
                .await?;
            for (key, count) in &per_key {
                let last = counters
                    .iter()
                    .find(|c| c.get_str("_id") == Ok(*key))
                    .and_then(|c| c.get("value").and_then(bson_i64))
                    .unwrap_or(*count);
                next_sequence.insert(key, last - count + 1);
            }
        }

        // 3. Event documents: new ones upserted, known ones extended with their new handlers.
        let mut event_updates = Vec::with_capacity(items.len());
        let mut deliveries = Vec::new();
        let mut outcomes = Vec::with_capacity(items.len());
        for mut item in items {
            let event = item.event;
            let (created, sequence, new_handlers, event_type, key) = match stored.get(&event.id) {
                Some(known) => {
                    let fresh: Vec<String> = item
                        .handlers
                        .iter()
                        .filter(|h| !known.handlers.contains(**h))
                        .map(|h| (*h).to_owned())
                        .collect();
                    if !fresh.is_empty() {
                        event_updates.push(doc! {
                            "q": { "_id": &event.id },
                            "u": {
                                "$addToSet": { "handlers": { "$each": &fresh } },
                                "$inc": { "revision": 1_i64 },
                            },
                        });
                    }
                    (
                        false,
                        known.sequence,
                        fresh,
                        known.event_type.clone(),
                        known.key.clone(),
                    )
                }
                None => {
                    let sequence = event.key.as_deref().map(|key| {
                        let slot = next_sequence.get_mut(key).expect("counted above");
                        let sequence = *slot;
                        *slot += 1;
                        sequence
                    });
                    if let Some(sequence) = sequence {
                        insert_after(&mut item.document, "key", "sequence", Bson::Int64(sequence));
                    }
                    event_updates.push(doc! {
                        "q": { "_id": &event.id },
                        "u": { "$setOnInsert": item.document },
                        "upsert": true,
                    });
                    let handlers = item.handlers.iter().map(|h| (*h).to_owned()).collect();
                    (
                        true,
                        sequence,
                        handlers,
                        event.event_type.clone(),
                        event.key.clone(),
                    )
                }
            };
            let lane = lane_of(key.as_deref(), &event.id) as i32;
            for handler in &new_handlers {
                let mut delivery = doc! {
                    "_id": ObjectId::new(),
                    "eventId": &event.id,
                    "handler": handler,
                    "eventType": &event_type,
                };
                if let Some(key) = &key {
                    delivery.insert("key", key);
                }
                if let Some(sequence) = sequence {
                    delivery.insert("sequence", sequence);
                }
                delivery.insert("laneId", lane);
                delivery.insert("lane", "ready");
                delivery.insert("status", "pending");
                delivery.insert("attempts", 0_i32);
                delivery.insert("dueAt", now);
                delivery.insert("createdAt", now);
                deliveries.push(delivery);
            }
            outcomes.push(Appended {
                event_id: event.id.clone(),
                created,
                sequence,
                new_deliveries: new_handlers,
            });
        }

        if !event_updates.is_empty() {
            let reply = inner
                .db
                .run_command(doc! {
                    "update": inner.events.name(),
                    "updates": event_updates,
                    "ordered": true,
                })
                .session(&mut *session)
                .await?;
            check_write_reply(&reply)?;
        }

        // 4. The deliveries, in one insert.
        if !deliveries.is_empty() {
            inner
                .deliveries
                .insert_many(deliveries)
                .session(&mut *session)
                .await?;
        }
        Ok(outcomes)
    }
}

/// Validates a batch and builds the event documents, before anything touches the database.
fn prepare<'a>(events: &[AppendRequest<'a>]) -> Result<Vec<Item<'a>>> {
    let mut items: Vec<Item<'a>> = Vec::with_capacity(events.len());
    let mut index_of: HashMap<&'a str, usize> = HashMap::new();
    for request in events {
        for handler in request.handlers {
            validate_handler_id(handler)?;
        }
        if let Some(&at) = index_of.get(request.event.id.as_str()) {
            // The same id twice in one batch: one event, with the union of the handlers.
            let item = &mut items[at];
            for handler in request.handlers {
                if !item.handlers.contains(&handler.as_str()) {
                    item.handlers.push(handler);
                }
            }
            continue;
        }
        let mut handlers: Vec<&str> = Vec::with_capacity(request.handlers.len());
        for handler in request.handlers {
            if !handlers.contains(&handler.as_str()) {
                handlers.push(handler);
            }
        }
        index_of.insert(&request.event.id, items.len());
        items.push(Item {
            event: request.event,
            handlers,
            document: Document::new(),
        });
    }
    for item in &mut items {
        item.document = event_document(item.event, &item.handlers);
        // Count the sequence a keyed event will get, so the size check is exact.
        let mut sized = item.document.clone();
        if item.event.key.is_some() {
            sized.insert("sequence", i64::MAX);
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
        "_id": &event.id,
        "type": &event.event_type,
        "payload": object_to_document(&event.payload),
    };
    if let Some(key) = &event.key {
        document.insert("key", key);
    }
    if let Some(id) = &event.correlation_id {
        document.insert("correlationId", id);
    }
    if let Some(id) = &event.causation_id {
        document.insert("causationId", id);
    }
    if !event.headers.is_empty() {
        let headers: Document = event
            .headers
            .iter()
            .map(|(k, v)| (k.clone(), Bson::String(v.clone())))
            .collect();
        document.insert("headers", headers);
    }
    document.insert("createdAt", event.created_at);
    document.insert("handlers", handlers.to_vec());
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
    if let Ok(errors) = reply.get_array("writeErrors") {
        if let Some(Bson::Document(first)) = errors.first() {
            return Err(command_error(first).into());
        }
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
