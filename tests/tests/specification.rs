//! Items of the store specification that had no test of their own: the default transaction
//! options, racing appends of one event id, the completion history's listing, the retry limit
//! of transactions, documents an older writer left with null fields, and the retention purge.

use std::{
    sync::{
        Arc, Mutex,
        atomic::{AtomicU32, Ordering},
    },
    time::{Duration, Instant},
};

use mongodb::{
    Client,
    bson::{DateTime, Document, doc},
    event::{EventHandler, command::CommandEvent},
    options::ClientOptions,
};
use relaybus::{
    AppendRequest, DeliveryQuery, DeliveryStatus, Error, EventEnvelope, MongoEventStore, RelayBus,
    Retention, Store, Timestamp,
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

async fn claim_all(
    store: &MongoEventStore,
    handlers: &[&str],
) -> Vec<relaybus::store::Claimed<relaybus::Lease>> {
    let handlers: Vec<String> = handlers.iter().map(|h| (*h).to_owned()).collect();
    Store::claim(
        store,
        ClaimRequest {
            owner: "w",
            handlers: &handlers,
            limit: 100,
            lease_duration: Duration::from_secs(30),
            now: Timestamp::now(),
            reported: &[],
        },
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
    transaction::run(&store, None, async |session| {
        Store::append(
            &store,
            session,
            &[AppendRequest::new(&event, &handlers)],
            Timestamp::now(),
        )
        .await
    })
    .await
    .unwrap();

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

    let mut first = Store::session(&store).await.unwrap();
    let mut second = Store::session(&store).await.unwrap();
    Store::begin(&store, &mut first, None).await.unwrap();
    Store::begin(&store, &mut second, None).await.unwrap();
    let appended = Store::append(&store, &mut first, &requests, Timestamp::now())
        .await
        .unwrap();
    assert!(appended[0].created);
    let raced = Store::append(&store, &mut second, &requests, Timestamp::now()).await;
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
    Store::abort(&store, &mut second).await;
    Store::commit(&store, &mut first).await.unwrap();

    // Run again after the first committed, the second finds the event and adds nothing.
    let again = transaction::run(&store, None, async |session| {
        Store::append(&store, session, &requests, Timestamp::now()).await
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
        Store::append(&history, session, &requests, Timestamp::now()).await
    })
    .await
    .unwrap();
    let claimed = claim_all(&history, &["projector", "mailer"]).await;
    assert_eq!(claimed.len(), 6);
    let leases: Vec<_> = claimed.iter().map(|c| c.lease).collect();
    assert_eq!(
        Store::complete(&history, &leases, Timestamp::now())
            .await
            .unwrap(),
        [true; 6]
    );

    let list = |query: DeliveryQuery| {
        let history = history.clone();
        async move { Store::list_deliveries(&history, &query).await.unwrap() }
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
    assert_eq!(Store::statistics(&history).await.unwrap().completed, 6);

    // The same database read without completion history: no completed listing, no count.
    let without = MongoEventStore::builder(db.client.clone())
        .database(&db.name)
        .build()
        .unwrap();
    assert!(
        Store::list_deliveries(&without, &completed)
            .await
            .unwrap()
            .is_empty(),
        "no completed listing without history"
    );
    let stats = Store::statistics(&without).await.unwrap();
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
    transaction::run(&store, None, async |session| {
        Store::append(
            &store,
            session,
            &[AppendRequest::new(&event, &handlers)],
            Timestamp::now(),
        )
        .await
    })
    .await
    .unwrap();

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
    let listed = Store::list_deliveries(&store, &DeliveryQuery::new())
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
        Store::complete(&store, &leases, Timestamp::now())
            .await
            .unwrap(),
        [true, true]
    );
}

#[tokio::test]
async fn purge_expired_deletes_what_the_retention_lets_go() {
    let db = test_db("spec_purge_expired").await;
    let bus = RelayBus::builder(store(&db).await)
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
    // The cutoff is `now - 1 ms`: let the completion time fall behind it.
    let completed = Instant::now();
    while completed.elapsed() < Duration::from_millis(5) {
        tokio::task::yield_now().await;
    }
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
    (0..)
        .map(|n| format!("lane-{lane}-{n}"))
        .find(|id| lane_of(None, id) == lane)
        .unwrap()
}

#[tokio::test]
async fn claimers_take_free_lanes_among_the_oldest_due() {
    let db = test_db("spec_lane_taking").await;
    let store = store(&db).await;
    // 128 free lanes with one due delivery each, the lane of rank r due r seconds after the
    // oldest, in an order unrelated to the lane numbers.
    let now = Timestamp::now();
    let ranked: Vec<u32> = (0..128).map(|rank| (rank * 37 + 11) % 256).collect();
    let events: Vec<EventEnvelope> = ranked
        .iter()
        .map(|lane| envelope(&id_in_lane(*lane)))
        .collect();
    let handlers = ["projector".to_owned()];
    transaction::run(&store, None, async |session| {
        let requests: Vec<AppendRequest<'_>> = events
            .iter()
            .enumerate()
            .map(|(rank, e)| {
                AppendRequest::new(e, &handlers)
                    .due_at(now.saturating_sub(Duration::from_secs(600 - rank as u64)))
            })
            .collect();
        Store::append(&store, session, &requests, now).await
    })
    .await
    .unwrap();

    // Claims of 4 deliveries take a first round of 4 lanes. Alone, a claimer takes the 4
    // oldest; with others holding lanes it takes 4 at random among the oldest 4 × spread,
    // the spread being at most 8: never a lane outside the oldest 32 still free.
    let mut free = ranked.clone();
    let handlers = ["projector".to_owned()];
    for claimer in 0..8 {
        let owner = format!("claimer-{claimer}");
        let batch = Store::claim(
            &store,
            ClaimRequest {
                owner: &owner,
                handlers: &handlers,
                limit: 4,
                lease_duration: Duration::from_secs(30),
                now,
                reported: &[],
            },
        )
        .await
        .unwrap();
        assert_eq!(batch.len(), 4, "{owner}");
        let taken: Vec<u32> = batch.iter().map(|c| c.lease.lane()).collect();
        let ranks: Vec<usize> = taken
            .iter()
            .map(|lane| {
                free.iter()
                    .position(|f| f == lane)
                    .expect("a lane that was free")
            })
            .collect();
        if claimer == 0 {
            let mut sorted = ranks.clone();
            sorted.sort_unstable();
            assert_eq!(sorted, [0, 1, 2, 3], "alone, the oldest four");
        }
        assert!(
            ranks.iter().all(|rank| *rank < 32),
            "{owner} took lanes of ranks {ranks:?} among the free ones"
        );
        free.retain(|lane| !taken.contains(lane));
    }
}
