//! `motley model list|show`: the catalog and what a model file resolves to, as the rank
//! library reads it (`motley_torch` resolves a catalog name with `motley model show NAME -o json`).

mod common;
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
