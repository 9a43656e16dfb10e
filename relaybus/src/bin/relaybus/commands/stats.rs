//! `relaybus stats`: deliveries per handler by state, and the oldest due.

use std::process::ExitCode;

use relaybus::store::Administration;
use serde_json::json;

use crate::{failure::Failure, output};

pub(super) async fn run<S: Administration>(store: &S, json: bool) -> Result<ExitCode, Failure> {
    let handlers = store.handler_statistics().await?;
    let totals = store.statistics().await?;
    let waiting = |pending: u64, running: u64, parked: u64| {
        pending.saturating_sub(running).saturating_sub(parked)
    };
    if json {
        for h in &handlers {
            output::json_line(&json!({
                "handler": h.handler,
                "waiting": waiting(h.pending, h.running, h.parked),
                "running": h.running,
                "parked": h.parked,
                "dead": h.dead,
                "oldest_due_at": h.oldest_due_at.map(|t| t.to_string()),
            }));
        }
        output::json_line(&json!({
            "handler": null,
            "waiting": waiting(totals.pending, totals.running, totals.parked),
            "running": totals.running,
            "parked": totals.parked,
            "dead": totals.dead,
            "oldest_due_at": totals.oldest_due_at.map(|t| t.to_string()),
            "completed": totals.completion_history.then_some(totals.completed),
        }));
        return Ok(ExitCode::SUCCESS);
    }
    let mut rows: Vec<Vec<String>> = handlers
        .iter()
        .map(|h| {
            vec![
                h.handler.clone(),
                waiting(h.pending, h.running, h.parked).to_string(),
                h.running.to_string(),
                h.parked.to_string(),
                h.dead.to_string(),
                output::time(h.oldest_due_at),
            ]
        })
        .collect();
    rows.push(vec![
        "(all)".to_owned(),
        waiting(totals.pending, totals.running, totals.parked).to_string(),
        totals.running.to_string(),
        totals.parked.to_string(),
        totals.dead.to_string(),
        output::time(totals.oldest_due_at),
    ]);
    output::table(
        &[
            "HANDLER",
            "WAITING",
            "RUNNING",
            "PARKED",
            "DEAD",
            "OLDEST DUE",
        ],
        &rows,
    );
    if totals.completion_history {
        println!("completed: {}", totals.completed);
    }
    Ok(ExitCode::SUCCESS)
}
