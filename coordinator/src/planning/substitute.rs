//! A lost replica back on other nodes (docs/keep-going.md, "Back to full strength"): when the
//! nodes a lost replica ran on stay away, a live node with enough free GPUs takes each lost
//! node's place for that replica. The plan is amended where it names the replica's GPUs (its
//! stages, and the communication groups it is in). A node of the same shape (the same GPU
//! type, NICs, RDMA domain, intra-node link and emulation) is taken first: every setting the
//! planner chose for the lost node holds there. Failing that, nodes of one other GPU type
//! (emulated where the lost ones were, and only then) take the replica with its stages and
//! layers as they were: `retyped` says so in its stages, and the job's life prices the result
//! and splits the batch again (`planning::price_amended`, `membership::split_all`).

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

/// Whether `other` may hold what `lost` held, of another shape: emulated exactly where `lost`
/// was (a real job never moves onto emulated GPUs, nor a demo onto real ones).
pub fn alike(lost: &NodeSpec, other: &NodeSpec) -> bool {
    lost.emulate.is_some() == other.emulate.is_some()
}

/// The GPUs of `replica` on each of `lost` mapped to GPUs of candidates `fits` accepts for it
/// (each lost node to one candidate, taken in name order, the same index where it is free, else
/// the lowest free); None when some lost node has no candidate. A candidate takes one lost
/// node's place at most.
pub fn places(
    plan: &PlanDocument,
    replica: u32,
    lost: &BTreeMap<String, NodeSpec>,
    candidates: &[Candidate],
    fits: impl Fn(&NodeSpec, &Candidate) -> bool,
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
            .find(|c| !taken.contains(c.name.as_str()) && c.name != node && fits(spec, c) && c.free.len() >= indices.len())?;
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

/// `plan` with every stage of `replica` computing on `gpu` (its GPUs moved to nodes of that
/// type); its prices are the old type's until the plan is priced again.
pub fn retyped(plan: &PlanDocument, replica: u32, gpu: &str) -> PlanDocument {
    let mut out = plan.clone();
    if let Some(r) = out.replicas.get_mut(replica as usize) {
        r.stages.iter_mut().for_each(|s| s.gpu = gpu.to_string());
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
        let same = |l: &NodeSpec, c: &Candidate| same_shape(l, &c.spec);
        assert_eq!(places(&plan(), 1, &lost, &unfit, same), None);
        // A fitting node: index 2 is free there, index 3 is not (taken by another job): the lowest free.
        let mut all = unfit.to_vec();
        all.push(cand("d", spec("A100-80G", "mlx5_0"), &[0, 2]));
        let moves = places(&plan(), 1, &lost, &all, same).expect("d fits");
        assert_eq!(moves, [(gpu("n1", 2), gpu("d", 2)), (gpu("n1", 3), gpu("d", 0))].into());
        // The replica of a node that is not lost: no place for it.
        assert_eq!(places(&plan(), 0, &lost, &all, same), None);

        let p = moved(&plan(), &moves);
        assert_eq!(p.replicas[1].stages[0].gpus, [gpu("d", 2), gpu("d", 0)]);
        assert_eq!(p.replicas[0], plan().replicas[0], "the other replica untouched");
        let dp = &p.comm_groups[0];
        assert_eq!(dp.gpus, [gpu("n0", 0), gpu("d", 2)]);
        assert_eq!(dp.node_env.keys().collect::<Vec<_>>(), ["d", "n0"], "n1's settings carried to d");
        assert_eq!(dp.node_env["d"]["NCCL_IB_GID_INDEX"], "3");
        assert_eq!(p.comm_groups[1], plan().comm_groups[1]);
    }

    #[test]
    fn without_a_node_of_its_shape_a_replica_takes_nodes_of_the_type_asked_never_emulated_ones_for_real() {
        let lost: BTreeMap<String, NodeSpec> = [("n1".to_string(), spec("A100-80G", "mlx5_0"))].into();
        let cand = |name: &str, spec: NodeSpec, free: &[u32]| Candidate { name: name.into(), spec, free: free.iter().copied().collect() };
        let mut emulated = spec("H100", "mlx5_0");
        emulated.emulate = serde_json::from_value(serde_json::json!({"cpu": 0.5})).unwrap();
        let all = [cand("e", emulated, &[0, 1]), cand("h", spec("H100", "eth0"), &[1, 3]), cand("v", spec("V100", "eth0"), &[0])];
        let other = |l: &NodeSpec, c: &Candidate| alike(l, &c.spec) && c.spec.gpu == "H100";
        assert_eq!(places(&plan(), 1, &lost, &all, |l, c| same_shape(l, &c.spec)), None, "no node of its shape");
        let moves = places(&plan(), 1, &lost, &all, other).expect("h fits");
        assert_eq!(moves, [(gpu("n1", 2), gpu("h", 1)), (gpu("n1", 3), gpu("h", 3))].into(), "the emulated node skipped");
        let p = retyped(&moved(&plan(), &moves), 1, "H100");
        assert!(p.replicas[1].stages.iter().all(|s| s.gpu == "H100"));
        assert_eq!(p.replicas[0], plan().replicas[0]);
        // Only the type asked for.
        let v100 = |l: &NodeSpec, c: &Candidate| alike(l, &c.spec) && c.spec.gpu == "V100";
        assert_eq!(places(&plan(), 1, &lost, &all, v100), None, "v has one GPU free, two are needed");
    }
}
