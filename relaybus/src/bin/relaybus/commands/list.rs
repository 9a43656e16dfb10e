//! `relaybus list`: deliveries by filter, oldest first, a page at a time.

use std::process::ExitCode;

use relaybus::{DeliveryQuery, DeliveryStatus, PendingState, store::Administration};

use crate::{
    failure::{Failure, bad},
    options::{ListArgs, State},
    output, selection,
};

pub(super) async fn run<S: Administration>(
    store: &S,
    json: bool,
    args: &ListArgs,
) -> Result<ExitCode, Failure> {
    if !(1..=selection::PAGE).contains(&args.limit) {
        return bad(format!(
            "--limit {} is out of range: give 1 to {}",
            args.limit,
            selection::PAGE
        ));
    }
    let mut query = DeliveryQuery::new();
    if let Some(state) = args.state {
        query = match state {
            State::Pending => query.status(DeliveryStatus::Pending),
            State::Waiting => query.pending_state(PendingState::Waiting),
            State::Running => query.pending_state(PendingState::Running),
            State::Parked => query.pending_state(PendingState::Parked),
            State::Dead => query.status(DeliveryStatus::Dead),
            State::Completed => query.status(DeliveryStatus::Completed),
        };
    }
    if let Some(after) = &args.after {
        selection::checked_ids(store, std::slice::from_ref(after))?;
        query = query.after(after.clone());
    }
    let query = selection::filtered(store, query, &args.filter).await?;
    let records = store.list_deliveries(&query.limit(args.limit)).await?;
    if json {
        records
            .iter()
            .for_each(|r| output::json_line(&output::record_json(r)));
    } else {
        let rows: Vec<Vec<String>> = records.iter().map(output::record_row).collect();
        output::table(&output::DELIVERY_HEADERS, &rows);
    }
    if records.len() == args.limit as usize
        && let Some(last) = records.last()
    {
        eprintln!(
            "relaybus: more deliveries match: run again with --after {}",
            last.id
        );
    }
    Ok(ExitCode::SUCCESS)
}
