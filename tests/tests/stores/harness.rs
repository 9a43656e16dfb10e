//! Tests of the test harness itself: the servers it provides are what the
//! relaybus tests assume.

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use mongodb::Client;
use mongodb::bson::{Document, doc};
use mongodb::error::ErrorKind;
use relaybus_harness::{FailPoint, start_replica_set, start_standalone, test_db};

async fn hello(client: &Client) -> Document {
    client
        .database("admin")
        .run_command(doc! { "hello": 1 })
        .await
        .expect("hello")
}

fn error_code(error: &mongodb::error::Error) -> Option<i32> {
    match *error.kind {
        ErrorKind::Command(ref c) => Some(c.code),
        ErrorKind::Write(mongodb::error::WriteFailure::WriteError(ref w)) => Some(w.code),
        _ => None,
    }
}

#[tokio::test]
async fn test_db_is_on_a_replica_set_primary() {
    let db = test_db("harness_primary").await;
    let hello = hello(&db.client).await;
    assert!(hello.get_str("setName").is_ok(), "no setName: {hello}");
    assert_eq!(hello.get_bool("isWritablePrimary"), Ok(true), "{hello}");
}

#[tokio::test]
async fn test_dbs_have_distinct_valid_names() {
    let a = test_db("harness::names").await;
    let b = test_db("harness::names").await;
    assert_ne!(a.name, b.name);
    assert_eq!(a.uri, b.uri);
    let long = test_db(&"very long test name ".repeat(10)).await;
    for name in [&a.name, &b.name, &long.name] {
        assert!(name.len() <= 63, "{name}");
        assert!(
            name.chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-'),
            "{name}"
        );
    }
    // The names are usable.
    long.db()
        .collection::<Document>("c")
        .insert_one(doc! { "x": 1 })
        .await
        .expect("insert into a long-named database");
    long.drop_database().await.expect("drop database");
}

#[tokio::test]
async fn a_transaction_commits_and_an_aborted_one_does_not() {
    let db = test_db("harness_transaction").await;
    let coll = db.db().collection::<Document>("events");
    coll.insert_one(doc! { "_id": 0 }).await.expect("create");

    let mut session = db.client.start_session().await.expect("session");
    session.start_transaction().await.expect("start");
    coll.insert_one(doc! { "_id": 1 })
        .session(&mut session)
        .await
        .expect("insert 1");
    coll.insert_one(doc! { "_id": 2 })
        .session(&mut session)
        .await
        .expect("insert 2");
    session.commit_transaction().await.expect("commit");

    session.start_transaction().await.expect("start");
    coll.insert_one(doc! { "_id": 3 })
        .session(&mut session)
        .await
        .expect("insert 3");
    session.abort_transaction().await.expect("abort");

    assert_eq!(coll.count_documents(doc! {}).await.expect("count"), 3);
    assert!(
        coll.find_one(doc! { "_id": 3 })
            .await
            .expect("find")
            .is_none()
    );
}

#[tokio::test]
async fn a_fail_point_injects_the_error_once() {
    let db = test_db("harness_fail_point").await;
    let coll = db.db().collection::<Document>("c");
    let fail_point = FailPoint::enable(
        &db.client,
        doc! {
            "configureFailPoint": "failCommand",
            "mode": { "times": 1 },
            // Limited to this test's client: other tests share the server.
            "data": { "failCommands": ["insert"], "errorCode": 2, "appName": &db.name },
        },
    )
    .await
    .expect("enable fail point");
    assert_eq!(fail_point.name(), "failCommand");

    let error = coll.insert_one(doc! { "n": 1 }).await.unwrap_err();
    assert_eq!(error_code(&error), Some(2), "{error:?}");
    coll.insert_one(doc! { "n": 2 })
        .await
        .expect("only one failure");
    fail_point.disable().await.expect("disable");
}

#[tokio::test]
async fn a_dropped_fail_point_is_switched_off() {
    let db = test_db("harness_fail_point_drop").await;
    let coll = db.db().collection::<Document>("c");
    {
        let _fail_point = FailPoint::enable(
            &db.client,
            doc! {
                "configureFailPoint": "failCommand",
                "mode": "alwaysOn",
                "data": { "failCommands": ["insert"], "errorCode": 11601, "appName": &db.name },
            },
        )
        .await
        .expect("enable fail point");
        for _ in 0..2 {
            let error = coll.insert_one(doc! {}).await.unwrap_err();
            assert_eq!(error_code(&error), Some(11601), "{error:?}");
        }
    }
    coll.insert_one(doc! {})
        .await
        .expect("the fail point is off after drop");
}

#[tokio::test]
async fn a_standalone_is_not_a_replica_set() {
    let server = start_standalone().await;
    let client = Client::with_uri_str(server.uri()).await.expect("client");
    let hello = hello(&client).await;
    assert!(hello.get("setName").is_none(), "{hello}");
    assert_eq!(hello.get_bool("isWritablePrimary"), Ok(true), "{hello}");
    assert!(server.uri().contains(&server.port().to_string()));
}

#[tokio::test]
async fn a_replica_set_survives_losing_its_primary() {
    let rs = start_replica_set(3).await;
    assert_eq!(rs.node_count(), 3);
    let client = Client::with_uri_str(rs.uri()).await.expect("client");
    let coll = client.database("failover").collection::<Document>("c");
    coll.insert_one(doc! { "n": 1 }).await.expect("insert");

    let first = rs.wait_for_primary().await;
    rs.kill(first);
    assert!(!rs.is_running(first));
    let second = rs.wait_for_primary().await;
    assert_ne!(first, second);
    // The driver finds the new primary; the write is majority-acknowledged by
    // the two nodes left.
    coll.insert_one(doc! { "n": 2 })
        .await
        .expect("insert after failover");

    rs.restart(first).await;
    assert!(rs.is_running(first));
    let stepped_down = rs.step_down().await;
    let third = rs.wait_for_primary().await;
    assert_ne!(stepped_down, third);
    assert_eq!(coll.count_documents(doc! {}).await.expect("count"), 2);

    let direct = Client::with_uri_str(rs.node_uri(first))
        .await
        .expect("client");
    let hello = hello(&direct).await;
    assert_eq!(hello.get_str("setName"), Ok(rs.name()), "{hello}");
}

// A process that dies must not leave a mongod behind. The test runs this test
// binary again, as a child that starts servers and then crashes.

const CRASH_MODE: &str = "RELAYBUS_HARNESS_CRASH_MODE";
const CRASH_REPORT: &str = "RELAYBUS_HARNESS_CRASH_REPORT";

/// Only does something when run by `mongods_die_with_a_crashed_process`.
#[tokio::test]
#[ignore = "run as a child process by mongods_die_with_a_crashed_process"]
async fn crash_child() {
    let (Ok(mode), Ok(report)) = (std::env::var(CRASH_MODE), std::env::var(CRASH_REPORT)) else {
        return;
    };
    // The child's own process-wide server: the variable is unset.
    let shared = relaybus_harness::shared_uri("RELAYBUS_HARNESS_UNSET_URI")
        .await
        .expect("shared server");
    let standalone = start_standalone().await;
    let mut lines = String::new();
    for uri in [shared.as_str(), standalone.uri()] {
        let client = Client::with_uri_str(uri).await.expect("client");
        let admin = client.database("admin");
        let status = admin
            .run_command(doc! { "serverStatus": 1 })
            .await
            .expect("serverStatus");
        let pid = status.get_i64("pid").expect("pid");
        let opts = admin
            .run_command(doc! { "getCmdLineOpts": 1 })
            .await
            .expect("getCmdLineOpts");
        let db_path = opts
            .get_document("parsed")
            .and_then(|p| p.get_document("storage"))
            .and_then(|s| s.get_str("dbPath"))
            .expect("dbPath")
            .to_owned();
        lines.push_str(&format!("{pid} {db_path}\n"));
    }
    std::fs::write(report, lines).expect("write report");
    match mode.as_str() {
        "abort" => std::process::abort(),
        _ => panic!("crashing on purpose"),
    }
}

/// The name the test runner of this binary gives [`crash_child`]: its path without the crate.
fn crash_child_name() -> String {
    match module_path!().split_once("::") {
        Some((_crate, module)) => format!("{module}::crash_child"),
        None => "crash_child".to_owned(),
    }
}

fn alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => {
            let state = stat.rsplit(')').next().unwrap_or("").trim_start();
            !state.starts_with('Z') && !state.starts_with('X')
        }
        Err(_) => false,
    }
}

#[test]
fn mongods_die_with_a_crashed_process() {
    for mode in ["panic", "abort"] {
        let report = std::env::temp_dir().join(format!(
            "relaybus-harness-crash-{}-{mode}",
            std::process::id()
        ));
        let _ = std::fs::remove_file(&report);
        let output = Command::new(std::env::current_exe().expect("current exe"))
            .args(["--exact", &crash_child_name(), "--ignored", "--nocapture"])
            .env(CRASH_MODE, mode)
            .env(CRASH_REPORT, &report)
            .env_remove("RELAYBUS_TEST_MONGODB_URI")
            .output()
            .expect("run the child");
        assert!(
            !output.status.success(),
            "the {mode} child should have failed: {output:?}"
        );
        let text = std::fs::read_to_string(&report).unwrap_or_else(|e| {
            panic!(
                "the {mode} child wrote no report ({e}): {}",
                String::from_utf8_lossy(&output.stderr)
            )
        });
        let _ = std::fs::remove_file(&report);
        let servers: Vec<(u32, PathBuf)> = text
            .lines()
            .map(|l| {
                let (pid, dir) = l.split_once(' ').expect("pid and path");
                (pid.parse().expect("pid"), PathBuf::from(dir))
            })
            .collect();
        assert_eq!(servers.len(), 2, "{text}");

        let deadline = Instant::now() + Duration::from_secs(10);
        while servers.iter().any(|(pid, _)| alive(*pid)) {
            assert!(
                Instant::now() < deadline,
                "mongod outlived its {mode}ed parent: {servers:?}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        for (_, db_path) in &servers {
            let instance_dir = db_path.parent().expect("instance dir");
            if mode == "panic" {
                // A normal exit (libtest catches the panic) runs the exit
                // hook, which removes the data.
                assert!(!instance_dir.exists(), "{instance_dir:?} was left");
            } else {
                // After an abort the next harness run sweeps it; do it now.
                let _ = std::fs::remove_dir_all(instance_dir);
            }
        }
    }
}
