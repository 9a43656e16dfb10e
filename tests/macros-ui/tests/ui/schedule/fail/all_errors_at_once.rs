use serde::{Deserialize, Serialize};

#[relaybus::event("report.due.v1")]
#[derive(Serialize, Deserialize)]
struct ReportDue {}

// Every problem is reported, not only the first.
#[relaybus::schedule(id = "daily report", cron = "0 9 * * *", every_ms = 60_000, each_missed = 0, time_zone = 1, hourly)]
async fn daily(_: relaybus::Tick, _: u32) -> ReportDue {
    ReportDue {}
}

fn main() {}
