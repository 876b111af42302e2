//! The operations' response types (`api`) as the Control service's messages
//! (`proto/motley/v1/control.proto`): one `From` per type, field by field. A field added to a
//! response type is spelt here once more.

use motley_proto::v1 as pb;

use crate::api::{DryRunView, Job, LeaderView, Network, Node, PlanView};
use crate::planning::profiling::{ProfileRun, RunState};
use crate::store::{Event, ProfileRecord, RankAssignment, RankRecord};
use crate::views::checkpoints::{StepGrid, StepView};

impl From<Node> for pb::Node {
    fn from(n: Node) -> Self {
        let v = n.view;
        pb::Node {
            live: v.live,
            emulated: v.emulated,
            load_age_ms: v.load.as_ref().map_or(0, |l| l.age_ms),
            load: v.load.map(crate::state::load::to_proto),
            state: v.state.as_str().to_string(),
            name: v.name,
            agent_epoch: v.agent_epoch,
            registered_at_ms: v.registered_at_ms,
            inventory_json: n.inventory_json,
        }
    }
}

impl From<Job> for pb::Job {
    fn from(j: Job) -> Self {
        let v = j.view;
        pb::Job {
            checkpoint_cloud: v.checkpoint_cloud,
            membership_json: v.membership.map(|m| serde_json::to_string(&m).expect("a membership serialises")),
            id: v.id,
            name: v.name,
            state: v.state.to_string(),
            generation: v.generation,
            reason: v.reason,
            created_at_ms: v.created_at_ms,
            updated_at_ms: v.updated_at_ms,
            spec_json: j.spec_json,
        }
    }
}

impl From<Event> for pb::Event {
    fn from(e: Event) -> Self {
        pb::Event { seq: e.seq, job_id: e.job_id, generation: e.generation, kind: e.kind, message: e.message, at_ms: e.at_ms }
    }
}

/// A rank as launched: its state and exit code as reported.
impl From<RankRecord> for pb::Rank {
    fn from(r: RankRecord) -> Self {
        let a = r.assignment;
        pb::Rank {
            rank: a.rank,
            node: a.node,
            local_rank: a.local_rank,
            gpu: a.gpu,
            replica: a.replica,
            stage: a.stage,
            layer_start: a.layer_start,
            layer_end: a.layer_end,
            state: r.state,
            exit_code: r.exit_code,
        }
    }
}

/// A rank a plan would launch (a dry run): `assigned`, no exit code.
impl From<RankAssignment> for pb::Rank {
    fn from(assignment: RankAssignment) -> Self {
        RankRecord { assignment, state: "assigned".into(), exit_code: None }.into()
    }
}

impl From<PlanView> for pb::JobPlan {
    fn from(p: PlanView) -> Self {
        pb::JobPlan { job: p.job, generation: p.generation, plan_json: p.plan_json, ranks: p.ranks.into_iter().map(Into::into).collect() }
    }
}

impl From<DryRunView> for pb::DryRun {
    fn from(d: DryRunView) -> Self {
        pb::DryRun { plan_json: d.plan_json, ranks: d.ranks.into_iter().map(Into::into).collect() }
    }
}

impl From<LeaderView> for pb::Leader {
    fn from(l: LeaderView) -> Self {
        pb::Leader { is_leader: l.is_leader, rest_url: l.rest_url, grpc_url: l.grpc_url, term: l.term, cluster_id: l.cluster_id }
    }
}

impl From<ProfileRecord> for pb::StoredProfile {
    fn from(r: ProfileRecord) -> Self {
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
}

impl From<ProfileRun> for pb::ProfileRun {
    fn from(r: ProfileRun) -> Self {
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
}

impl From<StepView> for pb::CheckpointStep {
    fn from(v: StepView) -> Self {
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
}

/// Each node's tiers joined by `+` ("memory+disk"), as the CLI's grid prints them.
impl From<StepGrid> for pb::CheckpointGrid {
    fn from(grid: StepGrid) -> Self {
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
        pb::CheckpointGrid { step: Some(grid.step.into()), rows }
    }
}

impl From<Network> for pb::Network {
    fn from(Network(v): Network) -> Self {
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
}
