//! The in-memory store's own behaviour, beyond the conformance suite: business documents in
//! the transaction of the events, write conflicts and their retry, sessions dropped with an
//! open transaction, completion fenced at the commit, the budget at the commit, completion
//! history, wake-ups, a bus dispatching on it, and a started bus publishing its schedule. No
//! MongoDB is needed.

use std::{
    sync::atomic::{AtomicU32, Ordering},
    time::Duration,
};

use futures::{FutureExt, StreamExt};
use relaybus::store::prelude::*;
use relaybus::{
    AppendRequest, BoxError, ConfigurationError, DeliveryQuery, DeliveryStatus, Error,
    EventEnvelope, HandlerContext, MemoryEventStore, MemorySession, PurgeOptions, RelayBus,
    Subscription, Timestamp,
    store::{ClaimRequest, Claimed, WakeUp, memory::MemoryStoreError},
};
use relaybus_tests::support::{OrderPlaced, next, placed};
use serde_json::{Value, json};
use tokio::sync::{Notify, mpsc};

/// The tests' epoch, in 2030: later than the creation time of every event they build.
const T0: i64 = 1_900_000_000_000;
const PROJECTOR: &str = "projector";
const MAILER: &str = "mailer";

/// `T0 + seconds`.
fn at(seconds: i64) -> Timestamp {
    Timestamp::from_millis(T0 + seconds * 1000)
}

/// An `order.placed.v1` event with this id and, if given, ordering key.
fn event(id: &str, key: Option<&str>) -> EventEnvelope {
    let event = EventEnvelope::new(&placed(id))
        .expect("valid event")
        .with_id(id)
        .expect("valid id");
    match key {
        Some(key) => event.with_key(key).expect("valid key"),
        None => event,
    }
}

fn names(handlers: &[&str]) -> Vec<String> {
    handlers.iter().map(|h| (*h).to_owned()).collect()
}

/// Appends `event` for `handlers` in the session's transaction.
async fn append(
    store: &MemoryEventStore,
    session: &mut MemorySession,
    event: &EventEnvelope,
    handlers: &[&str],
) -> Result<relaybus::Appended, Error> {
    let handlers = names(handlers);
    let mut appended = store
        .append(session, &[AppendRequest::new(event, &handlers)], at(0))
        .await?;
    Ok(appended.remove(0))
}

/// Claims up to 10 deliveries of `handlers` for `owner` at `now`, with a 30 s lease.
async fn claim(
    store: &MemoryEventStore,
    owner: &str,
    handlers: &[&str],
    now: Timestamp,
) -> Vec<Claimed<relaybus::store::memory::MemoryLease>> {
    let handlers = names(handlers);
    store
        .claim(ClaimRequest {
            owner,
            handlers: &handlers,
            limit: 10,
            lease_duration: Duration::from_secs(30),
            now,
        })
        .await
        .expect("claim")
}

/// The memory store's own error behind a database error.
fn memory_error(error: &Error) -> Option<&MemoryStoreError> {
    match error {
        Error::Database(database) => database.downcast_ref::<MemoryStoreError>(),
        _ => None,
    }
}

/// Whether `error` is the transient write conflict.
fn is_write_conflict(error: &Error) -> bool {
    error.is_transient_transaction_error()
        && matches!(
            memory_error(error),
            Some(MemoryStoreError::WriteConflict { .. })
        )
}

/// Every pending and dead delivery's event id, sorted.
async fn event_ids(store: &MemoryEventStore) -> Vec<String> {
    let mut ids: Vec<String> = store
        .list_deliveries(&DeliveryQuery::new().limit(1000))
        .await
        .expect("list")
        .into_iter()
        .map(|r| r.event_id)
        .collect();
    ids.sort();
    ids
}

#[tokio::test]
async fn documents_commit_and_roll_back_with_their_events() {
    let store = MemoryEventStore::new();
    let order = event("o-1", Some("customer-7"));

    // Committed: the document and the event both, and neither before the commit.
    let mut session = store.session().await.unwrap();
    store.begin(&mut session, None).await.unwrap();
    session
        .insert("orders", "o-1", json!({ "total_cents": 1250 }))
        .unwrap();
    let appended = append(&store, &mut session, &order, &[PROJECTOR])
        .await
        .unwrap();
    assert_eq!(appended.sequence, Some(1));
    assert_eq!(
        session.get("orders", "o-1").unwrap(),
        Some(json!({ "total_cents": 1250 })),
        "the transaction sees its own write"
    );
    assert_eq!(
        store.document("orders", "o-1"),
        None,
        "seen before the commit"
    );
    assert!(event_ids(&store).await.is_empty(), "seen before the commit");
    store.commit(&mut session).await.unwrap();
    assert_eq!(
        store.document("orders", "o-1"),
        Some(json!({ "total_cents": 1250 }))
    );
    assert_eq!(event_ids(&store).await, ["o-1"]);

    // Rolled back: the body fails after writing a document, changing one, deleting one and
    // publishing a keyed event; none of it stays, and the key's sequence is not taken.
    let second = event("o-2", Some("customer-7"));
    let failed: Result<(), Error> = store
        .transaction(async |session| {
            session.insert("orders", "o-2", json!({ "total_cents": 99 }))?;
            session.update("orders", "o-1", |order| {
                let mut order = order?;
                order["total_cents"] = json!(0);
                Some(order)
            })?;
            assert!(session.delete("orders", "o-1")?);
            assert_eq!(session.get("orders", "o-1")?, None);
            append(&store, session, &second, &[PROJECTOR]).await?;
            Err(Error::custom("the order was refused"))
        })
        .await;
    assert!(matches!(failed, Err(Error::Custom(_))), "{failed:?}");
    assert_eq!(
        store.documents("orders"),
        [("o-1".to_owned(), json!({ "total_cents": 1250 }))]
    );
    assert_eq!(event_ids(&store).await, ["o-1"]);
    assert!(store.event_detail("o-2").await.unwrap().is_none());

    let third = store
        .transaction(async |session| {
            session.put("orders", "o-3", json!({ "total_cents": 5 }))?;
            append(
                &store,
                session,
                &event("o-3", Some("customer-7")),
                &[PROJECTOR],
            )
            .await
        })
        .await
        .unwrap();
    assert_eq!(
        third.sequence,
        Some(2),
        "the rolled-back event took no number"
    );
    assert_eq!(store.count("orders"), 2);
    let ids: Vec<String> = store
        .documents("orders")
        .into_iter()
        .map(|(id, _)| id)
        .collect();
    assert_eq!(ids, ["o-1", "o-3"], "in id order");
}

#[tokio::test]
async fn the_document_calls_check_their_input_and_their_session() {
    let store = MemoryEventStore::new();
    let mut session = store.session().await.unwrap();
    match session.put("orders", "o-1", json!({})) {
        Err(Error::Configuration(error @ ConfigurationError::NoTransaction { operation })) => {
            assert_eq!(operation, "MemorySession.put");
            assert!(
                error.to_string().contains(
                    "needs a MemorySession inside a started transaction; start one with \
                     `store.begin(&mut session, None)`"
                ),
                "{error}"
            );
        }
        other => panic!("{other:?}"),
    }
    assert!(matches!(
        session.get("orders", "o-1"),
        Err(Error::Configuration(
            ConfigurationError::NoTransaction { .. }
        ))
    ));

    store.begin(&mut session, None).await.unwrap();
    for (collection, id, argument) in [
        ("", "o-1", "collection"),
        ("a\nb", "o-1", "collection"),
        ("orders", "", "id"),
    ] {
        match session.put(collection, id, json!({})) {
            Err(Error::InvalidArgument(error)) => assert_eq!(error.argument(), argument),
            other => panic!("{collection:?}/{id:?}: {other:?}"),
        }
    }
    // A duplicate insert is refused with a typed error, writes nothing and leaves the
    // transaction usable; `put` replaces; `delete` says whether there was a document.
    session.insert("orders", "o-1", json!(1)).unwrap();
    let duplicate = session.insert("orders", "o-1", json!(2)).unwrap_err();
    assert_eq!(
        memory_error(&duplicate),
        Some(&MemoryStoreError::DuplicateDocument {
            collection: "orders".to_owned(),
            id: "o-1".to_owned()
        })
    );
    assert!(!duplicate.is_transient_transaction_error());
    assert!(duplicate.to_string().contains("use `put`"), "{duplicate}");
    assert_eq!(session.get("orders", "o-1").unwrap(), Some(json!(1)));
    session.put("orders", "o-1", json!(3)).unwrap();
    assert!(!session.delete("orders", "missing").unwrap());
    store.commit(&mut session).await.unwrap();
    assert_eq!(store.document("orders", "o-1"), Some(json!(3)));

    // A session of another store is refused, and nothing is written through it.
    let other = MemoryEventStore::new();
    let mut foreign = other.session().await.unwrap();
    match store.begin(&mut foreign, None).await {
        Err(Error::InvalidArgument(error)) => assert_eq!(error.argument(), "session"),
        other => panic!("{other:?}"),
    }
    other.begin(&mut foreign, None).await.unwrap();
    let refused = append(&store, &mut foreign, &event("e-1", None), &[PROJECTOR]).await;
    assert!(
        matches!(refused, Err(Error::InvalidArgument(_))),
        "{refused:?}"
    );
    // Beginning twice on one session is refused.
    let twice = other.begin(&mut foreign, None).await.unwrap_err();
    assert_eq!(
        memory_error(&twice),
        Some(&MemoryStoreError::TransactionInProgress)
    );
    other.abort(&mut foreign).await;
    assert!(event_ids(&store).await.is_empty());
    assert!(event_ids(&other).await.is_empty());
}

#[tokio::test]
async fn a_write_conflict_is_transient_and_the_transaction_runs_again_to_success() {
    let store = MemoryEventStore::new();
    store
        .transaction(async |session| session.put("stock", "sku-1", json!(10)))
        .await
        .unwrap();

    // An open transaction holds the document.
    let mut holder = store.session().await.unwrap();
    store.begin(&mut holder, None).await.unwrap();
    holder
        .update("stock", "sku-1", |n| Some(json!(n?.as_i64()? - 1)))
        .unwrap();

    // Another transaction writing it conflicts at once, with a transient error that the
    // runner retries; once the holder committed, it runs to success on the committed value.
    let attempts = AtomicU32::new(0);
    let conflicted = Notify::new();
    let retried = store.transaction(async |session| {
        let attempt = attempts.fetch_add(1, Ordering::SeqCst) + 1;
        let written = session.update("stock", "sku-1", |n| Some(json!(n?.as_i64()? - 2)));
        if attempt == 1 {
            let error = written.as_ref().expect_err("the document is held");
            assert!(is_write_conflict(error), "{error:?}");
            assert!(
                error
                    .to_string()
                    .contains("another open transaction wrote document \"sku-1\""),
                "{error}"
            );
            assert!(
                <MemoryEventStore as Transactions>::is_transient(
                    memory_error(error).expect("the store's error")
                ),
                "the store recognizes its conflict"
            );
            conflicted.notify_one();
        }
        written
    });
    let commit_holder = async {
        conflicted.notified().await;
        store.commit(&mut holder).await
    };
    let (retried, committed) = tokio::join!(retried, commit_holder);
    committed.unwrap();
    retried.unwrap();
    assert!(attempts.load(Ordering::SeqCst) >= 2);
    assert_eq!(store.document("stock", "sku-1"), Some(json!(7)));
}

#[tokio::test]
async fn a_document_read_then_changed_by_another_commit_conflicts_on_write() {
    let store = MemoryEventStore::new();
    store
        .transaction(async |session| session.put("stock", "sku-1", json!(10)))
        .await
        .unwrap();
    let mut reader = store.session().await.unwrap();
    store.begin(&mut reader, None).await.unwrap();
    let seen = reader.get("stock", "sku-1").unwrap();
    assert_eq!(seen, Some(json!(10)));

    store
        .transaction(async |session| session.put("stock", "sku-1", json!(3)))
        .await
        .unwrap();
    // Writing what it computed from the stale read would lose the other update.
    let lost = reader.put("stock", "sku-1", json!(9)).unwrap_err();
    assert!(is_write_conflict(&lost), "{lost:?}");
    assert!(lost.to_string().contains("changed since"), "{lost}");
    // The transaction is lost: its commit fails as well, and applies nothing.
    let commit = store.commit(&mut reader).await.unwrap_err();
    assert!(is_write_conflict(&commit), "{commit:?}");
    assert_eq!(store.document("stock", "sku-1"), Some(json!(3)));
}

#[tokio::test]
async fn events_and_key_sequences_conflict_between_open_transactions() {
    let store = MemoryEventStore::new();
    let mut first = store.session().await.unwrap();
    let mut second = store.session().await.unwrap();
    store.begin(&mut first, None).await.unwrap();
    store.begin(&mut second, None).await.unwrap();

    let a1 = append(&store, &mut first, &event("a-1", Some("A")), &[PROJECTOR])
        .await
        .unwrap();
    assert_eq!(a1.sequence, Some(1));
    // The same key, another event: the key's counter is held by the first transaction.
    let error = append(&store, &mut second, &event("a-2", Some("A")), &[PROJECTOR])
        .await
        .unwrap_err();
    assert!(is_write_conflict(&error), "{error:?}");
    assert!(error.to_string().contains("ordering key \"A\""), "{error}");
    store.abort(&mut second).await;

    // The same event id: held too.
    store.begin(&mut second, None).await.unwrap();
    let error = append(&store, &mut second, &event("a-1", Some("A")), &[MAILER])
        .await
        .unwrap_err();
    assert!(is_write_conflict(&error), "{error:?}");
    store.abort(&mut second).await;

    // Another key is free.
    store.begin(&mut second, None).await.unwrap();
    let b1 = append(&store, &mut second, &event("b-1", Some("B")), &[PROJECTOR])
        .await
        .unwrap();
    assert_eq!(b1.sequence, Some(1));
    store.commit(&mut second).await.unwrap();

    // After the first commits, the key goes on from its number: gapless, in commit order.
    store.commit(&mut first).await.unwrap();
    let a2 = store
        .transaction(async |session| {
            append(&store, session, &event("a-2", Some("A")), &[PROJECTOR]).await
        })
        .await
        .unwrap();
    assert_eq!(a2.sequence, Some(2));
    assert_eq!(event_ids(&store).await, ["a-1", "a-2", "b-1"]);
}

#[tokio::test]
async fn a_dropped_session_aborts_its_transaction_and_lets_go_of_what_it_held() {
    let store = MemoryEventStore::new();
    {
        let mut session = store.session().await.unwrap();
        store.begin(&mut session, None).await.unwrap();
        session
            .put("orders", "o-1", json!({ "total_cents": 1 }))
            .unwrap();
        append(&store, &mut session, &event("o-1", Some("K")), &[PROJECTOR])
            .await
            .unwrap();
        // Dropped without a commit or an abort.
    }
    assert_eq!(store.document("orders", "o-1"), None);
    assert!(event_ids(&store).await.is_empty());
    assert_eq!(store.statistics().await.unwrap().pending, 0);

    // What it held is free: the same document, event id and key at once, with no conflict
    // and the first number of the key.
    let appended = store
        .transaction(async |session| {
            session.put("orders", "o-1", json!({ "total_cents": 2 }))?;
            append(&store, session, &event("o-1", Some("K")), &[PROJECTOR]).await
        })
        .await
        .unwrap();
    assert!(appended.created);
    assert_eq!(appended.sequence, Some(1));
    assert_eq!(
        store.document("orders", "o-1"),
        Some(json!({ "total_cents": 2 }))
    );
}

#[tokio::test]
async fn complete_in_transaction_is_fenced_again_at_the_commit() {
    let store = MemoryEventStore::new();
    store
        .transaction(async |session| {
            append(&store, session, &event("e-1", None), &[PROJECTOR]).await
        })
        .await
        .unwrap();
    let first = claim(&store, "a", &[PROJECTOR], at(1)).await;
    assert_eq!(first.len(), 1);
    let stale = first[0].lease;

    // The handler's transaction completes under the lease, which holds now ...
    let mut handler = store.session().await.unwrap();
    store.begin(&mut handler, None).await.unwrap();
    handler
        .put("projections", "e-1", json!("projected"))
        .unwrap();
    assert!(
        store
            .complete_in_transaction(&mut handler, &stale, at(2))
            .await
            .unwrap()
    );
    // ... and a second open transaction completing the same delivery conflicts.
    let mut rival = store.session().await.unwrap();
    store.begin(&mut rival, None).await.unwrap();
    let error = store
        .complete_in_transaction(&mut rival, &stale, at(2))
        .await
        .unwrap_err();
    assert!(is_write_conflict(&error), "{error:?}");
    store.abort(&mut rival).await;

    // The lease expires and another owner takes the delivery over before the commit.
    let taken = claim(&store, "b", &[PROJECTOR], at(40)).await;
    assert_eq!(taken.len(), 1);
    assert_eq!(taken[0].attempt, 2);
    let error = store.commit(&mut handler).await.unwrap_err();
    assert!(is_write_conflict(&error), "{error:?}");
    assert!(error.to_string().contains("taken over"), "{error}");
    assert_eq!(
        store.document("projections", "e-1"),
        None,
        "the handler's writes went with the commit"
    );
    let records = store.list_deliveries(&DeliveryQuery::new()).await.unwrap();
    assert_eq!(records.len(), 1);
    assert!(records[0].running, "still the new owner's: {records:?}");

    // Run again, as the dispatcher would, the handler's transaction sees the lease gone.
    let completed = store
        .transaction(async |session| {
            session.put("projections", "e-1", json!("projected"))?;
            store.complete_in_transaction(session, &stale, at(41)).await
        })
        .await
        .unwrap();
    assert!(!completed);
    assert_eq!(
        store.complete(&[taken[0].lease], at(42)).await.unwrap(),
        [true]
    );
    assert_eq!(store.statistics().await.unwrap().pending, 0);
}

#[tokio::test]
async fn a_commit_past_the_budget_applies_nothing() {
    let store = MemoryEventStore::new();

    let mut session = store.session().await.unwrap();
    store
        .begin(&mut session, Some(Duration::from_millis(1)))
        .await
        .unwrap();
    session.put("orders", "o-1", json!(1)).unwrap();
    append(&store, &mut session, &event("o-1", Some("K")), &[PROJECTOR])
        .await
        .unwrap();
    // The budget is wall-clock time: let it run out.
    tokio::time::sleep(Duration::from_millis(20)).await;
    let error = store.commit(&mut session).await.unwrap_err();
    assert!(error.is_timeout(), "{error:?}");
    assert!(!error.is_transient_transaction_error());
    assert!(
        matches!(
            memory_error(&error),
            Some(MemoryStoreError::BudgetExceeded { budget, elapsed })
                if *budget == Duration::from_millis(1) && *elapsed >= Duration::from_millis(20)
        ),
        "{error:?}"
    );
    assert_eq!(store.document("orders", "o-1"), None);
    assert!(event_ids(&store).await.is_empty());

    // The transaction is over and held nothing: the session and the key serve again.
    store.begin(&mut session, None).await.unwrap();
    let appended = append(&store, &mut session, &event("o-2", Some("K")), &[PROJECTOR])
        .await
        .unwrap();
    assert_eq!(appended.sequence, Some(1));
    store.commit(&mut session).await.unwrap();

    // Through the runner, the same timeout is a `TransactionTimeout`.
    let timed_out = store
        .transaction_within(Duration::from_millis(1), async |session| {
            session.put("orders", "o-3", json!(3))?;
            tokio::time::sleep(Duration::from_millis(20)).await;
            Ok(())
        })
        .await;
    assert!(
        matches!(timed_out, Err(Error::TransactionTimeout(_))),
        "{timed_out:?}"
    );
    assert_eq!(store.document("orders", "o-3"), None);
    let refused = store
        .transaction_within(Duration::ZERO, async |_| Ok(()))
        .await;
    assert!(
        matches!(&refused, Err(Error::InvalidArgument(e)) if e.argument() == "budget"),
        "{refused:?}"
    );
}

#[tokio::test]
async fn completion_history_keeps_a_record_of_every_completion() {
    let store = MemoryEventStore::builder().completion_history(true).build();
    assert!(store.completion_history());
    store
        .transaction(async |session| {
            append(&store, session, &event("e-1", None), &[PROJECTOR, MAILER]).await
        })
        .await
        .unwrap();
    let batch = claim(&store, "w", &[PROJECTOR], at(1)).await;
    assert!(
        store
            .reschedule(&batch[0].lease, at(2), "flaky", at(1))
            .await
            .unwrap()
    );
    let batch = claim(&store, "w", &[PROJECTOR], at(3)).await;
    let completed_id = batch[0].lease.delivery_id().to_string();
    assert_eq!(
        store.complete(&[batch[0].lease], at(4)).await.unwrap(),
        [true]
    );

    let stats = store.statistics().await.unwrap();
    assert!(stats.completion_history);
    assert_eq!((stats.completed, stats.pending), (1, 1), "{stats:?}");
    let records = store
        .list_deliveries(&DeliveryQuery::new().status(DeliveryStatus::Completed))
        .await
        .unwrap();
    assert_eq!(records.len(), 1, "{records:?}");
    let record = &records[0];
    assert_eq!(record.id, completed_id);
    assert_eq!(record.status, DeliveryStatus::Completed);
    assert_eq!(record.handler, PROJECTOR);
    assert_eq!(
        record.attempts, 2,
        "the failed attempt and the one that completed"
    );
    assert_eq!(record.completed_at, Some(at(4)));
    assert_eq!(record.errors.len(), 1, "the history goes with it");
    // The whole listing has it too, in id order with the pending one.
    let all = store.list_deliveries(&DeliveryQuery::new()).await.unwrap();
    let statuses: Vec<DeliveryStatus> = all.iter().map(|r| r.status).collect();
    assert_eq!(
        statuses,
        [DeliveryStatus::Completed, DeliveryStatus::Pending],
        "{all:?}"
    );
    let detail = store.event_detail("e-1").await.unwrap().unwrap();
    assert_eq!(detail.deliveries.len(), 2);
    assert_eq!(
        detail.completed_at, None,
        "the mailer has not completed yet"
    );

    // Purged by completion time; the event stays while its mailer delivery is pending.
    let purged = store
        .purge(&PurgeOptions::new().completed_before(at(5)))
        .await
        .unwrap();
    assert_eq!((purged.completion_records, purged.events), (1, 0));
    assert_eq!(store.statistics().await.unwrap().completed, 0);

    // Without history, nothing is kept.
    let plain = MemoryEventStore::new();
    plain
        .transaction(async |session| {
            append(&plain, session, &event("e-1", None), &[PROJECTOR]).await
        })
        .await
        .unwrap();
    let batch = claim(&plain, "w", &[PROJECTOR], at(1)).await;
    plain.complete(&[batch[0].lease], at(2)).await.unwrap();
    let stats = plain.statistics().await.unwrap();
    assert_eq!((stats.completed, stats.completion_history), (0, false));
    assert!(
        plain
            .list_deliveries(&DeliveryQuery::new().status(DeliveryStatus::Completed))
            .await
            .unwrap()
            .is_empty()
    );
    let detail = plain.event_detail("e-1").await.unwrap().unwrap();
    assert_eq!(detail.completed_at, Some(at(2)));
}

#[tokio::test]
async fn watch_wakes_on_a_commit_of_its_handlers_and_not_on_an_abort() {
    let store = MemoryEventStore::new();
    let mut wake_ups = store.watch(&names(&[PROJECTOR])).await.unwrap();

    // An aborted append of the watched handler, and a committed one of another handler.
    let mut session = store.session().await.unwrap();
    store.begin(&mut session, None).await.unwrap();
    append(&store, &mut session, &event("e-1", None), &[PROJECTOR])
        .await
        .unwrap();
    store.abort(&mut session).await;
    store
        .transaction(async |session| append(&store, session, &event("e-2", None), &[MAILER]).await)
        .await
        .unwrap();
    // A commit wakes watchers before it returns, so nothing ready now means no wake-up.
    assert!(
        wake_ups.next().now_or_never().is_none(),
        "woken by an abort or by another handler's delivery"
    );

    store
        .transaction(async |session| {
            append(&store, session, &event("e-3", None), &[PROJECTOR, MAILER]).await
        })
        .await
        .unwrap();
    let woken = wake_ups.next().now_or_never();
    assert!(
        matches!(woken, Some(Some(Ok(WakeUp { at: None, .. })))),
        "{woken:?}"
    );
    assert!(wake_ups.next().now_or_never().is_none(), "woken twice");
}

#[tokio::test]
async fn an_owner_is_not_handed_its_own_claims_again_and_lanes_list_the_owners() {
    let store = MemoryEventStore::new();
    store
        .transaction(async |session| {
            append(&store, session, &event("e-1", None), &[PROJECTOR]).await?;
            append(&store, session, &event("e-2", None), &[PROJECTOR]).await
        })
        .await
        .unwrap();
    let a = claim(&store, "a", &[PROJECTOR], at(1)).await;
    assert_eq!(a.len(), 2);
    // Long after the leases expired, the same owner gets nothing back: it still runs them.
    assert!(claim(&store, "a", &[PROJECTOR], at(100)).await.is_empty());
    let report = store.lanes().await.unwrap();
    assert_eq!(report.lanes.len(), 1, "{:?}", report.lanes);
    assert_eq!(report.lanes[0].owner.as_deref(), Some("a"));
    assert_eq!(report.lanes[0].in_flight, 2);

    // Handed back, the owner's own claim takes them over, charging the lost attempts.
    assert!(store.release(&a[0].lease, at(101)).await.unwrap());
    assert_eq!(store.relinquish("a").await.unwrap(), 1);
    let report = store.lanes().await.unwrap();
    assert_eq!(report.lanes.len(), 1, "{:?}", report.lanes);
    assert_eq!(report.lanes[0].owner, None, "handed back");
    let again = claim(&store, "a", &[PROJECTOR], at(102)).await;
    let mut attempts: Vec<(String, u32)> = again
        .iter()
        .map(|c| (c.event.id().to_owned(), c.attempt))
        .collect();
    attempts.sort();
    assert_eq!(
        attempts,
        [("e-1".to_owned(), 1), ("e-2".to_owned(), 2)],
        "the released one is not charged, the handed-back one is"
    );
    match store.relinquish("").await {
        Err(Error::InvalidArgument(error)) => assert_eq!(error.argument(), "owner"),
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn a_bus_dispatches_on_the_memory_store_and_handlers_write_in_its_transaction() {
    let store = MemoryEventStore::new();
    let (tx, mut rx) = mpsc::unbounded_channel::<String>();
    let bus: RelayBus<MemoryEventStore> = RelayBus::builder(store.clone())
        .without_registered_handlers()
        .subscribe(
            Subscription::new(
                "project-orders",
                move |event: OrderPlaced, ctx: HandlerContext<MemoryEventStore>| {
                    let tx = tx.clone();
                    async move {
                        {
                            let mut session = ctx.session().await?;
                            session.put(
                                "projections",
                                &event.order_id,
                                json!({ "total_cents": event.total_cents }),
                            )?;
                        }
                        tx.send(event.order_id).ok();
                        Ok::<(), BoxError>(())
                    }
                },
            )
            .transactional(),
        )
        .build()
        .unwrap();
    bus.start().await.unwrap();

    bus.transaction(async |session| {
        session.insert("orders", "o-1", json!({ "total_cents": 1250 }))?;
        bus.publish(&placed("o-1"))
            .key("o-1")
            .session(session)
            .await?;
        Ok(())
    })
    .await
    .unwrap();
    assert_eq!(next(&mut rx, "the handler").await, "o-1");
    bus.shutdown().await.unwrap();

    assert_eq!(
        store.document("projections", "o-1"),
        Some(json!({ "total_cents": 1250 }))
    );
    assert_eq!(store.statistics().await.unwrap().pending, 0);
    let _: Value = store.document("orders", "o-1").expect("the order");
}

/// A started bus publishes its schedule's ticks as its clock reaches them, and its handlers
/// get them: the background loop looks again at the poll interval on a test clock.
#[tokio::test]
async fn a_started_bus_publishes_its_ticks_in_the_background() {
    use relaybus::{Schedule, Tick, clock::TestClock};
    use relaybus_tests::fault::Beat;

    let clock = TestClock::new(at(0));
    let (ticks, mut heard) = mpsc::unbounded_channel();
    let bus = RelayBus::builder(MemoryEventStore::new())
        .without_registered_handlers()
        .without_registered_schedules()
        .clock(clock.clone())
        .poll_interval(Duration::from_millis(20))
        .subscribe(Subscription::new("beat-listener", move |beat: Beat| {
            let ticks = ticks.clone();
            async move {
                ticks.send(beat.at).map_err(BoxError::from)?;
                Ok::<(), BoxError>(())
            }
        }))
        .schedule(Schedule::every(
            "beat",
            Duration::from_secs(1),
            |tick: Tick| Beat { at: tick.at() },
        ))
        .build()
        .unwrap();
    bus.start().await.unwrap();
    for second in 0..4 {
        clock.advance_to(at(second));
        let got = tokio::time::timeout(Duration::from_secs(10), heard.recv())
            .await
            .expect("the tick is published and handled")
            .expect("the handler is alive");
        assert_eq!(got, at(second));
    }
    bus.shutdown().await.unwrap();
}

/// Three buses on clones of one store, a handler with `global_concurrency(4)`: at most 4 runs
/// at once across them, and the work drains.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn global_concurrency_holds_across_three_buses() {
    let store = MemoryEventStore::new();
    relaybus_tests::limits::global_concurrency_holds_across_buses([
        store.clone(),
        store.clone(),
        store,
    ])
    .await;
}

/// Three buses on clones of one store, a global concurrency of 2 partitioned by tenant: at
/// most 2 runs of a tenant at once, the tenants side by side.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partitioned_concurrency_holds_per_partition() {
    let store = MemoryEventStore::new();
    relaybus_tests::limits::partitioned_concurrency_holds_per_partition([
        store.clone(),
        store.clone(),
        store,
    ])
    .await;
}

/// A partition of a global concurrency the handler does not have: the bus is refused, saying
/// what to add.
#[test]
fn a_partition_without_a_global_concurrency_is_refused() {
    let handler = Subscription::new("limited", |_: OrderPlaced| async { Ok::<(), BoxError>(()) })
        .partition_concurrency_by(relaybus_tests::limits::tenant);
    let built = RelayBus::builder(MemoryEventStore::new())
        .without_registered_handlers()
        .subscribe(handler)
        .build();
    match built {
        Err(ConfigurationError::InvalidOption { option, reason }) => {
            assert_eq!(option, "partition_concurrency_by");
            assert!(reason.contains("global_concurrency(n)"), "{reason}");
        }
        other => panic!("expected the partition refused, got {other:?}"),
    }
}

/// A rate limit of 50 per second over three buses on clones of one store.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rate_limit_holds_across_three_buses() {
    let store = MemoryEventStore::new();
    relaybus_tests::limits::rate_limit_holds_across_buses([store.clone(), store.clone(), store])
        .await;
}

/// 10,000 unkeyed events through a transactional batch handler of at most 100 that writes one
/// document per event in the batch's transaction: each effect once, in batches of at most 100.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transactional_batches_drain_exactly_once() {
    use relaybus::Batch;
    use relaybus_tests::batches::{self, BATCHER, Batches};
    let store = MemoryEventStore::new();
    let recorded = std::sync::Arc::new(Batches::default());
    let recorder = std::sync::Arc::clone(&recorded);
    let handler = Subscription::batch(
        BATCHER,
        move |batch: Batch<OrderPlaced>, ctx: HandlerContext<MemoryEventStore>| {
            let recorder = std::sync::Arc::clone(&recorder);
            async move {
                let mut session = ctx.session().await?;
                for item in &batch {
                    session.insert(
                        "effects",
                        item.event_id(),
                        json!({ "order": item.event().order_id }),
                    )?;
                }
                drop(session);
                recorder.record(&batch);
                Ok::<(), BoxError>(())
            }
        },
    )
    .transactional();
    let bus = batches::bus(store.clone(), handler);
    batches::drain_in_batches(&bus, &recorded, 10_000, 100).await;
    assert_eq!(store.count("effects"), 10_000, "each effect once");
}

/// Deliveries retried after a failure in their batch come back in later batches, each batch
/// holding a delivery once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_holds_each_delivery_once() {
    relaybus_tests::batches::a_batch_holds_each_delivery_once(MemoryEventStore::new()).await;
}

/// Keyed events through a batch handler: each key's order holds across batches.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keyed_order_holds_across_batches() {
    relaybus_tests::batches::keyed_order_holds_across_batches(MemoryEventStore::new()).await;
}

/// A poison event in a batch goes dead alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poison_event_in_a_batch_goes_dead_alone() {
    relaybus_tests::batches::poison_goes_dead_alone(MemoryEventStore::new()).await;
}
