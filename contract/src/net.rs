//! The live link matrix as the coordinator's API shows it (`GET /api/v1/net`, gRPC
//! `GetNetwork`), what `motley net show` and the dashboard read back (docs/network.md, "The
//! link matrix"). Field names are a contract: fields may be added, never renamed. `bandwidth`
//! is the measured links in the `motley replan --bandwidth FILE` schema (pairs), so an
//! operator can save it and feed it to `motley replan` as it is.

use serde::{Deserialize, Serialize};

/// The link matrix, or one node's part of it.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "utoipa", derive(utoipa::ToSchema))]
pub struct NetworkView {
    /// One per (node, node, NIC kind) measured, `a` < `b`, in that order.
    pub links: Vec<LinkView>,
    /// The NICs' achieved rates, by node then name.
    pub nics: Vec<NicRateView>,
    /// The measured links between pairs of nodes (the slowest NIC kind of each pair), as
    /// `motley replan --bandwidth` reads them.
    pub bandwidth: BandwidthPairs,
}

/// A link between two nodes over one kind of NIC, as agents measured it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "utoipa", derive(utoipa::ToSchema))]
pub struct LinkView {
    pub a: String,
    pub b: String,
    /// "ib", "roce" or "eth": the NIC kind the probes crossed.
    pub nic_kind: String,
    /// The estimate: the best of the newest samples (GB/s, 1e9 bytes).
    pub gb_per_s: f64,
    /// The lowest round trip among those samples (ms).
    pub latency_ms: f64,
    /// Samples in the history.
    pub samples: u64,
    /// The newest sample's time (ms since the Unix epoch).
    pub updated_unix_ms: i64,
    /// What the declared inventory gives the pair (the planner's nominal inter-node GB/s
    /// between the two nodes' classes); null when a node's inventory is unknown.
    pub declared_gb_per_s: Option<f64>,
    /// Oldest first.
    pub history: Vec<LinkPoint>,
}

/// One probe's result.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "utoipa", derive(utoipa::ToSchema))]
pub struct LinkPoint {
    pub at_unix_ms: i64,
    pub gb_per_s: f64,
    pub latency_ms: f64,
}

/// A NIC's achieved rates from its byte counters over the agent's last interval.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "utoipa", derive(utoipa::ToSchema))]
pub struct NicRateView {
    pub node: String,
    pub name: String,
    pub kind: String,
    pub tx_gb_per_s: f64,
    pub rx_gb_per_s: f64,
    pub at_unix_ms: i64,
}

/// The `--bandwidth` file of `motley replan` (its pairs form).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "utoipa", derive(utoipa::ToSchema))]
pub struct BandwidthPairs {
    pub pairs: Vec<BandwidthPair>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "utoipa", derive(utoipa::ToSchema))]
pub struct BandwidthPair {
    pub a: String,
    pub b: String,
    pub gb_per_s: f64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_view_reads_back_what_the_api_writes() {
        let doc = serde_json::json!({
            "links": [{"a": "n0", "b": "n1", "nic_kind": "eth", "gb_per_s": 1.5, "latency_ms": 0.2, "samples": 2,
                "updated_unix_ms": 20, "declared_gb_per_s": null,
                "history": [{"at_unix_ms": 10, "gb_per_s": 1.0, "latency_ms": 0.3}, {"at_unix_ms": 20, "gb_per_s": 1.5, "latency_ms": 0.2}]}],
            "nics": [{"node": "n0", "name": "eth0", "kind": "eth", "tx_gb_per_s": 0.5, "rx_gb_per_s": 0.25, "at_unix_ms": 20}],
            "bandwidth": {"pairs": [{"a": "n0", "b": "n1", "gb_per_s": 1.5}]}
        });
        let v: NetworkView = serde_json::from_value(doc.clone()).unwrap();
        assert_eq!((v.links[0].samples, v.links[0].declared_gb_per_s, v.links[0].history.len()), (2, None, 2));
        assert_eq!(serde_json::to_value(&v).unwrap(), doc);
    }
}
