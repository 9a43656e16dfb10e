//! The macros' compile-time tests live in `tests/ui.rs`; this crate only gives them a small
//! dependency list of their own.
