//! The operator API: statistics, listings, the operator page's reads, requeue, discard, burial
//! by id, purge, and leads.

mod repair;

use std::collections::HashMap;

use sqlx::{Postgres, QueryBuilder, Row, postgres::PgRow};

use super::{
    PostgresEventStore, checks,
    claim::{EVENT_COLUMNS, event_of},
    db_error,
};
use crate::{
    error::Result,
    event::LANE_COUNT,
    store::{
        AttemptError, BlockedKey, DeadLetterGroup, DeliveryQuery, DeliveryRecord, DeliveryStatus,
        EventDetail, HandlerStatistics, LaneReport, LaneStatus, MAX_BLOCKED_KEYS,
        MAX_DEAD_LETTER_GROUPS, PendingState, Statistics,
    },
    time::Timestamp,
};

/// The columns of a delivery record, from `deliveries`.
const DELIVERY_RECORD: &str = "id, event_id, handler, event_type, key, sequence, unordered, \
     status, parked, (status = 'pending' AND lease_owner IS NOT NULL) AS running, attempts, \
     due_at, created_at, updated_at, NULL::bigint AS completed_at, last_error, \
     errors::text AS errors, requeued";

/// The columns of a delivery record, from `completed_deliveries`.
const COMPLETED_RECORD: &str = "id, event_id, handler, event_type, key, sequence, unordered, \
     'completed' AS status, false AS parked, false AS running, attempts, NULL::bigint AS due_at, \
     created_at, updated_at, completed_at, last_error, errors::text AS errors, requeued";

/// A record of a row selected with [`DELIVERY_RECORD`] or [`COMPLETED_RECORD`].
fn record_of(row: &PgRow) -> Result<DeliveryRecord> {
    let id: i64 = row.try_get("id").map_err(db_error)?;
    let status: String = row.try_get("status").map_err(db_error)?;
    let key: Option<String> = row.try_get("key").map_err(db_error)?;
    let unordered: bool = row.try_get("unordered").map_err(db_error)?;
    let running: bool = row.try_get("running").map_err(db_error)?;
    let parked: bool = row.try_get("parked").map_err(db_error)?;
    let attempts: i32 = row.try_get("attempts").map_err(db_error)?;
    let requeued: i32 = row.try_get("requeued").map_err(db_error)?;
    let errors: String = row.try_get("errors").map_err(db_error)?;
    let time = |name: &str| -> Result<Option<Timestamp>> {
        Ok(row
            .try_get::<Option<i64>, _>(name)
            .map_err(db_error)?
            .map(Timestamp::from_millis))
    };
    Ok(DeliveryRecord {
        id: id.to_string(),
        event_id: row.try_get("event_id").map_err(db_error)?,
        handler: row.try_get("handler").map_err(db_error)?,
        event_type: row.try_get("event_type").map_err(db_error)?,
        unordered: unordered && key.is_some(),
        key,
        sequence: row.try_get("sequence").map_err(db_error)?,
        status: DeliveryStatus::from_stored(&status).unwrap_or(DeliveryStatus::Pending),
        parked: parked && !running && status == "pending",
        running,
        attempts: u32::try_from(attempts).unwrap_or(0),
        due_at: time("due_at")?,
        created_at: time("created_at")?,
        updated_at: time("updated_at")?,
        completed_at: time("completed_at")?,
        last_error: row.try_get("last_error").map_err(db_error)?,
        errors: attempt_errors(&errors),
        requeues: u32::try_from(requeued).unwrap_or(0),
    })
}

/// The error history as stored: a JSON array of `{at, attempt, error}`; entries that do not
/// read are left out.
fn attempt_errors(text: &str) -> Vec<AttemptError> {
    let entries: Vec<serde_json::Value> = serde_json::from_str(text).unwrap_or_default();
    entries
        .iter()
        .filter_map(|entry| {
            Some(AttemptError::new(
                Timestamp::from_millis(entry.get("at")?.as_i64()?),
                entry
                    .get("attempt")
                    .and_then(serde_json::Value::as_u64)
                    .and_then(|a| u32::try_from(a).ok()),
                entry.get("error")?.as_str()?,
            ))
        })
        .collect()
}

/// The records of rows.
fn records_of(rows: &[PgRow]) -> Result<Vec<DeliveryRecord>> {
    rows.iter().map(record_of).collect()
}

/// A count column as `u64`.
fn count(row: &PgRow, name: &str) -> Result<u64> {
    let n: i64 = row.try_get(name).map_err(db_error)?;
    Ok(u64::try_from(n).unwrap_or(0))
}

/// The ids of rows with an `id` column.
pub(super) fn ids_of(rows: &[PgRow]) -> Result<Vec<i64>> {
    rows.iter()
        .map(|row| row.try_get("id").map_err(db_error))
        .collect()
}

impl PostgresEventStore {
    /// Counts deliveries by state.
    pub(super) async fn count_statistics(&self) -> Result<Statistics> {
        let row = sqlx::query(&self.sql(
            "SELECT count(*) FILTER (WHERE status = 'pending') AS pending, \
                 count(*) FILTER (WHERE status = 'pending' AND lease_owner IS NOT NULL) AS running, \
                 count(*) FILTER (WHERE status = 'pending' AND parked AND lease_owner IS NULL) \
                     AS parked, \
                 count(*) FILTER (WHERE status = 'dead') AS dead, \
                 min(due_at) FILTER (WHERE status = 'pending') AS oldest_due_at, \
                 (SELECT count(*) FROM {s}.completed_deliveries) AS completed \
             FROM {s}.deliveries",
        ))
        .fetch_one(&self.inner.pool)
        .await
        .map_err(db_error)?;
        Ok(Statistics {
            pending: count(&row, "pending")?,
            running: count(&row, "running")?,
            parked: count(&row, "parked")?,
            dead: count(&row, "dead")?,
            completed: count(&row, "completed")?,
            completion_history: self.inner.completion_history,
            oldest_due_at: row
                .try_get::<Option<i64>, _>("oldest_due_at")
                .map_err(db_error)?
                .map(Timestamp::from_millis),
        })
    }

    /// Counts deliveries by handler and state.
    pub(super) async fn count_handler_statistics(&self) -> Result<Vec<HandlerStatistics>> {
        let rows = sqlx::query(&self.sql(
            "SELECT handler, \
                 count(*) FILTER (WHERE status = 'pending') AS pending, \
                 count(*) FILTER (WHERE status = 'pending' AND lease_owner IS NOT NULL) AS running, \
                 count(*) FILTER (WHERE status = 'pending' AND parked AND lease_owner IS NULL) \
                     AS parked, \
                 count(*) FILTER (WHERE status = 'dead') AS dead, \
                 min(due_at) FILTER (WHERE status = 'pending') AS oldest_due_at \
             FROM {s}.deliveries GROUP BY handler ORDER BY handler",
        ))
        .fetch_all(&self.inner.pool)
        .await
        .map_err(db_error)?;
        rows.iter()
            .map(|row| {
                let mut stats =
                    HandlerStatistics::new(row.try_get::<String, _>("handler").map_err(db_error)?);
                stats.pending = count(row, "pending")?;
                stats.running = count(row, "running")?;
                stats.parked = count(row, "parked")?;
                stats.dead = count(row, "dead")?;
                stats.oldest_due_at = row
                    .try_get::<Option<i64>, _>("oldest_due_at")
                    .map_err(db_error)?
                    .map(Timestamp::from_millis);
                Ok(stats)
            })
            .collect()
    }

    /// Lists deliveries, a page at a time, by id.
    pub(super) async fn list(&self, query: &DeliveryQuery) -> Result<Vec<DeliveryRecord>> {
        checks::check_list_limit(query.limit)?;
        let after = query
            .after
            .as_deref()
            .map(checks::parse_after)
            .transpose()?;
        // PostgreSQL text holds no NUL character: a filter with one matches nothing.
        let texts = [
            &query.handler,
            &query.event_type,
            &query.key,
            &query.event_id,
        ];
        if texts
            .iter()
            .any(|t| t.as_deref().is_some_and(|t| t.contains('\0')))
        {
            return Ok(Vec::new());
        }
        let (columns, table, status) = match (query.status, query.pending_state) {
            (Some(DeliveryStatus::Completed), Some(_)) => return Ok(Vec::new()),
            (Some(DeliveryStatus::Dead), Some(_)) => return Ok(Vec::new()),
            (Some(DeliveryStatus::Completed), None) => {
                (COMPLETED_RECORD, "completed_deliveries", None)
            }
            (Some(DeliveryStatus::Dead), None) => (DELIVERY_RECORD, "deliveries", Some("dead")),
            (_, Some(_)) | (Some(DeliveryStatus::Pending), None) => {
                (DELIVERY_RECORD, "deliveries", Some("pending"))
            }
            (None, None) => (DELIVERY_RECORD, "deliveries", None),
        };
        let mut sql: QueryBuilder<'_, Postgres> =
            QueryBuilder::new(self.sql(&format!("SELECT {columns} FROM {{s}}.{table} WHERE true")));
        if let Some(status) = status {
            sql.push(" AND status = ").push_bind(status);
        }
        match query.pending_state {
            Some(PendingState::Running) => sql.push(" AND lease_owner IS NOT NULL"),
            Some(PendingState::Parked) => sql.push(" AND parked AND lease_owner IS NULL"),
            Some(PendingState::Waiting) => sql.push(" AND NOT parked AND lease_owner IS NULL"),
            _ => &mut sql,
        };
        if let Some(handler) = &query.handler {
            sql.push(" AND handler = ").push_bind(handler.clone());
        }
        if let Some(event_type) = &query.event_type {
            sql.push(" AND event_type = ").push_bind(event_type.clone());
        }
        if let Some(from) = query.created_from {
            sql.push(" AND created_at >= ")
                .push_bind(from.timestamp_millis());
        }
        if let Some(before) = query.created_before {
            sql.push(" AND created_at < ")
                .push_bind(before.timestamp_millis());
        }
        if let Some(key) = &query.key {
            sql.push(" AND key = ").push_bind(key.clone());
        }
        if let Some(event_id) = &query.event_id {
            sql.push(" AND event_id = ").push_bind(event_id.clone());
        }
        if let Some(text) = &query.error_contains {
            sql.push(" AND strpos(lower(last_error), lower(")
                .push_bind(text.replace('\0', "\u{fffd}"))
                .push(")) > 0");
        }
        if let Some(error) = &query.last_error {
            sql.push(" AND last_error = ")
                .push_bind(error.replace('\0', "\u{fffd}"));
        }
        if let Some(after) = after {
            sql.push(" AND id > ").push_bind(after);
        }
        sql.push(" ORDER BY id LIMIT ")
            .push_bind(i64::from(query.limit));
        let rows = sql
            .build()
            .fetch_all(&self.inner.pool)
            .await
            .map_err(db_error)?;
        records_of(&rows)
    }

    /// An event with every delivery and completion record of it.
    pub(super) async fn detail(&self, event_id: &str) -> Result<Option<EventDetail>> {
        if event_id.contains('\0') {
            // No stored id has one: ids with control characters are refused.
            return Ok(None);
        }
        let Some(row) = sqlx::query(&self.sql(&format!(
            "SELECT {EVENT_COLUMNS}, e.sequence, e.handlers, e.completed_at \
             FROM {{s}}.events AS e WHERE e.id = $1"
        )))
        .bind(event_id)
        .fetch_optional(&self.inner.pool)
        .await
        .map_err(db_error)?
        else {
            return Ok(None);
        };
        let rows = sqlx::query(&self.sql(&format!(
            "SELECT * FROM ( \
                 SELECT {DELIVERY_RECORD} FROM {{s}}.deliveries WHERE event_id = $1 \
                 UNION ALL \
                 SELECT {COMPLETED_RECORD} FROM {{s}}.completed_deliveries WHERE event_id = $1 \
             ) AS r ORDER BY handler, id"
        )))
        .bind(event_id)
        .fetch_all(&self.inner.pool)
        .await
        .map_err(db_error)?;
        let deliveries = records_of(&rows)?;
        let unfinished = deliveries
            .iter()
            .any(|d| d.status != DeliveryStatus::Completed);
        let completed_at: Option<i64> = row.try_get("completed_at").map_err(db_error)?;
        Ok(Some(EventDetail {
            event: event_of(&row)?,
            sequence: row.try_get("sequence").map_err(db_error)?,
            completed_at: if unfinished {
                None
            } else {
                completed_at.map(Timestamp::from_millis)
            },
            handlers: row.try_get("handlers").map_err(db_error)?,
            deliveries,
        }))
    }

    /// The 256 lanes with what runs in them, and the keys with parked deliveries.
    pub(super) async fn lane_report(&self) -> Result<LaneReport> {
        let mut lanes: Vec<LaneStatus> = (0..LANE_COUNT).map(LaneStatus::new).collect();
        let rows = sqlx::query(&self.sql(
            "SELECT lane, min(lease_owner) AS owner, max(lease_expires_at) AS expires, \
                 count(*) AS in_flight \
             FROM {s}.deliveries WHERE status = 'pending' AND lease_owner IS NOT NULL \
             GROUP BY lane",
        ))
        .fetch_all(&self.inner.pool)
        .await
        .map_err(db_error)?;
        for row in &rows {
            let lane: i32 = row.try_get("lane").map_err(db_error)?;
            let Some(status) = usize::try_from(lane).ok().and_then(|l| lanes.get_mut(l)) else {
                continue;
            };
            status.owner = row.try_get("owner").map_err(db_error)?;
            status.lease_expires_at = row
                .try_get::<Option<i64>, _>("expires")
                .map_err(db_error)?
                .map(Timestamp::from_millis);
            status.in_flight = u32::try_from(count(row, "in_flight")?).unwrap_or(u32::MAX);
        }

        let rows = sqlx::query(&self.sql(
            "SELECT handler, key, count(*) AS parked, min(sequence) AS first \
             FROM {s}.deliveries \
             WHERE status = 'pending' AND parked AND lease_owner IS NULL AND key IS NOT NULL \
             GROUP BY handler, key ORDER BY count(*) DESC, handler, key LIMIT $1",
        ))
        .bind(MAX_BLOCKED_KEYS as i64)
        .fetch_all(&self.inner.pool)
        .await
        .map_err(db_error)?;
        let mut blocked = Vec::with_capacity(rows.len());
        for row in &rows {
            blocked.push(BlockedKey {
                handler: row.try_get("handler").map_err(db_error)?,
                key: row
                    .try_get::<Option<String>, _>("key")
                    .map_err(db_error)?
                    .unwrap_or_default(),
                parked: count(row, "parked")?,
                first_parked_sequence: row.try_get("first").map_err(db_error)?,
                waiting_for: None,
            });
        }
        if !blocked.is_empty() {
            let handlers: Vec<&str> = blocked.iter().map(|b| b.handler.as_str()).collect();
            let keys: Vec<&str> = blocked.iter().map(|b| b.key.as_str()).collect();
            let rows = sqlx::query(&self.sql(&format!(
                "SELECT DISTINCT ON (handler, key) {DELIVERY_RECORD} FROM {{s}}.deliveries \
                 WHERE (handler, key) IN (SELECT * FROM unnest($1::text[], $2::text[])) \
                   AND status = 'pending' AND key IS NOT NULL AND NOT unordered AND NOT parked \
                 ORDER BY handler, key, sequence"
            )))
            .bind(&handlers)
            .bind(&keys)
            .fetch_all(&self.inner.pool)
            .await
            .map_err(db_error)?;
            let mut heads: HashMap<(String, String), DeliveryRecord> = HashMap::new();
            for record in records_of(&rows)? {
                if let Some(key) = record.key.clone() {
                    heads.insert((record.handler.clone(), key), record);
                }
            }
            for key in &mut blocked {
                key.waiting_for = heads.remove(&(key.handler.clone(), key.key.clone()));
            }
        }
        Ok(LaneReport { lanes, blocked })
    }

    /// Dead letters grouped by handler and last error.
    pub(super) async fn dead_groups(&self, handler: Option<&str>) -> Result<Vec<DeadLetterGroup>> {
        if handler.is_some_and(|h| h.contains('\0')) {
            return Ok(Vec::new());
        }
        let rows = sqlx::query(&self.sql(
            "SELECT handler, last_error, count(*) AS n, min(created_at) AS first_created_at, \
                 max(updated_at) AS last_updated_at, min(id) AS sample \
             FROM {s}.deliveries WHERE status = 'dead' AND ($1::text IS NULL OR handler = $1) \
             GROUP BY handler, last_error \
             ORDER BY count(*) DESC, handler, last_error NULLS LAST LIMIT $2",
        ))
        .bind(handler)
        .bind(MAX_DEAD_LETTER_GROUPS as i64)
        .fetch_all(&self.inner.pool)
        .await
        .map_err(db_error)?;
        rows.iter()
            .map(|row| {
                let sample: i64 = row.try_get("sample").map_err(db_error)?;
                let time = |name: &str| -> Result<Option<Timestamp>> {
                    Ok(row
                        .try_get::<Option<i64>, _>(name)
                        .map_err(db_error)?
                        .map(Timestamp::from_millis))
                };
                Ok(DeadLetterGroup {
                    handler: row.try_get("handler").map_err(db_error)?,
                    error: row.try_get("last_error").map_err(db_error)?,
                    count: count(row, "n")?,
                    first_created_at: time("first_created_at")?,
                    last_updated_at: time("last_updated_at")?,
                    sample_id: sample.to_string(),
                })
            })
            .collect()
    }
}
