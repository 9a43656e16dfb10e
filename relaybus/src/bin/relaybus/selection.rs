//! Which deliveries a command takes: filters checked and turned into a query, delivery ids
//! checked, and the ids a filter selects.

use std::io::{BufRead, IsTerminal, Write};

use relaybus::{DeliveryQuery, store::Administration};

use crate::{
    failure::{Failure, bad},
    options::FilterArgs,
    time::parse_time,
};

/// The most records one page of a listing holds.
pub(crate) const PAGE: u32 = 1_000;

/// `query` narrowed by `filter`, every value checked first; a handler must be one the store
/// holds deliveries of.
pub(crate) async fn filtered<S: Administration>(
    store: &S,
    mut query: DeliveryQuery,
    filter: &FilterArgs,
) -> Result<DeliveryQuery, Failure> {
    if let Some(event_type) = &filter.event_type {
        relaybus::event::validate_type_name(event_type)
            .map_err(|e| Failure::BadInput(format!("--event-type {event_type:?}: {e}")))?;
        query = query.event_type(event_type.clone());
    }
    if let Some(key) = &filter.key {
        check_text("key", key, 512)?;
        query = query.key(key.clone());
    }
    if let Some(event_id) = &filter.event_id {
        check_text("event-id", event_id, 256)?;
        query = query.event_id(event_id.clone());
    }
    if let Some(error) = &filter.error {
        check_text("error", error, 256)?;
        query = query.error_contains(error.clone());
    }
    if let Some(error) = &filter.last_error {
        // Stored errors are cut to 1 KiB, with an ellipsis.
        check_text("last-error", error, 1_100)?;
        query = query.last_error(error.clone());
    }
    if let Some(from) = &filter.created_from {
        query = query.created_from(parse_time("created-from", from)?);
    }
    if let Some(before) = &filter.created_before {
        query = query.created_before(parse_time("created-before", before)?);
    }
    if let Some(handler) = &filter.handler {
        known_handler(store, handler).await?;
        query = query.handler(handler.clone());
    }
    Ok(query)
}

/// Refuses a handler id that is malformed, or that the store holds no delivery of.
pub(crate) async fn known_handler<S: Administration>(
    store: &S,
    handler: &str,
) -> Result<(), Failure> {
    relaybus::validate_handler_id(handler)
        .map_err(|e| Failure::BadInput(format!("--handler {handler:?}: {e}")))?;
    let known = store.handler_ids().await?;
    if known.iter().any(|k| k == handler) {
        return Ok(());
    }
    let listed = if known.is_empty() {
        "it holds none".to_owned()
    } else {
        format!("it holds {}", known.join(", "))
    };
    bad(format!(
        "unknown handler {handler:?}: the store holds no delivery of it ({listed}); check the id"
    ))
}

/// Refuses a text that is empty, longer than `max` bytes, or holds control characters.
fn check_text(option: &str, value: &str, max: usize) -> Result<(), Failure> {
    if value.is_empty() || value.len() > max || value.chars().any(char::is_control) {
        return bad(format!(
            "--{option} must be 1 to {max} bytes without control characters"
        ));
    }
    Ok(())
}

/// Refuses ids that do not have the form of the store's delivery ids; drops repeated ones.
pub(crate) fn checked_ids<S: Administration>(
    store: &S,
    ids: &[String],
) -> Result<Vec<String>, Failure> {
    if let Some(id) = ids.iter().find(|id| !store.is_delivery_id(id)) {
        let shown: String = id.chars().take(64).collect();
        return bad(format!(
            "{shown:?} is not a delivery id ({}); `relaybus list` shows the ids",
            store.delivery_id_form()
        ));
    }
    let mut unique = Vec::with_capacity(ids.len());
    for id in ids {
        if !unique.contains(id) {
            unique.push(id.clone());
        }
    }
    Ok(unique)
}

/// The ids of every delivery `query` selects, oldest first, read a page at a time.
pub(crate) async fn ids_of<S: Administration>(
    store: &S,
    query: &DeliveryQuery,
) -> Result<Vec<String>, Failure> {
    let mut ids = Vec::new();
    let mut after: Option<String> = None;
    loop {
        let mut page = query.clone().limit(PAGE);
        if let Some(after) = &after {
            page = page.after(after.clone());
        }
        let records = store.list_deliveries(&page).await?;
        let full = records.len() == PAGE as usize;
        after = records.last().map(|last| last.id.clone());
        ids.extend(records.into_iter().map(|record| record.id));
        if !full {
            return Ok(ids);
        }
    }
}

/// Asks on the terminal whether to go on: `question` and `[y/N]`. Without a terminal to ask
/// on, the answer is no.
pub(crate) fn confirm(question: &str) -> Result<(), Failure> {
    let stdin = std::io::stdin();
    if !stdin.is_terminal() {
        return Err(Failure::NotConfirmed);
    }
    eprint!("{question} [y/N] ");
    let _ = std::io::stderr().flush();
    let mut answer = String::new();
    stdin
        .lock()
        .read_line(&mut answer)
        .map_err(|_| Failure::NotConfirmed)?;
    if matches!(answer.trim(), "y" | "Y" | "yes" | "YES" | "Yes") {
        Ok(())
    } else {
        Err(Failure::NotConfirmed)
    }
}
