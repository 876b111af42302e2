//! The ranks this agent runs: started in their own process group, reaped, reported once per
//! change, killed as a group on stop.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::{Arc, Mutex};

use motley_proto::v1::{Launch, RankStatus};

#[derive(Clone, Debug, PartialEq)]
enum State {
    Running { pgid: i32 },
    Exited(i64),
}

struct Rank {
    state: State,
    /// Reported to the coordinator in its current state.
    reported: bool,
}

/// Ranks by (job, generation, rank).
type Ranks = BTreeMap<(i64, i64, i64), Rank>;

/// Shared by the heartbeat task, the instruction loop and the reapers.
#[derive(Clone)]
pub struct Supervisor {
    work_dir: PathBuf,
    node: String,
    ranks: Arc<Mutex<Ranks>>,
}

impl Supervisor {
    pub fn new(work_dir: PathBuf, node: String) -> Supervisor {
        Supervisor { work_dir, node, ranks: Arc::new(Mutex::new(BTreeMap::new())) }
    }

    /// States changed since the last heartbeat (each change is reported once).
    pub fn changes(&self) -> Vec<RankStatus> {
        let mut ranks = self.ranks.lock().expect("rank lock");
        let mut out = vec![];
        for (&(job, generation, rank), r) in ranks.iter_mut().filter(|(_, r)| !r.reported) {
            r.reported = true;
            out.push(match r.state {
                State::Running { .. } => RankStatus { job, generation, rank, state: "running".into(), exit_code: None },
                State::Exited(code) => RankStatus { job, generation, rank, state: "exited".into(), exit_code: Some(code) },
            });
        }
        out
    }

    /// A new session: report every rank again (the coordinator may have missed changes).
    pub fn resend_all(&self) {
        for r in self.ranks.lock().expect("rank lock").values_mut() {
            r.reported = false;
        }
    }

    /// Start the launch's ranks; a rank that cannot start is reported as exited with 127.
    pub fn launch(&self, l: Launch) {
        let dir = self.work_dir.join("jobs").join(l.job.to_string()).join(l.generation.to_string());
        let plan = dir.join("plan.json");
        let prepared = std::fs::create_dir_all(&dir).and_then(|_| std::fs::write(&plan, &l.plan_json));
        for r in &l.ranks {
            let key = (l.job, l.generation, r.rank);
            if self.ranks.lock().expect("rank lock").contains_key(&key) {
                continue; // the same instruction twice
            }
            let log = dir.join(format!("rank-{}.log", r.rank));
            let spawned = prepared.as_ref().map_err(|e| e.to_string()).and_then(|_| {
                let out = std::fs::File::create(&log).map_err(|e| e.to_string())?;
                let err = out.try_clone().map_err(|e| e.to_string())?;
                let mut cmd = tokio::process::Command::new("sh");
                cmd.arg("-c").arg(&l.run).current_dir(&dir).stdin(Stdio::null()).stdout(out).stderr(err);
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
                ] {
                    cmd.env(k, v);
                }
                // Its own process group: a stop kills the rank and everything it started.
                cmd.process_group(0);
                cmd.spawn().map_err(|e| e.to_string())
            });
            match spawned {
                Ok(mut child) => {
                    let pgid = child.id().map_or(0, |p| p as i32);
                    self.ranks.lock().expect("rank lock").insert(key, Rank { state: State::Running { pgid }, reported: false });
                    let me = self.clone();
                    tokio::spawn(async move {
                        let code = match child.wait().await {
                            Ok(s) => s
                                .code()
                                .map_or_else(|| 128 + std::os::unix::process::ExitStatusExt::signal(&s).unwrap_or(0) as i64, i64::from),
                            Err(_) => -1,
                        };
                        if let Some(r) = me.ranks.lock().expect("rank lock").get_mut(&key) {
                            r.state = State::Exited(code);
                            r.reported = false;
                        }
                    });
                }
                Err(e) => {
                    eprintln!("motley-agent {}: rank {} of job {} did not start: {e}", self.node, r.rank, l.job);
                    self.ranks.lock().expect("rank lock").insert(key, Rank { state: State::Exited(127), reported: false });
                }
            }
        }
    }

    /// Kill the process groups of the job's ranks of generations up to `generation`.
    pub fn stop(&self, job: i64, generation: i64) {
        let ranks = self.ranks.lock().expect("rank lock");
        for (&(j, g, _), r) in ranks.iter() {
            if let (true, State::Running { pgid }) = (j == job && g <= generation, &r.state) {
                if *pgid > 0 {
                    // SAFETY: kill(2) with a negative pid signals a process group; no memory is shared.
                    unsafe {
                        libc::kill(-pgid, libc::SIGKILL);
                    }
                }
            }
        }
    }
}
