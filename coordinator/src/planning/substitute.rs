//! A lost replica back on other nodes (docs/keep-going.md, "Back to full strength"): when the
//! nodes a lost replica ran on stay away, a live node of the same shape (the same GPU type,
//! NICs, RDMA domain, intra-node link and emulation) with enough free GPUs takes each lost
//! node's place for that replica. The plan is amended where it names the replica's GPUs (its
//! stages, and the communication groups it is in), so every setting the planner chose for the
//! lost node holds on its substitute; nothing is planned again.

use std::collections::{BTreeMap, BTreeSet};

use motley_contract::{GpuRef, PlanDocument};
use motley_solver::hardware::NodeSpec;

/// A live node that could take a lost one's place: its name, its cluster-file entry, and its
/// GPUs no rank holds.
#[derive(Debug, Clone)]
pub struct Candidate {
    pub name: String,
    pub spec: NodeSpec,
    pub free: BTreeSet<u32>,
}

/// Whether `other` has the shape of `lost`: what the plan's settings for a node depend on.
pub fn same_shape(lost: &NodeSpec, other: &NodeSpec) -> bool {
    let shape = |n: &NodeSpec| serde_json::json!([n.gpu, n.nics, n.rdma_domain, n.intra, n.emulate, n.pcie_switch_gbit]);
    shape(lost) == shape(other)
}

/// The GPUs of `replica` on each of `lost` mapped to GPUs of candidates (each lost node to one
/// candidate, taken in name order, the same index where it is free, else the lowest free); None
/// when some lost node has no candidate. A candidate takes one lost node's place at most.
pub fn places(
    plan: &PlanDocument,
    replica: u32,
    lost: &BTreeMap<String, NodeSpec>,
    candidates: &[Candidate],
) -> Option<BTreeMap<GpuRef, GpuRef>> {
    let r = plan.replicas.get(replica as usize)?;
    let mut used: BTreeMap<&str, Vec<u32>> = BTreeMap::new();
    for g in r.stages.iter().flat_map(|s| &s.gpus) {
        used.entry(g.node.as_str()).or_default().push(g.index);
    }
    let mut taken: BTreeSet<&str> = BTreeSet::new();
    let mut out = BTreeMap::new();
    for (node, indices) in used {
        let spec = lost.get(node)?;
        let c = candidates
            .iter()
            .find(|c| !taken.contains(c.name.as_str()) && c.name != node && same_shape(spec, &c.spec) && c.free.len() >= indices.len())?;
        taken.insert(&c.name);
        let mut free = c.free.clone();
        for &i in &indices {
            let to = if free.contains(&i) { i } else { *free.iter().next()? };
            free.remove(&to);
            out.insert(GpuRef { node: node.to_string(), index: i }, GpuRef { node: c.name.clone(), index: to });
        }
    }
    Some(out)
}

/// `plan` with every GPU `moves` names replaced (the replica's stages, every communication
/// group holding them, and each such group's per-node settings copied to the new node, and
/// dropped from the old one where none of the group's GPUs is left there).
pub fn moved(plan: &PlanDocument, moves: &BTreeMap<GpuRef, GpuRef>) -> PlanDocument {
    let mut out = plan.clone();
    let swap = |g: &mut GpuRef| {
        if let Some(to) = moves.get(g) {
            *g = to.clone();
        }
    };
    out.replicas.iter_mut().flat_map(|r| r.stages.iter_mut()).flat_map(|s| s.gpus.iter_mut()).for_each(swap);
    let nodes: BTreeMap<&str, &str> = moves.iter().map(|(from, to)| (from.node.as_str(), to.node.as_str())).collect();
    for c in &mut out.comm_groups {
        if !c.gpus.iter().any(|g| moves.contains_key(g)) {
            continue;
        }
        c.gpus.iter_mut().for_each(swap);
        for (from, to) in &nodes {
            let Some(env) = c.node_env.get(*from).cloned() else { continue };
            c.node_env.entry(to.to_string()).or_insert(env);
            // Kept for the group's GPUs still there (another replica's).
            if !c.gpus.iter().any(|g| g.node == *from) {
                c.node_env.remove(*from);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(gpu: &str, nic: &str) -> NodeSpec {
        serde_json::from_value(serde_json::json!({"name": "x", "gpu": gpu, "gpus": 4, "nics": [{"name": nic, "kind": "ib", "gbps": 200}]}))
            .unwrap()
    }

    fn gpu(node: &str, index: u32) -> GpuRef {
        GpuRef { node: node.into(), index }
    }

    fn plan() -> PlanDocument {
        let stage = |node: &str, idx: &[u32]| {
            serde_json::json!({"layers": [0, 2], "gpu": "A100-80G", "tp": idx.len(), "dp": 1,
            "gpus": idx.iter().map(|&i| serde_json::json!({"node": node, "index": i})).collect::<Vec<_>>()})
        };
        serde_json::from_value(serde_json::json!({
            "global_batch": 4, "micro_batch": 2,
            "replicas": [{"micro_batches": 1, "stages": [stage("n0", &[0])]}, {"micro_batches": 1, "stages": [stage("n1", &[2, 3])]}],
            "comm_groups": [
                {"kind": "dp", "gpus": [{"node": "n0", "index": 0}, {"node": "n1", "index": 2}], "transport": "ib",
                 "env": {"NCCL_NET": "IB"}, "node_env": {"n1": {"NCCL_IB_GID_INDEX": "3"}, "n0": {"NCCL_IB_GID_INDEX": "1"}},
                 "nccl_net": "IB", "replica": null, "stage": null, "layers": [0, 2]},
                {"kind": "tp", "gpus": [{"node": "n0", "index": 0}], "transport": "nvlink", "env": {}, "nccl_net": null,
                 "replica": 0, "stage": 0, "layers": [0, 2]}
            ]
        }))
        .unwrap()
    }

    #[test]
    fn a_lost_nodes_place_goes_to_a_free_node_of_its_shape_and_the_plan_follows() {
        let lost: BTreeMap<String, NodeSpec> = [("n1".to_string(), spec("A100-80G", "mlx5_0"))].into();
        let cand = |name: &str, spec: NodeSpec, free: &[u32]| Candidate { name: name.into(), spec, free: free.iter().copied().collect() };
        // Another GPU type, other NICs, too few free GPUs: none fits.
        let unfit = [
            cand("a", spec("H100", "mlx5_0"), &[0, 1, 2, 3]),
            cand("b", spec("A100-80G", "mlx5_9"), &[0, 1, 2, 3]),
            cand("c", spec("A100-80G", "mlx5_0"), &[1]),
        ];
        assert_eq!(places(&plan(), 1, &lost, &unfit), None);
        // A fitting node: index 2 is free there, index 3 is not (taken by another job): the lowest free.
        let mut all = unfit.to_vec();
        all.push(cand("d", spec("A100-80G", "mlx5_0"), &[0, 2]));
        let moves = places(&plan(), 1, &lost, &all).expect("d fits");
        assert_eq!(moves, [(gpu("n1", 2), gpu("d", 2)), (gpu("n1", 3), gpu("d", 0))].into());
        // The replica of a node that is not lost: no place for it.
        assert_eq!(places(&plan(), 0, &lost, &all), None);

        let p = moved(&plan(), &moves);
        assert_eq!(p.replicas[1].stages[0].gpus, [gpu("d", 2), gpu("d", 0)]);
        assert_eq!(p.replicas[0], plan().replicas[0], "the other replica untouched");
        let dp = &p.comm_groups[0];
        assert_eq!(dp.gpus, [gpu("n0", 0), gpu("d", 2)]);
        assert_eq!(dp.node_env.keys().collect::<Vec<_>>(), ["d", "n0"], "n1's settings carried to d");
        assert_eq!(dp.node_env["d"]["NCCL_IB_GID_INDEX"], "3");
        assert_eq!(p.comm_groups[1], plan().comm_groups[1]);
    }
}
