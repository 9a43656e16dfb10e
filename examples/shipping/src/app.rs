//! Shipping's HTTP route: `GET /shipments`.

use axum::{
    Json, Router,
    extract::State,
    http::StatusCode,
    response::{IntoResponse, Response},
    routing::get,
};
use serde_json::json;

use crate::shipments::Shipments;

/// The router: `GET /shipments` answers `{"shipments": [{order_id, customer, total_cents}]}`,
/// in order id order.
pub fn router<H: Shipments>(shipments: H) -> Router {
    Router::new()
        .route("/shipments", get(list::<H>))
        .with_state(shipments)
}

async fn list<H: Shipments>(State(shipments): State<H>) -> Response {
    match shipments.list().await {
        Ok(shipments) => Json(json!({ "shipments": shipments })).into_response(),
        Err(error) => {
            eprintln!("listing shipments failed: {error}");
            (
                StatusCode::INTERNAL_SERVER_ERROR,
                Json(json!({ "error": "the shipments could not be read; try again" })),
            )
                .into_response()
        }
    }
}
