//! Metis's plan space searched under Motley's cost model: the branch and bound of
//! `search.rs` (tasks per node sequence, M and S; stages chosen in rank order; the
//! GPU-time conservation bound), with stage times, memory and the final price from
//! Motley's `CostModel` through [`MotleyView`]. Stages are whole transformer blocks (the
//! embedding rides with the first, the head with the last).

use std::collections::HashMap;

use super::cost::{Layout, MetisModel};
use super::motley_view::{MotleyPrice, MotleyView};
use super::plan::MetisPlan;
use motley_solver::cost::{CostModel, LayerCost, PlanOptions, StageKind};
use motley_solver::plan::{PlanStructure, ReplicaPlan, StagePlan};

#[derive(Debug, Clone)]
pub struct MotleySearchOutcome {
    pub best: Option<(MetisPlan, MotleyPrice)>,
    pub plans_costed: u64,
    pub nodes: u64,
    pub proven_optimal: bool,
}

struct Walk<'a> {
    cm: &'a CostModel<'a>,
    view: &'a MotleyView,
    m: &'a MetisModel<'a>,
    layout: Layout,
    n: u32,
    blocks: u32,
    batches: u32,
    micro_batch: u32,
    stages: usize,
    sizes: Vec<u32>,
    fillable: Vec<Vec<bool>>,
    costs: HashMap<StageKind, LayerCost>,
    /// Least GPU-seconds per sequence of one block, over every stage kind.
    block_work: f64,
    /// Relative speed of each rank's class (best class 1): a stage runs at its slowest
    /// class, so a GPU never contributes more than its own class's speed.
    speed: Vec<f64>,
    /// Suffix sums of `speed`.
    capacity_suffix: Vec<f64>,
    /// First rank after the run of equal-speed ranks that rank r is in.
    run_end: Vec<u32>,
    /// Seconds of the cheapest possible pipeline hop (activations forward, gradients back).
    min_hop: f64,
    hop_bytes: f64,
    best: f64,
    best_path: Vec<(u32, u32, StageKind, u32)>,
    path: Vec<(u32, u32, StageKind, u32)>,
    plans_costed: u64,
    nodes: u64,
    budget: u64,
}

impl Walk<'_> {
    fn cost(&mut self, k: StageKind) -> LayerCost {
        let (cm, mb) = (self.cm, self.micro_batch);
        *self.costs.entry(k).or_insert_with(|| cm.layer_cost(k, mb))
    }

    /// Least seconds of the hop between two consecutive stages: inside a node only if both
    /// fit in one node of the same class (what `CostModel::hop_times` allows at best).
    fn hop_floor(&self, x: StageKind, y: StageKind) -> f64 {
        let gpn = self.view.cluster.classes[x.class].gpus_per_node;
        let intra = x.class == y.class && x.dp * x.tp <= gpn && y.dp * y.tp <= gpn;
        let bw = if intra { self.view.cluster.intra_bw(x.class) } else { self.view.cluster.inter_bw(x.class, y.class) };
        2.0 * self.hop_bytes / (bw * 1e9)
    }

    fn root_bound(&self) -> f64 {
        self.bound(0, 0, 0, 0.0, 0.0, None)
    }

    /// Least cost of any completion (see the module's search.rs for the argument).
    fn bound(&self, s: usize, r: u32, a: u32, sum_t: f64, max_t: f64, prev: Option<StageKind>) -> f64 {
        let left = self.n - r;
        let k = self.stages - s;
        let widest = left.saturating_sub(self.sizes[0] * (k as u32 - 1)).clamp(1, *self.sizes.last().unwrap());
        let work = (self.blocks - a) as f64 * self.block_work * self.micro_batch as f64;
        // The widest stage can at best gather the fastest `widest` of the remaining GPUs;
        // ranks come in runs of one type, so count them per distinct speed.
        let mut runs: Vec<(f64, u32)> = vec![];
        let mut x = r;
        while x < self.n {
            let end = self.run_end[x as usize];
            runs.push((self.speed[x as usize], end - x));
            x = end;
        }
        runs.sort_by(|p, q| q.0.total_cmp(&p.0));
        let (mut widest_capacity, mut need) = (0.0, widest);
        for (sp, cnt) in runs {
            let take = cnt.min(need);
            widest_capacity += sp * take as f64;
            need -= take;
        }
        let rem_sum = work / widest_capacity;
        let rem_max = (work / self.capacity_suffix[r as usize]).max(rem_sum / k as f64);
        // Hops still to come: one before each remaining stage but the first of the plan.
        let hops = (k - usize::from(prev.is_none())) as f64 * self.min_hop;
        let period = max_t.max(rem_max).max(if hops > 0.0 { self.min_hop } else { 0.0 });
        (self.batches - 1) as f64 * period + sum_t + rem_sum + hops
    }

    /// `sum_t` and `max_t` include the hops between placed stages; `prev` is the last placed.
    fn walk(&mut self, s: usize, r: u32, a: u32, sum_t: f64, max_t: f64, prev: Option<StageKind>) {
        self.nodes += 1;
        if self.nodes > self.budget {
            return;
        }
        if self.bound(s, r, a, sum_t, max_t, prev) >= self.best {
            return;
        }
        let left = self.n - r;
        let k = self.stages - s;
        for gi in (0..self.sizes.len()).rev() {
            let g = self.sizes[gi];
            if g > left || !self.fillable[k - 1][(left - g) as usize] {
                continue;
            }
            let last = k == 1;
            let ends: Vec<u32> = if last { vec![self.blocks] } else { (a + 1..=self.blocks - (k as u32 - 1)).collect() };
            let mut tp = 1;
            while tp <= g {
                let dp = g / tp;
                if g.is_multiple_of(tp) && self.micro_batch.is_multiple_of(dp) && (g.is_power_of_two() && dp.is_power_of_two()) {
                    let (kind, _) = self.view.kind_of(self.m, &self.layout, r, g, dp);
                    let c = self.cost(kind);
                    let inflight = (k as u32).min(self.batches);
                    for &b in &ends {
                        let n = b - a;
                        let mem = CostModel::stage_memory(&c, n, s == 0, last, inflight, self.cm.opts.recompute);
                        if mem > c.capacity {
                            break;
                        }
                        let (f, bw) = CostModel::stage_time(&c, n, s == 0, last);
                        let hop = prev.map_or(0.0, |p| self.hop_floor(p, kind));
                        let t = f + bw;
                        self.path.push((r, g, kind, b));
                        if last {
                            if (self.batches - 1) as f64 * max_t.max(t).max(hop) + sum_t + t + hop < self.best {
                                self.leaf();
                            }
                        } else {
                            self.walk(s + 1, r + g, b, sum_t + t + hop, max_t.max(t).max(hop), Some(kind));
                        }
                        self.path.pop();
                    }
                }
                tp *= 2;
            }
        }
    }

    fn leaf(&mut self) {
        self.plans_costed += 1;
        let mut a = 0;
        let stages = self
            .path
            .iter()
            .map(|&(_, _, kind, b)| {
                let s = StagePlan { kind, layers: (a, b) };
                a = b;
                s
            })
            .collect();
        let plan = PlanStructure { micro_batch: self.micro_batch, replicas: vec![ReplicaPlan { stages, micro_batches: self.batches }] };
        let e = self.cm.evaluate(&plan);
        if e.fits && e.iteration_time < self.best {
            self.best = e.iteration_time;
            self.best_path = self.path.clone();
        }
    }
}

/// Cheapest plan of Metis's space (group floor `variance`) under Motley's model.
pub fn search_metis_space(m: &MetisModel, view: &MotleyView, opts: &PlanOptions, variance: f64, budget: u64) -> MotleySearchOutcome {
    let cm = CostModel { cluster: &view.cluster, model: &view.model, profiles: &view.profiles, opts };
    let n = m.cluster.total_gpus();
    let blocks = view.model.layers();
    let gbs = m.settings.global_batch;
    let pow2: Vec<u32> = (0..32).map(|k| 1u32 << k).take_while(|&g| g <= n).collect();
    let mut out = MotleySearchOutcome { best: None, plans_costed: 0, nodes: 0, proven_optimal: true };
    let mut best = f64::INFINITY;
    let mut best_plan = None;
    let orders = super::search::type_orders(&m.cluster.present());
    let mut tasks = vec![];
    for batches in (1..=gbs).filter(|d| gbs.is_multiple_of(*d)) {
        let micro_batch = gbs / batches;
        let class_work = class_work(&cm, view, &pow2, n, micro_batch);
        let block_work = class_work.iter().cloned().fold(f64::INFINITY, f64::min);
        for order in &orders {
            for stages in 1..=(n as usize).min(blocks as usize) {
                let floor = ((n as usize / stages).max(stages / n as usize)) as f64 * variance;
                let sizes: Vec<u32> = pow2.iter().copied().filter(|&g| g as f64 >= floor).collect();
                if sizes.is_empty() {
                    continue;
                }
                let fillable = fillable(&sizes, stages, n);
                if !fillable[stages][n as usize] {
                    continue;
                }
                let layout = Layout::by_type_sequence(m.cluster, order);
                let speed: Vec<f64> =
                    (0..n).map(|r| view.class_of_type[layout.type_of(r)].map_or(0.0, |c| block_work / class_work[c])).collect();
                let (capacity_suffix, run_end) = capacity_and_runs(&speed, n);
                let hop_bytes = micro_batch as f64 * view.model.seq_len as f64 * view.model.hidden() * 2.0;
                let fastest_link = fastest_link(view);
                let w = Walk {
                    min_hop: 2.0 * hop_bytes / (fastest_link * 1e9),
                    hop_bytes,
                    cm: &cm,
                    view,
                    m,
                    layout,
                    speed,
                    capacity_suffix,
                    run_end,
                    n,
                    blocks,
                    batches,
                    micro_batch,
                    stages,
                    sizes,
                    fillable,
                    costs: HashMap::new(),
                    block_work,
                    best,
                    best_path: vec![],
                    path: vec![],
                    plans_costed: 0,
                    nodes: 0,
                    budget: budget.saturating_sub(out.nodes),
                };
                tasks.push((w, order.clone(), batches));
            }
        }
    }
    // Most promising first, so the incumbent is good before the long tasks run.
    let mut tasks: Vec<_> = tasks.into_iter().map(|t| (t.0.root_bound(), t)).collect();
    tasks.sort_by(|x, y| x.0.total_cmp(&y.0));
    for (bound, (mut w, order, batches)) in tasks {
        if bound >= best {
            continue;
        }
        w.best = best;
        w.budget = budget.saturating_sub(out.nodes);
        w.walk(0, 0, 0, 0.0, 0.0, None);
        out.plans_costed += w.plans_costed;
        out.nodes += w.nodes;
        if w.nodes > w.budget {
            out.proven_optimal = false;
        }
        if w.best < best {
            best = w.best;
            best_plan = Some(metis_plan(m, &order, &w.best_path, batches));
        }
    }
    out.best = best_plan.and_then(|p| view.price(m, opts, &p).ok().map(|c| (p, c)));
    out
}

/// Least GPU-seconds per sequence of a block, per class, over all kinds this micro-batch
/// allows.
fn class_work(cm: &CostModel<'_>, view: &MotleyView, pow2: &[u32], n: u32, micro_batch: u32) -> Vec<f64> {
    let mut class_work = vec![f64::INFINITY; view.cluster.classes.len()];
    for (c, w) in class_work.iter_mut().enumerate() {
        for &tp in pow2 {
            for &dp in pow2.iter().filter(|&&dp| dp * tp <= n && micro_batch.is_multiple_of(dp)) {
                let lc = cm.layer_cost(StageKind { class: c, tp, dp }, micro_batch);
                *w = w.min((lc.fwd + lc.bwd) * (dp * tp) as f64 / micro_batch as f64);
            }
        }
    }
    class_work
}

/// `fillable[k][rem]`: `k` stages of the allowed `sizes` hold exactly `rem` GPUs.
fn fillable(sizes: &[u32], stages: usize, n: u32) -> Vec<Vec<bool>> {
    let mut fillable = vec![vec![false; n as usize + 1]; stages + 1];
    fillable[0][0] = true;
    for k in 1..=stages {
        for rem in 0..=n as usize {
            fillable[k][rem] = sizes.iter().any(|&g| g as usize <= rem && fillable[k - 1][rem - g as usize]);
        }
    }
    fillable
}

/// Suffix sums of the ranks' `speed`, and for each rank the first rank after its run of
/// equal speed (`Walk::capacity_suffix`, `Walk::run_end`).
fn capacity_and_runs(speed: &[f64], n: u32) -> (Vec<f64>, Vec<u32>) {
    let mut capacity_suffix = vec![0.0; n as usize + 1];
    let mut run_end = vec![n; n as usize];
    for r in (0..n as usize).rev() {
        capacity_suffix[r] = capacity_suffix[r + 1] + speed[r];
        if r + 1 < n as usize && speed[r + 1] == speed[r] {
            run_end[r] = run_end[r + 1];
        } else {
            run_end[r] = r as u32 + 1;
        }
    }
    (capacity_suffix, run_end)
}

/// The fastest link between any two classes (or within one), GB/s.
fn fastest_link(view: &MotleyView) -> f64 {
    (0..view.cluster.classes.len())
        .flat_map(|a| (0..view.cluster.classes.len()).map(move |b| (a, b)))
        .map(|(a, b)| view.cluster.intra_bw(a).max(view.cluster.inter_bw(a, b)))
        .fold(0.0, f64::max)
}

/// A walk's best path as Metis's plan of node sequence `order`.
fn metis_plan(m: &MetisModel<'_>, order: &[usize], path: &[(u32, u32, StageKind, u32)], batches: u32) -> MetisPlan {
    let mut partition = vec![0];
    for (i, &(_, _, _, b)) in path.iter().enumerate() {
        partition.push(if i + 1 == path.len() { m.settings.layers } else { b as usize + 1 });
    }
    MetisPlan {
        node_sequence: order.iter().map(|&t| m.profiles.types[t].clone()).collect(),
        device_groups: path.iter().map(|x| x.1).collect(),
        strategies: path.iter().map(|x| [x.2.dp, x.2.tp]).collect(),
        batches,
        layer_partition: partition,
    }
}
