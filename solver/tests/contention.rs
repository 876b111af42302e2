//! Flows that share a node's NIC (docs/network.md, "Contention in the cost model"; the
//! dynamic-network paper's eq. 7): the cost model's hop and gradient-sync times against a
//! brute-force reference that places the plan GPU by GPU, lists every flow with the nodes it
//! touches, and counts flows per node directly.

use std::collections::{BTreeMap, BTreeSet};

use motley_solver::cost::{StageKind, SyncContext};
use motley_solver::hardware::{NicKind, NicSpec, NodeSpec};
use motley_solver::placement::{place, Placement};
use motley_solver::plan::{PlanStructure, ReplicaPlan, StagePlan};
use motley_solver::{Cluster, ClusterSpec, CostModel, Model, ModelSpec, PlanOptions, ProfileSet};
use proptest::prelude::*;

const MICRO_BATCH: u32 = 12; // every dp of 1-4 divides it

fn node(name: &str, count: u32, gpu: &str, gpus: u32, nic: NicSpec) -> NodeSpec {
    NodeSpec {
        name: name.into(),
        count: Some(count),
        gpu: gpu.into(),
        gpus,
        intra: None,
        nics: vec![nic],
        rdma_domain: Some("dc".into()),
        spot: false,
        price_per_gpu_hour: None,
        pcie_switch_gbit: None,
        emulate: None,
    }
}

fn cluster(nodes: Vec<NodeSpec>) -> Cluster {
    Cluster::from_spec(&ClusterSpec { name: "t".into(), nodes, gpu_types: vec![] }).unwrap()
}

fn model(layers: u32) -> Model {
    Model::new(ModelSpec::gpt("tiny", layers, 1024, 8, 1024, 8192), None).unwrap()
}

/// `replicas` copies of one pipeline with stages `kinds`, the model's layers split as evenly
/// as they go.
fn uniform(kinds: &[StageKind], replicas: u32, layers: u32) -> PlanStructure {
    let p = kinds.len() as u32;
    let stages = kinds
        .iter()
        .enumerate()
        .map(|(i, &kind)| StagePlan { kind, layers: (i as u32 * layers / p, (i as u32 + 1) * layers / p) })
        .collect();
    PlanStructure { micro_batch: MICRO_BATCH, replicas: vec![ReplicaPlan { stages, micro_batches: 1 }; replicas as usize] }
}

/// The reference's times: per replica its hops, and per stage its ring.
struct Reference {
    hops: Vec<Vec<f64>>,
    rings: Vec<f64>,
}

/// Brute force from the GPUs' placement. A flow touches the nodes of its GPUs; one that
/// touches more than one node crosses each of their NICs. Pipeline phase: the cross-node hops
/// of one replica run at once. Sync phase: every stage's ring (stage i of every replica; the
/// TP shards' rings of a stage share its NICs, so one ring carries the whole layer's bytes).
/// A flow gets its NIC's bandwidth over the flows on it, at its busiest node.
fn reference(cm: &CostModel, plan: &PlanStructure, placed: &Placement) -> Reference {
    let (c, m) = (cm.cluster, cm.model);
    let node_of = |g: &motley_solver::placement::GpuId| c.nodes.iter().position(|n| n.name == g.node).unwrap();
    let nodes = |ri: usize, si: usize| -> BTreeSet<usize> { placed.gpus[ri][si].iter().map(node_of).collect() };
    let hop_bytes = 2.0 * plan.micro_batch as f64 * m.seq_len as f64 * m.hidden() * cm.opts.wire_bytes();
    let mut hops = vec![];
    for (ri, r) in plan.replicas.iter().enumerate() {
        let flows: Vec<BTreeSet<usize>> = (0..r.stages.len() - 1).map(|i| &nodes(ri, i) | &nodes(ri, i + 1)).collect();
        // Half-cycles of steady 1F1B: stage s runs forwards in half s % 2 and backwards in the
        // other. Hop i's activations leave stage i after a forward (half i % 2), its gradients
        // leave stage i+1 after a backward (half (i + 2) % 2): list each flow in its half.
        let half_of = |s: usize, forward: bool| if forward { s % 2 } else { (s + 1) % 2 };
        let mut load: BTreeMap<(usize, usize), u32> = BTreeMap::new();
        let mut halves = vec![];
        for (i, f) in flows.iter().enumerate() {
            let (activations, gradients) = (half_of(i, true), half_of(i + 1, false));
            assert_eq!(activations, gradients, "both ways of a hop in one half");
            halves.push(activations);
            if f.len() > 1 {
                for &n in f {
                    *load.entry((n, activations)).or_default() += 1;
                }
            }
        }
        hops.push(
            flows
                .iter()
                .enumerate()
                .map(|(i, f)| {
                    let (a, b) = (r.stages[i].kind.class, r.stages[i + 1].kind.class);
                    if f.len() == 1 {
                        hop_bytes / (c.intra_bw(a) * 1e9)
                    } else {
                        let share = f.iter().map(|&n| load[&(n, halves[i])]).max().unwrap() as f64;
                        hop_bytes / (c.inter_bw(a, b) / share * 1e9)
                    }
                })
                .collect(),
        );
    }
    let stages = &plan.replicas[0].stages;
    let ring_nodes: Vec<BTreeSet<usize>> =
        (0..stages.len()).map(|si| (0..plan.replicas.len()).flat_map(|ri| nodes(ri, si)).collect()).collect();
    let members = |si: usize| plan.replicas.len() as u32 * stages[si].kind.dp;
    let mut load: BTreeMap<usize, u32> = BTreeMap::new();
    for (si, ns) in ring_nodes.iter().enumerate() {
        if members(si) > 1 && ns.len() > 1 {
            for &n in ns {
                *load.entry(n).or_default() += 1;
            }
        }
    }
    let p = stages.len();
    let rings = (0..p)
        .map(|si| {
            let n = members(si) as f64;
            if n <= 1.0 {
                return 0.0;
            }
            let s = &stages[si];
            let params = (s.layers.1 - s.layers.0) as f64 * m.layer_params + m.ends_params(si == 0, si + 1 == p);
            let bytes = cm.opts.wire_bytes() * params;
            let ns = &ring_nodes[si];
            if ns.len() == 1 {
                2.0 * (n - 1.0) / n * bytes / s.kind.tp as f64 / (c.intra_bw(s.kind.class) * 1e9)
            } else {
                let share = ns.iter().map(|n| load[n]).max().unwrap() as f64;
                2.0 * (n - 1.0) / n * bytes / (c.inter_bw(s.kind.class, s.kind.class) / share * 1e9)
            }
        })
        .collect();
    Reference { hops, rings }
}

/// Every stage larger than a node shares none of its nodes with another stage.
fn large_stages_have_whole_nodes(c: &Cluster, plan: &PlanStructure, placed: &Placement) -> bool {
    let mut holders: BTreeMap<&str, BTreeSet<(usize, usize)>> = BTreeMap::new();
    for (ri, r) in placed.gpus.iter().enumerate() {
        for (si, gpus) in r.iter().enumerate() {
            for g in gpus {
                holders.entry(g.node.as_str()).or_default().insert((ri, si));
            }
        }
    }
    plan.replicas.iter().enumerate().all(|(ri, r)| {
        r.stages.iter().enumerate().all(|(si, s)| {
            s.kind.dp * s.kind.tp <= c.classes[s.kind.class].gpus_per_node
                || placed.gpus[ri][si].iter().all(|g| holders[g.node.as_str()].len() == 1)
        })
    })
}

/// Every replica with GPUs on a node has the same stages there.
fn replicas_share_nodes_alike(placed: &Placement) -> bool {
    let mut on: BTreeMap<&str, BTreeMap<usize, BTreeSet<usize>>> = BTreeMap::new();
    for (ri, r) in placed.gpus.iter().enumerate() {
        for (si, gpus) in r.iter().enumerate() {
            for g in gpus {
                on.entry(g.node.as_str()).or_default().entry(ri).or_default().insert(si);
            }
        }
    }
    on.values().all(|by_replica| by_replica.values().all(|s| Some(s) == by_replica.values().next()))
}

/// Every node holds consecutive stages of each replica on it.
fn nodes_hold_consecutive_stages(placed: &Placement) -> bool {
    placed.gpus.iter().all(|r| {
        let mut on: BTreeMap<&str, BTreeSet<usize>> = BTreeMap::new();
        for (si, gpus) in r.iter().enumerate() {
            for g in gpus {
                on.entry(g.node.as_str()).or_default().insert(si);
            }
        }
        on.values().all(|s| s.last().unwrap() - s.first().unwrap() + 1 == s.len())
    })
}

/// The cost model's times: its hops, and per stage the sync `replica_time` charges.
fn model_times(cm: &CostModel, plan: &PlanStructure) -> (Vec<f64>, Vec<f64>, SyncContext) {
    let r = &plan.replicas[0];
    let kinds: Vec<StageKind> = r.stages.iter().map(|s| s.kind).collect();
    let ctx = cm.sync_context(plan.replicas.len() as u32, &plan.gpus_per_class(cm.cluster.classes.len()), true);
    let shares = cm.ring_contention(&ctx, &kinds);
    let p = kinds.len();
    let rings = (0..p)
        .map(|i| {
            let s = &r.stages[i];
            let params = (s.layers.1 - s.layers.0) as f64 * cm.model.layer_params + cm.model.ends_params(i == 0, i + 1 == p);
            let charged = cm.sync_time(&ctx, s.kind, params) * shares[i];
            let coefficient = cm.sync_coefficients(&ctx, &kinds)[i] * params;
            assert!(close(charged, coefficient), "the search's coefficient {coefficient} against the charge {charged}");
            charged
        })
        .collect();
    (cm.hop_times(&kinds, plan.micro_batch), rings, ctx)
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-9 * a.abs().max(b.abs()) || a == b
}

fn nic(kind: u8) -> NicSpec {
    match kind {
        0 => NicSpec::new("eth0", NicKind::Ethernet, 25.0),
        _ => NicSpec::new("mlx5_0", NicKind::Ib, 200.0),
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, max_global_rejects: 100_000, ..ProptestConfig::default() })]

    /// Random small uniform plans on one or two node classes: the cost model's communication
    /// times are the brute force's.
    #[test]
    fn the_cost_model_counts_the_flows_on_every_nic_as_the_brute_force_does(
        classes in prop::collection::vec((prop_oneof![Just(2u32), Just(4)], 1u32..=6, 0u8..2), 1..=2),
        stages in prop::collection::vec((0usize..2, 1u32..=4, prop_oneof![Just(1u32), Just(2)]), 2..=3),
        replicas in 1u32..=4,
    ) {
        let gpus = ["A100-80G", "V100-32G"];
        let c = cluster(classes.iter().enumerate().map(|(i, &(g, n, k))| node(&format!("n{i}"), n, gpus[i], g, nic(k))).collect());
        let kinds: Vec<StageKind> = stages
            .iter()
            .map(|&(class, dp, tp)| {
                let class = class % c.classes.len();
                StageKind { class, dp, tp: tp.min(c.classes[class].gpus_per_node) }
            })
            .collect();
        let model = model(6);
        let plan = uniform(&kinds, replicas, 6);
        let placed = place(&c, &plan);
        // Plans the cluster cannot hold, and plans placement had to lay out other than the cost
        // model packs them (it reports those: `Placement::split_hops`), are not this test's.
        prop_assume!(placed.as_ref().is_some_and(|p| p.split_hops == 0));
        let placed = placed.unwrap();
        // Nor are plans whose stage larger than a node placement put beside other stages (it
        // fills leftover room TP group by TP group; the cost model gives such a stage whole
        // nodes, `same_node_hops`).
        prop_assume!(large_stages_have_whole_nodes(&c, &plan, &placed));
        // Nor those where placement ran out of the room the packing needs and fell back to TP
        // group by TP group, putting different stages of different replicas on one node.
        prop_assume!(replicas_share_nodes_alike(&placed));
        // Nor those where best fit put two runs of one class of a replica (a, b, a) into one
        // node: the cost model gives every run nodes of its own.
        prop_assume!(nodes_hold_consecutive_stages(&placed));
        let opts = PlanOptions { global_batch: MICRO_BATCH * replicas, ..PlanOptions::default() };
        let profiles = ProfileSet::default();
        let cm = CostModel { cluster: &c, model: &model, profiles: &profiles, opts: &opts };
        // The rule for whether a ring leaves its node at all is the cost model's class-level
        // one (`ring_link`: the class's GPUs fit in one node), checked against placement in
        // tests/network.rs; this test counts the rings that do leave, so it takes the cases
        // where that rule and the placement agree.
        let ctx = cm.sync_context(replicas, &plan.gpus_per_class(c.classes.len()), true);
        prop_assume!(plan.replicas[0].stages.iter().enumerate().all(|(si, s)| {
            let nodes: BTreeSet<&str> = placed.gpus.iter().flat_map(|r| r[si].iter().map(|g| g.node.as_str())).collect();
            replicas * s.kind.dp < 2 || cm.ring_link(&ctx, s.kind).1 == (nodes.len() > 1)
        }));
        let want = reference(&cm, &plan, &placed);
        let (hops, rings, _) = model_times(&cm, &plan);
        for (ri, h) in want.hops.iter().enumerate() {
            for (i, (a, b)) in hops.iter().zip(h).enumerate() {
                prop_assert!(close(*a, *b), "replica {ri} hop {i}: model {a}, reference {b} ({kinds:?}, {replicas} replicas, {placed:?})");
            }
        }
        for (i, (a, b)) in rings.iter().zip(&want.rings).enumerate() {
            prop_assert!(close(*a, *b), "ring of stage {i}: model {a}, reference {b} ({kinds:?}, {replicas} replicas, {placed:?})");
        }
    }
}

/// Two replicas of two 2-GPU stages on two 4-GPU InfiniBand nodes: each replica packs into one
/// node, so both stages' rings cross every node's NIC at once and each gets half of it.
#[test]
fn two_rings_through_one_nic_take_twice_as_long_as_one() {
    let c = cluster(vec![node("ib", 2, "A100-80G", 4, nic(1))]);
    let model = model(4);
    let kinds = [StageKind { class: 0, tp: 1, dp: 2 }; 2];
    let plan = uniform(&kinds, 2, 4);
    let opts = PlanOptions { global_batch: MICRO_BATCH * 2, ..PlanOptions::default() };
    let profiles = ProfileSet::default();
    let cm = CostModel { cluster: &c, model: &model, profiles: &profiles, opts: &opts };
    let (_, rings, ctx) = model_times(&cm, &plan);
    assert_eq!(cm.ring_contention(&ctx, &kinds), vec![2.0, 2.0]);
    for (i, s) in plan.replicas[0].stages.iter().enumerate() {
        let params = (s.layers.1 - s.layers.0) as f64 * model.layer_params + model.ends_params(i == 0, i == 1);
        let alone = cm.sync_time(&ctx, s.kind, params);
        assert!(alone > 0.0);
        assert!(close(rings[i], 2.0 * alone), "stage {i}: {} against twice {alone}", rings[i]);
    }
    // Brute force agrees.
    let placed = place(&c, &plan).unwrap();
    let want = reference(&cm, &plan, &placed);
    assert!(rings.iter().zip(&want.rings).all(|(a, b)| close(*a, *b)));
}

/// The same plan on four 2-GPU nodes: every stage fills a node of its own, no two rings meet
/// on a NIC, and each is priced alone. The hop between them crosses two NICs, alone on both.
#[test]
fn rings_on_nodes_of_their_own_are_priced_alone() {
    let c = cluster(vec![node("ib", 4, "A100-80G", 2, nic(1))]);
    let model = model(4);
    let kinds = [StageKind { class: 0, tp: 1, dp: 2 }; 2];
    let plan = uniform(&kinds, 2, 4);
    let opts = PlanOptions { global_batch: MICRO_BATCH * 2, ..PlanOptions::default() };
    let profiles = ProfileSet::default();
    let cm = CostModel { cluster: &c, model: &model, profiles: &profiles, opts: &opts };
    let (hops, rings, ctx) = model_times(&cm, &plan);
    assert_eq!(cm.ring_contention(&ctx, &kinds), vec![1.0, 1.0]);
    for (i, s) in plan.replicas[0].stages.iter().enumerate() {
        let params = (s.layers.1 - s.layers.0) as f64 * model.layer_params + model.ends_params(i == 0, i == 1);
        assert_eq!(rings[i], cm.sync_time(&ctx, s.kind, params), "stage {i}");
    }
    let lone_hop = 2.0 * 2.0 * MICRO_BATCH as f64 * model.seq_len as f64 * model.hidden() / (c.inter_bw(0, 0) * 1e9);
    assert!(close(hops[0], lone_hop), "{} against {lone_hop}", hops[0]);
}

/// Three one-node stages in a row: the middle stage's hops take turns (one carries traffic in
/// the half of the 1F1B cycle the other does not), so each has the NIC alone. Two stages in the
/// middle node: the hops in and out of it run in one half and share its NIC.
#[test]
fn hops_share_a_node_only_in_one_half_of_the_cycle() {
    let c = cluster(vec![node("ib", 3, "A100-80G", 2, nic(1))]);
    let model = model(6);
    let profiles = ProfileSet::default();
    let opts = PlanOptions { global_batch: MICRO_BATCH, ..PlanOptions::default() };
    let cm = CostModel { cluster: &c, model: &model, profiles: &profiles, opts: &opts };
    let two = StageKind { class: 0, tp: 1, dp: 2 };
    let lone = cm.hop_times(&[two; 2], MICRO_BATCH)[0];
    let three = cm.hop_times(&[two; 3], MICRO_BATCH);
    assert!(close(three[0], lone) && close(three[1], lone), "{three:?} against {lone}");
    let one = StageKind { class: 0, tp: 1, dp: 1 };
    let four = cm.hop_times(&[two, one, one, two], MICRO_BATCH);
    assert!(close(four[0], 2.0 * lone) && close(four[2], 2.0 * lone), "{four:?} against twice {lone}");
    assert!(four[1] < lone, "stages 1 and 2 share a node: NVLink");
}
