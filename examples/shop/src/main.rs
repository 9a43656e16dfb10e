//! A small shop on relaybus and Axum: `POST /orders` stores an order and publishes
//! `OrderPlaced` in the request's transaction; two handlers react to it, one sending a
//! (simulated) confirmation e-mail, one keeping a projection of order totals per customer in a
//! transaction of its own; the dispatcher runs in the same process and everything stops
//! gracefully on Ctrl-C.
//!
//! Run with
//!
//! ```sh
//! scripts/demo
//! ```
//!
//! which starts a local replica set and runs `example-shop --demo`: the shop serves on a free
//! loopback port, places a few orders over HTTP, shows the projection catching up, and shuts
//! down. Against a replica set of your own, as a server on 127.0.0.1:3000:
//!
//! ```sh
//! MONGODB_URI='mongodb://127.0.0.1:27017/?replicaSet=rs0' cargo run -p example-shop
//! curl -i -X POST localhost:3000/orders -H 'content-type: application/json' \
//!      -d '{"customer": "ada", "total_cents": 1250}'
//! curl localhost:3000/stats
//! ```
//!
//! `SHOP_DATABASE` names the database (`shop` by default), `SHOP_ADDR` the address.

use std::{net::SocketAddr, sync::Arc, time::Duration};

use axum::{
    Json, Router,
    extract::{FromRef, Path, State},
    http::{HeaderMap, StatusCode, header},
    response::{IntoResponse, Response},
    routing::{get, post},
};
use futures::TryStreamExt;
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use mongodb::{
    Client, Database,
    bson::{Document, doc, oid::ObjectId},
};
use relaybus::{BoxError, HandlerContext, MongoEventStore, RelayBus, event, handler};
use relaybus_axum::{DispatcherService, Publisher, RelayState};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

/// A customer placed an order.
#[event("order.placed.v1")]
#[derive(Debug, Clone, Serialize, Deserialize)]
struct OrderPlaced {
    order_id: String,
    customer: String,
    total_cents: i64,
}

/// Sends the confirmation e-mail (here: prints it). Not transactional: if it fails after the
/// mail went out, the mail goes out again, so a real one would pass the event id to the mail
/// service as an idempotency key.
#[handler(id = "send-confirmation")]
async fn send_confirmation(event: OrderPlaced, ctx: HandlerContext) -> Result<(), BoxError> {
    println!(
        "  [send-confirmation] to {}: order {} of {} is confirmed (event {}, attempt {})",
        event.customer,
        event.order_id,
        money(event.total_cents),
        ctx.event_id(),
        ctx.attempt()
    );
    Ok(())
}

/// Keeps the totals per customer. Transactional: its write and the completion of its delivery
/// commit together, so each order counts exactly once. It takes the shop's database from the
/// bus's state (`relaybus::State`, given with `RelayBus::builder(store).state(db)`).
#[handler(id = "projector", transactional)]
async fn projector(
    event: OrderPlaced,
    ctx: HandlerContext,
    relaybus::State(db): relaybus::State<Database>,
) -> Result<(), BoxError> {
    let mut session = ctx.session().await?;
    db.collection::<Document>("order_totals")
        .update_one(
            doc! { "_id": &event.customer },
            doc! { "$inc": { "orders": 1_i64, "total_cents": event.total_cents } },
        )
        .upsert(true)
        .session(&mut *session)
        .await?;
    Ok(())
}

/// The router's state: the request transactions' state, and the database.
#[derive(Clone)]
struct AppState {
    relay: RelayState,
    db: Database,
}

impl FromRef<AppState> for RelayState {
    fn from_ref(state: &AppState) -> Self {
        state.relay.clone()
    }
}

/// The answer an operator route expects in `Authorization`: HTTP Basic authentication as user
/// `ops` with `password`, which a browser asks for when it opens the page.
fn basic_credentials(password: &str) -> String {
    use base64::Engine;
    let token = base64::engine::general_purpose::STANDARD.encode(format!("ops:{password}"));
    format!("Basic {token}")
}

/// The operators' password: `SHOP_OPS_PASSWORD`, or a random one made up at start and printed.
fn ops_password() -> String {
    std::env::var("SHOP_OPS_PASSWORD").unwrap_or_else(|_| {
        use rand::Rng;
        rand::rng()
            .sample_iter(rand::distr::Alphanumeric)
            .take(20)
            .map(char::from)
            .collect()
    })
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

fn router(
    bus: RelayBus,
    db: Database,
    metrics: PrometheusHandle,
    ops_password: &str,
) -> Result<Router, relaybus::ConfigurationError> {
    let operator = axum::middleware::from_fn_with_state(
        Arc::<str>::from(basic_credentials(ops_password)),
        require_operator,
    );
    let (relay, layer) = relaybus_axum::setup(bus.clone())?;
    Ok(Router::new()
        .route("/orders", post(place_order))
        .route("/orders/{id}", get(order))
        .route("/stats", get(stats))
        // Routes above get a request transaction.
        .layer(layer)
        .with_state(AppState { relay, db })
        // The operator page and its JSON routes, behind your own authentication.
        .nest("/ops", relaybus_axum::ops::router(bus).layer(operator))
        // relaybus's metrics (messaging.*, relaybus.*), for Prometheus to scrape.
        .route("/metrics", get(async move || metrics.render())))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct NewOrder {
    customer: String,
    total_cents: i64,
}

/// What a route answers when it fails.
enum ApiError {
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

impl From<mongodb::error::Error> for ApiError {
    fn from(error: mongodb::error::Error) -> Self {
        relaybus::Error::from(error).into()
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        match self {
            ApiError::BadRequest(message) => {
                (StatusCode::BAD_REQUEST, Json(json!({ "error": message }))).into_response()
            }
            ApiError::NotFound => StatusCode::NOT_FOUND.into_response(),
            ApiError::Unavailable => (
                StatusCode::SERVICE_UNAVAILABLE,
                [(header::RETRY_AFTER, "1")],
                Json(json!({ "error": "busy; nothing was saved, try again" })),
            )
                .into_response(),
            ApiError::Internal(error) => {
                eprintln!("request failed: {error}");
                StatusCode::INTERNAL_SERVER_ERROR.into_response()
            }
        }
    }
}

/// `POST /orders`: the order and its event commit together when this answers 201, and
/// neither does when it answers anything else.
async fn place_order(
    State(state): State<AppState>,
    mut publisher: Publisher,
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
    let id = ObjectId::new().to_hex();
    state
        .db
        .collection::<Document>("orders")
        .insert_one(doc! {
            "_id": &id,
            "customer": customer,
            "total_cents": order.total_cents,
            "placed_at": mongodb::bson::DateTime::now(),
        })
        .session(publisher.session())
        .await?;
    publisher
        .publish(&OrderPlaced {
            order_id: id.clone(),
            customer: customer.to_owned(),
            total_cents: order.total_cents,
        })
        .key(customer) // one customer's orders are handled in the order they were placed
        .await?;
    let mut headers = HeaderMap::new();
    if let Ok(location) = format!("/orders/{id}").parse() {
        headers.insert(header::LOCATION, location);
    }
    Ok((
        StatusCode::CREATED,
        headers,
        Json(json!({ "id": id, "customer": customer, "total_cents": order.total_cents })),
    ))
}

/// `GET /orders/{id}`. Reads need no transaction, so this route takes no extractor of
/// relaybus and makes no session.
async fn order(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let order = state
        .db
        .collection::<Document>("orders")
        .find_one(doc! { "_id": &id })
        .await?
        .ok_or(ApiError::NotFound)?;
    Ok(Json(json!({
        "id": id,
        "customer": order.get_str("customer").unwrap_or_default(),
        "total_cents": order.get_i64("total_cents").unwrap_or_default(),
    })))
}

/// `GET /stats`: the orders stored, and what the projector has counted so far.
async fn stats(State(state): State<AppState>) -> Result<Json<Value>, ApiError> {
    let orders = state
        .db
        .collection::<Document>("orders")
        .count_documents(doc! {})
        .await?;
    let totals: Vec<Document> = state
        .db
        .collection::<Document>("order_totals")
        .find(doc! {})
        .sort(doc! { "_id": 1 })
        .await?
        .try_collect()
        .await?;
    let customers: Vec<Value> = totals
        .iter()
        .map(|t| {
            json!({
                "customer": t.get_str("_id").unwrap_or_default(),
                "orders": t.get_i64("orders").unwrap_or_default(),
                "total_cents": t.get_i64("total_cents").unwrap_or_default(),
            })
        })
        .collect();
    let projected: i64 = totals
        .iter()
        .map(|t| t.get_i64("orders").unwrap_or_default())
        .sum();
    Ok(Json(json!({
        "orders": orders,
        "projected_orders": projected,
        "customers": customers,
    })))
}

fn money(cents: i64) -> String {
    format!("${}.{:02}", cents / 100, cents % 100)
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    // relaybus logs through `tracing`: without a subscriber, a failing handler goes unseen.
    tracing_subscriber::fmt()
        .with_max_level(tracing_subscriber::filter::LevelFilter::INFO)
        .init();
    let demo = match std::env::args().nth(1).as_deref() {
        None => false,
        Some("--demo") => true,
        Some(other) => {
            return Err(format!("unknown argument {other:?}; the only one is --demo").into());
        }
    };
    let uri = std::env::var("MONGODB_URI").map_err(
        |_| "MONGODB_URI is not set; run `scripts/demo`, which starts a local replica set for you",
    )?;
    let client = Client::with_uri_str(&uri).await?;
    let database = match std::env::var("SHOP_DATABASE") {
        Ok(name) => name,
        Err(_) if demo => "relaybus_shop_demo".to_owned(),
        Err(_) => "shop".to_owned(),
    };
    if demo {
        client.database(&database).drop().await?;
    }
    let db = client.database(&database);

    // The metrics recorder goes in before the bus is built: the bus registers its metrics then.
    let metrics = PrometheusBuilder::new().install_recorder()?;
    let store = MongoEventStore::builder(client.clone())
        .database(&database)
        .build()?;
    // Subscribes every #[handler] of the binary: send-confirmation and projector, which takes
    // the database as its state.
    let bus = RelayBus::builder(store).state(db.clone()).build()?;
    let password = ops_password();
    let app = router(bus.clone(), db, metrics, &password)?;

    let address = match std::env::var("SHOP_ADDR") {
        Ok(address) => address,
        Err(_) if demo => "127.0.0.1:0".to_owned(),
        Err(_) => "127.0.0.1:3000".to_owned(),
    };
    let listener = tokio::net::TcpListener::bind(&address).await?;
    let address = listener.local_addr()?;
    let service = DispatcherService::new(bus);
    if !demo {
        println!("shop on http://{address} (database {database}); Ctrl-C stops it gracefully");
        println!("operator page on http://{address}/ops (user ops, password {password})");
        service.serve(listener, app).await?;
        println!("stopped");
        return Ok(());
    }

    println!("relaybus shop demo on {uri}, database {database}");
    println!("shop serving on http://{address}, dispatcher running beside it");
    println!("operator page on http://{address}/ops (user ops, password {password})\n");
    let shutdown = service.shutdown_token();
    let server = tokio::spawn(service.serve(listener, app));
    let outcome = run_demo(address, &basic_credentials(&password)).await;
    println!(
        "\nshutting down, as on Ctrl-C: draining requests, releasing deliveries, handing lanes back"
    );
    shutdown.cancel();
    server.await??;
    outcome?;
    println!("stopped cleanly. Done.");
    Ok(())
}

/// Places orders over HTTP and watches the projection catch up.
async fn run_demo(address: SocketAddr, operator: &str) -> Result<(), BoxError> {
    let orders = [("ada", 1250), ("grace", 990), ("ada", 4200)];
    let mut first = None;
    for (customer, total_cents) in orders {
        let body = json!({ "customer": customer, "total_cents": total_cents });
        let (status, answer) = http(address, "POST", "/orders", Some(body), None).await?;
        println!(
            "POST /orders {customer} {} -> {status} {answer}",
            money(total_cents)
        );
        if status != StatusCode::CREATED {
            return Err(format!("placing an order answered {status}").into());
        }
        first.get_or_insert(answer["id"].as_str().unwrap_or_default().to_owned());
    }

    let (status, answer) = http(
        address,
        "POST",
        "/orders",
        Some(json!({ "customer": "ada", "total_cents": -5 })),
        None,
    )
    .await?;
    println!("POST /orders ada -$0.05 -> {status} {answer} (rolled back: no order, no event)");

    let id = first.unwrap_or_default();
    let (status, answer) = http(address, "GET", &format!("/orders/{id}"), None, None).await?;
    println!("GET /orders/{id} -> {status} {answer}\n");

    // The handlers run in the background: poll the projection until it counted every order.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let mut last_seen = -1;
    loop {
        let (_, stats) = http(address, "GET", "/stats", None, None).await?;
        let projected = stats["projected_orders"].as_i64().unwrap_or_default();
        if projected != last_seen {
            println!(
                "GET /stats -> projection has {projected} of {} orders",
                stats["orders"]
            );
            last_seen = projected;
        }
        if projected == orders.len() as i64 {
            println!("projection caught up: {}", stats["customers"]);
            break;
        }
        if tokio::time::Instant::now() > deadline {
            return Err("the projection did not catch up within 30 s".into());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (refused, _) = http(address, "GET", "/ops/statistics", None, None).await?;
    if refused != StatusCode::UNAUTHORIZED {
        return Err(format!("the operator routes answered {refused} without credentials").into());
    }
    let (_, ops) = http(address, "GET", "/ops/statistics", None, Some(operator)).await?;
    println!("GET /ops/statistics (as ops) -> {ops}");
    let (status, _) = http(address, "GET", "/metrics", None, None).await?;
    println!("GET /metrics -> {status} (relaybus's counters and histograms, for Prometheus)");
    Ok(())
}

/// One HTTP/1.1 request on a fresh connection; the answer as JSON (or `null`).
async fn http(
    address: SocketAddr,
    method: &str,
    path: &str,
    body: Option<Value>,
    authorization: Option<&str>,
) -> Result<(StatusCode, Value), BoxError> {
    use http_body_util::{BodyExt, Full};
    use hyper::body::Bytes;

    let stream = tokio::net::TcpStream::connect(address).await?;
    let (mut sender, connection) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream)).await?;
    tokio::spawn(connection);
    let mut request = hyper::Request::builder()
        .method(method)
        .uri(path)
        .header(header::HOST, address.to_string());
    if let Some(authorization) = authorization {
        request = request.header(header::AUTHORIZATION, authorization);
    }
    let body = match body {
        Some(body) => {
            request = request.header(header::CONTENT_TYPE, "application/json");
            Bytes::from(body.to_string())
        }
        None => Bytes::new(),
    };
    let response = sender.send_request(request.body(Full::new(body))?).await?;
    let status = response.status();
    let bytes = response.into_body().collect().await?.to_bytes();
    let value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
    Ok((status, value))
}
