//! Events, handlers and schedules declared only through `#[event]`, `#[handler]` and
//! `#[schedule]`, in three modules, found through the registry and run end to end on a real
//! replica set (the schedules on the memory store).
//!
//! The registry is global to the binary, so every test here sees the same handlers. Those whose
//! deliveries the end-to-end test runs record their calls in [`CALLS`], keyed by order id so
//! that the tests do not read each other's calls.

use std::{
    sync::{Mutex, OnceLock},
    time::{Duration, Instant},
};

use mongodb::{
    Database,
    bson::{Document, doc},
};
use relaybus::{
    ConfigurationError, Event, EventEnvelope, HandlerContext, RelayBus, RetryPolicy, registry,
};
use relaybus_harness::test_db;
use relaybus_tests::support::{all, store};

/// Calls of the handlers: (handler id, order id, attempt).
static CALLS: Mutex<Vec<(&'static str, String, u32)>> = Mutex::new(Vec::new());

/// The database of the end-to-end test, where the projector writes its read model. Handlers are
/// plain functions, so what they need beyond the event and its context comes from the program's
/// own state.
static DATABASE: OnceLock<Database> = OnceLock::new();

fn record(handler: &'static str, order_id: &str, context: &HandlerContext) {
    CALLS
        .lock()
        .unwrap()
        .push((handler, order_id.to_owned(), context.attempt()));
}

fn calls_for(order_id: &str) -> Vec<(&'static str, u32)> {
    let mut calls: Vec<_> = CALLS
        .lock()
        .unwrap()
        .iter()
        .filter(|(_, order, _)| order == order_id)
        .map(|(handler, _, attempt)| (*handler, *attempt))
        .collect();
    calls.sort();
    calls
}

/// The orders side: an event and a transactional projector.
mod orders {
    use mongodb::bson::doc;
    use relaybus::{BoxError, HandlerContext};
    use serde::{Deserialize, Serialize};

    #[relaybus::event("macros.order.placed.v1")]
    #[derive(Debug, Clone, Serialize, Deserialize)]
    pub(crate) struct OrderPlaced {
        pub(crate) order_id: String,
        pub(crate) total_cents: u64,
    }

    /// Writes the order's total to a read model in the transaction that completes the delivery.
    #[relaybus::handler(id = "macros.projector", transactional)]
    pub(crate) async fn project(
        event: OrderPlaced,
        context: HandlerContext,
    ) -> Result<(), BoxError> {
        super::record("macros.projector", &event.order_id, &context);
        let mut session = context.session().await?;
        let totals = super::DATABASE
            .get()
            .ok_or("the test sets the database before running handlers")?
            .collection::<mongodb::bson::Document>("order_totals");
        totals
            .insert_one(doc! { "_id": &event.order_id, "total_cents": event.total_cents as i64 })
            .session(&mut *session)
            .await?;
        Ok(())
    }
}

/// The mailing side, in a module of its own: an event of its own and two handlers, one of them
/// for the orders' event, with a retry override and an error type of its own.
mod mailing {
    use std::fmt;

    use relaybus::HandlerContext;
    use serde::{Deserialize, Serialize};

    use crate::orders::OrderPlaced;

    #[relaybus::event("macros.order.shipped.v1")]
    #[derive(Debug, Clone, Serialize, Deserialize)]
    pub(crate) struct OrderShipped {
        pub(crate) order_id: String,
    }

    #[derive(Debug)]
    pub(crate) struct MailError;

    impl fmt::Display for MailError {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("the mail server is busy")
        }
    }

    impl std::error::Error for MailError {}

    /// Fails its first attempt, as a busy mail server would. Mails of one order need no order
    /// among themselves: unordered.
    #[relaybus::handler(
        id = "macros.mailer",
        unordered,
        max_attempts = 3,
        initial_backoff_ms = 20,
        max_backoff_ms = 200,
        timeout_ms = 5_000,
        global_concurrency = 8,
        rate_limit = 10_000,
        rate_interval_ms = 2_000
    )]
    pub(crate) async fn send_confirmation(
        event: OrderPlaced,
        context: HandlerContext,
    ) -> Result<(), MailError> {
        super::record("macros.mailer", &event.order_id, &context);
        if context.attempt() == 1 {
            Err(MailError)
        } else {
            Ok(())
        }
    }

    /// Takes the event alone.
    #[relaybus::handler(id = "macros.shipping-notice")]
    pub(crate) async fn notify_shipping(event: OrderShipped) -> relaybus::Result<()> {
        CALLS_WITHOUT_CONTEXT.lock().unwrap().push(event.order_id);
        Ok(())
    }

    /// Calls of the handler that takes no context.
    pub(crate) static CALLS_WITHOUT_CONTEXT: std::sync::Mutex<Vec<String>> =
        std::sync::Mutex::new(Vec::new());
}

/// The reports side: schedules declared with `#[schedule]`, publishing an event no handler
/// takes (the other tests' buses run them too).
mod reports {
    use relaybus::{Tick, Timestamp};
    use serde::{Deserialize, Serialize};

    #[relaybus::event("macros.report.due.v1")]
    #[derive(Debug, Clone, Serialize, Deserialize)]
    pub(crate) struct ReportDue {
        pub(crate) at: Timestamp,
    }

    /// At midnight on New Year's Day in Paris.
    #[relaybus::schedule(
        id = "macros.yearly-report",
        cron = "0 0 0 1 1 *",
        time_zone = "Europe/Paris"
    )]
    pub(crate) fn yearly_report(tick: Tick) -> ReportDue {
        ReportDue { at: tick.at() }
    }

    /// Every day at midnight UTC, each missed day published, up to 3.
    #[relaybus::schedule(
        id = "macros.daily-report",
        every_ms = 86_400_000,
        each_missed = 3,
        catch_up_ms = 259_200_000
    )]
    pub(crate) fn daily_report(tick: Tick) -> ReportDue {
        ReportDue { at: tick.at() }
    }
}

use mailing::OrderShipped;
use orders::OrderPlaced;

#[test]
fn the_registry_lists_what_the_macros_declared() {
    let events: Vec<_> = registry::events()
        .map(|e| (e.type_name(), e.rust_type()))
        .collect();
    assert_eq!(
        events,
        [
            ("macros.order.placed.v1", "macros::orders::OrderPlaced"),
            ("macros.order.shipped.v1", "macros::mailing::OrderShipped"),
            ("macros.report.due.v1", "macros::reports::ReportDue"),
        ]
    );
    assert_eq!(
        registry::event("macros.order.shipped.v1").map(|e| e.rust_type()),
        Some("macros::mailing::OrderShipped")
    );
    assert_eq!(OrderPlaced::TYPE, "macros.order.placed.v1");

    let handlers: Vec<_> = registry::handlers()
        .map(|h| (h.id(), h.event_type(), h.rust_path(), h.is_transactional()))
        .collect();
    assert_eq!(
        handlers,
        [
            (
                "macros.mailer",
                "macros.order.placed.v1",
                "macros::mailing::send_confirmation",
                false
            ),
            (
                "macros.projector",
                "macros.order.placed.v1",
                "macros::orders::project",
                true
            ),
            (
                "macros.shipping-notice",
                "macros.order.shipped.v1",
                "macros::mailing::notify_shipping",
                false
            ),
        ]
    );
    let retry: Vec<_> = registry::handlers().map(|h| h.retry_policy()).collect();
    assert_eq!(
        retry,
        [
            Some(
                RetryPolicy::new(3)
                    .initial_backoff(Duration::from_millis(20))
                    .max_backoff(Duration::from_millis(200))
            ),
            None,
            None,
        ]
    );
    let timeouts: Vec<_> = registry::handlers().map(|h| h.timeout()).collect();
    assert_eq!(timeouts, [Some(Duration::from_secs(5)), None, None]);
    let limits: Vec<_> = registry::handlers()
        .map(|h| {
            let subscription = h.subscription();
            (
                h.global_concurrency(),
                h.rate_limit(),
                subscription.global_concurrency_limit(),
                subscription.rate(),
            )
        })
        .collect();
    let mailer_rate = Some((10_000, Duration::from_secs(2)));
    assert_eq!(
        limits,
        [
            (Some(8), mailer_rate, Some(8), mailer_rate),
            (None, None, None, None),
            (None, None, None, None),
        ]
    );
    let unordered: Vec<_> = registry::handlers().map(|h| h.is_unordered()).collect();
    assert_eq!(unordered, [true, false, false]);
    assert_eq!(registry::check(), Ok(()));
}

#[tokio::test]
async fn handlers_stay_plain_functions() {
    let shipped = OrderShipped {
        order_id: "plain-1".into(),
    };
    mailing::notify_shipping(shipped.clone()).await.unwrap();
    assert!(
        mailing::CALLS_WITHOUT_CONTEXT
            .lock()
            .unwrap()
            .contains(&"plain-1".to_owned())
    );

    let placed = OrderPlaced {
        order_id: "plain-2".into(),
        total_cents: 1,
    };
    let context = HandlerContext::detached(&EventEnvelope::new(&placed).unwrap(), "macros.mailer");
    assert!(
        mailing::send_confirmation(placed.clone(), context.clone())
            .await
            .is_err(),
        "attempt 1 fails"
    );
    // The projector needs a transaction, which a detached context does not have.
    let error = orders::project(placed, context).await.unwrap_err();
    assert!(
        error
            .to_string()
            .contains("not subscribed as transactional"),
        "{error}"
    );
}

#[tokio::test]
async fn the_builder_subscribes_registered_handlers_unless_told_otherwise() {
    let db = test_db("macros-builder").await;
    let store = store(&db).await;

    let bus = RelayBus::builder(store.clone()).build().unwrap();
    let ids: Vec<_> = bus.subscriptions().iter().map(|s| s.id()).collect();
    assert_eq!(
        ids,
        [
            "macros.mailer",
            "macros.projector",
            "macros.shipping-notice"
        ]
    );
    assert_eq!(
        bus.handlers_for(OrderPlaced::TYPE),
        ["macros.mailer", "macros.projector"]
    );
    let projector = &bus.subscriptions()[1];
    assert!(projector.is_transactional());
    assert!(!projector.is_unordered());
    assert!(
        bus.subscriptions()[0].is_unordered(),
        "the attribute's `unordered` reaches the subscription"
    );
    assert_eq!(
        bus.subscriptions()[0].retry_policy(),
        Some(
            &RetryPolicy::new(3)
                .initial_backoff(Duration::from_millis(20))
                .max_backoff(Duration::from_millis(200))
        )
    );
    assert_eq!(
        bus.subscriptions()[0].attempt_timeout(),
        Some(Duration::from_secs(5)),
        "the attribute's timeout reaches the subscription"
    );

    let none = RelayBus::builder(store.clone())
        .without_registered_handlers()
        .build()
        .unwrap();
    assert!(none.subscriptions().is_empty());

    let mailing_only = RelayBus::builder(store.clone())
        .registered_handlers_where(|h| h.rust_path().starts_with("macros::mailing::"))
        .build()
        .unwrap();
    let ids: Vec<_> = mailing_only
        .subscriptions()
        .iter()
        .map(|s| s.id())
        .collect();
    assert_eq!(ids, ["macros.mailer", "macros.shipping-notice"]);

    // Picking handlers one by one after opting out.
    let picked = RelayBus::builder(store.clone())
        .without_registered_handlers()
        .subscribe(
            registry::handlers()
                .find(|h| h.id() == "macros.projector")
                .unwrap()
                .subscription(),
        )
        .build()
        .unwrap();
    assert!(picked.subscriptions()[0].is_transactional());

    // A subscription by hand that takes a registered id is refused, naming both.
    let clash = relaybus::Subscription::new(
        "macros.projector",
        |_: OrderShipped, _: HandlerContext| async { Ok::<(), relaybus::BoxError>(()) },
    );
    let error = RelayBus::builder(store.clone())
        .subscribe(clash.clone())
        .build()
        .unwrap_err();
    match &error {
        ConfigurationError::DuplicateHandlerId { id, first, second } => {
            assert_eq!(id, "macros.projector");
            assert!(first.contains("macros::orders::project"), "{first}");
            assert!(second.contains("macros::mailing::OrderShipped"), "{second}");
        }
        other => panic!("expected a duplicate handler id, got {other:?}"),
    }
    // Without the registered projector, the same subscription is fine.
    RelayBus::builder(store)
        .registered_handlers_where(|h| h.id() != "macros.projector")
        .subscribe(clash)
        .build()
        .unwrap();
}

#[tokio::test]
async fn registered_handlers_run_end_to_end() {
    let db = test_db("macros").await;
    DATABASE
        .set(db.db())
        .expect("only this test sets the database");
    let store = store(&db).await;
    let bus = RelayBus::builder(store)
        .lease_duration(Duration::from_secs(10))
        .build()
        .unwrap();

    // Publish in the caller's transaction, next to the business data.
    let orders = db.db().collection::<Document>("orders");
    let placed = bus
        .transaction(async |session| {
            orders
                .insert_one(doc! { "_id": "e2e-1" })
                .session(&mut *session)
                .await?;
            bus.publish(&OrderPlaced {
                order_id: "e2e-1".into(),
                total_cents: 1250,
            })
            .key("e2e-1")
            .session(session)
            .await
        })
        .await
        .unwrap();
    assert_eq!(placed.new_deliveries, ["macros.mailer", "macros.projector"]);
    let shipped = bus
        .publish(&OrderShipped {
            order_id: "e2e-1".into(),
        })
        .key("e2e-1")
        .await
        .unwrap();
    assert_eq!(shipped.new_deliveries, ["macros.shipping-notice"]);

    // One delivery per registered handler of each event.
    let mut pending: Vec<(String, String)> = all(&db, "relaybus_deliveries")
        .await
        .iter()
        .map(|d| {
            (
                d.get_str("eventType").unwrap().to_owned(),
                d.get_str("handler").unwrap().to_owned(),
            )
        })
        .collect();
    pending.sort();
    assert_eq!(
        pending,
        [
            ("macros.order.placed.v1".into(), "macros.mailer".into()),
            ("macros.order.placed.v1".into(), "macros.projector".into()),
            (
                "macros.order.shipped.v1".into(),
                "macros.shipping-notice".into()
            ),
        ]
    );

    // The unordered mailer's delivery keeps the key but is marked to ignore it; the
    // projector's is held to the key's order.
    let unordered: Vec<(String, bool, Option<String>)> = {
        let mut rows: Vec<_> = all(&db, "relaybus_deliveries")
            .await
            .iter()
            .map(|d| {
                (
                    d.get_str("handler").unwrap().to_owned(),
                    d.get_bool("unordered").unwrap_or(false),
                    d.get_str("key").ok().map(str::to_owned),
                )
            })
            .collect();
        rows.sort();
        rows
    };
    let key = Some("e2e-1".to_owned());
    assert_eq!(
        unordered,
        [
            ("macros.mailer".into(), true, key.clone()),
            ("macros.projector".into(), false, key.clone()),
            ("macros.shipping-notice".into(), false, key),
        ]
    );

    // Dispatch until every delivery is done; the mailer's retry waits 20 ms or so.
    let deadline = Instant::now() + Duration::from_secs(30);
    while !all(&db, "relaybus_deliveries").await.is_empty() {
        assert!(
            Instant::now() < deadline,
            "deliveries left: {:?}",
            all(&db, "relaybus_deliveries").await
        );
        bus.run_once().await.unwrap();
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    assert_eq!(
        calls_for("e2e-1"),
        [
            ("macros.mailer", 1),
            ("macros.mailer", 2),
            ("macros.projector", 1)
        ]
    );
    assert!(
        mailing::CALLS_WITHOUT_CONTEXT
            .lock()
            .unwrap()
            .contains(&"e2e-1".to_owned())
    );
    // The transactional projector's write committed with its delivery's completion.
    assert_eq!(
        all(&db, "order_totals").await,
        [doc! { "_id": "e2e-1", "total_cents": 1250_i64 }]
    );
}

/// A test bus on the memory store takes the registered handlers that can run there: a bus
/// given all of them refuses the MongoDB handlers, naming both stores, and `runs_on` picks the
/// one that takes its event alone.
#[test]
fn a_memory_bus_takes_the_registered_handlers_that_run_on_it() {
    use relaybus::{MemoryEventStore, MongoEventStore};

    match RelayBus::builder(MemoryEventStore::new()).build() {
        Err(ConfigurationError::HandlerOfAnotherStore {
            handler_store,
            bus_store,
            ..
        }) => assert_ne!(handler_store, bus_store),
        other => panic!("expected a handler of another store, got {other:?}"),
    }
    let bus = RelayBus::builder(MemoryEventStore::new())
        .registered_handlers_where(|handler| handler.runs_on::<MemoryEventStore>())
        .build()
        .unwrap();
    let ids: Vec<&str> = bus.subscriptions().iter().map(|s| s.id()).collect();
    assert_eq!(ids, ["macros.shipping-notice"]);
    let on_mongo = registry::handlers()
        .filter(|handler| handler.runs_on::<MongoEventStore>())
        .count();
    assert_eq!(on_mongo, registry::handlers().count(), "all run on MongoDB");
}

/// `#[schedule]` registers each schedule with its settings; every bus takes them unless told
/// otherwise, publishes their ticks, and refuses a schedule of its own under a registered id.
#[test]
fn registered_schedules_publish_their_ticks() {
    use relaybus::{MemoryEventStore, MissedTicks, Schedule, Tick, Timestamp, clock::TestClock};

    let declared: Vec<_> = registry::schedules()
        .map(|s| (s.id(), s.rust_path()))
        .collect();
    assert_eq!(
        declared,
        [
            ("macros.daily-report", "macros::reports::daily_report"),
            ("macros.yearly-report", "macros::reports::yearly_report"),
        ]
    );
    let yearly = registry::schedules().nth(1).unwrap().schedule();
    assert_eq!(yearly.cron_expression(), Some("0 0 0 1 1 *"));
    assert_eq!(yearly.zone(), Some("Europe/Paris"));
    assert_eq!(yearly.event_type(), "macros.report.due.v1");
    let daily = registry::schedules().next().unwrap().schedule();
    assert_eq!(daily.interval(), Some(Duration::from_secs(86_400)));
    assert_eq!(daily.missed_ticks(), MissedTicks::Each { max: 3 });
    assert_eq!(daily.catch_up_window(), Duration::from_secs(3 * 86_400));
    // The function stays a plain function.
    let at = Timestamp::parse_rfc3339("2030-01-01T00:00:00Z").unwrap();
    assert_eq!(reports::yearly_report(Tick::new("x", at)).at, at);

    // 2029-12-31T23:00Z is midnight in Paris, and the second daily tick of the window.
    let clock = TestClock::new(Timestamp::parse_rfc3339("2029-12-31T23:00:00Z").unwrap());
    let bus = RelayBus::builder(MemoryEventStore::new())
        .registered_handlers_where(|handler| handler.runs_on::<MemoryEventStore>())
        .clock(clock)
        .build()
        .unwrap();
    let ids: Vec<&str> = bus.schedules().map(|s| s.id()).collect();
    assert_eq!(ids, ["macros.daily-report", "macros.yearly-report"]);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let report = runtime.block_on(bus.publish_ticks()).unwrap();
    let published: Vec<(String, String)> = report
        .ticks
        .iter()
        .map(|tick| (tick.schedule.clone(), tick.at.to_string()))
        .collect();
    assert_eq!(
        published,
        [
            (
                "macros.daily-report".to_owned(),
                "2029-12-29T00:00:00.000Z".to_owned()
            ),
            (
                "macros.daily-report".to_owned(),
                "2029-12-30T00:00:00.000Z".to_owned()
            ),
            (
                "macros.daily-report".to_owned(),
                "2029-12-31T00:00:00.000Z".to_owned()
            ),
            (
                "macros.yearly-report".to_owned(),
                "2029-12-31T23:00:00.000Z".to_owned()
            ),
        ]
    );

    let without = RelayBus::builder(MemoryEventStore::new())
        .registered_handlers_where(|handler| handler.runs_on::<MemoryEventStore>())
        .without_registered_schedules()
        .build()
        .unwrap();
    assert_eq!(without.schedules().count(), 0);
    let twice = RelayBus::builder(MemoryEventStore::new())
        .registered_handlers_where(|handler| handler.runs_on::<MemoryEventStore>())
        .schedule(Schedule::every(
            "macros.daily-report",
            Duration::from_secs(60),
            reports::daily_report,
        ))
        .build();
    match twice {
        Err(ConfigurationError::DuplicateScheduleId { id, first, .. }) => {
            assert_eq!(id, "macros.daily-report");
            assert!(first.contains("macros::reports::daily_report"), "{first}");
        }
        other => panic!("expected a duplicate schedule id, got {other:?}"),
    }
}
