//! Ending a claim other than by completion (give back, retry later, bury), renewing leases and
//! handing back an owner's deliveries. Each matches the lease's claim generation and moves it
//! on, so a lease ends once.

use std::time::Duration;

use futures::FutureExt;
use sqlx::{PgConnection, Row};

use super::{
    PostgresEventStore, PostgresLease, checks,
    claim::{HELD, push_error},
    db_error,
};
use crate::{error::Result, time::Timestamp};

/// How a claim ends.
#[derive(Debug, Clone, Copy)]
pub(super) enum Ending<'a> {
    Release,
    Reschedule { due_at: Timestamp, error: &'a str },
    Bury { error: &'a str },
}

/// The error a delivery handed back by `relinquish` while it ran is charged with.
const RELINQUISHED_ERROR: &str =
    "the worker stopped while the delivery ran and handed it back (relinquish)";

impl PostgresEventStore {
    /// Ends a claim: one statement, or a transaction for a burial, which moves its key's head.
    pub(super) async fn end_claim(
        &self,
        lease: &PostgresLease,
        ending: Ending<'_>,
        now: Timestamp,
    ) -> Result<bool> {
        match ending {
            Ending::Bury { .. } => {
                self.own_transaction(
                    &(self, lease, ending, now),
                    |connection, (store, lease, ending, now)| {
                        store.end_claim_on(connection, lease, *ending, *now).boxed()
                    },
                )
                .await
            }
            _ => {
                let mut connection = self.inner.pool.acquire().await.map_err(db_error)?;
                self.end_claim_on(&mut connection, lease, ending, now).await
            }
        }
    }

    async fn end_claim_on(
        &self,
        connection: &mut PgConnection,
        lease: &PostgresLease,
        ending: Ending<'_>,
        now: Timestamp,
    ) -> Result<bool> {
        let entry = "jsonb_build_object('at', $3::bigint, 'attempt', d.attempts + 1, \
                     'error', $5::text)";
        let (set, error, history, due) = match ending {
            Ending::Release => ("due_at = $3", None, None, None),
            Ending::Reschedule { due_at, error } => (
                "due_at = $4, attempts = d.attempts + 1, last_error = $6, errors = {push}",
                Some(checks::clip_error(error)),
                Some(checks::clip_history_error(error)),
                Some(due_at.timestamp_millis()),
            ),
            Ending::Bury { error } => (
                "status = 'dead', parked = false, attempts = d.attempts + 1, last_error = $6, \
                 errors = {push}",
                Some(checks::clip_error(error)),
                Some(checks::clip_history_error(error)),
                None,
            ),
        };
        let mut pairs = Vec::new();
        if matches!(ending, Ending::Bury { .. }) {
            let rows = sqlx::query(&self.sql(
                "SELECT handler, key FROM {s}.deliveries WHERE id = $1 AND claims = $2 \
                 AND status = 'pending' AND lease_owner IS NOT NULL \
                 AND key IS NOT NULL AND NOT unordered",
            ))
            .bind(lease.delivery_id())
            .bind(lease.claim())
            .fetch_all(&mut *connection)
            .await
            .map_err(db_error)?;
            pairs = super::claim::pairs_of(&rows)?;
            let keys: Vec<String> = pairs.iter().map(|(_, k)| k.clone()).collect();
            self.lock_keys(connection, &keys).await?;
        }
        let set = set.replace("{push}", &push_error("d.errors", entry));
        let sql = self.sql(&format!(
            "UPDATE {{s}}.deliveries AS d SET {set}, claims = d.claims + 1, updated_at = $3, \
                 lease_owner = NULL, lease_instance = NULL, lease_expires_at = NULL \
             WHERE d.id = $1 AND d.claims = $2 AND d.status = 'pending' \
               AND d.lease_owner IS NOT NULL \
               AND ($4::bigint IS NULL OR true) AND ($5::text IS NULL OR true) \
               AND ($6::text IS NULL OR true)",
        ));
        let result = sqlx::query(&sql)
            .bind(lease.delivery_id())
            .bind(lease.claim())
            .bind(now.timestamp_millis())
            .bind(due)
            .bind(history)
            .bind(error)
            .execute(&mut *connection)
            .await
            .map_err(db_error)?;
        let ended = result.rows_affected() == 1;
        if ended && !pairs.is_empty() {
            self.move_heads(connection, &pairs).await?;
        }
        Ok(ended)
    }

    /// Extends running leases to `now + lease_duration`; how many of `leases` it covered.
    pub(super) async fn renew_leases(
        &self,
        leases: &[PostgresLease],
        lease_duration: Duration,
        now: Timestamp,
    ) -> Result<usize> {
        checks::check_batch(leases.len(), "renew")?;
        checks::check_lease_duration(lease_duration)?;
        let expires = checks::add(now, lease_duration)?;
        if leases.is_empty() {
            return Ok(0);
        }
        let ids: Vec<i64> = leases.iter().map(|l| l.delivery_id()).collect();
        let claims: Vec<i64> = leases.iter().map(|l| l.claim()).collect();
        let rows = sqlx::query(&self.sql(&format!(
            "UPDATE {{s}}.deliveries AS d SET lease_expires_at = greatest(d.lease_expires_at, $3) \
             WHERE {held} RETURNING d.id",
            held = HELD,
        )))
        .bind(&ids)
        .bind(&claims)
        .bind(expires.timestamp_millis())
        .fetch_all(&self.inner.pool)
        .await
        .map_err(db_error)?;
        let mut renewed = Vec::with_capacity(rows.len());
        for row in &rows {
            renewed.push(row.try_get::<i64, _>("id").map_err(db_error)?);
        }
        Ok(leases
            .iter()
            .filter(|l| renewed.contains(&l.delivery_id()))
            .count())
    }

    /// Hands back what `owner` runs through this store instance, charging each delivery the
    /// attempt it was running; its leases match nothing afterwards.
    pub(super) async fn relinquish_owner(&self, owner: &str) -> Result<u64> {
        checks::check_owner(owner)?;
        let now = Timestamp::now().timestamp_millis();
        let entry = "jsonb_build_object('at', $3::bigint, 'attempt', NULL, 'error', $4::text)";
        let result = sqlx::query(&self.sql(&format!(
            "UPDATE {{s}}.deliveries AS d SET claims = d.claims + 1, \
                 attempts = d.attempts + 1, last_error = $4, errors = {push}, updated_at = $3, \
                 lease_owner = NULL, lease_instance = NULL, lease_expires_at = NULL \
             WHERE d.lease_owner = $1 AND d.lease_instance = $2 AND d.status = 'pending'",
            push = push_error("d.errors", entry)
        )))
        .bind(owner)
        .bind(&self.inner.instance)
        .bind(now)
        .bind(RELINQUISHED_ERROR)
        .execute(&self.inner.pool)
        .await
        .map_err(db_error)?;
        Ok(result.rows_affected())
    }
}
