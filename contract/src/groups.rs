//! A rank's groups file (`MOTLEY_NCCL_GROUPS`): the plan's `comm_groups` that include the
//! rank's GPU, in the order ranks create them, each with its NCCL settings (the group's `env`
//! with the node's `node_env` on top). Settings that are the same in every one of the rank's
//! groups are safe to set once at process start; the rest must be applied per group, just
//! before its communicator is made (solver/src/network.rs says why).

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

/// The groups of `node`'s GPU `gpu`, and the settings common to all of them.
pub fn for_rank(plan: &PlanDocument, node: &str, gpu: u32) -> (Vec<RankGroup>, BTreeMap<String, String>) {
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
    let common = common_env(&groups);
    (groups, common)
}

/// Keys every group sets, to the same value.
fn common_env(groups: &[RankGroup]) -> BTreeMap<String, String> {
    let Some((first, rest)) = groups.split_first() else { return BTreeMap::new() };
    first.env.iter().filter(|(k, v)| rest.iter().all(|g| g.env.get(*k) == Some(v))).map(|(k, v)| (k.clone(), v.clone())).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rank_gets_its_groups_and_only_the_settings_they_agree_on() {
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
        let (groups, common) = for_rank(&plan, "a", 0);
        let kinds: Vec<(usize, GroupKind)> = groups.iter().map(|g| (g.index, g.kind)).collect();
        assert_eq!(kinds, [(0, GroupKind::Tp), (1, GroupKind::Dp)], "GPU a:0 is in the first two groups only");
        assert_eq!(groups[1].env["NCCL_IB_GID_INDEX"], "3", "node a's override applies");
        assert_eq!(groups[1].gpus.len(), 2);
        assert_eq!(common, BTreeMap::from([("NCCL_P2P_LEVEL".to_string(), "NVL".to_string())]));
        let (groups, common) = for_rank(&plan, "b", 0);
        assert_eq!(groups.len(), 1);
        assert!(!groups[0].env.contains_key("NCCL_IB_GID_INDEX"), "node a's override is not b's");
        assert_eq!(common["NCCL_NET"], "IB");
        let (groups, common) = for_rank(&plan, "c", 0);
        assert_eq!((groups.len(), common.len()), (0, 0));
    }
}
