//! Measured per-layer profiles that replace the roofline estimate where present.
//!
//! File format (YAML or JSON), one entry per (GPU type, tp, micro-batch):
//! ```yaml
//! profiles:
//!   - gpu: A100-80G      # catalog or cluster-declared GPU type name
//!     tp: 2              # tensor-parallel degree the layer was measured at
//!     micro_batch: 4     # sequences per GPU per micro-batch
//!     fwd_ms: 3.1        # forward time of ONE transformer layer, including its TP all-reduces
//!     bwd_ms: 6.4        # backward time of one layer (add the forward again if recomputing)
//!     act_mib: 410       # activation memory one layer keeps per in-flight micro-batch
//! ```
//! Entries that are absent fall back to the roofline estimate of `cost.rs`.

use serde::{Deserialize, Serialize};

use crate::error::{Result, SolverError};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LayerProfile {
    pub gpu: String,
    pub tp: u32,
    pub micro_batch: u32,
    pub fwd_ms: f64,
    pub bwd_ms: f64,
    #[serde(default)]
    pub act_mib: Option<f64>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProfileSet {
    pub profiles: Vec<LayerProfile>,
}

impl ProfileSet {
    pub fn validate(&self) -> Result<()> {
        for (i, p) in self.profiles.iter().enumerate() {
            let f = |x: &str| format!("profiles[{i}].{x}");
            if p.tp == 0 || !p.tp.is_power_of_two() {
                return Err(SolverError::invalid(f("tp"), "must be a power of two"));
            }
            if p.micro_batch == 0 {
                return Err(SolverError::invalid(f("micro_batch"), "must be at least 1"));
            }
            for (n, v) in [("fwd_ms", p.fwd_ms), ("bwd_ms", p.bwd_ms)] {
                if !(v.is_finite() && v > 0.0) {
                    return Err(SolverError::invalid(f(n), "must be a positive number of milliseconds"));
                }
            }
            if let Some(a) = p.act_mib {
                if !(a.is_finite() && a >= 0.0) {
                    return Err(SolverError::invalid(f("act_mib"), "must be a non-negative number of MiB"));
                }
            }
        }
        Ok(())
    }

    pub fn lookup(&self, gpu: &str, tp: u32, micro_batch: u32) -> Option<&LayerProfile> {
        self.profiles.iter().find(|p| p.tp == tp && p.micro_batch == micro_batch && p.gpu.eq_ignore_ascii_case(gpu))
    }
}
