//! An emulating agent's CPU share for a child that is no rank (the layer profiler, whose timings
//! must be the emulated device's, not the whole machine's): a cgroup of its own beside the
//! ranks', v2 (`cgroup`) or v1 (`cpu_share`) as the ranks have it (docs/emulation.md).

use std::ffi::CString;
use std::io;
use std::path::PathBuf;

use crate::ranks::cgroup::RankCgroups;
use crate::ranks::cpu_share::CpuV1;

#[derive(Clone, Debug)]
pub enum Confine {
    V2(RankCgroups),
    V1(CpuV1),
}

impl Confine {
    /// Make the cgroup `name` (the agent's own name for the child) with the node's share: its
    /// directory and the `cgroup.procs` the child enters before `exec` (`cgroup::enter`).
    pub fn create(&self, name: &str) -> io::Result<(PathBuf, CString)> {
        match self {
            Confine::V2(c) => c.create_named(name),
            Confine::V1(c) => c.create_named(name),
        }
    }

    /// Whether the child moves itself into the cgroup once started (v1: `cpu_share::ENTER_ENV`)
    /// rather than entering before `exec` (v2, where the cgroup also tracks what it started).
    pub fn enters_itself(&self) -> bool {
        matches!(self, Confine::V1(_))
    }

    /// Remove the cgroup once its child ended (v2 kills what is left in it first).
    pub async fn clear(&self, dir: PathBuf) {
        match self {
            Confine::V2(_) => crate::ranks::cgroup::clear(dir).await,
            Confine::V1(_) => crate::ranks::cpu_share::clear_v1(dir).await,
        }
    }
}
