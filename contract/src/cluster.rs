//! The cluster file as written (`motley plan --cluster`, `motley cluster declare`, an agent's
//! inventory): GPU types and the built-in catalog, NICs, node entries, and the checks every
//! reader runs on them, each error naming the field and the fix. The planner groups checked
//! entries into classes and prices their links (`motley_solver::hardware`); an agent checks
//! its discovered entry with the same rules before it registers.
//!
//! Units: GPU memory in GiB, compute in dense fp16/bf16 tensor TFLOPS, memory and NVLink
//! bandwidth in GB/s (bytes), NIC line rates in Gbit/s as vendors print them. A contract
//! (README.md, docs/plan.md): fields may be added, never renamed.

use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};

use crate::error::{ContractError, Result};

/// Nodes a cluster may have, after `count` expansion (solver/README.md, "Limits").
pub const MAX_NODES: u64 = 65_536;
/// GPUs in one node (DGX/HGX boxes have 8, the largest NVLink domains 72 across trays that
/// are separate nodes to the OS).
pub const MAX_GPUS_PER_NODE: u32 = 64;
/// GPUs a cluster may have in all.
pub const MAX_GPUS: u64 = 262_144;

/// What to do about an input over a limit.
pub const LIMIT_FIX: &str = "fix the number if it is a typo; the planner's limits are listed in solver/README.md (\"Limits\")";

/// `value` of `field` must be at most `max` `what`.
pub fn at_most(field: impl Into<String>, value: u64, max: u64, what: &str) -> Result<()> {
    if value > max {
        return Err(ContractError::invalid(field, format!("{value} is more than the {max} {what}; {LIMIT_FIX}")));
    }
    Ok(())
}

/// A GPU model as the planner sees it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GpuType {
    pub name: String,
    pub memory_gib: f64,
    /// Dense fp16/bf16 tensor-core TFLOPS from the vendor's sheet.
    pub tflops: f64,
    /// HBM/GDDR bandwidth, GB/s.
    pub mem_bw_gbps: f64,
    /// Aggregate NVLink bandwidth per GPU, GB/s (both directions); 0 when the card has none.
    #[serde(default)]
    pub nvlink_gbps: f64,
    /// Dense bf16 TFLOPS (`--precision bf16`). GPUs without bf16 tensor cores (Volta, Turing,
    /// Pascal) run bf16 matrix products on their fp32 pipes, so this is their fp32 rate, a
    /// fraction of `tflops`. Absent: bf16 runs at `tflops` (bf16 tensor cores, Ampere and later).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bf16_tflops: Option<f64>,
    /// Dense fp32 (non-tensor) TFLOPS (`--precision fp32`); required for that precision.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fp32_tflops: Option<f64>,
}

/// The data type a run computes in: which peak of a GPU its matrix products reach.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    /// fp16 (mixed precision): `tflops`, the catalog's historical figure (the default).
    #[default]
    Fp16,
    /// bf16 (mixed precision): `bf16_tflops`, else `tflops`.
    Bf16,
    /// fp32 without TF32: `fp32_tflops`.
    Fp32,
}

impl Precision {
    pub fn name(self) -> &'static str {
        match self {
            Precision::Fp16 => "fp16",
            Precision::Bf16 => "bf16",
            Precision::Fp32 => "fp32",
        }
    }
}

/// `--precision` / a job's `plan_options.precision`: a precision, or `auto` (the default):
/// bf16 when every GPU type of the cluster given to the planner has bf16 tensor cores
/// ([`GpuType::has_bf16_tensor_cores`]), fp16 otherwise. It is decided on the cluster's GPU
/// types (every type the search may use), not on the chosen plan's, because the precision
/// prices the search itself: a plan that leaves a V100 idle is still planned in fp16.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PrecisionChoice {
    #[default]
    Auto,
    Fp16,
    Bf16,
    Fp32,
}

impl GpuType {
    /// Whether the type has bf16 tensor cores (Ampere and later), as its peaks say: no
    /// `bf16_tflops` means bf16 runs at `tflops` (yes); a `bf16_tflops` above `fp32_tflops`
    /// means tensor cores (yes); one at or below it means bf16 runs on the fp32 pipes (no:
    /// V100, T4, P100 in the catalog, whose bf16 column equals their fp32 one). Without
    /// `fp32_tflops`, a bf16 peak of at least half of `tflops` counts as tensor cores.
    pub fn has_bf16_tensor_cores(&self) -> bool {
        match (self.bf16_tflops, self.fp32_tflops) {
            (None, _) => true,
            (Some(b), Some(f)) => b > f,
            (Some(b), None) => b >= self.tflops / 2.0,
        }
    }

    /// Dense TFLOPS at `p`; None when the type does not say (fp32 without `fp32_tflops`).
    pub fn peak_tflops(&self, p: Precision) -> Option<f64> {
        match p {
            Precision::Fp16 => Some(self.tflops),
            Precision::Bf16 => Some(self.bf16_tflops.unwrap_or(self.tflops)),
            Precision::Fp32 => self.fp32_tflops,
        }
    }
}

/// The built-in catalog: vendor datasheet numbers (dense, no sparsity). Columns: memory GiB,
/// fp16 tensor TFLOPS, memory GB/s, NVLink GB/s, bf16 TFLOPS, fp32 (non-tensor) TFLOPS.
/// V100, T4 and P100 have no bf16 tensor cores: their bf16 column is their fp32 rate, equal to
/// the fp32 column, which is how `GpuType::has_bf16_tensor_cores` tells (bf16 products run
/// on the fp32 pipes; Espresso's DeepSpeed traces measure bf16 layers on V100
/// and T4 at 5-9% of the fp16 tensor peak, BENCHMARKS.md). A10G is AWS's A10 (NVIDIA's A10
/// sheet: 125 TFLOPS fp16/bf16 tensor, 31.2 fp32, 600 GB/s).
pub fn gpu_catalog() -> Vec<GpuType> {
    let g = |name: &str, memory_gib: f64, tflops: f64, mem_bw_gbps: f64, nvlink_gbps: f64, bf16: f64, fp32: f64| GpuType {
        name: name.to_string(),
        memory_gib,
        tflops,
        mem_bw_gbps,
        nvlink_gbps,
        bf16_tflops: Some(bf16),
        fp32_tflops: Some(fp32),
    };
    vec![
        g("A100-80G", 80.0, 312.0, 2039.0, 600.0, 312.0, 19.5),
        g("A100-40G", 40.0, 312.0, 1555.0, 600.0, 312.0, 19.5),
        g("H100", 80.0, 989.0, 3350.0, 900.0, 989.0, 67.0),
        g("H800", 80.0, 989.0, 3350.0, 400.0, 989.0, 67.0),
        // H200 SXM: the H100's compute with 141 GB of HBM3e at 4.8 TB/s; NVML reports 143771
        // MiB (140.4 GiB), the column's unit.
        g("H200", 140.0, 989.0, 4800.0, 900.0, 989.0, 67.0),
        g("H20", 96.0, 148.0, 4000.0, 900.0, 148.0, 44.0),
        g("V100-32G", 32.0, 125.0, 900.0, 300.0, 15.7, 15.7),
        g("V100-16G", 16.0, 125.0, 900.0, 300.0, 15.7, 15.7),
        g("A6000", 48.0, 154.8, 768.0, 0.0, 154.8, 38.7),
        g("A30", 24.0, 165.0, 933.0, 200.0, 165.0, 10.3),
        g("RTX3090", 24.0, 71.0, 936.0, 0.0, 71.0, 35.6),
        g("A4000", 16.0, 76.7, 448.0, 0.0, 76.7, 19.2),
        g("L20", 48.0, 119.5, 864.0, 0.0, 119.5, 59.8),
        g("RTX4090", 24.0, 165.2, 1008.0, 0.0, 165.2, 82.6),
        g("T4", 16.0, 65.0, 320.0, 0.0, 8.1, 8.1),
        g("P100", 16.0, 18.7, 732.0, 0.0, 9.3, 9.3),
        g("A10G", 24.0, 125.0, 600.0, 0.0, 125.0, 31.2),
    ]
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum NicKind {
    Ib,
    Roce,
    Ethernet,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum IntraLink {
    Nvlink,
    Pcie,
}

/// One NIC (or one port of a multi-port HCA) of a node.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NicSpec {
    /// The RDMA device (`mlx5_0`) for ib/roce, the interface (`eth0`) for ethernet.
    pub name: String,
    pub kind: NicKind,
    /// Line rate, Gbit/s.
    pub gbps: f64,
    /// HCA port NCCL should use (`NCCL_IB_HCA=mlx5_0:1`); default 1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub port: Option<u32>,
    /// RoCE only: the GID index of the RoCEv2 address (`NCCL_IB_GID_INDEX`); default 3.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gid_index: Option<u32>,
    /// GPUs behind the same PCIe switch (the NIC's rail); empty when unknown.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub gpus: Vec<u32>,
    /// NICs naming the same PCIe switch share its uplink (`pcie_switch_gbit` of the node).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pcie_switch: Option<String>,
}

impl NicSpec {
    pub fn new(name: &str, kind: NicKind, gbps: f64) -> NicSpec {
        NicSpec { name: name.to_string(), kind, gbps, port: None, gid_index: None, gpus: vec![], pcie_switch: None }
    }

    /// The HCA with its port, as NCCL_IB_HCA spells it.
    pub fn hca(&self) -> String {
        format!("{}:{}", self.name, self.port.unwrap_or(1))
    }
}

/// One `nodes:` entry of the cluster file (a contract: README.md, `motley plan`; fields may be
/// added, never renamed).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeSpec {
    pub name: String,
    #[serde(default)]
    pub count: Option<u32>,
    pub gpu: String,
    pub gpus: u32,
    #[serde(default)]
    pub intra: Option<IntraLink>,
    #[serde(default)]
    pub nics: Vec<NicSpec>,
    #[serde(default)]
    pub rdma_domain: Option<String>,
    #[serde(default)]
    pub spot: bool,
    #[serde(default)]
    pub price_per_gpu_hour: Option<f64>,
    /// Uplink of one PCIe switch, Gbit/s: NICs behind one switch never carry more together.
    /// Default 256 (PCIe 4.0 x16).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pcie_switch_gbit: Option<f64>,
    /// A declared test and demo mode: the node's GPUs are emulated on CPU, each rank confined
    /// to a share of one core (the agent's cgroup CPU limit). Never implied: the node's view and
    /// every plan that uses it say `emulated`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub emulate: Option<Emulate>,
}

/// `emulate:` of a node entry (docs/emulation.md).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Emulate {
    /// Each rank's share of one CPU core (0.3: 30% of it; docs/emulation.md says how the kernel
    /// holds a rank to it).
    pub cpu: f64,
}

/// The largest `emulate.cpu`: a share of more cores than a node has is no emulation.
pub const MAX_EMULATE_CPU: f64 = 64.0;

impl Emulate {
    /// Checked, with the field named as `field` (`nodes[i].emulate.cpu`, `emulate.cpu`).
    pub fn check(&self, field: &str) -> Result<()> {
        if !(self.cpu.is_finite() && self.cpu > 0.0 && self.cpu <= MAX_EMULATE_CPU) {
            return Err(ContractError::invalid(
                field,
                format!("is {}; give each rank's share of one CPU core, above 0 and at most {MAX_EMULATE_CPU} (0.3: 30%)", self.cpu),
            ));
        }
        Ok(())
    }
}

/// The cluster file as written.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterSpec {
    pub name: String,
    pub nodes: Vec<NodeSpec>,
    #[serde(default)]
    pub gpu_types: Vec<GpuType>,
}

impl ClusterSpec {
    /// The file checked as every reader reads it: its own GPU types, then the sizes (before
    /// anything is expanded), then each entry in order with the node names it expands to
    /// (unique). Gives each entry's GPU type.
    pub fn check(&self) -> Result<Vec<GpuType>> {
        let types = gpu_types_of(self)?;
        if self.nodes.is_empty() {
            return Err(ContractError::invalid("nodes", "the cluster has no nodes; add at least one entry under nodes:"));
        }
        check_sizes(self)?;
        let mut seen = BTreeSet::new();
        let mut gpus = Vec::with_capacity(self.nodes.len());
        for (i, n) in self.nodes.iter().enumerate() {
            gpus.push(n.check(i, &types)?);
            for name in n.node_names() {
                if !seen.insert(name.clone()) {
                    return Err(ContractError::invalid(
                        format!("nodes[{i}].name"),
                        format!("duplicate node name '{name}'; node names (after count expansion) must be unique"),
                    ));
                }
            }
        }
        Ok(gpus)
    }
}

impl NodeSpec {
    /// The nodes this entry declares: `NAME-0` .. `NAME-(count-1)` with a `count`, else `NAME`.
    pub fn node_names(&self) -> Vec<String> {
        match self.count {
            Some(count) => (0..count).map(|k| format!("{}-{k}", self.name)).collect(),
            None => vec![self.name.clone()],
        }
    }

    /// Entry `i` checked against the GPU types known (lower-cased names); its GPU type.
    fn check(&self, i: usize, types: &BTreeMap<String, GpuType>) -> Result<GpuType> {
        let n = self;
        let f = |x: &str| format!("nodes[{i}].{x}");
        if n.name.trim().is_empty() {
            return Err(ContractError::invalid(f("name"), "must not be empty"));
        }
        let gpu = types.get(&n.gpu.to_ascii_lowercase()).cloned().ok_or_else(|| {
            let known: Vec<String> = gpu_catalog().into_iter().map(|g| g.name).collect();
            ContractError::invalid(
                f("gpu"),
                format!("unknown GPU type '{}'; use one of {} or declare it under gpu_types", n.gpu, known.join(", ")),
            )
        })?;
        if n.gpus == 0 {
            return Err(ContractError::invalid(f("gpus"), "must be at least 1 (zero GPUs in a node)"));
        }
        if n.count.unwrap_or(1) == 0 {
            return Err(ContractError::invalid(f("count"), "must be at least 1; remove the entry instead"));
        }
        if !n.pcie_switch_gbit.is_none_or(|g| g.is_finite() && g > 0.0) {
            return Err(ContractError::invalid(f("pcie_switch_gbit"), "must be a positive rate in Gbit/s (PCIe 4.0 x16 is 256)"));
        }
        check_nics(i, n)?;
        if let Some(e) = &n.emulate {
            e.check(&f("emulate.cpu"))?;
        }
        if let Some(p) = n.price_per_gpu_hour {
            if !(p.is_finite() && p >= 0.0) {
                return Err(ContractError::invalid(f("price_per_gpu_hour"), "must be a non-negative number"));
            }
        }
        if n.intra == Some(IntraLink::Nvlink) && gpu.nvlink_gbps <= 0.0 {
            return Err(ContractError::invalid(f("intra"), format!("{} has no NVLink (nvlink_gbps is 0); use intra: pcie", gpu.name)));
        }
        Ok(gpu)
    }
}

/// The GPU catalogue, with the cluster file's own `gpu_types` (checked) added or overriding
/// by lower-cased name.
fn gpu_types_of(spec: &ClusterSpec) -> Result<BTreeMap<String, GpuType>> {
    let mut types: BTreeMap<String, GpuType> = gpu_catalog().into_iter().map(|g| (g.name.to_ascii_lowercase(), g)).collect();
    for (i, g) in spec.gpu_types.iter().enumerate() {
        let f = |x: &str| format!("gpu_types[{i}].{x}");
        for (name, v) in [("memory_gib", g.memory_gib), ("tflops", g.tflops), ("mem_bw_gbps", g.mem_bw_gbps)] {
            if !(v.is_finite() && v > 0.0) {
                return Err(ContractError::invalid(f(name), format!("must be a positive number, got {v}")));
            }
        }
        for (name, v) in [("bf16_tflops", g.bf16_tflops), ("fp32_tflops", g.fp32_tflops)] {
            if let Some(v) = v.filter(|v| !(v.is_finite() && *v > 0.0)) {
                return Err(ContractError::invalid(
                    f(name),
                    format!("must be a positive number of TFLOPS, got {v}; remove it to use tflops"),
                ));
            }
        }
        if !(g.nvlink_gbps.is_finite() && g.nvlink_gbps >= 0.0) {
            return Err(ContractError::invalid(f("nvlink_gbps"), "must be 0 or a positive number"));
        }
        types.insert(g.name.to_ascii_lowercase(), g.clone());
    }
    Ok(types)
}

/// The node and GPU totals of the entries within the limits.
fn check_sizes(spec: &ClusterSpec) -> Result<()> {
    // Sizes first, before anything is expanded: a `count` typo must not allocate.
    let (mut total_nodes, mut total_gpus) = (0u64, 0u64);
    for (i, n) in spec.nodes.iter().enumerate() {
        let f = |x: &str| format!("nodes[{i}].{x}");
        let count = n.count.unwrap_or(1) as u64;
        at_most(f("count"), count, MAX_NODES, "nodes a cluster may have")?;
        at_most(f("gpus"), n.gpus as u64, MAX_GPUS_PER_NODE as u64, "GPUs a node may have")?;
        total_nodes += count;
        total_gpus += count * n.gpus as u64;
        if total_nodes > MAX_NODES {
            return Err(ContractError::invalid(
                f("count"),
                format!("the entries up to this one declare {total_nodes} nodes, more than the {MAX_NODES} a cluster may have; fix the counts, or plan part of the cluster"),
            ));
        }
        if total_gpus > MAX_GPUS {
            return Err(ContractError::invalid(
                f("gpus"),
                format!("the entries up to this one declare {total_gpus} GPUs, more than the {MAX_GPUS} a cluster may have; fix the counts, or plan part of the cluster"),
            ));
        }
    }
    Ok(())
}

/// The NICs of node entry `i`: rates, names, GPUs, RoCE-only fields, ports, no duplicates.
fn check_nics(i: usize, n: &NodeSpec) -> Result<()> {
    for (j, nic) in n.nics.iter().enumerate() {
        let nf = |x: &str| format!("nodes[{i}].nics[{j}].{x}");
        if !(nic.gbps.is_finite() && nic.gbps > 0.0) {
            return Err(ContractError::invalid(nf("gbps"), "must be a positive line rate in Gbit/s"));
        }
        if nic.name.trim().is_empty() {
            return Err(ContractError::invalid(nf("name"), "must name the device (mlx5_0) or interface (eth0)"));
        }
        if let Some(&g) = nic.gpus.iter().find(|&&g| g >= n.gpus) {
            return Err(ContractError::invalid(nf("gpus"), format!("GPU {g} does not exist; the node has GPUs 0..{}", n.gpus)));
        }
        if nic.gid_index.is_some() && nic.kind != NicKind::Roce {
            return Err(ContractError::invalid(nf("gid_index"), "only RoCE NICs have a GID index; remove it or set kind: roce"));
        }
        if nic.port == Some(0) {
            return Err(ContractError::invalid(nf("port"), "HCA ports are numbered from 1; remove it to use port 1"));
        }
        if n.nics[..j].iter().any(|o| o.name == nic.name && o.port.unwrap_or(1) == nic.port.unwrap_or(1)) {
            return Err(ContractError::invalid(nf("name"), format!("'{}' is declared twice on this node", nic.name)));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_catalog_says_which_gpus_have_bf16_tensor_cores() {
        for g in gpu_catalog() {
            let none = ["V100-32G", "V100-16G", "T4", "P100"].contains(&g.name.as_str());
            assert_eq!(g.has_bf16_tensor_cores(), !none, "{}", g.name);
        }
        let mine = |bf16, fp32| GpuType {
            name: "Mine".into(),
            memory_gib: 80.0,
            tflops: 100.0,
            mem_bw_gbps: 1000.0,
            nvlink_gbps: 0.0,
            bf16_tflops: bf16,
            fp32_tflops: fp32,
        };
        assert!(mine(None, None).has_bf16_tensor_cores(), "no bf16 peak: bf16 runs at tflops");
        assert!(!mine(Some(10.0), Some(10.0)).has_bf16_tensor_cores(), "bf16 at the fp32 rate");
        assert!(mine(Some(80.0), None).has_bf16_tensor_cores());
        assert!(!mine(Some(10.0), None).has_bf16_tensor_cores());
    }
}
