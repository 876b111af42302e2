//! Replica shapes and their layer splits.
//!
//! A *shape* is the structure of one replica without its batch share: an ordered list of
//! stage kinds (node class, tp, dp). Stages of one class are contiguous in a shape and share
//! one dp (a *block*); blocks of different classes may come in any order. GPUs of one class
//! are interchangeable, so a shape says how many TP groups of each class it takes, never which.

use std::collections::HashMap;

use crate::cost::{CostModel, LayerCost, StageKind, SyncContext};

/// One feasible assignment of layers to the stages of a shape, with its context-free times.
#[derive(Debug, Clone)]
pub struct Split {
    pub layers: Vec<u32>,
    pub latency: f64,
    pub period: f64,
    pub optimizer: f64,
    /// Parameters whose gradients stage i synchronises, and the backward time of stages < i.
    pub sync_params: Vec<f64>,
    pub pre_bwd: Vec<f64>,
}

#[derive(Debug, Clone)]
pub struct Shape {
    pub kinds: Vec<StageKind>,
    pub costs: Vec<LayerCost>,
    /// TP groups and GPUs taken per node class.
    pub units: Vec<u32>,
    pub gpus: Vec<u32>,
    pub splits: Vec<Split>,
    /// Every feasible split is kept (otherwise only the latency/period frontier of a greedy).
    pub all_splits: bool,
    /// Pareto points (base, period) ignoring gradient sync: a lower bound for every context.
    pub optimistic: Vec<(f64, f64)>,
}

/// A Pareto point of a shape under one context: a replica of this shape with K micro-batches
/// takes `base + (K - 1) * period` seconds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Point {
    pub base: f64,
    pub period: f64,
    pub split: usize,
}

/// Replica time with `k` micro-batches: the best point.
pub fn time_at(points: &[Point], k: u32) -> f64 {
    points.iter().map(|p| p.base + (k - 1) as f64 * p.period).fold(f64::INFINITY, f64::min)
}

/// The best point for `k` micro-batches.
pub fn best_point(points: &[Point], k: u32) -> Point {
    *points
        .iter()
        .min_by(|a, b| (a.base + (k - 1) as f64 * a.period).total_cmp(&(b.base + (k - 1) as f64 * b.period)))
        .expect("frontier is never empty")
}

/// Keep the points no other point beats on both base and period.
pub fn pareto(mut pts: Vec<Point>) -> Vec<Point> {
    pts.sort_by(|a, b| a.period.total_cmp(&b.period).then(a.base.total_cmp(&b.base)));
    let mut out: Vec<Point> = Vec::new();
    for p in pts {
        if out.last().is_none_or(|l| p.base < l.base) {
            out.push(p);
        }
    }
    out
}

/// Number of compositions of `l` into `p` positive parts, saturating.
pub fn compositions(l: u32, p: u32) -> u64 {
    if p == 0 || p > l {
        return 0;
    }
    // C(l-1, p-1)
    let (n, k) = ((l - 1) as u64, (p - 1).min(l - p) as u64);
    let mut c: u64 = 1;
    for i in 0..k {
        c = c.saturating_mul(n - i) / (i + 1);
        if c > 1 << 40 {
            return u64::MAX;
        }
    }
    c
}

/// Builds shapes of one configuration, sharing per-stage-kind costs between them.
pub struct ShapeBuilder<'a, 'b> {
    cm: &'a CostModel<'b>,
    micro_batch: u32,
    /// Micro-batches in flight are capped by the plan's total (memory).
    max_inflight: u32,
    /// Enumerate every layer split when there are at most this many.
    split_limit: u64,
    /// Greedy splits: bottlenecks up to this factor above the smallest feasible one.
    bottleneck_ratio: f64,
    layer_costs: HashMap<StageKind, LayerCost>,
}

impl<'a, 'b> ShapeBuilder<'a, 'b> {
    pub fn new(cm: &'a CostModel<'b>, micro_batch: u32, max_inflight: u32, split_limit: u64, bottleneck_ratio: f64) -> Self {
        ShapeBuilder { cm, micro_batch, max_inflight, split_limit, bottleneck_ratio, layer_costs: HashMap::new() }
    }

    /// The shape with these stages and its feasible layer splits; None if no split fits.
    pub fn build(&mut self, kinds: Vec<StageKind>) -> Option<Shape> {
        let cm = self.cm;
        let classes = cm.cluster.classes.len();
        let mut units = vec![0u32; classes];
        let mut gpus = vec![0u32; classes];
        for k in &kinds {
            units[k.class] += k.dp;
            gpus[k.class] += k.dp * k.tp;
        }
        let costs: Vec<LayerCost> =
            kinds.iter().map(|&k| *self.layer_costs.entry(k).or_insert_with(|| cm.layer_cost(k, self.micro_batch))).collect();
        let p = kinds.len();
        let l = cm.model.layers();
        // Most layers each stage can hold.
        let mut caps = Vec::with_capacity(p);
        for (i, c) in costs.iter().enumerate() {
            let inflight = ((p - i) as u32).min(self.max_inflight.max(1));
            let fixed = CostModel::stage_memory(c, 0, i == 0, i + 1 == p, inflight, cm.opts.recompute);
            let per_layer = CostModel::stage_memory(c, 1, false, false, inflight, cm.opts.recompute)
                - CostModel::stage_memory(c, 0, false, false, inflight, cm.opts.recompute);
            let room = c.capacity - fixed;
            let cap = if room < per_layer { 0 } else { ((room / per_layer).floor() as u64).min(l as u64) as u32 };
            if cap == 0 {
                return None;
            }
            caps.push(cap);
        }
        if caps.iter().map(|&c| c as u64).sum::<u64>() < l as u64 || (p as u32) > l {
            return None;
        }
        let hops = cm.hop_times(&kinds, self.micro_batch);
        let mut shape = Shape { kinds, costs, units, gpus, splits: vec![], all_splits: true, optimistic: vec![] };
        if compositions(l, p as u32) <= self.split_limit {
            let mut cur = vec![0u32; p];
            shape.enumerate(cm, &caps, &hops, 0, l, &mut cur);
        } else {
            shape.all_splits = false;
            shape.greedy_splits(cm, &caps, &hops, self.bottleneck_ratio);
        }
        if shape.splits.is_empty() {
            return None;
        }
        shape.optimistic = pareto(
            shape.splits.iter().enumerate().map(|(i, s)| Point { base: s.latency + s.optimizer, period: s.period, split: i }).collect(),
        )
        .into_iter()
        .map(|pt| (pt.base, pt.period))
        .collect();
        Some(shape)
    }
}

impl Shape {
    fn enumerate(&mut self, cm: &CostModel, caps: &[u32], hops: &[f64], i: usize, left: u32, cur: &mut Vec<u32>) {
        let p = caps.len();
        if i + 1 == p {
            if left >= 1 && left <= caps[i] {
                cur[i] = left;
                let split = self.make_split(cm, hops, cur.clone());
                self.splits.push(split);
            }
            return;
        }
        let rest = (p - i - 1) as u32;
        for n in 1..=caps[i].min(left.saturating_sub(rest)) {
            cur[i] = n;
            self.enumerate(cm, caps, hops, i + 1, left - n, cur);
        }
    }

    /// For every candidate bottleneck M (from the smallest feasible one up to
    /// `max_bottleneck_ratio` times it), the split with the least latency whose stages all
    /// take at most M: each stage gets one layer, the rest go to the stages with the cheapest
    /// layers up to their caps.
    fn greedy_splits(&mut self, cm: &CostModel, caps: &[u32], hops: &[f64], max_bottleneck_ratio: f64) {
        let p = caps.len();
        let l = cm.model.layers();
        // Stage time is affine in its layer count: extra + n * per_layer (with the hops on both
        // sides when sends block, as they then count against the stage's period).
        let (mut extra, mut per) = (vec![0.0; p], vec![0.0; p]);
        for i in 0..p {
            let (f0, b0) = CostModel::stage_time(&self.costs[i], 0, i == 0, i + 1 == p);
            extra[i] = f0 + b0;
            if cm.opts.p2p_blocking {
                extra[i] += if i > 0 { hops[i - 1] } else { 0.0 } + hops.get(i).copied().unwrap_or(0.0);
            }
            per[i] = self.costs[i].fwd + self.costs[i].bwd;
        }
        let time = |i: usize, n: u32| extra[i] + n as f64 * per[i];
        // Most layers stage i can take with its time at most m.
        let limit = |i: usize, m: f64| -> u32 {
            let mut n = (((m - extra[i]) / per[i]).floor().max(0.0) as u32).min(caps[i]);
            // Guard the floor against rounding: the definition is time(i, n) <= m.
            while n > 0 && time(i, n) > m {
                n -= 1;
            }
            while n < caps[i] && time(i, n + 1) <= m {
                n += 1;
            }
            n
        };
        let limits = |m: f64| -> Vec<u32> { (0..p).map(|i| limit(i, m)).collect() };
        let fits = |m: f64| {
            let mut sum = 0;
            for i in 0..p {
                let n = limit(i, m);
                if n == 0 {
                    return false;
                }
                sum += n;
            }
            sum >= l
        };
        let feasible = |lim: &[u32]| !lim.contains(&0) && lim.iter().sum::<u32>() >= l;
        // Feasibility is monotone in M: find the smallest feasible bottleneck by bisection,
        // then try every stage time from there up to `max_bottleneck_ratio` times it.
        let top = (0..p).map(|i| time(i, caps[i])).fold(0.0, f64::max);
        if !fits(top) {
            return;
        }
        // Every stage takes at least one layer, so no bottleneck below the slowest single layer.
        let (mut lo, mut hi) = ((0..p).map(|i| time(i, 1)).fold(0.0, f64::max), top);
        if fits(lo) {
            hi = lo;
        }
        for _ in 0..64 {
            let mid = 0.5 * (lo + hi);
            if fits(mid) {
                hi = mid;
            } else {
                lo = mid;
            }
            if hi - lo <= 1e-6 * hi {
                break;
            }
        }
        let m_max = if max_bottleneck_ratio.is_finite() { (hi * max_bottleneck_ratio).min(top) } else { top };
        let mut candidates: Vec<f64> = vec![];
        for i in 0..p {
            let n_lo = ((lo - extra[i]) / per[i]).floor().max(1.0) as u32;
            for n in n_lo..=caps[i] {
                let t = time(i, n);
                if t > m_max {
                    break;
                }
                if t >= lo {
                    candidates.push(t);
                }
            }
        }
        candidates.push(hi.max(lo));
        candidates.sort_by(f64::total_cmp);
        candidates.dedup();
        // Cheapest layers first; among equally cheap stages, fill early stages first in one
        // split and late stages first in another (a late stage's gradient sync hides behind the
        // earlier stages' backward passes, the first stage's does not, so a slow ring wants
        // layers moved late: Holmes's self-adapting partition, derived from the cost model).
        let mut early: Vec<usize> = (0..p).collect();
        early.sort_by(|&a, &b| per[a].total_cmp(&per[b]).then(a.cmp(&b)));
        let mut late: Vec<usize> = (0..p).collect();
        late.sort_by(|&a, &b| per[a].total_cmp(&per[b]).then(b.cmp(&a)));
        let mut seen: std::collections::HashSet<Vec<u32>> = std::collections::HashSet::new();
        for m in candidates {
            let lim = limits(m);
            if !feasible(&lim) {
                continue;
            }
            for order in [&early, &late] {
                let mut n = vec![1u32; p];
                let mut left = l - p as u32;
                for &i in order {
                    let add = left.min(lim[i] - 1);
                    n[i] += add;
                    left -= add;
                }
                if seen.insert(n.clone()) {
                    let split = self.make_split(cm, hops, n);
                    self.splits.push(split);
                }
            }
            if lim == caps {
                break; // every larger bottleneck gives this same split
            }
        }
    }

    fn make_split(&self, cm: &CostModel, hops: &[f64], layers: Vec<u32>) -> Split {
        let p = layers.len();
        let (mut latency, mut optimizer, mut pre) = (0.0, 0.0f64, 0.0);
        let mut busy = Vec::with_capacity(p);
        let mut sync_params = Vec::with_capacity(p);
        let mut pre_bwd = Vec::with_capacity(p);
        for i in 0..p {
            let (first, last) = (i == 0, i + 1 == p);
            let c = &self.costs[i];
            let (f, b) = CostModel::stage_time(c, layers[i], first, last);
            latency += f + b;
            busy.push(f + b);
            if i + 1 < p {
                latency += hops[i];
            }
            sync_params.push(layers[i] as f64 * cm.model.layer_params + cm.model.ends_params(first, last));
            optimizer = optimizer.max(cm.optimizer_time(c, self.kinds[i], layers[i], first, last));
            pre_bwd.push(pre);
            pre += b;
        }
        Split { layers, latency, period: cm.period(&busy, hops), optimizer, sync_params, pre_bwd }
    }

    /// The Pareto points of this shape under a sync context.
    pub fn frontier(&self, cm: &CostModel, ctx: &SyncContext) -> Vec<Point> {
        let coef: Vec<f64> = cm.sync_coefficients(ctx, &self.kinds);
        let pts = self
            .splits
            .iter()
            .enumerate()
            .map(|(si, s)| {
                let mut exposed: f64 = 0.0;
                for ((&params, &c), &pre) in s.sync_params.iter().zip(&coef).zip(&s.pre_bwd).take(s.layers.len()) {
                    exposed = exposed.max(params * c - pre);
                }
                Point { base: s.latency + exposed + s.optimizer, period: s.period, split: si }
            })
            .collect();
        pareto(pts)
    }
}
