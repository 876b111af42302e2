//! The exact search under Espresso's estimator equals the brute-force oracle (every
//! allocation of the space placed and priced), and finds RESULTS.md's optima (cheaper where
//! Espresso's pipeline-depth boundaries hid a plan).

use crate::common_espresso;

use common_espresso::{estimator_for, placer_inputs};
use motley_baselines::espresso::{EspressoPlan, Search, SpaceLimits};

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
    for (job, expect) in [
        ("llama_1.3b", 0.022875407404873847f64),
        ("llama_3b", 0.1299039583711252),
        ("llama_7b", 0.4868276899089499),
        ("ViT", 0.008777587292506312),
        ("open_llama_3b_v2", 0.2019491016738102),
    ] {
        let t0 = std::time::Instant::now();
        let (best, allocs, placed) = run(job, 12, false);
        let t1 = t0.elapsed();
        let (oracle, oallocs, oplaced) = run(job, 12, true);
        let b = best.unwrap();
        let o = oracle.unwrap();
        eprintln!(
            "{job}: search {} ({placed}/{allocs} placed, {t1:?}); oracle {} ({oplaced}/{oallocs}, {:?})",
            describe(&b),
            describe(&o),
            t0.elapsed() - t1
        );
        assert_eq!(b.estimate.cost.to_bits(), o.estimate.cost.to_bits(), "{job}");
        assert_eq!(b.estimate.cost.to_bits(), expect.to_bits(), "{job}: {}", describe(&b));
    }
}

/// Every order and split of every allocation, priced one by one: the full-space search's optimum.
fn brute_full(est: &motley_baselines::espresso::Estimator, quotas: &[u32], max_pp: usize) -> f64 {
    let (gpus, peaks) = placer_inputs(est);
    let m = est.job.gradient_accumulation_steps;
    let per = est.job.global_batch_size / m;
    let l = est.job.model_layer.unwrap_or(est.job.num_layers);
    let mut best = f64::INFINITY;
    for dp in (1..=per).filter(|&d| per.is_multiple_of(d)) {
        let placer = motley_baselines::espresso::Placer::new(est, &gpus, &peaks, dp);
        // Every sequence of GPU types of length 1..=max_pp within the quotas, every split.
        fn rec(
            placer: &motley_baselines::espresso::Placer,
            order: &mut Vec<usize>,
            left: &mut Vec<u32>,
            max_pp: usize,
            l: u32,
            best: &mut f64,
            slo: f64,
        ) {
            if !order.is_empty() {
                for split in compositions(l, order.len()) {
                    let e = placer.price(order, &split);
                    if e.fits && e.iteration_time < slo && e.cost < *best {
                        *best = e.cost;
                    }
                }
            }
            if order.len() == max_pp {
                return;
            }
            for t in 0..left.len() {
                if left[t] > 0 {
                    left[t] -= 1;
                    order.push(t);
                    rec(placer, order, left, max_pp, l, best, slo);
                    order.pop();
                    left[t] += 1;
                }
            }
        }
        let mut left: Vec<u32> = quotas.iter().map(|q| q / dp).collect();
        rec(&placer, &mut vec![], &mut left, max_pp, l, &mut best, est.job.slo);
    }
    best
}

fn compositions(total: u32, parts: usize) -> Vec<Vec<u32>> {
    if parts == 1 {
        return vec![vec![total]];
    }
    let mut out = vec![];
    for first in 1..=total.saturating_sub(parts as u32 - 1) {
        for mut rest in compositions(total - first, parts - 1) {
            rest.insert(0, first);
            out.push(rest);
        }
    }
    out
}

#[test]
fn full_space_search_equals_brute_force_and_never_loses_to_the_placer() {
    for (job, mc) in [
        ("jobs/this_run/llama_1.3b.json", "jobs/this_run/llama_1.3b.model_config.json"),
        ("jobs/this_run/ViT.json", "jobs/this_run/ViT.model_config.json"),
    ] {
        let est = estimator_for(job, mc);
        let (gpus, peaks) = placer_inputs(&est);
        let quotas = vec![2, 1, 2, 2];
        let limits = SpaceLimits { quotas: quotas.clone(), max_stages: 3, dps: vec![] };
        let s = Search { est: &est, placer_gpus: &gpus, table_peaks: &peaks, limits: &limits };
        let full = s.run_full();
        assert!(!full.counters.budget_cut);
        let placer_best = s.run().best.map_or(f64::INFINITY, |b| b.estimate.cost);
        let brute = brute_full(&est, &quotas, 3);
        let got = full.best.map_or(f64::INFINITY, |b| b.estimate.cost);
        assert!(got.is_finite(), "{job}: no plan found");
        assert_eq!(got.to_bits(), brute.to_bits(), "{job}: full search {got} vs brute force {brute}");
        assert!(got <= placer_best, "{job}");
    }
}
