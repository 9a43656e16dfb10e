//! Idempotent requests: a key taken by one transaction at a time, its answer committed with
//! that transaction or not at all, expired answers replaced and purged.

use relaybus::{
    Error, PurgeOptions, Store,
    store::{RequestKey, RequestKeyState, StoredResponse},
};

use super::at;

/// Opens a session with a started transaction.
async fn begun<S: Store>(store: &S) -> S::Session {
    let mut session = store.session().await.unwrap();
    store.begin(&mut session, None).await.unwrap();
    session
}

/// An answer of `fingerprint` given at `given`, kept until `expires`.
fn answer(fingerprint: &str, given: i64, expires: i64) -> StoredResponse {
    StoredResponse::new(
        fingerprint,
        201,
        vec![
            ("content-type".to_owned(), "application/json".to_owned()),
            ("x-order-id".to_owned(), "o-1".to_owned()),
        ],
        br#"{"order_id":"o-1"}"#.to_vec(),
        at(given),
        at(expires),
    )
}

/// Takes `key` in a transaction of its own and stores `response` in it, committed.
async fn answered<S: Store>(store: &S, key: &RequestKey<'_>, response: &StoredResponse) {
    let mut session = begun(store).await;
    let taken = store
        .take_request_key(&mut session, key, response.created_at)
        .await;
    assert_eq!(taken.unwrap(), RequestKeyState::Taken, "{}", S::NAME);
    store
        .store_response(&mut session, key, response)
        .await
        .unwrap();
    store.commit(&mut session).await.unwrap();
}

/// One open transaction holds a key: another finds it running until the first ends; after an
/// abort it is free, after a commit its answer is found as stored. The scope (method, route,
/// caller) is part of the key. Malformed keys are refused.
pub async fn a_request_key_is_held_by_one_transaction<S: Store>(store: &S) {
    let key = RequestKey::new("k-1", "POST", "/orders");
    let mut first = begun(store).await;
    let taken = store
        .take_request_key(&mut first, &key, at(0))
        .await
        .unwrap();
    assert_eq!(taken, RequestKeyState::Taken, "{}", S::NAME);

    let mut second = begun(store).await;
    let running = store
        .take_request_key(&mut second, &key, at(0))
        .await
        .unwrap();
    assert_eq!(running, RequestKeyState::Running, "{}", S::NAME);
    store.abort(&mut second).await;

    // Another scope is another key.
    for other in [
        RequestKey::new("k-1", "PUT", "/orders"),
        RequestKey::new("k-1", "POST", "/carts"),
        key.caller(Some("alice")),
    ] {
        let mut session = begun(store).await;
        let state = store
            .take_request_key(&mut session, &other, at(0))
            .await
            .unwrap();
        assert_eq!(state, RequestKeyState::Taken, "{}: {other:?}", S::NAME);
        store.abort(&mut session).await;
    }

    // Aborted: nothing stored, the key is free.
    store.abort(&mut first).await;
    let response = answer("f-1", 1, 100);
    answered(store, &key, &response).await;

    let mut later = begun(store).await;
    let found = store
        .take_request_key(&mut later, &key, at(2))
        .await
        .unwrap();
    assert_eq!(found, RequestKeyState::Answered(response), "{}", S::NAME);
    store.abort(&mut later).await;

    let mut session = begun(store).await;
    for bad in ["", "é", "new\nline"] {
        let refused = store
            .take_request_key(
                &mut session,
                &RequestKey::new(bad, "POST", "/orders"),
                at(0),
            )
            .await;
        assert!(
            matches!(refused, Err(Error::InvalidArgument(_))),
            "{}: {bad:?} {refused:?}",
            S::NAME
        );
    }
    store.abort(&mut session).await;
}

/// An answer past its expiry is no answer: the key is taken again and the new answer replaces
/// it. Purge deletes the expired answers at the time it is given, and only those.
pub async fn expired_request_keys_are_replaced_and_purged<S: Store>(store: &S) {
    let old = RequestKey::new("k-old", "POST", "/orders");
    let new = RequestKey::new("k-new", "POST", "/orders");
    answered(store, &old, &answer("f-old", 0, 10)).await;
    answered(store, &new, &answer("f-new", 0, 100)).await;

    let nothing = store.purge(&PurgeOptions::new()).await.unwrap();
    assert_eq!(nothing.request_keys, 0, "{}: no time given", S::NAME);
    let purged = store
        .purge(&PurgeOptions::new().request_keys_expired_at(at(50)))
        .await
        .unwrap();
    assert_eq!(purged.request_keys, 1, "{}: {purged:?}", S::NAME);

    let mut session = begun(store).await;
    let kept = store
        .take_request_key(&mut session, &new, at(50))
        .await
        .unwrap();
    assert_eq!(
        kept,
        RequestKeyState::Answered(answer("f-new", 0, 100)),
        "{}",
        S::NAME
    );
    let gone = store
        .take_request_key(&mut session, &old, at(50))
        .await
        .unwrap();
    assert_eq!(gone, RequestKeyState::Taken, "{}", S::NAME);
    store.abort(&mut session).await;

    // Expired but not purged yet: taken again, and replaced.
    let mut session = begun(store).await;
    let expired = store
        .take_request_key(&mut session, &new, at(100))
        .await
        .unwrap();
    assert_eq!(expired, RequestKeyState::Taken, "{}", S::NAME);
    let replacement = answer("f-again", 100, 200);
    store
        .store_response(&mut session, &new, &replacement)
        .await
        .unwrap();
    store.commit(&mut session).await.unwrap();
    let mut session = begun(store).await;
    let found = store
        .take_request_key(&mut session, &new, at(150))
        .await
        .unwrap();
    assert_eq!(found, RequestKeyState::Answered(replacement), "{}", S::NAME);
    store.abort(&mut session).await;
}
