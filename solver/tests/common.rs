//! Random small clusters and models for property tests.
#![allow(dead_code)]

use motley_solver::hardware::{GpuType, IntraLink, NicKind, NicSpec, NodeSpec};
use motley_solver::{Cluster, ClusterSpec, Model, ModelSpec};
use proptest::prelude::*;

pub fn gpu_types() -> Vec<GpuType> {
    let g = |name: &str, memory_gib: f64, tflops: f64, nvlink_gbps: f64| GpuType {
        name: name.into(),
        memory_gib,
        tflops,
        mem_bw_gbps: 900.0,
        nvlink_gbps,
        bf16_tflops: None,
        fp32_tflops: None,
    };
    vec![g("Big", 12.0, 300.0, 600.0), g("Mid", 8.0, 150.0, 300.0), g("Small", 4.0, 60.0, 0.0), g("Roomy", 24.0, 40.0, 0.0)]
}

pub fn node_strategy() -> impl Strategy<Value = (usize, u32, u32, u8)> {
    (0usize..4, prop_oneof![Just(1u32), Just(2), Just(4)], 1u32..=2, 0u8..3)
}

pub fn cluster_strategy(max_gpus: u32) -> impl Strategy<Value = ClusterSpec> {
    prop::collection::vec(node_strategy(), 1..=3).prop_filter_map("too many GPUs", move |nodes| {
        let total: u32 = nodes.iter().map(|n| n.1 * n.2).sum();
        if total > max_gpus {
            return None;
        }
        let types = gpu_types();
        let specs = nodes
            .iter()
            .enumerate()
            .map(|(i, &(t, gpus, count, net))| {
                let gpu = &types[t];
                let nics = match net {
                    0 => vec![NicSpec::new("eth0", NicKind::Ethernet, 25.0)],
                    1 => vec![NicSpec::new("mlx5_0", NicKind::Ib, 200.0)],
                    _ => vec![NicSpec::new("mlx5_0", NicKind::Roce, 100.0)],
                };
                NodeSpec {
                    name: format!("n{i}"),
                    count: Some(count),
                    gpu: gpu.name.clone(),
                    gpus,
                    intra: Some(if gpu.nvlink_gbps > 0.0 { IntraLink::Nvlink } else { IntraLink::Pcie }),
                    nics,
                    rdma_domain: Some("dc".into()),
                    spot: false,
                    price_per_gpu_hour: None,
                    pcie_switch_gbit: None,
                    emulate: None,
                }
            })
            .collect();
        Some(ClusterSpec { name: "random".into(), nodes: specs, gpu_types: types })
    })
}

pub fn model_strategy(max_layers: u32) -> impl Strategy<Value = ModelSpec> {
    (2u32..=max_layers, prop_oneof![Just(512u64), Just(1024), Just(2048)], prop_oneof![Just(512u64), Just(1024)])
        .prop_map(|(layers, hidden, seq_len)| ModelSpec::gpt("tiny", layers, hidden, 8, seq_len, 8192))
}

pub fn build(spec: &ClusterSpec, model: &ModelSpec) -> (Cluster, Model) {
    (Cluster::from_spec(spec).unwrap(), Model::new(model.clone(), None).unwrap())
}
