//! The gRPC control service (`proto/motley/v1/control.proto`): a thin edge that checks the
//! bearer token and leadership, translates messages and delegates to `control` and the store.
//! Errors become statuses through `CoordinatorError::grpc_code`, as REST's through
//! `http_status`.

use std::sync::Arc;
use std::time::Duration;

use motley_proto::v1 as pb;
use motley_proto::v1::control_server::Control;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};

use crate::cluster::ClusterIdentity;
use crate::control;
use crate::fleet::Fleet;
use crate::leader::Role;
use crate::service::{status_of, Tokens};
use crate::store::{Event, JobRecord, NodeRecord, RankAssignment, RankRecord, Store};

pub struct ControlService {
    pub store: Store,
    pub fleet: Arc<Fleet>,
    pub life: Arc<crate::life::Life>,
    pub role: Arc<Role>,
    /// The operators' token every call must carry (the agents' is refused).
    pub tokens: Tokens,
}

type Reply<T> = Result<Response<T>, Status>;

impl ControlService {
    /// The token, then leadership: every call but `GetLeader` needs both.
    fn admit<T>(&self, req: &Request<T>) -> Result<(), Status> {
        self.authenticate(req)?;
        if !self.role.is_leader() {
            return Err(status_of(self.role.not_leader()));
        }
        Ok(())
    }

    fn authenticate<T>(&self, req: &Request<T>) -> Result<(), Status> {
        let given = req.metadata().get("authorization").and_then(|v| v.to_str().ok()).and_then(crate::service::bearer);
        self.tokens.check_operator(given).map_err(status_of)
    }

    fn node(&self, n: NodeRecord) -> pb::Node {
        let load = self.fleet.load(&n.name);
        pb::Node {
            live: self.fleet.live(&n.name),
            load_age_ms: load.as_ref().map_or(0, |l| l.age_ms),
            load: load.map(crate::load::to_proto),
            name: n.name,
            state: serde_json::to_value(n.state).ok().and_then(|v| v.as_str().map(str::to_string)).unwrap_or_default(),
            agent_epoch: n.agent_epoch,
            registered_at_ms: n.registered_at_ms,
            inventory_json: n.inventory,
        }
    }
}

fn job(cluster: &ClusterIdentity, j: JobRecord) -> pb::Job {
    pb::Job {
        checkpoint_cloud: cluster.stored_checkpoints(&j.spec, j.id),
        id: j.id,
        name: j.name,
        state: j.state.to_string(),
        generation: j.generation,
        reason: j.reason,
        created_at_ms: j.created_at_ms,
        updated_at_ms: j.updated_at_ms,
        spec_json: j.spec,
    }
}

fn event(e: Event) -> pb::Event {
    pb::Event { seq: e.seq, job_id: e.job_id, generation: e.generation, kind: e.kind, message: e.message, at_ms: e.at_ms }
}

fn rank(a: RankAssignment, state: &str, exit_code: Option<i64>) -> pb::Rank {
    pb::Rank {
        rank: a.rank,
        node: a.node,
        local_rank: a.local_rank,
        gpu: a.gpu,
        replica: a.replica,
        stage: a.stage,
        layer_start: a.layer_start,
        layer_end: a.layer_end,
        state: state.to_string(),
        exit_code,
    }
}

fn rank_record(r: RankRecord) -> pb::Rank {
    rank(r.assignment, &r.state, r.exit_code)
}

fn stored_profile(r: crate::store::ProfileRecord) -> pb::StoredProfile {
    let p = r.profile;
    pb::StoredProfile {
        id: r.id,
        gpu: p.gpu,
        model: p.model,
        model_hash: p.model_hash,
        tp: p.tp,
        micro_batch: p.micro_batch,
        seq_len: p.seq_len,
        dtype: p.dtype,
        torch: p.torch,
        device: p.device,
        node: p.node,
        entry_json: p.entry,
        measured_at_ms: r.measured_at_ms,
    }
}

fn checkpoint_step(v: crate::checkpoints::StepView) -> pb::CheckpointStep {
    pb::CheckpointStep {
        step: v.step,
        generations: v.generations,
        files: v.files as u64,
        bytes: v.bytes,
        nodes: v.nodes,
        complete: v.complete,
        missing: v.missing,
    }
}

fn profile_run(r: crate::profiling::ProfileRun) -> pb::ProfileRun {
    use crate::profiling::RunState;
    let (state, profile, reason) = match r.state {
        RunState::Running => ("running", None, None),
        RunState::Stored { profile } => ("stored", Some(profile), None),
        RunState::Failed { reason } => ("failed", None, Some(reason)),
    };
    pb::ProfileRun {
        request: r.request,
        gpu: r.gpu,
        model: r.model,
        model_hash: r.model_hash,
        tp: r.tp,
        micro_batch: r.micro_batch,
        seq_len: r.seq_len,
        dtype: r.dtype,
        node: r.node,
        gpus: r.gpus,
        state: state.into(),
        profile,
        reason,
    }
}

fn network(v: motley_contract::net::NetworkView) -> pb::Network {
    let links = v
        .links
        .into_iter()
        .map(|l| pb::NetworkLink {
            a: l.a,
            b: l.b,
            nic_kind: l.nic_kind,
            gb_per_s: l.gb_per_s,
            latency_ms: l.latency_ms,
            samples: l.samples,
            updated_unix_ms: l.updated_unix_ms,
            declared_gb_per_s: l.declared_gb_per_s,
            history: l
                .history
                .into_iter()
                .map(|p| pb::LinkPoint { at_unix_ms: p.at_unix_ms, gb_per_s: p.gb_per_s, latency_ms: p.latency_ms })
                .collect(),
        })
        .collect();
    let nics = v
        .nics
        .into_iter()
        .map(|n| pb::NetworkNic {
            node: n.node,
            name: n.name,
            kind: n.kind,
            tx_gb_per_s: n.tx_gb_per_s,
            rx_gb_per_s: n.rx_gb_per_s,
            at_unix_ms: n.at_unix_ms,
        })
        .collect();
    let bandwidth = v.bandwidth.pairs.into_iter().map(|p| pb::BandwidthPair { a: p.a, b: p.b, gb_per_s: p.gb_per_s }).collect();
    pb::Network { links, nics, bandwidth }
}

#[tonic::async_trait]
impl Control for ControlService {
    async fn get_network(&self, req: Request<pb::GetNetworkRequest>) -> Reply<pb::Network> {
        self.admit(&req)?;
        let node = req.into_inner().node;
        let v = crate::net::view(&self.store, &self.fleet, Some(node.as_str())).await.map_err(status_of)?;
        Ok(Response::new(network(v)))
    }

    async fn list_checkpoints(&self, req: Request<pb::JobRef>) -> Reply<pb::CheckpointSteps> {
        self.admit(&req)?;
        let steps = crate::checkpoints::steps(&self.store, req.into_inner().id).await.map_err(status_of)?;
        Ok(Response::new(pb::CheckpointSteps { steps: steps.into_iter().map(checkpoint_step).collect() }))
    }

    async fn get_checkpoint_grid(&self, req: Request<pb::CheckpointGridRequest>) -> Reply<pb::CheckpointGrid> {
        self.admit(&req)?;
        let r = req.into_inner();
        let grid = crate::checkpoints::grid(&self.store, r.job, r.step).await.map_err(status_of)?;
        let rows = grid
            .rows
            .into_iter()
            .map(|row| pb::CheckpointGridRow {
                file: row.file,
                unit: row.unit,
                bytes: row.bytes,
                held: row.held.into_iter().map(|(node, tiers)| (node, tiers.join("+"))).collect(),
            })
            .collect();
        Ok(Response::new(pb::CheckpointGrid { step: Some(checkpoint_step(grid.step)), rows }))
    }

    async fn list_profiles(&self, req: Request<pb::ListProfilesRequest>) -> Reply<pb::ProfileList> {
        self.admit(&req)?;
        let hash = req.into_inner().model_hash;
        let rows = self.store.profiles(Some(hash.as_str()).filter(|h| !h.is_empty())).await.map_err(status_of)?;
        Ok(Response::new(pb::ProfileList { profiles: rows.into_iter().map(stored_profile).collect() }))
    }

    async fn get_profile(&self, req: Request<pb::ProfileRef>) -> Reply<pb::StoredProfile> {
        self.admit(&req)?;
        Ok(Response::new(stored_profile(self.store.profile(req.into_inner().id).await.map_err(status_of)?)))
    }

    async fn run_profile(&self, req: Request<pb::ProfileRunRequest>) -> Reply<pb::ProfileRun> {
        self.admit(&req)?;
        let text = req.into_inner().text;
        let run: crate::profiling::RunRequest =
            crate::jobspec::parse_yaml(serde_norway::Deserializer::from_str(&text), "profile run").map_err(status_of)?;
        Ok(Response::new(profile_run(crate::profiling::run_now(&self.store, &self.fleet, &run).await.map_err(status_of)?)))
    }

    async fn get_profile_run(&self, req: Request<pb::ProfileRunRef>) -> Reply<pb::ProfileRun> {
        self.admit(&req)?;
        let request = req.into_inner().request;
        let run = crate::profiling::run(&self.store, &self.fleet, request).await.map_err(status_of)?.ok_or_else(|| {
            status_of(crate::CoordinatorError::not_found(format!(
                "profile run {request} (ended runs are kept for a while: motley profile runs)"
            )))
        })?;
        Ok(Response::new(profile_run(run)))
    }

    async fn list_nodes(&self, req: Request<pb::ListNodesRequest>) -> Reply<pb::NodeList> {
        self.admit(&req)?;
        let nodes = self.store.nodes().await.map_err(status_of)?;
        Ok(Response::new(pb::NodeList { nodes: nodes.into_iter().map(|n| self.node(n)).collect() }))
    }

    async fn describe_node(&self, req: Request<pb::NodeRef>) -> Reply<pb::Node> {
        self.admit(&req)?;
        Ok(Response::new(self.node(self.store.node(&req.into_inner().name).await.map_err(status_of)?)))
    }

    async fn drain_node(&self, req: Request<pb::DrainNodeRequest>) -> Reply<pb::Node> {
        self.admit(&req)?;
        let req = req.into_inner();
        let deadline = control::drain_deadline(req.deadline_s).map_err(status_of)?;
        let n = control::set_draining(&self.life, &req.name, true, deadline).await.map_err(status_of)?;
        Ok(Response::new(self.node(n)))
    }

    async fn undrain_node(&self, req: Request<pb::NodeRef>) -> Reply<pb::Node> {
        self.admit(&req)?;
        let n = control::set_draining(&self.life, &req.into_inner().name, false, None).await.map_err(status_of)?;
        Ok(Response::new(self.node(n)))
    }

    async fn submit_job(&self, req: Request<pb::JobFile>) -> Reply<pb::Job> {
        self.admit(&req)?;
        let j = control::submit(&self.store, &self.fleet, &req.into_inner().text).await.map_err(status_of)?;
        Ok(Response::new(job(self.store.cluster(), j)))
    }

    async fn list_jobs(&self, req: Request<pb::ListJobsRequest>) -> Reply<pb::JobList> {
        self.admit(&req)?;
        let jobs = self.store.jobs().await.map_err(status_of)?;
        Ok(Response::new(pb::JobList { jobs: jobs.into_iter().map(|j| job(self.store.cluster(), self.life.annotate(j))).collect() }))
    }

    async fn get_job(&self, req: Request<pb::JobRef>) -> Reply<pb::Job> {
        self.admit(&req)?;
        Ok(Response::new(job(self.store.cluster(), self.life.annotate(self.store.job(req.into_inner().id).await.map_err(status_of)?))))
    }

    type WatchJobStream = ReceiverStream<Result<pb::Event, Status>>;

    async fn watch_job(&self, req: Request<pb::WatchJobRequest>) -> Reply<Self::WatchJobStream> {
        self.admit(&req)?;
        let pb::WatchJobRequest { id, after } = req.into_inner();
        self.store.job(id).await.map_err(status_of)?;
        let (tx, rx) = mpsc::channel(64);
        let store = self.store.clone();
        // Events are polled from the store (any coordinator may have written them); a fifth of
        // the base interval keeps a watch close behind without loading the database.
        let poll = (self.fleet.base / 5).clamp(Duration::from_millis(20), Duration::from_millis(500));
        tokio::spawn(async move {
            let mut after = after;
            loop {
                // The state first, then the events: a job seen over has all its events written.
                let over = match store.job(id).await {
                    Ok(j) => j.state.is_terminal(),
                    Err(e) => {
                        let _ = tx.send(Err(status_of(e))).await;
                        return;
                    }
                };
                let events = match store.events(Some(id), after, 1000).await {
                    Ok(e) => e,
                    Err(e) => {
                        let _ = tx.send(Err(status_of(e))).await;
                        return;
                    }
                };
                let drained = events.len() < 1000;
                for e in events {
                    after = e.seq;
                    if tx.send(Ok(event(e))).await.is_err() {
                        return; // the watcher left
                    }
                }
                if over && drained {
                    return;
                }
                if drained {
                    // A watcher that left ends the poll now, not at the next event.
                    tokio::select! {
                        _ = tokio::time::sleep(poll) => {}
                        _ = tx.closed() => return,
                    }
                }
            }
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    async fn cancel_job(&self, req: Request<pb::JobRef>) -> Reply<pb::Job> {
        self.admit(&req)?;
        let j = control::cancel(&self.store, &self.fleet, req.into_inner().id, "cancelled by the operator").await.map_err(status_of)?;
        Ok(Response::new(job(self.store.cluster(), j)))
    }

    async fn get_plan(&self, req: Request<pb::JobRef>) -> Reply<pb::JobPlan> {
        self.admit(&req)?;
        let (j, plan, ranks) = control::current_plan(&self.store, req.into_inner().id).await.map_err(status_of)?;
        Ok(Response::new(pb::JobPlan {
            job: j.id,
            generation: j.generation,
            plan_json: plan,
            ranks: ranks.into_iter().map(rank_record).collect(),
        }))
    }

    async fn dry_run_plan(&self, req: Request<pb::JobFile>) -> Reply<pb::DryRun> {
        self.admit(&req)?;
        let (report, ranks) = control::dry_run(&self.store, &self.fleet, &req.into_inner().text).await.map_err(status_of)?;
        Ok(Response::new(pb::DryRun {
            plan_json: serde_json::to_string(&report).expect("a plan serialises"),
            ranks: ranks.into_iter().map(|a| rank(a, "assigned", None)).collect(),
        }))
    }

    async fn get_leader(&self, req: Request<pb::LeaderRequest>) -> Reply<pb::Leader> {
        self.authenticate(&req)?;
        let l = self.role.leader();
        Ok(Response::new(pb::Leader {
            is_leader: self.role.is_leader(),
            rest_url: l.rest_url,
            grpc_url: l.grpc_url,
            term: l.term,
            cluster_id: self.store.cluster().id.clone(),
        }))
    }
}
