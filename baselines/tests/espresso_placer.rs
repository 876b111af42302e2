//! Espresso's stage placer, replayed: every allocation of the exhaustive enumeration in
//! `placer_golden.tsv` (4185 placements made by Espresso's own code over five jobs) gets the
//! same stage order, the same layers and the same time and cost, or the same "nothing fits".

use crate::common_espresso;

use common_espresso::{estimator_for, placer_inputs};
use motley_baselines::espresso::Placer;

#[test]
fn every_golden_placement_matches_espressos_own_placer() {
    let text = std::fs::read_to_string(common_espresso::data().join("placer_golden.tsv")).unwrap();
    let mut rows = 0;
    let mut last_job = String::new();
    let mut est = None;
    for line in text.lines().skip(1) {
        let c: Vec<&str> = line.split('\t').collect();
        if c[0] != last_job {
            let (job, mc) = match c[0] {
                "upstream_examples/open_llama_3b_v2" => ("jobs/upstream_examples/open_llama_3b_v2.json".to_string(), "-".to_string()),
                other => {
                    let m = other.trim_start_matches("this_run/");
                    (format!("jobs/this_run/{m}.json"), format!("jobs/this_run/{m}.model_config.json"))
                }
            };
            est = Some(estimator_for(&job, &mc));
            last_job = c[0].to_string();
        }
        let est = est.as_ref().unwrap();
        let dp: u32 = c[1].parse().unwrap();
        let (gpus, peaks) = placer_inputs(est);
        let placer = Placer::new(est, &gpus, &peaks, dp);
        let mut counts = vec![0u32; est.gpus.len()];
        for g in c[3].split(',') {
            counts[est.gpus.iter().position(|x| x.name == g).unwrap()] += 1;
        }
        let got = placer.place(&counts);
        if c[4] == "-" {
            assert!(got.is_none(), "{line}: placed {got:?}");
        } else {
            let p = got.unwrap_or_else(|| panic!("{line}: nothing placed"));
            let order: Vec<&str> = p.order.iter().map(|&g| est.gpus[g].name.as_str()).collect();
            assert_eq!(order.join(","), c[4], "{line}");
            let layers: Vec<String> = p.layers.iter().map(|l| l.to_string()).collect();
            assert_eq!(layers.join(","), c[5], "{line}");
            let t: f64 = c[6].parse().unwrap();
            let cost: f64 = c[7].parse().unwrap();
            assert_eq!(p.estimate.iteration_time.to_bits(), t.to_bits(), "{line}");
            assert_eq!(p.estimate.cost.to_bits(), cost.to_bits(), "{line}");
        }
        rows += 1;
    }
    assert!(rows > 4000, "{rows} rows");
}
