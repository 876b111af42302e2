//! Re-planning when bandwidth changes: price the running plan on the network as measured now,
//! plan afresh, and say whether switching pays (the dynamic-networks paper's re-planning).
//!
//! Switching is worth it when the new plan is at least `min_gain` faster than the current one
//! *under the new measurements* and the state that has to move pays for itself within
//! `horizon` iterations. What moves: every GPU whose layers change fetches the weights and
//! Adam states (14 bytes per parameter of its TP shard: fp16 weights, fp32 master weights and
//! two moments; gradients are rebuilt) of the layers it did not hold, over its node's NICs;
//! nodes fetch in parallel, so the switch takes as long as the busiest node.
//!
//! The running plan's document and its structure are `given_plan`'s; the new plan and the
//! current one's report are `report`'s. Calls `given_plan`, `report`, `cost`, `placement`.

use serde::Serialize;
use std::collections::{BTreeMap, HashMap};

use crate::cost::CostModel;
use crate::error::{Result, SolverError};
use crate::given_plan::structure_of;
use crate::placement::GpuId;
use crate::report::{plan, priced_as_given, PlanDocument, PlanRequest};

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
    pub new_plan: PlanDocument,
    /// The current plan as priced now, on its own GPUs: per-stage forward/backward seconds,
    /// hops, memory (search mode "given"; not checked against memory).
    pub current_plan: PlanDocument,
}

/// Re-plan on `req`'s cluster (with the new measurements in force) and compare with `current`.
pub fn replan(req: &PlanRequest, current: &PlanDocument, policy: SwitchPolicy) -> Result<ReplanReport> {
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
    let current_plan = priced_as_given(&cm, &structure, current);
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
