//! Metrics: after a known load, the recorded values are read back through a test recorder.
//!
//! The recorder is global to the process, so this file holds one test.

use std::time::Duration;

use axum::{
    Router,
    body::Body,
    http::{Request, StatusCode},
    routing::post,
};
use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
use relaybus::{BoxError, RelayBus, RetryPolicy, Subscription, telemetry};
use relaybus_axum::{PublishError, Publisher};
use relaybus_harness::test_db;
use relaybus_tests::support::{OrderPlaced, next, placed, store};
use tokio::sync::mpsc;
use tower::ServiceExt;

/// A metric's labels, as key and value.
type Labels = Vec<(String, String)>;

/// The recorded values, by name and labels.
struct Recorded(Vec<(String, Labels, DebugValue)>);

impl Recorded {
    fn take(snapshotter: &Snapshotter) -> Self {
        Recorded(
            snapshotter
                .snapshot()
                .into_vec()
                .into_iter()
                .map(|(key, _, _, value)| {
                    let key = key.key();
                    let labels = key
                        .labels()
                        .map(|l| (l.key().to_owned(), l.value().to_owned()))
                        .collect();
                    (key.name().to_owned(), labels, value)
                })
                .collect(),
        )
    }

    /// The values of `name` whose labels include all of `labels`.
    fn matching(&self, name: &str, labels: &[(&str, &str)]) -> Vec<&DebugValue> {
        self.0
            .iter()
            .filter(|(n, have, _)| {
                n == name
                    && labels
                        .iter()
                        .all(|(k, v)| have.iter().any(|(hk, hv)| hk == k && hv == v))
            })
            .map(|(_, _, value)| value)
            .collect()
    }

    /// The sum of the counters `name` with these labels.
    fn counter(&self, name: &str, labels: &[(&str, &str)]) -> u64 {
        self.matching(name, labels)
            .into_iter()
            .map(|value| match value {
                DebugValue::Counter(n) => *n,
                other => panic!("{name} is not a counter: {other:?}"),
            })
            .sum()
    }

    /// How many values the histograms `name` with these labels hold.
    fn samples(&self, name: &str, labels: &[(&str, &str)]) -> usize {
        self.matching(name, labels)
            .into_iter()
            .map(|value| match value {
                DebugValue::Histogram(values) => values.len(),
                other => panic!("{name} is not a histogram: {other:?}"),
            })
            .sum()
    }

    /// Whether any metric `name` carries the label `key`.
    fn has_label(&self, name: &str, key: &str) -> bool {
        self.0
            .iter()
            .any(|(n, labels, _)| n == name && labels.iter().any(|(k, _)| k == key))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_known_load_records_known_metrics() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    recorder
        .install()
        .expect("the only recorder of this test process");

    let db = test_db("metrics").await;
    let store = store(&db).await;
    let (done, mut finished) = mpsc::unbounded_channel::<&'static str>();
    let (projected, mailed, refused) = (done.clone(), done.clone(), done);
    let bus = RelayBus::builder(store)
        .without_registered_handlers()
        .poll_interval(Duration::from_millis(20))
        .retry(
            RetryPolicy::new(3)
                .initial_backoff(Duration::from_millis(1))
                .max_backoff(Duration::from_millis(1)),
        )
        .subscribe(Subscription::without_context(
            "projector",
            move |_: OrderPlaced| {
                let projected = projected.clone();
                async move {
                    projected.send("projector").unwrap();
                    Ok::<(), BoxError>(())
                }
            },
        ))
        .subscribe(Subscription::new(
            "mailer",
            move |_: OrderPlaced, ctx: relaybus::HandlerContext| {
                let mailed = mailed.clone();
                async move {
                    if ctx.attempt() == 1 {
                        return Err::<(), BoxError>("the mail server is away".into());
                    }
                    mailed.send("mailer").unwrap();
                    Ok(())
                }
            },
        ))
        .subscribe(Subscription::without_context(
            "biller",
            move |_: OrderPlaced| {
                let refused = refused.clone();
                async move {
                    refused.send("biller").unwrap();
                    Err::<(), BoxError>(relaybus::Permanent::new("no such account").into())
                }
            },
        ))
        .build()
        .unwrap();

    for n in 0..5 {
        bus.publish(&placed(&format!("o-{n}"))).await.unwrap();
    }
    bus.start().await.unwrap();
    // 5 projections, 5 mails (each on its second attempt), 5 refusals.
    for _ in 0..15 {
        next(&mut finished, "a handler run").await;
    }
    // The refusals are buried once their handler returned: wait until all five are dead.
    let dead = async {
        loop {
            let stats = relaybus::Store::statistics(bus.store()).await.unwrap();
            if stats.dead == 5 && stats.pending == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(30), dead)
        .await
        .expect("every delivery settles");
    bus.shutdown().await.unwrap();

    // A request that commits and one that rolls back.
    let (state, layer) = relaybus_axum::setup(bus.clone()).unwrap();
    let app: Router = Router::new()
        .route(
            "/orders/{id}",
            post(
                async |axum::extract::Path(id): axum::extract::Path<String>,
                       mut publisher: Publisher|
                       -> Result<StatusCode, PublishError> {
                    publisher.publish(&placed(&id)).await?;
                    Ok(if id == "refused" {
                        StatusCode::BAD_REQUEST
                    } else {
                        StatusCode::CREATED
                    })
                },
            ),
        )
        .layer(layer)
        .with_state(state);
    for (id, status) in [
        ("o-http", StatusCode::CREATED),
        ("refused", StatusCode::BAD_REQUEST),
    ] {
        let request = Request::post(format!("/orders/{id}"))
            .body(Body::empty())
            .unwrap();
        assert_eq!(app.clone().oneshot(request).await.unwrap().status(), status);
    }

    let recorded = Recorded::take(&snapshotter);
    let system = (telemetry::SYSTEM_ATTRIBUTE, telemetry::SYSTEM);
    let event = (telemetry::DESTINATION_ATTRIBUTE, "order.placed.v1");
    let handler = |id| (telemetry::CONSUMER_GROUP_ATTRIBUTE, id);

    // 5 publishes, then 2 in requests (the rolled-back one was appended before it aborted).
    assert_eq!(
        recorded.counter(telemetry::SENT_MESSAGES, &[system, event]),
        7
    );
    let publish = (telemetry::OPERATION_ATTRIBUTE, "publish");
    assert_eq!(
        recorded.samples(telemetry::OPERATION_DURATION, &[publish]),
        7
    );
    let receive = (telemetry::OPERATION_ATTRIBUTE, "receive");
    assert!(recorded.samples(telemetry::OPERATION_DURATION, &[receive]) >= 1);
    let settle = (telemetry::OPERATION_ATTRIBUTE, "settle");
    assert!(recorded.samples(telemetry::OPERATION_DURATION, &[settle]) >= 1);

    for (id, runs) in [("projector", 5), ("mailer", 10), ("biller", 5)] {
        let labels = [system, event, handler(id)];
        assert_eq!(
            recorded.counter(telemetry::CONSUMED_MESSAGES, &labels),
            runs,
            "{id}"
        );
        assert_eq!(recorded.counter(telemetry::ATTEMPTS, &labels), runs, "{id}");
        assert_eq!(
            recorded.samples(telemetry::PROCESS_DURATION, &labels),
            runs as usize
        );
        // First runs only.
        assert_eq!(recorded.samples(telemetry::LATENCY, &labels), 5, "{id}");
    }
    let mailer = [handler("mailer")];
    assert_eq!(recorded.counter(telemetry::RETRIES, &mailer), 5);
    assert_eq!(recorded.counter(telemetry::DEAD_LETTERS, &mailer), 0);
    let failed = (telemetry::ERROR_TYPE_ATTRIBUTE, "error");
    assert_eq!(
        recorded.samples(telemetry::PROCESS_DURATION, &[handler("mailer"), failed]),
        5
    );
    let biller = [handler("biller")];
    assert_eq!(recorded.counter(telemetry::DEAD_LETTERS, &biller), 5);
    assert_eq!(recorded.counter(telemetry::RETRIES, &biller), 0);
    let permanent = (telemetry::ERROR_TYPE_ATTRIBUTE, "permanent");
    assert_eq!(
        recorded.samples(telemetry::PROCESS_DURATION, &[handler("biller"), permanent]),
        5
    );
    assert_eq!(
        recorded.counter(telemetry::RETRIES, &[handler("projector")]),
        0
    );

    let outcome = |o| (telemetry::OUTCOME_ATTRIBUTE, o);
    assert_eq!(
        recorded.counter(telemetry::REQUEST_TRANSACTIONS, &[outcome("committed")]),
        1
    );
    assert_eq!(
        recorded.counter(telemetry::REQUEST_TRANSACTIONS, &[outcome("aborted")]),
        1
    );

    // No metric names an event or a key.
    for name in [
        telemetry::SENT_MESSAGES,
        telemetry::CONSUMED_MESSAGES,
        telemetry::PROCESS_DURATION,
        telemetry::LATENCY,
    ] {
        for forbidden in ["event_id", "messaging.message.id", "key"] {
            assert!(
                !recorded.has_label(name, forbidden),
                "{name} has {forbidden}"
            );
        }
    }
    db.drop_database().await.unwrap();
}
