//! Agents' reports on their ranks, fenced by the agent's epoch and the launch's generation,
//! and group-committed: the reports of concurrent heartbeats share one transaction.

use sqlx::Row;

use super::{job_in, rank_events, Store};
use crate::error::{CoordinatorError, Result};

/// One rank's state as an agent reports it.
#[derive(Debug, Clone, PartialEq)]
pub struct RankReport {
    pub job: i64,
    pub generation: i64,
    pub rank: i64,
    /// running | exited | lost
    pub state: String,
    pub exit_code: Option<i64>,
}

impl Store {
    /// An agent's report on a rank, fenced by generation: a report of an older launch is
    /// refused and changes nothing.
    pub async fn report_rank(&self, id: i64, generation: i64, rank: i64, state: &str, exit_code: Option<i64>) -> Result<()> {
        self.report_rank_from(None, id, generation, rank, state, exit_code).await
    }

    /// `report_rank` from an agent session: in the same transaction the node's agent epoch
    /// must still be `epoch` (a re-registered agent fences its older session) and the rank must
    /// run on that node; an exited rank never comes back.
    pub async fn report_rank_from(
        &self,
        agent: Option<(&str, i64)>,
        id: i64,
        generation: i64,
        rank: i64,
        state: &str,
        exit_code: Option<i64>,
    ) -> Result<()> {
        let report = RankReport { job: id, generation, rank, state: state.to_string(), exit_code };
        let done = self.report_ranks_from(agent, vec![report]).await?;
        if let Some(&(job, given, current)) = done.stale.first() {
            return Err(CoordinatorError::StaleGeneration { job, given, current });
        }
        match done.unknown.first() {
            Some(&(job, generation, rank)) => Err(CoordinatorError::invalid(
                "ranks.rank",
                format!("rank {rank} of job {job} generation {generation} does not run on {}", agent.map_or("this node", |a| a.0)),
            )),
            None => Ok(()),
        }
    }

    /// A heartbeat's reports as one unit: the agent's epoch checked once (a stale session
    /// changes nothing: `StaleAgent`), each job read once, one UPDATE per rank, the events (one
    /// per rank that changed, in order) in one INSERT. A report of an older launch is skipped
    /// and listed in `stale`; the others apply. Any other refusal (a bad state, a rank on
    /// another node, an unknown rank) stops at that report: the reports before it stay, as if
    /// each had been its own transaction, and the error is returned.
    ///
    /// Group commit: the units of concurrent callers (heartbeats of many agents) that queue
    /// while a commit is in flight share the next transaction, each applied as above on its
    /// own; a database error fails them all and commits nothing. One commit (one fsync on
    /// SQLite) per group instead of one per report.
    pub async fn report_ranks_from(&self, agent: Option<(&str, i64)>, reports: Vec<RankReport>) -> Result<RanksReported> {
        let (reply, mut done) = tokio::sync::oneshot::channel();
        let unit = QueuedReports { agent: agent.map(|(n, e)| (n.to_string(), e)), reports, reply };
        self.reports.pending.lock().expect("report queue").push(unit);
        let abandoned = || CoordinatorError::Database(sqlx::Error::Protocol("a rank report batch was abandoned; report again".into()));
        loop {
            // Either a writer's commit answers us, or we become the writer.
            let writer = tokio::select! {
                r = &mut done => return r.unwrap_or_else(|_| Err(abandoned())),
                w = self.reports.writer.lock() => w,
            };
            if let Ok(r) = done.try_recv() {
                return r;
            }
            let batch = std::mem::take(&mut *self.reports.pending.lock().expect("report queue"));
            let results = match self.apply_reports(&batch).await {
                Ok(results) => results,
                Err(e) => {
                    let message = e.to_string();
                    batch.iter().map(|_| Err(CoordinatorError::Database(sqlx::Error::Protocol(message.clone())))).collect()
                }
            };
            for (unit, result) in batch.into_iter().zip(results) {
                let _ = unit.reply.send(result);
            }
            drop(writer);
        }
    }

    /// Queued units of reports in one transaction, each with its own result.
    async fn apply_reports(&self, batch: &[QueuedReports]) -> Result<Vec<Result<RanksReported>>> {
        let mut tx = self.pool.begin().await?;
        let mut events: Vec<(i64, i64, String)> = vec![];
        let mut generations: std::collections::HashMap<i64, i64> = Default::default();
        let mut results = Vec::with_capacity(batch.len());
        for unit in batch {
            let agent = unit.agent.as_ref().map(|(n, e)| (n.as_str(), *e));
            match reports_in(&mut tx, agent, &unit.reports, &mut generations, &mut events).await {
                Err(e @ CoordinatorError::Database(_)) => return Err(e),
                result => results.push(result),
            }
        }
        rank_events(&mut tx, &events).await?;
        tx.commit().await?;
        Ok(results)
    }
}

/// Reports waiting for a group commit, and the lock its writer holds.
#[derive(Default)]
pub(super) struct ReportQueue {
    pending: std::sync::Mutex<Vec<QueuedReports>>,
    writer: tokio::sync::Mutex<()>,
}

/// One caller's reports (one heartbeat's), and where its result goes.
struct QueuedReports {
    agent: Option<(String, i64)>,
    reports: Vec<RankReport>,
    reply: tokio::sync::oneshot::Sender<Result<RanksReported>>,
}

/// One unit of `report_ranks_from` inside a group's transaction; its events join `events`.
async fn reports_in(
    tx: &mut sqlx::Transaction<'_, sqlx::Any>,
    agent: Option<(&str, i64)>,
    reports: &[RankReport],
    generations: &mut std::collections::HashMap<i64, i64>,
    events: &mut Vec<(i64, i64, String)>,
) -> Result<RanksReported> {
    if let Some((node, epoch)) = agent {
        // A no-op update that locks the node's row (PostgreSQL) while the epoch is checked.
        let same = sqlx::query("UPDATE nodes SET agent_epoch = agent_epoch WHERE name = $1 AND agent_epoch = $2")
            .bind(node)
            .bind(epoch)
            .execute(&mut **tx)
            .await?;
        if same.rows_affected() != 1 {
            let current = sqlx::query("SELECT agent_epoch FROM nodes WHERE name = $1").bind(node).fetch_optional(&mut **tx).await?;
            let current = current.map(|r| r.try_get::<i64, _>(0)).transpose()?.unwrap_or(0);
            return Err(CoordinatorError::StaleAgent { node: node.to_string(), given: epoch, current });
        }
    }
    let mut out = RanksReported::default();
    for r in reports {
        match report_in(tx, agent, r, generations).await? {
            Reported::Changed => {
                out.jobs.push(r.job);
                let message = match r.exit_code {
                    Some(c) => format!("job {}: rank {} {} (exit code {c})", r.job, r.rank, r.state),
                    None => format!("job {}: rank {} {}", r.job, r.rank, r.state),
                };
                events.push((r.job, r.generation, message));
            }
            Reported::Unchanged => out.jobs.push(r.job),
            Reported::Stale(current) => out.stale.push((r.job, r.generation, current)),
            Reported::Unknown => out.unknown.push((r.job, r.generation, r.rank)),
        }
    }
    out.jobs.sort_unstable();
    out.jobs.dedup();
    Ok(out)
}

/// What a batch of rank reports did.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RanksReported {
    /// Jobs of the reports that applied, whether they changed the rank or found it already
    /// exited (sorted, once each): their progress may have to move (after a restart, too).
    pub jobs: Vec<i64>,
    /// Reports of an older launch, refused and without effect: (job, given, current generation).
    pub stale: Vec<(i64, i64, i64)>,
    /// Reports of a job or rank this database does not have on the reporting node (job,
    /// generation, rank): refused, without effect; the agent stops them and forgets them.
    pub unknown: Vec<(i64, i64, i64)>,
}

enum Reported {
    Changed,
    /// A job, rank or node placement this database does not have: refused, without effect.
    Unknown,
    /// Already exited: a report sent again after a reconnect changes nothing.
    Unchanged,
    /// Of an older launch; the job's current generation.
    Stale(i64),
}

/// One report inside `report_ranks_from`'s transaction; `generations` caches each job's.
async fn report_in(
    tx: &mut sqlx::Transaction<'_, sqlx::Any>,
    agent: Option<(&str, i64)>,
    r: &RankReport,
    generations: &mut std::collections::HashMap<i64, i64>,
) -> Result<Reported> {
    let (id, generation, rank, state) = (r.job, r.generation, r.rank, r.state.as_str());
    if !["running", "exited", "lost"].contains(&state) {
        return Err(CoordinatorError::invalid("state", format!("'{state}' is not running, exited or lost")));
    }
    let current = match generations.get(&id) {
        Some(&g) => g,
        None => {
            let g = match job_in(tx, id).await {
                Ok(job) => job.generation,
                // A job this database never had (restored from a backup, reset): nothing to
                // apply, and the agent must not be stuck resending it.
                Err(CoordinatorError::NotFound { .. }) => return Ok(Reported::Unknown),
                Err(e) => return Err(e),
            };
            generations.insert(id, g);
            g
        }
    };
    if current != generation {
        return Ok(Reported::Stale(current));
    }
    let node = agent.map(|a| a.0.to_string());
    let done = sqlx::query(
        "UPDATE ranks SET state = $1, exit_code = $2 WHERE job_id = $3 AND generation = $4 AND rank = $5 \
         AND state <> 'exited' AND ($6 IS NULL OR node = $6)",
    )
    .bind(state)
    .bind(r.exit_code)
    .bind(id)
    .bind(generation)
    .bind(rank)
    .bind(node)
    .execute(&mut **tx)
    .await?;
    if done.rows_affected() == 1 {
        return Ok(Reported::Changed);
    }
    let row = sqlx::query("SELECT node, state FROM ranks WHERE job_id = $1 AND generation = $2 AND rank = $3")
        .bind(id)
        .bind(generation)
        .bind(rank)
        .fetch_optional(&mut **tx)
        .await?;
    let Some(row) = row else {
        return match agent {
            Some(_) => Ok(Reported::Unknown),
            None => Err(CoordinatorError::not_found(format!("rank {rank} of job {id} generation {generation}"))),
        };
    };
    let (on, was): (String, String) = (row.try_get("node")?, row.try_get("state")?);
    if let Some((node, _)) = agent.filter(|(n, _)| *n != on) {
        // Another node's rank: nothing of it applies here; the agent is told to stop its copy.
        tracing::warn!(job = id, generation, rank, "node {node} reported a rank that runs on {on}; refused");
        return Ok(Reported::Unknown);
    }
    debug_assert_eq!(was, "exited");
    Ok(Reported::Unchanged)
}
