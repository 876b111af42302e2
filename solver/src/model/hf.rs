//! Hugging Face `config.json` to a model spec (pure: the caller reads the file). Errors name
//! the config's field; the caller adds the file's name.

use serde_json::Value;

use super::{Family, ModelSpec, RopeScaling};
use crate::error::{Result, SolverError};

/// The `architectures` Motley reads: decoders that are a LLaMA layer with options.
pub const SUPPORTED_ARCHITECTURES: [&str; 3] = ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"];

/// The sequence length a Hugging Face model is trained at when nothing says otherwise (a job's
/// `seq_len`, `--seq-len`): at most this, and at most the config's `max_position_embeddings`
/// (and sliding window). A config says how long a sequence the model can take (Llama 3.1:
/// 131072), not how long the sequences it is fine-tuned on are; planning at the maximum asks for
/// activations no GPU holds.
pub const DEFAULT_SEQ_LEN: u64 = 4096;

/// The rotary scalings Motley reads (`rope_type`).
const SUPPORTED_ROPE_TYPES: &str = "default, linear, llama3";

fn present<'a>(c: &'a Value, field: &str) -> Option<&'a Value> {
    c.get(field).filter(|v| !v.is_null())
}

fn uint(c: &Value, field: &str) -> Result<Option<u64>> {
    match present(c, field) {
        None => Ok(None),
        Some(v) => match v.as_u64() {
            Some(n) if n > 0 => Ok(Some(n)),
            _ => Err(SolverError::invalid(field, format!("must be a positive integer; got {v}"))),
        },
    }
}

fn required_uint(c: &Value, field: &str) -> Result<u64> {
    uint(c, field)?.ok_or_else(|| SolverError::invalid(field, "missing; a Hugging Face model config has it (add it)"))
}

fn small(field: &str, n: u64) -> Result<u32> {
    u32::try_from(n).map_err(|_| SolverError::invalid(field, format!("{n} is too large")))
}

fn number(c: &Value, field: &str, name: &str) -> Result<Option<f64>> {
    match present(c, field) {
        None => Ok(None),
        Some(v) => v.as_f64().map(Some).ok_or_else(|| SolverError::invalid(name, format!("must be a number; got {v}"))),
    }
}

fn flag(c: &Value, field: &str) -> Result<bool> {
    match present(c, field) {
        None => Ok(false),
        Some(v) => v.as_bool().ok_or_else(|| SolverError::invalid(field, format!("must be true or false; got {v}"))),
    }
}

/// The model spec of a Hugging Face `config.json` (parsed), named `name` (the model
/// directory's base name).
pub fn spec_from_config(c: &Value, name: &str) -> Result<ModelSpec> {
    if !c.is_object() {
        return Err(SolverError::invalid("config", "is not a JSON object; give a Hugging Face model's config.json"));
    }
    let supported = SUPPORTED_ARCHITECTURES.join(", ");
    let arch = match present(c, "architectures").and_then(|a| a.get(0)).and_then(Value::as_str) {
        Some(a) if SUPPORTED_ARCHITECTURES.contains(&a) => a,
        Some(a) => {
            return Err(SolverError::invalid(
                "architectures",
                format!("'{a}' is not supported; Motley reads {supported} (or describe the model in a model YAML)"),
            ))
        }
        None => {
            return Err(SolverError::invalid(
                "architectures",
                format!("missing; Motley reads {supported} configs (or describe the model in a model YAML)"),
            ))
        }
    };
    if let Some(act) = present(c, "hidden_act") {
        if act.as_str() != Some("silu") {
            return Err(SolverError::invalid("hidden_act", format!("{act} is not supported; Motley's llama layer is SwiGLU (silu)")));
        }
    }
    if flag(c, "mlp_bias")? {
        return Err(SolverError::invalid("mlp_bias", "true is not supported; Motley's llama layer has no MLP biases"));
    }
    let layers = small("num_hidden_layers", required_uint(c, "num_hidden_layers")?)?;
    let hidden = required_uint(c, "hidden_size")?;
    let heads = small("num_attention_heads", required_uint(c, "num_attention_heads")?)?;
    let kv_heads = match uint(c, "num_key_value_heads")? {
        Some(k) => small("num_key_value_heads", k)?,
        None => heads,
    };
    if let Some(hd) = present(c, "head_dim") {
        if !hidden.is_multiple_of(heads as u64) || hd.as_u64() != Some(hidden / heads as u64) {
            return Err(SolverError::invalid(
                "head_dim",
                format!("{hd} is not hidden_size / num_attention_heads ({hidden} / {heads}); Motley's layer has heads of hidden / heads"),
            ));
        }
    }
    let ffn = required_uint(c, "intermediate_size")?;
    let vocab = required_uint(c, "vocab_size")?;
    let max_pos = required_uint(c, "max_position_embeddings")?;
    let norm_eps = number(c, "rms_norm_eps", "rms_norm_eps")?.unwrap_or(1e-6);
    let params = present(c, "rope_parameters");
    let rope_theta = match number(c, "rope_theta", "rope_theta")? {
        Some(t) => t,
        None => match params {
            Some(p) => number(p, "rope_theta", "rope_parameters.rope_theta")?.unwrap_or(1e4),
            None => 1e4,
        },
    };
    let scaling = match (present(c, "rope_scaling"), params) {
        (Some(s), _) => Some(("rope_scaling", s)),
        (None, Some(p)) => Some(("rope_parameters", p)),
        (None, None) => None,
    };
    let rope_scaling = match scaling {
        None => None,
        Some((src, s)) => rope(src, s)?,
    };
    // Llama's attention_bias biases q, k, v and o alike (transformers' modeling_llama.py);
    // Qwen2 biases q, k and v always and o never (modeling_qwen2.py); Mistral's attention has no
    // bias whatever its config says (modeling_mistral.py).
    let attention_bias = arch == "LlamaForCausalLM" && flag(c, "attention_bias")?;
    let qkv_bias = arch == "Qwen2ForCausalLM" || attention_bias;
    let sliding_window = match arch {
        "MistralForCausalLM" => uint(c, "sliding_window")?,
        "Qwen2ForCausalLM" if flag(c, "use_sliding_window")? => uint(c, "sliding_window")?,
        _ => None,
    };
    Ok(ModelSpec {
        name: name.to_string(),
        family: Family::Llama,
        layers,
        hidden,
        heads,
        seq_len: default_seq_len(max_pos, sliding_window),
        vocab,
        ffn_hidden: Some(ffn),
        kv_heads: Some(kv_heads),
        gated_mlp: true,
        norm_eps,
        rope_theta,
        rope_scaling,
        qkv_bias,
        o_bias: attention_bias,
        tie_embeddings: flag(c, "tie_word_embeddings")?,
        sliding_window,
        max_position_embeddings: Some(max_pos),
    })
}

/// How [`default_seq_len`] came to its answer, for people: `the smaller of its
/// max_position_embeddings (131072) and 4096`.
pub fn default_seq_len_reason(max_position_embeddings: u64, sliding_window: Option<u64>) -> String {
    match sliding_window {
        Some(w) => format!(
            "the smaller of its max_position_embeddings ({max_position_embeddings}), its sliding window ({w}) and {DEFAULT_SEQ_LEN}"
        ),
        None => format!("the smaller of its max_position_embeddings ({max_position_embeddings}) and {DEFAULT_SEQ_LEN}"),
    }
}

/// The training sequence length of a Hugging Face model no one gave one: the smaller of
/// [`DEFAULT_SEQ_LEN`], its `max_position_embeddings` and its attention window.
pub fn default_seq_len(max_position_embeddings: u64, sliding_window: Option<u64>) -> u64 {
    DEFAULT_SEQ_LEN.min(max_position_embeddings).min(sliding_window.unwrap_or(u64::MAX))
}

/// `rope_scaling` (older configs) or `rope_parameters` (transformers 5), named `src`.
fn rope(src: &str, s: &Value) -> Result<Option<RopeScaling>> {
    if !s.is_object() {
        return Err(SolverError::invalid(src, format!("must be an object; got {s}")));
    }
    let (key, kind) = match (present(s, "rope_type"), present(s, "type")) {
        (Some(t), _) => ("rope_type", t),
        (None, Some(t)) => ("type", t),
        (None, None) => return Ok(None),
    };
    let need = |field: &str| -> Result<f64> {
        let name = format!("{src}.{field}");
        number(s, field, &name)?.ok_or_else(|| SolverError::invalid(&name, "missing; this rope type needs it"))
    };
    match kind.as_str() {
        Some("default") => Ok(None),
        Some("linear") => Ok(Some(RopeScaling::Linear { factor: need("factor")? })),
        Some("llama3") => {
            let orig = format!("{src}.original_max_position_embeddings");
            let original_max_position_embeddings = match present(s, "original_max_position_embeddings") {
                None => return Err(SolverError::invalid(&orig, "missing; this rope type needs it")),
                Some(v) => v.as_u64().ok_or_else(|| SolverError::invalid(&orig, format!("must be a positive integer; got {v}")))?,
            };
            Ok(Some(RopeScaling::Llama3 {
                factor: need("factor")?,
                low_freq_factor: need("low_freq_factor")?,
                high_freq_factor: need("high_freq_factor")?,
                original_max_position_embeddings,
            }))
        }
        _ => Err(SolverError::invalid(format!("{src}.{key}"), format!("{kind} is not supported; Motley reads {SUPPORTED_ROPE_TYPES}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Model;
    use serde_json::json;

    fn field(c: Value) -> String {
        match spec_from_config(&c, "m").expect_err("refused") {
            SolverError::InvalidInput { field, .. } => field,
            other => panic!("{other}"),
        }
    }

    /// Llama 3.1 8B's config.json (transformers 4: top-level `rope_theta`, `rope_scaling`).
    fn llama31() -> Value {
        json!({
            "architectures": ["LlamaForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
            "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096,
            "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 131072,
            "mlp_bias": false, "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32,
            "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
            "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 8192, "rope_type": "llama3"},
            "rope_theta": 500000.0, "tie_word_embeddings": false, "torch_dtype": "bfloat16",
            "transformers_version": "4.43.0.dev0", "use_cache": true, "vocab_size": 128256
        })
    }

    #[test]
    fn llama_with_the_old_spelling() {
        let s = spec_from_config(&llama31(), "Llama-3.1-8B").unwrap();
        assert_eq!(s.name, "Llama-3.1-8B");
        assert_eq!(
            (s.family, s.layers, s.hidden, s.heads, s.kv_heads, s.ffn_hidden, s.vocab, s.seq_len, s.gated_mlp),
            (Family::Llama, 32, 4096, 32, Some(8), Some(14336), 128256, DEFAULT_SEQ_LEN, true)
        );
        // 131072 is how long a sequence the model takes, not how long it is trained on.
        assert_eq!((s.seq_len, s.max_position_embeddings), (4096, Some(131072)));
        assert_eq!((s.norm_eps, s.rope_theta, s.qkv_bias, s.tie_embeddings, s.sliding_window), (1e-5, 5e5, false, false, None));
        assert_eq!(
            s.rope_scaling,
            Some(RopeScaling::Llama3 { factor: 8.0, low_freq_factor: 1.0, high_freq_factor: 4.0, original_max_position_embeddings: 8192 })
        );
        assert_eq!(Model::new(s.clone(), None).unwrap().seq_len, 4096);
        assert_eq!(Model::new(s.clone(), Some(131072)).unwrap().seq_len, 131072, "the maximum, when asked for");
        assert_eq!(Model::new(s, Some(131073)).unwrap_err().to_string().split(':').next(), Some("seq_len"));
        // A model made for shorter sequences than the default is trained at its maximum.
        let mut short = llama31();
        short["max_position_embeddings"] = json!(2048);
        assert_eq!(spec_from_config(&short, "m").unwrap().seq_len, 2048);
        // Defaults: kv heads = heads, rms_norm_eps 1e-6, rope_theta 10000, no scaling, untied.
        let mut bare = llama31();
        for k in
            ["num_key_value_heads", "rms_norm_eps", "rope_theta", "rope_scaling", "tie_word_embeddings", "attention_bias", "hidden_act"]
        {
            bare.as_object_mut().unwrap().remove(k);
        }
        let s = spec_from_config(&bare, "m").unwrap();
        assert_eq!((s.kv_heads, s.norm_eps, s.rope_theta, s.rope_scaling, s.tie_embeddings), (Some(32), 1e-6, 1e4, None, false));
        bare["rope_scaling"] = json!({"type": "linear", "factor": 2});
        bare["tie_word_embeddings"] = json!(true);
        bare["attention_bias"] = json!(true);
        let s = spec_from_config(&bare, "m").unwrap();
        assert_eq!((s.rope_scaling, s.tie_embeddings, s.qkv_bias), (Some(RopeScaling::Linear { factor: 2.0 }), true, true));
        assert!(s.o_bias, "Llama's attention_bias biases o too");
        bare["rope_scaling"] = json!({"rope_type": "default"});
        assert_eq!(spec_from_config(&bare, "m").unwrap().rope_scaling, None);
    }

    #[test]
    fn llama_attention_bias_is_q_k_v_and_o_biases_and_only_llama_has_it() {
        let plain = spec_from_config(&llama31(), "m").unwrap();
        assert_eq!((plain.qkv_bias, plain.o_bias), (false, false));
        let mut c = llama31();
        c["attention_bias"] = json!(true);
        let s = spec_from_config(&c, "m").unwrap();
        assert_eq!((s.qkv_bias, s.o_bias), (true, true));
        // Per layer: q (hidden), k and v (1024 each: 8 of 32 heads), o (hidden).
        let per_layer = Model::new(s.clone(), None).unwrap().layer_params - Model::new(plain, None).unwrap().layer_params;
        assert_eq!(per_layer, 4096.0 + 2.0 * 1024.0 + 4096.0);
        // What a plan made from such a directory says (its model_spec): o_bias with the rest.
        let json = serde_json::to_value(&s).unwrap();
        assert_eq!((json["qkv_bias"].as_bool(), json["o_bias"].as_bool()), (Some(true), Some(true)));
        // Mistral's attention has no bias, whatever its config says.
        c["architectures"] = json!(["MistralForCausalLM"]);
        let m = spec_from_config(&c, "m").unwrap();
        assert_eq!((m.qkv_bias, m.o_bias), (false, false));
    }

    #[test]
    fn llama_with_transformers_5_rope_parameters() {
        let mut c = llama31();
        let o = c.as_object_mut().unwrap();
        o.remove("rope_theta");
        o.remove("rope_scaling");
        o.insert(
            "rope_parameters".into(),
            json!({"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
        );
        let s = spec_from_config(&c, "m").unwrap();
        assert_eq!(s.rope_theta, 5e5);
        assert_eq!(
            s.rope_scaling,
            Some(RopeScaling::Llama3 { factor: 32.0, low_freq_factor: 1.0, high_freq_factor: 4.0, original_max_position_embeddings: 8192 })
        );
        c["rope_parameters"] = json!({"rope_type": "default", "rope_theta": 1000000.0});
        let s = spec_from_config(&c, "m").unwrap();
        assert_eq!((s.rope_theta, s.rope_scaling), (1e6, None));
        c["rope_parameters"] = json!({"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4});
        let e = spec_from_config(&c, "m").unwrap_err().to_string();
        assert!(e.starts_with("rope_parameters.rope_type: ") && e.contains("linear, llama3"), "{e}");
        c["rope_parameters"] =
            json!({"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192});
        assert_eq!(field(c.clone()), "rope_parameters.low_freq_factor");
        let mut old = llama31();
        old["rope_scaling"] = json!({"type": "dynamic", "factor": 2.0});
        assert_eq!(field(old), "rope_scaling.type");
    }

    #[test]
    fn mistral_keeps_its_window_as_the_sequence_length() {
        let c = json!({
            "architectures": ["MistralForCausalLM"], "hidden_act": "silu", "hidden_size": 4096,
            "intermediate_size": 14336, "max_position_embeddings": 32768, "num_attention_heads": 32,
            "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 10000.0,
            "sliding_window": 4096, "tie_word_embeddings": false, "vocab_size": 32000
        });
        let s = spec_from_config(&c, "Mistral-7B-v0.1").unwrap();
        assert_eq!((s.sliding_window, s.seq_len, s.qkv_bias), (Some(4096), 4096, false));
        let m = Model::new(s.clone(), None).unwrap();
        assert_eq!(m.seq_len, 4096);
        assert!(Model::new(s, Some(8192)).unwrap_err().to_string().starts_with("sliding_window: "));
        let mut no_window = c.clone();
        no_window["sliding_window"] = Value::Null;
        let s = spec_from_config(&no_window, "m").unwrap();
        assert_eq!((s.sliding_window, s.seq_len, s.max_position_embeddings), (None, DEFAULT_SEQ_LEN, Some(32768)));
    }

    #[test]
    fn qwen2_has_qkv_biases_and_a_window_only_when_used() {
        let c = json!({
            "architectures": ["Qwen2ForCausalLM"], "hidden_act": "silu", "hidden_size": 896,
            "intermediate_size": 4864, "max_position_embeddings": 32768, "max_window_layers": 24,
            "num_attention_heads": 14, "num_hidden_layers": 24, "num_key_value_heads": 2, "rms_norm_eps": 1e-06,
            "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": true,
            "use_sliding_window": false, "vocab_size": 151936
        });
        let s = spec_from_config(&c, "Qwen2.5-0.5B").unwrap();
        assert_eq!((s.qkv_bias, s.tie_embeddings, s.sliding_window, s.seq_len, s.kv_heads), (true, true, None, DEFAULT_SEQ_LEN, Some(2)));
        assert!(!s.o_bias, "Qwen2's o_proj has no bias");
        let m = Model::new(s, None).unwrap();
        // Qwen2.5-0.5B's published count: 494,032,768 parameters (tied head once).
        assert_eq!(m.total_params(), 494_032_768.0);
        let mut windowed = c.clone();
        windowed["use_sliding_window"] = json!(true);
        windowed["sliding_window"] = json!(1024);
        let s = spec_from_config(&windowed, "m").unwrap();
        assert_eq!((s.sliding_window, s.seq_len), (Some(1024), 1024), "a window shorter than the default caps it");
    }

    #[test]
    fn unsupported_configs_are_refused_naming_the_field() {
        let e = spec_from_config(&json!({"architectures": ["GPT2LMHeadModel"], "n_layer": 12}), "gpt2").unwrap_err().to_string();
        assert!(
            e.starts_with("architectures: 'GPT2LMHeadModel'") && e.contains("LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM"),
            "{e}"
        );
        assert_eq!(field(json!({"hidden_size": 8})), "architectures");
        assert_eq!(field(json!([1])), "config");
        let with = |k: &str, v: Value| {
            let mut c = llama31();
            c[k] = v;
            c
        };
        assert_eq!(field(with("mlp_bias", json!(true))), "mlp_bias");
        assert_eq!(field(with("hidden_act", json!("gelu"))), "hidden_act");
        assert_eq!(field(with("head_dim", json!(256))), "head_dim");
        assert_eq!(spec_from_config(&with("head_dim", json!(128)), "m").unwrap().hidden, 4096, "head_dim = hidden / heads is fine");
        assert_eq!(field(with("num_hidden_layers", json!(-1))), "num_hidden_layers");
        assert_eq!(field(with("vocab_size", Value::Null)), "vocab_size");
        assert_eq!(field(with("rope_theta", json!("big"))), "rope_theta");
        assert_eq!(field(with("tie_word_embeddings", json!("yes"))), "tie_word_embeddings");
    }
}
