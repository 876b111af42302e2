//! Preemption notices (issue 15; docs/recovery.md "Preemption notices"): a drain with a
//! deadline, as a spot instance gets 30 s to 2 min before it is taken away. Instead of moving
//! a job off the node at once from its newest checkpoint (losing every step since), the
//! coordinator asks the launch's ranks to save now, as just-in-time checkpointing does:
//!
//! 1. every node of the launch gets `SaveNow {notice, deadline}`; its agent writes the notice
//!    where the ranks look (MOTLEY_CKPT_NOTICE); the ranks agree, at the end of each step, on
//!    the newest notice any of them saw and save that step once (`motley_torch`);
//! 2. once a step newer than the newest complete one at the notice is complete (the bitmap),
//!    the job recovers off the node from it (`recovery::try_recover`, spending a preemption):
//!    the draining node is still live, so its copies serve the restore;
//! 3. if no newer step is complete by the deadline (ranks that do not save on notice, a step
//!    longer than the notice), the job recovers from its newest complete step then, as a drain
//!    without a deadline does at once.
//!
//! A withdrawn drain (undrain) ends the notice; the job runs on. Pending notices live in the
//! leader's memory: a new leader does not know them, and the job recovers when the node's
//! lease ends instead (from its newest complete step).

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use motley_proto::v1::{instruction, Instruction, SaveNow};
use serde_json::json;

use crate::fleet::Fleet;
use crate::job::JobState;
use crate::jobspec::JobSpec;
use crate::store::{JobRecord, NodeState, RecoveryCause, Store};

/// A launch told to save now because `node` leaves at `deadline`.
#[derive(Debug, Clone)]
struct Pending {
    generation: i64,
    node: String,
    deadline: Instant,
    /// The newest complete step when the notice was given (-1: none): a newer one is the save.
    before: i64,
    given: Instant,
}

/// The notices in flight, by job.
#[derive(Default)]
pub struct Notices {
    pending: Mutex<HashMap<i64, Pending>>,
}

/// The newest complete checkpoint step of job `id` (-1: none).
async fn newest_complete(store: &Store, id: i64) -> crate::error::Result<i64> {
    Ok(crate::checkpoints::steps(store, id).await?.iter().filter(|s| s.complete).map(|s| s.step).max().unwrap_or(-1))
}

/// Node `node` leaves in `deadline`: if launched job `job` (with ranks there) checkpoints and
/// may recover from a preemption, ask its ranks to save now and recover it once they have
/// (`check`). False when it cannot be asked (no checkpoint or budget, a deadline too close for
/// a step to end): the caller recovers it at once.
pub async fn give(store: &Store, fleet: &Fleet, job: &JobRecord, node: &str, deadline: Duration) -> bool {
    let Ok(spec) = serde_json::from_str::<JobSpec>(&job.spec) else { return false };
    if spec.checkpoint.is_none() || spec.max_preemptions == 0 {
        return false;
    }
    // Less than two base intervals: the instruction and the step's report could not both arrive.
    if deadline < fleet.base * 2 {
        return false;
    }
    if store.spent(job.id).await.is_ok_and(|s| s.preemptions >= i64::from(spec.max_preemptions)) {
        return false;
    }
    let (Ok(ranks), Ok(before)) = (store.ranks(job.id, job.generation).await, newest_complete(store, job.id).await) else {
        return false;
    };
    let now_ms = crate::store::now_ms();
    let notice =
        SaveNow { job: job.id, generation: job.generation, notice: now_ms, deadline_unix_ms: now_ms + deadline.as_millis() as i64 };
    let mut nodes: Vec<&str> = ranks.iter().map(|r| r.assignment.node.as_str()).collect();
    nodes.sort_unstable();
    nodes.dedup();
    let mut told = 0;
    for n in &nodes {
        told += usize::from(fleet.send(n, Instruction { kind: Some(instruction::Kind::SaveNow(notice)) }));
    }
    if told == 0 {
        return false;
    }
    let message = json!({"node": node, "deadline_s": deadline.as_secs_f64(), "newest_step": before, "nodes": nodes});
    if let Err(e) = store.record_event(Some(job.id), Some(job.generation), "preemption_notice", &message.to_string()).await {
        tracing::warn!(job = job.id, "recording the preemption notice: {e}");
    }
    tracing::info!(job = job.id, node, "preemption notice: the ranks save now, the node leaves in {deadline:?}");
    let now = Instant::now();
    fleet
        .notices
        .pending
        .lock()
        .expect("notices")
        .insert(job.id, Pending { generation: job.generation, node: node.to_string(), deadline: now + deadline, before, given: now });
    true
}

/// Every base interval (the recovery loop): recover each noticed job whose save is complete or
/// whose deadline came; forget notices whose launch moved on or whose drain was withdrawn.
pub async fn check(store: &Store, fleet: &Fleet) {
    let pending: Vec<(i64, Pending)> = fleet.notices.pending.lock().expect("notices").iter().map(|(k, v)| (*k, v.clone())).collect();
    for (id, p) in pending {
        let forget = || fleet.notices.pending.lock().expect("notices").remove(&id);
        let Ok(job) = store.job(id).await else { continue };
        if job.generation != p.generation || !matches!(job.state, JobState::Launching | JobState::Running) {
            forget(); // recovered already (the node's lease ended, a rank failed), or over
            continue;
        }
        if store.node(&p.node).await.is_ok_and(|n| n.state != NodeState::Draining) {
            tracing::info!(job = id, node = %p.node, "the drain was withdrawn: the preemption notice ends, the job runs on");
            forget();
            continue;
        }
        let newest = match newest_complete(store, id).await {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(job = id, "preemption notice: {e}");
                continue;
            }
        };
        let waited = p.given.elapsed().as_secs_f64();
        let reason = if newest > p.before {
            format!("node {} is draining (preemption notice): step {newest} was saved on notice in {waited:.1} s", p.node)
        } else if Instant::now() >= p.deadline {
            let from = if newest >= 0 { format!("step {newest}") } else { "no checkpoint".into() };
            format!("node {} is draining (preemption notice): no step saved by the deadline; recovering from {from}", p.node)
        } else {
            continue;
        };
        forget();
        if !crate::recovery::try_recover(store, fleet, &job, RecoveryCause::Preemption, &reason).await {
            tracing::info!(job = id, "preemption notice: {reason}, but the job cannot recover; it runs on until the node leaves");
        }
    }
}
