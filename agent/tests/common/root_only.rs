//! The one rule for tests that need root (switching users, cgroups of their own, handing files
//! over): where what a test needs is missing, it is skipped on a developer's machine, with the
//! reason printed, but under CI as root it fails naming what is missing. CI runs the suite as
//! root (`.ci/run` sets `CI`), so there a skip would be a test that passes without running.
//! Used by the integration tests (`common`) and by the library's own unit tests, which
//! include this file by path.

/// What a test needs of the machine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Need {
    /// The test runs as root (uid 0).
    Root,
    /// The node has this user (ranks of a job naming it).
    User(&'static str),
    /// cgroup v2 is mounted (ranks get cgroups of their own).
    CgroupV2,
}

impl Need {
    /// Why it is missing here; None when it is not.
    fn missing(self) -> Option<String> {
        match self {
            // SAFETY: geteuid(2) only reads.
            Need::Root => (unsafe { libc::geteuid() } != 0).then(|| "it needs root (uid 0)".to_string()),
            Need::User(name) => {
                let c = std::ffi::CString::new(name).expect("a user name without NUL");
                // SAFETY: a NUL-terminated name; only whether the answer is null is read.
                let found = !unsafe { libc::getpwnam(c.as_ptr()) }.is_null();
                (!found).then(|| format!("the machine has no user '{name}' (create it: useradd --system {name})"))
            }
            Need::CgroupV2 => {
                let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
                (!mounts.contains(" - cgroup2 ")).then(|| "no cgroup v2 is mounted (/proc/self/mountinfo has no cgroup2)".to_string())
            }
        }
    }
}

/// What becomes of a test whose needs are not all met.
#[derive(Debug, PartialEq, Eq)]
pub enum Verdict {
    Run,
    /// Skipped, with this reason.
    Skip(String),
    /// Failed, with this reason.
    Fail(String),
}

/// The rule: run when nothing is missing; otherwise fail where `ci` is set and the process is
/// `root`, and skip elsewhere.
pub fn verdict(test: &str, ci: bool, root: bool, missing: &[String]) -> Verdict {
    if missing.is_empty() {
        return Verdict::Run;
    }
    let why = format!("{test} cannot run: {}", missing.join("; "));
    match ci && root {
        true => Verdict::Fail(format!("{why}. CI runs as root, where every root-only test must run: give the machine what it lacks")),
        false => Verdict::Skip(why),
    }
}

/// Whether CI is set (`CI` non-empty, and not `false` or `0`).
pub fn ci() -> bool {
    std::env::var("CI").is_ok_and(|v| !v.is_empty() && v != "false" && v != "0")
}

/// Whether `test` can run here, `needs` checked: true when they are all met; false (printed
/// as skipped) when one is not; a panic naming what is missing under CI as root.
#[must_use]
pub fn can_run(test: &str, needs: &[Need]) -> bool {
    let missing: Vec<String> = needs.iter().filter_map(|n| n.missing()).collect();
    // SAFETY: geteuid(2) only reads.
    let root = unsafe { libc::geteuid() } == 0;
    match verdict(test, ci(), root, &missing) {
        Verdict::Run => true,
        Verdict::Skip(why) => {
            eprintln!("skipped: {why}");
            false
        }
        Verdict::Fail(why) => panic!("{why}"),
    }
}
