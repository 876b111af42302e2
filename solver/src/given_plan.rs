//! A plan given as a document (`motley plan -o json`, the `plan:` of a job, the running plan
//! re-planning starts from): its structure rebuilt on a cluster GPU by GPU. Below `report`
//! (which prices such a plan as given) and `replan`; calls `plan`, `cost` and `error`.

use motley_contract::PlanDocument;
use std::collections::HashMap;

use crate::cost::{CostModel, StageKind};
use crate::error::{Result, SolverError};
use crate::plan::{PlanStructure, ReplicaPlan, StagePlan};

/// Rebuild the structure of a plan file on `cm`'s cluster (which may carry new measurements).
/// The GPUs are checked one by one (they exist, once each, of the stage's type); the cluster's
/// packing rule is not, since a running plan placed by an older cluster file may not follow it.
pub fn structure_of(cm: &CostModel, current: &PlanDocument) -> Result<PlanStructure> {
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
