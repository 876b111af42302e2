//! A job's life, decided in one place (docs/architecture.md, docs/recovery.md). The leader
//! keeps one `Life`: the store (durable state), the fleet (live sessions and their outboxes),
//! the facts agents told (`facts`), and the rooms' memories of the work in flight. One
//! reconcile tick per base interval (`reconcile`) reads every unfinished job and dispatches it
//! by its state, fenced in the store by (state, generation, term):
//!
//! | state | what is done | where |
//! |---|---|---|
//! | `submitted`, `planning` | the queue plans it, oldest first, and sends its launch | `queue` |
//! | `launching` | sends a launch not sent yet; fails one never acknowledged; moves it on from its ranks | `Life::step` |
//! | `running` | moves it on from its ranks; a failed rank or lost node ends its replica while the others keep going, or recovers or fails it; notices; scale-up; re-plans on changed links | `Life::step`, `keep_going`, `notice`, `scale`, `network` |
//! | `degraded` | moves it on from its members' ranks; sends its membership where not sent; another loss as in `running` | `Life::step`, `keep_going` |
//! | `launching`, `running` after a change of leader | waits for its nodes, fails at the grace | `takeover` |
//! | `recovering` | one task: stop, re-plan, restore, relaunch | `recover` |
//!
//! The tick is level-triggered: it reads the state again and does what it calls for, so a new
//! leader (or a move that lost a race) simply runs it again. What is in memory here is
//! rebuilt or re-derived by a new leader: launches it sent (sent again), why queued jobs wait
//! (found again), notices (from their durable events), a recovery in flight (started again).
//! The rooms below it (`planning`, `agents`, `views`, `store`, `state`) never call up into it.

pub mod capabilities;
pub mod keep_going;
pub mod network;
pub mod notice;
pub mod queue;
pub mod reconcile;
pub mod recover;
mod scale;
pub mod takeover;

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::agents::launch::{self, LAUNCH_INTERVALS};
use crate::error::CoordinatorError;
use crate::job::spec::JobSpec;
use crate::job::JobState;
use crate::planning::restore_plan::Mode;
use crate::state::facts::Facts;
use crate::state::fleet::{Fleet, LEASE_INTERVALS};
use crate::state::signals::JobSignals;
use crate::store::{JobRecord, NodeRecord, NodeState, RecoveryCause, Store};
pub use capabilities::DataPlaneKey;

/// How long, in base intervals, a new leader waits for a launched job's agents to come back.
pub const GRACE_INTERVALS: u32 = 10;

/// The coordinator's recovery settings (flags).
#[derive(Debug, Clone)]
pub struct Settings {
    /// The object store's egress, shared by all nodes (MB/s): the restore planner's cloud rate.
    pub cloud_egress_mb_s: f64,
    pub mode: Mode,
    /// Signs the capabilities each `Restore` carries (`capabilities`); none: restores carry
    /// none, and the agents' data planes refuse their fetches from peers.
    pub data_plane_key: Option<DataPlaneKey>,
    /// The checkpoint cloud of a job whose `checkpoint:` names none (`--checkpoint-cloud`): a
    /// Slurm allocation's shared storage (docs/slurm.md), where a requeued job finds its steps.
    pub default_cloud: Option<String>,
}

impl Default for Settings {
    fn default() -> Settings {
        Settings { cloud_egress_mb_s: 1200.0, mode: Mode::Planned, data_plane_key: None, default_cloud: None }
    }
}

/// The leader's job controller: what the steps read, and the rooms that keep their own memory
/// of the work in flight (each room's type is in its file).
pub struct Life {
    pub store: Store,
    pub fleet: Arc<Fleet>,
    /// What agents told about their nodes and restores.
    pub facts: Arc<Facts>,
    pub settings: Settings,
    /// The queue's wake-up, the launches sent, the jobs just reported (`signals`).
    pub signals: Arc<JobSignals>,
    /// Why each queued job waits (`queue`).
    queue: queue::Waiting,
    /// Preemption notices in flight (`notice`).
    notices: notice::Memory,
    /// Recovery tasks, failed ranks, restore requests (`recover`).
    recoveries: recover::Recoveries,
    /// The live nodes each launch could use when first seen (`scale`).
    scale: scale::Memory,
    /// Per running launch: the link changes reported and a switch decided (`network`).
    network: network::Memory,
    /// Membership changes in progress and the epochs sent (`keep_going`).
    memberships: keep_going::Memberships,
}

impl Life {
    pub fn new(store: Store, fleet: Arc<Fleet>, facts: Arc<Facts>, signals: Arc<JobSignals>, settings: Settings) -> Arc<Life> {
        Arc::new(Life {
            store,
            fleet,
            facts,
            signals,
            settings,
            queue: queue::Waiting::default(),
            notices: notice::Memory::default(),
            recoveries: recover::Recoveries::default(),
            scale: scale::Memory::default(),
            network: network::Memory::default(),
            memberships: keep_going::Memberships::default(),
        })
    }

    /// A queued job's record with why it waits as its reason (a queued job has no other).
    pub fn annotate(&self, mut job: JobRecord) -> JobRecord {
        if matches!(job.state, JobState::Submitted | JobState::Planning) && job.reason.is_none() {
            job.reason = self.queue.why(job.id);
        }
        job
    }

    /// Move a launched job on from its ranks' states: all running -> running; all exited 0 ->
    /// succeeded; a failed rank -> `rank_failed`. An error (the database) is returned: the
    /// caller logs it, and the next look moves the job on.
    pub async fn progress(&self, id: i64) -> Result<(), CoordinatorError> {
        let store = &self.store;
        let job = store.job(id).await?;
        if job.state == JobState::Degraded {
            return self.progress_degraded(&job).await;
        }
        if !matches!(job.state, JobState::Launching | JobState::Running) {
            return Ok(());
        }
        // Counted by the database: a heartbeat of a 1,024-rank job does not read 1,024 rows.
        let ranks = store.rank_summary(id, job.generation).await?;
        if let Some(bad) = ranks.first_failed {
            let reason = if bad.lost {
                format!("rank {} on node {} was lost (its process ended without an exit code while its agent was away)", bad.rank, bad.node)
            } else {
                format!("rank {} on node {} exited with code {}", bad.rank, bad.node, bad.exit_code.unwrap_or(-1))
            };
            self.rank_failed(&job, &reason).await;
            return Ok(());
        }
        let started = ranks.started == ranks.total;
        if job.state == JobState::Launching && started {
            launch::move_job(store, id, job.generation, JobState::Running, None).await;
        }
        if started && ranks.exited == ranks.total && launch::move_job(store, id, job.generation, JobState::Succeeded, None).await {
            self.signals.kick_queue();
        }
        Ok(())
    }

    /// A degraded launch moves on from its members' ranks alone: a member that failed ends its
    /// replica too (or the job recovers whole), all members exited 0 -> succeeded.
    async fn progress_degraded(&self, job: &JobRecord) -> Result<(), CoordinatorError> {
        let Some(members) = self.degraded_members(job).await? else { return Ok(()) };
        if let Some(bad) = members.iter().find(|r| keep_going::failed(r)) {
            let (rank, node) = (bad.assignment.rank, &bad.assignment.node);
            let reason = match bad.exit_code {
                Some(code) if bad.state == "exited" => format!("rank {rank} on node {node} exited with code {code}"),
                _ => format!("rank {rank} on node {node} was lost (its process ended without an exit code while its agent was away)"),
            };
            self.rank_failed(job, &reason).await;
            return Ok(());
        }
        if members.iter().all(|r| r.state == "exited")
            && launch::move_job(&self.store, job.id, job.generation, JobState::Succeeded, None).await
        {
            self.forget_membership(job.id, job.generation);
            self.signals.kick_queue();
        }
        // Lost replicas that rejoined: whole again once their ranks run.
        self.whole_again(job, &members).await?;
        Ok(())
    }

    /// Recover launched job `job` if it checkpoints and has `cause`'s budget left: true if it is
    /// now `recovering` (by this call or another), false if the caller should fail it.
    pub async fn try_recover(&self, job: &JobRecord, cause: RecoveryCause, reason: &str) -> bool {
        let Ok(spec) = serde_json::from_str::<JobSpec>(&job.spec) else { return false };
        let budget = match cause {
            RecoveryCause::Preemption => spec.max_preemptions,
            RecoveryCause::Restart => spec.max_restarts,
            RecoveryCause::ScaleUp | RecoveryCause::Replan => 1, // spends nothing (see `scale`, `network`)
        };
        if spec.checkpoint.is_none() || budget == 0 {
            return false;
        }
        match self.store.begin_recovery(job.id, job.generation, cause, budget, reason).await {
            Ok(_) => {
                tracing::warn!(job = job.id, "recovering: {reason}");
                launch::stop_job(&self.store, &self.fleet, &self.signals, job.id, job.generation, reason).await;
                self.recoveries.kick();
                true
            }
            Err(e) => {
                tracing::info!(job = job.id, "no recovery: {e}");
                self.store.job(job.id).await.is_ok_and(|j| j.state == JobState::Recovering)
            }
        }
    }

    /// A rank of launched `job` failed. A node that vanishes makes its peers' collectives fail
    /// before its lease ends, so a job that could recover from a lost node waits one lease (the
    /// reconcile loop's `node_leaving` moves it first if a node of the launch is lost meanwhile);
    /// then the failure spends a restart, or fails the job. Called on every look at the job.
    async fn rank_failed(&self, job: &JobRecord, reason: &str) {
        // A job that keeps going loses the failed ranks' replicas at once: nothing is spent.
        if self.keep_going(job, keep_going::failed, reason).await {
            return;
        }
        let preemptible = serde_json::from_str::<JobSpec>(&job.spec).is_ok_and(|s| s.checkpoint.is_some() && s.max_preemptions > 0);
        let key = (job.id, job.generation);
        if preemptible {
            let first = self.recoveries.rank_failed_since(key);
            if first.elapsed() <= self.fleet.base * (LEASE_INTERVALS + 1) {
                return; // the next look decides
            }
        }
        self.recoveries.forget_failed_rank(key);
        if !self.try_recover(job, RecoveryCause::Restart, reason).await {
            launch::fail(&self.store, &self.fleet, &self.signals, job.id, job.generation, reason).await;
        }
    }

    /// A node is leaving (its lease ended, `lost`; or it is draining): every launched job with
    /// ranks there recovers if it can; a lost node's others fail, a draining node's keep running.
    /// A drain with a `deadline` asks each job to save first (`notice`) where it can.
    pub async fn node_leaving(&self, node: &str, reason: &str, lost: bool, deadline: Option<Duration>) {
        let jobs = match self.store.unfinished_jobs().await {
            Ok(j) => j,
            Err(e) => return tracing::warn!(node, "cannot read the jobs of a leaving node: {e}"),
        };
        for j in jobs.into_iter().filter(|j| j.state.is_launched()) {
            let on_node = if j.state == JobState::Degraded {
                self.member_on(&j, node).await
            } else {
                self.store.ranks(j.id, j.generation).await.is_ok_and(|r| r.iter().any(|r| r.assignment.node == node))
            };
            if !on_node {
                continue;
            }
            if lost && self.keep_going(&j, |r| r.assignment.node == node, reason).await {
                continue; // the replicas with nothing there keep going
            }
            // A degraded job's members save whole steps (docs/keep-going.md), so it takes a
            // notice as a running job does.
            if let Some(d) = deadline.filter(|_| !lost) {
                if self.give_notice(&j, node, d).await {
                    continue; // recovers once its ranks saved, or at the deadline (`notice`)
                }
            }
            if !self.try_recover(&j, RecoveryCause::Preemption, reason).await && lost {
                launch::fail(&self.store, &self.fleet, &self.signals, j.id, j.generation, reason).await;
            }
        }
        // A recovering job whose restore waits on this node re-plans (its task watches liveness).
        self.facts.nudge();
    }

    /// A launch was planned: remember how many nodes it could use then (`scale` compares).
    pub async fn note_launch(&self, id: i64, generation: i64) {
        let (Ok(job), Ok(nodes)) = (self.store.job(id).await, self.store.nodes().await) else { return };
        let Ok(spec) = serde_json::from_str::<JobSpec>(&job.spec) else { return };
        let live = usable_nodes(&nodes, &self.fleet, &spec);
        self.scale.lock().insert((id, generation), (live, None));
    }

    /// One look at a launched job: send its launch if it was not sent, fail it if it was never
    /// acknowledged within `LAUNCH_INTERVALS` of this leader seeing it, move it on from its
    /// ranks. `launching_since`: when this leader first saw it launching.
    async fn step(&self, job: &JobRecord, launching_since: Option<Instant>) -> Result<(), CoordinatorError> {
        let (store, fleet) = (&self.store, &self.fleet);
        match job.state {
            JobState::Launching => {
                let limit = fleet.base * LAUNCH_INTERVALS;
                if launching_since.is_some_and(|s| s.elapsed() > limit) {
                    let waiting: Vec<String> = store
                        .ranks(job.id, job.generation)
                        .await?
                        .into_iter()
                        .filter(|r| r.state == "assigned")
                        .map(|r| format!("{} (rank {})", r.assignment.node, r.assignment.rank))
                        .take(5)
                        .collect();
                    let reason =
                        format!("launch not acknowledged within {} ms; still waiting for {}", limit.as_millis(), waiting.join(", "));
                    launch::fail(store, fleet, &self.signals, job.id, job.generation, &reason).await;
                    return Ok(());
                }
                if !self.signals.was_sent(job.id, job.generation) {
                    launch::send_out(store, fleet, &self.signals, job.id, job.generation).await?;
                }
                self.progress(job.id).await
            }
            JobState::Running | JobState::Degraded => self.progress(job.id).await,
            // The queue's (`queue`), a recovery task's (`recover`), or over.
            _ => Ok(()),
        }
    }

    /// A node's lease ended: its launched jobs recover where they have budget, and fail otherwise.
    async fn node_lost(&self, node: &str) {
        let lease = self.fleet.base * LEASE_INTERVALS;
        let reason = format!("node {node} lost: no heartbeat for {} ms ({LEASE_INTERVALS} intervals)", lease.as_millis());
        tracing::warn!("{reason}");
        if let Err(e) = self.store.record_event(None, None, "node_lost", &reason).await {
            tracing::warn!("{e}");
        }
        self.node_leaving(node, &reason, true, None).await;
    }
}

/// Live, active nodes within the job's resources.
fn usable_nodes(nodes: &[NodeRecord], fleet: &Fleet, spec: &JobSpec) -> usize {
    let mine = |n: &str| spec.resources.nodes.is_empty() || spec.resources.nodes.iter().any(|m| m == n);
    nodes.iter().filter(|n| n.state == NodeState::Active && mine(&n.name) && fleet.live(&n.name)).count()
}
