//! The agents' gRPC service (`motley.v1.Agent`): translates registrations and heartbeat streams
//! into calls on the fleet (leases, outboxes) and, for what a message reports (ranks, holdings,
//! profile runs, restores), into a `reports::NodeReport` that `reports` applies, sending back the
//! stops it returns; and their errors into statuses. It knows nothing of a job's life: the jobs whose ranks reported are
//! handed to it through the job signals (`JobSignals::reported`).
//!
//! One heartbeat stream is one agent session. Its reader never waits on the database: it
//! renews the lease on receipt and acknowledges every `BARE_ACK_EVERY`th bare heartbeat at
//! once (a bare heartbeat reports nothing; its ack only renews the ranks' dead-man lease, which
//! runs 30 intervals, see agent/src/ranks/lease.rs); messages with rank
//! reports (and a session's first message) go to the session's worker, which commits them in
//! order, hands their jobs to the job's life, and acknowledges each once committed. A slow commit delays acks,
//! never the lease.

use std::sync::Arc;

use motley_proto::v1::agent_server::Agent;
use motley_proto::v1::{instruction, Ack, AgentStatus, Drain, Instruction, RegisterReply, RegisterRequest, Stop};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

use crate::agents::reports::NodeReport;
use crate::api::control;
use crate::error::CoordinatorError;
use crate::service::{status_of, Tokens};
use crate::state::fleet::{Fleet, Outbound, Refused};
use crate::state::signals::JobSignals;
use crate::store::{Holding, NodeState, RankReport, Store};

pub struct AgentService {
    pub store: Store,
    pub fleet: Arc<Fleet>,
    /// Where what agents tell of their nodes and restores goes (`facts`), read by the job's life.
    pub facts: Arc<crate::state::facts::Facts>,
    /// Tells the job's life which jobs were reported, and when to send launches again.
    pub signals: Arc<JobSignals>,
    pub tokens: Tokens,
    /// Only the leader takes agents; a standby names the leader.
    pub role: Arc<crate::server::leader::Role>,
    /// Each agent gets the key derived from it for its node at registration, and checks peers'
    /// capabilities with that.
    pub data_plane_key: crate::life::DataPlaneKey,
}

#[tonic::async_trait]
impl Agent for AgentService {
    async fn register(&self, req: Request<RegisterRequest>) -> Result<Response<RegisterReply>, Status> {
        let r = req.into_inner();
        self.tokens.check_agent(Some(&r.token)).map_err(status_of)?;
        if !self.role.is_leader() {
            return Err(status_of(self.role.not_leader()));
        }
        if let Some(address) = self.fleet.held_by_live_agent(&r.node) {
            return Err(Status::already_exists(format!(
                "node {} is held by another live agent (at {address}); stop that agent, or start this one with another --node",
                r.node
            )));
        }
        let epoch = control::declare_node(&self.store, &r.node, &r.inventory_json).await.map_err(status_of)?;
        let address = if r.address.is_empty() { "127.0.0.1".to_string() } else { r.address };
        self.fleet.register(&r.node, epoch, address, r.logs_url);
        self.fleet.set_can_profile(&r.node, epoch, r.can_profile);
        self.fleet.set_data_url(&r.node, epoch, &r.data_url);
        let rates = r.ckpt_rates.unwrap_or_default();
        // The node's RDMA domain (its inventory's), when its agent has a device to READ with.
        let domain = (!r.rdma_device.is_empty())
            .then(|| serde_json::from_str::<motley_solver::hardware::NodeSpec>(&r.inventory_json).ok())
            .flatten()
            .map(|n| n.rdma_domain.unwrap_or_else(|| "default".into()));
        self.facts.set_node(
            &r.node,
            crate::planning::restore_plan::NodeInfo {
                data_url: r.data_url,
                rdma_domain: domain,
                disk_read_mb_s: rates.disk_read_mb_s,
                nic_mb_s: rates.nic_mb_s,
                mem_copy_mb_s: rates.mem_copy_mb_s,
            },
        );
        // The node's own key only (docs/recovery.md, "Who may fetch"): it signs for no other
        // node's files, and the cluster key never leaves the coordinators.
        let node_key = self.data_plane_key.for_node(&r.node).map_err(status_of)?;
        let probe_key = self.data_plane_key.for_probes().map_err(status_of)?;
        Ok(Response::new(RegisterReply {
            epoch,
            heartbeat_ms: self.fleet.base.as_millis() as u64,
            data_plane_key: node_key.to_vec(),
            probe_key: probe_key.to_vec(),
        }))
    }

    type HeartbeatStream = ReceiverStream<Result<Instruction, Status>>;

    async fn heartbeat(&self, req: Request<Streaming<AgentStatus>>) -> Result<Response<Self::HeartbeatStream>, Status> {
        let token = req.metadata().get("authorization").and_then(|v| v.to_str().ok()).and_then(crate::service::bearer);
        self.tokens.check_agent(token).map_err(status_of)?;
        let inbound = req.into_inner();
        let (outbox, out) = mpsc::unbounded_channel::<Outbound>();
        let (to_worker, work) = mpsc::unbounded_channel::<AgentStatus>();
        let (tx, rx) = mpsc::channel(64);
        tokio::spawn(forward(out, tx));
        tokio::spawn(read(inbound, self.fleet.clone(), self.facts.clone(), outbox.clone(), to_worker));
        tokio::spawn(work_on(work, self.store.clone(), self.facts.clone(), self.signals.clone(), outbox));
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}

/// The outbox down the response stream; a refusal ends it.
async fn forward(mut out: mpsc::UnboundedReceiver<Outbound>, tx: mpsc::Sender<Result<Instruction, Status>>) {
    while let Some(o) = out.recv().await {
        match o {
            Outbound::Instruction(i) => {
                if tx.send(Ok(i)).await.is_err() {
                    return;
                }
            }
            Outbound::Refuse(e) => {
                let _ = tx.send(Err(refusal(e))).await;
                return;
            }
        }
    }
}

fn refusal(e: CoordinatorError) -> Status {
    match e {
        CoordinatorError::StaleAgent { .. } => Status::aborted(format!("this agent session is stale ({e}); register again")),
        e => status_of(e),
    }
}

/// Bare heartbeats acknowledged: one in this many (by its number in the session). An ack per
/// heartbeat cost the coordinator a message down per agent per interval, half again the CPU of
/// a 2,000-agent fleet (BENCHMARKS.md); the agents' lease, renewed by any ack, lasts 30.
pub const BARE_ACK_EVERY: u64 = 5;

fn ack(seq: u64) -> Outbound {
    Outbound::Instruction(Instruction { kind: Some(instruction::Kind::Ack(Ack { seq })) })
}

/// The session's reader: one node and one epoch (those of its first message); leases renewed on
/// receipt; reports handed to the worker.
async fn read(
    mut inbound: Streaming<AgentStatus>,
    fleet: Arc<Fleet>,
    facts: Arc<crate::state::facts::Facts>,
    outbox: mpsc::UnboundedSender<Outbound>,
    to_worker: mpsc::UnboundedSender<AgentStatus>,
) {
    let mut session: Option<(String, i64)> = None;
    while let Ok(Some(status)) = inbound.message().await {
        if session.as_ref().is_some_and(|(n, e)| *n != status.node || *e != status.epoch) {
            let _ =
                outbox.send(Outbound::Refuse(CoordinatorError::invalid("heartbeat", "a heartbeat stream carries one node and one epoch")));
            break;
        }
        // Interval heartbeats (they carry the load), not the rank reports an agent sends between them.
        let interval = status.load.is_some() || (status.ranks.is_empty() && status.profiles.is_empty());
        match fleet.renew(&status.node, status.epoch, &outbox, status.load.clone().map(crate::state::load::from_proto), interval) {
            Ok(()) => {}
            Err(Refused::Stale { current }) => {
                let e = CoordinatorError::StaleAgent { node: status.node.clone(), given: status.epoch, current };
                let _ = outbox.send(Outbound::Refuse(e));
                break;
            }
            Err(Refused::NoLease) => {
                let e = CoordinatorError::Conflict("the lease expired (or the coordinator restarted); register again".into());
                let _ = outbox.send(Outbound::Refuse(e));
                break;
            }
        }
        let first = session.is_none();
        session.get_or_insert_with(|| (status.node.clone(), status.epoch));
        // Link measurements go to the in-memory matrix here, on receipt (no database).
        measured(&fleet, &facts, &status);
        if first
            || status.full
            || !status.ranks.is_empty()
            || !status.profiles.is_empty()
            || status.holdings_sent
            || !status.restores.is_empty()
        {
            if to_worker.send(status).is_err() {
                break; // the worker refused the session
            }
        } else if status.seq > 0 && status.seq.is_multiple_of(BARE_ACK_EVERY) {
            let _ = outbox.send(ack(status.seq));
        }
    }
    if let Some((node, epoch)) = session {
        fleet.closed(&node, epoch);
    }
}

/// Link samples and NIC rates one message carries, at most: a report above this is cut.
pub const MAX_LINKS_PER_MESSAGE: usize = 1024;
pub const MAX_NICS_PER_MESSAGE: usize = 256;
/// A NIC name longer than this is nonsense, dropped.
const MAX_NAME: usize = 64;

/// A NIC name an agent reported: short, printable, no spaces (kinds are `ib`, `roce`, `eth`).
fn sane_name(x: &str) -> bool {
    !x.is_empty() && x.len() <= MAX_NAME && x.bytes().all(|b| b.is_ascii_graphic())
}

/// The agent's clock, but never ahead of ours (a sample from the future would stay the newest
/// for as long as the agent's clock is ahead); no time at all is now.
fn at_or_now(at_unix_ms: i64, now: i64) -> i64 {
    if at_unix_ms <= 0 || at_unix_ms > now {
        now
    } else {
        at_unix_ms
    }
}

/// A message's link samples and NIC rates into the link matrix (`Fleet::links`). A sample to a
/// peer that never registered with this leader (so has no data plane to probe), a node paired
/// with itself, a kind or name that is not a short token, a rate that is not a number: dropped.
fn measured(fleet: &Fleet, facts: &crate::state::facts::Facts, status: &AgentStatus) {
    if status.links.is_empty() && status.nics.is_empty() {
        return;
    }
    let now = crate::store::now_ms();
    let mut dropped = 0usize;
    for l in status.links.iter().take(MAX_LINKS_PER_MESSAGE) {
        let known = l.peer != status.node && facts.node(&l.peer).is_some();
        let numbers = l.gb_per_s.is_finite() && l.gb_per_s > 0.0 && l.latency_ms.is_finite() && l.latency_ms >= 0.0;
        if !(known && numbers && matches!(l.nic_kind.as_str(), "ib" | "roce" | "eth")) {
            dropped += 1;
            continue;
        }
        let sample =
            crate::state::links::Sample { at_unix_ms: at_or_now(l.at_unix_ms, now), gb_per_s: l.gb_per_s, latency_ms: l.latency_ms };
        fleet.links.record(&status.node, &l.peer, &l.nic_kind, sample);
    }
    for n in status.nics.iter().take(MAX_NICS_PER_MESSAGE) {
        let rate = |x: f64| x.is_finite() && x >= 0.0;
        if !sane_name(&n.name) || !matches!(n.kind.as_str(), "ib" | "roce" | "eth") || !rate(n.tx_gb_per_s) || !rate(n.rx_gb_per_s) {
            dropped += 1;
            continue;
        }
        fleet.links.record_nic(crate::state::links::NicView {
            node: status.node.clone(),
            name: n.name.clone(),
            kind: n.kind.clone(),
            tx_gb_per_s: n.tx_gb_per_s,
            rx_gb_per_s: n.rx_gb_per_s,
            at_unix_ms: at_or_now(n.at_unix_ms, now),
        });
    }
    dropped += status.links.len().saturating_sub(MAX_LINKS_PER_MESSAGE) + status.nics.len().saturating_sub(MAX_NICS_PER_MESSAGE);
    if dropped > 0 {
        tracing::debug!(node = %status.node, dropped, "link reports dropped (unknown peer, bad name or rate, too many)");
    }
}

/// The session's worker: the durable session check and the node's drain state on the first
/// message, then each message's reports committed in order and acknowledged.
async fn work_on(
    mut work: mpsc::UnboundedReceiver<AgentStatus>,
    store: Store,
    facts: Arc<crate::state::facts::Facts>,
    signals: Arc<JobSignals>,
    outbox: mpsc::UnboundedSender<Outbound>,
) {
    let mut checked = false;
    while let Some(status) = work.recv().await {
        if !checked {
            // The durable check too: an agent session older than the node's latest one.
            if let Err(e) = store.check_agent(&status.node, status.epoch).await {
                let _ = outbox.send(Outbound::Refuse(e));
                return;
            }
            checked = true;
            // A new session learns the node's drain state, either way (it may have changed while
            // the agent was away).
            if let Ok(node) = store.node(&status.node).await {
                let draining = node.state == NodeState::Draining;
                let _ = outbox.send(Outbound::Instruction(Instruction { kind: Some(instruction::Kind::Drain(Drain { draining })) }));
            }
        }
        if let Err(e) = apply(&store, &facts, &signals, &outbox, &status).await {
            tracing::warn!(node = %status.node, "rank report: {e}");
            // Close the stream: the agent reconnects and reports everything again.
            let _ = outbox.send(Outbound::Refuse(e));
            return;
        }
        if status.seq > 0 {
            let _ = outbox.send(ack(status.seq));
        }
    }
}

/// One message applied (`reports`), and the stops it calls for sent down the session.
async fn apply(
    store: &Store,
    facts: &crate::state::facts::Facts,
    signals: &JobSignals,
    outbox: &mpsc::UnboundedSender<Outbound>,
    status: &AgentStatus,
) -> Result<(), CoordinatorError> {
    for s in crate::agents::reports::apply(store, facts, signals, node_report(status)).await? {
        let stop = Stop { job: s.job, generation: s.generation, reason: s.reason };
        let _ = outbox.send(Outbound::Instruction(Instruction { kind: Some(instruction::Kind::Stop(stop)) }));
    }
    Ok(())
}

/// The message in the store's terms.
fn node_report(status: &AgentStatus) -> NodeReport {
    let ranks = status
        .ranks
        .iter()
        .map(|r| RankReport { job: r.job, generation: r.generation, rank: r.rank, state: r.state.clone(), exit_code: r.exit_code })
        .collect();
    let holdings = status.holdings_sent.then(|| {
        status
            .holdings
            .iter()
            .map(|h| Holding {
                job_id: h.job,
                generation: h.generation,
                step: h.step as i64,
                file: h.file.clone(),
                node: status.node.clone(),
                tier: h.tier.clone(),
                bytes: h.bytes as i64,
                block: h.block.clone(),
                part: h.part.clone(),
                tp_rank: h.tp_rank.into(),
                tp_size: h.tp_size.into(),
                rank: h.rank,
                layers: h.layers.into(),
                world_size: h.world_size.into(),
                chunk_bytes: h.chunk_bytes as i64,
                crc32c: serde_json::to_string(&h.crc32c).expect("a list of integers serialises"),
            })
            .collect()
    });
    NodeReport {
        node: status.node.clone(),
        epoch: status.epoch,
        ranks,
        holdings,
        profiles: status.profiles.iter().map(|p| (p.request, p.profile_json.clone(), p.error.clone())).collect(),
        restores: status.restores.clone(),
        rejoins: status.ranks.iter().filter_map(|r| r.rejoined.map(|x| (r.job, r.generation, r.rank, x))).collect(),
        full: status.full,
    }
}
