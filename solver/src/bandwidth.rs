//! Measured bandwidth between nodes, overriding the nominal rates of the cluster file.
//!
//! The file (YAML or JSON) gives what two nodes reach with NCCL, in GB/s (gigabytes per
//! second, the bus bandwidth `nccl-tests`' `all_reduce_perf` prints for a two-node run), as a
//! list of pairs, a matrix, or both:
//!
//! ```yaml
//! pairs:
//!   - {a: ib-0, b: ib-1, gb_per_s: 10.6}
//! nodes: [ib-0, ib-1, roce-0]        # rows and columns of the matrix
//! matrix:
//!   - [~,    21.2, 2.6]              # ~ (null) = not measured; the diagonal is ignored
//!   - [21.2, ~,    2.6]
//!   - [2.6,  2.6,  ~]
//! ```
//!
//! A pair measured twice (both directions, or in both forms) counts at its slower value.
//!
//! How measurements enter the plan: a node's *factor* is the highest measured/nominal ratio of
//! its pairs, at most 1 (a node with a degraded NIC is slow with every peer; a congested path between two
//! healthy nodes leaves both with fast pairs elsewhere). Nodes whose factors fall in different
//! 10% buckets are planned as different node classes (a slow node is not averaged into fast
//! ones), and the bandwidth between two classes becomes the slowest pair between their nodes,
//! measured or nominal, so a slow path is still priced wherever a ring or hop crosses it. The transport each pair
//! uses (IB, RoCE, Ethernet) stays what the NICs allow; only its speed changes.

use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};

use crate::error::{Result, SolverError};
use crate::hardware::{same_class, Cluster};

#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BandwidthSpec {
    #[serde(default)]
    pub pairs: Vec<PairSpec>,
    #[serde(default)]
    pub nodes: Vec<String>,
    #[serde(default)]
    pub matrix: Vec<Vec<Option<f64>>>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PairSpec {
    pub a: String,
    pub b: String,
    /// GB/s (bytes) the pair reaches.
    pub gb_per_s: f64,
}

/// Factors within one bucket are 10% apart at most.
const BUCKET_RATIO: f64 = 1.1;

impl BandwidthSpec {
    /// Measured GB/s per unordered pair of node indices (smaller index first).
    pub fn resolve(&self, cluster: &Cluster) -> Result<BTreeMap<(usize, usize), f64>> {
        let index: HashMap<&str, usize> = cluster.nodes.iter().enumerate().map(|(i, n)| (n.name.as_str(), i)).collect();
        let lookup = |field: String, name: &str| -> Result<usize> {
            index.get(name).copied().ok_or_else(|| {
                let known: Vec<&str> = cluster.nodes.iter().take(6).map(|n| n.name.as_str()).collect();
                SolverError::invalid(
                    field,
                    format!(
                        "unknown node '{name}'; use the node names of the cluster file (after count expansion: {}, ...)",
                        known.join(", ")
                    ),
                )
            })
        };
        let mut out: BTreeMap<(usize, usize), f64> = BTreeMap::new();
        let mut put = |field: String, a: usize, b: usize, v: f64| -> Result<()> {
            if !(v.is_finite() && v > 0.0) {
                return Err(SolverError::invalid(
                    field,
                    format!("must be a positive GB/s, got {v}; leave a pair out (or ~) when it was not measured"),
                ));
            }
            if a == b {
                return Err(SolverError::invalid(field, "a node paired with itself; measurements are between two different nodes"));
            }
            let key = (a.min(b), a.max(b));
            let e = out.entry(key).or_insert(v);
            *e = e.min(v);
            Ok(())
        };
        for (i, p) in self.pairs.iter().enumerate() {
            let a = lookup(format!("pairs[{i}].a"), &p.a)?;
            let b = lookup(format!("pairs[{i}].b"), &p.b)?;
            put(format!("pairs[{i}].gb_per_s"), a, b, p.gb_per_s)?;
        }
        if self.matrix.len() != self.nodes.len() {
            return Err(SolverError::invalid(
                "matrix",
                format!(
                    "has {} rows but nodes lists {}; give one row per node, in the order of nodes",
                    self.matrix.len(),
                    self.nodes.len()
                ),
            ));
        }
        let ids: Vec<usize> = self.nodes.iter().enumerate().map(|(i, n)| lookup(format!("nodes[{i}]"), n)).collect::<Result<_>>()?;
        for (r, row) in self.matrix.iter().enumerate() {
            if row.len() != ids.len() {
                return Err(SolverError::invalid(format!("matrix[{r}]"), format!("has {} columns; nodes lists {}", row.len(), ids.len())));
            }
            for (c, v) in row.iter().enumerate() {
                if let (Some(v), false) = (v, r == c) {
                    put(format!("matrix[{r}][{c}]"), ids[r], ids[c], *v)?;
                }
            }
        }
        if out.is_empty() {
            return Err(SolverError::invalid("pairs", "the file measures no pair; list pairs (a, b, gb_per_s) or a nodes + matrix"));
        }
        Ok(out)
    }
}

impl Cluster {
    /// The cluster with measured bandwidths in force (see the module doc).
    pub fn with_measurements(&self, spec: &BandwidthSpec) -> Result<Cluster> {
        let measured = spec.resolve(self)?;
        let n = self.nodes.len();
        let nominal = |x: usize, y: usize| self.nominal_inter_bw(self.nodes[x].class, self.nodes[y].class);
        let mut factor = vec![f64::NAN; n];
        for (&(a, b), &v) in &measured {
            // A node that reaches its nominal rate with some peer is healthy, however much faster
            // than declared that peer reads (the measurement's noise, or a NIC priced below its
            // line rate): healthy nodes stay one class. Split apart by such noise, two classes'
            // link would be their slowest pair alone, and a pair measured fast before a drop
            // could hide the slow one measured since.
            let r = (v / nominal(a, b)).min(1.0);
            factor[a] = factor[a].max(r); // NAN.max(r) == r
            factor[b] = factor[b].max(r);
        }
        // Regroup: a class splits by the bucket of its nodes' factors.
        let mut classes = vec![];
        let mut nodes = self.nodes.clone();
        for (i, node) in self.nodes.iter().enumerate() {
            let mut class = self.classes[node.class].clone();
            class.bw_bucket = if factor[i].is_finite() { (factor[i].ln() / BUCKET_RATIO.ln()).round() as i32 } else { 0 };
            class.nodes = vec![];
            let ci = classes.iter().position(|c| same_class(c, &class)).unwrap_or_else(|| {
                classes.push(class);
                classes.len() - 1
            });
            classes[ci].nodes.push(i);
            nodes[i].class = ci;
        }
        // Old class of every new class (nominal rates and transports are the old classes').
        let old: Vec<usize> = classes.iter().map(|c| self.nodes[c.nodes[0]].class).collect();
        let k = classes.len();
        let mut link = vec![vec![None; k]; k];
        for a in 0..k {
            for b in a..k {
                let mut any = false;
                let mut slowest = f64::INFINITY;
                for &x in &classes[a].nodes {
                    for &y in &classes[b].nodes {
                        if x == y {
                            continue;
                        }
                        match measured.get(&(x.min(y), x.max(y))) {
                            Some(&v) => {
                                any = true;
                                slowest = slowest.min(v);
                            }
                            None => slowest = slowest.min(self.nominal_inter_bw(old[a], old[b])),
                        }
                    }
                }
                if any {
                    link[a][b] = Some(slowest);
                    link[b][a] = Some(slowest);
                }
            }
        }
        Ok(Cluster { name: self.name.clone(), nodes, classes, measured: link })
    }
}

pub use motley_contract::plan::{NetworkSource, PlanLink, PlanNetwork};

/// The pairs of `nodes` (names of `declared`'s nodes; unknown ones are skipped) priced as
/// a plan made on `declared` with `measured` in force assumed them: a measured pair at its
/// measured rate, any other at its classes' nominal rate.
pub fn plan_network(nodes: &[&str], declared: &Cluster, measured: Option<&BandwidthSpec>) -> Result<PlanNetwork> {
    let pairs = match measured {
        Some(spec) => spec.resolve(declared)?,
        None => BTreeMap::new(),
    };
    let index: HashMap<&str, usize> = declared.nodes.iter().enumerate().map(|(i, n)| (n.name.as_str(), i)).collect();
    let mut ids: Vec<usize> = nodes.iter().filter_map(|n| index.get(n).copied()).collect();
    ids.sort_by(|&x, &y| declared.nodes[x].name.cmp(&declared.nodes[y].name));
    ids.dedup();
    let mut links = vec![];
    for (i, &x) in ids.iter().enumerate() {
        for &y in &ids[i + 1..] {
            let m = pairs.get(&(x.min(y), x.max(y))).copied();
            let gb_per_s = m.unwrap_or_else(|| declared.nominal_inter_bw(declared.nodes[x].class, declared.nodes[y].class));
            let (a, b) = (declared.nodes[x].name.clone(), declared.nodes[y].name.clone());
            links.push(PlanLink { a, b, gb_per_s, measured: m.is_some() });
        }
    }
    let source = if measured.is_some() { NetworkSource::Measured } else { NetworkSource::Declared };
    Ok(PlanNetwork { source, links })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hardware::ClusterSpec;

    #[test]
    fn a_plans_network_names_each_pair_measured_or_declared() {
        let node = |n: &str| format!("  - {{name: {n}, gpu: A100-80G, gpus: 1, nics: [{{name: mlx5_0, kind: ib, gbps: 200}}]}}\n");
        let spec: ClusterSpec = serde_norway::from_str(&format!("name: c\nnodes:\n{}{}{}", node("n0"), node("n1"), node("n2"))).unwrap();
        let cluster = Cluster::from_spec(&spec).unwrap();
        let declared = plan_network(&["n1", "n0", "x"], &cluster, None).unwrap();
        assert_eq!(declared.source, NetworkSource::Declared);
        let nominal = cluster.nominal_inter_bw(0, 0);
        assert_eq!(declared.links, vec![PlanLink { a: "n0".into(), b: "n1".into(), gb_per_s: nominal, measured: false }]);
        let measured = BandwidthSpec { pairs: vec![PairSpec { a: "n2".into(), b: "n0".into(), gb_per_s: 2.0 }], ..Default::default() };
        let net = plan_network(&["n0", "n1", "n2"], &cluster, Some(&measured)).unwrap();
        assert_eq!(net.source, NetworkSource::Measured);
        let links: Vec<(&str, &str, f64, bool)> = net.links.iter().map(|l| (l.a.as_str(), l.b.as_str(), l.gb_per_s, l.measured)).collect();
        assert_eq!(links, [("n0", "n1", nominal, false), ("n0", "n2", 2.0, true), ("n1", "n2", nominal, false)]);
        let json = serde_json::to_value(&net).unwrap();
        assert_eq!(json["source"], "measured");
        assert_eq!(json["links"][1], serde_json::json!({"a": "n0", "b": "n2", "gb_per_s": 2.0, "measured": true}));
    }
}
