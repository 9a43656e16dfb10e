//! The operator API: statistics, listings and retention.

use std::collections::HashSet;

use relaybus::{DeliveryQuery, DeliveryStatus, EventEnvelope, PurgeOptions, Store};

use super::{
    MAILER, PLACED, PROJECTOR, all_deliveries, at, claim, event, holds_event, leases, list,
    publish, statistics, typed,
};

/// `handler_statistics` counts each handler's deliveries by state, lists only handlers with
/// an unfinished delivery, and finds each handler's oldest due one.
pub async fn handler_statistics_count_each_handlers_deliveries<S: Store>(store: &S) {
    assert_eq!(store.handler_statistics().await.unwrap(), [], "{}", S::NAME);
    let events: Vec<EventEnvelope> = (0..3).map(|i| event(&format!("h-{i}"), None)).collect();
    publish(store, &events, &[PROJECTOR, MAILER], at(0)).await;
    publish(store, &[event("h-late", None)], &[MAILER], at(50)).await;
    let batch = claim(store, "w", &[PROJECTOR], 2, at(60)).await;
    assert_eq!(batch.len(), 2);
    assert!(store.bury(&batch[0].lease, "broken", at(61)).await.unwrap());

    let stats = store.handler_statistics().await.unwrap();
    let names: Vec<&str> = stats.iter().map(|h| h.handler.as_str()).collect();
    let mut sorted = names.clone();
    sorted.sort_unstable();
    assert_eq!(names, sorted, "{}: in handler order", S::NAME);
    let of = |id: &str| {
        stats
            .iter()
            .find(|h| h.handler == id)
            .unwrap_or_else(|| panic!("{}: {id} missing from {stats:?}", S::NAME))
    };
    let projector = of(PROJECTOR);
    assert_eq!(
        (
            projector.pending,
            projector.running,
            projector.parked,
            projector.dead
        ),
        (2, 1, 0, 1),
        "{}: two pending (one running), one dead: {projector:?}",
        S::NAME
    );
    assert_eq!(projector.oldest_due_at, Some(at(0)));
    let mailer = of(MAILER);
    assert_eq!(
        (mailer.pending, mailer.running, mailer.dead),
        (4, 0, 0),
        "{}: {mailer:?}",
        S::NAME
    );
    assert_eq!(mailer.oldest_due_at, Some(at(0)));

    // A handler with nothing left is not listed.
    let rest = claim(store, "w", &[MAILER], 10, at(70)).await;
    assert_eq!(
        store.complete(&leases(&rest), at(71)).await.unwrap(),
        [true; 4]
    );
    let stats = store.handler_statistics().await.unwrap();
    assert!(
        stats.iter().all(|h| h.handler != MAILER),
        "{}: {stats:?}",
        S::NAME
    );
}

/// `gauge_statistics` counts as `handler_statistics` does: a new count when asked for one no
/// older than now, and within a longer age either a new count or one taken before by the same
/// store instance.
pub async fn gauge_statistics_count_as_handler_statistics<S: Store>(store: &S) {
    let age = std::time::Duration::from_secs(60);
    let fresh = std::time::Duration::ZERO;
    publish(store, &[event("g-1", None)], &[PROJECTOR], at(0)).await;
    let first = store.handler_statistics().await.unwrap();
    assert_eq!(
        store.gauge_statistics(fresh).await.unwrap(),
        first,
        "{}",
        S::NAME
    );
    assert_eq!(
        store.gauge_statistics(age).await.unwrap(),
        first,
        "{}",
        S::NAME
    );
    publish(store, &[event("g-2", None)], &[PROJECTOR], at(0)).await;
    let second = store.handler_statistics().await.unwrap();
    assert_ne!(first, second, "{}", S::NAME);
    let within_age = store.gauge_statistics(age).await.unwrap();
    assert!(
        within_age == first || within_age == second,
        "{}: {within_age:?} is neither count",
        S::NAME
    );
    assert_eq!(
        store.gauge_statistics(fresh).await.unwrap(),
        second,
        "{}",
        S::NAME
    );
}

/// `statistics` counts deliveries by state: pending ones (running ones included), running
/// ones, dead ones, none parked without keys, and the due time of the oldest pending one.
pub async fn statistics_count_deliveries_by_state<S: Store>(store: &S) {
    let empty = statistics(store).await;
    assert_eq!(
        (empty.pending, empty.running, empty.parked, empty.dead),
        (0, 0, 0, 0),
        "{}: {empty:?}",
        S::NAME
    );
    assert_eq!(empty.oldest_due_at, None);

    let events: Vec<EventEnvelope> = (0..4).map(|i| event(&format!("s-{i}"), None)).collect();
    publish(store, &events, &[PROJECTOR], at(0)).await;
    publish(store, &[event("m-1", None)], &[MAILER], at(10)).await;
    let batch = claim(store, "w", &[PROJECTOR], 3, at(20)).await;
    assert_eq!(batch.len(), 3);
    assert_eq!(
        store
            .complete(std::slice::from_ref(&batch[0].lease), at(21))
            .await
            .unwrap(),
        [true]
    );
    assert!(store.bury(&batch[1].lease, "broken", at(22)).await.unwrap());

    let stats = statistics(store).await;
    assert_eq!(
        stats.pending,
        3,
        "{}: one running, one waiting, one of another handler: {stats:?}",
        S::NAME
    );
    assert_eq!(stats.running, 1, "{}: {stats:?}", S::NAME);
    assert_eq!(stats.dead, 1);
    assert_eq!(stats.parked, 0);
    assert_eq!(stats.oldest_due_at, Some(at(0)));

    // Everything settled: only the dead letter is left.
    let rest = claim(store, "w", &[PROJECTOR, MAILER], 10, at(23)).await;
    assert_eq!(rest.len(), 2, "{}", S::NAME);
    let mut running = leases(&rest);
    running.push(batch[2].lease.clone());
    assert_eq!(store.complete(&running, at(24)).await.unwrap(), [true; 3]);
    let stats = statistics(store).await;
    assert_eq!(
        (
            stats.pending,
            stats.running,
            stats.dead,
            stats.oldest_due_at
        ),
        (0, 0, 1, None),
        "{}: {stats:?}",
        S::NAME
    );
}

/// `list_deliveries` lists pending and dead deliveries, oldest first, filtered by status,
/// handler and event type (combined with "and"), and pages with `after(last id)`: each page
/// starts right after the previous one, with no overlap and no gap.
pub async fn list_deliveries_filters_and_pages<S: Store>(store: &S) {
    for i in 0..5 {
        publish(
            store,
            &[event(&format!("p-{i}"), None)],
            &[PROJECTOR],
            at(i),
        )
        .await;
    }
    publish(store, &[event("m-1", None)], &[MAILER], at(5)).await;
    publish(
        store,
        &[typed("order.cancelled.v1", "c-1", None)],
        &[PROJECTOR],
        at(6),
    )
    .await;
    let batch = claim(store, "w", &[PROJECTOR], 1, at(10)).await;
    assert!(store.bury(&batch[0].lease, "broken", at(11)).await.unwrap());
    let buried = batch[0].event.id().to_owned();

    let all = all_deliveries(store).await;
    assert_eq!(all.len(), 7, "{}: {all:?}", S::NAME);
    let ids: HashSet<&str> = all.iter().map(|r| r.id.as_str()).collect();
    assert_eq!(ids.len(), 7, "{}: ids repeat", S::NAME);
    let order: Vec<&str> = all.iter().map(|r| r.event_id.as_str()).collect();
    assert_eq!(
        order,
        ["p-0", "p-1", "p-2", "p-3", "p-4", "m-1", "c-1"],
        "{}: not oldest first",
        S::NAME
    );

    let dead = list(store, DeliveryQuery::new().status(DeliveryStatus::Dead)).await;
    assert_eq!(dead.len(), 1, "{}: {dead:?}", S::NAME);
    assert_eq!(dead[0].event_id, buried);
    let pending = list(store, DeliveryQuery::new().status(DeliveryStatus::Pending)).await;
    assert_eq!(pending.len(), 6);
    assert!(pending.iter().all(|r| r.status == DeliveryStatus::Pending));
    let mailer = list(store, DeliveryQuery::new().handler(MAILER)).await;
    assert_eq!(mailer.len(), 1);
    assert_eq!(mailer[0].event_id, "m-1");
    let cancelled = list(store, DeliveryQuery::new().event_type("order.cancelled.v1")).await;
    assert_eq!(cancelled.len(), 1, "{}: {cancelled:?}", S::NAME);
    assert_eq!(cancelled[0].event_id, "c-1");
    let combined = list(
        store,
        DeliveryQuery::new()
            .handler(PROJECTOR)
            .event_type(PLACED)
            .status(DeliveryStatus::Pending),
    )
    .await;
    assert_eq!(combined.len(), 4, "{}: {combined:?}", S::NAME);
    assert!(
        list(store, DeliveryQuery::new().handler("nobody"))
            .await
            .is_empty()
    );

    // Pages of 3: 3, 3, 1, then nothing; together the whole listing, in order.
    let mut paged = Vec::new();
    let mut query = DeliveryQuery::new().limit(3);
    let mut sizes = Vec::new();
    loop {
        let page = store.list_deliveries(&query).await.unwrap();
        sizes.push(page.len());
        let Some(last) = page.last() else { break };
        query = DeliveryQuery::new().limit(3).after(last.id.clone());
        paged.extend(page);
        assert!(sizes.len() < 10, "{}: paging does not end", S::NAME);
    }
    assert_eq!(sizes, [3, 3, 1, 0], "{}", S::NAME);
    assert_eq!(paged, all, "{}: pages overlap or leave gaps", S::NAME);

    // Paging with a filter pages through the filtered listing.
    let first = store
        .list_deliveries(&DeliveryQuery::new().handler(PROJECTOR).limit(2))
        .await
        .unwrap();
    assert_eq!(first.len(), 2, "{}: the limit", S::NAME);
    let second = store
        .list_deliveries(
            &DeliveryQuery::new()
                .handler(PROJECTOR)
                .after(first[1].id.clone())
                .limit(2),
        )
        .await
        .unwrap();
    let projector: Vec<&str> = all
        .iter()
        .filter(|r| r.handler == PROJECTOR)
        .map(|r| r.id.as_str())
        .collect();
    let both: Vec<&str> = first.iter().chain(&second).map(|r| r.id.as_str()).collect();
    assert_eq!(both, projector[..4], "{}", S::NAME);
}

/// `purge` deletes dead letters buried before `dead_before`, with their events when nothing
/// else refers to them; keeps a completed event (as the record that deduplicates a publish of
/// its id) until `completed_before` passes its completion; never deletes an event that has a
/// pending delivery; and reports what it deleted.
pub async fn purge_deletes_dead_letters_and_completed_events_by_cutoff<S: Store>(store: &S) {
    publish(
        store,
        &[
            event("dead", None),
            event("late-dead", None),
            event("done", None),
        ],
        &[PROJECTOR],
        at(0),
    )
    .await;
    publish(store, &[event("mixed", None)], &[PROJECTOR, MAILER], at(0)).await;
    let batch = claim(store, "w", &[PROJECTOR], 10, at(1)).await;
    assert_eq!(batch.len(), 4, "{}", S::NAME);
    for claimed in &batch {
        let lease = &claimed.lease;
        let settled = match claimed.event.id() {
            "done" => store
                .complete(std::slice::from_ref(lease), at(100))
                .await
                .unwrap()[0],
            "late-dead" => store.bury(lease, "later", at(80)).await.unwrap(),
            _ => store.bury(lease, "broken", at(2)).await.unwrap(),
        };
        assert!(settled, "{}: {}", S::NAME, claimed.event.id());
    }

    let nothing = store.purge(&PurgeOptions::new()).await.unwrap();
    assert_eq!(
        (nothing.dead_deliveries, nothing.events),
        (0, 0),
        "{}: purged without a cutoff",
        S::NAME
    );

    let purged = store
        .purge(&PurgeOptions::new().dead_before(at(50)))
        .await
        .unwrap();
    assert_eq!(purged.dead_deliveries, 2, "{}: {purged:?}", S::NAME);
    assert_eq!(
        purged.events,
        1,
        "{}: the dead one only; mixed has a pending delivery, done completed: {purged:?}",
        S::NAME
    );
    let dead = list(store, DeliveryQuery::new().status(DeliveryStatus::Dead)).await;
    let dead: Vec<&str> = dead.iter().map(|r| r.event_id.as_str()).collect();
    assert_eq!(dead, ["late-dead"], "{}", S::NAME);
    assert_eq!(statistics(store).await.dead, 1);
    assert_eq!(
        statistics(store).await.pending,
        1,
        "mixed's mailer delivery stays"
    );

    let early = store
        .purge(&PurgeOptions::new().completed_before(at(99)))
        .await
        .unwrap();
    assert_eq!(
        early.events,
        0,
        "{}: a completion after the cutoff: {early:?}",
        S::NAME
    );
    let purged = store
        .purge(&PurgeOptions::new().completed_before(at(101)))
        .await
        .unwrap();
    assert_eq!(
        purged.events,
        1,
        "{}: the completed one: {purged:?}",
        S::NAME
    );
    assert_eq!(purged.dead_deliveries, 0);

    assert!(!holds_event(store, "dead", PLACED).await, "{}", S::NAME);
    assert!(!holds_event(store, "done", PLACED).await, "{}", S::NAME);
    assert!(holds_event(store, "mixed", PLACED).await, "{}", S::NAME);
    assert!(holds_event(store, "late-dead", PLACED).await, "{}", S::NAME);
}

/// `discard` deletes dead deliveries only; an event left with none counts as finished (purged
/// with the completed ones), one that still has a delivery stays.
pub async fn discard_deletes_dead_letters_only<S: Store>(store: &S) {
    publish(store, &[event("d-1", None)], &[PROJECTOR, MAILER], at(0)).await;
    publish(store, &[event("d-2", None)], &[PROJECTOR], at(0)).await;
    let batch = claim(store, "w", &[PROJECTOR], 2, at(1)).await;
    assert_eq!(batch.len(), 2, "{}", S::NAME);
    for delivery in &batch {
        assert!(store.bury(&delivery.lease, "poison", at(2)).await.unwrap());
    }
    let dead = list(store, DeliveryQuery::new().status(DeliveryStatus::Dead)).await;
    assert_eq!(dead.len(), 2, "{}: {dead:?}", S::NAME);
    let pending = list(store, DeliveryQuery::new().status(DeliveryStatus::Pending)).await;
    assert_eq!(pending.len(), 1, "{}: the mailer's: {pending:?}", S::NAME);

    let mut ids: Vec<String> = dead.iter().map(|d| d.id.clone()).collect();
    ids.push(pending[0].id.clone());
    ids.push("not-an-id".to_owned());
    let outcome = store.discard(&ids, at(3)).await.unwrap();
    let mut discarded = outcome.discarded.clone();
    discarded.sort();
    let mut expected: Vec<String> = dead.iter().map(|d| d.id.clone()).collect();
    expected.sort();
    assert_eq!(discarded, expected, "{}: {outcome:?}", S::NAME);
    let mut not_found = outcome.not_found.clone();
    not_found.sort();
    let mut refused = vec![pending[0].id.clone(), "not-an-id".to_owned()];
    refused.sort();
    assert_eq!(
        not_found,
        refused,
        "{}: pending ones are left alone",
        S::NAME
    );

    let stats = statistics(store).await;
    assert_eq!(
        (stats.dead, stats.pending),
        (0, 1),
        "{}: {stats:?}",
        S::NAME
    );
    // d-2 has nothing left: it is purged with the completed events; d-1 waits for its mailer.
    let purged = store
        .purge(&PurgeOptions::new().completed_before(at(100)))
        .await
        .unwrap();
    assert_eq!(purged.events, 1, "{}: {purged:?}", S::NAME);
    assert!(holds_event(store, "d-1", PLACED).await, "{}", S::NAME);
    assert!(!holds_event(store, "d-2", PLACED).await, "{}", S::NAME);
    // Discarding again finds nothing.
    let again = store.discard(&expected, at(4)).await.unwrap();
    assert!(again.discarded.is_empty(), "{}: {again:?}", S::NAME);
}
