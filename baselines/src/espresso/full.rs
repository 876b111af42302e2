//! A larger space under Espresso's estimator (`motley-baselines espresso search --space full`): every
//! allocation of `search.rs`'s space, but with *every* stage order and *every* split of the
//! layers (at least one per stage) instead of the one Espresso's placer picks. Still priced by
//! Espresso's estimator, so its plans compare with Espresso's on Espresso's ground.
//!
//! Per allocation, a depth-first search over distinct stage orders and layer counts, stage by
//! stage, cut by two bounds that hold for any completion: stage `i` cannot start its first
//! forward before the earlier stages' forwards, runs its `M` forwards and backwards back to
//! back, and its last backward must still pass back through the earlier stages, so
//! `T >= sum_{k<i} (F_k + B_k) + M (F_i + B_i)` (growing with stage i's layers); and the layers
//! left must fit in the stages left, by memory (each position's cap) and by time
//! (`sum_j ((T - prefix)/M - 0.8 (pp-1) comm_j) / (4 t_f(g_j))`). The incumbent time is
//! the least of the SLO and what the best cost so far allows at this allocation's price, so a
//! leaf is only simulated when it could win. Allocations go in increasing order of the same
//! cost bound as `search.rs`, starting from the placer space's optimum. A node budget
//! bounds the work; when it runs out the result is the best found (`budget_cut`).

use super::estimator::{Estimate, LayerTerms};
use super::placer::Placer;
use super::search::{EspressoPlan, Search, SearchCounters, SearchOutcome};

/// Best (order, layers) for one allocation at one dp, strictly faster than `t_cap`, within
/// `budget` search nodes (spent nodes are subtracted; a cut leaves it at 0).
pub fn best_split(placer: &Placer, counts: &[u32], t_cap: f64, budget: &mut u64) -> Option<(Vec<usize>, Vec<u32>, Estimate)> {
    let est = placer.est;
    let pp: usize = counts.iter().map(|&c| c as usize).sum();
    let l = placer.layers;
    if pp == 0 || pp as u32 > l {
        return None;
    }
    let m = est.job.gradient_accumulation_steps as f64;
    let terms = &placer.est_terms;
    let caps: Vec<Vec<u32>> =
        (0..counts.len()).map(|t| if counts[t] > 0 { (0..pp).map(|st| placer.cap(t, pp, st)).collect() } else { vec![] }).collect();
    let hop = |t: usize| terms[t].comm * (pp - 1) as f64 * 0.8;
    let mut st = Dfs {
        placer,
        counts: counts.to_vec(),
        pp,
        m,
        terms,
        caps: &caps,
        best: None,
        t_cap,
        order: vec![],
        layers: vec![],
        prefix: 0.0,
        budget: *budget,
    };
    st.go(0, l, &hop);
    *budget = st.budget;
    st.best
}

struct Dfs<'a, 'p> {
    placer: &'a Placer<'p>,
    counts: Vec<u32>,
    pp: usize,
    m: f64,
    terms: &'a [LayerTerms],
    caps: &'a [Vec<u32>],
    best: Option<(Vec<usize>, Vec<u32>, Estimate)>,
    t_cap: f64,
    order: Vec<usize>,
    layers: Vec<u32>,
    /// `F + B` of one micro-batch summed over the stages placed so far.
    prefix: f64,
    /// Search nodes left.
    budget: u64,
}

impl Dfs<'_, '_> {
    fn limit(&self) -> f64 {
        self.best.as_ref().map_or(self.t_cap, |b| b.2.iteration_time.min(self.t_cap))
    }

    /// `F_i + B_i` of one micro-batch on stage `i` with `n` layers on type `t`.
    fn stage_fb(&self, t: usize, i: usize, n: u32, hop: &dyn Fn(usize) -> f64) -> f64 {
        let tt = &self.terms[t];
        let (first, last) = (i == 0, i + 1 == self.pp);
        let emb = if last {
            tt.emb_out
        } else if first {
            tt.emb_in
        } else {
            0.0
        };
        let f0 = n as f64 * tt.t_f + emb;
        f0 + hop(t) + 3.0 * f0
    }

    /// Can the stages after `i` (the types still in `counts`) take `left` layers under `limit`?
    fn rest_can_take(&self, i: usize, left: u32, limit: f64, hop: &dyn Fn(usize) -> f64) -> bool {
        let rest = self.pp - i - 1;
        if rest == 0 {
            return left == 0;
        }
        if (left as usize) < rest {
            return false;
        }
        let (mut by_memory, mut by_time) = (0u64, 0.0f64);
        for (t, &c) in self.counts.iter().enumerate().filter(|(_, &c)| c > 0) {
            let cap = (i + 1..self.pp).map(|s| self.caps[t][s]).max().unwrap_or(0);
            by_memory += c as u64 * cap as u64;
            by_time += c as f64 * ((limit / self.m - hop(t)) / (4.0 * self.terms[t].t_f)).max(0.0);
        }
        by_memory >= left as u64 && by_time >= left as f64
    }

    fn go(&mut self, i: usize, left: u32, hop: &dyn Fn(usize) -> f64) {
        if self.budget == 0 {
            return;
        }
        self.budget -= 1;
        if i == self.pp {
            if left == 0 {
                let e = self.placer.price(&self.order, &self.layers);
                if e.fits && e.iteration_time < self.limit() {
                    self.best = Some((self.order.clone(), self.layers.clone(), e));
                }
            }
            return;
        }
        for t in 0..self.counts.len() {
            if self.counts[t] == 0 {
                continue;
            }
            let rest = (self.pp - i - 1) as u32;
            let most = self.caps[t][i].min(left.saturating_sub(rest));
            self.counts[t] -= 1;
            self.order.push(t);
            for n in 1..=most {
                let limit = self.limit();
                // Stage i's first forward waits for the earlier stages' forwards, its M
                // forwards and backwards run back to back, and its last backward still has to
                // pass back through the earlier stages: T >= prefix + M (F_i + B_i).
                let fb = self.stage_fb(t, i, n, hop);
                if self.prefix + self.m * fb >= limit {
                    break; // more layers only make this stage slower
                }
                if !self.rest_can_take(i, left - n, limit - self.prefix - fb, hop) {
                    continue;
                }
                self.layers.push(n);
                self.prefix += fb;
                self.go(i + 1, left - n, hop);
                self.prefix -= fb;
                self.layers.pop();
            }
            self.order.pop();
            self.counts[t] += 1;
        }
    }
}

impl Search<'_> {
    /// The cheapest plan with any stage order and layer split (see the module doc).
    pub fn run_full(&self) -> SearchOutcome {
        let seed = self.run();
        let placers = self.placers();
        let mut cands = self.candidates(&placers);
        cands.sort_by(|a, b| a.lb_cost.total_cmp(&b.lb_cost).then(a.lb_time.total_cmp(&b.lb_time)));
        let mut out = SearchOutcome {
            best: seed.best.clone(),
            fastest: seed.fastest.clone(),
            counters: SearchCounters { allocations: cands.len() as u64, ..Default::default() },
        };
        let slo = self.est.job.slo;
        let mut budget = FULL_BUDGET;
        for (k, c) in cands.iter().enumerate() {
            let (di, lb_t, lb_cost, counts) = (&c.dp_index, &c.lb_time, &c.lb_cost, &c.counts);
            if out.best.as_ref().is_some_and(|b| *lb_cost > b.estimate.cost) {
                out.counters.cost_pruned += (cands.len() - k) as u64;
                break;
            }
            if *lb_t >= slo {
                out.counters.time_pruned += 1;
                continue;
            }
            let dp = placers[*di].dp;
            let money: f64 = counts.iter().enumerate().map(|(t, &c)| c as f64 * self.est.gpus[t].price * dp as f64).sum();
            let t_cap = out.best.as_ref().map_or(slo, |b| slo.min(b.estimate.cost * 3600.0 / money * (1.0 + 1e-12)));
            out.counters.placed += 1;
            if budget == 0 {
                out.counters.budget_cut = true;
                break;
            }
            if let Some((order, layers, e)) = best_split(&placers[*di], counts, t_cap, &mut budget) {
                let plan = EspressoPlan { dp, counts: counts.clone(), order, layers, estimate: e };
                if plan.estimate.iteration_time < slo && out.best.as_ref().is_none_or(|b| plan.estimate.cost < b.estimate.cost) {
                    out.best = Some(plan);
                }
            }
        }
        out.counters.budget_cut |= budget == 0;
        out
    }
}

/// Search nodes the full-space search may visit over all allocations (a few seconds here).
pub const FULL_BUDGET: u64 = 30_000_000;
