//! Procedural macros for relaybus. Use them through the `relaybus` crate.
