//! [`Leadership`] for PostgreSQL: the `leads` table, a row per role naming its holder (the store
//! instance) and its expiry by the server's clock.
//!
//! Taking a lead is one upsert that replaces the row only when it is ours or expired. Keeping it
//! in a transaction is an update of the row under the same conditions, whose row lock lasts
//! until the transaction ends: a take-over's upsert waits for it, then reads the row the
//! transaction committed (renewed, so the take-over fails).

use std::time::Duration;

use super::{PostgresEventStore, PostgresSession, checks, db_error};
use crate::{
    error::Result,
    store::{Lead, Leadership, checks::check_role_prefix},
};

impl Leadership for PostgresEventStore {
    async fn lead(&self, role: &str, period: Duration) -> Result<bool> {
        checks::check_role(role, period)?;
        let row = sqlx::query(&self.sql(
            "INSERT INTO {s}.leads (role, holder, expires_at) \
             VALUES ($1, $2, clock_timestamp() + $3 * interval '1 millisecond') \
             ON CONFLICT (role) DO UPDATE SET holder = excluded.holder, \
                 expires_at = excluded.expires_at \
             WHERE {s}.leads.holder = excluded.holder OR {s}.leads.expires_at <= clock_timestamp() \
             RETURNING holder",
        ))
        .bind(role)
        .bind(&self.inner.instance)
        .bind(millis(period))
        .fetch_optional(&self.inner.pool)
        .await
        .map_err(db_error)?;
        Ok(row.is_some())
    }

    async fn keep_lead(
        &self,
        session: &mut PostgresSession,
        role: &str,
        period: Duration,
    ) -> Result<bool> {
        checks::check_role(role, period)?;
        session.ensure_in_transaction("PostgresEventStore.keep_lead")?;
        let kept = sqlx::query(&self.sql(
            "UPDATE {s}.leads SET expires_at = clock_timestamp() + $3 * interval '1 millisecond' \
             WHERE role = $1 AND holder = $2 AND expires_at > clock_timestamp()",
        ))
        .bind(role)
        .bind(&self.inner.instance)
        .bind(millis(period))
        .execute(session.connection())
        .await
        .map_err(db_error)?
        .rows_affected();
        Ok(kept == 1)
    }

    async fn leads(&self, prefix: &str) -> Result<Vec<Lead>> {
        check_role_prefix(prefix)?;
        let rows: Vec<(String, bool)> = sqlx::query_as(&self.sql(
            "SELECT role, holder = $2 FROM {s}.leads \
             WHERE starts_with(role, $1) AND expires_at > clock_timestamp() ORDER BY role",
        ))
        .bind(prefix)
        .bind(&self.inner.instance)
        .fetch_all(&self.inner.pool)
        .await
        .map_err(db_error)?;
        Ok(rows
            .into_iter()
            .map(|(role, ours)| Lead::new(role, ours))
            .collect())
    }

    async fn resign(&self, role: &str) -> Result<()> {
        checks::check_role(role, Duration::from_millis(1))?;
        sqlx::query(&self.sql("DELETE FROM {s}.leads WHERE role = $1 AND holder = $2"))
            .bind(role)
            .bind(&self.inner.instance)
            .execute(&self.inner.pool)
            .await
            .map_err(db_error)?;
        Ok(())
    }
}

/// A period in milliseconds, as the queries multiply an interval by it.
fn millis(period: Duration) -> f64 {
    period.as_millis() as f64
}
