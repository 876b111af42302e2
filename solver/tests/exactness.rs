//! The default search returns the brute-force optimum on every small cluster (up to 6 GPUs
//! and 8 layers), and is never slower than the baselines; with measured profiles too, the plan
//! it returns is priced as the evaluation prices it.

use crate::common;

use motley_solver::baselines::{best_baseline, Baseline};
use motley_solver::oracle::exhaustive;
use motley_solver::placement::place;
use motley_solver::profile::LayerProfile;
use motley_solver::search::{search, SearchMode};
use motley_solver::{CostModel, PlanOptions, ProfileSet, SolverError};
use proptest::prelude::*;

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn search_matches_oracle(spec in common::cluster_strategy(6), model in common::model_strategy(8), gb in prop_oneof![Just(2u32), Just(4), Just(6)]) {
        let (cluster, model) = common::build(&spec, &model);
        let opts = PlanOptions { global_batch: gb, ..PlanOptions::default() };
        let profiles = ProfileSet::default();
        let cm = CostModel { cluster: &cluster, model: &model, profiles: &profiles, opts: &opts };
        let seeds: Vec<_> = [Baseline::Megatron, Baseline::Whale].iter().filter_map(|&b| best_baseline(&cm, b).map(|x| x.1)).collect();
        let fast = search(&cm, SearchMode::Auto, &seeds);
        let slow = exhaustive(&cm, &seeds);
        match (fast, slow) {
            (Ok(f), Ok(o)) => {
                prop_assert!(f.stats.proven_optimal);
                let e = cm.evaluate(&f.plan);
                prop_assert!(e.fits);
                prop_assert!(cm.check_structure(&f.plan).is_ok());
                prop_assert!((e.iteration_time - f.iteration_time).abs() <= 1e-9 * f.iteration_time, "search priced {} but the plan costs {}", f.iteration_time, e.iteration_time);
                prop_assert!((f.iteration_time - o.iteration_time).abs() <= 1e-9 * o.iteration_time, "search {} vs oracle {}", f.iteration_time, o.iteration_time);
            }
            (Err(SolverError::DoesNotFit(_)), Err(SolverError::DoesNotFit(_))) => {}
            (f, o) => prop_assert!(false, "search {:?} vs oracle {:?}", f.map(|x| x.iteration_time), o.map(|x| x.iteration_time)),
        }
    }

    #[test]
    fn never_slower_than_baselines(spec in common::cluster_strategy(24), model in common::model_strategy(24), gb in prop_oneof![Just(8u32), Just(32), Just(64)]) {
        let (cluster, model) = common::build(&spec, &model);
        let opts = PlanOptions { global_batch: gb, ..PlanOptions::default() };
        let profiles = ProfileSet::default();
        let cm = CostModel { cluster: &cluster, model: &model, profiles: &profiles, opts: &opts };
        let base: Vec<_> = [Baseline::Megatron, Baseline::Whale].iter().filter_map(|&b| best_baseline(&cm, b)).collect();
        let seeds: Vec<_> = base.iter().map(|x| x.1.clone()).collect();
        match search(&cm, SearchMode::Auto, &seeds) {
            Ok(s) => {
                for (t, _) in &base {
                    prop_assert!(s.iteration_time <= *t * (1.0 + 1e-12));
                }
                // The placement is a real one: every GPU once, every TP group inside a node.
                let p = place(&cluster, &s.plan).expect("a searched plan can be placed");
                let mut seen = std::collections::HashSet::new();
                for (ri, r) in s.plan.replicas.iter().enumerate() {
                    for (si, st) in r.stages.iter().enumerate() {
                        let g = &p.gpus[ri][si];
                        prop_assert_eq!(g.len() as u32, st.kind.tp * st.kind.dp);
                        for group in g.chunks(st.kind.tp as usize) {
                            prop_assert!(group.iter().all(|x| x.node == group[0].node));
                        }
                        for x in g {
                            prop_assert!(seen.insert((x.node.clone(), x.index)));
                        }
                    }
                }
            }
            Err(_) => prop_assert!(base.is_empty()),
        }
    }

    /// Every GPU type measured (AutoHet's per-layer profile: passes, head, optimizer step), so
    /// every term the search prices comes from a profile: the plan it returns costs what it
    /// said, and no baseline that seeded it is faster.
    #[test]
    fn with_profiles_the_search_prices_as_evaluated(
        spec in common::cluster_strategy(12),
        model in common::model_strategy(12),
        gb in prop_oneof![Just(8u32), Just(16)],
        measured in prop::collection::vec((0.5f64..20.0, 1.0f64..4.0, 0.1f64..10.0, 0.1f64..40.0), 4),
    ) {
        let (cluster, model) = common::build(&spec, &model);
        let opts = PlanOptions { global_batch: gb, ..PlanOptions::default() };
        let profiles = ProfileSet {
            profiles: common::gpu_types()
                .iter()
                .zip(&measured)
                .map(|(g, &(fwd, bwd_ratio, head, optimizer))| {
                    let mut p = LayerProfile::per_layer(&g.name, 1, 1, fwd, fwd * bwd_ratio, None);
                    (p.head_fwd_ms, p.head_bwd_ms, p.optimizer_ms) = (Some(head), Some(head / 4.0), Some(optimizer));
                    p
                })
                .collect(),
        };
        let cm = CostModel { cluster: &cluster, model: &model, profiles: &profiles, opts: &opts };
        let base: Vec<_> = Baseline::ALL.iter().filter_map(|&b| best_baseline(&cm, b)).collect();
        let seeds: Vec<_> = base.iter().map(|x| x.1.clone()).collect();
        match search(&cm, SearchMode::Auto, &seeds) {
            Ok(s) => {
                let e = cm.evaluate(&s.plan);
                prop_assert!(e.fits);
                prop_assert!((e.iteration_time - s.iteration_time).abs() <= 1e-9 * s.iteration_time, "search priced {} but the plan costs {}", s.iteration_time, e.iteration_time);
                for (t, _) in &base {
                    prop_assert!(s.iteration_time <= *t * (1.0 + 1e-12), "search {} slower than a baseline's {t}", s.iteration_time);
                }
            }
            Err(_) => prop_assert!(base.is_empty()),
        }
    }
}
