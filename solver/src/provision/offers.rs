//! The offers file of `motley provision` (YAML; the schema is a contract, fields may be added):
//! what can be rented, per GPU type.
//!
//! ```yaml
//! name: my-cloud
//! offers:
//!   - gpu: A6000                  # catalog name, or one declared under gpu_types
//!     name: a6000                 # optional; defaults to the GPU name; unique
//!     price_per_gpu_hour: 6.0     # $ per GPU-hour
//!     quota: 8                    # at most this many GPUs can be had
//!     gpus_per_node: 1            # GPUs per instance (instances are rented whole)
//!     intra: pcie                 # optional, as in the cluster file
//!     nics: [{name: eth0, kind: ethernet, gbps: 20}]   # network between instances
//!     rdma_domain: zone-a         # optional, as in the cluster file
//! gpu_types: []                   # optional, as in the cluster file
//! ```

use serde::{Deserialize, Serialize};

use crate::error::{Result, SolverError};
use crate::hardware::{Cluster, ClusterSpec, GpuType, IntraLink, NicSpec, NodeSpec};
use crate::limits::{self, MAX_GPUS, MAX_GPUS_PER_NODE};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OfferSpec {
    pub gpu: String,
    #[serde(default)]
    pub name: Option<String>,
    pub price_per_gpu_hour: f64,
    pub quota: u32,
    #[serde(default = "one")]
    pub gpus_per_node: u32,
    #[serde(default)]
    pub intra: Option<IntraLink>,
    #[serde(default)]
    pub nics: Vec<NicSpec>,
    #[serde(default)]
    pub rdma_domain: Option<String>,
}

fn one() -> u32 {
    1
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OffersSpec {
    pub name: String,
    pub offers: Vec<OfferSpec>,
    #[serde(default)]
    pub gpu_types: Vec<GpuType>,
}

/// One validated offer.
#[derive(Debug, Clone, PartialEq)]
pub struct Offer {
    pub name: String,
    pub spec: OfferSpec,
    pub gpu: GpuType,
    /// Whole instances the quota allows.
    pub max_nodes: u32,
}

/// Validated offers: every allocation of them is a valid cluster.
#[derive(Debug, Clone, PartialEq)]
pub struct Offers {
    pub name: String,
    pub offers: Vec<Offer>,
    gpu_types: Vec<GpuType>,
}

/// How many instances of each offer (indexed like `Offers::offers`).
pub type Allocation = Vec<u32>;

impl Offers {
    pub fn from_spec(spec: &OffersSpec) -> Result<Offers> {
        if spec.offers.is_empty() {
            return Err(SolverError::invalid("offers", "lists nothing to rent; add at least one entry under offers:"));
        }
        let mut offers = Vec::new();
        for (i, o) in spec.offers.iter().enumerate() {
            let f = |x: &str| format!("offers[{i}].{x}");
            if !(o.price_per_gpu_hour.is_finite() && o.price_per_gpu_hour > 0.0 && o.price_per_gpu_hour <= 1e6) {
                return Err(SolverError::invalid(f("price_per_gpu_hour"), "must be a positive number of $ per GPU-hour (at most 1000000)"));
            }
            if o.gpus_per_node == 0 {
                return Err(SolverError::invalid(f("gpus_per_node"), "must be at least 1"));
            }
            // An allocation is a cluster: the cluster file's limits bound what can be rented.
            limits::at_most(f("gpus_per_node"), o.gpus_per_node as u64, MAX_GPUS_PER_NODE as u64, "GPUs a node may have")?;
            limits::at_most(f("quota"), o.quota as u64, MAX_GPUS, "GPUs a cluster may have")?;
            if o.quota < o.gpus_per_node {
                return Err(SolverError::invalid(
                    f("quota"),
                    format!("{} is less than one instance of {} GPUs; raise the quota or remove the offer", o.quota, o.gpus_per_node),
                ));
            }
            let name = o.name.clone().unwrap_or_else(|| o.gpu.clone());
            if offers.iter().any(|x: &Offer| x.name == name) {
                return Err(SolverError::invalid(f("name"), format!("duplicate offer name '{name}'; give each offer a unique name")));
            }
            // Each offer as a one-instance cluster: validates its GPU, link and NICs with the
            // cluster file's messages, named by offer.
            let node = node_spec(o, &name, 1);
            let cluster =
                Cluster::from_spec(&ClusterSpec { name: spec.name.clone(), nodes: vec![node], gpu_types: spec.gpu_types.clone() })
                    .map_err(|e| match e {
                        SolverError::InvalidInput { field, message } => SolverError::invalid(
                            field.replace("nodes[0]", &format!("offers[{i}]")).replace(".gpus", ".gpus_per_node"),
                            message,
                        ),
                        other => other,
                    })?;
            let gpu = cluster.classes[0].gpu.clone();
            offers.push(Offer { name, spec: o.clone(), gpu, max_nodes: o.quota / o.gpus_per_node });
        }
        let out = Offers { name: spec.name.clone(), offers, gpu_types: spec.gpu_types.clone() };
        Ok(out)
    }

    /// The cluster an allocation rents: `alloc[i]` instances of offer i, named `<offer>-<k>`.
    pub fn cluster(&self, alloc: &[u32]) -> Result<Cluster> {
        let nodes = self.offers.iter().zip(alloc).filter(|(_, &n)| n > 0).map(|(o, &n)| node_spec(&o.spec, &o.name, n)).collect();
        Cluster::from_spec(&ClusterSpec { name: self.name.clone(), nodes, gpu_types: self.gpu_types.clone() })
    }

    /// $ per hour of an allocation.
    pub fn price_per_hour(&self, alloc: &[u32]) -> f64 {
        self.offers.iter().zip(alloc).map(|(o, &n)| n as f64 * o.spec.gpus_per_node as f64 * o.spec.price_per_gpu_hour).sum()
    }

    pub fn gpus(&self, alloc: &[u32]) -> u32 {
        self.offers.iter().zip(alloc).map(|(o, &n)| n * o.spec.gpus_per_node).sum()
    }

    /// Every allocation within the quotas, the empty one excluded, in lexicographic order.
    pub fn all_allocations(&self) -> Vec<Allocation> {
        let mut out = vec![vec![]];
        for o in &self.offers {
            out = out.into_iter().flat_map(|a: Allocation| (0..=o.max_nodes).map(move |n| [a.clone(), vec![n]].concat())).collect();
        }
        out.retain(|a| a.iter().any(|&n| n > 0));
        out
    }

    /// How many allocations `all_allocations` lists.
    pub fn allocation_count(&self) -> f64 {
        self.offers.iter().map(|o| o.max_nodes as f64 + 1.0).product::<f64>() - 1.0
    }
}

fn node_spec(o: &OfferSpec, name: &str, count: u32) -> NodeSpec {
    NodeSpec {
        name: name.to_string(),
        count: Some(count),
        gpu: o.gpu.clone(),
        gpus: o.gpus_per_node,
        intra: o.intra,
        nics: o.nics.clone(),
        rdma_domain: o.rdma_domain.clone(),
        spot: false,
        price_per_gpu_hour: Some(o.price_per_gpu_hour),
        pcie_switch_gbit: None,
        emulate: None,
    }
}
