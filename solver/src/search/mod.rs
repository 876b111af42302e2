//! The planner's search. The problem and the argument for exactness are in `solver/README.md`;
//! in short:
//!
//! 1. *Configurations* (`space.rs`): one tensor-parallel degree `tp` and one micro-batch size
//!    `b` per plan (TP must be symmetric across replicas, AutoHet Observation 1).
//! 2. *Shapes* (`space.rs`, `shapes.rs`): every replica structure over node classes, with its
//!    feasible layer splits; GPUs of a class are interchangeable, so shapes count TP groups
//!    per class.
//! 3. *Plans* (`dfs.rs`): a multiset of shapes that fits the cluster, found by depth-first
//!    branch and bound over shape counts; every candidate plan is priced exactly (its sync
//!    context, each replica's best layer split for its batch share, the optimal batch split
//!    of `alloc.rs`), and a subtree is cut when even an optimistic fluid bound cannot beat the
//!    incumbent.
//! 4. *Fluid relaxation* (`fluid.rs`): a lower bound per configuration (configurations that
//!    cannot win are skipped) and, in fast mode, the first incumbent.

pub mod alloc;
mod dfs;
pub mod fluid;
pub mod shapes;
mod space;

use crate::cost::CostModel;
use crate::error::{Result, SolverError};
use crate::plan::PlanStructure;
use dfs::Dfs;
use fluid::{fluid_lower_bound, fluid_plan};
use shapes::Shape;
use space::{build_shapes_in_parallel, configurations};
pub use space::{configurations_for_oracle, max_stages, shape_kinds, tp_micro_batch_space, units_per_class, MAX_SEARCHED_MICRO_BATCH};

/// How hard to search.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SearchMode {
    /// `Exact` for small clusters, `Fast` otherwise.
    Auto,
    /// Every shape, every layer split up to `EXACT_SPLIT_LIMIT`, every plan not cut by a
    /// valid bound: the optimum of the declared space.
    Exact,
    /// Dominated shapes dropped, at most `FAST_SHAPES` per configuration, 0.1% pruning slack.
    Fast,
}

const AUTO_EXACT_MAX_GPUS: u32 = 8;
/// Up to this many GPUs `Auto` runs the fast search and then the exact one seeded with it.
const AUTO_REFINE_MAX_GPUS: u32 = 16;
/// Branch-and-bound nodes each search may visit.
const EXACT_BUDGET: u64 = 20_000_000;
const REFINE_BUDGET: u64 = 4_000_000;
const FAST_BUDGET: u64 = 60_000;

/// Counters of the work a search did.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SearchStats {
    pub mode: String,
    pub configurations: usize,
    pub shapes: usize,
    pub plans_costed: u64,
    pub nodes: u64,
    /// True when no budget cut the search and every shape kept all its layer splits: the
    /// result is the optimum of the declared space.
    pub proven_optimal: bool,
    /// Fast mode: no plan of the space is faster than this (the fluid relaxation with no
    /// gradient sync), so `iteration_time / lower_bound - 1` bounds the gap to the optimum.
    pub lower_bound: Option<f64>,
}

#[derive(Debug, Clone)]
pub struct Solution {
    pub plan: PlanStructure,
    pub iteration_time: f64,
    pub stats: SearchStats,
}

#[derive(Debug, Clone, Copy)]
pub(crate) struct Config {
    pub(crate) tp: u32,
    pub(crate) micro_batch: u32,
    pub(crate) micro_batches: u32,
}

/// Find the fastest plan. `seeds` (the baselines' plans) start the incumbent, so the result is
/// never slower than any of them.
pub fn search(cm: &CostModel, mode: SearchMode, seeds: &[PlanStructure]) -> Result<Solution> {
    let gpus = cm.cluster.total_gpus();
    let budget = match mode {
        SearchMode::Fast => return search_in(cm, SearchMode::Fast, seeds, FAST_BUDGET),
        SearchMode::Auto if gpus > AUTO_REFINE_MAX_GPUS => return search_in(cm, SearchMode::Fast, seeds, FAST_BUDGET),
        SearchMode::Auto if gpus > AUTO_EXACT_MAX_GPUS => REFINE_BUDGET,
        SearchMode::Auto | SearchMode::Exact => EXACT_BUDGET,
    };
    // The fast plan (a plan of the exact space too) is a strong first incumbent, so the exact
    // search prunes hard, and where its budget runs out it is still no worse than the fast one.
    // The fast space may hold no plan that fits where the exact one does: then start without it.
    let fast = search_in(cm, SearchMode::Fast, seeds, FAST_BUDGET).ok();
    let mut seeded = seeds.to_vec();
    seeded.extend(fast.as_ref().map(|f| f.plan.clone()));
    let mut exact = search_in(cm, SearchMode::Exact, &seeded, budget)?;
    exact.stats.plans_costed += fast.map_or(0, |f| f.stats.plans_costed);
    if budget == REFINE_BUDGET {
        exact.stats.mode = "fast+exact".into();
    }
    Ok(exact)
}

fn search_in(cm: &CostModel, mode: SearchMode, seeds: &[PlanStructure], budget_total: u64) -> Result<Solution> {
    let mut stats =
        SearchStats { mode: format!("{mode:?}").to_lowercase(), proven_optimal: mode == SearchMode::Exact, ..Default::default() };
    let mut best: Option<(f64, PlanStructure)> = None;
    for seed in seeds {
        if cm.check_structure(seed).is_ok() {
            let e = cm.evaluate(seed);
            stats.plans_costed += 1;
            if e.fits && best.as_ref().is_none_or(|b| e.iteration_time < b.0) {
                best = Some((e.iteration_time, seed.clone()));
            }
        }
    }
    let configs = configurations(cm, mode);
    stats.configurations = configs.len();
    let mut per_config: Vec<(Config, Vec<Shape>)> = vec![];
    for (cfg, shapes, all_splits) in build_shapes_in_parallel(cm, &configs, mode) {
        stats.proven_optimal &= all_splits;
        stats.shapes += shapes.len();
        if !shapes.is_empty() {
            per_config.push((cfg, shapes));
        }
    }
    let tolerance = if mode == SearchMode::Exact { 1e-12 } else { 1e-3 };
    let mut runs: Vec<(Config, Dfs)> = per_config.iter().map(|(cfg, shapes)| (*cfg, Dfs::new(cm, *cfg, shapes, tolerance))).collect();
    // No plan of a configuration beats its fluid bound: visit the most promising first and
    // skip those whose bound the incumbent already meets.
    let bounds: Vec<f64> = runs.iter().map(|(_, d)| fluid_lower_bound(d)).collect();
    stats.lower_bound = bounds.iter().copied().reduce(f64::min);
    // Bounds equal to a millionth (the fluid bound is bisected to a billionth) count as equal,
    // and then the larger micro-batch goes first: where two configurations price the same (a
    // one-stage replica on the roofline, whose step is its tokens however split), the first found
    // is kept, and fewer, larger micro-batches run faster on a GPU (fewer kernel launches: 32
    // micro-batches of one sequence ran 19x slower than one of 32 on an H200, BENCHMARKS.md).
    let bucket = |b: f64| if b.is_finite() && b > 0.0 { (b.ln() * 1e6).round() as i64 } else { i64::MAX };
    let mut order: Vec<usize> = (0..runs.len()).collect();
    order.sort_by_key(|&i| (bucket(bounds[i]), std::cmp::Reverse(runs[i].0.micro_batch)));
    let per_run_budget = budget_total / runs.len().max(1) as u64;
    for i in order {
        let incumbent = best.as_ref().map_or(f64::INFINITY, |b| b.0);
        if bounds[i] >= incumbent * (1.0 - tolerance) {
            continue;
        }
        let (cfg, dfs) = &mut runs[i];
        dfs.best = incumbent;
        dfs.budget = if mode == SearchMode::Exact { budget_total.saturating_sub(stats.nodes) } else { per_run_budget };
        if mode == SearchMode::Fast {
            for found in [fluid_plan(dfs), dfs.best_uniform()].into_iter().flatten() {
                if found.0 < dfs.best {
                    dfs.best = found.0;
                    dfs.best_groups = Some(found.1);
                }
            }
        }
        dfs.go(0);
        stats.nodes += dfs.nodes;
        stats.plans_costed += dfs.costed;
        if dfs.cut {
            stats.proven_optimal = false;
        }
        if let Some(groups) = dfs.best_groups.clone() {
            best = Some(dfs.materialise(&groups, cfg.micro_batch));
        }
        if mode == SearchMode::Exact && stats.nodes >= budget_total {
            stats.proven_optimal = false;
            break;
        }
    }
    // Profiles with measured layer blocks (AutoHet eq. 5) price a stage by its layer count's
    // binary digits, not affinely: the splits and the fluid bound assume affine stage times, so
    // the search no longer proves its answer or bounds it (every plan is still priced exactly).
    if cm.profiles.profiles.iter().any(|p| !p.blocks.is_empty()) {
        stats.proven_optimal = false;
        stats.lower_bound = None;
    }
    match best {
        Some((t, plan)) => Ok(Solution { plan, iteration_time: t, stats }),
        None => Err(SolverError::DoesNotFit(does_not_fit_message(cm))),
    }
}

/// "Fits nowhere": what the smallest plan needs against what the cluster has, and the fix that
/// can help. When one sequence's activations are the cause, neither recomputation nor a longer
/// pipeline splits them (the output head's logits sit whole on every TP rank of the last
/// stage): only a shorter sequence does, and the message says so.
pub fn does_not_fit_message(cm: &CostModel) -> String {
    use crate::cost::{activations, StageKind};
    let gib = 1024f64.powi(3);
    let params = cm.model.total_params();
    let state = params * 16.0 / gib;
    let usable: f64 =
        cm.cluster.nodes.iter().map(|n| n.gpus as f64 * (cm.cluster.classes[n.class].gpu.memory_gib - cm.opts.reserve_gib)).sum();
    let seq = cm.model.seq_len;
    let needs = format!(
        "{} needs at least {:.1} GiB for weights, gradients and Adam states ({} parameters x 16 bytes) plus activations, \
         but no plan of at most {} pipeline stages fits in this cluster's {:.1} GiB of usable GPU memory",
        cm.model.spec.name,
        state,
        crate::model::params_text(params).replace(' ', ""),
        max_stages(cm, 1),
        usable
    );
    // The least any plan keeps of one sequence on one GPU of each class: the last stage with one
    // layer, recomputed, at the class's widest TP, one sequence per micro-batch.
    let recomputing = crate::cost::PlanOptions { recompute: true, ..cm.opts.clone() };
    let least = CostModel { opts: &recomputing, ..*cm };
    let heads = cm.model.spec.heads;
    let fits_somewhere = cm.cluster.classes.iter().enumerate().any(|(class, c)| {
        let tp = (0..=c.gpus_per_node.ilog2()).rev().map(|k| 1u32 << k).find(|t| heads.is_multiple_of(*t)).unwrap_or(1);
        let lc = least.layer_cost(StageKind { class, tp, dp: 1 }, 1);
        let activations = CostModel::stage_memory(&lc, 1, false, true, 1, true) - lc.layer_state - lc.head_state;
        activations <= lc.capacity
    });
    let (precision, zero1) = (cm.opts.precision, cm.opts.zero1);
    let s = seq as f64;
    let head = activations::head_bytes(cm.model, precision, zero1, s) / gib;
    if !fits_somewhere {
        return format!(
            "{needs}; at seq_len {seq} one sequence's activations do not fit on any GPU (the output head's alone are {head:.1} GiB, \
             whole on every GPU of the last stage), and neither --recompute nor a longer pipeline splits one sequence: \
             lower --seq-len (a job's seq_len)"
        );
    }
    // Without recomputation, one sequence through every layer and the head.
    let per_token = activations::layer_token_bytes(cm.model, precision, zero1, s, !cm.opts.eager).per_gpu(1.0);
    let all = (s * per_token * cm.model.layers() as f64) / gib + head;
    if all > state {
        return format!(
            "{needs}; at seq_len {seq} one sequence's activations ({all:.1} GiB through every layer without recomputation) \
             outweigh the weights and optimizer state: lower --seq-len (a job's seq_len) or --micro-batch, pass --recompute, \
             add GPUs, or allow longer pipelines with --max-stages"
        );
    }
    format!("{needs}; add GPUs, pass --recompute, lower --micro-batch or --seq-len, or allow longer pipelines with --max-stages")
}
