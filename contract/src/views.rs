//! What the coordinator's API shows of nodes and jobs (`GET /api/v1/nodes`, `/api/v1/jobs`),
//! and what `motley node list`, `motley job list` and the dashboard read back. Field names are
//! a contract: fields may be added, never renamed.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::job::JobState;

/// Whether a node takes new ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "utoipa", derive(utoipa::ToSchema))]
#[serde(rename_all = "lowercase")]
pub enum NodeState {
    Active,
    /// Gets no new ranks; what runs there keeps running.
    Draining,
}

impl NodeState {
    pub fn as_str(self) -> &'static str {
        match self {
            NodeState::Active => "active",
            NodeState::Draining => "draining",
        }
    }
}

/// A node's load as its agent reported it on its last heartbeat.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "utoipa", derive(utoipa::ToSchema))]
pub struct NodeLoad {
    /// One entry per GPU NVML sees on the node (none without a driver).
    pub gpus: Vec<GpuLoad>,
    /// Free bytes on the file system of the agent's work directory.
    pub work_dir_free_bytes: u64,
    /// The node's 1-minute load average.
    pub load_1m: f64,
    /// Memory available to new processes, bytes.
    pub mem_available_bytes: u64,
    /// Ranks of the node's agent running now.
    pub ranks_running: u32,
    /// How old this report is, ms.
    pub age_ms: u64,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "utoipa", derive(utoipa::ToSchema))]
pub struct GpuLoad {
    /// NVML's index (PCI order), as in plans and CUDA_VISIBLE_DEVICES.
    pub index: u32,
    pub utilization_percent: u32,
    pub memory_used_bytes: u64,
    pub memory_total_bytes: u64,
    pub temperature_c: Option<u32>,
}

/// A node as the API shows it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "utoipa", derive(utoipa::ToSchema))]
pub struct NodeView {
    pub name: String,
    pub state: NodeState,
    /// The node's agent holds a lease now.
    pub live: bool,
    pub agent_epoch: i64,
    pub registered_at_ms: i64,
    /// The node's cluster-file entry.
    #[cfg_attr(feature = "utoipa", schema(value_type = Object))]
    pub inventory: Value,
    /// What its agent reported on its last heartbeat (null unless live).
    pub load: Option<NodeLoad>,
    /// Its GPUs are emulated on CPU (its entry's `emulate:`, docs/emulation.md): a test or
    /// demo node, never a real GPU. Absent when false.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub emulated: bool,
}

/// A job as the API shows it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "utoipa", derive(utoipa::ToSchema))]
pub struct JobView {
    pub id: i64,
    pub name: String,
    pub state: JobState,
    /// 0 until the first launch; +1 on every (re)launch.
    pub generation: i64,
    /// Why the job failed or was cancelled, or why a queued job waits.
    pub reason: Option<String>,
    pub created_at_ms: i64,
    pub updated_at_ms: i64,
    /// The job file as stored.
    #[cfg_attr(feature = "utoipa", schema(value_type = Object))]
    pub spec: Value,
    /// Where the job's checkpoint steps go in its checkpoint cloud: `URL/CLUSTER/jobs/ID`
    /// (`GEN/step-S/` under it), CLUSTER this cluster's identity; absent when the job file
    /// names no cloud.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpoint_cloud: Option<String>,
    /// While the job is `degraded`: the membership in force (docs/keep-going.md).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub membership: Option<MembershipView>,
}

/// The replicas of a degraded job that keep training, as its newest `membership_changed` event
/// says.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "utoipa", derive(utoipa::ToSchema))]
pub struct MembershipView {
    pub epoch: i64,
    /// The member replicas (plan order).
    pub replicas: Vec<u32>,
    /// The replicas lost, since the launch.
    pub lost: Vec<u32>,
    /// The planner's prediction of the members' share of the plan's throughput (0 to 1; 0 where
    /// the plan has no prices).
    pub throughput_share: f64,
    /// Why the newest epoch was opened.
    pub reason: String,
}

impl MembershipView {
    /// One line for people: `epoch 2: replicas 0, 2 train (1 lost); 67% of the plan's throughput`.
    pub fn summary(&self) -> String {
        let list = |v: &[u32]| v.iter().map(u32::to_string).collect::<Vec<_>>().join(", ");
        format!(
            "epoch {}: replicas {} train ({} lost); {:.0}% of the plan's throughput",
            self.epoch,
            list(&self.replicas),
            list(&self.lost),
            self.throughput_share * 100.0
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn views_read_back_what_the_api_writes() {
        let node = serde_json::json!({"name": "n1", "state": "draining", "live": true, "agent_epoch": 3, "registered_at_ms": 5,
            "inventory": {"gpu": "A100"}, "load": {"gpus": [{"index": 0, "utilization_percent": 90, "memory_used_bytes": 1,
            "memory_total_bytes": 2, "temperature_c": null}], "work_dir_free_bytes": 7, "load_1m": 0.5,
            "mem_available_bytes": 8, "ranks_running": 1, "age_ms": 10}});
        let v: NodeView = serde_json::from_value(node.clone()).unwrap();
        assert_eq!((v.state, v.load.as_ref().unwrap().gpus[0].utilization_percent), (NodeState::Draining, 90));
        assert_eq!(serde_json::to_value(&v).unwrap(), node);
        let job = serde_json::json!({"id": 1, "name": "j", "state": "running", "generation": 2, "reason": null,
            "created_at_ms": 1, "updated_at_ms": 2, "spec": {"name": "j"}});
        let j: JobView = serde_json::from_value(job.clone()).unwrap();
        assert_eq!(j.state, JobState::Running);
        assert_eq!(serde_json::to_value(&j).unwrap(), job);
        let degraded = serde_json::json!({"id": 2, "name": "k", "state": "degraded", "generation": 1, "reason": null,
            "created_at_ms": 1, "updated_at_ms": 2, "spec": {"name": "k"}, "membership": {"epoch": 1, "replicas": [0, 2],
            "lost": [1], "throughput_share": 0.75, "reason": "node n1 lost"}});
        let d: JobView = serde_json::from_value(degraded.clone()).unwrap();
        assert_eq!(d.membership.as_ref().unwrap().summary(), "epoch 1: replicas 0, 2 train (1 lost); 75% of the plan's throughput");
        assert_eq!(serde_json::to_value(&d).unwrap(), degraded);
        let e = serde_json::from_value::<JobView>(serde_json::json!({"id": 1, "state": "paused"})).unwrap_err().to_string();
        assert!(e.contains("paused") || e.contains("name"), "{e}");
    }
}
