//! A group of `mongod` children of the test process: a standalone server,
//! or the nodes of a replica set, in one data directory.

use std::path::PathBuf;
use std::process::Child;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard, Once};
use std::time::{Duration, Instant};

use crate::process::{self, kill_child, spawn_tied, track_dir, untrack_dir};
use crate::server::{self, NodeSpec, STARTUP_TIMEOUT, free_ports, log_tail};
use crate::{HarnessError, mongod_path, mongodb_dir};

/// mongod's exit code when it cannot listen on its port.
const EXIT_NET_ERROR: i32 = 48;

/// How often a start that lost its port to another process is retried.
const PORT_ATTEMPTS: usize = 5;

#[derive(Debug)]
pub(crate) struct Instance {
    mongod: PathBuf,
    dir: PathBuf,
    specs: Vec<NodeSpec>,
    children: Mutex<Vec<Option<Child>>>,
}

/// Why a node did not come up.
enum NodeFailure {
    /// Another process took the port: worth another try with new ports.
    PortTaken,
    Other(HarnessError),
}

impl Instance {
    /// Starts `nodes` servers on free ports, as members of replica set
    /// `repl_set` if given, and waits until they accept connections. Does
    /// not initiate the replica set.
    pub(crate) async fn launch(
        nodes: usize,
        repl_set: Option<&str>,
    ) -> Result<Instance, HarnessError> {
        assert!(nodes >= 1, "a server needs at least one node");
        let mongod = mongod_path()?;
        sweep_stale_dirs();
        let mut attempt = 0;
        loop {
            attempt += 1;
            let dir = new_instance_dir();
            track_dir(&dir);
            let specs = free_ports(nodes)?
                .into_iter()
                .enumerate()
                .map(|(i, port)| NodeSpec {
                    port,
                    dir: if nodes == 1 {
                        dir.clone()
                    } else {
                        dir.join(format!("node{i}"))
                    },
                    repl_set: repl_set.map(str::to_owned),
                })
                .collect();
            let instance = Instance {
                mongod: mongod.clone(),
                dir,
                specs,
                children: Mutex::new((0..nodes).map(|_| None).collect()),
            };
            let mut failure = None;
            for node in 0..nodes {
                if let Err(e) = instance.spawn(node) {
                    failure = Some(NodeFailure::Other(e));
                    break;
                }
            }
            if failure.is_none() {
                for node in 0..nodes {
                    if let Err(f) = instance.wait_accepting(node).await {
                        failure = Some(f);
                        break;
                    }
                }
            }
            match failure {
                None => return Ok(instance),
                Some(NodeFailure::PortTaken) if attempt < PORT_ATTEMPTS => {
                    drop(instance);
                }
                Some(NodeFailure::PortTaken) => {
                    return Err(HarnessError::Start(format!(
                        "mongod found its port taken {PORT_ATTEMPTS} times in a row"
                    )));
                }
                Some(NodeFailure::Other(e)) => return Err(e),
            }
        }
    }

    pub(crate) fn ports(&self) -> Vec<u16> {
        self.specs.iter().map(|s| s.port).collect()
    }

    pub(crate) fn port(&self, node: usize) -> u16 {
        self.spec(node).port
    }

    pub(crate) fn node_count(&self) -> usize {
        self.specs.len()
    }

    fn spec(&self, node: usize) -> &NodeSpec {
        self.specs.get(node).unwrap_or_else(|| {
            panic!(
                "relaybus-harness: no node {node}; there are {}",
                self.specs.len()
            )
        })
    }

    fn children(&self) -> MutexGuard<'_, Vec<Option<Child>>> {
        self.children.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Starts node `node` (which must not be running) on its port and data.
    pub(crate) fn spawn(&self, node: usize) -> Result<(), HarnessError> {
        let spec = self.spec(node);
        let cmd = spec.command(&self.mongod, false)?;
        let child = spawn_tied(cmd)
            .map_err(|e| HarnessError::io(format!("starting {}", self.mongod.display()), e))?;
        self.children()[node] = Some(child);
        Ok(())
    }

    /// Kills node `node` with SIGKILL, if it runs, and reaps it.
    pub(crate) fn kill(&self, node: usize) {
        let _ = self.spec(node);
        if let Some(mut child) = self.children()[node].take() {
            kill_child(&mut child);
        }
    }

    /// Whether node `node` was started and has not exited.
    pub(crate) fn is_running(&self, node: usize) -> bool {
        let _ = self.spec(node);
        match self.children()[node].as_mut() {
            Some(child) => matches!(child.try_wait(), Ok(None)),
            None => false,
        }
    }

    /// Waits until node `node` accepts connections and answers `hello`.
    pub(crate) async fn wait_for_node(&self, node: usize) -> Result<(), HarnessError> {
        match self.wait_accepting(node).await {
            Ok(()) => Ok(()),
            Err(NodeFailure::PortTaken) => Err(HarnessError::Start(format!(
                "mongod could not listen on port {}: it is taken",
                self.port(node)
            ))),
            Err(NodeFailure::Other(e)) => Err(e),
        }
    }

    async fn wait_accepting(&self, node: usize) -> Result<(), NodeFailure> {
        let spec = self.spec(node);
        let deadline = Instant::now() + STARTUP_TIMEOUT;
        loop {
            let exited = match self.children()[node].as_mut() {
                Some(child) => child.try_wait().ok().flatten(),
                None => {
                    return Err(NodeFailure::Other(HarnessError::Start(format!(
                        "node {node} is not running"
                    ))));
                }
            };
            if let Some(status) = exited {
                let log = log_tail(&spec.log_path(), 30);
                if status.code() == Some(EXIT_NET_ERROR) || log.contains("Address already in use") {
                    return Err(NodeFailure::PortTaken);
                }
                return Err(NodeFailure::Other(HarnessError::Start(format!(
                    "mongod on port {} exited at start ({status})\n{log}",
                    spec.port
                ))));
            }
            if server::hello(spec.port).await.is_some() {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(NodeFailure::Other(HarnessError::Start(format!(
                    "mongod on port {} did not answer within {} s\n{}",
                    spec.port,
                    STARTUP_TIMEOUT.as_secs(),
                    log_tail(&spec.log_path(), 30)
                ))));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Initiates the replica set and waits for a primary with every member
    /// healthy.
    pub(crate) async fn initiate(&self, name: &str) -> Result<(), HarnessError> {
        let ports = self.ports();
        server::initiate(name, &ports).await?;
        server::wait_for_primary(&ports, true, STARTUP_TIMEOUT)
            .await
            .map_err(|e| self.start_error(&format!("replica set {name}: {e}")))?;
        Ok(())
    }

    /// An error with the log tails of every node.
    pub(crate) fn start_error(&self, what: &str) -> HarnessError {
        let logs: Vec<String> = self
            .specs
            .iter()
            .map(|s| log_tail(&s.log_path(), 15))
            .collect();
        HarnessError::Start(format!("{what}\n{}", logs.join("\n")))
    }

    /// Leaves the instance running for the rest of the process; the exit
    /// hook and PDEATHSIG still kill it.
    pub(crate) fn leak(self) {
        std::mem::forget(self);
    }
}

impl Drop for Instance {
    fn drop(&mut self) {
        for child in self.children().iter_mut() {
            if let Some(child) = child.as_mut() {
                kill_child(child);
            }
        }
        let _ = std::fs::remove_dir_all(&self.dir);
        untrack_dir(&self.dir);
    }
}

/// A new directory name, `target/mongodb/harness-<pid>-<n>`.
fn new_instance_dir() -> PathBuf {
    static COUNTER: AtomicUsize = AtomicUsize::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    mongodb_dir().join(format!("harness-{}-{n}", std::process::id()))
}

/// Removes `harness-<pid>-*` directories of processes that are gone, and
/// fail point lock files of local servers that are gone.
fn sweep_stale_dirs() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        if let Ok(locks) = std::fs::read_dir(mongodb_dir().join("locks")) {
            for entry in locks.flatten() {
                let name = entry.file_name();
                let port = name
                    .to_str()
                    .and_then(|n| n.strip_prefix("127.0.0.1_"))
                    .and_then(|n| n.split('-').next())
                    .and_then(|p| p.parse::<u16>().ok());
                if port.is_some_and(|p| !server::port_open(p)) {
                    let _ = std::fs::remove_file(entry.path());
                }
            }
        }
        let Ok(entries) = std::fs::read_dir(mongodb_dir()) else {
            return;
        };
        for entry in entries.flatten() {
            let name = entry.file_name();
            let Some(pid) = name
                .to_str()
                .and_then(|n| n.strip_prefix("harness-"))
                .and_then(|n| n.split('-').next())
                .and_then(|p| p.parse::<u32>().ok())
            else {
                continue;
            };
            if pid != std::process::id() && !process::pid_alive(pid) {
                let _ = std::fs::remove_dir_all(entry.path());
            }
        }
    });
}

/// Starts the process-wide replica set of [`crate::shared_uri`], on a
/// private runtime; called on a helper thread.
pub(crate) fn start_shared_blocking() -> Result<String, HarnessError> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| HarnessError::io("building a tokio runtime", e))?;
    runtime.block_on(async {
        const NAME: &str = "relaybus-harness";
        let instance = Instance::launch(1, Some(NAME)).await?;
        instance.initiate(NAME).await?;
        let uri = format!(
            "mongodb://127.0.0.1:{}/?replicaSet={NAME}",
            instance.port(0)
        );
        instance.leak();
        Ok(uri)
    })
}
