//! `relaybus show EVENT_ID`: an event and every delivery of it, with their error histories.

use std::process::ExitCode;

use relaybus::{EventDetail, store::Administration};
use serde_json::json;

use crate::{
    failure::{Failure, PARTLY, bad},
    output,
};

pub(super) async fn run<S: Administration>(
    store: &S,
    json: bool,
    event_id: &str,
) -> Result<ExitCode, Failure> {
    if event_id.is_empty() || event_id.len() > 256 || event_id.chars().any(char::is_control) {
        return bad("the event id must be 1 to 256 bytes without control characters");
    }
    let Some(detail) = store.event_detail(event_id).await? else {
        eprintln!("relaybus: no event {event_id:?} in this store (never published, or purged)");
        return Ok(ExitCode::from(PARTLY));
    };
    if json {
        output::json_line(&detail_json(&detail));
    } else {
        print_detail(&detail);
    }
    Ok(ExitCode::SUCCESS)
}

fn detail_json(detail: &EventDetail) -> serde_json::Value {
    let event = &detail.event;
    json!({
        "event": {
            "id": event.id(),
            "type": event.event_type(),
            "key": event.key(),
            "sequence": detail.sequence,
            "correlation_id": event.correlation_id(),
            "causation_id": event.causation_id(),
            "headers": event.headers(),
            "payload": event.payload(),
            "created_at": event.created_at().to_string(),
            "completed_at": detail.completed_at.map(|t| t.to_string()),
            "handlers": detail.handlers,
        },
        "deliveries": detail.deliveries.iter().map(output::record_json).collect::<Vec<_>>(),
    })
}

fn print_detail(detail: &EventDetail) {
    let event = &detail.event;
    let key = match (event.key(), detail.sequence) {
        (Some(key), Some(sequence)) => format!("{key} (sequence {sequence})"),
        (Some(key), None) => key.to_owned(),
        (None, _) => "-".to_owned(),
    };
    let headers: Vec<String> = event
        .headers()
        .iter()
        .map(|(name, value)| format!("{name}={value}"))
        .collect();
    let fields = [
        ("event", event.id().to_owned()),
        ("type", event.event_type().to_owned()),
        ("key", key),
        ("created", event.created_at().to_string()),
        ("completed", output::time(detail.completed_at)),
        ("handlers", detail.handlers.join(", ")),
        (
            "headers",
            if headers.is_empty() {
                "-".to_owned()
            } else {
                headers.join(", ")
            },
        ),
        (
            "payload",
            serde_json::to_string(event.payload()).unwrap_or_default(),
        ),
    ];
    for (name, value) in fields {
        println!("{name:<10} {value}");
    }
    println!();
    let rows: Vec<Vec<String>> = detail
        .deliveries
        .iter()
        .map(|d| {
            vec![
                d.id.clone(),
                d.handler.clone(),
                output::state(d).to_owned(),
                d.attempts.to_string(),
                d.requeues.to_string(),
                output::time(d.due_at),
                output::time(d.completed_at.or(d.updated_at)),
            ]
        })
        .collect();
    output::table(
        &[
            "DELIVERY",
            "HANDLER",
            "STATE",
            "ATTEMPTS",
            "REQUEUES",
            "DUE",
            "LAST CHANGE",
        ],
        &rows,
    );
    for delivery in detail.deliveries.iter().filter(|d| !d.errors.is_empty()) {
        println!();
        println!("errors of {} ({}):", delivery.id, delivery.handler);
        let rows: Vec<Vec<String>> = delivery
            .errors
            .iter()
            .map(|e| {
                vec![
                    e.at.to_string(),
                    e.attempt
                        .map_or_else(|| "lost".to_owned(), |a| a.to_string()),
                    output::cut(&e.error, 100),
                ]
            })
            .collect();
        output::table(&["AT", "ATTEMPT", "ERROR"], &rows);
    }
}
