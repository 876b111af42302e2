//! The price of a plan's pipeline against the 1F1B schedule its picture draws
//! (`motley_contract::timeline::one_f_one_b`: every pass waits for its stage and its input, each hop
//! a latency on the dependencies): a slow hop's round trip that the stages cannot hide is in
//! the price's period as in the drawing (solver/README.md, "The cost model").

use crate::common;
use common::json;
use motley_contract::timeline::one_f_one_b;
use motley_solver::cost::pipeline_period;

/// (priced pipeline, drawn pipeline, micro-batches) of every replica of `motley plan ARGS`:
/// the price's latency plus `m - 1` periods from the plan's own stage and hop times (what its
/// iteration time holds besides the exposed gradient sync and the optimizer step), and the end
/// of the schedule drawn from the same times.
fn priced_and_drawn(args: &[&str]) -> Vec<(f64, f64, u32)> {
    let plan = json(&[&["plan"][..], args].concat());
    plan["replicas"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            let stages = r["stages"].as_array().unwrap();
            let fwd: Vec<f64> = stages.iter().map(|s| s["fwd_s"].as_f64().unwrap()).collect();
            let bwd: Vec<f64> = stages.iter().map(|s| s["bwd_s"].as_f64().unwrap()).collect();
            let hops: Vec<f64> = r["hops_s"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect();
            let m = r["micro_batches"].as_u64().unwrap() as u32;
            let busy: Vec<f64> = fwd.iter().zip(&bwd).map(|(f, b)| f + b).collect();
            let latency = busy.iter().sum::<f64>() + hops.iter().sum::<f64>();
            let priced = latency + (m - 1) as f64 * pipeline_period(&busy, &hops, false);
            assert!(priced <= r["iteration_time_s"].as_f64().unwrap() * (1.0 + 1e-12), "the iteration holds the pipeline");
            let drawn = one_f_one_b(&fwd, &bwd, &hops, m).iter().map(|o| o.end).fold(0.0, f64::max);
            (priced, drawn, m)
        })
        .collect()
}

const HYBRID: [&str; 4] = ["--cluster", "examples/holmes/hybrid-4.yaml", "--model", "examples/holmes/gpt-3.6b.yaml"];

#[test]
fn a_slow_hops_round_trip_is_priced_as_drawn() {
    // GPT 3.6B on Holmes's hybrid cluster: pipelines whose middle hop crosses Ethernet between
    // the InfiniBand and RoCE islands. At global batch 64, four balanced stages of ~40 ms and a
    // 9.5 ms hop, 16 micro-batches: the round trip through the stages beside the hop is not
    // hidden (2% of the pipeline); at 768, two balanced stages and 48 micro-batches; and two
    // stages 12 ms apart (--max-stages 2) hide the hop: the slowest stage sets the period alone.
    let cases: [&[&str]; 3] =
        [&["--global-batch", "64"], &["--global-batch", "768"], &["--global-batch", "64", "--tp", "1", "--max-stages", "2"]];
    for case in cases {
        for (priced, drawn, m) in priced_and_drawn(&[&HYBRID[..], case].concat()) {
            assert!((priced - drawn).abs() <= 0.005 * drawn, "{case:?}, {m} micro-batches: priced {priced}, drawn {drawn}");
        }
    }
}
