//! Metis's inputs seen through Motley's own cost model: the hostfile and clusterfile become
//! a Motley cluster (catalog GPUs, NVLink or PCIe inside a node, the clusterfile's
//! inter-node bandwidth as Ethernet between nodes), the profile directory's GPT becomes a
//! Motley model (embedding, L-2 transformer blocks, head), and a plan in Metis's form is
//! priced as what it physically is: a TP group that spans nodes all-reduces over the NIC,
//! and a replica that spans GPU types runs at its slowest GPU. Transformer blocks are timed
//! by Metis's own measurements (`import_profiles`), the embedding and head by Motley's
//! roofline. The same module searches
//! Metis's space under Motley's model, by the branch and bound of `search.rs` with Motley's
//! stage times.

use serde::Serialize;

use super::cost::{binary_pieces, Layout, MetisModel};
use super::plan::MetisPlan;
use crate::error::{BaselineError, Result};
use motley_solver::cost::{CostModel, PlanOptions, StageKind};
use motley_solver::hardware::{gpu_catalog, Cluster, ClusterSpec, NicKind, NicSpec, NodeSpec};
use motley_solver::model::{Model, ModelSpec};
use motley_solver::plan::{PlanStructure, ReplicaPlan, StagePlan};
use motley_solver::profile::{LayerProfile, ProfileSet};

/// Motley's cluster, model and profiles for a set of Metis inputs.
pub struct MotleyView {
    pub cluster: Cluster,
    pub model: Model,
    /// Metis's measured transformer-block times as Motley profiles (see `import_profiles`).
    pub profiles: ProfileSet,
    /// Motley node class of each Metis GPU type (None for types without GPUs).
    pub class_of_type: Vec<Option<usize>>,
}

/// Metis GPU type + memory -> Motley catalog name ("A100" with 80 GB -> "A100-80G").
fn catalog_name(ty: &str, memory_gb: f64) -> Result<String> {
    let cat = gpu_catalog();
    let matching: Vec<_> = cat.iter().filter(|g| g.name.to_ascii_uppercase().starts_with(&ty.to_ascii_uppercase())).collect();
    matching
        .iter()
        .min_by(|a, b| (a.memory_gib - memory_gb).abs().total_cmp(&(b.memory_gib - memory_gb).abs()))
        .map(|g| g.name.clone())
        .ok_or_else(|| BaselineError::invalid(format!("clusterfile (type {ty})"), "no Motley catalog GPU of this type to price it with"))
}

pub fn motley_view(m: &MetisModel) -> Result<MotleyView> {
    let mut nodes = vec![];
    let mut names = vec![];
    for (t, ty) in m.cluster.types.iter().enumerate() {
        if ty.gpus == 0 {
            continue;
        }
        let gpu = catalog_name(&ty.name, ty.memory_gb)?;
        // MiB per ms -> Gbit/s.
        let gbps = ty.inter_bw * 1.048576 * 8.0;
        nodes.push(NodeSpec {
            name: ty.name.to_ascii_lowercase(),
            count: Some(ty.gpus / m.cluster.gpus_per_node),
            gpu,
            gpus: m.cluster.gpus_per_node,
            intra: None,
            nics: vec![NicSpec::new("eth0", NicKind::Ethernet, gbps)],
            rdma_domain: None,
            spot: false,
            price_per_gpu_hour: None,
            pcie_switch_gbit: None,
            emulate: None,
        });
        names.push(t);
    }
    let cluster = Cluster::from_spec(&ClusterSpec { name: "metis".into(), nodes, gpu_types: vec![] })?;
    let mut class_of_type = vec![None; m.cluster.types.len()];
    for (i, &t) in names.iter().enumerate() {
        let node = cluster.classes.iter().position(|c| {
            c.nodes.iter().any(|&n| cluster.nodes[n].name.starts_with(&format!("{}-", m.cluster.types[t].name.to_ascii_lowercase())))
        });
        class_of_type[t] = node.or(Some(i));
    }
    let s = &m.settings;
    let hidden = s.hidden as u64;
    let spec = ModelSpec::gpt(
        &format!("metis-gpt-{}", s.layers),
        (s.layers - 2) as u32,
        hidden,
        (hidden / 128).max(1) as u32,
        s.seq as u64,
        s.vocab as u64,
    );
    let model = Model::new(spec, None)?;
    let profiles = import_profiles(m, &cluster, &class_of_type);
    profiles.validate()?;
    Ok(MotleyView { cluster, model, profiles, class_of_type })
}

/// Metis's profiles as Motley's: per (GPU, tp, bs), one transformer block's measured time
/// (`layer_compute_total_ms[1]`; Metis takes every block to equal it), split 1:2 between
/// forward and backward. Measurements with TP inside a node are taken as they are. For TP
/// groups larger than a node (synthetic extrapolations in Metis's data, with TP assumed free)
/// we take the node-sized measurement, scale its compute by node/tp, and add the four
/// activation all-reduces a Megatron block does, over the NIC.
pub fn import_profiles(m: &MetisModel, cluster: &Cluster, class_of_type: &[Option<usize>]) -> ProfileSet {
    let mut out = vec![];
    let s = &m.settings;
    for (t, ty) in m.cluster.types.iter().enumerate() {
        let Some(c) = class_of_type[t] else { continue };
        let class = &cluster.classes[c];
        let gpn = class.gpus_per_node;
        let nic = cluster.inter_bw(c, c) * 1e9;
        let mut tp = 1;
        while tp <= m.profiles.max_tp {
            for bs in 1..=m.profiles.max_bs {
                // A batch Metis did not measure runs as its binary pieces, as in Metis.
                let measured = |tp: u32| -> Option<f64> {
                    match m.profiles.get(t, tp, bs) {
                        Some(p) => Some(p.layer_ms[1]),
                        None => binary_pieces(bs).map(|b| m.profiles.get(t, tp, b).map(|p| p.layer_ms[1])).sum(),
                    }
                };
                let block_ms = if tp <= gpn {
                    measured(tp)
                } else {
                    measured(gpn).map(|ms| {
                        let t_f = tp as f64;
                        let allreduce = 2.0 * (t_f - 1.0) / t_f * bs as f64 * s.seq * s.hidden * 2.0 / nic * 1e3;
                        ms * gpn as f64 / t_f + 4.0 * allreduce
                    })
                };
                if let Some(ms) = block_ms.filter(|x| *x > 0.0) {
                    out.push(LayerProfile::per_layer(&class.gpu.name, tp, bs, ms / 3.0, ms * 2.0 / 3.0, None));
                }
            }
            tp *= 2;
        }
        let _ = ty;
    }
    ProfileSet { profiles: out }
}

/// A Metis plan priced by Motley's model.
#[derive(Debug, Clone, Serialize)]
pub struct MotleyPrice {
    pub iteration_ms: f64,
    pub fits: bool,
    /// What the plan is physically (TP groups across nodes, mixed replicas).
    pub notes: Vec<String>,
}

impl MotleyView {
    /// The Motley stage kind of Metis ranks [r, r + g) run as (dp, tp): the slowest type's
    /// class (a replica runs at its slowest GPU).
    pub fn kind_of(&self, m: &MetisModel, layout: &Layout, r: u32, g: u32, dp: u32) -> (StageKind, bool) {
        let mut types: Vec<usize> = (r..r + g).map(|x| layout.type_of(x)).collect();
        types.sort_unstable();
        types.dedup();
        let class = types
            .iter()
            .filter_map(|&t| self.class_of_type[t])
            .min_by(|&a, &b| {
                let (x, y) = (&self.cluster.classes[a].gpu, &self.cluster.classes[b].gpu);
                (x.tflops, x.memory_gib).partial_cmp(&(y.tflops, y.memory_gib)).unwrap()
            })
            .expect("types of a stage have GPUs");
        let _ = m;
        (StageKind { class, tp: g / dp, dp }, types.len() > 1)
    }

    /// Price a Metis plan with Motley's model. Stages that hold only the embedding or only
    /// the head have no transformer block and no Motley form: refused.
    pub fn price(&self, m: &MetisModel, opts: &PlanOptions, plan: &MetisPlan) -> Result<MotleyPrice> {
        let (layout, batches) = plan.validate(m)?;
        let gbs = m.settings.global_batch;
        let micro_batch = gbs / batches;
        let last_block = m.settings.layers - 1;
        let mut stages = vec![];
        let mut notes = vec![];
        let mut r = 0;
        for (i, (&g, &[dp, _])) in plan.device_groups.iter().zip(&plan.strategies).enumerate() {
            let (a, b) = (plan.layer_partition[i], plan.layer_partition[i + 1]);
            let (kind, mixed) = self.kind_of(m, &layout, r, g, dp);
            let (lo, hi) = (a.max(1) - 1, b.min(last_block) - 1);
            if hi <= lo {
                return Err(BaselineError::invalid(
                    format!("plan.layer_partition[{i}..{}]", i + 1),
                    "this stage holds no transformer block (only the embedding or the head); Motley's model gives every stage at least one",
                ));
            }
            if !micro_batch.is_multiple_of(dp) {
                return Err(BaselineError::invalid(
                    format!("plan.strategies[{i}]"),
                    format!(
                        "dp {dp} does not divide the {micro_batch} samples of a micro-batch: Metis drops the remainder, Motley does not"
                    ),
                ));
            }
            let gpn = self.cluster.classes[kind.class].gpus_per_node;
            if kind.tp > gpn {
                notes.push(format!(
                    "stage {i}: a TP group of {} GPUs spans {} nodes and all-reduces over the NIC",
                    kind.tp,
                    kind.tp.div_ceil(gpn)
                ));
            }
            if mixed {
                notes.push(format!(
                    "stage {i}: replicas span GPU types and run at the slowest, {}",
                    self.cluster.classes[kind.class].gpu.name
                ));
            }
            stages.push(StagePlan { kind, layers: (lo as u32, hi as u32) });
            r += g;
        }
        let structure = PlanStructure { micro_batch, replicas: vec![ReplicaPlan { stages, micro_batches: batches }] };
        let cm = CostModel { cluster: &self.cluster, model: &self.model, profiles: &self.profiles, opts };
        let e = cm.evaluate(&structure);
        Ok(MotleyPrice { iteration_ms: e.iteration_time * 1e3, fits: e.fits, notes })
    }
}
