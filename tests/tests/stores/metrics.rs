//! Metrics: after a known load, the recorded values are read back through a test recorder.
//!
//! The recorder is the test's own: set for its thread, on a runtime that runs every task of the
//! test there, so that the other tests of the binary, on other threads, record nothing into it.

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

#[tokio::test(flavor = "current_thread")]
async fn a_known_load_records_known_metrics() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let _recorder = metrics::set_default_local_recorder(&recorder);

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
            let stats = relaybus::store::Inspect::statistics(bus.store())
                .await
                .unwrap();
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

    // The gauges: this bus took the lead when it started, and keeps it; another does not.
    assert!(bus.sample_gauges().await.unwrap(), "the started bus leads");
    let other = RelayBus::builder(relaybus_tests::support::bare_store(&db))
        .without_registered_handlers()
        .build()
        .unwrap();
    assert!(
        !other.sample_gauges().await.unwrap(),
        "one bus samples at a time"
    );

    // A worker that lost its lane: another claims it after the lease and charges an attempt.
    let lost = relaybus_tests::support::publisher(bus.store(), &["lost-worker"]);
    lost.publish(&placed("o-lost")).await.unwrap();
    let now = mongodb::bson::DateTime::now();
    let lease = Duration::from_secs(1);
    let first = bus.store().claim("gone", &["lost-worker"], 10, lease, now);
    assert_eq!(first.await.unwrap().len(), 1);
    let later = mongodb::bson::DateTime::from_millis(now.timestamp_millis() + 5_000);
    let second = bus
        .store()
        .claim("heir", &["lost-worker"], 10, lease, later);
    assert_eq!(second.await.unwrap().len(), 1);

    let recorded = Recorded::take(&snapshotter);
    let system = (telemetry::SYSTEM_ATTRIBUTE, telemetry::SYSTEM);
    let handler = |id| (telemetry::CONSUMER_GROUP_ATTRIBUTE, id);
    let gauge = |handler: &str, state: &str| -> f64 {
        let values = recorded.matching(
            telemetry::DELIVERIES,
            &[
                (telemetry::CONSUMER_GROUP_ATTRIBUTE, handler),
                (telemetry::STATE_ATTRIBUTE, state),
            ],
        );
        match values.as_slice() {
            [DebugValue::Gauge(value)] => value.into_inner(),
            other => panic!("{handler} {state}: {other:?}"),
        }
    };
    assert_eq!(gauge("biller", "dead"), 5.0);
    // The committed request's event waits for every handler; the rolled-back one left none.
    assert_eq!(gauge("biller", "waiting"), 1.0);
    assert_eq!(gauge("mailer", "waiting"), 1.0);
    assert_eq!(gauge("mailer", "dead"), 0.0);
    assert_eq!(gauge("projector", "running"), 0.0);
    assert_eq!(
        recorded
            .matching(telemetry::OLDEST_DUE_AGE, &[handler("biller")])
            .len(),
        1
    );
    assert_eq!(recorded.counter(telemetry::TAKEOVERS, &[system]), 1);
    assert_eq!(recorded.counter(telemetry::LOST_ATTEMPTS, &[system]), 1);
    let event = (telemetry::DESTINATION_ATTRIBUTE, "order.placed.v1");

    // 5 publishes, 2 in requests (the rolled-back one was appended before it aborted), and
    // the lost worker's.
    assert_eq!(
        recorded.counter(telemetry::SENT_MESSAGES, &[system, event]),
        8
    );
    let publish = (telemetry::OPERATION_ATTRIBUTE, "publish");
    assert_eq!(
        recorded.samples(telemetry::OPERATION_DURATION, &[publish]),
        8
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
