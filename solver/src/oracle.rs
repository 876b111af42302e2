//! The brute-force oracle behind `--exhaustive`: every plan of the declared space, built as a
//! whole `PlanStructure` and priced by `CostModel::evaluate`, with none of the search's
//! decompositions (no per-shape frontiers, no greedy batch split, no bounds). Exponential:
//! meant for clusters of a handful of GPUs, to check that the search returns the optimum.

use crate::cost::{CostModel, StageKind};
use crate::error::{Result, SolverError};
use crate::plan::{PlanStructure, ReplicaPlan, StagePlan};
use crate::search::{configurations_for_oracle, max_stages, shape_kinds, units_per_class};

/// Stops the oracle from running for ever on a large input.
pub const ORACLE_PLAN_LIMIT: u64 = 200_000_000;

pub struct OracleResult {
    pub plan: PlanStructure,
    pub iteration_time: f64,
    pub plans_costed: u64,
}

pub fn exhaustive(cm: &CostModel, seeds: &[PlanStructure]) -> Result<OracleResult> {
    let mut best: Option<(f64, PlanStructure)> = None;
    let mut costed = 0u64;
    let mut consider = |p: &PlanStructure, costed: &mut u64| -> Result<()> {
        *costed += 1;
        if *costed > ORACLE_PLAN_LIMIT {
            return Err(SolverError::invalid("--exhaustive", "the brute-force oracle is for clusters of a few GPUs; drop --exhaustive"));
        }
        if cm.check_structure(p).is_err() {
            return Ok(());
        }
        let e = cm.evaluate(p);
        if e.fits && best.as_ref().is_none_or(|b| e.iteration_time < b.0) {
            best = Some((e.iteration_time, p.clone()));
        }
        Ok(())
    };
    for s in seeds {
        consider(s, &mut costed)?;
    }
    let l = cm.model.layers();
    for (tp, b) in configurations_for_oracle(cm) {
        let n = cm.opts.global_batch / b;
        let units = units_per_class(cm, tp);
        let shapes = shape_kinds(&units, tp, b, 8, max_stages(cm, tp), usize::MAX);
        // Every multiset of shapes that fits, then every layer split and batch split.
        let mut chosen: Vec<usize> = vec![];
        fn multisets(
            from: usize,
            shapes: &[Vec<StageKind>],
            rem: &mut Vec<u32>,
            chosen: &mut Vec<usize>,
            n: u32,
            visit: &mut dyn FnMut(&[usize]) -> Result<()>,
        ) -> Result<()> {
            if !chosen.is_empty() {
                visit(chosen)?;
            }
            if chosen.len() as u32 == n {
                return Ok(());
            }
            for s in from..shapes.len() {
                let fits = shapes[s].iter().fold(rem.clone(), |mut r, k| {
                    r[k.class] = r[k.class].wrapping_sub(k.dp);
                    r
                });
                if fits.iter().zip(rem.iter()).all(|(a, b)| a <= b) {
                    let saved = std::mem::replace(rem, fits);
                    chosen.push(s);
                    multisets(s, shapes, rem, chosen, n, visit)?;
                    chosen.pop();
                    *rem = saved;
                }
            }
            Ok(())
        }
        let mut rem = units.clone();
        multisets(0, &shapes, &mut rem, &mut chosen, n, &mut |set: &[usize]| {
            let splits: Vec<Vec<Vec<u32>>> = set.iter().map(|&s| compositions_of(l, shapes[s].len() as u32)).collect();
            let batches = compositions_of(n, set.len() as u32);
            let mut idx = vec![0usize; set.len()];
            loop {
                for ks in &batches {
                    let replicas = set
                        .iter()
                        .enumerate()
                        .map(|(ri, &s)| {
                            let mut start = 0;
                            let stages = shapes[s]
                                .iter()
                                .zip(&splits[ri][idx[ri]])
                                .map(|(&kind, &nl)| {
                                    start += nl;
                                    StagePlan { kind, layers: (start - nl, start) }
                                })
                                .collect();
                            ReplicaPlan { stages, micro_batches: ks[ri] }
                        })
                        .collect();
                    consider(&PlanStructure { micro_batch: b, replicas }, &mut costed)?;
                }
                // Odometer over each replica's layer split.
                let mut i = 0;
                loop {
                    if i == idx.len() {
                        return Ok(());
                    }
                    idx[i] += 1;
                    if idx[i] < splits[i].len() {
                        break;
                    }
                    idx[i] = 0;
                    i += 1;
                }
            }
        })?;
    }
    match best {
        Some((t, plan)) => Ok(OracleResult { plan, iteration_time: t, plans_costed: costed }),
        None => Err(SolverError::DoesNotFit(crate::search::does_not_fit_message(cm))),
    }
}

/// All ways to write `total` as `parts` positive integers, in order.
pub fn compositions_of(total: u32, parts: u32) -> Vec<Vec<u32>> {
    let mut out = vec![];
    fn rec(left: u32, parts: u32, cur: &mut Vec<u32>, out: &mut Vec<Vec<u32>>) {
        if parts == 1 {
            if left >= 1 {
                cur.push(left);
                out.push(cur.clone());
                cur.pop();
            }
            return;
        }
        for x in 1..left.saturating_sub(parts - 2) {
            cur.push(x);
            rec(left - x, parts - 1, cur, out);
            cur.pop();
        }
    }
    if parts >= 1 && total >= parts {
        rec(total, parts, &mut vec![], &mut out);
    }
    out
}
