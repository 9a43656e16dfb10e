//! The limits of the PostgreSQL store: the `slots` and `rate_windows` tables, each write one
//! statement.

use sqlx::Row;

use super::{PostgresEventStore, db_error};
use crate::{
    error::Result,
    store::{Limits, Slot, SlotRequest, StartsRequest, rate_window},
    time::Timestamp,
};

/// Of the handler's slots `0..limit`, one not held now (at random, so that buses taking at once
/// spread), inserted or taken over from an expired holder. A row another bus took meanwhile
/// fails the `ON CONFLICT .. WHERE` and returns nothing.
const TAKE: &str = "WITH candidate AS ( \
         SELECT n FROM generate_series(0, $2 - 1) AS n \
         WHERE NOT EXISTS (SELECT 1 FROM {s}.slots h \
             WHERE h.handler = $1 AND h.slot = n AND h.expires_at > $5) \
         ORDER BY random() LIMIT 1) \
     INSERT INTO {s}.slots (handler, slot, holder, owner, expires_at) \
     SELECT $1, n, $3, $4, $6 FROM candidate \
     ON CONFLICT (handler, slot) DO UPDATE SET holder = excluded.holder, \
         owner = excluded.owner, expires_at = excluded.expires_at \
     WHERE {s}.slots.expires_at <= $5 \
     RETURNING slot";

/// A newer window starts the count afresh; the current one (or an older one, from a bus whose
/// clock is behind) adds what it grants. `granted` keeps what this write granted, for its
/// `RETURNING`. `$3`: wanted; `$4`: the rate.
const TAKE_STARTS: &str = "INSERT INTO {s}.rate_windows AS w (handler, window_start, starts, granted) \
     VALUES ($1, $2, LEAST($3, $4), LEAST($3, $4)) \
     ON CONFLICT (handler) DO UPDATE SET \
         starts = CASE WHEN excluded.window_start > w.window_start THEN LEAST($3, $4) \
             ELSE w.starts + LEAST($3, GREATEST(0, $4 - w.starts)) END, \
         granted = CASE WHEN excluded.window_start > w.window_start THEN LEAST($3, $4) \
             ELSE LEAST($3, GREATEST(0, $4 - w.starts)) END, \
         window_start = GREATEST(excluded.window_start, w.window_start) \
     RETURNING granted";

impl Limits for PostgresEventStore {
    async fn take_slot(&self, request: SlotRequest<'_>) -> Result<Option<Slot>> {
        // The holder token is made before the statement picks the index; it names the taking,
        // not the slot.
        let token = Slot::taken(request.handler, 0, request.owner).holder;
        for _ in 0..3 {
            let row = sqlx::query(&self.sql(TAKE))
                .bind(request.handler)
                .bind(i32::try_from(request.limit).unwrap_or(i32::MAX))
                .bind(&token)
                .bind(request.owner)
                .bind(request.now.timestamp_millis())
                .bind(
                    request
                        .now
                        .saturating_add(request.lease_duration)
                        .timestamp_millis(),
                )
                .fetch_optional(&self.inner.pool)
                .await;
            match row {
                Ok(Some(row)) => {
                    let index: i32 = row.try_get("slot").map_err(db_error)?;
                    return Ok(Some(Slot {
                        handler: request.handler.to_owned(),
                        index: index as u32,
                        holder: token,
                    }));
                }
                Ok(None) => return Ok(None),
                // Two takers inserted the same new slot at once: pick again.
                Err(sqlx::Error::Database(error)) if error.is_unique_violation() => continue,
                Err(error) => return Err(db_error(error)),
            }
        }
        Ok(None)
    }

    async fn renew_slots(&self, slots: &[Slot], until: Timestamp) -> Result<usize> {
        if slots.is_empty() {
            return Ok(0);
        }
        let handlers: Vec<&str> = slots.iter().map(|s| s.handler.as_str()).collect();
        let indexes: Vec<i32> = slots.iter().map(|s| s.index as i32).collect();
        let holders: Vec<&str> = slots.iter().map(|s| s.holder.as_str()).collect();
        let renewed = sqlx::query(&self.sql(
            "UPDATE {s}.slots h SET expires_at = $4 \
             FROM unnest($1::text[], $2::int[], $3::text[]) AS r(handler, slot, holder) \
             WHERE h.handler = r.handler AND h.slot = r.slot AND h.holder = r.holder",
        ))
        .bind(&handlers)
        .bind(&indexes)
        .bind(&holders)
        .bind(until.timestamp_millis())
        .execute(&self.inner.pool)
        .await
        .map_err(db_error)?;
        Ok(renewed.rows_affected() as usize)
    }

    async fn give_back_slot(&self, slot: &Slot) -> Result<bool> {
        let deleted = sqlx::query(
            &self.sql("DELETE FROM {s}.slots WHERE handler = $1 AND slot = $2 AND holder = $3"),
        )
        .bind(&slot.handler)
        .bind(slot.index as i32)
        .bind(&slot.holder)
        .execute(&self.inner.pool)
        .await
        .map_err(db_error)?;
        Ok(deleted.rows_affected() == 1)
    }

    async fn take_starts(&self, request: StartsRequest<'_>) -> Result<(u32, Timestamp)> {
        let (start, end) = rate_window(request.interval, request.now);
        let granted: i64 = sqlx::query_scalar(&self.sql(TAKE_STARTS))
            .bind(request.handler)
            .bind(start)
            .bind(i64::from(request.wanted))
            .bind(i64::from(request.rate))
            .fetch_one(&self.inner.pool)
            .await
            .map_err(db_error)?;
        Ok((u32::try_from(granted).unwrap_or(0), end))
    }
}
