//! Axum and Tower integration for relaybus.
