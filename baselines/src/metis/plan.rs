//! Metis's plan, in Metis's own JSON form (the contract of `motley-baselines metis eval --plan`):
//! `{"node_sequence": ["V100","A100"], "device_groups": [8,8,16],
//!   "strategies": [[4,2],[1,8],[2,8]], "batches": 1, "layer_partition": [0,4,8,10]}`.
//! `node_sequence` orders the GPU types over global ranks; stage s owns the next
//! `device_groups[s]` ranks, runs them as `strategies[s] = [dp, tp]`, and holds layers
//! `[layer_partition[s], layer_partition[s+1])`; the global batch runs as `batches` micro-batches.
//!
//! The form only, below the cost model: `MetisPlan::validate` (the plan checked against the
//! inputs) is in `cost.rs`, beside the pricing that starts with it. Calls nothing of the crate.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MetisPlan {
    pub node_sequence: Vec<String>,
    pub device_groups: Vec<u32>,
    pub strategies: Vec<[u32; 2]>,
    pub batches: u32,
    pub layer_partition: Vec<usize>,
}
