//! Re-planning when bandwidth changes: price the running plan on the network as measured now,
//! plan afresh, and say whether switching pays (the dynamic-networks paper's re-planning).
//!
//! Switching is worth it when the new plan is at least `min_gain` faster than the current one
//! *under the new measurements* and the state that has to move pays for itself within
//! `horizon` iterations. What moves: every GPU whose layers change fetches the weights and
//! Adam states (14 bytes per parameter of its TP shard: fp16 weights, fp32 master weights and
//! two moments; gradients are rebuilt) of the layers it did not hold, over its node's NICs;
//! nodes fetch in parallel, so the switch takes as long as the busiest node.

use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};

use crate::cost::{CostModel, StageKind};
use crate::error::{Result, SolverError};
use crate::placement::GpuId;
use crate::plan::{PlanStructure, ReplicaPlan, StagePlan};
use crate::report::{plan, PlanReport, PlanRequest};

/// The parts of a `motley plan -o json` document re-planning reads (and a job's `plan:`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CurrentPlan {
    pub global_batch: u32,
    pub micro_batch: u32,
    /// Tokens per sequence the plan was made for, when the document says (`motley plan -o json`
    /// does): whoever runs the plan runs it at this length or refuses it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seq_len: Option<u64>,
    /// What the planner that made the plan priced it at (0 when the document does not say).
    #[serde(default)]
    pub iteration_time_s: f64,
    pub replicas: Vec<CurrentReplica>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CurrentReplica {
    /// `micro_batches * micro_batch`, when the document says.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub samples: Option<u32>,
    pub micro_batches: u32,
    pub stages: Vec<CurrentStage>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CurrentStage {
    pub layers: [u32; 2],
    pub gpu: String,
    pub tp: u32,
    pub dp: u32,
    pub gpus: Vec<GpuId>,
}

/// When a switch is worth it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SwitchPolicy {
    /// Smallest relative speed-up worth a switch (0.05 = 5%).
    pub min_gain: f64,
    /// Iterations within which the switch must pay for itself.
    pub horizon: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct Move {
    pub gpu: GpuId,
    /// Layers the GPU held before and holds after (None: idle).
    pub from: Option<[u32; 2]>,
    pub to: Option<[u32; 2]>,
    pub bytes_in: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct ReplanReport {
    /// What the plan file says the current plan takes (the network it was planned on).
    pub current_planned_s: f64,
    /// The current plan priced on the network as measured now.
    pub current_now_s: f64,
    pub new_iteration_time_s: f64,
    /// current_now / new - 1.
    pub gain: f64,
    pub worth_switching: bool,
    pub reason: String,
    pub gpus_moved: usize,
    pub switch_bytes: f64,
    pub switch_seconds: f64,
    /// Iterations the new plan needs to win back the switch (None when it is not faster).
    pub payback_iterations: Option<f64>,
    pub moves: Vec<Move>,
    pub new_plan: PlanReport,
    /// The current plan as priced now, on its own GPUs: per-stage forward/backward seconds,
    /// hops, memory (search mode "given"; not checked against memory).
    pub current_plan: PlanReport,
}

/// Rebuild the structure of a plan file on `cm`'s cluster (which may carry new measurements).
/// The GPUs are checked one by one (they exist, once each, of the stage's type); the cluster's
/// packing rule is not, since a running plan placed by an older cluster file may not follow it.
pub fn structure_of(cm: &CostModel, current: &CurrentPlan) -> Result<PlanStructure> {
    let cluster = cm.cluster;
    let node_of: HashMap<&str, usize> = cluster.nodes.iter().enumerate().map(|(i, n)| (n.name.as_str(), i)).collect();
    let tp = current.replicas.first().and_then(|r| r.stages.first()).map(|s| s.tp);
    let mut seen: HashMap<(usize, u32), String> = HashMap::new();
    let mut replicas = vec![];
    for (ri, r) in current.replicas.iter().enumerate() {
        let mut stages = vec![];
        for (si, s) in r.stages.iter().enumerate() {
            let field = |x: &str| format!("replicas[{ri}].stages[{si}].{x}");
            if Some(s.tp) != tp {
                return Err(SolverError::invalid(
                    field("tp"),
                    format!("is {} but the plan's first stage has {}; a plan has one tp", s.tp, tp.unwrap_or(0)),
                ));
            }
            if s.tp == 0 || s.dp == 0 || s.gpus.len() as u64 != s.tp as u64 * s.dp as u64 {
                return Err(SolverError::invalid(field("gpus"), format!("lists {} GPUs but tp x dp is {} x {}", s.gpus.len(), s.tp, s.dp)));
            }
            let mut classes: Vec<usize> = vec![];
            for (gi, g) in s.gpus.iter().enumerate() {
                let gfield = format!("replicas[{ri}].stages[{si}].gpus[{gi}]");
                let n = *node_of.get(g.node.as_str()).ok_or_else(|| {
                    SolverError::invalid(
                        format!("{gfield}.node"),
                        format!("node '{}' is not in the cluster; re-plan with the cluster file the plan was made for", g.node),
                    )
                })?;
                if g.index >= cluster.nodes[n].gpus {
                    return Err(SolverError::invalid(
                        format!("{gfield}.index"),
                        format!("node '{}' has GPUs 0..{}", g.node, cluster.nodes[n].gpus),
                    ));
                }
                if let Some(other) = seen.insert((n, g.index), gfield.clone()) {
                    return Err(SolverError::invalid(gfield, format!("GPU {}:{} is also {other}; a GPU runs one stage", g.node, g.index)));
                }
                let c = cluster.nodes[n].class;
                if !cluster.classes[c].gpu.name.eq_ignore_ascii_case(&s.gpu) {
                    return Err(SolverError::invalid(
                        gfield,
                        format!("node '{}' has {} GPUs, the plan says {}", g.node, cluster.classes[c].gpu.name, s.gpu),
                    ));
                }
                if !classes.contains(&c) {
                    classes.push(c);
                }
            }
            // A stage whose nodes now measure differently is priced as its slowest class: the
            // one with the slowest link to the stage's other nodes.
            let slowness = |c: usize| {
                classes
                    .iter()
                    .filter(|&&o| o != c || cluster.classes[c].nodes.len() > 1)
                    .map(|&o| cluster.inter_bw(c, o))
                    .fold(f64::INFINITY, f64::min)
            };
            let class = classes.iter().copied().min_by(|&a, &b| slowness(a).total_cmp(&slowness(b))).expect("a stage has GPUs");
            stages.push(StagePlan { kind: StageKind { class, tp: s.tp, dp: s.dp }, layers: (s.layers[0], s.layers[1]) });
        }
        replicas.push(ReplicaPlan { stages, micro_batches: r.micro_batches });
    }
    let structure = PlanStructure { micro_batch: current.micro_batch, replicas };
    cm.check_layers_and_batch(&structure)
        .map_err(|m| SolverError::invalid("replicas", format!("the plan file is not a plan of this model and batch: {m}")))?;
    Ok(structure)
}

/// Re-plan on `req`'s cluster (with the new measurements in force) and compare with `current`.
pub fn replan(req: &PlanRequest, current: &CurrentPlan, policy: SwitchPolicy) -> Result<ReplanReport> {
    req.opts.validate()?;
    req.cluster.check_precision(req.opts.precision)?;
    let cm = CostModel { cluster: req.cluster, model: req.model, profiles: req.profiles, opts: req.opts };
    // Priced at another length, the running plan's times and memory would not be its own.
    if let Some(seq) = current.seq_len.filter(|&s| s != req.model.seq_len) {
        return Err(SolverError::invalid(
            "seq_len",
            format!(
                "the plan runs {seq}-token sequences but re-planning was asked for {}; re-plan at the plan's length",
                req.model.seq_len
            ),
        ));
    }
    let structure = structure_of(&cm, current)?;
    let now = cm.evaluate(&structure).iteration_time;
    let current_plan = crate::report::priced_as_given(&cm, &structure, current);
    let seeded = PlanRequest { seeds: vec![structure.clone()], ..req.clone() };
    let new_plan = plan(&seeded)?;
    let new_t = new_plan.iteration_time_s;
    let gain = now / new_t - 1.0;

    // Per GPU, the layers and tp it holds in a plan.
    let held = |stages: Vec<([u32; 2], u32, &[GpuId])>| -> BTreeMap<GpuId, ([u32; 2], u32)> {
        stages.into_iter().flat_map(|(layers, tp, gpus)| gpus.iter().map(move |g| (g.clone(), (layers, tp)))).collect()
    };
    let before = held(current.replicas.iter().flat_map(|r| &r.stages).map(|s| (s.layers, s.tp, s.gpus.as_slice())).collect());
    let after = held(new_plan.replicas.iter().flat_map(|r| &r.stages).map(|s| (s.layers, s.tp, s.gpus.as_slice())).collect());
    let mut moves = vec![];
    let mut per_node: BTreeMap<String, f64> = BTreeMap::new();
    let mut keys: Vec<&GpuId> = before.keys().chain(after.keys()).collect();
    keys.sort();
    keys.dedup();
    for g in keys {
        let (from, to) = (before.get(g), after.get(g));
        if from == to {
            continue;
        }
        let layers = cm.model.layers();
        let bytes_in = match to {
            Some(&(l, tp)) => {
                let (kept, had) = match from {
                    Some(&(f, ftp)) if ftp == tp => (f[1].min(l[1]).saturating_sub(f[0].max(l[0])), Some(f)),
                    _ => (0, None),
                };
                // The embedding comes with layer 0, the output head with the last layer (a tied
                // matrix once when the GPU holds both); what the GPU held of them stays.
                let holds = |r: [u32; 2], e: u32| r[0] <= e && e < r[1];
                let (first, last) = (holds(l, 0), holds(l, layers - 1));
                let kept_ends = had.map_or(0.0, |f| cm.model.ends_params(first && holds(f, 0), last && holds(f, layers - 1)));
                let ends = cm.model.ends_params(first, last) - kept_ends;
                (((l[1] - l[0]) - kept) as f64 * cm.model.layer_params + ends) / tp as f64 * 14.0
            }
            None => 0.0,
        };
        *per_node.entry(g.node.clone()).or_insert(0.0) += bytes_in;
        moves.push(Move { gpu: g.clone(), from: from.map(|x| x.0), to: to.map(|x| x.0), bytes_in });
    }
    let node_of: HashMap<&str, usize> = req.cluster.nodes.iter().enumerate().map(|(i, n)| (n.name.as_str(), i)).collect();
    let switch_seconds = per_node
        .iter()
        .map(|(n, b)| {
            let c = req.cluster.nodes[node_of[n.as_str()]].class;
            b / (req.cluster.inter_bw(c, c) * 1e9)
        })
        .fold(0.0, f64::max);
    let switch_bytes: f64 = per_node.values().sum();
    let saved = now - new_t;
    let payback = (saved > 0.0).then(|| switch_seconds / saved);
    let (worth, reason) = if saved <= 0.0 {
        (false, "the current plan is already the fastest found on the measured network".to_string())
    } else if gain < policy.min_gain {
        (false, format!("the new plan is {:.1}% faster, below the {:.1}% worth a switch", gain * 100.0, policy.min_gain * 100.0))
    } else if payback.is_some_and(|p| p > policy.horizon) {
        (
            false,
            format!(
                "moving {:.1} GB takes {:.0} iterations to pay back, more than the horizon of {}",
                switch_bytes / 1e9,
                payback.unwrap_or(0.0),
                policy.horizon
            ),
        )
    } else {
        (
            true,
            format!(
                "{:.1}% faster; moving {:.1} GB pays back in {:.1} iterations",
                gain * 100.0,
                switch_bytes / 1e9,
                payback.unwrap_or(0.0)
            ),
        )
    };
    Ok(ReplanReport {
        current_planned_s: current.iteration_time_s,
        current_now_s: now,
        new_iteration_time_s: new_t,
        gain,
        worth_switching: worth,
        reason,
        gpus_moved: moves.len(),
        switch_bytes,
        switch_seconds,
        payback_iterations: payback,
        moves,
        new_plan,
        current_plan,
    })
}
