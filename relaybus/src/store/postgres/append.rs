//! Appending events and their deliveries inside the caller's transaction, and moving the head
//! of a key's ordered deliveries.

use std::collections::{BTreeSet, HashMap};

use sqlx::{PgConnection, Row};

use super::{PostgresEventStore, checks, conflict, db_error};
use crate::{
    error::{EventValidationError, Result},
    event::{EventEnvelope, lane_of},
    store::{AppendRequest, Appended},
    time::Timestamp,
};

/// The longest `pg_notify` payload sent; PostgreSQL takes up to 8000 bytes.
const MAX_NOTIFY_PAYLOAD: usize = 7_900;
/// The CTEs that make the lowest pending ordered delivery of each `(handler, key)` of `pairs`
/// its unparked head and park the others no worker runs, leaving out the rows of `done` (which
/// the statement deletes).
pub(super) const MOVE_HEADS: &str = "heads AS ( \
         SELECT h.id FROM pairs, LATERAL ( \
             SELECT d.id FROM {s}.deliveries AS d \
             WHERE d.handler = pairs.handler AND d.key = pairs.key \
               AND d.status = 'pending' AND NOT d.unordered \
               AND d.id NOT IN (SELECT id FROM done) \
             ORDER BY d.sequence LIMIT 1) AS h \
     ), unparked AS ( \
         UPDATE {s}.deliveries AS d SET parked = false FROM heads \
         WHERE d.id = heads.id AND d.parked RETURNING d.id \
     ), parked AS ( \
         UPDATE {s}.deliveries AS d SET parked = true FROM pairs \
         WHERE d.handler = pairs.handler AND d.key = pairs.key \
           AND d.status = 'pending' AND d.key IS NOT NULL AND NOT d.unordered \
           AND NOT d.parked AND d.lease_owner IS NULL \
           AND d.id NOT IN (SELECT id FROM heads) AND d.id NOT IN (SELECT id FROM done) \
         RETURNING d.id \
     )";
/// The payload of a wake-up that names no handler: every watcher looks.
pub(super) const NOTIFY_ALL: &str = "*";

/// One event of a batch, the requests of one id merged.
struct Item<'a> {
    event: &'a EventEnvelope,
    /// The handlers asked for, each once, in request order.
    handlers: Vec<&'a str>,
    /// The handlers that every request of the id named unordered.
    unordered: Vec<&'a str>,
    due_at: Option<Timestamp>,
}

/// What the store holds of an event.
struct Stored {
    event_type: String,
    key: Option<String>,
    sequence: Option<i64>,
    handlers: Vec<String>,
}

/// Checks the requests and merges those of one id; refuses one id with two types.
fn prepare<'a>(requests: &[AppendRequest<'a>]) -> Result<(Vec<Item<'a>>, Vec<usize>)> {
    let mut items: Vec<Item<'a>> = Vec::new();
    let mut of_request = Vec::with_capacity(requests.len());
    let mut by_id: HashMap<&str, usize> = HashMap::new();
    for request in requests {
        checks::check_request(request)?;
        let event = request.event();
        let ordered_only: Vec<&str> = request
            .unordered_handlers()
            .iter()
            .map(String::as_str)
            .filter(|h| request.handlers().iter().any(|x| x == h))
            .collect();
        match by_id.get(event.id()) {
            Some(&index) => {
                let item = &mut items[index];
                if item.event.event_type() != event.event_type() {
                    return Err(EventValidationError::IdReused {
                        id: event.id().to_owned(),
                        existing_type: item.event.event_type().to_owned(),
                        event_type: event.event_type().to_owned(),
                    }
                    .into());
                }
                for handler in request.handlers() {
                    if !item.handlers.contains(&handler.as_str()) {
                        item.handlers.push(handler);
                    }
                }
                item.unordered.retain(|h| ordered_only.contains(h));
                of_request.push(index);
            }
            None => {
                let mut handlers: Vec<&str> = Vec::new();
                for handler in request.handlers() {
                    if !handlers.contains(&handler.as_str()) {
                        handlers.push(handler);
                    }
                }
                by_id.insert(event.id(), items.len());
                of_request.push(items.len());
                items.push(Item {
                    event,
                    handlers,
                    unordered: ordered_only,
                    due_at: request.due(),
                });
            }
        }
    }
    Ok((items, of_request))
}

impl PostgresEventStore {
    /// Appends after the checks, on a connection known to be in a transaction.
    pub(super) async fn append_on(
        &self,
        connection: &mut PgConnection,
        requests: &[AppendRequest<'_>],
        now: Timestamp,
    ) -> Result<Vec<Appended>> {
        let (items, of_request) = prepare(requests)?;
        if items.is_empty() {
            return Ok(Vec::new());
        }
        if items.iter().all(|item| item.event.key().is_none())
            && self.append_new(connection, &items, now).await?
        {
            return Ok(appended(
                &items,
                &of_request,
                &vec![None; items.len()],
                |index| (true, &items[index].handlers),
            ));
        }
        self.append_items(connection, &items, &of_request, now)
            .await
    }

    /// Appends a batch of unkeyed events in one statement when the store holds none of their
    /// ids, the common case: the events, their deliveries and the wake-up. `false` when it
    /// holds one, having written nothing: the general path then merges the handlers. An id
    /// that a concurrent transaction stored meanwhile is a transient error, as there.
    async fn append_new(
        &self,
        connection: &mut PgConnection,
        items: &[Item<'_>],
        now: Timestamp,
    ) -> Result<bool> {
        let mut events = EventColumns::default();
        let mut rows = DeliveryColumns::default();
        let mut notified: BTreeSet<&str> = BTreeSet::new();
        for item in items {
            events.push(item, None)?;
            let due = item.due_at.unwrap_or(now).timestamp_millis();
            for handler in &item.handlers {
                notified.insert(handler);
                rows.event_ids.push(item.event.id());
                rows.handlers.push(handler);
                rows.types.push(item.event.event_type());
                rows.keys.push(None);
                rows.sequences.push(None);
                rows.unordered.push(false);
                rows.due_at.push(due);
                rows.lanes.push(lane_of(None, item.event.id()) as i32);
            }
        }
        let mut payload = notified.into_iter().collect::<Vec<_>>().join(",");
        if payload.len() > MAX_NOTIFY_PAYLOAD {
            payload = NOTIFY_ALL.to_owned();
        }
        let row = sqlx::query(&self.sql(
            "WITH known AS ( \
                 SELECT FROM {s}.events WHERE id = ANY($1) LIMIT 1 \
             ), event AS ( \
                 INSERT INTO {s}.events (id, event_type, key, sequence, payload, headers, \
                     correlation_id, causation_id, created_at, appended_at, handlers) \
                 SELECT id, event_type, NULL, NULL, payload::json, headers::json, \
                     correlation_id, causation_id, created_at, $11, string_to_array(handlers, ',') \
                 FROM unnest($1::text[], $2::text[], $5::text[], $6::text[], $7::text[], \
                     $8::text[], $9::bigint[], $10::text[]) \
                     AS v(id, event_type, payload, headers, correlation_id, causation_id, \
                     created_at, handlers) \
                 WHERE NOT EXISTS (SELECT FROM known) \
                 ON CONFLICT (id) DO NOTHING RETURNING id \
             ), delivery AS ( \
                 INSERT INTO {s}.deliveries (event_id, handler, event_type, unordered, status, \
                     due_at, created_at, lane) \
                 SELECT v.event_id, v.handler, v.event_type, false, 'pending', v.due_at, $11, \
                     v.lane \
                 FROM unnest($12::text[], $13::text[], $14::text[], $15::bigint[], \
                     $16::integer[]) AS v(event_id, handler, event_type, due_at, lane) \
                 WHERE v.event_id IN (SELECT id FROM event) \
                 RETURNING 1 \
             ) \
             SELECT EXISTS (SELECT FROM known) AS known, \
                 (SELECT count(*) FROM event) AS inserted, \
                 (SELECT pg_notify($3, $4) WHERE EXISTS (SELECT FROM delivery)) IS NULL AS n",
        ))
        .bind(&events.ids)
        .bind(&events.types)
        .bind(self.channel())
        .bind(payload)
        .bind(&events.payloads)
        .bind(&events.headers)
        .bind(&events.correlation_ids)
        .bind(&events.causation_ids)
        .bind(&events.created_at)
        .bind(&events.handlers)
        .bind(now.timestamp_millis())
        .bind(&rows.event_ids)
        .bind(&rows.handlers)
        .bind(&rows.types)
        .bind(&rows.due_at)
        .bind(&rows.lanes)
        .fetch_one(&mut *connection)
        .await
        .map_err(db_error)?;
        if row.try_get::<bool, _>("known").map_err(db_error)? {
            return Ok(false);
        }
        let inserted: i64 = row.try_get("inserted").map_err(db_error)?;
        if inserted != items.len() as i64 {
            return Err(conflict(
                "an event id of the batch was appended by a concurrent transaction",
            ));
        }
        Ok(true)
    }

    /// Checks the requests only: what `append` does before it looks at the session.
    pub(super) fn check_requests(requests: &[AppendRequest<'_>]) -> Result<()> {
        prepare(requests).map(|_| ())
    }

    async fn append_items(
        &self,
        connection: &mut PgConnection,
        items: &[Item<'_>],
        of_request: &[usize],
        now: Timestamp,
    ) -> Result<Vec<Appended>> {
        // 1. The counters of the batch's keys, locked in key order: appenders of a key wait
        //    for each other here, so a key's numbers follow commit order.
        let keys: BTreeSet<&str> = items.iter().filter_map(|i| i.event.key()).collect();
        let mut counters: HashMap<String, i64> = HashMap::new();
        if !keys.is_empty() {
            let keys: Vec<&str> = keys.into_iter().collect();
            let rows = sqlx::query(&self.sql(
                "INSERT INTO {s}.key_sequences (key, sequence) \
                 SELECT k, 0 FROM unnest($1::text[]) AS k ORDER BY k \
                 ON CONFLICT (key) DO UPDATE SET sequence = {s}.key_sequences.sequence \
                 RETURNING key, sequence",
            ))
            .bind(&keys)
            .fetch_all(&mut *connection)
            .await
            .map_err(db_error)?;
            for row in rows {
                counters.insert(
                    row.try_get("key").map_err(db_error)?,
                    row.try_get("sequence").map_err(db_error)?,
                );
            }
        }

        // 2. The events the store holds, locked (a purge skips them, a discard waits).
        let ids: Vec<&str> = items.iter().map(|i| i.event.id()).collect();
        let rows = sqlx::query(&self.sql(
            "SELECT id, event_type, key, sequence, handlers FROM {s}.events \
             WHERE id = ANY($1) FOR UPDATE",
        ))
        .bind(&ids)
        .fetch_all(&mut *connection)
        .await
        .map_err(db_error)?;
        let mut stored: HashMap<String, Stored> = HashMap::new();
        for row in rows {
            stored.insert(
                row.try_get("id").map_err(db_error)?,
                Stored {
                    event_type: row.try_get("event_type").map_err(db_error)?,
                    key: row.try_get("key").map_err(db_error)?,
                    sequence: row.try_get("sequence").map_err(db_error)?,
                    handlers: row.try_get("handlers").map_err(db_error)?,
                },
            );
        }
        for item in items {
            if let Some(known) = stored.get(item.event.id())
                && known.event_type != item.event.event_type()
            {
                return Err(EventValidationError::IdReused {
                    id: item.event.id().to_owned(),
                    existing_type: known.event_type.clone(),
                    event_type: item.event.event_type().to_owned(),
                }
                .into());
            }
        }
        // A known event keeps its stored key: lock it too when the batch did not name it.
        let extra: BTreeSet<&str> = stored
            .values()
            .filter_map(|s| s.key.as_deref())
            .filter(|k| !counters.contains_key(*k))
            .collect();
        if !extra.is_empty() {
            let extra: Vec<String> = extra.into_iter().map(str::to_owned).collect();
            self.lock_keys(connection, &extra).await?;
        }

        // 3. Numbers for the new keyed events, and the new events.
        let mut sequences: Vec<Option<i64>> = vec![None; items.len()];
        let mut next: HashMap<&str, i64> = HashMap::new();
        for (index, item) in items.iter().enumerate() {
            match stored.get(item.event.id()) {
                Some(known) => sequences[index] = known.sequence,
                None => {
                    if let Some(key) = item.event.key() {
                        let last = next
                            .entry(key)
                            .or_insert_with(|| counters.get(key).copied().unwrap_or(0));
                        *last += 1;
                        sequences[index] = Some(*last);
                    }
                }
            }
        }
        if !next.is_empty() {
            let (keys, values): (Vec<&str>, Vec<i64>) = next.iter().map(|(k, v)| (*k, *v)).unzip();
            sqlx::query(&self.sql(
                "UPDATE {s}.key_sequences AS k SET sequence = v.sequence \
                 FROM unnest($1::text[], $2::bigint[]) AS v(key, sequence) WHERE k.key = v.key",
            ))
            .bind(&keys)
            .bind(&values)
            .execute(&mut *connection)
            .await
            .map_err(db_error)?;
        }
        let fresh: Vec<usize> = (0..items.len())
            .filter(|i| !stored.contains_key(items[*i].event.id()))
            .collect();
        if !fresh.is_empty() {
            let mut columns = EventColumns::default();
            for &index in &fresh {
                columns.push(&items[index], sequences[index])?;
            }
            let inserted = sqlx::query(&self.sql(
                "INSERT INTO {s}.events (id, event_type, key, sequence, payload, headers, \
                 correlation_id, causation_id, created_at, appended_at, handlers) \
                 SELECT id, event_type, key, sequence, payload::json, headers::json, \
                 correlation_id, causation_id, created_at, $11, string_to_array(handlers, ',') \
                 FROM unnest($1::text[], $2::text[], $3::text[], $4::bigint[], $5::text[], \
                 $6::text[], $7::text[], $8::text[], $9::bigint[], $10::text[]) \
                 AS v(id, event_type, key, sequence, payload, headers, correlation_id, \
                 causation_id, created_at, handlers) \
                 ON CONFLICT (id) DO NOTHING",
            ))
            .bind(&columns.ids)
            .bind(&columns.types)
            .bind(&columns.keys)
            .bind(&columns.sequences)
            .bind(&columns.payloads)
            .bind(&columns.headers)
            .bind(&columns.correlation_ids)
            .bind(&columns.causation_ids)
            .bind(&columns.created_at)
            .bind(&columns.handlers)
            .bind(now.timestamp_millis())
            .execute(&mut *connection)
            .await
            .map_err(db_error)?;
            if inserted.rows_affected() != fresh.len() as u64 {
                return Err(conflict(
                    "an event id of the batch was appended by a concurrent transaction",
                ));
            }
        }

        // 4. The handlers each event gets a new delivery for.
        let mut new_handlers: Vec<Vec<&str>> = Vec::with_capacity(items.len());
        let (mut extend_ids, mut extend_handlers) = (Vec::new(), Vec::new());
        for item in items {
            let handlers: Vec<&str> = match stored.get(item.event.id()) {
                Some(known) => {
                    let added: Vec<&str> = item
                        .handlers
                        .iter()
                        .copied()
                        .filter(|h| !known.handlers.iter().any(|k| k == h))
                        .collect();
                    if !added.is_empty() {
                        extend_ids.push(item.event.id());
                        extend_handlers.push(added.join(","));
                    }
                    added
                }
                None => item.handlers.clone(),
            };
            new_handlers.push(handlers);
        }
        if !extend_ids.is_empty() {
            sqlx::query(&self.sql(
                "UPDATE {s}.events AS e SET handlers = e.handlers || string_to_array(v.handlers, ',') \
                 FROM unnest($1::text[], $2::text[]) AS v(id, handlers) WHERE e.id = v.id",
            ))
            .bind(&extend_ids)
            .bind(&extend_handlers)
            .execute(&mut *connection)
            .await
            .map_err(db_error)?;
        }

        // 5. The deliveries, then the heads of their keys.
        let mut rows = DeliveryColumns::default();
        let mut heads: BTreeSet<(String, String)> = BTreeSet::new();
        let mut notified: BTreeSet<&str> = BTreeSet::new();
        for (index, item) in items.iter().enumerate() {
            let key = match stored.get(item.event.id()) {
                Some(known) => known.key.as_deref(),
                None => item.event.key(),
            };
            let due = item.due_at.unwrap_or(now).timestamp_millis();
            for handler in &new_handlers[index] {
                let unordered = key.is_some() && item.unordered.contains(handler);
                let ordered_key = if unordered { None } else { key };
                if let Some(key) = ordered_key {
                    heads.insert(((*handler).to_owned(), key.to_owned()));
                }
                notified.insert(handler);
                rows.event_ids.push(item.event.id());
                rows.handlers.push(handler);
                rows.types.push(item.event.event_type());
                rows.keys.push(key);
                rows.sequences.push(sequences[index]);
                rows.unordered.push(unordered);
                rows.due_at.push(due);
                rows.lanes
                    .push(lane_of(ordered_key, item.event.id()) as i32);
            }
        }
        if !rows.event_ids.is_empty() {
            sqlx::query(&self.sql(
                "INSERT INTO {s}.deliveries (event_id, handler, event_type, key, sequence, \
                 unordered, status, due_at, created_at, lane) \
                 SELECT event_id, handler, event_type, key, sequence, unordered, 'pending', \
                 due_at, $9, lane \
                 FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::bigint[], \
                 $6::boolean[], $7::bigint[], $8::integer[]) \
                 AS v(event_id, handler, event_type, key, sequence, unordered, due_at, lane)",
            ))
            .bind(&rows.event_ids)
            .bind(&rows.handlers)
            .bind(&rows.types)
            .bind(&rows.keys)
            .bind(&rows.sequences)
            .bind(&rows.unordered)
            .bind(&rows.due_at)
            .bind(&rows.lanes)
            .bind(now.timestamp_millis())
            .execute(&mut *connection)
            .await
            .map_err(db_error)?;
            let heads: Vec<(String, String)> = heads.into_iter().collect();
            self.move_heads(connection, &heads).await?;
            let mut payload = notified.into_iter().collect::<Vec<_>>().join(",");
            if payload.len() > MAX_NOTIFY_PAYLOAD {
                payload = NOTIFY_ALL.to_owned();
            }
            sqlx::query("SELECT pg_notify($1, $2)")
                .bind(self.channel())
                .bind(payload)
                .execute(&mut *connection)
                .await
                .map_err(db_error)?;
        }

        Ok(appended(items, of_request, &sequences, |index| {
            (
                !stored.contains_key(items[index].event.id()),
                &new_handlers[index],
            )
        }))
    }

    /// Locks the counter rows of `keys`, in key order: what every write that adds or ends an
    /// ordered delivery holds before it moves the head of the delivery's key.
    pub(super) async fn lock_keys(
        &self,
        connection: &mut PgConnection,
        keys: &[String],
    ) -> Result<()> {
        if keys.is_empty() {
            return Ok(());
        }
        let mut keys: Vec<&str> = keys.iter().map(String::as_str).collect();
        keys.sort_unstable();
        keys.dedup();
        sqlx::query(&self.sql(
            "SELECT key FROM {s}.key_sequences WHERE key = ANY($1) ORDER BY key \
             FOR NO KEY UPDATE",
        ))
        .bind(&keys)
        .fetch_all(&mut *connection)
        .await
        .map_err(db_error)?;
        Ok(())
    }

    /// Makes the lowest pending ordered delivery of each handler and key the unparked head,
    /// and parks the others that no worker runs. The caller holds the keys' locks.
    pub(super) async fn move_heads(
        &self,
        connection: &mut PgConnection,
        pairs: &[(String, String)],
    ) -> Result<()> {
        if pairs.is_empty() {
            return Ok(());
        }
        let (handlers, keys): (Vec<&str>, Vec<&str>) =
            pairs.iter().map(|(h, k)| (h.as_str(), k.as_str())).unzip();
        sqlx::query(&self.sql(&format!(
            "WITH pairs AS ( \
                 SELECT DISTINCT handler, key FROM unnest($1::text[], $2::text[]) AS p(handler, key) \
             ), done AS (SELECT NULL::bigint AS id WHERE false), {MOVE_HEADS} \
             SELECT 1",
        )))
        .bind(&handlers)
        .bind(&keys)
        .execute(&mut *connection)
        .await
        .map_err(db_error)?;
        Ok(())
    }
}

/// What an append reports per request: for the first request of each id, whether its event
/// is new and the deliveries it got (`fresh` says both), for a later one of the same id
/// nothing.
fn appended<'a, 'b>(
    items: &[Item<'a>],
    of_request: &[usize],
    sequences: &[Option<i64>],
    fresh: impl Fn(usize) -> (bool, &'b Vec<&'a str>),
) -> Vec<Appended>
where
    'a: 'b,
{
    let mut reported = vec![false; items.len()];
    of_request
        .iter()
        .map(|&index| {
            let item = &items[index];
            let first = !std::mem::replace(&mut reported[index], true);
            let (created, handlers) = fresh(index);
            Appended {
                event_id: item.event.id().to_owned(),
                created: first && created,
                sequence: sequences[index],
                new_deliveries: if first {
                    handlers.iter().map(|h| (*h).to_owned()).collect()
                } else {
                    Vec::new()
                },
            }
        })
        .collect()
}

/// The columns of new events, one array each, for one `INSERT .. SELECT FROM unnest(..)`.
#[derive(Default)]
struct EventColumns<'a> {
    ids: Vec<&'a str>,
    types: Vec<&'a str>,
    keys: Vec<Option<&'a str>>,
    sequences: Vec<Option<i64>>,
    payloads: Vec<String>,
    headers: Vec<String>,
    correlation_ids: Vec<Option<&'a str>>,
    causation_ids: Vec<Option<&'a str>>,
    created_at: Vec<i64>,
    handlers: Vec<String>,
}

impl<'a> EventColumns<'a> {
    fn push(&mut self, item: &Item<'a>, sequence: Option<i64>) -> Result<()> {
        let event = item.event;
        let payload = serde_json::to_string(event.payload()).map_err(|source| {
            EventValidationError::Payload {
                event_type: event.event_type().to_owned(),
                source,
            }
        })?;
        let headers = serde_json::to_string(event.headers()).map_err(|source| {
            EventValidationError::Payload {
                event_type: event.event_type().to_owned(),
                source,
            }
        })?;
        self.ids.push(event.id());
        self.types.push(event.event_type());
        self.keys.push(event.key());
        self.sequences.push(sequence);
        self.payloads.push(payload);
        self.headers.push(headers);
        self.correlation_ids.push(event.correlation_id());
        self.causation_ids.push(event.causation_id());
        self.created_at.push(event.created_at().timestamp_millis());
        self.handlers.push(item.handlers.join(","));
        Ok(())
    }
}

/// The columns of new deliveries.
#[derive(Default)]
struct DeliveryColumns<'a> {
    event_ids: Vec<&'a str>,
    handlers: Vec<&'a str>,
    types: Vec<&'a str>,
    keys: Vec<Option<&'a str>>,
    sequences: Vec<Option<i64>>,
    unordered: Vec<bool>,
    due_at: Vec<i64>,
    lanes: Vec<i32>,
}
