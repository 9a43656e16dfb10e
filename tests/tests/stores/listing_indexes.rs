//! `MongoEventStoreBuilder::listing_indexes(false)`: the indexes `setup()` leaves on the
//! deliveries, dropping them from a database set up with them, and the listings and the purge
//! giving the same results without them as with them.

use mongodb::bson::{DateTime, Document};
use relaybus::{
    DeliveryQuery, DeliveryRecord, DeliveryStatus, EventEnvelope, MongoEventStore, PurgeOptions,
};
use relaybus_harness::{TestDb, test_db};
use serde_json::json;

/// In 2030: later than the wall-clock creation time of every event the tests publish, so
/// retention cutoffs on this clock apply to them.
const T0: i64 = 1_900_000_000_000;

/// `T0 + seconds`: the explicit clock of every test.
fn at(seconds: i64) -> DateTime {
    DateTime::from_millis(T0 + seconds * 1000)
}

/// The secondary indexes `setup()` makes on the deliveries when told to leave out the listing
/// ones.
const WITHOUT_LISTING: [&str; 7] = [
    "claim",
    "completed",
    "due",
    "event_handler",
    "ordering",
    "parked",
    "status_created",
];
/// The three listing indexes.
const LISTING: [&str; 3] = ["handler_created", "status_updated", "type_created"];

const HANDLERS: [&str; 2] = ["mailer", "projector"];
const PLACED: &str = "order.placed.v1";
const PAID: &str = "order.paid.v1";

fn store_on(db: &TestDb, listing: bool) -> MongoEventStore {
    MongoEventStore::builder(db.client.clone())
        .database(&db.name)
        .listing_indexes(listing)
        .purge_batch_size(2)
        .build()
        .expect("valid options")
}

async fn set_up(db: &TestDb, listing: bool) -> MongoEventStore {
    let store = store_on(db, listing);
    store.setup().await.expect("setup");
    store
}

/// The names of the secondary indexes of the deliveries, sorted.
async fn delivery_indexes(db: &TestDb) -> Vec<String> {
    let mut names: Vec<String> = db
        .db()
        .collection::<Document>("relaybus_deliveries")
        .list_index_names()
        .await
        .unwrap()
        .into_iter()
        .filter(|name| name != "_id_")
        .collect();
    names.sort();
    names
}

fn all_indexes() -> Vec<String> {
    let mut names: Vec<String> = WITHOUT_LISTING
        .iter()
        .chain(LISTING.iter())
        .map(|name| (*name).to_owned())
        .collect();
    names.sort();
    names
}

#[tokio::test]
async fn setup_without_the_listing_indexes_leaves_seven_secondary_indexes() {
    let db = test_db("no_listing_indexes").await;
    let store = set_up(&db, false).await;
    assert!(!store.listing_indexes());
    assert_eq!(delivery_indexes(&db).await, WITHOUT_LISTING);
    // Idempotent: a second setup, as the next start runs it, neither adds nor fails.
    set_up(&db, false).await;
    assert_eq!(delivery_indexes(&db).await, WITHOUT_LISTING);
}

#[tokio::test]
async fn a_setup_with_the_listing_indexes_off_drops_them_and_on_makes_them_again() {
    let db = test_db("drop_listing_indexes").await;
    let with = set_up(&db, true).await;
    assert!(with.listing_indexes());
    assert_eq!(delivery_indexes(&db).await, all_indexes());
    publish(&with, 4, at(0)).await;

    set_up(&db, false).await;
    assert_eq!(delivery_indexes(&db).await, WITHOUT_LISTING);
    // The deliveries are untouched.
    let pending = with
        .list_deliveries(&DeliveryQuery::new().status(DeliveryStatus::Pending))
        .await
        .unwrap();
    assert_eq!(pending.len(), 8);

    set_up(&db, true).await;
    assert_eq!(delivery_indexes(&db).await, all_indexes());
}

/// Publishes `events` events, alternately placed and paid, each for both handlers, due at
/// `now`: event `e-<i>`.
async fn publish(store: &MongoEventStore, events: usize, now: DateTime) {
    let events: Vec<EventEnvelope> = (0..events)
        .map(|i| {
            let event_type = if i % 2 == 0 { PLACED } else { PAID };
            EventEnvelope::from_json(event_type, json!({ "order": i }))
                .unwrap()
                .with_id(format!("e-{i}"))
                .unwrap()
        })
        .collect();
    relaybus_tests::support::append_events(store, &events, &HANDLERS, now).await;
}

/// What a listing says of a record, without what differs between two databases (ids and the
/// wall-clock creation time).
type Seen = (String, String, String, String, Option<String>, Option<i64>);

fn seen(records: &[DeliveryRecord]) -> Vec<Seen> {
    let mut seen: Vec<Seen> = records
        .iter()
        .map(|r| {
            (
                r.event_id.clone(),
                r.handler.clone(),
                r.event_type.clone(),
                r.status.as_str().to_owned(),
                r.last_error.clone(),
                r.updated_at.map(|t| t.timestamp_millis()),
            )
        })
        .collect();
    seen.sort();
    seen
}

/// The listings an operator makes, by status, handler and event type, alone and together.
fn queries() -> Vec<DeliveryQuery> {
    let mut queries = vec![
        DeliveryQuery::new(),
        DeliveryQuery::new().status(DeliveryStatus::Pending),
        DeliveryQuery::new().status(DeliveryStatus::Dead),
        DeliveryQuery::new().event_type(PLACED),
        DeliveryQuery::new().event_type(PAID),
        DeliveryQuery::new()
            .event_type(PAID)
            .status(DeliveryStatus::Dead),
    ];
    for handler in HANDLERS {
        queries.push(DeliveryQuery::new().handler(handler));
        queries.push(
            DeliveryQuery::new()
                .handler(handler)
                .status(DeliveryStatus::Dead),
        );
        queries.push(
            DeliveryQuery::new()
                .handler(handler)
                .event_type(PLACED)
                .status(DeliveryStatus::Pending),
        );
    }
    queries
}

/// Every page of `query`, three records at a time.
async fn paged(store: &MongoEventStore, query: &DeliveryQuery) -> Vec<DeliveryRecord> {
    let mut all: Vec<DeliveryRecord> = Vec::new();
    loop {
        let mut page = query.clone().limit(3);
        if let Some(last) = all.last() {
            page = page.after(last.id.clone());
        }
        let records = store.list_deliveries(&page).await.unwrap();
        if records.is_empty() {
            return all;
        }
        all.extend(records);
    }
}

/// 12 events for both handlers; the mailer's deliveries of events 0 to 5 buried, 0 to 2 at 10 s
/// and 3 to 5 at 20 s, and the projector's of events 0 and 1 at 10 s too, so that a purge of
/// the dead before 15 s leaves events 0 and 1 unreferenced.
async fn populate(store: &MongoEventStore) {
    publish(store, 12, at(0)).await;
    let pending = store
        .list_deliveries(&DeliveryQuery::new().status(DeliveryStatus::Pending))
        .await
        .unwrap();
    assert_eq!(pending.len(), 24);
    let ids = |wanted: &dyn Fn(&DeliveryRecord) -> bool| -> Vec<String> {
        pending
            .iter()
            .filter(|r| wanted(r))
            .map(|r| r.id.clone())
            .collect()
    };
    let number = |r: &DeliveryRecord| r.event_id[2..].parse::<u32>().unwrap();
    let early = ids(&|r| {
        (r.handler == "mailer" && number(r) < 3) || (r.handler == "projector" && number(r) < 2)
    });
    let late = ids(&|r| r.handler == "mailer" && (3..6).contains(&number(r)));
    assert_eq!((early.len(), late.len()), (5, 3));
    let buried = store.bury_by_id(&early, "smtp down", at(10)).await.unwrap();
    assert_eq!(buried.buried.len(), 5, "{buried:?}");
    let buried = store
        .bury_by_id(&late, "bad address", at(20))
        .await
        .unwrap();
    assert_eq!(buried.buried.len(), 3, "{buried:?}");
}

/// What the listings answer, in order of [`queries`]; each also read page by page.
async fn listings(store: &MongoEventStore) -> Vec<Vec<Seen>> {
    let mut answers = Vec::new();
    for query in queries() {
        let whole = seen(&store.list_deliveries(&query).await.unwrap());
        let pages = seen(&paged(store, &query).await);
        assert_eq!(whole, pages, "{query:?}: pages");
        answers.push(whole);
    }
    answers
}

#[tokio::test]
async fn listings_and_purge_answer_the_same_without_the_listing_indexes() {
    let on_db = test_db("listing_on").await;
    let off_db = test_db("listing_off").await;
    let on = set_up(&on_db, true).await;
    let off = set_up(&off_db, false).await;
    assert_eq!(delivery_indexes(&off_db).await, WITHOUT_LISTING);
    populate(&on).await;
    populate(&off).await;

    let expected = listings(&on).await;
    // The answers hold what was published and buried, so that equal answers mean something.
    let sizes: Vec<usize> = expected.iter().map(Vec::len).collect();
    assert_eq!(sizes, [24, 16, 8, 12, 12, 4, 12, 6, 3, 12, 2, 5]);
    assert_eq!(listings(&off).await, expected);

    // Dead letters and counts go through `status_created`, which both keep.
    let groups = |store: &MongoEventStore| {
        let store = store.clone();
        async move {
            let mut groups: Vec<(String, Option<String>, u64)> = store
                .dead_letter_groups(None)
                .await
                .unwrap()
                .into_iter()
                .map(|g| (g.handler, g.error, g.count))
                .collect();
            groups.sort();
            groups
        }
    };
    let error = |reason: &str| Some(format!("buried by an operator: {reason}"));
    assert_eq!(
        groups(&off).await,
        [
            ("mailer".to_owned(), error("bad address"), 3),
            ("mailer".to_owned(), error("smtp down"), 3),
            ("projector".to_owned(), error("smtp down"), 2),
        ]
    );
    assert_eq!(groups(&on).await, groups(&off).await);
    let (on_stats, off_stats) = (
        on.statistics().await.unwrap(),
        off.statistics().await.unwrap(),
    );
    assert_eq!((off_stats.pending, off_stats.dead), (16, 8));
    assert_eq!(
        (on_stats.pending, on_stats.dead),
        (off_stats.pending, off_stats.dead)
    );

    // The purge of the dead before 15 s: five dead deliveries, in batches of two, and the two
    // events nothing references any more.
    let options = PurgeOptions::new().dead_before(at(15));
    let purged = off.purge(&options).await.unwrap();
    assert_eq!(
        (
            purged.dead_deliveries,
            purged.completion_records,
            purged.events
        ),
        (5, 0, 2),
        "{purged:?}"
    );
    assert_eq!(on.purge(&options).await.unwrap(), purged);
    let after = listings(&off).await;
    let sizes: Vec<usize> = after.iter().map(Vec::len).collect();
    assert_eq!(sizes, [19, 16, 3, 9, 10, 2, 9, 3, 3, 10, 0, 5]);
    assert_eq!(listings(&on).await, after);
    let left = relaybus_tests::support::event_ids(&off_db).await;
    assert_eq!(left.len(), 10);
    assert!(!left.contains(&"e-0".to_owned()) && !left.contains(&"e-1".to_owned()));
    assert_eq!(relaybus_tests::support::event_ids(&on_db).await, left);
}

#[tokio::test]
async fn a_purge_with_the_listing_indexes_on_works_after_status_updated_was_dropped_by_hand() {
    let db = test_db("purge_dropped_status_updated").await;
    let store = set_up(&db, true).await;
    populate(&store).await;
    // The specification lets a deployment drop the listing indexes itself.
    db.db()
        .collection::<Document>("relaybus_deliveries")
        .drop_index("status_updated")
        .await
        .unwrap();
    let options = PurgeOptions::new().dead_before(at(25));
    let purged = store.purge(&options).await.unwrap();
    assert_eq!((purged.dead_deliveries, purged.events), (8, 2));
    let dead = store
        .list_deliveries(&DeliveryQuery::new().status(DeliveryStatus::Dead))
        .await
        .unwrap();
    assert!(dead.is_empty(), "{dead:?}");
}
