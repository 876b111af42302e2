//! Agents over gRPC: registration, leases held by the heartbeat stream, launch and stop
//! instructions, and a job's progress from its ranks' reports. Leases live in memory (they are
//! rebuilt from heartbeats after a restart, see docs/state.md); everything else goes through
//! the store, fenced by agent epoch and job generation.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use motley_proto::v1::agent_server::Agent;
use motley_proto::v1::{instruction, AgentStatus, Drain, Instruction, Launch, RankLaunch, RegisterReply, RegisterRequest, Stop};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

use crate::control;
use crate::error::CoordinatorError;
use crate::job::JobState;
use crate::jobspec::JobSpec;
use crate::load::NodeLoad;
use crate::store::{RankReport, Store};

/// A lease expires after this many base intervals without a heartbeat.
pub const LEASE_INTERVALS: u32 = 3;

/// A launch not acknowledged (every rank running) within this many base intervals of this
/// leader seeing it fails: an instruction or an agent was lost on the way.
pub const LAUNCH_INTERVALS: u32 = 30;

struct Lease {
    epoch: i64,
    address: String,
    /// The agent's log service (empty: it serves none).
    logs_url: String,
    last_seen: Instant,
    tx: Option<mpsc::Sender<Result<Instruction, Status>>>,
    /// The load of its last interval heartbeat, and when it came.
    load: Option<(NodeLoad, Instant)>,
}

/// The live agents (in memory only).
pub struct Fleet {
    /// The base interval: agents heartbeat on it; every timeout derives from it.
    pub base: Duration,
    /// The first MASTER_PORT (see `master_port`).
    master_port_base: u16,
    leases: Mutex<HashMap<String, Lease>>,
    heartbeats: AtomicU64,
    launches: AtomicU64,
    /// Something the job queue waits on changed (a submit, a job's end).
    queue: tokio::sync::Notify,
    /// Why each queued job waits, as the job queue last saw it.
    waiting: Mutex<HashMap<i64, String>>,
}

impl Fleet {
    pub fn new(base: Duration, master_port_base: u16) -> Arc<Fleet> {
        Arc::new(Fleet {
            base,
            master_port_base,
            leases: Mutex::new(HashMap::new()),
            heartbeats: AtomicU64::new(0),
            launches: AtomicU64::new(0),
            queue: tokio::sync::Notify::new(),
            waiting: Mutex::default(),
        })
    }

    /// Have the job queue look again (a job was submitted or ended).
    pub fn kick_queue(&self) {
        self.queue.notify_one();
    }

    /// Resolves at the next `kick_queue` (or at once if one came since the last wait).
    pub async fn queue_changed(&self) {
        self.queue.notified().await
    }

    /// Record why a queued job waits (None: it no longer does); true if the reason changed.
    pub fn set_waiting(&self, job: i64, why: Option<String>) -> bool {
        let mut waiting = self.waiting.lock().expect("waiting lock");
        match why {
            Some(w) => waiting.insert(job, w.clone()).as_ref() != Some(&w),
            None => waiting.remove(&job).is_some(),
        }
    }

    /// Forget the waits of jobs no longer queued.
    pub fn keep_waiting(&self, queued: &[i64]) {
        self.waiting.lock().expect("waiting lock").retain(|id, _| queued.contains(id));
    }

    /// A queued job's record with why it waits as its reason (a queued job has no other).
    pub fn annotate(&self, mut job: crate::store::JobRecord) -> crate::store::JobRecord {
        if matches!(job.state, JobState::Submitted | JobState::Planning) && job.reason.is_none() {
            job.reason = self.waiting.lock().expect("waiting lock").get(&job.id).cloned();
        }
        job
    }

    /// Agents holding a lease now.
    pub fn live_count(&self) -> usize {
        let lease = self.base * LEASE_INTERVALS;
        self.leases.lock().expect("lease lock").values().filter(|l| l.tx.is_some() && l.last_seen.elapsed() <= lease).count()
    }

    /// Heartbeats received since start.
    pub fn heartbeat_count(&self) -> u64 {
        self.heartbeats.load(Ordering::Relaxed)
    }

    /// Launch instructions sent since start.
    pub fn launch_count(&self) -> u64 {
        self.launches.load(Ordering::Relaxed)
    }

    /// The node's agent holds a lease and its heartbeat stream is open (it can take a launch).
    pub fn live(&self, node: &str) -> bool {
        self.leases
            .lock()
            .expect("lease lock")
            .get(node)
            .is_some_and(|l| l.tx.is_some() && l.last_seen.elapsed() <= self.base * LEASE_INTERVALS)
    }

    /// The load the node's agent last reported, if it is live.
    pub fn load(&self, node: &str) -> Option<NodeLoad> {
        let leases = self.leases.lock().expect("lease lock");
        let lease = leases.get(node).filter(|l| l.last_seen.elapsed() <= self.base * LEASE_INTERVALS)?;
        lease.load.as_ref().map(|(l, at)| NodeLoad { age_ms: at.elapsed().as_millis() as u64, ..l.clone() })
    }

    /// Every live node's last load, by node name.
    pub fn loads(&self) -> Vec<(String, NodeLoad)> {
        let names: Vec<String> = self.leases.lock().expect("lease lock").keys().cloned().collect();
        let mut out: Vec<(String, NodeLoad)> = names.into_iter().filter_map(|n| self.load(&n).map(|l| (n, l))).collect();
        out.sort_by(|a, b| a.0.cmp(&b.0));
        out
    }

    /// Tell the node's agent whether it is draining (if its stream is open; it is told again
    /// when it next opens one).
    pub fn tell_drain(&self, node: &str, draining: bool) {
        self.send(node, Instruction { kind: Some(instruction::Kind::Drain(Drain { draining })) });
    }

    fn send(&self, node: &str, i: Instruction) -> bool {
        let tx = self.leases.lock().expect("lease lock").get(node).and_then(|l| l.tx.clone());
        tx.is_some_and(|tx| tx.try_send(Ok(i)).is_ok())
    }

    /// Where the node's agent serves rank logs, if it is live and serves them.
    pub fn logs_url(&self, node: &str) -> Option<String> {
        self.leases.lock().expect("lease lock").get(node).map(|l| l.logs_url.clone()).filter(|u| !u.is_empty())
    }

    fn address(&self, node: &str) -> Option<String> {
        self.leases.lock().expect("lease lock").get(node).map(|l| l.address.clone())
    }

    /// Tell every node of a launch to stop the job's ranks (its GPUs go back to the queue).
    pub async fn stop_job(&self, store: &Store, job: i64, generation: i64, reason: &str) {
        self.kick_queue();
        let Ok(ranks) = store.ranks(job, generation).await else { return };
        let mut nodes: Vec<String> = ranks.into_iter().map(|r| r.assignment.node).collect();
        nodes.sort();
        nodes.dedup();
        for n in nodes {
            self.send(&n, Instruction { kind: Some(instruction::Kind::Stop(Stop { job, generation, reason: reason.to_string() })) });
        }
    }
}

pub struct AgentService {
    pub store: Store,
    pub fleet: Arc<Fleet>,
    pub token: Option<String>,
    /// Only the leader takes agents; a standby names the leader.
    pub role: Arc<crate::leader::Role>,
}

impl AgentService {
    fn check_token(&self, given: Option<&str>) -> Result<(), Status> {
        match &self.token {
            Some(t) if given != Some(t.as_str()) => {
                Err(Status::unauthenticated("wrong or missing agent token; pass --token or MOTLEY_TOKEN"))
            }
            _ => Ok(()),
        }
    }
}

#[tonic::async_trait]
impl Agent for AgentService {
    async fn register(&self, req: Request<RegisterRequest>) -> Result<Response<RegisterReply>, Status> {
        let r = req.into_inner();
        self.check_token(Some(&r.token))?;
        if !self.role.is_leader() {
            return Err(crate::grpc::status_of(self.role.not_leader()));
        }
        let epoch = control::declare_node(&self.store, &r.node, &r.inventory_json).await.map_err(crate::grpc::status_of)?;
        let address = if r.address.is_empty() { "127.0.0.1".to_string() } else { r.address };
        self.fleet
            .leases
            .lock()
            .expect("lease lock")
            .insert(r.node.clone(), Lease { epoch, address, logs_url: r.logs_url, last_seen: Instant::now(), tx: None, load: None });
        Ok(Response::new(RegisterReply { epoch, heartbeat_ms: self.fleet.base.as_millis() as u64 }))
    }

    type HeartbeatStream = ReceiverStream<Result<Instruction, Status>>;

    async fn heartbeat(&self, req: Request<Streaming<AgentStatus>>) -> Result<Response<Self::HeartbeatStream>, Status> {
        let token =
            req.metadata().get("authorization").and_then(|v| v.to_str().ok()).and_then(|v| v.strip_prefix("Bearer ")).map(str::to_string);
        self.check_token(token.as_deref())?;
        let mut inbound = req.into_inner();
        let (tx, rx) = mpsc::channel(64);
        let (store, fleet) = (self.store.clone(), self.fleet.clone());
        tokio::spawn(async move {
            // The stream belongs to the node and epoch of its first message.
            let mut session: Option<(String, i64)> = None;
            while let Ok(Some(status)) = inbound.message().await {
                if session.as_ref().is_some_and(|(n, e)| *n != status.node || *e != status.epoch) {
                    let _ = tx.send(Err(Status::invalid_argument("a heartbeat stream carries one node and one epoch"))).await;
                    return;
                }
                // The lease first, from memory: a slow database must not cost a live node its lease.
                let refused: Option<Status> = {
                    let mut leases = fleet.leases.lock().expect("lease lock");
                    match leases.get_mut(&status.node) {
                        Some(lease) if lease.epoch == status.epoch => {
                            lease.last_seen = Instant::now();
                            // Interval heartbeats (they carry the load), not the rank reports
                            // an agent sends between them.
                            if status.load.is_some() || status.ranks.is_empty() {
                                fleet.heartbeats.fetch_add(1, Ordering::Relaxed);
                            }
                            lease.tx = Some(tx.clone());
                            if let Some(load) = status.load.clone() {
                                lease.load = Some((load.into(), lease.last_seen));
                            }
                            None
                        }
                        Some(lease) => Some(crate::grpc::status_of(CoordinatorError::StaleAgent {
                            node: status.node.clone(),
                            given: status.epoch,
                            current: lease.epoch,
                        })),
                        None => Some(Status::failed_precondition("the lease expired (or the coordinator restarted); register again")),
                    }
                };
                if let Some(refusal) = refused {
                    let _ = tx.send(Err(refusal)).await;
                    return;
                }
                if session.is_none() {
                    // The durable check too: an agent session older than the node's latest one.
                    if let Err(e) = store.check_agent(&status.node, status.epoch).await {
                        let _ = tx.send(Err(crate::grpc::status_of(e))).await;
                        return;
                    }
                    session = Some((status.node.clone(), status.epoch));
                    // A new session learns the node's drain state (it may have changed while
                    // the agent was away).
                    if store.node(&status.node).await.is_ok_and(|n| n.state == crate::store::NodeState::Draining) {
                        let _ = tx.try_send(Ok(Instruction { kind: Some(instruction::Kind::Drain(Drain { draining: true })) }));
                    }
                }
                if status.ranks.is_empty() {
                    continue;
                }
                // The heartbeat's reports as one unit (group-committed with other agents'); those of
                // an older launch change nothing.
                let reports: Vec<RankReport> = status
                    .ranks
                    .iter()
                    .map(|r| RankReport {
                        job: r.job,
                        generation: r.generation,
                        rank: r.rank,
                        state: r.state.clone(),
                        exit_code: r.exit_code,
                    })
                    .collect();
                match store.report_ranks_from(Some((&status.node, status.epoch)), reports).await {
                    Ok(done) => {
                        for j in done.jobs {
                            progress(&store, &fleet, j).await;
                            // Ranks still running for a job that is over (failed or cancelled
                            // while their agent was away): stop them, or they hold the GPUs.
                            let running = status.ranks.iter().any(|r| r.job == j && r.state == "running");
                            if running && store.job(j).await.is_ok_and(|job| job.state.is_terminal()) {
                                let stop = Stop { job: j, generation: i64::MAX, reason: "the job is over".into() };
                                let _ = tx.try_send(Ok(Instruction { kind: Some(instruction::Kind::Stop(stop)) }));
                            }
                        }
                        // Ranks of a superseded launch: stop that launch's ranks on this node.
                        for (job, given, _) in done.stale {
                            let stop = Stop { job, generation: given, reason: "a newer generation of the job was launched".into() };
                            let _ = tx.try_send(Ok(Instruction { kind: Some(instruction::Kind::Stop(stop)) }));
                        }
                    }
                    Err(CoordinatorError::StaleAgent { .. }) => {
                        let _ = tx.send(Err(Status::aborted("this agent session is stale; register again"))).await;
                        return;
                    }
                    // Close the stream: the agent reconnects and reports everything again.
                    Err(e) => {
                        tracing::warn!(node = %status.node, "rank report: {e}");
                        let _ = tx.send(Err(Status::unavailable(e.to_string()))).await;
                        return;
                    }
                }
            }
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}

/// Move a launched job on from its ranks' states: all running -> running; all exited 0 ->
/// succeeded; any non-zero exit -> failed (and the other ranks stopped).
pub async fn progress(store: &Store, fleet: &Fleet, id: i64) {
    let Ok(job) = store.job(id).await else { return };
    if !matches!(job.state, JobState::Launching | JobState::Running) {
        return;
    }
    // Counted by the database: a heartbeat of a 1,024-rank job does not read 1,024 rows.
    let Ok(ranks) = store.rank_summary(id, job.generation).await else { return };
    if let Some(bad) = ranks.first_failed {
        let reason = if bad.lost {
            format!("rank {} on node {} was lost (its process ended without an exit code while its agent was away)", bad.rank, bad.node)
        } else {
            format!("rank {} on node {} exited with code {}", bad.rank, bad.node, bad.exit_code.unwrap_or(-1))
        };
        if store.transition_at(id, Some(job.generation), JobState::Failed, Some(&reason)).await.is_ok() {
            fleet.stop_job(store, id, job.generation, &reason).await;
        }
        return;
    }
    let started = ranks.started == ranks.total;
    if job.state == JobState::Launching && started {
        let _ = store.transition_at(id, Some(job.generation), JobState::Running, None).await;
    }
    if started && ranks.exited == ranks.total && store.transition_at(id, Some(job.generation), JobState::Succeeded, None).await.is_ok() {
        fleet.kick_queue();
    }
}

/// Send a launched job's ranks to their agents; a node without a live agent fails the job.
#[tracing::instrument(skip(store, fleet))]
pub async fn dispatch(store: &Store, fleet: &Fleet, id: i64) -> Result<(), CoordinatorError> {
    let job = store.job(id).await?;
    if job.state != JobState::Launching {
        return Ok(());
    }
    let spec: JobSpec = serde_json::from_str(&job.spec).map_err(|e| CoordinatorError::Conflict(format!("stored job spec: {e}")))?;
    let plan = store.plan(id, job.generation).await?;
    let ranks = store.ranks(id, job.generation).await?;
    let world = ranks.len() as i64;
    let Some(first) = ranks.first() else { return Ok(()) };
    let master_addr = fleet.address(&first.assignment.node).unwrap_or_else(|| "127.0.0.1".into());
    let master_port = master_port(fleet.master_port_base, id, job.generation);
    let plan_doc: serde_json::Value = serde_json::from_str(&plan).unwrap_or_default();
    let mut by_node: HashMap<String, Vec<RankLaunch>> = HashMap::new();
    for r in &ranks {
        let place = placement(&plan_doc, &r.assignment);
        by_node.entry(r.assignment.node.clone()).or_default().push(RankLaunch {
            rank: r.assignment.rank,
            local_rank: r.assignment.local_rank,
            local_world_size: 0,
            gpu: r.assignment.gpu,
            replica: r.assignment.replica,
            stage: r.assignment.stage,
            layer_start: r.assignment.layer_start,
            layer_end: r.assignment.layer_end,
            tp_rank: place.tp_rank,
            tp_size: place.tp_size,
            stage_dp_rank: place.stage_dp_rank,
            stage_dp_size: place.stage_dp_size,
            pp_size: place.pp_size,
            replicas: place.replicas,
        });
    }
    for (node, mut list) in by_node {
        let n = list.len() as i64;
        for r in &mut list {
            r.local_world_size = n;
        }
        let launch = Launch {
            job: id,
            generation: job.generation,
            run: spec.run.clone(),
            envs: spec.envs.clone().into_iter().collect(),
            plan_json: plan.clone(),
            master_addr: master_addr.clone(),
            master_port,
            world_size: world,
            ranks: list,
        };
        fleet.launches.fetch_add(1, Ordering::Relaxed);
        if !fleet.send(&node, Instruction { kind: Some(instruction::Kind::Launch(launch)) }) {
            let reason = format!("node {node} has no live agent to launch on");
            store.transition(id, JobState::Failed, Some(&reason)).await?;
            fleet.stop_job(store, id, job.generation, &reason).await;
            return Ok(());
        }
    }
    Ok(())
}

/// Where a launch's ranks meet: one of 1,024 ports from the base, by job (jobs whose ids differ
/// by less than 512 never share one, even when their rank 0s share a host) and by generation's
/// parity (a relaunch never meets the rendezvous of the launch before it, whose ranks may still
/// be stopping).
fn master_port(base: u16, job: i64, generation: i64) -> u32 {
    u32::from(base) + (job.rem_euclid(512) as u32) * 2 + generation.rem_euclid(2) as u32
}

/// Where a rank sits in the plan's parallelism.
#[derive(Debug, Default, PartialEq)]
struct Placement {
    tp_rank: i64,
    tp_size: i64,
    stage_dp_rank: i64,
    stage_dp_size: i64,
    pp_size: i64,
    replicas: i64,
}

/// A stage's GPUs are listed TP group by TP group (dp-major): the rank's position in that list
/// gives its TP rank (fastest) and its data-parallel rank inside the stage.
fn placement(plan: &serde_json::Value, a: &crate::store::RankAssignment) -> Placement {
    let replicas = plan["replicas"].as_array().map_or(0, Vec::len) as i64;
    let replica = &plan["replicas"][a.replica as usize];
    let stage = &replica["stages"][a.stage as usize];
    let tp = stage["tp"].as_i64().unwrap_or(1).max(1);
    let position = stage["gpus"]
        .as_array()
        .and_then(|g| g.iter().position(|g| g["node"] == a.node.as_str() && g["index"].as_i64() == Some(a.gpu)))
        .unwrap_or(0) as i64;
    Placement {
        tp_rank: position % tp,
        tp_size: tp,
        stage_dp_rank: position / tp,
        stage_dp_size: stage["dp"].as_i64().unwrap_or(1),
        pp_size: replica["stages"].as_array().map_or(0, Vec::len) as i64,
        replicas,
    }
}

/// Fail launches this leader has seen stuck in `launching` for `LAUNCH_INTERVALS`.
async fn fail_stuck_launches(store: &Store, fleet: &Fleet, seen: &mut HashMap<(i64, i64), Instant>) {
    let Ok(jobs) = store.unfinished_jobs().await else { return };
    let now: Vec<(i64, i64)> = jobs.iter().filter(|j| j.state == JobState::Launching).map(|j| (j.id, j.generation)).collect();
    seen.retain(|k, _| now.contains(k));
    let limit = fleet.base * LAUNCH_INTERVALS;
    for key in now {
        let since = *seen.entry(key).or_insert_with(Instant::now);
        if since.elapsed() <= limit {
            continue;
        }
        let (id, generation) = key;
        let waiting: Vec<String> = match store.ranks(id, generation).await {
            Ok(r) => r
                .into_iter()
                .filter(|r| r.state == "assigned")
                .map(|r| format!("{} (rank {})", r.assignment.node, r.assignment.rank))
                .take(5)
                .collect(),
            Err(_) => continue,
        };
        let reason = format!("launch not acknowledged within {} ms; still waiting for {}", limit.as_millis(), waiting.join(", "));
        if store.transition_at(id, Some(generation), JobState::Failed, Some(&reason)).await.is_ok() {
            fleet.stop_job(store, id, generation, &reason).await;
        }
    }
}

/// Every base interval: expire leases older than `LEASE_INTERVALS` intervals, and fail the
/// live jobs that have ranks on those nodes, with the reason; fail launches stuck for
/// `LAUNCH_INTERVALS`.
pub async fn watch_leases(store: Store, fleet: Arc<Fleet>) {
    let mut tick = tokio::time::interval(fleet.base);
    // When this leader first saw each (job, generation) launching: a takeover starts the clock
    // afresh rather than trusting another process's timestamps.
    let mut launching: HashMap<(i64, i64), Instant> = HashMap::new();
    loop {
        tick.tick().await;
        fail_stuck_launches(&store, &fleet, &mut launching).await;
        let expired: Vec<String> = {
            let mut leases = fleet.leases.lock().expect("lease lock");
            let dead: Vec<String> =
                leases.iter().filter(|(_, l)| l.last_seen.elapsed() > fleet.base * LEASE_INTERVALS).map(|(n, _)| n.clone()).collect();
            for n in &dead {
                leases.remove(n);
            }
            dead
        };
        for node in expired {
            let reason = format!(
                "node {node} lost: no heartbeat for {} ms ({LEASE_INTERVALS} intervals)",
                (fleet.base * LEASE_INTERVALS).as_millis()
            );
            tracing::warn!("{reason}");
            let _ = store.record_event(None, None, "node_lost", &reason).await;
            let Ok(jobs) = store.unfinished_jobs().await else { continue };
            for j in jobs.into_iter().filter(|j| matches!(j.state, JobState::Launching | JobState::Running)) {
                let on_node = store.ranks(j.id, j.generation).await.is_ok_and(|r| r.iter().any(|r| r.assignment.node == node));
                if on_node && store.transition_at(j.id, Some(j.generation), JobState::Failed, Some(&reason)).await.is_ok() {
                    fleet.stop_job(&store, j.id, j.generation, &reason).await;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn master_ports_differ_by_job_and_by_generation() {
        assert_eq!(master_port(29500, 1, 1), 29503);
        assert_eq!(master_port(29500, 1, 2), 29502, "a relaunch moves to the next port");
        let mut seen = std::collections::HashSet::new();
        for job in 1000..1512 {
            for generation in [7, 8] {
                let p = master_port(29500, job, generation);
                assert!((29500..29500 + 1024).contains(&p));
                assert!(seen.insert(p), "job {job} generation {generation} reuses port {p}");
            }
        }
    }

    #[test]
    fn placement_reads_tp_and_stage_dp_ranks_from_the_plan() {
        let plan = serde_json::json!({"replicas": [{"stages": [
            {"tp": 2, "dp": 2, "gpus": [{"node": "a", "index": 0}, {"node": "a", "index": 1}, {"node": "a", "index": 2}, {"node": "a", "index": 3}]},
            {"tp": 1, "dp": 1, "gpus": [{"node": "b", "index": 0}]}
        ]}]});
        let a = crate::store::RankAssignment {
            rank: 2,
            node: "a".into(),
            local_rank: 2,
            gpu: 3,
            replica: 0,
            stage: 0,
            layer_start: 0,
            layer_end: 4,
        };
        let p = placement(&plan, &a);
        assert_eq!(p, Placement { tp_rank: 1, tp_size: 2, stage_dp_rank: 1, stage_dp_size: 2, pp_size: 2, replicas: 1 });
    }
}
