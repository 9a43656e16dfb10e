//! The demo: places orders over HTTP against the running shop and watches the projection
//! catch up.

use std::{net::SocketAddr, time::Duration};

use axum::http::{StatusCode, header};
use relaybus::BoxError;
use serde_json::{Value, json};

use crate::handlers::money;

/// Places orders over HTTP and watches the projection catch up.
pub(crate) async fn run_demo(address: SocketAddr, operator: &str) -> Result<(), BoxError> {
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
pub(crate) async fn http(
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
