//! The inbound driver every consumer runs: take a batch from the broker, dead-letter what
//! cannot be read, append the events in one transaction of the local store (with the
//! consumer's position, for a broker that keeps none), then settle the batch with the broker.
//!
//! Each broker supplies only its client's side ([`Broker`]): fetching, dead-lettering and
//! settling, its pauses, and for Kafka where the store keeps its offsets.

mod append;
mod batch;
mod broker;
mod builder;
mod consumer;
mod report;
mod run;

#[cfg(feature = "kafka")]
pub(crate) use append::owned_work;
pub use batch::{AppendedBatch, InboundBatch};
pub(crate) use broker::{Broker, Settlement};
#[cfg(feature = "kafka")]
pub(crate) use broker::{Fence, Position};
pub use builder::ConsumerBuilder;
pub use consumer::Consumer;
pub use report::BatchReport;
#[cfg(feature = "kafka")]
pub(crate) use run::{run, run_once};
