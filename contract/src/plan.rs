//! The plan document. Rank numbering is part of it: replicas in order, stages in order, each
//! stage's `gpus` in order (TP fastest), so every party derives the same global rank of a GPU
//! from the document alone.

use std::collections::BTreeMap;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::cluster::Precision;
use crate::model::ModelSpec;

/// A GPU: a node name and the GPU's index on it (NVML's, PCI order).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, JsonSchema)]
pub struct GpuRef {
    pub node: String,
    pub index: u32,
}

#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize, JsonSchema)]
pub struct StageDoc {
    /// Half-open range of transformer layers.
    pub layers: [u32; 2],
    /// GPU type.
    pub gpu: String,
    pub tp: u32,
    pub dp: u32,
    /// TP group by TP group (dp-major).
    pub gpus: Vec<GpuRef>,
    /// What the planner priced (0 in a plan written by hand): the memory each GPU holds and has,
    #[serde(default)]
    pub memory_gib_per_gpu: f64,
    #[serde(default)]
    pub memory_capacity_gib: f64,
    /// seconds of one micro-batch's forward on this stage (its layers, TP all-reduces, the
    /// embedding on the first stage, the output head on the last),
    #[serde(default)]
    pub fwd_s: f64,
    /// and of its backward (recomputation included with --recompute).
    #[serde(default)]
    pub bwd_s: f64,
}

#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize, JsonSchema)]
pub struct ReplicaDoc {
    /// `micro_batches * micro_batch`: this replica's share of the global batch. The planner
    /// always writes it; a plan written by hand may leave it out.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub samples: Option<u32>,
    pub micro_batches: u32,
    /// What the planner priced one iteration of this replica at (0 in a plan written by hand).
    #[serde(default)]
    pub iteration_time_s: f64,
    pub stages: Vec<StageDoc>,
    /// Seconds of each pipeline hop per micro-batch (activations forward, gradients back).
    #[serde(default)]
    pub hops_s: Vec<f64>,
    /// Of `iteration_time_s`: the gradient sync that the backward passes do not hide. The
    /// planner writes it and `optimizer_s`, so a measured step can be set beside each term
    /// (`--timings`' `grad_sync_ms` and `optimizer_ms`); absent in a plan written by hand.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sync_s: Option<f64>,
    /// Of `iteration_time_s`: the optimizer step of the replica's slowest stage.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub optimizer_s: Option<f64>,
}

impl ReplicaDoc {
    /// This replica's samples per iteration, as written or as its micro-batches make them.
    pub fn samples_or_derived(&self, micro_batch: u32) -> u32 {
        self.samples.unwrap_or(self.micro_batches * micro_batch)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum GroupKind {
    Tp,
    Pp,
    Dp,
}

impl GroupKind {
    /// As the plan document spells it.
    pub fn name(self) -> &'static str {
        match self {
            GroupKind::Tp => "tp",
            GroupKind::Pp => "pp",
            GroupKind::Dp => "dp",
        }
    }
}

/// How a communicator's traffic travels: inside a node (NVLink, PCIe) or between nodes (an
/// RDMA kind, or sockets over Ethernet).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Transport {
    Nvlink,
    Pcie,
    Ib,
    Roce,
    Socket,
}

impl Transport {
    /// As the plan document spells it.
    pub fn name(self) -> &'static str {
        match self {
            Transport::Nvlink => "nvlink",
            Transport::Pcie => "pcie",
            Transport::Ib => "ib",
            Transport::Roce => "roce",
            Transport::Socket => "socket",
        }
    }
}

/// One communicator of the plan (the solver's `network.rs` says how ranks use it). The JSON
/// shape (`kind`, `gpus`, `transport`, `nics`, `env`) is a contract (docs/plan.md).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct CommGroupDoc {
    pub kind: GroupKind,
    pub gpus: Vec<GpuRef>,
    pub transport: Transport,
    /// RDMA devices with port (`mlx5_0:1`) or Ethernet interfaces; empty inside a node.
    #[serde(default)]
    pub nics: Vec<String>,
    /// NCCL settings that select this transport and these NICs.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Per node, settings that differ from `env` there (a RoCE port's GID index); ranks on
    /// that node apply them on top of `env`.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub node_env: BTreeMap<String, BTreeMap<String, String>>,
    /// `ncclConfig_t.netName` for this communicator ("IB" or "Socket"); None inside a node.
    pub nccl_net: Option<String>,
    /// TP and pipeline groups: the replica and stage (for a hop, the sending stage).
    pub replica: Option<u32>,
    pub stage: Option<u32>,
    /// Layers whose activations (tp, pp: the boundary) or gradients (dp) the group carries.
    pub layers: [u32; 2],
    /// GB/s of the slowest link the group crosses, as priced.
    #[serde(default)]
    pub link_gb_per_s: f64,
    /// Bytes each member sends per iteration, and the seconds that takes on the link.
    #[serde(default)]
    pub bytes_per_iteration: f64,
    #[serde(default)]
    pub seconds_per_iteration: f64,
}

/// One baseline's best plan as the planner priced it beside its own (all `None` when none fits).
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize, JsonSchema)]
pub struct BaselineDoc {
    pub iteration_time_s: Option<f64>,
    /// Baseline time over the plan's time.
    pub speedup: Option<f64>,
    pub replicas: Option<usize>,
    pub stages_per_replica: Option<usize>,
    pub tp: Option<u32>,
    pub micro_batch: Option<u32>,
}

/// How the plan was found.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize, JsonSchema)]
pub struct SearchDoc {
    /// The search mode, `given` for a plan priced as given, `baseline` for a baseline's plan.
    pub mode: String,
    #[serde(default)]
    pub proven_optimal: bool,
    #[serde(default)]
    pub configurations: usize,
    #[serde(default)]
    pub shapes: usize,
    #[serde(default)]
    pub plans_costed: u64,
    #[serde(default)]
    pub exhaustive_oracle: bool,
    /// No plan of the searched space is faster than this (fluid relaxation without gradient
    /// sync), when the search computed one.
    #[serde(default)]
    pub lower_bound: Option<f64>,
    /// Mode `baseline`: which baseline the plan is (`megatron`, `whale`, `fast-only`), made by
    /// that baseline's rule instead of Motley's search (`motley plan --baseline`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub baseline: Option<String>,
}

/// Where the links a plan assumed came from: the agents' measurements (with the declared
/// rates where a pair was not measured), or only the cluster's declared NICs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum NetworkSource {
    Measured,
    Declared,
}

/// The links between a plan's nodes as the plan assumed them: what a running job's measured
/// links are compared with (the solver's `bandwidth::plan_network` makes it).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct PlanNetwork {
    pub source: NetworkSource,
    /// One per pair of distinct nodes the plan uses (`a` < `b`), in name order.
    pub links: Vec<PlanLink>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct PlanLink {
    pub a: String,
    pub b: String,
    /// GB/s the plan assumed between them.
    pub gb_per_s: f64,
    /// Whether that was measured (else the declared NICs' nominal rate).
    pub measured: bool,
}

/// The plan document, the one type of it: what `motley plan -o json` prints, what the
/// coordinator stores and launches, a job's `plan:`, and what a rank reads at `MOTLEY_PLAN`
/// (the rank library's `Plan` reads the same fields; `plan_schema` holds both to one JSON
/// schema). The planner fills every field; a plan written by hand needs only the batch, the
/// replicas and their stages, and readers of such a plan see the defaults below.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize, JsonSchema)]
pub struct PlanDocument {
    /// The cluster's name.
    #[serde(default)]
    pub cluster: String,
    /// The model's name.
    #[serde(default)]
    pub model: String,
    /// The whole model (its file's fields, defaults filled in), so ranks can build it from the
    /// plan alone. Absent in documents from before it was added, and seen as absent by a reader
    /// older than the writer's model fields.
    #[serde(default, deserialize_with = "model_spec_if_known", skip_serializing_if = "Option::is_none")]
    pub model_spec: Option<ModelSpec>,
    pub global_batch: u32,
    pub micro_batch: u32,
    /// Tokens per sequence the plan was made for: whoever runs the plan runs it at this length
    /// or refuses it. A plan written by hand may leave it out.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seq_len: Option<u64>,
    /// What the plan was priced in and ranks compute in (`--precision`, `auto` resolved).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub precision: Option<Precision>,
    /// How the ranks run as the plan was priced, read by the rank library too: full activation
    /// recomputation (`--recompute`), activations as compiled blocks save them (the default;
    /// not `--eager`), optimizer state sharded over each stage's data-parallel ring
    /// (`--zero1`). False in documents from before they were added.
    #[serde(default)]
    pub recompute: bool,
    #[serde(default)]
    pub compiled: bool,
    #[serde(default)]
    pub zero1: bool,
    /// What the planner priced one iteration at (0 in a plan written by hand).
    #[serde(default)]
    pub iteration_time_s: f64,
    #[serde(default)]
    pub tokens_per_s: f64,
    /// Model FLOPs per second over the peak of every GPU in the cluster.
    #[serde(default)]
    pub peak_utilization: f64,
    #[serde(default)]
    pub gpus_used: u32,
    #[serde(default)]
    pub gpus_total: u32,
    /// GPUs the plan leaves idle, per GPU type (the search found no faster plan using them).
    #[serde(default)]
    pub idle_gpus: BTreeMap<String, u32>,
    /// Pipeline hops priced as inside one node that placement had to split across nodes
    /// (0 when the placement matches the cost model's packing).
    #[serde(default)]
    pub split_hops: usize,
    pub replicas: Vec<ReplicaDoc>,
    /// Every TP group, pipeline hop and gradient ring with its transport, NICs and NCCL
    /// settings, in the order ranks create them.
    #[serde(default)]
    pub comm_groups: Vec<CommGroupDoc>,
    /// The baselines priced beside the plan, by name (`megatron`, `whale`, `fast-only`).
    #[serde(default)]
    pub baselines: BTreeMap<String, BaselineDoc>,
    #[serde(default)]
    pub search: SearchDoc,
    /// The links between the plan's nodes as the plan assumed them, measured or declared; set
    /// by planners that know (the coordinator), absent otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network: Option<PlanNetwork>,
    /// Some of the plan's GPUs are emulated on CPU (a node's `emulate:`): a test or demo
    /// cluster, said so wherever the plan goes. Absent when none is.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub emulated: bool,
}

/// A model spec a reader cannot read (fields a newer writer added) reads as absent: readers
/// ignore what they do not know, and no Rust reader of a plan needs the model.
fn model_spec_if_known<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<ModelSpec>, D::Error> {
    let v = Option::<serde_json::Value>::deserialize(d)?;
    Ok(v.and_then(|v| serde_json::from_value(v).ok()))
}

/// Where one GPU sits in a plan's parallelism.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RankPlacement {
    pub rank: u32,
    pub replica: u32,
    pub stage: u32,
    pub tp_rank: u32,
    pub tp_size: u32,
    /// The TP group's position among the stage's `dp` groups.
    pub stage_dp_rank: u32,
    pub stage_dp_size: u32,
    pub pp_size: u32,
    pub replicas: u32,
    pub layers: [u32; 2],
}

impl PlanDocument {
    /// The JSON schema of the document, generated from these types: `docs/plan.schema.json`
    /// holds it, and the rank library's reader is tested against that file.
    pub fn json_schema() -> serde_json::Value {
        serde_json::to_value(schemars::schema_for!(PlanDocument)).expect("a schema is JSON")
    }

    pub fn from_json(text: &str) -> Result<PlanDocument, serde_json::Error> {
        serde_json::from_str(text)
    }

    /// Every GPU of the plan in rank order with its placement.
    pub fn placements(&self) -> Vec<(GpuRef, RankPlacement)> {
        let mut out = vec![];
        let replicas = self.replicas.len() as u32;
        for (ri, r) in self.replicas.iter().enumerate() {
            for (si, s) in r.stages.iter().enumerate() {
                let tp = s.tp.max(1);
                for (position, g) in s.gpus.iter().enumerate() {
                    let position = position as u32;
                    let p = RankPlacement {
                        rank: out.len() as u32,
                        replica: ri as u32,
                        stage: si as u32,
                        tp_rank: position % tp,
                        tp_size: tp,
                        stage_dp_rank: position / tp,
                        stage_dp_size: s.dp,
                        pp_size: r.stages.len() as u32,
                        replicas,
                        layers: s.layers,
                    };
                    out.push((g.clone(), p));
                }
            }
        }
        out
    }

    /// The placement of `node`'s GPU `index`, if the plan uses it.
    pub fn placement_of(&self, node: &str, index: u32) -> Option<RankPlacement> {
        self.placements().into_iter().find(|(g, _)| g.node == node && g.index == index).map(|(_, p)| p)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpu(node: &str, index: u32) -> GpuRef {
        GpuRef { node: node.into(), index }
    }

    #[test]
    fn ranks_run_replica_stage_gpu_with_tp_fastest() {
        let stage = |layers, tp, dp, gpus| StageDoc { layers, gpu: "A100".into(), tp, dp, gpus, ..Default::default() };
        let plan = PlanDocument {
            global_batch: 8,
            micro_batch: 2,
            seq_len: Some(16),
            model: "m".into(),
            replicas: vec![
                ReplicaDoc {
                    samples: Some(4),
                    micro_batches: 2,
                    stages: vec![
                        stage([0, 2], 2, 2, vec![gpu("a", 0), gpu("a", 1), gpu("a", 2), gpu("a", 3)]),
                        stage([2, 4], 1, 1, vec![gpu("b", 0)]),
                    ],
                    ..Default::default()
                },
                ReplicaDoc {
                    samples: Some(4),
                    micro_batches: 2,
                    stages: vec![stage([0, 4], 1, 1, vec![gpu("c", 5)])],
                    ..Default::default()
                },
            ],
            ..Default::default()
        };
        let all = plan.placements();
        assert_eq!(all.len(), 6);
        let a2 = plan.placement_of("a", 2).unwrap();
        assert_eq!((a2.rank, a2.tp_rank, a2.stage_dp_rank, a2.stage_dp_size, a2.pp_size), (2, 0, 1, 2, 2));
        let b0 = plan.placement_of("b", 0).unwrap();
        assert_eq!((b0.rank, b0.stage, b0.layers, b0.replicas), (4, 1, [2, 4], 2));
        assert_eq!(plan.placement_of("c", 5).unwrap().rank, 5);
        assert_eq!(plan.placement_of("c", 0), None, "a GPU the plan does not use has no placement");
    }

    /// The committed schema is the one these types make: change a type, and this fails until
    /// `MOTLEY_WRITE_SCHEMA=1 cargo test -p motley-contract plan_schema` rewrites the file (then
    /// the rank library's test reads the new one).
    #[test]
    fn plan_schema_file_is_the_one_the_types_make() {
        // The checkout's path as cargo gives it when the test runs (a test binary built in
        // another checkout and moved keeps its build-time path).
        let dir = std::env::var("CARGO_MANIFEST_DIR").unwrap_or_else(|_| env!("CARGO_MANIFEST_DIR").to_string());
        let path = std::path::Path::new(&dir).join("../docs/plan.schema.json");
        let made = serde_json::to_string_pretty(&PlanDocument::json_schema()).unwrap() + "\n";
        if std::env::var_os("MOTLEY_WRITE_SCHEMA").is_some() {
            std::fs::write(&path, &made).unwrap();
        }
        let committed = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        assert!(
            committed == made,
            "docs/plan.schema.json is not the schema of PlanDocument's types; rewrite it with MOTLEY_WRITE_SCHEMA=1 cargo test -p motley-contract plan_schema"
        );
    }

    #[test]
    fn readers_ignore_fields_they_do_not_know_and_name_missing_ones() {
        let doc = r#"{"global_batch": 2, "micro_batch": 1, "seq_len": 8, "model": "m", "new_field": [1],
            "replicas": [{"samples": 2, "micro_batches": 2, "iteration_time_s": 1.0,
              "stages": [{"layers": [0, 2], "gpu": "V100", "tp": 1, "dp": 1, "gpus": [{"node": "n", "index": 0}]}]}]}"#;
        let plan = PlanDocument::from_json(doc).unwrap();
        assert!(plan.comm_groups.is_empty() && plan.model_spec.is_none());
        let err = PlanDocument::from_json(r#"{"global_batch": 2}"#).unwrap_err().to_string();
        assert!(err.contains("micro_batch"), "{err}");
    }
}
