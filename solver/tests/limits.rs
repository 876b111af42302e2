//! Sizes beyond the planner's limits (`motley_solver::limits`) are refused before anything is
//! allocated, with the field named: a `count: 100000000` typo used to grow `motley plan` to
//! 16 GB. No clock here: a refusal that returns at all, from a spec whose expansion would need
//! gigabytes, shows nothing was expanded.

use motley_solver::hardware::NodeSpec;
use motley_solver::limits::{
    MAX_GLOBAL_BATCH, MAX_GPUS, MAX_GPUS_PER_NODE, MAX_LAYERS, MAX_MICRO_BATCH, MAX_NODES, MAX_SEQ_LEN, MAX_STAGES,
};
use motley_solver::provision::{OfferSpec, Offers, OffersSpec};
use motley_solver::{Cluster, ClusterSpec, Model, PlanOptions, PlanRequest, ProfileSet, SearchMode};

fn node(name: &str, count: Option<u32>, gpus: u32) -> NodeSpec {
    NodeSpec {
        name: name.into(),
        count,
        gpu: "H100".into(),
        gpus,
        intra: None,
        nics: vec![],
        rdma_domain: None,
        spot: false,
        price_per_gpu_hour: None,
        pcie_switch_gbit: None,
        emulate: None,
    }
}

fn cluster(nodes: Vec<NodeSpec>) -> Result<Cluster, String> {
    Cluster::from_spec(&ClusterSpec { name: "c".into(), nodes, gpu_types: vec![] }).map_err(|e| e.to_string())
}

#[test]
fn a_count_typo_is_refused_naming_the_entry_before_any_node_is_expanded() {
    let e = cluster(vec![node("a", Some(2), 8), node("g", Some(100_000_000), 8)]).unwrap_err();
    assert!(e.starts_with(&format!("nodes[1].count: 100000000 is more than the {MAX_NODES} nodes a cluster may have;")), "{e}");
    // u32::MAX nodes of u32::MAX GPUs: the sums must not overflow either.
    let e = cluster(vec![node("g", Some(u32::MAX), u32::MAX)]).unwrap_err();
    assert!(e.starts_with("nodes[0].count:"), "{e}");
}

#[test]
fn the_limits_hold_across_entries_and_per_node() {
    let half = (MAX_NODES / 2 + 1) as u32;
    let e = cluster(vec![node("a", Some(half), 1), node("b", Some(half), 1)]).unwrap_err();
    assert!(e.starts_with("nodes[1].count: the entries up to this one declare") && e.contains(&MAX_NODES.to_string()), "{e}");
    let e = cluster(vec![node("a", None, MAX_GPUS_PER_NODE + 1)]).unwrap_err();
    assert!(
        e.starts_with(&format!("nodes[0].gpus: {} is more than the {MAX_GPUS_PER_NODE} GPUs a node may have", MAX_GPUS_PER_NODE + 1)),
        "{e}"
    );
    let nodes = (MAX_GPUS / MAX_GPUS_PER_NODE as u64) as u32;
    let e = cluster(vec![node("a", Some(nodes), MAX_GPUS_PER_NODE), node("b", None, 1)]).unwrap_err();
    assert!(e.starts_with("nodes[1].gpus: the entries up to this one declare") && e.contains(&MAX_GPUS.to_string()), "{e}");
}

#[test]
fn the_benchmarks_largest_cluster_is_within_the_limits() {
    // BENCHMARKS.md's stress run: 20,000 nodes of 8 x H100.
    let c = cluster(vec![node("g", Some(20_000), 8)]).unwrap();
    assert_eq!(c.total_gpus(), 160_000);
    // Exactly at the limits is allowed.
    let c = cluster(vec![node("g", Some((MAX_GPUS / MAX_GPUS_PER_NODE as u64) as u32), MAX_GPUS_PER_NODE)]).unwrap();
    assert_eq!(c.total_gpus() as u64, MAX_GPUS);
}

fn model(layers: u32, seq_len: u64) -> Result<Model, String> {
    let mut spec = motley_solver::model::model_by_name("gpt3-1.3b").unwrap();
    spec.layers = layers;
    spec.seq_len = seq_len;
    Model::new(spec, None).map_err(|e| e.to_string())
}

#[test]
fn model_sizes_are_bounded() {
    assert!(model(MAX_LAYERS, MAX_SEQ_LEN).is_ok());
    let e = model(MAX_LAYERS + 1, 2048).unwrap_err();
    assert!(e.starts_with(&format!("layers: {} is more than the {MAX_LAYERS} transformer layers", MAX_LAYERS + 1)), "{e}");
    let e = model(24, MAX_SEQ_LEN + 1).unwrap_err();
    assert!(e.starts_with("seq_len:"), "{e}");
    // The override (`--seq-len`) is checked the same way.
    let spec = motley_solver::model::model_by_name("gpt3-1.3b").unwrap();
    assert!(Model::new(spec, Some(u64::MAX)).unwrap_err().to_string().starts_with("seq_len:"));
}

#[test]
fn request_sizes_are_refused_by_the_planner_naming_the_field() {
    let c = cluster(vec![node("a", Some(2), 8)]).unwrap();
    let m = model(24, 2048).unwrap();
    let profiles = ProfileSet::default();
    let plan = |opts: PlanOptions| {
        let req = PlanRequest {
            cluster: &c,
            model: &m,
            profiles: &profiles,
            opts: &opts,
            mode: SearchMode::Auto,
            exhaustive: false,
            seeds: vec![],
        };
        motley_solver::plan(&req).map(|_| ()).map_err(|e| e.to_string())
    };
    let d = PlanOptions::default;
    let e = plan(PlanOptions { global_batch: MAX_GLOBAL_BATCH + 1, ..d() }).unwrap_err();
    assert!(e.starts_with("global_batch:"), "{e}");
    assert!(plan(PlanOptions { global_batch: 0, ..d() }).unwrap_err().starts_with("global_batch:"));
    let e = plan(PlanOptions { global_batch: 1 << 20, micro_batch: Some(MAX_MICRO_BATCH * 2), ..d() }).unwrap_err();
    assert!(e.starts_with("micro_batch:"), "{e}");
    let e = plan(PlanOptions { max_stages: MAX_STAGES + 1, ..d() }).unwrap_err();
    assert!(e.starts_with("max_stages:"), "{e}");
    assert!(plan(d()).is_ok());
}

#[test]
fn offers_are_bounded_like_clusters() {
    let offer = |quota, gpus_per_node| OfferSpec {
        gpu: "A100-80G".into(),
        name: None,
        price_per_gpu_hour: 2.0,
        quota,
        gpus_per_node,
        intra: None,
        nics: vec![],
        rdma_domain: None,
    };
    let offers = |o| Offers::from_spec(&OffersSpec { name: "x".into(), offers: vec![o], gpu_types: vec![] }).map_err(|e| e.to_string());
    let e = offers(offer(128, 128)).unwrap_err();
    assert!(e.starts_with("offers[0].gpus_per_node: 128 is more than"), "{e}");
    let e = offers(offer(u32::MAX, 8)).unwrap_err();
    assert!(e.starts_with("offers[0].quota:"), "{e}");
    assert!(offers(offer(MAX_GPUS as u32, 8)).is_ok());
}
