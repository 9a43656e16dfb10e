//! Setup, appends and transactions.

use std::time::Duration;

use relaybus::{
    AppendRequest, ConfigurationError, DeliveryStatus, Error, EventValidationError, Store,
    store::transaction,
};

use super::{
    MAILER, PLACED, PROJECTOR, all_deliveries, at, claim, event, holds_event, leases, names,
    publish, statistics, typed,
};

/// `setup` is idempotent: running it again on a store that holds data succeeds and keeps
/// the data.
pub async fn setup_is_idempotent<S: Store>(store: &S) {
    publish(store, &[event("e-1", None)], &[PROJECTOR], at(0)).await;
    store
        .setup()
        .await
        .unwrap_or_else(|e| panic!("{}: a second setup failed: {e}", S::NAME));
    store.setup().await.expect("a third setup");
    let records = all_deliveries(store).await;
    assert_eq!(
        records.len(),
        1,
        "{}: setup lost data: {records:?}",
        S::NAME
    );
    assert_eq!(records[0].event_id, "e-1");
}

/// A new event gets one pending delivery per handler of its request, due at the append's
/// `now`, with no attempt; the append reports it as created with those handlers.
pub async fn append_creates_one_delivery_per_handler<S: Store>(store: &S) {
    let appended = publish(store, &[event("e-1", None)], &[PROJECTOR, MAILER], at(0)).await;
    assert_eq!(appended.len(), 1);
    assert_eq!(appended[0].event_id, "e-1");
    assert!(appended[0].created, "{}: {appended:?}", S::NAME);
    assert_eq!(
        appended[0].sequence, None,
        "an unkeyed event has no sequence"
    );
    let mut new = appended[0].new_deliveries.clone();
    new.sort();
    assert_eq!(new, names(&[MAILER, PROJECTOR]));

    let stats = statistics(store).await;
    assert_eq!(stats.pending, 2, "{}: {stats:?}", S::NAME);
    assert_eq!(stats.running, 0);
    assert_eq!(stats.dead, 0);
    assert_eq!(stats.oldest_due_at, Some(at(0)));

    let mut records = all_deliveries(store).await;
    records.sort_by(|a, b| a.handler.cmp(&b.handler));
    let handlers: Vec<&str> = records.iter().map(|r| r.handler.as_str()).collect();
    assert_eq!(handlers, [MAILER, PROJECTOR], "{}: {records:?}", S::NAME);
    for record in &records {
        assert_eq!(record.event_id, "e-1");
        assert_eq!(record.event_type, PLACED);
        assert_eq!(record.status, DeliveryStatus::Pending);
        assert_eq!(record.key, None);
        assert_eq!(record.sequence, None);
        assert_eq!(record.attempts, 0);
        assert_eq!(record.due_at, Some(at(0)), "due at the append's now");
        assert!(record.created_at.is_some());
        assert!(!record.parked);
        assert_eq!(record.last_error, None);
    }
    assert_ne!(
        records[0].id, records[1].id,
        "every delivery has its own id"
    );

    // An event with no handlers is stored but has no delivery.
    let appended = publish(store, &[event("e-2", None)], &[], at(0)).await;
    assert!(appended[0].created);
    assert!(appended[0].new_deliveries.is_empty());
    assert_eq!(statistics(store).await.pending, 2);
}

/// An event id the store holds is not written again: appending it adds only the deliveries of
/// handlers new to the event, none for handlers it has or had (completed ones included).
pub async fn append_of_a_known_id_adds_only_new_handlers<S: Store>(store: &S) {
    publish(store, &[event("e-1", None)], &[PROJECTOR], at(0)).await;

    let again = publish(store, &[event("e-1", None)], &[PROJECTOR, MAILER], at(1)).await;
    assert!(!again[0].created, "{}: {again:?}", S::NAME);
    assert_eq!(again[0].new_deliveries, names(&[MAILER]));
    assert_eq!(statistics(store).await.pending, 2);

    let third = publish(store, &[event("e-1", None)], &[PROJECTOR, MAILER], at(2)).await;
    assert!(!third[0].created);
    assert!(third[0].new_deliveries.is_empty(), "{}: {third:?}", S::NAME);
    assert_eq!(statistics(store).await.pending, 2);

    // The projector completes; a redelivered message must not run it again.
    let batch = claim(store, "w", &[PROJECTOR], 10, at(3)).await;
    assert_eq!(batch.len(), 1);
    assert_eq!(
        store.complete(&leases(&batch), at(4)).await.unwrap(),
        [true]
    );
    let after = publish(store, &[event("e-1", None)], &[PROJECTOR], at(5)).await;
    assert!(!after[0].created);
    assert!(
        after[0].new_deliveries.is_empty(),
        "{}: a completed handler got a new delivery: {after:?}",
        S::NAME
    );
    let records = all_deliveries(store).await;
    assert_eq!(records.len(), 1, "{}: {records:?}", S::NAME);
    assert_eq!(records[0].handler, MAILER);
    assert_eq!(records[0].due_at, Some(at(1)), "kept as first appended");
}

/// An event id that names an event of another type is refused with
/// [`EventValidationError::IdReused`], whether the event is stored or earlier in the same batch,
/// and the aborted transaction leaves nothing of itself.
pub async fn append_of_a_known_id_with_another_type_is_refused<S: Store>(store: &S) {
    publish(store, &[event("e-1", None)], &[PROJECTOR], at(0)).await;
    let before = all_deliveries(store).await;
    let stats = statistics(store).await;

    let cancelled = typed("order.cancelled.v1", "e-1", None);
    let fresh = event("e-2", None);
    let handlers = names(&[PROJECTOR, MAILER]);
    let refused = transaction::run(store, None, async |session| {
        // Another event first, in the same transaction: it must go with the abort.
        store
            .append(session, &[AppendRequest::new(&fresh, &handlers)], at(1))
            .await?;
        store
            .append(session, &[AppendRequest::new(&cancelled, &handlers)], at(1))
            .await
    })
    .await;
    match refused {
        Err(Error::EventValidation(EventValidationError::IdReused {
            id,
            existing_type,
            event_type,
        })) => {
            assert_eq!(id, "e-1");
            assert_eq!(existing_type, PLACED);
            assert_eq!(event_type, "order.cancelled.v1");
        }
        other => panic!("{}: expected IdReused, got {other:?}", S::NAME),
    }
    assert_eq!(statistics(store).await, stats, "{}", S::NAME);
    assert_eq!(all_deliveries(store).await, before, "{}", S::NAME);

    // The same id with two types in one batch: refused before anything is written.
    let placed = event("e-3", None);
    let cancelled = typed("order.cancelled.v1", "e-3", None);
    let refused = transaction::run(store, None, async |session| {
        store
            .append(
                session,
                &[
                    AppendRequest::new(&placed, &handlers),
                    AppendRequest::new(&cancelled, &handlers),
                ],
                at(2),
            )
            .await
    })
    .await;
    assert!(
        matches!(
            refused,
            Err(Error::EventValidation(
                EventValidationError::IdReused { .. }
            ))
        ),
        "{}: {refused:?}",
        S::NAME
    );
    assert_eq!(all_deliveries(store).await, before, "{}", S::NAME);
    assert!(!holds_event(store, "e-2", PLACED).await, "e-2 was kept");
    assert!(!holds_event(store, "e-3", PLACED).await, "e-3 was kept");
}

/// Keyed events take gapless sequences per key, 1, 2, 3, in commit order, shared by the
/// deliveries of one event; keys count independently; an aborted transaction and a repeated
/// id take no number.
pub async fn keyed_events_get_gapless_sequences_per_key<S: Store>(store: &S) {
    let first = publish(
        store,
        &[event("a-1", Some("A")), event("a-2", Some("A"))],
        &[PROJECTOR, MAILER],
        at(0),
    )
    .await;
    let sequences: Vec<Option<i64>> = first.iter().map(|a| a.sequence).collect();
    assert_eq!(sequences, [Some(1), Some(2)], "{}: {first:?}", S::NAME);

    let b = publish(store, &[event("b-1", Some("B"))], &[PROJECTOR], at(1)).await;
    assert_eq!(
        b[0].sequence,
        Some(1),
        "{}: keys count independently",
        S::NAME
    );
    let unkeyed = publish(store, &[event("u-1", None)], &[PROJECTOR], at(1)).await;
    assert_eq!(unkeyed[0].sequence, None);
    let a3 = publish(store, &[event("a-3", Some("A"))], &[PROJECTOR], at(2)).await;
    assert_eq!(a3[0].sequence, Some(3));

    // An aborted append of the key takes no number.
    let rolled_back = event("a-x", Some("A"));
    let handlers = names(&[PROJECTOR]);
    let aborted: Result<(), Error> = transaction::run(store, None, async |session| {
        let appended = store
            .append(
                session,
                &[AppendRequest::new(&rolled_back, &handlers)],
                at(3),
            )
            .await?;
        assert_eq!(appended[0].sequence, Some(4));
        Err(Error::custom("rolled back"))
    })
    .await;
    assert!(matches!(aborted, Err(Error::Custom(_))), "{aborted:?}");
    let a4 = publish(store, &[event("a-4", Some("A"))], &[PROJECTOR], at(4)).await;
    assert_eq!(a4[0].sequence, Some(4), "{}: a gap after an abort", S::NAME);

    // A repeated id keeps its sequence and takes no new one.
    let repeated = publish(store, &[event("a-1", Some("A"))], &[PROJECTOR], at(5)).await;
    assert!(!repeated[0].created);
    assert_eq!(repeated[0].sequence, Some(1), "{}: {repeated:?}", S::NAME);
    let a5 = publish(store, &[event("a-5", Some("A"))], &[PROJECTOR], at(6)).await;
    assert_eq!(a5[0].sequence, Some(5), "{}: a gap after a repeat", S::NAME);

    // The deliveries carry their event's key and sequence.
    let records = all_deliveries(store).await;
    assert_eq!(records.len(), 9, "{}: {records:?}", S::NAME);
    for record in &records {
        let expected = match record.event_id.as_str() {
            "u-1" => None,
            "b-1" => Some(("B", 1)),
            id => Some(("A", id[2..].parse().unwrap())),
        };
        assert_eq!(
            record.key.as_deref().zip(record.sequence),
            expected,
            "{}: {record:?}",
            S::NAME
        );
    }
}

/// An aborted transaction leaves nothing: no event, no delivery, no sequence number. The same
/// event appended afterwards is new.
pub async fn an_aborted_transaction_leaves_nothing<S: Store>(store: &S) {
    let keyed = event("e-1", Some("K"));
    let handlers = names(&[PROJECTOR, MAILER]);
    let mut session = store.session().await.expect("session");
    store.begin(&mut session, None).await.expect("begin");
    let appended = store
        .append(
            &mut session,
            &[AppendRequest::new(&keyed, &handlers)],
            at(0),
        )
        .await
        .expect("append");
    assert!(appended[0].created);
    store.abort(&mut session).await;

    let stats = statistics(store).await;
    assert_eq!(stats.pending, 0, "{}: {stats:?}", S::NAME);
    assert_eq!(stats.oldest_due_at, None);
    assert!(all_deliveries(store).await.is_empty());
    assert!(
        claim(store, "w", &[PROJECTOR, MAILER], 10, at(1))
            .await
            .is_empty()
    );

    let again = publish(store, &[keyed], &[PROJECTOR, MAILER], at(2)).await;
    assert!(again[0].created, "{}: the aborted event was kept", S::NAME);
    assert_eq!(again[0].sequence, Some(1));
    assert_eq!(again[0].new_deliveries.len(), 2);
}

/// `append` refuses a session without a started transaction with
/// [`ConfigurationError::NoTransaction`] and writes nothing, after validating the requests:
/// a malformed handler id is reported first. `ensure_in_transaction` tells the two sessions
/// apart.
pub async fn append_without_a_transaction_is_refused<S: Store>(store: &S) {
    let e = event("e-1", None);
    let handlers = names(&[PROJECTOR]);
    let mut session = store.session().await.expect("session");

    let refused = store
        .append(&mut session, &[AppendRequest::new(&e, &handlers)], at(0))
        .await;
    assert!(
        matches!(
            refused,
            Err(Error::Configuration(
                ConfigurationError::NoTransaction { .. }
            ))
        ),
        "{}: {refused:?}",
        S::NAME
    );
    let bad = names(&["bad handler"]);
    let invalid = store
        .append(&mut session, &[AppendRequest::new(&e, &bad)], at(0))
        .await;
    assert!(
        matches!(
            invalid,
            Err(Error::Configuration(
                ConfigurationError::InvalidHandlerId { .. }
            ))
        ),
        "{}: requests are validated before the session: {invalid:?}",
        S::NAME
    );
    let checked = store.ensure_in_transaction(&mut session, "test").await;
    assert!(
        matches!(
            checked,
            Err(Error::Configuration(ConfigurationError::NoTransaction {
                operation: "test"
            }))
        ),
        "{}: {checked:?}",
        S::NAME
    );
    assert_eq!(statistics(store).await.pending, 0);
    assert!(all_deliveries(store).await.is_empty());
    assert!(
        !holds_event(store, "e-1", PLACED).await,
        "the event was kept"
    );

    store.begin(&mut session, None).await.expect("begin");
    store
        .ensure_in_transaction(&mut session, "test")
        .await
        .unwrap_or_else(|e| panic!("{}: a started transaction was refused: {e}", S::NAME));
    store.abort(&mut session).await;
}

/// The transaction primitives on one session: `begin`, `append_in_transaction`, `commit` makes
/// the append visible; `begin`, append, `abort` leaves nothing; the session serves one
/// transaction after the other, with or without a budget.
pub async fn begin_commit_and_abort_on_one_session<S: Store>(store: &S) {
    let handlers = names(&[PROJECTOR]);
    let (kept, dropped, last) = (event("e-1", None), event("e-2", None), event("e-3", None));
    let mut session = store.session().await.expect("session");

    store.begin(&mut session, None).await.expect("begin");
    store
        .append_in_transaction(&mut session, &[AppendRequest::new(&kept, &handlers)], at(0))
        .await
        .expect("append");
    assert!(
        all_deliveries(store).await.is_empty(),
        "{}: an uncommitted append is visible outside its transaction",
        S::NAME
    );
    store.commit(&mut session).await.expect("commit");
    assert_eq!(statistics(store).await.pending, 1);

    store.begin(&mut session, None).await.expect("begin again");
    store
        .append_in_transaction(
            &mut session,
            &[AppendRequest::new(&dropped, &handlers)],
            at(0),
        )
        .await
        .expect("append");
    store.abort(&mut session).await;

    store
        .begin(&mut session, Some(Duration::from_secs(10)))
        .await
        .expect("begin with a budget");
    store
        .append_in_transaction(&mut session, &[AppendRequest::new(&last, &handlers)], at(0))
        .await
        .expect("append");
    store.commit(&mut session).await.expect("commit");

    let mut ids: Vec<String> = all_deliveries(store)
        .await
        .into_iter()
        .map(|r| r.event_id)
        .collect();
    ids.sort();
    assert_eq!(ids, ["e-1", "e-3"], "{}", S::NAME);
}

/// [`transaction::run`] commits the body's writes and returns its value; an error of the body
/// aborts every write of the transaction and comes back unchanged.
pub async fn transaction_run_returns_the_value_or_aborts_on_error<S: Store>(store: &S) {
    let handlers = names(&[PROJECTOR]);
    let (one, two) = (event("e-1", None), event("e-2", None));
    let value = transaction::run(store, None, async |session| {
        store
            .append(session, &[AppendRequest::new(&one, &handlers)], at(0))
            .await?;
        Ok(42)
    })
    .await
    .unwrap_or_else(|e| panic!("{}: {e}", S::NAME));
    assert_eq!(value, 42);
    assert_eq!(statistics(store).await.pending, 1);

    let failed: Result<u32, Error> = transaction::run(store, None, async |session| {
        store
            .append(
                session,
                &[AppendRequest::new(&one, &names(&[MAILER]))],
                at(1),
            )
            .await?;
        store
            .append(session, &[AppendRequest::new(&two, &handlers)], at(1))
            .await?;
        Err(Error::custom("the handler failed"))
    })
    .await;
    match failed {
        Err(Error::Custom(error)) => assert_eq!(error.to_string(), "the handler failed"),
        other => panic!("{}: expected the body's error, got {other:?}", S::NAME),
    }
    let records = all_deliveries(store).await;
    assert_eq!(records.len(), 1, "{}: {records:?}", S::NAME);
    assert_eq!(
        (records[0].event_id.as_str(), records[0].handler.as_str()),
        ("e-1", PROJECTOR)
    );
    assert!(!holds_event(store, "e-2", PLACED).await, "e-2 was kept");
}
