//! Event stores. relaybus ships one, on MongoDB.

pub mod mongo;
