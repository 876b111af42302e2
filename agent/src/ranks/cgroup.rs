//! One cgroup (v2) per rank, where the agent may make them: a rank that `setsid`s or double-
//! forks leaves its process group, never its cgroup, so `cgroup.kill` ends everything a rank
//! started. Without a writable cgroup v2 hierarchy (a v1-only host, an unprivileged agent
//! outside a delegated subtree) ranks are stopped by process group alone, as before.
//!
//! Layout: `<the agent's own cgroup>/motley-<node>-<work dir hash>/job-J-gen-G-rank-R`, a path
//! derived from the agent's node and work directory and the rank alone, so an agent restarted
//! into the same cgroup (systemd's `Delegate=yes` unit) finds the cgroups of the ranks it adopts
//! without a record, and agents of other coordinators on the same host (job numbers repeat
//! between coordinators) never share one. A rank enters its cgroup in the forked
//! child before `exec` (and before it drops root), so nothing it runs is ever outside it.

use std::ffi::CString;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use crate::ranks::cgroup_name::agent_root;

/// Where this agent's rank cgroups live.
#[derive(Clone, Debug)]
pub struct RankCgroups {
    root: PathBuf,
    /// Each rank's share of one core (`cpu.max`), on an emulating node (`cpu_share`).
    cpu_share: Option<f64>,
}

impl RankCgroups {
    /// The agent's own cgroup v2 directory with `motley-<node>-<hash>` made inside it, or why
    /// there is no writable cgroup v2 hierarchy. `work_dir` is absolute.
    pub fn detect(node: &str, work_dir: &Path) -> Result<RankCgroups, String> {
        let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").map_err(|e| format!("/proc/self/mountinfo: {e}"))?;
        let mount = cgroup2_mount(&mountinfo).ok_or("no cgroup2 file system is mounted")?;
        let own = std::fs::read_to_string("/proc/self/cgroup").map_err(|e| format!("/proc/self/cgroup: {e}"))?;
        let own = own_v2_path(&own).ok_or("/proc/self/cgroup names no cgroup v2 path")?;
        let root = mount.join(own.trim_start_matches('/')).join(agent_root("motley", node, work_dir));
        match std::fs::create_dir(&root) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(format!("{}: {e}", root.display())),
        }
        if !root.join("cgroup.kill").exists() {
            return Err(format!("{}: no cgroup.kill (a kernel older than 5.14)", root.display()));
        }
        // Made to know it can be; it comes back with the first rank (unless adopted ranks
        // still have theirs there).
        let _ = std::fs::remove_dir(&root);
        Ok(RankCgroups { root, cpu_share: None })
    }

    /// Confine each rank to `share` of one core (`cpu.max`), or say why this hierarchy cannot:
    /// the agent's own cgroup must delegate the cpu controller to its children (its
    /// `cgroup.subtree_control` lists `cpu`, as systemd's `Delegate=cpu` makes it).
    pub fn with_cpu_share(mut self, share: f64) -> Result<RankCgroups, String> {
        let own = self.root.parent().ok_or("the rank cgroups' directory has no parent")?;
        let control = own.join("cgroup.subtree_control");
        let enabled = std::fs::read_to_string(&control).map_err(|e| format!("{}: {e}", control.display()))?;
        if !enabled.split_whitespace().any(|c| c == "cpu") {
            return Err(format!("{}: the cpu controller is not delegated to the agent's children", control.display()));
        }
        self.cpu_share = Some(share);
        Ok(self)
    }

    /// Whether ranks get a CPU share here (`with_cpu_share`).
    pub fn limits_cpu(&self) -> bool {
        self.cpu_share.is_some()
    }

    /// The cgroup of one rank (made or not).
    pub fn path(&self, job: i64, generation: i64, rank: i64) -> PathBuf {
        self.root.join(format!("job-{job}-gen-{generation}-rank-{rank}"))
    }

    /// Make the rank's cgroup: the file a child writes itself into (see `enter`). With an
    /// `owner` (the rank's user when it is not the agent's), the cgroup is delegated to it as
    /// systemd delegates one: its `cgroup.procs` and `cgroup.kill` become the user's, so the
    /// rank's wrapper, which drops to that user, can still kill the whole cgroup when the
    /// agent's lease lapses (the dead-man switch). The directory stays the agent's: the user
    /// makes no cgroups below it and changes no limit.
    pub fn create(&self, job: i64, generation: i64, rank: i64, owner: Option<(u32, u32)>) -> io::Result<CString> {
        self.create_in(&self.path(job, generation, rank), owner)
    }

    /// A cgroup named `name` beside the ranks' (the layer profiler's on an emulating node):
    /// its directory and the file a child writes itself into. `name` is the agent's own
    /// (`profile-REQUEST`), never a rank's.
    pub fn create_named(&self, name: &str) -> io::Result<(PathBuf, CString)> {
        let dir = self.root.join(name);
        Ok((dir.clone(), self.create_in(&dir, None)?))
    }

    fn create_in(&self, dir: &Path, owner: Option<(u32, u32)>) -> io::Result<CString> {
        let dir = dir.to_path_buf();
        // The agent's directory goes with its last rank (`clear`): make it again if need be,
        // twice should a `clear` remove it in between.
        if std::fs::create_dir_all(&dir).is_err() {
            std::fs::create_dir_all(&dir)?;
        }
        if let Some(share) = self.cpu_share {
            // The agent's directory hands the controller on to its ranks' (it has no processes
            // of its own, so it may), then the rank's limit, before anything enters it.
            std::fs::write(self.root.join("cgroup.subtree_control"), b"+cpu")?;
            std::fs::write(dir.join("cpu.max"), crate::ranks::cpu_share::cpu_max(share))?;
        }
        if let Some((uid, gid)) = owner {
            // Files of the cgroup file system the agent just made: no rank can have replaced them.
            for file in DELEGATED {
                std::os::unix::fs::chown(dir.join(file), Some(uid), Some(gid))?;
            }
        }
        CString::new(dir.join("cgroup.procs").as_os_str().as_bytes()).map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))
    }
}

/// The files of a rank's cgroup its user gets (`RankCgroups::create`).
pub const DELEGATED: [&str; 2] = ["cgroup.procs", "cgroup.kill"];

/// In a forked child before exec: move the calling process into the cgroup whose
/// `cgroup.procs` is `procs` ("0" is the writer itself). System calls only: no allocation.
pub fn enter(procs: &CString) -> io::Result<()> {
    // SAFETY: a valid NUL-terminated path; the descriptor is closed on every path.
    unsafe {
        let fd = libc::open(procs.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        let wrote = libc::write(fd, b"0".as_ptr().cast(), 1);
        let err = io::Error::last_os_error();
        libc::close(fd);
        if wrote != 1 {
            return Err(err);
        }
    }
    Ok(())
}

/// SIGKILL every process in the cgroup (and its descendants' cgroups), wherever their process
/// groups and sessions are. False when there is no such cgroup.
pub fn kill(dir: &Path) -> bool {
    std::fs::write(dir.join("cgroup.kill"), b"1").is_ok()
}

/// Whether any process is left in the cgroup.
pub fn populated(dir: &Path) -> bool {
    std::fs::read_to_string(dir.join("cgroup.events")).is_ok_and(|e| e.lines().any(|l| l == "populated 1"))
}

/// Kill what is left of a finished rank and remove its cgroup (a cgroup is removed only once
/// empty: the kill takes a moment to land).
pub async fn clear(dir: PathBuf) {
    if !dir.exists() {
        return;
    }
    kill(&dir);
    for _ in 0..100 {
        if !populated(&dir) {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    if let Err(e) = std::fs::remove_dir(&dir) {
        tracing::warn!("{}: {e}", dir.display());
    }
    // The agent's own directory too once no rank has one there (it fails while one does), so
    // agents that come and go leave no cgroups behind.
    if let Some(root) = dir.parent() {
        let _ = std::fs::remove_dir(root);
    }
}

/// The dead-man switch's last step in a rank's wrapper: SIGKILL everything left in the rank's
/// cgroup, the wrapper included. Nothing when the wrapper is not in a rank cgroup.
pub fn kill_own_rank_cgroup() -> bool {
    let (Ok(mountinfo), Ok(own)) = (std::fs::read_to_string("/proc/self/mountinfo"), std::fs::read_to_string("/proc/self/cgroup")) else {
        return false;
    };
    let (Some(mount), Some(own)) = (cgroup2_mount(&mountinfo), own_v2_path(&own)) else { return false };
    let dir = mount.join(own.trim_start_matches('/'));
    let name = |p: Option<&Path>| p.and_then(Path::file_name).and_then(|n| n.to_str()).map(str::to_string).unwrap_or_default();
    let is_rank = name(Some(&dir)).starts_with("job-") && name(dir.parent()).starts_with("motley-");
    is_rank && kill(&dir)
}

/// The mount point of the cgroup2 file system in /proc/self/mountinfo (field 5 is the mount
/// point; the file system type follows the " - " separator).
fn cgroup2_mount(mountinfo: &str) -> Option<PathBuf> {
    mountinfo.lines().find_map(|line| {
        let (left, right) = line.split_once(" - ")?;
        if right.split_whitespace().next()? != "cgroup2" {
            return None;
        }
        left.split_whitespace().nth(4).map(PathBuf::from)
    })
}

/// The cgroup v2 path in /proc/self/cgroup (the `0::` line).
fn own_v2_path(cgroup: &str) -> Option<String> {
    cgroup.lines().find_map(|l| l.strip_prefix("0::")).map(str::to_string)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cpu_share_needs_the_controller_delegated_and_lands_in_the_ranks_cpu_max() {
        // A directory tree shaped like the agent's cgroup (plain files stand in for the
        // kernel's): the agent's own cgroup, and the rank cgroups' directory inside it.
        let own = std::env::temp_dir().join(format!("motley-cgroup-unit-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&own);
        std::fs::create_dir_all(&own).unwrap();
        let cgroups = || RankCgroups { root: own.join("motley-n0-1"), cpu_share: None };
        std::fs::write(own.join("cgroup.subtree_control"), "memory pids\n").unwrap();
        let e = cgroups().with_cpu_share(0.5).unwrap_err();
        assert!(e.contains("the cpu controller is not delegated"), "{e}");
        std::fs::write(own.join("cgroup.subtree_control"), "cpu memory pids\n").unwrap();
        let c = cgroups().with_cpu_share(0.5).unwrap();
        assert!(c.limits_cpu() && !cgroups().limits_cpu());
        c.create(3, 1, 0, None).unwrap();
        assert_eq!(std::fs::read_to_string(own.join("motley-n0-1/cgroup.subtree_control")).unwrap(), "+cpu");
        assert_eq!(std::fs::read_to_string(c.path(3, 1, 0).join("cpu.max")).unwrap(), "5000 10000");
        let _ = std::fs::remove_dir_all(&own);
    }

    #[test]
    fn finds_the_cgroup2_mount_and_the_agents_own_cgroup() {
        let hybrid = "35 25 0:30 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755\n\
                      36 35 0:31 / /sys/fs/cgroup/unified rw,relatime shared:9 - cgroup2 cgroup2 rw\n\
                      37 35 0:32 / /sys/fs/cgroup/cpu rw - cgroup cgroup rw,cpu\n";
        assert_eq!(cgroup2_mount(hybrid), Some(PathBuf::from("/sys/fs/cgroup/unified")));
        assert_eq!(cgroup2_mount("37 35 0:32 / /sys/fs/cgroup/cpu rw - cgroup cgroup rw,cpu\n"), None);
        assert_eq!(
            own_v2_path("4:memory:/x\n0::/system.slice/motley-agent.service\n").as_deref(),
            Some("/system.slice/motley-agent.service")
        );
        assert_eq!(own_v2_path("4:memory:/x\n"), None);
    }
}
