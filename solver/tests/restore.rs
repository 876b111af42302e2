//! The restore planner (docs/restore.md): its lower bound equals an LP of the fluid relaxation solved
//! by a general simplex (microlp), written per segment rather than through the planner's
//! aggregated max-flow networks; its plans cover every demand, fetch each cloud byte once,
//! relay only bytes the relay has, and never beat the bound.

use std::collections::{BTreeMap, HashMap};

use microlp::{ComparisonOp, OptimizationDirection, Problem};
use motley_solver::restore::{
    lower_bound, plan_restore, CloudSpec, Demand, Holding, Instance, Kind, NodeRates, Part, PartBytes, RestoreScenario, ShardSet,
    SourceTier, Tier, UnitSizes, HELD_DISK, HELD_MEMORY,
};
use proptest::prelude::*;

/// The fluid relaxation as one LP, per (node, segment): minimise T subject to
/// * every needed byte of node d through its memory copy (if it holds it in memory), its disk
///   read (if on its disk) or its NIC in; NIC-in arrivals within d's NIC in and, all together,
///   within every NIC out plus the cloud;
/// * every needed segment no node holds in memory read from some disk holding it or fetched
///   from the cloud, within each disk's and the cloud's rate.
fn lp_bound(inst: &Instance) -> f64 {
    let n = inst.nodes();
    let mb = 1e6; // bytes in MB, rates in MB/s: better conditioned
    let mut p = Problem::new(OptimizationDirection::Minimize);
    let t = p.add_var(1.0, (0.0, f64::INFINITY));
    let mut mem_use: Vec<Vec<(microlp::Variable, f64)>> = vec![vec![]; n];
    let mut disk_local: Vec<Vec<(microlp::Variable, f64)>> = vec![vec![]; n];
    let mut nic: Vec<Vec<(microlp::Variable, f64)>> = vec![vec![]; n];
    let mut net_all = vec![];
    let mut disk_origin: Vec<Vec<(microlp::Variable, f64)>> = vec![vec![]; n];
    let mut cloud_origin = vec![];
    for (s, seg) in inst.segments.iter().enumerate() {
        let b = seg.bytes() / mb;
        let mut needed = false;
        for d in 0..n {
            if !inst.needs[d][s] {
                continue;
            }
            needed = true;
            let mut row = vec![];
            if inst.held[d][s] & HELD_MEMORY != 0 {
                let x = p.add_var(0.0, (0.0, f64::INFINITY));
                mem_use[d].push((x, 1.0));
                row.push((x, 1.0));
            }
            if inst.held[d][s] & HELD_DISK != 0 {
                let x = p.add_var(0.0, (0.0, f64::INFINITY));
                disk_local[d].push((x, 1.0));
                row.push((x, 1.0));
            }
            let x = p.add_var(0.0, (0.0, f64::INFINITY));
            nic[d].push((x, 1.0));
            net_all.push((x, 1.0));
            row.push((x, 1.0));
            p.add_constraint(&row, ComparisonOp::Eq, b);
        }
        if needed && (0..n).all(|h| inst.held[h][s] & HELD_MEMORY == 0) {
            let mut row = vec![];
            for h in (0..n).filter(|&h| inst.held[h][s] & HELD_DISK != 0) {
                let y = p.add_var(0.0, (0.0, f64::INFINITY));
                disk_origin[h].push((y, 1.0));
                row.push((y, 1.0));
            }
            if inst.cloud_holds {
                let y = p.add_var(0.0, (0.0, f64::INFINITY));
                cloud_origin.push((y, 1.0));
                row.push((y, 1.0));
            }
            p.add_constraint(&row, ComparisonOp::Eq, b);
        }
    }
    let mut cap = |mut row: Vec<(microlp::Variable, f64)>, rate: f64| {
        if !row.is_empty() {
            row.push((t, -rate / mb));
            p.add_constraint(&row, ComparisonOp::Le, 0.0);
        }
    };
    for d in 0..n {
        cap(mem_use[d].clone(), inst.mem[d]);
        cap(disk_local[d].clone(), inst.disk[d]);
        cap(nic[d].clone(), inst.nic_in[d]);
        cap(disk_origin[d].clone(), inst.disk[d]);
    }
    let out_total: f64 = inst.nic_out.iter().sum::<f64>() + if inst.cloud_holds { inst.cloud } else { 0.0 };
    cap(net_all, out_total);
    cap(cloud_origin, inst.cloud);
    match p.solve().expect("the LP is feasible") {
        microlp::SolveOutcome::Solution(sol) => {
            assert_eq!(sol.status(), microlp::SolutionStatus::Optimal);
            sol.objective()
        }
        other => panic!("the LP stopped early: {other:?}"),
    }
}

/// A small random scenario from a seed: 2-5 nodes, 1-4 layers, TP degrees in {1, 2, 4} for
/// holdings and demands, random tiers and rates.
fn random_scenario(seed: u64) -> RestoreScenario {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut next = move |m: u64| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x % m
    };
    let nodes = 2 + next(4) as usize;
    let layers = 1 + next(4) as u32;
    let names: Vec<String> = (0..nodes).map(|i| format!("n{i}")).collect();
    let rate = |next: &mut dyn FnMut(u64) -> u64| [100.0, 400.0, 1200.0, 3500.0, 12000.0, 50000.0][next(6) as usize];
    let node_rates = names
        .iter()
        .map(|name| NodeRates {
            name: name.clone(),
            nic_in_mb_s: rate(&mut next),
            nic_out_mb_s: Some(rate(&mut next)),
            disk_read_mb_s: rate(&mut next),
            mem_copy_mb_s: rate(&mut next),
        })
        .collect();
    let tps = [1u32, 2, 4];
    let set = |next: &mut dyn FnMut(u64) -> u64| {
        let lo = next(u64::from(layers)) as u32;
        let hi = lo + next(u64::from(layers - lo)) as u32;
        let t = tps[next(3) as usize];
        let r0 = next(u64::from(t)) as u32;
        let r1 = r0 + next(u64::from(t - r0)) as u32;
        let parts = match next(3) {
            0 => Some(vec![Part::Model]),
            1 => Some(vec![Part::Optimizer]),
            _ => None,
        };
        ShardSet { layers: format!("{lo}-{hi}"), parts, tp_size: t, tp_ranks: Some(format!("{r0}-{r1}")) }
    };
    let mut holdings = vec![];
    for _ in 0..next(2 * nodes as u64 + 1) {
        let node = names[next(nodes as u64) as usize].clone();
        let tier = if next(2) == 0 { Tier::Memory } else { Tier::Disk };
        holdings.push(Holding { node, tier, shards: vec![set(&mut next)] });
    }
    let mut demands = vec![];
    for _ in 0..1 + next(2 * nodes as u64) {
        let node = names[next(nodes as u64) as usize].clone();
        demands.push(Demand { node, shards: vec![set(&mut next)] });
    }
    RestoreScenario {
        name: format!("random-{seed}"),
        cloud: CloudSpec { egress_mb_s: rate(&mut next), holds_step: true },
        units: UnitSizes {
            layers,
            layer: PartBytes { model: 1_000_000 + next(100_000_000), optimizer: 1_000_000 + next(600_000_000) },
            embed: None,
            head: None,
        },
        nodes: node_rates,
        holdings,
        demands,
        chunk_bytes: None,
    }
}

/// Every needed byte of every node arrives exactly once; each byte leaves the cloud at most
/// once; a relay forwards only bytes it holds or received; the makespan is at least the bound.
fn check_plan(sc: &RestoreScenario) {
    let inst = Instance::new(sc).unwrap();
    let plan = plan_restore(sc).unwrap();
    let lb = plan.lower_bound_s;
    assert!(plan.makespan_s >= lb * (1.0 - 1e-9), "{}: makespan {} below the bound {lb}", sc.name, plan.makespan_s);
    let name_of = |i: usize| sc.nodes[i].name.clone();
    let idx: HashMap<String, usize> = sc.nodes.iter().enumerate().map(|(i, n)| (n.name.clone(), i)).collect();
    let unit_key = |layer: &str, part: Part| (layer.to_string(), part);
    let unit_of: HashMap<(String, Part), usize> =
        inst.units.iter().enumerate().map(|(i, u)| (unit_key(&sc.units.label(u.id.pos), u.id.part), i)).collect();
    // Byte intervals received per (node, unit).
    let mut got: BTreeMap<(usize, usize), Vec<(u64, u64)>> = BTreeMap::new();
    let mut cloud: BTreeMap<usize, Vec<(u64, u64)>> = BTreeMap::new();
    for tr in &plan.transfers {
        let u = unit_of[&unit_key(&tr.layer, tr.part)];
        let to = idx[&tr.to];
        got.entry((to, u)).or_default().push((tr.offset, tr.offset + tr.bytes));
        if tr.kind == Kind::Cloud {
            cloud.entry(u).or_default().push((tr.offset, tr.offset + tr.bytes));
        }
        // The source has these bytes: it holds them in that tier, or received them (relay).
        if let Some(from) = idx.get(&tr.from) {
            let segs =
                inst.segments.iter().enumerate().filter(|(_, s)| s.unit == u && s.start >= tr.offset && s.end <= tr.offset + tr.bytes);
            for (s, _) in segs {
                let held = inst.held[*from][s];
                let ok = match (tr.tier, tr.relay) {
                    (SourceTier::Disk, _) => held & HELD_DISK != 0,
                    (SourceTier::Memory, false) => held != 0,
                    _ => inst.needs[*from][s] || held != 0,
                };
                assert!(ok, "{}: {} sends segment {s} it does not have ({:?})", sc.name, name_of(*from), tr);
            }
        }
    }
    for (u, mut v) in cloud {
        v.sort();
        assert!(v.windows(2).all(|w| w[0].1 <= w[1].0), "{}: unit {u} fetched from the cloud twice: {v:?}", sc.name);
    }
    for d in 0..inst.nodes() {
        for (s, seg) in inst.segments.iter().enumerate() {
            let have = got.get(&(d, seg.unit)).map_or(0, |v| v.iter().filter(|(a, b)| *a <= seg.start && seg.end <= *b).count());
            assert_eq!(have, usize::from(inst.needs[d][s]), "{}: node {} segment {s}", sc.name, name_of(d));
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]
    #[test]
    fn bound_equals_the_lp_and_plans_are_sound(seed in any::<u64>()) {
        let sc = random_scenario(seed);
        let inst = Instance::new(&sc).unwrap();
        let lb = lower_bound(&inst).value();
        let lp = lp_bound(&inst);
        prop_assert!((lb - lp).abs() <= 1e-6 * lp.max(1e-9), "{}: max-flow {lb} vs LP {lp}", sc.name);
        check_plan(&sc);
    }
}

fn node(name: &str, nic: f64, disk: f64) -> NodeRates {
    NodeRates { name: name.into(), nic_in_mb_s: nic, nic_out_mb_s: None, disk_read_mb_s: disk, mem_copy_mb_s: 10_000.0 }
}

fn shards(layers: &str, tp: u32, ranks: &str) -> Vec<ShardSet> {
    vec![ShardSet { layers: layers.into(), parts: None, tp_size: tp, tp_ranks: Some(ranks.into()) }]
}

/// AutoHet's scenario B in small: the node left holds the last third on disk at TP 2 and
/// needs the whole model at TP 4 twice (two replicas); the rest comes from the cloud once.
#[test]
fn missing_bytes_come_from_the_cloud_once_and_shards_are_resliced() {
    let sc = RestoreScenario {
        name: "b".into(),
        cloud: CloudSpec { egress_mb_s: 1200.0, holds_step: true },
        units: UnitSizes { layers: 3, layer: PartBytes { model: 2_000_000_000, optimizer: 12_000_000_000 }, embed: None, head: None },
        nodes: vec![node("n1", 50_000.0, 3500.0)],
        holdings: vec![Holding { node: "n1".into(), tier: Tier::Disk, shards: shards("2", 2, "0-1") }],
        demands: vec![
            Demand { node: "n1".into(), shards: shards("all", 4, "0-3") },
            Demand { node: "n1".into(), shards: shards("all", 4, "0-3") },
        ],
        chunk_bytes: None,
    };
    let p = plan_restore(&sc).unwrap();
    let third = 14e9;
    assert!((p.lower_bound_s - 2.0 * third / 1.2e9).abs() < 1e-6, "{}", p.lower_bound_s);
    assert!((p.makespan_s - p.lower_bound_s).abs() < 1e-6 * p.lower_bound_s);
    assert_eq!((p.bytes.cloud, p.bytes.local, p.bytes.peer), (28_000_000_000, 14_000_000_000, 0));
    assert!((p.cloud_only_s - 6.0 * third / 1.2e9).abs() < 1e-6, "each replica its own: {}", p.cloud_only_s);
    // The TP 4 shards of layer 2 come from the TP 2 files, at the right offsets in them.
    let l2: Vec<_> = p.transfers.iter().filter(|t| t.layer == "2" && t.part == Part::Model).collect();
    assert_eq!(l2.len(), 2, "{l2:?}");
    for t in l2 {
        let s = t.source_shard.expect("read from a shard file");
        assert_eq!((s.tp_size, s.offset, t.bytes), (2, 0, 1_000_000_000));
        assert_eq!(u64::from(s.tp_rank) * 1_000_000_000, t.offset);
    }
    check_plan(&sc);
}

/// AutoHet's scenario C in small: a new node needs what one old node holds on disk; the old
/// node reads it once and sends it from memory, the cloud supplying a share in parallel: the
/// bound is the disk and the cloud together (14 GB at 3.5 + 1.2 GB/s).
#[test]
fn a_holder_reads_once_and_serves_peers_from_memory() {
    let sc = RestoreScenario {
        name: "c".into(),
        cloud: CloudSpec { egress_mb_s: 1200.0, holds_step: true },
        units: UnitSizes { layers: 2, layer: PartBytes { model: 1_000_000_000, optimizer: 6_000_000_000 }, embed: None, head: None },
        nodes: vec![node("n0", 50_000.0, 3500.0), node("n2", 50_000.0, 3500.0)],
        holdings: vec![Holding { node: "n0".into(), tier: Tier::Disk, shards: shards("all", 2, "0-1") }],
        demands: vec![
            Demand { node: "n0".into(), shards: shards("all", 2, "0-1") },
            Demand { node: "n2".into(), shards: shards("all", 2, "0-1") },
        ],
        chunk_bytes: Some(1 << 20),
    };
    let p = plan_restore(&sc).unwrap();
    assert!((p.lower_bound_s - 14e9 / 4.7e9).abs() < 1e-6, "{}", p.lower_bound_s);
    assert_eq!(p.bytes.local + p.bytes.peer + p.bytes.cloud, 28_000_000_000);
    assert!(p.makespan_s <= p.lower_bound_s * 1.25, "{} vs {}", p.makespan_s, p.lower_bound_s);
    check_plan(&sc);
}

#[test]
fn bad_scenarios_name_the_field() {
    let base = random_scenario(7);
    let err = |f: &dyn Fn(&mut RestoreScenario)| {
        let mut sc = base.clone();
        f(&mut sc);
        plan_restore(&sc).unwrap_err().to_string()
    };
    assert!(err(&|s| s.cloud.egress_mb_s = 0.0).starts_with("cloud.egress_mb_s:"));
    assert!(err(&|s| s.nodes[0].disk_read_mb_s = -1.0).starts_with("nodes[0].disk_read_mb_s:"));
    assert!(err(&|s| s.demands[0].node = "nope".into()).starts_with("demands[0].node: 'nope' is not in nodes"));
    assert!(err(&|s| s.demands[0].shards[0].layers = "0-99".into()).starts_with("demands[0].shards[0].layers: '0-99' is out of range"));
    assert!(err(&|s| s.demands[0].shards[0].tp_ranks = Some("9".into())).starts_with("demands[0].shards[0].tp_ranks:"));
    assert!(err(&|s| s.demands[0].shards[0].layers = "embed".into()).contains("add units.embed"));
    let e = err(&|s| {
        s.holdings.clear();
        s.cloud.holds_step = false;
    });
    assert!(e.starts_with("cloud.holds_step: is false and no node holds"), "{e}");
}

/// A three-stage pipeline lost its last node: the two survivors hold their own stages' units
/// on disk and need them again, the replacement needs the lost stage, which only the cloud
/// holds. The replacement's NIC sets the makespan whatever the survivors do, so reading their
/// own disks costs no time and spares the cloud (egress money, one link for every job):
/// the cloud serves only the lost stage (docs/recovery.md, step 5).
#[test]
fn a_tie_on_the_makespan_goes_to_local_reads_not_the_cloud() {
    let layer = PartBytes { model: 228_000, optimizer: 1_140_000 };
    let stage = layer.model + layer.optimizer;
    let rates = |name: &str, nic: f64| NodeRates {
        name: name.into(),
        nic_in_mb_s: nic,
        nic_out_mb_s: None,
        disk_read_mb_s: 200.0,
        mem_copy_mb_s: 10_000.0,
    };
    let sc = RestoreScenario {
        name: "lost-last-stage".into(),
        cloud: CloudSpec { egress_mb_s: 2000.0, holds_step: true },
        units: UnitSizes { layers: 3, layer, embed: None, head: None },
        nodes: vec![rates("n0", 50_000.0), rates("n1", 50_000.0), rates("n3", 100.0)],
        holdings: vec![
            Holding { node: "n0".into(), tier: Tier::Disk, shards: shards("0", 1, "0") },
            Holding { node: "n1".into(), tier: Tier::Disk, shards: shards("1", 1, "0") },
        ],
        demands: vec![
            Demand { node: "n0".into(), shards: shards("0", 1, "0") },
            Demand { node: "n1".into(), shards: shards("1", 1, "0") },
            Demand { node: "n3".into(), shards: shards("2", 1, "0") },
        ],
        chunk_bytes: None,
    };
    let p = plan_restore(&sc).unwrap();
    // The replacement's NIC in: one stage at 100 MB/s.
    let nic = stage as f64 / 100e6;
    assert!((p.lower_bound_s - nic).abs() < 1e-9 * nic, "{}", p.lower_bound_s);
    assert!((p.makespan_s - nic).abs() < 1e-9 * nic, "{}", p.makespan_s);
    assert_eq!((p.bytes.local, p.bytes.peer, p.bytes.cloud), (2 * stage, 0, stage), "{:?}", p.transfers);
    for t in &p.transfers {
        let expect = if t.to == "n3" { (Kind::Cloud, SourceTier::Cloud) } else { (Kind::Local, SourceTier::Disk) };
        assert_eq!((t.kind, t.tier), expect, "{t:?}");
    }
    check_plan(&sc);
}

/// Where a node could read its units from its own disk or from a peer's memory in the same
/// time, it reads its disk: peer bytes share the NICs with every other flow of the restore.
#[test]
fn a_tie_between_a_local_disk_and_a_peer_goes_to_the_local_disk() {
    let rates = |name: &str| NodeRates {
        name: name.into(),
        nic_in_mb_s: 50_000.0,
        nic_out_mb_s: None,
        disk_read_mb_s: 3500.0,
        mem_copy_mb_s: 10_000.0,
    };
    let sc = RestoreScenario {
        name: "disk-or-peer".into(),
        cloud: CloudSpec { egress_mb_s: 100.0, holds_step: true },
        units: UnitSizes { layers: 2, layer: PartBytes { model: 1_000_000, optimizer: 6_000_000 }, embed: None, head: None },
        nodes: vec![rates("n0"), rates("n1")],
        holdings: vec![
            Holding { node: "n0".into(), tier: Tier::Disk, shards: shards("0", 1, "0") },
            Holding { node: "n1".into(), tier: Tier::Memory, shards: shards("0", 1, "0") },
        ],
        demands: vec![
            Demand { node: "n0".into(), shards: shards("0", 1, "0") },
            // Only the cloud holds layer 1: it sets the makespan.
            Demand { node: "n1".into(), shards: shards("1", 1, "0") },
        ],
        chunk_bytes: None,
    };
    let p = plan_restore(&sc).unwrap();
    let cloud = 7e6 / 100e6;
    assert!((p.makespan_s - cloud).abs() < 1e-9 * cloud, "{}", p.makespan_s);
    assert_eq!((p.bytes.local, p.bytes.peer, p.bytes.cloud), (7_000_000, 0, 7_000_000), "{:?}", p.transfers);
    check_plan(&sc);
}
