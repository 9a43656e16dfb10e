//! The operator page in a real headless Chromium, driven through ChromeDriver: it opens the
//! page, sees the counts, filters the deliveries, opens a dead letter, requeues it and sees it
//! go, then discards a group of dead letters from the dead-letter view.
//!
//! It needs `chromedriver` and `chromium` (Debian's `chromium-driver` and `chromium`, which
//! `scripts/test` installs), found on the `PATH` or named by `RELAYBUS_CHROMEDRIVER` and
//! `RELAYBUS_CHROMIUM`. Without them the test fails saying so: it is never skipped. With
//! `RELAYBUS_SCREENSHOTS` set to a folder, it saves the views it opens there as PNG files.

use std::{
    net::{Ipv4Addr, SocketAddr, TcpListener},
    path::PathBuf,
    process::Stdio,
    time::{Duration, Instant},
};

use axum::Router;
use fantoccini::{Client, ClientBuilder, Locator, elements::Element};
use relaybus::{RelayBus, Store};
use relaybus_axum::ops::NestOps;
use relaybus_harness::test_db;
use relaybus_tests::support::{MAILER_ERRORS, operated_bus};
use serde_json::json;

/// How long the page gets to show what the test waits for.
const PATIENCE: Duration = Duration::from_secs(20);

/// A program named by `variable`, or the first of `names` on the `PATH`.
fn program(variable: &str, names: &[&str]) -> PathBuf {
    if let Some(path) = std::env::var_os(variable) {
        return PathBuf::from(path);
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    for dir in std::env::split_paths(&path) {
        for name in names {
            let candidate = dir.join(name);
            if candidate.is_file() {
                return candidate;
            }
        }
    }
    panic!(
        "the page test needs {}: install Debian's chromium and chromium-driver (scripts/test \
         does), or name the program in {variable}",
        names.join(" or ")
    );
}

fn free_port() -> u16 {
    TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .and_then(|listener| listener.local_addr())
        .map(|address| address.port())
        .expect("a free port")
}

/// ChromeDriver on a port of its own, stopped when dropped.
struct Driver {
    _child: tokio::process::Child,
    url: String,
}

async fn chromedriver() -> Driver {
    let program = program("RELAYBUS_CHROMEDRIVER", &["chromedriver"]);
    let port = free_port();
    let child = tokio::process::Command::new(&program)
        .arg(format!("--port={port}"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap_or_else(|e| panic!("could not start {}: {e}", program.display()));
    // Ready once it accepts connections.
    let deadline = Instant::now() + PATIENCE;
    while tokio::net::TcpStream::connect((Ipv4Addr::LOCALHOST, port))
        .await
        .is_err()
    {
        assert!(Instant::now() < deadline, "chromedriver did not start");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Driver {
        _child: child,
        url: format!("http://127.0.0.1:{port}"),
    }
}

async fn browser(driver: &Driver) -> Client {
    let chromium = program(
        "RELAYBUS_CHROMIUM",
        &["chromium", "chromium-browser", "google-chrome"],
    );
    let capabilities = json!({
        "goog:chromeOptions": {
            "binary": chromium,
            "args": [
                "--headless=new",
                "--no-sandbox",
                "--disable-dev-shm-usage",
                "--disable-gpu",
                "--window-size=1360,900",
            ],
        },
    });
    let serde_json::Value::Object(capabilities) = capabilities else {
        unreachable!()
    };
    let connector = hyper_util::client::legacy::connect::HttpConnector::new();
    ClientBuilder::new(connector)
        .capabilities(capabilities)
        .connect(&driver.url)
        .await
        .expect("a browser session")
}

/// Serves the operator routes of `bus` at `/ops` on a free port.
async fn serve(bus: RelayBus) -> SocketAddr {
    let app: Router = Router::new().nest_ops("/ops", relaybus_axum::ops::router(bus));
    let listener = tokio::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .await
        .unwrap();
    let address = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    address
}

/// The elements `css` finds, once `ready` holds for them; fails the test after [`PATIENCE`],
/// saying what it last saw.
async fn until<F>(client: &Client, css: &str, what: &str, ready: F) -> Vec<Element>
where
    F: Fn(&[String]) -> bool,
{
    let deadline = Instant::now() + PATIENCE;
    loop {
        let found = client.find_all(Locator::Css(css)).await.unwrap_or_default();
        let mut texts = Vec::with_capacity(found.len());
        for element in &found {
            texts.push(element.text().await.unwrap_or_default());
        }
        if ready(&texts) {
            return found;
        }
        if Instant::now() > deadline {
            let notice = match client.find(Locator::Css("#notice")).await {
                Ok(notice) => notice.text().await.unwrap_or_default(),
                Err(_) => String::new(),
            };
            panic!("the page never showed {what}: `{css}` gave {texts:?}; notice: {notice:?}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Clicks the element `css` finds.
async fn click(client: &Client, css: &str) {
    client
        .find(Locator::Css(css))
        .await
        .unwrap_or_else(|e| panic!("no `{css}` on the page: {e}"))
        .click()
        .await
        .unwrap();
}

async fn screenshot(client: &Client, name: &str) {
    if let Some(dir) = std::env::var_os("RELAYBUS_SCREENSHOTS") {
        let png = client.screenshot().await.expect("a screenshot");
        let path = PathBuf::from(dir).join(format!("{name}.png"));
        std::fs::write(&path, png).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    }
}

async fn dead<S: Store>(bus: &RelayBus<S>) -> u64 {
    bus.store().statistics().await.unwrap().dead
}

/// Confirms the open confirmation dialog.
async fn confirm(client: &Client) {
    let button = until(
        client,
        "#confirm[open] button.confirm",
        "the confirmation",
        |found| !found.is_empty(),
    )
    .await;
    button[0].click().await.unwrap();
}

#[tokio::test]
async fn an_operator_finds_requeues_and_discards_dead_letters_in_the_page() {
    let db = test_db("ops_page_browser").await;
    let bus = operated_bus(&db).await;
    let address = serve(bus.clone()).await;
    let driver = chromedriver().await;
    let client = browser(&driver).await;

    // The overview shows the counts.
    client.goto(&format!("http://{address}/ops")).await.unwrap();
    until(&client, "#total-dead", "six dead letters", |t| t == ["6"]).await;
    until(&client, "#handlers tbody tr", "both handlers", |t| {
        t.len() == 2
    })
    .await;
    until(
        &client,
        "#completed-note",
        "the completion-history note",
        |t| t.iter().any(|t| t.contains("completion history")),
    )
    .await;
    screenshot(&client, "overview").await;

    // The deliveries browser filters, and keeps the filter in the URL.
    click(&client, "nav a[data-view=deliveries]").await;
    let form = until(&client, "#filters", "the filter form", |f| f.len() == 1).await;
    form[0]
        .find(Locator::Css("select[name=status]"))
        .await
        .unwrap()
        .select_by_value("dead")
        .await
        .unwrap();
    for (name, value) in [("handler", "mailer"), ("error", "mailbox")] {
        form[0]
            .find(Locator::Css(&format!("input[name={name}]")))
            .await
            .unwrap()
            .send_keys(value)
            .await
            .unwrap();
    }
    form[0]
        .find(Locator::Css("button[type=submit]"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    let rows = until(
        &client,
        "#deliveries tbody tr",
        "the four mailbox dead letters",
        |t| t.len() == 4 && t.iter().all(|t| t.contains(MAILER_ERRORS[0])),
    )
    .await;
    assert_eq!(rows.len(), 4);
    let url = client.current_url().await.unwrap();
    let query = url.query().unwrap_or_default();
    for part in [
        "view=deliveries",
        "status=dead",
        "handler=mailer",
        "error=mailbox",
    ] {
        assert!(query.contains(part), "{part} missing from {url}");
    }
    screenshot(&client, "deliveries").await;

    // A reload of that URL shows the same filter.
    client.refresh().await.unwrap();
    until(
        &client,
        "#deliveries tbody tr",
        "the same four after a reload",
        |t| t.len() == 4,
    )
    .await;

    // Open one: its event, payload and error history.
    let first = until(&client, "#deliveries a.open", "the event links", |t| {
        t.len() == 4
    })
    .await;
    first[0].click().await.unwrap();
    until(&client, "#payload", "the payload", |t| {
        t.iter()
            .any(|t| t.contains("\"order_id\"") && t.contains("order-"))
    })
    .await;
    until(
        &client,
        "#event-deliveries tbody tr[data-state=dead]",
        "the dead delivery with its error",
        |t| t.len() == 1 && t[0].contains(MAILER_ERRORS[0]),
    )
    .await;
    until(&client, "#event-fields", "the event's fields", |t| {
        t.len() == 1 && t[0].contains("order.placed.v1") && t[0].contains("mailer, projector")
    })
    .await;
    screenshot(&client, "event").await;

    // Requeue it behind the confirmation, and see it go.
    click(&client, "#event-deliveries button.requeue").await;
    confirm(&client).await;
    until(&client, "#notice", "the requeue's outcome", |t| {
        t.iter().any(|t| t.starts_with("Requeued 1"))
    })
    .await;
    until(
        &client,
        "#event-deliveries tbody tr[data-state=waiting]",
        "the requeued delivery waiting",
        |t| t.len() == 1,
    )
    .await;
    assert_eq!(dead(&bus).await, 5, "the store has one dead letter less");

    // The dead letters by error: discard a whole group behind the confirmation.
    click(&client, "nav a[data-view=dead]").await;
    let groups = until(&client, "#groups tbody tr", "two groups of 3 and 2", |t| {
        t.len() == 2 && t[0].contains(MAILER_ERRORS[0]) && t[1].contains(MAILER_ERRORS[1])
    })
    .await;
    screenshot(&client, "dead-letters").await;
    groups[1]
        .find(Locator::Css("button.discard-group"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    confirm(&client).await;
    until(&client, "#notice", "the discard's outcome", |t| {
        t.iter().any(|t| t.starts_with("Discarded 2"))
    })
    .await;
    until(&client, "#groups tbody tr", "one group left", |t| {
        t.len() == 1
    })
    .await;
    assert_eq!(dead(&bus).await, 3, "the group is gone from the store");

    // Cancelling a confirmation writes nothing.
    let groups = until(&client, "#groups tbody tr", "the last group", |t| {
        t.len() == 1
    })
    .await;
    groups[0]
        .find(Locator::Css("button.requeue-group"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    until(
        &client,
        "#confirm[open] button.cancel",
        "the confirmation",
        |f| !f.is_empty(),
    )
    .await[0]
        .click()
        .await
        .unwrap();
    until(&client, "#confirm:not([open])", "the dialog closed", |f| {
        f.len() == 1
    })
    .await;
    assert_eq!(dead(&bus).await, 3, "a cancelled requeue changes nothing");

    // The lanes view answers.
    click(&client, "nav a[data-view=lanes]").await;
    until(
        &client,
        "#view[data-view=lanes] .card .label",
        "the lane counts",
        |t| t.iter().any(|t| t.contains("lanes held")),
    )
    .await;

    // Opened with credentials in its URL (as behind HTTP Basic authentication), the page still
    // fetches its data: fetch refuses a URL that carries credentials, so the page builds its
    // requests from its origin.
    client
        .goto(&format!("http://ops:secret@{address}/ops"))
        .await
        .unwrap();
    until(
        &client,
        "#total-dead",
        "the counts, with credentials in the URL",
        |t| t == ["3"],
    )
    .await;

    // At `/ops/`, the same page.
    client
        .goto(&format!("http://{address}/ops/"))
        .await
        .unwrap();
    until(&client, "#total-dead", "the counts, at /ops/", |t| {
        t == ["3"]
    })
    .await;
    assert_eq!(
        client.current_url().await.unwrap().path(),
        "/ops",
        "sent to the page's own address"
    );

    client.close().await.unwrap();
}
