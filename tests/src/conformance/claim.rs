//! Claims: due work, per-key order, leases, takeover, renewal and hand-back.

use std::{collections::HashSet, time::Duration};

use relaybus::{EventEnvelope, Store, store::transaction};
use serde_json::json;

use super::{
    LEASE, MAILER, PLACED, PROJECTOR, all_deliveries, at, claim, delivery, event, event_ids,
    leases, publish, statistics,
};

/// A claim hands out due deliveries of the handlers it asks for, at most `limit`, each once
/// while its lease holds, at attempt 1 with a lease ending at `now + lease_duration`; nothing
/// before it is due.
pub async fn claim_hands_out_due_deliveries_of_the_asked_handlers<S: Store>(store: &S) {
    let events: Vec<EventEnvelope> = (0..5).map(|i| event(&format!("e-{i}"), None)).collect();
    publish(store, &events, &[PROJECTOR, MAILER], at(10)).await;

    assert!(
        claim(store, "w", &[PROJECTOR, MAILER], 10, at(9))
            .await
            .is_empty(),
        "{}: handed out before due",
        S::NAME
    );
    let first = claim(store, "w", &[PROJECTOR], 3, at(10)).await;
    assert_eq!(first.len(), 3, "{}: the limit, when enough is due", S::NAME);
    for claimed in &first {
        assert_eq!(claimed.handler, PROJECTOR, "only the handlers asked for");
        assert_eq!(claimed.attempt, 1);
        assert_eq!(claimed.sequence, None);
        assert_eq!(claimed.lease_expires_at, at(10).saturating_add(LEASE));
    }
    let rest = claim(store, "w", &[PROJECTOR], 10, at(11)).await;
    assert_eq!(rest.len(), 2, "{}: the rest", S::NAME);
    let mut all = event_ids(&first);
    all.extend(event_ids(&rest));
    all.sort();
    all.dedup();
    assert_eq!(all.len(), 5, "{}: every projector delivery once", S::NAME);
    assert!(
        claim(store, "w", &[PROJECTOR], 10, at(12)).await.is_empty(),
        "{}: running deliveries were handed out again",
        S::NAME
    );

    let mailer = claim(store, "w", &[MAILER], 10, at(12)).await;
    assert_eq!(mailer.len(), 5, "{}", S::NAME);
    assert!(mailer.iter().all(|c| c.handler == MAILER));
    let stats = statistics(store).await;
    assert_eq!(stats.pending, 10);
    assert_eq!(stats.running, 10, "{}: {stats:?}", S::NAME);
}

/// A claimed delivery carries the event as appended: id, type, payload, key, correlation and
/// causation ids, headers and creation time.
pub async fn a_claim_hands_out_the_event_as_appended<S: Store>(store: &S) {
    let appended = EventEnvelope::from_json(
        PLACED,
        json!({
            "order": "o-1",
            "lines": [{ "sku": "a", "qty": 2 }, { "sku": "b", "qty": 1.5 }],
            "id": { "$oid": "not an object id" },
            "a.b": null,
            "flag": true,
        }),
    )
    .unwrap()
    .with_id("e-1")
    .unwrap()
    .with_key("customer-7")
    .unwrap()
    .with_correlation_id("request-1")
    .unwrap()
    .with_causation_id("command-1")
    .unwrap()
    .with_header("tenant", "acme")
    .unwrap();
    publish(store, std::slice::from_ref(&appended), &[PROJECTOR], at(0)).await;

    let batch = claim(store, "w", &[PROJECTOR], 1, at(1)).await;
    assert_eq!(batch.len(), 1, "{}", S::NAME);
    assert_eq!(batch[0].event, appended, "{}: the event changed", S::NAME);
    assert_eq!(batch[0].sequence, Some(1));
    assert_eq!(batch[0].handler, PROJECTOR);
}

/// Deliveries of one key and handler run one at a time, in sequence order: a claim hands out
/// only the head, the next one comes after the head completed. Other keys and other handlers
/// of the key are not held up.
pub async fn a_key_runs_one_delivery_at_a_time_in_sequence<S: Store>(store: &S) {
    for i in 1..=3 {
        publish(
            store,
            &[event(&format!("k-{i}"), Some("order-1"))],
            &[PROJECTOR, MAILER],
            at(0),
        )
        .await;
    }
    publish(
        store,
        &[event("other-1", Some("order-2"))],
        &[PROJECTOR],
        at(0),
    )
    .await;

    let first = claim(store, "w", &[PROJECTOR, MAILER], 10, at(1)).await;
    let mut picked: Vec<(String, String, Option<i64>)> = first
        .iter()
        .map(|c| (c.event.id().to_owned(), c.handler.clone(), c.sequence))
        .collect();
    picked.sort();
    let expected = [
        ("k-1", MAILER, Some(1)),
        ("k-1", PROJECTOR, Some(1)),
        ("other-1", PROJECTOR, Some(1)),
    ]
    .map(|(e, h, s)| (e.to_owned(), h.to_owned(), s));
    assert_eq!(picked, expected, "{}: only the heads", S::NAME);
    assert!(
        claim(store, "w", &[PROJECTOR, MAILER], 10, at(2))
            .await
            .is_empty(),
        "{}: a follower came out while its head runs",
        S::NAME
    );

    // The projector's head completes: its next one comes out; the mailer's head still runs.
    let projector_head = first
        .iter()
        .find(|c| c.event.id() == "k-1" && c.handler == PROJECTOR)
        .unwrap();
    assert_eq!(
        store
            .complete(std::slice::from_ref(&projector_head.lease), at(3))
            .await
            .unwrap(),
        [true]
    );
    let next = claim(store, "w", &[PROJECTOR, MAILER], 10, at(4)).await;
    assert_eq!(next.len(), 1, "{}: {:?}", S::NAME, event_ids(&next));
    assert_eq!(next[0].event.id(), "k-2");
    assert_eq!(next[0].handler, PROJECTOR);
    assert_eq!(next[0].sequence, Some(2));
    assert_eq!(store.complete(&leases(&next), at(5)).await.unwrap(), [true]);
    let third = claim(store, "w", &[PROJECTOR], 10, at(6)).await;
    assert_eq!(event_ids(&third), ["k-3"], "{}", S::NAME);
}

/// A head that failed and waits for its retry still blocks its key until it is due again and
/// completes; a buried head no longer blocks it.
pub async fn a_failed_head_blocks_its_key_until_it_completes_or_is_buried<S: Store>(store: &S) {
    let keyed: Vec<EventEnvelope> = (1..=3)
        .map(|i| event(&format!("k-{i}"), Some("order-1")))
        .collect();
    publish(store, &keyed, &[PROJECTOR], at(0)).await;

    let head = claim(store, "w", &[PROJECTOR], 10, at(1)).await;
    assert_eq!(event_ids(&head), ["k-1"], "{}", S::NAME);
    assert!(
        store
            .reschedule(&head[0].lease, at(100), "slow", at(2))
            .await
            .unwrap()
    );
    assert!(
        claim(store, "w", &[PROJECTOR], 10, at(3)).await.is_empty(),
        "{}: a follower overtook its rescheduled head",
        S::NAME
    );
    let retried = claim(store, "w", &[PROJECTOR], 10, at(100)).await;
    assert_eq!(event_ids(&retried), ["k-1"], "{}", S::NAME);
    assert_eq!(retried[0].attempt, 2);
    assert!(
        store
            .bury(&retried[0].lease, "dead", at(101))
            .await
            .unwrap()
    );

    let next = claim(store, "w", &[PROJECTOR], 10, at(102)).await;
    assert_eq!(
        event_ids(&next),
        ["k-2"],
        "{}: a buried head blocks",
        S::NAME
    );
    assert_eq!(next[0].sequence, Some(2));
}

/// A key whose head runs, with a long backlog due before everything else, hides no other
/// work: claims of one delivery at a time still find the other keys and the unkeyed events.
pub async fn a_blocked_key_does_not_hide_other_work<S: Store>(store: &S) {
    let backlog: Vec<EventEnvelope> = (1..=300)
        .map(|i| event(&format!("a-{i}"), Some("A")))
        .collect();
    publish(store, &backlog, &[PROJECTOR], at(0)).await;
    let head = claim(store, "w", &[PROJECTOR], 10, at(1)).await;
    assert_eq!(event_ids(&head), ["a-1"], "{}", S::NAME);

    publish(store, &[event("b-1", Some("B"))], &[PROJECTOR], at(2)).await;
    publish(store, &[event("free-1", None)], &[PROJECTOR], at(3)).await;
    let mut found = Vec::new();
    for second in 4..6 {
        let batch = claim(store, "w", &[PROJECTOR], 1, at(second)).await;
        assert_eq!(
            batch.len(),
            1,
            "{}: the backlog of A hid other work (found so far: {found:?})",
            S::NAME
        );
        found.extend(event_ids(&batch));
    }
    found.sort();
    assert_eq!(found, ["b-1", "free-1"], "{}", S::NAME);
    assert!(claim(store, "w", &[PROJECTOR], 10, at(6)).await.is_empty());

    assert_eq!(store.complete(&leases(&head), at(7)).await.unwrap(), [true]);
    let next = claim(store, "w", &[PROJECTOR], 10, at(8)).await;
    assert_eq!(event_ids(&next), ["a-2"], "{}", S::NAME);
    assert_eq!(statistics(store).await.pending, 299 + 2);
}

/// Fencing: once a lease expired and another owner claimed the delivery, the first owner's
/// lease settles nothing (complete, reschedule, bury, release return `false`, renew covers
/// nothing) and changes nothing; the new owner's lease completes it. Before the expiry, the
/// other owner gets nothing.
pub async fn an_expired_lease_taken_over_fences_the_first_owner<S: Store>(store: &S) {
    publish(store, &[event("e-1", None)], &[PROJECTOR], at(0)).await;
    let old = claim(store, "a", &[PROJECTOR], 10, at(1)).await;
    assert_eq!(old.len(), 1);
    assert!(
        claim(store, "b", &[PROJECTOR], 10, at(20)).await.is_empty(),
        "{}: taken over before the lease expired",
        S::NAME
    );

    let new = claim(store, "b", &[PROJECTOR], 10, at(40)).await;
    assert_eq!(event_ids(&new), ["e-1"], "{}: not taken over", S::NAME);
    let before = all_deliveries(store).await;
    let stale = &old[0].lease;
    assert_eq!(
        store
            .complete(std::slice::from_ref(stale), at(41))
            .await
            .unwrap(),
        [false]
    );
    assert!(
        !store
            .reschedule(stale, at(90), "late", at(41))
            .await
            .unwrap()
    );
    assert!(!store.bury(stale, "late", at(41)).await.unwrap());
    assert!(!store.release(stale, at(41)).await.unwrap());
    assert_eq!(
        store
            .renew(std::slice::from_ref(stale), LEASE, at(41))
            .await
            .unwrap(),
        0
    );
    assert_eq!(
        all_deliveries(store).await,
        before,
        "{}: a stale lease changed the delivery",
        S::NAME
    );

    assert_eq!(store.complete(&leases(&new), at(42)).await.unwrap(), [true]);
    assert_eq!(statistics(store).await.pending, 0);
}

/// A takeover charges the lost attempt: the delivery a second owner claims after the first
/// one's lease expired comes at attempt 2, and its record counts the ended attempt.
pub async fn a_takeover_charges_the_lost_attempt<S: Store>(store: &S) {
    publish(store, &[event("e-1", None)], &[PROJECTOR], at(0)).await;
    let first = claim(store, "a", &[PROJECTOR], 10, at(1)).await;
    assert_eq!(first[0].attempt, 1);

    let second = claim(store, "b", &[PROJECTOR], 10, at(40)).await;
    assert_eq!(second.len(), 1, "{}", S::NAME);
    assert_eq!(
        second[0].attempt,
        2,
        "{}: the lost attempt is charged",
        S::NAME
    );
    let record = delivery(store, "e-1", PROJECTOR).await.unwrap();
    assert_eq!(record.attempts, 1, "{}: {record:?}", S::NAME);

    // Lost again: charged again.
    let third = claim(store, "c", &[PROJECTOR], 10, at(80)).await;
    assert_eq!(third.len(), 1, "{}", S::NAME);
    assert_eq!(third[0].attempt, 3);
    assert!(
        store
            .reschedule(&third[0].lease, at(90), "x", at(81))
            .await
            .unwrap()
    );
    assert_eq!(delivery(store, "e-1", PROJECTOR).await.unwrap().attempts, 3);
}

/// `renew` extends a running lease to `now + lease_duration`: another owner cannot take the
/// delivery over before the new expiry, and the renewed lease still completes it. A lease
/// whose claim ended is not renewed.
pub async fn renew_holds_off_a_takeover<S: Store>(store: &S) {
    publish(store, &[event("e-1", None)], &[PROJECTOR], at(0)).await;
    let batch = claim(store, "a", &[PROJECTOR], 10, at(1)).await;
    assert_eq!(batch[0].lease_expires_at, at(31));

    let covered = store
        .renew(&leases(&batch), Duration::from_secs(120), at(20))
        .await
        .unwrap();
    assert_eq!(covered, 1, "{}", S::NAME);
    assert!(
        claim(store, "b", &[PROJECTOR], 10, at(60)).await.is_empty(),
        "{}: taken over before the renewed lease expired",
        S::NAME
    );
    assert_eq!(
        store.complete(&leases(&batch), at(61)).await.unwrap(),
        [true]
    );
    assert_eq!(
        store.renew(&leases(&batch), LEASE, at(62)).await.unwrap(),
        0,
        "{}: a completed claim was renewed",
        S::NAME
    );
    assert_eq!(statistics(store).await.pending, 0);
}

/// `relinquish` hands back everything an owner holds, for a graceful shutdown: another owner
/// claims it at once, long before the lease would have expired; what was released first
/// comes at the same attempt. A delivery that was still running is handed out too, and the
/// old lease no longer settles it.
pub async fn relinquish_hands_back_at_once<S: Store>(store: &S) {
    let events: Vec<EventEnvelope> = (0..3).map(|i| event(&format!("e-{i}"), None)).collect();
    publish(store, &events, &[PROJECTOR], at(0)).await;
    let batch = claim(store, "a", &[PROJECTOR], 10, at(1)).await;
    assert_eq!(batch.len(), 3);
    let (running, released) = batch.split_first().unwrap();
    for claimed in released {
        assert!(store.release(&claimed.lease, at(2)).await.unwrap());
    }
    store
        .relinquish("a")
        .await
        .unwrap_or_else(|e| panic!("{}: relinquish failed: {e}", S::NAME));

    let taken = claim(store, "b", &[PROJECTOR], 10, at(3)).await;
    assert_eq!(
        event_ids(&taken),
        event_ids(&batch),
        "{}: not handed back at once",
        S::NAME
    );
    let released: HashSet<&str> = released.iter().map(|c| c.event.id()).collect();
    for claimed in &taken {
        if released.contains(claimed.event.id()) {
            assert_eq!(claimed.attempt, 1, "{}: a release was charged", S::NAME);
        }
    }
    assert_eq!(
        store
            .complete(std::slice::from_ref(&running.lease), at(4))
            .await
            .unwrap(),
        [false],
        "{}: the relinquished lease still settles",
        S::NAME
    );
    assert_eq!(
        store.complete(&leases(&taken), at(5)).await.unwrap(),
        [true; 3]
    );
}

/// After a key's delivery completed in a transaction, the worker's next claim hands out the
/// key's next one: the key runs in sequence, one delivery at a time, each once.
pub async fn the_next_of_a_key_comes_in_sequence_with_or_without_a_claim<S: Store>(store: &S) {
    for i in 1..=3 {
        publish(
            store,
            &[event(&format!("k-{i}"), Some("order-1"))],
            &[PROJECTOR],
            at(0),
        )
        .await;
    }
    let mut current = claim(store, "w", &[PROJECTOR], 10, at(1)).await;
    assert_eq!(event_ids(&current), ["k-1"], "{}", S::NAME);
    for (sequence, expected) in [(2, "k-2"), (3, "k-3")] {
        let head = current.pop().expect("one delivery runs");
        let done = transaction::run(store, None, async |session| {
            store
                .complete_in_transaction(session, &head.lease, at(2))
                .await
        })
        .await
        .unwrap_or_else(|e| panic!("{}: completion failed: {e}", S::NAME));
        assert!(done, "{}", S::NAME);
        current = claim(store, "w", &[PROJECTOR], 10, at(3)).await;
        assert_eq!(event_ids(&current), [expected], "{}", S::NAME);
        assert_eq!(current[0].sequence, Some(sequence), "{}", S::NAME);
        assert_eq!(current[0].attempt, 1, "{}", S::NAME);
    }
    assert_eq!(
        store.complete(&leases(&current), at(4)).await.unwrap(),
        [true],
        "{}: the lease of the last one settles it",
        S::NAME
    );
    assert!(all_deliveries(store).await.is_empty(), "{}", S::NAME);
}
