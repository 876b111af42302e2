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
//!     # Optional, written by `python -m motley_torch.profile`:
//!     blocks:            # n consecutive layers timed together (AutoHet eq. 5): a stage of
//!       - {layers: 1, fwd_ms: 3.2, bwd_ms: 6.6}   # n layers costs the blocks of n's binary
//!       - {layers: 8, fwd_ms: 24.9, bwd_ms: 51.0} # decomposition (7 = 4 + 2 + 1)
//!     embed_fwd_ms: 0.4  # the embedding (first stage) and the final norm, head and loss
//!     embed_bwd_ms: 0.5  # (last stage), per micro-batch
//!     head_fwd_ms: 2.0
//!     head_bwd_ms: 4.1
//!     optimizer_ms: 0.3  # the optimizer step per layer (timed over eight layers at once)
//!     fixed_mib: 1536    # parameters, gradients and optimizer state of one layer's shard
//!     model: gpt3-1.3b   # what was measured: the model (and a hash of its spec), sequence
//!     model_hash: 5f...  # length, data type, torch version and device
//!     seq_len: 2048
//!     dtype: bf16
//!     torch: 2.15.0
//!     device: NVIDIA A100-SXM4-80GB
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
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub blocks: Vec<LayerBlock>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub embed_fwd_ms: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub embed_bwd_ms: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub head_fwd_ms: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub head_bwd_ms: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub optimizer_ms: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fixed_mib: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model_hash: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seq_len: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dtype: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub torch: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device: Option<String>,
}

/// `layers` consecutive layers (a power of two, at most 8) timed together.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LayerBlock {
    pub layers: u32,
    pub fwd_ms: f64,
    pub bwd_ms: f64,
}

/// Block sizes AutoHet's eq. 5 measures.
pub const BLOCK_SIZES: [u32; 4] = [1, 2, 4, 8];

impl LayerProfile {
    /// A profile of only the per-layer times (blocks and extras absent).
    pub fn per_layer(gpu: &str, tp: u32, micro_batch: u32, fwd_ms: f64, bwd_ms: f64, act_mib: Option<f64>) -> LayerProfile {
        LayerProfile {
            gpu: gpu.into(),
            tp,
            micro_batch,
            fwd_ms,
            bwd_ms,
            act_mib,
            blocks: vec![],
            embed_fwd_ms: None,
            embed_bwd_ms: None,
            head_fwd_ms: None,
            head_bwd_ms: None,
            optimizer_ms: None,
            fixed_mib: None,
            model: None,
            model_hash: None,
            seq_len: None,
            dtype: None,
            torch: None,
            device: None,
        }
    }

    /// Forward and backward ms of each block size of `BLOCK_SIZES`: the measured block, or
    /// that many times the per-layer time where the block was not measured.
    pub fn block_ms(&self) -> [(f64, f64); 4] {
        BLOCK_SIZES.map(|n| match self.blocks.iter().find(|b| b.layers == n) {
            Some(b) => (b.fwd_ms, b.bwd_ms),
            None => (n as f64 * self.fwd_ms, n as f64 * self.bwd_ms),
        })
    }
}

/// Seconds of `n` consecutive layers from block times (AutoHet eq. 5): as many 8-blocks as fit,
/// then the blocks of the remainder's binary digits (7 = 4 + 2 + 1). `block_s[i]` is the time
/// of `BLOCK_SIZES[i]` layers.
pub fn layers_time(block_s: &[f64; 4], n: u32) -> f64 {
    let mut t = (n / 8) as f64 * block_s[3];
    for (i, bit) in [1u32, 2, 4].iter().enumerate() {
        if (n % 8) & bit != 0 {
            t += block_s[i];
        }
    }
    t
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
            for (n, v) in [("act_mib", p.act_mib), ("fixed_mib", p.fixed_mib)] {
                if v.is_some_and(|a| !(a.is_finite() && a >= 0.0)) {
                    return Err(SolverError::invalid(f(n), "must be a non-negative number of MiB"));
                }
            }
            let extras = [
                ("embed_fwd_ms", p.embed_fwd_ms),
                ("embed_bwd_ms", p.embed_bwd_ms),
                ("head_fwd_ms", p.head_fwd_ms),
                ("head_bwd_ms", p.head_bwd_ms),
                ("optimizer_ms", p.optimizer_ms),
            ];
            for (n, v) in extras {
                if v.is_some_and(|x| !(x.is_finite() && x >= 0.0)) {
                    return Err(SolverError::invalid(f(n), "must be a non-negative number of milliseconds"));
                }
            }
            for (j, b) in p.blocks.iter().enumerate() {
                let g = |x: &str| f(&format!("blocks[{j}].{x}"));
                if !BLOCK_SIZES.contains(&b.layers) {
                    return Err(SolverError::invalid(g("layers"), "must be 1, 2, 4 or 8 (AutoHet eq. 5 blocks)"));
                }
                for (n, v) in [("fwd_ms", b.fwd_ms), ("bwd_ms", b.bwd_ms)] {
                    if !(v.is_finite() && v > 0.0) {
                        return Err(SolverError::invalid(g(n), "must be a positive number of milliseconds"));
                    }
                }
            }
        }
        Ok(())
    }

    pub fn lookup(&self, gpu: &str, tp: u32, micro_batch: u32) -> Option<&LayerProfile> {
        self.profiles.iter().find(|p| p.tp == tp && p.micro_batch == micro_batch && p.gpu.eq_ignore_ascii_case(gpu))
    }

    /// The profile that prices `sequences` per GPU per micro-batch of a `gpu` at `tp`, and the
    /// factor its per-micro-batch times and activations scale by: the entry measured at that
    /// many sequences (factor 1), else the entry of the same type and TP degree measured
    /// nearest (by ratio), its times scaled linearly by `sequences / micro_batch`. A type that
    /// was measured at all is never priced at its catalog peak: on an emulated cluster the
    /// peak is a thousand times the measured speed, and on a real one it is the efficiency
    /// the measurement was made to replace. Linear is the stated assumption (a pass's work is
    /// linear in its sequences; a GPU at fewer sequences may run below it, so scaling down
    /// errs fast).
    pub fn lookup_scaled(&self, gpu: &str, tp: u32, sequences: f64) -> Option<(&LayerProfile, f64)> {
        if sequences.fract() == 0.0 {
            if let Some(p) = self.lookup(gpu, tp, sequences as u32) {
                return Some((p, 1.0));
            }
        }
        let distance = |p: &LayerProfile| (sequences / f64::from(p.micro_batch)).ln().abs();
        self.profiles
            .iter()
            .filter(|p| p.tp == tp && p.micro_batch > 0 && p.gpu.eq_ignore_ascii_case(gpu))
            .min_by(|a, b| distance(a).total_cmp(&distance(b)).then(b.micro_batch.cmp(&a.micro_batch)))
            .map(|p| (p, sequences / f64::from(p.micro_batch)))
    }
}

#[cfg(test)]
mod block_tests {
    use super::*;

    #[test]
    fn a_layer_count_costs_the_blocks_of_its_binary_digits() {
        let blocks = [1.0, 1.9, 3.7, 7.2];
        assert_eq!(layers_time(&blocks, 0), 0.0);
        assert_eq!(layers_time(&blocks, 1), 1.0);
        assert_eq!(layers_time(&blocks, 3), 2.9);
        assert_eq!(layers_time(&blocks, 7), 3.7 + 1.9 + 1.0);
        assert_eq!(layers_time(&blocks, 8), 7.2);
        assert_eq!(layers_time(&blocks, 21), 2.0 * 7.2 + 3.7 + 1.0);
        let mut p = LayerProfile::per_layer("A100", 1, 1, 2.0, 4.0, None);
        assert_eq!(p.block_ms()[3], (16.0, 32.0), "an unmeasured block is per-layer times its size");
        p.blocks.push(LayerBlock { layers: 8, fwd_ms: 12.0, bwd_ms: 30.0 });
        assert_eq!(p.block_ms(), [(2.0, 4.0), (4.0, 8.0), (8.0, 16.0), (12.0, 30.0)]);
    }

    #[test]
    fn blocks_and_extras_are_checked_by_name() {
        let text = "profiles:\n  - {gpu: A100, tp: 1, micro_batch: 1, fwd_ms: 1, bwd_ms: 2, blocks: [{layers: 3, fwd_ms: 1, bwd_ms: 1}]}\n";
        let set: ProfileSet = serde_norway::from_str(text).unwrap();
        let e = set.validate().unwrap_err().to_string();
        assert!(e.contains("profiles[0].blocks[0].layers"), "{e}");
        let text = "profiles:\n  - {gpu: A100, tp: 1, micro_batch: 1, fwd_ms: 1, bwd_ms: 2, head_fwd_ms: -1, torch: '2.15.0'}\n";
        let set: ProfileSet = serde_norway::from_str(text).unwrap();
        assert!(set.validate().unwrap_err().to_string().contains("profiles[0].head_fwd_ms"));
    }
}
