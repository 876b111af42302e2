//! Jobs: submission, the reads, moves between states (fenced by the leadership term), and
//! launches: each a new generation with its plan and rank assignments, in one transaction.

use sqlx::Row;

use super::{job_in, job_of, now_ms, JobRecord, RankAssignment, Store};
use crate::error::{CoordinatorError, Result};
use crate::job::JobState;

impl Store {
    /// Store a new job in state `submitted`.
    pub async fn submit_job(&self, name: &str, spec: &str) -> Result<JobRecord> {
        if name.trim().is_empty() {
            return Err(CoordinatorError::invalid("name", "a job needs a name"));
        }
        let mut tx = self.pool.begin().await?;
        let id = Self::next(&mut tx, "job_id").await?;
        let now = now_ms();
        sqlx::query(
            "INSERT INTO jobs (id, name, spec, state, generation, reason, created_at_ms, updated_at_ms) VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
        )
        .bind(id)
        .bind(name)
        .bind(spec)
        .bind(JobState::Submitted.as_str())
        .bind(0i64)
        .bind(None::<String>)
        .bind(now)
        .bind(now)
        .execute(&mut *tx)
        .await?;
        Self::event(&mut tx, Some(id), Some(0), "submitted", &format!("job {id} ({name}) submitted")).await?;
        tx.commit().await?;
        self.job(id).await
    }

    pub async fn job(&self, id: i64) -> Result<JobRecord> {
        let row = sqlx::query("SELECT id, name, spec, state, generation, reason, created_at_ms, updated_at_ms FROM jobs WHERE id = $1")
            .bind(id)
            .fetch_optional(&self.pool)
            .await?
            .ok_or_else(|| CoordinatorError::not_found(format!("job {id}")))?;
        job_of(&row)
    }

    pub async fn jobs(&self) -> Result<Vec<JobRecord>> {
        let rows = sqlx::query("SELECT id, name, spec, state, generation, reason, created_at_ms, updated_at_ms FROM jobs ORDER BY id")
            .fetch_all(&self.pool)
            .await?;
        rows.iter().map(job_of).collect()
    }

    /// How many jobs are in each state (counted by the database: `/metrics` need not read the
    /// whole history).
    pub async fn job_counts(&self) -> Result<Vec<(String, i64)>> {
        let rows = sqlx::query("SELECT state, COUNT(*) AS n FROM jobs GROUP BY state ORDER BY state").fetch_all(&self.pool).await?;
        rows.iter().map(|r| Ok((r.try_get("state")?, r.try_get("n")?))).collect()
    }

    /// Jobs that are not over (submitted, planning, launching, running), oldest first.
    pub async fn unfinished_jobs(&self) -> Result<Vec<JobRecord>> {
        let rows = sqlx::query(
            "SELECT id, name, spec, state, generation, reason, created_at_ms, updated_at_ms FROM jobs \
             WHERE state IN ('submitted', 'planning', 'launching', 'running', 'degraded', 'recovering') ORDER BY id",
        )
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(job_of).collect()
    }

    /// Move a job to `to` if its life allows it from the state it is in (checked and written
    /// in one transaction: two coordinators cannot both move it).
    pub async fn transition(&self, id: i64, to: JobState, reason: Option<&str>) -> Result<JobRecord> {
        self.transition_at(id, None, to, reason).await
    }

    /// `transition`, only if the job is still at `generation` (decisions taken on one launch's
    /// ranks never move the next launch).
    pub async fn transition_at(&self, id: i64, generation: Option<i64>, to: JobState, reason: Option<&str>) -> Result<JobRecord> {
        let mut tx = self.pool.begin().await?;
        let job = job_in(&mut tx, id).await?;
        if let Some(g) = generation.filter(|&g| g != job.generation) {
            return Err(CoordinatorError::StaleGeneration { job: id, given: g, current: job.generation });
        }
        if !job.state.can_become(to) {
            return Err(CoordinatorError::Conflict(format!("job {id} is {}; it cannot become {to}", job.state)));
        }
        // The term first: it locks the leader row (PostgreSQL), so a new leader's claim waits for
        // this move, and the move lands before the claim or is refused.
        self.check_term(&mut tx).await?;
        // A reason says why the job is where it is: a job that succeeded after a recovery does
        // not keep the failure that started the recovery (the events keep it).
        // Nor does a degraded job whose lost replicas rejoined: it runs whole again.
        let whole_again = job.state == JobState::Degraded && to == JobState::Running;
        let carried = if to == JobState::Succeeded || whole_again { None } else { job.reason.clone() };
        // A compare-and-set on what was read (state and generation) and on the term, in SQL:
        // a concurrent move, a relaunch, or a new leader between the read and this write makes
        // it match no row.
        let done = sqlx::query(
            "UPDATE jobs SET state = $1, reason = $2, updated_at_ms = $3 WHERE id = $4 AND state = $5 AND generation = $6 \
             AND ($7 = 0 OR EXISTS (SELECT 1 FROM leader WHERE id = 1 AND term = $7))",
        )
        .bind(to.as_str())
        .bind(reason.map(str::to_string).or(carried))
        .bind(now_ms())
        .bind(id)
        .bind(job.state.as_str())
        .bind(job.generation)
        .bind(self.term.load(std::sync::atomic::Ordering::SeqCst))
        .execute(&mut *tx)
        .await?;
        if done.rows_affected() != 1 {
            return Err(CoordinatorError::Conflict(format!("job {id} changed state concurrently; retry")));
        }
        let message = match reason {
            Some(r) => format!("job {id}: {} -> {to}: {r}", job.state),
            None => format!("job {id}: {} -> {to}", job.state),
        };
        Self::event(&mut tx, Some(id), Some(job.generation), to.as_str(), &message).await?;
        tx.commit().await?;
        self.job(id).await
    }

    /// A (re)launch: the next generation with its plan and rank assignments, the job moved
    /// to `launching`, all in one transaction. Returns the new generation.
    pub async fn start_generation(&self, id: i64, plan: &str, ranks: &[RankAssignment]) -> Result<i64> {
        self.start_generation_from(id, plan, ranks, None).await
    }

    /// `start_generation` of a launch whose ranks resume from checkpoint step `restore.0`, as
    /// written by generation `restore.1` (a recovery's: the agents restored it for this launch).
    pub async fn start_generation_from(&self, id: i64, plan: &str, ranks: &[RankAssignment], restore: Option<(i64, i64)>) -> Result<i64> {
        let restore_step = restore.map(|(step, _)| step);
        let mut tx = self.pool.begin().await?;
        self.check_term(&mut tx).await?;
        let job = job_in(&mut tx, id).await?;
        if !job.state.can_become(JobState::Launching) {
            return Err(CoordinatorError::Conflict(format!("job {id} is {}; it cannot be launched", job.state)));
        }
        super::ranks::gpus_free_of_others(&mut tx, id, ranks).await?;
        let generation = job.generation + 1;
        let now = now_ms();
        sqlx::query(
            "INSERT INTO plans (job_id, generation, plan, created_at_ms, restore_step, restore_generation) VALUES ($1, $2, $3, $4, $5, $6)",
        )
        .bind(id)
        .bind(generation)
        .bind(plan)
        .bind(now)
        .bind(restore_step.unwrap_or(-1))
        .bind(restore.map_or(-1, |(_, g)| g))
        .execute(&mut *tx)
        .await?;
        // Multi-row INSERTs (one round trip per chunk, not per rank): 8 parameters a row plus the
        // job and generation, within SQLite's 32766 and PostgreSQL's 65535 parameters.
        for chunk in ranks.chunks(RANK_ROWS_PER_INSERT) {
            let mut sql = String::from(
                "INSERT INTO ranks (job_id, generation, rank, node, local_rank, gpu, replica, stage, layer_start, layer_end, state, exit_code) VALUES ",
            );
            for i in 0..chunk.len() {
                let p = 3 + 8 * i;
                let sep = if i == 0 { "" } else { ", " };
                sql.push_str(&format!(
                    "{sep}($1, $2, ${}, ${}, ${}, ${}, ${}, ${}, ${}, ${}, 'assigned', NULL)",
                    p,
                    p + 1,
                    p + 2,
                    p + 3,
                    p + 4,
                    p + 5,
                    p + 6,
                    p + 7
                ));
            }
            // Built from placeholders only: no value is spliced into the SQL.
            let mut q = sqlx::query(sqlx::AssertSqlSafe(sql)).bind(id).bind(generation);
            for r in chunk {
                q = q
                    .bind(r.rank)
                    .bind(&r.node)
                    .bind(r.local_rank)
                    .bind(r.gpu)
                    .bind(r.replica)
                    .bind(r.stage)
                    .bind(r.layer_start)
                    .bind(r.layer_end);
            }
            q.execute(&mut *tx).await?;
        }
        let done = sqlx::query(
            "UPDATE jobs SET state = $1, generation = $2, updated_at_ms = $3 WHERE id = $4 AND generation = $5 AND state = $6 \
             AND ($7 = 0 OR EXISTS (SELECT 1 FROM leader WHERE id = 1 AND term = $7))",
        )
        .bind(JobState::Launching.as_str())
        .bind(generation)
        .bind(now)
        .bind(id)
        .bind(job.generation)
        .bind(job.state.as_str())
        .bind(self.term.load(std::sync::atomic::Ordering::SeqCst))
        .execute(&mut *tx)
        .await?;
        // Moved (cancelled, say) since it was read: the whole launch is rolled back.
        if done.rows_affected() != 1 {
            return Err(CoordinatorError::Conflict(format!("job {id} changed state concurrently; not launched")));
        }
        let message = match restore_step {
            Some(step) => format!("job {id}: generation {generation} launching {} ranks from checkpoint step {step}", ranks.len()),
            None => format!("job {id}: generation {generation} launching {} ranks", ranks.len()),
        };
        Self::event(&mut tx, Some(id), Some(generation), "launching", &message).await?;
        tx.commit().await?;
        Ok(generation)
    }

    /// Refuse anything addressed to an older launch of the job.
    pub async fn check_generation(&self, id: i64, generation: i64) -> Result<()> {
        let job = self.job(id).await?;
        if job.generation != generation {
            return Err(CoordinatorError::StaleGeneration { job: id, given: generation, current: job.generation });
        }
        Ok(())
    }

    /// The checkpoint step launch `generation` resumes from, if any.
    pub async fn restore_step(&self, id: i64, generation: i64) -> Result<Option<i64>> {
        let step: Option<i64> = sqlx::query_scalar("SELECT restore_step FROM plans WHERE job_id = $1 AND generation = $2")
            .bind(id)
            .bind(generation)
            .fetch_optional(&self.pool)
            .await?;
        Ok(step.filter(|s| *s >= 0))
    }

    /// The generation whose checkpoint files launch `generation` resumes from, if any (none for
    /// a launch from before migration 0009 recorded it).
    pub async fn restore_generation(&self, id: i64, generation: i64) -> Result<Option<i64>> {
        let from: Option<i64> = sqlx::query_scalar("SELECT restore_generation FROM plans WHERE job_id = $1 AND generation = $2")
            .bind(id)
            .bind(generation)
            .fetch_optional(&self.pool)
            .await?;
        Ok(from.filter(|g| *g >= 0))
    }

    pub async fn plan(&self, id: i64, generation: i64) -> Result<String> {
        let row = sqlx::query("SELECT plan FROM plans WHERE job_id = $1 AND generation = $2")
            .bind(id)
            .bind(generation)
            .fetch_optional(&self.pool)
            .await?
            .ok_or_else(|| CoordinatorError::not_found(format!("plan of job {id} generation {generation}")))?;
        Ok(row.try_get::<String, _>(0)?)
    }
}

/// Rows per multi-row INSERT of rank assignments.
const RANK_ROWS_PER_INSERT: usize = 500;
