//! The transports against real brokers: two services, each with its own store, the first
//! relaying its events to a broker, the second appending them to its store. One module per
//! broker, and the trace context carried across NATS.

mod kafka;
mod nats;
mod nats_tracing;
mod rabbitmq;
