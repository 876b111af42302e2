//! Micro-batch sizes: the host's launches as the roofline's floor on a layer's pass, and the
//! space's sizes up to 32, so a small model on one GPU runs its batch in one pass
//! (solver/README.md, "The cost model").

use motley_solver::cost::{CostModel, StageKind, HOST_LAYER_MS};
use motley_solver::{plan, Cluster, ClusterSpec, Model, ModelSpec, PlanOptions, PlanRequest, Precision, ProfileSet, SearchMode};

fn cluster(text: &str) -> Cluster {
    Cluster::from_spec(&serde_norway::from_str::<ClusterSpec>(text).unwrap()).unwrap()
}

fn one_h100() -> Cluster {
    let p = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../bench/gpu/one-h100.yaml");
    cluster(&std::fs::read_to_string(p).unwrap())
}

/// python/gpu-check's llama (motley_torch.tools.gpu_check.MODEL).
fn gpu_check_llama() -> Model {
    let spec: ModelSpec = serde_json::from_value(serde_json::json!({
        "name": "gpu-check-llama", "family": "llama", "layers": 8, "hidden": 1024, "heads": 16, "kv_heads": 8,
        "ffn_hidden": 2816, "seq_len": 512, "vocab": 32000, "gated_mlp": true
    }))
    .unwrap();
    Model::new(spec, None).unwrap()
}

fn options(host_layer_ms: f64) -> PlanOptions {
    PlanOptions { global_batch: 32, host_layer_ms, precision: Precision::Bf16, ..PlanOptions::default() }
}

fn plan_for(cluster: &Cluster, model: &Model, opts: &PlanOptions, mode: SearchMode) -> motley_solver::PlanDocument {
    let profiles = ProfileSet::default();
    plan(&PlanRequest { cluster, model, profiles: &profiles, opts, mode, exhaustive: false, seeds: vec![] }).unwrap()
}

#[test]
fn a_layer_pass_costs_at_least_the_hosts_launches() {
    let (c, model) = (one_h100(), gpu_check_llama());
    let profiles = ProfileSet::default();
    let kind = StageKind { class: 0, tp: 1, dp: 1 };
    let floored = options(HOST_LAYER_MS);
    let bare = options(0.0);
    let cost = |opts: &PlanOptions, b| CostModel { cluster: &c, model: &model, profiles: &profiles, opts }.layer_cost(kind, b);
    // One sequence of 512 tokens is a few dozen microseconds of an H100's work: the launches
    // set the pass.
    let (one, one_bare) = (cost(&floored, 1), cost(&bare, 1));
    assert!(one_bare.fwd < 1e-4, "{}", one_bare.fwd);
    assert_eq!((one.fwd, one.bwd), (HOST_LAYER_MS / 1e3, 2.0 * HOST_LAYER_MS / 1e3));
    // 32 sequences are above the floor: the floor changes nothing there.
    let (many, many_bare) = (cost(&floored, 32), cost(&bare, 32));
    assert!(many_bare.fwd > HOST_LAYER_MS / 1e3, "{}", many_bare.fwd);
    assert_eq!((many.fwd, many.bwd), (many_bare.fwd, many_bare.bwd));
}

#[test]
fn one_gpu_runs_a_small_models_batch_in_one_micro_batch() {
    let (c, model) = (one_h100(), gpu_check_llama());
    let doc = plan_for(&c, &model, &options(HOST_LAYER_MS), SearchMode::Auto);
    assert_eq!((doc.micro_batch, doc.replicas.len()), (32, 1), "{:?}", doc.search);
    // Priced against the split the space stopped at before (4 micro-batches of 8): the launches
    // of each micro-batch make that one slower, as it ran (BENCHMARKS.md).
    let pinned = PlanOptions { micro_batch: Some(8), ..options(HOST_LAYER_MS) };
    let four = plan_for(&c, &model, &pinned, SearchMode::Auto);
    assert!(four.iteration_time_s > 2.0 * doc.iteration_time_s, "{} against {}", four.iteration_time_s, doc.iteration_time_s);
    // Without the floor the roofline prices both the same.
    let bare_one = plan_for(&c, &model, &options(0.0), SearchMode::Auto);
    let bare_four = plan_for(&c, &model, &PlanOptions { micro_batch: Some(8), ..options(0.0) }, SearchMode::Auto);
    assert!((bare_four.iteration_time_s / bare_one.iteration_time_s - 1.0).abs() < 1e-9);
    assert_eq!(bare_one.micro_batch, 32, "on a tie the larger micro-batch is kept");
}

#[test]
fn a_micro_batch_that_does_not_fit_is_left_for_a_smaller_one() {
    // A T4 (16 GB) holds a 350M model's state but not 32 sequences of 2048 tokens of activations.
    let c = cluster("name: t4\nnodes:\n  - {name: t, gpu: T4, gpus: 1, nics: [{name: eth0, kind: ethernet, gbps: 25}]}\n");
    let spec: ModelSpec = serde_json::from_value(serde_json::json!({
        "name": "gpt-350m", "layers": 24, "hidden": 1024, "heads": 16, "seq_len": 2048, "vocab": 51200
    }))
    .unwrap();
    let model = Model::new(spec, None).unwrap();
    let opts = PlanOptions { global_batch: 32, ..PlanOptions::default() };
    let doc = plan_for(&c, &model, &opts, SearchMode::Exact);
    assert!(doc.micro_batch < 32, "micro-batch {}", doc.micro_batch);
    let pinned = PlanOptions { micro_batch: Some(32), ..opts };
    let profiles = ProfileSet::default();
    let refused = plan(&PlanRequest {
        cluster: &c,
        model: &model,
        profiles: &profiles,
        opts: &pinned,
        mode: SearchMode::Exact,
        exhaustive: false,
        seeds: vec![],
    });
    assert!(refused.is_err(), "32 sequences of 2048 tokens on a T4 should not fit");
}

#[test]
fn the_hosts_floor_is_checked_by_name() {
    for bad in [-1.0, f64::NAN, 2000.0] {
        let e = options(bad).validate().unwrap_err().to_string();
        assert!(e.starts_with("host_layer_ms:"), "{e}");
    }
}
