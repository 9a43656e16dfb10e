//! Compile-time behaviour of `#[event]`, `#[handler]` and `#[schedule]`: what they accept, and where their
//! errors point.
//!
//! The `.stderr` files hold rustc's output, which changes between compiler versions, so the
//! test runs on the toolchain they were recorded with. To record them again after a change:
//! `TRYBUILD=overwrite cargo test -p relaybus-tests --test macros ui`, then read every changed file.

#[rustversion::attr(
    not(stable(1.95)),
    ignore = "the .stderr files are recorded with Rust 1.95; record them again to run on another"
)]
#[test]
fn ui() {
    let t = trybuild::TestCases::new();
    t.pass("tests/macros/ui/event/pass/*.rs");
    t.compile_fail("tests/macros/ui/event/fail/*.rs");
    t.pass("tests/macros/ui/handler/pass/*.rs");
    t.compile_fail("tests/macros/ui/handler/fail/*.rs");
    t.pass("tests/macros/ui/schedule/pass/*.rs");
    t.compile_fail("tests/macros/ui/schedule/fail/*.rs");
}
