//! The fluid relaxation used by the fast search on large clusters.
//!
//! For a target iteration time T, a replica of shape s finishes `K_s(T)` micro-batches. The
//! best multiset of shapes is then the integer program
//!
//! ```text
//! maximise  sum_s K_s(T) x_s
//! subject   sum_s units[s][c] x_s <= U_c   for every node class c
//!           sum_s x_s            <= N      (every replica needs a micro-batch)
//!           x_s >= 0 integer
//! ```
//!
//! and T is feasible when the optimum reaches N. Its linear relaxation has a basic optimum
//! with at most (classes + 1) shapes in use, so rounding it down loses at most that many
//! replicas; the leftover TP groups are refilled greedily. With optimistic K (no gradient
//! sync) the relaxation's smallest feasible T is a lower bound on every plan of the space,
//! which is how the fast search reports its worst-case gap.

use super::alloc;
use super::dfs::Dfs;
use crate::cost::{CostModel, Rings, SyncContext};

/// Maximise `c.x` subject to `a x <= b`, `x >= 0`, with `b >= 0` (so the slack basis is
/// feasible). Dense tableau simplex with Bland's rule. Returns x.
pub fn simplex_max(c: &[f64], a: &[Vec<f64>], b: &[f64]) -> Vec<f64> {
    let (m, n) = (a.len(), c.len());
    let w = n + m + 1;
    let mut t = vec![vec![0.0; w]; m + 1];
    for i in 0..m {
        t[i][..n].copy_from_slice(&a[i]);
        t[i][n + i] = 1.0;
        t[i][w - 1] = b[i];
    }
    for j in 0..n {
        t[m][j] = -c[j];
    }
    let mut basis: Vec<usize> = (n..n + m).collect();
    let eps = 1e-12;
    for _ in 0..10_000 {
        let Some(col) = (0..n + m).find(|&j| t[m][j] < -eps) else { break };
        let mut row = None;
        let mut best = f64::INFINITY;
        for i in 0..m {
            if t[i][col] > eps {
                let r = t[i][w - 1] / t[i][col];
                if r < best - eps || (r <= best + eps && row.is_some_and(|k: usize| basis[i] < basis[k])) {
                    best = r;
                    row = Some(i);
                }
            }
        }
        let Some(row) = row else { break }; // unbounded cannot happen: every column uses a bounded row
        let p = t[row][col];
        for v in t[row].iter_mut() {
            *v /= p;
        }
        let pivot = t[row].clone();
        for (i, r) in t.iter_mut().enumerate() {
            if i != row && r[col].abs() > eps {
                let f = r[col];
                for (v, &pv) in r.iter_mut().zip(&pivot) {
                    *v -= f * pv;
                }
            }
        }
        basis[row] = col;
    }
    let mut x = vec![0.0; n];
    for i in 0..m {
        if basis[i] < n {
            x[basis[i]] = t[i][w - 1].max(0.0);
        }
    }
    x
}

/// Integer counts from the relaxation: round down, then refill the leftover TP groups
/// greedily with the shape that adds the most micro-batches per TP group.
pub fn round_and_fill(x: &[f64], value: &[f64], units: &[Vec<u32>], avail: &[u32], n: u32) -> Vec<u32> {
    let mut counts: Vec<u32> = x.iter().map(|v| (v + 1e-9).floor() as u32).collect();
    let mut rem: Vec<i64> = avail.iter().map(|&u| u as i64).collect();
    let mut r: i64 = 0;
    for (s, &k) in counts.iter().enumerate() {
        for c in 0..rem.len() {
            rem[c] -= (units[s][c] * k) as i64;
        }
        r += k as i64;
    }
    debug_assert!(rem.iter().all(|&v| v >= 0));
    let mut order: Vec<usize> = (0..value.len()).filter(|&s| value[s] > 0.0).collect();
    order.sort_by(|&a, &b| {
        let da = value[a] / units[a].iter().sum::<u32>() as f64;
        let db = value[b] / units[b].iter().sum::<u32>() as f64;
        db.total_cmp(&da)
    });
    for &s in &order {
        while r < n as i64 && (0..rem.len()).all(|c| rem[c] >= units[s][c] as i64) {
            for c in 0..rem.len() {
                rem[c] -= units[s][c] as i64;
            }
            counts[s] += 1;
            r += 1;
        }
    }
    counts
}

/// Pessimistic context: every ring as large and as slow as any plan of this cluster makes it.
fn pessimistic_context(cm: &CostModel, n: u32) -> SyncContext {
    let k = cm.cluster.classes.len();
    let mut bw = f64::INFINITY;
    for a in 0..k {
        for b in a..k {
            bw = bw.min(cm.cluster.inter_bw(a, b));
        }
    }
    SyncContext { replicas: n, rings: Rings::Shared { bw, intra: false } }
}

/// Smallest T (bisection) for which `feasible` holds, starting from a `hi` that may need doubling.
fn bisect(mut hi: f64, mut feasible: impl FnMut(f64) -> bool) -> Option<f64> {
    let mut grow = 0;
    while !feasible(hi) {
        hi *= 2.0;
        grow += 1;
        if grow > 60 {
            return None;
        }
    }
    let mut lo = 0.0;
    for _ in 0..60 {
        let mid = 0.5 * (lo + hi);
        if feasible(mid) {
            hi = mid;
        } else {
            lo = mid;
        }
        if hi - lo <= 1e-9 * hi {
            break;
        }
    }
    Some(hi)
}

fn start_time(dfs: &Dfs) -> f64 {
    let t = dfs.shapes.iter().flat_map(|s| s.optimistic.iter().map(|p| p.0 + p.1)).fold(f64::INFINITY, f64::min);
    if dfs.best.is_finite() {
        dfs.best
    } else {
        t.max(1e-6)
    }
}

/// Fast mode's first incumbent: the rounded fluid relaxation under the pessimistic context.
pub(super) fn fluid_plan(dfs: &mut Dfs) -> Option<(f64, Vec<(usize, u32)>)> {
    let ctx = pessimistic_context(dfs.cm, dfs.n);
    let fronts: Vec<Vec<(f64, f64)>> =
        dfs.shapes.iter().map(|s| s.frontier(dfs.cm, &ctx).iter().map(|p| (p.base, p.period)).collect()).collect();
    let units: Vec<Vec<u32>> = dfs.shapes.iter().map(|s| s.units.clone()).collect();
    let avail = dfs.rem.clone();
    let n = dfs.n;
    let counts_at = |t: f64| {
        let value: Vec<f64> = fronts.iter().map(|f| alloc::capacity(f, t).min(n as u64) as f64).collect();
        let mut a: Vec<Vec<f64>> = (0..avail.len()).map(|c| units.iter().map(|u| u[c] as f64).collect()).collect();
        a.push(vec![1.0; units.len()]);
        let mut b: Vec<f64> = avail.iter().map(|&u| u as f64).collect();
        b.push(n as f64);
        let x = simplex_max(&value, &a, &b);
        let counts = round_and_fill(&x, &value, &units, &avail, n);
        let cap: f64 = counts.iter().zip(&value).map(|(&k, v)| k as f64 * v).sum();
        (counts, cap)
    };
    let t = bisect(start_time(dfs), |t| counts_at(t).1 >= n as f64)?;
    let (counts, _) = counts_at(t);
    let groups: Vec<(usize, u32)> = counts.iter().enumerate().filter(|(_, &k)| k > 0).map(|(s, &k)| (s, k)).collect();
    let (t, _, _) = dfs.price(&groups)?;
    Some((t, groups))
}

/// No plan of this configuration beats this: the fractional relaxation without gradient sync.
pub(super) fn fluid_lower_bound(dfs: &Dfs) -> f64 {
    let units: Vec<Vec<u32>> = dfs.shapes.iter().map(|s| s.units.clone()).collect();
    let n = dfs.n;
    bisect(start_time(dfs), |t| {
        let value: Vec<f64> = dfs.shapes.iter().map(|s| alloc::capacity(&s.optimistic, t).min(n as u64) as f64).collect();
        let mut a: Vec<Vec<f64>> = (0..dfs.rem.len()).map(|c| units.iter().map(|u| u[c] as f64).collect()).collect();
        a.push(vec![1.0; units.len()]);
        let mut b: Vec<f64> = dfs.rem.iter().map(|&u| u as f64).collect();
        b.push(n as f64);
        let x = simplex_max(&value, &a, &b);
        x.iter().zip(&value).map(|(x, v)| x * v).sum::<f64>() >= n as f64 - 1e-9
    })
    .unwrap_or(f64::INFINITY)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn simplex_solves_a_small_lp() {
        // max 3x + 2y, x + y <= 4, x + 3y <= 6, x <= 3  ->  x = 3, y = 1, value 11
        let x = simplex_max(&[3.0, 2.0], &[vec![1.0, 1.0], vec![1.0, 3.0], vec![1.0, 0.0]], &[4.0, 6.0, 3.0]);
        assert!((x[0] - 3.0).abs() < 1e-9 && (x[1] - 1.0).abs() < 1e-9, "{x:?}");
    }

    #[test]
    fn rounding_refills_leftovers() {
        // One class of 5 units; shape 0 takes 2 units for 3 micro-batches, shape 1 takes 1 for 1.
        let counts = round_and_fill(&[2.5, 0.0], &[3.0, 1.0], &[vec![2], vec![1]], &[5], 100);
        assert_eq!(counts, vec![2, 1]);
    }
}
