//! The ranks this agent runs: started (through the wrapper, `ranks::wrapper`) in their own
//! process group, watched, reported once per change, stopped as a group; recorded on disk so a
//! restarted agent adopts the ones still running and reports how the others ended.
//!
//! This file holds the supervisor's state, its adoption of an earlier agent's ranks, the
//! watchers and the pruning of ended launches; `launch` starts ranks, `stop` stops them,
//! `report` tells the coordinator. Each adds its own methods to `Supervisor`.

mod launch;
mod report;
mod stop;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::ranks::rankfiles;
use crate::ranks::{group, GRACE_INTERVALS};
use crate::safe_fs::Dir;
use crate::workdir::{self, generation_dir, rank_file};

/// How often an adopted rank (not this agent's child, so no wait(2)) is looked at.
const ADOPTED_POLL: Duration = Duration::from_millis(200);

#[derive(Clone, Debug, PartialEq)]
enum State {
    Running {
        pgid: i32,
        /// The wrapper's start time (see `group::is_rank_group`).
        start: u64,
        stopping: bool,
    },
    Exited(i64),
    /// Its process group is gone and it left no exit code (killed with its wrapper).
    Lost,
}

/// A state as the coordinator sees it (a stop under way is still running; a running rank of a
/// joining replica, once it copied its state from its peers, says what it copied).
#[derive(Clone, Copy, Debug, PartialEq)]
enum Report {
    Running(Option<rankfiles::Rejoined>),
    Exited(i64),
    Lost,
}

struct Rank {
    state: State,
    /// What the rank wrote in `rank-R.rejoined` (`report::look_for_rejoins`), once read.
    rejoined: Option<rankfiles::Rejoined>,
    /// Its rejoined file was bad and the agent's log said so (said once; read again at each
    /// report: the rank may write a good one).
    rejoined_bad: bool,
    /// The state the coordinator acknowledged.
    told: Option<Report>,
    /// The state last sent in this session, and when: sent again if unacknowledged after an
    /// interval.
    sent: Option<(Report, Instant)>,
    dir: PathBuf,
}

impl Rank {
    fn new(state: State, dir: PathBuf) -> Rank {
        Rank { state, rejoined: None, rejoined_bad: false, told: None, sent: None, dir }
    }

    fn report(&self) -> Report {
        match self.state {
            State::Running { .. } => Report::Running(self.rejoined),
            State::Exited(code) => Report::Exited(code),
            State::Lost => Report::Lost,
        }
    }

    /// Its current state is acknowledged (nothing more to send or keep).
    fn settled(&self) -> bool {
        self.told == Some(self.report())
    }
}

type Key = (i64, i64, i64);
/// Ranks by (job, generation, rank).
type Ranks = BTreeMap<Key, Rank>;

/// Shared by the heartbeat task, the instruction loop and the watchers.
#[derive(Clone)]
pub struct Supervisor {
    work_dir: PathBuf,
    node: String,
    /// The program that runs a rank's wrapper (this agent's own executable), held open.
    wrapper: Arc<crate::ranks::wrapper_exe::WrapperExe>,
    ranks: Arc<Mutex<Ranks>>,
    /// The ranks and states each unacknowledged message of this session reported, by seq.
    /// Locked after `ranks` when both are.
    in_flight: Arc<Mutex<report::InFlight>>,
    /// The base interval (unacknowledged reports are sent again after it).
    interval: Arc<Mutex<Duration>>,
    grace: Arc<Mutex<Duration>>,
    /// This boot's id, written in rank records.
    boot_id: String,
    /// Ranks may run as root: as the agent when it is root and a job names no user, or as a
    /// uid-0 user a job names (the operator's `allow_root_ranks`; see `users`).
    allow_root_ranks: bool,
    /// The agent's variables a rank inherits (`environment`).
    rank_env: crate::ranks::environment::RankEnv,
    /// Launches (job, generation) whose files were pruned: a late copy of their Launch must not
    /// run them again.
    pruned: Arc<Mutex<std::collections::HashSet<(i64, i64)>>>,
    /// A rank started or ended: report it now rather than on the next heartbeat (a launch is
    /// acknowledged, and a job's end seen, within milliseconds).
    changed: Arc<tokio::sync::Notify>,
    /// Each rank's own cgroup, where the host lets the agent make them (`cgroup`).
    cgroups: Option<crate::ranks::cgroup::RankCgroups>,
    /// An emulating node's ranks' CPU shares in the v1 cpu hierarchy (`cpu_share`).
    cpu_v1: Option<crate::ranks::cpu_share::CpuV1>,
    /// The checkpoint memory tier's root (`tiers`): ranks write checkpoints under it.
    shm_root: Option<PathBuf>,
}

impl Supervisor {
    pub fn new(work_dir: PathBuf, node: String, wrapper: crate::ranks::wrapper_exe::WrapperExe) -> Supervisor {
        Supervisor {
            work_dir,
            node,
            wrapper: Arc::new(wrapper),
            ranks: Arc::default(),
            in_flight: Arc::default(),
            interval: Arc::new(Mutex::new(Duration::from_secs(1))),
            grace: Arc::new(Mutex::new(Duration::from_secs(5))),
            boot_id: group::boot_id(),
            changed: Arc::new(tokio::sync::Notify::new()),
            pruned: Arc::default(),
            allow_root_ranks: false,
            rank_env: Default::default(),
            cgroups: None,
            cpu_v1: None,
            shm_root: None,
        }
    }

    /// Ranks write checkpoints under `root` (the memory tier: `root/jobs/JOB/GENERATION/ckpt`)
    /// rather than in their launch directory; the tierer moves them to disk. A root that
    /// cannot be made, or that is not the agent's alone (its default name is predictable: a
    /// user who made it first could read and change every checkpoint; `safe_fs::private_dir`),
    /// is logged and ranks write on disk. Directories made here are 0711: ranks of other users
    /// pass through them to their own, which they alone can list.
    pub fn shm_root(mut self, root: Option<PathBuf>) -> Supervisor {
        self.shm_root = root.filter(|r| {
            let made = crate::safe_fs::private_dir(r, workdir::PASS_MODE);
            if let Err(e) = &made {
                tracing::warn!(node = %self.node, "checkpoint memory tier {}: {e}; ranks write checkpoints on disk", r.display());
            }
            made.is_ok()
        });
        self
    }

    /// The memory tier's root ranks write to, if any (for `Tierer::new` and
    /// `Holdings::with_memory_root`).
    pub fn memory_root(&self) -> Option<PathBuf> {
        self.shm_root.clone()
    }

    /// Run each rank in its own cgroup (see `cgroup`).
    pub fn rank_cgroups(mut self, cgroups: Option<crate::ranks::cgroup::RankCgroups>) -> Supervisor {
        self.cgroups = cgroups;
        self
    }

    /// Confine each rank to a CPU share in the v1 cpu hierarchy (`cpu_share`; emulated GPUs on
    /// hosts whose cpu controller is on v1).
    pub fn cpu_v1(mut self, cpu: Option<crate::ranks::cpu_share::CpuV1>) -> Supervisor {
        self.cpu_v1 = cpu;
        self
    }

    /// The CPU share ranks get on an emulating node, for children that are no ranks (the layer
    /// profiler): None when ranks run unconfined.
    pub fn cpu_confine(&self) -> Option<crate::ranks::confine::Confine> {
        use crate::ranks::confine::Confine;
        match (&self.cpu_v1, &self.cgroups) {
            (Some(v1), _) => Some(Confine::V1(v1.clone())),
            (None, Some(cg)) if cg.limits_cpu() => Some(Confine::V2(cg.clone())),
            _ => None,
        }
    }

    /// The allow-list of the agent's variables a rank inherits (default: `environment`'s).
    pub fn rank_env(mut self, env: crate::ranks::environment::RankEnv) -> Supervisor {
        self.rank_env = env;
        self
    }

    /// Let ranks run as root (see `users::run_as`).
    pub fn allow_root_ranks(mut self, allow: bool) -> Supervisor {
        self.allow_root_ranks = allow;
        self
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Ranks> {
        self.ranks.lock().expect("rank lock")
    }

    /// The coordinator's base interval as last given (1 s before the first registration).
    pub fn interval(&self) -> Duration {
        *self.interval.lock().expect("interval lock")
    }

    /// The coordinator's base interval (at each registration) sets the stop grace period.
    pub fn set_interval(&self, base: Duration) {
        *self.grace.lock().expect("grace lock") = base * GRACE_INTERVALS;
        *self.interval.lock().expect("interval lock") = base;
    }

    /// At start: take back this node's ranks an earlier agent left, from their records. Returns
    /// notes for the log (what was adopted, what was skipped). A rank is taken for running only
    /// if its group is still led by its wrapper (same boot, same start time); any other is
    /// never signalled.
    pub fn adopt(&self) -> Vec<String> {
        let (records, mut notes) = rankfiles::scan(&self.work_dir);
        for r in records {
            let what = format!("job {} generation {} rank {}", r.job, r.generation, r.rank);
            if r.node != self.node {
                let whose = if r.node.is_empty() { "no node (an older agent's record)".to_string() } else { format!("node {}", r.node) };
                notes.push(format!("{what}: its record names {whose}, not {}; not adopted", self.node));
                continue;
            }
            let dir = generation_dir(&self.work_dir, r.job, r.generation);
            if rank_file(&dir, r.rank, "reported").exists() {
                continue; // its end was told to a coordinator already
            }
            // A stop the earlier agent began (it died before the grace ended) is finished here.
            let stopping = rank_file(&dir, r.rank, "stopping").exists();
            let ours = !self.boot_id.is_empty() && r.boot_id == self.boot_id && group::is_rank_group(r.pgid, r.start_time);
            let state = match rankfiles::read_exit(&dir, r.rank).code(&self.node) {
                Some(code) => State::Exited(code),
                None if ours => State::Running { pgid: r.pgid, start: r.start_time, stopping },
                None => {
                    if group::group_alive(r.pgid) {
                        notes.push(format!(
                            "{what}: process group {} is not the rank's (another boot or another process now); left alone",
                            r.pgid
                        ));
                    }
                    State::Lost
                }
            };
            notes.push(format!("{what}: adopted, {state:?}"));
            self.lock().insert((r.job, r.generation, r.rank), Rank::new(state.clone(), dir.clone()));
            if let State::Running { pgid, start, .. } = state {
                let (me, key) = (self.clone(), (r.job, r.generation, r.rank));
                if stopping {
                    self.escalate(key, pgid, start, dir.clone());
                }
                tokio::spawn(async move { me.watch_adopted(key, pgid, dir).await });
            }
        }
        notes
    }

    /// Ranks running now (stopping ones included).
    pub fn running(&self) -> u32 {
        self.lock().values().filter(|r| matches!(r.state, State::Running { .. })).count() as u32
    }

    /// The launches (job, generation) with a rank running here (a stop under way included).
    pub fn running_launches(&self) -> std::collections::BTreeSet<(i64, i64)> {
        self.lock().iter().filter(|(_, r)| matches!(r.state, State::Running { .. })).map(|(k, _)| (k.0, k.1)).collect()
    }

    /// Resolves once a rank started or ended since the last call (at once if one did).
    pub async fn changed(&self) {
        self.changed.notified().await
    }

    fn finish(&self, key: Key, state: State) {
        if let Some(r) = self.lock().get_mut(&key) {
            r.state = state;
        }
        // A rank's end ends everything it started, also what left its process group.
        if let Some(cg) = &self.cgroups {
            tokio::spawn(crate::ranks::cgroup::clear(cg.path(key.0, key.1, key.2)));
        }
        if let Some(cpu) = &self.cpu_v1 {
            tokio::spawn(crate::ranks::cpu_share::clear_v1(cpu.path(key.0, key.1, key.2)));
        }
        self.changed.notify_one();
    }

    /// A rank this agent started: wait(2) for its wrapper; the exit file has the code.
    async fn watch_child(self, key: Key, mut child: tokio::process::Child, dir: PathBuf) {
        let status = child.wait().await;
        let code = rankfiles::read_exit_off(&dir, key.2).await.code(&self.node).unwrap_or_else(|| match status {
            Ok(s) => s.code().map_or_else(|| 128 + std::os::unix::process::ExitStatusExt::signal(&s).unwrap_or(0) as i64, i64::from),
            Err(_) => -1,
        });
        self.finish(key, State::Exited(code));
    }

    /// A rank an earlier agent started: poll its exit file and its process group.
    async fn watch_adopted(self, key: Key, pgid: i32, dir: PathBuf) {
        loop {
            if let Some(code) = rankfiles::read_exit_off(&dir, key.2).await.code(&self.node) {
                return self.finish(key, State::Exited(code));
            }
            if !group::group_alive(pgid) {
                // The wrapper writes before it exits: look once more, then it is lost.
                let end = rankfiles::read_exit_off(&dir, key.2).await.code(&self.node).map_or(State::Lost, State::Exited);
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
        let mut removed = vec![];
        // Every level through handles, every launch directory removed with `remove_tree` (any
        // depth, links not followed): ranks own their launch directories (docs/state.md).
        let Ok(Some(jobs)) = Dir::open(&self.work_dir).and_then(|w| w.dir_if_any("jobs")) else { return removed };
        for (job, job_name) in numbered(&jobs) {
            let Ok(job_dir) = jobs.dir(&job_name) else { continue };
            for (generation, name) in numbered(&job_dir) {
                let dir = generation_dir(&self.work_dir, job, generation);
                let mut ranks = self.lock();
                let busy = ranks
                    .iter()
                    .any(|(k, r)| k.0 == job && k.1 == generation && (matches!(r.state, State::Running { .. }) || !r.settled()));
                if busy || !job_dir.dir(&name).is_ok_and(|d| rankfiles::untouched_for(&d, keep)) {
                    continue;
                }
                // Under the rank lock: a launch of this generation cannot slip in between.
                if let Err(e) = job_dir.remove_tree(&name) {
                    tracing::warn!(node = %self.node, "{}: {e}", dir.display());
                    continue;
                }
                // Its checkpoints in the memory tier go with it (the disk and cloud keep theirs).
                if let Some(mem) = &self.shm_root {
                    let mem_job = Dir::open(mem).and_then(|m| m.dir_if_any(Path::new("jobs").join(&job_name)));
                    if let Ok(Some(mem_job)) = mem_job {
                        if let Err(e) = mem_job.remove_tree(&name) {
                            tracing::warn!(node = %self.node, "{}: {e}", mem_job.path().join(&name).display());
                        }
                        drop(mem_job);
                        let _ = Dir::open(mem).and_then(|m| m.dir("jobs")).and_then(|j| j.remove_dir(&job_name));
                    }
                }
                ranks.retain(|k, _| !(k.0 == job && k.1 == generation));
                self.pruned.lock().expect("pruned lock").insert((job, generation));
                removed.push(format!("job {job} generation {generation}: ended, files removed ({})", dir.display()));
            }
            drop(job_dir);
            // Only if empty; then the job ended here: the copies its restores left go too.
            if jobs.remove_dir(&job_name).unwrap_or(false) {
                removed.extend(crate::checkpoints::restorer::remove_copies(&self.work_dir, job));
            }
        }
        removed
    }
}

/// The entries of `dir` named by a number (jobs, generations), with their names.
fn numbered(dir: &Dir) -> Vec<(i64, String)> {
    let entries = dir.entries().unwrap_or_default();
    entries.into_iter().filter(|(_, t)| *t == rustix::fs::FileType::Directory).filter_map(|(n, _)| Some((n.parse().ok()?, n))).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::process::CommandExt;

    use motley_proto::v1::{Launch, RankLaunch};

    use crate::ranks::rankfiles::RankRecord;
    use crate::ranks::users;

    fn work_dir(name: &str) -> PathBuf {
        let work = std::env::temp_dir().join(format!("motley-ranks-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&work);
        work
    }

    fn record(node: &str, job: i64, pgid: i32, boot_id: String, start_time: u64, dir: &Path) -> RankRecord {
        RankRecord { node: node.into(), job, generation: 1, rank: 0, pgid, log: rank_file(dir, 0, "log"), boot_id, start_time }
    }

    /// A launch directory as an earlier agent of node "n" left it: one rank's record and exit
    /// code, and the `reported` marker if its end was told to a coordinator.
    fn finished(work: &Path, job: i64, reported: bool) -> PathBuf {
        let dir = generation_dir(work, job, 1);
        std::fs::create_dir_all(&dir).unwrap();
        // A process group that cannot exist: the rank is not running.
        rankfiles::write_record(&dir, &record("n", job, i32::MAX, group::boot_id(), 1, &dir)).unwrap();
        std::fs::write(rank_file(&dir, 0, "exit"), "0\n").unwrap();
        std::fs::write(rank_file(&dir, 0, "log"), "done\n").unwrap();
        if reported {
            std::fs::write(rank_file(&dir, 0, "reported"), "").unwrap();
        }
        dir
    }

    fn supervisor(work: &Path) -> Supervisor {
        Supervisor::new(work.to_path_buf(), "n".into(), crate::ranks::wrapper_exe::WrapperExe::open(Path::new("/bin/false")).unwrap())
    }

    #[test]
    fn finished_and_reported_launches_are_pruned_after_the_keep_period() {
        let work = work_dir("prune");
        let (told, untold) = (finished(&work, 1, true), finished(&work, 2, false));
        let s = supervisor(&work);
        s.adopt();
        assert!(s.prune(Duration::from_secs(3600)).is_empty(), "nothing is old enough yet");
        // What a restore for job 1 left: its copy and launch list go with the job, its fence stays.
        let restored = work.join("restore/1/1/step-00000004");
        std::fs::create_dir_all(&restored).unwrap();
        std::fs::write(restored.join("rank.00000.safetensors"), "r").unwrap();
        std::fs::write(work.join("restore/1/launch-2.json"), "[]").unwrap();
        std::fs::write(work.join("restore/1/newest"), "2\n").unwrap();
        let removed = s.prune(Duration::ZERO);
        assert_eq!(removed.len(), 3, "{removed:?}");
        assert!(!told.exists() && !work.join("jobs/1").exists(), "the reported launch and its empty job directory are gone");
        assert!(!work.join("restore/1/1").exists() && !work.join("restore/1/launch-2.json").exists(), "the restored copy is gone");
        assert!(work.join("restore/1/newest").exists(), "the fence stays");
        assert!(untold.exists(), "an end not yet reported keeps its files");
        assert_eq!(s.report(1, false).len(), 1, "job 2's end is reported now");
        assert!(s.prune(Duration::ZERO).is_empty() && untold.exists(), "an end sent but not acknowledged keeps its files");
        s.ack(1);
        assert_eq!(s.prune(Duration::ZERO).len(), 1);
        assert!(!untold.exists());
        assert!(s.report(2, true).is_empty() && s.running() == 0, "pruned ranks are forgotten");
        // A late copy of a pruned launch does not run it again.
        s.launch(Launch { job: 2, generation: 1, ranks: vec![RankLaunch { rank: 0, ..Default::default() }], ..Default::default() });
        assert!(s.report(3, true).is_empty() && !untold.exists());
        std::fs::remove_dir_all(&work).unwrap();
    }

    /// `rank-R.reported` follows the coordinator's acknowledgement, not the
    /// queueing of the report; an ack of an older state does not tell a newer one.
    #[test]
    fn an_end_is_marked_reported_only_once_acknowledged_in_that_state() {
        let work = work_dir("ack");
        let dir = finished(&work, 1, false);
        let marker = rank_file(&dir, 0, "reported");
        let s = supervisor(&work);
        s.set_interval(Duration::from_secs(3600));
        s.adopt();
        let sent = s.report(1, false);
        assert_eq!((sent.len(), sent[0].state.as_str(), sent[0].exit_code), (1, "exited", Some(0)));
        assert!(!marker.exists(), "no marker before the acknowledgement");
        assert!(s.report(2, false).is_empty(), "in flight: not sent again within the interval");
        s.ack(7); // not a seq this agent sent
        assert!(!marker.exists());
        s.ack(1);
        assert!(marker.exists(), "the marker follows the acknowledgement");
        assert!(s.report(3, false).is_empty(), "told: nothing more to send");

        // A running rank reported under seq 1 ends before seq 1 is acknowledged.
        let s = supervisor(&work);
        s.set_interval(Duration::from_secs(3600));
        let (key, dir2) = ((5, 1, 0), generation_dir(&work, 5, 1));
        std::fs::create_dir_all(&dir2).unwrap();
        s.lock().insert(key, Rank::new(State::Running { pgid: i32::MAX, start: 1, stopping: false }, dir2.clone()));
        assert_eq!(s.report(1, false)[0].state, "running");
        s.finish(key, State::Exited(3));
        s.ack(1);
        assert!(!rank_file(&dir2, 0, "reported").exists(), "an ack of `running` does not tell the end");
        let sent = s.report(2, false);
        assert_eq!((sent.len(), sent[0].state.as_str(), sent[0].exit_code), (1, "exited", Some(3)));
        // Acks out of order: a later message's first.
        s.lock().insert((6, 1, 0), Rank::new(State::Lost, dir2.clone()));
        assert_eq!(s.report(3, false).len(), 1, "only the new rank: the end of rank 5 is in flight");
        s.ack(3);
        assert!(rank_file(&dir2, 0, "reported").exists() && s.lock()[&(6, 1, 0)].settled());
        assert!(!s.lock()[&key].settled());
        s.ack(2);
        assert!(s.lock()[&key].settled());
        std::fs::remove_dir_all(&work).unwrap();
    }

    #[test]
    fn unacknowledged_reports_are_sent_again_after_an_interval_and_every_session_opens_with_all() {
        let work = work_dir("resend");
        finished(&work, 1, false);
        finished(&work, 2, false);
        let s = supervisor(&work);
        s.adopt();
        s.set_interval(Duration::ZERO); // any unacknowledged report is due again
        assert_eq!(s.report(1, false).len(), 2);
        s.ack(1);
        s.set_interval(Duration::from_secs(3600));
        s.finish((2, 1, 0), State::Exited(9));
        assert_eq!(s.report(2, false).len(), 1, "only the change");
        s.set_interval(Duration::ZERO);
        assert_eq!(s.report(3, false).len(), 1, "unacknowledged for an interval: sent again");
        // A new session: every rank, told or not; an ack of the old session's seq is void.
        s.new_session();
        let full = s.report(1, true);
        assert_eq!(full.len(), 2, "{full:?}");
        s.ack(1);
        assert!(s.lock().values().all(Rank::settled));
        std::fs::remove_dir_all(&work).unwrap();
    }

    /// A record the agent's user does not own (a rank running as another user wrote it in its
    /// launch directory) is never adopted: it could name any process group.
    #[test]
    fn a_record_not_owned_by_the_agents_user_is_not_trusted() {
        // Only root can give a file away.
        if !crate::root_only::can_run("a_record_not_owned_by_the_agents_user_is_not_trusted", &[crate::root_only::Need::Root]) {
            return;
        }
        let work = work_dir("forged");
        let dir = finished(&work, 1, false);
        workdir::hand_over(&rank_file(&dir, 0, "json"), 65534, 65534).unwrap();
        let s = supervisor(&work);
        let notes = s.adopt();
        assert!(notes.iter().any(|n| n.contains("owned by uid 65534, not by the agent's user; not trusted")), "{notes:?}");
        assert!(s.report(1, true).is_empty());
        std::fs::remove_dir_all(&work).unwrap();
    }

    /// A rank refused (or that could not start) leaves its reason in its log, and its exit code
    /// and record, so a restarted agent reports the same end.
    #[tokio::test]
    async fn a_refused_rank_is_told_in_its_log_and_survives_an_agent_restart() {
        let work = work_dir("refused");
        let s = supervisor(&work).allow_root_ranks(false);
        let launch = |user: &str| Launch {
            job: 1,
            generation: 1,
            user: user.into(),
            ranks: vec![RankLaunch { rank: 0, ..Default::default() }],
            ..Default::default()
        };
        s.launch(launch("motley-no-such-user"));
        let sent = s.report(1, true);
        assert_eq!((sent[0].state.as_str(), sent[0].exit_code), ("exited", Some(users::REFUSED)));
        let dir = generation_dir(&work, 1, 1);
        let log = std::fs::read_to_string(rank_file(&dir, 0, "log")).unwrap();
        assert!(log.contains("not started on node n: the job's user 'motley-no-such-user' does not exist on node n"), "{log}");
        let again = supervisor(&work);
        again.adopt();
        let sent = again.report(1, true);
        assert_eq!((sent.len(), sent[0].exit_code), (1, Some(users::REFUSED)), "{sent:?}");
        std::fs::remove_dir_all(&work).unwrap();
    }

    /// Two agents' records in one directory (two agents pointed at one work directory): each
    /// adopts its own node's only.
    #[test]
    fn a_record_of_another_node_is_never_adopted() {
        let work = work_dir("node");
        let dir = generation_dir(&work, 1, 1);
        std::fs::create_dir_all(&dir).unwrap();
        let b = record("b", 1, i32::MAX, group::boot_id(), 1, &dir);
        rankfiles::write_record(&dir, &b).unwrap();
        std::fs::write(rank_file(&dir, 0, "exit"), "0\n").unwrap();
        let a = Supervisor::new(work.clone(), "a".into(), crate::ranks::wrapper_exe::WrapperExe::open(Path::new("/bin/false")).unwrap());
        let notes = a.adopt();
        assert!(notes.iter().any(|n| n.contains("names node b, not a; not adopted")), "{notes:?}");
        assert!(a.report(1, true).is_empty(), "node a knows no rank");
        let b_agent =
            Supervisor::new(work.clone(), "b".into(), crate::ranks::wrapper_exe::WrapperExe::open(Path::new("/bin/false")).unwrap());
        b_agent.adopt();
        assert_eq!(b_agent.report(1, true).len(), 1, "node b adopts its own");
        std::fs::remove_dir_all(&work).unwrap();
    }

    /// A record whose boot id or start time does not match the live group
    /// its pgid names is not running, and that group is never signalled.
    #[tokio::test]
    async fn a_record_naming_a_foreign_live_group_is_not_adopted_as_running() {
        let work = work_dir("pid");
        let mut sleep = std::process::Command::new("sleep").arg("60").process_group(0).spawn().unwrap();
        let pid = sleep.id() as i32;
        let start = group::start_time(pid).unwrap();
        for (job, boot, st) in [(1, "another-boot".to_string(), start), (2, group::boot_id(), start + 1), (3, String::new(), 0)] {
            let dir = generation_dir(&work, job, 1);
            std::fs::create_dir_all(&dir).unwrap();
            // A stop under way too: the next agent would SIGKILL the group after the grace.
            std::fs::write(rank_file(&dir, 0, "stopping"), "").unwrap();
            rankfiles::write_record(&dir, &record("n", job, pid, boot, st, &dir)).unwrap();
        }
        let s = supervisor(&work);
        s.set_interval(Duration::from_millis(1));
        let notes = s.adopt();
        assert_eq!(notes.iter().filter(|n| n.contains("is not the rank's")).count(), 3, "{notes:?}");
        assert_eq!(s.running(), 0);
        let states: Vec<String> = s.report(1, true).into_iter().map(|r| r.state).collect();
        assert_eq!(states, ["lost", "lost", "lost"]);
        for job in 1..=3 {
            s.stop(job, 1);
        }
        assert!(!group::signal_group(pid, start + 1, libc::SIGKILL), "a wrong start time is never signalled");
        tokio::time::sleep(Duration::from_millis(100)).await; // past the (1 ms x 5) grace
        assert!(sleep.try_wait().unwrap().is_none(), "the foreign sleep is alive");
        assert!(group::is_rank_group(pid, start), "the check itself takes the right start time");

        // The same group with the right boot and start time is the rank's: running, and a stop
        // signals it.
        let dir = generation_dir(&work, 4, 1);
        std::fs::create_dir_all(&dir).unwrap();
        rankfiles::write_record(&dir, &record("n", 4, pid, group::boot_id(), start, &dir)).unwrap();
        let s = supervisor(&work);
        s.adopt();
        assert_eq!(s.running(), 1);
        s.stop(4, 1);
        let status = sleep.wait().unwrap();
        assert_eq!(std::os::unix::process::ExitStatusExt::signal(&status), Some(libc::SIGTERM));
        std::fs::remove_dir_all(&work).unwrap();
    }
    /// A lost replica rejoining (docs/keep-going.md): a launch with a `join_epoch` starts again
    /// a rank of the launch that ended here (its old log kept beside), after writing the
    /// epoch's membership; the same launch without one is a duplicate and changes nothing.
    #[tokio::test]
    async fn a_joining_launch_starts_an_ended_rank_again_after_writing_its_membership() {
        let work = work_dir("join");
        let dir = finished(&work, 3, false);
        let s = supervisor(&work);
        s.adopt();
        let launch = |join_epoch: i64| Launch {
            job: 3,
            generation: 1,
            ranks: vec![RankLaunch { rank: 0, ..Default::default() }],
            plan_json: "{}".into(),
            join_epoch,
            membership: if join_epoch > 0 { format!("{{\"epoch\": {join_epoch}, \"replicas\": [0]}}") } else { String::new() },
            ..Default::default()
        };
        s.launch(launch(0));
        assert_eq!(std::fs::read_to_string(rank_file(&dir, 0, "log")).unwrap(), "done\n", "a duplicate launch: nothing");
        std::fs::write(dir.join("rank-0.rejoined"), r#"{"epoch": 1, "bytes": 1, "seconds": 1, "copy_seconds": 1}"#).unwrap();
        s.launch(launch(2));
        assert!(!dir.join("rank-0.rejoined").exists(), "the earlier process's copy is not the new one's");
        assert_eq!(std::fs::read_to_string(dir.join("rank-0.log.before-2")).unwrap(), "done\n", "the old log kept");
        let m: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join("membership.json")).unwrap()).unwrap();
        assert_eq!(m["epoch"], 2);
        // Started again: as root without allow_root_ranks it is refused (126), elsewhere the plan
        // "{}" does not read (127); either way a new end, not the old exit 0.
        let sent = s.report(1, true);
        assert_eq!(sent.len(), 1, "{sent:?}");
        assert!(sent[0].state == "exited" && matches!(sent[0].exit_code, Some(126 | 127)), "{sent:?}");
        assert!(std::fs::read_to_string(rank_file(&dir, 0, "log")).unwrap().contains("not started"));
        // An agent that never held the rank (its end reported before it started): the same.
        let fresh = supervisor(&work);
        std::fs::write(dir.join("rank-0.rejoined"), r#"{"epoch": 2, "bytes": 1, "seconds": 1, "copy_seconds": 1}"#).unwrap();
        std::fs::write(rank_file(&dir, 0, "reported"), "").unwrap();
        fresh.adopt();
        fresh.launch(launch(3));
        assert!(!dir.join("rank-0.rejoined").exists() && dir.join("rank-0.log.before-3").exists());
        std::fs::remove_dir_all(&work).unwrap();
    }
}
