//! The exact search under Espresso's estimator equals the brute-force oracle (every
//! allocation of the space placed and priced), and finds RESULTS.md's optima (cheaper where
//! Espresso's pipeline-depth boundaries hid a plan).

mod common_espresso;

use common_espresso::{estimator_for, placer_inputs};
use motley_solver::espresso::{EspressoPlan, Search, SpaceLimits};

fn run(job: &str, max_stages: u32, exhaustive: bool) -> (Option<EspressoPlan>, u64, u64) {
    let (j, mc) = if job == "open_llama_3b_v2" {
        ("jobs/upstream_examples/open_llama_3b_v2.json".to_string(), "-".to_string())
    } else {
        (format!("jobs/this_run/{job}.json"), format!("jobs/this_run/{job}.model_config.json"))
    };
    let est = estimator_for(&j, &mc);
    let (gpus, peaks) = placer_inputs(&est);
    let limits = SpaceLimits { quotas: vec![16, 8, 16, 16], max_stages, dps: vec![] };
    let s = Search { est: &est, placer_gpus: &gpus, table_peaks: &peaks, limits: &limits };
    let o = if exhaustive { s.exhaustive() } else { s.run() };
    (o.best, o.counters.allocations, o.counters.placed)
}

fn describe(p: &EspressoPlan) -> String {
    format!("dp{} {:?} {:?} {} {}", p.dp, p.order, p.layers, p.estimate.iteration_time, p.estimate.cost)
}

#[test]
fn search_equals_the_oracle_and_beats_espresso() {
    for (job, expect) in [("llama_1.3b", 0.022875407404873847f64), ("llama_3b", 0.1299039583711252), ("llama_7b", 0.4868276899089499), ("ViT", 0.008777587292506312), ("open_llama_3b_v2", 0.2019491016738102)] {
        let t0 = std::time::Instant::now();
        let (best, allocs, placed) = run(job, 12, false);
        let t1 = t0.elapsed();
        let (oracle, oallocs, oplaced) = run(job, 12, true);
        let b = best.unwrap();
        let o = oracle.unwrap();
        eprintln!("{job}: search {} ({placed}/{allocs} placed, {t1:?}); oracle {} ({oplaced}/{oallocs}, {:?})", describe(&b), describe(&o), t0.elapsed() - t1);
        assert_eq!(b.estimate.cost.to_bits(), o.estimate.cost.to_bits(), "{job}");
        assert_eq!(b.estimate.cost.to_bits(), expect.to_bits(), "{job}: {}", describe(&b));
    }
}
