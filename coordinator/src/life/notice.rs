//! Preemption notices (docs/recovery.md "Preemption notices"): a drain with a
//! deadline, as a spot instance gets 30 s to 2 min before it is taken away. Instead of moving
//! a job off the node at once from its newest checkpoint (losing every step since), the
//! coordinator asks the launch's ranks to save now, as just-in-time checkpointing does:
//!
//! 1. every node of the launch gets `SaveNow {notice, deadline}`; its agent writes the notice
//!    where the ranks look (MOTLEY_CKPT_NOTICE); the ranks agree, at the end of each step, on
//!    the newest notice any of them saw and save that step once (`motley_torch`);
//! 2. once a step newer than any begun when the notice was given is complete (the bitmap),
//!    the job recovers off the node from it (`Life::try_recover`, spending a preemption):
//!    the draining node is still live, so its copies serve the restore;
//! 3. if no newer step is complete by the deadline (ranks that do not save on notice, a step
//!    longer than the notice), the job recovers from its newest complete step then, as a drain
//!    without a deadline does at once.
//!
//! A withdrawn drain (undrain) ends the notice; the job runs on. Pending notices live in the
//! leader's memory, rebuilt by a new leader from the durable `preemption_notice` events
//! (`resume_notices`): the notice's deadline and the step it waits to be passed are in the event.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use motley_proto::v1::{instruction, Instruction, SaveNow};
use serde_json::json;

use super::Life;
use crate::job::spec::JobSpec;
use crate::job::JobState;
use crate::store::{JobRecord, NodeState, RecoveryCause, Store};

/// The notice room's memory: the notices in flight, by job.
#[derive(Default)]
pub(super) struct Memory(Mutex<HashMap<i64, Pending>>);

impl Memory {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<i64, Pending>> {
        self.0.lock().expect("notices")
    }
}

/// A launch told to save now because `node` leaves at `deadline`.
#[derive(Debug, Clone)]
pub(super) struct Pending {
    generation: i64,
    node: String,
    deadline: Instant,
    /// The newest step any file of which was reported when the notice was given (-1: none): a
    /// complete step newer than it is the notice's save.
    before: i64,
    given: Instant,
}

/// The newest step of job `id` any file of which was reported, complete or not (-1: none): a
/// save in flight when a notice is given is not the notice's save, however it ends.
async fn newest_started(store: &Store, id: i64) -> crate::error::Result<i64> {
    Ok(crate::views::checkpoints::steps(store, id).await?.iter().map(|s| s.step).max().unwrap_or(-1))
}

/// Node `node` leaves in `deadline`: if launched job `job` (with ranks there) checkpoints and
/// may recover from a preemption, ask its ranks to save now and recover it once they have
/// (`check_notices`). False when it cannot be asked (no checkpoint or budget, a deadline too close for
/// a step to end): the caller recovers it at once. A second notice for a launch already
/// saving (another of its nodes drained, or this one again) asks nothing more: it can only
/// bring the deadline forward.
impl Life {
    pub(super) async fn give_notice(&self, job: &JobRecord, node: &str, deadline: Duration) -> bool {
        let (store, fleet) = (&self.store, &self.fleet);
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
        let now = Instant::now();
        let earlier = {
            let mut pending = self.notices.lock();
            pending.get_mut(&job.id).filter(|p| p.generation == job.generation).map(|p| {
                if now + deadline < p.deadline {
                    (p.deadline, p.node) = (now + deadline, node.to_string());
                }
                p.before
            })
        };
        let (before, nodes) = match earlier {
            Some(before) => (before, vec![]),
            None => {
                // A degraded job's lost replicas have no ranks to save: its members' nodes only.
                let ranks = if job.state == JobState::Degraded {
                    self.degraded_members(job).await.ok().flatten()
                } else {
                    store.ranks(job.id, job.generation).await.ok()
                };
                let (Some(ranks), Ok(before)) = (ranks, newest_started(store, job.id).await) else {
                    return false;
                };
                let mut nodes: Vec<String> = ranks.into_iter().map(|r| r.assignment.node).collect();
                nodes.sort_unstable();
                nodes.dedup();
                if !self.ask_to_save(job, &nodes, deadline) {
                    return false;
                }
                self.notices.lock().insert(
                    job.id,
                    Pending { generation: job.generation, node: node.to_string(), deadline: now + deadline, before, given: now },
                );
                tracing::info!(job = job.id, node, "preemption notice: the ranks save now, the node leaves in {deadline:?}");
                (before, nodes)
            }
        };
        // Durable: a new leader takes the notice over from it (`resume_notices`).
        let message = json!({"node": node, "deadline_s": deadline.as_secs_f64(), "newest_step": before, "nodes": nodes});
        if let Err(e) = store.record_event(Some(job.id), Some(job.generation), "preemption_notice", &message.to_string()).await {
            tracing::warn!(job = job.id, "recording the preemption notice: {e}");
        }
        true
    }

    /// Whether `node` holds ranks of degraded `job`'s members (a lost replica's are out already).
    pub(super) async fn member_on(&self, job: &JobRecord, node: &str) -> bool {
        self.degraded_members(job).await.ok().flatten().is_some_and(|m| m.iter().any(|r| r.assignment.node == node))
    }

    /// Ask launch `job`'s ranks on `nodes` to save at their next step: a `SaveNow` numbered by
    /// the wall clock, its deadline `deadline` away. True when some node was told.
    pub(super) fn ask_to_save(&self, job: &JobRecord, nodes: &[String], deadline: Duration) -> bool {
        let now_ms = crate::store::now_ms();
        let notice =
            SaveNow { job: job.id, generation: job.generation, notice: now_ms, deadline_unix_ms: now_ms + deadline.as_millis() as i64 };
        let mut told = false;
        for n in nodes {
            told |= self.fleet.send(n, Instruction { kind: Some(instruction::Kind::SaveNow(notice)) });
        }
        told
    }

    /// A new leader takes over the notices in flight from the `preemption_notice` events of each
    /// launched job's current generation whose nodes still drain: the earliest deadline among them
    /// and the step the first was given (the agents keep the notice; ranks that saw it saved).
    pub(super) async fn resume_notices(&self) -> crate::error::Result<usize> {
        let store = &self.store;
        let mut resumed = 0;
        for job in store.unfinished_jobs().await? {
            if !matches!(job.state, JobState::Launching | JobState::Running | JobState::Degraded) {
                continue;
            }
            let Some(p) = from_events(store, &job).await? else { continue };
            if job.state == JobState::Degraded && !self.member_on(&job, &p.node).await {
                continue; // its node's replica was lost since: the job keeps going without it
            }
            let (node, left) = (p.node.clone(), p.deadline.saturating_duration_since(Instant::now()));
            if self.notices.lock().insert(job.id, p).is_none() {
                tracing::info!(job = job.id, node, "preemption notice taken over: the node leaves in {left:?}");
                resumed += 1;
            }
        }
        Ok(resumed)
    }
}

/// The notice in flight for `job`'s current launch, from its `preemption_notice` events whose
/// nodes still drain (none: no notice, or every one withdrawn).
async fn from_events(store: &Store, job: &JobRecord) -> crate::error::Result<Option<Pending>> {
    let now_ms = crate::store::now_ms();
    let mut after = 0;
    // (deadline in wall ms, node, step, when given in wall ms)
    let mut found: Option<(i64, String, i64, i64)> = None;
    loop {
        let page = store.events(Some(job.id), after, 1000).await?;
        let Some(end) = page.last() else { break };
        after = end.seq;
        for e in page.iter().filter(|e| e.kind == "preemption_notice" && e.generation == Some(job.generation)) {
            let Ok(v) = serde_json::from_str::<serde_json::Value>(&e.message) else { continue };
            let (Some(node), Some(deadline_s), Some(before)) = (v["node"].as_str(), v["deadline_s"].as_f64(), v["newest_step"].as_i64())
            else {
                continue;
            };
            if !store.node(node).await.is_ok_and(|n| n.state == NodeState::Draining) {
                continue; // withdrawn
            }
            let due = e.at_ms + (deadline_s * 1000.0) as i64;
            found = Some(match found {
                None => (due, node.to_string(), before, e.at_ms),
                Some((d, n, b, g)) if d <= due => (d, n, b.min(before), g.min(e.at_ms)),
                Some((_, _, b, g)) => (due, node.to_string(), b.min(before), g.min(e.at_ms)),
            });
        }
    }
    let Some((due, node, before, given_ms)) = found else { return Ok(None) };
    let now = Instant::now();
    let given = now.checked_sub(Duration::from_millis((now_ms - given_ms).max(0) as u64)).unwrap_or(now);
    let deadline = now + Duration::from_millis((due - now_ms).max(0) as u64);
    Ok(Some(Pending { generation: job.generation, node, deadline, before, given }))
}

impl Life {
    /// Every base interval (the running jobs' watch, `reconcile`): recover each noticed job whose save is complete or
    /// whose deadline came; forget notices whose launch moved on or whose drain was withdrawn.
    pub(super) async fn check_notices(&self) {
        let store = &self.store;
        let pending: Vec<(i64, Pending)> = self.notices.lock().iter().map(|(k, v)| (*k, v.clone())).collect();
        for (id, p) in pending {
            // Only the notice looked at: one given meanwhile (a newer launch's) stays.
            let forget = || {
                let mut all = self.notices.lock();
                if all.get(&id).is_some_and(|q| q.given == p.given && q.generation == p.generation) {
                    all.remove(&id);
                }
            };
            let Ok(job) = store.job(id).await else { continue };
            if job.generation != p.generation || !matches!(job.state, JobState::Launching | JobState::Running | JobState::Degraded) {
                forget(); // recovered already (the node's lease ended, a rank failed), or over
                continue;
            }
            if job.state == JobState::Degraded && !self.member_on(&job, &p.node).await {
                // The noticed node's replica was lost since (its lease lapsed, its rank failed):
                // the members keep going without it, and nothing of the job leaves with the node.
                forget();
                continue;
            }
            if store.node(&p.node).await.is_ok_and(|n| n.state != NodeState::Draining) {
                forget();
                // Another of the launch's nodes may still drain under its own notice.
                match from_events(store, &job).await {
                    Ok(Some(other)) => {
                        tracing::info!(job = id, node = %p.node, "the drain was withdrawn; node {}'s notice still stands", other.node);
                        self.notices.lock().insert(id, other);
                    }
                    Ok(None) => {
                        tracing::info!(job = id, node = %p.node, "the drain was withdrawn: the preemption notice ends, the job runs on")
                    }
                    Err(e) => tracing::warn!(job = id, "preemption notice: {e}"),
                }
                continue;
            }
            let newest = match crate::views::checkpoints::newest_complete(store, id).await {
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
            if !self.try_recover(&job, RecoveryCause::Preemption, &reason).await {
                tracing::info!(job = id, "preemption notice: {reason}, but the job cannot recover; it runs on until the node leaves");
            }
        }
    }
}
