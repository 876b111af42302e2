//! What a coordinator does when it starts to lead (after a restart, or when a standby takes
//! over): nothing is lost from the store, but the work in flight was the old leader's.
//!
//! - `submitted` and `planning` jobs are planned again by the job queue (planning is pure;
//!   nothing was launched).
//! - `launching` and `running` jobs wait for their agents to register again (they reconnect on
//!   their own, trying the coordinators in their list). A job continues as soon as all its
//!   nodes are back — the job's step sends a launching job's instructions again (an agent
//!   ignores ranks it already runs), a running job's ranks are reported again by their
//!   agents — and a job with a node that is not back within `GRACE_INTERVALS` base intervals
//!   fails with the reason. A `degraded` job waits for its members' nodes only.

use super::{Life, GRACE_INTERVALS};
use crate::store::JobRecord;

impl Life {
    /// A launched job this leader inherited, looked at on each tick until its nodes are back:
    /// `Some(true)` once every node of its ranks is live again, `Some(false)` if it failed
    /// because one was not back within `GRACE_INTERVALS` base intervals of the term's start
    /// (`over`), `None` while it waits (or its ranks cannot be read now).
    pub(super) async fn taken_over(&self, job: &JobRecord, over: bool) -> Option<bool> {
        let mut ranks = self.store.ranks(job.id, job.generation).await.ok()?;
        if job.state == crate::job::JobState::Degraded {
            // Only the members' nodes: a lost replica's need not come back.
            ranks = self.degraded_members(job).await.ok().flatten()?;
        }
        let Some(node) = ranks.iter().map(|r| r.assignment.node.clone()).find(|n| !self.fleet.live(n)) else {
            // All back: a launching job's instructions are sent again by its step.
            return Some(true);
        };
        if !over {
            return None;
        }
        let grace = self.fleet.base * GRACE_INTERVALS;
        let reason = format!("node {node} did not come back within {} ms of the change of leader", grace.as_millis());
        crate::agents::launch::fail(&self.store, &self.fleet, &self.signals, job.id, job.generation, &reason).await;
        Some(false)
    }
}
