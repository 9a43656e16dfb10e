//! `relaybus lanes`: the lanes and their holders, and the keys whose deliveries are parked.

use std::process::ExitCode;

use relaybus::store::Administration;
use serde_json::json;

use crate::{failure::Failure, output};

pub(super) async fn run<S: Administration>(
    store: &S,
    json: bool,
    all: bool,
) -> Result<ExitCode, Failure> {
    let report = store.lanes().await?;
    let shown = report
        .lanes
        .iter()
        .filter(|lane| all || lane.owner.is_some() || lane.in_flight > 0 || lane.lost > 0);
    if json {
        for lane in shown {
            output::json_line(&json!({
                "kind": "lane",
                "lane": lane.lane,
                "owner": lane.owner,
                "lease_expires_at": lane.lease_expires_at.map(|t| t.to_string()),
                "in_flight": lane.in_flight,
                "lost": lane.lost,
                "epoch": lane.epoch,
            }));
        }
        for blocked in &report.blocked {
            output::json_line(&json!({
                "kind": "blocked",
                "handler": blocked.handler,
                "key": blocked.key,
                "parked": blocked.parked,
                "first_parked_sequence": blocked.first_parked_sequence,
                "waiting_for": blocked.waiting_for.as_ref().map(output::record_json),
            }));
        }
        return Ok(ExitCode::SUCCESS);
    }
    let rows: Vec<Vec<String>> = shown
        .map(|lane| {
            vec![
                lane.lane.to_string(),
                output::text(lane.owner.as_deref()),
                output::time(lane.lease_expires_at),
                lane.in_flight.to_string(),
                lane.lost.to_string(),
                lane.epoch.to_string(),
            ]
        })
        .collect();
    let held = report.lanes.iter().filter(|l| l.owner.is_some()).count();
    output::table(
        &[
            "LANE",
            "OWNER",
            "LEASE EXPIRES",
            "IN FLIGHT",
            "LOST",
            "EPOCH",
        ],
        &rows,
    );
    println!("{held} of {} lanes held", report.lanes.len());
    if !report.blocked.is_empty() {
        println!();
        let rows: Vec<Vec<String>> = report
            .blocked
            .iter()
            .map(|b| {
                let waiting_for = b.waiting_for.as_ref().map_or_else(
                    || "the next claim".to_owned(),
                    |d| format!("{} ({})", d.id, output::state(d)),
                );
                vec![
                    b.handler.clone(),
                    b.key.clone(),
                    b.parked.to_string(),
                    b.first_parked_sequence
                        .map_or_else(|| "-".to_owned(), |s| s.to_string()),
                    waiting_for,
                ]
            })
            .collect();
        output::table(
            &["HANDLER", "KEY", "PARKED", "FIRST SEQUENCE", "WAITING FOR"],
            &rows,
        );
    }
    Ok(ExitCode::SUCCESS)
}
