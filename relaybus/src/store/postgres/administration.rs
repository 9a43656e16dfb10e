//! [`Administration`] for PostgreSQL: `setup()`'s plan, read from the catalog.

use sqlx::Row;

use super::{PostgresEventStore, db_error};
use crate::{
    error::Result,
    store::administration::{Administration, SetupStep, SetupStepKind},
};

/// The tables `setup()` creates, in its order.
const TABLES: [&str; 9] = [
    "events",
    "key_sequences",
    "consumer_positions",
    "deliveries",
    "completed_deliveries",
    "idempotency_keys",
    "leads",
    "slots",
    "rate_windows",
];

/// The indexes `setup()` creates, with their tables, in its order.
const INDEXES: [(&str, &str); 7] = [
    ("deliveries_claim", "deliveries"),
    ("deliveries_ordering", "deliveries"),
    ("deliveries_heads", "deliveries"),
    ("deliveries_dead", "deliveries"),
    ("completed_deliveries_completed_at", "completed_deliveries"),
    ("completed_deliveries_event", "completed_deliveries"),
    ("idempotency_keys_expires_at", "idempotency_keys"),
];

/// Indexes of earlier versions that `setup()` drops: of the lease columns (before the fill
/// factor), of the events' completion time (no reader used it), of the handler (the hot path
/// never read it).
const DROPPED_INDEXES: [&str; 3] = [
    "deliveries_running",
    "events_finished",
    "deliveries_handler",
];

impl Administration for PostgresEventStore {
    async fn setup_plan(&self) -> Result<Vec<SetupStep>> {
        let schema = &self.inner.schema;
        let pool = &self.inner.pool;
        let mut steps = Vec::new();
        let schema_exists: bool =
            sqlx::query_scalar("SELECT EXISTS (SELECT FROM pg_namespace WHERE nspname = $1)")
                .bind(schema)
                .fetch_one(pool)
                .await
                .map_err(db_error)?;
        if !schema_exists {
            steps.push(SetupStep::new(
                SetupStepKind::Create,
                format!("create the schema {schema}"),
            ));
        }
        let relations: Vec<(String, Option<Vec<String>>)> = sqlx::query(
            "SELECT c.relname, c.reloptions FROM pg_class c \
             JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = $1",
        )
        .bind(schema)
        .fetch_all(pool)
        .await
        .map_err(db_error)?
        .iter()
        .map(|row| Ok((row.try_get(0)?, row.try_get(1)?)))
        .collect::<std::result::Result<_, sqlx::Error>>()
        .map_err(db_error)?;
        let find = |name: &str| relations.iter().find(|(n, _)| n == name);
        for table in TABLES {
            if find(table).is_none() {
                steps.push(SetupStep::new(
                    SetupStepKind::Create,
                    format!("create the table {schema}.{table}"),
                ));
            }
        }
        if let Some((_, options)) = find("deliveries") {
            let half_full = options
                .as_ref()
                .is_some_and(|o| o.iter().any(|o| o == "fillfactor=50"));
            if !half_full {
                steps.push(SetupStep::new(
                    SetupStepKind::Replace,
                    format!(
                        "set the fill factor of {schema}.deliveries to 50, so that claims \
                         update rows in place"
                    ),
                ));
            }
        }
        if let Some((_, options)) = find("events") {
            let fill = options
                .as_ref()
                .is_some_and(|o| o.iter().any(|o| o == "fillfactor=70"));
            if !fill {
                steps.push(SetupStep::new(
                    SetupStepKind::Replace,
                    format!(
                        "set the fill factor of {schema}.events to 70, so that completions \
                         stamp rows in place"
                    ),
                ));
            }
        }
        for index in DROPPED_INDEXES {
            if find(index).is_some() {
                steps.push(SetupStep::new(
                    SetupStepKind::Replace,
                    format!("drop the index {schema}.{index}"),
                ));
            }
        }
        for (index, table) in INDEXES {
            if find(index).is_none() {
                steps.push(SetupStep::new(
                    SetupStepKind::Create,
                    format!("create the index {index} of {schema}.{table}"),
                ));
            }
        }
        Ok(steps)
    }

    async fn handler_ids(&self) -> Result<Vec<String>> {
        let sql = if self.inner.completion_history {
            "SELECT handler FROM {s}.deliveries UNION SELECT handler FROM {s}.completed_deliveries \
             ORDER BY handler"
        } else {
            "SELECT DISTINCT handler FROM {s}.deliveries ORDER BY handler"
        };
        sqlx::query_scalar(&self.sql(sql))
            .fetch_all(&self.inner.pool)
            .await
            .map_err(db_error)
    }

    fn is_delivery_id(&self, id: &str) -> bool {
        (1..=19).contains(&id.len())
            && id.bytes().all(|b| b.is_ascii_digit())
            && id.parse::<i64>().is_ok_and(|n| n > 0)
    }

    fn delivery_id_form(&self) -> &'static str {
        "a PostgreSQL delivery id is a positive whole number"
    }
}
