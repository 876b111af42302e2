//! The search space: configurations (tp, micro-batch), shape stage lists, and the shapes of
//! each configuration with their layer splits.

use std::collections::HashMap;

use super::shapes::{Shape, ShapeBuilder};
use super::{Config, SearchMode};
use crate::cost::{CostModel, StageKind};

const EXACT_SPLIT_LIMIT: u64 = 2000;
const FAST_SPLIT_LIMIT: u64 = 64;
const FAST_SHAPES: usize = 12;
/// Fast mode's narrower space: micro-batches up to 4, stage dp up to 2, at most two node
/// classes per replica.
const FAST_MAX_MICRO_BATCH: u32 = 4;
/// The exact space's largest micro-batch: one GPU's whole batch of a small model in one pass
/// (32 sequences of 512 tokens ran 2.9x faster than 4 micro-batches of 8 on an H200,
/// BENCHMARKS.md); memory bounds it where it does not fit.
pub const MAX_SEARCHED_MICRO_BATCH: u32 = 32;
const FAST_MAX_STAGE_DP: u32 = 2;
const FAST_MAX_CLASSES_PER_REPLICA: usize = 2;
/// Fast mode's greedy layer splits: bottlenecks up to this factor above the smallest.
const FAST_MAX_BOTTLENECK_RATIO: f64 = 1.5;

/// Tensor-parallel degrees and micro-batch sizes the search tries.
pub(super) fn configurations(cm: &CostModel, mode: SearchMode) -> Vec<Config> {
    let max_gpn = cm.cluster.classes.iter().map(|c| c.gpus_per_node).max().unwrap_or(1);
    tp_micro_batch_space(cm.model.spec.heads, max_gpn, cm.opts, mode)
        .into_iter()
        .map(|(tp, b)| Config { tp, micro_batch: b, micro_batches: cm.opts.global_batch / b })
        .collect()
}

/// The (tp, micro-batch) pairs a search in `mode` tries for a model of `heads` heads on nodes
/// of at most `max_gpus_per_node` GPUs: tp a power of two dividing the heads and fitting a
/// node, micro-batches powers of two to 32 (4 in fast mode) dividing the global batch, or what
/// `opts` pins.
/// (The coordinator asks agents to profile exactly these.) Where two sizes price the same, the
/// search keeps the larger (`search_in`'s order).
pub fn tp_micro_batch_space(heads: u32, max_gpus_per_node: u32, opts: &crate::cost::PlanOptions, mode: SearchMode) -> Vec<(u32, u32)> {
    let tps: Vec<u32> = match opts.tp {
        Some(t) => vec![t],
        None => (0..8).map(|i| 1u32 << i).filter(|&t| t <= max_gpus_per_node && heads.is_multiple_of(t)).collect(),
    };
    let b_max = if mode == SearchMode::Fast { FAST_MAX_MICRO_BATCH } else { MAX_SEARCHED_MICRO_BATCH };
    let bs: Vec<u32> = match opts.micro_batch {
        Some(b) => vec![b],
        None => (0..6).map(|i| 1u32 << i).filter(|&b| b <= b_max && opts.global_batch.is_multiple_of(b)).collect(),
    };
    tps.iter().flat_map(|&tp| bs.iter().filter(|&&b| opts.global_batch.is_multiple_of(b)).map(move |&b| (tp, b))).collect()
}

/// The (tp, micro-batch) pairs of the exact space, for the oracle.
pub fn configurations_for_oracle(cm: &CostModel) -> Vec<(u32, u32)> {
    configurations(cm, SearchMode::Exact).iter().map(|c| (c.tp, c.micro_batch)).collect()
}

/// Longest pipeline worth trying: enough stages for the tightest class to hold the model,
/// with room to spare, and at least 8.
pub fn max_stages(cm: &CostModel, tp: u32) -> u32 {
    if cm.opts.max_stages > 0 {
        return cm.opts.max_stages.min(cm.model.layers());
    }
    let state = cm.model.total_params() * 16.0 / tp as f64;
    let cap = cm
        .cluster
        .classes
        .iter()
        .map(|c| (c.gpu.memory_gib - cm.opts.reserve_gib).max(0.1) * 1024f64.powi(3))
        .fold(f64::INFINITY, f64::min);
    let need = (state / cap).ceil() as u32 + 2;
    need.max(8).min(cm.model.layers())
}

/// The stage lists of every shape of a configuration (the space's definition, shared with
/// the oracle): ordered blocks of distinct node classes, each block `p >= 1` stages of one
/// dp `d` (a power of two dividing the micro-batch, at most `max_dp`), at most `max_classes`
/// blocks and `pmax` stages, within the TP groups each class has.
pub fn shape_kinds(units: &[u32], tp: u32, micro_batch: u32, max_dp: u32, pmax: u32, max_classes: usize) -> Vec<Vec<StageKind>> {
    let dps: Vec<u32> = (0..4).map(|i| 1u32 << i).filter(|&d| d <= max_dp && d <= micro_batch && micro_batch.is_multiple_of(d)).collect();
    /// What stays fixed while the blocks are chosen.
    struct Space<'a> {
        units: &'a [u32],
        dps: &'a [u32],
        tp: u32,
        pmax: u32,
        max_classes: usize,
    }
    fn rec(sp: &Space, used: &mut [bool], cur: &mut Vec<StageKind>, out: &mut Vec<Vec<StageKind>>) {
        if !cur.is_empty() {
            out.push(cur.clone());
        }
        if used.iter().filter(|&&u| u).count() >= sp.max_classes {
            return;
        }
        for (c, &units) in sp.units.iter().enumerate() {
            if used[c] {
                continue;
            }
            for &d in sp.dps {
                for p in 1..=sp.pmax.saturating_sub(cur.len() as u32) {
                    if p * d > units {
                        break;
                    }
                    used[c] = true;
                    let len = cur.len();
                    cur.extend((0..p).map(|_| StageKind { class: c, tp: sp.tp, dp: d }));
                    rec(sp, used, cur, out);
                    cur.truncate(len);
                    used[c] = false;
                }
            }
        }
    }
    let mut out = vec![];
    let space = Space { units, dps: &dps, tp, pmax, max_classes };
    rec(&space, &mut vec![false; units.len()], &mut vec![], &mut out);
    out
}

/// TP groups of `tp` GPUs each node class holds (a TP group never leaves a node).
pub fn units_per_class(cm: &CostModel, tp: u32) -> Vec<u32> {
    cm.cluster.classes.iter().map(|c| c.nodes.len() as u32 * (c.gpus_per_node / tp)).collect()
}

/// Every shape of a configuration that can hold the model, with its layer splits.
fn enumerate_shapes(cm: &CostModel, cfg: Config, mode: SearchMode) -> Vec<Shape> {
    let fast = mode == SearchMode::Fast;
    let kinds = shape_kinds(
        &units_per_class(cm, cfg.tp),
        cfg.tp,
        cfg.micro_batch,
        if fast { FAST_MAX_STAGE_DP } else { 8 },
        max_stages(cm, cfg.tp),
        if fast { FAST_MAX_CLASSES_PER_REPLICA } else { usize::MAX },
    );
    let mut builder = ShapeBuilder::new(
        cm,
        cfg.micro_batch,
        cfg.micro_batches,
        if fast { FAST_SPLIT_LIMIT } else { EXACT_SPLIT_LIMIT },
        if fast { FAST_MAX_BOTTLENECK_RATIO } else { f64::INFINITY },
    );
    kinds.into_iter().filter_map(|k| builder.build(k)).collect()
}

/// The shapes of every configuration, built on all cores (configurations are independent),
/// returned in configuration order so the search stays deterministic. The flag says whether
/// every shape kept all its layer splits.
pub(super) fn build_shapes_in_parallel(cm: &CostModel, configs: &[Config], mode: SearchMode) -> Vec<(Config, Vec<Shape>, bool)> {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let next = AtomicUsize::new(0);
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).clamp(1, configs.len().max(1));
    let work = || {
        let mut done = vec![];
        loop {
            let ci = next.fetch_add(1, Ordering::Relaxed);
            let Some(&cfg) = configs.get(ci) else { break };
            let mut shapes = enumerate_shapes(cm, cfg, mode);
            let all_splits = shapes.iter().all(|s| s.all_splits);
            if mode == SearchMode::Fast {
                shapes = prune_dominated(shapes);
            } else {
                shapes.sort_by(|a, b| rate(b).total_cmp(&rate(a)));
            }
            done.push((ci, cfg, shapes, all_splits));
        }
        done
    };
    let mut out: Vec<(usize, Config, Vec<Shape>, bool)> = std::thread::scope(|scope| {
        let handles: Vec<_> = (1..threads).map(|_| scope.spawn(work)).collect();
        let mut all = work();
        for h in handles {
            all.extend(h.join().expect("shape builder panicked"));
        }
        all
    });
    out.sort_by_key(|x| x.0);
    out.into_iter().map(|(_, cfg, shapes, all)| (cfg, shapes, all)).collect()
}

/// Best steady-state micro-batches per second per TP group: orders shapes in the search.
pub(super) fn rate(s: &Shape) -> f64 {
    let pmin = s.optimistic.iter().map(|p| p.1).fold(f64::INFINITY, f64::min);
    1.0 / (pmin * s.units.iter().sum::<u32>() as f64)
}

/// Fast mode: drop shapes another shape beats with no more TP groups of any class, then keep
/// the best `FAST_SHAPES` of every set of classes (so no class is crowded out by faster ones).
fn prune_dominated(mut shapes: Vec<Shape>) -> Vec<Shape> {
    let dominated = |a: &Shape, b: &Shape| {
        // b dominates a
        b.units.iter().zip(&a.units).all(|(x, y)| x <= y)
            && a.optimistic.iter().all(|pa| b.optimistic.iter().any(|pb| pb.0 <= pa.0 && pb.1 <= pa.1))
    };
    shapes.sort_by(|a, b| rate(b).total_cmp(&rate(a)));
    let mut keep: Vec<Shape> = vec![];
    let mut per_set: HashMap<Vec<bool>, usize> = HashMap::new();
    for s in shapes {
        let set: Vec<bool> = s.units.iter().map(|&u| u > 0).collect();
        let n = per_set.entry(set).or_insert(0);
        if *n < FAST_SHAPES && !keep.iter().any(|k| dominated(&s, k)) {
            *n += 1;
            keep.push(s);
        }
    }
    keep
}
