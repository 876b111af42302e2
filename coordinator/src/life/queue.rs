//! The job queue: a queued job's step. One worker of the leader plans queued jobs (`submitted`, or `planning` when a
//! coordinator stopped mid-plan), one at a time and oldest first, onto the GPUs no rank holds,
//! and sends each launch out. One task means two jobs are never planned onto the same free
//! GPUs.
//!
//! - A GPU is held by every rank of a launched job's current launch, and by any rank still
//!   reported running on a live node (a cancelled or failed job's ranks take up to the stop
//!   grace to exit, longer if a stop was lost): it is free once its rank is reported gone.
//! - A job is gang-scheduled: it waits while fewer GPUs are free than it would get on an idle
//!   cluster (its `resources.gpus`, or every GPU of its nodes), or while the free ones do not
//!   fit it (the solver says no but would have more to work with once others end), and the
//!   jobs behind it wait too — first come, first served, so a big job is not starved by small
//!   ones. The wait is recorded as a `waiting` event each time its reason changes.
//! - A job none of whose nodes is live fails with that reason — except a job queued before this
//!   term began (or before this process found it had been paused), during the next
//!   `GRACE_INTERVALS`: it waits until every node it may use is back (agents are
//!   still finding the leader).
//! - A job that cannot be planned for any other reason than the database (a stored spec this
//!   version cannot read) fails with the reason rather than blocking the queue.
//! - A new launch is sent to its agents at once; one that could not be sent (or inherited from
//!   an earlier leader) is sent by its step (`reconcile`) once its nodes are live.
//! - Planning has a deadline (`--plan-timeout-ms`, or the job file's `plan_timeout_s`): a job
//!   whose plan takes longer fails with the reason. Dispatch, lease and launch timeouts and the
//!   re-check of launched jobs run on the reconcile tick, never behind a plan: the queue is the
//!   tick's worker.
//! - The queue is looked at on every submit, whenever a job ends, and on every reconcile tick
//!   (each base interval) that finds a queued job.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use super::{Life, GRACE_INTERVALS};
use crate::agents::launch::send_out;
use crate::error::{CoordinatorError, Result};
use crate::job::JobState;
use crate::planning::{self, Planned};

/// The queue's worker, for as long as this coordinator leads (a deposed leader exits): one
/// pass whenever it is woken (a submit, a job's end, a profile that came in, and every
/// reconcile tick that finds a queued job).
pub async fn run(life: Arc<Life>) {
    let fleet = &life.fleet;
    let began = Instant::now();
    let began_ms = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as i64);
    loop {
        life.signals.queue_changed().await;
        // Early in a term, or soon after this process was paused: agents may still be on their
        // way back, so a queued job whose nodes are not live waits rather than fails.
        let grace = fleet.base * GRACE_INTERVALS;
        let settling = fleet.paused_within(grace).or((began.elapsed() < grace).then_some(began_ms));
        if let Err(e) = schedule(&life, settling).await {
            tracing::warn!("job queue: {e}");
        }
    }
}

/// One pass over the queue. `settling`: early in a term that began at this time (ms).
async fn schedule(life: &Life, settling: Option<i64>) -> Result<()> {
    let (store, fleet) = (&life.store, &*life.fleet);
    let jobs = store.unfinished_jobs().await?;
    let queued: Vec<i64> = jobs.iter().filter(|j| matches!(j.state, JobState::Submitted | JobState::Planning)).map(|j| j.id).collect();
    life.queue.keep(&queued);
    if queued.is_empty() {
        return Ok(()); // nothing to plan: no need to read who holds which GPU
    }
    let mut taken = planning::taken(store, fleet, &jobs).await?;
    for job in jobs.iter().filter(|j| matches!(j.state, JobState::Submitted | JobState::Planning)) {
        let why = if settling.is_some_and(|t| job.created_at_ms < t) {
            let missing = planning::missing_nodes(store, fleet, job).await.unwrap_or_default();
            (!missing.is_empty()).then(|| format!("waiting for the agents of {} to register with the new leader", missing.join(", ")))
        } else {
            None
        };
        let why = match why {
            Some(why) => Some(why),
            None => match planning::plan_job(store, fleet, job.id, &taken).await {
                Ok(Planned::Waiting(why)) => Some(why),
                Ok(Planned::Failed(_)) => None,
                Ok(Planned::Launched(j)) => {
                    for r in store.ranks(j.id, j.generation).await? {
                        taken.entry(r.assignment.node).or_default().insert(r.assignment.gpu as u32, j.id);
                    }
                    life.note_launch(j.id, j.generation).await;
                    send_out(store, fleet, &life.signals, j.id, j.generation).await?;
                    None
                }
                Err(e @ CoordinatorError::Database(_)) => return Err(e),
                Err(e) => {
                    // Not this pass's to retry: the job itself cannot be planned.
                    tracing::warn!(job = job.id, "cannot be planned: {e}");
                    if let Err(e) = store.transition(job.id, JobState::Failed, Some(&format!("cannot be planned: {e}"))).await {
                        tracing::info!(job = job.id, "move refused: {e}");
                    }
                    None
                }
            },
        };
        let waits = why.is_some();
        if let Some(why) = why.filter(|w| life.queue.set(job.id, Some(w.clone()))) {
            tracing::info!(job = job.id, "{why}");
            store.record_event(Some(job.id), None, "waiting", &why).await?;
        }
        if waits {
            break; // first come, first served
        }
        life.queue.set(job.id, None);
    }
    Ok(())
}

/// The queue's memory: why each queued job waits, as the queue last saw it.
#[derive(Default)]
pub struct Waiting(Mutex<HashMap<i64, String>>);

impl Waiting {
    /// Record why a queued job waits (None: it no longer does); true if the reason changed.
    fn set(&self, job: i64, why: Option<String>) -> bool {
        let mut waiting = self.0.lock().expect("waiting lock");
        match why {
            Some(w) => waiting.insert(job, w.clone()).as_ref() != Some(&w),
            None => waiting.remove(&job).is_some(),
        }
    }

    /// Forget the jobs no longer queued.
    fn keep(&self, queued: &[i64]) {
        self.0.lock().expect("waiting lock").retain(|id, _| queued.contains(id));
    }

    /// Why queued job `job` waits, if it does.
    pub fn why(&self, job: i64) -> Option<String> {
        self.0.lock().expect("waiting lock").get(&job).cloned()
    }
}
