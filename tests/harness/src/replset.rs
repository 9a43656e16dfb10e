//! A private replica set, for tests that kill, restart or step down nodes.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use mongodb::bson::doc;

use crate::HarnessError;
use crate::instance::Instance;
use crate::server::{self, STARTUP_TIMEOUT};

/// A replica set of its own for one test, on free ports of 127.0.0.1.
///
/// Made by [`start_replica_set`]. Its nodes are numbered from 0. Every node
/// is killed, and the data removed, when this is dropped; the kernel kills
/// them if the process dies first. Node settings: `enableTestCommands`, an
/// election timeout of 2 s and heartbeats every 0.5 s, so that failover in
/// tests takes a few seconds.
#[derive(Debug)]
pub struct ReplicaSet {
    instance: Instance,
    name: String,
    uri: String,
}

/// Starts a replica set of `nodes` members (1 or 3 are the usual choices)
/// and waits until it has a primary and every member is PRIMARY or
/// SECONDARY.
///
/// # Panics
///
/// When `nodes` is 0 or more than 7, or the servers cannot be installed or
/// started.
pub async fn start_replica_set(nodes: usize) -> ReplicaSet {
    static COUNTER: AtomicUsize = AtomicUsize::new(0);

    assert!(
        (1..=7).contains(&nodes),
        "relaybus-harness: a replica set has 1 to 7 voting nodes, not {nodes}"
    );
    let name = format!(
        "harness-rs-{}-{}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    );
    let start = async {
        let instance = Instance::launch(nodes, Some(&name)).await?;
        instance.initiate(&name).await?;
        Ok::<_, crate::HarnessError>(instance)
    };
    let instance = match start.await {
        Ok(i) => i,
        Err(e) => panic!("relaybus-harness: cannot start a {nodes}-node replica set: {e}"),
    };
    let hosts: Vec<String> = instance
        .ports()
        .iter()
        .map(|p| format!("127.0.0.1:{p}"))
        .collect();
    let uri = format!("mongodb://{}/?replicaSet={name}", hosts.join(","));
    ReplicaSet {
        instance,
        name,
        uri,
    }
}

impl ReplicaSet {
    /// The replica set URI, listing every node:
    /// `mongodb://127.0.0.1:<p0>,127.0.0.1:<p1>,…/?replicaSet=<name>`.
    pub fn uri(&self) -> &str {
        &self.uri
    }

    /// The URI of node `node` alone, with `directConnection=true`.
    pub fn node_uri(&self, node: usize) -> String {
        format!(
            "mongodb://127.0.0.1:{}/?directConnection=true",
            self.instance.port(node)
        )
    }

    /// The replica set name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// How many nodes it has.
    pub fn node_count(&self) -> usize {
        self.instance.node_count()
    }

    /// The port of node `node` on 127.0.0.1.
    pub fn port(&self, node: usize) -> u16 {
        self.instance.port(node)
    }

    /// Whether node `node` is running (it was not killed, or was restarted).
    pub fn is_running(&self, node: usize) -> bool {
        self.instance.is_running(node)
    }

    /// Kills node `node` with SIGKILL and waits until it is gone. Does
    /// nothing if it is not running.
    ///
    /// # Panics
    ///
    /// When there is no such node.
    pub fn kill(&self, node: usize) {
        self.instance.kill(node);
    }

    /// Starts node `node` again, on the same port and data, killing it first
    /// if it runs, and waits until it answers. It may not yet be PRIMARY or
    /// SECONDARY; see [`ReplicaSet::wait_for_primary`].
    ///
    /// # Panics
    ///
    /// When there is no such node, or it cannot be started.
    pub async fn restart(&self, node: usize) {
        self.instance.kill(node);
        let started = async {
            self.instance.spawn(node)?;
            self.instance.wait_for_node(node).await
        };
        if let Err(e) = started.await {
            panic!(
                "relaybus-harness: cannot restart node {node} of {}: {e}",
                self.name
            );
        }
    }

    /// The node that is a writable primary now, if any.
    pub async fn primary(&self) -> Option<usize> {
        server::find_primary(&self.live_ports()).await
    }

    /// Waits up to 60 s for a writable primary among the running nodes and
    /// returns its index.
    ///
    /// # Panics
    ///
    /// When there is none by then.
    pub async fn wait_for_primary(&self) -> usize {
        match server::wait_for_primary(&self.live_ports(), false, STARTUP_TIMEOUT).await {
            Ok(node) => node,
            Err(e) => panic!(
                "relaybus-harness: replica set {}: {}",
                self.name,
                self.instance.start_error(&e)
            ),
        }
    }

    /// Makes the current primary step down (`replSetStepDown`) and returns
    /// its index. It cannot be elected again for 10 s, while another node
    /// takes over; a single-node set is forced down and has no primary for
    /// about 2 s. Call [`ReplicaSet::wait_for_primary`] to wait for the next
    /// one.
    ///
    /// # Panics
    ///
    /// When there is no primary within 60 s, or the command fails.
    pub async fn step_down(&self) -> usize {
        match self.try_step_down().await {
            Ok(primary) => primary,
            Err(e) => panic!("relaybus-harness: {e}"),
        }
    }

    /// As [`ReplicaSet::step_down`], but a primary that refuses to step down (no secondary
    /// caught up within 5 s, say) is an error rather than a panic.
    ///
    /// # Errors
    ///
    /// The refusal of `replSetStepDown`, naming the node and the set.
    ///
    /// # Panics
    ///
    /// When there is no primary within 60 s.
    pub async fn try_step_down(&self) -> Result<usize, HarnessError> {
        let primary = self.wait_for_primary().await;
        let command = if self.node_count() == 1 {
            // No secondary to catch up: force it, briefly.
            doc! { "replSetStepDown": 2, "secondaryCatchUpPeriodSecs": 1, "force": true }
        } else {
            doc! { "replSetStepDown": 10, "secondaryCatchUpPeriodSecs": 5 }
        };
        server::admin_command(self.port(primary), command, Duration::from_secs(30))
            .await
            .map_err(|e| {
                HarnessError::Command(format!(
                    "replSetStepDown on node {primary} of {} failed: {e}",
                    self.name
                ))
            })?;
        Ok(primary)
    }

    /// Ports of running nodes; a killed node's port stays in place as 0 so
    /// that indexes keep matching nodes.
    fn live_ports(&self) -> Vec<u16> {
        (0..self.node_count())
            .map(|n| {
                if self.instance.is_running(n) {
                    self.instance.port(n)
                } else {
                    0
                }
            })
            .collect()
    }
}
