//! Exact search of Metis's plan space, or of its union with Motley's, under Metis's cost
//! model, by depth-first branch and bound.
//!
//! **Spaces.** Metis's space (`InterStagePlanGenerator` x `IntraStagePlanGenerator`): a node
//! sequence (an order of the GPU types over global ranks); S stages of power-of-two GPU
//! groups, each at least `variance x max(N/S, S/N)`, in every order; a micro-batch count M
//! dividing the global batch; per stage (dp, tp) = (g/2^k, 2^k) with 1 <= gbs/dp/M <= the
//! largest profiled batch and tp <= the largest profiled tp; and a layer partition. Metis
//! walks a few strategies and one greedy partition per group vector; we search all of them.
//! The union adds what Motley's plan model allows: stages of any whole number of nodes (not
//! only powers of two), any tp that divides the group, no group-size floor.
//!
//! **Search.** One task per (node sequence, M[, S]); tasks run in order of their lower bound
//! and stop once a bound reaches the best cost found. Inside a task a depth-first walk picks
//! each stage's GPU count, (dp, tp) and last layer in rank order, pricing stages from
//! [`StageTable`]s built once per (start rank, GPUs, dp). A partial plan is cut when
//! `(M-1) max T + sum T + F + PP + max DP + max UPD + BG` cannot drop below the incumbent:
//! the remaining stages' times are bounded below by GPU-time conservation (a stage of g GPUs
//! runs layer l for b = gbs/M samples in at least b e_l / g ms, e_l the least GPU-ms per
//! sample any profile at batch <= b shows), so their slowest is at least
//! b sum e / (GPUs left) and their sum at least that too. Memory is a per-stage constraint
//! that only grows with a stage's layers, so the walk stops extending a stage once it is out
//! of memory: no candidate ever needs repairing.

use std::collections::HashMap;

use serde::Serialize;

use super::cost::{Layout, MetisCost, MetisModel, StageTable};
use super::plan::MetisPlan;

const MIB: f64 = 1024.0 * 1024.0;

#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
#[serde(rename_all = "lowercase", tag = "space")]
pub enum Space {
    /// Metis's space with its group-size floor (`--min_group_scale_variance`).
    Metis { variance: f64 },
    /// Metis's space plus Motley's: any whole-node group, any tp dividing it, no floor.
    Union,
}

#[derive(Debug, Clone, Serialize)]
pub struct SearchOutcome {
    pub best: Option<(MetisPlan, MetisCost)>,
    /// Complete plans priced (Metis's `cost_evals`).
    pub plans_costed: u64,
    /// Partial plans visited by the walk.
    pub nodes: u64,
    /// (node sequence, M[, S]) tasks, and how many the bound skipped whole.
    pub tasks: u64,
    pub tasks_pruned: u64,
    /// The walk finished inside its budget, so no plan of the space is cheaper.
    pub proven_optimal: bool,
}

struct Task {
    order: Vec<usize>,
    batches: u32,
    stages: Option<usize>,
    sizes: Vec<u32>,
    bound: f64,
}

fn union_sizes(n: u32, gpus_per_node: u32) -> Vec<u32> {
    (1..=n).filter(|g| g.is_power_of_two() || g % gpus_per_node == 0).collect()
}

/// What any completion must still cost, for one (node sequence, M).
struct Floors {
    /// b x sum over layers >= a of e_l, the least GPU-ms per sample of layer l at batch <= b.
    work_suffix: Vec<f64>,
    /// Sum over ranks >= r of rho_r: the best relative speed rank r can be priced at (a
    /// replica is priced at one of its types, so at most the fastest type at ranks <= r
    /// under first-GPU pricing, or its own type's under slowest-GPU pricing).
    capacity_suffix: Vec<f64>,
    /// M x the least fb_sync the last stage can have (it always holds the last type).
    fb_sync: f64,
}

impl Floors {
    fn new(m: &MetisModel, layout: &Layout, batches: u32) -> Floors {
        let p = m.profiles;
        let layers = m.settings.layers;
        let b = m.settings.global_batch / batches;
        let n = layout.gpus();
        // e[t][l]: least GPU-ms per sample of type t on layer l, batch <= b.
        let mut e = vec![vec![f64::INFINITY; layers]; p.types.len()];
        let mut fb_sync = f64::INFINITY;
        let last_type = layout.type_of(n - 1);
        for (t, et) in e.iter_mut().enumerate() {
            let mut tp = 1;
            while tp <= p.max_tp {
                let mut bs = 1;
                while bs <= b.min(p.max_bs) {
                    if let Some(d) = p.get(t, tp, bs) {
                        for (l, x) in d.layer_ms.iter().enumerate() {
                            et[l] = et[l].min(x * tp as f64 / bs as f64);
                        }
                    }
                    bs += 1;
                }
                tp *= 2;
            }
        }
        for dp in 1..=b.min(n) {
            let mut tp = 1;
            while tp <= p.max_tp && tp * dp <= n {
                if let Some(d) = p.get(last_type, tp, b / dp) {
                    fb_sync = fb_sync.min(d.fb_sync_ms);
                }
                tp *= 2;
            }
        }
        let present: Vec<usize> = (0..p.types.len()).filter(|&t| e[t][0].is_finite()).collect();
        let e_min: Vec<f64> = (0..layers).map(|l| present.iter().map(|&t| e[t][l]).fold(f64::INFINITY, f64::min)).collect();
        let rho = |t: usize| (0..layers).map(|l| e_min[l] / e[t][l]).fold(f64::INFINITY, f64::min);
        let mut work_suffix = vec![0.0; layers + 1];
        for l in (0..layers).rev() {
            work_suffix[l] = work_suffix[l + 1] + e_min[l] * b as f64;
        }
        let mut capacity_suffix = vec![0.0; n as usize + 1];
        let mut prefix_best = 0.0f64;
        let mut speed = vec![0.0; n as usize];
        for (r, sp) in speed.iter_mut().enumerate() {
            let own = rho(layout.type_of(r as u32));
            prefix_best = prefix_best.max(own);
            *sp = if m.quirks.first_gpu_prices_replica { prefix_best } else { own };
        }
        for r in (0..n as usize).rev() {
            capacity_suffix[r] = capacity_suffix[r + 1] + speed[r];
        }
        if !fb_sync.is_finite() {
            fb_sync = 0.0;
        }
        Floors { work_suffix, capacity_suffix, fb_sync: fb_sync.max(0.0) * batches as f64 }
    }

    /// Lower bound on the cost of any completion: `k` stages still to place (None: any
    /// number), `layers_left` layers from layer `a`, ranks from `r`. Under first-GPU
    /// pricing speeds only grow with the rank, so the widest stage does best on the last ranks.
    #[allow(clippy::too_many_arguments)]
    fn bound(&self, sizes: &[u32], k: Option<usize>, layers_left: usize, r: u32, a: usize, p: &Partial, batches: u32) -> f64 {
        let n = self.capacity_suffix.len() as u32 - 1;
        let left = n - r;
        let work = self.work_suffix[a];
        let (k, widest) = match k {
            Some(k) => (k as f64, left.saturating_sub(sizes[0] * (k as u32).saturating_sub(1)).clamp(1, *sizes.last().unwrap())),
            None => (layers_left.min(left as usize) as f64, left),
        };
        let widest_capacity = self.capacity_suffix[(n - widest) as usize];
        let rem_sum = work / widest_capacity;
        let rem_max = (work / self.capacity_suffix[r as usize]).max(rem_sum / k);
        (batches - 1) as f64 * p.max_t.max(rem_max) + p.sum_t + rem_sum + self.fb_sync + p.pp + p.max_dp + p.max_upd
    }
}

/// All orders of the given types (Heap's algorithm is overkill for <= 4 types).
pub fn type_orders(items: &[usize]) -> Vec<Vec<usize>> {
    if items.len() <= 1 {
        return vec![items.to_vec()];
    }
    let mut out = vec![];
    for i in 0..items.len() {
        let mut rest = items.to_vec();
        let x = rest.remove(i);
        for mut p in type_orders(&rest) {
            p.insert(0, x);
            out.push(p);
        }
    }
    out
}

struct Walk<'m, 'a> {
    m: &'m MetisModel<'a>,
    layout: Layout,
    n: u32,
    layers: usize,
    batches: u32,
    /// Allowed GPU counts per stage, ascending.
    sizes: Vec<u32>,
    union: bool,
    /// Fixed stage count (Metis space) and which (stages left, GPUs left) can be filled.
    stages: Option<usize>,
    fillable: Vec<Vec<bool>>,
    tables: HashMap<(u32, u32, u32), Option<StageTable>>,
    floors: Floors,
    bg: f64,
    best: f64,
    best_path: Vec<(u32, [u32; 2], usize)>,
    path: Vec<(u32, [u32; 2], usize)>,
    plans_costed: u64,
    nodes: u64,
    budget: u64,
}

#[derive(Clone, Copy)]
struct Partial {
    sum_t: f64,
    max_t: f64,
    max_dp: f64,
    max_upd: f64,
    pp: f64,
    /// (start rank, elements sent) of the previous stage, priced when the next one is known.
    pending_hop: Option<(u32, f64)>,
}

impl<'m, 'a> Walk<'m, 'a> {
    fn table(&mut self, r: u32, g: u32, dp: u32) -> Option<&StageTable> {
        let key = (r, g, dp);
        if !self.tables.contains_key(&key) {
            let t = self.m.stage_table(&self.layout, r, g, dp, g / dp, self.batches).ok();
            self.tables.insert(key, t);
        }
        self.tables[&key].as_ref()
    }

    fn strategies(&self, g: u32) -> Vec<u32> {
        let gbs = self.m.settings.global_batch;
        let max_bs = self.m.profiles.max_bs;
        let max_tp = self.m.profiles.max_tp;
        let mut dps = vec![];
        let mut tp = 1;
        while tp <= g && tp <= max_tp {
            if g.is_multiple_of(tp) {
                let dp = g / tp;
                // Metis's own strategies floor gbs/dp/M; the extra ones of the union must divide.
                let metis_rule = g.is_power_of_two() && dp.is_power_of_two();
                let exact = metis_rule || (self.union && gbs.is_multiple_of(dp * self.batches));
                let mbs = gbs / dp / self.batches;
                if exact && mbs >= 1 && mbs <= max_bs {
                    dps.push(dp);
                }
            }
            tp *= 2;
        }
        dps
    }

    /// Lower bound on any completion of a partial plan that has placed `s` stages, up to
    /// rank `r` and layer `a`.
    fn bound(&self, s: usize, r: u32, a: usize, p: &Partial) -> f64 {
        self.floors.bound(&self.sizes, self.stages.map(|t| t - s), self.layers - a, r, a, p, self.batches) + self.bg
    }

    fn walk(&mut self, s: usize, r: u32, a: usize, p: Partial) {
        self.nodes += 1;
        if self.nodes > self.budget || self.bound(s, r, a, &p) >= self.best {
            return;
        }
        let left_gpus = self.n - r;
        let stages_left = self.stages.map(|k| k - s);
        for gi in (0..self.sizes.len()).rev() {
            let g = self.sizes[gi];
            if g > left_gpus {
                continue;
            }
            let rest = left_gpus - g;
            if let Some(k) = stages_left {
                if !self.fillable[k - 1][rest as usize] {
                    continue;
                }
            }
            let last = rest == 0;
            // Layers this stage may end at: the last stage ends at L; others leave a layer
            // per remaining stage (at least one).
            let min_after = match stages_left {
                Some(k) => k - 1,
                None => usize::from(!last),
            };
            if self.layers - a < 1 + min_after {
                continue;
            }
            let ends: Vec<usize> = if last { vec![self.layers] } else { (a + 1..=self.layers - min_after).collect() };
            for dp in self.strategies(g) {
                let tp = g / dp;
                let Some(t) = self.table(r, g, dp).cloned() else { continue };
                let fb = if last {
                    match t.fb_sync_total {
                        Ok(f) => f,
                        Err(_) => continue,
                    }
                } else {
                    0.0
                };
                let pp = match p.pending_hop {
                    Some((r0, act)) => p.pp + act / (self.m.pp_bandwidth(&self.layout, r0, r + g) * MIB),
                    None => p.pp,
                };
                for &b in &ends {
                    if !t.fits(a, b) {
                        break;
                    }
                    let time = t.time(a, b);
                    let q = Partial {
                        sum_t: p.sum_t + time,
                        max_t: p.max_t.max(time),
                        max_dp: p.max_dp.max(t.dp_cost(self.m.stage_params(tp, a, b))),
                        max_upd: p.max_upd.max(t.update_per_layer * (b - a) as f64),
                        pp,
                        pending_hop: Some((r, self.m.activation(b, t.mbs, tp))),
                    };
                    self.path.push((g, [dp, tp], b));
                    if last {
                        self.plans_costed += 1;
                        let cost = (self.batches - 1) as f64 * q.max_t + q.sum_t + fb + q.pp + q.max_dp + q.max_upd + self.bg;
                        if cost < self.best {
                            self.best = cost;
                            self.best_path = self.path.clone();
                        }
                    } else {
                        self.walk(s + 1, r + g, b, q);
                    }
                    self.path.pop();
                }
            }
        }
    }
}

/// Search `space` for the cheapest plan under `m`, visiting at most `budget` partial plans.
pub fn search(m: &MetisModel, space: Space, budget: u64) -> SearchOutcome {
    let n = m.cluster.total_gpus();
    let layers = m.settings.layers;
    let gbs = m.settings.global_batch;
    let gpn = m.cluster.gpus_per_node;
    let mut out = SearchOutcome { best: None, plans_costed: 0, nodes: 0, tasks: 0, tasks_pruned: 0, proven_optimal: true };
    let orders = type_orders(&m.cluster.present());
    let divisors: Vec<u32> = (1..=gbs).filter(|d| gbs.is_multiple_of(*d)).collect();
    let pow2: Vec<u32> = (0..32).map(|k| 1u32 << k).take_while(|&g| g <= n).collect();
    let mut tasks = vec![];
    for order in &orders {
        for &batches in &divisors {
            let floors = Floors::new(m, &Layout::by_type_sequence(m.cluster, order), batches);
            let bg = m.profiles.constants.batch_generator_ms * batches as f64;
            let start = Partial { sum_t: 0.0, max_t: 0.0, max_dp: 0.0, max_upd: 0.0, pp: 0.0, pending_hop: None };
            let bound = |sizes: &[u32], k: Option<usize>| floors.bound(sizes, k, layers, 0, 0, &start, batches) + bg;
            match space {
                Space::Union => {
                    let sizes = union_sizes(n, gpn);
                    tasks.push(Task { order: order.clone(), batches, stages: None, bound: bound(&sizes, None), sizes });
                }
                Space::Metis { variance } => {
                    for s in 1..=(n as usize).min(layers) {
                        let floor = ((n as usize / s).max(s / n as usize)) as f64 * variance;
                        let sizes: Vec<u32> = pow2.iter().copied().filter(|&g| g as f64 >= floor).collect();
                        if !sizes.is_empty() {
                            tasks.push(Task { order: order.clone(), batches, stages: Some(s), bound: bound(&sizes, Some(s)), sizes });
                        }
                    }
                }
            }
        }
    }
    tasks.sort_by(|x, y| x.bound.total_cmp(&y.bound));
    out.tasks = tasks.len() as u64;
    let mut best = f64::INFINITY;
    let mut best_plan: Option<MetisPlan> = None;
    for task in tasks {
        if task.bound >= best {
            out.tasks_pruned += 1;
            continue;
        }
        let sizes = task.sizes.clone();
        let fillable = match task.stages {
            Some(s) => {
                let mut f = vec![vec![false; n as usize + 1]; s + 1];
                f[0][0] = true;
                for k in 1..=s {
                    for rem in 0..=n as usize {
                        f[k][rem] = sizes.iter().any(|&g| g as usize <= rem && f[k - 1][rem - g as usize]);
                    }
                }
                f
            }
            None => vec![],
        };
        let layout = Layout::by_type_sequence(m.cluster, &task.order);
        let floors = Floors::new(m, &layout, task.batches);
        let mut w = Walk {
            m,
            layout,
            n,
            layers,
            batches: task.batches,
            sizes,
            union: matches!(space, Space::Union),
            stages: task.stages,
            fillable,
            tables: HashMap::new(),
            floors,
            bg: m.profiles.constants.batch_generator_ms * task.batches as f64,
            best,
            best_path: vec![],
            path: vec![],
            plans_costed: 0,
            nodes: 0,
            budget: budget.saturating_sub(out.nodes),
        };
        if let Some(s) = task.stages {
            if !w.fillable[s][n as usize] {
                continue;
            }
        }
        let start = Partial { sum_t: 0.0, max_t: 0.0, max_dp: 0.0, max_upd: 0.0, pp: 0.0, pending_hop: None };
        w.walk(0, 0, 0, start);
        out.plans_costed += w.plans_costed;
        out.nodes += w.nodes;
        if w.nodes > w.budget {
            out.proven_optimal = false;
        }
        if w.best < best {
            best = w.best;
            let mut partition = vec![0];
            partition.extend(w.best_path.iter().map(|x| x.2));
            best_plan = Some(MetisPlan {
                node_sequence: task.order.iter().map(|&t| m.profiles.types[t].clone()).collect(),
                device_groups: w.best_path.iter().map(|x| x.0).collect(),
                strategies: w.best_path.iter().map(|x| x.1).collect(),
                batches: task.batches,
                layer_partition: partition,
            });
        }
        if out.nodes > budget {
            out.proven_optimal = false;
            break;
        }
    }
    out.best = best_plan.and_then(|p| m.evaluate(&p).ok().map(|c| (p, c)));
    out
}
