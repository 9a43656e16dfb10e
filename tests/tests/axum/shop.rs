//! The shop example (`examples/shop`) with its idempotent `POST /orders`, run as a process on
//! MongoDB and driven over HTTP only: concurrent repeats of one request, a key reused with
//! another body, and a repeat sent to the shop restarted after a SIGKILL.
//!
//! The binary is `RELAYBUS_SHOP_BIN` when set, else built here with cargo (`example-shop`).

use std::{
    collections::HashMap,
    io::{BufRead, BufReader},
    path::PathBuf,
    process::{Child, Command, Stdio},
    sync::OnceLock,
    time::Duration,
};

use futures::future::join_all;
use mongodb::bson::{Document, doc};
use relaybus_harness::{TestDb, test_db};
use serde_json::Value;
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::TcpStream,
};

/// The `example-shop` binary, built once per test process.
fn binary() -> &'static PathBuf {
    static BINARY: OnceLock<PathBuf> = OnceLock::new();
    BINARY.get_or_init(|| match std::env::var_os("RELAYBUS_SHOP_BIN") {
        Some(path) => PathBuf::from(path),
        None => crate::workspace::build("example-shop", &["-p", "example-shop"]),
    })
}

/// The shop process on the test's database, and where it listens.
struct Shop {
    process: Child,
    address: String,
}

impl Shop {
    /// Starts the shop on a free port and returns once it listens (it says where).
    async fn start(db: &TestDb) -> Shop {
        let mut command = Command::new(binary());
        command
            .env("MONGODB_URI", &db.uri)
            .env("SHOP_DATABASE", &db.name)
            .env("SHOP_ADDR", "127.0.0.1:0")
            .env("SHOP_OPS_PASSWORD", "test")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null());
        let mut process = relaybus_harness::spawn_tied(command).expect("start the shop");
        let stdout = process.stdout.take().expect("piped stdout");
        let listening = tokio::task::spawn_blocking(move || {
            let mut lines = BufReader::new(stdout).lines().map_while(Result::ok);
            let address = lines.find_map(|line| {
                let rest = line.strip_prefix("shop on http://")?;
                Some(rest.split(';').next()?.to_owned())
            });
            // Keep reading, so the shop never blocks on a full pipe.
            std::thread::spawn(move || lines.for_each(drop));
            address
        });
        let address = tokio::time::timeout(Duration::from_secs(60), listening)
            .await
            .expect("the shop listens within a minute")
            .unwrap()
            .expect("the shop said where it listens");
        Shop { process, address }
    }

    /// Kills the shop with SIGKILL.
    fn kill(mut self) {
        relaybus_harness::kill_tied(&mut self.process);
    }

    /// Sends `POST /orders` with `key` as its `Idempotency-Key`.
    async fn post(&self, key: &str, body: &str) -> Answer {
        let request = format!(
            "POST /orders HTTP/1.1\r\nhost: {}\r\ncontent-type: application/json\r\n\
             idempotency-key: {key}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
            self.address,
            body.len()
        );
        let exchange = async {
            let mut stream = TcpStream::connect(&self.address).await?;
            stream.write_all(request.as_bytes()).await?;
            let mut response = Vec::new();
            stream.read_to_end(&mut response).await?;
            Ok::<_, std::io::Error>(String::from_utf8_lossy(&response).into_owned())
        };
        let response = tokio::time::timeout(Duration::from_secs(60), exchange)
            .await
            .expect("an answer within a minute")
            .expect("the exchange");
        Answer::parse(&response)
    }
}

impl Drop for Shop {
    fn drop(&mut self) {
        relaybus_harness::kill_tied(&mut self.process);
    }
}

/// A response: status, headers (names in lowercase) and body.
#[derive(Debug)]
struct Answer {
    status: u16,
    headers: HashMap<String, String>,
    body: String,
}

impl Answer {
    fn parse(response: &str) -> Answer {
        let (head, body) = response.split_once("\r\n\r\n").expect("a head and a body");
        let mut lines = head.lines();
        let status = lines
            .next()
            .and_then(|line| line.split_whitespace().nth(1))
            .and_then(|status| status.parse().ok())
            .expect("a status line");
        let headers = lines
            .filter_map(|line| line.split_once(':'))
            .map(|(name, value)| (name.trim().to_lowercase(), value.trim().to_owned()))
            .collect();
        Answer {
            status,
            headers,
            body: body.to_owned(),
        }
    }

    /// The order id a 201 names.
    fn order_id(&self) -> String {
        let body: Value = serde_json::from_str(&self.body).expect("a JSON body");
        body["id"].as_str().expect("an order id").to_owned()
    }

    fn replayed(&self) -> bool {
        self.headers.get("idempotent-replayed").map(String::as_str) == Some("true")
    }
}

/// The order ids stored, and the `order.placed.v1` events by order id.
async fn stored(db: &TestDb) -> (Vec<String>, HashMap<String, usize>) {
    use futures::TryStreamExt;
    let orders: Vec<Document> = db
        .db()
        .collection::<Document>("orders")
        .find(doc! {})
        .await
        .unwrap()
        .try_collect()
        .await
        .unwrap();
    let orders = orders
        .iter()
        .map(|order| order.get_str("_id").unwrap().to_owned())
        .collect();
    let events: Vec<Document> = db
        .db()
        .collection::<Document>("relaybus_events")
        .find(doc! { "type": "order.placed.v1" })
        .await
        .unwrap()
        .try_collect()
        .await
        .unwrap();
    let mut by_order = HashMap::new();
    for event in &events {
        let id = event
            .get_document("payload")
            .unwrap()
            .get_str("order_id")
            .unwrap();
        *by_order.entry(id.to_owned()).or_default() += 1;
    }
    (orders, by_order)
}

const ORDER: &str = r#"{"customer": "ada", "total_cents": 1250}"#;

/// 20 identical `POST /orders` with one key, at once: every 2xx names the same order, and one
/// order and one event are stored. The key with another body is answered 422.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_shop_stores_one_order_for_twenty_concurrent_posts_with_one_key() {
    let db = test_db("shop_idempotent").await;
    let shop = Shop::start(&db).await;
    let answers = join_all((0..20).map(|_| shop.post("order-ada-1", ORDER))).await;
    let ids: Vec<String> = answers
        .iter()
        .inspect(|a| assert!((200..300).contains(&a.status), "{a:?}"))
        .map(Answer::order_id)
        .collect();
    assert!(ids.iter().all(|id| *id == ids[0]), "{ids:?}");
    assert_eq!(answers.iter().filter(|a| !a.replayed()).count(), 1);
    let (orders, events) = stored(&db).await;
    assert_eq!(orders, [ids[0].clone()]);
    assert_eq!(events, HashMap::from([(ids[0].clone(), 1)]));

    let other = shop
        .post("order-ada-1", r#"{"customer": "ada", "total_cents": 999}"#)
        .await;
    assert_eq!(other.status, 422, "{other:?}");
    assert_eq!(stored(&db).await.0.len(), 1);
}

/// A `POST /orders` answered 201, the shop killed with SIGKILL right after, and the same
/// request sent to the restarted shop: the same order, stored once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repeat_sent_to_the_shop_restarted_after_a_kill_gets_the_same_order() {
    let db = test_db("shop_idempotent_kill").await;
    let shop = Shop::start(&db).await;
    let first = shop.post("order-ada-2", ORDER).await;
    assert_eq!(first.status, 201, "{first:?}");
    shop.kill();

    let shop = Shop::start(&db).await;
    let repeat = shop.post("order-ada-2", ORDER).await;
    assert_eq!(repeat.status, 201, "{repeat:?}");
    assert!(repeat.replayed(), "{repeat:?}");
    assert_eq!(repeat.order_id(), first.order_id());
    assert_eq!(repeat.body, first.body);
    let (orders, events) = stored(&db).await;
    assert_eq!(orders, [first.order_id()]);
    assert_eq!(events, HashMap::from([(first.order_id(), 1)]));
}
