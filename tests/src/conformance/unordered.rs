//! Unordered handlers: deliveries of keyed events that a request names unordered ignore the key,
//! while the other handlers of the same events keep the key's order.

use relaybus::{EventEnvelope, Store, store::Claimed};

use super::{
    MAILER, PROJECTOR, all_deliveries, at, claim, delivery, delivery_id, event, event_ids, leases,
    publish, publish_unordered,
};

/// The event id, handler, sequence and attempt of each claimed delivery, sorted.
fn picked<L>(batch: &[Claimed<L>]) -> Vec<(String, String, Option<i64>, u32)> {
    let mut picked: Vec<_> = batch
        .iter()
        .map(|c| {
            (
                c.event.id().to_owned(),
                c.handler.clone(),
                c.sequence,
                c.attempt,
            )
        })
        .collect();
    picked.sort();
    picked
}

/// `(event id, handler, sequence, attempt)` rows as [`picked`] returns them.
fn rows(expected: &[(&str, &str, i64, u32)]) -> Vec<(String, String, Option<i64>, u32)> {
    expected
        .iter()
        .map(|(e, h, s, a)| ((*e).to_owned(), (*h).to_owned(), Some(*s), *a))
        .collect()
}

/// The deliveries of a key for an unordered handler are claimable all at once, in one claim,
/// while the ordered handler of the same events gets only the key's head, and its next delivery
/// only after the head completed. An unordered delivery keeps the event's key and sequence
/// (for the handler and for operators), and its record says it is unordered.
pub async fn an_unordered_handler_gets_every_delivery_of_a_key_at_once<S: Store>(store: &S) {
    let keyed: Vec<EventEnvelope> = (1..=3)
        .map(|i| event(&format!("k-{i}"), Some("order-1")))
        .collect();
    publish_unordered(store, &keyed, &[PROJECTOR, MAILER], &[MAILER], at(0)).await;

    let first = claim(store, "w", &[PROJECTOR, MAILER], 100, at(1)).await;
    assert_eq!(
        picked(&first),
        rows(&[
            ("k-1", MAILER, 1, 1),
            ("k-1", PROJECTOR, 1, 1),
            ("k-2", MAILER, 2, 1),
            ("k-3", MAILER, 3, 1),
        ]),
        "{}: every unordered delivery, and only the head of the ordered handler",
        S::NAME
    );
    assert!(
        first.iter().all(|c| c.event.key() == Some("order-1")),
        "{}: the event keeps its key",
        S::NAME
    );
    assert!(
        claim(store, "w", &[PROJECTOR, MAILER], 100, at(2))
            .await
            .is_empty(),
        "{}: the ordered handler's follower came out while its head runs",
        S::NAME
    );
    let records = all_deliveries(store).await;
    assert_eq!(records.len(), 6, "{}", S::NAME);
    for record in &records {
        assert_eq!(record.key.as_deref(), Some("order-1"), "{}", S::NAME);
        assert!(record.sequence.is_some(), "{}: {record:?}", S::NAME);
        assert_eq!(
            record.unordered,
            record.handler == MAILER,
            "{}: {record:?}",
            S::NAME
        );
    }

    // The unordered deliveries complete in any order; the ordered handler's next one comes
    // after its head, whatever the unordered ones do.
    let mailer_last = first
        .iter()
        .find(|c| c.handler == MAILER && c.event.id() == "k-3")
        .unwrap();
    assert_eq!(
        store
            .complete(std::slice::from_ref(&mailer_last.lease), at(3))
            .await
            .unwrap(),
        [true]
    );
    let projector_head = first.iter().find(|c| c.handler == PROJECTOR).unwrap();
    assert_eq!(
        store
            .complete(std::slice::from_ref(&projector_head.lease), at(4))
            .await
            .unwrap(),
        [true]
    );
    let next = claim(store, "w", &[PROJECTOR, MAILER], 100, at(5)).await;
    assert_eq!(
        picked(&next),
        rows(&[("k-2", PROJECTOR, 2, 1)]),
        "{}",
        S::NAME
    );
}

/// A failed unordered delivery, waiting for its retry, holds back nothing of its key: the next
/// deliveries of the key for the same handler are claimed at once, and requeueing it once
/// buried is not refused while they run. The ordered handler of the same events waits behind
/// its own failed head as usual.
pub async fn a_failed_unordered_delivery_holds_back_nothing_of_its_key<S: Store>(store: &S) {
    let handlers = [PROJECTOR, MAILER];
    publish_unordered(
        store,
        &[event("k-1", Some("order-1"))],
        &handlers,
        &[MAILER],
        at(0),
    )
    .await;
    let first = claim(store, "w", &handlers, 10, at(1)).await;
    assert_eq!(
        picked(&first),
        rows(&[("k-1", MAILER, 1, 1), ("k-1", PROJECTOR, 1, 1)]),
        "{}",
        S::NAME
    );
    for claimed in &first {
        assert!(
            store
                .reschedule(&claimed.lease, at(100), "failed", at(2))
                .await
                .unwrap()
        );
    }

    let followers: Vec<EventEnvelope> = (2..=3)
        .map(|i| event(&format!("k-{i}"), Some("order-1")))
        .collect();
    publish_unordered(store, &followers, &handlers, &[MAILER], at(3)).await;
    let next = claim(store, "w", &handlers, 10, at(4)).await;
    assert_eq!(
        picked(&next),
        rows(&[("k-2", MAILER, 2, 1), ("k-3", MAILER, 3, 1)]),
        "{}: the unordered followers waited for their failed predecessor, or the ordered ones \
         overtook theirs",
        S::NAME
    );

    let retried = claim(store, "w", &handlers, 10, at(100)).await;
    assert_eq!(
        picked(&retried),
        rows(&[("k-1", MAILER, 1, 2), ("k-1", PROJECTOR, 1, 2)]),
        "{}: the retries, once due",
        S::NAME
    );
    let mailer_retry = retried.iter().find(|c| c.handler == MAILER).unwrap();
    assert!(
        store
            .bury(&mailer_retry.lease, "dead", at(101))
            .await
            .unwrap()
    );
    // Later deliveries of its key run (k-2 and k-3 of the mailer): an ordered dead letter
    // would wait for them, an unordered one does not.
    let dead_id = [delivery_id(mailer_retry)];
    let requeued = store.requeue(&dead_id, at(102)).await.unwrap();
    assert_eq!(requeued.requeued, dead_id, "{}: {requeued:?}", S::NAME);
    assert!(requeued.blocked.is_empty(), "{}: {requeued:?}", S::NAME);
    let again = claim(store, "w", &[MAILER], 10, at(103)).await;
    assert_eq!(event_ids(&again), ["k-1"], "{}", S::NAME);
    assert_eq!(
        store.complete(&leases(&next), at(104)).await.unwrap(),
        [true, true]
    );
}

/// A handler added to events the store holds already (a publish of the same ids by a process
/// that subscribes one more handler) gets unordered deliveries when the request names it
/// unordered: they keep the events' sequences and are all claimable at once, while the
/// handler the events had keeps its order.
pub async fn a_handler_added_as_unordered_ignores_the_key_of_a_known_event<S: Store>(store: &S) {
    let keyed: Vec<EventEnvelope> = (1..=3)
        .map(|i| event(&format!("k-{i}"), Some("order-1")))
        .collect();
    publish(store, &keyed, &[PROJECTOR], at(0)).await;
    let extended = publish_unordered(store, &keyed, &[PROJECTOR, MAILER], &[MAILER], at(1)).await;
    for (i, appended) in extended.iter().enumerate() {
        assert!(!appended.created, "{}: {appended:?}", S::NAME);
        assert_eq!(appended.new_deliveries, [MAILER], "{}", S::NAME);
        assert_eq!(appended.sequence, Some(i as i64 + 1), "{}", S::NAME);
    }
    assert!(delivery(store, "k-2", MAILER).await.unwrap().unordered);
    assert!(!delivery(store, "k-2", PROJECTOR).await.unwrap().unordered);

    let mailer = claim(store, "w", &[MAILER], 10, at(2)).await;
    assert_eq!(
        picked(&mailer),
        rows(&[
            ("k-1", MAILER, 1, 1),
            ("k-2", MAILER, 2, 1),
            ("k-3", MAILER, 3, 1),
        ]),
        "{}",
        S::NAME
    );
    let projector = claim(store, "w", &[PROJECTOR], 10, at(3)).await;
    assert_eq!(event_ids(&projector), ["k-1"], "{}", S::NAME);
}
