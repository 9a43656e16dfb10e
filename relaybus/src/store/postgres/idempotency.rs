//! [`IdempotentRequests`] for PostgreSQL: the `idempotency_keys` table.
//!
//! A transaction takes a key with a transaction-level advisory lock on the schema and the key's
//! id (`pg_try_advisory_xact_lock`, which never waits: a lock held elsewhere means the request is
//! running), then reads the stored answer in a statement of its own, whose snapshot is taken
//! once the lock is held and so sees the answer of a transaction that held the lock before.
//! The answer is written with an upsert (an expired one is replaced) in the same transaction.

use sqlx::Row;

use super::{PostgresEventStore, PostgresSession, db_error};
use crate::{
    error::Result,
    store::{IdempotentRequests, RequestKey, RequestKeyState, StoredResponse},
    time::Timestamp,
};

/// The seed of the 64-bit hash that names a key's advisory lock: "ridm".
const LOCK_SEED: i64 = 0x7269_646d;

impl IdempotentRequests for PostgresEventStore {
    async fn take_request_key(
        &self,
        session: &mut PostgresSession,
        key: &RequestKey<'_>,
        now: Timestamp,
    ) -> Result<RequestKeyState> {
        key.check()?;
        session.ensure_in_transaction("PostgresEventStore.take_request_key")?;
        let id = key.id();
        // Advisory locks are the database's, not the schema's: the schema is part of the name.
        let taken: bool =
            sqlx::query_scalar("SELECT pg_try_advisory_xact_lock(hashtextextended($1, $2))")
                .bind(format!("{}.{id}", self.inner.schema))
                .bind(LOCK_SEED)
                .fetch_one(session.connection())
                .await
                .map_err(db_error)?;
        if !taken {
            return Ok(RequestKeyState::Running);
        }
        let row = sqlx::query(&self.sql(
            "SELECT fingerprint, status, headers, body, created_at, expires_at \
             FROM {s}.idempotency_keys WHERE id = $1 AND expires_at > $2",
        ))
        .bind(&id)
        .bind(now.timestamp_millis())
        .fetch_optional(session.connection())
        .await
        .map_err(db_error)?;
        let Some(row) = row else {
            return Ok(RequestKeyState::Taken);
        };
        let read = || -> std::result::Result<StoredResponse, sqlx::Error> {
            let status: i32 = row.try_get("status")?;
            let headers: sqlx::types::Json<Vec<(String, String)>> = row.try_get("headers")?;
            Ok(StoredResponse::new(
                row.try_get::<String, _>("fingerprint")?,
                u16::try_from(status).unwrap_or(500),
                headers.0,
                row.try_get("body")?,
                Timestamp::from_millis(row.try_get("created_at")?),
                Timestamp::from_millis(row.try_get("expires_at")?),
            ))
        };
        Ok(RequestKeyState::Answered(read().map_err(db_error)?))
    }

    async fn store_response(
        &self,
        session: &mut PostgresSession,
        key: &RequestKey<'_>,
        response: &StoredResponse,
    ) -> Result<()> {
        key.check()?;
        session.ensure_in_transaction("PostgresEventStore.store_response")?;
        sqlx::query(&self.sql(
            "INSERT INTO {s}.idempotency_keys (id, key, method, route, caller, fingerprint, \
                 status, headers, body, created_at, expires_at) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11) \
             ON CONFLICT (id) DO UPDATE SET fingerprint = excluded.fingerprint, \
                 status = excluded.status, headers = excluded.headers, body = excluded.body, \
                 created_at = excluded.created_at, expires_at = excluded.expires_at",
        ))
        .bind(key.id())
        .bind(key.key)
        .bind(key.method)
        .bind(key.route)
        .bind(key.caller)
        .bind(&response.fingerprint)
        .bind(i32::from(response.status))
        .bind(sqlx::types::Json(&response.headers))
        .bind(&response.body)
        .bind(response.created_at.timestamp_millis())
        .bind(response.expires_at.timestamp_millis())
        .execute(session.connection())
        .await
        .map_err(db_error)?;
        Ok(())
    }
}
