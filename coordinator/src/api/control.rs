//! The changes behind the operations both APIs serve (`api`): they validate, call the store,
//! the planner and the job's life, and know nothing of HTTP or protobuf. The agents' gRPC
//! service declares nodes through here too.

use motley_solver::hardware::NodeSpec;
use motley_solver::{Cluster, ClusterSpec, PlanDocument};

use crate::error::{CoordinatorError, Result};
use crate::job::spec::JobSpec;
use crate::job::JobState;
use crate::state::signals::JobSignals;
use crate::store::{JobRecord, NodeState, RankAssignment, Store};

/// Declare (or update) a node's inventory: its cluster-file entry, one node (no `count`).
#[tracing::instrument(skip(store, entry))]
pub async fn declare_node(store: &Store, name: &str, entry: &str) -> Result<i64> {
    crate::job::validate::node_name(name).map_err(|e| CoordinatorError::invalid("node.name", e))?;
    let mut value: serde_norway::Value = serde_norway::from_str(entry).map_err(|e| CoordinatorError::invalid("node", format!("{e}")))?;
    let Some(map) = value.as_mapping_mut() else {
        return Err(CoordinatorError::invalid("node", "must be a cluster-file node entry (gpu, gpus, nics, ...)"));
    };
    // The name comes from the URL (or the agent); an entry may leave it out.
    map.insert("name".into(), name.into());
    let spec: NodeSpec = crate::job::spec::parse_yaml(value, "node")?;
    if spec.count.is_some() {
        return Err(CoordinatorError::invalid("node.count", "a node entry here is one node; remove count"));
    }
    // The same validation as a cluster file.
    Cluster::from_spec(&ClusterSpec { name: "check".into(), nodes: vec![spec.clone()], gpu_types: crate::state::catalog::declared() })
        .map_err(|e| CoordinatorError::invalid(e.to_string().replace("nodes[0]", "node"), "see the cluster file format in README.md"))?;
    let json = serde_json::to_string(&spec).expect("a node spec serialises");
    store.register_node(name, &json).await
}

/// Submit a job file: validated and stored as `submitted`, then queued (`life::queue`).
/// `default_cloud`: the checkpoint cloud of a job that checkpoints and names none.
#[tracing::instrument(skip_all)]
pub async fn submit(store: &Store, signals: &JobSignals, text: &str, default_cloud: Option<&str>) -> Result<JobRecord> {
    let spec = JobSpec::parse(text)?.with_default_cloud(default_cloud);
    let json = serde_json::to_string(&spec).expect("a job spec serialises");
    let job = store.submit_job(&spec.name, &json).await?;
    signals.kick_queue();
    Ok(job)
}

/// Plan a job file without storing anything, on the declared inventory (active nodes, live or
/// not: operators plan before the agents are up).
#[tracing::instrument(skip_all)]
pub async fn dry_run(store: &Store, fleet: &crate::state::fleet::Fleet, text: &str) -> Result<(PlanDocument, Vec<RankAssignment>)> {
    crate::planning::dry_run(store, fleet, &JobSpec::parse(text)?).await
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

/// The longest preemption notice taken: a week.
pub const MAX_DRAIN_DEADLINE_S: u32 = 7 * 86_400;

/// A drain's `deadline_s` (0: none) as a deadline, refused past `MAX_DRAIN_DEADLINE_S`.
pub fn drain_deadline(deadline_s: u32) -> Result<Option<std::time::Duration>> {
    if deadline_s > MAX_DRAIN_DEADLINE_S {
        return Err(CoordinatorError::invalid(
            "deadline_s",
            format!("{deadline_s} s is more than a week; give the seconds until the node goes away (at most {MAX_DRAIN_DEADLINE_S}), or 0 for none"),
        ));
    }
    Ok((deadline_s > 0).then(|| std::time::Duration::from_secs(u64::from(deadline_s))))
}

/// Drain (or undrain) a node: it gets no new ranks; its agent is told. `deadline`: the node
/// goes away then (a preemption notice, see `life::notice`).
#[tracing::instrument(skip(life))]
pub async fn set_draining(
    life: &crate::life::Life,
    name: &str,
    draining: bool,
    deadline: Option<std::time::Duration>,
) -> Result<crate::store::NodeRecord> {
    let state = if draining { NodeState::Draining } else { NodeState::Active };
    let node = life.store.set_node_state(name, state).await?;
    life.fleet.tell_drain(name, draining);
    if draining {
        // Jobs with budget move off the node now (its checkpoint copies still serve the
        // restore), or, given a deadline, once they saved a step; the others keep running
        // there until they end.
        life.node_leaving(name, &format!("node {name} is draining"), false, deadline).await;
    }
    Ok(node)
}

/// Cancel a job that is not over yet, and stop its ranks.
#[tracing::instrument(skip(store, fleet, signals))]
pub async fn cancel(store: &Store, fleet: &crate::state::fleet::Fleet, signals: &JobSignals, id: i64, reason: &str) -> Result<JobRecord> {
    let job = store.transition(id, JobState::Cancelled, Some(reason)).await?;
    crate::agents::launch::stop_job(store, fleet, signals, job.id, job.generation, reason).await;
    Ok(job)
}

/// Remove a node from the inventory: refused while its agent holds a lease (it would register
/// the node again) or while ranks of an unfinished job, or ranks still running, are on it.
#[tracing::instrument(skip(store, fleet))]
pub async fn remove_node(store: &Store, fleet: &crate::state::fleet::Fleet, name: &str) -> Result<crate::store::NodeRecord> {
    let node = store.node(name).await?;
    if fleet.live(name) {
        return Err(CoordinatorError::Conflict(format!(
            "node {name} has a live agent; stop it (systemctl stop motley-agent) first, then remove the node"
        )));
    }
    store.remove_node(name).await?;
    Ok(node)
}
