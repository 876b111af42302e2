//! What the agent's integration tests share: a scratch directory per test, a bounded wait
//! for a process they started, a free port, and the rule for tests that need root
//! (`root_only`), and a stand-in coordinator (`fake_coordinator`). Each test file uses some of them
//! only.
#![allow(dead_code)]

pub mod fake_coordinator;
pub mod root_only;

use std::path::PathBuf;
use std::process::{Child, ExitStatus};
use std::time::{Duration, Instant};

/// An empty directory of its own for test `name` of this test binary and process.
pub fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("motley-{}-{name}-{}", env!("CARGO_CRATE_NAME"), std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Wait for a process to end: its exit status. Bounded only so that a process that never
/// ends fails the test (killed first) instead of hanging it.
pub fn wait_exit(child: &mut Child, what: &str) -> ExitStatus {
    let start = Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        if start.elapsed() > Duration::from_secs(60) {
            let _ = child.kill();
            panic!("{what} did not exit");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A port nothing listens on now.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}
