//! The operator routes and the dispatcher service of each store, compiled once, here.
//!
//! As in `relaybus::instances`: these functions are not generic, so this crate compiles the
//! routes' handlers and the service for each store, and dependent crates' debug builds link to
//! them instead of compiling their own copy. Not a public API.

use std::{future::Future, pin::Pin};

use axum::Router;
use relaybus::{RelayBus, store::Store};
use tokio::net::TcpListener;

/// The operator routes, and a future that is never polled: naming it is what compiles it.
pub type Named = (Router, Pin<Box<dyn Future<Output = ()> + Send>>);

fn service<S: Store>(bus: RelayBus<S>, listener: TcpListener) -> Named {
    let routes = crate::ops::router(bus.clone());
    let serve = Box::pin(async move {
        let _ = crate::setup(bus.clone());
        let _ = crate::serve(bus, listener, Router::new()).await;
    });
    (routes, serve)
}

/// The MongoDB store's routes and service.
#[cfg(feature = "mongodb")]
pub fn mongodb(bus: RelayBus<relaybus::MongoEventStore>, listener: TcpListener) -> Named {
    service(bus, listener)
}

/// The PostgreSQL store's routes and service.
#[cfg(feature = "postgres")]
pub fn postgres(bus: RelayBus<relaybus::PostgresEventStore>, listener: TcpListener) -> Named {
    service(bus, listener)
}

/// The memory store's routes and service.
#[cfg(feature = "memory")]
pub fn memory(bus: RelayBus<relaybus::MemoryEventStore>, listener: TcpListener) -> Named {
    service(bus, listener)
}
