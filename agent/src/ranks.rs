//! The ranks this agent runs: started (through the wrapper, `rankfiles::wrapper_main`) in their
//! own process group, watched, reported once per change, stopped as a group; recorded on disk
//! so a restarted agent adopts the ones still running and reports how the others ended.
//!
//! Stop: SIGTERM to the group (marked `rank-R.stopping` first, so an agent that restarts
//! mid-stop finishes it), then SIGKILL after the grace period, which is 5 base intervals
//! of the coordinator's heartbeat (given at registration; 5 s before the first one): long
//! enough for a rank to flush a log line or a checkpoint marker, short enough that a cancel
//! frees the GPUs within a few heartbeats. A rank killed that way exits with 137. Only a
//! group whose leader is still the rank's wrapper (same boot, same start time) is signalled:
//! after a reboot or a pid wrap-around the number may be someone else's.
//!
//! Reports: each message to the coordinator has a number in its session (`seq`); the ranks it
//! reports are in flight under that number until the coordinator acknowledges it. Only then is
//! the state told, and an end marked `rank-R.reported` on disk (a later agent does not report
//! it again): an agent that dies in between reports it again. Unacknowledged reports are sent
//! again after one base interval, and every session opens with every rank (`full`).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use motley_proto::v1::{Launch, RankLaunch, RankStatus};

use crate::rankfiles::{self, generation_dir, rank_file, RankRecord};
use crate::users;

/// Grace periods are this many base intervals.
pub const GRACE_INTERVALS: u32 = 5;
/// How often an adopted rank (not this agent's child, so no wait(2)) is looked at.
const ADOPTED_POLL: Duration = Duration::from_millis(200);

#[derive(Clone, Debug, PartialEq)]
enum State {
    Running {
        pgid: i32,
        /// The wrapper's start time (see `rankfiles::is_rank_group`).
        start: u64,
        stopping: bool,
    },
    Exited(i64),
    /// Its process group is gone and it left no exit code (killed with its wrapper).
    Lost,
}

/// A state as the coordinator sees it (a stop under way is still running).
#[derive(Clone, Copy, Debug, PartialEq)]
enum Report {
    Running,
    Exited(i64),
    Lost,
}

impl State {
    fn report(&self) -> Report {
        match *self {
            State::Running { .. } => Report::Running,
            State::Exited(code) => Report::Exited(code),
            State::Lost => Report::Lost,
        }
    }
}

struct Rank {
    state: State,
    /// The state the coordinator acknowledged.
    told: Option<Report>,
    /// The state last sent in this session, and when: sent again if unacknowledged after an
    /// interval.
    sent: Option<(Report, Instant)>,
    dir: PathBuf,
}

impl Rank {
    fn new(state: State, dir: PathBuf) -> Rank {
        Rank { state, told: None, sent: None, dir }
    }

    /// Its current state is acknowledged (nothing more to send or keep).
    fn settled(&self) -> bool {
        self.told == Some(self.state.report())
    }
}

type Key = (i64, i64, i64);
/// Ranks by (job, generation, rank).
type Ranks = BTreeMap<Key, Rank>;

/// The ranks (and the states) each unacknowledged message reported, by seq.
type InFlight = BTreeMap<u64, Vec<(Key, Report)>>;

/// Messages in flight are bounded: a coordinator that never acknowledges (an older one) must
/// not grow the agent's memory; what falls out is sent again anyway.
const MAX_IN_FLIGHT: usize = 1024;

/// Shared by the heartbeat task, the instruction loop and the watchers.
#[derive(Clone)]
pub struct Supervisor {
    work_dir: PathBuf,
    node: String,
    /// The program that runs a rank's wrapper (this agent's own executable).
    wrapper: PathBuf,
    ranks: Arc<Mutex<Ranks>>,
    /// The ranks and states each unacknowledged message of this session reported, by seq.
    /// Locked after `ranks` when both are.
    in_flight: Arc<Mutex<InFlight>>,
    /// The base interval (unacknowledged reports are sent again after it).
    interval: Arc<Mutex<Duration>>,
    grace: Arc<Mutex<Duration>>,
    /// This boot's id, written in rank records.
    boot_id: String,
    /// Ranks may run as root: as the agent when it is root and a job names no user, or as a
    /// uid-0 user a job names (the operator's `allow_root_ranks`; see `users`).
    allow_root_ranks: bool,
    /// Launches (job, generation) whose files were pruned: a late copy of their Launch must not
    /// run them again.
    pruned: Arc<Mutex<std::collections::HashSet<(i64, i64)>>>,
    /// A rank started or ended: report it now rather than on the next heartbeat (a launch is
    /// acknowledged, and a job's end seen, within milliseconds).
    changed: Arc<tokio::sync::Notify>,
    /// Each rank's own cgroup, where the host lets the agent make them (`cgroup`).
    cgroups: Option<crate::cgroup::RankCgroups>,
    /// The checkpoint memory tier's root (`tiers`): ranks write checkpoints under it.
    shm_root: Option<PathBuf>,
}

impl Supervisor {
    pub fn new(work_dir: PathBuf, node: String, wrapper: PathBuf) -> Supervisor {
        Supervisor {
            work_dir,
            node,
            wrapper,
            ranks: Arc::default(),
            in_flight: Arc::default(),
            interval: Arc::new(Mutex::new(Duration::from_secs(1))),
            grace: Arc::new(Mutex::new(Duration::from_secs(5))),
            boot_id: rankfiles::boot_id(),
            changed: Arc::new(tokio::sync::Notify::new()),
            pruned: Arc::default(),
            allow_root_ranks: false,
            cgroups: None,
            shm_root: None,
        }
    }

    /// Ranks write checkpoints under `root` (the memory tier: `root/jobs/JOB/GENERATION/ckpt`)
    /// rather than in their launch directory; the tierer moves them to disk. A root that
    /// cannot be made is logged and ranks write on disk. Directories made here are 0711: ranks
    /// of other users pass through them to their own, which they alone can list.
    pub fn shm_root(mut self, root: Option<PathBuf>) -> Supervisor {
        self.shm_root = root.filter(|r| {
            let made = std::os::unix::fs::DirBuilderExt::mode(std::fs::DirBuilder::new().recursive(true), rankfiles::PASS_MODE).create(r);
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

    /// Where a rank of the launch in `dir` writes its checkpoints: the memory tier if there is
    /// one and its directory can be made (0700, the job's user's), else the launch directory.
    fn rank_ckpt_dir(&self, l: &Launch, dir: &Path, user: Option<&users::Account>) -> PathBuf {
        let on_disk = crate::holdings::ckpt_dir(dir);
        let Some(root) = &self.shm_root else { return on_disk };
        let ckpt = crate::holdings::ckpt_dir(&generation_dir(root, l.job, l.generation));
        let made = rankfiles::create_dirs(&ckpt).and_then(|_| match user {
            Some(a) => rankfiles::open_passage(root, &ckpt).and_then(|_| rankfiles::hand_over(&ckpt, a.uid, a.gid)),
            None => Ok(()),
        });
        match made {
            Ok(()) => ckpt,
            Err(e) => {
                tracing::warn!(node = %self.node, job = l.job, "checkpoint memory tier: {e}; this rank writes its checkpoints on disk");
                on_disk
            }
        }
    }

    /// Run each rank in its own cgroup (see `cgroup`).
    pub fn rank_cgroups(mut self, cgroups: Option<crate::cgroup::RankCgroups>) -> Supervisor {
        self.cgroups = cgroups;
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
            let ours = !self.boot_id.is_empty() && r.boot_id == self.boot_id && rankfiles::is_rank_group(r.pgid, r.start_time);
            let state = match rankfiles::read_exit(&dir, r.rank) {
                Some(code) => State::Exited(code),
                None if ours => State::Running { pgid: r.pgid, start: r.start_time, stopping },
                None => {
                    if rankfiles::group_alive(r.pgid) {
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

    /// Resolves once a rank started or ended since the last call (at once if one did).
    pub async fn changed(&self) {
        self.changed.notified().await
    }

    /// A new session (its seq numbers start again at 1): what was in flight is forgotten, and
    /// everything not acknowledged is sent again.
    pub fn new_session(&self) {
        let mut ranks = self.lock();
        for r in ranks.values_mut() {
            r.sent = None;
        }
        self.in_flight.lock().expect("in-flight lock").clear();
    }

    /// The ranks message `seq` reports: with `full` (a session's first message) every rank,
    /// acknowledged or not; otherwise those whose state the coordinator has not acknowledged
    /// and that were not sent in that state within the last interval. They are in flight under
    /// `seq` until `ack(seq)`.
    pub fn report(&self, seq: u64, full: bool) -> Vec<RankStatus> {
        let resend_after = *self.interval.lock().expect("interval lock");
        let mut ranks = self.lock();
        let (mut out, mut flying) = (vec![], vec![]);
        let now = Instant::now();
        for (&key, r) in ranks.iter_mut() {
            let report = r.state.report();
            let due = match r.sent {
                _ if full => true,
                _ if r.settled() => false,
                Some((sent, at)) => sent != report || now.duration_since(at) >= resend_after,
                None => true,
            };
            if !due {
                continue;
            }
            r.sent = Some((report, now));
            flying.push((key, report));
            let (state, exit_code) = match report {
                Report::Running => ("running", None),
                Report::Exited(code) => ("exited", Some(code)),
                Report::Lost => ("lost", None),
            };
            out.push(RankStatus { job: key.0, generation: key.1, rank: key.2, state: state.into(), exit_code });
        }
        if !flying.is_empty() {
            let mut in_flight = self.in_flight.lock().expect("in-flight lock");
            in_flight.insert(seq, flying);
            while in_flight.len() > MAX_IN_FLIGHT {
                in_flight.pop_first();
            }
        }
        out
    }

    /// The coordinator holds what message `seq` said: the ranks it reported are told, unless
    /// their state changed since (then the newer state is still to be told), and the ends are
    /// marked on disk so that a later agent does not report them again.
    pub fn ack(&self, seq: u64) {
        let mut ended = vec![];
        {
            let mut ranks = self.lock();
            let Some(flown) = self.in_flight.lock().expect("in-flight lock").remove(&seq) else { return };
            for (key, report) in flown {
                let Some(r) = ranks.get_mut(&key) else { continue };
                if r.state.report() != report || r.told == Some(report) {
                    continue;
                }
                r.told = Some(report);
                if report != Report::Running {
                    ended.push((key, r.dir.clone()));
                }
            }
        }
        // Off the rank lock: each marker is fsync'd.
        for (key, dir) in ended {
            if let Err(e) = rankfiles::write_atomic(&rank_file(&dir, key.2, "reported"), b"") {
                tracing::warn!(node = %self.node, "{e}; a restarted agent will report this end again");
            }
        }
    }

    /// Start the launch's ranks; a rank that cannot start is reported as exited with 127, one
    /// refused as the user the launch names (or as root, see `users`) with 126, the reason in
    /// its log either way. A launch of an older generation than one this agent already has for
    /// the job is ignored.
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
        let who = users::run_as(users::euid(), &l.user, self.allow_root_ranks, &self.node, users::lookup);
        let prepared = rankfiles::create_dirs(&dir)
            .and_then(|_| rankfiles::replace(&plan, l.plan_json.as_bytes()))
            .and_then(|_| match &who {
                // The user's own launch directory, reachable through the ones above it.
                Ok(Some(a)) => rankfiles::open_passage(&self.work_dir, &dir)
                    .and_then(|_| rankfiles::hand_over(&dir, a.uid, a.gid))
                    .and_then(|_| rankfiles::hand_over(&plan, a.uid, a.gid)),
                _ => Ok(()),
            })
            .map_err(|e| e.to_string());
        for r in &l.ranks {
            let key = (l.job, l.generation, r.rank);
            if self.lock().contains_key(&key) {
                continue; // the same instruction twice
            }
            let started = match (&who, prepared.clone()) {
                (Err(why), _) => Err((users::REFUSED, why.clone())),
                (_, Err(e)) => Err((127, e)),
                (Ok(account), Ok(())) => self.spawn(&l, r, &dir, &plan, account.as_ref()).map_err(|e| (127, e)),
            };
            match started {
                Ok((child, pgid, start)) => {
                    self.lock().insert(key, Rank::new(State::Running { pgid, start, stopping: false }, dir.clone()));
                    let (me, dir) = (self.clone(), dir.clone());
                    tokio::spawn(async move { me.watch_child(key, child, dir).await });
                }
                Err((code, why)) => {
                    tracing::warn!(node = %self.node, job = l.job, rank = r.rank, "rank did not start (exit {code}): {why}");
                    self.did_not_start(l.job, l.generation, r.rank, &dir, code, &why);
                    self.lock().insert(key, Rank::new(State::Exited(code), dir.clone()));
                }
            }
        }
        self.changed.notify_one();
    }

    /// A rank that never started: why, in its log (what `motley job logs` shows), and its exit
    /// code and record on disk so that a restarted agent reports the same end. Best effort:
    /// the launch directory itself may be what failed.
    fn did_not_start(&self, job: i64, generation: i64, rank: i64, dir: &Path, code: i64, why: &str) {
        for ext in ["reported", "stopping"] {
            let _ = std::fs::remove_file(rank_file(dir, rank, ext));
        }
        let log = rank_file(dir, rank, "log");
        let line = format!("motley-agent: rank {rank} of job {job} generation {generation} not started on node {}: {why}\n", self.node);
        let written = rankfiles::create_file(&log).and_then(|mut f| {
            std::io::Write::write_all(&mut f, line.as_bytes()).map_err(|err| crate::AgentError::Io {
                what: "writing",
                path: log.clone(),
                err,
            })
        });
        let record =
            RankRecord { node: self.node.clone(), job, generation, rank, pgid: 0, log, boot_id: self.boot_id.clone(), start_time: 0 };
        let done = written
            .and_then(|_| rankfiles::write_atomic(&rank_file(dir, rank, "exit"), format!("{code}\n").as_bytes()))
            .and_then(|_| rankfiles::write_record(dir, &record));
        if let Err(e) = done {
            tracing::warn!(node = %self.node, "{e}");
        }
    }

    /// The rank's wrapper, in its own process group, with the rank's environment; then its
    /// record, so a later agent can find it.
    fn spawn(
        &self,
        l: &Launch,
        r: &RankLaunch,
        dir: &Path,
        plan: &Path,
        user: Option<&users::Account>,
    ) -> Result<(tokio::process::Child, i32, u64), String> {
        // Files of an earlier agent life for the same key (a coordinator whose database was
        // reset hands out job ids again) must not describe this rank.
        for ext in ["exit", "reported", "json", "stopping"] {
            let _ = std::fs::remove_file(rank_file(dir, r.rank, ext));
        }
        let doc = motley_contract::PlanDocument::from_json(&l.plan_json).map_err(|e| format!("the launch's plan document: {e}"))?;
        let gpu = u32::try_from(r.gpu).map_err(|_| format!("the launch's GPU index {} is not a GPU index", r.gpu))?;
        let (groups, common) = rank_nccl(&doc, &self.node, gpu)?;
        let nccl = rank_file(dir, r.rank, "groups.json");
        let text = serde_json::to_string(&groups).map_err(|e| e.to_string())?;
        rankfiles::replace(&nccl, text.as_bytes()).map_err(|e| e.to_string())?;
        let log = rank_file(dir, r.rank, "log");
        let out = rankfiles::create_file(&log).map_err(|e| e.to_string())?;
        if let Some(a) = user {
            // Its own files: the rank may read its groups and append to its log by name.
            for file in [&nccl, &log] {
                rankfiles::hand_over(file, a.uid, a.gid).map_err(|e| e.to_string())?;
            }
        }
        let err = out.try_clone().map_err(|e| e.to_string())?;
        let mut cmd = tokio::process::Command::new(&self.wrapper);
        cmd.arg("__rank-wrapper").arg(rank_file(dir, r.rank, "exit"));
        cmd.arg("--lease").arg(crate::lease::path(&self.work_dir));
        cmd.arg("--").arg("sh").arg("-c").arg(&l.run);
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
            // Where a preemption notice will be (`notice`): the ranks look once per step.
            (crate::notice::ENV, crate::notice::path(dir).display().to_string()),
            // Checkpoints go into the memory tier (or the launch's directory), where the agent
            // reports them from and tiers them.
            ("MOTLEY_CKPT_DIR", self.rank_ckpt_dir(l, dir, user).display().to_string()),
        ] {
            cmd.env(k, v);
        }
        // A recovery's launch: the files this node restored for it (the restorer's list).
        if let Some(step) = l.envs.get(crate::restorer::RESTORE_STEP_ENV) {
            let list = crate::restorer::launch_list(&self.work_dir, l.job, l.generation);
            if !list.is_file() {
                return Err(format!(
                    "the launch resumes from checkpoint step {step} but this node has no restore for generation {} ({} is missing)",
                    l.generation,
                    list.display()
                ));
            }
            if let Some(a) = user {
                crate::restorer::hand_over(&self.work_dir, &list, a.uid, a.gid)
                    .map_err(|e| format!("handing the restored files to the rank's user: {e}"))?;
            }
            cmd.env("MOTLEY_CKPT_RESTORE", list.display().to_string());
        }
        // Set at start: the union of the rank's groups' device lists (NCCL reads them once per
        // process) and the other settings all its groups agree on; the rest are per group
        // (MOTLEY_NCCL_GROUPS, applied before each communicator is made).
        for (k, v) in &common {
            if !l.envs.contains_key(k) {
                cmd.env(k, v);
            }
        }
        if let Some(cg) = &self.cgroups {
            let procs = cg.create(l.job, l.generation, r.rank).map_err(|e| format!("the rank's cgroup: {e}"))?;
            // First of the child's steps: it still has the agent's rights to move itself.
            // SAFETY: `enter` makes system calls only (no allocation, no locks).
            unsafe {
                cmd.pre_exec(move || crate::cgroup::enter(&procs));
            }
        }
        if let Some(a) = user {
            cmd.env("HOME", &a.home).env("USER", &a.name).env("LOGNAME", &a.name);
            // The wrapper, and so the rank, as the job's user (groups, gid, uid: see `users`).
            // SAFETY: the closure makes system calls only (no allocation, no locks).
            unsafe {
                cmd.pre_exec(users::become_user(a));
            }
        }
        // Its own process group: a stop kills the rank and everything it started, and a
        // signal to the agent's group (a terminal's Ctrl-C) does not reach it.
        cmd.process_group(0);
        let child = cmd.spawn().map_err(|e| format!("{}: {e}", self.wrapper.display()))?;
        let pgid = child.id().map_or(0, |p| p as i32);
        // Not reaped before `watch_child` waits for it, so the pid is still the wrapper's.
        let start = rankfiles::start_time(pgid).unwrap_or(0);
        let record = RankRecord {
            node: self.node.clone(),
            job: l.job,
            generation: l.generation,
            rank: r.rank,
            pgid,
            log,
            boot_id: self.boot_id.clone(),
            start_time: start,
        };
        if let Err(e) = rankfiles::write_record(dir, &record) {
            tracing::warn!(node = %self.node, "{e}; a restarted agent will not find this rank");
        }
        Ok((child, pgid, start))
    }

    fn finish(&self, key: Key, state: State) {
        if let Some(r) = self.lock().get_mut(&key) {
            r.state = state;
        }
        // A rank's end ends everything it started, also what left its process group.
        if let Some(cg) = &self.cgroups {
            tokio::spawn(crate::cgroup::clear(cg.path(key.0, key.1, key.2)));
        }
        self.changed.notify_one();
    }

    /// A rank this agent started: wait(2) for its wrapper; the exit file has the code.
    async fn watch_child(self, key: Key, mut child: tokio::process::Child, dir: PathBuf) {
        let status = child.wait().await;
        let code = rankfiles::read_exit(&dir, key.2).unwrap_or_else(|| match status {
            Ok(s) => s.code().map_or_else(|| 128 + std::os::unix::process::ExitStatusExt::signal(&s).unwrap_or(0) as i64, i64::from),
            Err(_) => -1,
        });
        self.finish(key, State::Exited(code));
    }

    /// A rank an earlier agent started: poll its exit file and its process group.
    async fn watch_adopted(self, key: Key, pgid: i32, dir: PathBuf) {
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
                let busy = ranks
                    .iter()
                    .any(|(k, r)| k.0 == job && k.1 == generation && (matches!(r.state, State::Running { .. }) || !r.settled()));
                if busy || !rankfiles::untouched_for(&dir, keep) {
                    continue;
                }
                // Under the rank lock: a launch of this generation cannot slip in between.
                if let Err(e) = std::fs::remove_dir_all(&dir) {
                    tracing::warn!(node = %self.node, "{}: {e}", dir.display());
                    continue;
                }
                // Its checkpoints in the memory tier go with it (the disk and cloud keep theirs).
                if let Some(mem) = &self.shm_root {
                    let _ = std::fs::remove_dir_all(mem.join("jobs").join(job.to_string()).join(generation.to_string()));
                    let _ = std::fs::remove_dir(mem.join("jobs").join(job.to_string()));
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
            let State::Running { pgid, start, stopping: false } = r.state else { continue };
            r.state = State::Running { pgid, start, stopping: true };
            // Marked before the signal: an agent that dies now leaves the next one to finish.
            if let Err(e) = rankfiles::write_atomic(&rank_file(&r.dir, key.2, "stopping"), b"") {
                tracing::warn!(node = %self.node, "{e}; a restarted agent would not finish this stop");
            }
            if !rankfiles::signal_group(pgid, start, libc::SIGTERM) {
                tracing::warn!(node = %self.node, "job {job} rank {}: process group {pgid} is no longer the rank's; not signalled", key.2);
            }
            stopped.push((key, pgid, start, r.dir.clone()));
        }
        for (key, pgid, start, dir) in stopped {
            self.escalate(key, pgid, start, dir);
        }
    }

    /// SIGKILL to the rank's group if it is still running after the grace period.
    fn escalate(&self, key: Key, pgid: i32, start: u64, dir: PathBuf) {
        let grace = *self.grace.lock().expect("grace lock");
        let me = self.clone();
        tokio::spawn(async move {
            tokio::time::sleep(grace).await;
            let running = matches!(me.lock().get(&key).map(|r| &r.state), Some(State::Running { .. }));
            if running && rankfiles::is_rank_group(pgid, start) {
                // The code first: with the wrapper killed too, nobody else will write it.
                let _ = rankfiles::write_once(&rank_file(&dir, key.2, "exit"), b"137\n");
                rankfiles::signal_group(pgid, start, libc::SIGKILL);
                if let Some(cg) = &me.cgroups {
                    crate::cgroup::kill(&cg.path(key.0, key.1, key.2));
                }
            }
        });
    }
}

/// The groups of `node`'s GPU `gpu` and the rank's process-wide NCCL settings
/// (`motley_solver::network::process_env`); refused, naming both groups and the key, where two
/// of its groups need device lists no one value satisfies (a plan the planner did not make).
pub(crate) fn rank_nccl(
    doc: &motley_contract::PlanDocument,
    node: &str,
    gpu: u32,
) -> Result<(Vec<motley_contract::RankGroup>, std::collections::BTreeMap<String, String>), String> {
    let groups = motley_contract::for_rank(doc, node, gpu);
    let envs: Vec<_> = groups.iter().map(|g| &g.env).collect();
    let common = motley_solver::network::process_env(&envs).map_err(|c| {
        let (a, b) = (&groups[c.first], &groups[c.second]);
        let kind = |g: &motley_contract::RankGroup| format!("{:?}", g.kind).to_lowercase();
        format!(
            "the plan's comm_groups {} ({}, {}={}) and {} ({}, {}={}) of GPU {node}:{gpu} need {} lists that cannot be united (exact vs prefix matching, or inclusion vs exclusion); NCCL reads it once per process",
            a.index,
            kind(a),
            c.key,
            a.env[&c.key],
            b.index,
            kind(b),
            c.key,
            b.env[&c.key],
            c.key
        )
    })?;
    Ok((groups, common))
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_rank_gets_its_groups_the_union_of_their_device_lists_and_the_settings_they_agree_on() {
        use motley_contract::GroupKind;
        let plan = serde_json::json!({"global_batch": 1, "micro_batch": 1, "seq_len": 8, "model": "m", "replicas": [], "comm_groups": [
            {"kind": "tp", "gpus": [{"node": "a", "index": 0}, {"node": "a", "index": 1}], "transport": "nvlink",
             "env": {"NCCL_P2P_LEVEL": "NVL"}, "nccl_net": null, "replica": 0, "stage": 0, "layers": [0, 2]},
            {"kind": "pp", "gpus": [{"node": "a", "index": 0}, {"node": "c", "index": 0}], "transport": "ib",
             "env": {"NCCL_NET": "IB", "NCCL_IB_HCA": "=mlx5_1:1", "NCCL_P2P_LEVEL": "NVL"}, "nccl_net": "IB", "replica": 0, "stage": 0, "layers": [1, 1]},
            {"kind": "dp", "gpus": [{"node": "a", "index": 0}, {"node": "b", "index": 0}], "transport": "ib",
             "env": {"NCCL_NET": "IB", "NCCL_IB_HCA": "=mlx5_0:1,mlx5_1:1", "NCCL_P2P_LEVEL": "NVL"},
             "node_env": {"a": {"NCCL_IB_GID_INDEX": "3"}}, "nccl_net": "IB", "replica": null, "stage": null, "layers": [0, 2]},
            {"kind": "dp", "gpus": [{"node": "a", "index": 1}, {"node": "b", "index": 1}], "transport": "socket",
             "env": {"NCCL_NET": "Socket", "NCCL_SOCKET_IFNAME": "=eth0"}, "nccl_net": "Socket", "replica": null, "stage": null, "layers": [0, 2]}
        ]});
        let plan: motley_contract::PlanDocument = serde_json::from_value(plan).unwrap();
        let (groups, common) = super::rank_nccl(&plan, "a", 0).unwrap();
        let kinds: Vec<(usize, GroupKind)> = groups.iter().map(|g| (g.index, g.kind)).collect();
        assert_eq!(kinds, [(0, GroupKind::Tp), (1, GroupKind::Pp), (2, GroupKind::Dp)]);
        assert_eq!(groups[2].env["NCCL_IB_GID_INDEX"], "3", "node a's override applies");
        let map =
            |kv: &[(&str, &str)]| kv.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect::<std::collections::BTreeMap<_, _>>();
        // The TP group (first, no device list) does not hide the later groups' HCAs.
        assert_eq!(common, map(&[("NCCL_IB_HCA", "=mlx5_1:1,mlx5_0:1"), ("NCCL_P2P_LEVEL", "NVL")]));
        let (_, common) = super::rank_nccl(&plan, "a", 1).unwrap();
        assert_eq!(common, map(&[("NCCL_SOCKET_IFNAME", "=eth0")]));
        let (groups, common) = super::rank_nccl(&plan, "b", 0).unwrap();
        assert_eq!(groups.len(), 1);
        assert!(!groups[0].env.contains_key("NCCL_IB_GID_INDEX"), "node a's override is not b's");
        assert_eq!(common["NCCL_NET"], "IB");
        assert_eq!(super::rank_nccl(&plan, "d", 0).unwrap().1.len(), 0);
        // A hand-made plan whose lists contradict on one rank is refused, naming both groups.
        let mut bad = plan.clone();
        bad.comm_groups[2].env.insert("NCCL_IB_HCA".into(), "^mlx5_2:1".into());
        let e = super::rank_nccl(&bad, "a", 0).unwrap_err();
        assert!(e.contains("comm_groups 1 (pp") && e.contains("2 (dp") && e.contains("NCCL_IB_HCA"), "{e}");
    }

    use super::*;
    use std::os::unix::process::CommandExt;

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
        rankfiles::write_record(&dir, &record("n", job, i32::MAX, rankfiles::boot_id(), 1, &dir)).unwrap();
        std::fs::write(rank_file(&dir, 0, "exit"), "0\n").unwrap();
        std::fs::write(rank_file(&dir, 0, "log"), "done\n").unwrap();
        if reported {
            std::fs::write(rank_file(&dir, 0, "reported"), "").unwrap();
        }
        dir
    }

    fn supervisor(work: &Path) -> Supervisor {
        Supervisor::new(work.to_path_buf(), "n".into(), PathBuf::from("/bin/false"))
    }

    #[test]
    fn finished_and_reported_launches_are_pruned_after_the_keep_period() {
        let work = work_dir("prune");
        let (told, untold) = (finished(&work, 1, true), finished(&work, 2, false));
        let s = supervisor(&work);
        s.adopt();
        assert!(s.prune(Duration::from_secs(3600)).is_empty(), "nothing is old enough yet");
        let removed = s.prune(Duration::ZERO);
        assert_eq!(removed.len(), 1, "{removed:?}");
        assert!(!told.exists() && !work.join("jobs/1").exists(), "the reported launch and its empty job directory are gone");
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

    /// Issue 13 item 11: `rank-R.reported` follows the coordinator's acknowledgement, not the
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
        if users::euid() != 0 {
            return; // only root can give a file away
        }
        let work = work_dir("forged");
        let dir = finished(&work, 1, false);
        rankfiles::hand_over(&rank_file(&dir, 0, "json"), 65534, 65534).unwrap();
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

    /// Issue 13 item 1: two agents' records in one directory; each adopts its own node's only.
    #[test]
    fn a_record_of_another_node_is_never_adopted() {
        let work = work_dir("node");
        let dir = generation_dir(&work, 1, 1);
        std::fs::create_dir_all(&dir).unwrap();
        let b = record("b", 1, i32::MAX, rankfiles::boot_id(), 1, &dir);
        rankfiles::write_record(&dir, &b).unwrap();
        std::fs::write(rank_file(&dir, 0, "exit"), "0\n").unwrap();
        let a = Supervisor::new(work.clone(), "a".into(), PathBuf::from("/bin/false"));
        let notes = a.adopt();
        assert!(notes.iter().any(|n| n.contains("names node b, not a; not adopted")), "{notes:?}");
        assert!(a.report(1, true).is_empty(), "node a knows no rank");
        let b_agent = Supervisor::new(work.clone(), "b".into(), PathBuf::from("/bin/false"));
        b_agent.adopt();
        assert_eq!(b_agent.report(1, true).len(), 1, "node b adopts its own");
        std::fs::remove_dir_all(&work).unwrap();
    }

    /// Issue 13 item 14: a record whose boot id or start time does not match the live group
    /// its pgid names is not running, and that group is never signalled.
    #[tokio::test]
    async fn a_record_naming_a_foreign_live_group_is_not_adopted_as_running() {
        let work = work_dir("pid");
        let mut sleep = std::process::Command::new("sleep").arg("60").process_group(0).spawn().unwrap();
        let pid = sleep.id() as i32;
        let start = rankfiles::start_time(pid).unwrap();
        for (job, boot, st) in [(1, "another-boot".to_string(), start), (2, rankfiles::boot_id(), start + 1), (3, String::new(), 0)] {
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
        assert!(!rankfiles::signal_group(pid, start + 1, libc::SIGKILL), "a wrong start time is never signalled");
        tokio::time::sleep(Duration::from_millis(100)).await; // past the (1 ms x 5) grace
        assert!(sleep.try_wait().unwrap().is_none(), "the foreign sleep is alive");
        assert!(rankfiles::is_rank_group(pid, start), "the check itself takes the right start time");

        // The same group with the right boot and start time is the rank's: running, and a stop
        // signals it.
        let dir = generation_dir(&work, 4, 1);
        std::fs::create_dir_all(&dir).unwrap();
        rankfiles::write_record(&dir, &record("n", 4, pid, rankfiles::boot_id(), start, &dir)).unwrap();
        let s = supervisor(&work);
        s.adopt();
        assert_eq!(s.running(), 1);
        s.stop(4, 1);
        let status = sleep.wait().unwrap();
        assert_eq!(std::os::unix::process::ExitStatusExt::signal(&status), Some(libc::SIGTERM));
        std::fs::remove_dir_all(&work).unwrap();
    }
}
