//! The supervisor's launches: each rank's wrapper started in its own process group (and
//! cgroup, as the job's user where it names one) with the rank's environment, its record
//! written so a later agent finds it; a rank that cannot start is recorded as ended, its
//! reason in its log.

use std::path::{Path, PathBuf};
use std::process::Stdio;

use motley_proto::v1::{Launch, RankLaunch};

use super::{Rank, State, Supervisor};
use crate::ranks::rankfiles::{self, RankRecord};
use crate::ranks::{group, users};
use crate::workdir::{self, generation_dir, rank_file};

impl Supervisor {
    /// Start the launch's ranks; a rank that cannot start is reported as exited with 127, one
    /// refused as the user the launch names (or as root, see `users`) with 126, the reason in
    /// its log either way. A launch of an older generation than one this agent already has for
    /// the job is ignored. A launch with a `join_epoch` (a lost replica rejoining, docs/keep-going.md)
    /// starts its ranks afresh in the running launch: one of them that ended here is replaced (its
    /// log kept beside, as `rank-N.log.before-EPOCH`), and the epoch's membership is written
    /// where they look before any starts.
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
        let who = users::run_as(users::euid(), &l.user, self.allow_root_ranks, &self.node, users::lookup).and_then(|a| {
            // A user who cannot execute the wrapper would only see it fail to start: say why.
            match a.as_ref().and_then(|a| self.wrapper.not_runnable_by(a)) {
                Some(why) => Err(why),
                None => Ok(a),
            }
        });
        let prepared = workdir::create_dirs(&dir)
            .and_then(|_| workdir::replace(&plan, l.plan_json.as_bytes()))
            .and_then(|_| match &who {
                // The user's own launch directory, reachable through the ones above it.
                Ok(Some(a)) => workdir::open_passage(&self.work_dir, &dir)
                    .and_then(|_| workdir::hand_over(&dir, a.uid, a.gid))
                    .and_then(|_| workdir::hand_over(&plan, a.uid, a.gid)),
                _ => Ok(()),
            })
            .map_err(|e| e.to_string());
        let prepared = match prepared {
            Ok(()) if l.join_epoch > 0 => self.prepare_join(&l, &dir),
            other => other,
        };
        for r in &l.ranks {
            let key = (l.job, l.generation, r.rank);
            if l.join_epoch > 0 && prepared.is_ok() {
                // Started afresh unless it runs here: also a rank this agent does not hold (its
                // end reported before this agent started, or never run here), whose earlier
                // process's files must not pass for this one's.
                let mut ranks = self.lock();
                if !ranks.get(&key).is_some_and(|x| matches!(x.state, State::Running { .. })) {
                    ranks.remove(&key);
                    drop(ranks);
                    keep_log(&dir, r.rank, l.join_epoch);
                }
            }
            if self.lock().contains_key(&key) {
                continue; // the same instruction twice (a joining rank: still running here)
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

    /// A joining launch's membership, written where its ranks look before they start (they
    /// read it to know they join, and whom).
    fn prepare_join(&self, l: &Launch, dir: &Path) -> Result<(), String> {
        let m = motley_proto::v1::Membership {
            job: l.job,
            generation: l.generation,
            epoch: l.join_epoch,
            document: l.membership.clone(),
            stop_ranks: vec![],
        };
        match crate::ranks::membership::write(&self.work_dir, &m) {
            Ok(_) => Ok(()),
            // The same epoch (or a newer one) is there already: the Membership sent beside it.
            Err(crate::AgentError::StaleMembership { .. }) => Ok(()),
            Err(e) => Err(format!("the joining ranks' membership (epoch {}) in {}: {e}", l.join_epoch, dir.display())),
        }
    }

    /// A rank that never started: why, in its log (what `motley job logs` shows), and its exit
    /// code and record on disk so that a restarted agent reports the same end. Best effort:
    /// the launch directory itself may be what failed.
    fn did_not_start(&self, job: i64, generation: i64, rank: i64, dir: &Path, code: i64, why: &str) {
        if let Ok(d) = crate::safe_fs::open_under(dir, 3) {
            for ext in ["reported", "stopping"] {
                let _ = d.remove_file(&format!("rank-{rank}.{ext}"));
            }
        }
        let log = rank_file(dir, rank, "log");
        let line = format!("motley-agent: rank {rank} of job {job} generation {generation} not started on node {}: {why}\n", self.node);
        let written = workdir::create_file(&log).and_then(|mut f| {
            std::io::Write::write_all(&mut f, line.as_bytes()).map_err(|err| crate::AgentError::Io {
                what: "writing",
                path: log.clone(),
                err,
            })
        });
        let record =
            RankRecord { node: self.node.clone(), job, generation, rank, pgid: 0, log, boot_id: self.boot_id.clone(), start_time: 0 };
        let done = written
            .and_then(|_| workdir::write_atomic(&rank_file(dir, rank, "exit"), format!("{code}\n").as_bytes()))
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
        let files = rank_files(&self.node, l, r, dir, user)?;
        let mut cmd = self.rank_command(l, r, dir, plan, user, &files)?;
        self.confine(&mut cmd, l, r, user)?;
        // Last of the child's steps: the wrapper through the agent's descriptor of its own
        // executable, so the job's user needs no way through the directories above it.
        self.wrapper.exec_through(&mut cmd)?;
        let child = cmd.spawn().map_err(|e| format!("the rank wrapper {}: {e}", self.wrapper.path().display()))?;
        let pgid = child.id().map_or(0, |p| p as i32);
        if let Some(cpu) = &self.cpu_v1 {
            let (dir, allowance, node, rank) = (
                cpu.path(l.job, l.generation, r.rank),
                self.interval() * crate::ranks::cpu_share::ENTER_INTERVALS,
                self.node.clone(),
                r.rank,
            );
            tokio::spawn(async move {
                tokio::time::sleep(allowance).await;
                match crate::ranks::cpu_share::confine_late(&dir, pgid) {
                    Ok(0) => {}
                    Ok(n) => {
                        tracing::warn!(%node, rank, "the rank did not enter its CPU share within {allowance:?}: moved its {n} processes there")
                    }
                    Err(e) => tracing::debug!(%node, rank, "{}: {e}", dir.display()),
                }
            });
        }
        // Not reaped before `watch_child` waits for it, so the pid is still the wrapper's.
        let start = group::start_time(pgid).unwrap_or(0);
        let record = RankRecord {
            node: self.node.clone(),
            job: l.job,
            generation: l.generation,
            rank: r.rank,
            pgid,
            log: files.log,
            boot_id: self.boot_id.clone(),
            start_time: start,
        };
        if let Err(e) = rankfiles::write_record(dir, &record) {
            tracing::warn!(node = %self.node, "{e}; a restarted agent will not find this rank");
        }
        Ok((child, pgid, start))
    }

    /// The wrapper's command line, its output into the rank's log, and the rank's environment:
    /// the job's, then the rank's place in the plan, then the NCCL settings its groups share.
    fn rank_command(
        &self,
        l: &Launch,
        r: &RankLaunch,
        dir: &Path,
        plan: &Path,
        user: Option<&users::Account>,
        files: &RankFiles,
    ) -> Result<tokio::process::Command, String> {
        let out = files.log_file.try_clone().map_err(|e| e.to_string())?;
        let err = files.log_file.try_clone().map_err(|e| e.to_string())?;
        // Named for messages only: `spawn` executes it through its descriptor (`wrapper_exe`).
        let mut cmd = tokio::process::Command::new(self.wrapper.path());
        cmd.arg("__rank-wrapper").arg(rank_file(dir, r.rank, "exit"));
        cmd.arg("--lease").arg(crate::ranks::lease::path(&self.work_dir));
        cmd.arg("--").arg("sh").arg("-c").arg(&l.run);
        cmd.current_dir(dir).stdin(Stdio::null()).stdout(out).stderr(err);
        // The agent's own settings (its token above all) and cloud credentials are not the
        // job's business: only the allow-list's variables pass (`environment`). Cleared
        // first: the wrapper's exec passes exactly the variables set here (`exec_through`).
        cmd.env_clear();
        cmd.envs(self.rank_env.inherited(std::env::vars_os(), user.is_none()));
        // CUDA numbers GPUs fastest first unless told otherwise; NVML (discovery, the plan's
        // GPU indices) numbers them in PCI order. A job may still override it.
        cmd.env("CUDA_DEVICE_ORDER", "PCI_BUS_ID");
        cmd.envs(&l.envs);
        let nccl = &files.nccl;
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
            (crate::ranks::notice::ENV, crate::ranks::notice::path(dir).display().to_string()),
            // Where a new membership will be after a lost replica (`membership`): the same.
            (crate::ranks::membership::ENV, crate::ranks::membership::path(dir).display().to_string()),
            // Where a joining rank says what it copied from its peers (`rankfiles::read_rejoined`).
            (crate::ranks::rankfiles::REJOINED_ENV, dir.join(crate::ranks::rankfiles::rejoined_name(r.rank)).display().to_string()),
            // Checkpoints go into the memory tier (or the launch's directory), where the agent
            // reports them from and tiers them.
            ("MOTLEY_CKPT_DIR", self.rank_ckpt_dir(l, dir, user).display().to_string()),
        ] {
            cmd.env(k, v);
        }
        if let Some(list) = self.restored_files(l, user)? {
            cmd.env("MOTLEY_CKPT_RESTORE", list.display().to_string());
        }
        // Set at start: the union of the rank's groups' device lists (NCCL reads them once per
        // process) and the other settings all its groups agree on; the rest are per group
        // (MOTLEY_NCCL_GROUPS, applied before each communicator is made).
        for (k, v) in &files.common {
            if !l.envs.contains_key(k) {
                cmd.env(k, v);
            }
        }
        Ok(cmd)
    }

    /// A recovery's launch: the list of the files this node restored for it (the restorer's),
    /// handed to the rank's user; refused where this node has no restore for the launch.
    fn restored_files(&self, l: &Launch, user: Option<&users::Account>) -> Result<Option<PathBuf>, String> {
        let Some(step) = l.envs.get(crate::checkpoints::restorer::RESTORE_STEP_ENV) else { return Ok(None) };
        let list = crate::checkpoints::restorer::launch_list(&self.work_dir, l.job, l.generation);
        if !list.is_file() {
            return Err(format!(
                "the launch resumes from checkpoint step {step} but this node has no restore for generation {} ({} is missing)",
                l.generation,
                list.display()
            ));
        }
        if let Some(a) = user {
            crate::checkpoints::restorer::hand_over(&self.work_dir, &list, a.uid, a.gid)
                .map_err(|e| format!("handing the restored files to the rank's user: {e}"))?;
        }
        Ok(Some(list))
    }

    /// The rank's cgroup (and, emulating on a v1 host, its v1 cpu cgroup), its user and its
    /// own process group, entered by the child before `exec`.
    fn confine(&self, cmd: &mut tokio::process::Command, l: &Launch, r: &RankLaunch, user: Option<&users::Account>) -> Result<(), String> {
        if let Some(cg) = &self.cgroups {
            let owner = user.filter(|a| a.uid != users::euid()).map(|a| (a.uid, a.gid));
            let procs = cg.create(l.job, l.generation, r.rank, owner).map_err(|e| format!("the rank's cgroup: {e}"))?;
            // First of the child's steps: it still has the agent's rights to move itself.
            // SAFETY: `enter` makes system calls only (no allocation, no locks).
            unsafe {
                cmd.pre_exec(move || crate::ranks::cgroup::enter(&procs));
            }
        }
        if let Some(cpu) = &self.cpu_v1 {
            // The rank enters its share itself once started (`cpu_share::ENTER_ENV`), or the
            // agent moves it there after the allowance (`confine_late`, from `spawn`).
            let owner = user.filter(|a| a.uid != users::euid()).map(|a| (a.uid, a.gid));
            let procs = cpu.create(l.job, l.generation, r.rank, owner).map_err(|e| format!("the rank's CPU share (emulate.cpu): {e}"))?;
            cmd.env(crate::ranks::cpu_share::ENTER_ENV, procs);
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
        Ok(())
    }

    /// Where a rank of the launch in `dir` writes its checkpoints: the memory tier if there is
    /// one and its directory can be made (0700, the job's user's), else the launch directory.
    fn rank_ckpt_dir(&self, l: &Launch, dir: &Path, user: Option<&users::Account>) -> PathBuf {
        let on_disk = crate::checkpoints::steps::ckpt_dir(dir);
        let Some(root) = &self.shm_root else { return on_disk };
        let ckpt = crate::checkpoints::steps::ckpt_dir(&generation_dir(root, l.job, l.generation));
        let made = workdir::create_dirs(&ckpt).and_then(|_| match user {
            Some(a) => workdir::open_passage(root, &ckpt).and_then(|_| workdir::hand_over(&ckpt, a.uid, a.gid)),
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
}

/// The rank's own files in its launch directory, made before its wrapper starts.
struct RankFiles {
    /// `rank-R.groups.json`: its NCCL groups (MOTLEY_NCCL_GROUPS).
    nccl: PathBuf,
    /// `rank-R.log`, open for the wrapper's output.
    log: PathBuf,
    log_file: std::fs::File,
    /// The NCCL settings all its groups agree on (see `rank_nccl`).
    common: std::collections::BTreeMap<String, String>,
}

/// Files of an earlier agent life for the rank removed, its groups file written and its log
/// made (both the rank's user's, so it may read its groups and append to its log by name).
fn rank_files(node: &str, l: &Launch, r: &RankLaunch, dir: &Path, user: Option<&users::Account>) -> Result<RankFiles, String> {
    // Files of an earlier agent life for the same key (a coordinator whose database was
    // reset hands out job ids again) must not describe this rank.
    // Through the launch directory's handle: it is the rank's user's (docs/state.md).
    let launch = crate::safe_fs::open_under(dir, 3).map_err(|e| e.to_string())?;
    for ext in ["exit", "reported", "json", "stopping"] {
        launch.remove_file(&format!("rank-{}.{ext}", r.rank)).map_err(|e| e.to_string())?;
    }
    let doc = motley_contract::PlanDocument::from_json(&l.plan_json).map_err(|e| format!("the launch's plan document: {e}"))?;
    let gpu = u32::try_from(r.gpu).map_err(|_| format!("the launch's GPU index {} is not a GPU index", r.gpu))?;
    let (groups, common) = rank_nccl(&doc, node, gpu)?;
    let nccl = rank_file(dir, r.rank, "groups.json");
    let text = serde_json::to_string(&groups).map_err(|e| e.to_string())?;
    workdir::replace(&nccl, text.as_bytes()).map_err(|e| e.to_string())?;
    let log = rank_file(dir, r.rank, "log");
    let log_file = workdir::create_file(&log).map_err(|e| e.to_string())?;
    if let Some(a) = user {
        // Its own files: the rank may read its groups and append to its log by name.
        for file in [&nccl, &log] {
            workdir::hand_over(file, a.uid, a.gid).map_err(|e| e.to_string())?;
        }
    }
    Ok(RankFiles { nccl, log, log_file, common })
}

/// The groups of `node`'s GPU `gpu` and the rank's process-wide NCCL settings
/// (`motley_contract::groups::process_env`); refused, naming both groups and the key, where two
/// of its groups need device lists no one value satisfies (a plan the planner did not make).
pub(crate) fn rank_nccl(
    doc: &motley_contract::PlanDocument,
    node: &str,
    gpu: u32,
) -> Result<(Vec<motley_contract::RankGroup>, std::collections::BTreeMap<String, String>), String> {
    let groups = motley_contract::for_rank(doc, node, gpu);
    let envs: Vec<_> = groups.iter().map(|g| &g.env).collect();
    let common = motley_contract::groups::process_env(&envs).map_err(|c| {
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

/// The log of a rank that ended, kept beside when it is started again to rejoin (its lines up
/// to the loss stay readable). Best effort: a log that cannot be moved is started afresh.
fn keep_log(dir: &Path, rank: i64, epoch: i64) {
    if let Ok(d) = crate::safe_fs::open_under(dir, 3) {
        let _ = d.rename(&format!("rank-{rank}.log"), &format!("rank-{rank}.log.before-{epoch}"));
        // What the earlier process copied is not this one's (`rankfiles::read_rejoined`).
        let _ = d.remove_file(&crate::ranks::rankfiles::rejoined_name(rank));
    }
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
}
