//! A job's move into `recovering` (migration 0007): the relaunch budget it spends is counted in
//! the same transaction as the move, so a crash never spends one without moving the job nor
//! moves it without spending one, and two coordinators never both start a recovery.

use sqlx::Row;

use super::{job_in, now_ms, Store};
use crate::error::{CoordinatorError, Result};
use crate::job::JobState;

/// Why a job recovers: which budget the relaunch spends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecoveryCause {
    /// A node was lost or drained (`max_preemptions`).
    Preemption,
    /// A rank failed (`max_restarts`).
    Restart,
    /// Nodes came back or were added: the job is planned again onto more GPUs at its next
    /// checkpoint. Spends no budget.
    ScaleUp,
    /// The job's links changed and a plan for the measured network pays for the switch
    /// (`life::network`): planned again at its next checkpoint. Spends no budget.
    Replan,
}

impl RecoveryCause {
    fn column(self) -> &'static str {
        match self {
            RecoveryCause::Preemption => "preemptions",
            RecoveryCause::Restart => "restarts",
            RecoveryCause::ScaleUp => "scale-ups",
            RecoveryCause::Replan => "re-plans",
        }
    }
}

/// Relaunches a job has spent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Spent {
    pub preemptions: i64,
    pub restarts: i64,
}

impl Store {
    /// Relaunches job `id` has spent so far.
    pub async fn spent(&self, id: i64) -> Result<Spent> {
        let row = sqlx::query("SELECT preemptions, restarts FROM jobs WHERE id = $1")
            .bind(id)
            .fetch_optional(&self.pool)
            .await?
            .ok_or_else(|| CoordinatorError::not_found(format!("job {id}")))?;
        Ok(Spent { preemptions: row.try_get("preemptions")?, restarts: row.try_get("restarts")? })
    }

    /// Move launch `generation` of job `id` to `recovering`, spending one of `cause`'s budget,
    /// if fewer than `budget` are spent; with a `recovering` event naming `reason`. Refused
    /// (`Conflict`) when the budget is spent or the job moved on (another move, a newer
    /// launch, a deposed leader): the caller fails the job instead, or does nothing.
    pub async fn begin_recovery(&self, id: i64, generation: i64, cause: RecoveryCause, budget: u32, reason: &str) -> Result<Spent> {
        let mut tx = self.pool.begin().await?;
        self.check_term(&mut tx).await?;
        let job = job_in(&mut tx, id).await?;
        if job.generation != generation {
            return Err(CoordinatorError::StaleGeneration { job: id, given: generation, current: job.generation });
        }
        if !job.state.can_become(JobState::Recovering) {
            return Err(CoordinatorError::Conflict(format!("job {id} is {}; it cannot recover", job.state)));
        }
        // The column name comes from the enum, never from input.
        let update = match cause {
            RecoveryCause::Preemption => {
                "UPDATE jobs SET state = $1, reason = $2, updated_at_ms = $3, preemptions = preemptions + 1 \
                 WHERE id = $4 AND state = $5 AND generation = $6 AND preemptions < $7 \
                 AND ($8 = 0 OR EXISTS (SELECT 1 FROM leader WHERE id = 1 AND term = $8))"
            }
            RecoveryCause::Restart => {
                "UPDATE jobs SET state = $1, reason = $2, updated_at_ms = $3, restarts = restarts + 1 \
                 WHERE id = $4 AND state = $5 AND generation = $6 AND restarts < $7 \
                 AND ($8 = 0 OR EXISTS (SELECT 1 FROM leader WHERE id = 1 AND term = $8))"
            }
            RecoveryCause::ScaleUp | RecoveryCause::Replan => {
                "UPDATE jobs SET state = $1, reason = $2, updated_at_ms = $3 \
                 WHERE id = $4 AND state = $5 AND generation = $6 AND $7 >= 0 \
                 AND ($8 = 0 OR EXISTS (SELECT 1 FROM leader WHERE id = 1 AND term = $8))"
            }
        };
        let done = sqlx::query(update)
            .bind(JobState::Recovering.as_str())
            .bind(reason)
            .bind(now_ms())
            .bind(id)
            .bind(job.state.as_str())
            .bind(generation)
            .bind(i64::from(budget))
            .bind(self.term.load(std::sync::atomic::Ordering::SeqCst))
            .execute(&mut *tx)
            .await?;
        if done.rows_affected() != 1 {
            return Err(CoordinatorError::Conflict(format!(
                "job {id}: no {} left ({budget} allowed) or the job changed concurrently",
                cause.column()
            )));
        }
        let row = sqlx::query("SELECT preemptions, restarts FROM jobs WHERE id = $1").bind(id).fetch_one(&mut *tx).await?;
        let spent = Spent { preemptions: row.try_get("preemptions")?, restarts: row.try_get("restarts")? };
        let message = match cause {
            RecoveryCause::Preemption => {
                format!("job {id}: {} -> recovering (preemptions {} of {budget}): {reason}", job.state, spent.preemptions)
            }
            RecoveryCause::Restart => format!("job {id}: {} -> recovering (restarts {} of {budget}): {reason}", job.state, spent.restarts),
            RecoveryCause::ScaleUp => format!("job {id}: {} -> recovering (scale-up): {reason}", job.state),
            RecoveryCause::Replan => format!("job {id}: {} -> recovering (re-plan): {reason}", job.state),
        };
        Self::event(&mut tx, Some(id), Some(generation), "recovering", &message).await?;
        tx.commit().await?;
        Ok(spent)
    }
}
