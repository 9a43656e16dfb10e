//! Items of the store specification that had no test of their own: the default transaction
//! options, racing appends of one event id, the completion history's listing, the retry limit
//! of transactions and its default, the write concern and read preference outside
//! transactions, documents an older writer left with null fields, and the retention purge.

use std::{
    sync::{
        Arc, Mutex,
        atomic::{AtomicU32, Ordering},
    },
    time::{Duration, Instant},
};

use futures::TryStreamExt;
use mongodb::{
    Client,
    bson::{Bson, DateTime, Document, doc},
    event::{EventHandler, command::CommandEvent},
    options::{ClientOptions, ReadPreference, SelectionCriteria, WriteConcern},
};
use relaybus::store::prelude::*;
use relaybus::{
    AppendRequest, DeliveryQuery, DeliveryStatus, Error, EventEnvelope, MongoEventStore, RelayBus,
    Retention, Timestamp,
    event::lane_of,
    store::{ClaimRequest, transaction},
};
use relaybus_harness::{TestDb, test_db};
use relaybus_tests::support::{OrderPlaced, noop, placed, store};
use serde_json::json;

const PLACED: &str = "order.placed.v1";

fn envelope(id: &str) -> EventEnvelope {
    EventEnvelope::from_json(PLACED, json!({ "order_id": id, "total_cents": 1250 }))
        .unwrap()
        .with_id(id)
        .unwrap()
}

/// Appends `event` for `handlers`, created and due at `at`, in a transaction of its own.
async fn append_one(
    store: &MongoEventStore,
    event: &EventEnvelope,
    handlers: &[String],
    at: Timestamp,
) {
    transaction::run(store, None, async |session| {
        Append::append(store, session, &[AppendRequest::new(event, handlers)], at).await
    })
    .await
    .unwrap();
}

/// Claims up to `limit` deliveries of `handlers` for `owner` at `now`, with a 30 s lease.
async fn claim_as(
    store: &MongoEventStore,
    owner: &str,
    handlers: &[String],
    limit: u32,
    now: Timestamp,
) -> Vec<relaybus::store::Claimed<relaybus::Lease>> {
    Queue::claim(
        store,
        ClaimRequest {
            owner,
            handlers,
            limit,
            lease_duration: Duration::from_secs(30),
            now,
        },
    )
    .await
    .unwrap()
}

async fn claim_all(
    store: &MongoEventStore,
    handlers: &[&str],
) -> Vec<relaybus::store::Claimed<relaybus::Lease>> {
    let handlers: Vec<String> = handlers.iter().map(|h| (*h).to_owned()).collect();
    claim_as(store, "w", &handlers, 100, Timestamp::now()).await
}

/// The server's `failCommand` fail point in `mode` with `data`, until the guard drops.
async fn fail_command(db: &TestDb, mode: Bson, data: Document) -> relaybus_harness::FailPoint {
    relaybus_harness::FailPoint::enable(
        &db.client,
        doc! { "configureFailPoint": "failCommand", "mode": mode, "data": data },
    )
    .await
    .unwrap()
}

/// Every command a client started, whole.
async fn recording_client(uri: &str) -> (ClientOptions, Arc<Mutex<Vec<Document>>>) {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let mut options = ClientOptions::parse(uri).await.unwrap();
    let sink = Arc::clone(&seen);
    options.command_event_handler = Some(EventHandler::callback(move |event| {
        if let CommandEvent::Started(started) = event {
            sink.lock().unwrap().push(started.command);
        }
    }));
    (options, seen)
}

/// A store set up in `db` on a client that records every command it starts.
async fn recorded_store(db: &TestDb) -> (MongoEventStore, Arc<Mutex<Vec<Document>>>) {
    let (options, seen) = recording_client(&db.uri).await;
    let store = MongoEventStore::builder(Client::with_options(options).unwrap())
        .database(&db.name)
        .build()
        .unwrap();
    store.setup().await.unwrap();
    (store, seen)
}

#[tokio::test]
async fn the_default_transaction_options_read_a_snapshot_and_commit_with_majority() {
    let db = test_db("spec_tx_options").await;
    let (options, seen) = recording_client(&db.uri).await;
    let client = Client::with_options(options).unwrap();
    let store = MongoEventStore::builder(client)
        .database(&db.name)
        .build()
        .unwrap();
    store.setup().await.unwrap();
    seen.lock().unwrap().clear();

    let event = envelope("o-1");
    let handlers = ["projector".to_owned()];
    append_one(&store, &event, &handlers, Timestamp::now()).await;

    let commands = seen.lock().unwrap().clone();
    let in_transaction: Vec<&Document> = commands
        .iter()
        .filter(|c| c.get_bool("autocommit") == Ok(false))
        .collect();
    let first = in_transaction
        .iter()
        .find(|c| c.get_bool("startTransaction") == Ok(true))
        .expect("a command starts the transaction");
    assert_eq!(
        first
            .get_document("readConcern")
            .ok()
            .and_then(|r| r.get_str("level").ok()),
        Some("snapshot"),
        "{first}"
    );
    let commit = in_transaction
        .iter()
        .find(|c| c.contains_key("commitTransaction"))
        .expect("a commit");
    assert_eq!(
        commit
            .get_document("writeConcern")
            .ok()
            .and_then(|w| w.get_str("w").ok()),
        Some("majority"),
        "{commit}"
    );
}

#[tokio::test]
async fn two_transactions_racing_on_one_event_id_conflict_and_never_report_a_duplicate_key() {
    let db = test_db("spec_race_id").await;
    let store = store(&db).await;
    let event = envelope("o-race");
    let handlers = ["projector".to_owned()];
    let requests = [AppendRequest::new(&event, &handlers)];

    let mut first = Transactions::session(&store).await.unwrap();
    let mut second = Transactions::session(&store).await.unwrap();
    Transactions::begin(&store, &mut first, None).await.unwrap();
    Transactions::begin(&store, &mut second, None)
        .await
        .unwrap();
    let appended = Append::append(&store, &mut first, &requests, Timestamp::now())
        .await
        .unwrap();
    assert!(appended[0].created);
    let raced = Append::append(&store, &mut second, &requests, Timestamp::now()).await;
    match &raced {
        Err(error) => {
            assert!(
                error.is_transient_transaction_error(),
                "a retryable conflict: {error:?}"
            );
            assert!(
                !format!("{error:?}").contains("11000"),
                "never a duplicate key: {error:?}"
            );
        }
        Ok(appended) => panic!("the second append saw no conflict: {appended:?}"),
    }
    Transactions::abort(&store, &mut second).await;
    Transactions::commit(&store, &mut first).await.unwrap();

    // Run again after the first committed, the second finds the event and adds nothing.
    let again = transaction::run(&store, None, async |session| {
        Append::append(&store, session, &requests, Timestamp::now()).await
    })
    .await
    .unwrap();
    assert!(!again[0].created);
    assert!(again[0].new_deliveries.is_empty());
}

#[tokio::test]
async fn the_completion_history_lists_with_every_filter_and_is_empty_without_history() {
    let db = test_db("spec_history").await;
    let history = MongoEventStore::builder(db.client.clone())
        .database(&db.name)
        .completion_history(true)
        .build()
        .unwrap();
    history.setup().await.unwrap();
    let before = Timestamp::now();
    let events: Vec<EventEnvelope> = (0..3).map(|i| envelope(&format!("h-{i}"))).collect();
    let handlers = ["projector".to_owned(), "mailer".to_owned()];
    transaction::run(&history, None, async |session| {
        let requests: Vec<AppendRequest<'_>> = events
            .iter()
            .map(|e| AppendRequest::new(e, &handlers))
            .collect();
        Append::append(&history, session, &requests, Timestamp::now()).await
    })
    .await
    .unwrap();
    let claimed = claim_all(&history, &["projector", "mailer"]).await;
    assert_eq!(claimed.len(), 6);
    let leases: Vec<_> = claimed.iter().map(|c| c.lease).collect();
    assert_eq!(
        Queue::complete(&history, &leases, Timestamp::now())
            .await
            .unwrap(),
        [true; 6]
    );

    let list = |query: DeliveryQuery| {
        let history = history.clone();
        async move { Inspect::list_deliveries(&history, &query).await.unwrap() }
    };
    let completed = DeliveryQuery::new().status(DeliveryStatus::Completed);
    assert_eq!(list(completed.clone()).await.len(), 6);
    let mailer = list(completed.clone().handler("mailer")).await;
    assert_eq!(mailer.len(), 3);
    assert!(
        mailer
            .iter()
            .all(|r| r.handler == "mailer" && r.completed_at.is_some())
    );
    assert_eq!(list(completed.clone().event_type(PLACED)).await.len(), 6);
    assert!(
        list(completed.clone().event_type("order.shipped.v1"))
            .await
            .is_empty()
    );
    assert!(
        list(completed.clone().created_before(before))
            .await
            .is_empty()
    );
    assert_eq!(list(completed.clone().created_from(before)).await.len(), 6);
    assert_eq!(list(completed.clone().event_id("h-1")).await.len(), 2);
    let page = list(completed.clone().limit(4)).await;
    let rest = list(completed.clone().after(page[3].id.clone())).await;
    assert_eq!(rest.len(), 2, "paged by id with no overlap");
    assert_eq!(Inspect::statistics(&history).await.unwrap().completed, 6);

    // The same database read without completion history: no completed listing, no count.
    let without = MongoEventStore::builder(db.client.clone())
        .database(&db.name)
        .build()
        .unwrap();
    assert!(
        Inspect::list_deliveries(&without, &completed)
            .await
            .unwrap()
            .is_empty(),
        "no completed listing without history"
    );
    let stats = Inspect::statistics(&without).await.unwrap();
    assert_eq!((stats.completed, stats.completion_history), (0, false));
}

#[tokio::test]
async fn transaction_retries_stop_at_their_limit_with_the_last_error() {
    let db = test_db("spec_retry_limit").await;
    let bus = RelayBus::builder(store(&db).await)
        .subscribe(noop::<OrderPlaced>("a"))
        .transaction_retry_limit(Duration::from_millis(300))
        .build()
        .unwrap();
    let runs = AtomicU32::new(0);
    let started = Instant::now();
    let result: Result<(), Error> = bus
        .transaction(async |_session| {
            runs.fetch_add(1, Ordering::SeqCst);
            Err(Error::Database(
                relaybus::DatabaseError::new(std::io::Error::other("always a write conflict"))
                    .with_transient(true),
            ))
        })
        .await;
    let elapsed = started.elapsed();
    match result {
        Err(Error::Database(error)) => {
            assert!(error.is_transient());
            assert!(
                error.to_string().contains("always a write conflict"),
                "{error}"
            );
        }
        other => panic!("expected the last transient error, got {other:?}"),
    }
    assert!(runs.load(Ordering::SeqCst) >= 2, "it retried");
    assert!(elapsed >= Duration::from_millis(300), "{elapsed:?}");
    assert!(
        elapsed < Duration::from_secs(3),
        "stopped at the limit, not the budget: {elapsed:?}"
    );
}

/// Without a limit of its own, a store's transaction retries transient errors for 120 seconds,
/// then returns the last one. The runner is the one every store shares; on the in-memory store
/// the test can pause time, so that the pauses between attempts pass at once.
#[tokio::test(start_paused = true)]
async fn transaction_retries_stop_after_120_seconds_by_default() {
    let store = relaybus::MemoryEventStore::new();
    let runs = AtomicU32::new(0);
    let started = tokio::time::Instant::now();
    let result: Result<(), Error> = store
        .transaction(async |_session| {
            runs.fetch_add(1, Ordering::SeqCst);
            Err(Error::Database(
                relaybus::DatabaseError::new(std::io::Error::other("always a write conflict"))
                    .with_transient(true),
            ))
        })
        .await;
    let elapsed = started.elapsed();
    match result {
        Err(Error::Database(error)) => assert!(error.is_transient(), "{error}"),
        other => panic!("expected the last transient error, got {other:?}"),
    }
    assert!(
        (Duration::from_secs(120)..Duration::from_secs(121)).contains(&elapsed),
        "retried for {elapsed:?}"
    );
    assert!(runs.load(Ordering::SeqCst) > 1_000, "it retried all along");
}

/// The documents of an event and its delivery written by another writer that stores absent
/// values as null.
async fn write_with_nulls(db: &TestDb, id: &str) {
    db.db()
        .collection::<Document>("relaybus_events")
        .insert_one(doc! {
            "_id": id,
            "type": PLACED,
            "payload": { "order_id": id, "total_cents": 1250 },
            "key": null,
            "sequence": null,
            "correlationId": null,
            "causationId": null,
            "headers": null,
            "handlers": ["projector"],
            "createdAt": DateTime::now(),
        })
        .await
        .unwrap();
    db.db()
        .collection::<Document>("relaybus_deliveries")
        .insert_one(doc! {
            "eventId": id,
            "handler": "projector",
            "eventType": PLACED,
            "key": null,
            "sequence": null,
            "laneId": lane_of(None, id) as i32,
            "lane": "ready",
            "status": "pending",
            "attempts": 0,
            "dueAt": DateTime::now(),
            "createdAt": DateTime::now(),
            "updatedAt": null,
            "lastError": null,
        })
        .await
        .unwrap();
}

#[tokio::test]
async fn documents_with_null_fields_are_read_as_absent_ones() {
    let db = test_db("spec_nulls").await;
    let store = store(&db).await;
    write_with_nulls(&db, "with-nulls").await;
    let event = envelope("without");
    let handlers = ["projector".to_owned()];
    append_one(&store, &event, &handlers, Timestamp::now()).await;

    let claimed = claim_all(&store, &["projector"]).await;
    assert_eq!(claimed.len(), 2);
    for delivery in &claimed {
        let event = &delivery.event;
        assert_eq!(event.key(), None, "{}", event.id());
        assert_eq!(event.correlation_id(), None);
        assert_eq!(event.causation_id(), None);
        assert!(event.headers().is_empty());
        assert_eq!(delivery.sequence, None);
        assert_eq!(delivery.attempt, 1);
    }
    let listed = Inspect::list_deliveries(&store, &DeliveryQuery::new())
        .await
        .unwrap();
    assert_eq!(listed.len(), 2);
    for record in &listed {
        assert_eq!(
            (
                record.key.as_deref(),
                record.sequence,
                record.last_error.as_deref()
            ),
            (None, None, None)
        );
        assert!(record.running, "both are claimed now");
    }
    let leases: Vec<_> = claimed.iter().map(|c| c.lease).collect();
    assert_eq!(
        Queue::complete(&store, &leases, Timestamp::now())
            .await
            .unwrap(),
        [true, true]
    );
}

#[tokio::test]
async fn purge_expired_deletes_what_the_retention_lets_go() {
    let db = test_db("spec_purge_expired").await;
    let clock = relaybus::clock::TestClock::starting_now();
    let bus = RelayBus::builder(store(&db).await)
        .clock(clock.clone())
        .without_registered_handlers()
        .subscribe(noop::<OrderPlaced>("projector"))
        .retention(Some(Retention {
            completed: Duration::from_millis(1),
            dead: Duration::from_secs(3_600),
            interval: Duration::from_secs(3_600),
        }))
        .build()
        .unwrap();
    for n in 0..3 {
        bus.publish(&placed(&format!("o-{n}"))).await.unwrap();
    }
    assert_eq!(bus.run_once().await.unwrap().claimed, 3);
    let events = db.db().collection::<Document>("relaybus_events");
    assert_eq!(events.count_documents(doc! {}).await.unwrap(), 3);
    // Completed within a minute of their creation, the events carry no completion time: purge
    // takes them as completed two minutes after it, at the latest.
    clock.advance(Duration::from_secs(60));
    assert_eq!(bus.purge_expired().await.unwrap().events, 0);
    // The cutoff is `now - 1 ms`.
    clock.advance(Duration::from_secs(61));
    let purged = bus.purge_expired().await.unwrap();
    assert_eq!(purged.events, 3, "{purged:?}");
    assert_eq!(events.count_documents(doc! {}).await.unwrap(), 0);

    let off = RelayBus::builder(bus.store().clone())
        .without_registered_handlers()
        .subscribe(noop::<OrderPlaced>("projector"))
        .retention(None)
        .build()
        .unwrap();
    assert!(matches!(
        off.purge_expired().await,
        Err(Error::Configuration(
            relaybus::ConfigurationError::InvalidOption {
                option: "retention",
                ..
            }
        ))
    ));
}

/// An event id whose unkeyed deliveries land in `lane`.
fn id_in_lane(lane: u32) -> String {
    ids_in_lane("lane", lane, 1).remove(0)
}

/// `count` event ids starting with `prefix` whose unkeyed deliveries land in `lane`.
fn ids_in_lane(prefix: &str, lane: u32, count: usize) -> Vec<String> {
    (0..)
        .map(|n| format!("{prefix}-{lane}-{n}"))
        .filter(|id| lane_of(None, id) == lane)
        .take(count)
        .collect()
}

#[tokio::test]
async fn owners_of_no_lanes_take_free_lanes_oldest_due_first_in_growing_rounds() {
    let db = test_db("spec_lane_taking").await;
    let store = store(&db).await;
    // 128 free lanes with one due delivery each, the lane of rank r due r seconds after the
    // oldest, in an order unrelated to the lane numbers.
    let now = Timestamp::now();
    let ranked: Vec<u32> = (0..128).map(|rank| (rank * 37 + 11) % 256).collect();
    one_due_in_each(&store, &ranked, now).await;

    // A member claims for another handler: the members' handler sets differ, so none owns
    // lanes, and each takes free lanes with work as the specification says: 4 lanes in a
    // first round, the oldest due first, then 8, 16, ... until the claim is full.
    // The auditor, alone at first, owned and took every lane; once the claimer joined, it
    // owns none and hands them back at its next claim.
    let auditor = ["auditor".to_owned()];
    let handlers = ["projector".to_owned()];
    assert!(
        claim_as(&store, "auditor", &auditor, 4, now)
            .await
            .is_empty()
    );
    assert_eq!(held_lanes(&db).await.len(), 256);
    assert!(
        claim_as(&store, "claimer", &handlers, 4, now)
            .await
            .is_empty()
    );
    assert!(
        claim_as(&store, "auditor", &auditor, 4, now)
            .await
            .is_empty()
    );
    assert!(held_lanes(&db).await.is_empty());
    let rank_of = |batch: &[relaybus::store::Claimed<relaybus::Lease>]| {
        let mut ranks: Vec<usize> = batch
            .iter()
            .map(|c| {
                ranked
                    .iter()
                    .position(|lane| *lane == c.lease.lane())
                    .unwrap()
            })
            .collect();
        ranks.sort_unstable();
        ranks
    };
    let first = claim_as(&store, "claimer", &handlers, 4, now).await;
    assert_eq!(rank_of(&first), [0, 1, 2, 3], "the oldest four");
    // Its lanes run what it took; the next claim takes a round of 4 and one of 8.
    let second = claim_as(&store, "claimer", &handlers, 12, now).await;
    assert_eq!(rank_of(&second), (4..16).collect::<Vec<_>>());
    let held = held_lanes(&db).await;
    assert_eq!(held.len(), 16, "a lane per delivery running: {held:?}");
    // Completed, the lanes run nothing and yield nothing: the next claim hands them back.
    let leases: Vec<relaybus::Lease> = first.iter().chain(&second).map(|c| c.lease).collect();
    assert!(
        relaybus::store::Queue::complete(&store, &leases, now)
            .await
            .unwrap()
            .iter()
            .all(|done| *done)
    );
    let third = claim_as(&store, "claimer", &handlers, 4, now).await;
    assert_eq!(rank_of(&third), [16, 17, 18, 19]);
    assert_eq!(
        held_lanes(&db).await.len(),
        4,
        "the 16 emptied lanes went back"
    );
}

#[tokio::test]
async fn members_split_the_lanes_and_hand_on_those_that_moved_once_they_run_nothing() {
    let db = test_db("spec_lane_members").await;
    let (store, now) = one_due_per_lane(&db).await;
    let handlers = ["projector".to_owned()];

    // Alone, `a` owns every lane: it takes them all, and its claim the 4 oldest deliveries.
    let first = claim_as(&store, "a", &handlers, 4, now).await;
    assert_eq!(lanes_of(&first), [0, 1, 2, 3]);
    let held = held_lanes(&db).await;
    assert_eq!(held.len(), 256);
    assert!(held.values().all(|owner| owner == "a"));

    // `b` joins: it owns about half the lanes now, but `a` holds them under a live lease.
    assert!(claim_as(&store, "b", &handlers, 64, now).await.is_empty());
    // `a` claims again: it scans only the lanes it still owns, and hands on the others that
    // run nothing; the lanes of its first claim's deliveries it keeps while they run.
    let mine = claim_as(&store, "a", &handlers, 64, now).await;
    let held = held_lanes(&db).await;
    let of_a: Vec<u32> = held
        .iter()
        .filter(|(_, o)| *o == "a")
        .map(|(l, _)| *l)
        .collect();
    let given: Vec<u32> = (0..256).filter(|lane| !held.contains_key(lane)).collect();
    assert!(
        (60..=200).contains(&given.len()),
        "{} lanes handed on",
        given.len()
    );
    assert!(lanes_of(&mine).iter().all(|lane| of_a.contains(lane)));
    // `b` takes the lanes it owns and their deliveries; `a` keeps the running ones.
    let theirs = claim_as(&store, "b", &handlers, 64, now).await;
    assert_eq!(
        lanes_of(&theirs),
        given
            .iter()
            .copied()
            .filter(|l| *l < 64)
            .collect::<Vec<_>>()
    );
    let held = held_lanes(&db).await;
    assert_eq!(held.len(), 256);
    let of_b: Vec<u32> = held
        .iter()
        .filter(|(_, o)| *o == "b")
        .map(|(l, _)| *l)
        .collect();
    assert_eq!(of_b, given);
    // Every delivery went to exactly one of them.
    let mut all: Vec<u32> = [first, mine, theirs]
        .iter()
        .flat_map(|b| lanes_of(b))
        .collect();
    all.sort_unstable();
    assert_eq!(all, (0..64).collect::<Vec<_>>());
}

#[tokio::test]
async fn an_owner_that_relinquished_its_lanes_no_longer_counts_among_the_claimers() {
    let db = test_db("spec_lane_slots_relinquished").await;
    let (store, now) = one_due_per_lane(&db).await;
    let handlers = ["projector".to_owned()];

    // `b` claimed through the same store instance, then stopped: `a` is the only member again,
    // owns every lane, and takes the oldest deliveries.
    let other = ["auditor".to_owned()];
    assert!(claim_as(&store, "b", &other, 4, now).await.is_empty());
    Queue::relinquish(&store, "b").await.unwrap();
    let batch = claim_as(&store, "a", &handlers, 4, now).await;
    assert_eq!(lanes_of(&batch), [0, 1, 2, 3]);
}

/// A store on `db` whose lanes 0 to 63 are free with one due delivery of `projector` each,
/// lane n due n seconds after the oldest; and the time it was published at.
async fn one_due_per_lane(db: &TestDb) -> (MongoEventStore, Timestamp) {
    let store = store(db).await;
    let now = Timestamp::now();
    let lanes: Vec<u32> = (0..64).collect();
    one_due_in_each(&store, &lanes, now).await;
    (store, now)
}

/// Appends one due delivery of `projector` in each of `lanes`, the one at position n due n
/// seconds after the oldest, 600 s before `now`.
async fn one_due_in_each(store: &MongoEventStore, lanes: &[u32], now: Timestamp) {
    let events: Vec<EventEnvelope> = lanes
        .iter()
        .map(|lane| envelope(&id_in_lane(*lane)))
        .collect();
    let handlers = ["projector".to_owned()];
    transaction::run(store, None, async |session| {
        let requests: Vec<AppendRequest<'_>> = events
            .iter()
            .enumerate()
            .map(|(n, e)| {
                AppendRequest::new(e, &handlers)
                    .due_at(now.saturating_sub(Duration::from_secs(600 - n as u64)))
            })
            .collect();
        Append::append(store, session, &requests, now).await
    })
    .await
    .unwrap();
}

/// The lanes held, with their holders.
async fn held_lanes(db: &TestDb) -> std::collections::BTreeMap<u32, String> {
    let lanes: Vec<Document> = db
        .db()
        .collection::<Document>("relaybus_lanes")
        .find(doc! { "owner": { "$type": "string" } })
        .await
        .unwrap()
        .try_collect()
        .await
        .unwrap();
    lanes
        .iter()
        .map(|lane| {
            (
                lane.get_i32("_id").unwrap() as u32,
                lane.get_str("owner").unwrap().to_owned(),
            )
        })
        .collect()
}

/// The lanes of a claim's deliveries, sorted.
fn lanes_of(batch: &[relaybus::store::Claimed<relaybus::Lease>]) -> Vec<u32> {
    let mut lanes: Vec<u32> = batch.iter().map(|c| c.lease.lane()).collect();
    lanes.sort_unstable();
    lanes
}

#[tokio::test]
async fn a_claim_over_more_than_128_lanes_takes_the_oldest_due_deliveries_of_all() {
    let db = test_db("spec_lane_ranking_deep").await;
    let store = store(&db).await;
    // The four lowest lanes hold 300 recent deliveries each, more than a first page reads;
    // lane 1 also holds one of the four oldest, and lanes 200 to 202, which a query of the
    // first 128 lanes does not reach, the other three.
    let now = Timestamp::now();
    let recent = now.saturating_sub(Duration::from_secs(10));
    let mut due: Vec<(String, Timestamp)> = Vec::new();
    for lane in 0..4 {
        for id in ids_in_lane("lane", lane, 300) {
            due.push((id, recent));
        }
    }
    let oldest = [1_u32, 200, 201, 202];
    for (n, lane) in oldest.iter().enumerate() {
        let id = ids_in_lane("old", *lane, 1).remove(0);
        due.push((id, now.saturating_sub(Duration::from_secs(700 - n as u64))));
    }
    let events: Vec<(EventEnvelope, Timestamp)> =
        due.iter().map(|(id, at)| (envelope(id), *at)).collect();
    let handlers = ["projector".to_owned()];
    transaction::run(&store, None, async |session| {
        let requests: Vec<AppendRequest<'_>> = events
            .iter()
            .map(|(e, at)| AppendRequest::new(e, &handlers).due_at(*at))
            .collect();
        Append::append(&store, session, &requests, now).await
    })
    .await
    .unwrap();

    // Alone, its claimer owns every lane: a claim of 4 reads them in two groups and takes the 4
    // oldest due deliveries of both.
    let batch = claim_as(&store, "claimer", &handlers, 4, now).await;
    let mut taken: Vec<u32> = batch.iter().map(|c| c.lease.lane()).collect();
    taken.sort_unstable();
    assert_eq!(taken, oldest, "the lanes of the oldest due deliveries");
    assert!(
        batch.iter().all(|c| c.event.id().starts_with("old-")),
        "the oldest deliveries: {:?}",
        batch.iter().map(|c| c.event.id()).collect::<Vec<_>>()
    );
}

/// A client named `app` whose started commands are sent on a channel.
async fn announcing_client(
    db: &TestDb,
    app: &str,
) -> (Client, tokio::sync::mpsc::UnboundedReceiver<String>) {
    let mut options = ClientOptions::parse(&db.uri).await.unwrap();
    options.app_name = Some(app.to_owned());
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    options.command_event_handler = Some(EventHandler::callback(move |event| {
        if let CommandEvent::Started(started) = event {
            let _ = tx.send(started.command_name);
        }
    }));
    (Client::with_options(options).unwrap(), rx)
}

/// Waits until a command named `name` starts, failing the test after 10 s; returns the names
/// of the commands that started before it.
async fn started(
    commands: &mut tokio::sync::mpsc::UnboundedReceiver<String>,
    name: &str,
    what: &str,
) -> Vec<String> {
    let mut before = Vec::new();
    loop {
        let next = tokio::time::timeout(Duration::from_secs(10), commands.recv())
            .await
            .unwrap_or_else(|_| panic!("timed out waiting for {what}"))
            .unwrap();
        if next == name {
            return before;
        }
        before.push(next);
    }
}

/// A set-up store on the test's database through a client named `app`, and the names of the
/// commands it starts.
async fn announced_store(
    db: &TestDb,
    app: &str,
) -> (
    MongoEventStore,
    tokio::sync::mpsc::UnboundedReceiver<String>,
) {
    let (client, commands) = announcing_client(db, app).await;
    let store = MongoEventStore::builder(client)
        .database(&db.name)
        .build()
        .unwrap();
    store.setup().await.unwrap();
    (store, commands)
}

#[tokio::test]
async fn a_completion_that_deletes_fewer_than_it_fenced_reports_no_lease_completed() {
    let db = test_db("spec_fewer_deleted").await;
    let app = "relaybus-fewer-deleted";
    let (completer, mut commands) = announced_store(&db, app).await;
    let taker = store(&db).await;

    // One delivery of `projector` and one of `mailer`, in two lanes.
    let (first, second) = (envelope(&id_in_lane(3)), envelope(&id_in_lane(200)));
    let now = Timestamp::now();
    let (projector, mailer) = (["projector".to_owned()], ["mailer".to_owned()]);
    transaction::run(&completer, None, async |session| {
        let requests = [
            AppendRequest::new(&first, &projector),
            AppendRequest::new(&second, &mailer),
        ];
        Append::append(&completer, session, &requests, now).await
    })
    .await
    .unwrap();
    let both = ["projector".to_owned(), "mailer".to_owned()];
    let claimed = claim_as(&completer, "first-owner", &both, 10, now).await;
    assert_eq!(claimed.len(), 2);
    let leases: Vec<_> = claimed.iter().map(|c| c.lease).collect();

    // The completion's delete waits on the server while another owner, whose clock says the
    // lease has ended, takes the mailer's lane over and charges its delivery.
    let _held = fail_command(
        &db,
        Bson::from(doc! { "times": 1 }),
        doc! {
            "failCommands": ["delete"],
            "appName": app,
            "blockConnection": true,
            "blockTimeMS": 1_500,
        },
    )
    .await;
    while commands.try_recv().is_ok() {}
    let completion = tokio::spawn({
        let completer = completer.clone();
        async move { Queue::complete(&completer, &leases, Timestamp::now()).await }
    });
    started(&mut commands, "delete", "the completion sends its delete").await;
    let later = now.saturating_add(Duration::from_secs(120));
    let taken = claim_as(&taker, "second-owner", &mailer, 10, later).await;
    assert_eq!(taken.len(), 1, "the mailer's delivery, taken over");
    assert_eq!(taken[0].attempt, 2, "its lost attempt charged");

    let outcome = completion.await.unwrap().unwrap();
    assert_eq!(
        outcome,
        [false, false],
        "one delivery went, one did not: neither is proven completed"
    );
    let left = Inspect::list_deliveries(&taker, &DeliveryQuery::new())
        .await
        .unwrap();
    assert_eq!(left.len(), 1, "{left:?}");
    assert_eq!(left[0].handler, "mailer");
}

#[tokio::test]
async fn a_running_handler_keeps_its_lane_leased() {
    let db = test_db("spec_renewal").await;
    let (started_tx, mut started) = tokio::sync::mpsc::unbounded_channel::<()>();
    let release = Arc::new(tokio::sync::Notify::new());
    let handler = {
        let release = Arc::clone(&release);
        relaybus::Subscription::new(
            "slow",
            move |_: OrderPlaced, _: relaybus::HandlerContext| {
                let started = started_tx.clone();
                let release = Arc::clone(&release);
                async move {
                    started.send(()).unwrap();
                    release.notified().await;
                    Ok::<(), relaybus::BoxError>(())
                }
            },
        )
    };
    let bus = RelayBus::builder(store(&db).await)
        .without_registered_handlers()
        .subscribe(handler)
        .lease_duration(Duration::from_millis(900))
        .poll_interval(Duration::from_millis(100))
        .build()
        .unwrap();
    bus.publish(&placed("o-1")).await.unwrap();
    bus.start().await.unwrap();
    tokio::time::timeout(Duration::from_secs(10), started.recv())
        .await
        .expect("the handler starts")
        .unwrap();

    let lanes = db.db().collection::<Document>("relaybus_lanes");
    let held = doc! { "inFlight.0": { "$exists": true } };
    let expiry = async || {
        lanes
            .find_one(held.clone())
            .await
            .unwrap()
            .and_then(|lane| lane.get_datetime("leaseExpiresAt").ok().copied())
            .expect("the lane of the running delivery")
    };
    let first = expiry().await;
    // Renewed until it ends two lease periods past where it first ended, while the handler runs.
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut last = first;
    while last.timestamp_millis() - first.timestamp_millis() < 1_800 {
        assert!(
            Instant::now() < deadline,
            "the lease was not renewed past its first expiry: {first} .. {last}"
        );
        last = last.max(expiry().await);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    release.notify_one();
    bus.shutdown().await.unwrap();
    assert_eq!(
        relaybus_tests::support::deliveries(&db).await.len(),
        0,
        "the delivery completed under its renewed lease, once"
    );
}

/// What the store logged, as text.
#[derive(Clone, Default)]
struct Logged(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Logged {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[tokio::test]
async fn a_parking_failure_is_logged_and_the_claim_still_succeeds() {
    let db = test_db("spec_park_failure").await;
    let app = "relaybus-park-failure";
    let (store, _commands) = announced_store(&db, app).await;
    let backlog: Vec<EventEnvelope> = (0..40)
        .map(|i| envelope(&format!("b-{i}")).with_key("busy").unwrap())
        .collect();
    let handlers = ["projector".to_owned()];
    let now = Timestamp::now();
    transaction::run(&store, None, async |session| {
        let requests: Vec<AppendRequest<'_>> = backlog
            .iter()
            .map(|e| AppendRequest::new(e, &handlers))
            .collect();
        Append::append(&store, session, &requests, now).await
    })
    .await
    .unwrap();
    // The append wrote the 39 behind the first parked: ready, as a requeue leaves them, the
    // claim finds them waiting.
    let moved = db
        .db()
        .collection::<mongodb::bson::Document>("relaybus_deliveries")
        .update_many(
            doc! { "lane": "parked" },
            doc! { "$set": { "lane": "ready" } },
        )
        .await
        .unwrap();
    assert_eq!(moved.modified_count, 39);

    // Every update of a delivery fails: parking is one; the claim's own record is on a lane.
    let _broken = fail_command(
        &db,
        Bson::from("alwaysOn"),
        doc! {
            "failCommands": ["update"],
            "appName": app,
            "namespace": format!("{}.relaybus_deliveries", db.name),
            "errorCode": 8,
        },
    )
    .await;
    let logged = Logged::default();
    let subscriber = tracing_subscriber::fmt()
        .with_writer({
            let logged = logged.clone();
            move || logged.clone()
        })
        .with_ansi(false)
        .finish();
    let _default = tracing::subscriber::set_default(subscriber);
    let claimed = claim_as(&store, "w", &handlers, 10, now).await;
    assert_eq!(
        claimed.len(),
        1,
        "the key's head, claimed in spite of the failure"
    );
    assert_eq!(claimed[0].event.id(), "b-0");
    let text = String::from_utf8(logged.0.lock().unwrap().clone()).unwrap();
    assert!(
        text.contains("parking waiting deliveries failed"),
        "the failure is logged: {text}"
    );
    assert_eq!(
        Inspect::statistics(&store).await.unwrap().parked,
        0,
        "nothing parked: they wait in the claim index"
    );
}

/// Appends `event` for `projector`, created and due at `at`, and claims it.
async fn published_and_claimed(
    store: &MongoEventStore,
    event: &EventEnvelope,
    at: Timestamp,
) -> relaybus::Lease {
    append_one(store, event, &["projector".to_owned()], at).await;
    let claimed = claim_all(store, &["projector"]).await;
    assert_eq!(claimed.len(), 1);
    claimed[0].lease
}

#[tokio::test]
async fn a_purge_racing_a_completion_keeps_the_completed_event() {
    let db = test_db("spec_purge_race").await;
    let app = "relaybus-purge-race";
    let (completer, mut commands) = announced_store(&db, app).await;
    let purger = store(&db).await;
    let now = Timestamp::now();
    let two_hours_ago = now.saturating_sub(Duration::from_secs(7_200));
    let lease = published_and_claimed(&completer, &envelope("old-order"), two_hours_ago).await;

    // The completion's delete waits on the server: the event is stamped, its delivery is
    // still there.
    let held = fail_command(
        &db,
        Bson::from(doc! { "times": 1 }),
        doc! {
            "failCommands": ["delete"],
            "appName": app,
            "blockConnection": true,
            "blockTimeMS": 2_000,
        },
    )
    .await;
    while commands.try_recv().is_ok() {}
    let completion = tokio::spawn({
        let completer = completer.clone();
        async move { Queue::complete(&completer, &[lease], Timestamp::now()).await }
    });
    let seen = started(&mut commands, "delete", "the completion's delete").await;
    let events = db.db().collection::<Document>("relaybus_events");
    let stamped = events
        .find_one(doc! { "_id": "old-order" })
        .await
        .unwrap()
        .unwrap();
    let stamp = *stamped
        .get_datetime("completedAt")
        .unwrap_or_else(|_| panic!("stamped before the delete: {stamped}, commands {seen:?}"));

    // A purge that would delete events created before its earliest cutoff that never
    // completed keeps this one, during the completion and after it: it completed just now.
    let options = relaybus::PurgeOptions::new()
        .dead_before(now)
        .completed_before(now.saturating_sub(Duration::from_secs(3_600)));
    let purged = Operate::purge(&purger, &options).await.unwrap();
    assert_eq!(purged.events, 0, "{purged:?}");
    held.disable().await.unwrap();
    assert_eq!(completion.await.unwrap().unwrap(), [true]);
    let deliveries = db.db().collection::<Document>("relaybus_deliveries");
    assert_eq!(deliveries.count_documents(doc! {}).await.unwrap(), 0);
    let purged = Operate::purge(&purger, &options).await.unwrap();
    assert_eq!(purged.events, 0, "{purged:?}");
    let event = events
        .find_one(doc! { "_id": "old-order" })
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        event.get_datetime("completedAt").ok(),
        Some(&stamp),
        "{event}"
    );

    // Once its completion is older than the cutoff, the event goes.
    let later = Timestamp::now().saturating_add(Duration::from_secs(60));
    assert_eq!(events_purged_completed_before(&purger, later).await, 1);
}

/// An event completed by an earlier release, which marked `completingAt` before the delete and
/// stamped `completedAt` after it, and lost the stamp: purge still counts the mark as its
/// completion.
#[tokio::test]
async fn an_event_with_only_the_completion_mark_of_an_earlier_release_is_kept_as_completed() {
    let db = test_db("spec_legacy_mark").await;
    let store = store(&db).await;
    let now = Timestamp::now();
    let two_hours_ago = now.saturating_sub(Duration::from_secs(7_200));
    let lease = published_and_claimed(&store, &envelope("old-order"), two_hours_ago).await;
    assert_eq!(
        Queue::complete(&store, &[lease], now).await.unwrap(),
        [true]
    );
    let events = db.db().collection::<Document>("relaybus_events");
    let marked = events
        .update_one(
            doc! { "_id": "old-order" },
            doc! {
                "$unset": { "completedAt": "" },
                "$set": { "completingAt": mongodb::bson::DateTime::from_millis(now.timestamp_millis()) },
            },
        )
        .await
        .unwrap();
    assert_eq!(marked.modified_count, 1);
    let options = relaybus::PurgeOptions::new()
        .dead_before(now)
        .completed_before(now.saturating_sub(Duration::from_secs(3_600)));
    let purged = Operate::purge(&store, &options).await.unwrap();
    assert_eq!(
        purged.events, 0,
        "the mark counts as its completion: {purged:?}"
    );
    let later = now.saturating_add(Duration::from_secs(60));
    assert_eq!(events_purged_completed_before(&store, later).await, 1);
}

/// The events a purge of what completed before `cutoff` deletes.
async fn events_purged_completed_before(store: &MongoEventStore, cutoff: Timestamp) -> u64 {
    Operate::purge(
        store,
        &relaybus::PurgeOptions::new().completed_before(cutoff),
    )
    .await
    .unwrap()
    .events
}

#[tokio::test]
async fn a_completion_stamps_with_majority_before_it_deletes() {
    let db = test_db("spec_completion_order").await;
    let (store, seen) = recorded_store(&db).await;
    let lease = published_and_claimed(&store, &envelope("o-1"), Timestamp::now()).await;
    seen.lock().unwrap().clear();
    // More than a minute after the delivery was created: a quicker completion of a fresh event
    // stamps nothing (see the next test).
    let later = Timestamp::now().saturating_add(Duration::from_secs(61));
    assert_eq!(
        Queue::complete(&store, &[lease], later).await.unwrap(),
        [true]
    );

    let writes: Vec<Document> = seen
        .lock()
        .unwrap()
        .iter()
        .filter(|c| c.contains_key("update") || c.contains_key("delete"))
        .cloned()
        .collect();
    let shape: Vec<(String, String, Option<String>)> = writes
        .iter()
        .map(|c| {
            let (verb, target) = match c.get_str("update") {
                Ok(target) => ("update", target),
                Err(_) => ("delete", c.get_str("delete").unwrap()),
            };
            let field = c
                .get_array("updates")
                .ok()
                .and_then(|u| u[0].as_document())
                .and_then(|u| u.get_document("u").ok())
                .and_then(|u| u.get_document("$max").ok())
                .and_then(|max| max.keys().next().cloned())
                .unwrap_or_default();
            let concern = c
                .get_document("writeConcern")
                .ok()
                .and_then(|w| w.get("w"))
                .map(|w| w.to_string());
            (format!("{verb} {target}"), field, concern)
        })
        .collect();
    assert_eq!(
        shape,
        [
            (
                "update relaybus_events".to_owned(),
                "completedAt".to_owned(),
                Some("\"majority\"".to_owned())
            ),
            (
                "delete relaybus_deliveries".to_owned(),
                String::new(),
                Some("\"majority\"".to_owned())
            ),
        ],
        "{writes:?}"
    );
}

/// The write concern a command asks for (`w`), as text.
fn write_concern_of(command: &Document) -> Option<String> {
    command
        .get_document("writeConcern")
        .ok()
        .and_then(|w| w.get("w"))
        .map(|w| match w {
            Bson::String(w) => w.clone(),
            other => other.to_string(),
        })
}

/// Claims, renewals, lane hand-backs and completions write with majority outside transactions,
/// transactions commit with majority, and every read goes to the primary, whatever the client's
/// defaults are: here acknowledgement by one node, and reads from a secondary, which a
/// single-node replica set does not have, so that a read left to the client's default finds
/// no server.
#[tokio::test]
async fn claims_lanes_and_completions_write_with_majority_and_read_from_the_primary() {
    let db = test_db("spec_concerns").await;
    let (mut options, seen) = recording_client(&db.uri).await;
    options.write_concern = Some(WriteConcern::nodes(1));
    options.selection_criteria = Some(SelectionCriteria::ReadPreference(
        ReadPreference::Secondary {
            options: Default::default(),
        },
    ));
    options.server_selection_timeout = Some(Duration::from_secs(2));
    let store = MongoEventStore::builder(Client::with_options(options).unwrap())
        .database(&db.name)
        .build()
        .unwrap();
    store.setup().await.unwrap();
    seen.lock().unwrap().clear();

    let handlers = ["projector".to_owned()];
    let now = Timestamp::now();
    for id in ["o-1", "o-2"] {
        append_one(&store, &envelope(id), &handlers, now).await;
    }
    let claimed = claim_as(&store, "w", &handlers, 10, now).await;
    assert_eq!(claimed.len(), 2);
    let leases: Vec<relaybus::Lease> = claimed.iter().map(|c| c.lease).collect();
    assert_eq!(
        Queue::renew(&store, &leases, Duration::from_secs(60), now)
            .await
            .unwrap(),
        2
    );
    // More than a minute after the deliveries were created: the completion stamps the event.
    let later = now.saturating_add(Duration::from_secs(61));
    assert_eq!(
        Queue::complete(&store, &leases[..1], later).await.unwrap(),
        [true]
    );
    assert!(Queue::release(&store, &leases[1], later).await.unwrap());
    assert!(Queue::relinquish(&store, "w").await.unwrap() >= 1);

    let commands = seen.lock().unwrap().clone();
    let mut written = std::collections::BTreeSet::new();
    for command in &commands {
        let Some(name) = command.keys().next() else {
            continue;
        };
        let target = command.get_str(name).unwrap_or_default();
        let in_transaction = command.get_bool("autocommit") == Ok(false);
        let write = ["insert", "update", "delete", "findAndModify"].contains(&name.as_str());
        if (write && !in_transaction) || name == "commitTransaction" {
            assert_eq!(
                write_concern_of(command).as_deref(),
                Some("majority"),
                "{command}"
            );
            written.insert(format!("{name} {target}"));
        }
        // A `getMore` goes on where its cursor is, whatever it names.
        if let (Ok(preference), false) =
            (command.get_document("$readPreference"), name == "getMore")
        {
            assert_eq!(preference.get_str("mode"), Ok("primary"), "{command}");
        }
    }
    for expected in [
        "update relaybus_lanes",
        "update relaybus_events",
        "delete relaybus_deliveries",
        "commitTransaction",
    ] {
        assert!(
            written.iter().any(|w| w.starts_with(expected)),
            "no {expected}: {written:?}"
        );
    }
}

/// A completion within a minute of a fresh event's creation deletes its delivery and stamps
/// nothing; purge keeps the event as a completed one until two minutes after its creation
/// (never by the dead cutoff alone), and the event detail gives that time. An event that is
/// not fresh (created long before it was appended) and a requeued delivery are stamped.
#[tokio::test]
async fn a_quick_completion_of_a_fresh_event_stamps_nothing_and_purge_takes_the_latest_time() {
    let db = test_db("spec_quick_completion").await;
    let (store, seen) = recorded_store(&db).await;
    let events = db.db().collection::<Document>("relaybus_events");
    let fresh = envelope("quick-1");
    let created = fresh.created_at();
    let lease = published_and_claimed(&store, &fresh, Timestamp::now()).await;
    seen.lock().unwrap().clear();
    assert_eq!(
        Queue::complete(&store, &[lease], Timestamp::now())
            .await
            .unwrap(),
        [true]
    );
    let writes: Vec<String> = seen
        .lock()
        .unwrap()
        .iter()
        .filter_map(|c| {
            c.get_str("update")
                .map(|t| format!("update {t}"))
                .or_else(|_| c.get_str("delete").map(|t| format!("delete {t}")))
                .ok()
        })
        .collect();
    assert_eq!(writes, ["delete relaybus_deliveries"]);
    assert_eq!(stamp_of(&events, "quick-1").await, (true, None));

    let latest = created.saturating_add(Duration::from_secs(120));
    let detail = Inspect::event_detail(&store, "quick-1")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(detail.completed_at, Some(latest));
    // Kept while the completed cutoff has not passed two minutes after its creation, and by
    // the dead cutoff alone.
    let purge = |options: relaybus::PurgeOptions| {
        let store = store.clone();
        async move { Operate::purge(&store, &options).await.unwrap().events }
    };
    let just_before = latest.saturating_sub(Duration::from_millis(1));
    let options = relaybus::PurgeOptions::new();
    assert_eq!(purge(options.completed_before(just_before)).await, 0);
    let far = latest.saturating_add(Duration::from_secs(3_600));
    assert_eq!(purge(options.dead_before(far)).await, 0);
    assert_eq!(
        purge(options.completed_before(latest.saturating_add(Duration::from_millis(1)))).await,
        1
    );

    // Appended as if 30 s after its creation: not fresh, so stamped, although its delivery
    // completes within a minute.
    let appended = Timestamp::now().saturating_sub(Duration::from_secs(30));
    let lease = published_and_claimed(&store, &envelope("old-1"), appended).await;
    let at = Timestamp::now();
    assert_eq!(Queue::complete(&store, &[lease], at).await.unwrap(), [true]);
    assert_eq!(stamp_of(&events, "old-1").await, (false, Some(at)));

    // A requeued delivery is stamped, however quickly it completes.
    let lease = published_and_claimed(&store, &envelope("requeued-1"), Timestamp::now()).await;
    let now = DateTime::now();
    assert!(store.bury(&lease, "failed for good", now).await.unwrap());
    let requeued = store
        .requeue(&[lease.delivery_id().to_hex()], now)
        .await
        .unwrap();
    assert_eq!(requeued.requeued.len(), 1, "{requeued:?}");
    let claimed = claim_all(&store, &["projector"]).await;
    assert_eq!(claimed.len(), 1);
    let at = Timestamp::now();
    assert_eq!(
        Queue::complete(&store, &[claimed[0].lease], at)
            .await
            .unwrap(),
        [true]
    );
    assert_eq!(stamp_of(&events, "requeued-1").await, (true, Some(at)));
}

/// Whether the event `id` is marked fresh, and its `completedAt`.
async fn stamp_of(events: &mongodb::Collection<Document>, id: &str) -> (bool, Option<Timestamp>) {
    let event = events.find_one(doc! { "_id": id }).await.unwrap().unwrap();
    (
        event.get_bool("fresh") == Ok(true),
        event
            .get_datetime("completedAt")
            .ok()
            .map(|at| Timestamp::from_millis(at.timestamp_millis())),
    )
}

/// A second event type, so that two handlers get deliveries in lanes of their own.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
struct OrderShipped {
    order_id: String,
}

impl relaybus::Event for OrderShipped {
    const TYPE: &'static str = "order.shipped.v1";
}

/// A handler of `E` that tells the test it started, then waits for `release`.
fn waits_for<E: relaybus::Event>(
    id: &str,
    started: tokio::sync::mpsc::UnboundedSender<&'static str>,
    release: Arc<tokio::sync::Notify>,
    name: &'static str,
) -> relaybus::Subscription {
    relaybus::Subscription::new(id, move |_: E, _: relaybus::HandlerContext| {
        let started = started.clone();
        let release = Arc::clone(&release);
        async move {
            started.send(name).unwrap();
            release.notified().await;
            Ok::<(), relaybus::BoxError>(())
        }
    })
}

#[tokio::test]
async fn a_transactional_handlers_lease_is_not_renewed() {
    let db = test_db("spec_no_tx_renewal").await;
    let (started_tx, mut started) = tokio::sync::mpsc::unbounded_channel();
    let (steady, atomic) = (
        Arc::new(tokio::sync::Notify::new()),
        Arc::new(tokio::sync::Notify::new()),
    );
    let bus = RelayBus::builder(store(&db).await)
        .without_registered_handlers()
        .subscribe(waits_for::<OrderPlaced>(
            "steady",
            started_tx.clone(),
            Arc::clone(&steady),
            "steady",
        ))
        .subscribe(
            waits_for::<OrderShipped>("atomic", started_tx, Arc::clone(&atomic), "atomic")
                .transactional(),
        )
        .lease_duration(Duration::from_millis(4_500))
        .poll_interval(Duration::from_millis(100))
        .build()
        .unwrap();
    let (placed_id, shipped_id) = (id_in_lane(10), id_in_lane(20));
    bus.publish(&placed("o-1"))
        .id(placed_id.as_str())
        .await
        .unwrap();
    bus.publish(&OrderShipped {
        order_id: "o-1".to_owned(),
    })
    .id(shipped_id.as_str())
    .await
    .unwrap();
    bus.start().await.unwrap();
    let mut names = Vec::new();
    for _ in 0..2 {
        names.push(
            tokio::time::timeout(Duration::from_secs(10), started.recv())
                .await
                .expect("both handlers start")
                .unwrap(),
        );
    }
    names.sort_unstable();
    assert_eq!(names, ["atomic", "steady"]);

    let lanes = db.db().collection::<Document>("relaybus_lanes");
    let expiry = async |lane: i32| {
        lanes
            .find_one(doc! { "_id": lane })
            .await
            .unwrap()
            .and_then(|doc| doc.get_datetime("leaseExpiresAt").ok().copied())
            .expect("a held lane")
    };
    let (steady_first, atomic_first) = (expiry(10).await, expiry(20).await);
    // One renewal round covers every renewable lease at once: once the plain handler's lane
    // was renewed, the transactional one would have been too.
    let deadline = Instant::now() + Duration::from_secs(10);
    while expiry(10).await <= steady_first {
        assert!(
            Instant::now() < deadline,
            "the plain handler's lease was never renewed"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        expiry(20).await,
        atomic_first,
        "the transactional handler's lane keeps the lease of its claim"
    );
    steady.notify_one();
    atomic.notify_one();
    bus.shutdown().await.unwrap();
    assert_eq!(relaybus_tests::support::deliveries(&db).await.len(), 0);
}

#[tokio::test]
async fn claims_of_one_owner_on_one_instance_run_one_after_another() {
    let db = test_db("spec_claims_serialized").await;
    let app = "relaybus-claims-serialized";
    let mut options = ClientOptions::parse(&db.uri).await.unwrap();
    options.app_name = Some(app.to_owned());
    let (tx, mut events) = tokio::sync::mpsc::unbounded_channel::<(bool, String)>();
    options.command_event_handler = Some(EventHandler::callback(move |event| {
        let _ = match event {
            CommandEvent::Started(e) => tx.send((true, e.command_name)),
            CommandEvent::Succeeded(e) => tx.send((false, e.command_name)),
            CommandEvent::Failed(e) => tx.send((false, e.command_name)),
            _ => Ok(()),
        };
    }));
    let store = MongoEventStore::builder(Client::with_options(options).unwrap())
        .database(&db.name)
        .build()
        .unwrap();
    store.setup().await.unwrap();
    let events_in: Vec<EventEnvelope> = [10, 20, 30, 40]
        .iter()
        .map(|lane| envelope(&id_in_lane(*lane)))
        .collect();
    let handlers = ["projector".to_owned()];
    for event in &events_in {
        append_one(&store, event, &handlers, Timestamp::now()).await;
    }

    // The first claim's record on its lanes waits on the server for a while.
    let _held = block_lane_update(&db, app, 800).await;
    while events.try_recv().is_ok() {}
    let first = tokio::spawn({
        let (store, handlers) = (store.clone(), handlers.clone());
        async move { claim_as(&store, "w", &handlers, 2, Timestamp::now()).await }
    });
    let mut log = Vec::new();
    loop {
        let event = tokio::time::timeout(Duration::from_secs(10), events.recv())
            .await
            .expect("the first claim's commands")
            .unwrap();
        log.push(event.clone());
        if event == (true, "update".to_owned()) {
            break;
        }
    }
    // A second claim of the same owner, while the first is held in its write.
    let second = tokio::spawn({
        let (store, handlers) = (store.clone(), handlers.clone());
        async move { claim_as(&store, "w", &handlers, 2, Timestamp::now()).await }
    });
    let (first, second) = (first.await.unwrap(), second.await.unwrap());
    while let Ok(event) = events.try_recv() {
        log.push(event);
    }
    let held_at = log
        .iter()
        .position(|e| *e == (true, "update".to_owned()))
        .unwrap();
    let released_at = log[held_at..]
        .iter()
        .position(|e| !e.0)
        .map(|offset| held_at + offset)
        .expect("the held update ends");
    assert!(
        log[held_at + 1..released_at].iter().all(|e| !e.0),
        "no command of the second claim started while the first one's write was held: {log:?}"
    );
    assert_eq!(
        first.len() + second.len(),
        4,
        "both claims ran: {} + {}",
        first.len(),
        second.len()
    );
}

#[tokio::test]
async fn a_pick_a_concurrent_requeue_now_precedes_is_given_back() {
    let db = test_db("spec_requeue_race").await;
    let app = "relaybus-requeue-race";
    let (claimer, mut commands) = announced_store(&db, app).await;
    let operator = store(&db).await;
    let keyed: Vec<EventEnvelope> = (1..=2)
        .map(|i| envelope(&format!("k-{i}")).with_key("cart-9").unwrap())
        .collect();
    let handlers = ["projector".to_owned()];
    let now = Timestamp::now();
    transaction::run(&claimer, None, async |session| {
        let requests: Vec<AppendRequest<'_>> = keyed
            .iter()
            .map(|e| AppendRequest::new(e, &handlers))
            .collect();
        Append::append(&claimer, session, &requests, now).await
    })
    .await
    .unwrap();
    // The key's head dies; its follower is next.
    let head = claim_as(&claimer, "w", &handlers, 10, now).await;
    assert_eq!(head.len(), 1);
    assert_eq!(head[0].event.id(), "k-1");
    assert!(
        Queue::bury(&claimer, &head[0].lease, "broken", now)
            .await
            .unwrap()
    );
    let dead = Inspect::list_deliveries(
        &operator,
        &DeliveryQuery::new().status(DeliveryStatus::Dead),
    )
    .await
    .unwrap();
    assert_eq!(dead.len(), 1);

    // A claim picks the follower; its record on the lane waits on the server while an
    // operator requeues the head, which now goes first again.
    let (_held, racing) =
        claim_while_its_record_waits(&db, app, &mut commands, &claimer, "w", &handlers, now).await;
    let requeued = Operate::requeue(&operator, &[dead[0].id.clone()], now)
        .await
        .unwrap();
    assert_eq!(requeued.requeued, [dead[0].id.clone()], "{requeued:?}");
    let raced = racing.await.unwrap();
    // The record missed the lane's new requeue count, so the follower was given back; the
    // claim then read the lane again and took the requeued head, in the key's order.
    assert_eq!(
        raced.iter().map(|c| c.event.id()).collect::<Vec<_>>(),
        ["k-1"],
        "the follower was given back and the head taken instead"
    );
    assert_eq!(
        raced[0].attempt, 1,
        "the requeued head starts again at attempt 1"
    );
    let follower = Inspect::list_deliveries(&operator, &DeliveryQuery::new().event_id("k-2"))
        .await
        .unwrap();
    assert_eq!(follower[0].attempts, 0, "no attempt charged: {follower:?}");
    assert!(!follower[0].running);

    // Once the head completes, the follower runs.
    assert_eq!(
        Queue::complete(&claimer, &[raced[0].lease], now)
            .await
            .unwrap(),
        [true]
    );
    let next = claim_as(&claimer, "w", &handlers, 10, now).await;
    assert_eq!(
        next.iter().map(|c| c.event.id()).collect::<Vec<_>>(),
        ["k-2"]
    );
    assert_eq!(
        next[0].attempt, 1,
        "the follower's give-back charged nothing"
    );
}

/// Makes the next `update` of the lanes sent by the client named `app` wait `millis` on the
/// server before it runs, until the fail point is dropped.
async fn block_lane_update(db: &TestDb, app: &str, millis: i32) -> relaybus_harness::FailPoint {
    fail_command(
        db,
        Bson::from(doc! { "times": 1 }),
        doc! {
            "failCommands": ["update"],
            "appName": app,
            "namespace": format!("{}.relaybus_lanes", db.name),
            "blockConnection": true,
            "blockTimeMS": millis,
        },
    )
    .await
}

/// Starts a claim of `owner` (up to 10 deliveries of `handlers`) whose record on the lanes
/// waits on the server for a second, and returns once the record was sent: the fail point
/// (keep it until the claim ends) and the claim.
async fn claim_while_its_record_waits(
    db: &TestDb,
    app: &str,
    commands: &mut tokio::sync::mpsc::UnboundedReceiver<String>,
    store: &MongoEventStore,
    owner: &'static str,
    handlers: &[String],
    now: Timestamp,
) -> (
    relaybus_harness::FailPoint,
    tokio::task::JoinHandle<Vec<relaybus::store::Claimed<relaybus::Lease>>>,
) {
    let held = block_lane_update(db, app, 1_000).await;
    while commands.try_recv().is_ok() {}
    let claim = tokio::spawn({
        let (store, handlers) = (store.clone(), handlers.to_vec());
        async move { claim_as(&store, owner, &handlers, 10, now).await }
    });
    started(commands, "update", "the claim records its picks").await;
    (held, claim)
}

/// A claim of owner `first` whose record on its held lane waits on the server and then ends
/// as `failure` says, while another owner whose clock says the lease has ended takes the lane
/// over. Checks that the taker keeps its lane and its leases, and returns what the first claim
/// returned and the commands its client sent after the record.
async fn record_fails_during_a_takeover(
    test: &str,
    failure: Document,
) -> (
    relaybus::Result<Vec<relaybus::store::Claimed<relaybus::Lease>>>,
    Vec<String>,
) {
    let db = test_db(test).await;
    let app = format!("relaybus-{test}");
    let (first, mut commands) = announced_store(&db, &app).await;
    let taker = store(&db).await;
    let handlers = ["projector".to_owned()];
    let now = Timestamp::now();
    let lane = 77;
    let mut in_lane = (0..)
        .map(|n| format!("in-lane-{n}"))
        .filter(|id| lane_of(None, id) == lane);
    let (one, two) = (
        envelope(&in_lane.next().unwrap()),
        envelope(&in_lane.next().unwrap()),
    );
    append_one(&first, &one, &handlers, now).await;
    // The first owner holds the lane with one delivery running.
    let running = claim_as(&first, "first", &handlers, 10, now).await;
    assert_eq!(running.len(), 1);
    append_one(&first, &two, &handlers, now).await;

    let mut data = doc! {
        "failCommands": ["update"],
        "appName": &app,
        "namespace": format!("{}.relaybus_lanes", db.name),
        "blockConnection": true,
        "blockTimeMS": 1_000,
    };
    data.extend(failure);
    let _failing = fail_command(&db, Bson::from(doc! { "times": 1 }), data).await;
    while commands.try_recv().is_ok() {}
    let failed = tokio::spawn({
        let (first, handlers) = (first.clone(), handlers.clone());
        async move {
            Queue::claim(
                &first,
                ClaimRequest {
                    owner: "first",
                    handlers: &handlers,
                    limit: 10,
                    lease_duration: Duration::from_secs(30),
                    now,
                },
            )
            .await
        }
    });
    started(&mut commands, "update", "the claim records its picks").await;
    let later = now.saturating_add(Duration::from_secs(120));
    let taken = claim_as(&taker, "taker", &handlers, 10, later).await;
    let mut ids: Vec<&str> = taken.iter().map(|c| c.event.id()).collect();
    ids.sort_unstable();
    let mut expected = [one.id(), two.id()];
    expected.sort_unstable();
    assert_eq!(ids, expected, "the taker holds both deliveries of the lane");

    let failed = failed.await.unwrap();
    let mut after = Vec::new();
    while let Ok(name) = commands.try_recv() {
        after.push(name);
    }
    let lane_doc = db
        .db()
        .collection::<Document>("relaybus_lanes")
        .find_one(doc! { "_id": lane as i32 })
        .await
        .unwrap()
        .unwrap();
    assert_eq!(lane_doc.get_str("owner"), Ok("taker"), "{lane_doc}");
    assert_eq!(
        lane_doc.get_array("inFlight").unwrap().len(),
        2,
        "{lane_doc}"
    );
    let leases: Vec<_> = taken.iter().map(|c| c.lease).collect();
    assert_eq!(
        Queue::complete(&taker, &leases, later).await.unwrap(),
        [true, true],
        "the taker's leases still hold"
    );
    (failed, after)
}

#[tokio::test]
async fn a_failed_claims_reconciliation_leaves_a_taker_of_its_lane_alone() {
    // The connection drops: the claim cannot know whether its record applied, fails, and
    // reconciles the owner's lanes in a transaction.
    let (failed, after) =
        record_fails_during_a_takeover("reconcile_takeover", doc! { "closeConnection": true })
            .await;
    assert!(failed.is_err(), "the claim failed: {failed:?}");
    assert!(
        after.iter().any(|name| name == "commitTransaction"),
        "it reconciled in a transaction: {after:?}"
    );
}

#[tokio::test]
async fn an_unconfirmed_record_read_back_after_a_takeover_hands_out_nothing() {
    // The record answers a write concern error: the claim reads its lanes back, finds this
    // one taken, and hands nothing of it out.
    let (claimed, _) = record_fails_during_a_takeover(
        "unconfirmed_takeover",
        doc! { "writeConcernError": {
            "code": 64,
            "codeName": "WriteConcernFailed",
            "errmsg": "waiting for replication timed out",
        } },
    )
    .await;
    assert!(
        claimed.as_ref().is_ok_and(|claimed| claimed.is_empty()),
        "the first owner's claim handed out {claimed:?}"
    );
}

#[tokio::test]
async fn a_record_over_several_held_lanes_keeps_only_the_lanes_whose_condition_held() {
    // The record lists a claim's picks on all the held lanes it picked from in one statement;
    // a lane that changed hands while it was sent keeps nothing of the claim, and the others
    // keep theirs.
    let test = "record_several_lanes";
    let db = test_db(test).await;
    let app = format!("relaybus-{test}");
    let (first, mut commands) = announced_store(&db, &app).await;
    let handlers = ["projector".to_owned()];
    let now = Timestamp::now();
    let in_lane = |lane: u32| {
        (0..)
            .map(move |n| format!("lane-{lane}-{n}"))
            .filter(move |id| lane_of(None, id) == lane)
    };
    let (mut in_77, mut in_78) = (in_lane(77), in_lane(78));
    for id in [in_77.next().unwrap(), in_78.next().unwrap()] {
        append_one(&first, &envelope(&id), &handlers, now).await;
    }
    // The owner holds both lanes; what ran there completed (a completion leaves the lanes
    // alone, so both still list it).
    let ran = claim_as(&first, "first", &handlers, 10, now).await;
    assert_eq!(ran.len(), 2);
    let leases: Vec<_> = ran.iter().map(|c| c.lease).collect();
    assert_eq!(
        Queue::complete(&first, &leases, now).await.unwrap(),
        [true, true]
    );
    let (next_77, next_78) = (in_77.next().unwrap(), in_78.next().unwrap());
    for id in [&next_77, &next_78] {
        append_one(&first, &envelope(id), &handlers, now).await;
    }

    let (_failing, claim) =
        claim_while_its_record_waits(&db, &app, &mut commands, &first, "first", &handlers, now)
            .await;
    // Lane 78 changes hands meanwhile (its epoch moves on, as a takeover moves it).
    let lanes = db.db().collection::<Document>("relaybus_lanes");
    lanes
        .update_one(doc! { "_id": 78 }, doc! { "$inc": { "epoch": 1 } })
        .await
        .unwrap();
    let claimed = claim.await.unwrap();
    let ids: Vec<&str> = claimed.iter().map(|c| c.event.id()).collect();
    assert_eq!(ids, [next_77.as_str()], "only lane 77's pick is handed out");
    let listed = |lane: Document| -> Vec<mongodb::bson::oid::ObjectId> {
        lane.get_array("inFlight")
            .unwrap()
            .iter()
            .map(|id| id.as_object_id().unwrap())
            .collect()
    };
    let lane_77 = lanes.find_one(doc! { "_id": 77 }).await.unwrap().unwrap();
    assert_eq!(
        listed(lane_77),
        [claimed[0].lease.delivery_id()],
        "lane 77 lists its new pick alone: the completed delivery is off it"
    );
    let lane_78 = lanes.find_one(doc! { "_id": 78 }).await.unwrap().unwrap();
    assert_eq!(
        listed(lane_78),
        [ran.iter()
            .find(|c| c.lease.lane() == 78)
            .unwrap()
            .lease
            .delivery_id()],
        "lane 78 kept nothing of the claim"
    );
}

#[tokio::test]
async fn a_delivery_buried_while_a_claim_records_it_is_not_handed_out() {
    // An operator buries a delivery after a claim read it as pending and before the claim's
    // record lands: the record no longer matches the lane, and nothing dead is handed out.
    let test = "bury_during_record";
    let db = test_db(test).await;
    let app = format!("relaybus-{test}");
    let (claimer, mut commands) = announced_store(&db, &app).await;
    let operator = store(&db).await;
    let handlers = ["projector".to_owned()];
    let now = Timestamp::now();
    append_one(&claimer, &envelope("to-bury"), &handlers, now).await;
    let pending = Inspect::list_deliveries(
        &operator,
        &DeliveryQuery::new().status(DeliveryStatus::Pending),
    )
    .await
    .unwrap();
    assert_eq!(pending.len(), 1);

    let (_held, claim) =
        claim_while_its_record_waits(&db, &app, &mut commands, &claimer, "w", &handlers, now).await;
    let buried = Operate::bury_by_id(&operator, &[pending[0].id.clone()], "not wanted", now)
        .await
        .unwrap();
    assert_eq!(buried.buried, [pending[0].id.clone()], "{buried:?}");
    let claimed = claim.await.unwrap();
    assert!(
        claimed.is_empty(),
        "a buried delivery was handed out: {claimed:?}"
    );
    let dead = Inspect::list_deliveries(
        &operator,
        &DeliveryQuery::new().status(DeliveryStatus::Dead),
    )
    .await
    .unwrap();
    assert_eq!(dead.len(), 1, "it stays dead");
    assert!(
        claim_as(&claimer, "w", &handlers, 10, now).await.is_empty(),
        "and no later claim takes it"
    );
}
