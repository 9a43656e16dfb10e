//! What the end-to-end tests share: an order event, stores on the test's database, buses that
//! only publish, handlers that report to the test, and readers of the collections.

use std::time::Duration;

use futures::TryStreamExt;
use mongodb::{
    Client,
    bson::{DateTime, Document, doc},
};
use relaybus::{
    AppendRequest, BoxError, Event, EventEnvelope, HandlerContext, MongoEventStore, RelayBus,
    Subscription,
};
use relaybus_harness::{FailPoint, TestDb};
use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;

/// The order event of the tests, of type `order.placed.v1`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct OrderPlaced {
    /// The order's id.
    pub order_id: String,
    /// The order's total.
    pub total_cents: u64,
}

impl Event for OrderPlaced {
    const TYPE: &'static str = "order.placed.v1";
}

/// An order of 12.50 with this id.
pub fn placed(id: &str) -> OrderPlaced {
    OrderPlaced {
        order_id: id.to_owned(),
        total_cents: 1250,
    }
}

/// A handler of `E` that does nothing and succeeds.
pub fn noop<E: Event>(id: &str) -> Subscription {
    Subscription::new(id, |_: E, _: HandlerContext| async {
        Ok::<(), BoxError>(())
    })
}

/// A handler of `E` that sends its attempt number to the test and succeeds.
pub fn reports_attempt<E: Event>(id: &str, tx: mpsc::UnboundedSender<u32>) -> Subscription {
    Subscription::new(id, move |_: E, ctx: HandlerContext| {
        let tx = tx.clone();
        async move {
            tx.send(ctx.attempt()).unwrap();
            Ok::<(), BoxError>(())
        }
    })
}

/// A handler of `E` that tells the test it started and then never ends, so that its delivery
/// is still running when the test shuts the bus down.
pub fn starts_and_hangs<E: Event>(id: &str, started: mpsc::UnboundedSender<()>) -> Subscription {
    Subscription::new(id, move |_: E, _: HandlerContext| {
        let started = started.clone();
        async move {
            started.send(()).unwrap();
            std::future::pending::<()>().await;
            Ok::<(), BoxError>(())
        }
    })
}

/// A store on the test's database, not set up.
pub fn bare_store(db: &TestDb) -> MongoEventStore {
    MongoEventStore::builder(db.client.clone())
        .database(&db.name)
        .build()
        .expect("valid options")
}

/// A store on the test's database, set up.
pub async fn store(db: &TestDb) -> MongoEventStore {
    store_on(&db.client, db).await
}

/// A store on the test's database through a client of the test's own, set up.
pub async fn store_on(client: &Client, db: &TestDb) -> MongoEventStore {
    let store = MongoEventStore::builder(client.clone())
        .database(&db.name)
        .build()
        .expect("valid options");
    store.setup().await.expect("setup");
    store
}

/// A bus subscribing no-op handlers of [`OrderPlaced`] with these ids: publishing through it
/// writes one delivery per id, and it never runs them.
pub fn publisher(store: &MongoEventStore, handlers: &[&str]) -> RelayBus {
    let mut builder = RelayBus::builder(store.clone());
    for id in handlers {
        builder = builder.subscribe(noop::<OrderPlaced>(id));
    }
    builder.build().expect("valid bus")
}

/// Waits for a message, failing the test after a generous deadline.
pub async fn next<T>(rx: &mut mpsc::UnboundedReceiver<T>, what: &str) -> T {
    tokio::time::timeout(Duration::from_secs(30), rx.recv())
        .await
        .unwrap_or_else(|_| panic!("timed out waiting for {what}"))
        .unwrap_or_else(|| panic!("channel closed waiting for {what}"))
}

/// Every document of a collection of the test database, in `_id` order.
pub async fn all(db: &TestDb, collection: &str) -> Vec<Document> {
    db.db()
        .collection::<Document>(collection)
        .find(doc! {})
        .sort(doc! { "_id": 1 })
        .await
        .unwrap()
        .try_collect()
        .await
        .unwrap()
}

/// Appends `events` for `handlers` with the store's own `append`, due at `now`, in
/// transactions of at most 500 events.
pub async fn append_events(
    store: &MongoEventStore,
    events: &[EventEnvelope],
    handlers: &[&str],
    now: DateTime,
) {
    let handlers: Vec<String> = handlers.iter().map(|h| (*h).to_owned()).collect();
    for chunk in events.chunks(500) {
        let requests: Vec<AppendRequest<'_>> = chunk
            .iter()
            .map(|e| AppendRequest::new(e, &handlers))
            .collect();
        store
            .transaction(async |session| store.append(session, &requests, now).await)
            .await
            .expect("append");
    }
}

/// The ids of every event document, in `_id` order.
pub async fn event_ids(db: &TestDb) -> Vec<String> {
    all(db, "relaybus_events")
        .await
        .iter()
        .map(|e| e.get_str("_id").unwrap().to_owned())
        .collect()
}

/// Every delivery document, in `_id` order.
pub async fn deliveries(db: &TestDb) -> Vec<Document> {
    all(db, "relaybus_deliveries").await
}

/// How many documents a collection of the test database holds.
pub async fn count(db: &TestDb, collection: &str) -> u64 {
    db.db()
        .collection::<Document>(collection)
        .count_documents(doc! {})
        .await
        .unwrap()
}

/// Makes the server answer the next `times` `command`s of the client named `app` with the error
/// `code` labelled `label`, until the returned fail point is disabled or dropped. The client's
/// name keeps the failures away from the other tests on the server.
pub async fn fail_command(
    client: &Client,
    app: &str,
    command: &str,
    times: i32,
    code: i32,
    label: &str,
) -> FailPoint {
    FailPoint::enable(
        client,
        doc! {
            "configureFailPoint": "failCommand",
            "mode": { "times": times },
            "data": {
                "failCommands": [command],
                "appName": app,
                "errorCode": code,
                "errorLabels": [label],
            },
        },
    )
    .await
    .unwrap()
}

/// The errors of [`operated_bus`]'s mailer: orders 0 to 3 get the first, 4 and 5 the second.
pub const MAILER_ERRORS: [&str; 2] = ["SMTP 554: mailbox unavailable", "connection reset by peer"];

/// A bus that has run a known load, for the operator routes and page: six orders, each
/// projected by `projector` (which succeeds) and mailed by `mailer` (which fails for good on
/// its first attempt, with one of [`MAILER_ERRORS`]), so that `mailer` holds six dead letters
/// in two groups, and this process's activity shows six successes and six dead letters.
pub async fn operated_bus(db: &TestDb) -> RelayBus {
    let mailer = Subscription::new(
        "mailer",
        |order: OrderPlaced, _: HandlerContext| async move {
            let n: usize = order
                .order_id
                .trim_start_matches("order-")
                .parse()
                .unwrap_or(0);
            Err::<(), BoxError>(MAILER_ERRORS[usize::from(n >= 4)].into())
        },
    )
    .retry(relaybus::RetryPolicy::new(1));
    let bus = RelayBus::builder(store(db).await)
        .without_registered_handlers()
        .subscribe(noop::<OrderPlaced>("projector"))
        .subscribe(mailer)
        .build()
        .expect("valid bus");
    for n in 0..6 {
        bus.publish(&placed(&format!("order-{n}")))
            .await
            .expect("publish");
    }
    while bus.run_once().await.expect("a run").claimed > 0 {}
    bus
}
