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
//!
//! ```text
//! relaybus-shop-drill SHOP_BINARY MONGODB_URI SECONDS KILLS STOPPED \
//!     SHIPPING_BINARY NATS_URL POSTGRES_URL [SHIPPING_KILLS]
//! ```
//!
//! With a shipping binary (`cargo build --release -p example-shipping`), the drill runs the two
//! services of the examples: the shop relays `order.placed.v1` to the JetStream stream
//! `SHOP_ORDERS` of `NATS_URL` (deleted first and at the end: give the drill a NATS server of
//! its own, `scripts/nats start`), and shipping consumes it into PostgreSQL, in schemas of its
//! own (`shipping_drill_<pid>` and `shipping_drill_<pid>_events`, dropped at the end). Shipping
//! is killed with SIGKILL SHIPPING_KILLS times (4), evenly spread, and started again at once.
//! After the load the shop keeps running until shipping has shipped every order answered 201,
//! for at most 60 s: `caught_up_s` is the time from the load's end. Exits 1 as well when an
//! order is not shipped, or shipping took more than 10 s to catch up.

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
use relaybus::transport::nats::async_nats;
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::TcpStream,
};

const CLIENTS: usize = 8;
const CUSTOMERS: usize = 12;
const STOP_FOR: Duration = Duration::from_secs(3);
/// How long shipping may take to ship every order after the load ends.
const CATCH_UP_WITHIN: Duration = Duration::from_secs(10);
/// The stream the shop's relay publishes to and shipping consumes.
const STREAM: &str = "SHOP_ORDERS";

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
    let shipping = match args.get(5..8) {
        Some([binary, nats, postgres]) => match number(8, 4) {
            Ok(kills) => Some(Shipping {
                binary: binary.clone(),
                nats: nats.clone(),
                postgres: postgres.clone(),
                kills,
            }),
            Err(e) => {
                eprintln!("relaybus-shop-drill: {e}");
                return ExitCode::from(2);
            }
        },
        _ if args.len() > 5 => {
            eprintln!(
                "relaybus-shop-drill: the shipping part takes SHIPPING_BINARY NATS_URL POSTGRES_URL"
            );
            return ExitCode::from(2);
        }
        _ => None,
    };
    let length = Duration::from_secs(seconds);
    match drill(shop, uri, length, kills, stopped, shipping).await {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(error) => {
            eprintln!("relaybus-shop-drill: {error}");
            ExitCode::from(2)
        }
    }
}

/// The shipping service of the two-service drill.
#[derive(Debug, Clone)]
struct Shipping {
    binary: String,
    nats: String,
    postgres: String,
    kills: u64,
}

async fn drill(
    shop: &str,
    uri: &str,
    length: Duration,
    kills: u64,
    stopped: u64,
    shipping: Option<Shipping>,
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
                .env_remove("SHOP_RELAY")
                .stdin(Stdio::null())
                .stdout(log.try_clone()?)
                .stderr(log.try_clone()?);
            if let Some(shipping) = &shipping {
                command.env("SHOP_RELAY", &shipping.nats);
            }
            command
        })?)
    };
    let downstream = match &shipping {
        Some(shipping) => Some(Downstream::start(shipping.clone(), &log).await?),
        None => None,
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

    let shipping_faults = downstream
        .as_ref()
        .map(|downstream| downstream.kill_spread(started, length));
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
    let tally = std::mem::take(&mut *tally.lock().unwrap());
    let shipped = match (downstream, shipping_faults) {
        (Some(downstream), Some(faults)) => {
            faults.await??;
            let shipped = downstream.catch_up(&tally.created).await;
            downstream.finish().await?;
            Some(shipped?)
        }
        _ => None,
    };
    relaybus_harness::kill_tied(&mut process);

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
    let shipping_json = shipped.as_ref().map_or(String::new(), |shipped| {
        format!(
            ", \"shipping_kills\": {}, \"shipped\": {}, \"not_shipped\": {}, \"caught_up_s\": {}",
            shipped.kills,
            shipped.shipped,
            tally.created.len() as u64 - shipped.shipped.min(tally.created.len() as u64),
            shipped
                .caught_up
                .map_or("null".to_owned(), |at| format!("{:.2}", at.as_secs_f64())),
        )
    });
    println!(
        "{{\"seconds\": {}, \"kills\": {kills}, \"stopped\": {stopped}, \"answered\": {answered}, \
         \"created\": {}, \"unavailable\": {}, \"unavailable_percent\": {share:.2}, \"other\": {}, \
         \"unanswered\": {}, \"orders_stored\": {}, \"missing\": {missing}, \
         \"without_event\": {without_event}, \"doubled\": {doubled}, \"phantom\": {phantom}\
         {shipping_json}}}",
        length.as_secs(),
        tally.created.len(),
        tally.unavailable,
        tally.other,
        tally.unanswered,
        orders.len(),
    );
    db.drop().await?;
    let shipped_in_time = shipped.is_none_or(|shipped| {
        shipped.shipped == tally.created.len() as u64
            && shipped.caught_up.is_some_and(|at| at <= CATCH_UP_WITHIN)
    });
    Ok(share <= 2.0
        && missing == 0
        && without_event == 0
        && doubled == 0
        && phantom == 0
        && shipped_in_time)
}

/// What shipping did: how often it was killed, how many of the orders answered 201 it shipped,
/// and how long after the load's end it had shipped them all (`None`: not within 60 s).
#[derive(Debug)]
struct Shipped {
    kills: u64,
    shipped: u64,
    caught_up: Option<Duration>,
}

/// The shipping service of a running drill, killed and started again on its own schedule.
struct Downstream {
    shipping: Shipping,
    schema: String,
    pool: sqlx::PgPool,
    jetstream: async_nats::jetstream::Context,
    process: Arc<Mutex<Child>>,
    start: Arc<dyn Fn() -> Result<Child, BoxError> + Send + Sync>,
    load_ended: Arc<Mutex<Option<Instant>>>,
}

impl Downstream {
    /// Deletes the shop's stream, then starts shipping on schemas of its own and waits until it
    /// serves (its stream and consumer made).
    async fn start(shipping: Shipping, log: &std::fs::File) -> Result<Downstream, BoxError> {
        let client = async_nats::connect(&shipping.nats).await?;
        let jetstream = async_nats::jetstream::new(client);
        // A stream of an earlier run would hand this one its orders.
        let _ = jetstream.delete_stream(STREAM).await;
        let schema = format!("shipping_drill_{}", std::process::id());
        let pool = sqlx::PgPool::connect(&shipping.postgres).await?;
        let port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        let address = format!("127.0.0.1:{port}");
        let start: Arc<dyn Fn() -> Result<Child, BoxError> + Send + Sync> = Arc::new({
            let (shipping, schema, address) = (shipping.clone(), schema.clone(), address.clone());
            let log = log.try_clone()?;
            move || {
                let mut command = Command::new(&shipping.binary);
                command
                    .env("DATABASE_URL", &shipping.postgres)
                    .env("NATS_URL", &shipping.nats)
                    .env("SHIPPING_SCHEMA", &schema)
                    .env("SHIPPING_EVENTS_SCHEMA", format!("{schema}_events"))
                    .env("SHIPPING_ADDR", &address)
                    .stdin(Stdio::null())
                    .stdout(log.try_clone()?)
                    .stderr(log.try_clone()?);
                Ok(relaybus_harness::spawn_tied(command)?)
            }
        });
        let process = start()?;
        wait_listening(&address).await?;
        Ok(Downstream {
            shipping,
            schema,
            pool,
            jetstream,
            process: Arc::new(Mutex::new(process)),
            start,
            load_ended: Arc::new(Mutex::new(None)),
        })
    }

    /// Kills shipping `kills` times, evenly spread over the load, starting it again at once.
    fn kill_spread(
        &self,
        started: Instant,
        length: Duration,
    ) -> tokio::task::JoinHandle<Result<(), BoxError>> {
        let (kills, process, start) = (
            self.shipping.kills,
            Arc::clone(&self.process),
            Arc::clone(&self.start),
        );
        let load_ended = Arc::clone(&self.load_ended);
        tokio::spawn(async move {
            for kill in 0..kills {
                // Off the shop's schedule: half a step later.
                let at = length.mul_f64((kill as f64 + 0.5) / kills as f64);
                tokio::time::sleep(at.saturating_sub(started.elapsed())).await;
                let mut process = process.lock().unwrap();
                relaybus_harness::kill_tied(&mut process);
                eprintln!(
                    "relaybus-shop-drill: killed shipping at {:.1} s",
                    started.elapsed().as_secs_f64()
                );
                *process = start()?;
            }
            tokio::time::sleep(length.saturating_sub(started.elapsed())).await;
            *load_ended.lock().unwrap() = Some(started + length);
            Ok(())
        })
    }

    /// Waits until shipping has shipped every order of `created`, for at most 60 s after the
    /// load's end.
    async fn catch_up(&self, created: &[String]) -> Result<Shipped, BoxError> {
        let ended = self.load_ended.lock().unwrap().unwrap_or_else(Instant::now);
        let query = format!(
            "SELECT count(*) FROM {}.shipments WHERE order_id = ANY($1)",
            self.schema
        );
        let mut said = Instant::now();
        loop {
            let shipped: i64 = sqlx::query_scalar(&query)
                .bind(created)
                .fetch_one(&self.pool)
                .await?;
            let shipped = shipped as u64;
            if said.elapsed() >= Duration::from_secs(1) {
                said = Instant::now();
                let mut stream = self.jetstream.get_stream(STREAM).await?;
                eprintln!(
                    "relaybus-shop-drill: {:.1} s after the load, {} of {} orders relayed, \
                     {shipped} shipped",
                    ended.elapsed().as_secs_f64(),
                    stream.info().await?.state.messages,
                    created.len(),
                );
            }
            if shipped == created.len() as u64 || ended.elapsed() > Duration::from_secs(60) {
                return Ok(Shipped {
                    kills: self.shipping.kills,
                    shipped,
                    caught_up: (shipped == created.len() as u64).then(|| ended.elapsed()),
                });
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Stops shipping and drops what the drill made: its schemas and the stream.
    async fn finish(self) -> Result<(), BoxError> {
        relaybus_harness::kill_tied(&mut self.process.lock().unwrap());
        for schema in [self.schema.clone(), format!("{}_events", self.schema)] {
            sqlx::query(&format!("DROP SCHEMA IF EXISTS {schema} CASCADE"))
                .execute(&self.pool)
                .await?;
        }
        let _ = self.jetstream.delete_stream(STREAM).await;
        Ok(())
    }
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
