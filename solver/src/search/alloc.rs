//! Splitting the global batch across replicas.
//!
//! Replica g of a plan finishes k micro-batches in `f_g(k) = min_p base_p + (k-1) period_p`,
//! increasing in k. Minimising `max_g f_g(k_g)` subject to `sum k_g = N`, `k_g >= 1` is solved
//! exactly by handing out micro-batches one at a time to the replica whose next one finishes
//! first (an exchange argument: any allocation whose maximum is lower would have to give some
//! replica fewer micro-batches, and hence another one more, than the greedy did at that
//! value). Identical replicas form a group and are filled round-robin.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use super::shapes::{time_at, Point};

/// A time ordered by `f64::total_cmp`, for the heap.
struct Key(f64);
impl PartialEq for Key {
    fn eq(&self, o: &Self) -> bool {
        self.cmp(o).is_eq()
    }
}
impl Eq for Key {}
impl PartialOrd for Key {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Key {
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        self.0.total_cmp(&o.0)
    }
}

/// Groups of `count` identical replicas with frontier `points`; `n` micro-batches in all.
/// Returns the iteration time and, per group, the micro-batches of each of its replicas.
pub fn allocate(groups: &[(&[Point], u32)], n: u32) -> Option<(f64, Vec<Vec<u32>>)> {
    let replicas: u32 = groups.iter().map(|g| g.1).sum();
    if replicas == 0 || replicas > n {
        return None;
    }
    // (k, a): a replicas of the group have k+1 micro-batches, the others k.
    let mut state: Vec<(u32, u32)> = groups.iter().map(|_| (1, 0)).collect();
    let mut heap = BinaryHeap::with_capacity(groups.len());
    for (g, (pts, _)) in groups.iter().enumerate() {
        heap.push(Reverse((Key(time_at(pts, 2)), g)));
    }
    for _ in 0..(n - replicas) {
        let Reverse((_, g)) = heap.pop().expect("one entry per group");
        let (k, a) = &mut state[g];
        *a += 1;
        if *a == groups[g].1 {
            *k += 1;
            *a = 0;
        }
        heap.push(Reverse((Key(time_at(groups[g].0, *k + 1)), g)));
    }
    let mut t: f64 = 0.0;
    let mut ks = Vec::with_capacity(groups.len());
    for (g, &(k, a)) in state.iter().enumerate() {
        let top = if a > 0 { k + 1 } else { k };
        t = t.max(time_at(groups[g].0, top));
        let mut v = vec![k + 1; a as usize];
        v.resize(groups[g].1 as usize, k);
        ks.push(v);
    }
    Some((t, ks))
}

/// Micro-batches a replica with Pareto points `pts` (base, period) finishes within `t`.
pub fn capacity(pts: &[(f64, f64)], t: f64) -> u64 {
    pts.iter().filter(|p| p.0 <= t).map(|p| if p.1 > 0.0 { ((t - p.0) / p.1).floor() as u64 + 1 } else { u64::MAX / 4 }).max().unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pt(base: f64, period: f64) -> Point {
        Point { base, period, split: 0 }
    }

    #[test]
    fn fast_replica_gets_more_micro_batches() {
        let fast = [pt(1.0, 1.0)];
        let slow = [pt(2.0, 2.0)];
        let (t, ks) = allocate(&[(&fast, 1), (&slow, 1)], 9).unwrap();
        assert_eq!(ks, vec![vec![6], vec![3]]);
        assert_eq!(t, 6.0);
    }

    #[test]
    fn brute_force_agrees() {
        let a = [pt(3.0, 1.0), pt(2.0, 1.5)];
        let b = [pt(1.0, 2.5)];
        for n in 2..20 {
            let (t, _) = allocate(&[(&a, 1), (&b, 1)], n).unwrap();
            let best = (1..n).map(|k| time_at(&a, k).max(time_at(&b, n - k))).fold(f64::INFINITY, f64::min);
            assert!((t - best).abs() < 1e-12, "n={n}: {t} vs {best}");
        }
    }

    #[test]
    fn more_replicas_than_micro_batches_is_refused() {
        let a = [pt(1.0, 1.0)];
        assert!(allocate(&[(&a, 3)], 2).is_none());
    }
}
