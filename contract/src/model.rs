//! The model spec: the fields of a model file (`examples/tiny-gpt.yaml`), of a job's `model:`,
//! and of the plan document's `model_spec`, which ranks build the model from. The sizes the
//! planner derives from it are the solver's (`motley_solver::model::Model`).

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// What a layer computes: GPT (LayerNorm, biases everywhere, learned positions) or LLaMA
/// (RMSNorm, no biases, rotary positions, SwiGLU).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Family {
    #[default]
    Gpt,
    Llama,
}

impl Family {
    pub fn as_str(self) -> &'static str {
        match self {
            Family::Gpt => "gpt",
            Family::Llama => "llama",
        }
    }
}

/// Rotary position scaling (LLaMA family only): `{type: linear, factor}` or Llama 3.1's
/// `{type: llama3, factor, low_freq_factor, high_freq_factor, original_max_position_embeddings}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(tag = "type", rename_all = "lowercase", deny_unknown_fields)]
pub enum RopeScaling {
    Linear { factor: f64 },
    Llama3 { factor: f64, low_freq_factor: f64, high_freq_factor: f64, original_max_position_embeddings: u64 },
}

fn default_norm_eps() -> f64 {
    1e-5
}

fn default_rope_theta() -> f64 {
    10000.0
}

/// A decoder (or encoder) stack of identical transformer layers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ModelSpec {
    pub name: String,
    /// gpt (default) or llama.
    #[serde(default)]
    pub family: Family,
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
    /// The epsilon of the layer norms (LayerNorm for gpt, RMSNorm for llama); default 1e-5.
    #[serde(default = "default_norm_eps")]
    pub norm_eps: f64,
    /// The rotary base (llama); default 10000.
    #[serde(default = "default_rope_theta")]
    pub rope_theta: f64,
    /// Rotary position scaling (llama only); default none.
    #[serde(default)]
    pub rope_scaling: Option<RopeScaling>,
    /// Biases on the q, k and v projections only (llama family, as Qwen2); default false.
    #[serde(default)]
    pub qkv_bias: bool,
    /// A bias on the attention output projection (llama family; Llama's `attention_bias` sets
    /// it and `qkv_bias`); default false.
    #[serde(default)]
    pub o_bias: bool,
    /// The output head shares the token embedding's matrix; default false.
    #[serde(default)]
    pub tie_embeddings: bool,
    /// The model's attention window (tokens); Motley trains full causal attention only, so a
    /// sequence longer than the window is refused. Default none.
    #[serde(default)]
    pub sliding_window: Option<u64>,
    /// The longest sequence the model's positions were made for (a Hugging Face config's
    /// `max_position_embeddings`): an upper bound on `seq_len`, not the length trained at.
    /// Default none (no bound besides the planner's limit).
    #[serde(default)]
    pub max_position_embeddings: Option<u64>,
}

impl ModelSpec {
    /// A GPT-family spec with every optional field at its default.
    pub fn gpt(name: &str, layers: u32, hidden: u64, heads: u32, seq_len: u64, vocab: u64) -> ModelSpec {
        ModelSpec {
            name: name.into(),
            family: Family::Gpt,
            layers,
            hidden,
            heads,
            seq_len,
            vocab,
            ffn_hidden: None,
            kv_heads: None,
            gated_mlp: false,
            norm_eps: default_norm_eps(),
            rope_theta: default_rope_theta(),
            rope_scaling: None,
            qkv_bias: false,
            o_bias: false,
            tie_embeddings: false,
            sliding_window: None,
            max_position_embeddings: None,
        }
    }

    /// The spec with the defaults the planner applies written out (`ffn_hidden`, `kv_heads`).
    pub fn resolved(&self) -> ModelSpec {
        ModelSpec {
            ffn_hidden: Some(self.ffn_hidden.unwrap_or(4 * self.hidden)),
            kv_heads: Some(self.kv_heads.unwrap_or(self.heads)),
            ..self.clone()
        }
    }
}
