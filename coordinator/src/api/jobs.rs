//! Jobs: submit, list, describe, cancel, their events (read or watched), plans and dry runs.

use std::time::Duration;

use serde::Serialize;
use serde_json::Value;
use tokio::sync::mpsc;

use super::Operations;
use crate::api::control;
use crate::error::Result;
use crate::store::{Event, JobRecord, RankAssignment, RankRecord};

pub use motley_contract::views::{JobView, MembershipView};

/// Events answered by one read, and per poll of a watch.
const EVENTS_PAGE: i64 = 1000;

/// A job as both doors show it: the view (its JSON, what `motley job list` reads) and the job
/// file as stored, which gRPC carries as text.
#[derive(Debug, Clone, Serialize)]
#[serde(transparent)]
pub struct Job {
    pub view: JobView,
    #[serde(skip)]
    pub spec_json: String,
}

/// The plan and ranks of a job's current launch.
#[derive(Serialize, utoipa::ToSchema)]
pub struct PlanView {
    pub job: i64,
    pub generation: i64,
    /// `motley plan -o json`'s document.
    #[schema(value_type = Object)]
    pub plan: Value,
    /// The same document as stored (gRPC's `plan_json`, the plan picture's source).
    #[serde(skip)]
    pub plan_json: String,
    pub ranks: Vec<RankRecord>,
}

/// A dry run's plan and the ranks it would launch.
#[derive(Serialize, utoipa::ToSchema)]
pub struct DryRunView {
    #[schema(value_type = Object)]
    pub plan: Value,
    /// The same report as text (gRPC's `plan_json`).
    #[serde(skip)]
    pub plan_json: String,
    pub ranks: Vec<RankAssignment>,
}

impl Operations<'_> {
    /// A stored job with its checkpoint-cloud prefix (docs/recovery.md: `URL/CLUSTER/jobs/ID`).
    fn job_view(&self, j: JobRecord, membership: Option<MembershipView>) -> Job {
        let view = JobView {
            membership,
            checkpoint_cloud: self.store.cluster().stored_checkpoints(&j.spec, j.id),
            spec: serde_json::from_str(&j.spec).unwrap_or(Value::Null),
            id: j.id,
            name: j.name,
            state: j.state,
            generation: j.generation,
            reason: j.reason,
            created_at_ms: j.created_at_ms,
            updated_at_ms: j.updated_at_ms,
        };
        Job { view, spec_json: j.spec }
    }

    /// Validate and store a job file; the queue plans it in the background (`control::submit`).
    pub async fn submit(&self, text: &str) -> Result<Job> {
        Ok(self.job_view(control::submit(self.store, &self.life.signals, text, self.life.settings.default_cloud.as_deref()).await?, None))
    }

    /// Every job, a queued one with why it waits.
    pub async fn jobs(&self) -> Result<Vec<Job>> {
        let mut out = vec![];
        for j in self.store.jobs().await? {
            let membership = self.life.membership_view(&j).await?;
            out.push(self.job_view(self.life.annotate(j), membership));
        }
        Ok(out)
    }

    pub async fn job(&self, id: i64) -> Result<Job> {
        let j = self.store.job(id).await?;
        let membership = self.life.membership_view(&j).await?;
        Ok(self.job_view(self.life.annotate(j), membership))
    }

    pub async fn cancel(&self, id: i64) -> Result<Job> {
        Ok(self.job_view(control::cancel(self.store, self.fleet, &self.life.signals, id, "cancelled by the operator").await?, None))
    }

    /// The job's events after `after`, oldest first, at most a page.
    pub async fn events(&self, id: i64, after: i64) -> Result<Vec<Event>> {
        self.store.job(id).await?;
        self.store.events(Some(id), after, EVENTS_PAGE).await
    }

    /// The job's events after `after` as they are written, until the job is over and all its
    /// events are out; an error ends the stream. Dropping the receiver ends the watch.
    pub async fn watch(&self, id: i64, after: i64) -> Result<mpsc::Receiver<Result<Event>>> {
        self.store.job(id).await?;
        let (tx, rx) = mpsc::channel(64);
        let store = self.store.clone();
        // Events are polled from the store (any coordinator may have written them); a fifth of
        // the base interval keeps a watch close behind without loading the database.
        let poll = (self.fleet.base / 5).clamp(Duration::from_millis(20), Duration::from_millis(500));
        tokio::spawn(async move {
            let mut after = after;
            loop {
                // The state first, then the events: a job seen over has all its events written.
                let over = match store.job(id).await {
                    Ok(j) => j.state.is_terminal(),
                    Err(e) => {
                        let _ = tx.send(Err(e)).await;
                        return;
                    }
                };
                let events = match store.events(Some(id), after, EVENTS_PAGE).await {
                    Ok(e) => e,
                    Err(e) => {
                        let _ = tx.send(Err(e)).await;
                        return;
                    }
                };
                let drained = (events.len() as i64) < EVENTS_PAGE;
                for e in events {
                    after = e.seq;
                    if tx.send(Ok(e)).await.is_err() {
                        return; // the watcher left
                    }
                }
                if over && drained {
                    return;
                }
                if drained {
                    // A watcher that left ends the poll now, not at the next event.
                    tokio::select! {
                        _ = tokio::time::sleep(poll) => {}
                        _ = tx.closed() => return,
                    }
                }
            }
        });
        Ok(rx)
    }

    /// The plan and ranks of the job's current launch.
    pub async fn plan(&self, id: i64) -> Result<PlanView> {
        let (job, plan_json, ranks) = control::current_plan(self.store, id).await?;
        let plan = serde_json::from_str(&plan_json).unwrap_or(Value::Null);
        Ok(PlanView { job: job.id, generation: job.generation, plan, plan_json, ranks })
    }

    /// Plan a job file on the declared inventory; nothing is stored or launched.
    pub async fn dry_run(&self, text: &str) -> Result<DryRunView> {
        let (report, ranks) = control::dry_run(self.store, self.fleet, text).await?;
        let plan_json = serde_json::to_string(&report).expect("a plan serialises");
        Ok(DryRunView { plan: serde_json::to_value(report).expect("a plan serialises"), plan_json, ranks })
    }
}
