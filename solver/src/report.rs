//! What `motley plan` prints: the plan with its placement and prices, and the baselines.
//! The JSON field names are a contract (docs/plan.md); fields may be added, never renamed.

use serde::Serialize;
use std::collections::BTreeMap;

use crate::baselines::{best_baseline, Baseline};
use crate::cost::{CostModel, PlanOptions};
use crate::error::Result;
use crate::given_plan::{structure_of, CurrentPlan};
use crate::hardware::Cluster;
use crate::model::{Model, ModelSpec};
use crate::network::{comm_groups, CommGroup};
use crate::oracle;
use crate::placement::{place, GpuId};
use crate::plan::PlanStructure;
use crate::profile::ProfileSet;
use crate::search::{search, SearchMode, SearchStats};

const GIB: f64 = 1024.0 * 1024.0 * 1024.0;

#[derive(Debug, Clone, Serialize)]
pub struct StageReport {
    /// Half-open range of transformer layers.
    pub layers: [u32; 2],
    pub gpu: String,
    pub tp: u32,
    pub dp: u32,
    /// TP group by TP group (dp-major).
    pub gpus: Vec<GpuId>,
    pub memory_gib_per_gpu: f64,
    pub memory_capacity_gib: f64,
    /// Seconds of one micro-batch's forward on this stage (its layers, TP all-reduces, the
    /// embedding on the first stage, the output head on the last).
    pub fwd_s: f64,
    /// Seconds of one micro-batch's backward (recomputation included with --recompute).
    pub bwd_s: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct ReplicaReport {
    pub samples: u32,
    pub micro_batches: u32,
    pub iteration_time_s: f64,
    pub stages: Vec<StageReport>,
    /// Seconds of each pipeline hop per micro-batch (activations forward, gradients back).
    pub hops_s: Vec<f64>,
}

#[derive(Debug, Clone, Serialize)]
pub struct BaselineReport {
    pub iteration_time_s: Option<f64>,
    /// Baseline time over Motley's time.
    pub speedup: Option<f64>,
    pub replicas: Option<usize>,
    pub stages_per_replica: Option<usize>,
    pub tp: Option<u32>,
    pub micro_batch: Option<u32>,
}

#[derive(Debug, Clone, Serialize)]
pub struct SearchReport {
    pub mode: String,
    pub proven_optimal: bool,
    pub configurations: usize,
    pub shapes: usize,
    pub plans_costed: u64,
    pub exhaustive_oracle: bool,
    /// No plan of the searched space is faster than this (fluid relaxation without gradient
    /// sync), when the search computed one.
    pub lower_bound: Option<f64>,
    /// Mode `baseline`: which baseline the plan is (`megatron`, `whale`, `fast-only`), made by
    /// that baseline's rule instead of Motley's search (`motley plan --baseline`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub baseline: Option<String>,
}

#[derive(Debug, Clone, Serialize)]
pub struct PlanReport {
    pub cluster: String,
    pub model: String,
    /// The whole model (its file's fields, defaults filled in), so ranks can build it from the plan alone.
    pub model_spec: ModelSpec,
    pub global_batch: u32,
    pub micro_batch: u32,
    pub seq_len: u64,
    /// The precision the plan was priced in (`--precision`, `auto` resolved): fp16, bf16, fp32.
    pub precision: crate::Precision,
    /// Whether the plan was priced with full activation recomputation (`--recompute`): the
    /// ranks recompute as it assumes.
    pub recompute: bool,
    /// Whether the activations were priced as compiled blocks save them (the runtime's
    /// `--compile auto` on a GPU), or as eager ones (`--eager`).
    pub compiled: bool,
    /// Whether the plan was priced with optimizer state sharded over each segment's
    /// data-parallel ring (`--zero1`): the ranks shard it as it assumes.
    pub zero1: bool,
    pub iteration_time_s: f64,
    pub tokens_per_s: f64,
    /// Model FLOPs per second over the peak of every GPU in the cluster.
    pub peak_utilization: f64,
    pub gpus_used: u32,
    pub gpus_total: u32,
    /// GPUs the plan leaves idle, per GPU type (the search found no faster plan using them).
    pub idle_gpus: BTreeMap<String, u32>,
    /// Pipeline hops priced as inside one node that placement had to split across nodes
    /// (0 when the placement matches the cost model's packing).
    pub split_hops: usize,
    pub replicas: Vec<ReplicaReport>,
    /// Every TP group, pipeline hop and gradient ring with its transport, NICs and NCCL
    /// settings, in the order ranks create them (`network.rs`).
    pub comm_groups: Vec<CommGroup>,
    pub baselines: BTreeMap<String, BaselineReport>,
    pub search: SearchReport,
    /// The links between the plan's nodes as the plan assumed them, measured or declared
    /// (`bandwidth::PlanNetwork`); set by planners that know (the coordinator), absent otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network: Option<crate::bandwidth::PlanNetwork>,
    /// Some of the plan's GPUs are emulated on CPU (a node's `emulate:`): a test or demo
    /// cluster, said so wherever the plan goes. Absent when none is.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub emulated: bool,
}

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
pub fn plan(req: &PlanRequest) -> Result<PlanReport> {
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
pub fn baseline(req: &PlanRequest, which: Baseline) -> Result<PlanReport> {
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
pub fn given(req: &PlanRequest, doc: &CurrentPlan) -> Result<PlanReport> {
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
pub(crate) fn priced_as_given(cm: &CostModel, structure: &PlanStructure, doc: &CurrentPlan) -> PlanReport {
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
) -> PlanReport {
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
) -> PlanReport {
    let eval = cm.evaluate(plan);
    debug_assert!((eval.iteration_time - t).abs() <= 1e-9 * t.max(1.0), "search price {t} != evaluation {}", eval.iteration_time);
    let replicas = plan
        .replicas
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
            ReplicaReport {
                samples: r.micro_batches * plan.micro_batch,
                micro_batches: r.micro_batches,
                iteration_time_s: eval.replica_times[ri],
                hops_s: cm.hop_times(&kinds, plan.micro_batch),
                stages: r
                    .stages
                    .iter()
                    .enumerate()
                    .map(|(si, s)| StageReport {
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
        .collect();
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
                Some((bt, bp)) => BaselineReport {
                    iteration_time_s: Some(bt),
                    speedup: Some(bt / eval.iteration_time),
                    replicas: Some(bp.replicas.len()),
                    stages_per_replica: Some(bp.replicas[0].stages.len()),
                    tp: Some(bp.replicas[0].stages[0].kind.tp),
                    micro_batch: Some(bp.micro_batch),
                },
                None => BaselineReport {
                    iteration_time_s: None,
                    speedup: None,
                    replicas: None,
                    stages_per_replica: None,
                    tp: None,
                    micro_batch: None,
                },
            };
            (name.to_string(), rep)
        })
        .collect();
    PlanReport {
        cluster: cm.cluster.name.clone(),
        model: cm.model.spec.name.clone(),
        model_spec: cm.model.spec.resolved(),
        global_batch: cm.opts.global_batch,
        micro_batch: plan.micro_batch,
        seq_len: cm.model.seq_len,
        precision: cm.opts.precision,
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
        search: SearchReport {
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
