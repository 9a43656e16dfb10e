//! Settling claims: complete, release, reschedule, bury, and completion in the caller's
//! transaction.

use relaybus::{
    AppendRequest, ConfigurationError, DeliveryQuery, DeliveryStatus, Error, EventEnvelope, Store,
    store::transaction,
};

use super::{
    MAILER, PLACED, PROJECTOR, all_deliveries, at, claim, delivery, delivery_id, event, event_ids,
    holds_event, leases, list, names, publish, statistics,
};

/// `complete` settles a batch and answers for each lease, in order: `true` where the delivery
/// was completed under it, `false` where the lease no longer held (completed already). A
/// completed delivery is gone from the pending ones; an empty batch is answered with nothing.
pub async fn complete_reports_each_lease<S: Store>(store: &S) {
    let events: Vec<EventEnvelope> = (0..3).map(|i| event(&format!("e-{i}"), None)).collect();
    publish(store, &events, &[PROJECTOR], at(0)).await;
    let batch = claim(store, "w", &[PROJECTOR], 10, at(1)).await;
    assert_eq!(batch.len(), 3);
    let all = leases(&batch);

    assert_eq!(
        store.complete(&all[..2], at(2)).await.unwrap(),
        [true, true],
        "{}",
        S::NAME
    );
    assert_eq!(
        store
            .complete(&[all[0].clone(), all[2].clone()], at(3))
            .await
            .unwrap(),
        [false, true],
        "{}: a lease completes once",
        S::NAME
    );
    assert_eq!(
        store.complete(&[], at(4)).await.unwrap(),
        Vec::<bool>::new()
    );
    let stats = statistics(store).await;
    assert_eq!(
        (stats.pending, stats.running),
        (0, 0),
        "{}: {stats:?}",
        S::NAME
    );
    assert!(all_deliveries(store).await.is_empty());
    assert!(claim(store, "w", &[PROJECTOR], 10, at(5)).await.is_empty());
}

/// `release` gives a delivery back without charging it: it is due at once, for the next
/// claim, at the same attempt; the released lease settles nothing any more.
pub async fn release_gives_back_without_charging<S: Store>(store: &S) {
    publish(store, &[event("e-1", None)], &[PROJECTOR], at(0)).await;
    let first = claim(store, "w", &[PROJECTOR], 1, at(1)).await;
    assert_eq!(first[0].attempt, 1);
    assert!(store.release(&first[0].lease, at(2)).await.unwrap());
    let record = delivery(store, "e-1", PROJECTOR).await.unwrap();
    assert_eq!(record.attempts, 0, "{}: {record:?}", S::NAME);
    assert_eq!(record.status, DeliveryStatus::Pending);

    let second = claim(store, "w", &[PROJECTOR], 1, at(2)).await;
    assert_eq!(event_ids(&second), ["e-1"], "{}: not due at once", S::NAME);
    assert_eq!(second[0].attempt, 1, "{}: a release was charged", S::NAME);
    assert!(
        !store.release(&first[0].lease, at(3)).await.unwrap(),
        "{}: a released lease released again",
        S::NAME
    );
    assert_eq!(
        store.complete(&leases(&first), at(3)).await.unwrap(),
        [false],
        "{}: a released lease completed the next claim",
        S::NAME
    );
    assert_eq!(
        store.complete(&leases(&second), at(3)).await.unwrap(),
        [true]
    );
}

/// `reschedule` ends a failed attempt: charged, with its error, due again at `due_at` and not
/// before; the next claim is the next attempt.
pub async fn reschedule_charges_and_delays<S: Store>(store: &S) {
    publish(store, &[event("e-1", None)], &[PROJECTOR], at(0)).await;
    let first = claim(store, "w", &[PROJECTOR], 1, at(1)).await;
    assert!(
        store
            .reschedule(&first[0].lease, at(60), "timeout", at(2))
            .await
            .unwrap()
    );
    let record = delivery(store, "e-1", PROJECTOR).await.unwrap();
    assert_eq!(
        record.status,
        DeliveryStatus::Pending,
        "{}: {record:?}",
        S::NAME
    );
    assert_eq!(record.attempts, 1);
    assert_eq!(record.due_at, Some(at(60)));
    assert_eq!(record.last_error.as_deref(), Some("timeout"));
    let stats = statistics(store).await;
    assert_eq!(
        (stats.pending, stats.running),
        (1, 0),
        "{}: {stats:?}",
        S::NAME
    );
    assert_eq!(stats.oldest_due_at, Some(at(60)));
    assert!(
        !store
            .reschedule(&first[0].lease, at(5), "again", at(3))
            .await
            .unwrap(),
        "{}: a rescheduled lease rescheduled again",
        S::NAME
    );

    assert!(
        claim(store, "w", &[PROJECTOR], 1, at(59)).await.is_empty(),
        "{}: handed out before due_at",
        S::NAME
    );
    let second = claim(store, "w", &[PROJECTOR], 1, at(60)).await;
    assert_eq!(event_ids(&second), ["e-1"], "{}", S::NAME);
    assert_eq!(second[0].attempt, 2);
}

/// `bury` ends the last attempt: the delivery becomes a dead letter with its error, counted
/// and listed as dead and never claimed. `requeue` makes it pending again, due at once with its
/// attempts counted from 0, and reports ids that name no dead delivery as not found.
pub async fn bury_makes_a_dead_letter_and_requeue_revives_it<S: Store>(store: &S) {
    publish(store, &[event("e-1", None)], &[PROJECTOR, MAILER], at(0)).await;
    let batch = claim(store, "w", &[PROJECTOR], 1, at(1)).await;
    assert!(store.bury(&batch[0].lease, "broken", at(2)).await.unwrap());
    assert!(
        !store.bury(&batch[0].lease, "again", at(2)).await.unwrap(),
        "{}: buried twice",
        S::NAME
    );

    let stats = statistics(store).await;
    assert_eq!(
        (stats.dead, stats.pending),
        (1, 1),
        "{}: {stats:?}",
        S::NAME
    );
    let dead = list(store, DeliveryQuery::new().status(DeliveryStatus::Dead)).await;
    assert_eq!(dead.len(), 1, "{}: {dead:?}", S::NAME);
    assert_eq!(dead[0].event_id, "e-1");
    assert_eq!(dead[0].handler, PROJECTOR);
    assert_eq!(dead[0].status, DeliveryStatus::Dead);
    assert_eq!(dead[0].attempts, 1);
    assert_eq!(dead[0].last_error.as_deref(), Some("broken"));
    assert_eq!(
        dead[0].id,
        delivery_id(&batch[0]),
        "{}: the listed id is not the lease's delivery id",
        S::NAME
    );
    assert!(
        claim(store, "w", &[PROJECTOR], 10, at(100))
            .await
            .is_empty()
    );

    let pending = delivery(store, "e-1", MAILER).await.unwrap();
    let requeued = store
        .requeue(&[dead[0].id.clone(), pending.id.clone()], at(200))
        .await
        .unwrap_or_else(|e| panic!("{}: requeue failed: {e}", S::NAME));
    assert_eq!(
        requeued.requeued,
        [dead[0].id.clone()],
        "{}: {requeued:?}",
        S::NAME
    );
    assert!(requeued.blocked.is_empty());
    assert_eq!(
        requeued.not_found,
        [pending.id],
        "a pending delivery is not dead"
    );

    let record = delivery(store, "e-1", PROJECTOR).await.unwrap();
    assert_eq!(
        record.status,
        DeliveryStatus::Pending,
        "{}: {record:?}",
        S::NAME
    );
    assert_eq!(record.attempts, 0);
    assert_eq!(statistics(store).await.dead, 0);
    let again = claim(store, "w", &[PROJECTOR], 10, at(200)).await;
    assert_eq!(event_ids(&again), ["e-1"], "{}: not due at once", S::NAME);
    assert_eq!(again[0].attempt, 1);
    assert_eq!(
        store
            .requeue(&[dead[0].id.clone()], at(201))
            .await
            .unwrap()
            .not_found,
        [dead[0].id.clone()],
        "{}: a requeued delivery is no longer dead",
        S::NAME
    );
}

/// A dead keyed delivery cannot be requeued while a later delivery of its key runs (it is
/// reported blocked and stays dead); once that one finished it is requeued, and runs before the
/// later deliveries of its key that have not run yet.
pub async fn requeue_waits_for_a_running_later_delivery_of_its_key<S: Store>(store: &S) {
    let keyed: Vec<EventEnvelope> = (1..=3)
        .map(|i| event(&format!("k-{i}"), Some("account-9")))
        .collect();
    publish(store, &keyed, &[PROJECTOR], at(0)).await;
    let first = claim(store, "w", &[PROJECTOR], 10, at(1)).await;
    assert_eq!(event_ids(&first), ["k-1"]);
    assert!(
        store
            .bury(&first[0].lease, "bad data", at(2))
            .await
            .unwrap()
    );
    let second = claim(store, "w", &[PROJECTOR], 10, at(3)).await;
    assert_eq!(event_ids(&second), ["k-2"], "{}", S::NAME);

    let dead_id = [delivery_id(&first[0])];
    let refused = store.requeue(&dead_id, at(4)).await.unwrap();
    assert_eq!(refused.blocked, dead_id, "{}: {refused:?}", S::NAME);
    assert!(refused.requeued.is_empty());
    assert_eq!(
        delivery(store, "k-1", PROJECTOR).await.unwrap().status,
        DeliveryStatus::Dead
    );

    assert_eq!(
        store.complete(&leases(&second), at(5)).await.unwrap(),
        [true]
    );
    let done = store.requeue(&dead_id, at(6)).await.unwrap();
    assert_eq!(done.requeued, dead_id, "{}: {done:?}", S::NAME);
    let next = claim(store, "w", &[PROJECTOR], 10, at(7)).await;
    assert_eq!(
        event_ids(&next),
        ["k-1"],
        "{}: the requeued one goes first",
        S::NAME
    );
    assert_eq!(next[0].sequence, Some(1));
    assert_eq!(store.complete(&leases(&next), at(8)).await.unwrap(), [true]);
    let last = claim(store, "w", &[PROJECTOR], 10, at(9)).await;
    assert_eq!(event_ids(&last), ["k-3"], "{}", S::NAME);
}

/// `complete_in_transaction` commits with the caller's other writes or not at all: after an
/// abort the delivery is still pending and its lease still holds (it can be released and
/// claimed again, at the same attempt); after a commit both are there. A session without a
/// started transaction is refused with [`ConfigurationError::NoTransaction`].
pub async fn complete_in_transaction_commits_with_the_callers_writes<S: Store>(store: &S) {
    publish(store, &[event("e-1", None)], &[PROJECTOR], at(0)).await;
    let batch = claim(store, "w", &[PROJECTOR], 1, at(1)).await;
    let lease = batch[0].lease.clone();
    let follow_up = event("follow-1", None);
    let handlers = names(&[MAILER]);

    let aborted: Result<(), Error> = transaction::run(store, None, async |session| {
        store
            .append(session, &[AppendRequest::new(&follow_up, &handlers)], at(2))
            .await?;
        assert!(
            store
                .complete_in_transaction(session, &lease, at(2))
                .await?
        );
        Err(Error::custom("the handler failed after writing"))
    })
    .await;
    assert!(matches!(aborted, Err(Error::Custom(_))), "{aborted:?}");
    let records = all_deliveries(store).await;
    assert_eq!(records.len(), 1, "{}: {records:?}", S::NAME);
    assert_eq!(records[0].event_id, "e-1");
    assert!(!holds_event(store, "follow-1", PLACED).await);

    let mut session = store.session().await.unwrap();
    let refused = store
        .complete_in_transaction(&mut session, &lease, at(3))
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
    assert!(delivery(store, "e-1", PROJECTOR).await.is_some());

    assert!(
        store.release(&lease, at(4)).await.unwrap(),
        "{}: the aborted completion ended the claim",
        S::NAME
    );
    let again = claim(store, "w", &[PROJECTOR], 1, at(5)).await;
    assert_eq!(event_ids(&again), ["e-1"], "{}", S::NAME);
    assert_eq!(again[0].attempt, 1);

    let follow_up = event("follow-2", None);
    let lease = again[0].lease.clone();
    let completed = transaction::run(store, None, async |session| {
        store
            .append(session, &[AppendRequest::new(&follow_up, &handlers)], at(6))
            .await?;
        store.complete_in_transaction(session, &lease, at(6)).await
    })
    .await
    .unwrap_or_else(|e| panic!("{}: {e}", S::NAME));
    assert!(completed, "{}", S::NAME);
    let records = all_deliveries(store).await;
    assert_eq!(records.len(), 1, "{}: {records:?}", S::NAME);
    assert_eq!(
        (records[0].event_id.as_str(), records[0].handler.as_str()),
        ("follow-2", MAILER)
    );
    assert_eq!(store.complete(&[lease], at(7)).await.unwrap(), [false]);
}

/// A delivery remembers its failed attempts, oldest first, with their attempt numbers, across
/// a requeue: a dead letter that is requeued and fails again shows its whole history.
pub async fn failed_attempts_are_kept_across_a_requeue<S: Store>(store: &S) {
    publish(store, &[event("h-1", None)], &[PROJECTOR], at(0)).await;
    let first = claim(store, "w", &[PROJECTOR], 1, at(1)).await;
    assert!(
        store
            .reschedule(
                &first[0].lease,
                at(5),
                "timeout talking to the warehouse",
                at(2)
            )
            .await
            .unwrap()
    );
    let second = claim(store, "w", &[PROJECTOR], 1, at(10)).await;
    assert_eq!(second.len(), 1, "{}", S::NAME);
    assert!(
        store
            .bury(&second[0].lease, "warehouse refused", at(11))
            .await
            .unwrap()
    );

    let dead = delivery(store, "h-1", PROJECTOR).await.unwrap();
    let history: Vec<(Option<u32>, &str)> = dead
        .errors
        .iter()
        .map(|e| (e.attempt, e.error.as_str()))
        .collect();
    assert_eq!(
        history,
        [
            (Some(1), "timeout talking to the warehouse"),
            (Some(2), "warehouse refused")
        ],
        "{}: {dead:?}",
        S::NAME
    );
    assert_eq!(dead.errors[0].at, at(2));
    assert_eq!(dead.requeues, 0);

    let requeued = store
        .requeue(std::slice::from_ref(&dead.id), at(20))
        .await
        .unwrap();
    assert_eq!(
        requeued.requeued,
        std::slice::from_ref(&dead.id),
        "{}",
        S::NAME
    );
    let revived = delivery(store, "h-1", PROJECTOR).await.unwrap();
    assert_eq!(revived.attempts, 0, "{}: attempts start again", S::NAME);
    assert_eq!(revived.requeues, 1, "{}: {revived:?}", S::NAME);
    assert_eq!(
        revived.errors,
        dead.errors,
        "{}: the history stays",
        S::NAME
    );
    assert_eq!(revived.last_error.as_deref(), Some("warehouse refused"));

    let third = claim(store, "w", &[PROJECTOR], 1, at(21)).await;
    assert!(
        store
            .reschedule(&third[0].lease, at(30), "still refused", at(22))
            .await
            .unwrap()
    );
    let again = delivery(store, "h-1", PROJECTOR).await.unwrap();
    assert_eq!(again.errors.len(), 3, "{}: {again:?}", S::NAME);
    assert_eq!(
        again.errors[2].attempt,
        Some(1),
        "{}: counted since the requeue",
        S::NAME
    );
}

/// `bury_by_id` frees a key stuck behind a pending delivery: it buries deliveries no worker
/// runs, leaves running ones to their worker, and fences the leases of earlier claims.
pub async fn bury_by_id_frees_a_stuck_key<S: Store>(store: &S) {
    let events = [event("k-1", Some("k")), event("k-2", Some("k"))];
    publish(store, &events, &[PROJECTOR], at(0)).await;
    let first = claim(store, "w", &[PROJECTOR], 10, at(1)).await;
    assert_eq!(
        first.len(),
        1,
        "{}: one delivery of the key at a time",
        S::NAME
    );
    let head = delivery_id(&first[0]);

    let running = store
        .bury_by_id(std::slice::from_ref(&head), "poison pill", at(2))
        .await
        .unwrap();
    assert_eq!(
        running.running,
        std::slice::from_ref(&head),
        "{}: {running:?}",
        S::NAME
    );
    assert!(running.buried.is_empty());

    assert!(store.release(&first[0].lease, at(3)).await.unwrap());
    let outcome = store
        .bury_by_id(&[head.clone(), "junk".to_owned()], "poison pill", at(4))
        .await
        .unwrap();
    assert_eq!(
        outcome.buried,
        std::slice::from_ref(&head),
        "{}: {outcome:?}",
        S::NAME
    );
    assert_eq!(outcome.not_found, ["junk"]);
    let dead = delivery(store, "k-1", PROJECTOR).await.unwrap();
    assert_eq!(dead.status, DeliveryStatus::Dead);
    assert!(
        dead.last_error
            .as_deref()
            .is_some_and(|e| e.contains("buried by an operator: poison pill")),
        "{}: {dead:?}",
        S::NAME
    );
    assert_eq!(
        dead.attempts,
        0,
        "{}: an operator's burial is no attempt",
        S::NAME
    );
    assert_eq!(
        store.complete(&leases(&first), at(5)).await.unwrap(),
        [false],
        "{}: the earlier claim's lease no longer settles it",
        S::NAME
    );
    // The key moves on.
    let next = claim(store, "w", &[PROJECTOR], 10, at(6)).await;
    assert_eq!(event_ids(&next), ["k-2"], "{}", S::NAME);
    // A dead one is not found again, and an empty reason is refused.
    let again = store
        .bury_by_id(std::slice::from_ref(&head), "again", at(7))
        .await
        .unwrap();
    assert_eq!(again.not_found, std::slice::from_ref(&head), "{}", S::NAME);
    assert!(
        store.bury_by_id(&[head], " ", at(8)).await.is_err(),
        "{}: an empty reason",
        S::NAME
    );
}
