//! Claims and completions: leases per delivery, fenced by the claim generation.

use std::{collections::BTreeMap, fmt};

use sqlx::{Executor, PgConnection, Row, postgres::PgRow};

use super::{PostgresEventStore, checks, db_error};
use crate::{
    error::{EventValidationError, Result},
    event::EventEnvelope,
    store::{
        ClaimRequest, Claimed,
        transaction::{Attempts, RETRY_LIMIT},
    },
    time::Timestamp,
};

/// The error an attempt lost with its worker is charged with.
pub(super) const LOST_ERROR: &str =
    "the worker's lease expired before it settled the delivery; another worker took it over";

/// A claim's proof of ownership of one delivery of the PostgreSQL store: the delivery id and
/// the claim generation the claim gave it. Every end of a claim moves the generation on, so
/// the lease settles nothing once the claim ended or another claim took the delivery.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PostgresLease {
    delivery_id: i64,
    claim: i64,
}

impl PostgresLease {
    /// A lease of `delivery_id` under claim generation `claim`, as a claim returned them (for
    /// leases kept as text and read back; a lease no claim returned matches nothing).
    pub fn new(delivery_id: i64, claim: i64) -> Self {
        PostgresLease { delivery_id, claim }
    }

    /// The delivery id.
    pub fn delivery_id(&self) -> i64 {
        self.delivery_id
    }

    /// The claim generation the lease holds.
    pub fn claim(&self) -> i64 {
        self.claim
    }
}

impl fmt::Display for PostgresLease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.delivery_id, self.claim)
    }
}

impl crate::store::StoreLease for PostgresLease {
    type DeliveryId = i64;

    fn delivery_id(&self) -> i64 {
        self.delivery_id
    }
}

/// The event columns a claim and the operator reads select, prefixed `e_`.
pub(super) const EVENT_COLUMNS: &str = "e.id AS e_id, e.event_type AS e_type, e.key AS e_key, \
     e.payload::text AS e_payload, e.headers::text AS e_headers, \
     e.correlation_id AS e_correlation_id, e.causation_id AS e_causation_id, \
     e.created_at AS e_created_at";

/// The event of a row selected with [`EVENT_COLUMNS`].
pub(super) fn event_of(row: &PgRow) -> Result<EventEnvelope> {
    let id: String = row.try_get("e_id").map_err(db_error)?;
    let event_type: String = row.try_get("e_type").map_err(db_error)?;
    let corrupt = |source| EventValidationError::Payload {
        event_type: event_type.clone(),
        source,
    };
    let payload: String = row.try_get("e_payload").map_err(db_error)?;
    let headers: String = row.try_get("e_headers").map_err(db_error)?;
    let created_at: i64 = row.try_get("e_created_at").map_err(db_error)?;
    Ok(EventEnvelope {
        payload: serde_json::from_str(&payload).map_err(corrupt)?,
        headers: serde_json::from_str(&headers).map_err(corrupt)?,
        key: row.try_get("e_key").map_err(db_error)?,
        correlation_id: row.try_get("e_correlation_id").map_err(db_error)?,
        causation_id: row.try_get("e_causation_id").map_err(db_error)?,
        created_at: Timestamp::from_millis(created_at),
        id,
        event_type,
    })
}

/// SQL that appends the JSON entry `entry` to the error history `errors`, keeping the last
/// [`MAX_ERROR_HISTORY`](crate::store::MAX_ERROR_HISTORY).
pub(super) fn push_error(errors: &str, entry: &str) -> String {
    format!(
        "(SELECT coalesce(jsonb_agg(t.e ORDER BY t.n), '[]'::jsonb) FROM ( \
             SELECT e, n FROM jsonb_array_elements({errors} || jsonb_build_array({entry})) \
             WITH ORDINALITY AS a(e, n) ORDER BY n DESC LIMIT {max}) AS t)",
        max = crate::store::MAX_ERROR_HISTORY
    )
}

impl PostgresEventStore {
    /// Claims due deliveries in one statement: unparked pending ones of the handlers, with no
    /// lease or an expired one of another owner or store instance, in due order, skipping rows
    /// other claimers lock. An owner never takes over what it runs itself through this store
    /// instance: those deliveries still run in its process, and it settles them.
    ///
    /// The statement is prepared once per connection, and after a few runs PostgreSQL plans it
    /// for any limit; such a plan joined the picked rows and their events by scanning both
    /// tables. So the update takes its rows by primary key from an array of the picked ids,
    /// and each event is looked up by its own (`LATERAL … LIMIT 1`).
    pub(super) async fn claim_deliveries(
        &self,
        request: ClaimRequest<'_>,
    ) -> Result<Vec<Claimed<PostgresLease>>> {
        checks::check_owner(request.owner)?;
        let handlers = checks::check_handlers(request.handlers)?;
        checks::check_limit(request.limit)?;
        checks::check_lease_duration(request.lease_duration)?;
        let expires = checks::add(request.now, request.lease_duration)?;
        let now = request.now.timestamp_millis();
        let lost_entry = "jsonb_build_object('at', $4::bigint, 'attempt', NULL, 'error', $7::text)";
        let sql = self.sql(&format!(
            "WITH picked AS MATERIALIZED ( \
                 SELECT id FROM {{s}}.deliveries \
                 WHERE status = 'pending' AND NOT parked AND due_at <= $4 \
                   AND handler = ANY($1) \
                   AND (lease_owner IS NULL OR (lease_expires_at <= $4 \
                        AND (lease_owner <> $3 OR lease_instance <> $5))) \
                 ORDER BY due_at, id LIMIT $2 \
                 FOR UPDATE SKIP LOCKED \
             ), claimed AS ( \
                 UPDATE {{s}}.deliveries AS d SET \
                     claims = d.claims + 1, \
                     attempts = d.attempts + (d.lease_owner IS NOT NULL)::int, \
                     last_error = CASE WHEN d.lease_owner IS NOT NULL THEN $7 ELSE d.last_error END, \
                     errors = CASE WHEN d.lease_owner IS NOT NULL THEN {push} ELSE d.errors END, \
                     updated_at = CASE WHEN d.lease_owner IS NOT NULL THEN $4 ELSE d.updated_at END, \
                     lease_owner = $3, lease_instance = $5, lease_expires_at = $6 \
                 WHERE d.id = ANY (ARRAY(SELECT id FROM picked)) \
                   AND (d.lease_owner IS NULL OR (d.lease_expires_at <= $4 \
                        AND (d.lease_owner <> $3 OR d.lease_instance <> $5))) \
                 RETURNING d.id, d.claims, d.attempts, d.handler, d.sequence, d.event_id, \
                     d.due_at \
             ) \
             SELECT c.id, c.claims, c.attempts, c.handler, c.sequence, {events} \
             FROM claimed AS c CROSS JOIN LATERAL ( \
                 SELECT * FROM {{s}}.events AS e WHERE e.id = c.event_id LIMIT 1) AS e \
             ORDER BY c.due_at, c.id",
            push = push_error("d.errors", lost_entry),
            events = EVENT_COLUMNS,
        ));
        let rows = sqlx::query(&sql)
            .bind(&handlers)
            .bind(i64::from(request.limit))
            .bind(request.owner)
            .bind(now)
            .bind(&self.inner.instance)
            .bind(expires.timestamp_millis())
            .bind(LOST_ERROR)
            .fetch_all(&self.inner.pool)
            .await
            .map_err(db_error)?;
        rows.iter()
            .map(|row| {
                let attempts: i32 = row.try_get("attempts").map_err(db_error)?;
                Ok(Claimed {
                    lease: PostgresLease::new(
                        row.try_get("id").map_err(db_error)?,
                        row.try_get("claims").map_err(db_error)?,
                    ),
                    lease_expires_at: expires,
                    handler: row.try_get("handler").map_err(db_error)?,
                    attempt: u32::try_from(attempts).unwrap_or(0).saturating_add(1),
                    sequence: row.try_get("sequence").map_err(db_error)?,
                    // This store hands out one delivery of a key at a time, never a run.
                    ordered: false,
                    event: event_of(row)?,
                })
            })
            .collect()
    }

    /// Completes deliveries. Those that no key order holds (the common case) complete in one
    /// statement outside a transaction; a batch with a delivery held to its key's order
    /// completes in a transaction of the store's own, which locks the keys first.
    pub(super) async fn complete_leases(
        &self,
        leases: &[PostgresLease],
        now: Timestamp,
    ) -> Result<Vec<bool>> {
        checks::check_batch(leases.len(), "complete")?;
        if leases.is_empty() {
            return Ok(Vec::new());
        }
        let batch = Batch::of(leases);
        let mut attempts = Attempts::new(None).retry_for(RETRY_LIMIT);
        let outcome = loop {
            attempts.start();
            let mut connection = self.inner.pool.acquire().await.map_err(db_error)?;
            match self.complete_unordered(&mut connection, &batch, now).await {
                Ok(outcome) => break outcome,
                Err(error) => {
                    if attempts.retry_after(&error).await {
                        continue;
                    }
                    return Err(error);
                }
            }
        };
        let done = match outcome {
            Outcome::Done(done) => done,
            Outcome::Ordered => loop {
                attempts.start();
                let mut connection = self.inner.pool.acquire().await.map_err(db_error)?;
                match self.complete_ordered(&mut connection, &batch, now).await {
                    Ok(done) => break done,
                    Err(error) => {
                        if attempts.retry_after(&error).await {
                            continue;
                        }
                        return Err(error);
                    }
                }
            },
        };
        Ok(batch.flags(&done))
    }

    /// Completes deliveries on a connection in a transaction (the handler's): as
    /// [`complete_leases`](Self::complete_leases), on that connection. One flag per lease.
    pub(super) async fn complete_on(
        &self,
        connection: &mut PgConnection,
        leases: &[PostgresLease],
        now: Timestamp,
    ) -> Result<Vec<bool>> {
        let batch = Batch::of(leases);
        let done = match self.complete_unordered(connection, &batch, now).await? {
            Outcome::Done(done) => done,
            Outcome::Ordered => self.complete_ordered(connection, &batch, now).await?,
        };
        Ok(batch.flags(&done))
    }

    /// One statement: when no lease of the batch holds a delivery held to its key's order, it
    /// deletes the deliveries the leases hold (fenced by their claim generation), records them
    /// with completion history and stamps their events. Otherwise it writes nothing, for
    /// [`complete_ordered`](Self::complete_ordered), which must lock the keys before it
    /// touches a delivery or an event.
    async fn complete_unordered(
        &self,
        connection: &mut PgConnection,
        batch: &Batch,
        now: Timestamp,
    ) -> Result<Outcome> {
        let rows = sqlx::query(&self.sql(&format!(
            "WITH held AS ( \
                 SELECT d.handler, d.key, d.key IS NOT NULL AND NOT d.unordered AS ordered \
                 FROM {{s}}.deliveries AS d WHERE {held} \
             ), done AS ( \
                 DELETE FROM {{s}}.deliveries AS d \
                 WHERE {held} AND (d.key IS NULL OR d.unordered) \
                   AND NOT EXISTS (SELECT FROM held WHERE ordered) \
                 RETURNING d.* \
             ), {record} \
             SELECT false AS ordered, id FROM done \
             UNION ALL (SELECT true, NULL FROM held WHERE ordered LIMIT 1)",
            held = HELD,
            record = RECORD,
        )))
        .bind(&batch.ids)
        .bind(&batch.claims)
        .bind(now.timestamp_millis())
        .bind(self.inner.completion_history)
        .fetch_all(&mut *connection)
        .await
        .map_err(db_error)?;
        let mut done = Vec::with_capacity(rows.len());
        for row in rows {
            if row.try_get::<bool, _>("ordered").map_err(db_error)? {
                return Ok(Outcome::Ordered);
            }
            done.push(row.try_get::<i64, _>("id").map_err(db_error)?);
        }
        Ok(Outcome::Done(done))
    }

    /// Completes a batch holding deliveries held to their keys' order in one round trip: two
    /// statements in one simple query, which PostgreSQL runs as one transaction (or inside the
    /// caller's). The first locks the keys of the ordered deliveries the leases name (a
    /// delivery's key never changes); the second, whose snapshot is taken once it holds them
    /// and so sees every append of those keys, deletes what the leases still hold, records it,
    /// stamps the events and moves the heads of the keys, leaving out the rows it deletes. The
    /// ids it completed.
    ///
    /// A simple query takes no parameters, so the values are written into the text: integers
    /// and a boolean only, never text.
    async fn complete_ordered(
        &self,
        connection: &mut PgConnection,
        batch: &Batch,
        now: Timestamp,
    ) -> Result<Vec<i64>> {
        let ids = bigint_array(&batch.ids);
        let sql = self
            .sql(&format!(
                "SELECT count(*) AS locked FROM ( \
                 SELECT FROM {{s}}.key_sequences WHERE key IN ( \
                     SELECT d.key FROM {{s}}.deliveries AS d \
                     WHERE d.id = ANY($1::bigint[]) AND d.key IS NOT NULL AND NOT d.unordered) \
                 ORDER BY key FOR NO KEY UPDATE) AS l; \
             WITH done AS ( \
                 DELETE FROM {{s}}.deliveries AS d WHERE {held} RETURNING d.* \
             ), {record}, pairs AS ( \
                 SELECT DISTINCT handler, key FROM done WHERE key IS NOT NULL AND NOT unordered \
             ), {heads} \
             SELECT id FROM done",
                held = HELD,
                record = RECORD,
                heads = super::append::MOVE_HEADS,
            ))
            .replace("$1", &ids)
            .replace("$2", &bigint_array(&batch.claims))
            .replace("$3", &now.timestamp_millis().to_string())
            .replace(
                "$4",
                if self.inner.completion_history {
                    "true"
                } else {
                    "false"
                },
            );
        let rows = connection.fetch_all(sql.as_str()).await.map_err(db_error)?;
        let mut done: Vec<i64> = Vec::with_capacity(rows.len());
        for row in &rows {
            if let Ok(id) = row.try_get::<i64, _>("id") {
                done.push(id);
            }
        }
        Ok(done)
    }
}

/// An array literal of integers, for SQL text: `'{1,2}'::bigint[]`.
fn bigint_array(values: &[i64]) -> String {
    let items: Vec<String> = values.iter().map(i64::to_string).collect();
    format!("'{{{}}}'::bigint[]", items.join(","))
}

/// The condition on `d` (deliveries) of a delivery that a lease of the batch holds: `$1` the
/// delivery ids, `$2` their claim generations. The primary key finds the rows; the generation
/// is a filter on each, so it is checked again on the row a concurrent write left.
pub(super) const HELD: &str = "d.id = ANY($1::bigint[]) \
     AND d.claims = ANY (SELECT l.claims FROM unnest($1::bigint[], $2::bigint[]) \
                         AS l(id, claims) WHERE l.id = d.id) \
     AND d.status = 'pending' AND d.lease_owner IS NOT NULL";

/// The CTEs recording the deliveries of `done` (completion history when `$4`) and stamping
/// their events' `completed_at` with `$3`.
const RECORD: &str = "history AS ( \
         INSERT INTO {s}.completed_deliveries (id, event_id, handler, event_type, key, \
             sequence, unordered, attempts, due_at, created_at, updated_at, completed_at, \
             last_error, errors, requeued) \
         SELECT id, event_id, handler, event_type, key, sequence, unordered, attempts + 1, \
             due_at, created_at, $3, $3, last_error, errors, requeued \
         FROM done WHERE $4 \
     ), stamped AS ( \
         UPDATE {s}.events AS e SET completed_at = greatest(coalesce(e.completed_at, $3), $3) \
         WHERE e.id IN (SELECT event_id FROM done) \
     )";

/// The leases of a completion, as the statements' arrays.
struct Batch {
    ids: Vec<i64>,
    claims: Vec<i64>,
}

impl Batch {
    fn of(leases: &[PostgresLease]) -> Self {
        Batch {
            ids: leases.iter().map(|l| l.delivery_id).collect(),
            claims: leases.iter().map(|l| l.claim).collect(),
        }
    }

    /// One flag per lease: whether it completed. A lease named twice completes once: its first
    /// mention.
    fn flags(&self, done: &[i64]) -> Vec<bool> {
        let mut seen = std::collections::HashSet::new();
        self.ids
            .iter()
            .map(|id| done.contains(id) && seen.insert(*id))
            .collect()
    }
}

/// What the one-statement completion did.
enum Outcome {
    /// It completed these deliveries.
    Done(Vec<i64>),
    /// It wrote nothing: the batch holds deliveries held to their keys' order.
    Ordered,
}

/// The distinct `(handler, key)` pairs of rows with those columns.
pub(super) fn pairs_of(rows: &[PgRow]) -> Result<Vec<(String, String)>> {
    let mut pairs = BTreeMap::new();
    for row in rows {
        let handler: String = row.try_get("handler").map_err(db_error)?;
        let key: Option<String> = row.try_get("key").map_err(db_error)?;
        if let Some(key) = key {
            pairs.insert((handler, key), ());
        }
    }
    Ok(pairs.into_keys().collect())
}
