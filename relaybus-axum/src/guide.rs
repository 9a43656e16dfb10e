//! The guides of the Axum integration. Every example in them is compiled as a doc test (with
//! every feature on, as in CI). The core's guides are in `relaybus::guide`.

#[doc = include_str!("../docs/axum.md")]
#[cfg(any(doc, all(feature = "mongodb", feature = "postgres")))]
pub mod axum {}

#[doc = include_str!("../docs/operator-page.md")]
pub mod operator_page {}

/// The README's examples, compiled as doc tests: a service on each store.
#[cfg(all(doctest, feature = "mongodb", feature = "postgres"))]
#[doc = include_str!("../../README.md")]
struct ReadmeDoctests;
