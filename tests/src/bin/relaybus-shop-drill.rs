//! A crash drill for the shop example on MongoDB: clients post orders while the shop's process
//! is killed and restarted, then every order answered 201 must be stored once with its event.
//!
//! ```text
//! relaybus-shop-drill SHOP_BINARY MONGODB_URI [SECONDS] [KILLS] [STOPPED]
//! ```
//!
//! Starts `SHOP_BINARY` (build it with `cargo build --release -p example-shop`) on a free
//! loopback port and the database `shop_drill_<pid>` (dropped first and at the end), and 8
//! clients posting `POST /orders` back to back over 12 customers for SECONDS (40). KILLS times
//! (6), evenly spread, the shop is killed with SIGKILL and started again at once; STOPPED of
//! them (2) are stopped with SIGSTOP for 3 seconds first. A request whose connection fails
//! (refused while the shop restarts, reset when it dies) is not answered; the client tries
//! again after 10 ms. The shop's output goes to `shop-drill.log` in the working directory.
//!
//! Prints one JSON object. Exits 1 when more than 2 % of the answered requests are 503, or an
//! order answered 201 is missing, has no event or more than one, or an event has no order.

use std::{
    collections::{HashMap, HashSet},
    process::{Child, Command, ExitCode, Stdio},
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use futures::TryStreamExt;
use mongodb::{
    Client,
    bson::{Document, doc},
};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::TcpStream,
};

const CLIENTS: usize = 8;
const CUSTOMERS: usize = 12;
const STOP_FOR: Duration = Duration::from_secs(3);

type BoxError = Box<dyn std::error::Error + Send + Sync>;

#[derive(Debug, Default)]
struct Tally {
    created: Vec<String>,
    unavailable: u64,
    other: u64,
    unanswered: u64,
}

#[tokio::main]
async fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let number = |at: usize, default: u64| {
        args.get(at)
            .map_or(Ok(default), |v| v.parse::<u64>())
            .map_err(|_| format!("argument {} must be a whole number", at + 1))
    };
    let (Some(shop), Some(uri)) = (args.first(), args.get(1)) else {
        eprintln!("usage: relaybus-shop-drill SHOP_BINARY MONGODB_URI [SECONDS] [KILLS] [STOPPED]");
        return ExitCode::from(2);
    };
    let (seconds, kills, stopped) = match (number(2, 40), number(3, 6), number(4, 2)) {
        (Ok(s), Ok(k), Ok(p)) => (s, k, p.min(k)),
        (Err(e), ..) | (_, Err(e), _) | (.., Err(e)) => {
            eprintln!("relaybus-shop-drill: {e}");
            return ExitCode::from(2);
        }
    };
    match drill(shop, uri, Duration::from_secs(seconds), kills, stopped).await {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(error) => {
            eprintln!("relaybus-shop-drill: {error}");
            ExitCode::from(2)
        }
    }
}

async fn drill(
    shop: &str,
    uri: &str,
    length: Duration,
    kills: u64,
    stopped: u64,
) -> Result<bool, BoxError> {
    let database = format!("shop_drill_{}", std::process::id());
    let client = Client::with_uri_str(uri).await?;
    client.database(&database).drop().await?;
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let address = format!("127.0.0.1:{port}");
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open("shop-drill.log")?;
    let start = || -> Result<Child, BoxError> {
        Ok(relaybus_harness::spawn_tied({
            let mut command = Command::new(shop);
            command
                .env("MONGODB_URI", uri)
                .env("SHOP_DATABASE", &database)
                .env("SHOP_ADDR", &address)
                .stdin(Stdio::null())
                .stdout(log.try_clone()?)
                .stderr(log.try_clone()?);
            command
        })?)
    };
    let mut process = start()?;
    wait_listening(&address).await?;

    let tally = Arc::new(Mutex::new(Tally::default()));
    let started = Instant::now();
    let clients: Vec<_> = (0..CLIENTS)
        .map(|n| {
            let (tally, address) = (Arc::clone(&tally), address.clone());
            tokio::spawn(async move {
                let mut customer = n;
                while started.elapsed() < length {
                    customer = (customer * 7 + 5) % CUSTOMERS;
                    let answer = post_order(&address, &format!("customer-{customer}"))
                        .await
                        .ok();
                    let answered = answer.is_some();
                    {
                        let mut tally = tally.lock().unwrap();
                        match answer {
                            Some((201, id)) => tally.created.push(id),
                            Some((503, _)) => tally.unavailable += 1,
                            Some(_) => tally.other += 1,
                            None => tally.unanswered += 1,
                        }
                    }
                    if !answered {
                        tokio::time::sleep(Duration::from_millis(10)).await;
                    }
                }
            })
        })
        .collect();

    // The faults, evenly spread; the stopped ones among them spread too.
    for kill in 0..kills {
        let at = length.mul_f64((kill + 1) as f64 / (kills + 1) as f64);
        tokio::time::sleep(at.saturating_sub(started.elapsed())).await;
        let stop = (0..stopped).any(|s| kill == (2 * s + 1) * kills / (2 * stopped));
        if stop {
            relaybus_harness::pause_process(process.id(), Duration::from_secs(5)).await?;
            tokio::time::sleep(STOP_FOR).await;
        }
        relaybus_harness::kill_tied(&mut process);
        eprintln!(
            "relaybus-shop-drill: killed the shop at {:.1} s{}",
            started.elapsed().as_secs_f64(),
            if stop { " (stopped)" } else { "" }
        );
        process = start()?;
    }
    for client in clients {
        client.await?;
    }
    relaybus_harness::kill_tied(&mut process);

    let tally = std::mem::take(&mut *tally.lock().unwrap());
    let db = client.database(&database);
    let orders: HashSet<String> = db
        .collection::<Document>("orders")
        .find(doc! {})
        .await?
        .try_collect::<Vec<_>>()
        .await?
        .iter()
        .filter_map(|order| order.get_str("_id").ok().map(str::to_owned))
        .collect();
    let mut events: HashMap<String, u64> = HashMap::new();
    let mut cursor = db
        .collection::<Document>("relaybus_events")
        .find(doc! { "type": "order.placed.v1" })
        .await?;
    while let Some(event) = cursor.try_next().await? {
        let id = event
            .get_document("payload")
            .and_then(|p| p.get_str("order_id"))
            .unwrap_or_default();
        *events.entry(id.to_owned()).or_default() += 1;
    }
    let missing = tally
        .created
        .iter()
        .filter(|id| !orders.contains(*id))
        .count();
    let without_event = orders.iter().filter(|id| !events.contains_key(*id)).count();
    let doubled = events.values().filter(|n| **n > 1).count();
    let phantom = events.keys().filter(|id| !orders.contains(*id)).count();
    let answered = tally.created.len() as u64 + tally.unavailable + tally.other;
    let share = 100.0 * tally.unavailable as f64 / answered.max(1) as f64;
    println!(
        "{{\"seconds\": {}, \"kills\": {kills}, \"stopped\": {stopped}, \"answered\": {answered}, \
         \"created\": {}, \"unavailable\": {}, \"unavailable_percent\": {share:.2}, \"other\": {}, \
         \"unanswered\": {}, \"orders_stored\": {}, \"missing\": {missing}, \
         \"without_event\": {without_event}, \"doubled\": {doubled}, \"phantom\": {phantom}}}",
        length.as_secs(),
        tally.created.len(),
        tally.unavailable,
        tally.other,
        tally.unanswered,
        orders.len(),
    );
    db.drop().await?;
    Ok(share <= 2.0 && missing == 0 && without_event == 0 && doubled == 0 && phantom == 0)
}

/// Waits until the shop accepts connections, for at most a minute.
async fn wait_listening(address: &str) -> Result<(), BoxError> {
    let deadline = Instant::now() + Duration::from_secs(60);
    while TcpStream::connect(address).await.is_err() {
        if Instant::now() > deadline {
            return Err(format!("the shop did not listen on {address} within a minute").into());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(())
}

/// Posts one order; the status and, for a 201, the order's id.
async fn post_order(address: &str, customer: &str) -> Result<(u16, String), BoxError> {
    let body = format!("{{\"customer\": \"{customer}\", \"total_cents\": 1250}}");
    let request = format!(
        "POST /orders HTTP/1.1\r\nhost: {address}\r\ncontent-type: application/json\r\n\
         content-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    let exchange = async {
        let mut stream = TcpStream::connect(address).await?;
        stream.write_all(request.as_bytes()).await?;
        let mut response = Vec::new();
        stream.read_to_end(&mut response).await?;
        Ok::<_, BoxError>(String::from_utf8_lossy(&response).into_owned())
    };
    let response = tokio::time::timeout(Duration::from_secs(60), exchange).await??;
    let status: u16 = response
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or("no status line")?;
    let id = response
        .split("\"id\":\"")
        .nth(1)
        .and_then(|rest| rest.split('"').next())
        .unwrap_or_default()
        .to_owned();
    if status == 201 && id.is_empty() {
        return Err("a 201 without the order's id".into());
    }
    Ok((status, id))
}
