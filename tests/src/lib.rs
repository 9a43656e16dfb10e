//! End-to-end tests of relaybus against a real MongoDB replica set.

pub mod batches;
pub mod conformance;
pub mod consumer_crash;
pub mod fault;
pub mod hooked;
pub mod idempotency;
pub mod limits;
pub mod support;
pub mod traces;
