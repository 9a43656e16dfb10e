//! The shop's HTTP routes: `POST /orders`, `GET /orders/{id}`, `GET /stats`, the operator page
//! under `/ops` and the metrics, generic over where the shop keeps its data.

use std::sync::Arc;

use axum::{
    Json, Router,
    extract::{FromRef, Path, State},
    http::{HeaderMap, StatusCode, header},
    response::{IntoResponse, Response},
    routing::{get, post},
};
use metrics_exporter_prometheus::PrometheusHandle;
use mongodb::bson::oid::ObjectId;
use relaybus::{BoxError, RelayBus};
use relaybus_axum::{
    IdempotencyLayer, Publisher, RelayState, ops::NestOps, rejection::PublisherRejection,
};
use serde::Deserialize;
use serde_json::{Value, json};

use crate::{
    handlers::OrderPlaced,
    orders::{Order, Orders},
};

/// The router's state: the request transactions' state, and the shop's data.
#[derive(Clone)]
pub(crate) struct AppState<O: Orders> {
    relay: RelayState<O::Store>,
    orders: O,
}

impl<O: Orders> FromRef<AppState<O>> for RelayState<O::Store> {
    fn from_ref(state: &AppState<O>) -> Self {
        state.relay.clone()
    }
}

/// The publisher of a request on the store of `O`.
type ShopPublisher<O> = Publisher<PublisherRejection, <O as Orders>::Store>;

/// The answer an operator route expects in `Authorization`: HTTP Basic authentication as user
/// `ops` with `password`, which a browser asks for when it opens the page.
pub(crate) fn basic_credentials(password: &str) -> String {
    use base64::Engine;
    let token = base64::engine::general_purpose::STANDARD.encode(format!("ops:{password}"));
    format!("Basic {token}")
}

/// Your own authentication in front of the operator routes (relaybus has none of its own):
/// here HTTP Basic, compared in constant time; anything else answers 401.
async fn require_operator(
    State(expected): State<Arc<str>>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let given = request
        .headers()
        .get(header::AUTHORIZATION)
        .map(|value| value.as_bytes())
        .unwrap_or_default();
    let matches = given.len() == expected.len()
        && given
            .iter()
            .zip(expected.as_bytes())
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0;
    if matches {
        return next.run(request).await;
    }
    (
        StatusCode::UNAUTHORIZED,
        [(
            header::WWW_AUTHENTICATE,
            "Basic realm=\"relaybus operations\"",
        )],
        "sign in as user `ops` with the operators' password",
    )
        .into_response()
}

/// The shop's routes on `bus`, the operator routes behind `ops_password`, and the metrics when
/// a Prometheus recorder is given.
pub(crate) fn router<O: Orders>(
    bus: RelayBus<O::Store>,
    orders: O,
    metrics: Option<PrometheusHandle>,
    ops_password: &str,
) -> Result<Router, relaybus::ConfigurationError> {
    let operator = axum::middleware::from_fn_with_state(
        Arc::<str>::from(basic_credentials(ops_password)),
        require_operator,
    );
    let (relay, layer) = relaybus_axum::setup(bus.clone())?;
    // A client that sends `POST /orders` again with the same `Idempotency-Key` (after a
    // timeout, say) gets the first answer, stored with the order, instead of a second order.
    // A repeat while the first still runs waits for it up to 5 s.
    let idempotency = IdempotencyLayer::builder()
        .wait(std::time::Duration::from_secs(5))
        .build()?;
    let router = Router::new()
        .route("/orders", post(place_order::<O>).layer(idempotency))
        .route("/orders/{id}", get(order::<O>))
        .route("/stats", get(stats::<O>))
        // Routes above get a request transaction.
        .layer(layer)
        .with_state(AppState { relay, orders })
        // The operator page and its JSON routes, behind your own authentication.
        .nest_ops("/ops", relaybus_axum::ops::router(bus).layer(operator));
    Ok(match metrics {
        // relaybus's metrics (messaging.*, relaybus.*), for Prometheus to scrape.
        Some(metrics) => router.route("/metrics", get(async move || metrics.render())),
        None => router,
    })
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct NewOrder {
    customer: String,
    total_cents: i64,
}

/// What a route answers when it fails.
pub(crate) enum ApiError {
    BadRequest(String),
    NotFound,
    /// A write conflict or a lost primary: nothing was committed, the client may retry.
    Unavailable,
    Internal(BoxError),
}

impl From<relaybus::Error> for ApiError {
    fn from(error: relaybus::Error) -> Self {
        if error.is_transient_transaction_error() {
            ApiError::Unavailable
        } else {
            ApiError::Internal(error.into())
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        match self {
            ApiError::BadRequest(message) => {
                (StatusCode::BAD_REQUEST, Json(json!({ "error": message }))).into_response()
            }
            ApiError::NotFound => StatusCode::NOT_FOUND.into_response(),
            ApiError::Unavailable => {
                // Marked for the request layer, which runs the route again in a new
                // transaction before this answer leaves.
                let mut response = (
                    StatusCode::SERVICE_UNAVAILABLE,
                    [(header::RETRY_AFTER, "1")],
                    Json(json!({ "error": "busy; nothing was saved, try again" })),
                )
                    .into_response();
                response
                    .extensions_mut()
                    .insert(relaybus_axum::RetryRequest);
                response
            }
            ApiError::Internal(error) => {
                eprintln!("request failed: {error}");
                StatusCode::INTERNAL_SERVER_ERROR.into_response()
            }
        }
    }
}

/// `POST /orders`: the order and its event commit together when this answers 201, and
/// neither does when it answers anything else. With an `Idempotency-Key` header, the 201 is
/// stored with them and answered again to every repeat of the request.
async fn place_order<O: Orders>(
    State(state): State<AppState<O>>,
    mut publisher: ShopPublisher<O>,
    body: axum::body::Bytes,
) -> Result<(StatusCode, HeaderMap, Json<Value>), ApiError> {
    let order: NewOrder = serde_json::from_slice(&body).map_err(|e| {
        ApiError::BadRequest(format!(
            "{e}; send {{\"customer\": \"...\", \"total_cents\": 1250}}"
        ))
    })?;
    let customer = order.customer.trim();
    if customer.is_empty() || customer.len() > 64 {
        return Err(ApiError::BadRequest(
            "`customer` must be 1 to 64 characters".into(),
        ));
    }
    if !(1..=100_000_000).contains(&order.total_cents) {
        return Err(ApiError::BadRequest(
            "`total_cents` must be from 1 to 100000000".into(),
        ));
    }
    let order = Order {
        id: ObjectId::new().to_hex(),
        customer: customer.to_owned(),
        total_cents: order.total_cents,
    };
    state.orders.insert(publisher.session(), &order).await?;
    publisher
        .publish(&OrderPlaced {
            order_id: order.id.clone(),
            customer: order.customer.clone(),
            total_cents: order.total_cents,
        })
        .key(&order.customer) // one customer's orders are handled in the order they were placed
        .await?;
    let mut headers = HeaderMap::new();
    if let Ok(location) = format!("/orders/{}", order.id).parse() {
        headers.insert(header::LOCATION, location);
    }
    Ok((
        StatusCode::CREATED,
        headers,
        Json(
            json!({ "id": order.id, "customer": order.customer, "total_cents": order.total_cents }),
        ),
    ))
}

/// `GET /orders/{id}`. Reads need no transaction, so this route takes no extractor of
/// relaybus and makes no session.
async fn order<O: Orders>(
    State(state): State<AppState<O>>,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let order = state.orders.find(&id).await?.ok_or(ApiError::NotFound)?;
    Ok(Json(json!({
        "id": order.id,
        "customer": order.customer,
        "total_cents": order.total_cents,
    })))
}

/// `GET /stats`: the orders stored, and what the projector has counted so far.
async fn stats<O: Orders>(State(state): State<AppState<O>>) -> Result<Json<Value>, ApiError> {
    let stats = state.orders.stats().await?;
    let projected: i64 = stats.customers.iter().map(|c| c.orders).sum();
    Ok(Json(json!({
        "orders": stats.orders,
        "projected_orders": projected,
        "customers": stats.customers,
    })))
}
