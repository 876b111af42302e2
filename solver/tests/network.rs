//! The network-aware planner: Holmes's rules on every communication group, multi-edge links,
//! measured bandwidth and re-planning.

use std::collections::{BTreeSet, HashMap};

use motley_solver::bandwidth::{BandwidthSpec, PairSpec};
use motley_solver::cost::StageKind;
use motley_solver::hardware::{multi_edge_gbit, NicKind, NicSpec, NodeSpec};
use motley_solver::network::{comm_groups, GroupKind, Transport};
use motley_solver::placement::place;
use motley_solver::plan::{PlanStructure, ReplicaPlan, StagePlan};
use motley_solver::replan::{replan, ReplanReport, SwitchPolicy};
use motley_solver::{
    plan, Cluster, ClusterSpec, CostModel, Model, ModelSpec, PlanDocument, PlanOptions, PlanRequest, ProfileSet, SearchMode,
};
use proptest::prelude::*;

fn node(name: &str, count: u32, gpu: &str, gpus: u32, nics: Vec<NicSpec>, domain: Option<&str>) -> NodeSpec {
    NodeSpec {
        name: name.into(),
        count: Some(count),
        gpu: gpu.into(),
        gpus,
        intra: None,
        nics,
        rdma_domain: domain.map(str::to_string),
        spot: false,
        price_per_gpu_hour: None,
        pcie_switch_gbit: None,
        emulate: None,
    }
}

fn eth() -> NicSpec {
    NicSpec::new("eth0", NicKind::Ethernet, 25.0)
}

/// IB nodes with two rails (each NIC serving half the GPUs), RoCE nodes with one NIC and a
/// non-default GID index, and Ethernet-only nodes.
fn mixed_cluster(ib: u32, roce: u32, plain: u32, gpu: &str, gpus: u32) -> ClusterSpec {
    mixed_cluster_with(ib, roce, plain, 0, gpu, gpus)
}

/// As `mixed_cluster`, plus `odd` nodes in the RoCE island with both an IB and a RoCE NIC, GID
/// index 3 and no declared Ethernet NIC.
fn mixed_cluster_with(ib: u32, roce: u32, plain: u32, odd: u32, gpu: &str, gpus: u32) -> ClusterSpec {
    let half: Vec<u32> = (0..gpus / 2).collect();
    let rest: Vec<u32> = (gpus / 2..gpus).collect();
    let rail = |name: &str, g: &[u32]| NicSpec { gpus: g.to_vec(), ..NicSpec::new(name, NicKind::Ib, 200.0) };
    let mut nodes = vec![];
    if ib > 0 {
        nodes.push(node("ib", ib, gpu, gpus, vec![rail("mlx5_0", &half), rail("mlx5_1", &rest), eth()], Some("ib-island")));
    }
    if roce > 0 {
        let nic = NicSpec { gid_index: Some(5), ..NicSpec::new("mlx5_4", NicKind::Roce, 100.0) };
        nodes.push(node("roce", roce, gpu, gpus, vec![nic, eth()], Some("roce-island")));
    }
    if plain > 0 {
        nodes.push(node("plain", plain, gpu, gpus, vec![eth()], None));
    }
    if odd > 0 {
        let nics = vec![
            NicSpec::new("mlx5_0", NicKind::Ib, 100.0),
            NicSpec { gid_index: Some(3), ..NicSpec::new("mlx5_4", NicKind::Roce, 100.0) },
        ];
        nodes.push(node("odd", odd, gpu, gpus, nics, Some("roce-island")));
    }
    ClusterSpec { name: "mixed".into(), nodes, gpu_types: vec![] }
}

fn small_model(layers: u32) -> Model {
    let spec = ModelSpec::gpt("t", layers, 1024, 16, 1024, 32000);
    Model::new(spec, None).unwrap()
}

fn load_example<T: serde::de::DeserializeOwned>(path: &str) -> T {
    let p = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(path);
    serde_norway::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
}

fn plan_on(cluster: &Cluster, model: &Model, opts: &PlanOptions, mode: SearchMode) -> PlanDocument {
    let profiles = ProfileSet::default();
    plan(&PlanRequest { cluster, model, profiles: &profiles, opts, mode, exhaustive: false, seeds: vec![] }).unwrap()
}

/// `replan` of `before` (a plan report, read back as a plan file) on `cluster`, at a 5% bar
/// and a 1000-iteration horizon.
fn replan_on(cluster: &Cluster, model: &Model, opts: &PlanOptions, before: serde_json::Value) -> motley_solver::Result<ReplanReport> {
    let profiles = ProfileSet::default();
    let req = PlanRequest { cluster, model, profiles: &profiles, opts, mode: SearchMode::Auto, exhaustive: false, seeds: vec![] };
    let current: PlanDocument = serde_json::from_value(before).unwrap();
    replan(&req, &current, SwitchPolicy { min_gain: 0.05, horizon: 1000.0 })
}

/// Every rule a group must obey, checked against the cluster it was planned on.
fn check_groups(cluster: &Cluster, r: &PlanDocument) {
    let node_of: HashMap<&str, usize> = cluster.nodes.iter().enumerate().map(|(i, n)| (n.name.as_str(), i)).collect();
    let class_of = |name: &str| &cluster.classes[cluster.nodes[node_of[name]].class];
    let tp = r.replicas[0].stages[0].tp;
    let tp_groups: usize = if tp > 1 { r.replicas.iter().flat_map(|x| &x.stages).map(|s| s.dp as usize).sum() } else { 0 };
    assert_eq!(r.comm_groups.iter().filter(|g| g.kind == GroupKind::Tp).count(), tp_groups);
    for g in &r.comm_groups {
        assert!(g.gpus.len() >= 2, "a group of one GPU does not communicate: {g:?}");
        assert!(!g.env.is_empty(), "every group selects its transport: {g:?}");
        assert!(g.seconds_per_iteration.is_finite() && g.seconds_per_iteration >= 0.0);
        let nodes: BTreeSet<&str> = g.gpus.iter().map(|x| x.node.as_str()).collect();
        match g.transport {
            Transport::Nvlink | Transport::Pcie => {
                assert_eq!(nodes.len(), 1, "an intra-node transport inside one node: {g:?}");
                assert!(g.nics.is_empty() && g.nccl_net.is_none());
            }
            Transport::Ib | Transport::Roce => {
                let kind = if g.transport == Transport::Ib { NicKind::Ib } else { NicKind::Roce };
                let domains: BTreeSet<&str> = nodes.iter().map(|n| class_of(n).rdma_domain.as_str()).collect();
                assert_eq!(domains.len(), 1, "an RDMA group stays in one RDMA domain: {g:?}");
                for n in &nodes {
                    assert!(class_of(n).nic_gbps.contains_key(&kind), "{n} has no {kind:?} NIC but group uses it: {g:?}");
                }
                let hca = &g.env["NCCL_IB_HCA"];
                assert!(hca.starts_with('='), "exact HCA match: {hca}");
                for name in hca[1..].split(',') {
                    let dev = name.split(':').next().unwrap();
                    assert!(
                        nodes.iter().any(|n| class_of(n).nics.iter().any(|x| x.name == dev && x.kind == kind)),
                        "{dev} not on the group's nodes"
                    );
                }
                assert_eq!(g.env["NCCL_IB_DISABLE"], "0");
                assert_eq!(g.env.contains_key("NCCL_IB_GID_INDEX"), kind == NicKind::Roce);
                // Every member node ends up with its own port's GID index.
                for n in nodes.iter().filter(|_| kind == NicKind::Roce) {
                    let want = class_of(n).nics.iter().find(|x| x.kind == NicKind::Roce).unwrap().gid_index.unwrap_or(3).to_string();
                    let got = g.node_env.get(*n).and_then(|e| e.get("NCCL_IB_GID_INDEX")).unwrap_or(&g.env["NCCL_IB_GID_INDEX"]);
                    assert_eq!(got, &want, "{n}: {g:?}");
                }
                assert_eq!(g.nccl_net.as_deref(), Some("IB"));
            }
            Transport::Socket => {
                assert!(nodes.len() > 1);
                assert_eq!(g.env["NCCL_NET"], "Socket");
                assert!(!g.env.contains_key("NCCL_IB_DISABLE"), "cached per process: never set per group");
                let declared = nodes.iter().all(|n| class_of(n).nics.iter().any(|x| x.kind == NicKind::Ethernet));
                assert_eq!(g.env.get("NCCL_SOCKET_IFNAME").map(String::as_str), declared.then_some("=eth0"), "{g:?}");
            }
        }
        if g.kind == GroupKind::Tp {
            assert_eq!(nodes.len(), 1, "no TP group leaves a node: {g:?}");
            assert_eq!(g.gpus.len() as u32, tp);
        }
        if g.kind == GroupKind::Dp {
            // No ring mixes InfiniBand and RoCE: a ring joining an IB-only and a RoCE-only
            // node runs over sockets.
            let has =
                |k: NicKind| nodes.iter().any(|n| class_of(n).nic_gbps.contains_key(&k) && !class_of(n).nic_gbps.contains_key(&other(k)));
            if has(NicKind::Ib) && has(NicKind::Roce) {
                assert_eq!(g.transport, Transport::Socket, "{g:?}");
            }
        }
    }
}

fn other(k: NicKind) -> NicKind {
    if k == NicKind::Ib {
        NicKind::Roce
    } else {
        NicKind::Ib
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    /// Holmes's rules on every plan of random mixed-NIC clusters; the search's price is the
    /// cost model's evaluation of the plan it returns, and a uniform plan's rings are priced
    /// on the links their groups report.
    #[test]
    fn every_group_follows_the_network_rules(
        ib in 0u32..=3, roce in 0u32..=3, plain in 0u32..=2, odd in 0u32..=1,
        gpu in prop_oneof![Just("A100-80G"), Just("V100-32G"), Just("A6000")],
        gpus in prop_oneof![Just(2u32), Just(4), Just(8)],
        layers in 4u32..=16, batch in prop_oneof![Just(8u32), Just(16), Just(32)],
    ) {
        prop_assume!(ib + roce + plain + odd >= 1);
        let cluster = Cluster::from_spec(&mixed_cluster_with(ib, roce, plain, odd, gpu, gpus)).unwrap();
        let model = small_model(layers);
        let opts = PlanOptions { global_batch: batch, ..PlanOptions::default() };
        let r = plan_on(&cluster, &model, &opts, SearchMode::Fast);
        check_groups(&cluster, &r);

        let profiles = ProfileSet::default();
        let cm = CostModel { cluster: &cluster, model: &model, profiles: &profiles, opts: &opts };
        let s = motley_solver::search::search(&cm, SearchMode::Fast, &[]).unwrap();
        let e = cm.evaluate(&s.plan);
        prop_assert!((e.iteration_time - s.iteration_time).abs() <= 1e-9 * s.iteration_time, "search {} evaluate {}", s.iteration_time, e.iteration_time);
        let groups = comm_groups(&cm, &s.plan, &place(&cluster, &s.plan).unwrap());
        if s.plan.is_uniform() {
            let gpus_of = s.plan.gpus_per_class(cluster.classes.len());
            let ctx = cm.sync_context(s.plan.replicas.len() as u32, &gpus_of, true);
            for g in groups.iter().filter(|g| g.kind == GroupKind::Dp && !matches!(g.transport, Transport::Nvlink | Transport::Pcie)) {
                let stage = s.plan.replicas[0].stages.iter().find(|st| st.layers.0 <= g.layers[0] && g.layers[0] < st.layers.1).unwrap();
                let (bw, shared) = cm.ring_link(&ctx, stage.kind);
                prop_assert!(shared);
                prop_assert!((g.link_gb_per_s * stage.kind.tp as f64 - bw).abs() <= 1e-9 * bw, "group {} x tp vs priced {}", g.link_gb_per_s, bw);
            }
        }
    }
}

#[test]
fn holmes_hybrid_plan_pipelines_across_islands_and_keeps_rings_inside() {
    let cluster = Cluster::from_spec(&load_example::<ClusterSpec>("examples/holmes/hybrid-4.yaml")).unwrap();
    let model = Model::new(load_example::<ModelSpec>("examples/holmes/gpt-3.6b.yaml"), None).unwrap();
    let opts = PlanOptions { global_batch: 768, tp: Some(1), max_stages: 2, ..PlanOptions::default() };
    let r = plan_on(&cluster, &model, &opts, SearchMode::Auto);
    check_groups(&cluster, &r);
    let rings: BTreeSet<Transport> = r.comm_groups.iter().filter(|g| g.kind == GroupKind::Dp).map(|g| g.transport).collect();
    assert_eq!(rings, [Transport::Ib, Transport::Roce].into(), "one ring per island, on its own RDMA NIC");
    let hops: BTreeSet<Transport> = r.comm_groups.iter().filter(|g| g.kind == GroupKind::Pp).map(|g| g.transport).collect();
    assert_eq!(hops, [Transport::Socket].into(), "pipeline hops cross between the islands over Ethernet");
    // The same GPUs as one flat Ethernet fabric are slower.
    let flat = Cluster::from_spec(&load_example::<ClusterSpec>("examples/holmes/ethernet-4.yaml")).unwrap();
    let f = plan_on(&flat, &model, &opts, SearchMode::Auto);
    assert!(r.iteration_time_s < f.iteration_time_s, "hybrid {} vs flat Ethernet {}", r.iteration_time_s, f.iteration_time_s);
}

#[test]
fn a_ring_across_islands_runs_over_sockets_and_is_priced_on_ethernet() {
    let cluster = Cluster::from_spec(&mixed_cluster(1, 1, 0, "A100-80G", 8)).unwrap();
    let model = small_model(8);
    let opts = PlanOptions { global_batch: 16, ..PlanOptions::default() };
    let profiles = ProfileSet::default();
    let cm = CostModel { cluster: &cluster, model: &model, profiles: &profiles, opts: &opts };
    // Two replicas of one stage of 8 GPUs (tp 8): one on the IB node, one on the RoCE node,
    // with different micro-batch counts so the plan is not uniform.
    let ib_class = cluster.nodes.iter().find(|n| n.name.starts_with("ib")).unwrap().class;
    let roce_class = cluster.nodes.iter().find(|n| n.name.starts_with("roce")).unwrap().class;
    let rep =
        |class, mb| ReplicaPlan { stages: vec![StagePlan { kind: StageKind { class, tp: 8, dp: 1 }, layers: (0, 8) }], micro_batches: mb };
    let p = PlanStructure { micro_batch: 2, replicas: vec![rep(ib_class, 5), rep(roce_class, 3)] };
    cm.check_structure(&p).unwrap();
    assert!(!p.is_uniform());
    let groups = comm_groups(&cm, &p, &place(&cluster, &p).unwrap());
    let rings: Vec<_> = groups.iter().filter(|g| g.kind == GroupKind::Dp).collect();
    assert_eq!(rings.len(), 8, "one ring per TP rank");
    for g in &rings {
        assert_eq!(g.transport, Transport::Socket);
        assert_eq!(g.env["NCCL_NET"], "Socket");
        assert_eq!(g.env["NCCL_SOCKET_IFNAME"], "=eth0");
        assert!((g.link_gb_per_s - 25.0 / 8.0 * 0.85 / 8.0).abs() < 1e-9, "Ethernet shared by 8 TP shards: {}", g.link_gb_per_s);
    }
    // The cost model prices the same ring on Ethernet too.
    let ctx = cm.sync_context(2, &p.gpus_per_class(cluster.classes.len()), false);
    assert!((cm.ring_link(&ctx, p.replicas[0].stages[0].kind).0 - 25.0 / 8.0 * 0.85).abs() < 1e-9);
}

#[test]
fn a_ring_uses_the_rdma_kind_every_member_has_and_is_priced_on_it() {
    // Class A: IB 200 and RoCE 400; class B: IB 200 only; one RDMA domain. RoCE is A's fastest
    // link to itself, but a ring over A and B can only use IB, on both the price and the group.
    let a = node(
        "a",
        1,
        "A100-80G",
        8,
        vec![NicSpec::new("mlx5_0", NicKind::Ib, 200.0), NicSpec::new("mlx5_2", NicKind::Roce, 400.0), eth()],
        Some("dc"),
    );
    let b = node("b", 1, "A100-80G", 8, vec![NicSpec::new("mlx5_0", NicKind::Ib, 200.0), eth()], Some("dc"));
    let cluster = Cluster::from_spec(&ClusterSpec { name: "ab".into(), nodes: vec![a, b], gpu_types: vec![] }).unwrap();
    assert_eq!(cluster.inter_link(0, 0).0, NicKind::Roce);
    let model = small_model(8);
    let opts = PlanOptions { global_batch: 16, ..PlanOptions::default() };
    let profiles = ProfileSet::default();
    let cm = CostModel { cluster: &cluster, model: &model, profiles: &profiles, opts: &opts };
    let rep =
        |class, mb| ReplicaPlan { stages: vec![StagePlan { kind: StageKind { class, tp: 8, dp: 1 }, layers: (0, 8) }], micro_batches: mb };
    let p = PlanStructure { micro_batch: 2, replicas: vec![rep(0, 5), rep(1, 3)] };
    let ib = 200.0 / 8.0 * 0.85;
    let ctx = cm.sync_context(2, &p.gpus_per_class(2), false);
    assert!((cm.ring_link(&ctx, p.replicas[0].stages[0].kind).0 - ib).abs() < 1e-9);
    for g in comm_groups(&cm, &p, &place(&cluster, &p).unwrap()).iter().filter(|g| g.kind == GroupKind::Dp) {
        assert_eq!(g.transport, Transport::Ib);
        assert_eq!(g.env["NCCL_IB_HCA"], "=mlx5_0:1");
        assert!((g.link_gb_per_s * 8.0 - ib).abs() < 1e-9);
    }
}

#[test]
fn blocking_sends_only_lengthen_the_period() {
    let cluster = Cluster::from_spec(&load_example::<ClusterSpec>("examples/holmes/hybrid-4.yaml")).unwrap();
    let model = Model::new(load_example::<ModelSpec>("examples/holmes/gpt-3.6b.yaml"), None).unwrap();
    let profiles = ProfileSet::default();
    let busy = [0.2, 0.3, 0.25];
    let hops = [0.05, 0.01];
    let mut opts = PlanOptions::default();
    let overlapped = CostModel { cluster: &cluster, model: &model, profiles: &profiles, opts: &opts }.period(&busy, &hops);
    assert_eq!(overlapped, 0.3);
    opts.p2p_blocking = true;
    let blocking = CostModel { cluster: &cluster, model: &model, profiles: &profiles, opts: &opts }.period(&busy, &hops);
    assert!((blocking - (0.05 + 0.3 + 0.01)).abs() < 1e-12, "the middle stage waits for both its hops: {blocking}");
    // A hop slower than every stage sets the overlapped period.
    let slow =
        CostModel { cluster: &cluster, model: &model, profiles: &profiles, opts: &PlanOptions::default() }.period(&busy, &[0.5, 0.01]);
    assert_eq!(slow, 0.5);
}

#[test]
fn nics_add_up_unless_they_share_a_pcie_switch() {
    let on = |name: &str, sw: Option<&str>| NicSpec { pcie_switch: sw.map(str::to_string), ..NicSpec::new(name, NicKind::Ib, 200.0) };
    let apart = multi_edge_gbit(&[on("a", None), on("b", None)], 256.0);
    assert_eq!(apart[&NicKind::Ib], 400.0);
    let shared = multi_edge_gbit(&[on("a", Some("sw0")), on("b", Some("sw0")), on("c", Some("sw1"))], 256.0);
    assert_eq!(shared[&NicKind::Ib], 256.0 + 200.0);
    let kinds = multi_edge_gbit(&[on("a", None), NicSpec::new("eth0", NicKind::Ethernet, 25.0)], 256.0);
    assert_eq!((kinds[&NicKind::Ib], kinds[&NicKind::Ethernet]), (200.0, 25.0), "kinds never add up");
}

fn pairs(list: &[(&str, &str, f64)]) -> BandwidthSpec {
    BandwidthSpec {
        pairs: list.iter().map(|&(a, b, g)| PairSpec { a: a.into(), b: b.into(), gb_per_s: g }).collect(),
        ..BandwidthSpec::default()
    }
}

#[test]
fn measurements_override_nominal_rates_and_split_slow_nodes_off() {
    let cluster = Cluster::from_spec(&mixed_cluster(3, 0, 0, "A100-80G", 8)).unwrap();
    assert_eq!(cluster.classes.len(), 1);
    let nominal = cluster.inter_bw(0, 0);
    // ib-2's links measure at a quarter: it becomes its own class; ib-0/ib-1 stay nominal.
    let m = cluster
        .with_measurements(&pairs(&[("ib-0", "ib-2", nominal / 4.0), ("ib-1", "ib-2", nominal / 4.0), ("ib-0", "ib-1", nominal)]))
        .unwrap();
    assert_eq!(m.classes.len(), 2);
    let slow = m.nodes.iter().find(|n| n.name == "ib-2").unwrap().class;
    let fast = m.nodes.iter().find(|n| n.name == "ib-0").unwrap().class;
    assert_ne!(slow, fast);
    assert!((m.inter_bw(fast, fast) - nominal).abs() < 1e-9);
    assert!((m.inter_bw(fast, slow) - nominal / 4.0).abs() < 1e-9);
    assert_eq!(m.inter_link(fast, slow).0, NicKind::Ib, "measurements change speeds, not transports");
    // A matrix gives the same answer as the pairs.
    let spec = BandwidthSpec {
        nodes: vec!["ib-0".into(), "ib-1".into(), "ib-2".into()],
        matrix: vec![
            vec![None, Some(nominal), Some(nominal / 4.0)],
            vec![Some(nominal), None, Some(nominal / 4.0)],
            vec![Some(nominal / 4.0), Some(nominal / 4.0), None],
        ],
        ..BandwidthSpec::default()
    };
    assert_eq!(cluster.with_measurements(&spec).unwrap(), m);
}

/// Healthy nodes read above their nominal rate by different amounts: they stay one class, so
/// the one slow pair between them (a link that dropped) prices every ring and hop among them,
/// even beside a pair still measured fast from before the drop.
#[test]
fn healthy_nodes_faster_than_declared_stay_one_class_and_a_slow_pair_prices_it() {
    let cluster = Cluster::from_spec(&mixed_cluster(4, 0, 0, "A100-80G", 8)).unwrap();
    let n = cluster.inter_bw(0, 0);
    let m = cluster
        .with_measurements(&pairs(&[
            ("ib-0", "ib-1", n * 1.13),
            ("ib-2", "ib-3", n),
            ("ib-1", "ib-3", n * 1.2),
            ("ib-0", "ib-2", n / 10.0),
        ]))
        .unwrap();
    assert_eq!(m.classes.len(), 1, "{:?}", m.nodes.iter().map(|x| x.class).collect::<Vec<_>>());
    assert!((m.inter_bw(0, 0) - n / 10.0).abs() < 1e-9, "{}", m.inter_bw(0, 0));
}

#[test]
fn bad_measurement_files_name_the_field() {
    let cluster = Cluster::from_spec(&mixed_cluster(2, 0, 0, "A100-80G", 8)).unwrap();
    let err = |s: BandwidthSpec| cluster.with_measurements(&s).unwrap_err().to_string();
    assert!(err(pairs(&[("ib-0", "nope", 1.0)])).starts_with("pairs[0].b: unknown node 'nope'"));
    assert!(err(pairs(&[("ib-0", "ib-1", 0.0)])).starts_with("pairs[0].gb_per_s: must be a positive GB/s"));
    assert!(err(pairs(&[("ib-0", "ib-0", 3.0)])).starts_with("pairs[0].gb_per_s: a node paired with itself"));
    assert!(err(BandwidthSpec::default()).starts_with("pairs: the file measures no pair"));
    let ragged = BandwidthSpec {
        nodes: vec!["ib-0".into(), "ib-1".into()],
        matrix: vec![vec![None, Some(1.0)], vec![Some(1.0)]],
        ..BandwidthSpec::default()
    };
    assert!(err(ragged).starts_with("matrix[1]: has 1 columns"));
}

/// The IB island of Holmes's 4-node hybrid cluster measures at half its nominal rate:
/// re-planning moves layers off it, and the new plan is never slower than the running one on
/// the network as measured now.
#[test]
fn halving_an_islands_bandwidth_moves_work_away_from_it() {
    let cluster = Cluster::from_spec(&load_example::<ClusterSpec>("examples/holmes/hybrid-4.yaml")).unwrap();
    let model = Model::new(load_example::<ModelSpec>("examples/holmes/gpt-3.6b.yaml"), None).unwrap();
    let opts = PlanOptions { global_batch: 64, tp: Some(1), max_stages: 2, ..PlanOptions::default() };
    let before = plan_on(&cluster, &model, &opts, SearchMode::Auto);
    let half = cluster.inter_bw(0, 0) / 2.0;
    let slowed = cluster.with_measurements(&pairs(&[("hybrid-0", "hybrid-1", half)])).unwrap();
    let r = replan_on(&slowed, &model, &opts, serde_json::to_value(&before).unwrap()).unwrap();
    let share = |p: &PlanDocument| {
        let (mut island, mut all) = (0u64, 0u64);
        for rep in &p.replicas {
            for s in &rep.stages {
                let w = rep.samples.unwrap() as u64 * (s.layers[1] - s.layers[0]) as u64 * s.gpus.len() as u64;
                all += w;
                if s.gpus[0].node == "hybrid-0" || s.gpus[0].node == "hybrid-1" {
                    island += w;
                }
            }
        }
        island as f64 / all as f64
    };
    assert!(share(&r.new_plan) < share(&before) - 0.05, "island share {} -> {}", share(&before), share(&r.new_plan));
    assert!(r.current_now_s > before.iteration_time_s, "the slower network slows the running plan");
    assert!(r.new_iteration_time_s <= r.current_now_s, "re-planning never does worse than keeping the plan");
    assert!((r.gain - (r.current_now_s / r.new_iteration_time_s - 1.0)).abs() < 1e-12);
    assert!(r.gpus_moved > 0 && r.switch_bytes > 0.0 && r.payback_iterations.is_some());
    assert_eq!(r.worth_switching, r.gain >= 0.05 && r.payback_iterations.unwrap() <= 1000.0);
}

#[test]
fn replanning_an_unchanged_network_keeps_the_plan() {
    let cluster = Cluster::from_spec(&mixed_cluster(2, 2, 0, "A100-80G", 8)).unwrap();
    let model = small_model(12);
    let opts = PlanOptions { global_batch: 32, ..PlanOptions::default() };
    let before = plan_on(&cluster, &model, &opts, SearchMode::Auto);
    let r = replan_on(&cluster, &model, &opts, serde_json::to_value(&before).unwrap()).unwrap();
    assert!((r.current_now_s - before.iteration_time_s).abs() < 1e-9 * before.iteration_time_s);
    assert!(!r.worth_switching, "{}", r.reason);
    assert!(r.gain.abs() < 1e-9);
}

/// One node's NICs degrade: it becomes a class of its own, and the running plan (which spans it)
/// is still priced, on its slow links, and re-planned.
#[test]
fn replanning_after_one_node_degrades() {
    let cluster = Cluster::from_spec(&mixed_cluster(3, 0, 0, "A100-80G", 8)).unwrap();
    let model = small_model(12);
    let opts = PlanOptions { global_batch: 96, tp: Some(1), max_stages: 1, ..PlanOptions::default() };
    let before = plan_on(&cluster, &model, &opts, SearchMode::Auto);
    assert_eq!(before.gpus_used, 24, "pure data parallelism over all three nodes");
    let q = cluster.inter_bw(0, 0) / 8.0;
    let slowed = cluster.with_measurements(&pairs(&[("ib-0", "ib-2", q), ("ib-1", "ib-2", q), ("ib-0", "ib-1", q * 8.0)])).unwrap();
    assert_eq!(slowed.classes.len(), 2);
    let r = replan_on(&slowed, &model, &opts, serde_json::to_value(&before).unwrap()).unwrap();
    assert!(
        r.current_now_s > before.iteration_time_s * 1.01,
        "the ring now crosses the slow node: {} vs {}",
        r.current_now_s,
        before.iteration_time_s
    );
    assert!(r.new_iteration_time_s <= r.current_now_s);
}

#[test]
fn a_plan_file_for_another_cluster_is_refused_with_the_field() {
    let cluster = Cluster::from_spec(&mixed_cluster(2, 0, 0, "A100-80G", 8)).unwrap();
    let model = small_model(8);
    let opts = PlanOptions { global_batch: 16, ..PlanOptions::default() };
    let before = plan_on(&cluster, &model, &opts, SearchMode::Auto);
    let mut v = serde_json::to_value(&before).unwrap();
    v["replicas"][0]["stages"][0]["gpus"][0]["node"] = "elsewhere".into();
    let e = replan_on(&cluster, &model, &opts, v).unwrap_err().to_string();
    assert!(e.starts_with("replicas[0].stages[0].gpus[0].node: node 'elsewhere' is not in the cluster"), "{e}");
    let mut v = serde_json::to_value(&before).unwrap();
    let first = v["replicas"][0]["stages"][0]["gpus"][0].clone();
    let last = v["replicas"].as_array().unwrap().len() - 1;
    let stages = v["replicas"][last]["stages"].as_array().unwrap().len() - 1;
    let gpus = v["replicas"][last]["stages"][stages]["gpus"].as_array().unwrap().len() - 1;
    if (last, stages, gpus) != (0, 0, 0) {
        v["replicas"][last]["stages"][stages]["gpus"][gpus] = first;
        let e = replan_on(&cluster, &model, &opts, v).unwrap_err().to_string();
        assert!(e.contains("is also replicas[0].stages[0].gpus[0]"), "{e}");
    }
}

/// A plan document says the sequence length it was made for: re-planning or running it at
/// another length is refused naming both, never priced as if it were the same plan.
#[test]
fn a_plan_documents_sequence_length_is_kept_or_refused() {
    let cluster = Cluster::from_spec(&mixed_cluster(2, 0, 0, "A100-80G", 8)).unwrap();
    let model = small_model(8);
    let opts = PlanOptions { global_batch: 16, ..PlanOptions::default() };
    let before = plan_on(&cluster, &model, &opts, SearchMode::Auto);
    let doc = serde_json::to_value(&before).unwrap();
    let current: PlanDocument = serde_json::from_value(doc.clone()).unwrap();
    assert_eq!(current.seq_len, Some(1024), "the document's seq_len is read");
    replan_on(&cluster, &model, &opts, doc.clone()).unwrap();
    let shorter = Model::new(model.spec.clone(), Some(512)).unwrap();
    let e = replan_on(&cluster, &shorter, &opts, doc.clone()).unwrap_err().to_string();
    assert!(e.starts_with("seq_len: the plan runs 1024-token sequences but re-planning was asked for 512"), "{e}");
    let profiles = ProfileSet::default();
    let req = PlanRequest {
        cluster: &cluster,
        model: &shorter,
        profiles: &profiles,
        opts: &opts,
        mode: SearchMode::Auto,
        exhaustive: false,
        seeds: vec![],
    };
    let e = motley_solver::report::given(&req, &current).unwrap_err().to_string();
    assert!(e.starts_with("plan.seq_len: is 1024 but the model is run at 512"), "{e}");
    // A document without one (an older plan file, a hand-written plan) is run at the model's.
    let mut bare = doc;
    bare.as_object_mut().unwrap().remove("seq_len");
    let bare: PlanDocument = serde_json::from_value(bare).unwrap();
    assert_eq!(motley_solver::report::given(&req, &bare).unwrap().seq_len, Some(512));
}
