//! The job queue. One task of the leader plans queued jobs (`submitted`, or `planning` when a
//! coordinator stopped mid-plan), one at a time and oldest first, onto the GPUs no launched job
//! holds, and sends each launch out. One task means two jobs are never planned onto the same
//! free GPUs.
//!
//! - A job is gang-scheduled: it waits while fewer GPUs are free than it would get on an idle
//!   cluster (its `resources.gpus`, or every GPU of its nodes), and the jobs behind it wait
//!   too — first come, first served, so a big job is not starved by small ones. The wait is
//!   recorded as a `waiting` event each time its reason changes.
//! - A job none of whose nodes is live fails with that reason — except a job queued before this
//!   term began, during the term's first `takeover::GRACE_INTERVALS`: its agents may still be
//!   finding the new leader.
//! - The queue is looked at on every submit, whenever a job ends, and every base interval (nodes
//!   come and go, launches are cancelled).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use crate::agents::{dispatch, Fleet};
use crate::control::{self, Planned, Taken};
use crate::error::Result;
use crate::job::JobState;
use crate::store::{JobRecord, Store};

/// Run the queue for as long as this coordinator leads (a deposed leader exits).
pub async fn run(store: Store, fleet: Arc<Fleet>) {
    let began = Instant::now();
    let began_ms = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as i64);
    let mut told: HashMap<i64, String> = HashMap::new();
    let mut tick = tokio::time::interval(fleet.base);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = fleet.queue_changed() => {}
        }
        let settling = (began.elapsed() < fleet.base * crate::takeover::GRACE_INTERVALS).then_some(began_ms);
        if let Err(e) = schedule(&store, &fleet, settling, &mut told).await {
            tracing::warn!("job queue: {e}");
        }
    }
}

/// One pass over the queue. `settling`: early in a term that began at this time (ms), agents
/// may not be back yet.
async fn schedule(store: &Store, fleet: &Fleet, settling: Option<i64>, told: &mut HashMap<i64, String>) -> Result<()> {
    let jobs = store.unfinished_jobs().await?;
    told.retain(|id, _| jobs.iter().any(|j| j.id == *id && j.state == JobState::Submitted));
    let mut taken = taken(store, &jobs).await?;
    for job in jobs.iter().filter(|j| matches!(j.state, JobState::Submitted | JobState::Planning)) {
        let why = if settling.is_some_and(|t| job.created_at_ms < t) && !fleet.any_live() {
            Some("waiting for agents to register with the new leader".to_string())
        } else {
            match control::plan_job(store, fleet, job.id, &taken).await? {
                Planned::Waiting(why) => Some(why),
                Planned::Failed(_) => None,
                Planned::Launched(j) => {
                    for r in store.ranks(j.id, j.generation).await? {
                        taken.entry(r.assignment.node).or_default().insert(r.assignment.gpu as u32, j.id);
                    }
                    if let Err(e) = dispatch(store, fleet, j.id).await {
                        tracing::warn!(job = j.id, "not launched: {e}");
                    }
                    None
                }
            }
        };
        if let Some(why) = why {
            if told.get(&job.id) != Some(&why) {
                tracing::info!(job = job.id, "{why}");
                store.record_event(Some(job.id), None, "waiting", &why).await?;
                told.insert(job.id, why);
            }
            break; // first come, first served
        }
    }
    Ok(())
}

/// The GPUs of every launched job's current generation.
async fn taken(store: &Store, jobs: &[JobRecord]) -> Result<Taken> {
    let mut taken = Taken::new();
    for j in jobs.iter().filter(|j| matches!(j.state, JobState::Launching | JobState::Running)) {
        for r in store.ranks(j.id, j.generation).await? {
            taken.entry(r.assignment.node).or_default().insert(r.assignment.gpu as u32, j.id);
        }
    }
    Ok(taken)
}
