//! What a coordinator does when it starts to lead (after a restart, or when a standby takes
//! over): nothing is lost from the store, but the work in flight was the old leader's.
//!
//! - `submitted` and `planning` jobs are planned again by the job queue (planning is pure;
//!   nothing was launched).
//! - `launching` and `running` jobs wait for their agents to register again (they reconnect on
//!   their own, trying the coordinators in their list). A job continues as soon as all its
//!   nodes are back — the job queue sends a launching job's instructions again (an agent
//!   ignores ranks it already runs), a running job's ranks are reported again by their
//!   agents — and a job with a node that is not back within `GRACE_INTERVALS` base intervals
//!   fails with the reason.

use std::sync::Arc;

use super::{Life, GRACE_INTERVALS};
use crate::job::JobState;

/// Resume the unfinished jobs found at the start of a term.
#[tracing::instrument(skip_all)]
pub async fn resume(life: Arc<Life>) {
    let (store, fleet) = (&life.store, &life.fleet);
    let jobs = match store.unfinished_jobs().await {
        Ok(j) => j,
        Err(e) => {
            tracing::error!("cannot read unfinished jobs: {e}");
            return;
        }
    };
    let mut launched = vec![];
    for j in jobs {
        match j.state {
            // The job queue (`scheduler`) plans them again.
            JobState::Submitted | JobState::Planning => {}
            JobState::Launching | JobState::Running => launched.push(j),
            _ => {}
        }
    }
    // Each job continues as soon as all its nodes' agents are back (they reconnect on their
    // own); one whose nodes are not all back within `GRACE_INTERVALS` fails with the reason.
    let grace = fleet.base * GRACE_INTERVALS;
    let started = tokio::time::Instant::now();
    let mut tick = tokio::time::interval(fleet.base);
    while !launched.is_empty() {
        tick.tick().await;
        let over = started.elapsed() > grace;
        let mut waiting = vec![];
        for j in launched {
            let Ok(ranks) = store.ranks(j.id, j.generation).await else { continue };
            let missing = ranks.iter().map(|r| r.assignment.node.clone()).find(|n| !fleet.live(n));
            match missing {
                // All back: a launching job's instructions are sent again by the job queue.
                None => {}
                Some(node) if over => {
                    let reason = format!("node {node} did not come back within {} ms of the change of leader", grace.as_millis());
                    crate::launch::fail(store, fleet, &life.signals, j.id, j.generation, &reason).await;
                }
                Some(_) => waiting.push(j),
            }
        }
        launched = waiting;
    }
}
