//! Which process a heartbeat document belongs to, and whether that process is gone: a process
//! that restarts after a crash, or any other of the same host, ends the dead one's server
//! sessions at once instead of after its heartbeat expiry.
//!
//! Known on Linux only, from `/proc`: the host is its name, the boot, the process id namespace
//! and the user, so that two processes with the same `host` see each other's process ids in
//! `/proc` (the same user's processes stay visible with `hidepid`). A process counts as gone
//! when its `/proc/<pid>/stat` is missing, names a zombie, or names a later process that took
//! the id again (another start time). A process that is only stopped (`SIGSTOP`) still runs:
//! only its heartbeat expiry ends its sessions.

use std::sync::OnceLock;

/// This process, as a heartbeat document names it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ProcessIdentity {
    pub(crate) host: String,
    pub(crate) pid: u32,
    pub(crate) started: u64,
}

impl ProcessIdentity {
    /// This process; `None` where `/proc` does not tell.
    pub(crate) fn current() -> Option<&'static ProcessIdentity> {
        static CURRENT: OnceLock<Option<ProcessIdentity>> = OnceLock::new();
        CURRENT.get_or_init(read_current).as_ref()
    }

    /// Writes this process's host, process id and start time into `set`, where `/proc` tells.
    pub(crate) fn stamp(set: &mut mongodb::bson::Document) {
        use super::schema::field;
        if let Some(process) = Self::current() {
            set.insert(field::HOST, &process.host);
            set.insert(field::PID, i64::from(process.pid));
            set.insert(
                field::STARTED,
                i64::try_from(process.started).unwrap_or(i64::MAX),
            );
        }
    }

    /// Whether the process `pid`, started at `started`, of this identity's host is gone.
    /// `false` when unsure.
    pub(crate) fn is_gone(pid: u32, started: u64) -> bool {
        match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
            Err(error) => error.kind() == std::io::ErrorKind::NotFound,
            Ok(stat) => match parse_stat(&stat) {
                Some((state, start)) => matches!(state, 'Z' | 'X') || start != started,
                None => false,
            },
        }
    }
}

fn read_current() -> Option<ProcessIdentity> {
    #[cfg(target_os = "linux")]
    {
        use std::os::unix::fs::MetadataExt;

        let read = |path: &str| std::fs::read_to_string(path).ok();
        let hostname = read("/proc/sys/kernel/hostname")?;
        let boot = read("/proc/sys/kernel/random/boot_id")?;
        let namespace = std::fs::read_link("/proc/self/ns/pid").ok()?;
        let uid = std::fs::metadata("/proc/self").ok()?.uid();
        let (_, started) = parse_stat(&read("/proc/self/stat")?)?;
        Some(ProcessIdentity {
            host: format!(
                "{}/{}/{}/{uid}",
                hostname.trim(),
                boot.trim(),
                namespace.display()
            ),
            pid: std::process::id(),
            started,
        })
    }
    #[cfg(not(target_os = "linux"))]
    {
        None
    }
}

/// The state and start time of a `/proc/<pid>/stat` line. The command name, in parentheses,
/// may hold spaces and parentheses itself: fields are counted after the last `)`.
fn parse_stat(stat: &str) -> Option<(char, u64)> {
    let rest = &stat[stat.rfind(')')? + 1..];
    let mut fields = rest.split_whitespace();
    let state = fields.next()?.chars().next()?;
    // Field 3 is the state; the start time is field 22.
    let started = fields.nth(18)?.parse().ok()?;
    Some((state, started))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stat_line_gives_its_state_and_start_even_with_odd_command_names() {
        let line = "4242 (a) b (c)) S 1 4242 4242 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 \
                    987654 1000 10 18446744073709551615 1 1 0 0 0 0 0 0 0 0 0 0 17 1 0 0";
        assert_eq!(parse_stat(line), Some(('S', 987_654)));
        assert_eq!(parse_stat("12 (x) Z"), None);
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn this_process_runs_and_a_later_start_time_names_another() {
        let Some(me) = ProcessIdentity::current() else {
            panic!("/proc must tell on the test machine");
        };
        assert_eq!(me.pid, std::process::id());
        assert!(!ProcessIdentity::is_gone(me.pid, me.started));
        assert!(ProcessIdentity::is_gone(me.pid, me.started + 1));
        assert!(ProcessIdentity::is_gone(u32::MAX, me.started));
    }
}
