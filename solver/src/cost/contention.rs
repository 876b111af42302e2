//! Flows that share a node's NIC (docs/network.md, "Contention in the cost model").
//!
//! The dynamic-network paper's eq. 7 bounds the flows on a link at any time by its bandwidth:
//! `sum_{c in C(t, link)} rate(c) <= B_link`. The cost model divides a NIC's bandwidth equally
//! over the flows that cross it in one phase, and a flow runs at its slowest share along its
//! path, so its time is its lone time times the largest number of flows on any NIC it crosses.
//!
//! Where a replica's GPUs are is the packing the cost model already assumes
//! (`CostModel::hop_times`): consecutive stages of one class share a node while they fit, a
//! stage larger than a node has nodes of its own. Every stage of a replica therefore sits in one
//! *node group* (one node, or the whole nodes of a large stage), and every node of a group
//! carries the same flows, so counting flows per group is counting them per NIC, in O(stages).
//!
//! The phases, as `CostModel::replica_time` prices them:
//! - the pipeline (warm-up, steady 1F1B, cool-down): the latency term (a micro-batch's trip,
//!   the warm-up and cool-down) and the period (steady state) use one time per hop. In steady
//!   1F1B every hop carries a micro-batch each way every period, hops of one parity in one half
//!   of the cycle and the others in the other half (`hop_shares`); warm-up and cool-down use
//!   the same hops and are priced with the steady state's shares. A hop's activations and
//!   gradients leave the two ends of one node's NIC in opposite directions, so counting hops
//!   per NIC counts flows per direction of a full-duplex NIC.
//! - the gradient sync after the last backward pass: every stage's ring that crosses a NIC is
//!   a concurrent flow on the NICs of its stage's nodes (rings of stages packed into one node
//!   share its NIC; in a uniform plan each replica packs alike, so one replica's count is every
//!   node's).
//!
//! Hops and rings are not in one phase: the cost model starts the sync after the pipeline.

use crate::cost::{CostModel, Rings, StageKind, SyncContext};
use crate::hardware::Cluster;

/// The node group (an ordinal inside the replica) of every stage of a replica with stages
/// `kinds`, packed as `CostModel::hop_times` assumes.
pub(crate) fn node_groups(cluster: &Cluster, kinds: &[StageKind]) -> Vec<usize> {
    let mut node = Vec::with_capacity(kinds.len());
    let (mut ordinal, mut used) = (0usize, 0u32);
    for (i, k) in kinds.iter().enumerate() {
        let gpn = cluster.classes[k.class].gpus_per_node;
        let g = k.dp * k.tp;
        let run_starts = i == 0 || kinds[i - 1].class != k.class;
        if run_starts || used + g > gpn {
            ordinal += 1;
            used = 0;
        }
        node.push(ordinal);
        // A stage larger than a node fills whole nodes: the next one starts afresh.
        used = if g > gpn { gpn } else { used + g };
    }
    node
}

/// Per hop of a replica, the number of the replica's concurrent pipeline flows on the most
/// loaded NIC the hop crosses (1 for a hop inside a node). `same_node[i]`: hop i stays inside
/// a node (`same_node_hops`).
///
/// In steady 1F1B neighbouring stages are in opposite halves of the cycle (one runs a forward
/// while the next runs a backward), and hop i carries its activations (sent after stage i's
/// forward) and its gradients (sent after stage i+1's backward) in the same half: the one of
/// the parity of i. So hops of one parity run at once and never with those of the other: the
/// two hops of a stage alone in its node take turns, while the hops in and out of a node
/// holding an even number of stages (a hop's neighbours two apart in parity) meet on its NIC.
pub(crate) fn hop_shares(groups: &[usize], same_node: &[bool]) -> Vec<f64> {
    let mut load = vec![[0u32; 2]; groups.last().map_or(0, |g| g + 1)];
    for (i, &same) in same_node.iter().enumerate() {
        if !same {
            load[groups[i]][i % 2] += 1;
            load[groups[i + 1]][i % 2] += 1;
        }
    }
    same_node
        .iter()
        .enumerate()
        .map(|(i, &same)| if same { 1.0 } else { load[groups[i]][i % 2].max(load[groups[i + 1]][i % 2]) as f64 })
        .collect()
}

/// Per stage of a replica, the number of concurrent gradient rings on the NICs its own ring
/// crosses (1 for a ring that stays inside a node, or that there is not). `nic[i]`: stage i's
/// ring crosses a NIC.
pub(crate) fn ring_shares(groups: &[usize], nic: &[bool]) -> Vec<f64> {
    let mut load = vec![0u32; groups.last().map_or(0, |g| g + 1)];
    for (&g, &n) in groups.iter().zip(nic) {
        load[g] += n as u32;
    }
    groups.iter().zip(nic).map(|(&g, &n)| if n { load[g] as f64 } else { 1.0 }).collect()
}

impl CostModel<'_> {
    /// Members of the gradient ring of a stage of kind `k` (`sync_time`).
    pub(crate) fn ring_members(&self, ctx: &SyncContext, k: StageKind) -> u32 {
        match ctx.rings {
            // Stage i of every replica: exactly R * d_i members.
            Rings::PerStage { .. } => ctx.replicas * k.dp,
            // The members of a layer's ring depend on the other replicas' stages.
            Rings::Shared { .. } => ctx.replicas - 1 + k.dp,
        }
    }

    /// Per stage of a replica with stages `kinds`, how many gradient rings share the busiest
    /// NIC its ring crosses in the sync phase (eq. 7: its ring gets that fraction of the NIC).
    pub fn ring_contention(&self, ctx: &SyncContext, kinds: &[StageKind]) -> Vec<f64> {
        let groups = node_groups(self.cluster, kinds);
        let nic: Vec<bool> = kinds.iter().map(|&k| self.ring_members(ctx, k) > 1 && self.ring_link(ctx, k).1).collect();
        ring_shares(&groups, &nic)
    }

    /// Per stage of a replica, seconds of gradient all-reduce per parameter of the stage, NIC
    /// sharing included (what `replica_time` charges: `params * coefficient`).
    pub fn sync_coefficients(&self, ctx: &SyncContext, kinds: &[StageKind]) -> Vec<f64> {
        let shares = self.ring_contention(ctx, kinds);
        kinds.iter().zip(shares).map(|(&k, s)| self.sync_time(ctx, k, 1.0) * s).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hops_of_one_parity_share_a_node() {
        // Three stages on three nodes: the middle stage's two hops take turns.
        assert_eq!(hop_shares(&[1, 2, 3], &[false, false]), vec![1.0, 1.0]);
        // Stages 0 and 1 in one node, stage 2 apart: one flow each side.
        assert_eq!(hop_shares(&[1, 1, 2], &[true, false]), vec![1.0, 1.0]);
        // Stages 1 and 2 in one node between two cross-node hops (0 and 2, one parity): its
        // NIC carries both at once.
        assert_eq!(hop_shares(&[1, 2, 2, 3], &[false, true, false]), vec![2.0, 1.0, 2.0]);
        // Stages 1-3 in one node: hops 0 and 3 are in opposite halves.
        assert_eq!(hop_shares(&[1, 2, 2, 2, 3], &[false, true, true, false]), vec![1.0, 1.0, 1.0, 1.0]);
        assert_eq!(hop_shares(&[1], &[]), Vec::<f64>::new());
    }

    #[test]
    fn rings_of_stages_in_one_node_share_its_nic() {
        assert_eq!(ring_shares(&[1, 1, 2], &[true, true, true]), vec![2.0, 2.0, 1.0]);
        assert_eq!(ring_shares(&[1, 1, 2], &[true, false, true]), vec![1.0, 1.0, 1.0]);
    }
}
