//! Baselines as runnable plans (`motley plan --baseline`): each baseline's best plan is a whole
//! plan document, priced as the comparison prices it, that a job can run as given; fast-only
//! uses the fastest GPU type alone; Motley's own plan is never slower than any of them.

use motley_solver::baselines::Baseline;
use motley_solver::report::{baseline, given};
use motley_solver::PlanDocument;
use motley_solver::{model, plan, Cluster, ClusterSpec, Model, PlanOptions, PlanRequest, ProfileSet, SearchMode, SolverError};

fn lab() -> Cluster {
    let p = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/lab.yaml");
    let spec: ClusterSpec = serde_norway::from_str(&std::fs::read_to_string(p).unwrap()).unwrap();
    Cluster::from_spec(&spec).unwrap()
}

/// A model on the lab with the default profiles and a global batch: what every test here plans.
struct Case {
    cluster: Cluster,
    model: Model,
    profiles: ProfileSet,
    opts: PlanOptions,
}

impl Case {
    fn on_lab(model: &str, global_batch: u32) -> Case {
        Case {
            cluster: lab(),
            model: Model::new(model::model_by_name(model).unwrap(), None).unwrap(),
            profiles: ProfileSet::default(),
            opts: PlanOptions { global_batch, ..PlanOptions::default() },
        }
    }

    fn request(&self) -> PlanRequest<'_> {
        let (cluster, model, profiles, opts) = (&self.cluster, &self.model, &self.profiles, &self.opts);
        PlanRequest { cluster, model, profiles, opts, mode: SearchMode::Auto, exhaustive: false, seeds: vec![] }
    }
}

const ALL: [Baseline; 3] = Baseline::ALL;

#[test]
fn each_baselines_plan_is_the_one_the_comparison_prices_and_motley_is_never_slower() {
    let case = Case::on_lab("llama-13b", 256);
    let req = case.request();
    let motley = plan(&req).unwrap();
    assert_eq!(motley.search.baseline, None);
    for b in ALL {
        let r = baseline(&req, b).unwrap();
        assert_eq!((r.search.mode.as_str(), r.search.baseline.as_deref()), ("baseline", Some(b.name())));
        let compared = motley.baselines[b.name()].iteration_time_s.unwrap();
        assert!((r.iteration_time_s - compared).abs() <= 1e-9 * compared, "{}: {} against {compared}", b.name(), r.iteration_time_s);
        assert!(motley.iteration_time_s <= r.iteration_time_s * (1.0 + 1e-9), "{}: motley {} slower", b.name(), motley.iteration_time_s);
        // Symmetric baselines: every replica the same share and the same stages' layer counts.
        if b != Baseline::Whale {
            let shares: Vec<u32> = r.replicas.iter().map(|x| x.samples.unwrap()).collect();
            assert!(shares.iter().all(|&s| s == shares[0]), "{}: {shares:?}", b.name());
            let layers: Vec<u32> = r.replicas.iter().flat_map(|x| x.stages.iter().map(|s| s.layers[1] - s.layers[0])).collect();
            assert!(layers.iter().all(|&l| l == layers[0]), "{}: {layers:?}", b.name());
        }
        assert_eq!(r.replicas.iter().map(|x| x.samples.unwrap()).sum::<u32>(), 256);
    }
}

#[test]
fn fast_only_runs_on_the_fastest_gpu_type_alone() {
    let case = Case::on_lab("llama-13b", 256);
    let cluster = &case.cluster;
    let r = baseline(&case.request(), Baseline::FastOnly).unwrap();
    let peak = |name: &str| {
        let g = &cluster.classes.iter().find(|c| c.gpu.name == name).unwrap().gpu;
        g.peak_tflops(r.precision.unwrap()).unwrap_or(g.tflops)
    };
    let best = cluster.classes.iter().map(|c| peak(&c.gpu.name)).fold(0.0, f64::max);
    let used: Vec<&str> = r.replicas.iter().flat_map(|x| x.stages.iter().map(|s| s.gpu.as_str())).collect();
    assert!(used.iter().all(|g| peak(g) == best), "{used:?}");
    // Every GPU of another type is idle.
    let others: u32 = cluster.nodes.iter().filter(|n| peak(&cluster.classes[n.class].gpu.name) < best).map(|n| n.gpus).sum();
    assert!(others > 0);
    assert_eq!(r.idle_gpus.iter().filter(|(g, _)| peak(g) < best).map(|(_, n)| n).sum::<u32>(), others);
}

#[test]
fn a_baselines_plan_document_runs_as_given_at_the_same_price() {
    let case = Case::on_lab("llama-7b", 128);
    let req = case.request();
    for b in ALL {
        let r = baseline(&req, b).unwrap();
        let doc: PlanDocument = serde_json::from_value(serde_json::to_value(&r).unwrap()).unwrap();
        let again = given(&req, &doc).unwrap_or_else(|e| panic!("{}: {e}", b.name()));
        assert!((again.iteration_time_s - r.iteration_time_s).abs() <= 1e-9 * r.iteration_time_s, "{}", b.name());
        let gpus = |x: &motley_solver::PlanDocument| -> Vec<_> {
            x.replicas.iter().flat_map(|r| r.stages.iter().flat_map(|s| s.gpus.clone())).collect()
        };
        assert_eq!(gpus(&again), gpus(&r), "{}", b.name());
    }
}

#[test]
fn a_baseline_with_no_plan_that_fits_says_which_baseline() {
    // LLaMA-70B on the lab: Motley's search finds a plan (24 of the 40 GPUs), no baseline's
    // rule does; the refusal names the baseline.
    let case = Case::on_lab("llama-70b", 256);
    let req = case.request();
    assert!(plan(&req).is_ok());
    for b in ALL {
        match baseline(&req, b) {
            Err(SolverError::DoesNotFit(m)) => assert!(m.starts_with(&format!("no {} plan fits", b.name())), "{m}"),
            Ok(r) => panic!("{}: llama-70b fits at {} s?", b.name(), r.iteration_time_s),
            Err(e) => panic!("{}: {e}", b.name()),
        }
    }
}

#[test]
fn every_replica_says_its_unhidden_sync_and_its_optimizer_step_within_its_time() {
    let case = Case::on_lab("llama-13b", 256);
    let req = case.request();
    for doc in [plan(&req).unwrap(), baseline(&req, Baseline::Megatron).unwrap()] {
        for r in &doc.replicas {
            let (sync, opt) = (r.sync_s.unwrap(), r.optimizer_s.unwrap());
            assert!(sync >= 0.0 && opt > 0.0, "sync {sync}, optimizer {opt}");
            assert!(sync + opt < r.iteration_time_s, "sync {sync} + optimizer {opt} against {}", r.iteration_time_s);
        }
        // Data parallelism somewhere: a ring whose sync the backward passes cannot all hide.
        assert!(doc.replicas.len() > 1 || doc.replicas[0].stages.iter().any(|s| s.dp > 1));
        assert!(doc.replicas.iter().any(|r| r.sync_s.unwrap() > 0.0), "{:?}", doc.replicas.iter().map(|r| r.sync_s).collect::<Vec<_>>());
    }
}
