//! Espresso's own GPU allocator (`GPUAllocator.gpu_allocator`), replayed with its counters so
//! that its search can be run side by side with the exact one. For each dp in 1, 2, 4, 8 and
//! each pipeline depth in its boundary range `[k_lower, k_upper)` (the depths where a uniform
//! split fits on one GPU type; the upper end is exclusive, so at most 7), it places the four
//! homogeneous allocations, then walks a cost tree (one level per GPU type, in table order)
//! best first by a FLOP-based bound, placing every complete allocation it pops. Its cost
//! pruning also applies the whole-job memory test (memory of a uniform split on the first
//! GPU type) to *partial* allocations: that cuts branches later levels would complete, which
//! is why it misses cheaper mixed plans (RESULTS.md). Kept as Espresso does it.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use super::estimator::{stage_memory, Estimator, EstimatorGpu, OOM_TIME};
use super::placer::Placer;
use super::search::EspressoPlan;

#[derive(Debug, Clone, Default, PartialEq)]
pub struct AllocatorCounters {
    /// Allocations placed (`callMapper` calls, homogeneous ones counted twice as Espresso does).
    pub placed: u64,
    pub pops: u64,
    pub bound_calls: u64,
    /// Cost-pruning cuts at pop, and how many of them the whole-job memory test caused.
    pub cost_pruned: u64,
    pub memory_cuts: u64,
    /// Children not pushed because their bound was infinite.
    pub time_pruned: u64,
}

#[derive(Debug, Clone)]
pub struct AllocatorResult {
    pub best: Option<EspressoPlan>,
    pub fastest: Option<EspressoPlan>,
    pub counters: AllocatorCounters,
}

const GIB: f64 = 1073741824.0;

struct Ctx<'a> {
    placer: &'a Placer<'a>,
    pp: usize,
    min_mem: f64,
    maxfit: &'a [i64],
    table_peaks: &'a [f64],
}

impl Ctx<'_> {
    fn dp(&self) -> u32 {
        self.placer.dp
    }

    /// `minCostEstimator`: (cost bound, time bound); (inf, inf) when the allocation's memory
    /// is below the whole job's.
    fn bound(&self, cfg: &[usize], full_layers: bool) -> (f64, f64) {
        let job = &self.placer.est.job;
        let d = self.placer.est.dims;
        let l: i64 = if full_layers { self.placer.layers as i64 } else { cfg.iter().map(|&g| self.maxfit[g]).sum() };
        let price: f64 = cfg.iter().map(|&g| self.placer.est.gpus[g].price).sum::<f64>() / 3600.0;
        let r: f64 = cfg.iter().map(|&g| self.table_peaks[g] * self.dp() as f64).sum();
        let (s, h, v) = (d.s as f64, d.h as f64, d.v as f64);
        let flops = if l == 0 {
            0.0
        } else {
            (72 * job.global_batch_size as i128 * l as i128 * (d.s * d.h * d.h) as i128) as f64
                * (1.0 + s / (6.0 * h) + v / (12.0 * h * l as f64))
                / 1e12
        };
        let m = job.gradient_accumulation_steps as f64;
        let p = m / (m + self.pp as f64 - 1.0) * 0.35;
        let tmin = flops / (p * r);
        let mem: f64 = cfg.iter().map(|&g| self.placer.est.gpus[g].memory_gb * self.dp() as f64).sum();
        if mem < self.min_mem {
            return (f64::INFINITY, f64::INFINITY);
        }
        if tmin < job.slo {
            (tmin * price, tmin)
        } else {
            (f64::INFINITY, tmin)
        }
    }

    fn call_mapper(&self, cfg: &[usize], counts: &mut AllocatorCounters) -> (f64, Option<EspressoPlan>) {
        counts.placed += 1;
        let mut c = vec![0u32; self.placer.est.gpus.len()];
        for &g in cfg {
            c[g] += 1;
        }
        let mut money = 0.0;
        for &g in cfg {
            money += self.placer.est.gpus[g].price * self.dp() as f64 * 1.0;
        }
        match self.placer.place(&c) {
            Some(p) => {
                let plan = EspressoPlan { dp: self.dp(), counts: c, order: p.order, layers: p.layers, estimate: p.estimate };
                (plan.estimate.cost, Some(plan))
            }
            None => (money * OOM_TIME / 3600.0, None),
        }
    }
}

fn uniform(l: u32, k: usize) -> Vec<u32> {
    (0..k).map(|i| l / k as u32 + u32::from(i < (l as usize % k))).collect()
}

/// Run Espresso's allocator on `quotas` (GPUs per type, table order).
pub fn replay(est: &Estimator, placer_gpus: &[EstimatorGpu], table_peaks: &[f64], quotas: &[u32]) -> AllocatorResult {
    let job = &est.job;
    let n = est.gpus.len();
    let mut out = AllocatorResult { best: None, fastest: None, counters: AllocatorCounters::default() };
    let mut best_money = OOM_TIME;
    let consider = |out: &mut AllocatorResult, best_money: &mut f64, money: f64, plan: Option<EspressoPlan>| {
        if let Some(p) = plan {
            if p.estimate.fits && out.fastest.as_ref().is_none_or(|f| p.estimate.iteration_time < f.estimate.iteration_time) {
                out.fastest = Some(p.clone());
            }
            if p.estimate.fits && p.estimate.iteration_time < job.slo && money < *best_money {
                *best_money = money;
                out.best = Some(p);
            }
        }
    };
    for dp in [1u32, 2, 4, 8] {
        if job.gradient_accumulation_steps as u64 * dp as u64 > job.global_batch_size as u64 {
            continue;
        }
        let placer = Placer::new(est, placer_gpus, table_peaks, dp);
        let l = placer.layers;
        let fits_uniform = |k: usize| (0..n).any(|t| placer.price(&vec![t; k], &uniform(l, k)).fits);
        let k_lower = (1..=8).find(|&k| fits_uniform(k)).unwrap_or(9);
        let k_upper = (1..=8).rev().find(|&k| fits_uniform(k)).unwrap_or(8);
        let (terms, fit) = (&placer.est_terms, placer.fit);
        // Most layers a GPU holds as a first stage with one micro-batch, within 80% of memory.
        let maxfit: Vec<i64> = (0..n)
            .map(|g| {
                let (mut lo, mut hi, mut best) = (1i64, l as i64, -1i64);
                while lo <= hi {
                    let mid = (lo + hi) / 2;
                    if stage_memory(&terms[g], mid as u32, 1, true, false, fit) < 0.8 * est.gpus[g].memory_gb * GIB {
                        best = mid;
                        lo = mid + 1;
                    } else {
                        hi = mid - 1;
                    }
                }
                best
            })
            .collect();
        for pp in k_lower..k_upper {
            // (a) the homogeneous allocations.
            let mut rapid: Option<(f64, Option<EspressoPlan>)> = None;
            let ctx = Ctx { placer: &placer, pp, min_mem: 0.0, maxfit: &maxfit, table_peaks };
            for (t, &quota) in quotas.iter().enumerate().take(n) {
                if dp as usize * pp > quota as usize {
                    continue;
                }
                let (money, plan) = ctx.call_mapper(&vec![t; pp], &mut out.counters);
                let success = plan.as_ref().is_some_and(|p| p.estimate.iteration_time < job.slo);
                if success && rapid.as_ref().is_none_or(|r| r.0 > money) {
                    rapid = Some((money, plan));
                }
            }
            if let Some((money, plan)) = rapid {
                if money < best_money {
                    consider(&mut out, &mut best_money, money, plan);
                }
            }
            // (b) the cost tree.
            let uni = uniform(l, pp);
            let e = placer.price(&vec![0; pp], &uni);
            let min_mem: f64 = e.stages.iter().map(|s| s.memory).sum::<f64>() / GIB;
            let ctx = Ctx { min_mem, ..ctx };
            let mut heap = BinaryHeap::new();
            let mut seq = 0u64;
            heap.push(Reverse((Ord64(0.0), seq, Vec::<usize>::new(), 0usize, -1i64)));
            while let Some(Reverse((_, _, cfg, stage, idx))) = heap.pop() {
                out.counters.pops += 1;
                if stage == pp {
                    let (money, plan) = ctx.call_mapper(&cfg, &mut out.counters);
                    consider(&mut out, &mut best_money, money, plan);
                    continue;
                }
                if idx >= n as i64 {
                    continue;
                }
                if !cfg.is_empty() {
                    out.counters.bound_calls += 1;
                    let (cl, tl) = ctx.bound(&cfg, false);
                    if cl > best_money {
                        out.counters.cost_pruned += 1;
                        if tl.is_infinite() {
                            out.counters.memory_cuts += 1;
                        }
                        continue;
                    }
                    if tl > job.slo {
                        out.counters.time_pruned += 1;
                        continue;
                    }
                }
                let t = (idx + 1) as usize;
                let limit = if t < n { quotas[t] / dp } else { 0 };
                for num in 0..=(limit as usize).min(pp - cfg.len()) {
                    let mut child = cfg.clone();
                    child.extend(std::iter::repeat_n(t, num));
                    // Completions start at the parent's level (at the root, Python's T[-1]: the last type).
                    let mut prio = f64::INFINITY;
                    for i in idx..n as i64 {
                        let fill = if i < 0 { n - 1 } else { i as usize };
                        let mut full = child.clone();
                        full.extend(std::iter::repeat_n(fill, pp - child.len()));
                        out.counters.bound_calls += 1;
                        prio = prio.min(ctx.bound(&full, true).0);
                    }
                    if prio >= OOM_TIME {
                        out.counters.time_pruned += 1;
                        continue;
                    }
                    seq += 1;
                    heap.push(Reverse((Ord64(prio), seq, child, stage + num, t as i64)));
                }
            }
        }
    }
    out
}

/// An f64 ordered by `total_cmp`, for the heap.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Ord64(f64);
impl Eq for Ord64 {}
impl PartialOrd for Ord64 {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Ord64 {
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        self.0.total_cmp(&o.0)
    }
}
