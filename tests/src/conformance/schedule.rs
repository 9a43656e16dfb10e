//! Scheduled events on every store: each tick published once across the buses of one
//! database, the missed-ticks policies, ticks across a change to daylight saving time, and a
//! restart in the middle of a tick. The buses run on a shared
//! [`TestClock`](relaybus::clock::TestClock), so nothing sleeps; the ticks' events are counted
//! through the deliveries of a handler every bus subscribes.

use std::time::Duration;

use relaybus::{
    BoxError, DeliveryQuery, Event, MissedTicks, RelayBus, Schedule, Store, Subscription, Tick,
    Timestamp, clock::TestClock,
};
use serde::{Deserialize, Serialize};

use super::{T0, at, list};

/// The event the tests' schedules publish.
#[derive(Debug, Serialize, Deserialize)]
pub struct Beat {
    /// The tick's time.
    pub at: Timestamp,
}

impl Event for Beat {
    const TYPE: &'static str = "schedule.beat.v1";
}

/// The handler every test bus subscribes to the ticks' events.
const COUNTER: &str = "beat-counter";

/// A schedule `id` every second.
fn every_second(id: &str) -> Schedule {
    Schedule::every(id, Duration::from_secs(1), |tick: Tick| Beat {
        at: tick.at(),
    })
}

/// A bus on `store` with `schedule`, on `clock`, subscribing [`COUNTER`].
fn bus<S: Store>(store: &S, clock: &TestClock, schedule: Schedule) -> RelayBus<S> {
    RelayBus::builder(store.clone())
        .without_registered_handlers()
        .without_registered_schedules()
        .clock(clock.clone())
        .subscribe(Subscription::new(COUNTER, |_: Beat| async {
            Ok::<(), BoxError>(())
        }))
        .schedule(schedule)
        .build()
        .unwrap_or_else(|e| panic!("{}: the bus builds: {e}", S::NAME))
}

/// The tick times whose events the store holds (one delivery each to [`COUNTER`]), sorted.
async fn published<S: Store>(store: &S, schedule: &str) -> Vec<Timestamp> {
    let prefix = format!("schedule:{schedule}:");
    let mut ticks: Vec<Timestamp> = list(store, DeliveryQuery::new().handler(COUNTER))
        .await
        .into_iter()
        .map(|record| {
            let time = record
                .event_id
                .strip_prefix(&prefix)
                .unwrap_or_else(|| panic!("{}: an event of another schedule", S::NAME));
            Timestamp::parse_rfc3339(time).expect("the tick's time in the event id")
        })
        .collect();
    ticks.sort();
    ticks
}

/// `T0 + millis`.
fn at_ms(millis: i64) -> Timestamp {
    Timestamp::from_millis(T0 + millis)
}

/// The ticks `from..to` seconds after `T0`.
fn seconds(range: std::ops::Range<i64>) -> Vec<Timestamp> {
    range.map(at).collect()
}

/// Three buses on one database run a schedule every second over 30 seconds of test clock,
/// each looking every quarter second, all three at once: 30 events, one per tick, whichever
/// bus appended each first.
pub async fn a_schedule_publishes_each_tick_once_across_three_buses<S: Store>(store: &S) {
    three_buses_publish_each_tick_once([store.clone(), store.clone(), store.clone()]).await;
}

/// [`a_schedule_publishes_each_tick_once_across_three_buses`] with the buses on two store
/// instances, as two processes open the database.
pub async fn a_schedule_publishes_each_tick_once_across_instances<S: Store>(first: &S, second: &S) {
    three_buses_publish_each_tick_once([first.clone(), second.clone(), first.clone()]).await;
}

async fn three_buses_publish_each_tick_once<S: Store>(stores: [S; 3]) {
    let clock = TestClock::new(at(0));
    let buses: Vec<RelayBus<S>> = stores
        .iter()
        .map(|store| bus(store, &clock, every_second("beat")))
        .collect();
    let mut created = 0;
    let mut appended = 0;
    // 0 to 29.75 s: the ticks at 0, 1, .., 29 s.
    for quarter in 0..120 {
        clock.advance_to(at_ms(quarter * 250));
        let reports = futures::future::join_all(buses.iter().map(|bus| bus.publish_ticks())).await;
        for report in reports {
            let report = report.unwrap_or_else(|e| panic!("{}: publish_ticks: {e}", S::NAME));
            created += report.created();
            appended += report.ticks.len();
        }
    }
    assert_eq!(created, 30, "{}: ticks made by the buses", S::NAME);
    assert_eq!(appended, 90, "{}: each bus appends each tick", S::NAME);
    assert_eq!(
        published(&stores[0], "beat").await,
        seconds(0..30),
        "{}: one event per tick",
        S::NAME
    );
}

/// Ticks missed while no bus ran, under [`MissedTicks::Latest`]: a bus that looks again after
/// 10 seconds publishes only the latest; a new bus (a restart) after 100 seconds too.
pub async fn missed_ticks_latest_publishes_only_the_latest<S: Store>(store: &S) {
    let clock = TestClock::new(at(0));
    let first = bus(
        store,
        &clock,
        every_second("latest").missed(MissedTicks::Latest),
    );
    assert_eq!(first.publish_ticks().await.unwrap().created(), 1);
    clock.advance_to(at_ms(10_500));
    let report = first.publish_ticks().await.unwrap();
    assert_eq!(report.created(), 1, "{}", S::NAME);
    assert_eq!(report.ticks[0].at, at(10));
    assert_eq!(report.next_tick, Some(at(11)));
    drop(first);

    clock.advance_to(at_ms(110_500));
    let restarted = bus(
        store,
        &clock,
        every_second("latest").missed(MissedTicks::Latest),
    );
    assert_eq!(restarted.publish_ticks().await.unwrap().created(), 1);
    assert_eq!(
        published(store, "latest").await,
        [at(0), at(10), at(110)],
        "{}",
        S::NAME
    );
}

/// Ticks missed while no bus ran, under [`MissedTicks::Each`]: each missed tick, but only the
/// latest `max`; ticks a restarted bus finds published already are absorbed.
pub async fn missed_ticks_each_publishes_each_up_to_the_bound<S: Store>(store: &S) {
    let each = || every_second("each").missed(MissedTicks::Each { max: 5 });
    let clock = TestClock::new(at(0));
    let first = bus(store, &clock, each());
    // The first look publishes the latest 5 ticks within the catch-up window.
    assert_eq!(first.publish_ticks().await.unwrap().created(), 5);
    clock.advance_to(at(3));
    assert_eq!(first.publish_ticks().await.unwrap().created(), 3);
    drop(first);

    // Down from 3 to 20 s: 17 ticks missed, the latest 5 published.
    clock.advance_to(at_ms(20_200));
    let restarted = bus(store, &clock, each());
    let report = restarted.publish_ticks().await.unwrap();
    assert_eq!(report.created(), 5, "{}", S::NAME);
    assert_eq!(
        report.ticks.iter().map(|t| t.at).collect::<Vec<_>>(),
        seconds(16..21)
    );
    // Another restart at once finds them all published.
    let again = bus(store, &clock, each());
    let report = again.publish_ticks().await.unwrap();
    assert_eq!(
        (report.ticks.len(), report.created()),
        (5, 0),
        "{}",
        S::NAME
    );

    let mut expected = seconds(-4..4);
    expected.extend(seconds(16..21));
    assert_eq!(published(store, "each").await, expected, "{}", S::NAME);
}

/// A cron schedule in a named zone keeps to its wall clock across daylight saving changes:
/// 02:30 every day in Paris ticks at 03:00 on the day 02:30 does not exist, and once on the
/// day it happens twice; an hourly one ticks 25 times on the long day.
pub async fn cron_ticks_follow_the_zone_across_daylight_saving<S: Store>(store: &S) {
    let daily = Schedule::cron("paris-daily", "0 30 2 * * *", |tick: Tick| Beat {
        at: tick.at(),
    })
    .time_zone("Europe/Paris")
    .missed(MissedTicks::Each { max: 10 })
    .catch_up_within(Duration::from_secs(2 * 3_600));
    let t = |text: &str| Timestamp::parse_rfc3339(text).expect("a valid time");
    // Paris went to summer time on 2030-03-31 at 02:00, and back on 2030-10-27 at 03:00.
    let clock = TestClock::new(t("2030-03-29T22:00:00Z"));
    let bus_a = bus(store, &clock, daily.clone());
    while clock.now() < t("2030-04-01T22:00:00Z") {
        bus_a.publish_ticks().await.unwrap();
        clock.advance(Duration::from_secs(1_800));
    }
    clock.advance_to(t("2030-10-25T22:00:00Z"));
    let bus_b = bus(store, &clock, daily);
    while clock.now() < t("2030-10-28T22:00:00Z") {
        bus_b.publish_ticks().await.unwrap();
        clock.advance(Duration::from_secs(1_800));
    }
    let texts: Vec<String> = published(store, "paris-daily")
        .await
        .iter()
        .map(ToString::to_string)
        .collect();
    assert_eq!(
        texts,
        [
            "2030-03-30T01:30:00.000Z",
            "2030-03-31T01:00:00.000Z",
            "2030-04-01T00:30:00.000Z",
            "2030-10-26T00:30:00.000Z",
            "2030-10-27T00:30:00.000Z",
            "2030-10-28T01:30:00.000Z",
        ],
        "{}",
        S::NAME
    );

    let hourly = Schedule::cron("paris-hourly", "0 0 * * * *", |tick: Tick| Beat {
        at: tick.at(),
    })
    .time_zone("Europe/Paris");
    let clock = TestClock::new(t("2030-10-26T22:00:00Z"));
    let bus_c = bus(store, &clock, hourly);
    bus_c.publish_ticks().await.unwrap();
    let mut created = 0;
    // Midnight to midnight in Paris on 2030-10-27: 25 hours.
    while clock.now() < t("2030-10-27T23:00:00Z") {
        clock.advance(Duration::from_secs(600));
        created += bus_c.publish_ticks().await.unwrap().created();
    }
    assert_eq!(created, 25, "{}: the hours of the long day", S::NAME);
}

/// A restart in the middle of a tick: a bus whose append of the tick did not commit (its
/// process died) leaves the tick to whichever bus looks next, which publishes it once; a bus
/// restarted after its tick committed appends it again and adds nothing. The ticks after
/// follow, each once.
pub async fn a_restart_in_the_middle_of_a_tick_publishes_it_once<S: Store>(store: &S) {
    let clock = TestClock::new(at_ms(4_999));
    let schedule = || every_second("restart");
    let first = bus(store, &clock, schedule());
    assert_eq!(first.publish_ticks().await.unwrap().created(), 1); // 4 s.

    // At 5 s the first bus appends the tick in its transaction and dies before the commit.
    clock.advance_to(at(5));
    let tick = Tick::new("restart", at(5));
    let envelope = relaybus::EventEnvelope::new(&Beat { at: tick.at() })
        .and_then(|e| e.with_id(tick.event_id()))
        .expect("a valid event");
    let mut session = store.session().await.expect("a session");
    store.begin(&mut session, None).await.expect("begin");
    first
        .publish_envelope(envelope)
        .session(&mut session)
        .await
        .expect("the append in the open transaction");
    drop(first);
    store.abort(&mut session).await;
    drop(session);

    // Its replacement starts in the same second and publishes the tick; another replacement
    // (the first bus's process restarted once more) finds it published.
    clock.advance_to(at_ms(5_400));
    let second = bus(store, &clock, schedule());
    let report = second.publish_ticks().await.unwrap();
    assert_eq!(
        (report.ticks.len(), report.created()),
        (1, 1),
        "{}: the tick whose commit never came",
        S::NAME
    );
    let third = bus(store, &clock, schedule());
    let report = third.publish_ticks().await.unwrap();
    assert_eq!(
        (report.ticks.len(), report.created()),
        (1, 0),
        "{}: the tick published already",
        S::NAME
    );
    for second_of in 6..10 {
        clock.advance_to(at(second_of));
        let created: usize = [&second, &third]
            .into_iter()
            .map(|bus| bus.publish_ticks())
            .collect::<futures::future::JoinAll<_>>()
            .await
            .into_iter()
            .map(|report| report.unwrap().created())
            .sum();
        assert_eq!(created, 1, "{}: tick {second_of}", S::NAME);
    }
    assert_eq!(
        published(store, "restart").await,
        seconds(4..10),
        "{}",
        S::NAME
    );
    // The schedule's status names the last tick published and the next.
    let status = third.schedule_statuses().await.unwrap();
    assert_eq!(status.len(), 1);
    assert_eq!(status[0].last_tick, Some(at(9)), "{}", S::NAME);
    assert_eq!(status[0].next_tick, Some(at(10)));
}
