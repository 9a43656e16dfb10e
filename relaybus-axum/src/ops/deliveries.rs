//! The routes that read deliveries: the filtered listing, one event with all its deliveries,
//! and the dead letters grouped by error.

use axum::{
    Json,
    extract::{Path, RawQuery, State, rejection::PathRejection},
    http::StatusCode,
};
use relaybus::{RelayBus, Store};

use super::{
    check::{check_text, parse_listing, parse_query},
    error::{OpsError, bad},
    model::{DeadLettersAnswer, DeliveriesAnswer, EventAnswer, GroupParams},
};

/// `GET /deliveries`: one page, oldest first.
pub(super) async fn deliveries<St: Store>(
    State(bus): State<RelayBus<St>>,
    RawQuery(raw): RawQuery,
) -> Result<Json<DeliveriesAnswer>, OpsError> {
    let listing = parse_listing(raw.as_deref())?;
    let records = bus
        .store()
        .list_deliveries(&listing.query)
        .await
        .map_err(OpsError::Store)?;
    Ok(Json(DeliveriesAnswer::new(records, listing.limit)))
}

/// `GET /events/{event_id}`: 404 for an unknown id.
pub(super) async fn event<St: Store>(
    State(bus): State<RelayBus<St>>,
    path: Result<Path<String>, PathRejection>,
) -> Result<Json<EventAnswer>, OpsError> {
    let Path(event_id) = path.map_err(|rejection| {
        bad(format!(
            "{}; ask for /events/<event id>",
            rejection.body_text()
        ))
    })?;
    check_text("event_id", &event_id, 256, "an event id")?;
    let detail = bus
        .store()
        .event_detail(&event_id)
        .await
        .map_err(OpsError::Store)?
        .ok_or_else(|| {
            OpsError::Refused(
                StatusCode::NOT_FOUND,
                "no event has this id: it was never published, or it was purged".to_owned(),
            )
        })?;
    Ok(Json(detail.into()))
}

/// `GET /dead-letters`: the largest group first; `?handler=` narrows it.
pub(super) async fn dead_letters<St: Store>(
    State(bus): State<RelayBus<St>>,
    RawQuery(raw): RawQuery,
) -> Result<Json<DeadLettersAnswer>, OpsError> {
    let params: GroupParams = parse_query(raw.as_deref(), "handler")?;
    if let Some(handler) = &params.handler {
        relaybus::validate_handler_id(handler).map_err(|e| bad(format!("`handler`: {e}")))?;
    }
    let groups = bus
        .store()
        .dead_letter_groups(params.handler.as_deref())
        .await
        .map_err(OpsError::Store)?;
    Ok(Json(groups.into()))
}
