//! Running one `mongod` and talking to servers while they come up.

use std::fs;
use std::io;
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use mongodb::Client;
use mongodb::bson::{Bson, Document, doc};
use mongodb::error::ErrorKind;
use mongodb::options::ClientOptions;

use crate::HarnessError;

/// How long a server may take to start, or a replica set to elect a primary.
pub(crate) const STARTUP_TIMEOUT: Duration = Duration::from_secs(60);

/// How often to look again while waiting.
const POLL: Duration = Duration::from_millis(50);

/// How one `mongod` is run.
#[derive(Debug, Clone)]
pub(crate) struct NodeSpec {
    pub(crate) port: u16,
    /// Holds `db/`, `mongod.log` and, when forked, `mongod.pid`.
    pub(crate) dir: PathBuf,
    pub(crate) repl_set: Option<String>,
}

impl NodeSpec {
    pub(crate) fn db_path(&self) -> PathBuf {
        self.dir.join("db")
    }

    pub(crate) fn log_path(&self) -> PathBuf {
        self.dir.join("mongod.log")
    }

    pub(crate) fn pid_path(&self) -> PathBuf {
        self.dir.join("mongod.pid")
    }

    /// The `mongod` command line; creates the data directory. With `fork`,
    /// mongod daemonizes itself and records its pid in [`Self::pid_path`].
    pub(crate) fn command(&self, mongod: &Path, fork: bool) -> Result<Command, HarnessError> {
        let db = self.db_path();
        fs::create_dir_all(&db)
            .map_err(|e| HarnessError::io(format!("creating {}", db.display()), e))?;
        let mut cmd = Command::new(mongod);
        cmd.arg("--port")
            .arg(self.port.to_string())
            .args(["--bind_ip", "127.0.0.1", "--nounixsocket"])
            .arg("--dbpath")
            .arg(&db)
            .arg("--logpath")
            .arg(self.log_path())
            .arg("--logappend")
            // A small footprint: several servers run at once on small machines.
            .args(["--wiredTigerCacheSizeGB", "0.25"])
            .args([
                "--wiredTigerEngineConfigString",
                "log=(prealloc=false,file_max=16MB)",
            ])
            .args(["--setParameter", "diagnosticDataCollectionEnabled=false"])
            // SIGTERM waits 1 s, not 15, for secondaries to catch up and for
            // operations to finish: a clean shutdown that takes no time.
            .args([
                "--setParameter",
                "shutdownTimeoutMillisForSignaledShutdown=1000",
            ])
            // Tests use configureFailPoint.
            .args(["--setParameter", "enableTestCommands=1"])
            // No snapshot history, as the README advises: deleted index entries go at the next
            // reconciliation of their pages instead of staying 300 s in every claim's way.
            .args(["--setParameter", "minSnapshotHistoryWindowInSeconds=0"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        if let Some(name) = &self.repl_set {
            cmd.args(["--replSet", name, "--oplogSize", "64"]);
        }
        if fork {
            cmd.arg("--fork").arg("--pidfilepath").arg(self.pid_path());
        }
        Ok(cmd)
    }
}

/// `n` distinct ports that were free a moment ago on 127.0.0.1.
pub(crate) fn free_ports(n: usize) -> Result<Vec<u16>, HarnessError> {
    // Hold all listeners at once so the ports differ.
    let listeners = (0..n)
        .map(|_| TcpListener::bind((Ipv4Addr::LOCALHOST, 0)))
        .collect::<io::Result<Vec<_>>>()
        .map_err(|e| HarnessError::io("finding a free port", e))?;
    listeners
        .iter()
        .map(|l| l.local_addr().map(|a| a.port()))
        .collect::<io::Result<Vec<_>>>()
        .map_err(|e| HarnessError::io("finding a free port", e))
}

/// Whether something accepts TCP connections on 127.0.0.1:`port`.
pub(crate) fn port_open(port: u16) -> bool {
    let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
    TcpStream::connect_timeout(&addr, Duration::from_millis(250)).is_ok()
}

/// A client for one server, bypassing replica set discovery.
pub(crate) async fn direct_client(port: u16, timeout: Duration) -> Result<Client, HarnessError> {
    let mut options =
        ClientOptions::parse(format!("mongodb://127.0.0.1:{port}/?directConnection=true")).await?;
    options.server_selection_timeout = Some(timeout);
    options.connect_timeout = Some(timeout);
    options.app_name = Some("relaybus-harness".into());
    Ok(Client::with_options(options)?)
}

/// Runs an admin command on one server.
pub(crate) async fn admin_command(
    port: u16,
    command: Document,
    timeout: Duration,
) -> Result<Document, HarnessError> {
    let client = direct_client(port, timeout).await?;
    let reply = client.database("admin").run_command(command).await;
    client.shutdown().immediate(true).await;
    Ok(reply?)
}

/// The `hello` reply of one server, or `None` if it does not answer quickly
/// (or `port` is 0, which stands for a node that is down).
pub(crate) async fn hello(port: u16) -> Option<Document> {
    if port == 0 || !port_open(port) {
        return None;
    }
    admin_command(port, doc! { "hello": 1 }, Duration::from_secs(2))
        .await
        .ok()
}

/// Whether a `hello` reply comes from a writable primary.
pub(crate) fn is_writable_primary(hello: &Document) -> bool {
    hello.get_bool("isWritablePrimary").unwrap_or(false)
}

/// The server error code of a driver error, if it is a command error.
pub(crate) fn command_code(error: &HarnessError) -> Option<i32> {
    match error {
        HarnessError::Mongo(e) => match *e.kind {
            ErrorKind::Command(ref c) => Some(c.code),
            _ => None,
        },
        _ => None,
    }
}

/// The last `lines` lines of a log file, for error messages.
pub(crate) fn log_tail(path: &Path, lines: usize) -> String {
    match fs::read_to_string(path) {
        Ok(text) => {
            let all: Vec<&str> = text.lines().collect();
            let start = all.len().saturating_sub(lines);
            format!(
                "last lines of {}:\n{}",
                path.display(),
                all[start..].join("\n")
            )
        }
        Err(e) => format!("(cannot read {}: {e})", path.display()),
    }
}

/// Initiates a replica set of the given nodes, unless it already is one.
pub(crate) async fn initiate(name: &str, ports: &[u16]) -> Result<(), HarnessError> {
    const NOT_YET_INITIALIZED: i32 = 94;

    let first = ports[0];
    match admin_command(
        first,
        doc! { "replSetGetStatus": 1 },
        Duration::from_secs(5),
    )
    .await
    {
        Ok(_) => return Ok(()),
        Err(e) if command_code(&e) == Some(NOT_YET_INITIALIZED) => {}
        Err(e) => return Err(e),
    }
    let members: Vec<Bson> = ports
        .iter()
        .enumerate()
        .map(|(i, port)| {
            Bson::Document(doc! { "_id": i as i32, "host": format!("127.0.0.1:{port}") })
        })
        .collect();
    // Quicker failover than the defaults (10 s election timeout, 2 s
    // heartbeats), for tests that kill the primary.
    let config = doc! {
        "_id": name,
        "members": members,
        "settings": { "electionTimeoutMillis": 2000, "heartbeatIntervalMillis": 500 },
    };
    admin_command(
        first,
        doc! { "replSetInitiate": config },
        Duration::from_secs(30),
    )
    .await?;
    Ok(())
}

/// The index in `ports` of a writable primary, if any answers now.
pub(crate) async fn find_primary(ports: &[u16]) -> Option<usize> {
    for (i, &port) in ports.iter().enumerate() {
        if let Some(hello) = hello(port).await
            && is_writable_primary(&hello)
        {
            return Some(i);
        }
    }
    None
}

/// Waits until one of `ports` is a writable primary and, with
/// `all_healthy`, every member is PRIMARY or SECONDARY. Returns the
/// primary's index.
pub(crate) async fn wait_for_primary(
    ports: &[u16],
    all_healthy: bool,
    timeout: Duration,
) -> Result<usize, String> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(primary) = find_primary(ports).await
            && (!all_healthy || members_healthy(ports[primary]).await)
        {
            return Ok(primary);
        }
        if Instant::now() >= deadline {
            return Err(format!(
                "no PRIMARY{} within {} s",
                if all_healthy {
                    " with all members healthy"
                } else {
                    ""
                },
                timeout.as_secs()
            ));
        }
        tokio::time::sleep(POLL).await;
    }
}

/// Whether every member reported by `replSetGetStatus` on `port` is PRIMARY
/// (1) or SECONDARY (2).
async fn members_healthy(port: u16) -> bool {
    let Ok(status) =
        admin_command(port, doc! { "replSetGetStatus": 1 }, Duration::from_secs(2)).await
    else {
        return false;
    };
    let Ok(members) = status.get_array("members") else {
        return false;
    };
    members.iter().all(|m| {
        m.as_document()
            .and_then(|m| m.get("state"))
            .and_then(|s| s.as_i32().or_else(|| s.as_i64().map(|v| v as i32)))
            .is_some_and(|s| s == 1 || s == 2)
    })
}
