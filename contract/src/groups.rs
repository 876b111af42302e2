//! A rank's groups file (`MOTLEY_NCCL_GROUPS`): the plan's `comm_groups` that include the
//! rank's GPU, in the order ranks create them, each with its NCCL settings (the group's `env`
//! with the node's `node_env` on top), each applied just before its communicator is made. The
//! rank's process environment (the union of its groups' device lists, and the other settings
//! all its groups agree on) is `motley_solver::network::process_env` of these groups' `env`
//! (solver/src/network.rs says why); the agent sets it at start.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::plan::{GpuRef, GroupKind, PlanDocument};

/// One entry of the groups file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RankGroup {
    /// Position in the plan's `comm_groups` (creation order over every rank).
    pub index: usize,
    pub kind: GroupKind,
    pub replica: Option<u32>,
    pub stage: Option<u32>,
    pub layers: [u32; 2],
    /// The members, in the plan's order.
    pub gpus: Vec<GpuRef>,
    /// `ncclConfig_t.netName` for this communicator; None inside a node.
    pub nccl_net: Option<String>,
    /// Set just before the communicator is made.
    pub env: BTreeMap<String, String>,
}

/// The groups of `node`'s GPU `gpu`, in creation order.
pub fn for_rank(plan: &PlanDocument, node: &str, gpu: u32) -> Vec<RankGroup> {
    let mut groups = vec![];
    for (index, g) in plan.comm_groups.iter().enumerate() {
        if !g.gpus.iter().any(|m| m.node == node && m.index == gpu) {
            continue;
        }
        let mut env = g.env.clone();
        if let Some(over) = g.node_env.get(node) {
            env.extend(over.iter().map(|(k, v)| (k.clone(), v.clone())));
        }
        groups.push(RankGroup {
            index,
            kind: g.kind,
            replica: g.replica,
            stage: g.stage,
            layers: g.layers,
            gpus: g.gpus.clone(),
            nccl_net: g.nccl_net.clone(),
            env,
        });
    }
    groups
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rank_gets_its_groups_with_its_nodes_overrides() {
        let plan = serde_json::json!({"global_batch": 1, "micro_batch": 1, "seq_len": 8, "model": "m", "replicas": [], "comm_groups": [
            {"kind": "tp", "gpus": [{"node": "a", "index": 0}, {"node": "a", "index": 1}], "transport": "nvlink",
             "env": {"NCCL_P2P_LEVEL": "NVL"}, "nccl_net": null, "replica": 0, "stage": 0, "layers": [0, 2]},
            {"kind": "dp", "gpus": [{"node": "a", "index": 0}, {"node": "b", "index": 0}], "transport": "ib",
             "env": {"NCCL_NET": "IB", "NCCL_IB_HCA": "=mlx5_0:1", "NCCL_P2P_LEVEL": "NVL"},
             "node_env": {"a": {"NCCL_IB_GID_INDEX": "3"}}, "nccl_net": "IB", "replica": null, "stage": null, "layers": [0, 2]},
            {"kind": "dp", "gpus": [{"node": "a", "index": 1}, {"node": "b", "index": 1}], "transport": "socket",
             "env": {"NCCL_NET": "Socket"}, "nccl_net": "Socket", "replica": null, "stage": null, "layers": [0, 2]}
        ]});
        let plan: PlanDocument = serde_json::from_value(plan).unwrap();
        let groups = for_rank(&plan, "a", 0);
        let kinds: Vec<(usize, GroupKind)> = groups.iter().map(|g| (g.index, g.kind)).collect();
        assert_eq!(kinds, [(0, GroupKind::Tp), (1, GroupKind::Dp)], "GPU a:0 is in the first two groups only");
        assert_eq!(groups[1].env["NCCL_IB_GID_INDEX"], "3", "node a's override applies");
        assert_eq!(groups[1].gpus.len(), 2);
        let groups = for_rank(&plan, "b", 0);
        assert_eq!(groups.len(), 1);
        assert!(!groups[0].env.contains_key("NCCL_IB_GID_INDEX"), "node a's override is not b's");
        assert_eq!(groups[0].env["NCCL_NET"], "IB");
        assert!(for_rank(&plan, "c", 0).is_empty());
    }
}
