//! The rank's wrapper: the process the agent starts for each rank (`motley-agent
//! __rank-wrapper`), which runs the rank, writes its exit code where a restarted agent finds it,
//! and is the node's dead-man switch (`lease`).

use std::path::Path;

use crate::ranks::{cgroup, lease};
use crate::workdir::write_atomic;

extern "C" fn ignore(_: libc::c_int) {}

/// `motley-agent __rank-wrapper EXIT_FILE [--lease LEASE_FILE] -- PROGRAM ARGS...`: runs the
/// rank as its child in the same process group and writes its exit code (128 + signal when
/// killed) to EXIT_FILE atomically, so an agent that is not its parent (restarted since)
/// learns how it ended. SIGTERM, SIGINT and SIGHUP sent to the group are meant for the rank:
/// the wrapper catches them with a handler that does nothing (a handler, unlike SIG_IGN, is
/// not inherited across exec, so the rank sees them) and waits for the rank to end.
///
/// With a lease file (see `lease`), the wrapper is the node's dead-man switch: once the
/// agent's lease has run out, it stops the rank itself (SIGTERM to the group, SIGKILL after
/// the lease's grace period), so a host whose agent died does not keep training alone.
pub fn wrapper_main(exit_file: &Path, lease_file: Option<&Path>, program: &str, args: &[String]) -> i32 {
    for s in [libc::SIGTERM, libc::SIGINT, libc::SIGHUP] {
        // SAFETY: installs an async-signal-safe handler that does nothing.
        unsafe {
            libc::signal(s, ignore as extern "C" fn(libc::c_int) as libc::sighandler_t);
        }
    }
    let mut child = match std::process::Command::new(program).args(args).spawn() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("motley-agent: cannot start {program}: {e}");
            return finish_wrapper(exit_file, 127);
        }
    };
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
