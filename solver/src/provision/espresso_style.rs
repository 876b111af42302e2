//! Espresso-style stage placement on a given allocation, priced by Motley's cost model: the
//! comparison `motley provision --compare` prints next to Motley's own plan.
//!
//! Espresso's plan shape (its paper, Sec. III-C): `dp` identical replicas, each a pipeline
//! with one GPU per stage (no tensor parallelism), GPUs ordered by increasing compute-memory
//! ratio (peak TFLOPS / GiB: memory-rich, compute-poor GPUs take the front stages, which hold
//! the most in-flight activations), layers balanced by compute (Whale's share), each stage
//! capped by what its memory holds, the remainder spread over later stages while memory
//! allows. We try every `dp` that divides every GPU count of the allocation and every
//! micro-batch size, and keep the fastest; the plan is priced by `CostModel::evaluate`.

use crate::cost::{CostModel, StageKind};
use crate::plan::{PlanStructure, ReplicaPlan, StagePlan};

use super::search::{Priced, Search};

/// The fastest Espresso-style plan on `alloc`, if one fits.
pub fn best_on(s: &Search, alloc: &[u32]) -> Option<Priced> {
    let cluster = s.offers.cluster(alloc).ok()?;
    let cm = CostModel { cluster: &cluster, model: s.model, profiles: s.profiles, opts: s.opts };
    // GPUs per class, and the class order by compute-memory ratio.
    let per_class: Vec<u32> = cluster.classes.iter().map(|c| c.nodes.len() as u32 * c.gpus_per_node).collect();
    let mut order: Vec<usize> = (0..cluster.classes.len()).collect();
    let cmr = |c: usize| cluster.classes[c].gpu.tflops / cluster.classes[c].gpu.memory_gib;
    order.sort_by(|&a, &b| cmr(a).total_cmp(&cmr(b)).then(a.cmp(&b)));
    let g = s.opts.global_batch;
    let mut best: Option<f64> = None;
    let total: u32 = per_class.iter().sum();
    for dp in (1..=total).filter(|d| per_class.iter().all(|n| n % d == 0)) {
        let stages: Vec<usize> = order.iter().flat_map(|&c| std::iter::repeat_n(c, (per_class[c] / dp) as usize)).collect();
        let sizes = s.opts.micro_batch.map_or(vec![1u32, 2, 4, 8], |b| vec![b]);
        for b in sizes.into_iter().filter(|&b| g.is_multiple_of(b * dp)) {
            let kinds: Vec<StageKind> = stages.iter().map(|&c| StageKind { class: c, tp: 1, dp: 1 }).collect();
            let Some(layers) = split_layers(&cm, &kinds, b, g / b) else { continue };
            let mut replicas = vec![];
            for _ in 0..dp {
                let mut start = 0;
                let st = kinds
                    .iter()
                    .zip(&layers)
                    .map(|(&kind, &n)| {
                        start += n;
                        StagePlan { kind, layers: (start - n, start) }
                    })
                    .collect();
                replicas.push(ReplicaPlan { stages: st, micro_batches: g / b / dp });
            }
            let plan = PlanStructure { micro_batch: b, replicas };
            if cm.check_structure(&plan).is_err() {
                continue;
            }
            let e = cm.evaluate(&plan);
            if e.fits && best.is_none_or(|t| e.iteration_time < t) {
                best = Some(e.iteration_time);
            }
        }
    }
    let t = best?;
    let price = s.offers.price_per_hour(alloc);
    Some(Priced { alloc: alloc.to_vec(), iteration_time: t, price_per_hour: price, cost_per_iteration: t * price / 3600.0, proven: false })
}

/// Layers per stage: compute-proportional shares capped by memory, the rest spread over later
/// stages (front to back, the first stage last) while memory allows. None when the model does not fit.
fn split_layers(cm: &CostModel, kinds: &[StageKind], b: u32, micro_batches: u32) -> Option<Vec<u32>> {
    let l = cm.model.layers();
    let p = kinds.len();
    if p as u32 > l {
        return None;
    }
    let costs: Vec<_> = kinds.iter().map(|&k| cm.layer_cost(k, b)).collect();
    // Most layers stage i can hold (its first/last extras included).
    let cap: Vec<u32> = (0..p)
        .map(|i| {
            let inflight = ((p - i) as u32).min(micro_batches);
            (0..=l)
                .take_while(|&n| {
                    CostModel::stage_memory(&costs[i], n, i == 0, i + 1 == p, inflight, cm.opts.recompute) <= costs[i].capacity
                })
                .last()
                .unwrap_or(0)
        })
        .collect();
    if cap.contains(&0) {
        return None;
    }
    let speed: Vec<f64> = costs.iter().map(|c| 1.0 / (c.fwd + c.bwd)).collect();
    let shares = crate::baselines::proportional(l, &speed);
    let mut layers: Vec<u32> = shares.iter().zip(&cap).map(|(&s, &c)| s.clamp(1, c)).collect();
    let mut placed: u32 = layers.iter().sum();
    // Too many (a share of 0 raised to 1): take back from the slowest stages.
    while placed > l {
        let i = (0..p).filter(|&i| layers[i] > 1).min_by(|&a, &b| speed[a].total_cmp(&speed[b]))?;
        layers[i] -= 1;
        placed -= 1;
    }
    // Too few (memory caps): stages after the first, front to back, then the first (the
    // first stage holds the most in-flight activations).
    while placed < l {
        let i = (1..p).chain(0..1).find(|&i| layers[i] < cap[i])?;
        layers[i] += 1;
        placed += 1;
    }
    Some(layers)
}
