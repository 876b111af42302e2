#[path = "../tests/common.rs"]
mod common;
use motley_solver::baselines::{best_baseline, Baseline};
use motley_solver::oracle::exhaustive;
use motley_solver::search::{search, SearchMode};
use motley_solver::{CostModel, PlanOptions, ProfileSet};
use proptest::strategy::{Strategy, ValueTree};
use proptest::test_runner::TestRunner;
fn main() {
    let mut runner = TestRunner::deterministic();
    let (mut ok, mut nofit, mut beat, mut oracle_plans) = (0, 0, 0, 0u64);
    for _ in 0..40 {
        let spec = common::cluster_strategy(6).new_tree(&mut runner).unwrap().current();
        let model = common::model_strategy(8).new_tree(&mut runner).unwrap().current();
        let (cluster, model) = common::build(&spec, &model);
        let opts = PlanOptions { global_batch: 4, ..PlanOptions::default() };
        let profiles = ProfileSet::default();
        let cm = CostModel { cluster: &cluster, model: &model, profiles: &profiles, opts: &opts };
        let base: Vec<_> = [Baseline::Megatron, Baseline::Whale].iter().filter_map(|&b| best_baseline(&cm, b)).collect();
        let seeds: Vec<_> = base.iter().map(|x| x.1.clone()).collect();
        let bt = base.iter().map(|x| x.0).fold(f64::INFINITY, f64::min);
        match (search(&cm, SearchMode::Auto, &seeds), exhaustive(&cm, &seeds)) {
            (Ok(f), Ok(o)) => {
                ok += 1;
                oracle_plans += o.plans_costed;
                if f.iteration_time < bt * 0.999 {
                    beat += 1;
                }
                println!(
                    "gpus {} layers {} search {:.4} oracle {:.4} base {:.4} costed {} oracle {}",
                    cluster.total_gpus(),
                    model.layers(),
                    f.iteration_time,
                    o.iteration_time,
                    bt,
                    f.stats.plans_costed,
                    o.plans_costed
                );
            }
            _ => nofit += 1,
        }
    }
    println!("ok {ok} nofit {nofit} beat-baselines {beat} oracle plans {oracle_plans}");
}
