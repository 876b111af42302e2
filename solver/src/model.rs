//! Transformer models: the catalog, the file format, and the derived sizes the cost model uses.

use serde::{Deserialize, Serialize};

use crate::error::{Result, SolverError};
use crate::limits::{self, MAX_LAYERS, MAX_SEQ_LEN};

/// A decoder (or encoder) stack of identical transformer layers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSpec {
    pub name: String,
    pub layers: u32,
    pub hidden: u64,
    pub heads: u32,
    pub seq_len: u64,
    pub vocab: u64,
    /// Default 4 * hidden.
    #[serde(default)]
    pub ffn_hidden: Option<u64>,
    /// Default `heads` (no grouped-query attention).
    #[serde(default)]
    pub kv_heads: Option<u32>,
    /// SwiGLU-style MLP with three matrices (LLaMA); default false (GPT: two matrices).
    #[serde(default)]
    pub gated_mlp: bool,
}

pub fn model_catalog() -> Vec<ModelSpec> {
    let m = |name: &str, layers, hidden, heads, seq_len, vocab, ffn: Option<u64>, kv: Option<u32>, gated| ModelSpec {
        name: name.into(),
        layers,
        hidden,
        heads,
        seq_len,
        vocab,
        ffn_hidden: ffn,
        kv_heads: kv,
        gated_mlp: gated,
    };
    vec![
        m("bert-large", 24, 1024, 16, 512, 30522, None, None, false),
        m("gpt3-1.3b", 24, 2048, 16, 2048, 51200, None, None, false),
        m("gpt3-2.7b", 32, 2560, 32, 2048, 51200, None, None, false),
        m("gpt3-6.7b", 32, 4096, 32, 2048, 51200, None, None, false),
        m("gpt3-13b", 40, 5120, 40, 2048, 51200, None, None, false),
        m("gpt3-20b", 44, 6144, 64, 2048, 51200, None, None, false),
        m("llama-3b", 26, 3200, 32, 2048, 32000, Some(8640), None, true),
        m("llama-7b", 32, 4096, 32, 2048, 32000, Some(11008), None, true),
        m("llama-13b", 40, 5120, 40, 2048, 32000, Some(13824), None, true),
        m("llama-70b", 80, 8192, 64, 4096, 32000, Some(28672), Some(8), true),
    ]
}

pub fn model_by_name(name: &str) -> Option<ModelSpec> {
    model_catalog().into_iter().find(|m| m.name.eq_ignore_ascii_case(name))
}

/// A validated model with the sizes the cost model needs.
#[derive(Debug, Clone, PartialEq)]
pub struct Model {
    pub spec: ModelSpec,
    pub seq_len: u64,
    /// Parameters of one transformer layer.
    pub layer_params: f64,
    /// Input embedding (first stage) and output head (last stage) parameters each.
    pub embed_params: f64,
    /// Forward FLOPs of one layer for one sequence.
    pub layer_fwd_flops: f64,
    /// Forward FLOPs of the output head for one sequence.
    pub head_fwd_flops: f64,
}

impl Model {
    pub fn new(spec: ModelSpec, seq_len_override: Option<u64>) -> Result<Model> {
        let nz = |field: &str, v: u64| -> Result<()> {
            if v == 0 {
                Err(SolverError::invalid(field, "must be a positive integer"))
            } else {
                Ok(())
            }
        };
        nz("layers", spec.layers as u64)?;
        nz("hidden", spec.hidden)?;
        nz("heads", spec.heads as u64)?;
        nz("seq_len", seq_len_override.unwrap_or(spec.seq_len))?;
        nz("vocab", spec.vocab)?;
        // Before any size is derived: layers drive the search's layer splits.
        limits::at_most("layers", spec.layers as u64, MAX_LAYERS as u64, "transformer layers a model may have")?;
        limits::at_most("seq_len", seq_len_override.unwrap_or(spec.seq_len), MAX_SEQ_LEN, "tokens a sequence may have")?;
        if !spec.hidden.is_multiple_of(spec.heads as u64) {
            return Err(SolverError::invalid("hidden", format!("{} is not divisible by heads ({})", spec.hidden, spec.heads)));
        }
        let kv = spec.kv_heads.unwrap_or(spec.heads);
        if kv == 0 || !spec.heads.is_multiple_of(kv) {
            return Err(SolverError::invalid("kv_heads", format!("must divide heads ({}); got {kv}", spec.heads)));
        }
        let ffn = spec.ffn_hidden.unwrap_or(4 * spec.hidden);
        nz("ffn_hidden", ffn)?;
        let h = spec.hidden as f64;
        let kv_dim = h * kv as f64 / spec.heads as f64;
        let attn = 2.0 * h * h + 2.0 * h * kv_dim;
        let mlp = if spec.gated_mlp { 3.0 } else { 2.0 } * h * ffn as f64;
        let s = seq_len_override.unwrap_or(spec.seq_len) as f64;
        let matmul = attn + mlp;
        Ok(Model {
            seq_len: s as u64,
            layer_params: matmul + 4.0 * h,
            embed_params: spec.vocab as f64 * h,
            // 2 FLOPs per multiply-add over all weights, plus QK^T and AV (2 * 2 * s^2 * h).
            layer_fwd_flops: 2.0 * matmul * s + 4.0 * s * s * h,
            head_fwd_flops: 2.0 * s * h * spec.vocab as f64,
            spec,
        })
    }

    pub fn layers(&self) -> u32 {
        self.spec.layers
    }

    pub fn hidden(&self) -> f64 {
        self.spec.hidden as f64
    }

    /// Total parameters (embedding and head counted separately, as with pipeline parallelism).
    pub fn total_params(&self) -> f64 {
        self.layer_params * self.spec.layers as f64 + 2.0 * self.embed_params
    }
}
