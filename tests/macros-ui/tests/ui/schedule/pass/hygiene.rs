//! Strict lints and a module without the prelude: the generated code of `#[schedule]` adds no
//! warning, needs no import, and names nothing the user's scope could shadow.
#![deny(warnings, missing_docs, unreachable_pub, unused_qualifications, unused_results)]

/// Schedules declared without the prelude.
pub mod reports {
    #![no_implicit_prelude]

    /// An event.
    #[::relaybus::event("report.due.v1")]
    #[derive(::serde::Serialize, ::serde::Deserialize)]
    pub struct ReportDue {}

    /// A cron schedule in a zone.
    #[::relaybus::schedule(id = "daily", cron = "0 0 9 * * MON-FRI", time_zone = "Europe/Paris")]
    pub fn daily(_: ::relaybus::Tick) -> ReportDue {
        ReportDue {}
    }

    /// An interval schedule with every option.
    #[::relaybus::schedule(id = "often", every_ms = 60_000, each_missed = 5, catch_up_ms = 600_000)]
    pub fn often(_: ::relaybus::Tick) -> ReportDue {
        ReportDue {}
    }

    // Names the generated code must not pick up from the user's scope.
    #[allow(dead_code)]
    struct Schedule;
    #[allow(dead_code)]
    struct MissedTicks;
    #[allow(dead_code)]
    struct Duration;
}

fn main() {
    let ids: ::std::vec::Vec<&str> = ::relaybus::registry::schedules().map(|s| s.id()).collect();
    assert_eq!(ids, ["daily", "often"]);
}
