//! The node's dead-man switch: a host whose agent died (or lost the coordinator) must not keep
//! training alone. The agent keeps `WORK_DIR/lease` holding a deadline, `LOST_INTERVALS` base
//! intervals after the coordinator's latest acknowledgement (well past the coordinator's own
//! lease of the node, 3 intervals, so by then the node's jobs have been failed over); every
//! rank's wrapper reads it and stops its rank once the deadline has passed. A restarted agent
//! renews it on its first acknowledgement, so ranks survive a quick agent restart.
//!
//! Conservative on purpose: a wrapper that never saw a lease file (an agent on a coordinator
//! that does not acknowledge yet) never fires; one that saw it and then cannot read it keeps
//! the last deadline it read.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use crate::error::Result;

/// The lease lasts this many base intervals after the latest acknowledgement: longer than a
/// PostgreSQL standby waits for a frozen leader (5) plus the new leader's grace for agents to
/// come back (10), plus a coordinator pause or an agent's reconnect (its keepalive, register
/// timeout and backoff), so a healthy node's ranks are never stopped by a failover.
pub const LOST_INTERVALS: u32 = 30;
/// How often a wrapper reads the lease file.
const POLL: Duration = Duration::from_millis(500);

#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Lease {
    /// Unix time (ms) after which the rank is stopped.
    pub deadline_ms: u64,
    /// SIGTERM to SIGKILL, in ms (the agent's stop grace: 5 base intervals).
    pub grace_ms: u64,
}

pub fn path(work_dir: &Path) -> PathBuf {
    work_dir.join("lease")
}

fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// The coordinator acknowledged a message: the lease runs `LOST_INTERVALS` base intervals
/// from now.
pub fn renew(work_dir: &Path, base: Duration) -> Result<Lease> {
    let lease = Lease {
        deadline_ms: now_ms() + (base * LOST_INTERVALS).as_millis() as u64,
        grace_ms: (base * crate::ranks::GRACE_INTERVALS).as_millis() as u64,
    };
    write(&path(work_dir), &lease)?;
    Ok(lease)
}

/// The lease file's mode: ranks running as the job's user (not the agent's) read it in their
/// wrapper; it holds a deadline and a grace period, nothing secret.
pub const MODE: u32 = 0o644;

pub fn write(path: &Path, lease: &Lease) -> Result<()> {
    crate::workdir::replace_with_mode(path, serde_json::to_string(lease).expect("a lease serialises").as_bytes(), MODE)
}

pub fn read(path: &Path) -> Option<Lease> {
    serde_json::from_str(&std::fs::read_to_string(path).ok()?).ok()
}

/// At agent start: a lease an earlier agent left that has run out is removed, or the ranks
/// launched before this agent's first acknowledgement would be stopped at once by its
/// deadline. (The wrappers of ranks that outlived that agent keep the deadline they read:
/// they stop all the same.) Whether one was removed.
pub fn clear_if_lapsed(work_dir: &Path) -> bool {
    let file = path(work_dir);
    match read(&file) {
        Some(l) if l.deadline_ms <= now_ms() => std::fs::remove_file(&file).is_ok(),
        _ => false,
    }
}

/// The wrapper's watch (a thread of its own, for the life of the wrapper): once the lease has
/// run out, SIGTERM to the rank, SIGKILL after the grace period; `fired` says it did.
pub fn switch(lease_file: &Path, child: i32, fired: &AtomicBool) {
    let mut last = read(lease_file);
    loop {
        std::thread::sleep(POLL);
        if let Some(l) = read(lease_file) {
            last = Some(l);
        }
        let Some(lease) = last else { continue };
        if now_ms() < lease.deadline_ms {
            continue;
        }
        fired.store(true, Ordering::SeqCst);
        eprintln!(
            "motley-agent: the agent's lease ran out ({} holds no later deadline): stopping the rank (SIGTERM, SIGKILL after {} ms)",
            lease_file.display(),
            lease.grace_ms
        );
        signal_rank(child, libc::SIGTERM);
        std::thread::sleep(Duration::from_millis(lease.grace_ms));
        signal_rank(child, libc::SIGKILL);
        return;
    }
}

fn leads_own_group() -> bool {
    // SAFETY: getpgrp(2) and getpid(2) only read.
    unsafe { libc::getpgrp() == libc::getpid() }
}

/// The rank and what it started share the wrapper's process group; the wrapper only signals
/// the group when it leads it (as the agent starts it), never a group it merely belongs to.
/// SIGTERM goes to the whole group (the wrapper's own handler ignores it); SIGKILL to every
/// member but the wrapper, which still has to write the exit code.
fn signal_rank(child: i32, signal: i32) {
    if !leads_own_group() {
        // SAFETY: kill(2) of the wrapper's own child; no memory is shared.
        unsafe { libc::kill(child, signal) };
    } else if signal == libc::SIGKILL {
        kill_rest_of_group();
    } else {
        // SAFETY: kill(2) of the wrapper's own group (0: the caller's group).
        unsafe { libc::kill(0, signal) };
    }
}

/// SIGKILL to every process of the wrapper's group but the wrapper (when it leads one).
pub fn kill_rest_of_group() {
    if !leads_own_group() {
        return;
    }
    let me = std::process::id() as i32;
    for pid in crate::ranks::group::group_members(me).into_iter().filter(|&p| p != me) {
        // SAFETY: kill(2) of a member of the wrapper's own group.
        unsafe { libc::kill(pid, libc::SIGKILL) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lapsed_lease_left_by_an_earlier_agent_is_cleared_at_start_and_a_live_one_kept() {
        let dir = std::env::temp_dir().join(format!("motley-lease-unit-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        write(&path(&dir), &Lease { deadline_ms: now_ms() - 1, grace_ms: 5 }).unwrap();
        assert!(clear_if_lapsed(&dir) && !path(&dir).exists());
        let live = renew(&dir, Duration::from_secs(1)).unwrap();
        assert!(!clear_if_lapsed(&dir));
        assert_eq!(read(&path(&dir)), Some(live));
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(std::fs::metadata(path(&dir)).unwrap().permissions().mode() & 0o777, MODE, "readable by ranks of other users");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
