//! The delivery lifecycle on a real replica set: lane-leased claims, per-key order, parking,
//! fencing, completion, retries, dead letters and retention. Every call takes an explicit clock.

use std::{
    collections::{HashMap, HashSet},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use futures::{TryStreamExt, future::join_all};
use mongodb::{
    Client,
    bson::{Bson, DateTime, Document, doc, oid::ObjectId},
    event::{EventHandler, command::CommandEvent},
    options::ClientOptions,
};
use relaybus::store::prelude::*;
use relaybus::{
    AppendRequest, ClaimedDelivery, ConfigurationError, DeliveryQuery, DeliveryStatus, Error,
    EventEnvelope, Lease, LeaseError, MongoEventStore, MongoEventStoreBuilder, PurgeOptions,
    event::lane_of,
};
use relaybus_harness::{FailPoint, TestDb, test_db};
use relaybus_tests::support::{bare_store, deliveries};
use serde_json::json;
use tokio::sync::Notify;

const LEASE: Duration = Duration::from_secs(30);
const HANDLER: &str = "projector";
/// In 2030: later than the wall-clock creation time of every event the tests publish, so
/// retention cutoffs on this clock apply to them.
const T0: i64 = 1_900_000_000_000;

/// `T0 + seconds`: the explicit clock of every test.
fn at(seconds: i64) -> DateTime {
    DateTime::from_millis(T0 + seconds * 1000)
}

/// A store over `db` on `client`, built with `options` and set up.
async fn store_built(
    client: &Client,
    db: &TestDb,
    options: impl FnOnce(MongoEventStoreBuilder) -> MongoEventStoreBuilder,
) -> MongoEventStore {
    let store = options(MongoEventStore::builder(client.clone()).database(&db.name))
        .build()
        .expect("valid options");
    store.setup().await.expect("setup");
    store
}

async fn store_with(client: &Client, db: &TestDb, history: bool) -> MongoEventStore {
    store_built(client, db, |builder| builder.completion_history(history)).await
}

/// A store without the crash-recovery heartbeat, for tests whose fail point takes the next
/// `update` of their client: the heartbeat's could take it first.
async fn store_without_heartbeat(client: &Client, db: &TestDb) -> MongoEventStore {
    store_built(client, db, |builder| builder.crash_recovery(false)).await
}

async fn store(db: &TestDb) -> MongoEventStore {
    store_with(&db.client, db, false).await
}

/// Another store instance on the same database, as a second process would have.
async fn another_instance(db: &TestDb) -> MongoEventStore {
    bare_store(db)
}

/// A client that counts the commands it starts, except the crash-recovery heartbeat's, which
/// runs on its own clock (its writes and reads of `relaybus_processes`).
async fn counting_client(db: &TestDb) -> (Client, Arc<AtomicUsize>, Arc<Mutex<Vec<String>>>) {
    let mut options = ClientOptions::parse(&db.uri).await.unwrap();
    options.app_name = Some(format!("{}-counted", db.name));
    let count = Arc::new(AtomicUsize::new(0));
    let names = Arc::new(Mutex::new(Vec::new()));
    let (c, n) = (Arc::clone(&count), Arc::clone(&names));
    options.command_event_handler = Some(EventHandler::callback(move |event| {
        if let CommandEvent::Started(started) = event {
            let target = started.command.get_str(&started.command_name);
            if target == Ok("relaybus_processes") {
                return;
            }
            c.fetch_add(1, Ordering::SeqCst);
            n.lock().unwrap().push(started.command_name);
        }
    }));
    (Client::with_options(options).unwrap(), count, names)
}

/// Has the server hold back, once, the next `command` of the client named `app` for `ms`
/// milliseconds, until the returned fail point is dropped.
async fn hold_back_once(db: &TestDb, app: &str, command: &str, ms: i64) -> FailPoint {
    FailPoint::enable(
        &db.client,
        doc! {
            "configureFailPoint": "failCommand",
            "mode": { "times": 1 },
            "data": {
                "failCommands": [command],
                "blockConnection": true,
                "blockTimeMS": ms,
                "appName": app,
            },
        },
    )
    .await
    .unwrap()
}

fn event(id: &str, key: Option<&str>) -> EventEnvelope {
    let event = EventEnvelope::from_json("order.placed.v1", json!({ "order": id }))
        .unwrap()
        .with_id(id)
        .unwrap();
    match key {
        Some(key) => event.with_key(key).unwrap(),
        None => event,
    }
}

/// Appends events for `handlers`, due at `now`, in transactions of at most 500 events.
async fn publish(
    store: &MongoEventStore,
    events: &[EventEnvelope],
    handlers: &[&str],
    now: DateTime,
) {
    relaybus_tests::support::append_events(store, events, handlers, now).await;
}

async fn publish_unkeyed(store: &MongoEventStore, prefix: &str, n: usize, now: DateTime) {
    let events: Vec<EventEnvelope> = (0..n)
        .map(|i| event(&format!("{prefix}-{i}"), None))
        .collect();
    publish(store, &events, &[HANDLER], now).await;
}

async fn claim(
    store: &MongoEventStore,
    owner: &str,
    limit: u32,
    now: DateTime,
) -> Vec<ClaimedDelivery> {
    store
        .claim(owner, &[HANDLER], limit, LEASE, now)
        .await
        .expect("claim")
}

async fn delivery(db: &TestDb, id: ObjectId) -> Option<Document> {
    db.db()
        .collection::<Document>("relaybus_deliveries")
        .find_one(doc! { "_id": id })
        .await
        .unwrap()
}

async fn lane(db: &TestDb, lane: u32) -> Document {
    db.db()
        .collection::<Document>("relaybus_lanes")
        .find_one(doc! { "_id": lane as i32 })
        .await
        .unwrap()
        .expect("lane document")
}

async fn lanes_of(db: &TestDb, owner: &str) -> Vec<Document> {
    db.db()
        .collection::<Document>("relaybus_lanes")
        .find(doc! { "owner": owner })
        .await
        .unwrap()
        .try_collect()
        .await
        .unwrap()
}

fn in_flight(lane: &Document) -> Vec<ObjectId> {
    lane.get_array("inFlight")
        .unwrap()
        .iter()
        .filter_map(Bson::as_object_id)
        .collect()
}

fn attempts(doc: &Document) -> i64 {
    match doc.get("attempts") {
        Some(Bson::Int32(n)) => i64::from(*n),
        Some(Bson::Int64(n)) => *n,
        other => panic!("attempts is {other:?}"),
    }
}

fn ids(batch: &[ClaimedDelivery]) -> Vec<ObjectId> {
    batch.iter().map(ClaimedDelivery::delivery_id).collect()
}

fn leases(batch: &[ClaimedDelivery]) -> Vec<Lease> {
    batch.iter().map(|d| *d.lease()).collect()
}

fn assert_send<T: Send>(value: T) -> T {
    value
}

// ---------------------------------------------------------------------------------------------
// Claims

#[tokio::test]
async fn a_claim_hands_out_due_deliveries_with_event_and_lease_and_writes_no_delivery_document() {
    let db = test_db("claim_basics").await;
    let store = store(&db).await;
    let payload_event = EventEnvelope::from_json(
        "order.placed.v1",
        json!({ "id": { "$oid": "not an object id" }, "a.b": 1, "$x": [true] }),
    )
    .unwrap()
    .with_id("e-payload")
    .unwrap()
    .with_correlation_id("req-1")
    .unwrap()
    .with_causation_id("cause-1")
    .unwrap()
    .with_header("tenant", "acme")
    .unwrap();
    publish(
        &store,
        std::slice::from_ref(&payload_event),
        &[HANDLER, "mailer"],
        at(0),
    )
    .await;
    publish_unkeyed(&store, "later", 3, at(10)).await;
    let before = deliveries(&db).await;

    // Not due yet: nothing.
    assert!(claim(&store, "w1", 10, at(-1)).await.is_empty());

    let batch = assert_send(store.claim("w1", &[HANDLER], 10, LEASE, at(5)))
        .await
        .unwrap();
    assert_eq!(
        batch.len(),
        1,
        "only the delivery due at 5 s of this handler"
    );
    let claimed = &batch[0];
    assert_eq!(claimed.handler(), HANDLER);
    assert_eq!(claimed.attempt(), 1);
    assert_eq!(claimed.event_id(), "e-payload");
    assert_eq!(claimed.event_type(), "order.placed.v1");
    assert_eq!(claimed.key(), None);
    assert_eq!(claimed.sequence(), None);
    assert_eq!(
        serde_json::Value::Object(claimed.event().payload().clone()),
        json!({ "id": { "$oid": "not an object id" }, "a.b": 1, "$x": [true] })
    );
    assert_eq!(claimed.event().correlation_id(), Some("req-1"));
    assert_eq!(claimed.event().causation_id(), Some("cause-1"));
    assert_eq!(
        claimed.event().headers().get("tenant").map(String::as_str),
        Some("acme")
    );
    assert_eq!(claimed.event().created_at(), payload_event.created_at());
    assert_eq!(claimed.lease_expires_at(), at(35));
    let lease = claimed.lease();
    assert_eq!(lease.lane(), lane_of(None, "e-payload"));
    assert_eq!(lease.epoch(), 1);
    assert_eq!(lease.claims(), 0);
    assert_eq!(lease.token(), format!("{}:1:0", lease.lane()));

    // The lane lists the delivery; no delivery document changed.
    let held = lane(&db, lease.lane()).await;
    assert_eq!(held.get_str("owner").unwrap(), "w1");
    assert_eq!(in_flight(&held), vec![claimed.delivery_id()]);
    assert_eq!(*held.get_datetime("leaseExpiresAt").unwrap(), at(35));
    assert_eq!(deliveries(&db).await, before);

    // Running deliveries are not handed out again, to the same owner or anyone else.
    assert!(claim(&store, "w1", 10, at(6)).await.is_empty());
    assert!(claim(&store, "w2", 10, at(6)).await.is_empty());
}

#[tokio::test]
async fn a_delivery_whose_event_is_missing_is_given_back_uncharged_and_the_rest_handed_out() {
    let db = test_db("orphan_delivery").await;
    let store = store(&db).await;
    publish_unkeyed(&store, "u", 3, at(0)).await;
    db.db()
        .collection::<Document>("relaybus_events")
        .delete_one(doc! { "_id": "u-1" })
        .await
        .unwrap();
    let orphan = db
        .db()
        .collection::<Document>("relaybus_deliveries")
        .find_one(doc! { "eventId": "u-1" })
        .await
        .unwrap()
        .expect("the delivery of u-1")
        .get_object_id("_id")
        .unwrap();

    for (owner, now) in [("w", at(1)), ("v", at(2))] {
        let claimed = claim(&store, owner, 10, now).await;
        let events: HashSet<String> = claimed.iter().map(|d| d.event_id().to_owned()).collect();
        let expected: HashSet<String> = if owner == "w" {
            ["u-0", "u-2"].map(String::from).into()
        } else {
            HashSet::new()
        };
        assert_eq!(
            events, expected,
            "{owner} gets the deliveries that have events"
        );
        let listing: Vec<Document> = db
            .db()
            .collection::<Document>("relaybus_lanes")
            .find(doc! { "inFlight": orphan })
            .await
            .unwrap()
            .try_collect()
            .await
            .unwrap();
        assert!(listing.is_empty(), "no lane lists the orphan: {listing:?}");
        let doc = delivery(&db, orphan).await.expect("still there");
        assert_eq!(doc.get_str("status"), Ok("pending"));
        assert_eq!(attempts(&doc), 0, "giving it back charged no attempt");
    }
}

#[tokio::test]
async fn bad_input_is_refused_with_a_typed_error_and_no_database_call() {
    let db = test_db("claim_input").await;
    let (client, count, _) = counting_client(&db).await;
    let store = store_with(&client, &db, false).await;
    let before = count.load(Ordering::SeqCst);
    let now = at(0);
    let refused = [
        store.claim("w", &[HANDLER], 0, LEASE, now).await,
        store.claim("w", &[HANDLER], 10_001, LEASE, now).await,
        store.claim("", &[HANDLER], 1, LEASE, now).await,
        store.claim("a\u{0}b", &[HANDLER], 1, LEASE, now).await,
        store.claim("w", &[] as &[&str], 1, LEASE, now).await,
        store.claim("w", &[HANDLER], 1, Duration::ZERO, now).await,
        store
            .claim("w", &[HANDLER], 1, Duration::from_secs(8 * 86_400), now)
            .await,
        store.claim("w", &[HANDLER], 1, LEASE, DateTime::MAX).await,
    ];
    for outcome in refused {
        assert!(
            matches!(outcome, Err(Error::InvalidArgument(_))),
            "{outcome:?}"
        );
    }
    assert!(matches!(
        store.claim("w", &["bad handler"], 1, LEASE, now).await,
        Err(Error::Configuration(
            ConfigurationError::InvalidHandlerId { .. }
        ))
    ));
    let lease = Lease::parse(&ObjectId::new().to_hex(), "1:1:0").unwrap();
    assert!(matches!(
        store.extend_lease(&lease, Duration::ZERO, now).await,
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        store.list_deliveries(&DeliveryQuery::new().limit(0)).await,
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        store.relinquish("").await,
        Err(Error::InvalidArgument(_))
    ));
    let too_many = vec![lease; 10_001];
    assert!(matches!(
        store.complete_many(&too_many, now).await,
        Err(Error::InvalidArgument(_))
    ));
    assert_eq!(
        store.complete_many(&[], now).await.unwrap(),
        Vec::<bool>::new()
    );
    assert_eq!(
        count.load(Ordering::SeqCst),
        before,
        "bad input reached the server"
    );
}

#[tokio::test]
async fn forged_and_stale_tokens_are_refused() {
    let db = test_db("tokens").await;
    let store = store(&db).await;
    publish_unkeyed(&store, "e", 1, at(0)).await;
    let first = claim(&store, "w", 1, at(1)).await.remove(0);
    let id = first.delivery_id().to_hex();

    // Tokens no claim can have produced never become leases.
    for (token, lane_error) in [
        ("", false),
        ("1:2", false),
        ("x:1:0", false),
        ("1:0:0", false),
        ("-1:1:0", false),
        ("256:1:0", true),
        ("99999:1:0", true),
    ] {
        let refused = Lease::parse(&id, token).unwrap_err();
        assert_eq!(
            matches!(refused, LeaseError::LaneOutOfRange { .. }),
            lane_error,
            "{token:?}: {refused}"
        );
    }
    assert!(matches!(
        Lease::parse("{\"$ne\": null}", "1:1:0"),
        Err(LeaseError::InvalidDeliveryId { .. })
    ));

    // Well-formed tokens that do not match the claim change nothing.
    let lease = first.lease();
    let lane = lease.lane();
    let forged = [
        format!("{lane}:{}:{}", lease.epoch() + 1, lease.claims()),
        format!("{lane}:{}:{}", lease.epoch(), lease.claims() + 1),
        format!("{}:{}:{}", (lane + 1) % 256, lease.epoch(), lease.claims()),
    ];
    for token in &forged {
        let forged = Lease::parse(&id, token).unwrap();
        assert!(!store.complete(&forged, at(2)).await.unwrap(), "{token}");
        assert!(!store.release(&forged, at(2)).await.unwrap(), "{token}");
        assert!(!store.bury(&forged, "x", at(2)).await.unwrap(), "{token}");
        assert!(
            !store.reschedule(&forged, at(9), "x", at(2)).await.unwrap(),
            "{token}"
        );
        assert_eq!(
            store.extend_lease(&forged, LEASE, at(2)).await.unwrap(),
            None
        );
    }
    let doc = delivery(&db, first.delivery_id())
        .await
        .expect("still there");
    assert_eq!(attempts(&doc), 0);
    assert_eq!(doc.get_str("status").unwrap(), "pending");

    // A stale lease of the same delivery, same owner, same lane epoch: released, claimed again.
    assert!(store.release(lease, at(2)).await.unwrap());
    let second = claim(&store, "w", 1, at(3)).await.remove(0);
    assert_eq!(second.delivery_id(), first.delivery_id());
    assert_eq!(second.lease().epoch(), lease.epoch(), "same lane epoch");
    assert_eq!(second.lease().claims(), lease.claims() + 1);
    assert_eq!(second.attempt(), 1, "a release costs no attempt");
    assert!(!store.complete(lease, at(4)).await.unwrap());
    assert_eq!(store.extend_lease(lease, LEASE, at(4)).await.unwrap(), None);
    assert!(delivery(&db, first.delivery_id()).await.is_some());
    assert!(store.complete(second.lease(), at(4)).await.unwrap());
    assert!(delivery(&db, first.delivery_id()).await.is_none());
    assert!(
        !store.complete(second.lease(), at(4)).await.unwrap(),
        "only once"
    );
}

#[tokio::test]
async fn two_stores_claiming_concurrently_never_hold_the_same_delivery() {
    let db = test_db("two_stores").await;
    let first = store(&db).await;
    let second = another_instance(&db).await;
    publish_unkeyed(&first, "c", 1_000, at(0)).await;

    // One clock for both, so that no lease expires and nothing is taken over.
    let holding: Arc<Mutex<HashSet<ObjectId>>> = Arc::default();
    let seen: Arc<Mutex<Vec<ObjectId>>> = Arc::default();
    let worker = |store: MongoEventStore, owner: &'static str| {
        let holding = Arc::clone(&holding);
        let seen = Arc::clone(&seen);
        async move {
            loop {
                let batch = claim(&store, owner, 25, at(1)).await;
                if batch.is_empty() {
                    // The other store may hold the rest; stop when everything is gone.
                    if store.statistics().await.unwrap().pending == 0 {
                        return;
                    }
                    tokio::task::yield_now().await;
                    continue;
                }
                {
                    let mut holding = holding.lock().unwrap();
                    for id in ids(&batch) {
                        assert!(holding.insert(id), "{id} held by both stores");
                    }
                    seen.lock().unwrap().extend(ids(&batch));
                }
                let done = store.complete_many(&leases(&batch), at(1)).await.unwrap();
                assert!(done.iter().all(|d| *d));
                let mut holding = holding.lock().unwrap();
                for id in ids(&batch) {
                    holding.remove(&id);
                }
            }
        }
    };
    tokio::join!(worker(first, "a"), worker(second, "b"));
    let seen = std::mem::take(&mut *seen.lock().unwrap());
    let unique: HashSet<&ObjectId> = seen.iter().collect();
    assert_eq!(seen.len(), 1_000, "every delivery handed out once");
    assert_eq!(unique.len(), 1_000);
    assert!(deliveries(&db).await.is_empty());
}

#[tokio::test]
async fn a_restarted_owner_does_not_adopt_its_predecessors_lanes() {
    let db = test_db("restart").await;
    let old = store(&db).await;
    publish_unkeyed(&old, "r", 3, at(0)).await;
    let batch = claim(&old, "worker", 10, at(1)).await;
    assert_eq!(batch.len(), 3);
    drop(old);

    let restarted = another_instance(&db).await;
    assert!(
        claim(&restarted, "worker", 10, at(2)).await.is_empty(),
        "the lanes are still leased to the previous instance"
    );
    // After the lease expired, the lanes are taken over and the lost attempts charged.
    let again = claim(&restarted, "worker", 10, at(40)).await;
    assert_eq!(again.len(), 3);
    assert!(again.iter().all(|d| d.attempt() == 2));
    for d in deliveries(&db).await {
        assert_eq!(attempts(&d), 1);
    }
}

#[tokio::test]
async fn a_worker_whose_lane_was_taken_over_changes_nothing_with_its_old_tokens() {
    let db = test_db("takeover").await;
    let a = store(&db).await;
    let b = another_instance(&db).await;
    publish_unkeyed(&a, "t", 4, at(0)).await;
    let old = claim(&a, "a", 10, at(1)).await;
    assert_eq!(old.len(), 4);

    let new = claim(&b, "b", 10, at(32)).await;
    assert_eq!(new.len(), 4, "the expired lanes were taken over");
    assert!(new.iter().all(|d| d.attempt() == 2));
    for d in &new {
        let lane = lane(&db, d.lease().lane()).await;
        assert_eq!(lane.get_str("owner").unwrap(), "b");
        assert_eq!(
            lane.get_array("lost").unwrap().len(),
            0,
            "lost list cleared"
        );
    }
    let before = deliveries(&db).await;

    let stale = leases(&old);
    assert_eq!(
        a.complete_many(&stale, at(33)).await.unwrap(),
        vec![false; 4]
    );
    for lease in &stale {
        assert!(!a.complete(lease, at(33)).await.unwrap());
        assert!(!a.reschedule(lease, at(90), "boom", at(33)).await.unwrap());
        assert!(!a.release(lease, at(33)).await.unwrap());
        assert!(!a.bury(lease, "boom", at(33)).await.unwrap());
        assert_eq!(a.extend_lease(lease, LEASE, at(33)).await.unwrap(), None);
    }
    assert_eq!(
        deliveries(&db).await,
        before,
        "the old tokens changed nothing"
    );
    assert!(
        b.complete_many(&leases(&new), at(34))
            .await
            .unwrap()
            .into_iter()
            .all(|d| d)
    );
    assert!(deliveries(&db).await.is_empty());
}

#[tokio::test]
async fn an_expired_lease_nobody_took_over_is_still_honoured() {
    let db = test_db("expired_honoured").await;
    let store = store(&db).await;
    publish_unkeyed(&store, "x", 2, at(0)).await;
    let batch = claim(&store, "w", 2, at(1)).await;
    let later = at(3_600);
    assert_eq!(
        store
            .extend_lease(batch[0].lease(), LEASE, later)
            .await
            .unwrap(),
        Some(at(3_630))
    );
    assert!(store.complete(batch[0].lease(), later).await.unwrap());
    assert!(store.complete(batch[1].lease(), later).await.unwrap());
    assert!(deliveries(&db).await.is_empty());
}

#[tokio::test]
async fn a_poison_delivery_whose_worker_keeps_dying_reaches_the_attempt_limit_and_is_buried() {
    const MAX_ATTEMPTS: u32 = 5;
    let db = test_db("poison").await;
    let first = store(&db).await;
    publish_unkeyed(&first, "poison", 1, at(0)).await;
    drop(first);

    let mut now = 1;
    let mut last = None;
    for attempt in 1..=MAX_ATTEMPTS {
        // A fresh process each time: it claims, then dies without settling anything.
        let worker = another_instance(&db).await;
        let batch = claim(&worker, "worker", 1, at(now)).await;
        assert_eq!(batch.len(), 1, "attempt {attempt}");
        assert_eq!(batch[0].attempt(), attempt);
        last = Some((worker, batch.into_iter().next().unwrap()));
        now += 31;
    }
    let (worker, claimed) = last.unwrap();
    assert_eq!(claimed.attempt(), MAX_ATTEMPTS, "the limit is reached");
    assert!(
        worker
            .bury(claimed.lease(), "gave up after 5 attempts", at(now))
            .await
            .unwrap()
    );
    let dead = delivery(&db, claimed.delivery_id()).await.unwrap();
    assert_eq!(dead.get_str("status").unwrap(), "dead");
    assert_eq!(attempts(&dead), i64::from(MAX_ATTEMPTS));
    assert_eq!(
        dead.get_str("lastError").unwrap(),
        "gave up after 5 attempts"
    );
    assert!(
        claim(&another_instance(&db).await, "worker", 1, at(now + 100))
            .await
            .is_empty()
    );
}

#[tokio::test]
async fn a_lost_claim_is_charged_once_even_when_its_charge_is_replayed() {
    let db = test_db("lost_once").await;
    let a = store(&db).await;
    let b = another_instance(&db).await;
    publish_unkeyed(&a, "l", 1, at(0)).await;
    let old = claim(&a, "a", 1, at(1)).await.remove(0);
    let taken = claim(&b, "b", 1, at(40)).await.remove(0);
    assert_eq!(taken.attempt(), 2);
    let id = taken.delivery_id();
    let charged = delivery(&db, id).await.unwrap();
    assert_eq!(attempts(&charged), 1);
    assert_eq!(charged.get_i64("lostAt").unwrap(), old.lease().epoch());

    // A holder that failed between charging and clearing leaves the lost list behind; whoever
    // holds the lane next charges it again, which must change nothing.
    assert!(b.release(taken.lease(), at(41)).await.unwrap());
    db.db()
        .collection::<Document>("relaybus_lanes")
        .update_one(
            doc! { "_id": taken.lease().lane() as i32 },
            doc! { "$push": { "lost": { "d": id, "e": old.lease().epoch() } } },
        )
        .await
        .unwrap();
    let again = claim(&b, "b", 1, at(42)).await.remove(0);
    assert_eq!(again.attempt(), 2, "charged once");
    assert_eq!(attempts(&delivery(&db, id).await.unwrap()), 1);
    assert!(
        lane(&db, again.lease().lane())
            .await
            .get_array("lost")
            .unwrap()
            .is_empty()
    );
}

#[tokio::test]
async fn a_delivery_gone_without_its_settlement_reaching_the_store_frees_its_key_within_16_claims()
{
    let db = test_db("vouched_gone").await;
    let store = store(&db).await;
    let events: Vec<EventEnvelope> = (1..=2)
        .map(|n| event(&format!("k-{n}"), Some("k")))
        .collect();
    publish(&store, &events, &[HANDLER], at(0)).await;
    let first = claim(&store, "w", 10, at(1)).await;
    assert_eq!(first.len(), 1);
    // Its completion applied and its reply was lost: the delivery is gone, and the store
    // instance still counts the claim as outstanding.
    db.db()
        .collection::<Document>("relaybus_deliveries")
        .delete_one(doc! { "_id": first[0].delivery_id() })
        .await
        .unwrap();
    let mut claims = 0;
    let next = loop {
        claims += 1;
        let batch = claim(&store, "w", 10, at(2)).await;
        if !batch.is_empty() || claims > 16 {
            break batch;
        }
    };
    assert_eq!(
        next.len(),
        1,
        "the key's next delivery, after {claims} claims"
    );
    assert_eq!(next[0].sequence(), Some(2));
    assert!(claims <= 16, "{claims} claims");
}

/// Makes the next `update` command of the client named `app` apply its writes and then report
/// a write concern error, as a reply lost after the write would.
async fn lose_the_reply_of_the_next_update(db: &TestDb, app: &str) -> FailPoint {
    FailPoint::enable(
        &db.client,
        doc! {
            "configureFailPoint": "failCommand",
            "mode": { "times": 1 },
            "data": {
                "failCommands": ["update"],
                "writeConcernError": { "code": 91, "errmsg": "injected after the write" },
                "appName": app,
            },
        },
    )
    .await
    .unwrap()
}

#[tokio::test]
async fn a_failed_claim_reconciles_so_nothing_it_recorded_stays_running() {
    let db = test_db("reconcile").await;
    let (client, _, _) = counting_client(&db).await;
    let app = format!("{}-counted", db.name);
    let store = store_without_heartbeat(&client, &db).await;
    // A first claim makes `w` a member that holds its lanes, before anything is due.
    assert!(claim(&store, "w", 10, at(0)).await.is_empty());
    publish_unkeyed(&store, "f", 3, at(0)).await;

    // The record reaches the database, but the reply reports a failure.
    let fail = lose_the_reply_of_the_next_update(&db, &app).await;
    let failed = store.claim("w", &[HANDLER], 10, LEASE, at(1)).await;
    fail.disable().await.unwrap();
    assert!(matches!(failed, Err(Error::Database(_))), "{failed:?}");

    for lane in lanes_of(&db, "w").await {
        assert!(
            in_flight(&lane).is_empty(),
            "nothing stays listed: {lane:?}"
        );
    }
    for d in deliveries(&db).await {
        assert_eq!(
            d.get_i64("claims").unwrap(),
            1,
            "generation moved on: {d:?}"
        );
        assert_eq!(attempts(&d), 0, "no attempt charged");
    }
    let batch = claim(&store, "w", 10, at(2)).await;
    assert_eq!(batch.len(), 3);
    assert!(
        batch
            .iter()
            .all(|d| d.attempt() == 1 && d.lease().claims() == 1)
    );
}

/// What a store instance keeps in memory of its claims and members decides nothing: with it
/// forgotten in the middle of a drain, the next claim finds its lanes listing deliveries it no
/// longer knows, reconciles them and hands them out again. The forgotten leases settle nothing,
/// the new ones everything, a key still runs one delivery at a time, and every delivery
/// completes once.
#[tokio::test]
async fn forgetting_the_claim_state_mid_run_costs_runs_never_a_second_live_lease() {
    let db = test_db("forgotten").await;
    let store = store(&db).await;
    publish_unkeyed(&store, "u", 20, at(0)).await;
    let keyed: Vec<EventEnvelope> = (0..3)
        .map(|i| event(&format!("k-{i}"), Some("k")))
        .collect();
    publish(&store, &keyed, &[HANDLER], at(0)).await;
    let first = claim(&store, "w", 10, at(1)).await;
    assert_eq!(first.len(), 10);
    let (done, running) = first.split_at(4);
    assert!(
        store
            .complete_many(&leases(done), at(2))
            .await
            .unwrap()
            .iter()
            .all(|d| *d)
    );

    store.forget_claim_state();
    let again = claim(&store, "w", 100, at(3)).await;
    // What ran is handed out again under a new claim generation, with the rest: one delivery
    // of the key, and no key's delivery twice.
    let ids = |batch: &[ClaimedDelivery]| -> HashSet<ObjectId> {
        batch.iter().map(|d| d.delivery_id()).collect()
    };
    assert!(ids(running).is_subset(&ids(&again)));
    assert!(ids(done).is_disjoint(&ids(&again)));
    assert_eq!(
        again.len(),
        20 - 4 + 1,
        "every unkeyed one left and the key's head"
    );
    assert_eq!(again.iter().filter(|d| d.key().is_some()).count(), 1);
    // The forgotten leases settle nothing; the new ones settle everything, once.
    let stale = store.complete_many(&leases(running), at(4)).await.unwrap();
    assert!(stale.iter().all(|d| !*d), "{stale:?}");
    assert!(
        store
            .complete_many(&leases(&again), at(4))
            .await
            .unwrap()
            .iter()
            .all(|d| *d)
    );
    // The key's next deliveries follow, one at a time.
    for (sequence, now) in [(2, 5), (3, 7)] {
        let next = claim(&store, "w", 100, at(now)).await;
        assert_eq!(
            next.iter().map(|d| d.sequence()).collect::<Vec<_>>(),
            [Some(sequence)]
        );
        let done = store.complete_many(&leases(&next), at(now + 1)).await;
        assert_eq!(done.unwrap(), [true]);
    }
    assert!(deliveries(&db).await.is_empty());
}

#[tokio::test]
async fn a_listing_the_instance_did_not_hand_out_is_reconciled_within_9_claims() {
    let db = test_db("orphan").await;
    let store = store(&db).await;
    // Two deliveries in one lane.
    let lane_id = lane_of(None, "orphan-0");
    let ids: Vec<String> = (0..)
        .map(|n| format!("orphan-{n}"))
        .filter(|id| lane_of(None, id) == lane_id)
        .take(2)
        .collect();
    publish(&store, &[event(&ids[0], None)], &[HANDLER], at(0)).await;
    publish(&store, &[event(&ids[1], None)], &[HANDLER], at(1)).await;
    let first = claim(&store, "w", 1, at(2)).await.remove(0);
    assert_eq!(first.event_id(), ids[0]);
    let second_id = deliveries(&db)
        .await
        .iter()
        .find(|d| d.get_str("eventId") == Ok(ids[1].as_str()))
        .unwrap()
        .get_object_id("_id")
        .unwrap();

    // What a dropped claim can leave behind: a listing nobody received a lease for.
    db.db()
        .collection::<Document>("relaybus_lanes")
        .update_one(
            doc! { "_id": lane_id as i32 },
            doc! { "$push": { "inFlight": second_id } },
        )
        .await
        .unwrap();
    // The owner takes its lanes as its last record left them for a few claims, then reads
    // them and finds the listing.
    let mut claims = 0;
    let next = loop {
        claims += 1;
        let next = claim(&store, "w", 10, at(3)).await;
        if !next.is_empty() || claims > 8 {
            break next;
        }
    };
    assert_eq!(
        next.len(),
        1,
        "the orphan was taken out and claimed properly, after {claims} claims"
    );
    assert_eq!(next[0].delivery_id(), second_id);
    // Reconciled at a read of the lanes (its generation moved on), or picked before one as
    // the delivery it is: no lease of it was handed out.
    assert!(next[0].lease().claims() <= 1, "{:?}", next[0].lease());
    assert_eq!(next[0].attempt(), 1);
    let listed: HashSet<_> = in_flight(&lane(&db, lane_id).await).into_iter().collect();
    assert_eq!(listed, HashSet::from([first.delivery_id(), second_id]));
    assert!(
        store.complete(first.lease(), at(4)).await.unwrap(),
        "handed-out claims kept"
    );
    assert!(store.complete(next[0].lease(), at(4)).await.unwrap());
}

#[tokio::test]
async fn a_completion_that_lands_while_a_claim_reads_is_not_taken_for_an_orphan() {
    let db = test_db("settled_meanwhile").await;
    let app = format!("{}-watched", db.name);
    // Armed just before the claim under test: wakes the test when that claim writes to the
    // deliveries (its unparking, after it has read its lanes), and counts transactions.
    let armed = Arc::new(AtomicBool::new(false));
    let unparking = Arc::new(Notify::new());
    let transactions = Arc::new(AtomicUsize::new(0));
    let mut options = ClientOptions::parse(&db.uri).await.unwrap();
    options.app_name = Some(app.clone());
    let (a, u, t) = (
        Arc::clone(&armed),
        Arc::clone(&unparking),
        Arc::clone(&transactions),
    );
    options.command_event_handler = Some(EventHandler::callback(move |event| {
        let CommandEvent::Started(started) = event else {
            return;
        };
        if !a.load(Ordering::SeqCst) {
            return;
        }
        match started.command_name.as_str() {
            "update" if started.command.get_str("update") == Ok("relaybus_deliveries") => {
                u.notify_one();
            }
            "commitTransaction" => {
                t.fetch_add(1, Ordering::SeqCst);
            }
            _ => {}
        }
    }));
    let client = Client::with_options(options).unwrap();
    let store = store_with(&client, &db, false).await;
    publish_unkeyed(&store, "s", 20, at(0)).await;
    let first = claim(&store, "w", 10, at(1)).await;
    assert_eq!(first.len(), 10);
    // A parked delivery with nothing before it: the next claim moves it back to the ready lane,
    // a write it makes after reading its lanes and before judging what they list.
    publish(&store, &[event("s-keyed", Some("k"))], &[HANDLER], at(0)).await;
    db.db()
        .collection::<Document>("relaybus_deliveries")
        .update_one(
            doc! { "eventId": "s-keyed" },
            doc! { "$set": { "lane": "parked" } },
        )
        .await
        .unwrap();
    let hold = hold_back_once(&db, &app, "update", 1000).await;
    armed.store(true, Ordering::SeqCst);
    let claiming = tokio::spawn({
        let store = store.clone();
        async move { claim(&store, "w", 20, at(2)).await }
    });
    tokio::time::timeout(Duration::from_secs(30), unparking.notified())
        .await
        .expect("the claim unparks");
    // While that write is held, the first batch completes: its deliveries are deleted, and
    // then the store lets go of their claims. The claim's read still lists and shows them.
    let completed = store.complete_many(&leases(&first), at(2)).await.unwrap();
    assert!(completed.iter().all(|c| *c), "{completed:?}");
    let second = claiming.await.unwrap();
    hold.disable().await.unwrap();
    assert_eq!(
        transactions.load(Ordering::SeqCst),
        0,
        "the claim took the completed deliveries for its own and reconciled nothing"
    );
    assert_eq!(second.len(), 11, "the other ten and the unparked one");
    assert!(
        store
            .complete_many(&leases(&second), at(3))
            .await
            .unwrap()
            .iter()
            .all(|c| *c)
    );
}

// ---------------------------------------------------------------------------------------------
// Per-key order and parking

#[tokio::test]
async fn per_key_rules_one_at_a_time_in_sequence_and_blocked_keys_do_not_starve_others() {
    let db = test_db("per_key").await;
    let store = store(&db).await;
    // 30 deliveries of one key, fewer than a claim parks, all due before the unkeyed work.
    let keyed: Vec<EventEnvelope> = (0..30)
        .map(|i| event(&format!("k-{i}"), Some("order-1")))
        .collect();
    publish(&store, &keyed, &[HANDLER], at(0)).await;
    // Unkeyed work in the key's own lane, so that every page the claim reads holds the key.
    let key_lane = lane_of(Some("order-1"), "");
    let free: Vec<EventEnvelope> = (0..)
        .map(|i| format!("free-{i}"))
        .filter(|id| lane_of(None, id) == key_lane)
        .take(3)
        .map(|id| event(&id, None))
        .collect();
    publish(&store, &free, &[HANDLER], at(1)).await;
    // The append wrote parked what waits behind the key's first delivery; ready, as a requeue
    // or an earlier version leaves them, the claims must scan past them.
    let readied = db
        .db()
        .collection::<Document>("relaybus_deliveries")
        .update_many(
            doc! { "key": "order-1" },
            doc! { "$set": { "lane": "ready" } },
        )
        .await
        .unwrap();
    assert_eq!(
        readied.modified_count, 29,
        "the append had parked the followers"
    );

    // A claim of 4 reads a first page of 20, all of the key: one pick, 19 blocked. The unkeyed
    // work lies past the page and past the rest of the blocked backlog.
    let batch = claim(&store, "w", 4, at(2)).await;
    let keyed_picks: Vec<&ClaimedDelivery> = batch.iter().filter(|d| d.key().is_some()).collect();
    assert_eq!(keyed_picks.len(), 1, "one delivery of a key per claim");
    assert_eq!(keyed_picks[0].sequence(), Some(1));
    assert_eq!(
        batch.len(),
        4,
        "the scan went past the 29 blocked deliveries to the unkeyed work"
    );
    assert_eq!(parked_count(&db).await, 0, "scanned, not parked");
    let head = keyed_picks[0].clone();

    // While the head runs, nothing of its key comes out.
    assert!(claim(&store, "w", 10, at(3)).await.is_empty());
    // A rescheduled head still blocks its followers until it is due.
    assert!(
        store
            .reschedule(head.lease(), at(100), "slow", at(3))
            .await
            .unwrap()
    );
    assert!(claim(&store, "w", 10, at(4)).await.is_empty());
    let retried = claim(&store, "w", 10, at(100)).await;
    assert_eq!(retried.len(), 1);
    assert_eq!(retried[0].sequence(), Some(1));
    assert_eq!(retried[0].attempt(), 2);
    // A buried head unblocks its followers.
    assert!(
        store
            .bury(retried[0].lease(), "dead", at(101))
            .await
            .unwrap()
    );
    let next = claim(&store, "w", 10, at(102)).await;
    assert_eq!(next.len(), 1);
    assert_eq!(next[0].sequence(), Some(2));
    assert!(store.complete(next[0].lease(), at(103)).await.unwrap());
    let next = claim(&store, "w", 10, at(104)).await;
    assert_eq!(next[0].sequence(), Some(3));
}

#[tokio::test]
async fn unordered_deliveries_keep_their_key_in_the_lane_of_their_event_and_never_wait_or_park() {
    const LOOSE: &str = "loose";
    let db = test_db("unordered_lanes").await;
    let store = store(&db).await;
    let keyed: Vec<EventEnvelope> = (1..=40)
        .map(|i| event(&format!("k-{i}"), Some("order-1")))
        .collect();
    let handlers: Vec<String> = [HANDLER, LOOSE].map(str::to_owned).to_vec();
    let unordered = vec![LOOSE.to_owned()];
    let requests: Vec<AppendRequest<'_>> = keyed
        .iter()
        .map(|e| AppendRequest::new(e, &handlers).unordered(&unordered))
        .collect();
    store
        .transaction(async |session| store.append(session, &requests, at(0)).await)
        .await
        .unwrap();

    // The stored form: both keep the key and sequence; the unordered one is marked, and lives
    // in the lane of its event id rather than of its key.
    let key_lane = lane_of(Some("order-1"), "") as i32;
    let mut loose_lanes = HashSet::new();
    for d in deliveries(&db).await {
        let event_id = d.get_str("eventId").unwrap();
        assert_eq!(d.get_str("key"), Ok("order-1"), "{d}");
        assert!(d.get_i64("sequence").is_ok(), "{d}");
        let lane = d.get_i32("laneId").unwrap();
        if d.get_str("handler") == Ok(LOOSE) {
            assert_eq!(d.get_bool("unordered"), Ok(true), "{d}");
            assert_eq!(lane, lane_of(None, event_id) as i32, "{d}");
            loose_lanes.insert(lane);
        } else {
            assert!(!d.contains_key("unordered"), "{d}");
            assert_eq!(lane, key_lane, "{d}");
        }
    }
    assert!(loose_lanes.len() > 1, "spread over lanes: {loose_lanes:?}");

    // One claim hands out every unordered delivery and the ordered head; the ordered backlog
    // waits and is parked, nothing unordered is.
    let batch = store
        .claim("w", &[HANDLER, LOOSE], 100, LEASE, at(1))
        .await
        .unwrap();
    let ordered: Vec<Option<i64>> = batch
        .iter()
        .filter(|d| d.handler() == HANDLER)
        .map(ClaimedDelivery::sequence)
        .collect();
    assert_eq!(ordered, [Some(1)]);
    assert_eq!(batch.len(), 41);
    let parked: Vec<Document> = deliveries(&db)
        .await
        .into_iter()
        .filter(|d| d.get_str("lane") == Ok("parked"))
        .collect();
    assert_eq!(parked.len(), 39, "the ordered backlog was parked");
    assert!(parked.iter().all(|d| d.get_str("handler") == Ok(HANDLER)));
    let listed = store
        .list_deliveries(&DeliveryQuery::new().handler(LOOSE))
        .await
        .unwrap();
    assert!(
        listed
            .iter()
            .all(|r| r.unordered && r.key.as_deref() == Some("order-1")),
        "{listed:?}"
    );

    // The handler becomes ordered again (a later publish does not name it unordered): its
    // new delivery waits for the unordered ones published before it, then runs.
    let later = event("k-41", Some("order-1"));
    publish(&store, std::slice::from_ref(&later), &[LOOSE], at(2)).await;
    assert!(
        store
            .claim("w", &[LOOSE], 100, LEASE, at(3))
            .await
            .unwrap()
            .is_empty(),
        "an ordered delivery overtook the unordered ones before it"
    );
    let loose: Vec<Lease> = batch
        .iter()
        .filter(|d| d.handler() == LOOSE)
        .map(|d| *d.lease())
        .collect();
    assert!(
        store
            .complete_many(&loose, at(4))
            .await
            .unwrap()
            .iter()
            .all(|done| *done)
    );
    let next = store.claim("w", &[LOOSE], 100, LEASE, at(5)).await.unwrap();
    assert_eq!(next.len(), 1);
    assert_eq!(next[0].event_id(), "k-41");
    assert_eq!(next[0].sequence(), Some(41));
}

#[tokio::test]
async fn per_key_order_holds_with_8_concurrent_claimers_over_50_keys_of_200_events() {
    const KEYS: usize = 50;
    const PER_KEY: usize = 200;
    let started = Instant::now();
    let db = test_db("order_8").await;
    let store0 = store(&db).await;
    // Interleaved, so that every transaction appends to many keys.
    let events: Vec<EventEnvelope> = (0..PER_KEY)
        .flat_map(|n| (0..KEYS).map(move |k| (n, k)))
        .map(|(n, k)| event(&format!("o-{k}-{n}"), Some(&format!("key-{k}"))))
        .collect();
    publish(&store0, &events, &[HANDLER], at(0)).await;
    let published = started.elapsed();

    // key -> (running, last sequence completed)
    let state: Arc<Mutex<HashMap<String, (bool, i64)>>> = Arc::default();
    let completed = Arc::new(AtomicUsize::new(0));
    // An idle claimer waits for another one to complete something, or polls.
    let progress = Arc::new(Notify::new());
    let claimers = (0..8).map(|n| {
        let state = Arc::clone(&state);
        let completed = Arc::clone(&completed);
        let progress = Arc::clone(&progress);
        let db = db.clone();
        async move {
            let store = another_instance(&db).await;
            let owner = format!("claimer-{n}");
            while completed.load(Ordering::SeqCst) < KEYS * PER_KEY {
                let notified = progress.notified();
                tokio::pin!(notified);
                notified.as_mut().enable();
                // One clock for all, so that no lease expires and nothing is taken over.
                let batch = claim(&store, &owner, 20, at(1)).await;
                if batch.is_empty() {
                    if completed.load(Ordering::SeqCst) < KEYS * PER_KEY {
                        // Or polling, as a dispatcher does: the lanes it owns may come free
                        // without a completion telling it.
                        let _ = tokio::time::timeout(Duration::from_millis(50), notified).await;
                    }
                    continue;
                }
                let mut keys_in_batch = HashSet::new();
                {
                    let mut state = state.lock().unwrap();
                    for d in &batch {
                        let key = d.key().unwrap().to_owned();
                        assert!(
                            keys_in_batch.insert(key.clone()),
                            "two of {key} in one claim"
                        );
                        let entry = state.entry(key.clone()).or_insert((false, 0));
                        assert!(!entry.0, "{key} handed out while running");
                        assert_eq!(d.sequence(), Some(entry.1 + 1), "{key} out of order");
                        entry.0 = true;
                    }
                    // Marked finished before the completion reaches the database, so that the
                    // next delivery of the key can only come after.
                    for d in &batch {
                        let entry = state.get_mut(d.key().unwrap()).unwrap();
                        *entry = (false, d.sequence().unwrap());
                    }
                }
                let done = store.complete_many(&leases(&batch), at(1)).await.unwrap();
                assert!(done.iter().all(|d| *d));
                let total = completed.fetch_add(batch.len(), Ordering::SeqCst) + batch.len();
                if total >= KEYS * PER_KEY {
                    progress.notify_waiters();
                } else {
                    // One idle claimer looks for work that may have been handed back.
                    progress.notify_one();
                }
            }
            progress.notify_waiters();
        }
    });
    join_all(claimers).await;
    let state = std::mem::take(&mut *state.lock().unwrap());
    assert_eq!(state.len(), KEYS);
    assert!(
        state
            .values()
            .all(|(running, last)| !running && *last == PER_KEY as i64)
    );
    assert!(deliveries(&db).await.is_empty());
    eprintln!(
        "per-key order: published {} in {published:?}, drained in {:?}",
        KEYS * PER_KEY,
        started.elapsed() - published
    );
}

#[tokio::test]
async fn a_parked_backlog_of_5000_unparks_level_triggered_after_its_head_completes() {
    let db = test_db("parked").await;
    let store = store(&db).await;
    let backlog: Vec<EventEnvelope> = (0..5_000)
        .map(|i| event(&format!("hot-{i}"), Some("hot")))
        .collect();
    publish(&store, &backlog, &[HANDLER], at(0)).await;
    publish_unkeyed(&store, "cold", 5, at(1)).await;
    // The appends wrote parked what waits behind the first of each; ready, as a requeue or an
    // earlier version leaves them, the claim finds the backlog waiting.
    db.db()
        .collection::<Document>("relaybus_deliveries")
        .update_many(doc! { "key": "hot" }, doc! { "$set": { "lane": "ready" } })
        .await
        .unwrap();

    let first = claim(&store, "w", 10, at(2)).await;
    assert_eq!(first.len(), 6, "the head of the hot key and the 5 others");
    let head = first
        .iter()
        .find(|d| d.key() == Some("hot"))
        .unwrap()
        .clone();
    assert_eq!(head.sequence(), Some(1));
    let stats = store.statistics().await.unwrap();
    assert_eq!(stats.parked, 4_999, "the waiting backlog was parked");
    assert_eq!(
        stats.oldest_due_at,
        Some(at(0).into()),
        "parked deliveries still count"
    );
    assert!(
        store
            .complete_many(
                &first
                    .iter()
                    .filter(|d| d.key().is_none())
                    .map(|d| *d.lease())
                    .collect::<Vec<_>>(),
                at(3)
            )
            .await
            .unwrap()
            .iter()
            .all(|d| *d)
    );

    // The head still runs: the backlog stays parked and claims do not scan it.
    let started = Instant::now();
    assert!(claim(&store, "w", 10, at(4)).await.is_empty());
    let blocked_claim = started.elapsed();
    assert_eq!(store.statistics().await.unwrap().parked, 4_999);

    assert!(store.complete(head.lease(), at(5)).await.unwrap());
    // Nothing but the parked backlog is pending now: the oldest due time is theirs, as
    // appended.
    let stats = store.statistics().await.unwrap();
    assert_eq!((stats.pending, stats.parked), (4_999, 4_999));
    assert_eq!(
        stats.oldest_due_at,
        Some(at(0).into()),
        "parked deliveries keep their due time and count"
    );
    let next = claim(&store, "w", 10, at(6)).await;
    assert_eq!(next.len(), 1);
    assert_eq!(
        next[0].sequence(),
        Some(2),
        "the lowest parked delivery came back"
    );
    assert_eq!(store.statistics().await.unwrap().parked, 4_998);
    assert!(store.complete(next[0].lease(), at(7)).await.unwrap());

    // Level-triggered: park the key's head by hand, as a crash while parking could leave it.
    // The next claim looks at the state, not at an event, and moves it back.
    db.db()
        .collection::<Document>("relaybus_deliveries")
        .update_many(doc! { "key": "hot" }, doc! { "$set": { "lane": "parked" } })
        .await
        .unwrap();
    let after_crash = claim(&store, "w", 10, at(8)).await;
    assert_eq!(after_crash.len(), 1);
    assert_eq!(after_crash[0].sequence(), Some(3));
    eprintln!("claim with a parked backlog of 4999 behind a running head: {blocked_claim:?}");
}

#[tokio::test]
async fn a_claim_that_unparks_keys_looks_each_of_them_up_once() {
    let db = test_db("unpark_once").await;
    let (client, count, names) = counting_client(&db).await;
    let store = store_with(&client, &db, false).await;
    let backlog: Vec<EventEnvelope> = ["a", "b"]
        .iter()
        .flat_map(|key| (0..40).map(move |i| event(&format!("{key}-{i}"), Some(key))))
        .collect();
    publish(&store, &backlog, &[HANDLER], at(0)).await;
    let heads = claim(&store, "w", 10, at(1)).await;
    assert_eq!(heads.len(), 2);
    assert_eq!(store.statistics().await.unwrap().parked, 78);
    let done = store.complete_many(&leases(&heads), at(2)).await.unwrap();
    assert!(done.iter().all(|d| *d));

    names.lock().unwrap().clear();
    let before = count.load(Ordering::SeqCst);
    let next = claim(&store, "w", 10, at(3)).await;
    let used = count.load(Ordering::SeqCst) - before;
    let sent = names.lock().unwrap().clone();
    assert_eq!(
        next.iter().map(|d| d.sequence()).collect::<Vec<_>>(),
        vec![Some(2), Some(2)],
        "each key's next delivery came back and was claimed"
    );
    // The parked heads, and one lookup of their keys' lowest pending deliveries, which
    // decides what to unpark and serves the per-key rules too: no lookup of its own. The lanes
    // are not read: the last claim's record left them as it knows.
    let aggregations = sent.iter().filter(|name| *name == "aggregate").count();
    assert_eq!(aggregations, 2, "{sent:?}");
    assert!(used <= 12, "{used} commands: {sent:?}");
    // The heads went back to their lanes in one update, and the record is the other.
    assert_eq!(
        sent.iter().filter(|name| *name == "update").count(),
        2,
        "{sent:?}"
    );
    for head in &next {
        let doc = delivery(&db, head.delivery_id()).await.expect("the head");
        assert_eq!(doc.get_str("lane"), Ok("ready"), "{doc:?}");
    }
    assert_eq!(store.statistics().await.unwrap().parked, 76);
}

/// [`publish_parked_pairs`], then claims and completes every key's first event: each second
/// one is a parked head free to come back.
async fn complete_parked_pairs_firsts(store: &MongoEventStore, db: &TestDb, keys: usize) {
    publish_parked_pairs(store, db, keys).await;
    let first = claim(store, "w", 1000, at(1)).await;
    assert_eq!(first.len(), keys);
    let done = store.complete_many(&leases(&first), at(2)).await.unwrap();
    assert!(done.iter().all(|d| *d));
}

/// Publishes two events for each of `keys` keys (`k<i>-1`, `k<i>-2`), every second one parked
/// behind its first (the append writes it so; this makes sure).
async fn publish_parked_pairs(store: &MongoEventStore, db: &TestDb, keys: usize) {
    let events: Vec<EventEnvelope> = (0..keys)
        .flat_map(|i| {
            let key = format!("k{i}");
            [1, 2].map(|n| event(&format!("{key}-{n}"), Some(&key)))
        })
        .collect();
    publish(store, &events, &[HANDLER], at(0)).await;
    let parked = db
        .db()
        .collection::<Document>("relaybus_deliveries")
        .update_many(
            doc! { "eventId": { "$regex": "-2$" } },
            doc! { "$set": { "lane": "parked" } },
        )
        .await
        .unwrap();
    assert_eq!(parked.matched_count, keys as u64);
    assert_eq!(parked.modified_count, 0, "written parked by the append");
}

/// The parked deliveries a claim takes once their predecessors completed are completed without
/// being read again: the claim noted what their completion needs, as for the rest.
#[tokio::test]
async fn parked_heads_are_completed_as_read_by_their_claim() {
    const KEYS: usize = 3;
    let db = test_db("parked_heads_completed").await;
    let (client, _, names) = counting_client(&db).await;
    let store = store_with(&client, &db, false).await;
    complete_parked_pairs_firsts(&store, &db, KEYS).await;
    let heads = claim(&store, "w", 100, at(3)).await;
    let mut ids: Vec<&str> = heads.iter().map(ClaimedDelivery::event_id).collect();
    ids.sort_unstable();
    assert_eq!(ids, ["k0-2", "k1-2", "k2-2"]);

    names.lock().unwrap().clear();
    let done = store.complete_many(&leases(&heads), at(4)).await.unwrap();
    let sent = names.lock().unwrap().clone();
    assert!(done.iter().all(|d| *d));
    assert_eq!(sent, ["find", "update", "delete"]);
}

#[tokio::test]
async fn a_claim_over_more_parked_keys_than_its_first_read_looks_up_unparks_only_free_heads() {
    const KEYS: usize = 600;
    let db = test_db("many_parked_keys").await;
    let store = store(&db).await;
    publish_parked_pairs(&store, &db, KEYS).await;

    // More keys than the first read looks up: none of their heads may come back while their
    // first deliveries are pending.
    let first = claim(&store, "w", 1000, at(1)).await;
    assert_eq!(first.len(), KEYS, "every key's first delivery");
    assert!(first.iter().all(|d| d.sequence() == Some(1)));
    assert_eq!(parked_count(&db).await, KEYS, "no head came back early");

    let done = store.complete_many(&leases(&first), at(2)).await.unwrap();
    assert!(done.iter().all(|d| *d));
    let mut second = Vec::new();
    for round in 0..3 {
        second.extend(claim(&store, "w", 1000, at(3 + round)).await);
    }
    assert_eq!(second.len(), KEYS, "every key's second delivery came back");
    assert!(second.iter().all(|d| d.sequence() == Some(2)));
    // Some ran from the parked lane: none counts as parked while it runs.
    let stats = store.statistics().await.unwrap();
    assert_eq!((stats.parked, stats.running), (0, KEYS as u64));
}

/// How many deliveries are parked.
async fn parked_count(db: &TestDb) -> usize {
    deliveries(db)
        .await
        .into_iter()
        .filter(|d| d.get_str("lane") == Ok("parked"))
        .count()
}

#[tokio::test]
async fn the_park_threshold_decides_when_a_keys_backlog_is_parked() {
    let db = test_db("park_threshold").await;
    let built = |db: &TestDb, threshold: u32| {
        MongoEventStore::builder(db.client.clone())
            .database(&db.name)
            .park_threshold(threshold)
            .build()
    };
    assert_eq!(store(&db).await.park_threshold(), 32, "the specification's");
    match built(&db, 0) {
        Err(ConfigurationError::InvalidOption { option, reason }) => {
            assert_eq!(option, "park_threshold");
            assert!(reason.contains("use 1 or more"), "{reason}");
        }
        other => panic!("expected an invalid option, got {other:?}"),
    }
    // 40 deliveries of one key: the claim takes the head, and finds 39 waiting behind it.
    for (threshold, parked) in [(u32::MAX, 0), (40, 0), (39, 39)] {
        let db = test_db(&format!("park_threshold_{}", threshold % 1000)).await;
        let store = built(&db, threshold).unwrap();
        assert_eq!(store.park_threshold(), threshold);
        store.setup().await.unwrap();
        let events: Vec<EventEnvelope> = (0..40)
            .map(|n| event(&format!("k-{n}"), Some("k")))
            .collect();
        publish(&store, &events, &[HANDLER], at(0)).await;
        // The append wrote the 39 behind the first parked, unless parking is off.
        let born = if threshold == u32::MAX { 0 } else { 39 };
        assert_eq!(parked_count(&db).await, born, "threshold {threshold}");
        // Written ready, as a requeue or an earlier version leaves them, the claim finds them.
        db.db()
            .collection::<Document>("relaybus_deliveries")
            .update_many(doc! {}, doc! { "$set": { "lane": "ready" } })
            .await
            .unwrap();
        let head = claim(&store, "w", 10, at(1)).await;
        assert_eq!(head.len(), 1);
        assert_eq!(head[0].sequence(), Some(1));
        assert_eq!(parked_count(&db).await, parked, "threshold {threshold}");
        // Parked or not, the key goes on in order.
        assert!(store.complete(head[0].lease(), at(2)).await.unwrap());
        let next = claim(&store, "w", 10, at(3)).await;
        assert_eq!(next.len(), 1);
        assert_eq!(next[0].sequence(), Some(2), "threshold {threshold}");
    }
}

#[tokio::test]
async fn a_lane_handed_back_parks_the_few_deliveries_waiting_there() {
    let db = test_db("handback_park").await;
    let store = store(&db).await;
    // A member of another handler set: no member owns lanes, so `w` hands back the lanes that
    // yield nothing and run nothing, as the specification says. The auditor took every lane
    // while it was alone, and hands them back once `w` joined.
    assert!(
        store
            .claim("auditor", &["auditor"], 5, LEASE, at(0))
            .await
            .unwrap()
            .is_empty()
    );
    assert!(claim(&store, "w", 5, at(0)).await.is_empty());
    assert!(
        store
            .claim("auditor", &["auditor"], 5, LEASE, at(0))
            .await
            .unwrap()
            .is_empty()
    );
    // Appended one at a time, the followers are written ready, not parked.
    for i in 0..3 {
        publish(
            &store,
            &[event(&format!("s-{i}"), Some("slow"))],
            &[HANDLER],
            at(0),
        )
        .await;
    }
    assert_eq!(parked_count(&db).await, 0);
    let head = claim(&store, "w", 5, at(1)).await.remove(0);
    // The head fails and is retried later; its followers are due, but blocked.
    assert!(
        store
            .reschedule(head.lease(), at(500), "later", at(2))
            .await
            .unwrap()
    );
    assert!(claim(&store, "w", 5, at(3)).await.is_empty());
    assert!(
        lanes_of(&db, "w").await.is_empty(),
        "the lane was handed back"
    );
    assert_eq!(parked_count(&db).await, 2);
    // Nothing is stranded: the head comes back when due, then the followers one by one.
    let retried = claim(&store, "w", 5, at(500)).await;
    assert_eq!(retried.len(), 1);
    assert_eq!(retried[0].sequence(), Some(1));
    assert!(store.complete(retried[0].lease(), at(501)).await.unwrap());
    let next = claim(&store, "w", 5, at(502)).await;
    assert_eq!(next[0].sequence(), Some(2));
}

// ---------------------------------------------------------------------------------------------
// Settlement

#[tokio::test]
async fn attempts_count_ended_attempts_reschedule_and_bury_add_one_release_none() {
    let db = test_db("attempts").await;
    let store = store(&db).await;
    publish_unkeyed(&store, "a", 1, at(0)).await;
    let first = claim(&store, "w", 1, at(1)).await.remove(0);
    assert_eq!(first.attempt(), 1);
    assert!(
        store
            .reschedule(first.lease(), at(60), "timeout", at(2))
            .await
            .unwrap()
    );
    let doc = delivery(&db, first.delivery_id()).await.unwrap();
    assert_eq!(attempts(&doc), 1);
    assert_eq!(doc.get_str("lastError").unwrap(), "timeout");
    assert_eq!(*doc.get_datetime("dueAt").unwrap(), at(60));
    assert!(in_flight(&lane(&db, first.lease().lane()).await).is_empty());
    assert!(
        claim(&store, "w", 1, at(59)).await.is_empty(),
        "not due yet"
    );

    let second = claim(&store, "w", 1, at(60)).await.remove(0);
    assert_eq!(second.attempt(), 2);
    assert!(store.release(second.lease(), at(61)).await.unwrap());
    let third = claim(&store, "w", 1, at(61)).await.remove(0);
    assert_eq!(third.attempt(), 2, "a release costs no attempt");

    assert!(
        store
            .bury(third.lease(), &"x".repeat(20_000), at(62))
            .await
            .unwrap()
    );
    let dead = delivery(&db, first.delivery_id()).await.unwrap();
    assert_eq!(dead.get_str("status").unwrap(), "dead");
    assert_eq!(attempts(&dead), 2);
    assert!(dead.get_str("lastError").unwrap().len() <= 8 * 1024);
    assert!(claim(&store, "w", 1, at(100)).await.is_empty());
}

#[tokio::test]
async fn extend_lease_checks_the_generation_and_never_shrinks_the_lease() {
    let db = test_db("extend").await;
    let store = store(&db).await;
    publish_unkeyed(&store, "x", 1, at(0)).await;
    let first = claim(&store, "w", 1, at(1)).await.remove(0);
    let lane_id = first.lease().lane();
    assert_eq!(
        store
            .extend_lease(first.lease(), Duration::from_secs(120), at(10))
            .await
            .unwrap(),
        Some(at(130))
    );
    assert_eq!(
        *lane(&db, lane_id)
            .await
            .get_datetime("leaseExpiresAt")
            .unwrap(),
        at(130)
    );
    assert_eq!(
        store
            .extend_lease(first.lease(), Duration::from_secs(5), at(11))
            .await
            .unwrap(),
        Some(at(130)),
        "never shrinks"
    );
    assert_eq!(
        *lane(&db, lane_id)
            .await
            .get_datetime("leaseExpiresAt")
            .unwrap(),
        at(130)
    );

    // A stale lease (the claim ended and the delivery was claimed again) extends nothing.
    assert!(store.release(first.lease(), at(12)).await.unwrap());
    let second = claim(&store, "w", 1, at(13)).await.remove(0);
    assert_eq!(second.lease().epoch(), first.lease().epoch());
    assert_eq!(
        store
            .extend_lease(first.lease(), Duration::from_secs(600), at(14))
            .await
            .unwrap(),
        None
    );
    assert_eq!(
        *lane(&db, lane_id)
            .await
            .get_datetime("leaseExpiresAt")
            .unwrap(),
        at(130)
    );
}

#[tokio::test]
async fn complete_many_settles_a_batch_from_many_lanes_and_refuses_the_stale_part() {
    let db = test_db("complete_many").await;
    let a = store(&db).await;
    let b = another_instance(&db).await;
    publish_unkeyed(&a, "m", 30, at(0)).await;
    let batch = claim(&a, "a", 30, at(1)).await;
    assert_eq!(batch.len(), 30);
    let lanes: HashSet<u32> = batch.iter().map(|d| d.lease().lane()).collect();
    assert!(lanes.len() > 1);
    // One lane is taken over after its lease expired: every other one is extended.
    let victim = batch[0].lease().lane();
    for lane in &lanes {
        if *lane != victim {
            let d = batch.iter().find(|d| d.lease().lane() == *lane).unwrap();
            let extended = a
                .extend_lease(d.lease(), Duration::from_secs(3_600), at(1))
                .await
                .unwrap();
            assert_eq!(extended, Some(at(3_601)));
        }
    }
    let taken = claim(&b, "b", 30, at(40)).await;
    assert!(!taken.is_empty());
    assert!(taken.iter().all(|d| d.lease().lane() == victim));

    let outcome = a.complete_many(&leases(&batch), at(41)).await.unwrap();
    for (d, done) in batch.iter().zip(&outcome) {
        assert_eq!(*done, d.lease().lane() != victim, "{}", d.lease());
    }
    let left: Vec<ObjectId> = deliveries(&db)
        .await
        .iter()
        .map(|d| d.get_object_id("_id").unwrap())
        .collect();
    assert_eq!(left.len(), taken.len());
    let completed_event = db
        .db()
        .collection::<Document>("relaybus_events")
        .find_one(
            doc! { "_id": batch.iter().find(|d| d.lease().lane() != victim).unwrap().event_id() },
        )
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        *completed_event.get_datetime("completedAt").unwrap(),
        at(41)
    );
}

#[tokio::test]
async fn completion_history_records_completions_in_the_same_transaction() {
    let db = test_db("history").await;
    let store = store_with(&db.client, &db, true).await;
    publish_unkeyed(&store, "h", 3, at(0)).await;
    let batch = claim(&store, "w", 3, at(1)).await;
    assert!(
        store
            .reschedule(batch[0].lease(), at(2), "retry", at(1))
            .await
            .unwrap()
    );
    let retried = claim(&store, "w", 1, at(2)).await;
    let mut all = leases(&batch[1..]);
    all.extend(leases(&retried));
    all.push(*batch[0].lease()); // stale: rescheduled
    let outcome = store.complete_many(&all, at(3)).await.unwrap();
    assert_eq!(outcome, vec![true, true, true, false]);
    assert!(deliveries(&db).await.is_empty());

    let records = store
        .list_deliveries(&DeliveryQuery::new().status(DeliveryStatus::Completed))
        .await
        .unwrap();
    assert_eq!(records.len(), 3);
    assert!(records.iter().all(|r| r.completed_at == Some(at(3).into())));
    let retried_record = records
        .iter()
        .find(|r| r.id == batch[0].delivery_id().to_hex())
        .unwrap();
    assert_eq!(retried_record.attempts, 2, "the completing attempt counts");
    // The completion record keeps what went wrong before it succeeded.
    assert_eq!(retried_record.last_error.as_deref(), Some("retry"));
    let history: Vec<_> = retried_record
        .errors
        .iter()
        .map(|e| (e.attempt, e.error.as_str()))
        .collect();
    assert_eq!(history, [(Some(1), "retry")]);
    assert_eq!(store.statistics().await.unwrap().completed, 3);
}

#[tokio::test]
async fn a_transactional_completion_commits_with_the_handlers_writes_or_not_at_all() {
    let db = test_db("tx_complete").await;
    let store = store(&db).await;
    let projections = db.db().collection::<Document>("projections");
    publish_unkeyed(&store, "p", 2, at(0)).await;
    let batch = claim(&store, "w", 2, at(1)).await;

    // Aborted: neither the projection nor the completion.
    let aborted: Result<(), Error> = store
        .transaction(async |session| {
            projections
                .insert_one(doc! { "event": batch[0].event_id() })
                .session(&mut *session)
                .await?;
            assert!(
                store
                    .complete_in_transaction(session, batch[0].lease(), at(2))
                    .await?
            );
            Err(Error::custom("handler failed after writing"))
        })
        .await;
    assert!(matches!(aborted, Err(Error::Custom(_))));
    assert_eq!(projections.count_documents(doc! {}).await.unwrap(), 0);
    assert!(delivery(&db, batch[0].delivery_id()).await.is_some());

    // Committed: both.
    let done = store
        .transaction(async |session| {
            projections
                .insert_one(doc! { "event": batch[0].event_id() })
                .session(&mut *session)
                .await?;
            store
                .complete_in_transaction(session, batch[0].lease(), at(3))
                .await
        })
        .await
        .unwrap();
    assert!(done);
    assert_eq!(projections.count_documents(doc! {}).await.unwrap(), 1);
    assert!(delivery(&db, batch[0].delivery_id()).await.is_none());

    // A session without a transaction is refused.
    let mut session = db.client.start_session().await.unwrap();
    assert!(matches!(
        store
            .complete_in_transaction(&mut session, batch[1].lease(), at(4))
            .await,
        Err(Error::Configuration(
            ConfigurationError::NoTransaction { .. }
        ))
    ));
    assert!(delivery(&db, batch[1].delivery_id()).await.is_some());
}

#[tokio::test]
async fn relinquish_hands_the_lanes_back_at_once() {
    let db = test_db("relinquish").await;
    let a = store(&db).await;
    let b = another_instance(&db).await;
    publish_unkeyed(&a, "g", 5, at(0)).await;
    let batch = claim(&a, "a", 5, at(1)).await;
    for d in &batch {
        assert!(a.release(d.lease(), at(2)).await.unwrap());
    }
    assert!(a.relinquish("a").await.unwrap() > 0);
    assert!(lanes_of(&db, "a").await.is_empty());
    let again = claim(&b, "b", 5, at(3)).await;
    assert_eq!(again.len(), 5, "no lease expiry to wait for");
    assert!(
        again.iter().all(|d| d.attempt() == 1),
        "released, so nothing lost"
    );
}

// ---------------------------------------------------------------------------------------------
// Command counts

#[tokio::test]
async fn command_counts_are_fixed_whatever_the_batch_size() {
    let db = test_db("command_counts").await;
    let (client, count, names) = counting_client(&db).await;
    let store = store_with(&client, &db, false).await;
    // 1,000 running deliveries in lanes 0 to 99 (fewer than the 128 lanes one query reads).
    let base: Vec<EventEnvelope> = (0..)
        .map(|n| format!("base-{n}"))
        .filter(|id| lane_of(None, id) < 100)
        .take(1_000)
        .map(|id| event(&id, None))
        .collect();
    publish(&store, &base, &[HANDLER], at(0)).await;
    let base = claim(&store, "w", 10_000, at(1)).await;
    assert_eq!(base.len(), 1_000);
    let held: HashSet<u32> = lanes_of(&db, "w")
        .await
        .iter()
        .map(|l| l.get_i32("_id").unwrap() as u32)
        .collect();

    // New deliveries in lanes the owner already holds.
    let mut n = 0;
    let mut fresh = Vec::new();
    while fresh.len() < 111 {
        let id = format!("fresh-{n}");
        n += 1;
        if held.contains(&lane_of(None, &id)) {
            fresh.push(event(&id, None));
        }
    }
    publish(&store, &fresh, &[HANDLER], at(2)).await;

    let mut claims = Vec::new();
    let mut completes = Vec::new();
    for size in [1, 10, 100] {
        names.lock().unwrap().clear();
        let before = count.load(Ordering::SeqCst);
        let batch = claim(&store, "w", size, at(3)).await;
        let used = count.load(Ordering::SeqCst) - before;
        assert_eq!(batch.len(), size as usize);
        eprintln!(
            "claim of {size}: {used} commands {:?}",
            names.lock().unwrap()
        );
        claims.push(used);

        names.lock().unwrap().clear();
        let before = count.load(Ordering::SeqCst);
        let done = store.complete_many(&leases(&batch), at(4)).await.unwrap();
        let used = count.load(Ordering::SeqCst) - before;
        assert!(done.iter().all(|d| *d));
        eprintln!(
            "complete_many of {size}: {used} commands {:?}",
            names.lock().unwrap()
        );
        completes.push(used);
    }
    // A claim from held lanes, which it takes as its last record left them: the first pages
    // of the held lanes (two groups of 128: the one owner owns every lane), one deeper read of
    // the first lanes it picks from when the pages did not hold all that is due, then the
    // events of the picks beside the record; the first also looks up parked deliveries.
    // Whatever the batch size.
    assert!(
        claims[1..].iter().all(|n| (4..=5).contains(n)),
        "claims: {claims:?}"
    );
    assert!(claims[0] <= 6, "claims: {claims:?}");
    assert_eq!(completes, vec![3, 3, 3]);
}

/// With unkeyed deliveries due in a few lanes it knows of (those its last claim left more in,
/// then those the last read of every lane ranked), a claim reads those lanes alone: their
/// deliveries, then the events of the picks beside the record, three commands, where reading
/// every lane takes more. A backlog drains a few lanes at a time.
#[tokio::test]
async fn a_backlog_drains_a_few_lanes_at_a_time_reading_only_those() {
    let db = test_db("drain_few_lanes").await;
    let (client, count, names) = counting_client(&db).await;
    let store = store_with(&client, &db, false).await;
    // 8 deliveries in each of 32 lanes: a claim of 16 empties two lanes.
    let mut per_lane = [0; 32];
    let backlog: Vec<EventEnvelope> = (0..)
        .map(|n| format!("backlog-{n}"))
        .filter(|id| {
            let lane = lane_of(None, id) as usize;
            let room = lane < 32 && per_lane[lane] < 8;
            if room {
                per_lane[lane] += 1;
            }
            room
        })
        .take(256)
        .map(|id| event(&id, None))
        .collect();
    publish(&store, &backlog, &[HANDLER], at(0)).await;
    for step in 0..6 {
        names.lock().unwrap().clear();
        let before = count.load(Ordering::SeqCst);
        // Claims a millisecond apart, so that parked deliveries are looked up by the first only.
        let batch = claim(&store, "w", 16, ms(step)).await;
        let used = count.load(Ordering::SeqCst) - before;
        let lanes: HashSet<u32> = batch.iter().map(|c| c.lease().lane()).collect();
        assert_eq!(batch.len(), 16);
        assert!(lanes.len() <= 8, "step {step}: {lanes:?}");
        if step > 0 {
            assert_eq!(used, 3, "step {step}: {:?}", names.lock().unwrap());
        }
        let done = store
            .complete_many(&leases(&batch), ms(step))
            .await
            .unwrap();
        assert!(done.iter().all(|d| *d));
    }
}

/// A completion of claims this store instance handed out and has not seen settled reads only
/// their lanes: the claims noted what it needs of the deliveries. Another instance, which did
/// not hand them out, reads the deliveries too. Either way a lease completes once, and a lease
/// whose lane was taken over completes nothing, its delivery left as it is.
#[tokio::test]
async fn a_completion_of_its_own_claims_reads_only_their_lanes() {
    let db = test_db("own_completions").await;
    let (client, _, names) = counting_client(&db).await;
    let store = store_with(&client, &db, false).await;
    let events: Vec<EventEnvelope> = (0..5).map(|n| event(&format!("own-{n}"), None)).collect();
    publish(&store, &events, &[HANDLER], at(0)).await;
    let batch = claim(&store, "w", 4, at(1)).await;
    assert_eq!(batch.len(), 4);
    let all = leases(&batch);

    names.lock().unwrap().clear();
    let done = store.complete_many(&all[..2], at(2)).await.unwrap();
    let sent = names.lock().unwrap().clone();
    assert_eq!(done, [true, true]);
    assert_eq!(sent.first().map(String::as_str), Some("find"), "{sent:?}");
    assert!(!sent.iter().any(|name| name == "aggregate"), "{sent:?}");

    let other = store_with(&client, &db, false).await;
    names.lock().unwrap().clear();
    let done = other.complete_many(&all[2..], at(2)).await.unwrap();
    let sent = names.lock().unwrap().clone();
    assert_eq!(done, [true, true]);
    assert_eq!(
        sent.first().map(String::as_str),
        Some("aggregate"),
        "{sent:?}"
    );
    assert_eq!(
        store.complete_many(&all[..1], at(3)).await.unwrap(),
        [false]
    );
    assert_eq!(
        other.complete_many(&all[2..3], at(3)).await.unwrap(),
        [false]
    );

    // The last one, claimed here, taken over by the other instance once its lease expired: this
    // instance still has the claim as issued, and its lane fences it.
    let stale = claim(&store, "w", 1, at(4)).await;
    assert_eq!(stale.len(), 1);
    let taken = claim(&other, "w", 1, at(4 + LEASE.as_secs() as i64 + 1)).await;
    assert_eq!(taken.len(), 1);
    assert_eq!(taken[0].delivery_id(), stale[0].delivery_id());
    let before = delivery(&db, stale[0].delivery_id()).await;
    names.lock().unwrap().clear();
    let done = store.complete_many(&leases(&stale), at(50)).await.unwrap();
    let sent = names.lock().unwrap().clone();
    assert_eq!(done, [false]);
    assert!(!sent.iter().any(|name| name == "aggregate"), "{sent:?}");
    assert_eq!(delivery(&db, stale[0].delivery_id()).await, before);
    assert_eq!(
        other.complete_many(&leases(&taken), at(51)).await.unwrap(),
        [true]
    );
}

/// A claim through the store boundary, as the dispatcher makes it: with the lanes reported since
/// the last claim and whether they are all. How many commands it sent, and how many deliveries
/// it got.
async fn boundary_claim(
    store: &MongoEventStore,
    count: &AtomicUsize,
    now: DateTime,
) -> (usize, usize) {
    let (used, claimed) = boundary_claimed(store, count, now).await;
    (used, claimed.len())
}

/// [`boundary_claim`], with the deliveries claimed.
async fn boundary_claimed(
    store: &MongoEventStore,
    count: &AtomicUsize,
    now: DateTime,
) -> (usize, Vec<relaybus::store::Claimed<Lease>>) {
    use relaybus::store::ClaimRequest;
    let handlers = [HANDLER.to_owned()];
    let before = count.load(Ordering::SeqCst);
    let claimed = Queue::claim(
        store,
        ClaimRequest {
            owner: "w",
            handlers: &handlers,
            limit: 32,
            lease_duration: LEASE,
            now: std::time::SystemTime::from(now).into(),
        },
    )
    .await
    .expect("claim");
    (count.load(Ordering::SeqCst) - before, claimed)
}

/// A store over `db` whose client counts the commands it sends, and that count.
async fn counted_store(db: &TestDb) -> (MongoEventStore, Arc<AtomicUsize>) {
    let (client, count, _) = counting_client(db).await;
    (store_with(&client, db, false).await, count)
}

/// `n` milliseconds into the second second after `T0`: the clock of the boundary claim tests.
fn ms(n: i64) -> DateTime {
    DateTime::from_millis(T0 + 1_000 + n)
}

#[tokio::test]
async fn lanes_a_full_claim_hands_back_unread_are_not_taken_for_empty_by_the_ranking() {
    use relaybus::store::ClaimRequest;
    let db = test_db("full_claim_unread").await;
    let store = store(&db).await;
    // Eight lanes with two deliveries each, the lanes' deliveries due one millisecond apart:
    // fewer than a ranking reads, so the first ranking sees them all.
    let mut lanes: Vec<u32> = Vec::new();
    let mut n = 0;
    while lanes.len() < 8 {
        let id = format!("unread-{n}");
        n += 1;
        let lane = lane_of(None, &id);
        if lanes.contains(&lane) {
            continue;
        }
        let partner = id_in_lane(&format!("{id}-partner"), lane, true);
        let due = DateTime::from_millis(T0 + lanes.len() as i64);
        publish(
            &store,
            &[event(&id, None), event(&partner, None)],
            &[HANDLER],
            due,
        )
        .await;
        lanes.push(lane);
    }
    // Claims of four, each completed before the next, a few milliseconds apart: each fills up
    // from the two oldest of the lanes it looks at and hands the other two back unread.
    let handlers = [HANDLER.to_owned()];
    let mut claimed = 0;
    for step in 0..8 {
        let batch = Queue::claim(
            &store,
            ClaimRequest {
                owner: "w",
                handlers: &handlers,
                limit: 4,
                lease_duration: LEASE,
                now: std::time::SystemTime::from(ms(step * 5)).into(),
            },
        )
        .await
        .unwrap();
        if batch.is_empty() {
            break;
        }
        claimed += batch.len();
        let leases: Vec<Lease> = batch.iter().map(|c| c.lease).collect();
        assert!(
            store
                .complete_many(&leases, ms(step * 5 + 1))
                .await
                .unwrap()
                .into_iter()
                .all(|done| done)
        );
    }
    assert_eq!(
        claimed, 16,
        "every due delivery is found within the quarter second a complete ranking is trusted"
    );
}

#[tokio::test]
async fn a_delivery_a_claim_unparks_into_a_lane_the_ranking_found_empty_is_found_at_once() {
    let db = test_db("unparked_uncovered").await;
    let (store, count) = counted_store(&db).await;
    let slow: Vec<EventEnvelope> = (0..3)
        .map(|n| event(&format!("slow-{n}"), Some("slow")))
        .collect();
    publish(&store, &slow, &[HANDLER], at(0)).await;
    // The head fails and waits for a retry much later; its lane goes back with the followers
    // parked.
    let (_, claimed) = boundary_claimed(&store, &count, ms(0)).await;
    assert_eq!(claimed.len(), 1);
    let head = &claimed[0];
    assert!(
        store
            .reschedule(&head.lease, ms(60_000), "later", ms(5))
            .await
            .unwrap()
    );
    let (_, got) = boundary_claim(&store, &count, ms(10)).await;
    assert_eq!(got, 0);
    assert_eq!(parked_count(&db).await, 2);
    // A ranking finds every free lane empty, that one included.
    let (_, got) = boundary_claim(&store, &count, ms(20)).await;
    assert_eq!(got, 0);
    // An operator buries the head: the next claim unparks the follower into that free lane,
    // and does not trust the ranking for it.
    let buried = store
        .bury_by_id(&[head.lease.delivery_id().to_hex()], "given up", ms(25))
        .await
        .unwrap();
    assert_eq!(buried.buried.len(), 1, "{buried:?}");
    let (_, claimed) = boundary_claimed(&store, &count, ms(30)).await;
    assert_eq!(claimed.len(), 1, "the unparked follower is claimed at once");
    assert_eq!(claimed[0].event.id(), "slow-1");
}

/// The next `n` wake-ups of `stream`.
async fn next_wake_ups(
    stream: &mut futures::stream::BoxStream<'static, relaybus::Result<relaybus::store::WakeUp>>,
    n: usize,
) -> Vec<relaybus::store::WakeUp> {
    use futures::StreamExt;
    let mut woken = Vec::with_capacity(n);
    while woken.len() < n {
        let next = tokio::time::timeout(Duration::from_secs(10), stream.next())
            .await
            .expect("a wake-up within 10 s");
        woken.push(next.expect("the stream goes on").expect("a wake-up"));
    }
    woken
}

/// An event id of the unkeyed kind whose lane is (`same`) or is not `lane`.
fn id_in_lane(prefix: &str, lane: u32, same: bool) -> String {
    (0..)
        .map(|n| format!("{prefix}-{n}"))
        .find(|id| (lane_of(None, id) == lane) == same)
        .unwrap()
}

// ---------------------------------------------------------------------------------------------
// Operator API

#[tokio::test]
async fn headers_of_any_json_value_reach_the_handler_as_text() {
    let db = test_db("json_headers").await;
    let store = store(&db).await;
    publish_unkeyed(&store, "h", 1, at(0)).await;
    // Another writer of the specification's format may store headers of any JSON value.
    db.db()
        .collection::<Document>("relaybus_events")
        .update_one(
            doc! { "_id": "h-0" },
            doc! { "$set": { "headers": {
                "tenant": "acme",
                "retries": 3,
                "route": { "region": "eu" },
                "flags": [true, null],
            } } },
        )
        .await
        .unwrap();
    let batch = claim(&store, "w", 1, at(1)).await;
    let headers = batch[0].event().headers();
    assert_eq!(headers["tenant"], "acme");
    assert_eq!(headers["retries"], "3");
    assert_eq!(headers["route"], r#"{"region":"eu"}"#);
    assert_eq!(headers["flags"], "[true,null]");
    assert_eq!(headers.len(), 4, "none dropped: {headers:?}");
}

#[tokio::test]
async fn gauge_samples_of_one_store_instance_share_a_count_while_it_is_young() {
    let db = test_db("gauge_sample").await;
    let (client, count, names) = counting_client(&db).await;
    let store = store_with(&client, &db, false).await;
    publish_unkeyed(&store, "g", 1, at(0)).await;
    let pending = |stats: &[relaybus::HandlerStatistics]| -> Vec<u64> {
        stats.iter().map(|handler| handler.pending).collect()
    };

    // What one count sends.
    let before = count.load(Ordering::SeqCst);
    assert_eq!(
        pending(&Inspect::handler_statistics(&store).await.unwrap()),
        [1]
    );
    let one_count = count.load(Ordering::SeqCst) - before;
    assert!(one_count > 0);

    // Two buses of one instance sampling at once: one count.
    let age = Duration::from_secs(60);
    let before = count.load(Ordering::SeqCst);
    names.lock().unwrap().clear();
    let other = store.clone();
    let (first, second) = futures::join!(
        Inspect::gauge_statistics(&store, age),
        Inspect::gauge_statistics(&other, age)
    );
    let (first, second) = (first.unwrap(), second.unwrap());
    assert_eq!(pending(&first), [1]);
    assert_eq!(first, second);
    assert_eq!(
        count.load(Ordering::SeqCst) - before,
        one_count,
        "{:?}",
        names.lock().unwrap()
    );

    // A delivery later: a sample within the age reports the count it shares; one that asks
    // for a newer count, and the operators' statistics, count again.
    publish_unkeyed(&store, "h", 1, at(0)).await;
    let before = count.load(Ordering::SeqCst);
    let shared = Inspect::gauge_statistics(&store, age).await.unwrap();
    assert_eq!(pending(&shared), [1]);
    assert_eq!(count.load(Ordering::SeqCst), before, "no command");
    let fresh = Inspect::gauge_statistics(&store, Duration::ZERO)
        .await
        .unwrap();
    assert_eq!(pending(&fresh), [2]);
    assert_eq!(
        pending(&Inspect::handler_statistics(&store).await.unwrap()),
        [2]
    );
    // Another instance counts for itself.
    let apart = store_with(&client, &db, false).await;
    assert_eq!(
        pending(&Inspect::gauge_statistics(&apart, age).await.unwrap()),
        [2]
    );
}

#[tokio::test]
async fn statistics_and_listings_work_after_the_listing_indexes_are_dropped() {
    let db = test_db("dropped_listing_indexes").await;
    let store = store(&db).await;
    publish_unkeyed(&store, "s", 3, at(0)).await;
    let batch = claim(&store, "w", 1, at(1)).await;
    assert!(store.bury(batch[0].lease(), "broken", at(2)).await.unwrap());
    // The specification allows dropping them when listings are not filtered.
    let deliveries = db.db().collection::<Document>("relaybus_deliveries");
    for index in ["status_created", "handler_created", "type_created"] {
        deliveries.drop_index(index).await.unwrap();
    }
    let stats = store.statistics().await.unwrap();
    assert_eq!((stats.pending, stats.dead), (2, 1), "{stats:?}");
    let per_handler = store.handler_statistics().await.unwrap();
    assert_eq!(per_handler.len(), 1, "{per_handler:?}");
    assert_eq!((per_handler[0].pending, per_handler[0].dead), (2, 1));
    let listed = store
        .list_deliveries(
            &DeliveryQuery::new()
                .handler(HANDLER)
                .status(DeliveryStatus::Dead),
        )
        .await
        .unwrap();
    assert_eq!(listed.len(), 1);
}
#[tokio::test]
async fn requeue_makes_a_dead_delivery_pending_again_ahead_of_its_key() {
    let db = test_db("requeue").await;
    let store = store(&db).await;
    let keyed: Vec<EventEnvelope> = (0..3)
        .map(|i| event(&format!("q-{i}"), Some("acct-9")))
        .collect();
    publish(&store, &keyed, &[HANDLER], at(0)).await;
    let first = claim(&store, "w", 5, at(1)).await.remove(0);
    assert!(store.bury(first.lease(), "bad data", at(2)).await.unwrap());
    let second = claim(&store, "w", 5, at(3)).await.remove(0);
    assert_eq!(second.sequence(), Some(2));

    // A later delivery of its key runs: the requeue waits.
    let dead_id = first.delivery_id().to_hex();
    let refused = store
        .requeue(&[dead_id.as_str(), "{\"$ne\": null}", "nope"], at(4))
        .await
        .unwrap();
    assert_eq!(refused.blocked, vec![first.delivery_id().to_hex()]);
    assert!(refused.requeued.is_empty());
    assert_eq!(refused.not_found, vec!["{\"$ne\": null}", "nope"]);
    assert_eq!(
        delivery(&db, first.delivery_id())
            .await
            .unwrap()
            .get_str("status")
            .unwrap(),
        "dead"
    );

    assert!(store.complete(second.lease(), at(5)).await.unwrap());
    let done = store.requeue(&[dead_id.as_str()], at(6)).await.unwrap();
    assert_eq!(done.requeued, vec![first.delivery_id().to_hex()]);
    let doc = delivery(&db, first.delivery_id()).await.unwrap();
    assert_eq!(doc.get_str("status").unwrap(), "pending");
    assert_eq!(attempts(&doc), 0);
    assert_eq!(
        lane(&db, first.lease().lane())
            .await
            .get_i64("requeues")
            .unwrap(),
        1
    );

    // It goes before the third one, which waits for it.
    let next = claim(&store, "w", 5, at(7)).await;
    assert_eq!(next.len(), 1);
    assert_eq!(next[0].sequence(), Some(1));
    assert_eq!(next[0].attempt(), 1);
    assert!(store.complete(next[0].lease(), at(8)).await.unwrap());
    let last = claim(&store, "w", 5, at(9)).await;
    assert_eq!(last[0].sequence(), Some(3));
}

#[tokio::test]
async fn statistics_and_listing_count_and_filter_with_plain_values() {
    let db = test_db("operator").await;
    let store = store_with(&db.client, &db, true).await;
    publish_unkeyed(&store, "s", 4, at(0)).await;
    let other = event("other-1", None);
    publish(&store, &[other], &["mailer"], at(10)).await;
    let batch = claim(&store, "w", 4, at(20)).await;
    assert!(store.complete(batch[0].lease(), at(21)).await.unwrap());
    assert!(
        store
            .bury(batch[1].lease(), "broken", at(22))
            .await
            .unwrap()
    );

    let stats = store.statistics().await.unwrap();
    assert_eq!(stats.pending, 3, "two running, one of another handler");
    assert_eq!(stats.running, 2);
    assert_eq!(stats.dead, 1);
    assert_eq!(stats.completed, 1);
    assert_eq!(stats.parked, 0);
    assert_eq!(stats.oldest_due_at, Some(at(0).into()));

    let dead = store
        .list_deliveries(&DeliveryQuery::new().status(DeliveryStatus::Dead))
        .await
        .unwrap();
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].last_error.as_deref(), Some("broken"));
    assert_eq!(dead[0].attempts, 1);
    let mailer = store
        .list_deliveries(&DeliveryQuery::new().handler("mailer"))
        .await
        .unwrap();
    assert_eq!(mailer.len(), 1);
    assert_eq!(mailer[0].event_id, "other-1");
    let by_time = store
        .list_deliveries(
            &DeliveryQuery::new()
                .created_from(at(5))
                .created_before(at(15)),
        )
        .await
        .unwrap();
    assert_eq!(by_time.len(), 1);
    let by_type = store
        .list_deliveries(&DeliveryQuery::new().event_type("order.placed.v1").limit(2))
        .await
        .unwrap();
    assert_eq!(by_type.len(), 2);
    let page_two = store
        .list_deliveries(
            &DeliveryQuery::new()
                .event_type("order.placed.v1")
                .after(by_type[1].id.clone())
                .limit(2),
        )
        .await
        .unwrap();
    assert_eq!(page_two.len(), 2);
    assert!(by_type.iter().all(|r| !page_two.contains(r)));
    assert!(
        by_type[1].id < page_two[0].id,
        "a page starts after the last id of the one before"
    );
    // Operator input is a plain string, never a query operator.
    let injected = store
        .list_deliveries(&DeliveryQuery::new().handler("{\"$ne\": null}"))
        .await
        .unwrap();
    assert!(injected.is_empty());
}

#[tokio::test]
async fn purge_never_leaves_a_delivery_without_its_event() {
    let db = test_db("purge").await;
    let store = store_with(&db.client, &db, true).await;
    // e-mixed: one dead, one pending delivery. e-done: completed. e-dead: dead only.
    // e-none: no handlers at all.
    publish(
        &store,
        &[event("e-mixed", None)],
        &[HANDLER, "mailer"],
        at(0),
    )
    .await;
    publish(
        &store,
        &[event("e-done", None), event("e-dead", None)],
        &[HANDLER],
        at(0),
    )
    .await;
    publish(&store, &[event("e-none", None)], &[], at(0)).await;
    let batch = claim(&store, "w", 10, at(1)).await;
    assert_eq!(batch.len(), 3);
    for d in &batch {
        match d.event_id() {
            "e-done" => assert!(store.complete(d.lease(), at(100)).await.unwrap()),
            _ => assert!(store.bury(d.lease(), "x", at(2)).await.unwrap()),
        }
    }
    let event_ids = async || relaybus_tests::support::event_ids(&db).await;
    let every_delivery_has_its_event = async || {
        let ids = event_ids().await;
        for d in deliveries(&db).await {
            assert!(
                ids.contains(&d.get_str("eventId").unwrap().to_owned()),
                "{d:?} lost its event"
            );
        }
    };

    // Dead letters go; an event still referenced stays; a completed event stays as a dedupe
    // record while its completion is within retention, however old the event.
    let cutoff = at(50);
    let purged = store
        .purge(
            &PurgeOptions::new()
                .dead_before(cutoff)
                .completed_before(cutoff),
        )
        .await
        .unwrap();
    assert_eq!(purged.dead_deliveries, 2);
    assert_eq!(purged.completion_records, 0);
    assert_eq!(
        purged.events, 2,
        "e-dead with its dead letter, e-none by age"
    );
    assert_eq!(event_ids().await, vec!["e-done", "e-mixed"]);
    every_delivery_has_its_event().await;

    // Once completed retention passes the completion, the record and the event go.
    let purged = store
        .purge(&PurgeOptions::new().completed_before(at(101)))
        .await
        .unwrap();
    assert_eq!(purged.completion_records, 1);
    assert_eq!(purged.events, 1);
    assert_eq!(event_ids().await, vec!["e-mixed"]);
    every_delivery_has_its_event().await;

    // Purging while publishers add deliveries to the same events never orphans a delivery.
    let racers: Vec<EventEnvelope> = (0..200)
        .map(|i| event(&format!("race-{i}"), None))
        .collect();
    publish(&store, &racers, &[], at(0)).await;
    let published = AtomicUsize::new(0);
    let republish = async {
        for chunk in racers.chunks(10) {
            publish(&store, chunk, &["late-handler"], at(200)).await;
            published.fetch_add(1, Ordering::SeqCst);
            tokio::task::yield_now().await;
        }
    };
    let purge = async {
        let mut total = 0;
        while published.load(Ordering::SeqCst) < 20 {
            total += store
                .purge(&PurgeOptions::new().dead_before(at(300)))
                .await
                .unwrap()
                .events;
        }
        total
    };
    let ((), purged_events) = tokio::join!(republish, purge);
    every_delivery_has_its_event().await;
    let late = deliveries(&db)
        .await
        .iter()
        .filter(|d| d.get_str("handler") == Ok("late-handler"))
        .count();
    assert_eq!(
        late, 200,
        "every republished event kept or got its delivery"
    );
    eprintln!("purged {purged_events} events while publishing");
}

#[tokio::test]
async fn a_renewal_goes_through_another_delivery_of_the_lane_when_one_has_completed() {
    let db = test_db("renew_lane").await;
    let store = store(&db).await;
    // One keyed event for two handlers: both deliveries are in the key's lane.
    publish(&store, &[event("e-1", Some("k"))], &["a", "b"], at(0)).await;
    let claimed = store
        .claim("w1", &["a", "b"], 10, LEASE, at(0))
        .await
        .unwrap();
    assert_eq!(claimed.len(), 2);
    let (done, running) = (*claimed[0].lease(), *claimed[1].lease());
    assert_eq!(done.lane(), running.lane());
    assert_eq!(store.complete_many(&[done], at(1)).await.unwrap(), [true]);

    // The completed delivery comes first: the lane is renewed through the one still running.
    let renewed_at = at(20);
    let covered = Queue::renew(&store, &[done, running], LEASE, renewed_at.into())
        .await
        .unwrap();
    assert_eq!(covered, 2, "the lane's lease covers both leases given");
    let lane = db
        .db()
        .collection::<Document>("relaybus_lanes")
        .find_one(doc! { "_id": running.lane() as i32 })
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        lane.get_datetime("leaseExpiresAt")
            .unwrap()
            .timestamp_millis(),
        renewed_at.timestamp_millis() + LEASE.as_millis() as i64,
        "{lane}"
    );
}

// ---------------------------------------------------------------------------------------------
// The next delivery of a key, claimed by the worker that completed its predecessor

/// Publishes 40 deliveries of the key `k` and claims the first for worker `w`, at second 1: the
/// claim parks the 39 waiting behind it.
async fn claim_head_of_parked_backlog(store: &MongoEventStore, db: &TestDb) -> ClaimedDelivery {
    let events: Vec<EventEnvelope> = (0..40)
        .map(|n| event(&format!("k-{n}"), Some("k")))
        .collect();
    publish(store, &events, &[HANDLER], at(0)).await;
    let mut head = claim(store, "w", 10, at(1)).await;
    assert_eq!(head.len(), 1);
    assert_eq!(parked_count(db).await, 39);
    head.remove(0)
}

/// A claim sends the parked head of a key whose predecessor finished back to its lane and runs
/// it from there. Buried, it is out of the parked lane, where it would stand for its key and
/// hide the key's next deliveries.
#[tokio::test]
async fn a_key_s_parked_head_goes_back_to_its_lane_and_buried_leaves_the_next_ones_free() {
    let db = test_db("parked_head_buried").await;
    let store = store(&db).await;
    let head = claim_head_of_parked_backlog(&store, &db).await;
    assert!(store.complete(head.lease(), at(2)).await.unwrap());

    let next = claim(&store, "w", 10, at(3)).await;
    assert_eq!(next.len(), 1);
    assert_eq!(next[0].sequence(), Some(2));
    // Unparked before the claim picked it: it runs from the ready lane.
    let doc = delivery(&db, next[0].delivery_id()).await.unwrap();
    assert_eq!(doc.get_str("lane").unwrap(), "ready");
    let stats = store.statistics().await.unwrap();
    assert_eq!((stats.running, stats.parked), (1, 38));

    assert!(store.bury(next[0].lease(), "poison", at(4)).await.unwrap());
    let doc = delivery(&db, next[0].delivery_id()).await.unwrap();
    assert_eq!(doc.get_str("status").unwrap(), "dead");
    assert_eq!(doc.get_str("lane").unwrap(), "ready");
    let stats = store.statistics().await.unwrap();
    assert_eq!((stats.dead, stats.parked, stats.running), (1, 38, 0));
    let after = claim(&store, "w", 10, at(5)).await;
    assert_eq!(after.len(), 1, "the key's next delivery");
    assert_eq!(after[0].sequence(), Some(3));
}

/// A dead delivery left in the parked lane (as burying one that ran from there used to leave
/// it) holds back its key's next deliveries until `setup()` moves it out.
#[tokio::test]
async fn setup_moves_a_dead_delivery_out_of_the_parked_lane_and_frees_its_key() {
    let db = test_db("dead_parked_setup").await;
    let store = store(&db).await;
    let head = claim_head_of_parked_backlog(&store, &db).await;
    assert!(store.bury(head.lease(), "poison", at(2)).await.unwrap());
    let deliveries = db.db().collection::<Document>("relaybus_deliveries");
    deliveries
        .update_one(
            doc! { "_id": head.delivery_id() },
            doc! { "$set": { "lane": "parked" } },
        )
        .await
        .unwrap();
    assert!(
        claim(&store, "w", 10, at(3)).await.is_empty(),
        "the dead head stands for its key in the parked lane"
    );

    // The setup of the next start (a store runs its own once).
    let _restarted = self::store(&db).await;
    let doc = delivery(&db, head.delivery_id()).await.unwrap();
    assert_eq!(
        (doc.get_str("status").unwrap(), doc.get_str("lane").unwrap()),
        ("dead", "ready")
    );
    let next = claim(&store, "w", 10, at(4)).await;
    assert_eq!(next.len(), 1, "the key's next delivery");
    assert_eq!(next[0].sequence(), Some(2));
}

// ---------------------------------------------------------------------------------------------
// Claims beside a running claim

/// The lane (`ready` or `parked`) of each pending delivery, by event id, sorted.
async fn lanes_by_event(db: &TestDb) -> Vec<(String, String)> {
    let mut lanes: Vec<(String, String)> = deliveries(db)
        .await
        .iter()
        .map(|d| {
            (
                d.get_str("eventId").unwrap().to_owned(),
                d.get_str("lane").unwrap().to_owned(),
            )
        })
        .collect();
    lanes.sort();
    lanes
}

#[tokio::test]
async fn an_append_writes_parked_what_waits_behind_a_delivery_of_the_same_append() {
    let db = test_db("born_parked_batch").await;
    let store = store(&db).await;
    assert!(!store.park_behind_pending(), "off by default");
    publish(&store, &[event("k-0", Some("k"))], &[HANDLER], at(0)).await;
    // Without looking up what is pending: k-1 is its append's first of `k`, k-2 waits behind
    // it in the same append.
    publish(
        &store,
        &[event("k-1", Some("k")), event("k-2", Some("k"))],
        &[HANDLER],
        at(0),
    )
    .await;
    let expected = [("k-0", "ready"), ("k-1", "ready"), ("k-2", "parked")]
        .map(|(id, lane)| (id.to_owned(), lane.to_owned()));
    assert_eq!(lanes_by_event(&db).await, expected);
}

/// A store over `db` whose appends look up the pending deliveries of their keys.
async fn store_parking_behind_pending(client: &Client, db: &TestDb) -> MongoEventStore {
    store_built(client, db, |builder| builder.park_behind_pending(true)).await
}

#[tokio::test]
async fn an_append_writes_parked_what_waits_behind_a_pending_delivery_of_its_key() {
    let db = test_db("born_parked").await;
    let store = store_parking_behind_pending(&db.client, &db).await;
    publish(
        &store,
        &[event("k-0", Some("k")), event("j-0", Some("j"))],
        &[HANDLER],
        at(0),
    )
    .await;
    // While k-0 is pending, k-1 and k-2 wait behind it, appended alone or with others; the first
    // delivery of a new key and an unkeyed one do not wait.
    publish(&store, &[event("k-1", Some("k"))], &[HANDLER], at(0)).await;
    publish(
        &store,
        &[
            event("k-2", Some("k")),
            event("n-0", Some("n")),
            event("n-1", Some("n")),
            event("u-0", None),
        ],
        &[HANDLER],
        at(0),
    )
    .await;
    let expected = [
        ("j-0", "ready"),
        ("k-0", "ready"),
        ("k-1", "parked"),
        ("k-2", "parked"),
        ("n-0", "ready"),
        ("n-1", "parked"),
        ("u-0", "ready"),
    ]
    .map(|(id, lane)| (id.to_owned(), lane.to_owned()));
    assert_eq!(lanes_by_event(&db).await, expected);

    // Each key goes on in order, one delivery of it per claim, each found by the claim after
    // its predecessor completed.
    let mut order: Vec<String> = Vec::new();
    for round in 0..3 {
        let batch = claim(&store, "w", 10, at(1 + round * 2)).await;
        let keys: Vec<&str> = batch.iter().filter_map(|d| d.key()).collect();
        let distinct: HashSet<&str> = keys.iter().copied().collect();
        assert_eq!(
            keys.len(),
            distinct.len(),
            "one delivery of a key at a time"
        );
        order.extend(
            batch
                .iter()
                .filter(|d| d.key() == Some("k"))
                .map(|d| d.event_id().to_owned()),
        );
        for delivery in &batch {
            assert!(
                store
                    .complete(delivery.lease(), at(2 + round * 2))
                    .await
                    .unwrap()
            );
        }
    }
    assert_eq!(order, ["k-0", "k-1", "k-2"]);
    assert!(
        deliveries(&db).await.is_empty(),
        "all drained in three claims"
    );
}

#[tokio::test]
async fn a_delivery_written_parked_behind_one_that_completed_before_its_commit_is_claimed_next() {
    let db = test_db("born_parked_race").await;
    let (client, count, _) = counting_client(&db).await;
    let store = store_parking_behind_pending(&client, &db).await;
    publish(&store, &[event("k-0", Some("k"))], &[HANDLER], at(0)).await;
    let (_, head) = boundary_claimed(&store, &count, ms(0)).await;
    assert_eq!(head.len(), 1);
    let lease = head[0].lease;
    let mut wake_ups = {
        Queue::watch(&store, &[HANDLER.to_owned()])
            .await
            .expect("watch")
    };

    // k-1 is appended while k-0 runs; k-0 completes before the append commits, and the owner's
    // next claim finds nothing (k-1 is not committed yet) and goes idle.
    let next = event("k-1", Some("k"));
    let handlers = [HANDLER.to_owned()];
    let completed = AtomicBool::new(false);
    store
        .transaction(async |session| {
            let appended = store
                .append(session, &[AppendRequest::new(&next, &handlers)], at(0))
                .await?;
            if !completed.swap(true, Ordering::SeqCst) {
                assert!(store.complete(&lease, ms(1)).await?);
                let (_, none) = boundary_claimed(&store, &count, ms(2)).await;
                assert!(none.is_empty());
            }
            Ok(appended)
        })
        .await
        .unwrap();
    assert_eq!(
        lanes_by_event(&db).await,
        [("k-1".to_owned(), "parked".to_owned())],
        "written behind a delivery that was pending when the append read"
    );

    // Its insert is reported, written parked (the store's claims look for parked deliveries
    // again): the next claim takes it, nothing being pending before it.
    let woken = next_wake_ups(&mut wake_ups, 1).await;
    assert_eq!(woken[0].at, Some(lane_of(Some("k"), "k-1")));
    let (_, got) = boundary_claimed(&store, &count, ms(3)).await;
    let ids: Vec<&str> = got.iter().map(|c| c.event.id()).collect();
    assert_eq!(ids, ["k-1"]);
}

/// Deliveries released and claimed again, in every position among the claims that read their
/// lanes and those that take them from memory, with more due than a claim's first pages hold
/// (so claims read lanes deeper): a claim never hands out what the owner runs.
#[tokio::test]
async fn deliveries_released_and_claimed_again_are_never_handed_out_while_they_run() {
    let db = test_db("release_reclaim").await;
    let store = store(&db).await;
    publish_unkeyed(&store, "r", 400, at(0)).await;
    let mut held: Vec<ClaimedDelivery> = Vec::new();
    for round in 0..60i64 {
        // Give back a third of what runs, a different third each round.
        let (back, kept): (Vec<_>, Vec<_>) = held
            .into_iter()
            .enumerate()
            .partition(|(n, _)| (*n as i64 + round) % 3 == 0);
        held = kept.into_iter().map(|(_, running)| running).collect();
        for (_, running) in back {
            assert!(store.release(running.lease(), at(1 + round)).await.unwrap());
        }
        let batch = claim(&store, "w", 10, at(1 + round)).await;
        let running: HashSet<ObjectId> = held.iter().map(ClaimedDelivery::delivery_id).collect();
        let again: Vec<ObjectId> = ids(&batch)
            .into_iter()
            .filter(|id| running.contains(id))
            .collect();
        assert!(
            again.is_empty(),
            "round {round}: handed out {again:?}, which run"
        );
        let distinct: HashSet<ObjectId> = ids(&batch).into_iter().collect();
        assert_eq!(
            distinct.len(),
            batch.len(),
            "round {round}: one claim, one hand-out each"
        );
        held.extend(batch);
    }
}
