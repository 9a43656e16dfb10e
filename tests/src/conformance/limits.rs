//! Limits: the slots of a handler's global concurrency and the start counters of its rate
//! limit ([`Limits`]).

use std::time::Duration;

use relaybus::{
    Timestamp,
    store::{SlotRequest, StartsRequest, Store},
};

use super::{LEASE, PROJECTOR, at};

fn request(limit: u32, owner: &str, now: i64) -> SlotRequest<'_> {
    SlotRequest {
        handler: PROJECTOR,
        limit,
        owner,
        lease_duration: LEASE,
        now: at(now),
    }
}

/// `take_slot`: each of a handler's `limit` slots is held by one taker at a time; a slot given
/// back, or expired, can be taken again; a renewal keeps it past its first expiry; a holder
/// whose slot expired and was taken by another can neither renew it nor give it back.
pub async fn slots_are_held_one_taker_at_a_time<S: Store>(store: &S) {
    let first = store
        .take_slot(request(2, "a", 0))
        .await
        .unwrap()
        .expect("a free slot");
    let second = store
        .take_slot(request(2, "b", 0))
        .await
        .unwrap()
        .expect("a free slot");
    assert_ne!(first.index, second.index, "two takers, two slots");
    assert!(first.index < 2 && second.index < 2);
    assert_eq!(
        store.take_slot(request(2, "c", 1)).await.unwrap(),
        None,
        "every slot is held"
    );
    assert!(
        store.give_back_slot(&first).await.unwrap(),
        "given back by its holder"
    );
    assert!(
        !store.give_back_slot(&first).await.unwrap(),
        "not held any more"
    );
    let third = store
        .take_slot(request(2, "c", 1))
        .await
        .unwrap()
        .expect("the freed slot");
    assert_eq!(third.index, first.index);

    // The second slot is renewed past its first expiry; the third is not.
    let renewed = store
        .renew_slots(std::slice::from_ref(&second), at(20).saturating_add(LEASE))
        .await
        .unwrap();
    assert_eq!(renewed, 1);
    let after_expiry = LEASE.as_secs() as i64 + 5;
    let fourth = store
        .take_slot(request(2, "d", after_expiry))
        .await
        .unwrap()
        .expect("the expired slot");
    assert_eq!(fourth.index, third.index, "only the expired slot is free");
    assert_eq!(
        store
            .take_slot(request(2, "e", after_expiry))
            .await
            .unwrap(),
        None,
        "the renewed slot is still held"
    );
    assert_eq!(
        store
            .renew_slots(
                std::slice::from_ref(&third),
                at(after_expiry).saturating_add(LEASE),
            )
            .await
            .unwrap(),
        0,
        "an expired holder renews nothing"
    );
    assert!(
        !store.give_back_slot(&third).await.unwrap(),
        "an expired holder gives nothing back"
    );
    assert!(
        store.give_back_slot(&fourth).await.unwrap(),
        "its new holder does"
    );
}

/// Asks for `wanted` starts of `handler`, of 5 a window.
fn starts(handler: &str, wanted: u32, interval: Duration, now: Timestamp) -> StartsRequest<'_> {
    StartsRequest {
        handler,
        wanted,
        rate: 5,
        interval,
        now,
    }
}

/// `take_starts`: a window grants at most `rate` starts in all, however they are asked for,
/// and says when it ends; the next window grants afresh.
pub async fn a_window_grants_at_most_its_rate<S: Store>(store: &S) {
    let interval = Duration::from_secs(10);
    let (granted, end) = store
        .take_starts(starts(PROJECTOR, 3, interval, at(1)))
        .await
        .unwrap();
    assert_eq!(granted, 3);
    assert_eq!(end, at(10), "windows start at multiples of the interval");
    let (granted, _) = store
        .take_starts(starts(PROJECTOR, 4, interval, at(2)))
        .await
        .unwrap();
    assert_eq!(granted, 2, "what the window has left");
    let (granted, end) = store
        .take_starts(starts(PROJECTOR, 1, interval, at(9)))
        .await
        .unwrap();
    assert_eq!(
        (granted, end),
        (0, at(10)),
        "the window is full until its end"
    );
    let (granted, end) = store
        .take_starts(starts(PROJECTOR, 4, interval, at(10)))
        .await
        .unwrap();
    assert_eq!((granted, end), (4, at(20)), "the next window grants afresh");
    let (granted, _) = store
        .take_starts(starts("mailer", 5, interval, at(10)))
        .await
        .unwrap();
    assert_eq!(granted, 5, "each handler has its own counter");
}
