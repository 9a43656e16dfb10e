//! A shipping service on relaybus, the shop's second service: it takes the shop's
//! `order.placed.v1` events from NATS JetStream into its own database, where a transactional
//! handler makes one shipment per order, and lists the shipments over HTTP.
//!
//! Run with
//!
//! ```sh
//! scripts/services
//! ```
//!
//! which starts the shop (relaying its events to NATS) and this service, places a few orders
//! on the shop, waits until they show up here, and stops both. By hand, with a NATS server
//! with JetStream at 127.0.0.1:4222 and the shop started with `--relay nats://127.0.0.1:4222`:
//!
//! ```sh
//! DATABASE_URL=postgres://postgres@127.0.0.1:5432/postgres cargo run -p example-shipping
//! curl localhost:3001/shipments
//! ```
//!
//! The service keeps its events in the schema `relaybus_shipping` (`SHIPPING_EVENTS_SCHEMA`)
//! and its shipments in the schema `shipping` (`SHIPPING_SCHEMA`) of the database at
//! `DATABASE_URL`; `--store memory` keeps everything in memory instead. `NATS_URL` names the
//! NATS server (`nats://127.0.0.1:4222` by default), `SHIPPING_ADDR` the address
//! (`127.0.0.1:3001`).
//!
//! The pieces are in this library so that the shop's tests can run both services in one
//! process: [`broker`] (the stream and the consumer), [`handlers`] (the event and the
//! handler), [`shipments`] (where shipments are kept) and [`app`] (the HTTP route).

pub mod app;
pub mod broker;
pub mod handlers;
pub mod shipments;
#[cfg(test)]
mod tests;
