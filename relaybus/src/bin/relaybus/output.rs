//! Output: aligned tables for people, one JSON object per line for scripts.

use relaybus::{DeliveryRecord, DeliveryStatus, Timestamp};
use serde_json::{Value, json};

/// Prints `rows` under `headers`, each column as wide as its widest cell, two spaces apart.
pub(crate) fn table(headers: &[&str], rows: &[Vec<String>]) {
    let mut widths: Vec<usize> = headers.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (width, cell) in widths.iter_mut().zip(row) {
            *width = (*width).max(cell.chars().count());
        }
    }
    let line = |cells: Vec<&str>| {
        let last = cells.len().saturating_sub(1);
        let text: Vec<String> = cells
            .iter()
            .enumerate()
            .map(|(i, cell)| {
                if i == last {
                    (*cell).to_owned()
                } else {
                    format!("{cell:<width$}", width = widths[i])
                }
            })
            .collect();
        println!("{}", text.join("  ").trim_end());
    };
    line(headers.to_vec());
    for row in rows {
        line(row.iter().map(String::as_str).collect());
    }
}

/// Prints one JSON object on a line of its own.
pub(crate) fn json_line(value: &Value) {
    println!("{value}");
}

/// A time as RFC 3339, or `-`.
pub(crate) fn time(time: Option<Timestamp>) -> String {
    time.map_or_else(|| "-".to_owned(), |t| t.to_string())
}

/// An optional text, or `-`.
pub(crate) fn text(text: Option<&str>) -> String {
    text.unwrap_or("-").to_owned()
}

/// `text` cut to `max` characters, with an ellipsis, on one line.
pub(crate) fn cut(text: &str, max: usize) -> String {
    let one_line = text.replace(['\n', '\r'], " ");
    if one_line.chars().count() <= max {
        return one_line;
    }
    let mut cut: String = one_line.chars().take(max.saturating_sub(1)).collect();
    cut.push('…');
    cut
}

/// What a delivery is doing: waiting, running, parked, dead or completed.
pub(crate) fn state(record: &DeliveryRecord) -> &'static str {
    match record.status {
        DeliveryStatus::Pending if record.running => "running",
        DeliveryStatus::Pending if record.parked => "parked",
        DeliveryStatus::Pending => "waiting",
        status => status.as_str(),
    }
}

/// A delivery as JSON, with the fields of the operator routes' listing.
pub(crate) fn record_json(record: &DeliveryRecord) -> Value {
    json!({
        "id": record.id,
        "event_id": record.event_id,
        "handler": record.handler,
        "event_type": record.event_type,
        "key": record.key,
        "sequence": record.sequence,
        "unordered": record.unordered,
        "status": record.status.as_str(),
        "state": state(record),
        "parked": record.parked,
        "running": record.running,
        "attempts": record.attempts,
        "due_at": record.due_at.map(|t| t.to_string()),
        "created_at": record.created_at.map(|t| t.to_string()),
        "updated_at": record.updated_at.map(|t| t.to_string()),
        "completed_at": record.completed_at.map(|t| t.to_string()),
        "last_error": record.last_error,
        "errors": record.errors.iter().map(|e| json!({
            "at": e.at.to_string(),
            "attempt": e.attempt,
            "error": e.error,
        })).collect::<Vec<_>>(),
        "requeues": record.requeues,
    })
}

/// A row of a deliveries table: see [`DELIVERY_HEADERS`].
pub(crate) fn record_row(record: &DeliveryRecord) -> Vec<String> {
    vec![
        record.id.clone(),
        record.event_id.clone(),
        record.handler.clone(),
        record.event_type.clone(),
        text(record.key.as_deref()),
        state(record).to_owned(),
        record.attempts.to_string(),
        time(record.created_at),
        cut(record.last_error.as_deref().unwrap_or("-"), 60),
    ]
}

/// The headers of [`record_row`].
pub(crate) const DELIVERY_HEADERS: [&str; 9] = [
    "ID",
    "EVENT",
    "HANDLER",
    "TYPE",
    "KEY",
    "STATE",
    "ATTEMPTS",
    "CREATED",
    "LAST ERROR",
];
