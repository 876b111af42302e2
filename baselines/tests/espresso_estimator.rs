//! Espresso's estimator, reproduced bit for bit: every row of `estimator_golden.tsv` (times,
//! costs and memory verdicts computed by Espresso's own code on its own files: the README
//! example, the optima of RESULTS.md, every GPU type, dp 1/2/4, pp 1..6, out-of-memory plans)
//! must come out as the same f64.

use crate::common_espresso;

use common_espresso::estimator_for;
use motley_baselines::espresso::OOM_TIME;

fn data() -> std::path::PathBuf {
    common_espresso::data()
}

fn read(p: &std::path::Path) -> String {
    std::fs::read_to_string(p).unwrap()
}

#[test]
fn every_golden_row_matches_espressos_own_code_bit_for_bit() {
    let text = read(&data().join("estimator_golden.tsv"));
    let mut rows = 0;
    for line in text.lines().skip(1) {
        let c: Vec<&str> = line.split('\t').collect();
        let est = estimator_for(c[0], c[1]);
        let dp: u32 = c[2].parse().unwrap();
        let plan: Vec<(usize, u32)> = c[3]
            .split(',')
            .map(|s| {
                let (g, l) = s.split_once(':').unwrap();
                (est.gpus.iter().position(|x| x.name == g).unwrap(), l.parse().unwrap())
            })
            .collect();
        let e = est.estimate(&plan, dp);
        let fits = c[6] == "true";
        assert_eq!(e.fits, fits, "{line}");
        assert_eq!(e.micro_batch.to_string(), c[8], "{line}");
        if fits {
            let t: f64 = c[4].parse().unwrap();
            let cost: f64 = c[5].parse().unwrap();
            assert_eq!(e.iteration_time.to_bits(), t.to_bits(), "time {} vs {t}: {line}", e.iteration_time);
            assert_eq!(e.cost.to_bits(), cost.to_bits(), "cost {} vs {cost}: {line}", e.cost);
        } else {
            assert_eq!(e.iteration_time, OOM_TIME);
            let excess: f64 = c[9].parse().unwrap();
            assert!((e.oom_excess_mib - excess).abs() <= 1e-9 * excess, "{} vs {excess}", e.oom_excess_mib);
        }
        let mem: Vec<f64> = c[10].split(';').map(|x| x.parse().unwrap()).collect();
        for (s, m) in e.stages.iter().zip(&mem) {
            assert_eq!(s.memory.to_bits(), m.to_bits(), "stage memory {} vs {m}: {line}", s.memory);
        }
        rows += 1;
    }
    assert!(rows >= 50, "golden file has {rows} rows");
}

#[test]
fn readme_example_prices_as_espressos_result_json() {
    let est = estimator_for("jobs/upstream_examples/open_llama_3b_v2.json", "-");
    let g = |n: &str| est.gpus.iter().position(|x| x.name == n).unwrap();
    let e = est.estimate(&[(g("a6000-pcie4-48gb"), 11), (g("a6000-pcie4-48gb"), 12), (g("3090-pcie4-24gb"), 3)], 1);
    assert_eq!(format!("{:.3}", e.iteration_time), "50.139");
    assert_eq!(format!("{:.5}", e.cost), "0.20195");
}
