//! Lower bounds that let the provisioning search skip allocations without planning them.
//!
//! **Time** (aggregate compute). Under the cost model a stage of `d x t` GPUs spends at least
//! `n * b * c / (d * t)` seconds on each of its `K` micro-batches, where `c` is the least
//! GPU-seconds one sequence costs in one layer (forward + backward, + forward again with
//! recompute) on that GPU type: the roofline's compute term `k * f / (peak * efficiency)`
//! (`k` = 3, or 4 with recompute), or a measured profile's `(fwd + bwd) * tp / m` where one is
//! lower. Under 1F1B a replica lasts at least `K` times any of its stage times, so summing over
//! every GPU: `T * sum_gpus 1/c >= G * L`, plus the output head (`3 * head_flops` per
//! sequence, counted in layer equivalents). Bubbles, hops, gradient sync and the optimizer
//! step only add, so `T >= G * (L + head) / sum_i n_i g_i / c_i` for every plan of every
//! allocation.
//!
//! **Cost**: `cost = T * price / 3600 >= lower_time * price / 3600`.
//!
//! **Memory**: every parameter's fp16 weight and gradient and its fp32 Adam states live on
//! some GPU (ZeRO-1 only spreads them), so an allocation whose usable memory (after the
//! per-GPU reserve) is below `16 bytes x parameters` has no plan.

use crate::cost::PlanOptions;
use crate::model::Model;
use crate::profile::ProfileSet;

use super::offers::Offers;

const GIB: f64 = 1024.0 * 1024.0 * 1024.0;

pub struct Bounds {
    /// Per offer: sequence-layers per second one instance can do at best.
    node_rate: Vec<f64>,
    /// Sequence-layers (head included as layer equivalents) of one iteration.
    work: f64,
    /// Per offer: usable bytes of one instance.
    node_memory: Vec<f64>,
    /// Bytes of weights, gradients and optimizer states of the whole model.
    pub state_bytes: f64,
}

impl Bounds {
    pub fn new(offers: &Offers, model: &Model, profiles: &ProfileSet, opts: &PlanOptions) -> Bounds {
        let k = if opts.recompute { 4.0 } else { 3.0 };
        let node_rate = offers
            .offers
            .iter()
            .map(|o| {
                // The faster of forward and backward rates: a bound for any mix of the two.
                let (f, b) = opts.layer_flops(&o.gpu);
                let roofline = k * model.layer_fwd_flops / f.max(b);
                let measured = profiles
                    .profiles
                    .iter()
                    .filter(|p| p.gpu.eq_ignore_ascii_case(&o.gpu.name))
                    .map(|p| {
                        let ms = p.fwd_ms + p.bwd_ms + if opts.recompute { p.fwd_ms } else { 0.0 };
                        ms / 1e3 * p.tp as f64 / p.micro_batch as f64
                    })
                    .fold(f64::INFINITY, f64::min);
                o.spec.gpus_per_node as f64 / roofline.min(measured)
            })
            .collect();
        let head = 3.0 * model.head_fwd_flops / (k * model.layer_fwd_flops);
        Bounds {
            node_rate,
            work: opts.global_batch as f64 * (model.layers() as f64 + head),
            node_memory: offers
                .offers
                .iter()
                .map(|o| o.spec.gpus_per_node as f64 * (o.gpu.memory_gib - opts.reserve_gib).max(0.0) * GIB)
                .collect(),
            state_bytes: 16.0 * model.total_params(),
        }
    }

    /// No plan on `alloc` iterates faster than this (seconds).
    pub fn time(&self, alloc: &[u32]) -> f64 {
        let rate: f64 = alloc.iter().zip(&self.node_rate).map(|(&n, r)| n as f64 * r).sum();
        self.work / rate
    }

    /// Usable GPU memory of an allocation, bytes.
    pub fn memory(&self, alloc: &[u32]) -> f64 {
        alloc.iter().zip(&self.node_memory).map(|(&n, m)| n as f64 * m).sum()
    }

    /// False when the model's states alone exceed the allocation's memory.
    pub fn may_fit(&self, alloc: &[u32]) -> bool {
        self.memory(alloc) >= self.state_bytes
    }

    pub fn missing_gib(&self, alloc: &[u32]) -> f64 {
        (self.state_bytes - self.memory(alloc)) / GIB
    }
}
