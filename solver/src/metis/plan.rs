//! Metis's plan, in Metis's own JSON form (the contract of `motley metis eval --plan`):
//! `{"node_sequence": ["V100","A100"], "device_groups": [8,8,16],
//!   "strategies": [[4,2],[1,8],[2,8]], "batches": 1, "layer_partition": [0,4,8,10]}`.
//! `node_sequence` orders the GPU types over global ranks; stage s owns the next
//! `device_groups[s]` ranks, runs them as `strategies[s] = [dp, tp]`, and holds layers
//! `[layer_partition[s], layer_partition[s+1])`; the global batch runs as `batches` micro-batches.

use serde::{Deserialize, Serialize};

use super::cost::{Layout, MetisModel};
use crate::error::{Result, SolverError};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MetisPlan {
    pub node_sequence: Vec<String>,
    pub device_groups: Vec<u32>,
    pub strategies: Vec<[u32; 2]>,
    pub batches: u32,
    pub layer_partition: Vec<usize>,
}

impl MetisPlan {
    /// Check the plan against the inputs; return its rank layout and micro-batch count.
    pub fn validate(&self, m: &MetisModel) -> Result<(Layout, u32)> {
        let bad = |f: &str, why: String| Err(SolverError::invalid(format!("plan.{f}"), why));
        let mut order = vec![];
        for (i, name) in self.node_sequence.iter().enumerate() {
            match m.profiles.type_index(&name.to_ascii_uppercase()) {
                Some(t) if m.cluster.types[t].gpus > 0 && !order.contains(&t) => order.push(t),
                _ => return bad(&format!("node_sequence[{i}]"), format!("{name} is not a GPU type of the cluster, or is repeated")),
            }
        }
        if order.len() != m.cluster.present().len() {
            return bad(
                "node_sequence",
                format!(
                    "must list every GPU type of the cluster once: {:?}",
                    m.cluster.present().iter().map(|&t| &m.profiles.types[t]).collect::<Vec<_>>()
                ),
            );
        }
        let s = self.device_groups.len();
        if s == 0 || self.strategies.len() != s || self.layer_partition.len() != s + 1 {
            return bad("device_groups", "needs one group per stage, one [dp, tp] per stage and stages + 1 layer boundaries".into());
        }
        let total: u32 = self.device_groups.iter().sum();
        if total != m.cluster.total_gpus() {
            return bad("device_groups", format!("sum to {total} GPUs but the cluster has {}", m.cluster.total_gpus()));
        }
        for (i, (g, [dp, tp])) in self.device_groups.iter().zip(&self.strategies).enumerate() {
            if dp * tp != *g || *dp == 0 {
                return bad(&format!("strategies[{i}]"), format!("dp x tp = {dp} x {tp} must equal the stage's {g} GPUs"));
            }
        }
        let l = m.settings.layers;
        let p = &self.layer_partition;
        if p[0] != 0 || p[s] != l || p.windows(2).any(|w| w[1] <= w[0]) {
            return bad("layer_partition", format!("must rise strictly from 0 to the model's {l} layers"));
        }
        let gbs = m.settings.global_batch;
        if self.batches == 0 || !gbs.is_multiple_of(self.batches) {
            return bad("batches", format!("must divide the global batch {gbs}"));
        }
        for (i, [dp, _]) in self.strategies.iter().enumerate() {
            if gbs / dp / self.batches == 0 {
                return bad(&format!("strategies[{i}]"), format!("dp {dp} x {} micro-batches exceeds the global batch", self.batches));
            }
        }
        Ok((Layout::by_type_sequence(m.cluster, &order), self.batches))
    }
}
