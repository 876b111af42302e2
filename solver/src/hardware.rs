//! The cluster as the planner prices it: checked node entries (`motley_contract::cluster`,
//! re-exported here) grouped into classes, with the link bandwidths the cost model prices.
//!
//! Units: GPU memory in GiB, compute in dense fp16/bf16 tensor TFLOPS, memory and NVLink
//! bandwidth in GB/s (bytes), NIC line rates in Gbit/s as vendors print them.

use std::collections::BTreeMap;

pub use motley_contract::cluster::{
    gpu_catalog, ClusterSpec, Emulate, GpuType, IntraLink, NicKind, NicSpec, NodeSpec, Precision, PrecisionChoice, MAX_EMULATE_CPU,
};

use crate::error::{Result, SolverError};

/// Nodes that are interchangeable for planning: same GPU type and count, same intra-node
/// link, same NICs and RDMA domain. The search runs over counts of classes, never over
/// individual GPUs.
#[derive(Debug, Clone, PartialEq)]
pub struct NodeClass {
    pub gpu: GpuType,
    pub gpus_per_node: u32,
    pub intra: IntraLink,
    /// Per kind, the Gbit/s all NICs of that kind carry together (multi-edge rule, see
    /// `multi_edge_gbit`).
    pub nic_gbps: BTreeMap<NicKind, f64>,
    /// The NICs as declared (ports, GID indices, rails), for the NCCL settings of a group.
    pub nics: Vec<NicSpec>,
    pub rdma_domain: String,
    /// Measured over nominal inter-node bandwidth of this class's nodes, bucketed (0 when no
    /// measurement applies); nodes whose links measure differently are planned apart.
    pub bw_bucket: i32,
    /// Indices into `Cluster::nodes`, in file order.
    pub nodes: Vec<usize>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Node {
    pub name: String,
    pub class: usize,
    pub gpus: u32,
    /// Its GPUs are emulated on CPU (`NodeSpec::emulate`).
    pub emulated: bool,
}

/// A validated cluster.
#[derive(Debug, Clone, PartialEq)]
pub struct Cluster {
    pub name: String,
    pub nodes: Vec<Node>,
    pub classes: Vec<NodeClass>,
    /// GB/s between two nodes of classes a and b when measured (`bandwidth.rs`), overriding
    /// the nominal rate of the transport `inter_link` picks; None where nothing was measured.
    pub measured: Vec<Vec<Option<f64>>>,
}

/// Effective fraction of a link's nominal rate that collectives reach.
const NVLINK_EFFICIENCY: f64 = 0.8;
/// InfiniBand and TCP over Ethernet reach ~85% of line rate in NCCL's bus bandwidth; RoCE
/// less (PFC pauses, DCQCN rate cuts under incast): Holmes Table 1 measures 200 Gbit/s RoCE
/// 19% below 200 Gbit/s InfiniBand for the same job.
pub(crate) fn nic_efficiency(kind: NicKind) -> f64 {
    match kind {
        NicKind::Ib | NicKind::Ethernet => 0.85,
        NicKind::Roce => 0.75,
    }
}
/// PCIe 4.0 x16 as seen by NCCL between two GPUs of one node, GB/s.
const PCIE_GBPS: f64 = 16.0;
/// PCIe 4.0 x16 uplink of a PCIe switch, Gbit/s.
pub const DEFAULT_PCIE_SWITCH_GBIT: f64 = 256.0;
/// Nodes that declare no NIC are assumed to have this much plain Ethernet, Gbit/s.
pub const DEFAULT_ETHERNET_GBIT: f64 = 10.0;

/// A checked entry as its class (no nodes yet, bandwidth bucket 0).
fn node_class(n: &NodeSpec, gpu: GpuType) -> NodeClass {
    let switch_gbit = n.pcie_switch_gbit.unwrap_or(DEFAULT_PCIE_SWITCH_GBIT);
    let mut nic_gbps = multi_edge_gbit(&n.nics, switch_gbit);
    nic_gbps.entry(NicKind::Ethernet).or_insert(DEFAULT_ETHERNET_GBIT);
    let intra = n.intra.unwrap_or(if gpu.nvlink_gbps > 0.0 { IntraLink::Nvlink } else { IntraLink::Pcie });
    NodeClass {
        gpu,
        gpus_per_node: n.gpus,
        intra,
        nic_gbps,
        nics: n.nics.clone(),
        rdma_domain: n.rdma_domain.clone().unwrap_or_else(|| "default".to_string()),
        bw_bucket: 0,
        nodes: vec![],
    }
}

impl Cluster {
    /// Validate a cluster file (`ClusterSpec::check`) and group its nodes into classes.
    pub fn from_spec(spec: &ClusterSpec) -> Result<Cluster> {
        let gpus = spec.check()?;
        let mut nodes = Vec::new();
        let mut classes: Vec<NodeClass> = Vec::new();
        for (n, gpu) in spec.nodes.iter().zip(gpus) {
            let class = node_class(n, gpu);
            let ci = match classes.iter().position(|c| same_class(c, &class)) {
                Some(ci) => ci,
                None => {
                    classes.push(class);
                    classes.len() - 1
                }
            };
            for name in n.node_names() {
                classes[ci].nodes.push(nodes.len());
                nodes.push(Node { name, class: ci, gpus: n.gpus, emulated: n.emulate.is_some() });
            }
        }
        let measured = vec![vec![None; classes.len()]; classes.len()];
        Ok(Cluster { name: spec.name.clone(), nodes, classes, measured })
    }

    /// A `--precision` / `plan_options.precision` choice on this cluster: `auto` is
    /// [`Cluster::auto_precision`].
    pub fn precision(&self, choice: PrecisionChoice) -> Precision {
        match choice {
            PrecisionChoice::Auto => self.auto_precision(),
            PrecisionChoice::Fp16 => Precision::Fp16,
            PrecisionChoice::Bf16 => Precision::Bf16,
            PrecisionChoice::Fp32 => Precision::Fp32,
        }
    }

    /// `--precision auto`: bf16 when every GPU type of the cluster has bf16 tensor cores,
    /// fp16 otherwise.
    pub fn auto_precision(&self) -> Precision {
        if self.classes.iter().all(|c| c.gpu.has_bf16_tensor_cores()) {
            Precision::Bf16
        } else {
            Precision::Fp16
        }
    }

    /// Every GPU type the cluster uses has a peak at `p` (fp32 needs `fp32_tflops`).
    pub fn check_precision(&self, p: Precision) -> Result<()> {
        match self.classes.iter().find(|c| c.gpu.peak_tflops(p).is_none()) {
            Some(c) => Err(SolverError::invalid(
                "precision",
                format!(
                    "GPU type {} has no {} peak; add fp32_tflops (the vendor's dense fp32 TFLOPS) to its gpu_types entry, or plan in fp16/bf16",
                    c.gpu.name,
                    p.name()
                ),
            )),
            None => Ok(()),
        }
    }

    pub fn total_gpus(&self) -> u32 {
        self.nodes.iter().map(|n| n.gpus).sum()
    }

    /// Bandwidth (GB/s) between two GPUs of one node of class `c`.
    pub fn intra_bw(&self, c: usize) -> f64 {
        let class = &self.classes[c];
        match class.intra {
            IntraLink::Nvlink => class.gpu.nvlink_gbps / 2.0 * NVLINK_EFFICIENCY,
            IntraLink::Pcie => PCIE_GBPS,
        }
    }

    /// Best transport between a node of class `a` and a different node of class `b`:
    /// RDMA when both sit in one RDMA domain and share an RDMA kind, else Ethernet.
    pub fn inter_link(&self, a: usize, b: usize) -> (NicKind, f64) {
        let (ca, cb) = (&self.classes[a], &self.classes[b]);
        let mut best = (NicKind::Ethernet, 0.0f64);
        for kind in [NicKind::Ib, NicKind::Roce, NicKind::Ethernet] {
            if kind != NicKind::Ethernet && ca.rdma_domain != cb.rdma_domain {
                continue;
            }
            if let (Some(x), Some(y)) = (ca.nic_gbps.get(&kind), cb.nic_gbps.get(&kind)) {
                let gbs = x.min(*y) / 8.0 * nic_efficiency(kind);
                if gbs > best.1 {
                    best = (kind, gbs);
                }
            }
        }
        if let Some(m) = self.measured[a][b] {
            best.1 = m;
        }
        best
    }

    /// Transport and GB/s of a collective over nodes of `classes` (`multi[i]`: class i has
    /// more than one node in it, so its own inter-node link is crossed too): the fastest RDMA
    /// kind every class has, all in one RDMA domain, else Ethernet (so InfiniBand and RoCE
    /// never mix); the slowest pair sets the rate, measured where a measurement applies.
    pub fn common_link(&self, classes: &[usize], multi: &[bool]) -> (NicKind, f64) {
        let domain = &self.classes[classes[0]].rdma_domain;
        let same_domain = classes.iter().all(|&c| &self.classes[c].rdma_domain == domain);
        let mut best: Option<(NicKind, f64)> = None;
        for kind in [NicKind::Ib, NicKind::Roce, NicKind::Ethernet] {
            if kind != NicKind::Ethernet && !same_domain {
                continue;
            }
            if !classes.iter().all(|&c| self.classes[c].nic_gbps.contains_key(&kind)) {
                continue;
            }
            let mut rate = f64::INFINITY;
            for (i, &a) in classes.iter().enumerate() {
                let partners = if multi[i] { &classes[i..] } else { &classes[i + 1..] };
                for &b in partners {
                    let nominal = self.classes[a].nic_gbps[&kind].min(self.classes[b].nic_gbps[&kind]) / 8.0 * nic_efficiency(kind);
                    // A measurement is of the pair's own best transport.
                    let measured = self.measured[a][b].filter(|_| self.inter_link(a, b).0 == kind);
                    rate = rate.min(measured.unwrap_or(nominal));
                }
            }
            if rate.is_finite() && best.is_none_or(|b| rate > b.1) {
                best = Some((kind, rate));
            }
        }
        // Ethernet is always there (a default rate for nodes that declare none).
        best.unwrap_or((NicKind::Ethernet, f64::INFINITY))
    }

    /// The nominal GB/s between classes `a` and `b`, ignoring measurements.
    pub fn nominal_inter_bw(&self, a: usize, b: usize) -> f64 {
        let (ca, cb) = (&self.classes[a], &self.classes[b]);
        let (kind, _) = self.inter_link(a, b);
        ca.nic_gbps[&kind].min(cb.nic_gbps[&kind]) / 8.0 * nic_efficiency(kind)
    }

    /// GB/s between two different nodes of classes `a` and `b`.
    pub fn inter_bw(&self, a: usize, b: usize) -> f64 {
        self.inter_link(a, b).1
    }
}

pub(crate) fn same_class(a: &NodeClass, b: &NodeClass) -> bool {
    a.gpu == b.gpu
        && a.gpus_per_node == b.gpus_per_node
        && a.intra == b.intra
        && a.nic_gbps == b.nic_gbps
        && a.nics == b.nics
        && a.rdma_domain == b.rdma_domain
        && a.bw_bucket == b.bw_bucket
}

/// The multi-edge rule for a node's NICs, per kind, in Gbit/s: NICs of one kind are parallel
/// edges that add up (NCCL stripes a communicator's channels over them), except that NICs
/// behind one PCIe switch share its uplink, so their sum is capped by `switch_gbit`. Edges of
/// different kinds never add up: one communicator uses one network (IB verbs or sockets), and
/// a RoCE port and its Ethernet netdev are the same wire. Between two GPUs of one node NVLink
/// and PCIe contend (a copy uses one), so `intra_bw` takes the faster.
pub fn multi_edge_gbit(nics: &[NicSpec], switch_gbit: f64) -> BTreeMap<NicKind, f64> {
    let mut per_switch: BTreeMap<(NicKind, Option<&str>), f64> = BTreeMap::new();
    let mut out: BTreeMap<NicKind, f64> = BTreeMap::new();
    for nic in nics {
        match nic.pcie_switch.as_deref() {
            Some(sw) => *per_switch.entry((nic.kind, Some(sw))).or_insert(0.0) += nic.gbps,
            None => *out.entry(nic.kind).or_insert(0.0) += nic.gbps,
        }
    }
    for ((kind, _), gbit) in per_switch {
        *out.entry(kind).or_insert(0.0) += gbit.min(switch_gbit);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_is_bf16_only_where_every_gpu_type_has_bf16_tensor_cores() {
        let cluster = |gpus: &[&str]| {
            let nodes: Vec<String> = gpus.iter().enumerate().map(|(i, g)| format!("  - {{name: n{i}, gpu: {g}, gpus: 2}}\n")).collect();
            let spec: ClusterSpec = serde_norway::from_str(&format!("name: c\nnodes:\n{}", nodes.concat())).unwrap();
            Cluster::from_spec(&spec).unwrap()
        };
        let (a100, mixed) = (cluster(&["A100-80G", "H100"]), cluster(&["A100-80G", "V100-32G"]));
        assert_eq!(a100.precision(PrecisionChoice::Auto), Precision::Bf16);
        assert_eq!(mixed.precision(PrecisionChoice::Auto), Precision::Fp16);
        assert_eq!(PrecisionChoice::default(), PrecisionChoice::Auto);
        for (c, p) in
            [(PrecisionChoice::Fp16, Precision::Fp16), (PrecisionChoice::Bf16, Precision::Bf16), (PrecisionChoice::Fp32, Precision::Fp32)]
        {
            assert_eq!((a100.precision(c), mixed.precision(c)), (p, p));
        }
    }
}
