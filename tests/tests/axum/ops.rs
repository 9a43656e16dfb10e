//! The operator routes behind the page, against a real replica set: the event detail, the
//! lanes, the dead letters by error, this process's activity, the listing's new filters, the
//! page and its assets, and the refusals of bad input.

use axum::{
    Router,
    body::Body,
    http::{Request, Response, StatusCode, header},
};
use relaybus_axum::ops::NestOps;
use relaybus_harness::test_db;
use relaybus_tests::support::{MAILER_ERRORS, operated_bus};
use serde_json::{Value, json};
use tower::ServiceExt;

async fn body(response: Response<Body>) -> String {
    let bytes = axum::body::to_bytes(response.into_body(), usize::MAX)
        .await
        .unwrap();
    String::from_utf8(bytes.to_vec()).unwrap()
}

struct Ops(Router);

impl Ops {
    async fn get(&self, uri: &str) -> (StatusCode, Value) {
        let response = self
            .raw(Request::get(uri).body(Body::empty()).unwrap())
            .await;
        let status = response.status();
        let text = body(response).await;
        let value = serde_json::from_str(&text).unwrap_or_else(|_| panic!("{uri}: {text}"));
        (status, value)
    }

    async fn post(&self, uri: &str, json: Value) -> (StatusCode, Value) {
        let request = Request::post(uri)
            .header(relaybus_axum::ops::WRITE_HEADER, "1")
            .header(header::CONTENT_TYPE, "application/json")
            .body(Body::from(json.to_string()))
            .unwrap();
        let response = self.raw(request).await;
        let status = response.status();
        (status, serde_json::from_str(&body(response).await).unwrap())
    }

    async fn raw(&self, request: Request<Body>) -> Response<Body> {
        self.0.clone().oneshot(request).await.unwrap()
    }
}

#[tokio::test]
async fn the_pages_routes_show_events_lanes_groups_and_activity() {
    let db = test_db("ops_routes").await;
    let bus = operated_bus(&db).await;
    let ops = Ops(Router::new().nest("/ops", relaybus_axum::ops::router(bus.clone())));

    let (status, stats) = ops.get("/ops/statistics").await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(stats["dead"], 6, "{stats}");
    assert_eq!(stats["completion_history"], false, "{stats}");
    assert_eq!(
        stats["completed"],
        Value::Null,
        "not counted, so not 0: {stats}"
    );
    assert!(
        stats["completed_note"]
            .as_str()
            .is_some_and(|note| note.contains("completion history")),
        "{stats}"
    );

    let (_, activity) = ops.get("/ops/activity").await;
    let of = |handler: &str| {
        activity["handlers"]
            .as_array()
            .unwrap()
            .iter()
            .find(|h| h["handler"] == handler)
            .cloned()
            .unwrap_or_else(|| panic!("{handler} missing: {activity}"))
    };
    assert_eq!(
        (
            of("projector")["succeeded"].as_u64(),
            of("projector")["failed"].as_u64()
        ),
        (Some(6), Some(0)),
        "{activity}"
    );
    assert_eq!(of("mailer")["failed"], 6, "{activity}");
    assert_eq!(of("mailer")["dead_lettered"], 6, "{activity}");
    let minutes: u64 = of("projector")["minutes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["succeeded"].as_u64().unwrap())
        .sum();
    assert_eq!(minutes, 6, "the minutes add up: {activity}");

    let (_, groups) = ops.get("/ops/dead-letters").await;
    let shape: Vec<(String, u64)> = groups["groups"]
        .as_array()
        .unwrap()
        .iter()
        .map(|g| {
            (
                g["error"].as_str().unwrap().to_owned(),
                g["count"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        shape,
        [
            (MAILER_ERRORS[0].to_owned(), 4),
            (MAILER_ERRORS[1].to_owned(), 2)
        ],
        "{groups}"
    );
    let (_, none) = ops.get("/ops/dead-letters?handler=projector").await;
    assert_eq!(none["groups"], json!([]), "{none}");

    // One group, listed by its exact error, and by text it contains.
    let exact = format!(
        "/ops/deliveries?status=dead&last_error={}",
        MAILER_ERRORS[1].replace(' ', "%20")
    );
    let (_, listed) = ops.get(&exact).await;
    assert_eq!(
        listed["deliveries"].as_array().unwrap().len(),
        2,
        "{listed}"
    );
    let (_, contains) = ops.get("/ops/deliveries?error=MAILBOX").await;
    assert_eq!(
        contains["deliveries"].as_array().unwrap().len(),
        4,
        "{contains}"
    );
    let (_, running) = ops.get("/ops/deliveries?status=running").await;
    assert_eq!(
        running["deliveries"],
        json!([]),
        "nothing runs now: {running}"
    );

    // The event behind a dead letter, with both handlers' deliveries.
    let first = &listed["deliveries"][0];
    let event_id = first["event_id"].as_str().unwrap();
    let (status, detail) = ops.get(&format!("/ops/events/{event_id}")).await;
    assert_eq!(status, StatusCode::OK, "{detail}");
    assert_eq!(detail["event"]["id"], event_id);
    assert_eq!(detail["event"]["type"], "order.placed.v1");
    assert!(
        detail["event"]["payload"]["order_id"].is_string(),
        "{detail}"
    );
    let handlers: Vec<&str> = detail["deliveries"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["handler"].as_str().unwrap())
        .collect();
    assert_eq!(
        handlers,
        ["mailer"],
        "the projector's completed delivery left no record without history: {detail}"
    );
    assert_eq!(
        detail["deliveries"][0]["errors"][0]["error"],
        MAILER_ERRORS[1]
    );
    let mut named: Vec<&str> = detail["event"]["handlers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|h| h.as_str().unwrap())
        .collect();
    named.sort_unstable();
    assert_eq!(named, ["mailer", "projector"], "{detail}");

    let (_, lanes) = ops.get("/ops/lanes").await;
    assert!(!lanes["lanes"].as_array().unwrap().is_empty(), "{lanes}");
    assert_eq!(lanes["blocked"], json!([]), "{lanes}");
    assert!(
        lanes["lanes"]
            .as_array()
            .unwrap()
            .iter()
            .all(|lane| lane["in_flight"] == 0),
        "{lanes}"
    );

    // A group requeued by its filter: exactly its dead letters.
    let (status, requeued) = ops
        .post(
            "/ops/deliveries/requeue",
            json!({ "filter": { "handler": "mailer", "last_error": MAILER_ERRORS[1] } }),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{requeued}");
    assert_eq!(
        requeued["requeued"].as_array().unwrap().len(),
        2,
        "{requeued}"
    );
    let (_, stats) = ops.get("/ops/statistics").await;
    assert_eq!(
        (stats["dead"].as_u64(), stats["pending"].as_u64()),
        (Some(4), Some(2))
    );
}

#[tokio::test]
async fn the_page_is_served_with_its_assets_and_a_policy_of_its_own() {
    let db = test_db("ops_page_served").await;
    let bus = operated_bus(&db).await;
    let ops = Ops(Router::new().nest_ops(
        "/ops",
        relaybus_axum::ops::config(bus).read_only(true).router(),
    ));

    let page = ops
        .raw(Request::get("/ops").body(Body::empty()).unwrap())
        .await;
    assert_eq!(page.status(), StatusCode::OK);
    let policy = page.headers()[header::CONTENT_SECURITY_POLICY]
        .to_str()
        .unwrap()
        .to_owned();
    assert!(policy.contains("script-src 'self'"), "{policy}");
    assert!(policy.contains("frame-ancestors 'none'"), "{policy}");
    assert!(!policy.contains("unsafe"), "{policy}");
    assert_eq!(page.headers()[header::CACHE_CONTROL], "no-store");
    assert!(
        page.headers()[header::CONTENT_TYPE]
            .to_str()
            .unwrap()
            .starts_with("text/html")
    );
    let html = body(page).await;
    assert!(html.contains(r#"src="/ops/assets/ops.js""#), "{html}");
    assert!(html.contains(r#"data-read-only="true""#), "{html}");

    // With a trailing slash: sent to the page, its query kept.
    let slash = ops
        .raw(
            Request::get("/ops/?view=lanes")
                .body(Body::empty())
                .unwrap(),
        )
        .await;
    assert_eq!(slash.status(), StatusCode::PERMANENT_REDIRECT);
    assert_eq!(slash.headers()[header::LOCATION], "../ops?view=lanes");

    for (asset, kind) in [
        ("/ops/assets/ops.js", "text/javascript"),
        ("/ops/assets/ops.css", "text/css"),
    ] {
        let answer = ops
            .raw(Request::get(asset).body(Body::empty()).unwrap())
            .await;
        assert_eq!(answer.status(), StatusCode::OK, "{asset}");
        assert!(
            answer.headers()[header::CONTENT_TYPE]
                .to_str()
                .unwrap()
                .starts_with(kind)
        );
        assert!(!body(answer).await.is_empty());
    }

    // The JSON routes still refuse writes on a read-only router.
    let (status, _) = ops
        .post("/ops/deliveries/requeue", json!({ "all": true }))
        .await;
    assert_eq!(status, StatusCode::FORBIDDEN);
}

#[tokio::test]
async fn the_new_routes_refuse_bad_input_with_json() {
    let db = test_db("ops_bad_input").await;
    let bus = operated_bus(&db).await;
    let ops = Ops(Router::new().nest("/ops", relaybus_axum::ops::router(bus)));
    for (uri, code, says) in [
        (
            "/ops/events/no-such-event",
            StatusCode::NOT_FOUND,
            "no event has this id",
        ),
        ("/ops/events/%00", StatusCode::BAD_REQUEST, "`event_id`"),
        (
            "/ops/dead-letters?handler=a%20b",
            StatusCode::BAD_REQUEST,
            "`handler`",
        ),
        (
            "/ops/dead-letters?handler[$ne]=x",
            StatusCode::BAD_REQUEST,
            "unknown field",
        ),
        (
            "/ops/dead-letters?error=x",
            StatusCode::BAD_REQUEST,
            "unknown field",
        ),
        (
            "/ops/deliveries?status=stuck",
            StatusCode::BAD_REQUEST,
            "`running`",
        ),
        ("/ops/deliveries?key=", StatusCode::BAD_REQUEST, "`key`"),
        (
            "/ops/deliveries?error=%01",
            StatusCode::BAD_REQUEST,
            "`error`",
        ),
        (
            "/ops/lanes/7",
            StatusCode::NOT_FOUND,
            "no such operator route",
        ),
    ] {
        let (status, answer) = ops.get(uri).await;
        assert_eq!(status, code, "{uri}: {answer}");
        assert!(
            answer["error"].as_str().is_some_and(|e| e.contains(says)),
            "{uri}: {answer}"
        );
    }
    let long = format!("/ops/events/{}", "e".repeat(300));
    let (status, answer) = ops.get(&long).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{answer}");
    let (status, answer) = ops
        .post(
            "/ops/deliveries/discard",
            json!({ "filter": { "last_error": "" } }),
        )
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{answer}");
    let (_, stats) = ops.get("/ops/statistics").await;
    assert_eq!(stats["dead"], 6, "nothing was written: {stats}");
}

/// `GET /schedules` lists the bus's schedules with the last tick the store holds, whichever
/// bus published it, and the next; the page has a view for them.
#[tokio::test]
async fn the_schedules_route_lists_last_and_next_ticks() {
    use std::time::Duration;

    use relaybus::{RelayBus, Schedule, Tick, Timestamp, clock::TestClock};
    use relaybus_tests::fault::Beat;

    let db = test_db("ops_schedules").await;
    let store = relaybus_tests::support::store(&db).await;
    let t = |text: &str| Timestamp::parse_rfc3339(text).unwrap();
    let clock = TestClock::new(t("2030-01-01T08:59:59Z"));
    let bus = || {
        RelayBus::builder(store.clone())
            .without_registered_handlers()
            .without_registered_schedules()
            .clock(clock.clone())
            .schedule(
                Schedule::cron("paris-report", "0 0 10 * * *", |tick: Tick| Beat {
                    at: tick.at(),
                })
                .time_zone("Europe/Paris"),
            )
            .schedule(Schedule::every(
                "minutely",
                Duration::from_secs(60),
                |tick: Tick| Beat { at: tick.at() },
            ))
            .build()
            .unwrap()
    };
    let (publisher, viewer) = (bus(), bus());
    let ops = Ops(Router::new().nest("/ops", relaybus_axum::ops::router(viewer)));

    let (status, listed) = ops.get("/ops/schedules").await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(
        listed,
        json!({"schedules": [
            {"id": "paris-report", "event_type": "schedule.beat.v1",
             "cadence": "cron \"0 0 10 * * *\" in Europe/Paris", "missed": "latest",
             "last_tick": null, "next_tick": "2030-01-01T09:00:00.000Z"},
            {"id": "minutely", "event_type": "schedule.beat.v1", "cadence": "every 60s",
             "missed": "latest", "last_tick": null, "next_tick": "2030-01-01T09:00:00.000Z"},
        ]})
    );

    clock.advance(Duration::from_secs(61));
    assert_eq!(publisher.publish_ticks().await.unwrap().created(), 2);
    let (_, listed) = ops.get("/ops/schedules").await;
    let ticks: Vec<(&str, &str)> = listed["schedules"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| {
            (
                s["last_tick"].as_str().unwrap(),
                s["next_tick"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        ticks,
        [
            ("2030-01-01T09:00:00.000Z", "2030-01-02T09:00:00.000Z"),
            ("2030-01-01T09:01:00.000Z", "2030-01-01T09:02:00.000Z"),
        ]
    );

    let page = body(
        ops.raw(Request::get("/ops").body(Body::empty()).unwrap())
            .await,
    )
    .await;
    assert!(page.contains("data-view=\"schedules\""), "{page}");
    let script = body(
        ops.raw(
            Request::get("/ops/assets/ops.js")
                .body(Body::empty())
                .unwrap(),
        )
        .await,
    )
    .await;
    assert!(script.contains("api(\"/schedules\")"));
}

/// The handler overview shows each handler's limits: global concurrency (and whether it is
/// partitioned), rate limit, batches.
#[tokio::test]
async fn the_handler_overview_shows_limits() {
    use relaybus::{Batch, BoxError, MemoryEventStore, RelayBus, Subscription};
    use relaybus_tests::support::OrderPlaced;
    use std::time::Duration;
    let charge = Subscription::new("charge", |_: OrderPlaced| async { Ok::<(), BoxError>(()) })
        .global_concurrency(4)
        .partition_concurrency_by(|event: &OrderPlaced| event.order_id.clone())
        .rate_limit(50, Duration::from_secs(1));
    let project = Subscription::batch("project", |_: Batch<OrderPlaced>| async {
        Ok::<(), BoxError>(())
    })
    .max_batch(200)
    .batch_wait(Duration::from_millis(20));
    let plain = Subscription::new("plain", |_: OrderPlaced| async { Ok::<(), BoxError>(()) });
    let bus = RelayBus::builder(MemoryEventStore::new())
        .without_registered_handlers()
        .subscribe(charge)
        .subscribe(project)
        .subscribe(plain)
        .build()
        .expect("valid bus");
    let ops = Ops(Router::new().nest("/ops", relaybus_axum::ops::router(bus)));
    let (status, handlers) = ops.get("/ops/handlers").await;
    assert_eq!(status, StatusCode::OK);
    let limits: Vec<(String, Value)> = handlers["handlers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|h| {
            (
                h["handler"].as_str().unwrap().to_owned(),
                h["limits"].clone(),
            )
        })
        .collect();
    assert_eq!(
        limits,
        [
            (
                "charge".to_owned(),
                json!({
                    "global_concurrency": 4,
                    "concurrency_partitioned": true,
                    "rate_limit": { "starts": 50, "interval_ms": 1000 },
                    "batch": null,
                })
            ),
            (
                "plain".to_owned(),
                json!({
                    "global_concurrency": null,
                    "concurrency_partitioned": false,
                    "rate_limit": null,
                    "batch": null,
                })
            ),
            (
                "project".to_owned(),
                json!({
                    "global_concurrency": null,
                    "concurrency_partitioned": false,
                    "rate_limit": null,
                    "batch": { "max": 200, "wait_ms": 20 },
                })
            ),
        ]
    );
}
