//! Creating the schema, its tables and indexes, idempotently.

use futures::FutureExt;
use sqlx::Executor;

use super::{PostgresEventStore, db_error};
use crate::error::Result;

/// The first key of the advisory lock setups take (the second is the schema's hash): "rbus".
const SETUP_LOCK_CLASS: i32 = 0x7262_7573;

/// The tables and indexes, `{s}` standing for the schema.
const DDL: &str = r#"
CREATE SCHEMA IF NOT EXISTS {s};

CREATE TABLE IF NOT EXISTS {s}.events (
    id text PRIMARY KEY,
    event_type text NOT NULL,
    key text,
    sequence bigint,
    payload json NOT NULL,
    headers json NOT NULL,
    correlation_id text,
    causation_id text,
    created_at bigint NOT NULL,
    appended_at bigint NOT NULL,
    handlers text[] NOT NULL,
    completed_at bigint
) WITH (fillfactor = 70);

CREATE TABLE IF NOT EXISTS {s}.key_sequences (
    key text PRIMARY KEY,
    sequence bigint NOT NULL
);

-- How far each consumer of a partitioned log (a Kafka topic) took records into the store:
-- written in the transaction that appended them.
CREATE TABLE IF NOT EXISTS {s}.consumer_positions (
    consumer text NOT NULL,
    source text NOT NULL,
    partition integer NOT NULL,
    next_offset bigint NOT NULL,
    updated_at bigint NOT NULL,
    PRIMARY KEY (consumer, source, partition)
);

CREATE TABLE IF NOT EXISTS {s}.deliveries (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    event_id text NOT NULL REFERENCES {s}.events (id),
    handler text NOT NULL,
    event_type text NOT NULL,
    key text,
    sequence bigint,
    unordered boolean NOT NULL DEFAULT false,
    status text NOT NULL CHECK (status IN ('pending', 'dead')),
    parked boolean NOT NULL DEFAULT false,
    attempts integer NOT NULL DEFAULT 0,
    due_at bigint NOT NULL,
    created_at bigint NOT NULL,
    updated_at bigint,
    last_error text,
    errors jsonb NOT NULL DEFAULT '[]',
    requeued integer NOT NULL DEFAULT 0,
    claims bigint NOT NULL DEFAULT 0,
    lease_owner text,
    lease_instance text,
    lease_expires_at bigint,
    lane integer NOT NULL,
    UNIQUE (event_id, handler)
) WITH (fillfactor = 50);

-- A claim writes only columns no index reads (the lease and the claim generation), into the
-- free half of the row's page, so it is a heap-only (HOT) update that writes no index entry.
-- Tables made before this kept the default fill factor, and an index of the lease columns.
DO $$
BEGIN
    IF NOT EXISTS (SELECT FROM pg_class WHERE oid = to_regclass('{s}.deliveries')
                   AND 'fillfactor=50' = ANY (reloptions)) THEN
        ALTER TABLE {s}.deliveries SET (fillfactor = 50);
    END IF;
END
$$;
DROP INDEX IF EXISTS {s}.deliveries_running;

-- A completion stamps `completed_at` on its event: no index reads it, and the table keeps
-- room on each page, so the stamp too is a heap-only update. Purge finds old events by a scan,
-- as it always did (no index served its condition). Tables made before this had the default
-- fill factor and an index of the completion time.
DO $$
BEGIN
    IF NOT EXISTS (SELECT FROM pg_class WHERE oid = to_regclass('{s}.events')
                   AND 'fillfactor=70' = ANY (reloptions)) THEN
        ALTER TABLE {s}.events SET (fillfactor = 70);
    END IF;
END
$$;
DROP INDEX IF EXISTS {s}.events_finished;
-- Only the operator's listings filtered by handler read an index of the handler, and they
-- scan instead: every append no longer writes one.
DROP INDEX IF EXISTS {s}.deliveries_handler;

-- What a claim reads: unparked pending deliveries in due order.
CREATE INDEX IF NOT EXISTS deliveries_claim ON {s}.deliveries (due_at, id)
    WHERE status = 'pending' AND NOT parked;
-- The pending deliveries of a handler and key held to the key's order, in sequence order.
CREATE INDEX IF NOT EXISTS deliveries_ordering ON {s}.deliveries (handler, key, sequence)
    WHERE status = 'pending' AND key IS NOT NULL AND NOT unordered;
-- The heads: unparked ones of the above (one per handler and key, unless a requeue raced).
CREATE INDEX IF NOT EXISTS deliveries_heads ON {s}.deliveries (handler, key)
    WHERE status = 'pending' AND key IS NOT NULL AND NOT unordered AND NOT parked;
CREATE INDEX IF NOT EXISTS deliveries_dead ON {s}.deliveries (updated_at)
    WHERE status = 'dead';

CREATE TABLE IF NOT EXISTS {s}.completed_deliveries (
    id bigint PRIMARY KEY,
    event_id text NOT NULL,
    handler text NOT NULL,
    event_type text NOT NULL,
    key text,
    sequence bigint,
    unordered boolean NOT NULL,
    attempts integer NOT NULL,
    due_at bigint NOT NULL,
    created_at bigint NOT NULL,
    updated_at bigint,
    completed_at bigint NOT NULL,
    last_error text,
    errors jsonb NOT NULL,
    requeued integer NOT NULL
);
CREATE INDEX IF NOT EXISTS completed_deliveries_completed_at
    ON {s}.completed_deliveries (completed_at);
CREATE INDEX IF NOT EXISTS completed_deliveries_event ON {s}.completed_deliveries (event_id);

-- The first answers of idempotent requests, written in the request's transaction.
CREATE TABLE IF NOT EXISTS {s}.idempotency_keys (
    id text PRIMARY KEY,
    key text NOT NULL,
    method text NOT NULL,
    route text NOT NULL,
    caller text,
    fingerprint text NOT NULL,
    status integer NOT NULL,
    headers jsonb NOT NULL,
    body bytea NOT NULL,
    created_at bigint NOT NULL,
    expires_at bigint NOT NULL
);
CREATE INDEX IF NOT EXISTS idempotency_keys_expires_at ON {s}.idempotency_keys (expires_at);

CREATE TABLE IF NOT EXISTS {s}.leads (
    role text PRIMARY KEY,
    holder text NOT NULL,
    expires_at timestamptz NOT NULL
);

-- The slots of the handlers' global concurrency held now (or expired, free to take).
CREATE TABLE IF NOT EXISTS {s}.slots (
    handler text NOT NULL,
    slot integer NOT NULL,
    holder text NOT NULL,
    owner text NOT NULL,
    expires_at bigint NOT NULL,
    PRIMARY KEY (handler, slot)
);

-- The start counter of each rate-limited handler, for its current window.
CREATE TABLE IF NOT EXISTS {s}.rate_windows (
    handler text PRIMARY KEY,
    window_start bigint NOT NULL,
    starts bigint NOT NULL,
    granted bigint NOT NULL
);
"#;

impl PostgresEventStore {
    /// Creates the schema, its tables and indexes, idempotently: run it at every start. Setups
    /// running at the same time (processes starting together) take a transaction-level
    /// advisory lock on the schema and run one after the other. On a schema that exists it
    /// changes nothing and logs nothing: the server's notices about what exists already are
    /// turned off for its transaction.
    ///
    /// A store value and its clones run it once: a later call, such as the one
    /// [`RelayBus::start`](crate::RelayBus::start) makes after yours, returns at once.
    ///
    /// # Errors
    ///
    /// [`Error::Database`](crate::Error::Database) when the server refuses (the user may not
    /// create schemas, for example: create the schema once as its owner).
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it is one transaction, and running it again finishes the job.
    pub async fn setup(&self) -> Result<()> {
        self.inner
            .set_up
            .get_or_try_init(|| self.create_schema())
            .await
            .map(|_| ())
    }

    async fn create_schema(&self) -> Result<()> {
        let ddl = self.sql(DDL);
        let context = (ddl, self.inner.schema.clone());
        self.own_transaction(&context, |connection, (ddl, schema)| {
            async move {
                sqlx::query("SELECT pg_advisory_xact_lock($1, hashtext($2))")
                    .bind(SETUP_LOCK_CLASS)
                    .bind(schema)
                    .execute(&mut *connection)
                    .await
                    .map_err(db_error)?;
                // `IF NOT EXISTS` answers an existing object with a notice, which sqlx logs;
                // a start on an existing schema is no news.
                sqlx::query("SET LOCAL client_min_messages = warning")
                    .execute(&mut *connection)
                    .await
                    .map_err(db_error)?;
                connection.execute(ddl.as_str()).await.map_err(db_error)?;
                Ok(())
            }
            .boxed()
        })
        .await
    }
}
