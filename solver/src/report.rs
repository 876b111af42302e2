//! What `motley plan` prints: the plan document (`motley_contract::PlanDocument`, whose field
//! names are a contract, docs/plan.md) with its placement and prices, and the baselines.

use std::collections::BTreeMap;

use crate::baselines::{best_baseline, Baseline};
use crate::cost::{CostModel, PlanOptions};
use crate::error::Result;
use crate::given_plan::structure_of;
use crate::hardware::Cluster;
use crate::model::Model;
use crate::network::comm_groups;
use crate::oracle;
use crate::placement::{place, GpuId};
use crate::plan::{Evaluation, PlanStructure};
use crate::profile::ProfileSet;
use crate::search::{search, SearchMode, SearchStats};
pub use motley_contract::plan::{BaselineDoc, PlanDocument, ReplicaDoc, SearchDoc, StageDoc};

const GIB: f64 = 1024.0 * 1024.0 * 1024.0;

/// Inputs of one planning run.
#[derive(Clone)]
pub struct PlanRequest<'a> {
    pub cluster: &'a Cluster,
    pub model: &'a Model,
    pub profiles: &'a ProfileSet,
    pub opts: &'a PlanOptions,
    pub mode: SearchMode,
    pub exhaustive: bool,
    /// Plans the search starts from besides the baselines (re-planning passes the running
    /// plan, so the answer is never slower than it).
    pub seeds: Vec<PlanStructure>,
}

/// Plan, compare with the baselines, and lay out the report.
pub fn plan(req: &PlanRequest) -> Result<PlanDocument> {
    req.opts.validate()?;
    req.cluster.check_precision(req.opts.precision)?;
    let cm = CostModel { cluster: req.cluster, model: req.model, profiles: req.profiles, opts: req.opts };
    let [megatron, whale, fast_only] = Baseline::ALL.map(|b| best_baseline(&cm, b));
    // The baselines seed the search: Motley's plan is never slower than any of them.
    let mut seeds: Vec<PlanStructure> = [&megatron, &whale, &fast_only].iter().filter_map(|b| b.as_ref().map(|x| x.1.clone())).collect();
    seeds.extend(req.seeds.iter().cloned());
    let (structure, t, stats) = if req.exhaustive {
        let o = oracle::exhaustive(&cm, &seeds)?;
        let stats = SearchStats { mode: "exhaustive".into(), plans_costed: o.plans_costed, proven_optimal: true, ..Default::default() };
        (o.plan, o.iteration_time, stats)
    } else {
        let s = search(&cm, req.mode, &seeds)?;
        (s.plan, s.iteration_time, s.stats)
    };
    let report =
        build_report(&cm, &structure, t, stats, req.exhaustive, [("megatron", megatron), ("whale", whale), ("fast-only", fast_only)]);
    crate::network::check_process_env(&report.comm_groups)?;
    Ok(report)
}

/// The best plan of one baseline's rule (`baselines.rs`) as a whole plan document, placed
/// and priced like Motley's own, so that a job can run it (`plan:`) beside Motley's. Search mode
/// `baseline`, `search.baseline` its name; the other baselines are compared as usual.
pub fn baseline(req: &PlanRequest, which: Baseline) -> Result<PlanDocument> {
    req.opts.validate()?;
    req.cluster.check_precision(req.opts.precision)?;
    let cm = CostModel { cluster: req.cluster, model: req.model, profiles: req.profiles, opts: req.opts };
    // Every baseline priced once: the report lists them all, the chosen one among them.
    let others = Baseline::ALL.map(|b| (b.name(), best_baseline(&cm, b)));
    let chosen = others.iter().find(|(name, _)| *name == which.name()).and_then(|(_, best)| best.clone());
    let Some((t, structure)) = chosen else {
        return Err(crate::SolverError::DoesNotFit(format!(
            "no {} plan fits ({}); {}",
            which.name(),
            match which {
                Baseline::Megatron => "equal layers per stage, equal batch shares, GPUs in node order",
                Baseline::Whale => "tp x pp grid, shares by peak FLOPS and memory",
                Baseline::FastOnly => "a symmetric plan on the fastest GPU type alone",
            },
            crate::search::does_not_fit_message(&cm)
        )));
    };
    let stats = SearchStats { mode: "baseline".into(), ..Default::default() };
    let mut report = build_report(&cm, &structure, t, stats, false, others);
    report.search.baseline = Some(which.name().to_string());
    crate::network::check_process_env(&report.comm_groups)?;
    Ok(report)
}

/// A plan given whole (a job's `plan:`: one an operator reviewed, or another planner made),
/// checked on `req`'s cluster and model and priced as given, on its own GPUs in its own order.
/// Refused, with the field named, unless every GPU exists once with the stage's GPU type, each
/// TP group is inside one node, every replica holds every layer once in contiguous stages,
/// the samples add up to the global batch, and every stage fits in its GPUs' memory.
pub fn given(req: &PlanRequest, doc: &PlanDocument) -> Result<PlanDocument> {
    req.opts.validate()?;
    let cm = CostModel { cluster: req.cluster, model: req.model, profiles: req.profiles, opts: req.opts };
    if doc.global_batch != req.opts.global_batch {
        return Err(crate::SolverError::invalid(
            "plan.global_batch",
            format!("is {} but the job's global_batch is {}; make them agree", doc.global_batch, req.opts.global_batch),
        ));
    }
    // A plan made for another sequence length is another plan (its memory, its times).
    if let Some(seq) = doc.seq_len.filter(|&s| s != req.model.seq_len) {
        return Err(crate::SolverError::invalid(
            "plan.seq_len",
            format!("is {seq} but the model is run at {} tokens a sequence; make them agree", req.model.seq_len),
        ));
    }
    for (ri, r) in doc.replicas.iter().enumerate() {
        if let Some(samples) = r.samples.filter(|&x| x != r.micro_batches * doc.micro_batch) {
            return Err(crate::SolverError::invalid(
                format!("plan.replicas[{ri}].samples"),
                format!("is {samples} but micro_batches x micro_batch is {} x {}", r.micro_batches, doc.micro_batch),
            ));
        }
        for (si, st) in r.stages.iter().enumerate() {
            for (gi, group) in st.gpus.chunks(st.tp.max(1) as usize).enumerate() {
                if group.iter().any(|g| g.node != group[0].node) {
                    return Err(crate::SolverError::invalid(
                        format!("plan.replicas[{ri}].stages[{si}].gpus"),
                        format!("TP group {gi} spans nodes {} and others; a TP group lives inside one node", group[0].node),
                    ));
                }
            }
        }
    }
    let named = |e: crate::SolverError| match e {
        crate::SolverError::InvalidInput { field, message } => crate::SolverError::InvalidInput { field: format!("plan.{field}"), message },
        other => other,
    };
    let structure = structure_of(&cm, doc).map_err(named)?;
    let eval = cm.evaluate(&structure);
    cm.cluster.check_precision(cm.opts.precision)?;
    for (ri, r) in structure.replicas.iter().enumerate() {
        for si in 0..r.stages.len() {
            let (need, have) = (eval.memory[ri][si] / GIB, eval.capacity[ri][si] / GIB);
            if need > have {
                return Err(crate::SolverError::invalid(
                    format!("plan.replicas[{ri}].stages[{si}]"),
                    format!("needs {need:.1} GiB per GPU, its GPUs have {have:.1}; give it fewer layers or more GPUs (dp, tp)"),
                ));
            }
        }
    }
    let report = priced_as_given(&cm, &structure, doc);
    crate::network::check_process_env(&report.comm_groups)?;
    Ok(report)
}

/// The report of a plan document's `structure` (from `given_plan::structure_of`) on the document's
/// own GPUs in its own order, priced by `cm` without any check (search mode "given").
pub(crate) fn priced_as_given(cm: &CostModel, structure: &PlanStructure, doc: &PlanDocument) -> PlanDocument {
    let t = cm.evaluate(structure).iteration_time;
    let gpus: Vec<Vec<Vec<GpuId>>> = doc.replicas.iter().map(|r| r.stages.iter().map(|s| s.gpus.clone()).collect()).collect();
    let placement = crate::placement::Placement { gpus, split_hops: 0 };
    let stats = SearchStats { mode: "given".into(), ..Default::default() };
    report_placed(cm, structure, t, stats, false, [("megatron", None), ("whale", None), ("fast-only", None)], placement)
}

fn build_report(
    cm: &CostModel,
    plan: &PlanStructure,
    t: f64,
    stats: SearchStats,
    exhaustive: bool,
    baselines: [(&str, Option<(f64, PlanStructure)>); 3],
) -> PlanDocument {
    let placement = place(cm.cluster, plan).expect("searched plans fit the cluster");
    report_placed(cm, plan, t, stats, exhaustive, baselines, placement)
}

/// The report of a plan on `placement`'s GPUs.
fn report_placed(
    cm: &CostModel,
    plan: &PlanStructure,
    t: f64,
    stats: SearchStats,
    exhaustive: bool,
    baselines: [(&str, Option<(f64, PlanStructure)>); 3],
    placement: crate::placement::Placement,
) -> PlanDocument {
    let eval = cm.evaluate(plan);
    debug_assert!((eval.iteration_time - t).abs() <= 1e-9 * t.max(1.0), "search price {t} != evaluation {}", eval.iteration_time);
    let replicas = replica_docs(cm, plan, &eval, &placement);
    let b = cm.opts.global_batch as f64;
    let flops = b * 3.0 * (cm.model.layers() as f64 * cm.model.layer_fwd_flops + cm.model.head_fwd_flops);
    let peak: f64 = cm
        .cluster
        .nodes
        .iter()
        .map(|n| {
            n.gpus as f64 * {
                let g = &cm.cluster.classes[n.class].gpu;
                g.peak_tflops(cm.opts.precision).unwrap_or(g.tflops) * 1e12
            }
        })
        .sum();
    let baselines = baselines
        .into_iter()
        .map(|(name, b)| {
            let rep = match b {
                Some((bt, bp)) => BaselineDoc {
                    iteration_time_s: Some(bt),
                    speedup: Some(bt / eval.iteration_time),
                    replicas: Some(bp.replicas.len()),
                    stages_per_replica: Some(bp.replicas[0].stages.len()),
                    tp: Some(bp.replicas[0].stages[0].kind.tp),
                    micro_batch: Some(bp.micro_batch),
                },
                None => BaselineDoc::default(),
            };
            (name.to_string(), rep)
        })
        .collect();
    PlanDocument {
        cluster: cm.cluster.name.clone(),
        model: cm.model.spec.name.clone(),
        model_spec: Some(cm.model.spec.resolved()),
        global_batch: cm.opts.global_batch,
        micro_batch: plan.micro_batch,
        seq_len: Some(cm.model.seq_len),
        precision: Some(cm.opts.precision),
        recompute: cm.opts.recompute,
        compiled: !cm.opts.eager,
        zero1: cm.opts.zero1,
        iteration_time_s: eval.iteration_time,
        tokens_per_s: b * cm.model.seq_len as f64 / eval.iteration_time,
        peak_utilization: flops / eval.iteration_time / peak,
        gpus_used: plan.gpus_per_class(cm.cluster.classes.len()).iter().sum(),
        gpus_total: cm.cluster.total_gpus(),
        split_hops: placement.split_hops,
        idle_gpus: idle_gpus(cm, plan),
        comm_groups: comm_groups(cm, plan, &placement),
        replicas,
        baselines,
        search: SearchDoc {
            mode: stats.mode,
            proven_optimal: stats.proven_optimal,
            configurations: stats.configurations,
            shapes: stats.shapes,
            plans_costed: stats.plans_costed,
            exhaustive_oracle: exhaustive,
            lower_bound: stats.lower_bound,
            baseline: None,
        },
        network: None,
        emulated: {
            let emulated: std::collections::HashSet<&str> =
                cm.cluster.nodes.iter().filter(|n| n.emulated).map(|n| n.name.as_str()).collect();
            !emulated.is_empty() && placement.gpus.iter().flatten().flatten().any(|g| emulated.contains(g.node.as_str()))
        },
    }
}

/// Each replica's part of the plan document: its share, its time and the terms of it, its
/// stages on `placement`'s GPUs.
fn replica_docs(cm: &CostModel, plan: &PlanStructure, eval: &Evaluation, placement: &crate::placement::Placement) -> Vec<ReplicaDoc> {
    plan.replicas
        .iter()
        .enumerate()
        .map(|(ri, r)| {
            let kinds: Vec<_> = r.stages.iter().map(|s| s.kind).collect();
            let p = r.stages.len();
            let times: Vec<(f64, f64)> = r
                .stages
                .iter()
                .enumerate()
                .map(|(si, s)| {
                    let c = cm.layer_cost(s.kind, plan.micro_batch);
                    CostModel::stage_time(&c, s.layers.1 - s.layers.0, si == 0, si + 1 == p)
                })
                .collect();
            ReplicaDoc {
                samples: Some(r.micro_batches * plan.micro_batch),
                micro_batches: r.micro_batches,
                iteration_time_s: eval.replica_times[ri],
                hops_s: cm.hop_times(&kinds, plan.micro_batch),
                sync_s: Some(eval.terms[ri].exposed_sync),
                optimizer_s: Some(eval.terms[ri].optimizer),
                stages: r
                    .stages
                    .iter()
                    .enumerate()
                    .map(|(si, s)| StageDoc {
                        fwd_s: times[si].0,
                        bwd_s: times[si].1,
                        layers: [s.layers.0, s.layers.1],
                        gpu: cm.cluster.classes[s.kind.class].gpu.name.clone(),
                        tp: s.kind.tp,
                        dp: s.kind.dp,
                        gpus: placement.gpus[ri][si].clone(),
                        memory_gib_per_gpu: round3(eval.memory[ri][si] / GIB),
                        memory_capacity_gib: round3(eval.capacity[ri][si] / GIB),
                    })
                    .collect(),
            }
        })
        .collect()
}

fn idle_gpus(cm: &CostModel, plan: &PlanStructure) -> BTreeMap<String, u32> {
    let used = plan.gpus_per_class(cm.cluster.classes.len());
    let mut idle = BTreeMap::new();
    for (c, class) in cm.cluster.classes.iter().enumerate() {
        let total = class.nodes.len() as u32 * class.gpus_per_node;
        if total > used[c] {
            *idle.entry(class.gpu.name.clone()).or_insert(0) += total - used[c];
        }
    }
    idle
}

fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}
