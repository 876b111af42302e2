//! The training sequence length: a Hugging Face model's is a stated default, never its
//! `max_position_embeddings`, and a plan that does not fit because of it says so.

use motley_solver::model::hf::{spec_from_config, DEFAULT_SEQ_LEN};
use motley_solver::{plan, Cluster, ClusterSpec, Model, PlanOptions, PlanRequest, ProfileSet, SearchMode, SolverError};

fn lab() -> Cluster {
    let p = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/lab.yaml");
    let spec: ClusterSpec = serde_norway::from_str(&std::fs::read_to_string(p).unwrap()).unwrap();
    Cluster::from_spec(&spec).unwrap()
}

/// Llama 3.1 8B's config.json: positions for 131072 tokens.
fn llama31_8b() -> serde_json::Value {
    serde_json::json!({
        "architectures": ["LlamaForCausalLM"], "hidden_act": "silu", "hidden_size": 4096,
        "intermediate_size": 14336, "max_position_embeddings": 131072, "num_attention_heads": 32,
        "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
        "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "rope_theta": 500000.0, "tie_word_embeddings": false, "vocab_size": 128256
    })
}

fn plan_on(cluster: &Cluster, model: &Model) -> motley_solver::Result<motley_solver::PlanDocument> {
    plan_with(cluster, model, false)
}

fn plan_with(cluster: &Cluster, model: &Model, recompute: bool) -> motley_solver::Result<motley_solver::PlanDocument> {
    let profiles = ProfileSet::default();
    let opts = PlanOptions { global_batch: 64, recompute, ..PlanOptions::default() };
    plan(&PlanRequest { cluster, model, profiles: &profiles, opts: &opts, mode: SearchMode::Fast, exhaustive: false, seeds: vec![] })
}

#[test]
fn a_hugging_face_model_is_planned_at_the_default_not_its_maximum() {
    let spec = spec_from_config(&llama31_8b(), "Llama-3.1-8B").unwrap();
    assert_eq!((spec.seq_len, spec.max_position_embeddings, DEFAULT_SEQ_LEN), (4096, Some(131072), 4096));
    let report = plan_on(&lab(), &Model::new(spec, None).unwrap()).expect("an 8B model fits 40 GPUs at 4096 tokens");
    assert_eq!((report.seq_len, report.model_spec.unwrap().max_position_embeddings), (Some(4096), Some(131072)));
}

/// At its maximum of 131072 tokens Llama 3.1 8B's sequence fits once recomputed: the head's loss
/// holds one chunk of logits, not the sequence's (solver/src/cost/activations.rs), so the advice
/// offers --recompute, and with it the lab plans.
#[test]
fn the_longest_sequence_is_planned_recomputed() {
    let spec = spec_from_config(&llama31_8b(), "Llama-3.1-8B").unwrap();
    let long = Model::new(spec, Some(131072)).unwrap();
    let Err(SolverError::DoesNotFit(m)) = plan_on(&lab(), &long) else { panic!("131072 tokens do not fit unrecomputed") };
    assert!(m.contains("at seq_len 131072") && m.contains("pass --recompute"), "{m}");
    let report = plan_with(&lab(), &long, true).expect("recomputed, 131072 tokens fit the lab");
    assert_eq!(report.seq_len, Some(131072));
}

/// A sequence whose one recomputed layer holds more than any GPU: only a shorter one helps.
#[test]
fn a_sequence_no_gpu_holds_asks_for_a_shorter_one_not_recomputation() {
    let mut spec = spec_from_config(&llama31_8b(), "Llama-3.1-8B").unwrap();
    spec.max_position_embeddings = None;
    let long = Model::new(spec, Some(1 << 21)).unwrap();
    let Err(SolverError::DoesNotFit(m)) = plan_with(&lab(), &long, true) else { panic!("2M tokens a sequence fit nowhere") };
    assert!(m.contains("at seq_len 2097152") && m.contains("lower --seq-len"), "{m}");
    assert!(m.contains("neither --recompute nor a longer pipeline"), "{m}");
    assert!(!m.contains("with --max-stages") && !m.contains("add GPUs"), "no fix that cannot help is offered: {m}");
    assert!(m.contains("8.03B parameters"), "{m}");
}

#[test]
fn a_model_too_big_for_its_gpus_keeps_the_usual_advice() {
    let spec: ClusterSpec = serde_norway::from_str("name: t4\nnodes:\n  - {name: t, gpu: T4, gpus: 2, intra: pcie}\n").unwrap();
    let t4 = Cluster::from_spec(&spec).unwrap();
    let big = Model::new(motley_solver::model::model_by_name("llama-70b").unwrap(), None).unwrap();
    let Err(SolverError::DoesNotFit(m)) = plan_on(&t4, &big) else { panic!("70B on two T4s fits nowhere") };
    assert!(m.contains("add GPUs") && m.contains("--max-stages") && !m.contains("at seq_len"), "{m}");
}
