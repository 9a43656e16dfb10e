//! Compile-time behaviour of `#[event]`, `#[handler]` and `#[schedule]`: what they accept, and where their
//! errors point.
//!
//! The `.stderr` files hold rustc's output, which changes between compiler versions, so the
//! test runs on the toolchain they were recorded with. To record them again after a change:
//! `TRYBUILD=overwrite cargo test -p relaybus-macros-ui`, then read every changed file.

#[rustversion::attr(
    not(stable(1.95)),
    ignore = "the .stderr files are recorded with Rust 1.95; record them again to run on another"
)]
#[test]
fn ui() {
    let t = trybuild::TestCases::new();
    t.pass("tests/ui/event/pass/*.rs");
    t.compile_fail("tests/ui/event/fail/*.rs");
    t.pass("tests/ui/handler/pass/*.rs");
    t.compile_fail("tests/ui/handler/fail/*.rs");
    t.pass("tests/ui/schedule/pass/*.rs");
    t.compile_fail("tests/ui/schedule/fail/*.rs");
}
