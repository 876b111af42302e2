//! The planner's search. The problem and the argument for exactness are in `solver/README.md`;
//! in short:
//!
//! 1. *Configurations*: one tensor-parallel degree `tp` and one micro-batch size `b` per plan
//!    (TP must be symmetric across replicas, AutoHet Observation 1).
//! 2. *Shapes* (`shapes.rs`): every replica structure over node classes, with its feasible
//!    layer splits; GPUs of a class are interchangeable, so shapes count TP groups per class.
//! 3. *Plans*: a multiset of shapes that fits the cluster, found by depth-first branch and
//!    bound over shape counts; every candidate plan is priced exactly (its sync context, each
//!    replica's best layer split for its batch share, the optimal batch split of `alloc.rs`),
//!    and a subtree is cut when even an optimistic fluid bound cannot beat the incumbent.

pub mod alloc;
pub mod fluid;
pub mod shapes;

use std::collections::HashMap;
use std::rc::Rc;

use crate::cost::{CostModel, StageKind};
use crate::error::{Result, SolverError};
use crate::plan::{PlanStructure, ReplicaPlan, StagePlan};
use shapes::{best_point, Point, Shape, ShapeBuilder};

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

const EXACT_SPLIT_LIMIT: u64 = 2000;
const FAST_SPLIT_LIMIT: u64 = 64;
const FAST_SHAPES: usize = 12;
const AUTO_EXACT_MAX_GPUS: u32 = 8;
/// Up to this many GPUs `Auto` runs the fast search and then the exact one seeded with it.
const AUTO_REFINE_MAX_GPUS: u32 = 16;
/// Branch-and-bound nodes each search may visit.
const EXACT_BUDGET: u64 = 20_000_000;
const REFINE_BUDGET: u64 = 1_000_000;
const FAST_BUDGET: u64 = 60_000;
/// Fast mode's narrower space: micro-batches up to 4, stage dp up to 2, at most two node
/// classes per replica.
const FAST_MAX_MICRO_BATCH: u32 = 4;
const FAST_MAX_STAGE_DP: u32 = 2;
const FAST_MAX_CLASSES_PER_REPLICA: usize = 2;
/// Fast mode's greedy layer splits: bottlenecks up to this factor above the smallest.
const FAST_MAX_BOTTLENECK_RATIO: f64 = 1.5;

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
struct Config {
    tp: u32,
    micro_batch: u32,
    micro_batches: u32,
}

/// Tensor-parallel degrees and micro-batch sizes the search tries.
fn configurations(cm: &CostModel, mode: SearchMode) -> Vec<Config> {
    let max_gpn = cm.cluster.classes.iter().map(|c| c.gpus_per_node).max().unwrap_or(1);
    let heads = cm.model.spec.heads;
    let tps: Vec<u32> = match cm.opts.tp {
        Some(t) => vec![t],
        None => (0..8).map(|i| 1u32 << i).filter(|&t| t <= max_gpn && heads.is_multiple_of(t)).collect(),
    };
    let b_max = if mode == SearchMode::Fast { FAST_MAX_MICRO_BATCH } else { 8 };
    let bs: Vec<u32> = match cm.opts.micro_batch {
        Some(b) => vec![b],
        None => (0..4).map(|i| 1u32 << i).filter(|&b| b <= b_max && cm.opts.global_batch.is_multiple_of(b)).collect(),
    };
    let mut out = vec![];
    for &tp in &tps {
        for &b in &bs {
            if cm.opts.global_batch.is_multiple_of(b) {
                out.push(Config { tp, micro_batch: b, micro_batches: cm.opts.global_batch / b });
            }
        }
    }
    out
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
    let mut out = vec![];
    let mut used = vec![false; units.len()];
    let mut cur: Vec<StageKind> = vec![];
    fn rec(
        units: &[u32],
        dps: &[u32],
        tp: u32,
        pmax: u32,
        max_classes: usize,
        used: &mut [bool],
        cur: &mut Vec<StageKind>,
        out: &mut Vec<Vec<StageKind>>,
    ) {
        if !cur.is_empty() {
            out.push(cur.clone());
        }
        if used.iter().filter(|&&u| u).count() >= max_classes {
            return;
        }
        for c in 0..units.len() {
            if used[c] {
                continue;
            }
            for &d in dps {
                for p in 1..=pmax.saturating_sub(cur.len() as u32) {
                    if p * d > units[c] {
                        break;
                    }
                    used[c] = true;
                    let len = cur.len();
                    cur.extend((0..p).map(|_| StageKind { class: c, tp, dp: d }));
                    rec(units, dps, tp, pmax, max_classes, used, cur, out);
                    cur.truncate(len);
                    used[c] = false;
                }
            }
        }
    }
    rec(units, &dps, tp, pmax, max_classes, &mut used, &mut cur, &mut out);
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
fn build_shapes_in_parallel(cm: &CostModel, configs: &[Config], mode: SearchMode) -> Vec<(Config, Vec<Shape>, bool)> {
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
fn rate(s: &Shape) -> f64 {
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

struct Dfs<'a, 'b> {
    cm: &'a CostModel<'b>,
    shapes: &'a [Shape],
    n: u32,
    /// Per shape index i and class c: bound on micro-batches per TP group of class c that
    /// shapes >= i can add by time T: max(0, T * rho + kappa).
    rho: Vec<Vec<f64>>,
    kappa: Vec<Vec<f64>>,
    rem: Vec<u32>,
    groups: Vec<(usize, u32)>,
    best: f64,
    best_groups: Option<Vec<(usize, u32)>>,
    cache: HashMap<(usize, u32, u64, bool), Rc<Vec<Point>>>,
    tolerance: f64,
    budget: u64,
    nodes: u64,
    costed: u64,
    cut: bool,
}

impl<'a, 'b> Dfs<'a, 'b> {
    fn new(cm: &'a CostModel<'b>, cfg: Config, shapes: &'a [Shape], tolerance: f64) -> Self {
        let classes = cm.cluster.classes.len();
        let units = units_per_class(cm, cfg.tp);
        let ns = shapes.len();
        let mut rho = vec![vec![0.0; classes]; ns + 1];
        let mut kappa = vec![vec![f64::NEG_INFINITY; classes]; ns + 1];
        for i in (0..ns).rev() {
            rho[i] = rho[i + 1].clone();
            kappa[i] = kappa[i + 1].clone();
            let s = &shapes[i];
            let u = s.units.iter().sum::<u32>() as f64;
            let pmin = s.optimistic.iter().map(|p| p.1).fold(f64::INFINITY, f64::min);
            let k0 = s.optimistic.iter().map(|p| 1.0 - p.0 / p.1).fold(f64::NEG_INFINITY, f64::max);
            for c in 0..classes {
                if s.units[c] > 0 {
                    rho[i][c] = f64::max(rho[i][c], 1.0 / (pmin * u));
                    kappa[i][c] = f64::max(kappa[i][c], k0 / u);
                }
            }
        }
        Dfs {
            cm,
            shapes,
            n: cfg.micro_batches,
            rho,
            kappa,
            rem: units,
            groups: vec![],
            best: f64::INFINITY,
            best_groups: None,
            cache: HashMap::new(),
            tolerance,
            budget: 0,
            nodes: 0,
            costed: 0,
            cut: false,
        }
    }

    /// The plan of a multiset: each replica's batch share and best layer split for it.
    fn materialise(&mut self, groups: &[(usize, u32)], micro_batch: u32) -> (f64, PlanStructure) {
        let incumbent = std::mem::replace(&mut self.best, f64::INFINITY);
        let (t, ks, fronts) = self.price(groups).expect("priced before");
        self.best = incumbent;
        let mut replicas = vec![];
        for (gi, &(s, _)) in groups.iter().enumerate() {
            let shape = &self.shapes[s];
            for &k in &ks[gi] {
                let split = &shape.splits[best_point(&fronts[gi], k).split];
                let mut start = 0;
                let stages = shape
                    .kinds
                    .iter()
                    .zip(&split.layers)
                    .map(|(&kind, &n)| {
                        start += n;
                        StagePlan { kind, layers: (start - n, start) }
                    })
                    .collect();
                replicas.push(ReplicaPlan { stages, micro_batches: k });
            }
        }
        (t, PlanStructure { micro_batch, replicas })
    }

    fn frontier(&mut self, shape: usize, ctx: &crate::cost::SyncContext) -> Rc<Vec<Point>> {
        let key = (shape, ctx.replicas, ctx.ring_bw.to_bits(), ctx.ring_intra);
        if let Some(f) = self.cache.get(&key) {
            return f.clone();
        }
        let f = Rc::new(self.shapes[shape].frontier(self.cm, ctx));
        self.cache.insert(key, f.clone());
        f
    }

    /// Exact price of the current multiset and, per group, its frontier.
    fn price(&mut self, groups: &[(usize, u32)]) -> Option<(f64, Vec<Vec<u32>>, Vec<Rc<Vec<Point>>>)> {
        let r: u32 = groups.iter().map(|g| g.1).sum();
        if r == 0 || r > self.n {
            return None;
        }
        let mut gpus = vec![0u32; self.rem.len()];
        for &(s, x) in groups {
            for (c, g) in self.shapes[s].gpus.iter().enumerate() {
                gpus[c] += g * x;
            }
        }
        let ctx = self.cm.sync_context(r, &gpus);
        let fronts: Vec<Rc<Vec<Point>>> = groups.iter().map(|&(s, _)| self.frontier(s, &ctx)).collect();
        if self.best.is_finite() {
            // Cheap filter: if the replicas cannot finish N micro-batches by the incumbent's
            // time, the plan cannot beat it and the exact split is not worth computing.
            let t = self.best * (1.0 - self.tolerance);
            let cap: u64 = fronts
                .iter()
                .zip(groups)
                .map(|(f, g)| {
                    g.1 as u64
                        * f.iter().map(|p| if p.base <= t { ((t - p.base) / p.period).floor() as u64 + 1 } else { 0 }).max().unwrap_or(0)
                })
                .sum();
            if cap < self.n as u64 {
                self.costed += 1;
                return None;
            }
        }
        let refs: Vec<(&[Point], u32)> = fronts.iter().zip(groups).map(|(f, g)| (f.as_slice(), g.1)).collect();
        self.costed += 1;
        let (t, ks) = alloc::allocate(&refs, self.n)?;
        Some((t, ks, fronts))
    }

    fn bound_allows(&self, i: usize) -> bool {
        let t = self.best * (1.0 - self.tolerance);
        if !t.is_finite() {
            return true;
        }
        let mut cap: f64 = 0.0;
        for &(s, x) in &self.groups {
            cap += x as f64 * alloc::capacity(&self.shapes[s].optimistic, t) as f64;
        }
        if i < self.shapes.len() {
            for c in 0..self.rem.len() {
                cap += self.rem[c] as f64 * (t * self.rho[i][c] + self.kappa[i][c]).max(0.0);
            }
        }
        cap >= self.n as f64
    }

    fn go(&mut self, i: usize) {
        if i == self.shapes.len() || self.cut {
            return;
        }
        self.nodes += 1;
        if self.nodes > self.budget {
            self.cut = true;
            return;
        }
        if !self.bound_allows(i) {
            return;
        }
        let s = &self.shapes[i];
        let r: u32 = self.groups.iter().map(|g| g.1).sum();
        let mut xmax = self.n - r;
        for (c, &u) in s.units.iter().enumerate() {
            if u > 0 {
                xmax = xmax.min(self.rem[c] / u);
            }
        }
        let units = s.units.clone();
        for x in (0..=xmax).rev() {
            if x > 0 {
                for c in 0..units.len() {
                    self.rem[c] -= units[c] * x;
                }
                self.groups.push((i, x));
                let groups = self.groups.clone();
                if let Some((t, _, _)) = self.price(&groups) {
                    if t < self.best {
                        self.best = t;
                        self.best_groups = Some(groups);
                    }
                }
            }
            self.go(i + 1);
            if x > 0 {
                self.groups.pop();
                for c in 0..units.len() {
                    self.rem[c] += units[c] * x;
                }
            }
            if self.cut {
                return;
            }
        }
    }
}

/// Find the fastest plan. `seeds` (the baselines' plans) start the incumbent, so the result is
/// never slower than any of them.
pub fn search(cm: &CostModel, mode: SearchMode, seeds: &[PlanStructure]) -> Result<Solution> {
    let gpus = cm.cluster.total_gpus();
    match mode {
        SearchMode::Auto if gpus <= AUTO_EXACT_MAX_GPUS => search_in(cm, SearchMode::Exact, seeds, EXACT_BUDGET),
        SearchMode::Auto if gpus <= AUTO_REFINE_MAX_GPUS => {
            // The fast plan is a strong first incumbent, so the exact search that follows
            // prunes hard and usually finishes well inside its budget.
            let fast = search_in(cm, SearchMode::Fast, seeds, FAST_BUDGET)?;
            let mut seeded = seeds.to_vec();
            seeded.push(fast.plan.clone());
            let mut exact = search_in(cm, SearchMode::Exact, &seeded, REFINE_BUDGET)?;
            exact.stats.plans_costed += fast.stats.plans_costed;
            exact.stats.mode = "fast+exact".into();
            Ok(exact)
        }
        SearchMode::Auto | SearchMode::Fast => search_in(cm, SearchMode::Fast, seeds, FAST_BUDGET),
        SearchMode::Exact => search_in(cm, SearchMode::Exact, seeds, EXACT_BUDGET),
    }
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
    let mut order: Vec<usize> = (0..runs.len()).collect();
    order.sort_by(|&a, &b| bounds[a].total_cmp(&bounds[b]));
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
            if let Some((t, groups)) = fluid_plan(dfs) {
                if t < dfs.best {
                    dfs.best = t;
                    dfs.best_groups = Some(groups);
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
    match best {
        Some((t, plan)) => Ok(Solution { plan, iteration_time: t, stats }),
        None => Err(SolverError::DoesNotFit(does_not_fit_message(cm))),
    }
}

/// Pessimistic context: every ring as large and as slow as any plan of this cluster makes it.
fn pessimistic_context(cm: &CostModel, n: u32) -> crate::cost::SyncContext {
    let k = cm.cluster.classes.len();
    let mut bw = f64::INFINITY;
    for a in 0..k {
        for b in a..k {
            bw = bw.min(cm.cluster.inter_bw(a, b));
        }
    }
    crate::cost::SyncContext { replicas: n, ring_bw: bw, ring_intra: false }
}

/// Smallest T (bisection) for which `feasible` holds, starting from a `hi` that may need doubling.
fn bisect(mut hi: f64, mut feasible: impl FnMut(f64) -> bool) -> Option<f64> {
    let mut grow = 0;
    while !feasible(hi) {
        hi *= 2.0;
        grow += 1;
        if grow > 60 {
            return None;
        }
    }
    let mut lo = 0.0;
    for _ in 0..60 {
        let mid = 0.5 * (lo + hi);
        if feasible(mid) {
            hi = mid;
        } else {
            lo = mid;
        }
        if hi - lo <= 1e-9 * hi {
            break;
        }
    }
    Some(hi)
}

fn start_time(dfs: &Dfs) -> f64 {
    let t = dfs.shapes.iter().flat_map(|s| s.optimistic.iter().map(|p| p.0 + p.1)).fold(f64::INFINITY, f64::min);
    if dfs.best.is_finite() {
        dfs.best
    } else {
        t.max(1e-6)
    }
}

/// Fast mode's first incumbent: the rounded fluid relaxation under the pessimistic context.
fn fluid_plan(dfs: &mut Dfs) -> Option<(f64, Vec<(usize, u32)>)> {
    let ctx = pessimistic_context(dfs.cm, dfs.n);
    let fronts: Vec<Vec<(f64, f64)>> =
        dfs.shapes.iter().map(|s| s.frontier(dfs.cm, &ctx).iter().map(|p| (p.base, p.period)).collect()).collect();
    let units: Vec<Vec<u32>> = dfs.shapes.iter().map(|s| s.units.clone()).collect();
    let avail = dfs.rem.clone();
    let n = dfs.n;
    let counts_at = |t: f64| {
        let value: Vec<f64> = fronts.iter().map(|f| alloc::capacity(f, t).min(n as u64) as f64).collect();
        let mut a: Vec<Vec<f64>> = (0..avail.len()).map(|c| units.iter().map(|u| u[c] as f64).collect()).collect();
        a.push(vec![1.0; units.len()]);
        let mut b: Vec<f64> = avail.iter().map(|&u| u as f64).collect();
        b.push(n as f64);
        let x = fluid::simplex_max(&value, &a, &b);
        let counts = fluid::round_and_fill(&x, &value, &units, &avail, n);
        let cap: f64 = counts.iter().zip(&value).map(|(&k, v)| k as f64 * v).sum();
        (counts, cap)
    };
    let t = bisect(start_time(dfs), |t| counts_at(t).1 >= n as f64)?;
    let (counts, _) = counts_at(t);
    let groups: Vec<(usize, u32)> = counts.iter().enumerate().filter(|(_, &k)| k > 0).map(|(s, &k)| (s, k)).collect();
    let (t, _, _) = dfs.price(&groups)?;
    Some((t, groups))
}

/// No plan of this configuration beats this: the fractional relaxation without gradient sync.
fn fluid_lower_bound(dfs: &Dfs) -> f64 {
    let units: Vec<Vec<u32>> = dfs.shapes.iter().map(|s| s.units.clone()).collect();
    let n = dfs.n;
    bisect(start_time(dfs), |t| {
        let value: Vec<f64> = dfs.shapes.iter().map(|s| alloc::capacity(&s.optimistic, t).min(n as u64) as f64).collect();
        let mut a: Vec<Vec<f64>> = (0..dfs.rem.len()).map(|c| units.iter().map(|u| u[c] as f64).collect()).collect();
        a.push(vec![1.0; units.len()]);
        let mut b: Vec<f64> = dfs.rem.iter().map(|&u| u as f64).collect();
        b.push(n as f64);
        let x = fluid::simplex_max(&value, &a, &b);
        x.iter().zip(&value).map(|(x, v)| x * v).sum::<f64>() >= n as f64 - 1e-9
    })
    .unwrap_or(f64::INFINITY)
}

/// "Fits nowhere": what the smallest plan needs against what the cluster has.
pub fn does_not_fit_message(cm: &CostModel) -> String {
    let gib = 1024f64.powi(3);
    let state = cm.model.total_params() * 16.0 / gib;
    let usable: f64 =
        cm.cluster.nodes.iter().map(|n| n.gpus as f64 * (cm.cluster.classes[n.class].gpu.memory_gib - cm.opts.reserve_gib)).sum();
    format!(
        "{} needs at least {:.1} GiB for weights, gradients and Adam states ({:.2}B parameters x 16 bytes) plus activations, \
         but no plan of at most {} pipeline stages fits in this cluster's {:.1} GiB of usable GPU memory; \
         add GPUs, pass --recompute, lower --micro-batch or --seq-len, or allow longer pipelines with --max-stages",
        cm.model.spec.name,
        state,
        cm.model.total_params() / 1e9,
        max_stages(cm, 1),
        usable
    )
}
