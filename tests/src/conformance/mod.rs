//! The store conformance suite: what every [`Store`] must do, written once against the trait
//! and run for every store.
//!
//! Each test is a generic `async fn <behaviour><S: Store>(store: &S)` that uses the trait alone
//! (plus [`relaybus::store::transaction::run`]; the schedule tests use buses on the store, which
//! is how schedules reach it) and documents the contract it checks. Every call
//! takes an explicit clock (seconds after `T0`, a time in 2030), so due times and lease expiries
//! are the test's to choose and nothing sleeps. One clock is not the test's: an event's creation
//! time is the wall clock of `EventEnvelope::from_json`, which retention compares with purge
//! cutoffs; `T0` lies after it. [`conformance_tests!`](crate::conformance_tests) turns
//! the suite into one `#[tokio::test]` per behaviour for a store; the list of tests lives there
//! and only there.
//!
//! ```text
//! // tests/tests/stores/conformance/mod.rs
//! async fn mongo_store(test: &'static str) -> (MongoEventStore, TestDb) { .. }
//! async fn second_instance(db: &TestDb) -> MongoEventStore { .. }
//!
//! relaybus_tests::conformance_tests!(mongo_store, second_instance);
//! ```
//!
//! The first argument opens a fresh, set-up store on a database of its own, named after the
//! test (so the tests run in parallel), and returns it with a guard that lives as long as the
//! test (a test database, a temporary directory, or `()`). The optional second argument opens a
//! second instance of the store on the guard's database, as a second process would.
//!
//! # What a store may skip
//!
//! Only the `_instances` tests, which need two store instances on one database (two processes):
//! a store that lives in one process (an in-memory store) has no second instance and leaves
//! them out by passing one argument to the macro. They are:
//!
//! - [`takeover_fences_and_charges_across_instances`]
//! - [`restarted_owner_waits_for_its_lease_across_instances`]
//! - [`concurrent_claims_never_share_a_delivery_across_instances`]
//! - [`relinquish_hands_back_across_instances`]
//! - [`one_instance_leads_a_role_at_a_time_across_instances`]
//! - [`a_kept_lead_fences_transactions_across_instances`]
//! - [`a_schedule_publishes_each_tick_once_across_instances`]
//!
//! Every other test runs for every store. Skipped today: none for MongoDB; all seven for the
//! in-memory store (`relaybus::store::memory`), which lives in one process and has no second
//! instance to open. Takeover, fencing and hand-back between owners of one store instance are
//! checked for it by the other tests.
//!
//! # What the suite leaves to each store
//!
//! How a store implements leases and per-key order (MongoDB's lanes and parking), completion
//! history, the exact bounds of its input checks, and whether an expired lease that nobody took
//! over is still honoured are not part of the contract; the store's own tests cover them. In
//! particular the suite never expects one owner to claim what another owner's claim may hold a
//! lease near (MongoDB leases lanes, not deliveries): a second owner claims only after the first
//! one's lease expired or was handed back.

mod append;
mod claim;
mod idempotency;
mod inspect;
mod instances;
mod limits;
mod operator;
mod schedule;
mod settle;
mod unordered;

use std::time::Duration;

use relaybus::{
    AppendRequest, Appended, DeliveryQuery, DeliveryRecord, EventEnvelope, Statistics, Store,
    Timestamp,
    store::{ClaimRequest, Claimed, StoreLease, transaction},
};
use serde_json::json;

pub use append::*;
pub use claim::*;
pub use idempotency::*;
pub use inspect::*;
pub use instances::*;
pub use limits::*;
pub use operator::*;
pub use schedule::*;
pub use settle::*;
pub use unordered::*;

/// Expands to one `#[tokio::test]` per conformance test for a store.
///
/// - `make_store`: an async function `fn(test: &'static str) -> (S, G)` that returns a fresh,
///   set-up store on a database of its own (named after `test`), and a guard kept alive until
///   the test ends.
/// - `second_instance` (optional): an async function `fn(&G) -> S` that opens another instance
///   of the store on the same database, as another process would. Without it the `_instances`
///   tests are left out (see the [module documentation](crate::conformance)).
///
/// The caller needs `tokio` (with the `macros` and `rt` features). To test several stores in one
/// file, call the macro once per store inside a `mod` of its own.
#[macro_export]
macro_rules! conformance_tests {
    ($make_store:expr $(,)?) => {
        $crate::conformance_tests!(@single $make_store;
            setup_is_idempotent,
            append_creates_one_delivery_per_handler,
            append_of_a_known_id_adds_only_new_handlers,
            append_of_a_known_id_with_another_type_is_refused,
            keyed_events_get_gapless_sequences_per_key,
            an_aborted_transaction_leaves_nothing,
            append_without_a_transaction_is_refused,
            begin_commit_and_abort_on_one_session,
            transaction_run_returns_the_value_or_aborts_on_error,
            claim_hands_out_due_deliveries_of_the_asked_handlers,
            a_claim_hands_out_the_event_as_appended,
            a_key_runs_one_delivery_at_a_time_in_sequence,
            the_next_of_a_key_comes_in_sequence_with_or_without_a_claim,
            a_failed_head_blocks_its_key_until_it_completes_or_is_buried,
            a_blocked_key_does_not_hide_other_work,
            an_expired_lease_taken_over_fences_the_first_owner,
            a_takeover_charges_the_lost_attempt,
            renew_holds_off_a_takeover,
            relinquish_hands_back_at_once,
            complete_reports_each_lease,
            release_gives_back_without_charging,
            reschedule_charges_and_delays,
            bury_makes_a_dead_letter_and_requeue_revives_it,
            failed_attempts_are_kept_across_a_requeue,
            bury_by_id_frees_a_stuck_key,
            requeue_waits_for_a_running_later_delivery_of_its_key,
            complete_in_transaction_commits_with_the_callers_writes,
            statistics_count_deliveries_by_state,
            handler_statistics_count_each_handlers_deliveries,
            gauge_statistics_count_as_handler_statistics,
            discard_deletes_dead_letters_only,
            list_deliveries_filters_and_pages,
            list_deliveries_filters_by_state_key_event_and_error,
            event_detail_has_the_event_and_every_delivery,
            lanes_show_holders_and_blocked_keys,
            dead_letter_groups_group_by_handler_and_error,
            purge_deletes_dead_letters_and_completed_events_by_cutoff,
            an_unordered_handler_gets_every_delivery_of_a_key_at_once,
            a_failed_unordered_delivery_holds_back_nothing_of_its_key,
            a_handler_added_as_unordered_ignores_the_key_of_a_known_event,
            a_schedule_publishes_each_tick_once_across_three_buses,
            missed_ticks_latest_publishes_only_the_latest,
            missed_ticks_each_publishes_each_up_to_the_bound,
            cron_ticks_follow_the_zone_across_daylight_saving,
            a_restart_in_the_middle_of_a_tick_publishes_it_once,
            a_request_key_is_held_by_one_transaction,
            expired_request_keys_are_replaced_and_purged,
            slots_are_held_one_taker_at_a_time,
            a_window_grants_at_most_its_rate,
        );
    };
    ($make_store:expr, $second_instance:expr $(,)?) => {
        $crate::conformance_tests!($make_store);
        $crate::conformance_tests!(@instances $make_store, $second_instance;
            takeover_fences_and_charges_across_instances,
            restarted_owner_waits_for_its_lease_across_instances,
            concurrent_claims_never_share_a_delivery_across_instances,
            relinquish_hands_back_across_instances,
            one_instance_leads_a_role_at_a_time_across_instances,
            a_kept_lead_fences_transactions_across_instances,
            a_schedule_publishes_each_tick_once_across_instances,
        );
    };
    (@single $make_store:expr; $($test:ident),+ $(,)?) => {
        $(
            #[::tokio::test]
            async fn $test() {
                let (store, _guard) = ($make_store)(::core::stringify!($test)).await;
                $crate::conformance::$test(&store).await;
            }
        )+
    };
    (@instances $make_store:expr, $second_instance:expr; $($test:ident),+ $(,)?) => {
        $(
            #[::tokio::test]
            async fn $test() {
                let (first, guard) = ($make_store)(::core::stringify!($test)).await;
                let second = ($second_instance)(&guard).await;
                $crate::conformance::$test(&first, &second).await;
            }
        )+
    };
}

/// The tests' epoch, in 2030: later than the wall-clock creation time of every event the tests
/// build, so that retention cutoffs on this clock apply to them.
pub(crate) const T0: i64 = 1_900_000_000_000;
/// The lease every claim asks for.
pub(crate) const LEASE: Duration = Duration::from_secs(30);
/// The handler most tests deliver to.
pub(crate) const PROJECTOR: &str = "projector";
/// A second handler.
pub(crate) const MAILER: &str = "mailer";
/// The event type of the tests.
pub(crate) const PLACED: &str = "order.placed.v1";

/// `T0 + seconds`: the explicit clock of every call.
pub(crate) fn at(seconds: i64) -> Timestamp {
    Timestamp::from_millis(T0 + seconds * 1000)
}

/// An `order.placed.v1` event with this id and, if given, this ordering key.
pub(crate) fn event(id: &str, key: Option<&str>) -> EventEnvelope {
    typed(PLACED, id, key)
}

/// An event of type `event_type` with this id and, if given, this ordering key.
pub(crate) fn typed(event_type: &str, id: &str, key: Option<&str>) -> EventEnvelope {
    let event = EventEnvelope::from_json(event_type, json!({ "order": id, "total_cents": 1250 }))
        .expect("valid event")
        .with_id(id)
        .expect("valid id");
    match key {
        Some(key) => event.with_key(key).expect("valid key"),
        None => event,
    }
}

/// Handler ids as the trait takes them.
pub(crate) fn names(handlers: &[&str]) -> Vec<String> {
    handlers.iter().map(|h| (*h).to_owned()).collect()
}

/// Appends `events` for `handlers`, due at `now`, in one transaction of
/// [`transaction::run`], and returns what the append did.
pub(crate) async fn publish<S: Store>(
    store: &S,
    events: &[EventEnvelope],
    handlers: &[&str],
    now: Timestamp,
) -> Vec<Appended> {
    publish_unordered(store, events, handlers, &[], now).await
}

/// Appends `events` for `handlers` as [`publish`] does, the handlers in `unordered` (a subset
/// of `handlers`) named unordered: their deliveries ignore the key.
pub(crate) async fn publish_unordered<S: Store>(
    store: &S,
    events: &[EventEnvelope],
    handlers: &[&str],
    unordered: &[&str],
    now: Timestamp,
) -> Vec<Appended> {
    let handlers = names(handlers);
    let unordered = names(unordered);
    let requests: Vec<AppendRequest<'_>> = events
        .iter()
        .map(|e| AppendRequest::new(e, &handlers).unordered(&unordered))
        .collect();
    transaction::run(store, None, async |session| {
        store.append(session, &requests, now).await
    })
    .await
    .unwrap_or_else(|e| panic!("{}: append failed: {e}", S::NAME))
}

/// Claims up to `limit` deliveries of `handlers` for `owner` at `now`, with a lease of
/// [`LEASE`].
pub(crate) async fn claim<S: Store>(
    store: &S,
    owner: &str,
    handlers: &[&str],
    limit: u32,
    now: Timestamp,
) -> Vec<Claimed<S::Lease>> {
    let handlers = names(handlers);
    store
        .claim(ClaimRequest {
            owner,
            handlers: &handlers,
            limit,
            lease_duration: LEASE,
            now,
        })
        .await
        .unwrap_or_else(|e| panic!("{}: claim failed: {e}", S::NAME))
}

/// The leases of a batch, in order.
pub(crate) fn leases<L: Clone>(batch: &[Claimed<L>]) -> Vec<L> {
    batch.iter().map(|c| c.lease.clone()).collect()
}

/// The event ids of a batch, sorted.
pub(crate) fn event_ids<L>(batch: &[Claimed<L>]) -> Vec<String> {
    let mut ids: Vec<String> = batch.iter().map(|c| c.event.id().to_owned()).collect();
    ids.sort();
    ids
}

/// The delivery id of a claimed delivery, as the operator API names it.
pub(crate) fn delivery_id<L: StoreLease>(claimed: &Claimed<L>) -> String {
    claimed.lease.delivery_id().to_string()
}

/// The store's statistics.
pub(crate) async fn statistics<S: Store>(store: &S) -> Statistics {
    store
        .statistics()
        .await
        .unwrap_or_else(|e| panic!("{}: statistics failed: {e}", S::NAME))
}

/// The first 1000 records `query` lists (whatever limit it had).
pub(crate) async fn list<S: Store>(store: &S, query: DeliveryQuery) -> Vec<DeliveryRecord> {
    store
        .list_deliveries(&query.limit(1000))
        .await
        .unwrap_or_else(|e| panic!("{}: list_deliveries failed: {e}", S::NAME))
}

/// Every pending and dead delivery.
pub(crate) async fn all_deliveries<S: Store>(store: &S) -> Vec<DeliveryRecord> {
    list(store, DeliveryQuery::new()).await
}

/// The pending or dead delivery of `event_id` to `handler`, if there is one.
pub(crate) async fn delivery<S: Store>(
    store: &S,
    event_id: &str,
    handler: &str,
) -> Option<DeliveryRecord> {
    list(store, DeliveryQuery::new().handler(handler))
        .await
        .into_iter()
        .find(|r| r.event_id == event_id)
}

/// Whether the store holds an event with this id: an append of it without handlers reports
/// it as not created. The check appends the event when it is missing.
pub(crate) async fn holds_event<S: Store>(store: &S, id: &str, event_type: &str) -> bool {
    let appended = publish(store, &[typed(event_type, id, None)], &[], at(0)).await;
    !appended[0].created
}
