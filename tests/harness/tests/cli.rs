//! The relaybus-mongo command behind scripts/mongo, end to end. Also makes
//! `cargo test` build the binary, so that scripts/test can run it without a
//! build of its own.

use std::process::{Command, Output};

use mongodb::Client;
use mongodb::bson::doc;

const BIN: &str = env!("CARGO_BIN_EXE_relaybus-mongo");

fn run(args: &[&str]) -> Output {
    Command::new(BIN)
        .args(args)
        .output()
        .expect("run relaybus-mongo")
}

fn stdout(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// Stops and deletes the replica set even when the test fails: its nodes
/// are daemons, not children of the test process.
struct Cleanup(String);

impl Drop for Cleanup {
    fn drop(&mut self) {
        let _ = run(&["stop", "--name", &self.0, "--rm"]);
    }
}

#[tokio::test]
async fn starts_reuses_and_stops_a_replica_set() {
    let name = format!("cli-test-{}", std::process::id());
    let _cleanup = Cleanup(name.clone());

    let started = run(&["start", "--name", &name, "--port", "0"]);
    assert!(started.status.success(), "{started:?}");
    let uri = stdout(&started).lines().last().unwrap_or("").to_owned();
    assert!(
        uri.starts_with("mongodb://127.0.0.1:") && uri.ends_with(&format!("?replicaSet={name}")),
        "{uri}"
    );

    // A second start reuses the running set.
    let again = run(&["start", "--name", &name]);
    assert!(again.status.success(), "{again:?}");
    assert_eq!(stdout(&again).lines().last(), Some(uri.as_str()));
    let printed = run(&["uri", "--name", &name]);
    assert_eq!(stdout(&printed).trim(), uri);
    let status = run(&["status", "--name", &name]);
    assert!(status.status.success(), "{status:?}");
    assert!(stdout(&status).contains("PRIMARY"), "{status:?}");

    let client = Client::with_uri_str(&uri).await.expect("client");
    let hello = client
        .database("admin")
        .run_command(doc! { "hello": 1 })
        .await
        .expect("hello");
    assert_eq!(hello.get_str("setName"), Ok(name.as_str()), "{hello}");
    assert_eq!(hello.get_bool("isWritablePrimary"), Ok(true), "{hello}");
    client.shutdown().immediate(true).await;

    let stopped = run(&["stop", "--name", &name, "--rm"]);
    assert!(stopped.status.success(), "{stopped:?}");
    let status = run(&["status", "--name", &name]);
    assert!(!status.status.success(), "{status:?}");
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    assert!(!root.join("target/mongodb").join(&name).exists());
}

#[test]
fn rejects_bad_arguments() {
    for args in [
        &["start", "--nodes", "9"][..],
        &["start", "--name", "no/slashes"],
        &["start", "--port", "x"],
        &["stop", "--nodes", "3"],
        &["frobnicate"],
        &[],
    ] {
        let output = run(args);
        assert!(!output.status.success(), "{args:?} succeeded");
        assert!(
            !output.stderr.is_empty(),
            "{args:?} failed without a message"
        );
    }
    assert!(run(&["--help"]).status.success());
}
