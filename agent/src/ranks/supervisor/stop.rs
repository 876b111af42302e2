//! The supervisor's stops: SIGTERM to the group (marked `rank-R.stopping` first, so an agent
//! that restarts mid-stop finishes it), then SIGKILL after the grace period, which is
//! `GRACE_INTERVALS` base intervals of the coordinator's heartbeat (given at registration; 5 s
//! before the first one): long enough for a rank to flush a log line or a checkpoint marker,
//! short enough that a cancel frees the GPUs within a few heartbeats. A rank killed that way
//! exits with 137. Only a group whose leader is still the rank's wrapper (same boot, same
//! start time) is signalled: after a reboot or a pid wrap-around the number may be someone
//! else's.

use std::path::PathBuf;

use super::{Key, State, Supervisor};
use crate::ranks::group;
use crate::workdir::{self, rank_file};

impl Supervisor {
    /// Stop the job's ranks of generations up to `generation`: SIGTERM to each group, SIGKILL
    /// after the grace period to those still there.
    pub fn stop(&self, job: i64, generation: i64) {
        self.stop_matching(|k| k.0 == job && k.1 <= generation)
    }

    /// Stop these ranks of launch (job, generation) (a lost replica's, `Membership`), as `stop`.
    pub fn stop_ranks(&self, job: i64, generation: i64, ranks: &[i64]) {
        self.stop_matching(|k| k.0 == job && k.1 == generation && ranks.contains(&k.2))
    }

    fn stop_matching(&self, matches: impl Fn(&Key) -> bool) {
        let mut stopped = vec![];
        for (&key, r) in self.lock().iter_mut().filter(|(k, _)| matches(k)) {
            let State::Running { pgid, start, stopping: false } = r.state else { continue };
            r.state = State::Running { pgid, start, stopping: true };
            // Marked before the signal: an agent that dies now leaves the next one to finish.
            if let Err(e) = workdir::write_atomic(&rank_file(&r.dir, key.2, "stopping"), b"") {
                tracing::warn!(node = %self.node, "{e}; a restarted agent would not finish this stop");
            }
            if !group::signal_group(pgid, start, libc::SIGTERM) {
                tracing::warn!(node = %self.node, "job {} rank {}: process group {pgid} is no longer the rank's; not signalled", key.0, key.2);
            }
            stopped.push((key, pgid, start, r.dir.clone()));
        }
        for (key, pgid, start, dir) in stopped {
            self.escalate(key, pgid, start, dir);
        }
    }

    /// SIGKILL to the rank's group if it is still running after the grace period.
    pub(super) fn escalate(&self, key: Key, pgid: i32, start: u64, dir: PathBuf) {
        let grace = *self.grace.lock().expect("grace lock");
        let me = self.clone();
        tokio::spawn(async move {
            tokio::time::sleep(grace).await;
            let running = matches!(me.lock().get(&key).map(|r| &r.state), Some(State::Running { .. }));
            if running && group::is_rank_group(pgid, start) {
                // The code first: with the wrapper killed too, nobody else will write it.
                let _ = workdir::write_once(&rank_file(&dir, key.2, "exit"), b"137\n");
                group::signal_group(pgid, start, libc::SIGKILL);
                if let Some(cg) = &me.cgroups {
                    crate::ranks::cgroup::kill(&cg.path(key.0, key.1, key.2));
                }
            }
        });
    }
}
