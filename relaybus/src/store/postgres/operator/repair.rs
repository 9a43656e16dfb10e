//! Operator writes: discarding and requeueing dead letters, burying pending deliveries, purging
//! finished events.

use std::collections::HashMap;

use futures::FutureExt;
use sqlx::{PgConnection, Row};

use super::super::{
    PostgresEventStore, checks,
    claim::{pairs_of, push_error},
    db_error,
};
use super::ids_of;
use crate::{
    error::Result,
    store::{Buried, Discarded, PurgeOptions, Purged, Requeued},
    time::Timestamp,
};

impl PostgresEventStore {
    /// Deletes dead deliveries; an event left with none is finished from `now`.
    pub(crate) async fn discard_ids(&self, ids: &[String], now: Timestamp) -> Result<Discarded> {
        let (parsed, mut not_found) = checks::parse_ids(ids, "discard")?;
        if parsed.is_empty() {
            return Ok(Discarded {
                not_found,
                ..Discarded::default()
            });
        }
        let sql = self.sql(
            "WITH gone AS ( \
                 DELETE FROM {s}.deliveries WHERE id = ANY($1) AND status = 'dead' \
                 RETURNING id, event_id \
             ), finished AS ( \
                 UPDATE {s}.events AS e SET completed_at = greatest(coalesce(e.completed_at, $2), $2) \
                 WHERE e.id IN (SELECT event_id FROM gone) \
                   AND NOT EXISTS (SELECT 1 FROM {s}.deliveries AS d \
                       WHERE d.event_id = e.id AND d.id NOT IN (SELECT id FROM gone)) \
             ) \
             SELECT id FROM gone",
        );
        let rows = sqlx::query(&sql)
            .bind(&parsed)
            .bind(now.timestamp_millis())
            .fetch_all(&self.inner.pool)
            .await
            .map_err(db_error)?;
        let gone = ids_of(&rows)?;
        not_found.extend(
            parsed
                .iter()
                .filter(|id| !gone.contains(id))
                .map(i64::to_string),
        );
        Ok(Discarded {
            discarded: gone.iter().map(i64::to_string).collect(),
            not_found,
        })
    }

    /// Buries pending deliveries no worker runs.
    pub(crate) async fn bury_ids(
        &self,
        ids: &[String],
        reason: &str,
        now: Timestamp,
    ) -> Result<Buried> {
        let (parsed, mut not_found) = checks::parse_ids(ids, "bury")?;
        checks::check_reason(reason)?;
        if parsed.is_empty() {
            return Ok(Buried {
                not_found,
                ..Buried::default()
            });
        }
        let error = format!("buried by an operator: {reason}");
        let (buried, running) = self
            .own_transaction(
                &(self, parsed.as_slice(), error.as_str(), now),
                |connection, (store, ids, error, now)| {
                    store.bury_ids_on(connection, ids, error, *now).boxed()
                },
            )
            .await?;
        not_found.extend(
            parsed
                .iter()
                .filter(|id| !buried.contains(id) && !running.contains(id))
                .map(i64::to_string),
        );
        Ok(Buried {
            buried: buried.iter().map(i64::to_string).collect(),
            running: running.iter().map(i64::to_string).collect(),
            not_found,
        })
    }

    async fn bury_ids_on(
        &self,
        connection: &mut PgConnection,
        ids: &[i64],
        error: &str,
        now: Timestamp,
    ) -> Result<(Vec<i64>, Vec<i64>)> {
        let rows = sqlx::query(&self.sql(
            "SELECT handler, key FROM {s}.deliveries WHERE id = ANY($1) AND status = 'pending' \
             AND key IS NOT NULL AND NOT unordered",
        ))
        .bind(ids)
        .fetch_all(&mut *connection)
        .await
        .map_err(db_error)?;
        let pairs = pairs_of(&rows)?;
        let keys: Vec<String> = pairs.iter().map(|(_, k)| k.clone()).collect();
        self.lock_keys(connection, &keys).await?;
        let entry = "jsonb_build_object('at', $2::bigint, 'attempt', NULL, 'error', $4::text)";
        let rows = sqlx::query(&self.sql(&format!(
            "UPDATE {{s}}.deliveries AS d SET status = 'dead', parked = false, last_error = $3, \
                 errors = {push}, claims = d.claims + 1, updated_at = $2 \
             WHERE d.id = ANY($1) AND d.status = 'pending' AND d.lease_owner IS NULL \
             RETURNING d.id",
            push = push_error("d.errors", entry)
        )))
        .bind(ids)
        .bind(now.timestamp_millis())
        .bind(checks::clip_error(error))
        .bind(checks::clip_history_error(error))
        .fetch_all(&mut *connection)
        .await
        .map_err(db_error)?;
        let buried = ids_of(&rows)?;
        let rows = sqlx::query(&self.sql(
            "SELECT id FROM {s}.deliveries WHERE id = ANY($1) AND status = 'pending' \
             AND lease_owner IS NOT NULL",
        ))
        .bind(ids)
        .fetch_all(&mut *connection)
        .await
        .map_err(db_error)?;
        let running = ids_of(&rows)?;
        if !buried.is_empty() {
            self.move_heads(connection, &pairs).await?;
        }
        Ok((buried, running))
    }

    /// Makes dead deliveries pending again, unless a later delivery of their key runs.
    pub(crate) async fn requeue_ids(&self, ids: &[String], now: Timestamp) -> Result<Requeued> {
        let (parsed, not_found) = checks::parse_ids(ids, "requeue")?;
        if parsed.is_empty() {
            return Ok(Requeued {
                not_found,
                ..Requeued::default()
            });
        }
        let (requeued, blocked) = self
            .own_transaction(
                &(self, parsed.as_slice(), now),
                |connection, (store, ids, now)| store.requeue_on(connection, ids, *now).boxed(),
            )
            .await?;
        let mut not_found = not_found;
        not_found.extend(
            parsed
                .iter()
                .filter(|id| !requeued.contains(id) && !blocked.contains(id))
                .map(i64::to_string),
        );
        Ok(Requeued {
            requeued: requeued.iter().map(i64::to_string).collect(),
            blocked: blocked.iter().map(i64::to_string).collect(),
            not_found,
        })
    }

    async fn requeue_on(
        &self,
        connection: &mut PgConnection,
        ids: &[i64],
        now: Timestamp,
    ) -> Result<(Vec<i64>, Vec<i64>)> {
        let dead = sqlx::query(&self.sql(
            "SELECT id, handler, key, sequence, unordered FROM {s}.deliveries \
             WHERE id = ANY($1) AND status = 'dead' ORDER BY id",
        ))
        .bind(ids)
        .fetch_all(&mut *connection)
        .await
        .map_err(db_error)?;
        if dead.is_empty() {
            return Ok((Vec::new(), Vec::new()));
        }
        let mut pairs: Vec<(String, String)> = Vec::new();
        for row in &dead {
            let unordered: bool = row.try_get("unordered").map_err(db_error)?;
            let key: Option<String> = row.try_get("key").map_err(db_error)?;
            if let (false, Some(key)) = (unordered, key) {
                pairs.push((row.try_get("handler").map_err(db_error)?, key));
            }
        }
        pairs.sort();
        pairs.dedup();
        let keys: Vec<String> = pairs.iter().map(|(_, k)| k.clone()).collect();
        self.lock_keys(connection, &keys).await?;
        // The heads of those keys, locked: a claim skips them until this commits, and one
        // that took a head first is seen running.
        let mut running: HashMap<(String, String), Vec<i64>> = HashMap::new();
        if !pairs.is_empty() {
            let (handlers, keys): (Vec<&str>, Vec<&str>) =
                pairs.iter().map(|(h, k)| (h.as_str(), k.as_str())).unzip();
            let heads = sqlx::query(&self.sql(
                "SELECT d.handler, d.key, d.sequence, d.lease_owner IS NOT NULL AS running \
                 FROM {s}.deliveries AS d \
                 JOIN unnest($1::text[], $2::text[]) AS p(handler, key) \
                   ON d.handler = p.handler AND d.key = p.key \
                 WHERE d.status = 'pending' AND NOT d.unordered AND NOT d.parked \
                 FOR UPDATE OF d",
            ))
            .bind(&handlers)
            .bind(&keys)
            .fetch_all(&mut *connection)
            .await
            .map_err(db_error)?;
            for head in &heads {
                if head.try_get::<bool, _>("running").map_err(db_error)? {
                    let handler: String = head.try_get("handler").map_err(db_error)?;
                    let key: String = head.try_get("key").map_err(db_error)?;
                    let sequence: Option<i64> = head.try_get("sequence").map_err(db_error)?;
                    running
                        .entry((handler, key))
                        .or_default()
                        .push(sequence.unwrap_or(i64::MAX));
                }
            }
        }
        let (mut requeue, mut blocked) = (Vec::new(), Vec::new());
        for row in &dead {
            let id: i64 = row.try_get("id").map_err(db_error)?;
            let handler: String = row.try_get("handler").map_err(db_error)?;
            let key: Option<String> = row.try_get("key").map_err(db_error)?;
            let unordered: bool = row.try_get("unordered").map_err(db_error)?;
            let sequence: Option<i64> = row.try_get("sequence").map_err(db_error)?;
            let later_runs = match key {
                Some(key) if !unordered => running
                    .get(&(handler, key))
                    .is_some_and(|runs| runs.iter().any(|&s| s > sequence.unwrap_or(i64::MIN))),
                _ => false,
            };
            if later_runs {
                blocked.push(id);
            } else {
                requeue.push(id);
            }
        }
        if requeue.is_empty() {
            return Ok((Vec::new(), blocked));
        }
        let rows = sqlx::query(&self.sql(
            "UPDATE {s}.deliveries SET status = 'pending', parked = false, attempts = 0, \
                 due_at = $2, updated_at = $2, claims = claims + 1, requeued = requeued + 1, \
                 lease_owner = NULL, lease_instance = NULL, lease_expires_at = NULL \
             WHERE id = ANY($1) AND status = 'dead' RETURNING id",
        ))
        .bind(&requeue)
        .bind(now.timestamp_millis())
        .fetch_all(&mut *connection)
        .await
        .map_err(db_error)?;
        let requeued = ids_of(&rows)?;
        self.move_heads(connection, &pairs).await?;
        Ok((requeued, blocked))
    }

    /// Deletes what `options` lets go, in batches of the purge batch size.
    pub(crate) async fn purge_by(&self, options: &PurgeOptions) -> Result<Purged> {
        let mut purged = Purged::default();
        if let Some(cutoff) = options.dead_before {
            purged.dead_deliveries = self
                .purge_batches(
                    "DELETE FROM {s}.deliveries WHERE id IN ( \
                         SELECT id FROM {s}.deliveries WHERE status = 'dead' AND updated_at < $1 \
                         ORDER BY id LIMIT $3 FOR UPDATE SKIP LOCKED)",
                    cutoff,
                    None,
                )
                .await?;
        }
        if let Some(cutoff) = options.completed_before {
            purged.completion_records = self
                .purge_batches(
                    "DELETE FROM {s}.completed_deliveries WHERE id IN ( \
                         SELECT id FROM {s}.completed_deliveries WHERE completed_at < $1 \
                         ORDER BY id LIMIT $3 FOR UPDATE SKIP LOCKED)",
                    cutoff,
                    None,
                )
                .await?;
        }
        if let Some(earliest) = options.earliest() {
            purged.events = self
                .purge_batches(
                    "DELETE FROM {s}.events WHERE id IN ( \
                         SELECT e.id FROM {s}.events AS e \
                         WHERE ((e.completed_at IS NULL AND e.created_at < $1) \
                                OR (e.completed_at IS NOT NULL AND e.completed_at < $2)) \
                           AND NOT EXISTS (SELECT 1 FROM {s}.deliveries AS d \
                               WHERE d.event_id = e.id) \
                         LIMIT $3 FOR UPDATE SKIP LOCKED)",
                    earliest,
                    options.completed_before,
                )
                .await?;
        }
        if let Some(now) = options.request_keys_expired_at {
            purged.request_keys = self
                .purge_batches(
                    "DELETE FROM {s}.idempotency_keys WHERE id IN ( \
                         SELECT id FROM {s}.idempotency_keys WHERE expires_at <= $1 \
                         ORDER BY expires_at LIMIT $3 FOR UPDATE SKIP LOCKED)",
                    now,
                    None,
                )
                .await?;
        }
        Ok(purged)
    }

    /// Runs one purge statement until a batch deletes less than the batch size.
    async fn purge_batches(
        &self,
        template: &str,
        cutoff: Timestamp,
        second: Option<Timestamp>,
    ) -> Result<u64> {
        let sql = self.sql(&format!("{template} AND ($2::bigint IS NULL OR true)"));
        let batch = u64::from(self.inner.purge_batch_size);
        let mut total = 0;
        loop {
            let deleted = sqlx::query(&sql)
                .bind(cutoff.timestamp_millis())
                .bind(second.map(Timestamp::timestamp_millis))
                .bind(batch as i64)
                .execute(&self.inner.pool)
                .await
                .map_err(db_error)?
                .rows_affected();
            total += deleted;
            if deleted < batch {
                return Ok(total);
            }
        }
    }
}
