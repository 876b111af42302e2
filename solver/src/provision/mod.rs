//! `motley provision`: which GPUs to rent, and how many, so that an iteration takes at most
//! `slo` seconds for the least money (Espresso's question, under Motley's cost model).
//!
//! **Problem.** Offers `i = 1..k`: a GPU type, a price `p_i` per GPU-hour, `g_i` GPUs per
//! instance, a quota `q_i` GPUs, links and NICs. An *allocation* rents `n_i` whole instances,
//! `0 <= n_i <= floor(q_i / g_i)`, not all zero. Its cluster is planned by Motley's planner
//! (`crate::search`, the same plan space and cost model as `motley plan`, seeded with the
//! Megatron and Whale baselines), which gives the iteration time `T(n)`. Find
//!
//! ```text
//! minimise   cost(n) = T(n) * sum_i n_i g_i p_i / 3600      ($ per iteration)
//! subject to T(n) <= slo
//! ```
//!
//! **Declared space, and why the answer is exact in it.** Every allocation within the quotas,
//! each with the plan the planner returns for it (`--search fast|auto|exact` picks the planner's
//! own mode; the planner's report says when its plan is proven optimal for that allocation).
//! The search (`search.rs`) skips an allocation only by a valid bound (`bound.rs`): its memory
//! cannot hold the model's states, its compute-only time bound misses the SLO, or its cost bound
//! `lower_time * price / 3600` is at least the best cost found. So the result equals the
//! brute-force oracle's (`--exhaustive`: plan every allocation), which the tests check.
//!
//! **Frontier.** With `--frontier`, the Pareto frontier of (iteration time, cost per
//! iteration) over the allocations costing at most `frontier_cap` times the optimum, SLO or
//! not: what a looser SLO would save and what a tighter one would cost.
//!
//! **Comparisons.** The best homogeneous allocation (one offer only, Sia-style) found by the
//! same search; and Espresso-style stage placement (one GPU per stage, identical replicas,
//! layers by compute-memory ratio) on the chosen allocation, priced by the same cost model.

pub mod bound;
pub mod espresso_style;
pub mod offers;
pub mod search;

use serde::Serialize;

use crate::error::{Result, SolverError};
use crate::report::{plan, PlanDocument, PlanRequest};

pub use offers::{Allocation, Offer, OfferSpec, Offers, OffersSpec};
pub use search::{Counters, Outcome, Priced, Progress, Search};

/// Inputs of one provisioning run: the search (offers, model, planner, SLO, bounds) and what
/// to report around it.
pub struct ProvisionRequest<'a> {
    pub search: Search<'a>,
    pub iterations: u64,
    pub exhaustive: bool,
    pub compare: bool,
    /// Frontier up to this multiple of the optimum's cost (None: no frontier).
    pub frontier_cap: Option<f64>,
}

#[derive(Debug, Clone, Serialize)]
pub struct AllocationLine {
    pub offer: String,
    pub gpu: String,
    pub instances: u32,
    pub gpus: u32,
    pub price_per_gpu_hour: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct PricedReport {
    pub allocation: Vec<AllocationLine>,
    pub gpus: u32,
    pub price_per_hour: f64,
    pub iteration_time_s: f64,
    pub cost_per_iteration: f64,
    pub meets_slo: bool,
    /// Best over this one: 1 - best cost / this cost (comparisons only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub savings_vs_this: Option<f64>,
}

#[derive(Debug, Clone, Serialize)]
pub struct ProvisionSearchReport {
    /// "branch-and-bound" or "exhaustive".
    pub method: String,
    /// The planner's mode on each allocation.
    pub planner: String,
    pub allocations: u64,
    pub planned: u64,
    pub memory_pruned: u64,
    pub time_pruned: u64,
    pub cost_pruned: u64,
    /// Cut only by the superset bound (`T(A) >= T(B)` for `A` within `B`).
    pub superset_pruned: u64,
    pub monotone_bound: bool,
    /// No allocation was skipped but by a valid bound: the allocation is the best over the
    /// quotas given the planner's time on each (always without the superset bound).
    pub allocation_search_exact: bool,
    /// Allocations planned whose plan the planner did not prove optimal (fast mode: all).
    pub plans_unproven: u64,
    /// Allocation and plan both proven optimal: the allocation search was exact and the
    /// planner proved its plan on every allocation it planned (`--search exact`, small cases).
    pub proven_optimal: bool,
}

#[derive(Debug, Clone, Serialize)]
pub struct Comparison {
    /// The cheapest allocation of a single offer meeting the SLO (None: none does).
    pub homogeneous: Option<PricedReport>,
    /// Espresso-style stage placement on the chosen allocation (None: it does not fit).
    pub espresso_placement: Option<PricedReport>,
}

#[derive(Debug, Clone, Serialize)]
pub struct ProvisionReport {
    pub offers: String,
    pub model: String,
    pub global_batch: u32,
    pub slo_s: f64,
    pub iterations: u64,
    pub allocation: Vec<AllocationLine>,
    pub gpus: u32,
    pub price_per_hour: f64,
    pub iteration_time_s: f64,
    pub cost_per_iteration: f64,
    pub total_cost: f64,
    pub total_hours: f64,
    /// The plan on the allocation, as `motley plan -o json` prints it.
    pub plan: PlanDocument,
    pub search: ProvisionSearchReport,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub compare: Option<Comparison>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub frontier: Option<Vec<PricedReport>>,
}

/// Rent the cheapest allocation that meets the SLO, and lay out the report.
pub fn provision(req: &ProvisionRequest) -> Result<ProvisionReport> {
    let s = req.search;
    s.opts.validate()?;
    let count = s.offers.allocation_count();
    if count > crate::limits::MAX_ALLOCATIONS {
        return Err(SolverError::invalid(
            "offers[].quota",
            format!(
                "{count:.0} allocations are too many to search (at most {:.0}); lower the quotas or raise gpus_per_node",
                crate::limits::MAX_ALLOCATIONS
            ),
        ));
    }
    check_memory(&s)?;
    let all = |_: &[u32]| true;
    let out = if req.exhaustive { s.exhaustive(all) } else { s.branch_and_bound(all, req.frontier_cap) };
    // The best single-offer allocation (Sia-style): compared with, and, since the superset
    // bound can cut the optimum on a fast planner, a floor the answer never goes above.
    let homogeneous = (req.compare || s.monotone)
        .then(|| {
            (0..s.offers.offers.len())
                .filter_map(|i| {
                    Search { progress: None, ..s }
                        .branch_and_bound(|a: &[u32]| a.iter().enumerate().all(|(j, &n)| j == i || n == 0), None)
                        .best
                })
                .min_by(|a, b| a.cost_per_iteration.total_cmp(&b.cost_per_iteration))
        })
        .flatten();
    let Some(mut best) = out.best.clone().or_else(|| homogeneous.clone()) else { return Err(nothing_meets(&s, out.fastest.as_ref())) };
    if let Some(h) = homogeneous.as_ref().filter(|h| h.cost_per_iteration < best.cost_per_iteration) {
        best = h.clone();
    }
    let cluster = s.offers.cluster(&best.alloc)?;
    let plan_report = plan(&PlanRequest {
        cluster: &cluster,
        model: s.model,
        profiles: s.profiles,
        opts: s.opts,
        mode: s.mode,
        exhaustive: false,
        seeds: vec![],
    })?;
    // Exact over allocations when every skip rests on a valid bound: the superset bound is
    // valid only where the planner proved its plans (the exact planner never slows down with
    // more GPUs; the fast one can).
    let c = &out.counters;
    let allocation_exact = req.exhaustive || !s.monotone || c.unproven == 0;
    let proven = allocation_exact && c.unproven == 0 && plan_report.search.proven_optimal;
    let compare = req.compare.then(|| {
        let espresso = espresso_style::best_on(&s, &best.alloc);
        Comparison {
            homogeneous: homogeneous.as_ref().map(|h| priced_report(s.offers, s.slo, h, Some(&best))),
            espresso_placement: espresso.map(|e| priced_report(s.offers, s.slo, &e, Some(&best))),
        }
    });
    let frontier = req.frontier_cap.map(|_| out.frontier.iter().map(|p| priced_report(s.offers, s.slo, p, None)).collect());
    Ok(ProvisionReport {
        offers: s.offers.name.clone(),
        model: s.model.spec.name.clone(),
        global_batch: s.opts.global_batch,
        slo_s: s.slo,
        iterations: req.iterations,
        allocation: lines(s.offers, &best.alloc),
        gpus: s.offers.gpus(&best.alloc),
        price_per_hour: best.price_per_hour,
        iteration_time_s: best.iteration_time,
        cost_per_iteration: best.cost_per_iteration,
        total_cost: best.cost_per_iteration * req.iterations as f64,
        total_hours: best.iteration_time * req.iterations as f64 / 3600.0,
        plan: plan_report,
        search: ProvisionSearchReport {
            method: if req.exhaustive { "exhaustive" } else { "branch-and-bound" }.into(),
            planner: format!("{:?}", s.mode).to_lowercase(),
            allocations: c.allocations,
            planned: c.planned,
            memory_pruned: c.memory_pruned,
            time_pruned: c.time_pruned,
            cost_pruned: c.cost_pruned,
            superset_pruned: c.superset_pruned,
            monotone_bound: s.monotone,
            allocation_search_exact: allocation_exact,
            plans_unproven: c.unproven,
            proven_optimal: proven,
        },
        compare,
        frontier,
    })
}

/// Refuse early when the bounds prove it: the whole quota's memory cannot hold the model's
/// states, or even its compute-only time bound misses the SLO.
fn check_memory(s: &Search) -> Result<()> {
    let full: Allocation = s.offers.offers.iter().map(|o| o.max_nodes).collect();
    let bounds = s.bounds();
    let gib = 1024f64.powi(3);
    if !bounds.may_fit(&full) {
        return Err(SolverError::DoesNotFit(format!(
            "{} needs at least {:.1} GiB for weights, gradients and Adam states, but the whole quota holds {:.1} GiB of usable GPU memory: \
             {:.1} GiB missing; raise offers[].quota or offer GPUs with more memory",
            s.model.spec.name,
            bounds.state_bytes / gib,
            bounds.memory(&full) / gib,
            bounds.missing_gib(&full)
        )));
    }
    if bounds.time(&full) > s.slo {
        return Err(SolverError::invalid(
            "--slo",
            format!(
                "no allocation within the quotas meets {} s per iteration: even the whole quota's compute alone takes {:.4} s; \
                 raise --slo above {:.4} or raise offers[].quota",
                s.slo,
                bounds.time(&full),
                bounds.time(&full)
            ),
        ));
    }
    Ok(())
}

/// The search found nothing: say how fast the fastest allocation it planned goes and what that
/// costs, or that no plan's activations fit.
fn nothing_meets(s: &Search, fastest: Option<&Priced>) -> SolverError {
    let full: Allocation = s.offers.offers.iter().map(|o| o.max_nodes).collect();
    let bounds = s.bounds();
    let gib = 1024f64.powi(3);
    match fastest {
        None => SolverError::DoesNotFit(format!(
            "{}'s states fit in the whole quota ({:.1} of {:.1} GiB) but no plan's activations do; pass --recompute, lower \
             --micro-batch or raise offers[].quota",
            s.model.spec.name,
            bounds.state_bytes / gib,
            bounds.memory(&full) / gib
        )),
        Some(f) => SolverError::invalid(
            "--slo",
            format!(
                "no allocation within the quotas meets {} s per iteration; the fastest planned, {}, takes {:.4} s at ${:.6} \
                 per iteration (${:.2}/h); raise --slo to at least {:.4} or raise offers[].quota",
                s.slo,
                describe(s.offers, &f.alloc),
                f.iteration_time,
                f.cost_per_iteration,
                f.price_per_hour,
                f.iteration_time
            ),
        ),
    }
}

pub fn lines(offers: &Offers, alloc: &[u32]) -> Vec<AllocationLine> {
    offers
        .offers
        .iter()
        .zip(alloc)
        .filter(|(_, &n)| n > 0)
        .map(|(o, &n)| AllocationLine {
            offer: o.name.clone(),
            gpu: o.gpu.name.clone(),
            instances: n,
            gpus: n * o.spec.gpus_per_node,
            price_per_gpu_hour: o.spec.price_per_gpu_hour,
        })
        .collect()
}

/// "4 x A30 + 2 x A6000".
pub fn describe(offers: &Offers, alloc: &[u32]) -> String {
    lines(offers, alloc).iter().map(|l| format!("{} x {}", l.gpus, l.offer)).collect::<Vec<_>>().join(" + ")
}

fn priced_report(offers: &Offers, slo: f64, p: &Priced, best: Option<&Priced>) -> PricedReport {
    PricedReport {
        allocation: lines(offers, &p.alloc),
        gpus: offers.gpus(&p.alloc),
        price_per_hour: p.price_per_hour,
        iteration_time_s: p.iteration_time,
        cost_per_iteration: p.cost_per_iteration,
        meets_slo: p.iteration_time <= slo,
        savings_vs_this: best.map(|b| 1.0 - b.cost_per_iteration / p.cost_per_iteration),
    }
}
