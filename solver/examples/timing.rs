use motley_solver::baselines::{best_baseline, Baseline};
use motley_solver::search::{search, SearchMode};
use motley_solver::*;
use std::time::Instant;
fn main() {
    let args: Vec<String> = std::env::args().collect();
    let text = std::fs::read_to_string(&args[1]).unwrap();
    let spec: ClusterSpec = serde_json::from_str(&text).unwrap();
    let cluster = Cluster::from_spec(&spec).unwrap();
    let model = Model::new(model::model_by_name(&args[2]).unwrap(), None).unwrap();
    let opts = PlanOptions { global_batch: args[3].parse().unwrap(), ..Default::default() };
    let profiles = ProfileSet::default();
    let cm = CostModel { cluster: &cluster, model: &model, profiles: &profiles, opts: &opts };
    let t = Instant::now();
    let m = best_baseline(&cm, Baseline::Megatron);
    let w = best_baseline(&cm, Baseline::Whale);
    println!("baselines {:?} {:?} {:?}", t.elapsed(), m.as_ref().map(|x| x.0), w.as_ref().map(|x| x.0));
    let seeds: Vec<_> = [m, w].into_iter().flatten().map(|x| x.1).collect();
    let t = Instant::now();
    let s = search(&cm, SearchMode::Fast, &seeds).unwrap();
    println!("search {:?} {} {:?}", t.elapsed(), s.iteration_time, s.stats);
}
