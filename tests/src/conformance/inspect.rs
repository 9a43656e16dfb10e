//! What the operator page reads: listings by what a pending delivery is doing, by key, event
//! and error; one event with its deliveries; the lanes and their blocked keys; dead letters
//! grouped by error.

use relaybus::{DeliveryQuery, DeliveryStatus, EventEnvelope, PendingState, Store};

use super::{MAILER, PROJECTOR, at, claim, event, list, publish, statistics};

/// The ids of listed records, sorted.
fn ids(records: &[relaybus::DeliveryRecord]) -> Vec<String> {
    let mut ids: Vec<String> = records.iter().map(|r| r.id.clone()).collect();
    ids.sort();
    ids
}

/// `list_deliveries` narrows pending deliveries to the waiting, running or parked ones (the
/// three together are every pending one), marks running ones, and filters by key, event id,
/// error text (as text, whatever its case) and exact last error.
pub async fn list_deliveries_filters_by_state_key_event_and_error<S: Store>(store: &S) {
    let keyed: Vec<EventEnvelope> = (1..=3)
        .map(|i| event(&format!("k-{i}"), Some("order-1")))
        .collect();
    publish(store, &keyed, &[PROJECTOR], at(0)).await;
    publish(
        store,
        &[event("u-1", None), event("u-2", None)],
        &[PROJECTOR],
        at(0),
    )
    .await;
    let batch = claim(store, "w", &[PROJECTOR], 2, at(10)).await;
    assert_eq!(batch.len(), 2, "{}", S::NAME);
    let failing = batch
        .iter()
        .find(|c| c.event.id().starts_with('u'))
        .or_else(|| batch.last())
        .unwrap();
    let failing_id = failing.event.id().to_owned();
    assert!(
        store
            .bury(
                &failing.lease,
                "Connection REFUSED by smtp.example.com",
                at(11)
            )
            .await
            .unwrap()
    );
    let running_event = batch
        .iter()
        .find(|c| c.event.id() != failing_id)
        .unwrap()
        .event
        .id()
        .to_owned();

    let pending = list(store, DeliveryQuery::new().status(DeliveryStatus::Pending)).await;
    assert_eq!(pending.len(), 4, "{}: {pending:?}", S::NAME);
    let running = list(
        store,
        DeliveryQuery::new().pending_state(PendingState::Running),
    )
    .await;
    assert_eq!(running.len(), 1, "{}: {running:?}", S::NAME);
    assert_eq!(running[0].event_id, running_event, "{}", S::NAME);
    assert!(running[0].running, "{}: {running:?}", S::NAME);
    let waiting = list(
        store,
        DeliveryQuery::new().pending_state(PendingState::Waiting),
    )
    .await;
    let parked = list(
        store,
        DeliveryQuery::new().pending_state(PendingState::Parked),
    )
    .await;
    assert!(
        waiting.iter().all(|r| !r.running && !r.parked),
        "{}: {waiting:?}",
        S::NAME
    );
    assert!(
        parked.iter().all(|r| r.parked && !r.running),
        "{}: {parked:?}",
        S::NAME
    );
    let mut together = [running.clone(), waiting, parked].concat();
    together.sort_by(|a, b| a.id.cmp(&b.id));
    assert_eq!(
        ids(&together),
        ids(&pending),
        "{}: every pending one, once",
        S::NAME
    );
    let marked: Vec<&str> = pending
        .iter()
        .filter(|r| r.running)
        .map(|r| r.event_id.as_str())
        .collect();
    assert_eq!(
        marked,
        [running_event.as_str()],
        "{}: the plain listing marks it",
        S::NAME
    );
    assert!(
        list(
            store,
            DeliveryQuery::new()
                .status(DeliveryStatus::Dead)
                .pending_state(PendingState::Running)
        )
        .await
        .is_empty(),
        "{}: a dead letter is never running",
        S::NAME
    );

    let of_key = list(store, DeliveryQuery::new().key("order-1")).await;
    assert_eq!(of_key.len(), 3, "{}: {of_key:?}", S::NAME);
    assert!(of_key.iter().all(|r| r.key.as_deref() == Some("order-1")));
    assert!(
        list(store, DeliveryQuery::new().key("order-2"))
            .await
            .is_empty()
    );
    let of_event = list(store, DeliveryQuery::new().event_id("k-2")).await;
    assert_eq!(of_event.len(), 1, "{}: {of_event:?}", S::NAME);
    assert_eq!(of_event[0].event_id, "k-2");

    for text in ["refused by SMTP", "REFUSED", "example.com"] {
        let found = list(store, DeliveryQuery::new().error_contains(text)).await;
        assert_eq!(found.len(), 1, "{}: {text:?} found {found:?}", S::NAME);
        assert_eq!(found[0].event_id, failing_id);
    }
    for text in [".*", "refused.by", "smtp|x", "^Connection"] {
        assert!(
            list(store, DeliveryQuery::new().error_contains(text))
                .await
                .is_empty(),
            "{}: {text:?} is text, not a pattern",
            S::NAME
        );
    }
    let exact = list(
        store,
        DeliveryQuery::new().last_error("Connection REFUSED by smtp.example.com"),
    )
    .await;
    assert_eq!(exact.len(), 1, "{}", S::NAME);
    assert!(
        list(store, DeliveryQuery::new().last_error("Connection REFUSED"))
            .await
            .is_empty(),
        "{}: `last_error` matches the whole error",
        S::NAME
    );
}

/// `event_detail` returns the event as appended (payload, key, headers, sequence) with every
/// handler's delivery, in handler order; `None` for an id the store does not hold.
pub async fn event_detail_has_the_event_and_every_delivery<S: Store>(store: &S) {
    let keyed = event("d-1", Some("order-7"))
        .with_header("tenant", "acme")
        .unwrap();
    publish(
        store,
        std::slice::from_ref(&keyed),
        &[PROJECTOR, MAILER],
        at(0),
    )
    .await;
    let batch = claim(store, "w", &[MAILER], 10, at(1)).await;
    assert_eq!(batch.len(), 1);
    assert!(
        store
            .bury(&batch[0].lease, "no mail today", at(2))
            .await
            .unwrap()
    );

    let detail = store
        .event_detail("d-1")
        .await
        .unwrap()
        .unwrap_or_else(|| panic!("{}: the event is missing", S::NAME));
    assert_eq!(detail.event.id(), "d-1");
    assert_eq!(detail.event.payload(), keyed.payload(), "{}", S::NAME);
    assert_eq!(detail.event.key(), Some("order-7"));
    assert_eq!(
        detail.event.headers().get("tenant").map(String::as_str),
        Some("acme")
    );
    assert_eq!(detail.sequence, Some(1), "{}", S::NAME);
    let mut handlers = detail.handlers.clone();
    handlers.sort();
    assert_eq!(handlers, [MAILER, PROJECTOR], "{}", S::NAME);
    let deliveries: Vec<(&str, DeliveryStatus)> = detail
        .deliveries
        .iter()
        .map(|d| (d.handler.as_str(), d.status))
        .collect();
    assert_eq!(
        deliveries,
        [
            (MAILER, DeliveryStatus::Dead),
            (PROJECTOR, DeliveryStatus::Pending)
        ],
        "{}",
        S::NAME
    );
    assert_eq!(
        detail.deliveries[0].last_error.as_deref(),
        Some("no mail today")
    );
    assert_eq!(detail.deliveries[0].errors.len(), 1);

    assert!(
        store.event_detail("d-404").await.unwrap().is_none(),
        "{}",
        S::NAME
    );
}

/// `lanes` lists the units of lease with their holder and in-flight count, and each key whose
/// deliveries are parked with what they wait for: the key's running head.
pub async fn lanes_show_holders_and_blocked_keys<S: Store>(store: &S) {
    let backlog: Vec<EventEnvelope> = (1..=40)
        .map(|i| event(&format!("b-{i}"), Some("busy")))
        .collect();
    publish(store, &backlog, &[PROJECTOR], at(0)).await;
    let head = claim(store, "w", &[PROJECTOR], 10, at(1)).await;
    assert_eq!(head.len(), 1, "{}", S::NAME);
    // A second claim finds the key still busy (and may park its backlog).
    assert!(claim(store, "w", &[PROJECTOR], 10, at(2)).await.is_empty());

    let report = store.lanes().await.unwrap();
    let held: Vec<_> = report
        .lanes
        .iter()
        .filter(|lane| lane.owner.as_deref() == Some("w") && lane.in_flight > 0)
        .collect();
    assert_eq!(held.len(), 1, "{}: {:?}", S::NAME, report.lanes);
    assert_eq!(held[0].in_flight, 1);
    assert!(held[0].lease_expires_at.is_some_and(|at_| at_ > at(2)));

    let stats = statistics(store).await;
    let parked: u64 = report.blocked.iter().map(|key| key.parked).sum();
    assert_eq!(parked, stats.parked, "{}: {:?}", S::NAME, report.blocked);
    for key in &report.blocked {
        assert_eq!(
            (key.handler.as_str(), key.key.as_str()),
            (PROJECTOR, "busy")
        );
        let waits_for = key
            .waiting_for
            .as_ref()
            .unwrap_or_else(|| panic!("{}: {key:?} waits for nothing", S::NAME));
        assert_eq!(waits_for.event_id, "b-1", "{}", S::NAME);
        assert!(waits_for.running, "{}: {waits_for:?}", S::NAME);
        assert!(key.first_parked_sequence.is_some_and(|s| s > 1));
    }
}

/// `dead_letter_groups` groups dead letters by handler and last error, the largest first (then
/// by handler and error), narrowed to a handler when asked; `last_error` lists one group.
pub async fn dead_letter_groups_group_by_handler_and_error<S: Store>(store: &S) {
    let events: Vec<EventEnvelope> = (0..5).map(|i| event(&format!("g-{i}"), None)).collect();
    publish(store, &events, &[PROJECTOR], at(0)).await;
    publish(store, &events[..2], &[MAILER], at(0)).await;
    let batch = claim(store, "w", &[PROJECTOR, MAILER], 10, at(1)).await;
    assert_eq!(batch.len(), 7, "{}", S::NAME);
    let mut projector_buried = 0;
    for claimed in &batch {
        let error = if claimed.handler == MAILER {
            "timeout"
        } else {
            projector_buried += 1;
            if projector_buried <= 3 {
                "timeout"
            } else {
                "refused"
            }
        };
        assert!(store.bury(&claimed.lease, error, at(2)).await.unwrap());
    }

    let groups = store.dead_letter_groups(None).await.unwrap();
    let shape: Vec<(&str, Option<&str>, u64)> = groups
        .iter()
        .map(|g| (g.handler.as_str(), g.error.as_deref(), g.count))
        .collect();
    assert_eq!(
        shape,
        [
            (PROJECTOR, Some("timeout"), 3),
            (MAILER, Some("timeout"), 2),
            (PROJECTOR, Some("refused"), 2),
        ],
        "{}",
        S::NAME
    );
    let only = store.dead_letter_groups(Some(MAILER)).await.unwrap();
    assert_eq!(only.len(), 1, "{}: {only:?}", S::NAME);

    let group = list(
        store,
        DeliveryQuery::new()
            .status(DeliveryStatus::Dead)
            .handler(PROJECTOR)
            .last_error("timeout"),
    )
    .await;
    assert_eq!(group.len(), 3, "{}", S::NAME);
    assert!(
        group.iter().any(|r| r.id == groups[0].sample_id),
        "{}",
        S::NAME
    );
}
