//! The live link matrix as people read it (`motley net show`, `GET /api/v1/net`, gRPC
//! `GetNetwork`, the dashboard): what agents measured of each link (`Fleet::links`), beside
//! what the declared inventory gives the pair (the planner's nominal inter-node rate between
//! the two nodes' classes), the NICs' achieved rates, and the measured pairs in the
//! `motley replan --bandwidth` schema. Reads only; the agents' sessions write the matrix.

use std::collections::{BTreeSet, HashMap};

use motley_contract::net::{BandwidthPair, BandwidthPairs, LinkPoint, LinkView, NetworkView, NicRateView};
use motley_solver::hardware::NodeSpec;
use motley_solver::{Cluster, ClusterSpec};

use crate::error::{CoordinatorError, Result};
use crate::state::fleet::Fleet;
use crate::store::{NodeRecord, Store};

/// The matrix, or (`node`) only that node's links and NICs. An empty name is every node; a
/// name the inventory does not hold is refused, naming it.
pub async fn view(store: &Store, fleet: &Fleet, node: Option<&str>) -> Result<NetworkView> {
    let node = node.filter(|n| !n.is_empty());
    let nodes = store.nodes().await?;
    if let Some(n) = node.filter(|n| !nodes.iter().any(|r| r.name == *n)) {
        return Err(CoordinatorError::invalid(
            "node",
            format!("no node '{}' in the inventory; `motley node list` names the nodes", n.escape_default()),
        ));
    }
    let declared = Declared::new(&nodes);
    let links: Vec<LinkView> = fleet
        .links
        .links(node)
        .into_iter()
        .map(|l| LinkView {
            declared_gb_per_s: declared.between(&l.key.a, &l.key.b),
            a: l.key.a,
            b: l.key.b,
            nic_kind: l.key.nic_kind,
            gb_per_s: l.gb_per_s,
            latency_ms: l.latency_ms,
            samples: l.samples as u64,
            updated_unix_ms: l.updated_unix_ms,
            history: l
                .history
                .iter()
                .map(|s| LinkPoint { at_unix_ms: s.at_unix_ms, gb_per_s: s.gb_per_s, latency_ms: s.latency_ms })
                .collect(),
        })
        .collect();
    let nics = fleet
        .links
        .nics(node)
        .into_iter()
        .map(|n| NicRateView {
            node: n.node,
            name: n.name,
            kind: n.kind,
            tx_gb_per_s: n.tx_gb_per_s,
            rx_gb_per_s: n.rx_gb_per_s,
            at_unix_ms: n.at_unix_ms,
        })
        .collect();
    // The pairs the links above join, each at its slowest kind (`Links::bandwidth_spec`).
    let measured: BTreeSet<String> = links.iter().flat_map(|l| [l.a.clone(), l.b.clone()]).collect();
    let measured: Vec<String> = measured.into_iter().collect();
    let pairs = fleet
        .links
        .bandwidth_spec(&measured)
        .map(|spec| spec.pairs)
        .unwrap_or_default()
        .into_iter()
        .filter(|p| node.is_none_or(|n| p.a == n || p.b == n))
        .map(|p| BandwidthPair { a: p.a, b: p.b, gb_per_s: p.gb_per_s })
        .collect();
    Ok(NetworkView { links, nics, bandwidth: BandwidthPairs { pairs } })
}

/// What the declared inventory gives a pair of nodes: the planner's cluster of every node
/// whose stored entry reads, and each node's class in it.
struct Declared {
    cluster: Option<Cluster>,
    class: HashMap<String, usize>,
}

impl Declared {
    fn new(nodes: &[NodeRecord]) -> Declared {
        let specs: Vec<NodeSpec> = nodes.iter().filter_map(|n| serde_json::from_str::<NodeSpec>(&n.inventory).ok()).collect();
        let cluster = (!specs.is_empty())
            .then(|| {
                Cluster::from_spec(&ClusterSpec { name: "declared".into(), nodes: specs, gpu_types: crate::state::catalog::declared() })
            })
            .and_then(|c| c.map_err(|e| tracing::warn!("the declared inventory does not make a cluster: {e}")).ok());
        let class = cluster.iter().flat_map(|c| c.nodes.iter().map(|n| (n.name.clone(), n.class))).collect();
        Declared { cluster, class }
    }

    /// The nominal GB/s between two different nodes (nothing measured is in this cluster),
    /// None when either is not in it.
    fn between(&self, a: &str, b: &str) -> Option<f64> {
        let cluster = self.cluster.as_ref()?;
        let (ca, cb) = (*self.class.get(a)?, *self.class.get(b)?);
        Some(cluster.inter_bw(ca, cb)).filter(|g| g.is_finite() && *g > 0.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(name: &str, inventory: &str) -> NodeRecord {
        NodeRecord {
            name: name.into(),
            inventory: inventory.into(),
            state: crate::store::NodeState::Active,
            agent_epoch: 1,
            registered_at_ms: 0,
        }
    }

    #[test]
    fn the_declared_rate_is_the_planners_nominal_one_between_the_classes() {
        let ib = r#"{"name": "NAME", "gpu": "A100-80G", "gpus": 8, "nics": [{"name": "mlx5_0", "kind": "ib", "gbps": 200}], "rdma_domain": "lab"}"#;
        let eth = r#"{"name": "NAME", "gpu": "A100-80G", "gpus": 8, "nics": [{"name": "eth0", "kind": "ethernet", "gbps": 100}]}"#;
        let nodes = vec![
            record("i0", &ib.replace("NAME", "i0")),
            record("i1", &ib.replace("NAME", "i1")),
            record("e0", &eth.replace("NAME", "e0")),
        ];
        let d = Declared::new(&nodes);
        // 200 Gbit/s InfiniBand at 85% between the InfiniBand nodes.
        assert_eq!(d.between("i0", "i1"), Some(200.0 / 8.0 * 0.85));
        assert_eq!(d.between("i1", "i0"), d.between("i0", "i1"));
        assert_eq!(d.between("i0", "x"), None);
        assert_eq!(d.between("x", "i1"), None);
    }
}
