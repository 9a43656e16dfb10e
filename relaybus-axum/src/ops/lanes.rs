//! The lanes route: holders, leases, and the keys held back.

use axum::{Json, extract::State};
use relaybus::{RelayBus, Store};

use super::{error::OpsError, model::LanesAnswer};

/// `GET /lanes`.
pub(super) async fn lanes<St: Store>(
    State(bus): State<RelayBus<St>>,
) -> Result<Json<LanesAnswer>, OpsError> {
    let report = bus.store().lanes().await.map_err(OpsError::Store)?;
    Ok(Json(LanesAnswer::new(report, bus.now())))
}
