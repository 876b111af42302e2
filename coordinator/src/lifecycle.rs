//! How jobs move once launched: rank reports -> job state (`progress`), launches sent to the
//! agents (`dispatch`), launches that are never acknowledged, nodes whose lease ends, and the
//! stop that follows a job's end. Reads and writes go through the store, every job move a
//! compare-and-set on (state, generation, term); the fleet carries instructions to agents.
//! Every refused move is logged: a job left behind by one is picked up again by the next look
//! (the job queue calls `progress` on every launched job every base interval).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use motley_proto::v1::{Launch, RankLaunch};

use crate::error::CoordinatorError;
use crate::fleet::{Fleet, LEASE_INTERVALS};
use crate::job::JobState;
use crate::jobspec::JobSpec;
use crate::store::Store;

/// A launch not acknowledged (every rank running) within this many base intervals of this
/// leader seeing it fails: an instruction or an agent was lost on the way.
pub const LAUNCH_INTERVALS: u32 = 30;

/// Move a job, logging a refusal (another move won, or this leader was deposed): true if it moved.
pub(crate) async fn move_job(store: &Store, id: i64, generation: i64, to: JobState, reason: Option<&str>) -> bool {
    match store.transition_at(id, Some(generation), to, reason).await {
        Ok(_) => true,
        Err(e) => {
            tracing::info!(job = id, generation, to = %to, "move refused: {e}");
            false
        }
    }
}

/// Tell every node of a launch to stop the job's ranks (its GPUs go back to the queue).
pub async fn stop_job(store: &Store, fleet: &Fleet, job: i64, generation: i64, reason: &str) {
    fleet.kick_queue();
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
pub async fn fail(store: &Store, fleet: &Fleet, id: i64, generation: i64, reason: &str) {
    if move_job(store, id, generation, JobState::Failed, Some(reason)).await {
        stop_job(store, fleet, id, generation, reason).await;
    }
}

/// Move a launched job on from its ranks' states: all running -> running; all exited 0 ->
/// succeeded; any non-zero exit -> failed (and the other ranks stopped). An error (the database)
/// is returned: the caller logs it, and the job queue's next pass looks again.
pub async fn progress(store: &Store, fleet: &Fleet, id: i64) -> Result<(), CoordinatorError> {
    let job = store.job(id).await?;
    if !matches!(job.state, JobState::Launching | JobState::Running) {
        return Ok(());
    }
    // Counted by the database: a heartbeat of a 1,024-rank job does not read 1,024 rows.
    let ranks = store.rank_summary(id, job.generation).await?;
    if let Some(bad) = ranks.first_failed {
        let reason = if bad.lost {
            format!("rank {} on node {} was lost (its process ended without an exit code while its agent was away)", bad.rank, bad.node)
        } else {
            format!("rank {} on node {} exited with code {}", bad.rank, bad.node, bad.exit_code.unwrap_or(-1))
        };
        crate::recovery::rank_failed(store, fleet, &job, &reason).await;
        return Ok(());
    }
    let started = ranks.started == ranks.total;
    if job.state == JobState::Launching && started {
        move_job(store, id, job.generation, JobState::Running, None).await;
    }
    if started && ranks.exited == ranks.total && move_job(store, id, job.generation, JobState::Succeeded, None).await {
        fleet.kick_queue();
    }
    Ok(())
}

/// Send a launched job's ranks to their agents; a node without a live agent fails the job.
#[tracing::instrument(skip(store, fleet))]
pub async fn dispatch(store: &Store, fleet: &Fleet, id: i64) -> Result<(), CoordinatorError> {
    let job = store.job(id).await?;
    if job.state != JobState::Launching {
        return Ok(());
    }
    let spec: JobSpec = serde_json::from_str(&job.spec).map_err(|e| CoordinatorError::Conflict(format!("stored job spec: {e}")))?;
    let plan = store.plan(id, job.generation).await?;
    let ranks = store.ranks(id, job.generation).await?;
    let mut envs = spec.launch_envs();
    // A recovery's launch: the agents restored this step for it (their MOTLEY_CKPT_RESTORE).
    if let Some(step) = store.restore_step(id, job.generation).await? {
        envs.insert(crate::recovery::RESTORE_STEP_ENV.into(), step.to_string());
    }
    let world = ranks.len() as i64;
    let Some(first) = ranks.first() else { return Ok(()) };
    let master_addr = fleet.address(&first.assignment.node).unwrap_or_else(|| "127.0.0.1".into());
    let master_port = master_port(fleet.master_port_base, id, job.generation);
    let doc = match motley_contract::PlanDocument::from_json(&plan) {
        Ok(doc) => doc,
        Err(e) => {
            fail(store, fleet, id, job.generation, &format!("the stored plan of generation {} does not read: {e}", job.generation)).await;
            return Ok(());
        }
    };
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
        };
        if !fleet.send_launch(&node, launch) {
            let reason = format!("node {node} has no live agent to launch on");
            fail(store, fleet, id, job.generation, &reason).await;
            return Ok(());
        }
    }
    Ok(())
}

/// Where a launch's ranks meet: one of 1,024 ports from the base, by job (jobs whose ids differ
/// by less than 512 never share one, even when their rank 0s share a host) and by generation's
/// parity (a relaunch never meets the rendezvous of the launch before it, whose ranks may still
/// be stopping).
fn master_port(base: u16, job: i64, generation: i64) -> u32 {
    u32::from(base) + (job.rem_euclid(512) as u32) * 2 + generation.rem_euclid(2) as u32
}

/// Fail launches this leader has seen stuck in `launching` for `LAUNCH_INTERVALS`.
async fn fail_stuck_launches(store: &Store, fleet: &Fleet, seen: &mut HashMap<(i64, i64), Instant>) {
    let Ok(jobs) = store.unfinished_jobs().await else { return };
    let now: Vec<(i64, i64)> = jobs.iter().filter(|j| j.state == JobState::Launching).map(|j| (j.id, j.generation)).collect();
    seen.retain(|k, _| now.contains(k));
    let limit = fleet.base * LAUNCH_INTERVALS;
    for key in now {
        let since = *seen.entry(key).or_insert_with(Instant::now);
        if since.elapsed() <= limit {
            continue;
        }
        let (id, generation) = key;
        let waiting: Vec<String> = match store.ranks(id, generation).await {
            Ok(r) => r
                .into_iter()
                .filter(|r| r.state == "assigned")
                .map(|r| format!("{} (rank {})", r.assignment.node, r.assignment.rank))
                .take(5)
                .collect(),
            Err(_) => continue,
        };
        let reason = format!("launch not acknowledged within {} ms; still waiting for {}", limit.as_millis(), waiting.join(", "));
        fail(store, fleet, id, generation, &reason).await;
    }
}

/// The lease clock: every base interval, expire leases older than `LEASE_INTERVALS` intervals
/// (judged by this process's own continuity, `Fleet::expire`) and hand the lost nodes to
/// `watch`. No database work here: a slow database must neither delay an expiry nor look like
/// a pause of the coordinator.
pub async fn lease_clock(fleet: Arc<Fleet>, lost: tokio::sync::mpsc::UnboundedSender<String>) {
    let mut tick = tokio::time::interval(fleet.base);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        for node in fleet.expire() {
            if lost.send(node).is_err() {
                return;
            }
        }
    }
}

/// Fail the launched jobs of the nodes `lease_clock` finds lost, with the reason; and every
/// base interval send launches not sent yet once their nodes are live, fail launches stuck for
/// `LAUNCH_INTERVALS`, and look at every launched job's ranks again (a report whose move
/// failed, on a database error say, is not lost: the job moves on this pass).
pub async fn watch(store: Store, fleet: Arc<Fleet>, mut lost: tokio::sync::mpsc::UnboundedReceiver<String>) {
    let mut tick = tokio::time::interval(fleet.base);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // When this leader first saw each (job, generation) launching: a takeover starts the clock
    // afresh rather than trusting another process's timestamps.
    let mut launching: HashMap<(i64, i64), Instant> = HashMap::new();
    loop {
        tokio::select! {
            node = lost.recv() => match node {
                Some(node) => node_lost(&store, &fleet, &node).await,
                None => return,
            },
            _ = tick.tick() => {
                fail_stuck_launches(&store, &fleet, &mut launching).await;
                if let Err(e) = recheck(&store, &fleet).await {
                    tracing::warn!("launched jobs: {e}");
                }
            }
        }
    }
}

/// Send the launches not sent yet and move every launched job on from its ranks.
async fn recheck(store: &Store, fleet: &Fleet) -> Result<(), CoordinatorError> {
    let jobs = store.unfinished_jobs().await?;
    let launching: Vec<(i64, i64)> = jobs.iter().filter(|j| j.state == JobState::Launching).map(|j| (j.id, j.generation)).collect();
    fleet.keep_sent(&launching);
    for &(id, generation) in &launching {
        if !fleet.was_sent(id, generation) {
            crate::scheduler::send_out(store, fleet, id, generation).await?;
        }
    }
    for j in jobs.iter().filter(|j| matches!(j.state, JobState::Launching | JobState::Running)) {
        progress(store, fleet, j.id).await?;
    }
    Ok(())
}

/// A node's lease ended: its launched jobs recover where they have budget, and fail otherwise.
async fn node_lost(store: &Store, fleet: &Fleet, node: &str) {
    let reason = format!("node {node} lost: no heartbeat for {} ms ({LEASE_INTERVALS} intervals)", lease(fleet).as_millis());
    tracing::warn!("{reason}");
    if let Err(e) = store.record_event(None, None, "node_lost", &reason).await {
        tracing::warn!("{e}");
    }
    crate::recovery::node_leaving(store, fleet, node, &reason, true, None).await;
}

fn lease(fleet: &Fleet) -> Duration {
    fleet.base * LEASE_INTERVALS
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
