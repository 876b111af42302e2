//! The training sequence length as a user meets it: a Hugging Face model's is a stated default
//! (`motley model show`, the plan), never its `max_position_embeddings`; a plan that does not
//! fit because of it asks for a shorter one; a running plan's is the one re-planned for.

use crate::common;
use common::{json, motley, write_temp};

const LLAMA31_8B: &str = r#"{
  "architectures": ["LlamaForCausalLM"], "hidden_act": "silu", "hidden_size": 4096,
  "intermediate_size": 14336, "max_position_embeddings": 131072, "num_attention_heads": 32,
  "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
  "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192, "rope_type": "llama3"},
  "rope_theta": 500000.0, "tie_word_embeddings": false, "vocab_size": 128256
}"#;

/// A Hugging Face model directory `name` holding `config`.
fn hf_dir(name: &str, config: &str) -> std::path::PathBuf {
    let dir = write_temp(&format!("{name}.txt"), "").with_extension("");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("config.json"), config).unwrap();
    dir
}

fn text(args: &[&str]) -> String {
    let out = motley(args);
    assert!(out.status.success(), "motley {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn model_show_states_the_default_and_the_maximum() {
    let dir = hf_dir("Llama-3.1-8B", LLAMA31_8B);
    let m = json(&["model", "show", dir.to_str().unwrap()]);
    assert_eq!((m["seq_len"].as_u64(), m["max_position_embeddings"].as_u64()), (Some(4096), Some(131072)));
    let t = text(&["model", "show", dir.to_str().unwrap()]);
    assert!(t.contains("max positions") && t.contains("131072") && t.contains("8.03 B"), "{t}");
    assert!(t.contains("seq len 4096 is the length trained at") && t.contains("max_position_embeddings (131072) and 4096"), "{t}");
    // A model without a maximum says nothing of one.
    let t = text(&["model", "show", "gpt3-1.3b"]);
    assert!(!t.contains("is the length trained at"), "{t}");
}

#[test]
fn a_tiny_model_counts_its_parameters_in_a_unit_that_shows_them() {
    let tiny = write_temp("tiny.yaml", "name: tiny\nlayers: 2\nhidden: 64\nheads: 4\nseq_len: 32\nvocab: 100\n");
    let t = text(&["model", "show", tiny.to_str().unwrap()]);
    assert!(!t.contains("0.00 B"), "{t}");
    assert!(t.contains(" K "), "{t}");
}

#[test]
fn a_hugging_face_model_is_planned_at_its_stated_default() {
    let dir = hf_dir("Llama-3.1-8B-plan", LLAMA31_8B);
    let base = ["plan", "--cluster", "examples/lab.yaml", "--model", dir.to_str().unwrap(), "--global-batch", "64", "--search", "fast"];
    let v = json(&base);
    assert_eq!((v["seq_len"].as_u64(), v["model_spec"]["max_position_embeddings"].as_u64()), (Some(4096), Some(131072)));
    let t = text(&base);
    assert!(t.contains("seq 4096: the model's default training length") && t.contains("--seq-len sets another"), "{t}");
    let v = json(&[&base[..], &["--seq-len", "2048"]].concat());
    assert_eq!(v["seq_len"], 2048);
    assert!(!text(&[&base[..], &["--seq-len", "2048"]].concat()).contains("default training length"), "an asked-for length is no default");
    // Asked for the maximum: the sequence is the cause, and the advice says so; recomputed it
    // fits (the head's loss holds one chunk of logits, not the sequence's).
    let out = motley(&[&base[..], &["--seq-len", "131072"]].concat());
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("does not fit") && err.contains("at seq_len 131072") && err.contains("lower --seq-len"), "{err}");
    assert!(err.contains("pass --recompute"), "{err}");
    let v = json(&[&base[..], &["--seq-len", "131072", "--recompute"]].concat());
    assert_eq!(v["seq_len"], 131072);
    let out = motley(&[&base[..], &["--seq-len", "131073"]].concat());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.code() == Some(2) && err.contains("max_position_embeddings (131072)"), "{err}");
}

#[test]
fn replan_keeps_the_running_plans_sequence_length() {
    let base = ["--cluster", "examples/lab.yaml", "--model", "gpt3-1.3b", "--global-batch", "64", "--seq-len", "1024"];
    let current = json(&[&["plan"][..], &base[..]].concat());
    let path = write_temp("current-seq.json", &current.to_string());
    let plan_flags: Vec<&str> = base[..6].to_vec();
    let v = json(&[&["replan", "--current", path.to_str().unwrap()][..], &plan_flags[..]].concat());
    assert_eq!(v["new_plan"]["seq_len"], 1024, "not the model's 2048");
    let out = motley(&[&["replan", "--current", path.to_str().unwrap()][..], &plan_flags[..], &["--seq-len", "512"][..]].concat());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.code() == Some(2) && err.contains("--seq-len: 512") && err.contains("1024-token"), "{err}");
}
