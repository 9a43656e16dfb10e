//! relaybus-axum end to end: the request transaction, the extractors, the dispatcher service
//! and the operator routes through the real router, on MongoDB and on PostgreSQL; the operator
//! page in a real browser; and, as processes, the shop example and the `relaybus` command line.

mod cli;
mod mongo;
mod ops;
mod ops_page;
mod postgres;
mod shop;
mod workspace;
