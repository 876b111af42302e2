//! A launch's ranks as stored: the list, the GPUs ranks hold, how a launch's ranks stand, and
//! the ranks a new agent session no longer knows (lost).

use serde::{Deserialize, Serialize};
use sqlx::Row;

use super::{rank_events, RankAssignment, Store};
use crate::error::{CoordinatorError, Result};

/// A GPU a rank holds (`Store::held_gpus`).
#[derive(Debug, Clone, PartialEq)]
pub struct HeldGpu {
    pub node: String,
    pub gpu: i64,
    pub job: i64,
    /// Its rank reported running (it holds the GPU whatever its job's state).
    pub running: bool,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct RankRecord {
    pub assignment: RankAssignment,
    /// assigned | running | exited | lost
    pub state: String,
    pub exit_code: Option<i64>,
}

impl_from_row!(RankRecord { state, exit_code } flatten { assignment });

impl Store {
    pub async fn ranks(&self, id: i64, generation: i64) -> Result<Vec<RankRecord>> {
        Ok(sqlx::query_as::<_, RankRecord>(
            "SELECT rank, node, local_rank, gpu, replica, stage, layer_start, layer_end, state, exit_code FROM ranks \
             WHERE job_id = $1 AND generation = $2 ORDER BY rank",
        )
        .bind(id)
        .bind(generation)
        .fetch_all(&self.pool)
        .await?)
    }

    /// A degraded launch's lost replica rejoins (docs/keep-going.md): its ranks that ended
    /// (`lost`, or `exited`) are `assigned` again, to be started afresh in the same launch, with
    /// an event each, and `then` (the epoch's membership: kind, message) recorded in the same
    /// transaction, so a crash leaves neither or both. Fenced like a job move: the job must
    /// still be `degraded` at `generation`, under this leader's term. Returns how many ranks
    /// were reassigned.
    pub async fn reassign_ranks(&self, id: i64, generation: i64, ranks: &[i64], epoch: i64, then: (&str, &str)) -> Result<usize> {
        self.rejoin_ranks(id, generation, ranks, None, epoch, then).await
    }

    /// `reassign_ranks` onto other nodes (`planning::substitute`): each of `to`'s ranks moves to
    /// its node and GPU (from any state: its old node's lease lapsed, so a rank still recorded
    /// running there is taken as lost, and one assigned there never started), and the launch's
    /// plan becomes `plan` (which names them there), all or nothing.
    pub async fn move_ranks(
        &self,
        id: i64,
        generation: i64,
        to: &[RankAssignment],
        plan: &str,
        epoch: i64,
        then: (&str, &str),
    ) -> Result<usize> {
        let ranks: Vec<i64> = to.iter().map(|a| a.rank).collect();
        self.rejoin_ranks(id, generation, &ranks, Some((to, plan)), epoch, then).await
    }

    async fn rejoin_ranks(
        &self,
        id: i64,
        generation: i64,
        ranks: &[i64],
        moved: Option<(&[RankAssignment], &str)>,
        epoch: i64,
        then: (&str, &str),
    ) -> Result<usize> {
        let mut tx = self.pool.begin().await?;
        let job = super::job_in(&mut tx, id).await?;
        if job.generation != generation {
            return Err(CoordinatorError::StaleGeneration { job: id, given: generation, current: job.generation });
        }
        if job.state != crate::job::JobState::Degraded {
            return Err(CoordinatorError::Conflict(format!("job {id} is {}; only a degraded job's replicas rejoin", job.state)));
        }
        self.check_term(&mut tx).await?;
        if let Some((to, _)) = moved {
            gpus_free_of_others(&mut tx, id, to).await?;
        }
        let (mut events, mut reassigned) = (vec![], 0);
        for &rank in ranks {
            let to = moved.and_then(|(to, _)| to.iter().find(|a| a.rank == rank));
            let done = match to {
                None => {
                    sqlx::query(
                        "UPDATE ranks SET state = 'assigned', exit_code = NULL WHERE job_id = $1 AND generation = $2 AND rank = $3 \
                         AND state IN ('lost', 'exited')",
                    )
                    .bind(id)
                    .bind(generation)
                    .bind(rank)
                    .execute(&mut *tx)
                    .await?
                }
                // Its old node's lease lapsed: a rank still recorded running there is taken as
                // lost (its agent, if it comes back, is told to stop what this leader does not
                // know there).
                Some(a) => {
                    sqlx::query(
                        "UPDATE ranks SET state = 'assigned', exit_code = NULL, node = $1, gpu = $2, local_rank = $3 \
                         WHERE job_id = $4 AND generation = $5 AND rank = $6",
                    )
                    .bind(&a.node)
                    .bind(a.gpu)
                    .bind(a.local_rank)
                    .bind(id)
                    .bind(generation)
                    .bind(rank)
                    .execute(&mut *tx)
                    .await?
                }
            };
            if done.rows_affected() != 1 && to.is_some() {
                return Err(CoordinatorError::not_found(format!("rank {rank} of job {id} generation {generation}, to move")));
            }
            if done.rows_affected() == 1 {
                reassigned += 1;
                let whereto = to.map(|a| format!(", on node {} GPU {}", a.node, a.gpu)).unwrap_or_default();
                events.push((id, generation, format!("job {id}: rank {rank} assigned again, to rejoin in epoch {epoch}{whereto}")));
            }
        }
        if let Some((_, plan)) = moved {
            sqlx::query("UPDATE plans SET plan = $1 WHERE job_id = $2 AND generation = $3")
                .bind(plan)
                .bind(id)
                .bind(generation)
                .execute(&mut *tx)
                .await?;
        }
        rank_events(&mut tx, &events).await?;
        Self::event(&mut tx, Some(id), Some(generation), then.0, then.1).await?;
        tx.commit().await?;
        Ok(reassigned)
    }

    /// GPUs held by ranks: every rank of a launched (`launching` or `running`) job's current
    /// launch, and ranks of other launches still reported `running` (a job that is over whose
    /// ranks have not exited yet). Sorted by node, GPU.
    pub async fn held_gpus(&self) -> Result<Vec<HeldGpu>> {
        let rows = sqlx::query(
            "SELECT r.node, r.gpu, r.job_id, r.state FROM ranks r JOIN jobs j ON j.id = r.job_id \
             WHERE (j.state IN ('launching', 'running', 'degraded', 'recovering') AND r.generation = j.generation) \
             UNION ALL \
             SELECT r.node, r.gpu, r.job_id, r.state FROM ranks r JOIN jobs j ON j.id = r.job_id \
             WHERE r.state = 'running' AND NOT (j.state IN ('launching', 'running', 'degraded', 'recovering') AND r.generation = j.generation) \
             ORDER BY 1, 2",
        )
        .fetch_all(&self.pool)
        .await?;
        rows.iter()
            .map(|r| {
                Ok(HeldGpu {
                    node: r.try_get("node")?,
                    gpu: r.try_get("gpu")?,
                    job: r.try_get("job_id")?,
                    running: r.try_get::<String, _>("state")? == "running",
                })
            })
            .collect()
    }

    /// How a launch's ranks stand (what a job's progress is decided on), counted by the
    /// database rather than read rank by rank.
    pub async fn rank_summary(&self, id: i64, generation: i64) -> Result<RankSummary> {
        let row = sqlx::query(
            "SELECT COUNT(*), \
             COALESCE(SUM(CASE WHEN state = 'running' OR state = 'exited' THEN 1 ELSE 0 END), 0), \
             COALESCE(SUM(CASE WHEN state = 'exited' THEN 1 ELSE 0 END), 0), \
             COALESCE(SUM(CASE WHEN state = 'lost' OR (state = 'exited' AND (exit_code IS NULL OR exit_code <> 0)) THEN 1 ELSE 0 END), 0) \
             FROM ranks WHERE job_id = $1 AND generation = $2",
        )
        .bind(id)
        .bind(generation)
        .fetch_one(&self.pool)
        .await?;
        let mut summary = RankSummary {
            total: row.try_get::<i64, _>(0)?,
            started: row.try_get::<i64, _>(1)?,
            exited: row.try_get::<i64, _>(2)?,
            first_failed: None,
        };
        if row.try_get::<i64, _>(3)? > 0 {
            let bad = sqlx::query(
                "SELECT rank, node, exit_code, state FROM ranks WHERE job_id = $1 AND generation = $2 \
                 AND (state = 'lost' OR (state = 'exited' AND (exit_code IS NULL OR exit_code <> 0))) ORDER BY rank LIMIT 1",
            )
            .bind(id)
            .bind(generation)
            .fetch_one(&self.pool)
            .await?;
            let lost = bad.try_get::<String, _>("state")? == "lost";
            summary.first_failed =
                Some(FailedRank { rank: bad.try_get("rank")?, node: bad.try_get("node")?, exit_code: bad.try_get("exit_code")?, lost });
        }
        Ok(summary)
    }

    /// A new agent session's full list of the ranks it knows: ranks held as running on the node
    /// (of a launched job's current launch) that the agent does not know are lost (its agent
    /// died between the report and the acknowledgement, or the host rebooted). Fenced by the
    /// agent's epoch in the same transaction. Returns the jobs whose ranks were lost.
    pub async fn lose_unknown_ranks(&self, node: &str, epoch: i64, known: &[(i64, i64, i64)]) -> Result<Vec<i64>> {
        let mut tx = self.pool.begin().await?;
        let same = sqlx::query("UPDATE nodes SET agent_epoch = agent_epoch WHERE name = $1 AND agent_epoch = $2")
            .bind(node)
            .bind(epoch)
            .execute(&mut *tx)
            .await?;
        if same.rows_affected() != 1 {
            let current = sqlx::query("SELECT agent_epoch FROM nodes WHERE name = $1").bind(node).fetch_optional(&mut *tx).await?;
            let current = current.map(|r| r.try_get::<i64, _>(0)).transpose()?.unwrap_or(0);
            return Err(CoordinatorError::StaleAgent { node: node.to_string(), given: epoch, current });
        }
        let rows = sqlx::query(
            "SELECT r.job_id, r.generation, r.rank FROM ranks r JOIN jobs j ON j.id = r.job_id AND r.generation = j.generation \
             WHERE r.node = $1 AND r.state = 'running' AND j.state IN ('launching', 'running', 'degraded') ORDER BY r.job_id, r.rank",
        )
        .bind(node)
        .fetch_all(&mut *tx)
        .await?;
        let known: std::collections::HashSet<&(i64, i64, i64)> = known.iter().collect();
        let (mut events, mut jobs) = (vec![], vec![]);
        for row in rows {
            let key: (i64, i64, i64) = (row.try_get(0)?, row.try_get(1)?, row.try_get(2)?);
            if known.contains(&key) {
                continue;
            }
            sqlx::query("UPDATE ranks SET state = 'lost' WHERE job_id = $1 AND generation = $2 AND rank = $3 AND state = 'running'")
                .bind(key.0)
                .bind(key.1)
                .bind(key.2)
                .execute(&mut *tx)
                .await?;
            events.push((key.0, key.1, format!("job {}: rank {} lost (its agent on {node} no longer knows it)", key.0, key.2)));
            jobs.push(key.0);
        }
        rank_events(&mut tx, &events).await?;
        tx.commit().await?;
        jobs.dedup();
        Ok(jobs)
    }
}

/// A launch's ranks, counted.
#[derive(Debug, Clone, PartialEq)]
pub struct RankSummary {
    pub total: i64,
    /// running or exited
    pub started: i64,
    pub exited: i64,
    /// The lowest-numbered rank that exited with a non-zero (or no) code: rank, node, code.
    pub first_failed: Option<FailedRank>,
}

/// The first rank that ended a launch: a non-zero exit, or lost (its process vanished without
/// an exit code, e.g. while its agent was down).
#[derive(Debug, Clone, PartialEq)]
pub struct FailedRank {
    pub rank: i64,
    pub node: String,
    pub exit_code: Option<i64>,
    pub lost: bool,
}

/// Inside a launch's or a move's transaction, after `check_term` took the leader row (so two
/// claims are read and written one after the other): refuse, naming one, if any GPU of
/// `ranks` is held by another job's current launch (launching, running, degraded or
/// recovering). The caller planned on what was free when it looked; another claim may have
/// landed since.
pub(super) async fn gpus_free_of_others(tx: &mut sqlx::Transaction<'_, sqlx::Any>, id: i64, ranks: &[RankAssignment]) -> Result<()> {
    let rows = sqlx::query(
        "SELECT r.node, r.gpu, r.job_id FROM ranks r JOIN jobs j ON j.id = r.job_id \
         WHERE j.id <> $1 AND j.state IN ('launching', 'running', 'degraded', 'recovering') AND r.generation = j.generation",
    )
    .bind(id)
    .fetch_all(&mut **tx)
    .await?;
    let mut held = std::collections::HashMap::new();
    for r in &rows {
        held.insert((r.try_get::<String, _>("node")?, r.try_get::<i64, _>("gpu")?), r.try_get::<i64, _>("job_id")?);
    }
    for a in ranks {
        if let Some(other) = held.get(&(a.node.clone(), a.gpu)) {
            return Err(CoordinatorError::GpusHeld(format!(
                "job {id}: GPU {}:{} (rank {}) is held by job {other}'s launch; plan again on what is free now",
                a.node, a.gpu, a.rank
            )));
        }
    }
    Ok(())
}
