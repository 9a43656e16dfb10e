//! Two store instances on one database, as two processes have: takeover, fencing, restarts,
//! concurrent claims and hand-back across instances. A store that lives in one process may
//! skip these (see the [module documentation](crate::conformance)).

use std::{
    collections::{HashMap, HashSet},
    sync::Mutex,
};

use relaybus::{EventEnvelope, Store};

use super::{
    LEASE, PROJECTOR, all_deliveries, at, claim, delivery_id, event, event_ids, leases, publish,
    statistics,
};

/// A delivery claimed through one instance and taken over through another after its lease
/// expired comes at attempt 2; the first instance's leases then settle and renew nothing and
/// change nothing, and the second instance's complete it.
pub async fn takeover_fences_and_charges_across_instances<S: Store>(first: &S, second: &S) {
    let events: Vec<EventEnvelope> = (0..3).map(|i| event(&format!("e-{i}"), None)).collect();
    publish(first, &events, &[PROJECTOR], at(0)).await;
    let old = claim(first, "worker-a", &[PROJECTOR], 10, at(1)).await;
    assert_eq!(old.len(), 3, "{}", S::NAME);
    assert!(
        claim(second, "worker-b", &[PROJECTOR], 10, at(10))
            .await
            .is_empty(),
        "{}: taken over before the lease expired",
        S::NAME
    );

    let new = claim(second, "worker-b", &[PROJECTOR], 10, at(40)).await;
    assert_eq!(event_ids(&new), event_ids(&old), "{}", S::NAME);
    assert!(
        new.iter().all(|c| c.attempt == 2),
        "{}: lost attempts not charged",
        S::NAME
    );
    let before = all_deliveries(first).await;
    let stale = leases(&old);
    assert_eq!(first.complete(&stale, at(41)).await.unwrap(), [false; 3]);
    for lease in &stale {
        assert!(
            !first
                .reschedule(lease, at(90), "late", at(41))
                .await
                .unwrap()
        );
        assert!(!first.bury(lease, "late", at(41)).await.unwrap());
        assert!(!first.release(lease, at(41)).await.unwrap());
    }
    assert_eq!(first.renew(&stale, LEASE, at(41)).await.unwrap(), 0);
    assert_eq!(
        all_deliveries(second).await,
        before,
        "{}: stale leases changed deliveries",
        S::NAME
    );
    assert_eq!(
        second.complete(&leases(&new), at(42)).await.unwrap(),
        [true; 3]
    );
    assert_eq!(statistics(first).await.pending, 0);
}

/// An owner restarted as a new instance under the same name does not get back what its
/// predecessor still holds: nothing until the lease expires, then the deliveries at their next
/// attempt, and the predecessor's leases settle nothing.
pub async fn restarted_owner_waits_for_its_lease_across_instances<S: Store>(
    old: &S,
    restarted: &S,
) {
    let events: Vec<EventEnvelope> = (0..3).map(|i| event(&format!("r-{i}"), None)).collect();
    publish(old, &events, &[PROJECTOR], at(0)).await;
    let held = claim(old, "worker", &[PROJECTOR], 10, at(1)).await;
    assert_eq!(held.len(), 3);

    assert!(
        claim(restarted, "worker", &[PROJECTOR], 10, at(2))
            .await
            .is_empty(),
        "{}: a restarted owner adopted its predecessor's running deliveries",
        S::NAME
    );
    let again = claim(restarted, "worker", &[PROJECTOR], 10, at(40)).await;
    assert_eq!(event_ids(&again), event_ids(&held), "{}", S::NAME);
    assert!(again.iter().all(|c| c.attempt == 2), "{}", S::NAME);
    assert_eq!(
        old.complete(&leases(&held), at(41)).await.unwrap(),
        [false; 3]
    );
    assert_eq!(
        restarted.complete(&leases(&again), at(41)).await.unwrap(),
        [true; 3]
    );
}

/// Two instances claiming and completing at the same time, on one clock (no lease expires),
/// never hold one delivery at once, hand out every delivery exactly once, and keep each key in
/// sequence order, one at a time.
pub async fn concurrent_claims_never_share_a_delivery_across_instances<S: Store>(
    first: &S,
    second: &S,
) {
    let mut events: Vec<EventEnvelope> = (0..100).map(|i| event(&format!("u-{i}"), None)).collect();
    for n in 1..=10 {
        for k in 0..5 {
            events.push(event(&format!("k{k}-{n}"), Some(&format!("key-{k}"))));
        }
    }
    publish(first, &events, &[PROJECTOR], at(0)).await;

    #[derive(Default)]
    struct Seen {
        holding: HashSet<String>,
        handed_out: Vec<String>,
        // key -> (running, last sequence finished)
        keys: HashMap<String, (bool, i64)>,
    }
    let seen = Mutex::new(Seen::default());
    let shared = &seen;
    let worker = move |store: &S, owner: &'static str| {
        let seen = shared;
        let store = store.clone();
        async move {
            loop {
                let batch = claim(&store, owner, &[PROJECTOR], 7, at(1)).await;
                if batch.is_empty() {
                    // The other instance may hold the rest; stop when nothing is left.
                    if statistics(&store).await.pending == 0 {
                        return;
                    }
                    tokio::task::yield_now().await;
                    continue;
                }
                {
                    let mut seen = seen.lock().unwrap();
                    for claimed in &batch {
                        let id = delivery_id(claimed);
                        assert!(
                            seen.holding.insert(id.clone()),
                            "{}: {id} held by both instances",
                            S::NAME
                        );
                        seen.handed_out.push(id);
                        if let Some(key) = claimed.event.key() {
                            let (running, last) =
                                seen.keys.entry(key.to_owned()).or_insert((false, 0));
                            assert!(!*running, "{}: {key} handed out while running", S::NAME);
                            assert_eq!(
                                claimed.sequence,
                                Some(*last + 1),
                                "{}: {key} out of order",
                                S::NAME
                            );
                            *running = true;
                        }
                    }
                    // Finished before the completion reaches the store, so that the next
                    // delivery of a key can only be handed out after.
                    for claimed in &batch {
                        seen.holding.remove(&delivery_id(claimed));
                        if let Some(key) = claimed.event.key() {
                            let sequence = claimed.sequence.unwrap();
                            seen.keys.insert(key.to_owned(), (false, sequence));
                        }
                    }
                }
                let done = store.complete(&leases(&batch), at(1)).await.unwrap();
                assert!(done.iter().all(|d| *d), "{}: {done:?}", S::NAME);
            }
        }
    };
    tokio::join!(worker(first, "worker-a"), worker(second, "worker-b"));

    let seen = seen.into_inner().unwrap();
    let unique: HashSet<&String> = seen.handed_out.iter().collect();
    assert_eq!(
        seen.handed_out.len(),
        150,
        "{}: handed out more than once",
        S::NAME
    );
    assert_eq!(unique.len(), 150);
    assert!(
        seen.keys
            .values()
            .all(|(running, last)| !running && *last == 10),
        "{}",
        S::NAME
    );
    assert!(all_deliveries(first).await.is_empty());
}

/// What one instance relinquishes another instance claims at once, long before the lease would
/// have expired, at the same attempt when it was released first.
pub async fn relinquish_hands_back_across_instances<S: Store>(first: &S, second: &S) {
    let events: Vec<EventEnvelope> = (0..3).map(|i| event(&format!("g-{i}"), None)).collect();
    publish(first, &events, &[PROJECTOR], at(0)).await;
    let batch = claim(first, "worker-a", &[PROJECTOR], 10, at(1)).await;
    assert_eq!(batch.len(), 3);
    for claimed in &batch {
        assert!(first.release(&claimed.lease, at(2)).await.unwrap());
    }
    first.relinquish("worker-a").await.unwrap();

    let taken = claim(second, "worker-b", &[PROJECTOR], 10, at(3)).await;
    assert_eq!(
        event_ids(&taken),
        event_ids(&batch),
        "{}: not handed back at once",
        S::NAME
    );
    assert!(taken.iter().all(|c| c.attempt == 1), "{}", S::NAME);
    assert_eq!(
        second.complete(&leases(&taken), at(4)).await.unwrap(),
        [true; 3]
    );
}

/// `lead`: one instance leads a role at a time; it keeps the lead while it renews it, and
/// another takes it once it expired.
pub async fn one_instance_leads_a_role_at_a_time_across_instances<S: Store>(first: &S, second: &S) {
    let period = std::time::Duration::from_secs(1);
    assert!(
        first.lead("conformance", period).await.unwrap(),
        "{}",
        S::NAME
    );
    assert!(
        !second.lead("conformance", period).await.unwrap(),
        "{}",
        S::NAME
    );
    assert!(
        first.lead("conformance", period).await.unwrap(),
        "{}: renewed",
        S::NAME
    );
    // Another role is free.
    assert!(second.lead("other", period).await.unwrap(), "{}", S::NAME);
    // The first stops renewing: the second takes over once the lead expired.
    let taken = async {
        while !second.lead("conformance", period).await.unwrap() {
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
    };
    tokio::time::timeout(period * 5, taken)
        .await
        .unwrap_or_else(|_| panic!("{}: an expired lead is taken over", S::NAME));
    assert!(
        !first.lead("conformance", period).await.unwrap(),
        "{}",
        S::NAME
    );
}

/// `keep_lead`, `leads` and `resign`: a lead kept in a transaction is renewed with it, and a
/// take-over waits for that transaction and then finds the lead renewed; a transaction of an
/// instance whose lead expired and was taken keeps nothing; each instance lists the leads of a
/// prefix and which are its own; a resigned lead is free at once.
pub async fn a_kept_lead_fences_transactions_across_instances<S: Store>(first: &S, second: &S) {
    use std::time::Duration;

    use relaybus::store::{Lead, transaction};

    let period = Duration::from_secs(2);
    let keep = async |store: &S, role: &'static str, period: Duration| {
        transaction::run(store, None, async |session| {
            store.keep_lead(session, role, period).await
        })
        .await
        .unwrap()
    };
    assert!(first.lead("fence/a", period).await.unwrap(), "{}", S::NAME);
    assert!(second.lead("fence/b", period).await.unwrap(), "{}", S::NAME);
    assert!(second.lead("other", period).await.unwrap(), "{}", S::NAME);
    assert!(keep(first, "fence/a", period).await, "{}", S::NAME);
    assert!(
        !keep(first, "fence/b", period).await,
        "{}: kept another instance's lead",
        S::NAME
    );
    assert!(
        !keep(first, "fence/none", period).await,
        "{}: kept a lead nobody took",
        S::NAME
    );
    assert_eq!(
        first.leads("fence/").await.unwrap(),
        [Lead::new("fence/a", true), Lead::new("fence/b", false)],
        "{}",
        S::NAME
    );
    assert_eq!(
        second.leads("fence/").await.unwrap(),
        [Lead::new("fence/a", false), Lead::new("fence/b", true)],
        "{}",
        S::NAME
    );

    // A take-over of a lead kept in an open transaction waits for it, then finds it renewed.
    let short = Duration::from_millis(300);
    assert!(first.lead("fence/a", short).await.unwrap(), "{}", S::NAME);
    let mut session = first.session().await.unwrap();
    first.begin(&mut session, None).await.unwrap();
    assert!(
        first
            .keep_lead(&mut session, "fence/a", Duration::from_secs(30))
            .await
            .unwrap(),
        "{}",
        S::NAME
    );
    tokio::time::sleep(short * 2).await;
    let taker = second.clone();
    let take_over = tokio::spawn(async move { taker.lead("fence/a", short).await.unwrap() });
    tokio::time::sleep(Duration::from_millis(100)).await;
    first.commit(&mut session).await.unwrap();
    assert!(
        !take_over.await.unwrap(),
        "{}: taken over past a transaction that kept the lead",
        S::NAME
    );

    // Once it expired and another instance took it, a transaction keeps nothing.
    assert!(first.lead("fence/c", short).await.unwrap(), "{}", S::NAME);
    let taken = async {
        while !second.lead("fence/c", period).await.unwrap() {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    tokio::time::timeout(period * 5, taken)
        .await
        .unwrap_or_else(|_| panic!("{}: an expired lead is taken over", S::NAME));
    assert!(
        !keep(first, "fence/c", period).await,
        "{}: a stale holder kept the lead",
        S::NAME
    );

    // A resigned lead is free at once; resigning another's changes nothing.
    first.resign("fence/c").await.unwrap();
    assert!(!first.lead("fence/c", period).await.unwrap(), "{}", S::NAME);
    second.resign("fence/c").await.unwrap();
    assert!(first.lead("fence/c", period).await.unwrap(), "{}", S::NAME);
}
