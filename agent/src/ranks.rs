//! The ranks this agent runs: started (through the wrapper, `rankfiles::wrapper_main`) in their
//! own process group, watched, reported once per change, stopped as a group; recorded on disk
//! so a restarted agent adopts the ones still running and reports how the others ended.
//!
//! Stop: SIGTERM to the group (marked `rank-R.stopping` first, so an agent that restarts
//! mid-stop finishes it), then SIGKILL after the grace period, which is 5 base intervals
//! of the coordinator's heartbeat (given at registration; 5 s before the first one): long
//! enough for a rank to flush a log line or a checkpoint marker, short enough that a cancel
//! frees the GPUs within a few heartbeats. A rank killed that way exits with 137.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use motley_proto::v1::{Launch, RankLaunch, RankStatus};

use crate::rankfiles::{self, generation_dir, rank_file, RankRecord};

/// Grace periods are this many base intervals.
pub const GRACE_INTERVALS: u32 = 5;
/// How often an adopted rank (not this agent's child, so no wait(2)) is looked at.
const ADOPTED_POLL: Duration = Duration::from_millis(200);

#[derive(Clone, Debug, PartialEq)]
enum State {
    Running {
        pgid: i32,
        stopping: bool,
    },
    Exited(i64),
    /// Its process group is gone and it left no exit code (killed with its wrapper).
    Lost,
}

struct Rank {
    state: State,
    /// Reported to the coordinator in its current state.
    reported: bool,
    dir: PathBuf,
}

/// Ranks by (job, generation, rank).
type Ranks = BTreeMap<(i64, i64, i64), Rank>;

/// Shared by the heartbeat task, the instruction loop and the watchers.
#[derive(Clone)]
pub struct Supervisor {
    work_dir: PathBuf,
    node: String,
    /// The program that runs a rank's wrapper (this agent's own executable).
    wrapper: PathBuf,
    ranks: Arc<Mutex<Ranks>>,
    grace: Arc<Mutex<Duration>>,
    /// Launches (job, generation) whose files were pruned: a late copy of their Launch must not
    /// run them again.
    pruned: Arc<Mutex<std::collections::HashSet<(i64, i64)>>>,
    /// A rank started or ended: report it now rather than on the next heartbeat (a launch is
    /// acknowledged, and a job's end seen, within milliseconds).
    changed: Arc<tokio::sync::Notify>,
}

impl Supervisor {
    pub fn new(work_dir: PathBuf, node: String, wrapper: PathBuf) -> Supervisor {
        Supervisor {
            work_dir,
            node,
            wrapper,
            ranks: Arc::default(),
            grace: Arc::new(Mutex::new(Duration::from_secs(5))),
            changed: Arc::new(tokio::sync::Notify::new()),
            pruned: Arc::default(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Ranks> {
        self.ranks.lock().expect("rank lock")
    }

    /// The coordinator's base interval (at each registration) sets the stop grace period.
    pub fn set_interval(&self, base: Duration) {
        *self.grace.lock().expect("grace lock") = base * GRACE_INTERVALS;
    }

    /// At start: take back the ranks an earlier agent left, from their records. Returns notes
    /// for the log (what was adopted, what was skipped).
    pub fn adopt(&self) -> Vec<String> {
        let (records, mut notes) = rankfiles::scan(&self.work_dir);
        for r in records {
            let dir = generation_dir(&self.work_dir, r.job, r.generation);
            if rank_file(&dir, r.rank, "reported").exists() {
                continue; // its end was told to a coordinator already
            }
            // A stop the earlier agent began (it died before the grace ended) is finished here.
            let stopping = rank_file(&dir, r.rank, "stopping").exists();
            let state = match rankfiles::read_exit(&dir, r.rank) {
                Some(code) => State::Exited(code),
                None if rankfiles::group_alive(r.pgid) => State::Running { pgid: r.pgid, stopping },
                None => State::Lost,
            };
            notes.push(format!("job {} generation {} rank {}: adopted, {state:?}", r.job, r.generation, r.rank));
            let running = matches!(state, State::Running { .. });
            self.lock().insert((r.job, r.generation, r.rank), Rank { state, reported: false, dir: dir.clone() });
            if running {
                let (me, key) = (self.clone(), (r.job, r.generation, r.rank));
                if stopping {
                    self.escalate(key, r.pgid, dir.clone());
                }
                tokio::spawn(async move { me.watch_adopted(key, r.pgid, dir).await });
            }
        }
        notes
    }

    /// Ranks running now (stopping ones included).
    pub fn running(&self) -> u32 {
        self.lock().values().filter(|r| matches!(r.state, State::Running { .. })).count() as u32
    }

    /// Resolves once a rank started or ended since the last call (at once if one did).
    pub async fn changed(&self) {
        self.changed.notified().await
    }

    /// States changed since the last heartbeat (each change is reported once).
    pub fn changes(&self) -> Vec<RankStatus> {
        let mut ranks = self.lock();
        let mut out = vec![];
        for (&(job, generation, rank), r) in ranks.iter_mut().filter(|(_, r)| !r.reported) {
            r.reported = true;
            let (state, exit_code) = match r.state {
                State::Running { .. } => ("running", None),
                State::Exited(code) => ("exited", Some(code)),
                State::Lost => ("lost", None),
            };
            if !matches!(r.state, State::Running { .. }) {
                // Best effort: a later agent need not report this end again.
                let _ = rankfiles::write_atomic(&rank_file(&r.dir, rank, "reported"), b"");
            }
            out.push(RankStatus { job, generation, rank, state: state.into(), exit_code });
        }
        out
    }

    /// A new session: report every rank again (the coordinator may have missed changes).
    pub fn resend_all(&self) {
        for r in self.lock().values_mut() {
            r.reported = false;
        }
    }

    /// Start the launch's ranks; a rank that cannot start is reported as exited with 127. A
    /// launch of an older generation than one this agent already has for the job is ignored.
    pub fn launch(&self, l: Launch) {
        if self.pruned.lock().expect("pruned lock").contains(&(l.job, l.generation)) {
            tracing::warn!(node = %self.node, "ignoring a launch of job {} generation {}: it ended and was pruned", l.job, l.generation);
            return;
        }
        let newest = self.lock().keys().filter(|k| k.0 == l.job).map(|k| k.1).max();
        if let Some(g) = newest.filter(|&g| g > l.generation) {
            tracing::warn!(node = %self.node, "ignoring a launch of job {} generation {}: generation {g} is already here", l.job, l.generation);
            return;
        }
        let dir = generation_dir(&self.work_dir, l.job, l.generation);
        let plan = dir.join("plan.json");
        let prepared =
            std::fs::create_dir_all(&dir).and_then(|_| std::fs::write(&plan, &l.plan_json)).map_err(|e| format!("{}: {e}", dir.display()));
        for r in &l.ranks {
            let key = (l.job, l.generation, r.rank);
            if self.lock().contains_key(&key) {
                continue; // the same instruction twice
            }
            match prepared.clone().and_then(|_| self.spawn(&l, r, &dir, &plan)) {
                Ok((child, pgid)) => {
                    self.lock().insert(key, Rank { state: State::Running { pgid, stopping: false }, reported: false, dir: dir.clone() });
                    let (me, dir) = (self.clone(), dir.clone());
                    tokio::spawn(async move { me.watch_child(key, child, dir).await });
                }
                Err(e) => {
                    tracing::warn!(node = %self.node, job = l.job, rank = r.rank, "rank did not start: {e}");
                    self.lock().insert(key, Rank { state: State::Exited(127), reported: false, dir: dir.clone() });
                }
            }
        }
        self.changed.notify_one();
    }

    /// The rank's wrapper, in its own process group, with the rank's environment; then its
    /// record, so a later agent can find it.
    fn spawn(&self, l: &Launch, r: &RankLaunch, dir: &Path, plan: &Path) -> Result<(tokio::process::Child, i32), String> {
        // Files of an earlier agent life for the same key (a coordinator whose database was
        // reset hands out job ids again) must not describe this rank.
        for ext in ["exit", "reported", "json", "stopping"] {
            let _ = std::fs::remove_file(rank_file(dir, r.rank, ext));
        }
        let (groups, common) = crate::groups::for_rank(&l.plan_json, &self.node, r.gpu);
        let nccl = rank_file(dir, r.rank, "groups.json");
        std::fs::write(&nccl, groups.to_string()).map_err(|e| format!("{}: {e}", nccl.display()))?;
        let log = rank_file(dir, r.rank, "log");
        let out = std::fs::File::create(&log).map_err(|e| format!("{}: {e}", log.display()))?;
        let err = out.try_clone().map_err(|e| e.to_string())?;
        let mut cmd = tokio::process::Command::new(&self.wrapper);
        cmd.arg("__rank-wrapper").arg(rank_file(dir, r.rank, "exit")).arg("--").arg("sh").arg("-c").arg(&l.run);
        cmd.current_dir(dir).stdin(Stdio::null()).stdout(out).stderr(err);
        // CUDA numbers GPUs fastest first unless told otherwise; NVML (discovery, the plan's
        // GPU indices) numbers them in PCI order. A job may still override it.
        cmd.env("CUDA_DEVICE_ORDER", "PCI_BUS_ID");
        // The agent's own settings (its token above all) are not the job's business.
        for (k, _) in std::env::vars_os() {
            if k.to_str().is_some_and(|k| k.starts_with("MOTLEY_")) {
                cmd.env_remove(k);
            }
        }
        cmd.envs(&l.envs);
        for (k, v) in [
            ("RANK", r.rank.to_string()),
            ("WORLD_SIZE", l.world_size.to_string()),
            ("LOCAL_RANK", r.local_rank.to_string()),
            ("LOCAL_WORLD_SIZE", r.local_world_size.to_string()),
            ("MASTER_ADDR", l.master_addr.clone()),
            ("MASTER_PORT", l.master_port.to_string()),
            ("CUDA_VISIBLE_DEVICES", r.gpu.to_string()),
            ("MOTLEY_NODE", self.node.clone()),
            ("MOTLEY_JOB", l.job.to_string()),
            ("MOTLEY_GENERATION", l.generation.to_string()),
            ("MOTLEY_REPLICA", r.replica.to_string()),
            ("MOTLEY_STAGE", r.stage.to_string()),
            ("MOTLEY_LAYER_START", r.layer_start.to_string()),
            ("MOTLEY_LAYER_END", r.layer_end.to_string()),
            ("MOTLEY_PLAN", plan.display().to_string()),
            ("MOTLEY_TP_RANK", r.tp_rank.to_string()),
            ("MOTLEY_TP_SIZE", r.tp_size.to_string()),
            ("MOTLEY_STAGE_DP_RANK", r.stage_dp_rank.to_string()),
            ("MOTLEY_STAGE_DP_SIZE", r.stage_dp_size.to_string()),
            ("MOTLEY_DP_RANK", r.replica.to_string()),
            ("MOTLEY_DP_SIZE", r.replicas.to_string()),
            ("MOTLEY_PP_RANK", r.stage.to_string()),
            ("MOTLEY_PP_SIZE", r.pp_size.to_string()),
            ("MOTLEY_NCCL_GROUPS", nccl.display().to_string()),
        ] {
            cmd.env(k, v);
        }
        // NCCL settings every one of the rank's groups agrees on are set at start; the rest are
        // per group (MOTLEY_NCCL_GROUPS, applied before each communicator is made).
        for (k, v) in &common {
            if !l.envs.contains_key(k) {
                cmd.env(k, v);
            }
        }
        // Its own process group: a stop kills the rank and everything it started, and a
        // signal to the agent's group (a terminal's Ctrl-C) does not reach it.
        cmd.process_group(0);
        let child = cmd.spawn().map_err(|e| format!("{}: {e}", self.wrapper.display()))?;
        let pgid = child.id().map_or(0, |p| p as i32);
        let record = RankRecord { job: l.job, generation: l.generation, rank: r.rank, pgid, log };
        if let Err(e) = rankfiles::write_record(dir, &record) {
            tracing::warn!(node = %self.node, "{e}; a restarted agent will not find this rank");
        }
        Ok((child, pgid))
    }

    fn finish(&self, key: (i64, i64, i64), state: State) {
        if let Some(r) = self.lock().get_mut(&key) {
            r.state = state;
            r.reported = false;
        }
        self.changed.notify_one();
    }

    /// A rank this agent started: wait(2) for its wrapper; the exit file has the code.
    async fn watch_child(self, key: (i64, i64, i64), mut child: tokio::process::Child, dir: PathBuf) {
        let status = child.wait().await;
        let code = rankfiles::read_exit(&dir, key.2).unwrap_or_else(|| match status {
            Ok(s) => s.code().map_or_else(|| 128 + std::os::unix::process::ExitStatusExt::signal(&s).unwrap_or(0) as i64, i64::from),
            Err(_) => -1,
        });
        self.finish(key, State::Exited(code));
    }

    /// A rank an earlier agent started: poll its exit file and its process group.
    async fn watch_adopted(self, key: (i64, i64, i64), pgid: i32, dir: PathBuf) {
        loop {
            if let Some(code) = rankfiles::read_exit(&dir, key.2) {
                return self.finish(key, State::Exited(code));
            }
            if !rankfiles::group_alive(pgid) {
                // The wrapper writes before it exits: look once more, then it is lost.
                let end = rankfiles::read_exit(&dir, key.2).map_or(State::Lost, State::Exited);
                return self.finish(key, end);
            }
            tokio::time::sleep(ADOPTED_POLL).await;
        }
    }

    /// Delete the directories (logs included) of launches whose every rank here ended and was
    /// reported, once nothing in them changed for `keep`, and forget those ranks: without it
    /// a long-lived agent's disk and memory grow with every job it ever ran. Returns what was
    /// removed, for the log.
    pub fn prune(&self, keep: Duration) -> Vec<String> {
        let numbered = |dir: &Path| -> Vec<(i64, PathBuf)> {
            let entries = std::fs::read_dir(dir).map(|d| d.filter_map(|e| e.ok()).collect::<Vec<_>>()).unwrap_or_default();
            entries.into_iter().filter_map(|e| Some((e.file_name().to_str()?.parse().ok()?, e.path()))).collect()
        };
        let mut removed = vec![];
        for (job, job_dir) in numbered(&self.work_dir.join("jobs")) {
            for (generation, dir) in numbered(&job_dir) {
                let mut ranks = self.lock();
                let busy =
                    ranks.iter().any(|(k, r)| k.0 == job && k.1 == generation && (matches!(r.state, State::Running { .. }) || !r.reported));
                if busy || !rankfiles::untouched_for(&dir, keep) {
                    continue;
                }
                // Under the rank lock: a launch of this generation cannot slip in between.
                if let Err(e) = std::fs::remove_dir_all(&dir) {
                    tracing::warn!(node = %self.node, "{}: {e}", dir.display());
                    continue;
                }
                ranks.retain(|k, _| !(k.0 == job && k.1 == generation));
                self.pruned.lock().expect("pruned lock").insert((job, generation));
                removed.push(format!("job {job} generation {generation}: ended, files removed ({})", dir.display()));
            }
            let _ = std::fs::remove_dir(&job_dir); // only if empty
        }
        removed
    }

    /// Stop the job's ranks of generations up to `generation`: SIGTERM to each group, SIGKILL
    /// after the grace period to those still there.
    pub fn stop(&self, job: i64, generation: i64) {
        let mut stopped = vec![];
        for (&key, r) in self.lock().iter_mut().filter(|(k, _)| k.0 == job && k.1 <= generation) {
            let State::Running { pgid, stopping: false } = r.state else { continue };
            r.state = State::Running { pgid, stopping: true };
            // Marked before the signal: an agent that dies now leaves the next one to finish.
            if let Err(e) = rankfiles::write_atomic(&rank_file(&r.dir, key.2, "stopping"), b"") {
                tracing::warn!(node = %self.node, "{e}; a restarted agent would not finish this stop");
            }
            rankfiles::signal_group(pgid, libc::SIGTERM);
            stopped.push((key, pgid, r.dir.clone()));
        }
        for (key, pgid, dir) in stopped {
            self.escalate(key, pgid, dir);
        }
    }

    /// SIGKILL to the rank's group if it is still running after the grace period.
    fn escalate(&self, key: (i64, i64, i64), pgid: i32, dir: PathBuf) {
        let grace = *self.grace.lock().expect("grace lock");
        let me = self.clone();
        tokio::spawn(async move {
            tokio::time::sleep(grace).await;
            if matches!(me.lock().get(&key).map(|r| &r.state), Some(State::Running { .. })) {
                // The code first: with the wrapper killed too, nobody else will write it.
                let _ = rankfiles::write_once(&rank_file(&dir, key.2, "exit"), b"137\n");
                rankfiles::signal_group(pgid, libc::SIGKILL);
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A launch directory as an earlier agent left it: one rank's record and exit code, and the
    /// `reported` marker if its end was told to a coordinator.
    fn finished(work: &Path, job: i64, reported: bool) -> PathBuf {
        let dir = generation_dir(work, job, 1);
        std::fs::create_dir_all(&dir).unwrap();
        // A process group that cannot exist: the rank is not running.
        let record = RankRecord { job, generation: 1, rank: 0, pgid: i32::MAX, log: rank_file(&dir, 0, "log") };
        rankfiles::write_record(&dir, &record).unwrap();
        std::fs::write(rank_file(&dir, 0, "exit"), "0\n").unwrap();
        std::fs::write(rank_file(&dir, 0, "log"), "done\n").unwrap();
        if reported {
            std::fs::write(rank_file(&dir, 0, "reported"), "").unwrap();
        }
        dir
    }

    #[test]
    fn finished_and_reported_launches_are_pruned_after_the_keep_period() {
        let work = std::env::temp_dir().join(format!("motley-prune-{}-{}", std::process::id(), line!()));
        let _ = std::fs::remove_dir_all(&work);
        let (told, untold) = (finished(&work, 1, true), finished(&work, 2, false));
        let s = Supervisor::new(work.clone(), "n".into(), PathBuf::from("/bin/false"));
        s.adopt();
        assert!(s.prune(Duration::from_secs(3600)).is_empty(), "nothing is old enough yet");
        let removed = s.prune(Duration::ZERO);
        assert_eq!(removed.len(), 1, "{removed:?}");
        assert!(!told.exists() && !work.join("jobs/1").exists(), "the reported launch and its empty job directory are gone");
        assert!(untold.exists(), "an end not yet reported keeps its files");
        assert_eq!(s.changes().len(), 1, "job 2's end is reported now");
        assert_eq!(s.prune(Duration::ZERO).len(), 1);
        assert!(!untold.exists());
        assert!(s.changes().is_empty() && s.running() == 0, "pruned ranks are forgotten");
        // A late copy of a pruned launch does not run it again.
        s.launch(Launch { job: 2, generation: 1, ranks: vec![RankLaunch { rank: 0, ..Default::default() }], ..Default::default() });
        assert!(s.changes().is_empty() && !untold.exists());
        std::fs::remove_dir_all(&work).unwrap();
    }
}
