//! Transformer models: the catalog, the file format, and the derived sizes the cost model uses.

use crate::error::{Result, SolverError};
use crate::limits::{self, MAX_LAYERS, MAX_SEQ_LEN};

pub mod hf;

pub use motley_contract::model::{Family, ModelSpec, RopeScaling};

pub fn model_catalog() -> Vec<ModelSpec> {
    let gpt = |name: &str, layers, hidden, heads, seq_len, vocab| ModelSpec::gpt(name, layers, hidden, heads, seq_len, vocab);
    // LLaMA-family entries as their published configurations declare them.
    #[allow(clippy::too_many_arguments)]
    let llama = |name: &str, layers, hidden, heads, kv: Option<u32>, ffn: u64, vocab, seq_len, rope_theta: f64, norm_eps: f64| ModelSpec {
        family: Family::Llama,
        ffn_hidden: Some(ffn),
        kv_heads: kv,
        gated_mlp: true,
        rope_theta,
        norm_eps,
        ..ModelSpec::gpt(name, layers, hidden, heads, seq_len, vocab)
    };
    vec![
        gpt("bert-large", 24, 1024, 16, 512, 30522),
        gpt("gpt3-1.3b", 24, 2048, 16, 2048, 51200),
        gpt("gpt3-2.7b", 32, 2560, 32, 2048, 51200),
        gpt("gpt3-6.7b", 32, 4096, 32, 2048, 51200),
        gpt("gpt3-13b", 40, 5120, 40, 2048, 51200),
        gpt("gpt3-20b", 44, 6144, 64, 2048, 51200),
        // OpenLLaMA 3B.
        llama("llama-3b", 26, 3200, 32, None, 8640, 32000, 2048, 1e4, 1e-6),
        // LLaMA-1 7B and 13B.
        llama("llama-7b", 32, 4096, 32, None, 11008, 32000, 2048, 1e4, 1e-6),
        llama("llama-13b", 40, 5120, 40, None, 13824, 32000, 2048, 1e4, 1e-6),
        // Llama 2 70B.
        llama("llama-70b", 80, 8192, 64, Some(8), 28672, 32000, 4096, 1e4, 1e-5),
        // Llama 3 8B and 70B.
        llama("llama3-8b", 32, 4096, 32, Some(8), 14336, 128256, 8192, 5e5, 1e-5),
        llama("llama3-70b", 80, 8192, 64, Some(8), 28672, 128256, 8192, 5e5, 1e-5),
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
    /// What the first stage holds besides its layers: the token embedding, and for gpt the
    /// learned position table.
    pub embed_params: f64,
    /// What the last stage holds besides its layers: the final norm and the output head.
    pub head_params: f64,
    /// The matrix the embedding and the head share when they are tied (0 when untied): a
    /// stage holding both holds it once; with a pipeline the first and last stage each hold a
    /// copy (as Megatron-LM does).
    pub tied_params: f64,
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
        validate_family(&spec, seq_len_override.unwrap_or(spec.seq_len))?;
        let h = spec.hidden as f64;
        let v = spec.vocab as f64;
        let kv_dim = h * kv as f64 / spec.heads as f64;
        let attn = 2.0 * h * h + 2.0 * h * kv_dim;
        let mlp = if spec.gated_mlp { 3.0 } else { 2.0 } * h * ffn as f64;
        let s = seq_len_override.unwrap_or(spec.seq_len) as f64;
        let matmul = attn + mlp;
        let table = v * h;
        let (layer_extra, embed_params, final_norm) = match spec.family {
            // Biases on q, k, v, o (and fc1, fc2 when not gated), two LayerNorms (weight and
            // bias); a learned position table of the sequence length; a final LayerNorm.
            Family::Gpt => {
                let mlp_bias = if spec.gated_mlp { 0.0 } else { ffn as f64 + h };
                (2.0 * h + 2.0 * kv_dim + mlp_bias + 4.0 * h, table + s * h, 2.0 * h)
            }
            // Two RMSNorm weights, q/k/v and o biases when the model has them; rotary positions
            // (no table); a final RMSNorm.
            Family::Llama => {
                let qkv_bias = if spec.qkv_bias { h + 2.0 * kv_dim } else { 0.0 };
                let o_bias = if spec.o_bias { h } else { 0.0 };
                (2.0 * h + qkv_bias + o_bias, table, h)
            }
        };
        Ok(Model {
            seq_len: s as u64,
            layer_params: matmul + layer_extra,
            embed_params,
            head_params: final_norm + table,
            tied_params: if spec.tie_embeddings { table } else { 0.0 },
            // 2 FLOPs per multiply-add over all weights, plus QK^T and AV (2 * 2 * s^2 * h).
            layer_fwd_flops: 2.0 * matmul * s + 4.0 * s * s * h,
            head_fwd_flops: 2.0 * s * h * v,
            spec,
        })
    }

    pub fn layers(&self) -> u32 {
        self.spec.layers
    }

    pub fn hidden(&self) -> f64 {
        self.spec.hidden as f64
    }

    /// Parameters a stage holds besides its layers: the embedding when it is the `first`,
    /// the final norm and head when it is the `last`, a tied matrix once when it is both.
    pub fn ends_params(&self, first: bool, last: bool) -> f64 {
        let mut p = 0.0;
        if first {
            p += self.embed_params;
        }
        if last {
            p += self.head_params;
        }
        if first && last {
            p -= self.tied_params;
        }
        p
    }

    /// Total parameters (a tied embedding and head counted once).
    pub fn total_params(&self) -> f64 {
        self.layer_params * self.spec.layers as f64 + self.ends_params(true, true)
    }
}

/// A parameter count for people: `8.03 B`, `494.03 M`, `1.26 M`, `12.29 K`, `96`.
pub fn params_text(params: f64) -> String {
    match params {
        p if p >= 1e9 => format!("{:.2} B", p / 1e9),
        p if p >= 1e6 => format!("{:.2} M", p / 1e6),
        p if p >= 1e3 => format!("{:.2} K", p / 1e3),
        p => format!("{p:.0}"),
    }
}

fn positive(field: &str, v: f64) -> Result<()> {
    if v.is_finite() && v > 0.0 {
        Ok(())
    } else {
        Err(SolverError::invalid(field, format!("must be a positive number; got {v}")))
    }
}

/// The family's own rules and the fields only one family has.
fn validate_family(spec: &ModelSpec, seq_len: u64) -> Result<()> {
    positive("norm_eps", spec.norm_eps)?;
    positive("rope_theta", spec.rope_theta)?;
    match spec.family {
        Family::Gpt => {
            if spec.rope_scaling.is_some() {
                return Err(SolverError::invalid(
                    "rope_scaling",
                    "family gpt has learned positions, not rotary ones; remove rope_scaling or set family: llama",
                ));
            }
            if spec.qkv_bias {
                return Err(SolverError::invalid(
                    "qkv_bias",
                    "family gpt has biases on every projection already; remove qkv_bias (it is for family llama)",
                ));
            }
            if spec.o_bias {
                return Err(SolverError::invalid(
                    "o_bias",
                    "family gpt has biases on every projection already; remove o_bias (it is for family llama)",
                ));
            }
        }
        Family::Llama => {
            if !spec.gated_mlp {
                return Err(SolverError::invalid("gated_mlp", "family llama has a SwiGLU MLP; set gated_mlp: true"));
            }
        }
    }
    match &spec.rope_scaling {
        None => {}
        Some(RopeScaling::Linear { factor }) => positive("rope_scaling.factor", *factor)?,
        Some(RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position_embeddings }) => {
            positive("rope_scaling.factor", *factor)?;
            positive("rope_scaling.low_freq_factor", *low_freq_factor)?;
            positive("rope_scaling.high_freq_factor", *high_freq_factor)?;
            if *original_max_position_embeddings == 0 {
                return Err(SolverError::invalid("rope_scaling.original_max_position_embeddings", "must be a positive integer"));
            }
            if low_freq_factor >= high_freq_factor {
                return Err(SolverError::invalid(
                    "rope_scaling.low_freq_factor",
                    format!("must be below high_freq_factor ({high_freq_factor}); got {low_freq_factor}"),
                ));
            }
        }
    }
    match spec.max_position_embeddings {
        Some(0) => return Err(SolverError::invalid("max_position_embeddings", "must be a positive integer (or null: no bound)")),
        Some(max) if seq_len > max => {
            return Err(SolverError::invalid(
                "seq_len",
                format!(
                    "{seq_len} tokens is more than the model's max_position_embeddings ({max}), the longest sequence its positions were made for; use a sequence length of at most {max} (--seq-len or a job's seq_len)"
                ),
            ))
        }
        _ => {}
    }
    match spec.sliding_window {
        Some(0) => Err(SolverError::invalid("sliding_window", "must be a positive integer (or null: full attention)")),
        Some(w) if w < seq_len => Err(SolverError::invalid(
            "sliding_window",
            format!(
                "the model attends over a window of {w} tokens but the sequence length is {seq_len}; Motley trains with full causal attention only: use a sequence length of at most {w} (--seq-len or plan_options.seq_len)"
            ),
        )),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn field(e: SolverError) -> String {
        match e {
            SolverError::InvalidInput { field, .. } => field,
            other => panic!("not an input error: {other}"),
        }
    }

    fn err(spec: ModelSpec, seq: Option<u64>) -> String {
        field(Model::new(spec, seq).expect_err("refused"))
    }

    fn llama(name: &str) -> ModelSpec {
        ModelSpec { family: Family::Llama, gated_mlp: true, ffn_hidden: Some(688), ..ModelSpec::gpt(name, 2, 256, 4, 128, 1000) }
    }

    #[test]
    fn the_catalog_declares_the_published_configurations() {
        let m = model_by_name("llama3-8b").unwrap();
        assert_eq!(
            (m.family, m.layers, m.hidden, m.heads, m.kv_heads, m.ffn_hidden, m.vocab, m.seq_len),
            (Family::Llama, 32, 4096, 32, Some(8), Some(14336), 128256, 8192)
        );
        assert_eq!((m.rope_theta, m.norm_eps, m.tie_embeddings, m.gated_mlp), (5e5, 1e-5, false, true));
        let m = model_by_name("llama3-70b").unwrap();
        assert_eq!(
            (m.layers, m.hidden, m.heads, m.kv_heads, m.ffn_hidden, m.vocab, m.seq_len),
            (80, 8192, 64, Some(8), Some(28672), 128256, 8192)
        );
        assert_eq!(m.rope_theta, 5e5);
        let m = model_by_name("llama-3b").unwrap();
        assert_eq!(
            (m.layers, m.hidden, m.heads, m.ffn_hidden, m.vocab, m.seq_len, m.norm_eps),
            (26, 3200, 32, Some(8640), 32000, 2048, 1e-6)
        );
        for n in ["llama-7b", "llama-13b"] {
            let m = model_by_name(n).unwrap();
            assert_eq!((m.seq_len, m.vocab, m.norm_eps, m.rope_theta, m.tie_embeddings), (2048, 32000, 1e-6, 1e4, false), "{n}");
        }
        let m = model_by_name("llama-70b").unwrap();
        assert_eq!(
            (m.layers, m.hidden, m.heads, m.kv_heads, m.ffn_hidden, m.seq_len, m.norm_eps),
            (80, 8192, 64, Some(8), Some(28672), 4096, 1e-5)
        );
        for m in model_catalog() {
            let llama = m.name.starts_with("llama");
            assert_eq!(m.family, if llama { Family::Llama } else { Family::Gpt }, "{}", m.name);
            assert_eq!(m.gated_mlp, llama, "{}", m.name);
            Model::new(m, None).expect("every catalog entry is valid");
        }
        // Llama 3 8B's published parameter count.
        assert_eq!(Model::new(model_by_name("llama3-8b").unwrap(), None).unwrap().total_params(), 8_030_261_248.0);
    }

    #[test]
    fn gpt_prices_biases_layernorms_and_the_position_table() {
        let (h, ffn, v, kv) = (256.0, 1024.0, 1000.0, 256.0);
        let m = Model::new(ModelSpec::gpt("g", 2, 256, 4, 128, 1000), None).unwrap();
        let matmul = 2.0 * h * h + 2.0 * h * kv + 2.0 * h * ffn;
        // q, k, v, o, fc1, fc2 biases; two LayerNorms (weight and bias).
        assert_eq!(m.layer_params, matmul + (h + 2.0 * kv + h) + (ffn + h) + 4.0 * h);
        assert_eq!(m.embed_params, v * h + 128.0 * h);
        assert_eq!(m.head_params, 2.0 * h + v * h);
        assert_eq!(m.total_params(), 2.0 * m.layer_params + m.embed_params + m.head_params);
        // The position table is the trained sequence length's.
        let short = Model::new(ModelSpec::gpt("g", 2, 256, 4, 128, 1000), Some(64)).unwrap();
        assert_eq!(short.embed_params, v * h + 64.0 * h);
    }

    #[test]
    fn llama_prices_rmsnorms_qkv_biases_and_no_position_table() {
        let (h, ffn, v, kv) = (256.0, 688.0, 1000.0, 128.0);
        let spec = ModelSpec { kv_heads: Some(2), ..llama("l") };
        let m = Model::new(spec.clone(), None).unwrap();
        let matmul = 2.0 * h * h + 2.0 * h * kv + 3.0 * h * ffn;
        assert_eq!(m.layer_params, matmul + 2.0 * h);
        assert_eq!(m.embed_params, v * h);
        assert_eq!(m.head_params, h + v * h);
        assert_eq!(m.tied_params, 0.0);
        let biased = Model::new(ModelSpec { qkv_bias: true, ..spec.clone() }, None).unwrap();
        assert_eq!(biased.layer_params, matmul + 2.0 * h + h + 2.0 * kv);
        let o_biased = Model::new(ModelSpec { qkv_bias: true, o_bias: true, ..spec.clone() }, None).unwrap();
        assert_eq!(o_biased.layer_params, biased.layer_params + h);
        // A tied head: counted once in all, once by a stage holding both ends, and a copy on
        // each end of a pipeline.
        let tied = Model::new(ModelSpec { tie_embeddings: true, ..spec }, None).unwrap();
        assert_eq!(tied.tied_params, v * h);
        assert_eq!(tied.total_params(), m.total_params() - v * h);
        assert_eq!(tied.ends_params(true, true), h + v * h);
        assert_eq!(tied.ends_params(true, false) + tied.ends_params(false, true), m.ends_params(true, true));
        assert_eq!(m.ends_params(false, false), 0.0);
    }

    #[test]
    fn old_files_parse_with_the_defaults_and_new_fields_are_read() {
        let old: ModelSpec = serde_norway::from_str("{name: g, layers: 2, hidden: 256, heads: 4, seq_len: 128, vocab: 1000}").unwrap();
        assert_eq!(old, ModelSpec::gpt("g", 2, 256, 4, 128, 1000));
        assert_eq!(
            (old.family, old.norm_eps, old.rope_theta, old.rope_scaling.clone(), old.sliding_window),
            (Family::Gpt, 1e-5, 1e4, None, None)
        );
        let json = serde_json::to_value(&old).unwrap();
        for k in [
            "family",
            "norm_eps",
            "rope_theta",
            "rope_scaling",
            "qkv_bias",
            "o_bias",
            "tie_embeddings",
            "sliding_window",
            "max_position_embeddings",
        ] {
            assert!(json.get(k).is_some(), "{k} is printed: {json}");
        }
        assert_eq!(json["family"], "gpt");
        let l: ModelSpec = serde_norway::from_str(
            "{name: l, family: llama, layers: 2, hidden: 256, heads: 4, seq_len: 128, vocab: 1000, gated_mlp: true, \
             rope_scaling: {type: llama3, factor: 8, low_freq_factor: 1, high_freq_factor: 4, original_max_position_embeddings: 8192}}",
        )
        .unwrap();
        assert_eq!(
            l.rope_scaling,
            Some(RopeScaling::Llama3 { factor: 8.0, low_freq_factor: 1.0, high_freq_factor: 4.0, original_max_position_embeddings: 8192 })
        );
        Model::new(l.clone(), None).unwrap();
        let back: ModelSpec = serde_json::from_value(serde_json::to_value(&l).unwrap()).unwrap();
        assert_eq!(back, l);
        for bad in [
            "{name: l, family: bert, layers: 2, hidden: 256, heads: 4, seq_len: 128, vocab: 1000}",
            "{name: l, layers: 2, hidden: 256, heads: 4, seq_len: 128, vocab: 1000, rope_scaling: {type: yarn, factor: 2}}",
            "{name: l, layers: 2, hidden: 256, heads: 4, seq_len: 128, vocab: 1000, rope_scaling: {type: llama3, factor: 2}}",
            "{name: l, layers: 2, hidden: 256, heads: 4, seq_len: 128, vocab: 1000, rope_scaling: {type: linear, factor: 2, x: 1}}",
        ] {
            assert!(serde_norway::from_str::<ModelSpec>(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn family_rules_are_refused_naming_the_field() {
        let linear = Some(RopeScaling::Linear { factor: 2.0 });
        assert_eq!(err(ModelSpec { rope_scaling: linear.clone(), ..ModelSpec::gpt("g", 2, 256, 4, 128, 1000) }, None), "rope_scaling");
        assert_eq!(err(ModelSpec { qkv_bias: true, ..ModelSpec::gpt("g", 2, 256, 4, 128, 1000) }, None), "qkv_bias");
        assert_eq!(err(ModelSpec { o_bias: true, ..ModelSpec::gpt("g", 2, 256, 4, 128, 1000) }, None), "o_bias");
        assert_eq!(err(ModelSpec { gated_mlp: false, ..llama("l") }, None), "gated_mlp");
        assert_eq!(err(ModelSpec { norm_eps: 0.0, ..llama("l") }, None), "norm_eps");
        assert_eq!(err(ModelSpec { rope_theta: -1.0, ..llama("l") }, None), "rope_theta");
        assert_eq!(err(ModelSpec { rope_scaling: Some(RopeScaling::Linear { factor: 0.0 }), ..llama("l") }, None), "rope_scaling.factor");
        let l3 = |factor, low, high, orig| {
            Some(RopeScaling::Llama3 { factor, low_freq_factor: low, high_freq_factor: high, original_max_position_embeddings: orig })
        };
        Model::new(ModelSpec { rope_scaling: linear, ..llama("l") }, None).unwrap();
        Model::new(ModelSpec { rope_scaling: l3(8.0, 1.0, 4.0, 8192), ..llama("l") }, None).unwrap();
        assert_eq!(err(ModelSpec { rope_scaling: l3(-8.0, 1.0, 4.0, 8192), ..llama("l") }, None), "rope_scaling.factor");
        assert_eq!(err(ModelSpec { rope_scaling: l3(8.0, 0.0, 4.0, 8192), ..llama("l") }, None), "rope_scaling.low_freq_factor");
        assert_eq!(err(ModelSpec { rope_scaling: l3(8.0, 1.0, f64::NAN, 8192), ..llama("l") }, None), "rope_scaling.high_freq_factor");
        assert_eq!(
            err(ModelSpec { rope_scaling: l3(8.0, 1.0, 4.0, 0), ..llama("l") }, None),
            "rope_scaling.original_max_position_embeddings"
        );
        assert_eq!(err(ModelSpec { rope_scaling: l3(8.0, 4.0, 1.0, 8192), ..llama("l") }, None), "rope_scaling.low_freq_factor");
        // A window shorter than the sequence: refused, unless a shorter sequence is asked for.
        let windowed = ModelSpec { sliding_window: Some(64), ..llama("l") };
        assert_eq!(err(windowed.clone(), None), "sliding_window");
        assert_eq!(err(windowed.clone(), Some(65)), "sliding_window");
        let e = Model::new(windowed.clone(), None).unwrap_err().to_string();
        assert!(e.contains("--seq-len") && e.contains("at most 64"), "{e}");
        assert_eq!(Model::new(windowed.clone(), Some(64)).unwrap().seq_len, 64);
        Model::new(ModelSpec { sliding_window: Some(128), ..llama("l") }, None).unwrap();
        assert_eq!(err(ModelSpec { sliding_window: Some(0), ..llama("l") }, Some(1)), "sliding_window");
    }

    #[test]
    fn max_position_embeddings_bounds_the_sequence_and_is_not_it() {
        let bounded = ModelSpec { max_position_embeddings: Some(512), ..llama("l") };
        // The spec's own seq_len (128) is what is trained; the bound only refuses longer.
        assert_eq!(Model::new(bounded.clone(), None).unwrap().seq_len, 128);
        assert_eq!(Model::new(bounded.clone(), Some(512)).unwrap().seq_len, 512);
        let e = Model::new(bounded.clone(), Some(513)).unwrap_err().to_string();
        assert!(
            e.starts_with("seq_len: 513 tokens is more than the model's max_position_embeddings (512)") && e.contains("--seq-len"),
            "{e}"
        );
        assert_eq!(err(ModelSpec { max_position_embeddings: Some(0), ..llama("l") }, None), "max_position_embeddings");
        // Old model files have no bound.
        let old: ModelSpec = serde_norway::from_str("{name: g, layers: 2, hidden: 256, heads: 4, seq_len: 128, vocab: 1000}").unwrap();
        assert_eq!(old.max_position_embeddings, None);
    }

    #[test]
    fn parameter_counts_read_in_their_unit() {
        assert_eq!(params_text(8_030_261_248.0), "8.03 B");
        assert_eq!(params_text(494_032_768.0), "494.03 M");
        assert_eq!(params_text(1_260_000.0), "1.26 M");
        assert_eq!(params_text(12_288.0), "12.29 K");
        assert_eq!(params_text(96.0), "96");
        // A tiny model is not "0.00 B".
        let tiny = Model::new(ModelSpec::gpt("t", 2, 64, 4, 32, 100), None).unwrap();
        assert!(params_text(tiny.total_params()).ends_with(" K"), "{}", params_text(tiny.total_params()));
    }
}
