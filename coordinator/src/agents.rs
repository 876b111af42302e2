//! Agents over gRPC: registration, leases held by the heartbeat stream, launch and stop
//! instructions, and a job's progress from its ranks' reports. Leases live in memory (they are
//! rebuilt from heartbeats after a restart, see docs/state.md); everything else goes through
//! the store, fenced by agent epoch and job generation.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use motley_proto::v1::agent_server::Agent;
use motley_proto::v1::{instruction, AgentStatus, Instruction, Launch, RankLaunch, RegisterReply, RegisterRequest, Stop};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

use crate::control;
use crate::error::CoordinatorError;
use crate::job::JobState;
use crate::jobspec::JobSpec;
use crate::store::Store;

/// A lease expires after this many base intervals without a heartbeat.
pub const LEASE_INTERVALS: u32 = 3;

struct Lease {
    epoch: i64,
    address: String,
    last_seen: Instant,
    tx: Option<mpsc::Sender<Result<Instruction, Status>>>,
}

/// The live agents (in memory only).
pub struct Fleet {
    /// The base interval: agents heartbeat on it; every timeout derives from it.
    pub base: Duration,
    leases: Mutex<HashMap<String, Lease>>,
}

impl Fleet {
    pub fn new(base: Duration) -> Arc<Fleet> {
        Arc::new(Fleet { base, leases: Mutex::new(HashMap::new()) })
    }

    /// The node's agent holds a lease and its heartbeat stream is open (it can take a launch).
    pub fn live(&self, node: &str) -> bool {
        self.leases
            .lock()
            .expect("lease lock")
            .get(node)
            .is_some_and(|l| l.tx.is_some() && l.last_seen.elapsed() <= self.base * LEASE_INTERVALS)
    }

    fn send(&self, node: &str, i: Instruction) -> bool {
        let tx = self.leases.lock().expect("lease lock").get(node).and_then(|l| l.tx.clone());
        tx.is_some_and(|tx| tx.try_send(Ok(i)).is_ok())
    }

    fn address(&self, node: &str) -> Option<String> {
        self.leases.lock().expect("lease lock").get(node).map(|l| l.address.clone())
    }

    /// Tell every node of a launch to stop the job's ranks.
    pub async fn stop_job(&self, store: &Store, job: i64, generation: i64, reason: &str) {
        let Ok(ranks) = store.ranks(job, generation).await else { return };
        let mut nodes: Vec<String> = ranks.into_iter().map(|r| r.assignment.node).collect();
        nodes.sort();
        nodes.dedup();
        for n in nodes {
            self.send(&n, Instruction { kind: Some(instruction::Kind::Stop(Stop { job, generation, reason: reason.to_string() })) });
        }
    }
}

pub fn to_status(e: CoordinatorError) -> Status {
    Status::new(tonic::Code::from(e.grpc_code()), e.to_string())
}

pub struct AgentService {
    pub store: Store,
    pub fleet: Arc<Fleet>,
    pub token: Option<String>,
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
        let epoch = control::declare_node(&self.store, &r.node, &r.inventory_json).await.map_err(to_status)?;
        let address = if r.address.is_empty() { "127.0.0.1".to_string() } else { r.address };
        self.fleet.leases.lock().expect("lease lock").insert(r.node.clone(), Lease { epoch, address, last_seen: Instant::now(), tx: None });
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
                            lease.tx = Some(tx.clone());
                            None
                        }
                        Some(lease) => Some(to_status(CoordinatorError::StaleAgent {
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
                        let _ = tx.send(Err(to_status(e))).await;
                        return;
                    }
                    session = Some((status.node.clone(), status.epoch));
                }
                let mut jobs = vec![];
                for r in &status.ranks {
                    match store
                        .report_rank_from(Some((&status.node, status.epoch)), r.job, r.generation, r.rank, &r.state, r.exit_code)
                        .await
                    {
                        Ok(()) => jobs.push(r.job),
                        // Reports of an older launch change nothing.
                        Err(CoordinatorError::StaleGeneration { .. }) => {}
                        Err(CoordinatorError::StaleAgent { .. }) => {
                            let _ = tx.send(Err(Status::aborted("this agent session is stale; register again"))).await;
                            return;
                        }
                        // Close the stream: the agent reconnects and reports everything again.
                        Err(e) => {
                            eprintln!("motley-coordinator: rank report from {}: {e}", status.node);
                            let _ = tx.send(Err(Status::unavailable(e.to_string()))).await;
                            return;
                        }
                    }
                }
                jobs.sort();
                jobs.dedup();
                for j in jobs {
                    progress(&store, &fleet, j).await;
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
    let Ok(ranks) = store.ranks(id, job.generation).await else { return };
    if let Some(bad) = ranks.iter().find(|r| r.state == "exited" && r.exit_code != Some(0)) {
        let reason =
            format!("rank {} on node {} exited with code {}", bad.assignment.rank, bad.assignment.node, bad.exit_code.unwrap_or(-1));
        if store.transition_at(id, Some(job.generation), JobState::Failed, Some(&reason)).await.is_ok() {
            fleet.stop_job(store, id, job.generation, &reason).await;
        }
        return;
    }
    let started = ranks.iter().all(|r| r.state == "running" || r.state == "exited");
    if job.state == JobState::Launching && started {
        let _ = store.transition_at(id, Some(job.generation), JobState::Running, None).await;
    }
    if started && ranks.iter().all(|r| r.state == "exited") {
        let _ = store.transition_at(id, Some(job.generation), JobState::Succeeded, None).await;
    }
}

/// Send a launched job's ranks to their agents; a node without a live agent fails the job.
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
    // A port per launch, so a relaunch never meets the old rendezvous.
    let master_port = 20000 + ((id * 131 + job.generation * 17) % 20000) as u32;
    let mut by_node: HashMap<String, Vec<RankLaunch>> = HashMap::new();
    for r in &ranks {
        by_node.entry(r.assignment.node.clone()).or_default().push(RankLaunch {
            rank: r.assignment.rank,
            local_rank: r.assignment.local_rank,
            local_world_size: 0,
            gpu: r.assignment.gpu,
            replica: r.assignment.replica,
            stage: r.assignment.stage,
            layer_start: r.assignment.layer_start,
            layer_end: r.assignment.layer_end,
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
        if !fleet.send(&node, Instruction { kind: Some(instruction::Kind::Launch(launch)) }) {
            let reason = format!("node {node} has no live agent to launch on");
            store.transition(id, JobState::Failed, Some(&reason)).await?;
            fleet.stop_job(store, id, job.generation, &reason).await;
            return Ok(());
        }
    }
    Ok(())
}

/// Every base interval: expire leases older than `LEASE_INTERVALS` intervals, and fail the
/// live jobs that have ranks on those nodes, with the reason.
pub async fn watch_leases(store: Store, fleet: Arc<Fleet>) {
    let mut tick = tokio::time::interval(fleet.base);
    loop {
        tick.tick().await;
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
            eprintln!("motley-coordinator: {reason}");
            let _ = store.record_event(None, None, "node_lost", &reason).await;
            let Ok(jobs) = store.jobs().await else { continue };
            for j in jobs.into_iter().filter(|j| matches!(j.state, JobState::Launching | JobState::Running)) {
                let on_node = store.ranks(j.id, j.generation).await.is_ok_and(|r| r.iter().any(|r| r.assignment.node == node));
                if on_node && store.transition_at(j.id, Some(j.generation), JobState::Failed, Some(&reason)).await.is_ok() {
                    fleet.stop_job(&store, j.id, j.generation, &reason).await;
                }
            }
        }
    }
}
