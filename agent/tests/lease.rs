//! The rank wrapper as the node's dead-man switch (README, "The running system": the ranks'
//! dead-man lease): once the agent's lease file holds a deadline in the past, the wrapper stops its
//! rank (SIGTERM, then SIGKILL after the lease's grace period) and writes its exit code; with a
//! deadline ahead, or no lease file at all, the rank runs to its end.

use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use motley_agent::ranks::lease::{self, Lease};

use crate::common;
use common::{scratch, wait_exit};

fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_millis() as u64
}

/// The wrapper in its own process group, as the agent starts it.
fn wrapper(dir: &Path, script: &str) -> Child {
    Command::new(env!("CARGO_BIN_EXE_motley-agent"))
        .arg("__rank-wrapper")
        .arg(dir.join("rank-0.exit"))
        .arg("--lease")
        .arg(dir.join("lease"))
        .args(["--", "sh", "-c", script])
        .process_group(0)
        .spawn()
        .unwrap()
}

fn exit_code(dir: &Path) -> String {
    std::fs::read_to_string(dir.join("rank-0.exit")).unwrap_or_default().trim().to_string()
}

#[test]
fn a_lapsed_lease_stops_the_rank() {
    let dir = scratch("lapsed");
    lease::write(&dir.join("lease"), &Lease { deadline_ms: now_ms() - 1, grace_ms: 500 }).unwrap();
    let mut w = wrapper(&dir, "sleep 60");
    assert_eq!(wait_exit(&mut w, "the wrapper").code(), Some(143), "SIGTERM ended the rank");
    assert_eq!(exit_code(&dir), "143");

    // A rank that ignores SIGTERM, and what it started, are killed after the grace period.
    let mut w = wrapper(&dir, "trap '' TERM; sleep 60 & while true; do sleep 0.05; done");
    assert_eq!(wait_exit(&mut w, "the wrapper").code(), Some(137));
    assert_eq!(exit_code(&dir), "137");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_lease_that_lapses_while_the_rank_runs_stops_it() {
    let dir = scratch("later");
    let base = Duration::from_millis(100);
    let renewed = lease::renew(&dir, base).unwrap();
    assert_eq!(renewed.grace_ms, 500, "5 base intervals");
    assert!(renewed.deadline_ms >= now_ms() + 900, "10 base intervals ahead: {renewed:?}");
    let mut w = wrapper(&dir, "sleep 60");
    // No renewal: the deadline passes a second later and the rank is stopped.
    assert_eq!(wait_exit(&mut w, "the wrapper").code(), Some(143));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_live_lease_or_none_lets_the_rank_run_to_its_end() {
    let dir = scratch("live");
    lease::write(&dir.join("lease"), &Lease { deadline_ms: now_ms() + 3_600_000, grace_ms: 500 }).unwrap();
    let mut w = wrapper(&dir, "sleep 1.5; exit 3");
    assert_eq!(wait_exit(&mut w, "the wrapper").code(), Some(3));
    assert_eq!(exit_code(&dir), "3");
    // No lease file at start (a coordinator that does not acknowledge): no switch.
    std::fs::remove_file(dir.join("lease")).unwrap();
    let mut w = wrapper(&dir, "sleep 1.5; exit 4");
    assert_eq!(wait_exit(&mut w, "the wrapper").code(), Some(4));
    let _ = std::fs::remove_dir_all(&dir);
}
