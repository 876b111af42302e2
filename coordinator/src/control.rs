//! The control operations behind both APIs (REST and gRPC): they validate, call the store and
//! the solver, and know nothing of HTTP or protobuf.

use motley_solver::hardware::NodeSpec;
use motley_solver::{Cluster, ClusterSpec, PlanOptions, PlanReport, PlanRequest, ProfileSet, SearchMode};

use crate::error::{CoordinatorError, Result};
use crate::job::JobState;
use crate::jobspec::JobSpec;
use crate::store::{JobRecord, NodeState, RankAssignment, Store};

/// Declare (or update) a node's inventory: its cluster-file entry, one node (no `count`).
#[tracing::instrument(skip(store, entry))]
pub async fn declare_node(store: &Store, name: &str, entry: &str) -> Result<i64> {
    let mut value: serde_norway::Value = serde_norway::from_str(entry).map_err(|e| CoordinatorError::invalid("node", format!("{e}")))?;
    let Some(map) = value.as_mapping_mut() else {
        return Err(CoordinatorError::invalid("node", "must be a cluster-file node entry (gpu, gpus, nics, ...)"));
    };
    // The name comes from the URL (or the agent); an entry may leave it out.
    map.insert("name".into(), name.into());
    let spec: NodeSpec = crate::jobspec::parse_yaml(value, "node")?;
    if spec.count.is_some() {
        return Err(CoordinatorError::invalid("node.count", "a node entry here is one node; remove count"));
    }
    // The same validation as a cluster file.
    Cluster::from_spec(&ClusterSpec { name: "check".into(), nodes: vec![spec.clone()], gpu_types: vec![] })
        .map_err(|e| CoordinatorError::invalid(e.to_string().replace("nodes[0]", "node"), "see the cluster file format in README.md"))?;
    let json = serde_json::to_string(&spec).expect("a node spec serialises");
    store.register_node(name, &json).await
}

/// Submit a job file: validated and stored as `submitted`.
#[tracing::instrument(skip_all)]
pub async fn submit(store: &Store, text: &str) -> Result<JobRecord> {
    let spec = JobSpec::parse(text)?;
    let json = serde_json::to_string(&spec).expect("a job spec serialises");
    store.submit_job(&spec.name, &json).await
}

/// Plan and launch a stored job in the background: planning on the live inventory, then the
/// launch instructions to the agents. Progress shows in the job's events.
pub fn start(store: &Store, fleet: &std::sync::Arc<crate::agents::Fleet>, id: i64) {
    // Once per job at a time: a job submitted as a standby takes over is found by both the
    // submit and the takeover, and a second planning could fail the launched job.
    if !fleet.begin_planning(id) {
        return;
    }
    let (store, fleet) = (store.clone(), fleet.clone());
    tokio::spawn(async move {
        let launched = match plan_job(&store, &fleet, id).await {
            Ok(_) => crate::agents::dispatch(&store, &fleet, id).await,
            Err(e) => Err(e),
        };
        fleet.end_planning(id);
        if let Err(e) = launched {
            tracing::warn!(job = id, "not launched: {e}");
        }
    });
}

/// Plan a job file without storing anything, on the declared inventory (active nodes, live or
/// not: operators plan before the agents are up).
#[tracing::instrument(skip_all)]
pub async fn dry_run(store: &Store, text: &str) -> Result<(PlanReport, Vec<RankAssignment>)> {
    let spec = JobSpec::parse(text)?;
    plan_on_inventory(store, &spec, None).await
}

/// The job with the plan and ranks of its current launch.
pub async fn current_plan(store: &Store, id: i64) -> Result<(JobRecord, String, Vec<crate::store::RankRecord>)> {
    let job = store.job(id).await?;
    if job.generation == 0 {
        return Err(CoordinatorError::not_found(format!("plan of job {} (it is {}, not launched yet)", job.id, job.state)));
    }
    let plan = store.plan(job.id, job.generation).await?;
    let ranks = store.ranks(job.id, job.generation).await?;
    Ok((job, plan, ranks))
}

/// Drain (or undrain) a node: it gets no new ranks; its agent is told.
#[tracing::instrument(skip(store, fleet))]
pub async fn set_draining(store: &Store, fleet: &crate::agents::Fleet, name: &str, draining: bool) -> Result<crate::store::NodeRecord> {
    let state = if draining { NodeState::Draining } else { NodeState::Active };
    let node = store.set_node_state(name, state).await?;
    fleet.tell_drain(name, draining);
    Ok(node)
}

/// Cancel a job that is not over yet.
#[tracing::instrument(skip(store))]
pub async fn cancel(store: &Store, id: i64, reason: &str) -> Result<JobRecord> {
    store.transition(id, JobState::Cancelled, Some(reason)).await
}

/// Plan a submitted job on the live inventory (active nodes with a live agent, within the
/// job's resources) and store its first launch: `submitted -> planning -> launching` with
/// generation 1, or `failed` with the planner's reason.
#[tracing::instrument(skip(store, fleet))]
pub async fn plan_job(store: &Store, fleet: &crate::agents::Fleet, id: i64) -> Result<JobRecord> {
    let job = store.job(id).await?;
    // A job found in `planning` was left there by a coordinator that stopped: plan it again.
    let job = if job.state == JobState::Planning { job } else { store.transition(id, JobState::Planning, None).await? };
    let spec: JobSpec = serde_json::from_str(&job.spec).map_err(|e| CoordinatorError::Conflict(format!("stored job spec: {e}")))?;
    match plan_on_inventory(store, &spec, Some(fleet)).await {
        Ok((report, ranks)) => {
            let plan = serde_json::to_string(&report).expect("a plan serialises");
            store.start_generation(id, &plan, &ranks).await?;
            store.job(id).await
        }
        Err(e) => store.transition(id, JobState::Failed, Some(&e.to_string())).await,
    }
}

/// The solver on the active nodes within the job's resources; with `live`, only nodes whose
/// agent holds a lease (a launch on a node that vanished would fail at once).
async fn plan_on_inventory(
    store: &Store,
    spec: &JobSpec,
    live: Option<&crate::agents::Fleet>,
) -> Result<(PlanReport, Vec<RankAssignment>)> {
    let mut nodes = vec![];
    for n in store.nodes().await? {
        if n.state != NodeState::Active || (!spec.resources.nodes.is_empty() && !spec.resources.nodes.contains(&n.name)) {
            continue;
        }
        if live.is_some_and(|f| !f.live(&n.name)) {
            continue;
        }
        let entry: NodeSpec = serde_json::from_str(&n.inventory)
            .map_err(|e| CoordinatorError::Conflict(format!("node {}: stored inventory: {e}", n.name)))?;
        nodes.push(entry);
    }
    if nodes.is_empty() {
        let which = if live.is_some() { "live node (an active node whose agent holds a lease)" } else { "active node" };
        return Err(CoordinatorError::Conflict(format!("no {which} matches the job's resources; start agents, register or undrain nodes")));
    }
    // Within a GPU budget, take nodes in name order until it is met (the last one only in
    // part): the plan never uses more GPUs than the job may.
    if let Some(budget) = spec.resources.gpus {
        let mut left = budget;
        nodes.retain_mut(|n| {
            let take = n.gpus.min(left);
            left -= take;
            n.gpus = take;
            // Rails name GPUs by index: keep those the part still has.
            for nic in &mut n.nics {
                nic.gpus.retain(|&g| g < take);
            }
            take > 0
        });
    }
    let cluster = Cluster::from_spec(&ClusterSpec { name: "live".into(), nodes, gpu_types: vec![] })
        .map_err(|e| CoordinatorError::Conflict(format!("inventory: {e}")))?;
    let model = spec.model()?;
    let opts = PlanOptions { global_batch: spec.global_batch, ..PlanOptions::default() };
    // The solver is pure CPU work: keep it off the async workers.
    let report = tokio::task::spawn_blocking(move || {
        let profiles = ProfileSet::default();
        let req = PlanRequest {
            cluster: &cluster,
            model: &model,
            profiles: &profiles,
            opts: &opts,
            mode: SearchMode::Auto,
            exhaustive: false,
            seeds: vec![],
        };
        motley_solver::plan(&req)
    })
    .await
    .map_err(|e| CoordinatorError::Conflict(format!("planner: {e}")))?
    .map_err(|e| CoordinatorError::Conflict(e.to_string()))?;
    let ranks = ranks_of(&report);
    Ok((report, ranks))
}

/// Rank numbering: replicas in order, stages in order, GPUs in order (TP fastest); local ranks
/// count a node's ranks in that order.
pub fn ranks_of(report: &PlanReport) -> Vec<RankAssignment> {
    let mut out = vec![];
    let mut local: std::collections::HashMap<String, i64> = Default::default();
    for (ri, r) in report.replicas.iter().enumerate() {
        for (si, s) in r.stages.iter().enumerate() {
            for g in &s.gpus {
                let l = local.entry(g.node.clone()).or_insert(0);
                out.push(RankAssignment {
                    rank: out.len() as i64,
                    node: g.node.clone(),
                    local_rank: *l,
                    gpu: g.index as i64,
                    replica: ri as i64,
                    stage: si as i64,
                    layer_start: s.layers[0] as i64,
                    layer_end: s.layers[1] as i64,
                });
                *l += 1;
            }
        }
    }
    out
}
