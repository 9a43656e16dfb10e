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
use metrics_util::debugging::{DebugValue, DebuggingRecorder};
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
    event::lane_of, telemetry,
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

/// A client named after `db` and `app` that keeps every command it sends, by name.
async fn commands_client(db: &TestDb, app: &str) -> (Client, Arc<Mutex<Vec<(String, Document)>>>) {
    let mut options = ClientOptions::parse(&db.uri).await.unwrap();
    options.app_name = Some(format!("{}-{app}", db.name));
    let commands: Arc<Mutex<Vec<(String, Document)>>> = Arc::default();
    let seen = Arc::clone(&commands);
    options.command_event_handler = Some(EventHandler::callback(move |event| {
        if let CommandEvent::Started(started) = event {
            seen.lock()
                .unwrap()
                .push((started.command_name, started.command));
        }
    }));
    (Client::with_options(options).unwrap(), commands)
}

/// The `aggregate` commands among `commands` (as kept by [`commands_client`]), taken out of it
/// with every other command.
fn take_aggregates(commands: &Mutex<Vec<(String, Document)>>) -> Vec<Document> {
    std::mem::take(&mut *commands.lock().unwrap())
        .into_iter()
        .filter(|(name, _)| name == "aggregate")
        .map(|(_, command)| command)
        .collect()
}

/// Whether an aggregation, as sent, is a claim's lane read: it reads the lanes collection,
/// and unlike a completion's fence read it does not filter their in-flight lists.
fn is_lane_read(command: &str) -> bool {
    command.contains("relaybus_lanes") && !command.contains("$filter")
}

/// The claims' lane reads among `sent` (recorded commands by name), as sent (text).
fn lane_reads(sent: &[(String, Document)]) -> Vec<String> {
    sent.iter()
        .filter(|(name, _)| name == "aggregate")
        .map(|(_, command)| command.to_string())
        .filter(|command| is_lane_read(command))
        .collect()
}

/// A client named `app` that notifies the returned `Notify` of each command event `tells`
/// accepts while the returned flag is set.
async fn client_telling(
    db: &TestDb,
    app: &str,
    tells: impl Fn(&CommandEvent) -> bool + Send + Sync + 'static,
) -> (Client, Arc<AtomicBool>, Arc<Notify>) {
    let mut options = ClientOptions::parse(&db.uri).await.unwrap();
    options.app_name = Some(app.to_owned());
    let armed = Arc::new(AtomicBool::new(false));
    let told = Arc::new(Notify::new());
    let (a, t) = (Arc::clone(&armed), Arc::clone(&told));
    options.command_event_handler = Some(EventHandler::callback(move |event| {
        if a.load(Ordering::SeqCst) && tells(&event) {
            t.notify_one();
        }
    }));
    (Client::with_options(options).unwrap(), armed, told)
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

/// Completes every delivery of `batch`, each of which must complete.
async fn complete_all(store: &MongoEventStore, batch: &[ClaimedDelivery], now: DateTime) {
    let completed = store.complete_many(&leases(batch), now).await.unwrap();
    assert!(completed.iter().all(|done| *done), "{completed:?}");
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
    for run in [0, 1_001] {
        let outcome = store.claim_runs("w", &[HANDLER], 1, run, LEASE, now).await;
        assert!(
            matches!(&outcome, Err(Error::InvalidArgument(error)) if error.to_string().contains("1 to 1000")),
            "run {run}: {outcome:?}"
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
async fn free_lanes_are_taken_oldest_due_first_and_empty_ones_handed_back() {
    let db = test_db("lane_rounds").await;
    let store = store(&db).await;
    // 40 deliveries in different lanes, the oldest one due first.
    for i in 0..40 {
        publish_unkeyed(&store, &format!("round{i}"), 1, at(i)).await;
    }
    let oldest = deliveries(&db)
        .await
        .into_iter()
        .find(|d| d.get_str("eventId") == Ok("round0-0"))
        .unwrap();
    let batch = claim(&store, "w", 1, at(100)).await;
    assert_eq!(batch.len(), 1);
    assert_eq!(
        batch[0].event_id(),
        "round0-0",
        "the oldest due delivery first"
    );
    let held = lanes_of(&db, "w").await;
    assert_eq!(
        held.len(),
        1,
        "lanes that yielded nothing were handed back: {held:?}"
    );
    assert_eq!(
        held[0].get_i32("_id").unwrap(),
        oldest.get_i32("laneId").unwrap()
    );
    // Three more lanes were taken in that round and handed back: their epochs moved on.
    let lanes = db.db().collection::<Document>("relaybus_lanes");
    let taken = lanes
        .count_documents(doc! { "epoch": { "$gt": 0_i64 } })
        .await
        .unwrap();
    assert_eq!(taken, 4, "the first round takes 4 lanes");

    // A bigger claim takes more lanes per round and gets everything.
    let rest = claim(&store, "w", 100, at(100)).await;
    assert_eq!(rest.len(), 39);
    let all: HashSet<ObjectId> = ids(&rest).into_iter().chain(ids(&batch)).collect();
    assert_eq!(all.len(), 40);
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
async fn a_claimer_that_found_nothing_is_counted_and_gets_lanes_handed_on() {
    let db = test_db("share_lanes").await;
    let a = store(&db).await;
    let (client, commands) = commands_client(&db, "b").await;
    let b = store_without_heartbeat(&client, &db).await;
    let events: Vec<EventEnvelope> = (0..3)
        .flat_map(|n| (0..12).map(move |k| (n, k)))
        .map(|(n, k)| event(&format!("k{k}-{n}"), Some(&format!("k{k}"))))
        .collect();
    publish(&a, &events, &[HANDLER], at(0)).await;

    // `a` takes the lanes of every key: a claim hands out one delivery of a key.
    let first = claim(&a, "a", 100, at(1)).await;
    assert_eq!(first.len(), 12);
    let a_lanes = lanes_of(&db, "a").await.len();
    assert!(a_lanes > 2, "{a_lanes} lanes");
    // `b` finds nothing, and keeps one lane listing nothing, to be counted.
    assert!(claim(&b, "b", 100, at(2)).await.is_empty());
    let kept = lanes_of(&db, "b").await;
    assert_eq!(kept.len(), 1, "{kept:?}");
    assert!(in_flight(&kept[0]).is_empty());

    // `a` keeps its share of the lanes held and hands the rest back unread.
    complete_all(&a, &first, at(3)).await;
    let second = claim(&a, "a", 100, at(4)).await;
    let share = (a_lanes + 1).div_ceil(2);
    let a_now = lanes_of(&db, "a").await;
    assert_eq!(a_now.len(), share, "{a_now:?}");
    let a_keys: HashSet<String> = second
        .iter()
        .map(|delivery| delivery.key().unwrap().to_owned())
        .collect();
    assert!(!second.is_empty() && second.len() < 12, "{}", second.len());

    // `b` takes them: the keys `a` no longer holds, none that `a` runs; first those of its own
    // slot among the two claimers, then, finding nothing more there, the others.
    let mut b_claim = claim(&b, "b", 100, at(5)).await;
    assert!(!b_claim.is_empty());
    b_claim.extend(claim(&b, "b", 100, at(5)).await);
    let b_keys: HashSet<String> = b_claim
        .iter()
        .map(|delivery| delivery.key().unwrap().to_owned())
        .collect();
    assert_eq!(
        a_keys.len() + b_keys.len(),
        12,
        "a: {a_keys:?}, b: {b_keys:?}"
    );
    assert!(a_keys.is_disjoint(&b_keys));
    for delivery in second.iter().chain(&b_claim) {
        assert!(
            delivery.event_id().ends_with("-1"),
            "each key's second event"
        );
    }
    // `b` holds the lanes it took, its kept one among them.
    let b_lanes: HashSet<i32> = lanes_of(&db, "b")
        .await
        .iter()
        .map(|lane| lane.get_i32("_id").unwrap())
        .collect();
    assert!(b_lanes.len() > 1);
    for delivery in &b_claim {
        assert!(b_lanes.contains(&(delivery.lease().lane() as i32)));
    }

    // Finding nothing while its lanes run something, `b` keeps them as it would anyway: no
    // lane is written for it.
    commands.lock().unwrap().clear();
    assert!(claim(&b, "b", 100, at(6)).await.is_empty());
    let lane_writes: Vec<Document> = std::mem::take(&mut *commands.lock().unwrap())
        .into_iter()
        .filter(|(name, command)| {
            name == "update" && command.get_str("update") == Ok("relaybus_lanes")
        })
        .map(|(_, command)| command)
        .collect();
    assert!(lane_writes.is_empty(), "{lane_writes:?}");
}

#[tokio::test]
async fn a_claim_that_found_nothing_in_the_lanes_it_kept_takes_the_ones_it_handed_on() {
    let db = test_db("share_again").await;
    let a = store(&db).await;
    let b = another_instance(&db).await;
    let mut used = HashSet::new();
    let events = events_in_new_lanes("f", 12, &mut used);
    publish(&a, &events, &[HANDLER], at(0)).await;
    let first = claim(&a, "a", 100, at(1)).await;
    assert_eq!(first.len(), 12);
    assert!(claim(&b, "b", 100, at(2)).await.is_empty());
    assert_eq!(lanes_of(&db, "b").await.len(), 1, "b waits");
    complete_all(&a, &first, at(3)).await;
    // New work only in the five lanes `a` hands on first (its highest), none in the seven it
    // keeps (its share of 13 lanes held by two).
    let mut lanes: Vec<u32> = first.iter().map(|d| d.lease().lane()).collect();
    lanes.sort_unstable();
    let more: Vec<EventEnvelope> = lanes[7..]
        .iter()
        .map(|lane| {
            let id = (0..)
                .map(|i| format!("g{lane}-{i}"))
                .find(|id| lane_of(None, id) == *lane)
                .unwrap();
            event(&id, None)
        })
        .collect();
    publish(&a, &more, &[HANDLER], at(3)).await;

    // `a` finds nothing in the lanes it keeps and hands five on; it does not come back empty
    // beside free work, but takes only those of its own slot among the two claimers: the
    // others are `b`'s, who takes them.
    let second = claim(&a, "a", 100, at(4)).await;
    assert!(
        !second.is_empty(),
        "the claim does not come back empty beside free work"
    );
    let third = claim(&b, "b", 100, at(4)).await;
    let mut got: Vec<String> = second
        .iter()
        .chain(&third)
        .map(|d| d.event_id().to_owned())
        .collect();
    got.sort();
    let mut wanted: Vec<String> = more.iter().map(|e| e.id().to_owned()).collect();
    wanted.sort();
    assert_eq!(got, wanted);
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

/// A claim of `owner` through the store boundary, handing out runs of up to `run` deliveries
/// of a key.
async fn claim_runs(
    store: &MongoEventStore,
    owner: &str,
    run: u32,
    now: DateTime,
) -> Vec<relaybus::store::Claimed<Lease>> {
    use relaybus::store::ClaimRequest;
    let handlers = [HANDLER.to_owned()];
    Queue::claim(
        store,
        ClaimRequest {
            owner,
            handlers: &handlers,
            limit: 32,
            run,
            runs: 8,
            lease_duration: LEASE,
            now: std::time::SystemTime::from(now).into(),
            reported: &[],
            reports_complete: false,
            arrivals: &[],
        },
    )
    .await
    .expect("claim")
}

/// The sequences handed out for `key`, in the order of the claim.
fn sequences_of(claimed: &[relaybus::store::Claimed<Lease>], key: &str) -> Vec<i64> {
    claimed
        .iter()
        .filter(|delivery| delivery.event.key() == Some(key))
        .filter_map(|delivery| delivery.sequence)
        .collect()
}

#[tokio::test]
async fn a_run_ends_before_a_member_whose_event_is_missing_and_gives_the_rest_back() {
    let db = test_db("run_missing_event").await;
    let store = store(&db).await;
    let events: Vec<EventEnvelope> = (1..=4)
        .map(|n| event(&format!("k-{n}"), Some("k")))
        .collect();
    publish(&store, &events, &[HANDLER], at(0)).await;
    // The third delivery's event is gone (a purge that went too far).
    db.db()
        .collection::<Document>("relaybus_events")
        .delete_one(doc! { "_id": "k-3" })
        .await
        .unwrap();

    let claimed = claim_runs(&store, "w", 16, at(1)).await;
    assert_eq!(
        sequences_of(&claimed, "k"),
        [1, 2],
        "the run stops before k-3"
    );
    // What was not handed out is not listed on the lane, nor charged.
    let listed: Vec<ObjectId> = lanes_of(&db, "w")
        .await
        .iter()
        .flat_map(in_flight)
        .collect();
    assert_eq!(listed.len(), 2, "only the two handed out stay listed");
    for d in deliveries(&db).await {
        let sequence = d.get_i64("sequence").unwrap();
        if sequence > 2 {
            assert_eq!(attempts(&d), 0, "not charged: {d:?}");
            assert!(!listed.contains(&d.get_object_id("_id").unwrap()));
        }
    }
}

#[tokio::test]
async fn a_claim_with_runs_hands_out_a_keys_next_deliveries_behind_its_head() {
    let db = test_db("runs").await;
    let store = store(&db).await;
    let mut events: Vec<EventEnvelope> = (1..=6)
        .map(|n| event(&format!("k-{n}"), Some("k")))
        .collect();
    events.push(event("j-1", Some("j")));
    publish(&store, &events, &[HANDLER], at(0)).await;
    // Key `g`: the handler takes its first and third events only, the second is another
    // handler's: its run ends at the gap.
    publish(&store, &[event("g-1", Some("g"))], &[HANDLER], at(0)).await;
    publish(&store, &[event("g-2", Some("g"))], &["other"], at(0)).await;
    publish(&store, &[event("g-3", Some("g"))], &[HANDLER], at(0)).await;

    let first = claim_runs(&store, "w", 4, at(1)).await;
    assert_eq!(sequences_of(&first, "k"), vec![1, 2, 3, 4], "a run of four");
    assert_eq!(sequences_of(&first, "j"), vec![1]);
    assert_eq!(
        sequences_of(&first, "g"),
        vec![1],
        "the run ends at the gap"
    );
    assert!(first.iter().all(|delivery| delivery.ordered));
    let k: Vec<&relaybus::store::Claimed<Lease>> = first
        .iter()
        .filter(|delivery| delivery.event.key() == Some("k"))
        .collect();
    let listed = in_flight(&lane(&db, k[0].lease.lane()).await);
    for delivery in &k {
        assert_eq!(delivery.lease.lane(), k[0].lease.lane());
        assert!(
            listed.contains(&delivery.lease.delivery_id()),
            "listed on the lane"
        );
    }

    // Nothing of a key whose run runs is handed out again.
    assert!(claim_runs(&store, "w", 4, at(2)).await.is_empty());
    let leases: Vec<Lease> = k.iter().map(|delivery| delivery.lease).collect();
    assert!(
        store
            .complete_many(&leases, at(3))
            .await
            .unwrap()
            .into_iter()
            .all(|done| done)
    );
    let second = claim_runs(&store, "w", 4, at(4)).await;
    assert_eq!(
        sequences_of(&second, "k"),
        vec![5, 6],
        "the rest of the key"
    );
    assert!(
        sequences_of(&second, "g").is_empty(),
        "g-3 waits for g-1, which still runs"
    );

    // Without runs, one delivery of a key at a time.
    let db = test_db("runs_one").await;
    let store = self::store(&db).await;
    publish(&store, &events[..6], &[HANDLER], at(0)).await;
    assert_eq!(
        sequences_of(&claim_runs(&store, "w", 1, at(1)).await, "k"),
        vec![1]
    );
}

#[tokio::test]
async fn claim_runs_groups_each_keys_run_in_sequence_order_and_a_released_rest_comes_back_uncharged()
 {
    let db = test_db("public_runs").await;
    let store = store(&db).await;
    let mut events: Vec<EventEnvelope> = (1..=5)
        .map(|n| event(&format!("k-{n}"), Some("k")))
        .collect();
    events.extend((1..=2).map(|n| event(&format!("j-{n}"), Some("j"))));
    events.extend((1..=2).map(|n| event(&format!("u-{n}"), None)));
    publish(&store, &events, &[HANDLER], at(0)).await;

    let runs = store
        .claim_runs("w", &[HANDLER], 10, 3, LEASE, at(1))
        .await
        .unwrap();
    let shape: Vec<(Option<&str>, Vec<Option<i64>>)> = runs
        .iter()
        .map(|run| {
            (
                run[0].key(),
                run.iter().map(ClaimedDelivery::sequence).collect(),
            )
        })
        .collect();
    let of = |key: Option<&str>| -> Vec<Vec<Option<i64>>> {
        shape
            .iter()
            .filter(|(k, _)| *k == key)
            .map(|(_, sequences)| sequences.clone())
            .collect()
    };
    assert_eq!(
        of(Some("k")),
        vec![vec![Some(1), Some(2), Some(3)]],
        "{shape:?}"
    );
    assert_eq!(of(Some("j")), vec![vec![Some(1), Some(2)]], "{shape:?}");
    assert_eq!(of(None), vec![vec![None], vec![None]], "unkeyed ones alone");

    // The first wave completes; `k-2` fails: the rest of its run goes back.
    let k = runs.iter().find(|run| run[0].key() == Some("k")).unwrap();
    assert!(store.complete(k[0].lease(), at(2)).await.unwrap());
    assert!(store.release(k[1].lease(), at(3)).await.unwrap());
    assert!(store.release(k[2].lease(), at(3)).await.unwrap());
    let again = store
        .claim_runs("w", &[HANDLER], 10, 3, LEASE, at(4))
        .await
        .unwrap();
    let k_again: Vec<(Option<i64>, u32)> = again
        .iter()
        .filter(|run| run[0].key() == Some("k"))
        .flatten()
        .map(|delivery| (delivery.sequence(), delivery.attempt()))
        .collect();
    assert_eq!(
        k_again,
        vec![(Some(2), 1), (Some(3), 1), (Some(4), 1)],
        "the released members come back first, uncharged"
    );
}

#[tokio::test]
async fn a_run_takes_the_parked_deliveries_behind_its_head_where_they_are() {
    let db = test_db("runs_parked").await;
    let store = store(&db).await;
    let events: Vec<EventEnvelope> = (1..=40)
        .map(|n| event(&format!("k-{n}"), Some("k")))
        .collect();
    publish(&store, &events, &[HANDLER], at(0)).await;
    let head = claim(&store, "w", 10, at(1)).await;
    assert_eq!(head.len(), 1);
    assert_eq!(parked_count(&db).await, 39, "the key's backlog is parked");
    assert!(store.complete(head[0].lease(), at(2)).await.unwrap());

    let run = claim_runs(&store, "w", 5, at(3)).await;
    assert_eq!(sequences_of(&run, "k"), vec![2, 3, 4, 5, 6]);
    for delivery in &run[1..] {
        let doc = delivery_doc(&db, delivery.lease.delivery_id()).await;
        assert_eq!(
            doc.get_str("lane").unwrap(),
            "parked",
            "a run member runs from the parked lane, unwritten"
        );
    }
    let leases: Vec<Lease> = run.iter().map(|delivery| delivery.lease).collect();
    assert!(
        store
            .complete_many(&leases, at(4))
            .await
            .unwrap()
            .into_iter()
            .all(|done| done)
    );
    let next = claim_runs(&store, "w", 5, at(5)).await;
    assert_eq!(sequences_of(&next, "k"), vec![7, 8, 9, 10, 11]);
}

#[tokio::test]
async fn a_run_lost_with_its_worker_charges_only_the_delivery_that_may_have_started() {
    let db = test_db("runs_lost").await;
    let a = store(&db).await;
    let b = another_instance(&db).await;
    let events: Vec<EventEnvelope> = (1..=4)
        .map(|n| event(&format!("k-{n}"), Some("k")))
        .collect();
    publish(&a, &events, &[HANDLER], at(0)).await;
    publish_unkeyed(&a, "u", 2, at(0)).await;
    let lost = claim_runs(&a, "a", 4, at(1)).await;
    assert_eq!(sequences_of(&lost, "k"), vec![1, 2, 3, 4]);
    assert_eq!(lost.len(), 6);

    // The worker died; another takes its lanes over once their leases ended.
    let taken = claim_runs(&b, "b", 4, at(40)).await;
    assert_eq!(sequences_of(&taken, "k"), vec![1, 2, 3, 4]);
    let attempts_of: HashMap<Option<i64>, u32> = taken
        .iter()
        .filter(|delivery| delivery.event.key() == Some("k"))
        .map(|delivery| (delivery.sequence, delivery.attempt))
        .collect();
    assert_eq!(
        attempts_of[&Some(1)],
        2,
        "the first of the run may have started"
    );
    for sequence in 2..=4 {
        assert_eq!(
            attempts_of[&Some(sequence)],
            1,
            "a run's later delivery waits for the first: never started"
        );
    }
    for delivery in taken
        .iter()
        .filter(|delivery| delivery.event.key().is_none())
    {
        assert_eq!(
            delivery.attempt, 2,
            "every unkeyed delivery may have started"
        );
    }
    for delivery in &lost {
        let doc = delivery_doc(&db, delivery.lease.delivery_id()).await;
        let charged = delivery.event.key().is_none() || delivery.sequence == Some(1);
        assert_eq!(attempts(&doc) == 1, charged, "{doc:?}");
        assert_eq!(doc.get_str("lastError").is_ok(), charged, "{doc:?}");
    }
    // The old leases, charged or not, change nothing any more.
    for delivery in &lost {
        assert!(!a.complete(&delivery.lease, at(41)).await.unwrap());
    }
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

async fn delivery_doc(db: &TestDb, id: ObjectId) -> Document {
    delivery(db, id).await.expect("the delivery")
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

#[tokio::test]
async fn a_listing_the_instance_did_not_hand_out_is_reconciled_by_the_next_claim() {
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
    let next = claim(&store, "w", 10, at(3)).await;
    assert_eq!(
        next.len(),
        1,
        "the orphan was taken out and claimed properly"
    );
    assert_eq!(next[0].delivery_id(), second_id);
    assert_eq!(next[0].lease().claims(), 1, "its generation moved on");
    assert_eq!(next[0].attempt(), 1);
    let listed = in_flight(&lane(&db, lane_id).await);
    assert_eq!(listed.len(), 2);
    assert!(listed.contains(&first.delivery_id()) && listed.contains(&second_id));
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
    let keyed: Vec<EventEnvelope> = (0..5)
        .map(|i| event(&format!("k-{i}"), Some("order-1")))
        .collect();
    publish(&store, &keyed, &[HANDLER], at(0)).await;
    publish_unkeyed(&store, "free", 3, at(1)).await;

    let batch = claim(&store, "w", 10, at(2)).await;
    let keyed_picks: Vec<&ClaimedDelivery> = batch.iter().filter(|d| d.key().is_some()).collect();
    assert_eq!(keyed_picks.len(), 1, "one delivery of a key per claim");
    assert_eq!(keyed_picks[0].sequence(), Some(1));
    assert_eq!(
        batch.len(),
        4,
        "the blocked key did not starve the unkeyed work"
    );
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
    // An idle claimer waits for another one to complete something instead of polling, as a
    // dispatcher waits for its polling interval.
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
                        notified.await;
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
    // The lane read, which also looks up the parked keys' lowest pending deliveries that
    // decide what to unpark, and the ranking of the free lanes (the claim is not full); the
    // per-key rules reuse the lane read's lookup instead of sending their own.
    let aggregations = sent.iter().filter(|name| *name == "aggregate").count();
    assert_eq!(aggregations, 2, "{sent:?}");
    assert!(used <= 7, "{used} commands: {sent:?}");
    // The heads were picked from that read and run from the parked lane: the held lane's first
    // page came with the read too (the heads left to the claim are still parked), so the
    // claim's second command is its ranking, its one `find` the events of its picks, and no
    // update sends the heads back to their lanes.
    assert_eq!(
        sent.get(1).map(String::as_str),
        Some("aggregate"),
        "{sent:?}"
    );
    assert_eq!(
        sent.iter().filter(|name| *name == "find").count(),
        1,
        "{sent:?}"
    );
    assert_eq!(
        sent.iter().filter(|name| *name == "update").count(),
        1,
        "the record alone: {sent:?}"
    );
    for head in &next {
        let doc = delivery(&db, head.delivery_id()).await.expect("the head");
        assert_eq!(doc.get_str("lane"), Ok("parked"), "{doc:?}");
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

/// A claim takes the deliveries its store instance completed as gone without reading them,
/// although their lanes still list them (a completion writes no lane document): its lane read
/// looks up nothing of what the held lanes list, no other command reads them, and its record
/// takes them off their lanes.
#[tokio::test]
async fn a_claim_takes_what_its_instance_completed_as_gone_without_reading_it() {
    let db = test_db("completed_known_gone").await;
    let (client, commands) = commands_client(&db, "commands").await;
    let store = store_with(&client, &db, false).await;
    let events: Vec<EventEnvelope> = (0..40).map(|i| event(&format!("e{i}"), None)).collect();
    publish(&store, &events, &[HANDLER], at(0)).await;
    let first = claim(&store, "w", 10, at(1)).await;
    assert_eq!(first.len(), 10);
    let done = store.complete_many(&leases(&first), at(2)).await.unwrap();
    assert!(done.iter().all(|done| *done));
    let completed: HashSet<ObjectId> = first.iter().map(|d| d.lease().delivery_id()).collect();
    let lanes = db.db().collection::<Document>("relaybus_lanes");
    let listing = |ids: &HashSet<ObjectId>| {
        let ids: Vec<ObjectId> = ids.iter().copied().collect();
        doc! { "inFlight": { "$in": ids } }
    };
    assert!(
        lanes.count_documents(listing(&completed)).await.unwrap() > 0,
        "the lanes still list what was completed"
    );

    commands.lock().unwrap().clear();
    let second = claim(&store, "w", 10, at(3)).await;
    assert_eq!(second.len(), 10);
    let sent = std::mem::take(&mut *commands.lock().unwrap());
    let lane_reads = lane_reads(&sent);
    assert_eq!(lane_reads.len(), 1);
    assert!(
        !lane_reads[0].contains("$lookup"),
        "no lookup of the listed deliveries: {}",
        lane_reads[0]
    );
    let reads_completed = sent.iter().any(|(name, command)| {
        name != "update"
            && completed
                .iter()
                .any(|id| command.to_string().contains(&id.to_hex()))
    });
    assert!(
        !reads_completed,
        "no command reads the completed deliveries"
    );
    assert_eq!(
        lanes.count_documents(listing(&completed)).await.unwrap(),
        0,
        "the record took them off their lanes"
    );
}

/// A lane read looks up a handler's parked deliveries while the last lookup found some, when
/// this store instance parked deliveries since, or 250 ms of claim time after a lookup that
/// found none; the keys' lowest pending deliveries come along only while the last lookup found
/// parked deliveries. The claim whose read finds the first of them looks their keys up itself,
/// and unparks nothing whose predecessor is pending.
#[tokio::test]
async fn a_lane_read_looks_up_parked_deliveries_while_some_may_be_parked() {
    const KEYS: usize = 3;
    let db = test_db("lookups_while_parked").await;
    let (client, commands) = commands_client(&db, "reads").await;
    let store = store_with(&client, &db, false).await;
    // The lane reads since the last call, how many of them looked up parked deliveries, and
    // how many the lowest pending deliveries of parked keys.
    let reads = || {
        let lane_reads = lane_reads(&std::mem::take(&mut *commands.lock().unwrap()));
        let with = |marker: &str| {
            lane_reads
                .iter()
                .filter(|command| command.contains(marker))
                .count()
        };
        (
            lane_reads.len(),
            with("parkedHandler"),
            with("lowestHandler"),
        )
    };
    let complete = async |claimed: &[ClaimedDelivery], now: DateTime| {
        let done = store.complete_many(&leases(claimed), now).await.unwrap();
        assert!(done.iter().all(|done| *done));
    };
    let at_ms = |ms: i64| DateTime::from_millis(at(1).timestamp_millis() + ms);

    publish(&store, &[event("plain-1", None)], &[HANDLER], at(0)).await;
    reads();
    let plain = claim(&store, "w", 10, at_ms(0)).await;
    assert_eq!(plain.len(), 1);
    assert_eq!(reads(), (1, 1, 0), "the first read looks");
    complete(&plain, at_ms(1)).await;
    assert!(claim(&store, "w", 10, at_ms(100)).await.is_empty());
    assert_eq!(reads(), (1, 0, 0), "nothing was parked 100 ms before");
    assert!(claim(&store, "w", 10, at_ms(250)).await.is_empty());
    assert_eq!(reads(), (1, 1, 0), "250 ms after the last look");

    // Appends of this instance that park: the next read looks.
    publish_parked_pairs(&store, &db, KEYS).await;
    reads();
    let first = claim(&store, "w", 1000, at_ms(260)).await;
    assert_eq!(first.len(), KEYS, "every key's first delivery");
    assert_eq!(reads(), (1, 1, 0), "the first parked keys found");
    assert_eq!(parked_count(&db).await, KEYS, "no head came back early");

    complete(&first, at_ms(270)).await;
    let heads = claim(&store, "w", 1000, at_ms(280)).await;
    assert_eq!(heads.len(), KEYS, "every key's head came back");
    assert_eq!(reads(), (1, 1, 1), "parked keys seen: lowest too");
    complete(&heads, at_ms(290)).await;
    assert!(claim(&store, "w", 1000, at_ms(300)).await.is_empty());
    assert_eq!(reads(), (1, 1, 1), "the last read found parked keys");
    assert!(claim(&store, "w", 1000, at_ms(310)).await.is_empty());
    assert_eq!(reads(), (1, 0, 0), "the last read found none");
}

#[tokio::test]
async fn a_busy_claim_takes_a_reported_delivery_before_the_parked_heads_it_frees() {
    const KEYS: usize = 40;
    let db = test_db("reported_before_heads").await;
    let (client, count, _) = counting_client(&db).await;
    let store = store_with(&client, &db, false).await;
    complete_parked_pairs_firsts(&store, &db, KEYS).await;

    // More heads free to come back than one claim takes, and a new key's delivery reported.
    let fresh = event("fresh-1", Some("fresh"));
    publish(&store, std::slice::from_ref(&fresh), &[HANDLER], at(3)).await;
    let reported = [lane_of(Some("fresh"), "fresh-1")];
    let (_, claimed) = boundary_claimed(&store, &count, at(4), &reported, true).await;
    assert_eq!(claimed.len(), 32);
    assert!(
        claimed.iter().any(|c| c.event.id() == "fresh-1"),
        "the reported delivery does not wait behind the keys' backlog"
    );
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
    let keyed: Vec<EventEnvelope> = (0..3)
        .map(|i| event(&format!("s-{i}"), Some("slow")))
        .collect();
    publish(&store, &keyed, &[HANDLER], at(0)).await;
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
    // A claim from held lanes: the lanes read with the first page of the held lanes, then the
    // events of the picks beside the record.
    assert_eq!(claims, vec![3, 3, 3], "claims: {claims:?}");
    assert_eq!(completes, vec![3, 3, 3]);
}

/// Every `ObjectId` in a command, at any depth.
fn object_ids_in(value: &Bson, found: &mut HashSet<ObjectId>) {
    match value {
        Bson::ObjectId(id) => {
            found.insert(*id);
        }
        Bson::Document(doc) => doc.values().for_each(|v| object_ids_in(v, found)),
        Bson::Array(items) => items.iter().for_each(|v| object_ids_in(v, found)),
        _ => {}
    }
}

/// The registry of a store instance holds the claims of all its owners; an owner's lane read
/// sends only the ids of those handed out in the lanes it held, not the other owners'.
#[tokio::test]
async fn a_lane_read_sends_only_the_claims_of_its_own_lanes() {
    let db = test_db("own_lanes_ids").await;
    let (client, commands) = commands_client(&db, "ids").await;
    let store = store_with(&client, &db, false).await;
    let in_lane = |lane: u32, prefix: &str| -> Vec<EventEnvelope> {
        (0..)
            .map(|n| format!("{prefix}-{n}"))
            .filter(|id| lane_of(None, id) == lane)
            .take(10)
            .map(|id| event(&id, None))
            .collect()
    };
    publish(&store, &in_lane(7, "seven"), &[HANDLER], at(0)).await;
    publish(&store, &in_lane(9, "nine"), &[HANDLER], at(1)).await;
    let a = claim(&store, "a", 5, at(2)).await;
    let b = claim(&store, "b", 5, at(2)).await;
    assert!(a.iter().all(|d| d.lease().lane() == 7), "the oldest lane");
    assert!(b.iter().all(|d| d.lease().lane() == 9), "lane 7 is held");

    commands.lock().unwrap().clear();
    let again = claim(&store, "a", 2, at(3)).await;
    assert_eq!(again.len(), 2);
    assert!(again.iter().all(|d| d.lease().lane() == 7));
    let mut sent = HashSet::new();
    for command in take_aggregates(&commands) {
        object_ids_in(&Bson::Document(command), &mut sent);
    }
    let a_ids: HashSet<ObjectId> = a.iter().map(ClaimedDelivery::delivery_id).collect();
    assert!(
        a_ids.is_subset(&sent),
        "its own claims are left out of its page"
    );
    assert!(
        b.iter().all(|d| !sent.contains(&d.delivery_id())),
        "the other owner's claims were sent"
    );
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
    reported: &[u32],
    reports_complete: bool,
) -> (usize, usize) {
    let (used, claimed) = boundary_claimed(store, count, now, reported, reports_complete).await;
    (used, claimed.len())
}

/// [`boundary_claim`], with the deliveries claimed.
async fn boundary_claimed(
    store: &MongoEventStore,
    count: &AtomicUsize,
    now: DateTime,
    reported: &[u32],
    reports_complete: bool,
) -> (usize, Vec<relaybus::store::Claimed<Lease>>) {
    boundary_claimed_with(store, count, now, reported, reports_complete, &[]).await
}

/// [`boundary_claimed`], with what the wake-ups told of the new deliveries.
async fn boundary_claimed_with(
    store: &MongoEventStore,
    count: &AtomicUsize,
    now: DateTime,
    reported: &[u32],
    reports_complete: bool,
    arrivals: &[relaybus::store::Arrival],
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
            run: 1,
            runs: 0,
            lease_duration: LEASE,
            now: std::time::SystemTime::from(now).into(),
            reported,
            reports_complete,
            arrivals,
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

/// Publishes three deliveries of the key `hot` (`hot-0` to `hot-2`); their lane.
async fn publish_hot(store: &MongoEventStore) -> u32 {
    let hot: Vec<EventEnvelope> = (0..3)
        .map(|n| event(&format!("hot-{n}"), Some("hot")))
        .collect();
    publish(store, &hot, &[HANDLER], at(0)).await;
    lane_of(Some("hot"), "hot-0")
}

/// Two claims that find nothing, at `ms(trusted)` with complete reports and at `ms(unsure)`
/// without: the first ranks no free lane, the second ranks them all again (one more read: the
/// ranking's pass over the free lanes' entries, which finds them empty).
async fn assert_ranking_kept(
    store: &MongoEventStore,
    count: &AtomicUsize,
    trusted: i64,
    unsure: i64,
) {
    let (kept, got) = boundary_claim(store, count, ms(trusted), &[], true).await;
    assert_eq!(got, 0);
    let (ranked, got) = boundary_claim(store, count, ms(unsure), &[], false).await;
    assert_eq!(got, 0);
    assert!(
        ranked > kept,
        "{kept} commands with complete reports, {ranked} without"
    );
}

#[tokio::test]
async fn a_complete_ranking_spares_busy_claims_reading_free_lanes_while_reports_are_complete() {
    let db = test_db("complete_ranking").await;
    let (store, count) = counted_store(&db).await;
    // One hot key: a claim takes its first delivery and finds nothing else to run.
    let hot_lane = publish_hot(&store).await;
    let (_, got) = boundary_claim(&store, &count, ms(0), &[], true).await;
    assert_eq!(got, 1);

    // Still busy with the key. With complete reports, the ranking that found every free lane
    // empty stands; without, the free lanes are ranked again (one more read).
    assert_ranking_kept(&store, &count, 10, 20).await;

    // A new delivery in a free lane: found at once when reported, or when the reports are not
    // complete; unreported, by the first claim a quarter of a second after the ranking.
    let fresh_id = (0..)
        .map(|n| format!("fresh-{n}"))
        .find(|id| lane_of(None, id) != hot_lane)
        .unwrap();
    let fresh_lane = lane_of(None, &fresh_id);
    publish(&store, &[event(&fresh_id, None)], &[HANDLER], at(0)).await;
    let (_, got) = boundary_claim(&store, &count, ms(30), &[fresh_lane], true).await;
    assert_eq!(got, 1, "reported");
    let second = (0..)
        .map(|n| format!("second-{n}"))
        .find(|id| ![hot_lane, fresh_lane].contains(&lane_of(None, id)))
        .unwrap();
    publish(&store, &[event(&second, None)], &[HANDLER], at(0)).await;
    let (_, got) = boundary_claim(&store, &count, ms(40), &[], false).await;
    assert_eq!(
        got, 1,
        "reports not complete: the free lanes are ranked again"
    );
    let taken = [hot_lane, fresh_lane, lane_of(None, &second)];
    let third = (0..)
        .map(|n| format!("third-{n}"))
        .find(|id| !taken.contains(&lane_of(None, id)))
        .unwrap();
    publish(&store, &[event(&third, None)], &[HANDLER], at(0)).await;
    // The claim at 40 ms ranked anew and found nothing else: unreported, the delivery waits.
    let (_, got) = boundary_claim(&store, &count, ms(50), &[], true).await;
    assert_eq!(got, 0, "the ranking 10 ms ago found every free lane empty");
    let (_, got) = boundary_claim(&store, &count, ms(300), &[], true).await;
    assert_eq!(
        got, 1,
        "a quarter of a second after the ranking, it is read again"
    );
}

#[tokio::test]
async fn lanes_a_busy_claim_read_in_full_and_handed_back_keep_the_ranking_complete() {
    let db = test_db("handed_back_covered").await;
    let (store, count) = counted_store(&db).await;
    // A hot key keeps the owner busy; a key of one delivery holds a second lane for a while.
    let hot_lane = publish_hot(&store).await;
    let solo_key = (0..)
        .map(|n| format!("solo-{n}"))
        .find(|key| lane_of(Some(key), "solo") != hot_lane)
        .unwrap();
    publish(&store, &[event("solo", Some(&solo_key))], &[HANDLER], at(0)).await;
    // The first claim takes both; the next, unsure of the reports, ranks the other lanes and
    // finds them empty.
    let (_, claimed) = boundary_claimed(&store, &count, ms(0), &[], true).await;
    assert_eq!(claimed.len(), 2);
    let (_, got) = boundary_claim(&store, &count, ms(2), &[], false).await;
    assert_eq!(got, 0);
    let solo = claimed
        .iter()
        .find(|delivery| delivery.event.id() == "solo")
        .unwrap();
    assert!(store.complete(&solo.lease, ms(5)).await.unwrap());
    // The next claim hands the solo lane back, having read it: nothing there.
    let (_, got) = boundary_claim(&store, &count, ms(10), &[], true).await;
    assert_eq!(got, 0);
    // That lane is free now; the ranking still holds for it, so the next claim ranks nothing.
    // Without complete reports it ranks every free lane again.
    assert_ranking_kept(&store, &count, 20, 30).await;
    // A delivery that comes to that lane is reported and found at once.
    publish(
        &store,
        &[event("solo-again", Some(&solo_key))],
        &[HANDLER],
        at(0),
    )
    .await;
    let solo_lane = lane_of(Some(&solo_key), "solo");
    let (_, got) = boundary_claim(&store, &count, ms(40), &[solo_lane], true).await;
    assert_eq!(got, 1);
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
                run: 1,
                runs: 0,
                lease_duration: LEASE,
                now: std::time::SystemTime::from(ms(step * 5)).into(),
                reported: &[],
                reports_complete: true,
                arrivals: &[],
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
    let (_, claimed) = boundary_claimed(&store, &count, ms(0), &[], true).await;
    assert_eq!(claimed.len(), 1);
    let head = &claimed[0];
    assert!(
        store
            .reschedule(&head.lease, ms(60_000), "later", ms(5))
            .await
            .unwrap()
    );
    let (_, got) = boundary_claim(&store, &count, ms(10), &[], true).await;
    assert_eq!(got, 0);
    assert_eq!(parked_count(&db).await, 2);
    // A ranking finds every free lane empty, that one included.
    let (_, got) = boundary_claim(&store, &count, ms(20), &[], false).await;
    assert_eq!(got, 0);
    // An operator buries the head: the next claim unparks the follower into that free lane,
    // and does not trust the ranking for it.
    let buried = store
        .bury_by_id(&[head.lease.delivery_id().to_hex()], "given up", ms(25))
        .await
        .unwrap();
    assert_eq!(buried.buried.len(), 1, "{buried:?}");
    let (_, claimed) = boundary_claimed(&store, &count, ms(30), &[], true).await;
    assert_eq!(claimed.len(), 1, "the unparked follower is claimed at once");
    assert_eq!(claimed[0].event.id(), "slow-1");
}

#[tokio::test]
async fn an_idle_claim_that_took_every_reported_delivery_spares_the_claim_right_after_it() {
    let db = test_db("idle_claim_exhausted").await;
    let (store, count) = counted_store(&db).await;
    // Nothing to do: the owner goes idle.
    let (_, got) = boundary_claim(&store, &count, ms(0), &[], true).await;
    assert_eq!(got, 0);

    // Two deliveries arrive, reported: the idle claim takes both, and the claim that follows at
    // once, with nothing new reported, sends nothing.
    let arrived = [event("arrived-0", None), event("arrived-1", None)];
    publish(&store, &arrived, &[HANDLER], at(0)).await;
    let lanes: Vec<u32> = ["arrived-0", "arrived-1"]
        .iter()
        .map(|id| lane_of(None, id))
        .collect();
    let (_, got) = boundary_claim(&store, &count, ms(10), &lanes, true).await;
    assert_eq!(got, 2);
    let (spared, got) = boundary_claim(&store, &count, ms(15), &[], true).await;
    assert_eq!((spared, got), (0, 0), "the follow-up claim read nothing");
    // Only that one: the next claim, at a wake-up or the poll, reads again.
    let (next, got) = boundary_claim(&store, &count, ms(20), &[], true).await;
    assert_eq!(got, 0);
    assert!(next > 0, "the claim after it read the lanes");

    // Not when a reported delivery was left behind: two of one key, the second waits in its
    // lane (written parked, it is moved back as a requeue leaves it).
    let keyed = [event("keyed-0", Some("k")), event("keyed-1", Some("k"))];
    publish(&store, &keyed, &[HANDLER], at(0)).await;
    db.db()
        .collection::<Document>("relaybus_deliveries")
        .update_many(doc! { "key": "k" }, doc! { "$set": { "lane": "ready" } })
        .await
        .unwrap();
    let (_, got) = boundary_claim(
        &store,
        &count,
        ms(30),
        &[lane_of(Some("k"), "keyed-0")],
        true,
    )
    .await;
    assert_eq!(got, 1);
    let (follow_up, _) = boundary_claim(&store, &count, ms(35), &[], true).await;
    assert!(follow_up > 0, "a delivery waits: the follow-up claim reads");

    // Nor when the reports may have missed a lane.
    let (_, got) = boundary_claim(&store, &count, ms(40), &[], true).await;
    assert_eq!(got, 0, "idle again");
    publish(&store, &[event("unsure-0", None)], &[HANDLER], at(0)).await;
    let (_, got) =
        boundary_claim(&store, &count, ms(50), &[lane_of(None, "unsure-0")], false).await;
    assert_eq!(got, 1);
    let (follow_up, _) = boundary_claim(&store, &count, ms(55), &[], true).await;
    assert!(
        follow_up > 0,
        "the reports were not complete: the follow-up claim reads"
    );
}

/// A claim after an idle wait reads the documents of its held and reported lanes only, and the
/// lanes other live owners hold as a summary: it still leaves their parked keys to them.
#[tokio::test]
async fn an_idle_claim_unparks_only_the_keys_of_lanes_no_other_live_owner_holds() {
    let db = test_db("idle_claim_others").await;
    let (store, count) = counted_store(&db).await;
    let (_, got) = boundary_claim(&store, &count, ms(0), &[], true).await;
    assert_eq!(got, 0, "idle");

    // Two keys in lanes of their own, each with one parked delivery and nothing before it,
    // and a new unkeyed delivery in a third lane.
    let lane_a = lane_of(Some("mine"), "mine-1");
    let lane_b = lane_of(Some("theirs"), "theirs-1");
    let fresh = (0..)
        .map(|n| format!("fresh-{n}"))
        .find(|id| ![lane_a, lane_b].contains(&lane_of(None, id)))
        .unwrap();
    assert_ne!(lane_a, lane_b);
    publish(
        &store,
        &[
            event("mine-1", Some("mine")),
            event("theirs-1", Some("theirs")),
            event(&fresh, None),
        ],
        &[HANDLER],
        at(0),
    )
    .await;
    let deliveries = db.db().collection::<Document>("relaybus_deliveries");
    let parked = deliveries
        .update_many(
            doc! { "eventId": { "$in": ["mine-1", "theirs-1"] } },
            doc! { "$set": { "lane": "parked" } },
        )
        .await
        .unwrap();
    assert_eq!(parked.modified_count, 2);
    // Another live owner holds the second key's lane.
    let held = db
        .db()
        .collection::<Document>("relaybus_lanes")
        .update_one(
            doc! { "_id": lane_b as i32 },
            doc! { "$set": {
                "owner": "other",
                "instance": ObjectId::new(),
                "leaseExpiresAt": DateTime::from_millis(T0 + 3_600_000),
            } },
        )
        .await
        .unwrap();
    assert_eq!(held.matched_count, 1);

    // Parked by hand, as another process would: the store's claims look again for parked
    // deliveries 250 ms of claim time after their last look found none.
    let (_, claimed) =
        boundary_claimed(&store, &count, ms(260), &[lane_of(None, &fresh)], true).await;
    let ids: Vec<&str> = claimed.iter().map(|c| c.event.id()).collect();
    assert_eq!(ids, [fresh.as_str()], "the reported lane alone");
    let lane_of_event = async |id: &str| {
        deliveries
            .find_one(doc! { "eventId": id })
            .await
            .unwrap()
            .unwrap()
            .get_str("lane")
            .unwrap()
            .to_owned()
    };
    assert_eq!(lane_of_event("mine-1").await, "ready", "unparked");
    assert_eq!(
        lane_of_event("theirs-1").await,
        "parked",
        "left to the owner of its lane"
    );
}

/// A change stream of wake-ups for new deliveries of [`HANDLER`], opened through the store
/// boundary on its own client, so that it sends none of the counted commands.
async fn wake_up_stream(
    db: &TestDb,
) -> futures::stream::BoxStream<'static, relaybus::Result<relaybus::store::WakeUp>> {
    Queue::watch(&store(db).await, &[HANDLER.to_owned()])
        .await
        .expect("watch")
}

/// A store whose client counts its commands, how many and which it sent, and a wake-up stream
/// on its database.
async fn watched(
    db: &TestDb,
) -> (
    MongoEventStore,
    Arc<AtomicUsize>,
    Arc<Mutex<Vec<String>>>,
    futures::stream::BoxStream<'static, relaybus::Result<relaybus::store::WakeUp>>,
) {
    let (client, count, names) = counting_client(db).await;
    let store = store_with(&client, db, false).await;
    (store, count, names, wake_up_stream(db).await)
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

/// The event ids the wake-ups told of.
fn woken_event_ids(wake_ups: &[relaybus::store::WakeUp]) -> Vec<String> {
    wake_ups
        .iter()
        .map(|wake_up| {
            let arrival = wake_up
                .arrival
                .as_ref()
                .expect("a wake-up tells its delivery");
            mongodb::bson::RawDocument::from_bytes(arrival.as_bytes())
                .unwrap()
                .get_str("eventId")
                .unwrap()
                .to_owned()
        })
        .collect()
}

#[tokio::test]
async fn a_paced_wake_up_stream_reads_briefly_while_gathering_and_misses_nothing_between_paces() {
    use relaybus::store::WakePace;
    let db = test_db("paced_wake_ups").await;
    // The server-side wait of each read of the stream (`maxTimeMS` of its `getMore`s).
    let waits: Arc<Mutex<Vec<Option<i64>>>> = Arc::default();
    let read = Arc::new(Notify::new());
    let mut options = ClientOptions::parse(&db.uri).await.unwrap();
    let (seen, told) = (Arc::clone(&waits), Arc::clone(&read));
    options.command_event_handler = Some(EventHandler::callback(move |event| {
        if let CommandEvent::Started(started) = event
            && started.command_name == "getMore"
        {
            let wait = match started.command.get("maxTimeMS") {
                Some(Bson::Int32(ms)) => Some(i64::from(*ms)),
                Some(Bson::Int64(ms)) => Some(*ms),
                _ => None,
            };
            seen.lock().unwrap().push(wait);
            told.notify_one();
        }
    }));
    // Waits until the stream has read more than `after` times, the last of them as `brief`
    // says (waiting 1 ms on the server, or not).
    let reads_after = |after: usize, brief: bool| {
        let (waits, read) = (Arc::clone(&waits), Arc::clone(&read));
        async move {
            while waits.lock().unwrap()[after..]
                .last()
                .is_none_or(|wait| (*wait == Some(1)) != brief)
            {
                tokio::time::timeout(Duration::from_secs(10), read.notified())
                    .await
                    .expect("a read of the stream within 10 s");
            }
        }
    };
    let client = Client::with_options(options).unwrap();
    let watching = store_with(&client, &db, false).await;
    let publisher = store(&db).await;
    let (pace, paced) = tokio::sync::watch::channel(WakePace::Eager);
    let mut stream = ClaimShortcuts::watch_paced(&watching, &[HANDLER.to_owned()], paced)
        .await
        .expect("watch");

    publish(&publisher, &[event("eager-1", None)], &[HANDLER], at(0)).await;
    let woken = next_wake_ups(&mut stream, 1).await;
    assert_eq!(woken_event_ids(&woken), ["eager-1"]);
    assert!(
        !waits.lock().unwrap().contains(&Some(1)),
        "an eager stream waits on the server: {:?}",
        waits.lock().unwrap()
    );

    // Gathering: the stream's reads wait 1 ms on the server, and report what came meanwhile.
    // (The stream reads only while it is polled.)
    pace.send(WakePace::Gathered(Duration::from_millis(20)))
        .unwrap();
    let polled = tokio::spawn(async move {
        let woken = next_wake_ups(&mut stream, 3).await;
        (stream, woken)
    });
    reads_after(0, true).await;
    publish_unkeyed(&publisher, "gathered", 3, at(1)).await;
    let (mut stream, woken) = polled.await.unwrap();
    assert_eq!(
        woken_event_ids(&woken),
        ["gathered-0", "gathered-1", "gathered-2"]
    );

    // Committed while the stream gathers, then the pace turns eager before the next read: the
    // stream reopened where the last read ended reports them.
    publish_unkeyed(&publisher, "between", 2, at(2)).await;
    pace.send(WakePace::Eager).unwrap();
    let woken = next_wake_ups(&mut stream, 2).await;
    assert_eq!(woken_event_ids(&woken), ["between-0", "between-1"]);

    // And back while an eager read waits on the server: that read is dropped, the reads are
    // brief again, and nothing is lost.
    let before = waits.lock().unwrap().len();
    let polled = tokio::spawn(async move { next_wake_ups(&mut stream, 2).await });
    reads_after(before, false).await;
    let eager = waits.lock().unwrap().len();
    pace.send(WakePace::Gathered(Duration::from_millis(20)))
        .unwrap();
    reads_after(eager, true).await;
    publish_unkeyed(&publisher, "late", 2, at(3)).await;
    assert_eq!(
        woken_event_ids(&polled.await.unwrap()),
        ["late-0", "late-1"]
    );
}

/// A claim after an idle wait, as the dispatcher makes it with `wake_ups` reported: the names of
/// the commands it sent, and what it claimed.
async fn claim_woken(
    store: &MongoEventStore,
    count: &AtomicUsize,
    names: &Mutex<Vec<String>>,
    now: DateTime,
    wake_ups: &[relaybus::store::WakeUp],
) -> (Vec<String>, Vec<relaybus::store::Claimed<Lease>>) {
    let mut lanes: Vec<u32> = wake_ups.iter().filter_map(|w| w.at).collect();
    lanes.dedup();
    let arrivals: Vec<relaybus::store::Arrival> = wake_ups
        .iter()
        .map(|w| w.arrival.clone().expect("a wake-up tells its delivery"))
        .collect();
    let before = names.lock().unwrap().len();
    let (_, claimed) = boundary_claimed_with(store, count, now, &lanes, true, &arrivals).await;
    let sent = names.lock().unwrap()[before..].to_vec();
    (sent, claimed)
}

/// An event id of the unkeyed kind whose lane is (`same`) or is not `lane`.
fn id_in_lane(prefix: &str, lane: u32, same: bool) -> String {
    (0..)
        .map(|n| format!("{prefix}-{n}"))
        .find(|id| (lane_of(None, id) == lane) == same)
        .unwrap()
}

/// The lane document of `lane`.
async fn lane_document(db: &TestDb, lane: u32) -> Document {
    db.db()
        .collection::<Document>("relaybus_lanes")
        .find_one(doc! { "_id": lane as i32 })
        .await
        .unwrap()
        .unwrap()
}

#[tokio::test]
async fn an_idle_claim_takes_reported_unkeyed_deliveries_with_a_write_per_lane_beside_one_read() {
    let db = test_db("arrivals_taken").await;
    let (store, count, names, mut stream) = watched(&db).await;
    let (_, got) = boundary_claim(&store, &count, ms(0), &[], true).await;
    assert_eq!(got, 0, "idle");

    let first = id_in_lane("two", u32::MAX, false);
    let second = id_in_lane("two", lane_of(None, &first), false);
    publish(
        &store,
        &[event(&first, None), event(&second, None)],
        &[HANDLER],
        at(0),
    )
    .await;
    let woken = next_wake_ups(&mut stream, 2).await;
    let (mut sent, claimed) = claim_woken(&store, &count, &names, ms(10), &woken).await;
    sent.sort();
    assert_eq!(sent, ["aggregate", "findAndModify", "findAndModify"]);
    let mut ids: Vec<&str> = claimed.iter().map(|c| c.event.id()).collect();
    ids.sort_unstable();
    let mut expected = [first.as_str(), second.as_str()];
    expected.sort_unstable();
    assert_eq!(ids, expected);
    for delivery in &claimed {
        assert_eq!(delivery.attempt, 1);
        assert_eq!(delivery.handler, HANDLER);
        assert_eq!(
            delivery.event.payload().get("order"),
            Some(&json!(delivery.event.id()))
        );
        let lane = lane_document(&db, delivery.lease.lane()).await;
        assert_eq!(lane.get_str("owner"), Ok("w"));
        assert_eq!(
            lane.get_array("inFlight").unwrap(),
            &vec![Bson::ObjectId(delivery.lease.delivery_id())]
        );
    }
    let (spared, got) = boundary_claim(&store, &count, ms(15), &[], true).await;
    assert_eq!(
        (spared, got),
        (0, 0),
        "they were all that was new: the follow-up claim reads nothing"
    );
    let leases: Vec<Lease> = claimed.iter().map(|c| c.lease).collect();
    assert_eq!(
        store.complete_many(&leases, ms(20)).await.unwrap(),
        [true, true],
        "the leases hold"
    );
    assert!(deliveries(&db).await.is_empty());
}

#[tokio::test]
async fn a_reported_delivery_in_a_lane_the_owner_holds_joins_what_runs_there() {
    let db = test_db("arrivals_held").await;
    let (store, count, names, mut stream) = watched(&db).await;
    publish(&store, &[event("runs", None)], &[HANDLER], at(0)).await;
    next_wake_ups(&mut stream, 1).await;
    let (_, running) = boundary_claimed(&store, &count, ms(0), &[], true).await;
    assert_eq!(running.len(), 1);
    let (_, got) = boundary_claim(&store, &count, ms(5), &[], true).await;
    assert_eq!(got, 0, "idle, the lane still held");

    let lane = lane_of(None, "runs");
    let joins = id_in_lane("joins", lane, true);
    publish(&store, &[event(&joins, None)], &[HANDLER], at(0)).await;
    let woken = next_wake_ups(&mut stream, 1).await;
    let (sent, claimed) = claim_woken(&store, &count, &names, ms(10), &woken).await;
    assert!(sent.contains(&"findAndModify".to_owned()), "{sent:?}");
    assert_eq!(claimed.len(), 1);
    assert_eq!(claimed[0].event.id(), joins);
    assert_eq!(
        claimed[0].lease.epoch(),
        running[0].lease.epoch(),
        "the lane was not taken again"
    );
    let listed = lane_document(&db, lane).await;
    assert_eq!(
        listed.get_array("inFlight").unwrap(),
        &vec![
            Bson::ObjectId(running[0].lease.delivery_id()),
            Bson::ObjectId(claimed[0].lease.delivery_id())
        ]
    );
    let leases = [running[0].lease, claimed[0].lease];
    assert_eq!(
        store.complete_many(&leases, ms(20)).await.unwrap(),
        [true, true]
    );
}

#[tokio::test]
async fn a_reported_delivery_another_owner_ran_meanwhile_is_not_run_again() {
    let db = test_db("arrivals_raced").await;
    let other = store(&db).await;
    let (store, count, names, mut stream) = watched(&db).await;
    let (_, got) = boundary_claim(&store, &count, ms(0), &[], true).await;
    assert_eq!(got, 0, "idle");

    // Another owner claims and completes it before the woken claim, and hands its lane back.
    publish(&store, &[event("ran", None)], &[HANDLER], at(0)).await;
    let woken = next_wake_ups(&mut stream, 1).await;
    let ran = other
        .claim("other", &[HANDLER], 10, LEASE, ms(1))
        .await
        .unwrap();
    assert_eq!(ran.len(), 1);
    assert!(other.complete(ran[0].lease(), ms(2)).await.unwrap());
    assert!(
        other
            .claim("other", &[HANDLER], 10, LEASE, ms(3))
            .await
            .unwrap()
            .is_empty()
    );
    let lane = lane_of(None, "ran");
    assert_eq!(
        lane_document(&db, lane).await.get("owner"),
        Some(&Bson::Null)
    );
    let (sent, claimed) = claim_woken(&store, &count, &names, ms(10), &woken).await;
    assert!(claimed.is_empty(), "ran once already: {claimed:?}");
    assert!(sent.contains(&"findAndModify".to_owned()), "{sent:?}");
    let listed = lane_document(&db, lane).await;
    assert!(
        listed.get_array("inFlight").is_ok_and(|ids| ids.is_empty()),
        "nothing left listed: {listed:?}"
    );

    // Another owner runs it while the woken claim comes: the lane is not free.
    publish(&store, &[event("running", None)], &[HANDLER], at(0)).await;
    let woken = next_wake_ups(&mut stream, 1).await;
    let running = other
        .claim("other", &[HANDLER], 10, LEASE, ms(11))
        .await
        .unwrap();
    assert_eq!(running.len(), 1);
    let (mut sent, claimed) = claim_woken(&store, &count, &names, ms(12), &woken).await;
    assert!(claimed.is_empty(), "it runs elsewhere: {claimed:?}");
    sent.sort();
    assert_eq!(
        sent,
        ["aggregate", "findAndModify"],
        "the read showed the lane held by a live owner: nothing else to look at"
    );
    let listed = lane_document(&db, lane_of(None, "running")).await;
    assert_eq!(listed.get_str("owner"), Ok("other"));
    assert_eq!(
        listed.get_array("inFlight").unwrap(),
        &vec![Bson::ObjectId(running[0].lease().delivery_id())]
    );
    assert!(other.complete(running[0].lease(), ms(13)).await.unwrap());
}

#[tokio::test]
async fn a_reported_delivery_is_claimed_whichever_of_its_write_and_read_the_server_runs_first() {
    let db = test_db("arrivals_order").await;
    let (store, count, names, mut stream) = watched(&db).await;
    let app = format!("{}-counted", db.name);
    for (n, held_back) in ["findAndModify", "aggregate"].into_iter().enumerate() {
        let (_, got) = boundary_claim(&store, &count, ms(100 * n as i64), &[], true).await;
        assert_eq!(got, 0, "idle");
        let id = format!("order-{n}");
        publish(&store, &[event(&id, None)], &[HANDLER], at(0)).await;
        let woken = next_wake_ups(&mut stream, 1).await;
        // The server holds one of the two back, so that the other runs first.
        let fail_point = hold_back_once(&db, &app, held_back, 200).await;
        let (sent, claimed) =
            claim_woken(&store, &count, &names, ms(100 * n as i64 + 10), &woken).await;
        drop(fail_point);
        assert_eq!(
            sent.len(),
            2,
            "{held_back} held back: one write and one read, {sent:?}"
        );
        assert_eq!(claimed.len(), 1, "{held_back} held back");
        assert_eq!(claimed[0].event.id(), id);
        assert!(
            store
                .complete(&claimed[0].lease, ms(100 * n as i64 + 20))
                .await
                .unwrap()
        );
    }
}

#[tokio::test]
async fn a_reported_delivery_run_elsewhere_between_the_read_and_the_write_is_not_run_again() {
    let db = test_db("arrivals_between").await;
    let other = store(&db).await;
    // The woken claim's client tells when the server answered its read.
    let app = format!("{}-between", db.name);
    let (client, armed, read) = client_telling(
        &db,
        &app,
        |event| matches!(event, CommandEvent::Succeeded(done) if done.command_name == "aggregate"),
    )
    .await;
    let woken_store = store_with(&client, &db, false).await;
    let count = AtomicUsize::new(0);
    let mut stream = wake_up_stream(&db).await;
    let (_, got) = boundary_claim(&woken_store, &count, ms(0), &[], true).await;
    assert_eq!(got, 0, "idle");

    publish(&other, &[event("between", None)], &[HANDLER], at(0)).await;
    let woken = next_wake_ups(&mut stream, 1).await;
    let running = other
        .claim("other", &[HANDLER], 10, LEASE, ms(1))
        .await
        .unwrap();
    assert_eq!(running.len(), 1);
    // The woken claim's write waits on the server; its read sees the lane held, the delivery
    // listed. Meanwhile the other owner completes it and hands the lane back, in the same
    // epoch: the write then finds the lane free and clean.
    let _held_back = hold_back_once(&db, &app, "findAndModify", 1_000).await;
    armed.store(true, Ordering::SeqCst);
    let claim = tokio::spawn({
        let store = woken_store.clone();
        async move {
            let count = AtomicUsize::new(0);
            let lanes: Vec<u32> = woken.iter().filter_map(|w| w.at).collect();
            let arrivals: Vec<relaybus::store::Arrival> =
                woken.iter().filter_map(|w| w.arrival.clone()).collect();
            boundary_claimed_with(&store, &count, ms(10), &lanes, true, &arrivals)
                .await
                .1
        }
    });
    read.notified().await;
    assert!(other.complete(running[0].lease(), ms(11)).await.unwrap());
    assert!(
        other
            .claim("other", &[HANDLER], 10, LEASE, ms(12))
            .await
            .unwrap()
            .is_empty()
    );
    assert_eq!(
        lane_document(&db, lane_of(None, "between"))
            .await
            .get("owner"),
        Some(&Bson::Null),
        "handed back before the write ran"
    );
    let claimed = claim.await.unwrap();
    assert!(claimed.is_empty(), "it ran once already: {claimed:?}");
}

#[tokio::test]
async fn a_reported_keyed_delivery_is_claimed_the_usual_way() {
    let db = test_db("arrivals_keyed").await;
    let (store, count, names, mut stream) = watched(&db).await;
    let (_, got) = boundary_claim(&store, &count, ms(0), &[], true).await;
    assert_eq!(got, 0, "idle");
    publish(
        &store,
        &[event("keyed-0", Some("k")), event("plain-0", None)],
        &[HANDLER],
        at(0),
    )
    .await;
    let woken = next_wake_ups(&mut stream, 2).await;
    let (sent, claimed) = claim_woken(&store, &count, &names, ms(10), &woken).await;
    assert!(!sent.contains(&"findAndModify".to_owned()), "{sent:?}");
    let mut ids: Vec<&str> = claimed.iter().map(|c| c.event.id()).collect();
    ids.sort_unstable();
    assert_eq!(ids, ["keyed-0", "plain-0"]);
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

/// `ClaimShortcuts::claim_next_of_key` for worker `owner` after `completed` (of the key `key`)
/// completed.
async fn next_of_key(
    store: &MongoEventStore,
    owner: &str,
    completed: &Lease,
    key: &str,
    now: DateTime,
) -> Option<relaybus::store::Claimed<Lease>> {
    next_of_key_after(store, owner, (completed, false, None), key, now).await
}

/// `ClaimShortcuts::claim_next_of_key` for worker `owner` after `completed` (of the key `key`),
/// `committing` or not, with the key's delivery `finished` before it.
async fn next_of_key_after(
    store: &MongoEventStore,
    owner: &str,
    (completed, committing, finished): (&Lease, bool, Option<&Lease>),
    key: &str,
    now: DateTime,
) -> Option<relaybus::store::Claimed<Lease>> {
    use relaybus::store::NextOfKey;
    ClaimShortcuts::claim_next_of_key(
        store,
        NextOfKey {
            owner,
            completed,
            committing,
            finished,
            handler: HANDLER,
            key,
            lease_duration: LEASE,
            now: std::time::SystemTime::from(now).into(),
        },
    )
    .await
    .expect("claim of the next delivery")
}

/// Completes `lease` in a transaction of the store, as a transactional handler does.
async fn complete_in_transaction(store: &MongoEventStore, lease: &Lease, now: DateTime) {
    let done = store
        .transaction(async |session| store.complete_in_transaction(session, lease, now).await)
        .await
        .expect("transactional completion");
    assert!(done, "completed under its lease");
}

#[tokio::test]
async fn a_worker_that_completed_a_keyed_delivery_takes_the_next_of_its_key_in_two_commands() {
    let db = test_db("next_of_key").await;
    let (store, count) = counted_store(&db).await;
    let lane_id = publish_hot(&store).await;
    let first = claim(&store, "w", 10, at(1)).await;
    assert_eq!(first.len(), 1, "one delivery of the key at a time");
    assert_eq!(first[0].sequence(), Some(1));

    let mut lease = *first[0].lease();
    for sequence in 2..=3 {
        let before = count.load(Ordering::SeqCst);
        complete_in_transaction(&store, &lease, at(2)).await;
        assert_eq!(
            count.load(Ordering::SeqCst) - before,
            4,
            "the delivery with its lane, the delete, the event's mark, the commit"
        );
        let before = count.load(Ordering::SeqCst);
        let next = next_of_key(&store, "w", &lease, "hot", at(2))
            .await
            .expect("the key's next delivery");
        assert_eq!(
            count.load(Ordering::SeqCst) - before,
            2,
            "one read, one write"
        );
        assert_eq!(next.sequence, Some(sequence));
        assert_eq!(next.attempt, 1);
        assert_eq!(next.event.id(), format!("hot-{}", sequence - 1));
        assert_eq!(next.lease.lane(), lane_id);
        assert_eq!(
            next.lease.epoch(),
            lease.epoch(),
            "the lane stays in its epoch"
        );
        // The lane lists the new claim, and no longer the completed one.
        assert_eq!(
            in_flight(&lane(&db, lane_id).await),
            vec![next.lease.delivery_id()]
        );
        // Nothing else of the key is claimable while it runs.
        assert!(claim(&store, "w", 10, at(2)).await.is_empty());
        lease = next.lease;
    }
    // Its lease settles it; after the last one there is nothing left to take.
    complete_in_transaction(&store, &lease, at(3)).await;
    assert!(
        next_of_key(&store, "w", &lease, "hot", at(3))
            .await
            .is_none()
    );
    assert!(deliveries(&db).await.is_empty());
}

#[tokio::test]
async fn the_next_delivery_of_a_key_is_claimed_while_its_predecessor_commits_and_given_back_if_it_does_not()
 {
    let db = test_db("next_of_key_committing").await;
    let (store, count) = counted_store(&db).await;
    let lane_id = publish_hot(&store).await;
    let first = claim(&store, "w", 10, at(1)).await;
    assert_eq!(first.len(), 1);
    let first = *first[0].lease();

    // Claimed inside the completion's transaction, before its commit: the completed delivery
    // is still pending, the key's lowest, and the claim takes the one after it.
    let (second, commands) = store
        .transaction(async |session| {
            assert!(
                store
                    .complete_in_transaction(session, &first, at(2))
                    .await?
            );
            let before = count.load(Ordering::SeqCst);
            let next = next_of_key_after(&store, "w", (&first, true, None), "hot", at(2)).await;
            Ok((next, count.load(Ordering::SeqCst) - before))
        })
        .await
        .unwrap();
    let second = second.expect("the key's next delivery, claimed as its predecessor commits");
    assert_eq!(commands, 2, "one read, one write, as after a commit");
    assert_eq!(second.sequence, Some(2));
    assert_eq!(second.attempt, 1);
    // The completed one stays listed: its transaction read the lane so.
    assert_eq!(
        in_flight(&lane(&db, lane_id).await),
        vec![first.delivery_id(), second.lease.delivery_id()]
    );
    assert!(claim(&store, "w", 10, at(2)).await.is_empty());

    // A commit that fails: the claimed next delivery goes back uncharged, and the completed
    // one, still listed, completes when its transaction runs again.
    let second = second.lease;
    let aborted = store
        .transaction(async |session| {
            assert!(
                store
                    .complete_in_transaction(session, &second, at(3))
                    .await?
            );
            let next = next_of_key_after(&store, "w", (&second, true, Some(&first)), "hot", at(3))
                .await
                .expect("the third delivery");
            assert_eq!(next.sequence, Some(3));
            // The first is taken off its lane, the second stays.
            assert_eq!(
                in_flight(&lane(&db, lane_id).await),
                vec![second.delivery_id(), next.lease.delivery_id()]
            );
            assert!(store.release(&next.lease, at(3)).await?);
            Err::<(), _>(Error::InvalidArgument(relaybus::InvalidArgumentError::new(
                "commit",
                "the commit fails",
            )))
        })
        .await;
    assert!(aborted.is_err());
    assert!(
        delivery(&db, second.delivery_id()).await.is_some(),
        "still pending"
    );
    assert_eq!(
        in_flight(&lane(&db, lane_id).await),
        vec![second.delivery_id()]
    );
    assert!(
        claim(&store, "w", 10, at(3)).await.is_empty(),
        "nothing of the key while the second still runs"
    );
    complete_in_transaction(&store, &second, at(4)).await;
    // The worker tells the store the commit returned: its claims need not hold the key back.
    relaybus::store::ClaimShortcuts::completion_committed(&store, &second);
    let third = claim(&store, "w", 10, at(5)).await;
    assert_eq!(third.len(), 1);
    assert_eq!(third[0].sequence(), Some(3));
    assert_eq!(third[0].attempt(), 1, "given back uncharged");
}

#[tokio::test]
async fn a_claim_leaves_a_just_completed_key_to_the_claim_of_its_next_delivery_once() {
    let db = test_db("next_of_key_hand_over").await;
    let store = store(&db).await;
    let lane_id = publish_hot(&store).await;
    let first = claim(&store, "w", 10, at(1)).await;
    assert_eq!(first.len(), 1);
    let lease = *first[0].lease();
    complete_in_transaction(&store, &lease, at(2)).await;

    // A claim of the worker that runs between the completion's commit and the worker's claim
    // of the key's next delivery (which waits for it) leaves that delivery to it, and keeps
    // the lane although nothing of it runs.
    assert!(
        claim(&store, "w", 10, at(2)).await.is_empty(),
        "the key's next delivery is left to the worker that completed its predecessor"
    );
    let held = lane(&db, lane_id).await;
    assert_eq!(held.get_str("owner"), Ok("w"), "{held}");
    assert!(
        in_flight(&held).is_empty(),
        "the completed one is taken off: {held}"
    );
    let next = next_of_key(&store, "w", &lease, "hot", at(2))
        .await
        .expect("the key's next delivery, for the worker");
    assert_eq!(next.sequence, Some(2));

    // A worker that never claims the next delivery holds its key back for one claim only.
    complete_in_transaction(&store, &next.lease, at(3)).await;
    assert!(claim(&store, "w", 10, at(3)).await.is_empty());
    let third = claim(&store, "w", 10, at(3)).await;
    assert_eq!(third.len(), 1, "the claim after that takes it");
    assert_eq!(third[0].sequence(), Some(3));
}

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

#[tokio::test]
async fn the_next_delivery_of_a_key_is_taken_from_the_parked_ones_and_only_when_it_may_run() {
    let db = test_db("next_of_key_rules").await;
    let store = store(&db).await;
    let head = claim_head_of_parked_backlog(&store, &db).await;
    let lease = *head.lease();
    complete_in_transaction(&store, &lease, at(2)).await;

    // Not before the next delivery is due.
    assert!(
        next_of_key(&store, "w", &lease, "k", at(-1))
            .await
            .is_none()
    );
    // Not for another worker, nor with a lease of another epoch.
    assert!(
        next_of_key(&store, "other", &lease, "k", at(2))
            .await
            .is_none()
    );
    let stale = Lease::parse(
        &lease.delivery_id().to_hex(),
        &format!("{}:{}:0", lease.lane(), lease.epoch() + 1),
    )
    .unwrap();
    assert!(next_of_key(&store, "w", &stale, "k", at(2)).await.is_none());
    assert_eq!(parked_count(&db).await, 39, "nothing was unparked by those");

    // The worker that completed the head takes the next one from the parked lane, where it
    // runs without being written back to the ready one.
    let next = next_of_key(&store, "w", &lease, "k", at(2))
        .await
        .expect("the parked head of the key");
    assert_eq!(next.sequence, Some(2));
    assert_eq!(parked_count(&db).await, 39);
    let doc = delivery(&db, next.lease.delivery_id()).await.unwrap();
    assert_eq!(doc.get_str("lane").unwrap(), "parked");
    // The counts and listings give it as running, not as parked.
    let stats = store.statistics().await.unwrap();
    assert_eq!((stats.running, stats.parked), (1, 38));
    let by_handler = store.handler_statistics().await.unwrap();
    assert_eq!((by_handler[0].running, by_handler[0].parked), (1, 38));
    let listed = |state| {
        let store = store.clone();
        async move {
            store
                .list_deliveries(&DeliveryQuery::new().pending_state(state).limit(100))
                .await
                .unwrap()
        }
    };
    let running = listed(relaybus::PendingState::Running).await;
    assert_eq!(running.len(), 1);
    assert!(running[0].running && !running[0].parked, "{:?}", running[0]);
    let parked = listed(relaybus::PendingState::Parked).await;
    assert_eq!(parked.len(), 38);
    assert!(parked.iter().all(|record| record.parked && !record.running));
    // While it runs, neither a claim nor another call hands out anything of the key.
    assert!(claim(&store, "w", 10, at(3)).await.is_empty());
    assert!(next_of_key(&store, "w", &lease, "k", at(3)).await.is_none());
    // Given back, it is the key's parked head again, which the next claim hands out from
    // where it is.
    assert!(store.release(&next.lease, at(3)).await.unwrap());
    let again = claim(&store, "w", 10, at(3)).await;
    assert_eq!(again.len(), 1);
    assert_eq!(again[0].sequence(), Some(2));
    let doc = delivery(&db, next.lease.delivery_id()).await.unwrap();
    assert_eq!(doc.get_str("lane").unwrap(), "parked");
    let next = again.into_iter().next().unwrap();
    assert!(store.complete(next.lease(), at(4)).await.unwrap());
    assert_eq!(parked_count(&db).await, 38);

    // A lane taken over since: nothing, and the new holder's lane is left as it was.
    let taken = another_instance(&db).await;
    let later = claim(&taken, "w2", 10, at(100)).await;
    assert_eq!(later.len(), 1);
    assert_eq!(later[0].sequence(), Some(3));
    let before = lane(&db, lease.lane()).await;
    assert!(
        next_of_key(&store, "w", next.lease(), "k", at(101))
            .await
            .is_none()
    );
    assert_eq!(lane(&db, lease.lane()).await, before);
}

/// A claim takes the parked head of a key it holds the lane of where it is: the head runs from
/// the parked lane, with no write to send it back first. Buried there, it leaves the parked
/// lane, where it would stand for its key and hide the key's next deliveries.
#[tokio::test]
async fn a_key_s_parked_head_runs_where_it_is_and_buried_there_leaves_the_next_ones_free() {
    let db = test_db("parked_head_buried").await;
    let store = store(&db).await;
    let head = claim_head_of_parked_backlog(&store, &db).await;
    assert!(store.complete(head.lease(), at(2)).await.unwrap());

    let next = claim(&store, "w", 10, at(3)).await;
    assert_eq!(next.len(), 1);
    assert_eq!(next[0].sequence(), Some(2));
    let doc = delivery(&db, next[0].delivery_id()).await.unwrap();
    assert_eq!(doc.get_str("lane").unwrap(), "parked");
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

    store.setup().await.unwrap();
    let doc = delivery(&db, head.delivery_id()).await.unwrap();
    assert_eq!(
        (doc.get_str("status").unwrap(), doc.get_str("lane").unwrap()),
        ("dead", "ready")
    );
    let next = claim(&store, "w", 10, at(4)).await;
    assert_eq!(next.len(), 1, "the key's next delivery");
    assert_eq!(next[0].sequence(), Some(2));
}

#[tokio::test]
async fn a_next_of_key_claim_whose_reply_is_lost_is_reconciled_by_the_next_claim() {
    let db = test_db("next_of_key_lost").await;
    let (client, _, _) = counting_client(&db).await;
    let app = format!("{}-counted", db.name);
    let store = store_without_heartbeat(&client, &db).await;
    let lane_id = publish_hot(&store).await;
    let head = claim(&store, "w", 10, at(1)).await;
    assert_eq!(head.len(), 1);
    let lease = *head[0].lease();
    complete_in_transaction(&store, &lease, at(2)).await;

    // The lane write reaches the database, but the reply reports a failure.
    let fail = lose_the_reply_of_the_next_update(&db, &app).await;
    let failed = {
        use relaybus::store::NextOfKey;
        ClaimShortcuts::claim_next_of_key(
            &store,
            NextOfKey {
                owner: "w",
                completed: &lease,
                committing: false,
                finished: None,
                handler: HANDLER,
                key: "hot",
                lease_duration: LEASE,
                now: std::time::SystemTime::from(at(2)).into(),
            },
        )
        .await
    };
    fail.disable().await.unwrap();
    assert!(matches!(failed, Err(Error::Database(_))), "{failed:?}");
    let listed = in_flight(&lane(&db, lane_id).await);
    assert_eq!(listed.len(), 1, "the write landed: {listed:?}");

    // Nobody received it: the next claim puts it back and hands it out under a new generation.
    let again = claim(&store, "w", 10, at(3)).await;
    assert_eq!(again.len(), 1);
    assert_eq!(again[0].delivery_id(), listed[0]);
    assert_eq!(again[0].sequence(), Some(2));
    assert_eq!(again[0].attempt(), 1, "no attempt charged");
    assert_eq!(again[0].lease().claims(), 1, "the generation moved on");
    assert_eq!(
        in_flight(&lane(&db, lane_id).await),
        vec![listed[0]],
        "listed once"
    );
}

// ---------------------------------------------------------------------------------------------
// Claims beside a running claim

/// A claim beside the running claims of owner `w`, as the dispatcher makes it with what
/// `wake_ups` told of new deliveries.
async fn claim_beside(
    store: &MongoEventStore,
    now: DateTime,
    wake_ups: &[relaybus::store::WakeUp],
) -> Vec<relaybus::store::Claimed<Lease>> {
    use relaybus::store::ClaimRequest;
    let handlers = [HANDLER.to_owned()];
    let arrivals: Vec<relaybus::store::Arrival> =
        wake_ups.iter().filter_map(|w| w.arrival.clone()).collect();
    assert_eq!(
        arrivals.len(),
        wake_ups.len(),
        "every wake-up tells its delivery"
    );
    ClaimShortcuts::claim_beside(
        store,
        ClaimRequest {
            owner: "w",
            handlers: &handlers,
            limit: 32,
            run: 1,
            runs: 0,
            lease_duration: LEASE,
            now: std::time::SystemTime::from(now).into(),
            reported: &[],
            reports_complete: false,
            arrivals: &arrivals,
        },
    )
    .await
    .expect("claim beside")
}

/// A key other than `key` whose deliveries share its lane.
fn key_in_lane_of(key: &str) -> String {
    let lane = lane_of(Some(key), "");
    (0..)
        .map(|n| format!("{key}-neighbour-{n}"))
        .find(|other| lane_of(Some(other), "") == lane)
        .expect("some key shares the lane")
}

/// A claim of owner `w` at `now`, running in a task of its own.
fn spawn_claim(
    store: &MongoEventStore,
    now: DateTime,
) -> tokio::task::JoinHandle<Vec<relaybus::store::Claimed<Lease>>> {
    let store = store.clone();
    tokio::spawn(async move {
        let count = AtomicUsize::new(0);
        boundary_claimed(&store, &count, now, &[], false).await.1
    })
}

/// `w` comes to hold the lane of key `a`, whose delivery (`a-0`) completed, so the lane runs
/// nothing; then a new key's first delivery (`b-0`) comes into that lane. What the wake-ups
/// told of it.
async fn new_key_in_a_held_lane(
    db: &TestDb,
    store: &MongoEventStore,
    count: &AtomicUsize,
) -> Vec<relaybus::store::WakeUp> {
    let mut stream = wake_up_stream(db).await;
    publish(store, &[event("a-0", Some("a"))], &[HANDLER], at(0)).await;
    next_wake_ups(&mut stream, 1).await;
    let (_, first) = boundary_claimed(store, count, ms(0), &[], false).await;
    assert_eq!(first.len(), 1);
    assert!(store.complete(&first[0].lease, ms(1)).await.unwrap());
    let fresh = key_in_lane_of("a");
    publish(
        store,
        &[event("b-0", Some(fresh.as_str()))],
        &[HANDLER],
        at(0),
    )
    .await;
    next_wake_ups(&mut stream, 1).await
}

/// A client whose command monitor stops the task of the first claim's ranking of free lanes
/// once armed, as the ranking's first read starts, until the returned sender says go on: the
/// claim has read its lanes and scanned the held ones by then. The task is stopped on its worker
/// thread, so the test needs several.
async fn client_stopping_at_ranking(
    db: &TestDb,
) -> (
    Client,
    Arc<AtomicBool>,
    Arc<Notify>,
    std::sync::mpsc::Sender<()>,
) {
    let armed = Arc::new(AtomicBool::new(false));
    let stopped = Arc::new(Notify::new());
    let (go_on, wait) = std::sync::mpsc::channel::<()>();
    let mut options = ClientOptions::parse(&db.uri).await.unwrap();
    options.command_event_handler = Some(EventHandler::callback({
        let (armed, stopped, wait) = (Arc::clone(&armed), Arc::clone(&stopped), Mutex::new(wait));
        let rankings = AtomicUsize::new(0);
        move |event| {
            // The ranking's first read groups the free lanes' entries by lane.
            let ranks = matches!(&event, CommandEvent::Started(started)
            if started.command_name == "aggregate"
                && started.command.get_array("pipeline").is_ok_and(|stages| {
                    stages.iter().any(|stage| {
                        stage.as_document().is_some_and(|stage| stage.contains_key("$group"))
                    })
                }));
            if ranks && armed.load(Ordering::SeqCst) && rankings.fetch_add(1, Ordering::SeqCst) == 0
            {
                stopped.notify_one();
                let _ = wait.lock().unwrap().recv();
            }
        }
    }));
    (
        Client::with_options(options).unwrap(),
        armed,
        stopped,
        go_on,
    )
}

/// Several worker threads: the running claim's task is stopped on one of them.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_new_key_is_claimed_beside_a_running_claim_which_leaves_it_and_keeps_its_lane() {
    let db = test_db("beside_running").await;
    let (client, armed, stopped, go_on) = client_stopping_at_ranking(&db).await;
    let store = store_with(&client, &db, false).await;
    let count = AtomicUsize::new(0);
    let woken = new_key_in_a_held_lane(&db, &store, &count).await;
    let lane_a = lane_of(Some("a"), "a-0");

    // The owner's claim reads its held lane, running nothing, finds the new delivery there and
    // stops before ranking free lanes. Meanwhile a claim beside it takes that delivery.
    armed.store(true, Ordering::SeqCst);
    let running = spawn_claim(&store, ms(10));
    tokio::time::timeout(Duration::from_secs(60), stopped.notified())
        .await
        .expect("the running claim ranks free lanes after scanning its lane");
    let beside = claim_beside(&store, ms(11), &woken).await;
    assert_eq!(beside.len(), 1, "claimed beside the running claim");
    assert_eq!(beside[0].event.id(), "b-0");
    assert_eq!(beside[0].sequence, Some(1));
    go_on.send(()).unwrap();
    let running = running.await.unwrap();
    assert!(
        running.iter().all(|claimed| claimed.event.id() != "b-0"),
        "the running claim leaves what was claimed beside it: {running:?}"
    );
    // The running claim read the lane running nothing, yet kept it: it lists the new delivery.
    let lane = lane(&db, lane_a).await;
    assert_eq!(
        lane.get_str("owner"),
        Ok("w"),
        "the lane was not handed back"
    );
    assert_eq!(in_flight(&lane), vec![beside[0].lease.delivery_id()]);
    assert!(store.complete(&beside[0].lease, ms(12)).await.unwrap());
    // Nothing is left to run, and the lane goes back once it runs nothing.
    let (_, after) = boundary_claimed(&store, &count, ms(13), &[], false).await;
    assert!(after.is_empty(), "{after:?}");
    assert!(lanes_of(&db, "w").await.is_empty());
}

/// Several worker threads: the running claim's task is stopped on one of them.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_running_claim_does_not_hand_out_again_what_was_claimed_and_completed_beside_it() {
    let db = test_db("beside_completed").await;
    let (client, armed, stopped, go_on) = client_stopping_at_ranking(&db).await;
    let store = store_with(&client, &db, false).await;
    let count = AtomicUsize::new(0);
    let woken = new_key_in_a_held_lane(&db, &store, &count).await;

    // The owner's claim finds the new delivery in its held lane and stops before ranking free
    // lanes. Meanwhile a claim beside it takes the delivery, and the handler completes it: it
    // is no longer outstanding when the running claim records its batch.
    armed.store(true, Ordering::SeqCst);
    let running = spawn_claim(&store, ms(10));
    tokio::time::timeout(Duration::from_secs(60), stopped.notified())
        .await
        .expect("the running claim ranks free lanes after scanning its lane");
    let beside = claim_beside(&store, ms(11), &woken).await;
    assert_eq!(beside.len(), 1, "claimed beside the running claim");
    assert_eq!(beside[0].event.id(), "b-0");
    assert!(store.complete(&beside[0].lease, ms(12)).await.unwrap());
    go_on.send(()).unwrap();

    let running = running.await.unwrap();
    assert!(
        running.iter().all(|claimed| claimed.event.id() != "b-0"),
        "the running claim hands out again what completed beside it: {running:?}"
    );
    // Nothing is left to run, and the lane goes back once it runs nothing.
    let (_, after) = boundary_claimed(&store, &count, ms(13), &[], false).await;
    assert!(after.is_empty(), "{after:?}");
    assert!(lanes_of(&db, "w").await.is_empty());
}

#[tokio::test]
async fn a_claim_beside_takes_only_what_may_run_at_once() {
    let db = test_db("beside_rules").await;
    // Parking off: the second delivery of a key is written ready, as a requeue leaves it (a
    // delivery written parked is left to the owner's next claim).
    let store = store_built(&db.client, &db, |builder| builder.park_threshold(u32::MAX)).await;
    let other = store_with(&db.client, &db, false).await;
    let mut stream = wake_up_stream(&db).await;
    // Two deliveries of key `k`: the first runs, so the second waits.
    publish(
        &store,
        &[event("k-0", Some("k")), event("k-1", Some("k"))],
        &[HANDLER],
        at(0),
    )
    .await;
    let woken = next_wake_ups(&mut stream, 2).await;
    let count = AtomicUsize::new(0);
    let (_, head) = boundary_claimed(&store, &count, ms(0), &[], false).await;
    assert_eq!(head.len(), 1);
    assert!(
        claim_beside(&store, ms(1), &woken).await.is_empty(),
        "k runs"
    );
    // Once it completed, the second is the key's lowest pending delivery; the first's arrival
    // (its delivery is gone) is passed over.
    assert!(store.complete(&head[0].lease, ms(2)).await.unwrap());
    let next = claim_beside(&store, ms(3), &woken).await;
    assert_eq!(next.len(), 1);
    assert_eq!(next[0].event.id(), "k-1");
    assert!(
        claim_beside(&store, ms(4), &woken).await.is_empty(),
        "handed out already"
    );
    assert!(store.complete(&next[0].lease, ms(5)).await.unwrap());

    // A lane another owner holds is theirs, whatever comes into it.
    publish(&other, &[event("x-0", Some("x"))], &[HANDLER], at(0)).await;
    next_wake_ups(&mut stream, 1).await;
    let theirs = other
        .claim("x", &[HANDLER], 10, LEASE, ms(6))
        .await
        .unwrap();
    assert_eq!(theirs.len(), 1);
    let neighbour = key_in_lane_of("x");
    publish(
        &store,
        &[event("y-0", Some(neighbour.as_str()))],
        &[HANDLER],
        at(0),
    )
    .await;
    let woken = next_wake_ups(&mut stream, 1).await;
    assert!(claim_beside(&store, ms(7), &woken).await.is_empty());
    // Not yet due: left to the owner's claims.
    publish(&store, &[event("later", None)], &[HANDLER], at(3_600)).await;
    let woken = next_wake_ups(&mut stream, 1).await;
    assert!(claim_beside(&store, ms(8), &woken).await.is_empty());
    // An unkeyed delivery in a free lane is taken, the lane with it.
    publish(&store, &[event("free-0", None)], &[HANDLER], at(0)).await;
    let woken = next_wake_ups(&mut stream, 1).await;
    let taken = claim_beside(&store, ms(9), &woken).await;
    assert_eq!(taken.len(), 1);
    let lane = lane(&db, lane_of(None, "free-0")).await;
    assert_eq!(lane.get_str("owner"), Ok("w"));
    assert!(store.complete(&taken[0].lease, ms(10)).await.unwrap());
}

/// `n` unkeyed events whose ids fall in lanes none of `used` has, each in a lane of its own;
/// their lanes join `used`.
fn events_in_new_lanes(prefix: &str, n: usize, used: &mut HashSet<u32>) -> Vec<EventEnvelope> {
    (0..)
        .map(|i| format!("{prefix}-{i}"))
        .filter(|id| used.insert(lane_of(None, id)))
        .take(n)
        .map(|id| event(&id, None))
        .collect()
}

/// The event ids of the pending deliveries, oldest first (all are due at once: `_id` order).
async fn oldest_first(db: &TestDb) -> Vec<String> {
    deliveries(db)
        .await
        .iter()
        .map(|d| d.get_str("eventId").unwrap().to_owned())
        .collect()
}

fn sorted(ids: &[String]) -> Vec<String> {
    let mut ids = ids.to_vec();
    ids.sort();
    ids
}

/// The event ids of a claim's deliveries, sorted.
fn claimed_ids(claimed: &[ClaimedDelivery]) -> Vec<String> {
    let mut ids: Vec<String> = claimed.iter().map(|c| c.event_id().to_owned()).collect();
    ids.sort();
    ids
}

#[tokio::test]
async fn a_claim_that_lost_some_lanes_returns_what_it_got_and_one_that_lost_all_tries_again() {
    // The lanes A loses are counted: this test's thread (the runtime's only one) records them.
    // Each look takes the count since the last one.
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let _recording = metrics::set_default_local_recorder(&recorder);
    let conflicts = || -> u64 {
        snapshotter
            .snapshot()
            .into_vec()
            .into_iter()
            .filter(|(key, ..)| key.key().name() == telemetry::LANE_CONFLICTS)
            .map(|(.., value)| match value {
                DebugValue::Counter(n) => n,
                other => panic!("not a counter: {other:?}"),
            })
            .sum()
    };
    let db = test_db("raced_claims").await;
    // Instance A's client tells when A sends a lane `update` (a claim's record), which the
    // server holds back once, while instance B claims from the same lanes.
    let app = format!("{}-raced", db.name);
    let (client, armed, recording) = client_telling(&db, &app, |event| {
        matches!(event, CommandEvent::Started(started)
            if started.command_name == "update"
                && started.command.get_str("update") == Ok("relaybus_lanes"))
    })
    .await;
    // Without crash recovery: its heartbeat would send `update`s of its own.
    let a = MongoEventStore::builder(client)
        .database(&db.name)
        .crash_recovery(false)
        .build()
        .unwrap();
    a.setup().await.unwrap();
    let b = another_instance(&db).await;
    let mut used = HashSet::new();
    // Twelve deliveries, oldest first, each in a lane of its own.
    let events = events_in_new_lanes("r", 12, &mut used);
    publish(&b, &events, &[HANDLER], at(0)).await;
    let ids = sorted(&oldest_first(&db).await);
    assert_eq!(ids.len(), 12);

    // A ranks the free lanes and picks one delivery from each of eight; before its record
    // lands, B, ranking the same lanes the same way, takes lanes of them.
    let held_back = hold_back_once(&db, &app, "update", 3_000).await;
    armed.store(true, Ordering::SeqCst);
    let claiming = tokio::spawn({
        let a = a.clone();
        async move { claim(&a, "a", 8, at(1)).await }
    });
    recording.notified().await;
    armed.store(false, Ordering::SeqCst);
    let taken_first = claim(&b, "b", 2, at(1)).await;
    assert_eq!(taken_first.len(), 2);
    let partial = claiming.await.unwrap();
    drop(held_back);
    // A lost the lanes B wrote first; it returns what it kept, without another pass over the
    // lanes for the rest (which would find the four untouched lanes).
    assert!(
        !partial.is_empty() && partial.len() < 8,
        "A returns what it kept: {:?}",
        claimed_ids(&partial)
    );
    // One delivery in each lane: it counted a conflict per delivery it lost.
    assert_eq!(conflicts(), 8 - partial.len() as u64);
    // Its next claims take the rest: first the lanes of its own slot among the two claimers,
    // then, finding nothing more there, B's.
    let mut rest = claim(&a, "a", 8, at(2)).await;
    assert!(!rest.is_empty());
    rest.extend(claim(&a, "a", 8, at(2)).await);
    assert_eq!(rest.len(), 10 - partial.len());
    let all: Vec<ClaimedDelivery> = [&taken_first, &partial, &rest]
        .into_iter()
        .flatten()
        .cloned()
        .collect();
    assert_eq!(claimed_ids(&all), ids, "each delivery claimed once");

    // Four more in new lanes. A (as owner c) picks two, and B (as owner d) takes both lanes
    // first: A's claim has nothing, so it tries the other lanes.
    for lease in partial.iter().chain(&rest).map(ClaimedDelivery::lease) {
        assert!(a.complete(lease, at(3)).await.unwrap());
    }
    for lease in taken_first.iter().map(ClaimedDelivery::lease) {
        assert!(b.complete(lease, at(3)).await.unwrap());
    }
    // Claims that find nothing hand the lanes back: the next claimers are alone again. (A's
    // first keeps one lane, listing nothing, while B still holds two; its next one, with B
    // holding none, hands it back.)
    assert!(claim(&a, "a", 8, at(3)).await.is_empty());
    assert_eq!(lanes_of(&db, "a").await.len(), 1);
    assert!(claim(&b, "b", 8, at(3)).await.is_empty());
    assert!(claim(&a, "a", 8, at(3)).await.is_empty());
    assert!(lanes_of(&db, "a").await.is_empty());
    assert!(lanes_of(&db, "b").await.is_empty());
    let events = events_in_new_lanes("s", 4, &mut used);
    publish(&b, &events, &[HANDLER], at(3)).await;
    let ids = sorted(&oldest_first(&db).await);
    assert_eq!(ids.len(), 4);
    let held_back = hold_back_once(&db, &app, "update", 3_000).await;
    armed.store(true, Ordering::SeqCst);
    let claiming = tokio::spawn({
        let a = a.clone();
        async move { claim(&a, "c", 2, at(4)).await }
    });
    recording.notified().await;
    armed.store(false, Ordering::SeqCst);
    let taken_first = claim(&b, "d", 2, at(4)).await;
    assert_eq!(taken_first.len(), 2);
    let mut retried = claiming.await.unwrap();
    drop(held_back);
    assert!(
        !retried.is_empty(),
        "A lost every lane it picked from and claimed from the others"
    );
    assert_eq!(conflicts(), 2, "the two lanes it lost, since the last look");
    // The retry took the lanes of its own slot among the claimers it knows of (a and c on A, d
    // holding lanes) if there were any; its next claim takes what is left.
    if retried.len() < 2 {
        retried.extend(claim(&a, "c", 2, at(4)).await);
    }
    assert_eq!(retried.len(), 2);
    let all: Vec<ClaimedDelivery> = taken_first.iter().chain(&retried).cloned().collect();
    assert_eq!(claimed_ids(&all), ids, "each delivery claimed once");
}

#[tokio::test]
async fn an_idle_claim_hands_out_no_reported_delivery_buried_between_its_read_and_its_write() {
    // The claim of reported deliveries reads and writes at once; here its read finds the
    // delivery pending, an operator buries it, and only then its write lists it. The write
    // finds the lane's requeue count moved on, so the read proves nothing, the pick is taken
    // back, and the usual claim finds nothing due.
    let db = test_db("arrival_buried").await;
    let app = format!("{}-told", db.name);
    let (client, armed, told) = client_telling(
        &db,
        &app,
        |event| matches!(event, CommandEvent::Succeeded(e) if e.command_name == "aggregate"),
    )
    .await;
    let store = store_with(&client, &db, false).await;
    let mut stream = wake_up_stream(&db).await;
    let count = AtomicUsize::new(0);
    let (_, got) = boundary_claim(&store, &count, ms(0), &[], true).await;
    assert_eq!(got, 0, "idle");
    let id = id_in_lane("buried", u32::MAX, false);
    publish(&store, &[event(&id, None)], &[HANDLER], at(0)).await;
    let woken = next_wake_ups(&mut stream, 1).await;
    let lanes: Vec<u32> = woken.iter().filter_map(|w| w.at).collect();
    let arrivals: Vec<relaybus::store::Arrival> = woken
        .iter()
        .map(|w| w.arrival.clone().expect("a wake-up tells its delivery"))
        .collect();
    let pending = deliveries(&db).await;
    assert_eq!(pending.len(), 1);
    let delivery = pending[0].get_object_id("_id").unwrap().to_hex();

    let _held = hold_back_once(&db, &app, "findAndModify", 1_500).await;
    armed.store(true, Ordering::SeqCst);
    let claim = tokio::spawn({
        let store = store.clone();
        async move {
            let count = AtomicUsize::new(0);
            boundary_claimed_with(&store, &count, ms(10), &lanes, true, &arrivals)
                .await
                .1
        }
    });
    tokio::time::timeout(Duration::from_secs(10), told.notified())
        .await
        .expect("the claim's read ends while its write is held");
    let operator = store_with(&db.client, &db, false).await;
    let buried = operator
        .bury_by_id(&[delivery], "not wanted", ms(11))
        .await
        .unwrap();
    assert_eq!(buried.buried.len(), 1, "{buried:?}");
    let claimed = claim.await.unwrap();
    assert!(
        claimed.is_empty(),
        "a buried delivery was handed out: {claimed:?}"
    );
    let lane = lane_document(&db, lane_of(None, &id)).await;
    assert_eq!(
        lane.get_array("inFlight").map(Vec::len).unwrap_or(0),
        0,
        "its write was taken back: {lane:?}"
    );
}

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
async fn a_delivery_written_parked_behind_one_that_completed_before_its_commit_is_claimed_when_reported()
 {
    let db = test_db("born_parked_race").await;
    let (client, count, _) = counting_client(&db).await;
    let store = store_parking_behind_pending(&client, &db).await;
    publish(&store, &[event("k-0", Some("k"))], &[HANDLER], at(0)).await;
    let (_, head) = boundary_claimed(&store, &count, ms(0), &[], true).await;
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
                let (_, none) = boundary_claimed(&store, &count, ms(2), &[], true).await;
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
    // again): the idle claim takes it, nothing being pending before it.
    assert_eq!(
        woken_event_ids(&next_wake_ups(&mut wake_ups, 1).await),
        ["k-1"]
    );
    let reported = [lane_of(Some("k"), "k-1")];
    let (_, got) = boundary_claimed(&store, &count, ms(3), &reported, true).await;
    let ids: Vec<&str> = got.iter().map(|c| c.event.id()).collect();
    assert_eq!(ids, ["k-1"]);
}
