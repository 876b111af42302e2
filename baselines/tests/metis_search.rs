//! The branch-and-bound search of Metis's space (and of the union) finds the same optimum
//! as pricing every plan of the space one by one with `evaluate`, on clusters small enough
//! to enumerate, with Metis's quirks and with them fixed.

use std::path::Path;

use motley_baselines::metis::{search, MetisCluster, MetisModel, MetisPlan, MetisProfiles, MetisSettings, Quirks, Space};
use serde_json::Value;

/// Profiles of an L-layer model cut from the 10-layer synthetic set (embedding, L-2 blocks,
/// head), keeping only batch sizes <= max_bs so the space stays small.
fn cut_profiles(layers: usize, max_bs: u32) -> Vec<(String, String)> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/metis/synth_L10");
    let mut out = vec![];
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        let name = p.file_name().unwrap().to_string_lossy().into_owned();
        let (_, tp, bs) = motley_baselines::metis::input::parse_profile_name(&name).unwrap();
        if bs > max_bs || tp > 8 {
            continue;
        }
        let mut v: Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
        let cut = |a: &mut Value| {
            let arr = a.as_array().unwrap().clone();
            let mut c = vec![arr[0].clone()];
            // Vary the blocks a little so partitions are not all alike.
            for i in 1..layers - 1 {
                let x = arr[1].as_f64().unwrap() * (1.0 + 0.1 * i as f64);
                c.push(Value::from(x));
            }
            c.push(arr[9].clone());
            *a = Value::from(c);
        };
        cut(&mut v["execution_time"]["layer_compute_total_ms"]);
        cut(&mut v["execution_memory"]["layer_memory_total_mb"]);
        cut(&mut v["model"]["parameters"]["parameters_per_layer_bytes"]);
        let sum: f64 = v["execution_time"]["layer_compute_total_ms"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).sum();
        let fb = v["execution_time"]["between_forward_backward_time_ms"].as_f64().unwrap();
        v["execution_time"]["forward_backward_time_ms"] = Value::from(sum + fb);
        out.push((name, v.to_string()));
    }
    out
}

const CLUSTERFILE: &str = r#"{"10.0.0.1": {"instance_type": "V100", "inter_bandwidth": 10, "intra_bandwidth": 50, "memory": 16},
 "10.0.0.2": {"instance_type": "A100", "inter_bandwidth": 8, "intra_bandwidth": 46, "memory": 80}}"#;

fn compositions(n: u32, parts: usize, sizes: &[u32]) -> Vec<Vec<u32>> {
    if parts == 0 {
        return if n == 0 { vec![vec![]] } else { vec![] };
    }
    let mut out = vec![];
    for &g in sizes.iter().filter(|&&g| g <= n) {
        for mut rest in compositions(n - g, parts - 1, sizes) {
            rest.insert(0, g);
            out.push(rest);
        }
    }
    out
}

fn partitions(layers: usize, parts: usize) -> Vec<Vec<usize>> {
    fn go(a: usize, layers: usize, parts: usize, cur: &mut Vec<usize>, out: &mut Vec<Vec<usize>>) {
        if parts == 1 {
            cur.push(layers);
            out.push(cur.clone());
            cur.pop();
            return;
        }
        for b in a + 1..=layers - (parts - 1) {
            cur.push(b);
            go(b, layers, parts - 1, cur, out);
            cur.pop();
        }
    }
    let mut out = vec![];
    if parts <= layers {
        go(0, layers, parts, &mut vec![0], &mut out);
    }
    out
}

/// Price every plan of the space; return the cheapest that fits.
fn brute_force(m: &MetisModel, union: bool, variance: f64) -> f64 {
    let n = m.cluster.total_gpus();
    let gbs = m.settings.global_batch;
    let l = m.settings.layers;
    let gpn = m.cluster.gpus_per_node;
    let mut best = f64::INFINITY;
    for order in [vec!["V100", "A100"], vec!["A100", "V100"]] {
        for batches in (1..=gbs).filter(|&d| gbs.is_multiple_of(d)) {
            for s in 1..=(n as usize).min(l) {
                let sizes: Vec<u32> = if union {
                    (1..=n).filter(|g| g.is_power_of_two() || g % gpn == 0).collect()
                } else {
                    let floor = ((n as usize / s).max(s / n as usize)) as f64 * variance;
                    (0..8).map(|k| 1u32 << k).filter(|&g| g <= n && g as f64 >= floor).collect()
                };
                for groups in compositions(n, s, &sizes) {
                    let options: Vec<Vec<[u32; 2]>> = groups
                        .iter()
                        .map(|&g| {
                            (0..8)
                                .map(|k| 1u32 << k)
                                .filter(|&tp| g % tp == 0 && tp <= m.profiles.max_tp)
                                .map(|tp| [g / tp, tp])
                                .filter(|&[dp, _]| {
                                    let metis = g.is_power_of_two() && dp.is_power_of_two();
                                    let mbs = gbs / dp / batches;
                                    (metis || (union && gbs.is_multiple_of(dp * batches))) && mbs >= 1 && mbs <= m.profiles.max_bs
                                })
                                .collect()
                        })
                        .collect();
                    let mut strategies = vec![vec![]];
                    for o in &options {
                        strategies =
                            strategies.iter().flat_map(|p: &Vec<[u32; 2]>| o.iter().map(move |x| [p.clone(), vec![*x]].concat())).collect();
                    }
                    for st in &strategies {
                        for part in partitions(l, s) {
                            let plan = MetisPlan {
                                node_sequence: order.iter().map(|s| s.to_string()).collect(),
                                device_groups: groups.clone(),
                                strategies: st.clone(),
                                batches,
                                layer_partition: part,
                            };
                            if let Ok(c) = m.evaluate(&plan) {
                                if c.fits && c.cost_ms < best {
                                    best = c.cost_ms;
                                }
                            }
                        }
                    }
                }
            }
        }
    }
    best
}

fn check(hostfile: &str, layers: usize, gbs: u32, quirks: Quirks) {
    let profiles = MetisProfiles::load(&cut_profiles(layers, gbs), layers, None).unwrap();
    let cluster = MetisCluster::parse(hostfile, CLUSTERFILE, &profiles).unwrap();
    let settings = MetisSettings { global_batch: gbs, layers, hidden: 4096.0, seq: 1024.0, vocab: 51200.0 };
    let m = MetisModel { profiles: &profiles, cluster: &cluster, settings, quirks };
    for (space, union, variance) in
        [(Space::Metis { variance: 1.0 }, false, 1.0), (Space::Metis { variance: 0.0 }, false, 0.0), (Space::Union, true, 0.0)]
    {
        let want = brute_force(&m, union, variance);
        let got = search(&m, space, u64::MAX);
        assert!(got.proven_optimal);
        let Some((plan, cost)) = got.best else {
            assert!(want.is_infinite(), "{space:?} {quirks:?}: search found nothing, brute force {want}");
            assert!(!union, "the union (every other space's superset) must hold a plan here");
            continue;
        };
        assert!((cost.cost_ms - want).abs() < 1e-6, "{space:?} {quirks:?}: search {} vs brute force {want}, plan {plan:?}", cost.cost_ms);
        assert!(cost.fits);
        eprintln!("{space:?}: {} {}", cost.cost_ms, serde_json::to_string(&plan).unwrap());
    }
}

#[test]
fn search_equals_brute_force_with_metis_quirks() {
    check("10.0.0.1 slots=2\n10.0.0.1 slots=2\n10.0.0.2 slots=2\n10.0.0.2 slots=2\n", 5, 8, Quirks::default());
    check("10.0.0.1 slots=4\n10.0.0.2 slots=4\n", 6, 16, Quirks::default());
}

#[test]
fn search_equals_brute_force_with_quirks_fixed() {
    check("10.0.0.1 slots=2\n10.0.0.2 slots=2\n10.0.0.2 slots=2\n", 5, 8, Quirks::fixed());
    check("10.0.0.1 slots=4\n10.0.0.2 slots=4\n", 6, 16, Quirks::fixed());
}

#[test]
fn search_equals_brute_force_on_uneven_types() {
    check("10.0.0.2 slots=4\n10.0.0.1 slots=4\n10.0.0.1 slots=4\n", 4, 4, Quirks::default());
}
