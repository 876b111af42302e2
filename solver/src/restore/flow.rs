//! Max-flow (Dinic) on `f64` capacities, and the smallest horizon `T` at which a network whose
//! capacities are `a + b * T` carries a required flow (Dinkelbach's iteration on min cuts).

/// An edge whose capacity at horizon `T` is `fixed + per_s * T`.
#[derive(Debug, Clone, Copy)]
struct Edge {
    to: usize,
    rev: usize,
    cap: f64,
    fixed: f64,
    per_s: f64,
}

/// A flow network with parametric capacities.
#[derive(Debug, Clone, Default)]
pub struct Network {
    adj: Vec<Vec<Edge>>,
}

impl Network {
    pub fn new() -> Network {
        Network::default()
    }

    pub fn node(&mut self) -> usize {
        self.adj.push(Vec::new());
        self.adj.len() - 1
    }

    /// An edge of capacity `fixed + per_s * T` (`f64::INFINITY` for no limit).
    pub fn edge(&mut self, from: usize, to: usize, fixed: f64, per_s: f64) {
        let (rf, rt) = (self.adj[to].len() + usize::from(from == to), self.adj[from].len());
        self.adj[from].push(Edge { to, rev: rf, cap: 0.0, fixed, per_s });
        self.adj[to].push(Edge { to: from, rev: rt, cap: 0.0, fixed: 0.0, per_s: 0.0 });
    }

    fn set_horizon(&mut self, t: f64) {
        for edges in &mut self.adj {
            for e in edges.iter_mut() {
                e.cap = if e.per_s == 0.0 { e.fixed } else { e.fixed + e.per_s * t };
            }
        }
    }

    /// The maximum flow from `s` to `t` at the capacities set last, and the source side of a
    /// minimum cut.
    fn max_flow(&mut self, s: usize, t: usize, eps: f64) -> (f64, Vec<bool>) {
        let n = self.adj.len();
        let mut total = 0.0;
        loop {
            let mut level = vec![usize::MAX; n];
            level[s] = 0;
            let mut queue = std::collections::VecDeque::from([s]);
            while let Some(v) = queue.pop_front() {
                for e in &self.adj[v] {
                    if e.cap > eps && level[e.to] == usize::MAX {
                        level[e.to] = level[v] + 1;
                        queue.push_back(e.to);
                    }
                }
            }
            if level[t] == usize::MAX {
                let side = level.iter().map(|&l| l != usize::MAX).collect();
                return (total, side);
            }
            let mut it = vec![0usize; n];
            loop {
                let f = self.augment(s, t, f64::INFINITY, &level, &mut it, eps);
                if f <= eps {
                    break;
                }
                total += f;
            }
        }
    }

    fn augment(&mut self, v: usize, t: usize, limit: f64, level: &[usize], it: &mut [usize], eps: f64) -> f64 {
        if v == t {
            return limit;
        }
        while it[v] < self.adj[v].len() {
            let e = self.adj[v][it[v]];
            if e.cap > eps && level[e.to] == level[v] + 1 {
                let f = self.augment(e.to, t, limit.min(e.cap), level, it, eps);
                if f > eps {
                    self.adj[v][it[v]].cap -= f;
                    self.adj[e.to][e.rev].cap += f;
                    return f;
                }
            }
            it[v] += 1;
        }
        0.0
    }

    /// The smallest `T >= 0` at which the flow from `s` to `t` reaches `required`, or `None`
    /// when no horizon is enough (a cut of fixed capacities below `required`).
    ///
    /// Dinkelbach's iteration: at an infeasible `T`, a minimum cut has capacity
    /// `A + B * T < required`; every feasible horizon satisfies `A + B * T' >= required`, so
    /// `T' >= (required - A) / B`, which becomes the next `T`. Each step moves to a strictly
    /// larger horizon set by another cut, so it ends after finitely many cuts, exactly at the
    /// largest of the cut bounds: the optimum.
    pub fn min_horizon(&mut self, s: usize, t: usize, required: f64) -> Option<f64> {
        if required <= 0.0 {
            return Some(0.0);
        }
        let eps = required * 1e-12;
        let mut horizon = 0.0f64;
        for _ in 0..10_000 {
            self.set_horizon(horizon);
            let (flow, side) = self.max_flow(s, t, eps);
            if flow >= required * (1.0 - 1e-9) {
                return Some(horizon);
            }
            let (mut a, mut b) = (0.0, 0.0);
            for (v, edges) in self.adj.iter().enumerate() {
                if !side[v] {
                    continue;
                }
                for e in edges.iter().filter(|e| !side[e.to]) {
                    a += e.fixed;
                    b += e.per_s;
                }
            }
            if b <= 0.0 || !a.is_finite() {
                return None;
            }
            let next = (required - a) / b;
            if next <= horizon * (1.0 + 1e-12) {
                // Rounding: the cut bound did not move; the flow is short only by rounding.
                return Some(horizon);
            }
            horizon = next;
        }
        Some(horizon)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn horizon_of_two_parallel_pipes() {
        // 100 bytes over pipes of 10 and 30 bytes/s: 2.5 s.
        let mut n = Network::new();
        let (s, m, t) = (n.node(), n.node(), n.node());
        n.edge(s, m, 100.0, 0.0);
        n.edge(m, t, 0.0, 10.0);
        n.edge(m, t, 0.0, 30.0);
        assert!((n.min_horizon(s, t, 100.0).unwrap() - 2.5).abs() < 1e-9);
        // A fixed bottleneck below the requirement: never.
        let mut n = Network::new();
        let (s, t) = (n.node(), n.node());
        n.edge(s, t, 50.0, 0.0);
        assert_eq!(n.min_horizon(s, t, 100.0), None);
    }
}
