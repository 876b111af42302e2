//! One iteration of a pipeline replica in time: the 1F1B schedule as the plan picture draws it
//! (`one_f_one_b`), its steady-state period as the cost model prices it (`pipeline_period`,
//! which the planner calls), and what the priced iteration holds besides the pipeline
//! (`sync_and_optimizer`). One place for both, so the price and the picture cannot drift.

/// One pass of one micro-batch on one stage of the timeline.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Op {
    pub stage: usize,
    pub micro_batch: u32,
    pub backward: bool,
    pub start: f64,
    pub end: f64,
}

/// One iteration of a replica under 1F1B (each stage: warm-up forwards, then one forward one
/// backward, then the remaining backwards), each pass starting when its stage is free and its
/// input has arrived (the previous stage's forward plus the hop, the next stage's backward
/// plus the hop). `fwd`/`bwd` per stage, `hops` per stage boundary (both directions, as the
/// solver's `hops_s`: half each way), seconds.
pub fn one_f_one_b(fwd: &[f64], bwd: &[f64], hops: &[f64], micro_batches: u32) -> Vec<Op> {
    let p = fwd.len();
    let m = micro_batches as usize;
    let hop = |i: usize| hops.get(i).copied().unwrap_or(0.0) / 2.0;
    // Each stage's order of passes: (micro-batch, backward).
    let orders: Vec<Vec<(usize, bool)>> = (0..p)
        .map(|s| {
            let warm = (p - s - 1).min(m);
            let mut o: Vec<(usize, bool)> = (0..warm).map(|i| (i, false)).collect();
            for i in 0..m - warm {
                o.push((warm + i, false));
                o.push((i, true));
            }
            o.extend((m - warm..m).map(|i| (i, true)));
            o
        })
        .collect();
    let mut f_end = vec![vec![f64::NAN; m]; p];
    let mut b_end = vec![vec![f64::NAN; m]; p];
    let mut next = vec![0usize; p];
    let mut free = vec![0.0f64; p];
    let mut ops = vec![];
    // 1F1B never deadlocks: every sweep schedules at least one pass until all are done.
    loop {
        let mut progressed = false;
        for s in 0..p {
            while let Some(&(i, back)) = orders[s].get(next[s]) {
                let ready = if back {
                    if s + 1 < p {
                        b_end[s + 1][i] + hop(s)
                    } else {
                        f_end[s][i]
                    }
                } else if s > 0 {
                    f_end[s - 1][i] + hop(s - 1)
                } else {
                    0.0
                };
                if ready.is_nan() {
                    break;
                }
                let start = free[s].max(ready);
                let end = start + if back { bwd[s] } else { fwd[s] };
                if back {
                    b_end[s][i] = end;
                } else {
                    f_end[s][i] = end;
                }
                free[s] = end;
                ops.push(Op { stage: s, micro_batch: i as u32, backward: back, start, end });
                next[s] += 1;
                progressed = true;
            }
        }
        if !progressed {
            break;
        }
    }
    ops
}

/// What the cost model adds to a replica's pipeline: the gradient sync not hidden behind
/// backward passes and the optimizer step, i.e. the iteration time `it` less the pipeline's
/// latency (every stage and hop once) and `m - 1` steady-state periods (with overlapped sends,
/// the slowest stage, hop, or round trip through a window of stages shared by the window's
/// micro-batches in flight; with blocking ones, `motley plan --p2p-blocking`, the slowest
/// stage with its hops: `pipeline_period`, solver/README.md). The document
/// does not say which the plan was priced with: the smaller remainder that is not negative is
/// taken (a blocking period is never shorter; where both readings fit, they differ by little).
pub fn sync_and_optimizer(fwd: &[f64], bwd: &[f64], hops: &[f64], m: u32, it: f64) -> f64 {
    let busy: Vec<f64> = fwd.iter().zip(bwd).map(|(f, b)| f + b).collect();
    let latency = busy.iter().sum::<f64>() + hops.iter().sum::<f64>();
    let rest = |period: f64| it - latency - m.saturating_sub(1) as f64 * period;
    let eps = 1e-9 * it.max(1.0);
    [rest(pipeline_period(&busy, hops, false)), rest(pipeline_period(&busy, hops, true))]
        .into_iter()
        .filter(|r| *r >= -eps)
        .reduce(f64::min)
        .unwrap_or(0.0)
        .max(0.0)
}

/// The 1F1B steady-state period of a replica whose stages take `busy` (forward plus backward)
/// and whose hops take `hops` (round trips): with blocking sends, the slowest stage with its
/// hops; with overlapped ones, the slowest stage or hop, or the round trip through a window of
/// stages s..t (their passes once, their hops both ways) shared by the t - s + 1 micro-batches
/// in flight there, the longest such cycle of the schedule `one_f_one_b` draws once its
/// warm-up is over. The one formula the cost model prices with and the picture reads
/// (solver/README.md, "The cost model").
pub fn pipeline_period(busy: &[f64], hops: &[f64], p2p_blocking: bool) -> f64 {
    let hop = |i: usize| hops.get(i).copied().unwrap_or(0.0);
    let mut period: f64 = 0.0;
    for (i, &t) in busy.iter().enumerate() {
        let before = if i > 0 { hop(i - 1) } else { 0.0 };
        period = if p2p_blocking { period.max(t + before + hop(i)) } else { period.max(t).max(hop(i)) };
    }
    // A blocking period already holds every window's round trip: each stage of it pays both
    // its hops.
    if !p2p_blocking {
        for (s, &first) in busy.iter().enumerate() {
            let mut round_trip = first;
            for (t, &busy_t) in busy.iter().enumerate().skip(s + 1) {
                round_trip += hop(t - 1) + busy_t;
                period = period.max(round_trip / (t - s + 1) as f64);
            }
        }
    }
    period
}
