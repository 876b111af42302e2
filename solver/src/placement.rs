//! Where a plan's GPUs physically are.
//!
//! The cost model (`CostModel::hop_times`) packs each *run* of a replica (maximal consecutive
//! stages of one node class) into nodes in order and prices a hop as NVLink/PCIe traffic only
//! between stages packed into one node. Placement realises that packing: runs go largest first;
//! a run that fits in a node goes whole to the node of its class with the least room that still
//! holds it (best fit decreasing); a longer run fills empty nodes one after another, stage by
//! stage. Only when no such room is left does a run fall back to TP group by TP group (each
//! still inside one node). Hops the model priced inside a node that placement had to split are
//! counted and reported, never hidden.
//!
//! Also here: `CostModel::check_structure`, a plan's whole check (its layers and batch, from
//! `plan`, then whether the cluster's nodes hold it). Calls `plan`, `cost` and `hardware`.

use std::collections::BTreeSet;

use crate::cost::CostModel;
use crate::hardware::Cluster;
use crate::plan::PlanStructure;

/// A GPU: a node name and the GPU's index inside it (the plan document's type).
pub use motley_contract::plan::GpuRef as GpuId;

#[derive(Debug, Clone, PartialEq)]
pub struct Placement {
    /// Per replica and stage, the GPUs TP group by TP group (dp-major).
    pub gpus: Vec<Vec<Vec<GpuId>>>,
    /// Pipeline hops priced as inside one node whose two stages ended up on different nodes.
    pub split_hops: usize,
}

/// Place a plan; None when the cluster cannot hold it.
pub fn place(cluster: &Cluster, plan: &PlanStructure) -> Option<Placement> {
    let mut gpus: Vec<Vec<Vec<GpuId>>> = plan.replicas.iter().map(|r| vec![Vec::new(); r.stages.len()]).collect();
    let mut nodes_of: Vec<Vec<Vec<usize>>> = plan.replicas.iter().map(|r| vec![Vec::new(); r.stages.len()]).collect();
    let placed = assign(cluster, plan, |ri, si, node, start, tp| {
        let name = &cluster.nodes[node].name;
        gpus[ri][si].extend((start..start + tp).map(|index| GpuId { node: name.clone(), index }));
        nodes_of[ri][si].push(node);
    });
    if !placed {
        return None;
    }
    let mut split_hops = 0;
    for (ri, r) in plan.replicas.iter().enumerate() {
        let kinds: Vec<_> = r.stages.iter().map(|s| s.kind).collect();
        for (si, priced_intra) in crate::cost::same_node_hops(cluster, &kinds).into_iter().enumerate() {
            let first = nodes_of[ri][si][0];
            let together = nodes_of[ri][si].iter().chain(&nodes_of[ri][si + 1]).all(|&n| n == first);
            if priced_intra && !together {
                split_hops += 1;
            }
        }
    }
    Some(Placement { gpus, split_hops })
}

/// Free GPUs per node, and per class the nodes ordered by free GPUs (best fit is one range
/// query away).
struct Room {
    free: Vec<u32>,
    by_class: Vec<BTreeSet<(u32, usize)>>,
}

impl Room {
    fn new(cluster: &Cluster) -> Room {
        let mut by_class = vec![BTreeSet::new(); cluster.classes.len()];
        for (i, n) in cluster.nodes.iter().enumerate() {
            by_class[n.class].insert((n.gpus, i));
        }
        Room { free: cluster.nodes.iter().map(|n| n.gpus).collect(), by_class }
    }

    /// The node of `class` with the least free GPUs that still has `need`.
    fn best_fit(&self, class: usize, need: u32) -> Option<usize> {
        self.by_class[class].range((need, 0)..).next().map(|&(_, n)| n)
    }

    /// Take `count` GPUs of `node`; returns the index of the first.
    fn reserve(&mut self, cluster: &Cluster, class: usize, node: usize, count: u32) -> u32 {
        let f = self.free[node];
        self.by_class[class].remove(&(f, node));
        self.free[node] = f - count;
        self.by_class[class].insert((f - count, node));
        cluster.nodes[node].gpus - f
    }
}

impl<'a> CostModel<'a> {
    /// Why a plan is not a plan of this cluster and model, if it is not.
    pub fn check_structure(&self, plan: &PlanStructure) -> Result<(), String> {
        self.check_layers_and_batch(plan)?;
        if !fits(self.cluster, plan) {
            return Err("the plan needs more GPUs (whole TP groups inside one node) than the cluster has".into());
        }
        Ok(())
    }
}

/// Whether the cluster can hold the plan. When every stage of a class uses one tp, TP groups
/// are interchangeable slots (each placement uses up exactly one of a node's `gpus / tp`),
/// so counting is exact; otherwise run the placement itself.
pub(crate) fn fits(cluster: &Cluster, plan: &PlanStructure) -> bool {
    let classes = cluster.classes.len();
    let mut tp_of: Vec<Option<u32>> = vec![None; classes];
    let mut groups = vec![0u64; classes];
    for s in plan.replicas.iter().flat_map(|r| &r.stages) {
        let c = s.kind.class;
        match tp_of[c] {
            Some(t) if t != s.kind.tp => return assign(cluster, plan, |_, _, _, _, _| {}),
            _ => tp_of[c] = Some(s.kind.tp),
        }
        groups[c] += s.kind.dp as u64;
    }
    (0..classes).all(|c| {
        let slots = tp_of[c].map_or(0, |t| cluster.classes[c].nodes.len() as u64 * (cluster.classes[c].gpus_per_node / t) as u64);
        groups[c] <= slots
    })
}

/// The placement algorithm; `on_group(replica, stage, node, first GPU index, tp)` is called
/// once per TP group. False when some TP group finds no node with room.
pub(crate) fn assign(cluster: &Cluster, plan: &PlanStructure, mut on_group: impl FnMut(usize, usize, usize, u32, u32)) -> bool {
    let mut room = Room::new(cluster);
    // Runs: (replica, first stage, end stage, class, GPUs needed).
    let mut runs: Vec<(usize, usize, usize, usize, u32)> = vec![];
    for (ri, r) in plan.replicas.iter().enumerate() {
        let mut s0 = 0;
        while s0 < r.stages.len() {
            let class = r.stages[s0].kind.class;
            let mut s1 = s0;
            let mut need = 0;
            while s1 < r.stages.len() && r.stages[s1].kind.class == class {
                need += r.stages[s1].kind.dp * r.stages[s1].kind.tp;
                s1 += 1;
            }
            runs.push((ri, s0, s1, class, need));
            s0 = s1;
        }
    }
    runs.sort_by_key(|r| std::cmp::Reverse(r.4)); // stable: ties keep plan order
    for (ri, s0, s1, class, need) in runs {
        let gpn = cluster.classes[class].gpus_per_node;
        // A run that fits in a node goes whole to the best-fitting one; a longer run fills
        // empty nodes stage by stage. `current` is the node being filled.
        let mut current = if need <= gpn { room.best_fit(class, need) } else { None };
        for (k, s) in plan.replicas[ri].stages[s0..s1].iter().enumerate() {
            let g = s.kind.dp * s.kind.tp;
            if need > gpn && g <= gpn && current.is_none_or(|n| room.free[n] < g) {
                current = room.best_fit(class, gpn); // an empty node
            }
            for _ in 0..s.kind.dp {
                let node = match current {
                    Some(n) if g <= gpn && room.free[n] >= s.kind.tp => n,
                    // No room where the cost model expects it: any node that holds the TP group.
                    _ => match room.best_fit(class, s.kind.tp) {
                        Some(n) => n,
                        None => return false,
                    },
                };
                let start = room.reserve(cluster, class, node, s.kind.tp);
                on_group(ri, s0 + k, node, start, s.kind.tp);
            }
        }
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cost::StageKind;
    use crate::hardware::{ClusterSpec, NodeSpec};
    use crate::plan::{ReplicaPlan, StagePlan};

    fn cluster(nodes: u32, gpus: u32) -> Cluster {
        let node = NodeSpec {
            name: "n".into(),
            count: Some(nodes),
            gpu: "A100-40G".into(),
            gpus,
            intra: None,
            nics: vec![],
            rdma_domain: None,
            spot: false,
            price_per_gpu_hour: None,
            pcie_switch_gbit: None,
            emulate: None,
        };
        Cluster::from_spec(&ClusterSpec { name: "t".into(), nodes: vec![node], gpu_types: vec![] }).unwrap()
    }

    fn replica(stages: u32, dp: u32) -> ReplicaPlan {
        ReplicaPlan {
            stages: (0..stages).map(|i| StagePlan { kind: StageKind { class: 0, tp: 1, dp }, layers: (i, i + 1) }).collect(),
            micro_batches: 1,
        }
    }

    #[test]
    fn whole_runs_go_to_one_node_when_they_can() {
        // Three nodes of 8: replicas of 5, 5 and 3 GPUs. First fit in plan order would split
        // the third replica; best fit decreasing keeps every replica inside one node.
        let c = cluster(3, 8);
        let plan = PlanStructure { micro_batch: 1, replicas: vec![replica(3, 1), replica(5, 1), replica(5, 1)] };
        let p = place(&c, &plan).unwrap();
        assert_eq!(p.split_hops, 0);
        for r in &p.gpus {
            let first = &r[0][0].node;
            assert!(r.iter().flatten().all(|g| &g.node == first));
        }
        let mut all: Vec<(String, u32)> = p.gpus.iter().flatten().flatten().map(|g| (g.node.clone(), g.index)).collect();
        let n = all.len();
        all.sort();
        all.dedup();
        assert_eq!(all.len(), n, "no GPU twice");
    }

    #[test]
    fn split_hops_are_counted_when_packing_cannot_keep_them() {
        // Two nodes of 4, replicas of 3, 3 and 2 single-GPU stages: the last must straddle.
        let c = cluster(2, 4);
        let plan = PlanStructure { micro_batch: 1, replicas: vec![replica(3, 1), replica(3, 1), replica(2, 1)] };
        let p = place(&c, &plan).unwrap();
        assert!(p.split_hops >= 1);
    }

    #[test]
    fn refuses_what_does_not_fit() {
        let c = cluster(1, 4);
        let plan = PlanStructure { micro_batch: 1, replicas: vec![replica(5, 1)] };
        assert!(place(&c, &plan).is_none());
    }
}
