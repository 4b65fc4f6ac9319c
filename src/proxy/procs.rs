//! Finding the proxy process by name in `/proc` and signalling it.
//!
//! In a pod with `shareProcessNamespace: true` the sidecar sees the
//! proxy's process; `/proc/<pid>/comm` is the executable's file name, cut
//! to 15 bytes by the kernel.

use std::io;
use std::path::Path;

use rustix::process::{Pid, Signal, kill_process};

/// Longest `/proc/<pid>/comm` (the kernel's `TASK_COMM_LEN` less the NUL).
pub(crate) const MAX_COMM_LEN: usize = 15;

/// Whether a `comm` value names `name` (a name longer than the kernel keeps
/// matches by its first 15 bytes).
pub(crate) fn comm_matches(comm: &str, name: &str) -> bool {
    let comm = comm.strip_suffix('\n').unwrap_or(comm);
    if name.len() > MAX_COMM_LEN {
        name.as_bytes().get(..MAX_COMM_LEN) == Some(comm.as_bytes())
    } else {
        comm == name
    }
}

/// The state letter of `/proc/<pid>/stat` (`R`, `S`, `Z`, ...): the field
/// after the parenthesised name, which may itself hold spaces or `)`.
pub(crate) fn stat_state(stat: &str) -> Option<char> {
    let after = &stat[stat.rfind(')')? + 1..];
    after.trim_start().chars().next()
}

/// When `pid` under `proc_root` started, in clock ticks since boot (field
/// 22 of its `stat`): with the pid, it names one process, which a reused
/// pid does not.
pub(crate) fn start_ticks(proc_root: &Path, pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(proc_root.join(pid.to_string()).join("stat")).ok()?;
    let after = &stat[stat.rfind(')')? + 1..];
    // Fields 3 (state) onwards; starttime is field 22.
    after.split_whitespace().nth(19)?.parse().ok()
}

/// Whether the process `pid` under `proc_root` exists and has not exited
/// (a zombie, exited but not yet reaped by its parent, counts as gone).
fn running(proc_root: &Path, pid: u32) -> bool {
    match std::fs::read_to_string(proc_root.join(pid.to_string()).join("stat")) {
        Ok(stat) => !matches!(stat_state(&stat), Some('Z' | 'X') | None),
        Err(_) => false,
    }
}

/// The running processes under `proc_root` (normally `/proc`) whose comm
/// is `name`, this process excluded, by pid.
pub(crate) fn find_by_name(proc_root: &Path, name: &str) -> io::Result<Vec<u32>> {
    let own = std::process::id();
    let mut found = Vec::new();
    for entry in std::fs::read_dir(proc_root)? {
        let Ok(entry) = entry else { continue };
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<u32>().ok())
        else {
            continue;
        };
        if pid == own {
            continue;
        }
        // A process may exit between the listing and the read.
        let Ok(comm) = std::fs::read_to_string(entry.path().join("comm")) else {
            continue;
        };
        if comm_matches(&comm, name) && running(proc_root, pid) {
            found.push(pid);
        }
    }
    found.sort_unstable();
    Ok(found)
}

/// Whether any of `pids` still runs under the name `name` (a pid reused by
/// another program does not count).
pub(crate) fn any_running(proc_root: &Path, pids: &[u32], name: &str) -> bool {
    pids.iter().any(|pid| {
        let dir = proc_root.join(pid.to_string());
        std::fs::read_to_string(dir.join("comm")).is_ok_and(|comm| comm_matches(&comm, name))
            && running(proc_root, *pid)
    })
}

/// Sends SIGTERM to `pid`.
pub fn terminate(pid: u32) -> io::Result<()> {
    let raw = i32::try_from(pid).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    let pid = Pid::from_raw(raw).ok_or_else(|| io::Error::from(io::ErrorKind::InvalidInput))?;
    kill_process(pid, Signal::TERM).map_err(io::Error::from)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_process_is_named_by_its_pid_and_start() {
        let own = std::process::id();
        let proc_root = Path::new("/proc");
        let start = start_ticks(proc_root, own).expect("our own stat");
        assert_eq!(start_ticks(proc_root, own), Some(start));
        assert_eq!(start_ticks(proc_root, u32::MAX), None);
    }

    #[test]
    fn comm_compares_exactly_or_by_the_kernel_prefix() {
        assert!(comm_matches("sbproxy\n", "sbproxy"));
        assert!(comm_matches("sbproxy", "sbproxy"));
        assert!(!comm_matches("sbproxy2\n", "sbproxy"));
        assert!(!comm_matches("sbprox\n", "sbproxy"));
        assert!(comm_matches("a-very-long-nam\n", "a-very-long-name"));
        assert!(!comm_matches("a-very-long-na\n", "a-very-long-name"));
    }

    #[test]
    fn stat_state_skips_odd_names() {
        assert_eq!(stat_state("12 (sbproxy) S 1 12"), Some('S'));
        assert_eq!(stat_state("12 (a) b) Z 1 12"), Some('Z'));
        assert_eq!(stat_state("garbage"), None);
    }

    #[test]
    fn finds_itself_never_and_a_child_by_name() {
        let me = std::fs::read_to_string("/proc/self/comm").unwrap();
        let found = find_by_name(Path::new("/proc"), me.trim_end()).unwrap();
        assert!(!found.contains(&std::process::id()));
        assert!(
            find_by_name(Path::new("/proc"), "no-such-proc-x")
                .unwrap()
                .is_empty()
        );
        assert!(!any_running(Path::new("/proc"), &[u32::MAX - 1], "x"));
    }
}
