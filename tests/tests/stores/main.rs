//! The bus on each store: the store conformance suite for MongoDB, PostgreSQL and memory; each
//! store's own behaviour beyond it; publishing, dispatch, the delivery lifecycle, upgrades and
//! crash recovery on a real replica set; the test kit; the test harness itself; and what the
//! bus reports (metrics, trace context).

mod conformance;
mod crash;
mod dispatch;
mod harness;
mod lifecycle;
mod listing_indexes;
mod memory;
mod metrics;
mod postgres;
mod publish;
mod specification;
mod test_kit;
mod tracing;
mod upgrade;
