//! `motley model list|show`: the catalog and what a model file resolves to, as the rank
//! library reads it (`motley_torch` resolves a catalog name with `motley model show NAME -o json`).

use crate::common;
use common::{json, motley, repo};

#[test]
fn show_fills_the_defaults_and_list_has_the_catalog() {
    let m = json(&["model", "show", "gpt3-1.3b"]);
    assert_eq!(
        (m["layers"].as_u64(), m["hidden"].as_u64(), m["ffn_hidden"].as_u64(), m["kv_heads"].as_u64()),
        (Some(24), Some(2048), Some(8192), Some(16))
    );
    assert_eq!(m["gated_mlp"], false);
    let file = repo().join("examples/tiny-gpt.yaml");
    let t = json(&["model", "show", file.to_str().unwrap()]);
    assert_eq!((t["name"].as_str(), t["ffn_hidden"].as_u64()), (Some("tiny-gpt"), Some(3072)), "a file's defaults filled too");
    let all = json(&["model", "list"]);
    assert!(all.as_array().unwrap().iter().any(|m| m["name"] == "llama-70b" && m["kv_heads"] == 8));
    let out = motley(&["model", "list"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && text.contains("llama-7b") && text.contains("SwiGLU"), "{text}");
    let out = motley(&["model", "show", "gpt-9000"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("gpt-9000") && err.contains("llama-7b"), "{err}");
}

/// A Hugging Face model directory `name` holding `config`, in this test's temporary folder.
fn hf_dir(name: &str, config: &str) -> std::path::PathBuf {
    let dir = common::write_temp(&format!("{name}.txt"), "").with_extension("");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("config.json"), config).unwrap();
    dir
}

const TINY_LLAMA: &str = r#"{
  "architectures": ["LlamaForCausalLM"], "hidden_act": "silu", "hidden_size": 256,
  "intermediate_size": 688, "max_position_embeddings": 512, "num_attention_heads": 4,
  "num_hidden_layers": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-06,
  "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
  "tie_word_embeddings": true, "vocab_size": 1000
}"#;

#[test]
fn a_hugging_face_directory_is_a_model() {
    let dir = hf_dir("Tiny-Llama", TINY_LLAMA);
    let m = json(&["model", "show", dir.to_str().unwrap()]);
    assert_eq!((m["name"].as_str(), m["family"].as_str(), m["layers"].as_u64()), (Some("Tiny-Llama"), Some("llama"), Some(4)));
    assert_eq!((m["kv_heads"].as_u64(), m["ffn_hidden"].as_u64(), m["seq_len"].as_u64()), (Some(2), Some(688), Some(512)));
    assert_eq!((m["rope_theta"].as_f64(), m["norm_eps"].as_f64(), m["tie_embeddings"].as_bool()), (Some(5e5), Some(1e-6), Some(true)));
    assert_eq!((m["gated_mlp"].as_bool(), m["qkv_bias"].as_bool()), (Some(true), Some(false)));
    assert!(m["rope_scaling"].is_null() && m["sliding_window"].is_null(), "{m}");
    // Its config.json names it too.
    let c = json(&["model", "show", dir.join("config.json").to_str().unwrap()]);
    assert_eq!(c, m);
    let plan = json(&["plan", "--cluster", "examples/a100-h800.yaml", "--model", dir.to_str().unwrap(), "--global-batch", "16"]);
    assert_eq!(plan["model"], "Tiny-Llama");
    assert_eq!((plan["model_spec"]["family"].as_str(), plan["model_spec"]["tie_embeddings"].as_bool()), (Some("llama"), Some(true)));
    // A longer sequence than a Mistral window is refused naming the window.
    let mistral = hf_dir(
        "Tiny-Mistral",
        &TINY_LLAMA.replace("LlamaForCausalLM", "MistralForCausalLM").replace("\"vocab_size\"", "\"sliding_window\": 256, \"vocab_size\""),
    );
    assert_eq!(json(&["model", "show", mistral.to_str().unwrap()])["seq_len"].as_u64(), Some(256));
    let out = motley(&["plan", "--cluster", "examples/a100-h800.yaml", "--model", mistral.to_str().unwrap(), "--seq-len", "512"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.code() == Some(2) && err.contains("sliding_window") && err.contains("--seq-len"), "{err}");
}

#[test]
fn an_unsupported_hugging_face_model_exits_2_naming_the_field() {
    let dir = hf_dir("gpt2", r#"{"architectures": ["GPT2LMHeadModel"], "n_layer": 12, "n_embd": 768}"#);
    for args in [
        vec!["model", "show", dir.to_str().unwrap()],
        vec!["plan", "--cluster", "examples/a100-h800.yaml", "--model", dir.to_str().unwrap()],
    ] {
        let out = motley(&args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{err}");
        assert!(
            err.contains("config.json: architectures: 'GPT2LMHeadModel' is not supported") && err.contains("Qwen2ForCausalLM"),
            "{err}"
        );
        assert_eq!(err.trim().lines().count(), 1, "one line: {err}");
    }
    let bias = hf_dir("biased", &TINY_LLAMA.replace("\"vocab_size\"", "\"mlp_bias\": true, \"vocab_size\""));
    let out = motley(&["model", "show", bias.to_str().unwrap()]);
    assert!(out.status.code() == Some(2) && String::from_utf8_lossy(&out.stderr).contains("mlp_bias"));
}

#[test]
fn the_catalog_has_families() {
    let m = json(&["model", "show", "llama3-8b"]);
    assert_eq!((m["family"].as_str(), m["vocab"].as_u64(), m["kv_heads"].as_u64()), (Some("llama"), Some(128256), Some(8)));
    assert_eq!((m["rope_theta"].as_f64(), m["seq_len"].as_u64()), (Some(5e5), Some(8192)));
    let g = json(&["model", "show", "gpt3-1.3b"]);
    assert_eq!((g["family"].as_str(), g["norm_eps"].as_f64(), g["qkv_bias"].as_bool()), (Some("gpt"), Some(1e-5), Some(false)));
    assert!(g["rope_scaling"].is_null() && g["sliding_window"].is_null() && g["tie_embeddings"] == false, "{g}");
    let out = motley(&["model", "list"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("family") && text.contains("llama3-70b"), "{text}");
    // The plan carries the same fields, defaults filled in.
    let plan = json(&["plan", "--cluster", "examples/a100-h800.yaml", "--model", "gpt3-1.3b", "--global-batch", "16"]);
    assert_eq!(plan["model_spec"], g, "the plan's model_spec is `motley model show`'s");
}
