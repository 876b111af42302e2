//! Emulated GPUs (docs/emulation.md): a node whose inventory says `emulate: {cpu: F}` runs each
//! rank confined to F of one CPU core by the kernel's CPU bandwidth controller, so that GPU
//! types of different speeds can be reproduced on one machine. cgroup v2's `cpu.max` in the
//! rank's own cgroup (`cgroup`) where the agent's cgroup delegates the cpu controller; else
//! cgroup v1's `cpu.cfs_quota_us` in a cgroup of the rank's own under the agent's in the v1
//! `cpu` hierarchy (hosts whose cpu controller is on v1, as the CI machine's is). An agent asked
//! to emulate that can do neither refuses to start: emulation is never silently off.

use std::ffi::CString;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use crate::ranks::cgroup_name::agent_root;

/// The kernel's least quota and least period (1 ms).
const MIN_US: u64 = 1_000;
/// The kernel's largest period (1 s).
const MAX_PERIOD_US: u64 = 1_000_000;
/// The quota a period is sized for: a few scheduler ticks (4 ms at 250 Hz), the finest grain at
/// which the kernel enforces a quota, so a rank is throttled within every few ms of CPU time.
const QUOTA_US: u64 = 5_000;

/// The bandwidth controller's period for `share` of one core: the one whose quota is
/// [`QUOTA_US`] (within the kernel's 1 ms-1 s). The layer profiler times passes of a few
/// milliseconds: under the kernel's default 100 ms period a 0.4 share would run the first 40 ms
/// of every period at full speed, and only a measurement over many periods would see the share
/// (docs/emulation.md, "Short periods").
pub fn period_us(share: f64) -> u64 {
    ((QUOTA_US as f64 / share.min(1.0)).round() as u64).clamp(MIN_US, MAX_PERIOD_US)
}

/// `cpu.max`'s text for `share` of one core (`"QUOTA PERIOD"`, microseconds).
pub fn cpu_max(share: f64) -> String {
    format!("{} {}", quota_us(share), period_us(share))
}

/// The quota, in microseconds per period, of `share` of one core (1 ms at least).
pub fn quota_us(share: f64) -> u64 {
    ((share * period_us(share) as f64).round() as u64).max(MIN_US)
}

/// Where ranks' v1 cpu cgroups live: `<v1 cpu mount>/<the agent's v1 cpu cgroup>/motley-cpu-<node>-<hash>`.
#[derive(Clone, Debug)]
pub struct CpuV1 {
    root: PathBuf,
    share: f64,
}

impl CpuV1 {
    /// The v1 `cpu` hierarchy's directory for this agent's ranks, made and checked writable
    /// (a quota can be set), or why not.
    pub fn detect(node: &str, work_dir: &Path, share: f64) -> Result<CpuV1, String> {
        let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").map_err(|e| format!("/proc/self/mountinfo: {e}"))?;
        let mount = v1_cpu_mount(&mountinfo).ok_or("no cgroup v1 hierarchy with the cpu controller is mounted")?;
        let own = std::fs::read_to_string("/proc/self/cgroup").map_err(|e| format!("/proc/self/cgroup: {e}"))?;
        let own = own_v1_cpu_path(&own).ok_or("/proc/self/cgroup names no cgroup v1 cpu path")?;
        let root = mount.join(own.trim_start_matches('/')).join(agent_root("motley-cpu", node, work_dir));
        std::fs::create_dir_all(&root).map_err(|e| format!("{}: {e}", root.display()))?;
        let probe = root.join("probe");
        let wrote = std::fs::create_dir_all(&probe).and_then(|()| set_v1_quota(&probe, share));
        let _ = std::fs::remove_dir(&probe);
        wrote.map_err(|e| format!("{}: setting a CPU quota: {e}", root.display()))?;
        // Made to know it can be; it comes back with the first rank and goes with the last
        // (`clear_v1`), so agents that come and go leave no cgroups behind.
        let _ = std::fs::remove_dir(&root);
        Ok(CpuV1 { root, share })
    }

    /// The v1 cpu cgroup of one rank (made or not).
    pub fn path(&self, job: i64, generation: i64, rank: i64) -> PathBuf {
        self.root.join(format!("job-{job}-gen-{generation}-rank-{rank}"))
    }

    /// Make the rank's v1 cpu cgroup with its quota: the `cgroup.procs` the rank writes itself
    /// into once it has started ([`ENTER_ENV`]). With an `owner` (the rank's user when it is
    /// not the agent's), that one file becomes the user's, so the rank may move itself in; the
    /// directory and the quota stay the agent's.
    pub fn create(&self, job: i64, generation: i64, rank: i64, owner: Option<(u32, u32)>) -> io::Result<PathBuf> {
        let dir = self.path(job, generation, rank);
        self.create_in(&dir)?;
        let procs = dir.join("cgroup.procs");
        if let Some((uid, gid)) = owner {
            // A file of the cgroup file system the agent just made: no rank can have replaced it.
            std::os::unix::fs::chown(&procs, Some(uid), Some(gid))?;
        }
        Ok(procs)
    }

    /// A v1 cpu cgroup named `name` beside the ranks' (the layer profiler's: `confine`), with
    /// the share: its directory and the `cgroup.procs` a child enters.
    pub fn create_named(&self, name: &str) -> io::Result<(PathBuf, CString)> {
        let dir = self.root.join(name);
        Ok((dir.clone(), self.create_in(&dir)?))
    }

    fn create_in(&self, dir: &Path) -> io::Result<CString> {
        std::fs::create_dir_all(dir)?;
        set_v1_quota(dir, self.share)?;
        CString::new(dir.join("cgroup.procs").as_os_str().as_bytes()).map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))
    }
}

/// The variable that hands a rank (or the layer profiler) the `cgroup.procs` of its CPU share,
/// to write itself into ("0") once its runtime is loaded (docs/emulation.md, "Start-up outside
/// the share"): held to a few ms every period from its first instruction, a process spends
/// minutes importing torch (its hundreds of MiB of libraries) where it needs seconds, many
/// times more CPU time than unconfined, so the share starts with the work it emulates.
pub const ENTER_ENV: &str = "MOTLEY_CPU_SHARE_PROCS";

/// A rank's start-up allowance, in base intervals: a rank not in its share by then (a program
/// that does not read [`ENTER_ENV`]) is moved there by the agent ([`confine_late`]).
pub const ENTER_INTERVALS: u32 = 60;

/// Move every process of the process group `pgid` into the cgroup `dir` unless a process is
/// there already (the rank entered itself): how many were moved. A rank whose processes all
/// ended moves nothing.
pub fn confine_late(dir: &Path, pgid: i32) -> io::Result<usize> {
    let procs = dir.join("cgroup.procs");
    if !std::fs::read_to_string(&procs)?.trim().is_empty() {
        return Ok(0);
    }
    let mut moved = 0;
    for pid in crate::ranks::group::group_members(pgid) {
        if std::fs::write(&procs, pid.to_string()).is_ok() {
            moved += 1;
        }
    }
    Ok(moved)
}

/// The line a process that entered its share prints to its standard error
/// (`motley_torch/components/cpu_share.py`): the layer profiler's run is refused without it.
pub const ENTERED_LINE: &str = "motley-cpu-share: entered ";

fn set_v1_quota(dir: &Path, share: f64) -> io::Result<()> {
    std::fs::write(dir.join("cpu.cfs_period_us"), period_us(share).to_string())?;
    std::fs::write(dir.join("cpu.cfs_quota_us"), quota_us(share).to_string())
}

/// Remove a finished rank's v1 cpu cgroup once its processes are gone (the rank's stop ends
/// them: its process group, and its v2 cgroup where it has one), and the agent's directory with
/// it once no other cgroup is left there.
pub async fn clear_v1(dir: PathBuf) {
    for _ in 0..100 {
        match std::fs::remove_dir(&dir) {
            Ok(()) => break,
            Err(e) if e.kind() == io::ErrorKind::NotFound => break,
            Err(_) => tokio::time::sleep(std::time::Duration::from_millis(20)).await,
        }
    }
    if dir.exists() {
        tracing::warn!("{}: still holds processes; left in place", dir.display());
    } else if let Some(root) = dir.parent() {
        let _ = std::fs::remove_dir(root);
    }
}

/// The mount point of a cgroup v1 hierarchy with the `cpu` controller (its super options list
/// `cpu`, alone or with `cpuacct`).
fn v1_cpu_mount(mountinfo: &str) -> Option<PathBuf> {
    mountinfo.lines().find_map(|line| {
        let (left, right) = line.split_once(" - ")?;
        let mut r = right.split_whitespace();
        if r.next()? != "cgroup" {
            return None;
        }
        let options = r.nth(1)?;
        options.split(',').any(|o| o == "cpu").then(|| left.split_whitespace().nth(4).map(PathBuf::from))?
    })
}

/// The v1 cpu cgroup path in /proc/self/cgroup (`N:cpu,cpuacct:/path` or `N:cpu:/path`).
fn own_v1_cpu_path(cgroup: &str) -> Option<String> {
    cgroup.lines().find_map(|l| {
        let mut parts = l.splitn(3, ':');
        let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
        controllers.split(',').any(|c| c == "cpu").then(|| path.to_string())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_share_is_a_quota_of_a_few_ticks_in_the_period_that_gives_it() {
        assert_eq!(cpu_max(0.3), "5000 16667", "5 ms every 16.7 ms");
        assert_eq!(cpu_max(0.5), "5000 10000");
        assert_eq!(cpu_max(1.0), "5000 5000");
        assert_eq!(cpu_max(2.0), "10000 5000", "two cores: 10 ms every 5 ms");
        // A share so small that 1 ms needs more than the kernel's longest period: 1 ms every 1 s.
        assert_eq!((quota_us(0.0001), period_us(0.0001)), (1000, 1_000_000));
        for share in [0.05, 0.1, 0.3, 0.4, 0.77, 1.0, 3.5] {
            let got = quota_us(share) as f64 / period_us(share) as f64;
            assert!((got / share - 1.0).abs() < 1e-3, "{share}: {got}");
        }
    }

    #[test]
    fn finds_the_v1_cpu_hierarchy_and_the_agents_place_in_it() {
        let hybrid = "35 25 0:30 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755\n\
                      36 35 0:31 / /sys/fs/cgroup/unified rw,relatime shared:9 - cgroup2 cgroup2 rw\n\
                      37 35 0:32 / /sys/fs/cgroup/cpuacct rw - cgroup cgroup rw,cpuacct\n\
                      38 35 0:33 / /sys/fs/cgroup/cpu,cpuacct rw - cgroup cgroup rw,cpu,cpuacct\n";
        assert_eq!(v1_cpu_mount(hybrid), Some(PathBuf::from("/sys/fs/cgroup/cpu,cpuacct")));
        assert_eq!(v1_cpu_mount("36 35 0:31 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n"), None);
        assert_eq!(own_v1_cpu_path("4:memory:/x\n2:cpuacct:/y\n1:cpu,cpuacct:/agents/a\n0::/\n").as_deref(), Some("/agents/a"));
        assert_eq!(own_v1_cpu_path("2:cpuacct:/y\n0::/\n"), None);
    }
}
