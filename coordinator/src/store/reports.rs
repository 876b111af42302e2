//! Agents' reports on their ranks, fenced by the agent's epoch and the launch's generation,
//! and group-committed: the reports of concurrent heartbeats share one transaction.

use sqlx::Row;

use super::{job_in, rank_events, Store};
use crate::error::{CoordinatorError, Result};
use crate::job::JobState;

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
        let mut events: Vec<Logged> = vec![];
        let mut jobs: std::collections::HashMap<i64, (i64, bool)> = Default::default();
        let term = self.term.load(std::sync::atomic::Ordering::SeqCst);
        let mut results = Vec::with_capacity(batch.len());
        for unit in batch {
            let agent = unit.agent.as_ref().map(|(n, e)| (n.as_str(), *e));
            let mut seen = Seen { jobs: &mut jobs, events: &mut events, term };
            match reports_in(&mut tx, agent, &unit.reports, &mut seen).await {
                Err(e @ CoordinatorError::Database(_)) => return Err(e),
                result => results.push(result),
            }
        }
        // In the order they happened: a launch that started within these reports is `running`
        // before any of its ranks' later exits.
        let mut ranks: Vec<(i64, i64, String)> = vec![];
        for e in events {
            match e {
                Logged::Rank(job, generation, message) => ranks.push((job, generation, message)),
                Logged::Started(job, generation) => {
                    rank_events(&mut tx, &std::mem::take(&mut ranks)).await?;
                    let message = format!("job {job}: {} -> {}", JobState::Launching, JobState::Running);
                    Self::event(&mut tx, Some(job), Some(generation), JobState::Running.as_str(), &message).await?;
                }
            }
        }
        rank_events(&mut tx, &ranks).await?;
        tx.commit().await?;
        Ok(results)
    }
}

/// An event of a batch of reports, in order: a rank's, or its launch moving `running`.
enum Logged {
    Rank(i64, i64, String),
    Started(i64, i64),
}

/// What a batch of reports has learnt so far: per job, its generation and whether it is
/// `launching`; the events; the term moves are fenced by.
struct Seen<'a> {
    jobs: &'a mut std::collections::HashMap<i64, (i64, bool)>,
    events: &'a mut Vec<Logged>,
    term: i64,
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
    seen: &mut Seen<'_>,
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
    for (i, r) in reports.iter().enumerate() {
        match report_in(tx, agent, r, seen.jobs).await? {
            Reported::Changed => {
                out.jobs.push(r.job);
                let message = match r.exit_code {
                    Some(c) => format!("job {}: rank {} {} (exit code {c})", r.job, r.rank, r.state),
                    None => format!("job {}: rank {} {}", r.job, r.rank, r.state),
                };
                seen.events.push(Logged::Rank(r.job, r.generation, message));
                // Counted where it matters only: before a report of the job that is not a start
                // (an exit), and at the end of the unit.
                let next_starts = reports[i + 1..].iter().find(|n| n.job == r.job).is_some_and(|n| n.state == "running");
                if !next_starts && seen.jobs.get(&r.job).is_some_and(|j| j.1) && start_running(tx, seen.term, r.job, r.generation).await? {
                    seen.jobs.insert(r.job, (r.generation, false));
                    seen.events.push(Logged::Started(r.job, r.generation));
                }
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

/// A launch whose every rank has started (running or exited) and none failed moves
/// `launching -> running` in the transaction of the report that completed it, so its event
/// comes before the ranks' later exits (the leader's look at the job, `Life::progress`, would
/// record it after them). Fenced as every job move is: the state and generation in SQL, and
/// the leadership term (its row locked, as `Store::check_term` does); a move refused here is
/// left to that look. Whether it moved.
async fn start_running(tx: &mut sqlx::Transaction<'_, sqlx::Any>, term: i64, id: i64, generation: i64) -> Result<bool> {
    let row = sqlx::query(
        "SELECT COALESCE(SUM(CASE WHEN state = 'running' OR state = 'exited' THEN 0 ELSE 1 END), 0), \
         COALESCE(SUM(CASE WHEN state = 'lost' OR (state = 'exited' AND (exit_code IS NULL OR exit_code <> 0)) THEN 1 ELSE 0 END), 0) \
         FROM ranks WHERE job_id = $1 AND generation = $2",
    )
    .bind(id)
    .bind(generation)
    .fetch_one(&mut **tx)
    .await?;
    if row.try_get::<i64, _>(0)? != 0 || row.try_get::<i64, _>(1)? != 0 {
        return Ok(false);
    }
    if term != 0 {
        let same = sqlx::query("UPDATE leader SET term = term WHERE id = 1 AND term = $1").bind(term).execute(&mut **tx).await?;
        if same.rows_affected() != 1 {
            return Ok(false);
        }
    }
    let moved = sqlx::query("UPDATE jobs SET state = $1, updated_at_ms = $2 WHERE id = $3 AND generation = $4 AND state = $5")
        .bind(JobState::Running.as_str())
        .bind(super::now_ms())
        .bind(id)
        .bind(generation)
        .bind(JobState::Launching.as_str())
        .execute(&mut **tx)
        .await?;
    Ok(moved.rows_affected() == 1)
}

/// One report inside `report_ranks_from`'s transaction; `jobs` caches each job's generation
/// and whether it is launching.
async fn report_in(
    tx: &mut sqlx::Transaction<'_, sqlx::Any>,
    agent: Option<(&str, i64)>,
    r: &RankReport,
    jobs: &mut std::collections::HashMap<i64, (i64, bool)>,
) -> Result<Reported> {
    let (id, generation, rank, state) = (r.job, r.generation, r.rank, r.state.as_str());
    if !["running", "exited", "lost"].contains(&state) {
        return Err(CoordinatorError::invalid("state", format!("'{state}' is not running, exited or lost")));
    }
    let current = match jobs.get(&id) {
        Some(&(g, _)) => g,
        None => {
            let job = match job_in(tx, id).await {
                Ok(job) => job,
                // A job this database never had (restored from a backup, reset): nothing to
                // apply, and the agent must not be stuck resending it.
                Err(CoordinatorError::NotFound { .. }) => return Ok(Reported::Unknown),
                Err(e) => return Err(e),
            };
            jobs.insert(id, (job.generation, job.state == JobState::Launching));
            job.generation
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
