//! The guides: how to use relaybus, one page per subject. Every example in them is compiled
//! as a doc test (with every feature on, as in CI).
//!
//! The Axum integration and the operator page have their guides in `relaybus-axum`
//! (`relaybus_axum::guide`); the benchmarks are described in `relaybus/benches/README.md`.

// The guides' examples use every store, so they are compiled where every store is built; the
// pages themselves are always documented.

#[doc = include_str!("../docs/stores.md")]
#[cfg(any(
    doc,
    all(
        feature = "mongodb",
        feature = "postgres",
        feature = "memory",
        feature = "macros"
    )
))]
pub mod stores {}

#[doc = include_str!("../docs/handlers.md")]
#[cfg(any(
    doc,
    all(feature = "mongodb", feature = "postgres", feature = "macros")
))]
pub mod handlers {}

#[doc = include_str!("../docs/limits.md")]
#[cfg(any(doc, feature = "postgres"))]
pub mod limits_and_batches {}

#[doc = include_str!("../docs/testing.md")]
#[cfg(any(doc, all(feature = "postgres", feature = "memory", feature = "macros")))]
pub mod testing {}

#[doc = include_str!("../docs/schedules.md")]
#[cfg(any(doc, all(feature = "postgres", feature = "memory", feature = "macros")))]
pub mod schedules {}

#[doc = include_str!("../docs/transports.md")]
pub mod transports {}

#[doc = include_str!("../docs/operations.md")]
pub mod operations {}

#[doc = include_str!("../docs/cli.md")]
pub mod command_line {}

#[doc = include_str!("../docs/reliability.md")]
pub mod reliability {}

#[doc = include_str!("../docs/differences.md")]
pub mod differences {}

#[doc = include_str!("../docs/upgrading.md")]
pub mod upgrading {}
