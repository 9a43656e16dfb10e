//! The writes: requeueing, discarding and burying deliveries, each behind the checks that keep
//! them from being sent by another site or to a read-only router, and each logged.

use axum::{
    Json,
    body::Bytes,
    extract::{State, rejection::BytesRejection},
    http::{HeaderMap, StatusCode},
};
use relaybus::{DeliveryQuery, DeliveryStatus, RelayBus, Store};

use super::{
    OpsState, WRITE_HEADER,
    check::{MAX_LIMIT, Selection, WRITE_SHAPES, filtered, parse_bury, parse_write},
    error::OpsError,
    model::{BuryAnswer, BuryBody, DiscardAnswer, Filter, RequeueAnswer},
};

/// `POST /deliveries/requeue`.
pub(super) async fn requeue<St: Store>(
    State(state): State<OpsState<St>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<RequeueAnswer>, OpsError> {
    let (selection, ids, more) = selected(&state, &headers, body).await?;
    let outcome = state
        .bus
        .store()
        .requeue(&ids, state.bus.now())
        .await
        .map_err(OpsError::Store)?;
    tracing::info!(
        target: "relaybus::ops",
        selection = ?selection,
        requeued = ?outcome.requeued,
        blocked = ?outcome.blocked,
        not_found = outcome.not_found.len(),
        "an operator requeued dead letters"
    );
    Ok(Json(RequeueAnswer::new(outcome, more)))
}

/// `POST /deliveries/discard`: deletes dead letters for good.
pub(super) async fn discard<St: Store>(
    State(state): State<OpsState<St>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<DiscardAnswer>, OpsError> {
    let (selection, ids, more) = selected(&state, &headers, body).await?;
    let outcome = state
        .bus
        .store()
        .discard(&ids, state.bus.now())
        .await
        .map_err(OpsError::Store)?;
    tracing::info!(
        target: "relaybus::ops",
        selection = ?selection,
        discarded = ?outcome.discarded,
        not_found = outcome.not_found.len(),
        "an operator discarded dead letters"
    );
    Ok(Json(DiscardAnswer::new(outcome, more)))
}

/// `POST /deliveries/bury`: buries pending deliveries that no worker runs.
pub(super) async fn bury<St: Store>(
    State(state): State<OpsState<St>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<BuryAnswer>, OpsError> {
    check_write(&state, &headers)?;
    let BuryBody { ids, reason } = parse_bury(&headers, &write_body(body)?)?;
    let outcome = state
        .bus
        .bury(&ids, &reason)
        .await
        .map_err(OpsError::Store)?;
    tracing::info!(
        target: "relaybus::ops",
        %reason,
        buried = ?outcome.buried,
        running = ?outcome.running,
        not_found = outcome.not_found.len(),
        "an operator buried pending deliveries"
    );
    Ok(Json(outcome.into()))
}

/// Refuses a write of a read-only router, or one without [`WRITE_HEADER`].
fn check_write<St: Store>(state: &OpsState<St>, headers: &HeaderMap) -> Result<(), OpsError> {
    if state.read_only {
        return Err(OpsError::Refused(
            StatusCode::FORBIDDEN,
            "these operator routes are read-only".to_owned(),
        ));
    }
    if headers.get(WRITE_HEADER).and_then(|v| v.to_str().ok()) != Some("1") {
        return Err(OpsError::Refused(
            StatusCode::FORBIDDEN,
            format!(
                "a write needs the header `{WRITE_HEADER}: 1`, which a page of another site \
                 cannot send"
            ),
        ));
    }
    Ok(())
}

/// The body of a write, or the refusal of one that could not be read.
fn write_body(body: Result<Bytes, BytesRejection>) -> Result<Bytes, OpsError> {
    body.map_err(|rejection| {
        OpsError::Refused(
            rejection.status(),
            format!("{}; {WRITE_SHAPES}", rejection.body_text()),
        )
    })
}

/// A requeue's or discard's checks, then the dead letters it names: the selection, their ids
/// and whether more match.
async fn selected<St: Store>(
    state: &OpsState<St>,
    headers: &HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<(Selection, Vec<String>, bool), OpsError> {
    check_write(state, headers)?;
    let selection = parse_write(headers, &write_body(body)?)?;
    let (ids, more) = select(&state.bus, &selection).await?;
    Ok((selection, ids, more))
}

/// The most dead letters one write by filter takes; the answer says when more are left.
const MAX_SELECTED: usize = 10_000;

/// The ids of the dead letters a selection names, at most [`MAX_SELECTED`], and whether more
/// match.
async fn select<St: Store>(
    bus: &RelayBus<St>,
    selection: &Selection,
) -> Result<(Vec<String>, bool), OpsError> {
    let filter = match selection {
        Selection::Ids(ids) => return Ok((ids.clone(), false)),
        Selection::Filter(filter) => filter.clone(),
        Selection::All => Filter::default(),
    };
    let base = filtered(DeliveryQuery::new().status(DeliveryStatus::Dead), &filter)?;
    let mut ids = Vec::new();
    let mut after: Option<String> = None;
    loop {
        let mut page = base.clone().limit(MAX_LIMIT);
        if let Some(after) = &after {
            page = page.after(after.clone());
        }
        let records = bus
            .store()
            .list_deliveries(&page)
            .await
            .map_err(OpsError::Store)?;
        let full = records.len() == MAX_LIMIT as usize;
        after = records.last().map(|last| last.id.clone());
        ids.extend(records.into_iter().map(|record| record.id));
        if ids.len() >= MAX_SELECTED {
            let more = ids.len() > MAX_SELECTED || full;
            ids.truncate(MAX_SELECTED);
            return Ok((ids, more));
        }
        if !full {
            return Ok((ids, false));
        }
    }
}
