//! The `relaybus-mongo` command behind `scripts/mongo`: long-lived local
//! replica sets for development and for `scripts/test`.
//!
//! Unlike the rest of the crate, these servers are daemons (`mongod --fork`)
//! that outlive the command; `stop` ends them. Each replica set NAME keeps
//! its data and logs in `target/mongodb/NAME/`: a `cluster` file with its
//! ports, and `node<i>/` with `db/`, `mongod.log` and `mongod.pid` for each
//! node. Not a stable interface: use `scripts/mongo`.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, ExitCode, Stdio};
use std::time::{Duration, Instant};

use crate::mongod_path;
use crate::process::pid_alive;
use crate::server::{self, NodeSpec, STARTUP_TIMEOUT, free_ports, log_tail, port_open};

const USAGE: &str = "\
usage: relaybus-mongo <command> [options]

commands:
  start [--nodes N] [--name NAME] [--port PORT]
        start replica set NAME (default relaybus-dev) of N nodes (default 1) on
        127.0.0.1, ports PORT, PORT+1, ... (default 27117; 0 picks free ports),
        wait until it has a PRIMARY and print its URI as the last line. If it
        runs already, print its URI. Data and logs: target/mongodb/NAME/.
  stop [--name NAME] [--rm]
        shut replica set NAME down cleanly (SIGTERM, wait); with --rm also
        delete its data and logs.
  uri [--name NAME]
        print the URI of replica set NAME.
  status [--name NAME]
        show replica set NAME, or every one in target/mongodb/; exit status 1
        if the named one is not running.";

const DEFAULT_NAME: &str = "relaybus-dev";
const DEFAULT_PORT: u16 = 27117;
const STOP_TIMEOUT: Duration = Duration::from_secs(60);

/// Runs the command line; the entry point of the `relaybus-mongo` binary.
pub fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match run(&args) {
        Ok(code) => code,
        Err(message) => {
            eprintln!("relaybus-mongo: {message}");
            ExitCode::FAILURE
        }
    }
}

#[derive(Debug, Default)]
struct Options {
    nodes: Option<usize>,
    name: Option<String>,
    port: Option<u16>,
    rm: bool,
}

impl Options {
    fn name(&self) -> &str {
        self.name.as_deref().unwrap_or(DEFAULT_NAME)
    }
}

fn run(args: &[String]) -> Result<ExitCode, String> {
    let Some((command, rest)) = args.split_first() else {
        return Err(format!("no command given\n{USAGE}"));
    };
    if matches!(command.as_str(), "-h" | "--help" | "help") {
        println!("{USAGE}");
        return Ok(ExitCode::SUCCESS);
    }
    let allowed: &[&str] = match command.as_str() {
        "start" => &["--nodes", "--name", "--port"],
        "stop" => &["--name", "--rm"],
        "uri" | "status" => &["--name"],
        other => return Err(format!("unknown command {other:?}\n{USAGE}")),
    };
    let options = parse_options(rest, allowed)?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("cannot build a tokio runtime: {e}"))?;
    match command.as_str() {
        "start" => runtime
            .block_on(start(&options))
            .map(|()| ExitCode::SUCCESS),
        "stop" => stop(&options).map(|()| ExitCode::SUCCESS),
        "uri" => {
            let cluster = Cluster::load(options.name())?
                .ok_or_else(|| format!("no replica set {} (start it first)", options.name()))?;
            println!("{}", cluster.uri());
            Ok(ExitCode::SUCCESS)
        }
        _ => runtime.block_on(status(&options)),
    }
}

fn parse_options(args: &[String], allowed: &[&str]) -> Result<Options, String> {
    let mut options = Options::default();
    let mut args = args.iter();
    while let Some(arg) = args.next() {
        let (flag, inline) = match arg.split_once('=') {
            Some((f, v)) => (f, Some(v.to_owned())),
            None => (arg.as_str(), None),
        };
        if !allowed.contains(&flag) {
            return Err(format!("unexpected argument {arg:?}\n{USAGE}"));
        }
        if flag == "--rm" {
            options.rm = true;
            continue;
        }
        let value = match inline {
            Some(v) => v,
            None => args
                .next()
                .cloned()
                .ok_or_else(|| format!("{flag} needs a value"))?,
        };
        match flag {
            "--nodes" => {
                let n: usize = value
                    .parse()
                    .map_err(|_| format!("--nodes {value:?}: not a number"))?;
                if !(1..=7).contains(&n) {
                    return Err(format!("--nodes {n}: a replica set has 1 to 7 nodes"));
                }
                options.nodes = Some(n);
            }
            "--port" => {
                options.port = Some(
                    value
                        .parse()
                        .map_err(|_| format!("--port {value:?}: not a port number"))?,
                );
            }
            _ => {
                let valid = !value.is_empty()
                    && value.len() <= 64
                    && value
                        .chars()
                        .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
                    && !value.starts_with("harness-");
                if !valid {
                    return Err(format!(
                        "--name {value:?}: use up to 64 letters, digits, '_' and '-', \
                         not starting with harness-"
                    ));
                }
                options.name = Some(value);
            }
        }
    }
    Ok(options)
}

/// A replica set of this command, as recorded in `target/mongodb/NAME/`.
#[derive(Debug)]
struct Cluster {
    name: String,
    dir: PathBuf,
    ports: Vec<u16>,
}

impl Cluster {
    fn dir_of(name: &str) -> PathBuf {
        crate::mongodb_dir().join(name)
    }

    fn state_path(dir: &Path) -> PathBuf {
        dir.join("cluster")
    }

    /// The recorded replica set NAME, if any.
    fn load(name: &str) -> Result<Option<Cluster>, String> {
        let dir = Self::dir_of(name);
        let path = Self::state_path(&dir);
        let text = match fs::read_to_string(&path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(format!("reading {}: {e}", path.display())),
        };
        let ports = text
            .lines()
            .find_map(|l| l.strip_prefix("ports="))
            .and_then(|p| {
                p.split(',')
                    .map(|p| p.trim().parse::<u16>().ok())
                    .collect::<Option<Vec<u16>>>()
            })
            .filter(|p| !p.is_empty())
            .ok_or_else(|| format!("{} is damaged: no ports= line", path.display()))?;
        Ok(Some(Cluster {
            name: name.to_owned(),
            dir,
            ports,
        }))
    }

    fn create(name: &str, ports: Vec<u16>) -> Result<Cluster, String> {
        let dir = Self::dir_of(name);
        fs::create_dir_all(&dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
        let list: Vec<String> = ports.iter().map(u16::to_string).collect();
        let path = Self::state_path(&dir);
        fs::write(&path, format!("ports={}\n", list.join(",")))
            .map_err(|e| format!("writing {}: {e}", path.display()))?;
        Ok(Cluster {
            name: name.to_owned(),
            dir,
            ports,
        })
    }

    fn uri(&self) -> String {
        let hosts: Vec<String> = self
            .ports
            .iter()
            .map(|p| format!("127.0.0.1:{p}"))
            .collect();
        format!("mongodb://{}/?replicaSet={}", hosts.join(","), self.name)
    }

    fn specs(&self) -> Vec<NodeSpec> {
        self.ports
            .iter()
            .enumerate()
            .map(|(i, &port)| NodeSpec {
                port,
                dir: self.dir.join(format!("node{i}")),
                repl_set: Some(self.name.clone()),
            })
            .collect()
    }

    fn log_tails(&self) -> String {
        self.specs()
            .iter()
            .map(|s| log_tail(&s.log_path(), 20))
            .collect::<Vec<_>>()
            .join("\n")
    }
}

/// The pid of the running `mongod` of `spec`: its pid file names a live
/// process whose command line has this node's data directory, so a recycled
/// pid of some other process is never taken for it.
fn node_pid(spec: &NodeSpec) -> Option<u32> {
    let pid: u32 = fs::read_to_string(spec.pid_path())
        .ok()?
        .trim()
        .parse()
        .ok()?;
    if !pid_alive(pid) {
        return None;
    }
    let cmdline = fs::read(format!("/proc/{pid}/cmdline")).ok()?;
    let db = spec.db_path();
    let db = db.to_string_lossy();
    cmdline
        .split(|&b| b == 0)
        .any(|arg| arg == db.as_bytes())
        .then_some(pid)
}

async fn start(options: &Options) -> Result<(), String> {
    let name = options.name();
    let cluster = match Cluster::load(name)? {
        Some(cluster) => {
            let nodes_differ = options.nodes.is_some_and(|n| n != cluster.ports.len());
            let port_differs = options
                .port
                .is_some_and(|p| p != 0 && p != cluster.ports[0]);
            if nodes_differ || port_differs {
                return Err(format!(
                    "replica set {name} exists with {} node(s) on port {}; to change that, \
                     delete it with `scripts/mongo stop --name {name} --rm`",
                    cluster.ports.len(),
                    cluster.ports[0]
                ));
            }
            cluster
        }
        None => {
            let nodes = options.nodes.unwrap_or(1);
            let ports = match options.port.unwrap_or(DEFAULT_PORT) {
                0 => free_ports(nodes).map_err(|e| e.to_string())?,
                base => (0..nodes)
                    .map(|i| base.checked_add(i as u16))
                    .collect::<Option<Vec<u16>>>()
                    .ok_or_else(|| format!("--port {base}: too high for {nodes} nodes"))?,
            };
            if let Some(port) = ports.iter().find(|&&p| port_open(p)) {
                return Err(format!(
                    "port {port} is in use by another process; choose another with --port \
                     (0 picks free ports)"
                ));
            }
            Cluster::create(name, ports)?
        }
    };

    let mongod = mongod_path().map_err(|e| e.to_string())?;
    let specs = cluster.specs();
    let mut forked: Vec<(usize, Child)> = Vec::new();
    for (i, spec) in specs.iter().enumerate() {
        if node_pid(spec).is_some() {
            continue;
        }
        if port_open(spec.port) {
            return Err(format!(
                "port {} is in use by another process, not by node {i} of {name}; \
                 choose another with --port (after `scripts/mongo stop --name {name} --rm`)",
                spec.port
            ));
        }
        let mut cmd = spec.command(&mongod, true).map_err(|e| e.to_string())?;
        let out_path = spec.dir.join("fork.out");
        let out = fs::File::create(&out_path)
            .map_err(|e| format!("creating {}: {e}", out_path.display()))?;
        let err = out
            .try_clone()
            .map_err(|e| format!("cloning a file handle: {e}"))?;
        cmd.stdout(Stdio::from(out)).stderr(Stdio::from(err));
        let child = cmd
            .spawn()
            .map_err(|e| format!("starting {}: {e}", mongod.display()))?;
        forked.push((i, child));
    }
    let started = !forked.is_empty();
    let mut failures = Vec::new();
    for (i, mut child) in forked {
        // `mongod --fork` returns once the daemon is ready, or has failed.
        let status = child
            .wait()
            .map_err(|e| format!("waiting for mongod: {e}"))?;
        if !status.success() {
            let spec = &specs[i];
            let out = fs::read_to_string(spec.dir.join("fork.out")).unwrap_or_default();
            failures.push(format!(
                "node {i} (port {}) failed to start ({status}):\n{}\n{}",
                spec.port,
                out.trim_end(),
                log_tail(&spec.log_path(), 20)
            ));
        }
    }
    if !failures.is_empty() {
        let _ = stop_nodes(&specs);
        return Err(format!(
            "replica set {name} did not start; its nodes are stopped, the data is kept in {}\n{}",
            cluster.dir.display(),
            failures.join("\n")
        ));
    }
    if started {
        eprintln!(
            "relaybus-mongo: started {} node(s) of {name}, waiting for a PRIMARY",
            specs.len()
        );
    }

    let ready = async {
        server::initiate(name, &cluster.ports)
            .await
            .map_err(|e| e.to_string())?;
        server::wait_for_primary(&cluster.ports, true, STARTUP_TIMEOUT).await
    };
    if let Err(e) = ready.await {
        let _ = stop_nodes(&specs);
        return Err(format!(
            "replica set {name} did not become ready: {e}; its nodes are stopped, the data \
             is kept in {}\n{}",
            cluster.dir.display(),
            cluster.log_tails()
        ));
    }
    println!("{}", cluster.uri());
    Ok(())
}

/// Sends SIGTERM (a clean shutdown) to every running node and waits until
/// they are gone, with SIGKILL after [`STOP_TIMEOUT`]. Returns how many ran.
fn stop_nodes(specs: &[NodeSpec]) -> Result<usize, String> {
    let pids: Vec<u32> = specs.iter().filter_map(node_pid).collect();
    for &pid in &pids {
        // SAFETY: a plain system call; node_pid checked that pid is our mongod.
        unsafe {
            libc::kill(pid as libc::pid_t, libc::SIGTERM);
        }
    }
    let deadline = Instant::now() + STOP_TIMEOUT;
    while pids.iter().any(|&p| pid_alive(p)) {
        if Instant::now() >= deadline {
            for &pid in pids.iter().filter(|&&p| pid_alive(p)) {
                eprintln!("relaybus-mongo: mongod {pid} ignored SIGTERM, killing it");
                // SAFETY: as above.
                unsafe {
                    libc::kill(pid as libc::pid_t, libc::SIGKILL);
                }
            }
            let deadline = Instant::now() + Duration::from_secs(10);
            while pids.iter().any(|&p| pid_alive(p)) {
                if Instant::now() >= deadline {
                    return Err("mongod did not die after SIGKILL".into());
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(pids.len())
}

fn stop(options: &Options) -> Result<(), String> {
    let name = options.name();
    let dir = Cluster::dir_of(name);
    // Go by the node directories on disk rather than the cluster file, so a
    // half-created replica set is stopped too.
    let mut specs = Vec::new();
    if let Ok(entries) = fs::read_dir(&dir) {
        for entry in entries.flatten() {
            if entry.file_name().to_string_lossy().starts_with("node") {
                specs.push(NodeSpec {
                    port: 0,
                    dir: entry.path(),
                    repl_set: None,
                });
            }
        }
    }
    let stopped = stop_nodes(&specs)?;
    if stopped > 0 {
        eprintln!("relaybus-mongo: stopped {stopped} node(s) of {name}");
    } else if dir.exists() {
        eprintln!("relaybus-mongo: {name} was not running");
    } else {
        eprintln!("relaybus-mongo: no replica set {name}");
    }
    if options.rm && dir.exists() {
        fs::remove_dir_all(&dir).map_err(|e| format!("removing {}: {e}", dir.display()))?;
        eprintln!("relaybus-mongo: removed {}", dir.display());
    }
    Ok(())
}

async fn status(options: &Options) -> Result<ExitCode, String> {
    let names: Vec<String> = match &options.name {
        Some(name) => vec![name.clone()],
        None => {
            let mut names: Vec<String> = fs::read_dir(crate::mongodb_dir())
                .into_iter()
                .flatten()
                .flatten()
                .filter(|e| Cluster::state_path(&e.path()).is_file())
                .filter_map(|e| e.file_name().to_str().map(str::to_owned))
                .collect();
            names.sort();
            if names.is_empty() {
                println!("no replica sets in {}", crate::mongodb_dir().display());
            }
            names
        }
    };
    let mut all_running = true;
    for name in &names {
        let Some(cluster) = Cluster::load(name)? else {
            println!("{name}: none");
            all_running = false;
            continue;
        };
        let mut lines = Vec::new();
        let mut running = 0;
        for (i, spec) in cluster.specs().iter().enumerate() {
            let line = match node_pid(spec) {
                Some(pid) => {
                    running += 1;
                    let state = match server::hello(spec.port).await {
                        Some(h) if server::is_writable_primary(&h) => "PRIMARY",
                        Some(h) if h.get_bool("secondary").unwrap_or(false) => "SECONDARY",
                        Some(_) => "up",
                        None => "not answering",
                    };
                    format!("  node{i} 127.0.0.1:{} pid {pid} {state}", spec.port)
                }
                None => format!("  node{i} 127.0.0.1:{} stopped", spec.port),
            };
            lines.push(line);
        }
        let state = if running == cluster.ports.len() {
            "running"
        } else if running == 0 {
            "stopped"
        } else {
            "partly running"
        };
        all_running &= running == cluster.ports.len();
        println!("{name}: {state}  {}", cluster.uri());
        for line in lines {
            println!("{line}");
        }
    }
    Ok(if options.name.is_some() && !all_running {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    })
}
