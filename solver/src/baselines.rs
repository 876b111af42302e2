//! The planners Motley is compared with, priced by the same cost model.
//!
//! * `megatron`: Megatron-LM's symmetric 3D parallelism. Every replica has `pp` stages of one
//!   `tp` group each and the same share of the batch; layers are split equally (`pp` must
//!   divide the layer count); GPUs are taken in node order with Megatron's rank order (tp
//!   fastest, then dp, then pp), so a stage gets whatever GPU type sits at its ranks.
//! * `whale`: Whale's heterogeneity-aware data parallelism on the same grid: each replica's
//!   share of the batch is proportional to its GPUs' peak FLOPS, and each stage's share of
//!   the layers is proportional to its GPU memory.
//! * `fast-only`: what a user of DDP, torchtitan or Megatron-LM does on a mixed cluster today:
//!   Megatron's symmetric plan on the GPUs of the fastest type alone (the highest peak for the
//!   run's precision; the most GPUs on a tie), every other GPU left idle.
//!
//! Each baseline is the best such plan over tp, pp and micro-batch size.

use crate::cost::{CostModel, StageKind};
use crate::plan::{PlanStructure, ReplicaPlan, StagePlan};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Baseline {
    Megatron,
    Whale,
    FastOnly,
}

impl Baseline {
    /// Every baseline, in the order reports list them.
    pub const ALL: [Baseline; 3] = [Baseline::Megatron, Baseline::Whale, Baseline::FastOnly];

    /// The name the plan document and `motley plan --baseline` use.
    pub fn name(self) -> &'static str {
        match self {
            Baseline::Megatron => "megatron",
            Baseline::Whale => "whale",
            Baseline::FastOnly => "fast-only",
        }
    }
}

/// The class of the fastest GPU type: the highest peak for the run's precision, the most GPUs
/// on a tie (then the first class).
fn fastest_class(cm: &CostModel) -> Option<usize> {
    let peak = |c: usize| {
        let g = &cm.cluster.classes[c].gpu;
        g.peak_tflops(cm.opts.precision).unwrap_or(g.tflops)
    };
    let gpus = |c: usize| cm.cluster.classes[c].nodes.len() as u32 * cm.cluster.classes[c].gpus_per_node;
    (0..cm.cluster.classes.len()).reduce(|best, c| {
        let (pb, pc) = (peak(best), peak(c));
        if pc > pb || (pc == pb && gpus(c) > gpus(best)) {
            c
        } else {
            best
        }
    })
}

/// Best plan of a baseline and its iteration time, if any of its plans fits.
pub fn best_baseline(cm: &CostModel, which: Baseline) -> Option<(f64, PlanStructure)> {
    let cluster = cm.cluster;
    let l = cm.model.layers();
    let fastest = if which == Baseline::FastOnly { Some(fastest_class(cm)?) } else { None };
    let nodes: Vec<_> = cluster.nodes.iter().filter(|n| fastest.is_none_or(|c| n.class == c)).collect();
    let total: u32 = nodes.iter().map(|n| n.gpus).sum();
    let mut best: Option<(f64, PlanStructure)> = None;
    let max_gpn = nodes.iter().map(|n| n.gpus).max().unwrap_or(1);
    for tp in (0..8).map(|i| 1u32 << i).filter(|&t| t <= max_gpn && cm.model.spec.heads.is_multiple_of(t)) {
        if cm.opts.tp.is_some_and(|t| t != tp) {
            continue;
        }
        // TP groups in node order; a node whose GPU count tp does not divide leaves a remainder idle.
        let groups: Vec<usize> = nodes.iter().flat_map(|n| std::iter::repeat_n(n.class, (n.gpus / tp) as usize)).collect();
        let symmetric = which != Baseline::Whale;
        for pp in 1..=l.min(total / tp) {
            if (symmetric && !l.is_multiple_of(pp)) || (cm.opts.max_stages > 0 && pp > cm.opts.max_stages) {
                continue;
            }
            let max_r = groups.len() as u32 / pp;
            // Largest first: on a tie the first is kept, as in the search (`search::search_in`).
            let largest = crate::search::MAX_SEARCHED_MICRO_BATCH;
            let sizes = cm.opts.micro_batch.map_or_else(|| (0..=largest.ilog2()).rev().map(|i| 1u32 << i).collect(), |b| vec![b]);
            for b in sizes {
                if !cm.opts.global_batch.is_multiple_of(b) {
                    continue;
                }
                let n = cm.opts.global_batch / b;
                let r = match which {
                    Baseline::Megatron | Baseline::FastOnly => (1..=max_r.min(n)).rev().find(|r| n.is_multiple_of(*r)),
                    Baseline::Whale => Some(max_r.min(n)).filter(|&r| r > 0),
                };
                let Some(r) = r else { continue };
                let plan = grid_plan(cm, which, &groups, tp, pp, r, b);
                if cm.check_structure(&plan).is_err() {
                    continue;
                }
                let e = cm.evaluate(&plan);
                if e.fits && best.as_ref().is_none_or(|x| e.iteration_time < x.0) {
                    best = Some((e.iteration_time, plan));
                }
            }
        }
    }
    best
}

fn grid_plan(cm: &CostModel, which: Baseline, groups: &[usize], tp: u32, pp: u32, r: u32, b: u32) -> PlanStructure {
    let l = cm.model.layers();
    let n = cm.opts.global_batch / b;
    let class_of = |rep: u32, stage: u32| groups[(stage * r + rep) as usize];
    let weights = |f: &dyn Fn(usize) -> f64, rep: u32| -> Vec<f64> { (0..pp).map(|s| f(class_of(rep, s))).collect() };
    let mem = |c: usize| cm.cluster.classes[c].gpu.memory_gib;
    let flops = |c: usize| {
        let g = &cm.cluster.classes[c].gpu;
        g.peak_tflops(cm.opts.precision).unwrap_or(g.tflops)
    };
    let shares: Vec<u32> = match which {
        Baseline::Megatron | Baseline::FastOnly => vec![n / r; r as usize],
        Baseline::Whale => {
            let speed: Vec<f64> = (0..r).map(|rep| weights(&flops, rep).iter().sum()).collect();
            proportional(n, &speed)
        }
    };
    let replicas = (0..r)
        .map(|rep| {
            let layers: Vec<u32> = match which {
                Baseline::Megatron | Baseline::FastOnly => vec![l / pp; pp as usize],
                Baseline::Whale => proportional(l, &weights(&mem, rep)),
            };
            let mut start = 0;
            let stages = (0..pp)
                .map(|s| {
                    let n = layers[s as usize];
                    start += n;
                    StagePlan { kind: StageKind { class: class_of(rep, s), tp, dp: 1 }, layers: (start - n, start) }
                })
                .collect();
            ReplicaPlan { stages, micro_batches: shares[rep as usize] }
        })
        .collect();
    PlanStructure { micro_batch: b, replicas }
}

/// Split `total` into parts proportional to `w`, each at least 1 (largest remainder).
pub fn proportional(total: u32, w: &[f64]) -> Vec<u32> {
    let k = w.len() as u32;
    assert!(k > 0 && total >= k);
    let sum: f64 = w.iter().sum();
    let free = (total - k) as f64;
    let exact: Vec<f64> = w.iter().map(|x| free * x / sum).collect();
    let mut parts: Vec<u32> = exact.iter().map(|x| x.floor() as u32 + 1).collect();
    let mut left = total - parts.iter().sum::<u32>();
    let mut order: Vec<usize> = (0..w.len()).collect();
    order.sort_by(|&a, &b| (exact[b] - exact[b].floor()).total_cmp(&(exact[a] - exact[a].floor())));
    for &i in order.iter().cycle() {
        if left == 0 {
            break;
        }
        parts[i] += 1;
        left -= 1;
    }
    parts
}
