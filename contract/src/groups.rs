//! A rank's groups file (`MOTLEY_NCCL_GROUPS`): the plan's `comm_groups` that include the
//! rank's GPU, in the order ranks create them, each with its NCCL settings (the group's `env`
//! with the node's `node_env` on top), each applied just before its communicator is made. The
//! rank's process environment (the union of its groups' device lists, and the other settings
//! all its groups agree on) is [`process_env`] of these groups' `env`; the agent sets it at
//! start, and the planner refuses groups whose settings contradict on one rank.

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

/// The NCCL settings the network plugin reads once per process (NCCL device lists): a rank
/// starts with the union of its groups' values for these.
pub const PROCESS_LISTS: [&str; 2] = ["NCCL_IB_HCA", "NCCL_SOCKET_IFNAME"];

/// How an NCCL device list matches names: its leading `^` (exclude) and `=` (exact match).
fn list_kind(list: &str) -> ((bool, bool), &str) {
    let (not, rest) = match list.strip_prefix('^') {
        Some(r) => (true, r),
        None => (false, list),
    };
    let (exact, rest) = match rest.strip_prefix('=') {
        Some(r) => (true, r),
        None => (false, rest),
    };
    ((not, exact), rest)
}

/// The one process-wide value of NCCL device lists (`NCCL_IB_HCA`, `NCCL_SOCKET_IFNAME`:
/// `[^][=]name[:port],...`) that lets a process use every device any of `lists` allows.
/// Inclusion lists unite: entries in first-seen order, duplicates dropped, the shared prefix
/// kept (`=mlx5_0:1` and `=mlx5_1:1` give `=mlx5_0:1,mlx5_1:1`). Exclusion lists keep what
/// every one excludes (first list's order); None when that is nothing (no list: NCCL's
/// default, every device). Lists of different kinds (exact and prefix matching, inclusion and
/// exclusion) cannot be united: `Err((i, j))` names the first two such positions.
pub fn unite_device_lists(lists: &[&str]) -> std::result::Result<Option<String>, (usize, usize)> {
    let Some(first) = lists.first() else { return Ok(None) };
    let (kind, _) = list_kind(first);
    if let Some(j) = lists.iter().position(|l| list_kind(l).0 != kind) {
        return Err((0, j));
    }
    let entries = |l: &'_ str| -> Vec<String> {
        list_kind(l).1.split(',').map(str::trim).filter(|e| !e.is_empty()).map(String::from).collect::<Vec<_>>()
    };
    let mut out: Vec<String> = vec![];
    if kind.0 {
        let all: Vec<Vec<String>> = lists.iter().map(|l| entries(l)).collect();
        for e in &all[0] {
            if all[1..].iter().all(|l| l.contains(e)) && !out.contains(e) {
                out.push(e.clone());
            }
        }
        if out.is_empty() {
            return Ok(None);
        }
    } else {
        for l in lists {
            for e in entries(l) {
                if !out.contains(&e) {
                    out.push(e);
                }
            }
        }
    }
    let prefix = format!("{}{}", if kind.0 { "^" } else { "" }, if kind.1 { "=" } else { "" });
    Ok(Some(format!("{prefix}{}", out.join(","))))
}

/// Two of a rank's groups need process-wide values that no one value satisfies.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EnvConflict {
    pub key: String,
    /// Positions in the `envs` given to [`process_env`].
    pub first: usize,
    pub second: usize,
}

/// A rank's process environment, from the `env` of each of its groups (in creation order,
/// `node_env` applied): for [`PROCESS_LISTS`] the union of the groups that set them
/// ([`unite_device_lists`]), for every other key the value all its groups agree on (keys
/// some group leaves out or sets differently are applied per group instead).
pub fn process_env(envs: &[&BTreeMap<String, String>]) -> std::result::Result<BTreeMap<String, String>, EnvConflict> {
    let Some((first, rest)) = envs.split_first() else { return Ok(BTreeMap::new()) };
    let mut out: BTreeMap<String, String> = first
        .iter()
        .filter(|(k, v)| !PROCESS_LISTS.contains(&k.as_str()) && rest.iter().all(|e| e.get(*k) == Some(v)))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    for key in PROCESS_LISTS {
        let (pos, lists): (Vec<usize>, Vec<&str>) =
            envs.iter().enumerate().filter_map(|(i, e)| e.get(key).map(|v| (i, v.as_str()))).unzip();
        match unite_device_lists(&lists) {
            Ok(Some(v)) => {
                out.insert(key.to_string(), v);
            }
            Ok(None) => {}
            Err((i, j)) => return Err(EnvConflict { key: key.to_string(), first: pos[i], second: pos[j] }),
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(kv: &[(&str, &str)]) -> BTreeMap<String, String> {
        kv.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    #[test]
    fn device_lists_unite_in_first_seen_order_without_duplicates_keeping_their_prefix() {
        let u = |l: &[&str]| unite_device_lists(l);
        assert_eq!(u(&[]), Ok(None));
        assert_eq!(u(&["=mlx5_0:1"]), Ok(Some("=mlx5_0:1".into())));
        assert_eq!(u(&["=mlx5_0:1", "=mlx5_1:1"]), Ok(Some("=mlx5_0:1,mlx5_1:1".into())));
        assert_eq!(u(&["=mlx5_1:1,mlx5_0:1", "=mlx5_0:1,mlx5_2:1", "=mlx5_1:1"]), Ok(Some("=mlx5_1:1,mlx5_0:1,mlx5_2:1".into())));
        assert_eq!(u(&["eth", "eth0, ,eth", "ib"]), Ok(Some("eth,eth0,ib".into())), "prefix matching, spaces and empty entries");
        // Exclusions: the process may use what any group allows, so it excludes only what
        // every group excludes; nothing in common leaves NCCL's default (every device).
        assert_eq!(u(&["^mlx5_2,mlx5_3", "^mlx5_3,mlx5_2,mlx5_4"]), Ok(Some("^mlx5_2,mlx5_3".into())));
        assert_eq!(u(&["^=docker0,lo", "^=lo"]), Ok(Some("^=lo".into())));
        assert_eq!(u(&["^=mlx5_0", "^=mlx5_1"]), Ok(None));
    }

    #[test]
    fn device_lists_of_different_kinds_contradict() {
        let u = |l: &[&str]| unite_device_lists(l);
        assert_eq!(u(&["=mlx5_0:1", "mlx5_1:1"]), Err((0, 1)), "exact vs prefix matching");
        assert_eq!(u(&["mlx5_0", "^mlx5_1"]), Err((0, 1)), "inclusion vs exclusion");
        assert_eq!(u(&["=eth0", "^=eth1"]), Err((0, 1)));
        assert_eq!(u(&["^eth0", "^=eth1"]), Err((0, 1)));
        assert_eq!(u(&["=a", "=b", "c"]), Err((0, 2)), "the first list that differs is named");
    }

    #[test]
    fn a_process_gets_the_union_of_device_lists_and_the_other_settings_its_groups_agree_on() {
        let tp = env(&[("NCCL_P2P_DISABLE", "0"), ("NCCL_P2P_LEVEL", "NVL")]);
        let ib = env(&[("NCCL_NET", "IB"), ("NCCL_IB_HCA", "=mlx5_0:1"), ("NCCL_P2P_DISABLE", "0")]);
        let ib2 = env(&[("NCCL_NET", "IB"), ("NCCL_IB_HCA", "=mlx5_1:1,mlx5_0:1"), ("NCCL_P2P_DISABLE", "0")]);
        let sock = env(&[("NCCL_NET", "Socket"), ("NCCL_SOCKET_IFNAME", "=eth0"), ("NCCL_P2P_DISABLE", "0")]);
        let got = process_env(&[&tp, &ib, &ib2, &sock]).unwrap();
        assert_eq!(
            got,
            env(&[("NCCL_IB_HCA", "=mlx5_0:1,mlx5_1:1"), ("NCCL_SOCKET_IFNAME", "=eth0"), ("NCCL_P2P_DISABLE", "0")]),
            "NCCL_NET and NCCL_P2P_LEVEL differ between groups: set per group"
        );
        assert_eq!(process_env(&[]).unwrap(), BTreeMap::new());
        let bad = env(&[("NCCL_IB_HCA", "^mlx5_0:1")]);
        assert_eq!(process_env(&[&tp, &ib, &bad]), Err(EnvConflict { key: "NCCL_IB_HCA".into(), first: 1, second: 2 }));
    }

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
