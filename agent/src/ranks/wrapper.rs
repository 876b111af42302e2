//! The rank's wrapper: the process the agent starts for each rank (`motley-agent
//! __rank-wrapper`), which runs the rank, writes its exit code where a restarted agent finds it,
//! and is the node's dead-man switch (`lease`).

use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};

use crate::ranks::{cgroup, lease};
use crate::workdir::write_atomic;

/// A stop signal that reached the wrapper before its rank existed (0: none). The agent reports a
/// rank running once it has started the wrapper, so a stop can come while the wrapper is still
/// starting its rank: the wrapper's handler took that signal and the rank would never see it
/// (it ran on until the SIGKILL at the end of the grace period). It is sent on to the rank once
/// the rank exists.
static EARLY_SIGNAL: AtomicI32 = AtomicI32::new(0);
/// Set once the rank is started: from then on a signal to the group reaches the rank itself.
static RANK_STARTED: AtomicBool = AtomicBool::new(false);

extern "C" fn note_signal(sig: libc::c_int) {
    // Async-signal-safe: two atomics.
    if !RANK_STARTED.load(Ordering::SeqCst) {
        EARLY_SIGNAL.store(sig, Ordering::SeqCst);
    }
}

/// The rank now exists: a stop signal the wrapper took before that is sent to it (once).
fn rank_started(pid: u32) {
    RANK_STARTED.store(true, Ordering::SeqCst);
    let sig = EARLY_SIGNAL.swap(0, Ordering::SeqCst);
    if sig != 0 {
        // SAFETY: kill(2) on the child the wrapper has just started and not yet waited for.
        unsafe {
            libc::kill(pid as libc::pid_t, sig);
        }
    }
}

/// `motley-agent __rank-wrapper EXIT_FILE [--lease LEASE_FILE] -- PROGRAM ARGS...`: runs the
/// rank as its child in the same process group and writes its exit code (128 + signal when
/// killed) to EXIT_FILE atomically, so an agent that is not its parent (restarted since)
/// learns how it ended. SIGTERM, SIGINT and SIGHUP sent to the group are meant for the rank:
/// the wrapper catches them with a handler that only notes one that came before the rank was
/// started, to send it on (a handler, unlike SIG_IGN, is not inherited across exec, so the rank
/// sees them), and waits for the rank to end.
///
/// With a lease file (see `lease`), the wrapper is the node's dead-man switch: once the
/// agent's lease has run out, it stops the rank itself (SIGTERM to the group, SIGKILL after
/// the lease's grace period), so a host whose agent died does not keep training alone.
pub fn wrapper_main(exit_file: &Path, lease_file: Option<&Path>, program: &str, args: &[String]) -> i32 {
    for s in [libc::SIGTERM, libc::SIGINT, libc::SIGHUP] {
        // SAFETY: installs an async-signal-safe handler (it only stores to two atomics).
        unsafe {
            libc::signal(s, note_signal as extern "C" fn(libc::c_int) as libc::sighandler_t);
        }
    }
    let mut child = match std::process::Command::new(program).args(args).spawn() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("motley-agent: cannot start {program}: {e}");
            return finish_wrapper(exit_file, 127);
        }
    };
    rank_started(child.id());
    let fired = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    if let Some(lease) = lease_file {
        let (lease, pid, fired) = (lease.to_path_buf(), child.id() as i32, fired.clone());
        std::thread::spawn(move || lease::switch(&lease, pid, &fired));
    }
    let code = match child.wait() {
        Ok(s) => s.code().unwrap_or_else(|| 128 + std::os::unix::process::ExitStatusExt::signal(&s).unwrap_or(0)),
        Err(e) => {
            eprintln!("motley-agent: waiting for {program}: {e}");
            -1
        }
    };
    if fired.load(std::sync::atomic::Ordering::SeqCst) {
        // What the rank started and left behind is stopped with it: its process group now,
        // and, its code written, everything in its cgroup (the wrapper too).
        lease::kill_rest_of_group();
        let code = finish_wrapper(exit_file, code);
        cgroup::kill_own_rank_cgroup();
        return code;
    }
    finish_wrapper(exit_file, code)
}

fn finish_wrapper(exit_file: &Path, code: i32) -> i32 {
    if let Err(e) = write_atomic(exit_file, format!("{code}\n").as_bytes()) {
        eprintln!("motley-agent: {e}");
    }
    code
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::process::ExitStatusExt;

    #[test]
    fn a_stop_that_came_before_the_rank_existed_is_sent_to_it_and_later_ones_are_not_noted() {
        // A SIGTERM the wrapper took while starting its rank (the handler, called as the kernel
        // would): noted, and sent to the rank once it exists.
        note_signal(libc::SIGTERM);
        let mut rank = std::process::Command::new("sleep").arg("600").spawn().unwrap();
        rank_started(rank.id());
        let status = rank.wait().unwrap();
        assert_eq!(status.signal(), Some(libc::SIGTERM), "the rank took the early stop: {status:?}");
        // Once the rank exists, a signal to the group reaches it directly: the wrapper notes
        // nothing more, so nothing is sent twice.
        note_signal(libc::SIGTERM);
        assert_eq!(EARLY_SIGNAL.load(Ordering::SeqCst), 0);
        let mut other = std::process::Command::new("sleep").arg("0.2").spawn().unwrap();
        rank_started(other.id());
        assert_eq!(other.wait().unwrap().code(), Some(0), "no signal was left to send");
    }
}
