//! `setup()` upgrades a database a 0.1.0 version left: documents of 0.1.0's shape, written
//! through the raw driver, are claimable, listable and purgeable afterwards; the upgrade works
//! in batches, resumes after stopping part-way, and runs once.

use futures::TryStreamExt;
use mongodb::{
    Client, IndexModel,
    bson::{DateTime, Document, doc},
    options::ClientOptions,
};
use relaybus::store::prelude::*;
use relaybus::{
    AppendRequest, DeliveryQuery, DeliveryStatus, EventEnvelope, MongoEventStore, PurgeOptions,
    Timestamp,
    event::lane_of,
    store::{ClaimRequest, transaction},
};
use relaybus_harness::{FailPoint, TestDb, test_db};
use relaybus_tests::support::{bare_store, count};
use serde_json::json;

const PLACED: &str = "order.placed.v1";

fn millis_ago(millis: i64) -> DateTime {
    DateTime::from_millis(DateTime::now().timestamp_millis() - millis)
}

/// A 0.1.0 event: no `handlers`, no `createdAt`.
fn event_0_1(id: &str, key: Option<(&str, i64)>) -> Document {
    let mut event = doc! {
        "_id": id,
        "type": PLACED,
        "payload": { "order_id": id, "total_cents": 1250 },
    };
    if let Some((key, sequence)) = key {
        event.insert("key", key);
        event.insert("sequence", sequence);
    }
    event
}

/// A 0.1.0 delivery: no `laneId`, no `lane`.
fn delivery_0_1(event_id: &str, handler: &str, status: &str, key: Option<(&str, i64)>) -> Document {
    let mut delivery = doc! {
        "eventId": event_id,
        "handler": handler,
        "eventType": PLACED,
        "status": status,
        "attempts": 0,
        "dueAt": millis_ago(60_000),
        "createdAt": millis_ago(120_000),
        "updatedAt": millis_ago(60_000),
    };
    if let Some((key, sequence)) = key {
        delivery.insert("key", key);
        delivery.insert("sequence", sequence);
    }
    delivery
}

/// Writes a small 0.1.0 database: a claimed (`processing`) and a pending delivery of one key,
/// a dead letter, a `completed` delivery, `bulk` unkeyed pending deliveries of handler `bulk`,
/// and the 0.1.0 `running` and `claim` indexes.
async fn write_0_1(db: &TestDb, bulk: usize) {
    let events = db.db().collection::<Document>("relaybus_events");
    let deliveries = db.db().collection::<Document>("relaybus_deliveries");
    let mut all_events = vec![
        event_0_1("e-claimed", Some(("cart-1", 1))),
        event_0_1("e-waiting", Some(("cart-1", 2))),
        event_0_1("e-dead", None),
        event_0_1("e-done", None),
    ];
    let mut claimed = delivery_0_1("e-claimed", "projector", "processing", Some(("cart-1", 1)));
    claimed.insert("attempts", 1);
    // Due in an hour: only the upgrade can make it due at once.
    claimed.insert("dueAt", millis_ago(-3_600_000));
    claimed.insert("leaseOwner", "worker-of-0.1.0");
    claimed.insert(
        "leaseExpiresAt",
        DateTime::from_millis(DateTime::now().timestamp_millis() + 600_000),
    );
    let mut dead = delivery_0_1("e-dead", "projector", "dead", None);
    dead.insert("attempts", 3);
    dead.insert("lastError", "the mail server said no");
    let mut done = delivery_0_1("e-done", "projector", "completed", None);
    done.insert("attempts", 1);
    done.insert("completedAt", millis_ago(30_000));
    let mut all_deliveries = vec![
        claimed,
        delivery_0_1("e-waiting", "projector", "pending", Some(("cart-1", 2))),
        dead,
        done,
    ];
    for i in 0..bulk {
        let id = format!("bulk-{i}");
        all_events.push(event_0_1(&id, None));
        all_deliveries.push(delivery_0_1(&id, "bulk", "pending", None));
    }
    events.insert_many(all_events).await.unwrap();
    deliveries.insert_many(all_deliveries).await.unwrap();
    db.db()
        .collection::<Document>("relaybus_key_sequences")
        .insert_one(doc! { "_id": "cart-1", "value": 2_i64 })
        .await
        .unwrap();
    deliveries
        .create_indexes([
            IndexModel::builder()
                .keys(doc! { "status": 1, "leaseExpiresAt": 1 })
                .options(
                    mongodb::options::IndexOptions::builder()
                        .name("running".to_owned())
                        .build(),
                )
                .build(),
            IndexModel::builder()
                .keys(doc! { "status": 1, "dueAt": 1 })
                .options(
                    mongodb::options::IndexOptions::builder()
                        .name("claim".to_owned())
                        .build(),
                )
                .build(),
        ])
        .await
        .unwrap();
}

async fn index_keys(db: &TestDb) -> Vec<(String, Document)> {
    let models: Vec<IndexModel> = db
        .db()
        .collection::<Document>("relaybus_deliveries")
        .list_indexes()
        .await
        .unwrap()
        .try_collect()
        .await
        .unwrap();
    models
        .into_iter()
        .map(|m| (m.options.and_then(|o| o.name).unwrap_or_default(), m.keys))
        .collect()
}

async fn matching(db: &TestDb, filter: Document) -> u64 {
    db.db()
        .collection::<Document>("relaybus_deliveries")
        .count_documents(filter)
        .await
        .unwrap()
}

async fn claim(
    store: &MongoEventStore,
    handler: &str,
    limit: u32,
) -> Vec<relaybus::store::Claimed<relaybus::Lease>> {
    let handlers = [handler.to_owned()];
    Queue::claim(
        store,
        ClaimRequest {
            owner: "w",
            handlers: &handlers,
            limit,
            lease_duration: std::time::Duration::from_secs(30),
            now: Timestamp::now(),
        },
    )
    .await
    .unwrap()
}

#[tokio::test]
async fn setup_makes_a_0_1_database_claimable_listable_and_purgeable() {
    let db = test_db("upgrade_0_1").await;
    write_0_1(&db, 2_500).await;
    let store = bare_store(&db);
    let before = DateTime::now();
    store.setup().await.unwrap();
    let after = DateTime::now();

    // The lanes mark the upgrade as done; the 0.1.0 indexes are gone or replaced.
    assert_eq!(count(&db, "relaybus_lanes").await, 256);
    let indexes = index_keys(&db).await;
    assert!(
        indexes.iter().all(|(name, _)| name != "running"),
        "{indexes:?}"
    );
    let claim_keys = indexes
        .iter()
        .find(|(name, _)| name == "claim")
        .map(|(_, k)| k.clone());
    assert_eq!(
        claim_keys,
        Some(doc! { "laneId": 1, "dueAt": 1, "_id": 1, "handler": 1 })
    );

    // No 0.1.0 field or state is left, and every delivery has the lane of its key or event.
    assert_eq!(matching(&db, doc! { "status": "processing" }).await, 0);
    assert_eq!(
        matching(&db, doc! { "leaseOwner": { "$exists": true } }).await,
        0
    );
    assert_eq!(
        matching(&db, doc! { "leaseExpiresAt": { "$exists": true } }).await,
        0
    );
    assert_eq!(
        matching(&db, doc! { "laneId": { "$exists": false } }).await,
        0
    );
    assert_eq!(
        matching(&db, doc! { "status": "pending", "lane": "ready" }).await,
        2_502,
        "every pending delivery is in the claim index"
    );
    let waiting = db
        .db()
        .collection::<Document>("relaybus_deliveries")
        .find_one(doc! { "eventId": "e-waiting" })
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        waiting.get_i32("laneId").unwrap() as u32,
        lane_of(Some("cart-1"), "e-waiting")
    );
    // The claimed delivery, due in an hour before, is due at once: at the upgrade's time.
    let claimed = db
        .db()
        .collection::<Document>("relaybus_deliveries")
        .find_one(doc! { "eventId": "e-claimed" })
        .await
        .unwrap()
        .unwrap();
    let due = *claimed.get_datetime("dueAt").unwrap();
    assert!(
        before <= due && due <= after,
        "due at {due}, the upgrade ran from {before} to {after}"
    );
    let events = db.db().collection::<Document>("relaybus_events");
    assert_eq!(
        events
            .count_documents(doc! { "$or": [{ "handlers": { "$exists": false } }, { "createdAt": { "$exists": false } }] })
            .await
            .unwrap(),
        0
    );

    // Claimable: the key's head first (its attempt still counted), then its follower.
    let head = claim(&store, "projector", 10).await;
    let ids: Vec<&str> = head.iter().map(|c| c.event.id()).collect();
    assert_eq!(ids, ["e-claimed"], "the key's head alone");
    assert_eq!(
        head[0].attempt, 2,
        "the 0.1.0 claim's attempt stays counted"
    );
    assert_eq!(head[0].event.payload()["order_id"], json!("e-claimed"));
    let leases: Vec<_> = head.iter().map(|c| c.lease).collect();
    assert_eq!(
        Queue::complete(&store, &leases, Timestamp::now())
            .await
            .unwrap(),
        [true]
    );
    let next = claim(&store, "projector", 10).await;
    assert_eq!(
        next.iter().map(|c| c.event.id()).collect::<Vec<_>>(),
        ["e-waiting"]
    );
    let mut bulk = 0;
    loop {
        let batch = claim(&store, "bulk", 1_000).await;
        if batch.is_empty() {
            break;
        }
        bulk += batch.len();
        let leases: Vec<_> = batch.iter().map(|c| c.lease).collect();
        Queue::complete(&store, &leases, Timestamp::now())
            .await
            .unwrap();
    }
    assert_eq!(bulk, 2_500, "every bulk delivery was claimable");

    // Listable: the dead letter, with its error.
    let dead = Inspect::list_deliveries(&store, &DeliveryQuery::new().status(DeliveryStatus::Dead))
        .await
        .unwrap();
    assert_eq!(dead.len(), 1);
    assert_eq!(
        dead[0].last_error.as_deref(),
        Some("the mail server said no")
    );
    assert_eq!(
        Inspect::statistics(&store).await.unwrap().completed,
        1,
        "the 0.1.0 completed document"
    );

    // A republished event gets no handler twice.
    let again =
        EventEnvelope::from_json(PLACED, json!({ "order_id": "e-dead", "total_cents": 1250 }))
            .unwrap()
            .with_id("e-dead")
            .unwrap();
    let handlers = ["projector".to_owned()];
    let appended = transaction::run(&store, None, async |session| {
        Append::append(
            &store,
            session,
            &[AppendRequest::new(&again, &handlers)],
            Timestamp::now(),
        )
        .await
    })
    .await
    .unwrap();
    assert!(appended[0].new_deliveries.is_empty(), "{appended:?}");

    // Purgeable: the completed document and the events nothing references any more.
    let later = Timestamp::now().saturating_add(std::time::Duration::from_secs(60));
    let purged = Operate::purge(&store, &PurgeOptions::new().completed_before(later))
        .await
        .unwrap();
    assert_eq!(purged.completion_records, 1, "{purged:?}");
    assert!(
        purged.events >= 2_501,
        "e-done, e-claimed and the bulk events: {purged:?}"
    );
    assert!(
        events
            .find_one(doc! { "_id": "e-done" })
            .await
            .unwrap()
            .is_none()
    );
}

#[tokio::test]
async fn an_upgrade_stopped_part_way_resumes_and_then_runs_no_more() {
    let db = test_db("upgrade_resume").await;
    write_0_1(&db, 2_500).await;
    let app = "relaybus-upgrade-crash";
    let mut options = ClientOptions::parse(&db.uri).await.unwrap();
    options.app_name = Some(app.to_owned());
    let client = Client::with_options(options).unwrap();
    let store = MongoEventStore::builder(client.clone())
        .database(&db.name)
        .build()
        .unwrap();

    // The third `update` of the upgrade fails, as if the process died there: the claimed
    // delivery and the first batch of 1,000 unlaned ones are done, the rest is not, and no lane
    // document marks the upgrade as done.
    let failing = FailPoint::enable(
        &db.client,
        doc! {
            "configureFailPoint": "failCommand",
            "mode": { "skip": 2 },
            "data": { "failCommands": ["update"], "appName": app, "errorCode": 8 },
        },
    )
    .await
    .unwrap();
    let stopped = store.setup().await;
    assert!(stopped.is_err(), "the fail point stops the upgrade");
    failing.disable().await.unwrap();
    let ready = matching(&db, doc! { "status": "pending", "lane": "ready" }).await;
    assert_eq!(ready, 1_001, "one batch done, not all");
    assert_eq!(count(&db, "relaybus_lanes").await, 0, "not marked as done");

    // The next setup finishes it.
    store.setup().await.unwrap();
    assert_eq!(
        matching(&db, doc! { "status": "pending", "lane": "ready" }).await,
        2_502
    );
    assert_eq!(matching(&db, doc! { "status": "processing" }).await, 0);
    assert_eq!(
        matching(&db, doc! { "laneId": { "$exists": false } }).await,
        0
    );
    assert_eq!(count(&db, "relaybus_lanes").await, 256);

    // Once marked, setup leaves the documents alone: a 0.1.0-shaped document written now
    // stays as it is.
    db.db()
        .collection::<Document>("relaybus_deliveries")
        .insert_one(delivery_0_1("late", "bulk", "processing", None))
        .await
        .unwrap();
    // The next start's setup (a store runs its own once).
    MongoEventStore::builder(client.clone())
        .database(&db.name)
        .build()
        .unwrap()
        .setup()
        .await
        .unwrap();
    assert_eq!(matching(&db, doc! { "status": "processing" }).await, 1);
}
