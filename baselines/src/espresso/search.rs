//! The cheapest plan under Espresso's own estimator, exactly, over a declared space.
//!
//! **Space.** Every `dp` dividing `global_batch / M` (Espresso tries 1, 2, 4, 8); every
//! allocation of `c_t` GPUs of type t per replica with `dp * c_t <= quota_t` and
//! `1 <= pp = sum c_t <= max_stages` (default: the layer count; Espresso stops at 7); each
//! allocation placed by Espresso's own placer (`placer.rs`: its stage order and layers) and
//! priced by its estimator. Objective: least $ per iteration with `T < slo` (strict, as
//! Espresso). This is the space RESULTS.md's "optimum" enumerates, without Espresso's
//! pipeline-depth boundaries (which hide a cheaper LLaMA-7B plan).
//!
//! **Bound.** Every stage runs its `M` forwards and `M` backwards one after another, so
//! `T >= M * (F_i + B_i)` with `F_i + B_i >= 4 * L_i * t_f(g_i) + 0.8 (pp - 1) comm(g_i)`
//! for every stage; since the layers cover the model, `T >= M * (min_i 0.8 (pp - 1) comm_i +
//! 4 L / sum_i 1 / t_f(g_i))` whatever the placer decides. Cost `>= dp * sum price * T / 3600`.
//! Allocations are visited in increasing order of that cost bound; the search stops when the
//! bound exceeds the best cost found, and skips allocations whose time bound misses the SLO.
//! `exhaustive` places every allocation of the space (the oracle the tests compare with).

use super::estimator::{Estimate, Estimator, EstimatorGpu};
use super::placer::Placer;

/// Search settings.
#[derive(Debug, Clone)]
pub struct SpaceLimits {
    /// Per GPU type: GPUs that can be had (`dp * count <= quota`).
    pub quotas: Vec<u32>,
    /// Longest pipeline (0: the layer count).
    pub max_stages: u32,
    /// Data-parallel degrees to try (empty: every divisor of global_batch / M).
    pub dps: Vec<u32>,
}

/// A plan of the space with its price.
#[derive(Debug, Clone)]
pub struct EspressoPlan {
    pub dp: u32,
    /// GPUs per type per replica (the allocation).
    pub counts: Vec<u32>,
    /// Stage order (GPU type indices) and layers, as the placer decided.
    pub order: Vec<usize>,
    pub layers: Vec<u32>,
    pub estimate: Estimate,
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct SearchCounters {
    /// Allocations (dp, counts) in the space.
    pub allocations: u64,
    /// Allocations placed (the placer ran and the estimator priced its candidates).
    pub placed: u64,
    /// Skipped because the time bound misses the SLO.
    pub time_pruned: u64,
    /// Skipped because the cost bound exceeds the best cost found.
    pub cost_pruned: u64,
    /// The full-space search ran out of its node budget: the result is the best found.
    pub budget_cut: bool,
}

#[derive(Debug, Clone)]
pub struct SearchOutcome {
    /// Cheapest plan meeting the SLO.
    pub best: Option<EspressoPlan>,
    /// Fastest plan seen (for "no plan meets the SLO").
    pub fastest: Option<EspressoPlan>,
    pub counters: SearchCounters,
}

pub(crate) struct Candidate {
    pub(crate) dp_index: usize,
    pub(crate) counts: Vec<u32>,
    pub(crate) lb_time: f64,
    pub(crate) lb_cost: f64,
}

/// Cheaper first; then faster, smaller dp, shorter pipeline, allocation in table order.
fn better(a: &EspressoPlan, b: &EspressoPlan) -> bool {
    let ka = (a.estimate.cost, a.estimate.iteration_time, a.dp, a.order.len());
    let kb = (b.estimate.cost, b.estimate.iteration_time, b.dp, b.order.len());
    match ka.0.total_cmp(&kb.0).then(ka.1.total_cmp(&kb.1)).then(ka.2.cmp(&kb.2)).then(ka.3.cmp(&kb.3)) {
        std::cmp::Ordering::Less => true,
        std::cmp::Ordering::Greater => false,
        std::cmp::Ordering::Equal => a.counts > b.counts,
    }
}

pub struct Search<'a> {
    pub est: &'a Estimator,
    pub placer_gpus: &'a [EstimatorGpu],
    pub table_peaks: &'a [f64],
    pub limits: &'a SpaceLimits,
}

impl<'a> Search<'a> {
    pub(crate) fn dps(&self) -> Vec<u32> {
        let m = self.est.job.gradient_accumulation_steps;
        let per = self.est.job.global_batch_size / m;
        if self.limits.dps.is_empty() {
            (1..=per).filter(|d| per.is_multiple_of(*d)).collect()
        } else {
            self.limits.dps.iter().copied().filter(|&d| d >= 1 && m as u64 * d as u64 <= self.est.job.global_batch_size as u64).collect()
        }
    }

    fn layers(&self) -> u32 {
        self.est.job.model_layer.unwrap_or(self.est.job.num_layers)
    }

    /// An upper bound on the allocations of the space (for refusing spaces too large to list).
    pub fn space_size(&self) -> f64 {
        let l = self.layers();
        let max_pp = if self.limits.max_stages == 0 { l } else { self.limits.max_stages.min(l) };
        self.dps()
            .iter()
            .map(|&dp| {
                (0..self.est.gpus.len())
                    .map(|t| (self.limits.quotas.get(t).copied().unwrap_or(0) / dp).min(max_pp) as f64 + 1.0)
                    .product::<f64>()
            })
            .sum()
    }

    /// One placer (tables at that dp's micro-batch) per dp of the space.
    pub(crate) fn placers(&self) -> Vec<Placer<'a>> {
        self.dps().into_iter().map(|d| Placer::new(self.est, self.placer_gpus, self.table_peaks, d)).collect()
    }

    /// Every allocation of the space with its bounds, one dp per placer.
    pub(crate) fn candidates(&self, placers: &[Placer]) -> Vec<Candidate> {
        let l = self.layers();
        let max_pp = if self.limits.max_stages == 0 { l } else { self.limits.max_stages.min(l) };
        let m = self.est.job.gradient_accumulation_steps as f64;
        let n = self.est.gpus.len();
        let mut out = vec![];
        for (di, placer) in placers.iter().enumerate() {
            let (dp, terms) = (placer.dp, &placer.est_terms);
            let max: Vec<u32> = (0..n).map(|t| (self.limits.quotas.get(t).copied().unwrap_or(0) / dp).min(max_pp)).collect();
            let mut counts = vec![0u32; n];
            loop {
                // Next multiset in lexicographic order (odometer).
                let mut t = 0;
                while t < n {
                    if counts[t] < max[t] {
                        counts[t] += 1;
                        break;
                    }
                    counts[t] = 0;
                    t += 1;
                }
                if t == n {
                    break;
                }
                let pp: u32 = counts.iter().sum();
                if pp > max_pp {
                    continue;
                }
                let mut inv_speed = 0.0;
                let mut comm_min = f64::INFINITY;
                let mut money = 0.0;
                for (t, &c) in counts.iter().enumerate().filter(|(_, &c)| c > 0) {
                    inv_speed += c as f64 / terms[t].t_f;
                    comm_min = comm_min.min(terms[t].comm);
                    money += c as f64 * self.est.gpus[t].price * dp as f64;
                }
                let lb_time = m * (0.8 * (pp - 1) as f64 * comm_min + 4.0 * l as f64 / inv_speed);
                out.push(Candidate { dp_index: di, counts: counts.clone(), lb_time, lb_cost: money * lb_time / 3600.0 });
            }
        }
        out
    }

    fn place(&self, placers: &[Placer], c: &Candidate, counters: &mut SearchCounters) -> Option<EspressoPlan> {
        counters.placed += 1;
        let p = placers[c.dp_index].place(&c.counts)?;
        Some(EspressoPlan { dp: placers[c.dp_index].dp, counts: c.counts.clone(), order: p.order, layers: p.layers, estimate: p.estimate })
    }

    fn record(&self, out: &mut SearchOutcome, p: EspressoPlan) {
        if !p.estimate.fits {
            return;
        }
        if out.fastest.as_ref().is_none_or(|f| p.estimate.iteration_time < f.estimate.iteration_time) {
            out.fastest = Some(p.clone());
        }
        if p.estimate.iteration_time < self.est.job.slo && out.best.as_ref().is_none_or(|b| better(&p, b)) {
            out.best = Some(p);
        }
    }

    /// Best-first branch and bound (see the module doc).
    pub fn run(&self) -> SearchOutcome {
        let placers = self.placers();
        let mut cands = self.candidates(&placers);
        cands.sort_by(|a, b| a.lb_cost.total_cmp(&b.lb_cost).then(a.lb_time.total_cmp(&b.lb_time)));
        let mut out =
            SearchOutcome { best: None, fastest: None, counters: SearchCounters { allocations: cands.len() as u64, ..Default::default() } };
        for (i, c) in cands.iter().enumerate() {
            if let Some(b) = &out.best {
                if c.lb_cost > b.estimate.cost {
                    out.counters.cost_pruned += (cands.len() - i) as u64;
                    break;
                }
            }
            if c.lb_time >= self.est.job.slo {
                out.counters.time_pruned += 1;
                continue;
            }
            if let Some(p) = self.place(&placers, c, &mut out.counters) {
                self.record(&mut out, p);
            }
        }
        out
    }

    /// The fastest plan of the space, SLO or not (what "no plan meets the SLO" reports): the
    /// same bound, on time.
    pub fn fastest(&self) -> Option<EspressoPlan> {
        let placers = self.placers();
        let mut cands = self.candidates(&placers);
        cands.sort_by(|a, b| a.lb_time.total_cmp(&b.lb_time).then(a.lb_cost.total_cmp(&b.lb_cost)));
        let mut counters = SearchCounters::default();
        let mut fastest: Option<EspressoPlan> = None;
        for c in &cands {
            if fastest.as_ref().is_some_and(|f| c.lb_time > f.estimate.iteration_time) {
                break;
            }
            if let Some(p) = self.place(&placers, c, &mut counters) {
                if p.estimate.fits && fastest.as_ref().is_none_or(|f| p.estimate.iteration_time < f.estimate.iteration_time) {
                    fastest = Some(p);
                }
            }
        }
        fastest
    }

    /// Place and price every allocation of the space.
    pub fn exhaustive(&self) -> SearchOutcome {
        let placers = self.placers();
        let cands = self.candidates(&placers);
        let mut out =
            SearchOutcome { best: None, fastest: None, counters: SearchCounters { allocations: cands.len() as u64, ..Default::default() } };
        for c in &cands {
            if let Some(p) = self.place(&placers, c, &mut out.counters) {
                self.record(&mut out, p);
            }
        }
        out
    }
}
