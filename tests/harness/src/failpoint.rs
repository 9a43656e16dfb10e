//! Server-side failure injection with `configureFailPoint`.

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::Duration;

use mongodb::bson::{Document, doc};
use mongodb::options::{ClientOptions, SelectionCriteria, ServerAddress};
use mongodb::{Client, ServerType};
use tokio::sync::OwnedMutexGuard;

/// How long [`FailPoint::enable`] waits for another holder of the same fail
/// point to let go.
const LOCK_TIMEOUT: Duration = Duration::from_secs(120);

/// A fail point switched on on one server, switched off again by
/// [`FailPoint::disable`] or, failing that, when dropped.
///
/// Needs a server started with `enableTestCommands=1`, as every server of
/// this harness and of `scripts/mongo` is. A fail point applies to every
/// client of the server, so on the shared server of [`crate::test_db`] limit
/// a `failCommand` fail point to the test's own client with `appName`.
///
/// A server has one configuration per fail point: enabling it again replaces
/// the previous one, and switching it off ends it for everyone. So a
/// `FailPoint` holds the fail point exclusively, for one server, until it is
/// disabled or dropped: [`FailPoint::enable`] waits while another holds it,
/// in this process or another (a lock file under `target/mongodb/locks/`).
/// Tests running in parallel take turns. Enabling a fail point that the same
/// test still holds therefore waits, and fails after 120 s.
///
/// ```no_run
/// # async fn example() -> mongodb::error::Result<()> {
/// use mongodb::bson::doc;
/// use relaybus_harness::{FailPoint, test_db};
///
/// let db = test_db("fail_point_example").await;
/// let fail_point = FailPoint::enable(
///     &db.client,
///     doc! {
///         "configureFailPoint": "failCommand",
///         "mode": { "times": 1 },
///         "data": { "failCommands": ["insert"], "errorCode": 2, "appName": &db.name },
///     },
/// )
/// .await?;
/// let error = db.db().collection("c").insert_one(doc! {}).await.unwrap_err();
/// fail_point.disable().await?;
/// # let _ = error;
/// # Ok(())
/// # }
/// ```
#[derive(Debug)]
#[must_use = "the fail point is switched off when this is dropped"]
pub struct FailPoint {
    client: Client,
    name: String,
    address: ServerAddress,
    armed: bool,
    // Released after the fail point is off: fields drop after `Drop::drop`.
    _process_lock: OwnedMutexGuard<()>,
    _file_lock: File,
}

impl FailPoint {
    /// Runs `command`, a whole `configureFailPoint` command such as
    /// `{configureFailPoint: "failCommand", mode: {times: 1}, data: {…}}`,
    /// on the `admin` database of a writable server (the primary) of
    /// `client`, once no other `FailPoint` holds this fail point on that
    /// server, and remembers the server to switch the fail point off there.
    ///
    /// # Panics
    ///
    /// When `command` has no string field `configureFailPoint`, or the fail
    /// point stays held by another `FailPoint` for 120 s.
    pub async fn enable(client: &Client, command: Document) -> mongodb::error::Result<FailPoint> {
        let name = command
            .get_str("configureFailPoint")
            .unwrap_or_else(|_| {
                panic!("relaybus-harness: not a configureFailPoint command: {command}")
            })
            .to_owned();
        // Pick one writable server and learn which it is.
        let chosen: Arc<Mutex<Option<ServerAddress>>> = Arc::default();
        let pin = Arc::clone(&chosen);
        let criteria = SelectionCriteria::Predicate(Arc::new(move |server| {
            let writable = matches!(
                server.server_type(),
                ServerType::Standalone
                    | ServerType::RsPrimary
                    | ServerType::Mongos
                    | ServerType::LoadBalancer
            );
            let mut pin = pin.lock().unwrap_or_else(|p| p.into_inner());
            match &*pin {
                Some(address) => address == server.address(),
                None if writable => {
                    *pin = Some(server.address().clone());
                    true
                }
                None => false,
            }
        }));
        client
            .database("admin")
            .run_command(doc! { "ping": 1 })
            .selection_criteria(criteria)
            .await?;
        let address = chosen
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
            .expect("the command ran on a selected server");

        let key = lock_key(&address, &name);
        let locks = async {
            let process_lock = process_lock(&key).lock_owned().await;
            let file_lock = file_lock(&key).await;
            (process_lock, file_lock)
        };
        let (process_lock, file_lock) = match tokio::time::timeout(LOCK_TIMEOUT, locks).await {
            Ok((p, Ok(f))) => (p, f),
            Ok((_, Err(e))) => panic!("relaybus-harness: cannot lock fail point {key}: {e}"),
            Err(_) => panic!(
                "relaybus-harness: fail point {name} on {address} is still held by another \
                 FailPoint after {} s; disable or drop that one first",
                LOCK_TIMEOUT.as_secs()
            ),
        };

        client
            .database("admin")
            .run_command(command)
            .selection_criteria(at(&address))
            .await?;
        Ok(FailPoint {
            client: client.clone(),
            name,
            address,
            armed: true,
            _process_lock: process_lock,
            _file_lock: file_lock,
        })
    }

    /// The fail point's name, such as `failCommand`.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Switches the fail point off (`mode: "off"`), with the client it was
    /// enabled with, in the caller's runtime, and lets others enable it.
    /// Prefer this to dropping. On error, dropping tries once more.
    pub async fn disable(mut self) -> mongodb::error::Result<()> {
        self.client
            .database("admin")
            .run_command(off(&self.name))
            .selection_criteria(at(&self.address))
            .await?;
        self.armed = false;
        Ok(())
    }
}

fn off(name: &str) -> Document {
    doc! { "configureFailPoint": name, "mode": "off" }
}

/// Selects the server at `address`.
fn at(address: &ServerAddress) -> SelectionCriteria {
    let address = address.clone();
    SelectionCriteria::Predicate(Arc::new(move |server| server.address() == &address))
}

/// Names fail point `name` on the server at `address`, safely for a file name.
fn lock_key(address: &ServerAddress, name: &str) -> String {
    format!("{address}-{name}")
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '.' {
                c
            } else {
                '_'
            }
        })
        .collect()
}

/// The lock of this process for fail point `key`.
fn process_lock(key: &str) -> Arc<tokio::sync::Mutex<()>> {
    static LOCKS: Mutex<Option<HashMap<String, Arc<tokio::sync::Mutex<()>>>>> = Mutex::new(None);
    let mut locks = LOCKS.lock().unwrap_or_else(|p| p.into_inner());
    Arc::clone(
        locks
            .get_or_insert_with(HashMap::new)
            .entry(key.to_owned())
            .or_default(),
    )
}

/// An exclusive `flock` on `target/mongodb/locks/<key>.lock`, for tests in
/// other processes; taken on a thread of its own since it blocks. Closing the
/// file releases it.
async fn file_lock(key: &str) -> io::Result<File> {
    let dir: PathBuf = crate::mongodb_dir().join("locks");
    let path = dir.join(format!("{key}.lock"));
    let (tx, rx) = tokio::sync::oneshot::channel();
    thread::spawn(move || {
        let locked = (|| {
            std::fs::create_dir_all(&dir)?;
            let file = OpenOptions::new()
                .create(true)
                .truncate(false)
                .write(true)
                .open(&path)?;
            // SAFETY: flock on a file descriptor we own.
            if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX) } != 0 {
                return Err(io::Error::last_os_error());
            }
            Ok(file)
        })();
        // If the caller gave up, the file drops here and the lock with it.
        let _ = tx.send(locked);
    });
    rx.await
        .map_err(|_| io::Error::other("the fail point lock thread died"))?
}

impl Drop for FailPoint {
    /// Switches the fail point off if [`FailPoint::disable`] was not called,
    /// also while a test unwinds from a panic. Drop cannot await, and the
    /// enabling client belongs to a runtime that may be blocked or gone, so
    /// this connects anew to the same server, without credentials, from a
    /// thread with a runtime of its own, and blocks until done. Failures are
    /// printed, not raised.
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let uri = format!("mongodb://{}/?directConnection=true", self.address);
        let name = self.name.clone();
        let done = thread::spawn(move || -> Result<(), String> {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(|e| e.to_string())?;
            runtime.block_on(async {
                let mut options = ClientOptions::parse(&uri)
                    .await
                    .map_err(|e| e.to_string())?;
                options.server_selection_timeout = Some(Duration::from_secs(10));
                let client = Client::with_options(options).map_err(|e| e.to_string())?;
                let result = client.database("admin").run_command(off(&name)).await;
                client.shutdown().immediate(true).await;
                result.map(drop).map_err(|e| e.to_string())
            })
        })
        .join();
        match done {
            Ok(Ok(())) => {}
            Ok(Err(e)) => eprintln!(
                "relaybus-harness: could not switch fail point {} off on {}: {e}",
                self.name, self.address
            ),
            Err(_) => eprintln!(
                "relaybus-harness: the thread switching fail point {} off panicked",
                self.name
            ),
        }
    }
}
