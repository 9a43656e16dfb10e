//! Child processes that never outlive the test process.
//!
//! Every `mongod` of the harness is forked by one thread that lives as long
//! as the process, with `PR_SET_PDEATHSIG = SIGKILL`: the kernel kills the
//! child when the thread that forked it exits, which for that thread means
//! when the whole process ends, however it ends (normal exit, panic, abort,
//! signal). Forking from the calling thread instead would be wrong: each test
//! runs on a thread of its own that exits when the test ends.
//!
//! On a normal exit an `atexit` hook also kills the tracked children and
//! removes their data directories, which the kernel would not do.

use std::io;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::{Mutex, Once, OnceLock, mpsc};
use std::thread;

type SpawnRequest = (Command, mpsc::Sender<io::Result<Child>>);

/// Spawns `cmd` as a child that dies with this process.
pub(crate) fn spawn_tied(mut cmd: Command) -> io::Result<Child> {
    static SPAWNER: OnceLock<mpsc::Sender<SpawnRequest>> = OnceLock::new();

    install_exit_hook();
    let parent = std::process::id() as libc::pid_t;
    let tie = move || -> io::Result<()> {
        // Runs in the forked child before exec: only async-signal-safe calls,
        // no allocation.
        // SAFETY: prctl with PR_SET_PDEATHSIG takes a signal number and has no
        // memory-safety preconditions.
        let rc = unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong) };
        if rc == -1 {
            return Err(io::Error::last_os_error());
        }
        // The parent may have died between fork and prctl; then the signal
        // will never come, so do not start at all.
        // SAFETY: getppid has no preconditions.
        if unsafe { libc::getppid() } != parent {
            return Err(io::Error::from_raw_os_error(libc::ESRCH));
        }
        Ok(())
    };
    // SAFETY: the closure only calls async-signal-safe functions and does not
    // allocate, as required between fork and exec.
    unsafe {
        cmd.pre_exec(tie);
    }

    let spawner = SPAWNER.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<SpawnRequest>();
        thread::Builder::new()
            .name("relaybus-harness-spawner".into())
            .spawn(move || {
                // `rx` never disconnects: its sender lives in a static. This
                // thread must never exit, see the module documentation.
                for (mut cmd, reply) in rx {
                    let _ = reply.send(cmd.spawn());
                }
                loop {
                    thread::park();
                }
            })
            .expect("relaybus-harness: cannot spawn a thread");
        tx
    });
    let gone = || io::Error::other("relaybus-harness spawner thread is gone");
    let (tx, rx) = mpsc::channel();
    spawner.send((cmd, tx)).map_err(|_| gone())?;
    let child = rx.recv().map_err(|_| gone())??;
    track_pid(child.id());
    Ok(child)
}

/// Kills (SIGKILL) and reaps a child started by [`spawn_tied`].
pub(crate) fn kill_child(child: &mut Child) {
    untrack_pid(child.id());
    let _ = child.kill();
    let _ = child.wait();
}

/// Forgets a child started by [`spawn_tied`] that was reaped elsewhere.
pub(crate) fn untrack_child(pid: u32) {
    untrack_pid(pid);
}

struct Live {
    pids: Vec<u32>,
    dirs: Vec<PathBuf>,
}

static LIVE: Mutex<Live> = Mutex::new(Live {
    pids: Vec::new(),
    dirs: Vec::new(),
});

fn live() -> std::sync::MutexGuard<'static, Live> {
    LIVE.lock().unwrap_or_else(|p| p.into_inner())
}

fn track_pid(pid: u32) {
    live().pids.push(pid);
}

fn untrack_pid(pid: u32) {
    live().pids.retain(|&p| p != pid);
}

/// Removes `dir` at exit unless [`untrack_dir`] is called first.
pub(crate) fn track_dir(dir: &Path) {
    install_exit_hook();
    live().dirs.push(dir.to_owned());
}

pub(crate) fn untrack_dir(dir: &Path) {
    live().dirs.retain(|d| d != dir);
}

fn install_exit_hook() {
    static HOOK: Once = Once::new();
    HOOK.call_once(|| {
        // SAFETY: registers a plain `extern "C"` function; it can fail only
        // when out of memory, in which case the kernel's PDEATHSIG still kills
        // the children.
        unsafe {
            libc::atexit(kill_all_at_exit);
        }
    });
}

extern "C" fn kill_all_at_exit() {
    let mut live = live();
    for &pid in &live.pids {
        // SAFETY: plain system calls on pids of our own children.
        unsafe {
            libc::kill(pid as libc::pid_t, libc::SIGKILL);
        }
    }
    for &pid in &live.pids {
        // SAFETY: as above; a null status pointer is allowed.
        unsafe {
            libc::waitpid(pid as libc::pid_t, std::ptr::null_mut(), 0);
        }
    }
    live.pids.clear();
    for dir in live.dirs.drain(..) {
        let _ = std::fs::remove_dir_all(dir);
    }
}

/// Whether `pid` names a live (not zombie) process.
pub(crate) fn pid_alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state is the first field after the command name in parentheses.
        Ok(stat) => match stat.rfind(')') {
            Some(i) => !matches!(stat[i + 1..].trim_start().chars().next(), Some('Z' | 'X')),
            None => true,
        },
        Err(_) => false,
    }
}

/// Sends SIGSTOP to `pid` and returns once every thread of it is stopped.
///
/// `kill` returns when the signal is queued, not when the process has stopped: the kernel
/// wakes one thread to take the stop, and until that thread runs, the others may go on
/// serving (a broker's worker woken by a request, on a loaded machine). A test that pauses a
/// server to make requests fail must wait for the stop itself.
pub(crate) async fn pause(pid: u32, within: std::time::Duration) -> io::Result<()> {
    // SAFETY: a plain system call; a pid that is gone gives ESRCH, which is returned.
    if unsafe { libc::kill(pid as libc::pid_t, libc::SIGSTOP) } == -1 {
        return Err(io::Error::last_os_error());
    }
    let deadline = tokio::time::Instant::now() + within;
    loop {
        if all_threads_stopped(pid)? {
            return Ok(());
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!(
                    "process {pid} took SIGSTOP but not every thread stopped within {within:?}"
                ),
            ));
        }
        tokio::time::sleep(std::time::Duration::from_millis(1)).await;
    }
}

/// Whether every thread of `pid` is in the stopped state (`T` in `/proc/PID/task/TID/stat`).
fn all_threads_stopped(pid: u32) -> io::Result<bool> {
    for task in std::fs::read_dir(format!("/proc/{pid}/task"))? {
        let stat = match std::fs::read_to_string(task?.path().join("stat")) {
            Ok(stat) => stat,
            // A thread that ended between the listing and the read.
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            Err(e) => return Err(e),
        };
        // The state follows the command name, which is in parentheses and may hold spaces.
        let state = stat
            .rsplit_once(") ")
            .and_then(|(_, rest)| rest.chars().next());
        if !matches!(state, Some('T' | 't')) {
            return Ok(false);
        }
    }
    Ok(true)
}
