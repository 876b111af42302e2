//! Depth-first branch and bound over how many replicas of each shape a plan takes.

use std::collections::HashMap;
use std::rc::Rc;

use super::alloc;
use super::shapes::{best_point, Point, Shape};
use super::space::units_per_class;
use super::Config;
use crate::cost::{CostModel, Rings, SyncContext};
use crate::plan::{PlanStructure, ReplicaPlan, StagePlan};

/// What pricing a multiset gives: the iteration time, each group's micro-batches per
/// replica, and each group's frontier under the plan's context.
type Priced = (f64, Vec<Vec<u32>>, Vec<Rc<Vec<Point>>>);

/// Frontiers by (shape, replicas, shared ring GB/s bits and intra flag, or None for per-stage
/// rings).
type FrontierCache = HashMap<(usize, u32, Option<(u64, bool)>), Rc<Vec<Point>>>;

pub(super) struct Dfs<'a, 'b> {
    pub(super) cm: &'a CostModel<'b>,
    pub(super) shapes: &'a [Shape],
    pub(super) n: u32,
    /// Per shape index i and class c: bound on micro-batches per TP group of class c that
    /// shapes >= i can add by time T: max(0, T * rho + kappa).
    pub(super) rho: Vec<Vec<f64>>,
    pub(super) kappa: Vec<Vec<f64>>,
    pub(super) rem: Vec<u32>,
    pub(super) groups: Vec<(usize, u32)>,
    pub(super) best: f64,
    pub(super) best_groups: Option<Vec<(usize, u32)>>,
    pub(super) cache: FrontierCache,
    pub(super) tolerance: f64,
    pub(super) budget: u64,
    pub(super) nodes: u64,
    pub(super) costed: u64,
    pub(super) cut: bool,
}

impl<'a, 'b> Dfs<'a, 'b> {
    pub(super) fn new(cm: &'a CostModel<'b>, cfg: Config, shapes: &'a [Shape], tolerance: f64) -> Self {
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
    pub(super) fn materialise(&mut self, groups: &[(usize, u32)], micro_batch: u32) -> (f64, PlanStructure) {
        let incumbent = std::mem::replace(&mut self.best, f64::INFINITY);
        let (t, ks, fronts) = self.price(groups).expect("priced before");
        self.best = incumbent;
        let mut replicas = vec![];
        let uniform = groups.len() == 1;
        for (gi, &(s, _)) in groups.iter().enumerate() {
            let shape = &self.shapes[s];
            // A uniform plan's replicas all take the split of the one with the most
            // micro-batches (the slowest): the others finish no later with it.
            let kmax = ks[gi].iter().copied().max().unwrap_or(1);
            for &k in &ks[gi] {
                let split = &shape.splits[best_point(&fronts[gi], if uniform { kmax } else { k }).split];
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

    fn frontier(&mut self, shape: usize, ctx: &SyncContext) -> Rc<Vec<Point>> {
        // Per-stage rings depend only on the plan's GPUs, which one shape and its replica
        // count fix (a uniform plan has one group).
        let rings = match &ctx.rings {
            Rings::PerStage { .. } => None,
            Rings::Shared { bw, intra } => Some((bw.to_bits(), *intra)),
        };
        let key = (shape, ctx.replicas, rings);
        if let Some(f) = self.cache.get(&key) {
            return f.clone();
        }
        let f = Rc::new(self.shapes[shape].frontier(self.cm, ctx));
        self.cache.insert(key, f.clone());
        f
    }

    /// Exact price of the current multiset and, per group, its frontier.
    pub(super) fn price(&mut self, groups: &[(usize, u32)]) -> Option<Priced> {
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
        // One group is a uniform plan: `materialise` gives all its replicas one split.
        let ctx = self.cm.sync_context(r, &gpus, groups.len() == 1);
        let fronts: Vec<Rc<Vec<Point>>> = groups.iter().map(|&(s, _)| self.frontier(s, &ctx)).collect();
        if self.best.is_finite() {
            // Cheap filter: if the replicas cannot finish N micro-batches by the incumbent's
            // time, the plan cannot beat it and the exact split is not worth computing.
            let t = self.best * (1.0 - self.tolerance);
            let cap: u64 = fronts.iter().zip(groups).map(|(f, g)| g.1 as u64 * alloc::finishes_by(f, t)).sum();
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

    /// The best uniform plan (one shape, every replica alike): one pricing per shape and
    /// replica count (every count up to 64, then 64 evenly spaced). Uniform plans keep each
    /// gradient ring inside one node class (Holmes's cross-island pipelines), which the
    /// pessimistic context of the fluid incumbent cannot see, so they seed the search.
    pub(super) fn best_uniform(&mut self) -> Option<(f64, Vec<(usize, u32)>)> {
        let mut best: Option<(f64, Vec<(usize, u32)>)> = None;
        for si in 0..self.shapes.len() {
            let units = &self.shapes[si].units;
            let xmax = (0..units.len()).filter(|&c| units[c] > 0).map(|c| self.rem[c] / units[c]).min().unwrap_or(0).min(self.n);
            let step = (xmax / 64).max(1);
            let mut x = xmax;
            while x > 0 {
                let groups = vec![(si, x)];
                if let Some((t, _, _)) = self.price(&groups) {
                    if best.as_ref().is_none_or(|b| t < b.0) {
                        best = Some((t, groups));
                    }
                }
                x = x.saturating_sub(step);
            }
        }
        best
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

    pub(super) fn go(&mut self, i: usize) {
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
        for (&rem, &u) in self.rem.iter().zip(&s.units) {
            if let Some(fit) = rem.checked_div(u) {
                xmax = xmax.min(fit);
            }
        }
        let units = s.units.clone();
        for x in (0..=xmax).rev() {
            if x > 0 {
                // Every priced plan counts against the budget, not only the levels visited.
                self.nodes += 1;
                if self.nodes > self.budget {
                    self.cut = true;
                    return;
                }
                for (rem, &u) in self.rem.iter_mut().zip(&units) {
                    *rem -= u * x;
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
                for (rem, &u) in self.rem.iter_mut().zip(&units) {
                    *rem += u * x;
                }
            }
            if self.cut {
                return;
            }
        }
    }
}
