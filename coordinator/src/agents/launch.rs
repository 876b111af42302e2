//! Launches and stops: a launch's instructions to its agents (`dispatch`, sent once by
//! `send_out`), the stop of a launch's ranks, and the fenced job moves that go with them. Below
//! the job's life (`life`), which decides when; this room only carries it out. Every job move
//! is a compare-and-set on (state, generation, term) in the store; a refused one is logged and
//! the next look at the job picks it up again.

use std::collections::HashMap;

use motley_proto::v1::{Launch, PeerDataPlane, RankLaunch};

use crate::error::CoordinatorError;
use crate::job::spec::JobSpec;
use crate::job::JobState;
use crate::state::fleet::Fleet;
use crate::state::signals::JobSignals;
use crate::store::{JobRecord, Store};

/// A launch not acknowledged (every rank running) within this many base intervals of this
/// leader seeing it fails: an instruction or an agent was lost on the way.
pub const LAUNCH_INTERVALS: u32 = 30;

/// The launch environment variable naming the step a recovery's ranks resume from.
pub const RESTORE_STEP_ENV: &str = "MOTLEY_CKPT_RESTORE_STEP";
/// The launch environment variable naming the generation whose files of that step the ranks
/// load: they refuse a file another generation wrote (docs/checkpoint.md, "Environment").
pub const RESTORE_GENERATION_ENV: &str = "MOTLEY_CKPT_RESTORE_GENERATION";
/// The launch environment variable naming the cloud prefix the agents upload the job's steps
/// to (`cluster::ClusterIdentity::checkpoint_cloud`).
pub const CLOUD_ENV: &str = "MOTLEY_CKPT_CLOUD";

/// Move a job, logging a refusal (another move won, or this leader was deposed): true if it moved.
pub async fn move_job(store: &Store, id: i64, generation: i64, to: JobState, reason: Option<&str>) -> bool {
    match store.transition_at(id, Some(generation), to, reason).await {
        Ok(_) => true,
        Err(e) => {
            tracing::info!(job = id, generation, to = %to, "move refused: {e}");
            false
        }
    }
}

/// Tell every node of a launch to stop the job's ranks (its GPUs go back to the queue).
pub async fn stop_job(store: &Store, fleet: &Fleet, signals: &JobSignals, job: i64, generation: i64, reason: &str) {
    signals.kick_queue();
    let ranks = match store.ranks(job, generation).await {
        Ok(r) => r,
        Err(e) => {
            // The ranks' own reports will find the job over and be told to stop then.
            tracing::warn!(job, generation, "cannot read the ranks to stop: {e}");
            return;
        }
    };
    let mut nodes: Vec<String> = ranks.into_iter().map(|r| r.assignment.node).collect();
    nodes.sort();
    nodes.dedup();
    for n in nodes {
        fleet.tell_stop(&n, job, generation, reason);
    }
}

/// Fail a launch with the reason and stop its ranks (if the move is still allowed).
pub async fn fail(store: &Store, fleet: &Fleet, signals: &JobSignals, id: i64, generation: i64, reason: &str) {
    if move_job(store, id, generation, JobState::Failed, Some(reason)).await {
        stop_job(store, fleet, signals, id, generation, reason).await;
    }
}

/// Send a launch to its agents if all its nodes are live, once: claimed in the signals first.
pub async fn send_out(store: &Store, fleet: &Fleet, signals: &JobSignals, id: i64, generation: i64) -> Result<(), CoordinatorError> {
    let ranks = store.ranks(id, generation).await?;
    if !ranks.iter().all(|r| fleet.live(&r.assignment.node)) {
        return Ok(()); // the takeover's grace (or the launch timeout) decides if they never come
    }
    if !signals.claim_send(id, generation) {
        return Ok(()); // being sent, or sent, by another task
    }
    if let Err(e) = dispatch(store, fleet, signals, id).await {
        signals.unclaim_send(id, generation);
        tracing::warn!(job = id, "not launched yet: {e}");
    }
    Ok(())
}

/// Send a launched job's ranks to their agents; a node without a live agent fails the job.
#[tracing::instrument(skip(store, fleet, signals))]
pub async fn dispatch(store: &Store, fleet: &Fleet, signals: &JobSignals, id: i64) -> Result<(), CoordinatorError> {
    let job = store.job(id).await?;
    if job.state != JobState::Launching {
        return Ok(());
    }
    let launches = match launches(store, fleet, &job).await? {
        Ok(l) => l,
        Err(reason) => {
            fail(store, fleet, signals, id, job.generation, &reason).await;
            return Ok(());
        }
    };
    for (node, launch) in launches {
        if !fleet.send_launch(&node, launch) {
            let reason = format!("node {node} has no live agent to launch on");
            fail(store, fleet, signals, id, job.generation, &reason).await;
            return Ok(());
        }
    }
    Ok(())
}

/// Start ranks `ranks` of a degraded job's current launch again, to rejoin in epoch `epoch`
/// (docs/keep-going.md): their nodes' part of the launch, with the epoch's membership document
/// the agents write before starting them; never a restore (they take their state from the
/// members). False when a node has no live agent (the next look tries again).
pub async fn send_rejoin(
    store: &Store,
    fleet: &Fleet,
    job: &JobRecord,
    ranks: &[i64],
    epoch: i64,
    document: &str,
) -> Result<bool, CoordinatorError> {
    let Ok(launches) = launches(store, fleet, job).await? else { return Ok(false) };
    let mut all = true;
    for (node, mut launch) in launches {
        launch.ranks.retain(|r| ranks.contains(&r.rank));
        if launch.ranks.is_empty() {
            continue;
        }
        launch.envs.remove(RESTORE_STEP_ENV);
        launch.envs.remove(RESTORE_GENERATION_ENV);
        launch.join_epoch = epoch;
        launch.membership = document.to_string();
        all &= fleet.send_launch(&node, launch);
    }
    Ok(all)
}

/// The launch of `job`'s current generation, node by node, as its agents get it; Err(why) when
/// its stored plan does not read (the launch cannot run).
async fn launches(store: &Store, fleet: &Fleet, job: &JobRecord) -> Result<Result<Vec<(String, Launch)>, String>, CoordinatorError> {
    let id = job.id;
    let spec: JobSpec = serde_json::from_str(&job.spec).map_err(|e| CoordinatorError::Conflict(format!("stored job spec: {e}")))?;
    let plan = store.plan(id, job.generation).await?;
    let ranks = store.ranks(id, job.generation).await?;
    let mut envs = spec.launch_envs();
    // The cloud prefix of this cluster's job (`cluster`): never another cluster's job 1.
    if let Some(url) = store.cluster().checkpoint_cloud(&spec, id) {
        envs.insert(CLOUD_ENV.into(), url);
    }
    // A recovery's launch: the agents restored this step for it (their MOTLEY_CKPT_RESTORE).
    if let Some(step) = store.restore_step(id, job.generation).await? {
        envs.insert(RESTORE_STEP_ENV.into(), step.to_string());
        if let Some(from) = store.restore_generation(id, job.generation).await? {
            envs.insert(RESTORE_GENERATION_ENV.into(), from.to_string());
        }
    }
    let world = ranks.len() as i64;
    let Some(first) = ranks.first() else { return Ok(Ok(vec![])) };
    let master_addr = fleet.address(&first.assignment.node).unwrap_or_else(|| "127.0.0.1".into());
    let master_port = master_port(fleet.master_port_base, id, job.generation);
    let doc = match motley_contract::PlanDocument::from_json(&plan) {
        Ok(doc) => doc,
        Err(e) => return Ok(Err(format!("the stored plan of generation {} does not read: {e}", job.generation))),
    };
    // The other replicas keep training through a lost one (docs/keep-going.md): the ranks
    // vote on each step and watch their membership file (the agents' MOTLEY_MEMBERSHIP).
    if crate::planning::membership::keeps_going(spec.keep_going, &doc) {
        envs.insert("MOTLEY_KEEP_GOING".into(), "1".into());
    }
    let places: HashMap<(String, u32), motley_contract::RankPlacement> =
        doc.placements().into_iter().map(|(g, p)| ((g.node, g.index), p)).collect();
    let mut by_node: HashMap<String, Vec<RankLaunch>> = HashMap::new();
    for r in &ranks {
        let a = &r.assignment;
        let place = u32::try_from(a.gpu).ok().and_then(|gpu| places.get(&(a.node.clone(), gpu))).copied().unwrap_or_default();
        by_node.entry(r.assignment.node.clone()).or_default().push(RankLaunch {
            rank: r.assignment.rank,
            local_rank: r.assignment.local_rank,
            local_world_size: 0,
            gpu: r.assignment.gpu,
            replica: r.assignment.replica,
            stage: r.assignment.stage,
            layer_start: r.assignment.layer_start,
            layer_end: r.assignment.layer_end,
            tp_rank: place.tp_rank.into(),
            tp_size: place.tp_size.into(),
            stage_dp_rank: place.stage_dp_rank.into(),
            stage_dp_size: place.stage_dp_size.into(),
            pp_size: place.pp_size.into(),
            replicas: place.replicas.into(),
        });
    }
    let plan_nodes: std::collections::BTreeSet<String> = by_node.keys().cloned().collect();
    let mut out = Vec::with_capacity(by_node.len());
    for (node, mut list) in by_node {
        let n = list.len() as i64;
        for r in &mut list {
            r.local_world_size = n;
        }
        let launch = Launch {
            job: id,
            generation: job.generation,
            run: spec.run.clone(),
            envs: envs.clone(),
            plan_json: plan.clone(),
            master_addr: master_addr.clone(),
            master_port,
            world_size: world,
            ranks: list,
            user: spec.user.clone().unwrap_or_default(),
            peers: peers(fleet, &plan_nodes, &node),
            join_epoch: 0,
            membership: String::new(),
        };
        out.push((node, launch));
    }
    Ok(Ok(out))
}

/// The other nodes of a launch with the data plane each registered, which the node probes the
/// links to while the launch runs (docs/network.md); a node without a data plane is left out.
fn peers(fleet: &Fleet, nodes: &std::collections::BTreeSet<String>, node: &str) -> Vec<PeerDataPlane> {
    nodes
        .iter()
        .filter(|n| n.as_str() != node)
        .filter_map(|n| fleet.data_url(n).map(|data_url| PeerDataPlane { node: n.clone(), data_url }))
        .collect()
}

/// Where a launch's ranks meet: one of 1,024 ports from the base, by job (jobs whose ids differ
/// by less than 512 never share one, even when their rank 0s share a host) and by generation's
/// parity (a relaunch never meets the rendezvous of the launch before it, whose ranks may still
/// be stopping).
pub(crate) fn master_port(base: u16, job: i64, generation: i64) -> u32 {
    u32::from(base) + (job.rem_euclid(512) as u32) * 2 + generation.rem_euclid(2) as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn master_ports_differ_by_job_and_by_generation() {
        assert_eq!(master_port(29500, 1, 1), 29503);
        assert_eq!(master_port(29500, 1, 2), 29502, "a relaunch moves to the next port");
        let mut seen = std::collections::HashSet::new();
        for job in 1000..1512 {
            for generation in [7, 8] {
                let p = master_port(29500, job, generation);
                assert!((29500..29500 + 1024).contains(&p));
                assert!(seen.insert(p), "job {job} generation {generation} reuses port {p}");
            }
        }
    }
}
