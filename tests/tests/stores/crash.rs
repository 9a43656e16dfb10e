//! Crash recovery: a process killed with transactions open stops holding its keys once its
//! heartbeat expires, instead of for the server's `transactionLifetimeLimitSeconds`.

use std::{
    io::{BufRead, BufReader},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use futures::{TryStreamExt, future::join_all};
use mongodb::bson::{Document, doc};
use relaybus::{ConfigurationError, MongoEventStore};
use relaybus_harness::{TestDb, test_db};
use relaybus_tests::support::{all, placed, publisher};

const APP: &str = env!("CARGO_BIN_EXE_relaybus-crash-app");

/// The heartbeat expiry of the killed process and of the test's own store.
const HEARTBEAT: Duration = Duration::from_secs(2);
/// The target: the dead process's keys take publishes again within a lease duration...
const LEASE: Duration = Duration::from_secs(5);
/// ... with a margin for a busy two-core machine running other tests.
const MARGIN: Duration = Duration::from_secs(2);

fn store(db: &TestDb) -> MongoEventStore {
    MongoEventStore::builder(db.client.clone())
        .database(&db.name)
        .heartbeat_expiry(HEARTBEAT)
        .build()
        .expect("valid options")
}

async fn processes(db: &TestDb) -> Vec<Document> {
    all(db, "relaybus_processes").await
}

/// The server's own limit, after which it aborts a dead client's transactions anyway.
async fn transaction_lifetime_limit(db: &TestDb) -> Duration {
    let reply = db
        .client
        .database("admin")
        .run_command(doc! { "getParameter": 1, "transactionLifetimeLimitSeconds": 1 })
        .await
        .expect("getParameter");
    let seconds = match reply.get("transactionLifetimeLimitSeconds") {
        Some(mongodb::bson::Bson::Int32(n)) => u64::try_from(*n).unwrap_or(0),
        Some(mongodb::bson::Bson::Int64(n)) => u64::try_from(*n).unwrap_or(0),
        other => panic!("transactionLifetimeLimitSeconds: {other:?}"),
    };
    Duration::from_secs(seconds)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_process_killed_mid_load_frees_its_keys_within_the_lease_duration() {
    let db = test_db("crash_frees_keys").await;
    let store = store(&db);
    store.setup().await.unwrap();
    let limit = transaction_lifetime_limit(&db).await;
    assert!(
        limit > LEASE + MARGIN,
        "the server aborts dead transactions after {limit:?} anyway; the test needs a longer limit"
    );

    let mut command = Command::new(APP);
    command
        .args([
            db.uri.as_str(),
            db.name.as_str(),
            &HEARTBEAT.as_millis().to_string(),
            "4",
        ])
        .stdin(Stdio::null());
    let mut app = start_holding(command, "a transaction").await;

    // The application named the sessions of its transactions before it started them.
    let recorded = processes(&db).await;
    assert_eq!(recorded.len(), 1, "one process document: {recorded:?}");
    let sessions = recorded[0].get_array("sessions").unwrap().len();
    assert!(
        sessions >= 2,
        "the load and the held transaction: {recorded:?}"
    );

    relaybus_harness::kill_tied(&mut app);
    let killed = Instant::now();

    // Publish on every key the dead process was writing: the held one, whose counter its open
    // transaction holds, and the load's keys, whose transactions were cut off mid-flight.
    let bus = publisher(&store, &["projector"]);
    let orders = db.db().collection::<Document>("orders");
    let keys = ["held", "key-0", "key-1", "key-2", "key-3"];
    let took = join_all(keys.iter().map(|key| {
        let (bus, orders) = (bus.clone(), orders.clone());
        async move {
            let id = format!("after-{key}");
            let publisher = bus.clone();
            bus.transaction(async move |session| {
                orders
                    .insert_one(doc! { "_id": &id, "key": *key })
                    .session(&mut *session)
                    .await?;
                publisher
                    .publish(&placed(&id))
                    .key(*key)
                    .session(session)
                    .await?;
                Ok(())
            })
            .await
            .unwrap_or_else(|e| panic!("publish on {key} after the crash: {e}"));
            killed.elapsed()
        }
    }))
    .await;
    let worst = took.iter().max().copied().unwrap();
    eprintln!(
        "crash recovery: publishes on the dead process's {} keys succeeded {:?} after the kill \
         (each: {took:?}); heartbeat expiry {HEARTBEAT:?}, server limit {limit:?}",
        keys.len(),
        worst
    );
    assert!(
        worst <= LEASE + MARGIN,
        "the dead process's keys took publishes again only after {worst:?}"
    );

    // Its held transaction was aborted, never committed: the key's first event is ours.
    assert!(
        orders
            .find_one(doc! { "_id": "held" })
            .await
            .unwrap()
            .is_none(),
        "the held transaction's write must not survive"
    );
    let held: Vec<Document> = all(&db, "relaybus_events")
        .await
        .into_iter()
        .filter(|event| event.get_str("key") == Ok("held"))
        .collect();
    assert_eq!(held.len(), 1, "{held:?}");
    assert_eq!(held[0].get_i64("sequence").unwrap(), 1, "{held:?}");

    // The dead process's document is gone; only the test's own store beats. The sweep deletes
    // it right after killing its sessions, which let the publishes through: await its delete.
    let dead = recorded[0].get("_id").unwrap().clone();
    let mut deletes = db
        .db()
        .collection::<Document>("relaybus_processes")
        .watch()
        .pipeline([doc! { "$match": { "operationType": "delete", "documentKey._id": &dead } }])
        .await
        .unwrap();
    if processes(&db)
        .await
        .iter()
        .any(|p| p.get("_id") == Some(&dead))
    {
        tokio::time::timeout(LEASE + MARGIN, deletes.try_next())
            .await
            .expect("the dead process's document goes")
            .unwrap()
            .expect("a delete");
    }
    let left = processes(&db).await;
    assert_eq!(left.len(), 1, "{left:?}");
    assert_ne!(left[0].get("_id"), recorded[0].get("_id"));
    db.drop_database().await.unwrap();
}

#[tokio::test]
async fn a_dropped_store_takes_its_process_document_away() {
    let db = test_db("crash_dropped_store").await;
    let first = store(&db);
    first.setup().await.unwrap();
    first
        .transaction(async |_| Ok(()))
        .await
        .expect("a transaction");
    let recorded = processes(&db).await;
    assert_eq!(recorded.len(), 1, "{recorded:?}");
    assert_eq!(recorded[0].get_array("sessions").unwrap().len(), 1);
    drop(first);

    // Its sessions went back to the client's pool, where another store may take them: the
    // document must go, so that nobody kills them later.
    let gone = async {
        while !processes(&db).await.is_empty() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    tokio::time::timeout(HEARTBEAT * 2, gone)
        .await
        .expect("the dropped store's document is deleted within a beat");

    // Without crash recovery, nothing is recorded.
    let quiet = MongoEventStore::builder(db.client.clone())
        .database(&db.name)
        .crash_recovery(false)
        .build()
        .unwrap();
    quiet.transaction(async |_| Ok(())).await.unwrap();
    assert!(processes(&db).await.is_empty());
    db.drop_database().await.unwrap();
}

#[tokio::test]
async fn a_heartbeat_expiry_out_of_range_is_refused() {
    let db = test_db("crash_bad_expiry").await;
    for expiry in [
        Duration::ZERO,
        Duration::from_millis(999),
        Duration::from_secs(601),
    ] {
        let error = MongoEventStore::builder(db.client.clone())
            .database(&db.name)
            .heartbeat_expiry(expiry)
            .build()
            .unwrap_err();
        assert!(
            matches!(
                &error,
                ConfigurationError::InvalidOption {
                    option: "heartbeat_expiry",
                    ..
                }
            ),
            "{error:?}"
        );
        assert!(
            error.to_string().contains("1 second to 10 minutes"),
            "{error}"
        );
    }
}

/// Starts the application with `heartbeat`, stdin piped; its stdout lines arrive on the
/// receiver.
/// Starts the application and waits until it prints `holding` (what it holds named in
/// `what`), within a minute.
async fn start_holding(mut command: Command, what: &str) -> std::process::Child {
    command.stdout(Stdio::piped()).stderr(Stdio::inherit());
    let mut app = relaybus_harness::spawn_tied(command).expect("start the application");
    let stdout = app.stdout.take().expect("piped stdout");
    let holding = tokio::task::spawn_blocking(move || {
        BufReader::new(stdout)
            .lines()
            .map_while(Result::ok)
            .any(|line| line == "holding")
    });
    let held = tokio::time::timeout(Duration::from_secs(60), holding)
        .await
        .unwrap_or_else(|_| panic!("the application holds {what} within a minute"))
        .unwrap();
    assert!(held, "the application exited before it held {what}");
    app
}

fn start_app(
    db: &TestDb,
    heartbeat: Duration,
    extra: &[&str],
) -> (
    std::process::Child,
    tokio::sync::mpsc::UnboundedReceiver<String>,
) {
    let mut command = Command::new(APP);
    command
        .args([
            db.uri.as_str(),
            db.name.as_str(),
            &heartbeat.as_millis().to_string(),
            "4",
        ])
        .args(extra)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    let mut app = relaybus_harness::spawn_tied(command).expect("start the application");
    let stdout = app.stdout.take().expect("piped stdout");
    let (lines, received) = tokio::sync::mpsc::unbounded_channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if lines.send(line).is_err() {
                break;
            }
        }
    });
    (app, received)
}

/// Waits for the line `wanted` from the application, for at most a minute.
async fn line(lines: &mut tokio::sync::mpsc::UnboundedReceiver<String>, wanted: &str) -> String {
    let found = async {
        while let Some(line) = lines.recv().await {
            if line.starts_with(wanted) {
                return Some(line);
            }
        }
        None
    };
    tokio::time::timeout(Duration::from_secs(60), found)
        .await
        .unwrap_or_else(|_| panic!("no line {wanted:?} from the application within a minute"))
        .unwrap_or_else(|| panic!("the application exited before {wanted:?}"))
}

/// Publishes the order `id` on `key` in a transaction with its business document.
async fn place(
    bus: &relaybus::RelayBus,
    orders: &mongodb::Collection<Document>,
    id: &str,
    key: &str,
) {
    let key_name = key;
    let (publisher, orders, id, key) = (bus.clone(), orders.clone(), id.to_owned(), key.to_owned());
    bus.transaction(async move |session| {
        orders
            .insert_one(doc! { "_id": &id, "key": &key })
            .session(&mut *session)
            .await?;
        publisher
            .publish(&placed(&id))
            .key(key.clone())
            .session(session)
            .await?;
        Ok(())
    })
    .await
    .unwrap_or_else(|e| panic!("publish on {key}: {e}", key = key_name));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_process_ends_its_dead_predecessors_sessions_at_once() {
    // An expiry far longer than the target: only recognising the dead process frees its keys.
    const LONG: Duration = Duration::from_secs(30);
    const TARGET: Duration = Duration::from_secs(2);
    let db = test_db("crash_predecessor").await;
    let limit = transaction_lifetime_limit(&db).await;
    assert!(
        limit > TARGET + MARGIN,
        "the server aborts dead transactions after {limit:?} anyway"
    );
    let (mut app, mut lines) = start_app(&db, LONG, &[]);
    line(&mut lines, "holding").await;
    relaybus_harness::kill_tied(&mut app);
    let killed = Instant::now();

    // The process that takes its place, on the same host, with the same long expiry.
    let store = MongoEventStore::builder(db.client.clone())
        .database(&db.name)
        .heartbeat_expiry(LONG)
        .build()
        .unwrap();
    let bus = publisher(&store, &["projector"]);
    let orders = db.db().collection::<Document>("orders");
    place(&bus, &orders, "after-held", "held").await;
    let took = killed.elapsed();
    eprintln!("crash recovery: the dead predecessor's key took a publish {took:?} after the kill");
    assert!(
        took <= TARGET + MARGIN,
        "the dead predecessor's key took publishes again only after {took:?}"
    );
    assert!(
        orders
            .find_one(doc! { "_id": "held" })
            .await
            .unwrap()
            .is_none(),
        "the dead process's open transaction must not survive"
    );
    let left = processes(&db).await;
    assert_eq!(left.len(), 1, "only the new process beats: {left:?}");
    db.drop_database().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_process_paused_past_its_expiry_loses_its_transactions_and_commits_each_once() {
    let db = test_db("crash_paused").await;
    let store = store(&db);
    store.setup().await.unwrap();
    let (mut app, mut lines) = start_app(&db, HEARTBEAT, &["resume"]);
    line(&mut lines, "holding").await;
    let pid = app.id();
    let paused = processes(&db).await;
    assert_eq!(paused.len(), 1, "{paused:?}");

    relaybus_harness::pause_process(pid, Duration::from_secs(5))
        .await
        .expect("pause the application");
    // A live process sweeps: the paused one's heartbeat expires, its sessions are killed. It
    // still runs on this host, so only the expiry may end them.
    let bus = publisher(&store, &["projector"]);
    let orders = db.db().collection::<Document>("orders");
    let pause_started = Instant::now();
    place(&bus, &orders, "probe", "probe").await;
    let swept = async {
        while processes(&db)
            .await
            .iter()
            .any(|p| p.get("_id") == paused[0].get("_id"))
        {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    tokio::time::timeout(HEARTBEAT * 4, swept)
        .await
        .expect("the paused process's sessions are killed after its expiry");
    assert!(
        pause_started.elapsed() >= HEARTBEAT - Duration::from_millis(500),
        "a stopped process is not gone: only its expiry ends its sessions ({:?})",
        pause_started.elapsed()
    );

    // Resumed, its held transaction finds itself aborted and runs again, once.
    // SAFETY: a plain system call on the child's pid.
    assert_eq!(unsafe { libc::kill(pid as libc::pid_t, libc::SIGCONT) }, 0);
    use std::io::Write;
    writeln!(app.stdin.as_mut().expect("piped stdin")).expect("wake the held transaction");
    let committed = line(&mut lines, "held committed after").await;
    let attempts: u32 = committed
        .trim_start_matches("held committed after ")
        .trim_end_matches(" attempts")
        .parse()
        .unwrap_or_else(|_| panic!("{committed}"));
    assert!(
        attempts >= 2,
        "its first attempt was killed while paused: {committed}"
    );
    // It beats again, and its load goes on.
    let beating = async {
        while processes(&db).await.len() < 2 {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    tokio::time::timeout(HEARTBEAT * 2, beating)
        .await
        .expect("the resumed process writes its document anew");
    relaybus_harness::kill_tied(&mut app);

    // Every order is stored once, with one event; each key's sequence has no gap or double.
    let stored = all(&db, "orders").await;
    let events = all(&db, "relaybus_events").await;
    assert!(stored.iter().any(|o| o.get_str("_id") == Ok("held")));
    assert!(stored.iter().any(|o| o.get_str("_id") == Ok("held-after")));
    let mut by_order: std::collections::HashMap<String, Vec<&Document>> = Default::default();
    for event in &events {
        let order = event
            .get_document("payload")
            .and_then(|p| p.get_str("order_id"))
            .unwrap_or_else(|_| panic!("{event:?}"));
        by_order.entry(order.to_owned()).or_default().push(event);
    }
    for order in &stored {
        let id = order.get_str("_id").unwrap();
        if id == "held-after" {
            continue;
        }
        let found = by_order.get(id).map_or(0, Vec::len);
        assert_eq!(found, 1, "order {id} has {found} events");
    }
    assert_eq!(events.len(), stored.len() - 1, "no event without its order");
    let mut sequences: std::collections::HashMap<&str, Vec<i64>> = Default::default();
    for event in &events {
        sequences
            .entry(event.get_str("key").unwrap())
            .or_default()
            .push(event.get_i64("sequence").unwrap());
    }
    for (key, mut numbers) in sequences {
        numbers.sort_unstable();
        let expected: Vec<i64> = (1..=numbers.len() as i64).collect();
        assert_eq!(numbers, expected, "the sequence of {key}");
    }
    db.drop_database().await.unwrap();
}

/// Three worker processes run a schedule every second on one database for 30 seconds of real
/// time; one is killed with SIGKILL and started again: each tick is one event, none missing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_schedule_survives_a_killed_process_with_one_event_per_tick() {
    let db = test_db("schedule_kill").await;
    let (started, ended) = relaybus_tests::fault::three_schedule_workers_one_killed(
        env!("CARGO_BIN_EXE_relaybus-fault-worker"),
        |owner| {
            [&db.uri, &db.name, owner, "2000", "200"]
                .map(|arg| arg.to_string())
                .into_iter()
                .fold(vec!["--schedule".to_owned()], |mut args, arg| {
                    args.push(arg);
                    args
                })
        },
        Duration::from_secs(30),
        Duration::from_millis(12_300),
    )
    .await;
    let ids: Vec<String> = db
        .client
        .database(&db.name)
        .collection::<Document>("relaybus_events")
        .distinct("_id", doc! { "type": "schedule.beat.v1" })
        .await
        .expect("the ticks' events")
        .into_iter()
        .map(|id| id.as_str().expect("a string id").to_owned())
        .collect();
    relaybus_tests::fault::check_one_event_per_tick(
        relaybus_tests::fault::tick_times(ids),
        started,
        ended,
    );
}

/// A process holding all 4 slots of a handler's global concurrency is killed: the other buses
/// take them within its lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_slots_of_a_killed_bus_free_within_its_lease() {
    let db = test_db("crash_slots").await;
    let stores = [
        relaybus_tests::support::store_on(&db.client, &db).await,
        relaybus_tests::support::store_on(&db.client, &db).await,
    ];
    let mut holder = Command::new(APP);
    holder.args([
        "slots",
        "mongodb",
        db.uri.as_str(),
        db.name.as_str(),
        &relaybus_tests::limits::KILLED_LEASE.as_millis().to_string(),
    ]);
    relaybus_tests::limits::slots_of_a_killed_bus_free_within_the_lease(stores, holder).await;
}

/// A process of this host killed while its handler runs the deliveries of 8 lanes: another
/// process takes those lanes and runs the deliveries long before the dead one's lease (60 s)
/// or heartbeat (30 s) would have ended.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_lanes_of_a_killed_process_run_elsewhere_before_its_lease_ends() {
    const LONG_LEASE: Duration = Duration::from_secs(60);
    const LONG_HEARTBEAT: Duration = Duration::from_secs(30);
    /// A few beats of the member list (a quarter of the expiry each), on a loaded machine.
    const TARGET: Duration = Duration::from_secs(20);
    const EVENTS: usize = 8;
    let db = test_db("crash_lanes").await;
    let store = MongoEventStore::builder(db.client.clone())
        .database(&db.name)
        .heartbeat_expiry(LONG_HEARTBEAT)
        .build()
        .unwrap();
    let events: Vec<String> = (0..EVENTS).map(|n| format!("o-{n}")).collect();
    {
        let publishing = relaybus::RelayBus::builder(store.clone())
            .without_registered_handlers()
            .subscribe(relaybus::Subscription::new(
                "slow",
                |_: relaybus_tests::support::OrderPlaced, _: relaybus::HandlerContext| async {
                    Ok::<(), relaybus::BoxError>(())
                },
            ))
            .build()
            .unwrap();
        for id in &events {
            publishing
                .publish(&placed(id))
                .key(id.clone())
                .await
                .unwrap();
        }
    }
    let mut command = Command::new(APP);
    command.args([
        "lanes",
        db.uri.as_str(),
        db.name.as_str(),
        &LONG_LEASE.as_millis().to_string(),
        &LONG_HEARTBEAT.as_millis().to_string(),
        &EVENTS.to_string(),
    ]);
    let mut app = start_holding(command, "its lanes").await;
    relaybus_harness::kill_tied(&mut app);
    let killed = Instant::now();

    let (ran_tx, mut ran) = tokio::sync::mpsc::unbounded_channel::<String>();
    let bus = relaybus::RelayBus::builder(store)
        .without_registered_handlers()
        .subscribe(relaybus::Subscription::new(
            "slow",
            move |event: relaybus_tests::support::OrderPlaced, _: relaybus::HandlerContext| {
                let ran = ran_tx.clone();
                async move {
                    let _ = ran.send(event.order_id);
                    Ok::<(), relaybus::BoxError>(())
                }
            },
        ))
        .lease_duration(LONG_LEASE)
        .poll_interval(Duration::from_millis(100))
        .build()
        .unwrap();
    bus.start().await.unwrap();
    let mut seen = Vec::new();
    while seen.len() < EVENTS {
        let id = tokio::time::timeout(TARGET.saturating_sub(killed.elapsed()), ran.recv())
            .await
            .unwrap_or_else(|_| {
                panic!(
                    "after {:?} only {seen:?} ran: the dead process's lanes wait for its lease",
                    killed.elapsed()
                )
            })
            .expect("the bus runs");
        seen.push(id);
    }
    eprintln!(
        "crash recovery: the dead process's lanes ran elsewhere {:?} after the kill",
        killed.elapsed()
    );
    seen.sort();
    assert_eq!(seen, events, "each delivery ran once more, elsewhere");
    bus.shutdown().await.unwrap();
    db.drop_database().await.unwrap();
}
