//! Best-first branch and bound over allocations (see `mod.rs` for the problem and the space).
//!
//! Every allocation within the quotas gets its lower bounds (`bound.rs`), then they are taken
//! in increasing order of the cost bound. An allocation is planned only when its memory can
//! hold the model, its time bound meets the SLO and its cost bound is below the best cost
//! found so far; the first allocation whose cost bound reaches the best cost ends the search,
//! since every later one is at least as dear. With `frontier`, allocations above the SLO are
//! planned too (up to a cost cap) unless a planned one already dominates their bounds.

use crate::baselines::{best_baseline, Baseline};
use crate::cost::{CostModel, PlanOptions};
use crate::model::Model;
use crate::plan::PlanStructure;
use crate::profile::ProfileSet;
use crate::search::{search, SearchMode};

use super::bound::Bounds;
use super::offers::{Allocation, Offers};

/// One allocation with its planned iteration.
#[derive(Debug, Clone, PartialEq)]
pub struct Priced {
    pub alloc: Allocation,
    pub iteration_time: f64,
    pub price_per_hour: f64,
    pub cost_per_iteration: f64,
    /// The planner proved its plan optimal for this allocation.
    pub proven: bool,
}

/// What a provisioning search did.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Counters {
    /// Allocations within the quotas (the space).
    pub allocations: u64,
    /// Allocations planned (the planner ran on them).
    pub planned: u64,
    /// Skipped: total memory below the model's states.
    pub memory_pruned: u64,
    /// Skipped: the time bound misses the SLO.
    pub time_pruned: u64,
    /// Skipped: the cost bound reaches the best cost (or the frontier's cap), or a frontier
    /// point dominates the bounds.
    pub cost_pruned: u64,
    /// Of the skipped, those only the superset bound (monotone planner) cut.
    pub superset_pruned: u64,
    /// Planned allocations whose plan the planner did not prove optimal.
    pub unproven: u64,
}

#[derive(Clone, Copy)]
pub struct Search<'a> {
    pub offers: &'a Offers,
    pub model: &'a Model,
    pub profiles: &'a ProfileSet,
    pub opts: &'a PlanOptions,
    pub mode: SearchMode,
    pub slo: f64,
    /// Also bound an allocation's time by the time planned on any allocation that contains
    /// it (`T(A) >= T(B)` for `A` within `B`: more GPUs to choose from never force a slower
    /// plan, which holds for the exact planner).
    pub monotone: bool,
    /// Told after every batch of planned allocations (the caller draws progress).
    pub progress: Option<&'a (dyn Fn(&Progress) + Sync)>,
}

/// Where a search is, for progress reports.
#[derive(Debug, Clone, PartialEq)]
pub struct Progress {
    /// Allocations looked at (planned or cut) of `total`.
    pub visited: u64,
    pub total: u64,
    pub planned: u64,
    /// Cheapest cost per iteration meeting the SLO so far.
    pub best_cost: Option<f64>,
}

/// Outcome of a search over a set of allocations.
#[derive(Debug, Clone, Default)]
pub struct Outcome {
    /// Cheapest allocation meeting the SLO.
    pub best: Option<Priced>,
    /// Pareto frontier of (iteration time, cost per iteration), by increasing time.
    pub frontier: Vec<Priced>,
    /// The fastest allocation planned, SLO or not.
    pub fastest: Option<Priced>,
    pub counters: Counters,
}

impl<'a> Search<'a> {
    pub fn bounds(&self) -> Bounds {
        Bounds::new(self.offers, self.model, self.profiles, self.opts)
    }

    /// Plan one allocation: the planner's plan (never slower than the Megatron and Whale
    /// baselines on it) and whether it is proven optimal. None when nothing fits.
    pub fn plan(&self, alloc: &[u32]) -> Option<(f64, PlanStructure, bool)> {
        let cluster = self.offers.cluster(alloc).ok()?;
        let cm = CostModel { cluster: &cluster, model: self.model, profiles: self.profiles, opts: self.opts };
        let seeds: Vec<PlanStructure> =
            [Baseline::Megatron, Baseline::Whale].iter().filter_map(|&b| best_baseline(&cm, b).map(|x| x.1)).collect();
        search(&cm, self.mode, &seeds).ok().map(|s| (s.iteration_time, s.plan, s.stats.proven_optimal))
    }

    fn price(&self, alloc: &[u32]) -> Option<Priced> {
        let (t, _, proven) = self.plan(alloc)?;
        let price = self.offers.price_per_hour(alloc);
        Some(Priced { alloc: alloc.to_vec(), iteration_time: t, price_per_hour: price, cost_per_iteration: t * price / 3600.0, proven })
    }

    /// Plan several allocations on all cores; results in input order.
    fn price_all(&self, allocs: &[Allocation]) -> Vec<Option<Priced>> {
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).min(allocs.len()).max(1);
        if threads == 1 {
            return allocs.iter().map(|a| self.price(a)).collect();
        }
        let chunk = allocs.len().div_ceil(threads);
        std::thread::scope(|s| {
            let handles: Vec<_> =
                allocs.chunks(chunk).map(|c| s.spawn(move || c.iter().map(|a| self.price(a)).collect::<Vec<_>>())).collect();
            handles.into_iter().flat_map(|h| h.join().expect("planner thread")).collect()
        })
    }

    /// Plan every allocation that `keep` admits: the brute-force oracle.
    pub fn exhaustive(&self, keep: impl Fn(&[u32]) -> bool) -> Outcome {
        let allocs: Vec<Allocation> = self.offers.all_allocations().into_iter().filter(|a| keep(a)).collect();
        let mut out = Outcome { counters: Counters { allocations: allocs.len() as u64, ..Default::default() }, ..Default::default() };
        for (k, chunk) in allocs.chunks(64).enumerate() {
            for p in self.price_all(chunk).into_iter().flatten() {
                out.counters.unproven += u64::from(!p.proven);
                self.record(&mut out, p);
            }
            if let Some(report) = self.progress {
                let done = (k * 64 + chunk.len()) as u64;
                report(&Progress {
                    visited: done,
                    total: allocs.len() as u64,
                    planned: done,
                    best_cost: out.best.as_ref().map(|b| b.cost_per_iteration),
                });
            }
        }
        out.counters.planned = allocs.len() as u64;
        out
    }

    /// Best-first branch and bound over the allocations `keep` admits. With `frontier_cap`,
    /// also the Pareto frontier of every allocation whose cost is at most `cap` x the best.
    pub fn branch_and_bound(&self, keep: impl Fn(&[u32]) -> bool, frontier_cap: Option<f64>) -> Outcome {
        let bounds = self.bounds();
        let mut cands: Vec<(f64, f64, Allocation)> = self
            .offers
            .all_allocations()
            .into_iter()
            .filter(|a| keep(a))
            .map(|a| {
                let t = bounds.time(&a);
                (t * self.offers.price_per_hour(&a) / 3600.0, t, a)
            })
            .collect();
        cands.sort_by(|x, y| x.0.total_cmp(&y.0).then(x.1.total_cmp(&y.1)).then(x.2.cmp(&y.2)));
        let mut out = Outcome { counters: Counters { allocations: cands.len() as u64, ..Default::default() }, ..Default::default() };
        let batch = std::thread::available_parallelism().map_or(1, |n| n.get());
        // Planned allocations and their times (infinite: nothing fits), for the superset bound.
        let mut known: Vec<(f64, Allocation)> = vec![];
        if self.monotone {
            // The largest allocation first: its time bounds every other one from below.
            let n = self.offers.offers.len();
            let top: Allocation = (0..n).map(|j| cands.iter().map(|c| c.2[j]).max().unwrap_or(0)).collect();
            if cands.iter().any(|c| c.2 == top) {
                let p = self.price(&top);
                out.counters.planned += 1;
                known.push((p.as_ref().map_or(f64::INFINITY, |p| p.iteration_time), top.clone()));
                out.counters.unproven += u64::from(p.as_ref().is_none_or(|p| !p.proven));
                if let Some(p) = p {
                    self.record(&mut out, p);
                }
                cands.retain(|c| c.2 != top);
            }
        }
        let mut i = 0;
        while i < cands.len() {
            let cap = match (&out.best, frontier_cap) {
                (None, _) => f64::INFINITY,
                (Some(b), None) => b.cost_per_iteration,
                (Some(b), Some(f)) => b.cost_per_iteration * f,
            };
            if cands[i].0 >= cap {
                out.counters.cost_pruned += (cands.len() - i) as u64;
                break;
            }
            // The next few admissible candidates, planned side by side.
            let mut todo = vec![];
            while i < cands.len() && todo.len() < batch && cands[i].0 < cap {
                let (lb_cost0, lb_t0, a) = &cands[i];
                i += 1;
                let sup = if self.monotone { superset_time(&known, a) } else { 0.0 };
                let lb_t = lb_t0.max(sup);
                let lb_cost = if lb_t > *lb_t0 { lb_t * self.offers.price_per_hour(a) / 3600.0 } else { *lb_cost0 };
                let cut_without_sup = |lb_t: f64, lb_cost: f64| {
                    (frontier_cap.is_none() && lb_t > self.slo)
                        || out.frontier.iter().any(|p| p.cost_per_iteration <= lb_cost && p.iteration_time <= lb_t)
                        || (frontier_cap.is_none() && out.best.as_ref().is_some_and(|b| lb_cost >= b.cost_per_iteration))
                        || lb_cost >= cap
                };
                if !bounds.may_fit(a) {
                    out.counters.memory_pruned += 1;
                } else if frontier_cap.is_none() && *lb_t0 > self.slo {
                    out.counters.time_pruned += 1;
                } else if cut_without_sup(*lb_t0, *lb_cost0) {
                    out.counters.cost_pruned += 1;
                } else if cut_without_sup(lb_t, lb_cost) {
                    out.counters.superset_pruned += 1;
                } else {
                    todo.push(a.clone());
                }
            }
            out.counters.planned += todo.len() as u64;
            for (a, p) in todo.iter().zip(self.price_all(&todo)) {
                if self.monotone {
                    known.push((p.as_ref().map_or(f64::INFINITY, |p| p.iteration_time), a.clone()));
                }
                out.counters.unproven += u64::from(p.as_ref().is_none_or(|p| !p.proven));
                if let Some(p) = p {
                    self.record(&mut out, p);
                }
            }
            if let Some(report) = self.progress {
                report(&Progress {
                    visited: i as u64,
                    total: cands.len() as u64,
                    planned: out.counters.planned,
                    best_cost: out.best.as_ref().map(|b| b.cost_per_iteration),
                });
            }
        }
        if let (Some(b), Some(f)) = (&out.best, frontier_cap) {
            let cap = b.cost_per_iteration * f;
            out.frontier.retain(|p| p.cost_per_iteration <= cap);
        }
        out
    }

    fn record(&self, out: &mut Outcome, p: Priced) {
        if out.fastest.as_ref().is_none_or(|f| p.iteration_time < f.iteration_time) {
            out.fastest = Some(p.clone());
        }
        if p.iteration_time <= self.slo && out.best.as_ref().is_none_or(|b| better(&p, b)) {
            out.best = Some(p.clone());
        }
        if !out.frontier.iter().any(|q| q.cost_per_iteration <= p.cost_per_iteration && q.iteration_time <= p.iteration_time) {
            out.frontier.retain(|q| !(p.cost_per_iteration <= q.cost_per_iteration && p.iteration_time <= q.iteration_time));
            out.frontier.push(p);
            out.frontier.sort_by(|a, b| a.iteration_time.total_cmp(&b.iteration_time));
        }
    }
}

/// The longest time planned on an allocation containing `a` (0 if none). A valid bound for
/// the exact planner (more GPUs to choose from never force a slower plan); the fast planner
/// narrows its space per set of GPU types, so a plan on more types can come out slower than
/// one on fewer, and then this bound may cut the true optimum (`proven_optimal` says so).
fn superset_time(known: &[(f64, Allocation)], a: &[u32]) -> f64 {
    known.iter().filter(|(_, b)| b.iter().zip(a).all(|(x, y)| x >= y)).map(|k| k.0).fold(0.0, f64::max)
}

/// Cheaper wins; then faster; then fewer GPUs of earlier offers (deterministic).
fn better(a: &Priced, b: &Priced) -> bool {
    let rel = |x: f64, y: f64| (x - y) / y.abs().max(1e-300);
    let dc = rel(a.cost_per_iteration, b.cost_per_iteration);
    if dc.abs() > 1e-12 {
        return dc < 0.0;
    }
    let dt = rel(a.iteration_time, b.iteration_time);
    if dt.abs() > 1e-12 {
        return dt < 0.0;
    }
    a.alloc < b.alloc
}
