//! A rank's communication groups, cut from the plan's `comm_groups` (see solver/src/network.rs
//! for the contract): the groups whose GPUs include this rank's, each with its NCCL settings
//! (the group's `env` with this node's `node_env` on top) in the order ranks create them.
//! Settings that are the same in every one of the rank's groups are safe to set once at
//! process start; the rest must be applied per group, just before its communicator is made.

use std::collections::BTreeMap;

use serde_json::{json, Value};

/// The rank's groups (JSON array) and the settings common to all of them.
pub fn for_rank(plan_json: &str, node: &str, gpu: i64) -> (Value, BTreeMap<String, String>) {
    let Ok(plan) = serde_json::from_str::<Value>(plan_json) else { return (json!([]), BTreeMap::new()) };
    let mut groups = vec![];
    for g in plan["comm_groups"].as_array().into_iter().flatten() {
        let member = g["gpus"].as_array().into_iter().flatten().any(|m| m["node"] == node && m["index"].as_i64() == Some(gpu));
        if !member {
            continue;
        }
        let mut env: BTreeMap<String, String> = BTreeMap::new();
        for source in [&g["env"], &g["node_env"][node]] {
            for (k, v) in source.as_object().into_iter().flatten() {
                env.insert(k.clone(), v.as_str().map_or_else(|| v.to_string(), str::to_string));
            }
        }
        groups.push(json!({
            "kind": g["kind"],
            "replica": g["replica"],
            "stage": g["stage"],
            "nccl_net": g["nccl_net"],
            "env": env,
        }));
    }
    let common = common_env(&groups);
    (Value::Array(groups), common)
}

/// Keys every group sets, to the same value.
fn common_env(groups: &[Value]) -> BTreeMap<String, String> {
    let envs: Vec<BTreeMap<String, String>> = groups.iter().map(|g| serde_json::from_value(g["env"].clone()).unwrap_or_default()).collect();
    let Some((first, rest)) = envs.split_first() else { return BTreeMap::new() };
    first.iter().filter(|(k, v)| rest.iter().all(|e| e.get(*k) == Some(v))).map(|(k, v)| (k.clone(), v.clone())).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rank_gets_its_groups_and_only_the_settings_they_agree_on() {
        let plan = json!({"comm_groups": [
            {"kind": "tp", "gpus": [{"node": "a", "index": 0}, {"node": "a", "index": 1}], "env": {"NCCL_P2P_LEVEL": "NVL"}, "nccl_net": null},
            {"kind": "dp", "gpus": [{"node": "a", "index": 0}, {"node": "b", "index": 0}],
             "env": {"NCCL_NET": "IB", "NCCL_IB_HCA": "=mlx5_0:1", "NCCL_P2P_LEVEL": "NVL"},
             "node_env": {"a": {"NCCL_IB_GID_INDEX": "3"}}, "nccl_net": "IB"},
            {"kind": "dp", "gpus": [{"node": "a", "index": 1}, {"node": "b", "index": 1}], "env": {"NCCL_NET": "Socket"}, "nccl_net": "Socket"}
        ]})
        .to_string();
        let (groups, common) = for_rank(&plan, "a", 0);
        let kinds: Vec<&str> = groups.as_array().unwrap().iter().map(|g| g["kind"].as_str().unwrap()).collect();
        assert_eq!(kinds, ["tp", "dp"], "GPU a:0 is in the first two groups only");
        assert_eq!(groups[1]["env"]["NCCL_IB_GID_INDEX"], "3", "node a's override applies");
        assert_eq!(common, BTreeMap::from([("NCCL_P2P_LEVEL".to_string(), "NVL".to_string())]));
        let (groups, common) = for_rank(&plan, "b", 0);
        assert_eq!(groups.as_array().unwrap().len(), 1);
        assert!(groups[0]["env"].get("NCCL_IB_GID_INDEX").is_none(), "node a's override is not b's");
        assert_eq!(common["NCCL_NET"], "IB");
        let (groups, common) = for_rank("not json", "a", 0);
        assert_eq!((groups, common.len()), (json!([]), 0));
    }
}
