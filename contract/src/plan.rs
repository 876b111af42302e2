//! The plan document. Rank numbering is part of it: replicas in order, stages in order, each
//! stage's `gpus` in order (TP fastest), so every party derives the same global rank of a GPU
//! from the document alone.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// A GPU: a node name and the GPU's index on it (NVML's, PCI order).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct GpuRef {
    pub node: String,
    pub index: u32,
}

/// The model the plan was made for (the fields of a model file, `examples/tiny-gpt.yaml`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelDoc {
    pub name: String,
    pub layers: u32,
    pub hidden: u64,
    pub heads: u32,
    pub seq_len: u64,
    pub vocab: u64,
    #[serde(default)]
    pub ffn_hidden: Option<u64>,
    #[serde(default)]
    pub kv_heads: Option<u32>,
    #[serde(default)]
    pub gated_mlp: bool,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StageDoc {
    /// Half-open range of transformer layers.
    pub layers: [u32; 2],
    /// GPU type.
    pub gpu: String,
    pub tp: u32,
    pub dp: u32,
    /// TP group by TP group (dp-major).
    pub gpus: Vec<GpuRef>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ReplicaDoc {
    /// `micro_batches * micro_batch`: this replica's share of the global batch.
    pub samples: u32,
    pub micro_batches: u32,
    pub stages: Vec<StageDoc>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum GroupKind {
    Tp,
    Pp,
    Dp,
}

/// One communicator of the plan (solver/src/network.rs says how ranks use it).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CommGroupDoc {
    pub kind: GroupKind,
    pub gpus: Vec<GpuRef>,
    /// nvlink, pcie, ib, roce or socket.
    pub transport: String,
    #[serde(default)]
    pub nics: Vec<String>,
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Per node, settings applied on top of `env` there.
    #[serde(default)]
    pub node_env: BTreeMap<String, BTreeMap<String, String>>,
    pub nccl_net: Option<String>,
    pub replica: Option<u32>,
    pub stage: Option<u32>,
    pub layers: [u32; 2],
}

/// The plan document: the fields every reader needs, the ranks' included. The solver's report
/// has more (prices, baselines, search statistics); readers that want them read the JSON
/// themselves.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PlanDocument {
    pub global_batch: u32,
    pub micro_batch: u32,
    pub seq_len: u64,
    /// The model's name.
    pub model: String,
    /// The whole model, for ranks that build it (absent in documents from before it was added).
    #[serde(default)]
    pub model_spec: Option<ModelDoc>,
    pub replicas: Vec<ReplicaDoc>,
    #[serde(default)]
    pub comm_groups: Vec<CommGroupDoc>,
    /// What the plan was priced in and ranks should compute in: "bf16", "fp16" or "fp32"
    /// (`--precision`, `auto` resolved; absent in documents from before it was added).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub precision: Option<String>,
    /// How the ranks run as the plan was priced, read by the rank library too
    /// (`motley_torch.plan`): full activation recomputation (`--recompute`), activations as
    /// compiled blocks save them (the default; not `--eager`), optimizer state sharded over each
    /// stage's data-parallel ring (`--zero1`). False in documents from before they were added.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub recompute: bool,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub compiled: bool,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub zero1: bool,
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
        let stage = |layers, tp, dp, gpus| StageDoc { layers, gpu: "A100".into(), tp, dp, gpus };
        let plan = PlanDocument {
            global_batch: 8,
            micro_batch: 2,
            seq_len: 16,
            model: "m".into(),
            model_spec: None,
            replicas: vec![
                ReplicaDoc {
                    samples: 4,
                    micro_batches: 2,
                    stages: vec![
                        stage([0, 2], 2, 2, vec![gpu("a", 0), gpu("a", 1), gpu("a", 2), gpu("a", 3)]),
                        stage([2, 4], 1, 1, vec![gpu("b", 0)]),
                    ],
                },
                ReplicaDoc { samples: 4, micro_batches: 2, stages: vec![stage([0, 4], 1, 1, vec![gpu("c", 5)])] },
            ],
            comm_groups: vec![],
            precision: None,
            recompute: false,
            compiled: false,
            zero1: false,
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
