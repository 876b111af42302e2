//! The coordinator's durable state, through sqlx's Any driver: the same SQL on SQLite (the
//! embedded default, a file) and PostgreSQL. `migrations/` is applied at open. Every change
//! that must be all-or-nothing (a launch: new generation, plan, rank assignments, event) is
//! one transaction, so a crash at any point leaves either all of it or none. `docs/state.md`
//! says what is here and what is rebuilt from heartbeats.

use serde::{Deserialize, Serialize};
use sqlx::any::{AnyPoolOptions, AnyRow};
use sqlx::{AnyPool, Row};
use std::time::{SystemTime, UNIX_EPOCH};

use crate::error::{CoordinatorError, Result};
use crate::job::JobState;

mod checkpoints;
mod profiles;
mod recovery;
pub use checkpoints::Holding;
pub use profiles::{NewProfile, ProfileRecord, ProfileRun, RunKey, RunState};
pub use recovery::{RecoveryCause, Spent};

/// `sqlx::migrate!` embeds `migrations/` in the binary.
static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("../migrations");

pub use motley_contract::views::NodeState;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NodeRecord {
    pub name: String,
    /// The node's cluster-file entry, JSON.
    pub inventory: String,
    pub state: NodeState,
    /// Fencing token of the agent's current session.
    pub agent_epoch: i64,
    pub registered_at_ms: i64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JobRecord {
    pub id: i64,
    pub name: String,
    /// The job file, JSON.
    pub spec: String,
    pub state: JobState,
    pub generation: i64,
    pub reason: Option<String>,
    pub created_at_ms: i64,
    pub updated_at_ms: i64,
}

/// One rank of a launch: where it runs and which layers it holds (the seam for checkpoints).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema, sqlx::FromRow)]
pub struct RankAssignment {
    pub rank: i64,
    pub node: String,
    pub local_rank: i64,
    pub gpu: i64,
    pub replica: i64,
    pub stage: i64,
    pub layer_start: i64,
    pub layer_end: i64,
}

/// A GPU a rank holds (`Store::held_gpus`).
#[derive(Debug, Clone, PartialEq)]
pub struct HeldGpu {
    pub node: String,
    pub gpu: i64,
    pub job: i64,
    /// Its rank reported running (it holds the GPU whatever its job's state).
    pub running: bool,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema, sqlx::FromRow)]
pub struct RankRecord {
    #[sqlx(flatten)]
    pub assignment: RankAssignment,
    /// assigned | running | exited | lost
    pub state: String,
    pub exit_code: Option<i64>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema, sqlx::FromRow)]
pub struct Event {
    pub seq: i64,
    pub job_id: Option<i64>,
    pub generation: Option<i64>,
    pub kind: String,
    pub message: String,
    pub at_ms: i64,
}

/// A handle on the database; cheap to clone.
#[derive(Clone)]
pub struct Store {
    pub(crate) pool: AnyPool,
    /// Rank reports waiting for the next group commit (`report_ranks_from`).
    reports: std::sync::Arc<ReportQueue>,
    /// The leadership term this process writes under (0: not fenced, e.g. tests); job moves
    /// check it inside their transaction, so a deposed leader's late writes are refused.
    term: std::sync::Arc<std::sync::atomic::AtomicI64>,
}

pub(crate) fn now_ms() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as i64)
}

impl Store {
    /// Open (creating a SQLite file if needed) and migrate. `url`: `sqlite://PATH` or
    /// `postgres://USER@HOST:PORT/DB`.
    pub async fn open(url: &str) -> Result<Store> {
        Store::open_bounded(url, std::time::Duration::from_secs(60)).await
    }

    /// `open`, with PostgreSQL sessions ended by the server when they sit inside a transaction
    /// for `idle_in_transaction` (a coordinator frozen mid-transaction would otherwise hold its
    /// row locks, the leader row's among them, and block the standby's takeover for as long
    /// as it stays frozen).
    pub async fn open_bounded(url: &str, idle_in_transaction: std::time::Duration) -> Result<Store> {
        sqlx::any::install_default_drivers();
        let url = if let Some(path) = url.strip_prefix("sqlite://") {
            if path.contains('?') {
                url.to_string()
            } else {
                format!("sqlite://{path}?mode=rwc")
            }
        } else if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            url.to_string()
        } else {
            return Err(CoordinatorError::invalid(
                "--database-url",
                format!("'{url}' is neither sqlite://PATH nor postgres://USER@HOST:PORT/DB"),
            ));
        };
        // SQLite takes one writer at a time: one connection avoids "database is locked".
        let max = if url.starts_with("sqlite:") { 1 } else { 8 };
        let postgres = !url.starts_with("sqlite:");
        let idle_ms = idle_in_transaction.as_millis().max(1);
        let pool = AnyPoolOptions::new()
            .max_connections(max)
            .after_connect(move |conn, _| {
                Box::pin(async move {
                    if postgres {
                        // A number, not user input.
                        sqlx::query(sqlx::AssertSqlSafe(format!("SET idle_in_transaction_session_timeout = {idle_ms}")))
                            .execute(&mut *conn)
                            .await?;
                    }
                    Ok(())
                })
            })
            .connect(&url)
            .await?;
        if url.starts_with("sqlite:") {
            // Write-ahead logging: a commit appends to the log (still synced: a crash loses no
            // committed state) instead of rewriting pages, and a standby coordinator on the same
            // file reads while the leader writes.
            sqlx::query("PRAGMA journal_mode=WAL").execute(&pool).await?;
        }
        MIGRATOR.run(&pool).await?;
        Ok(Store { pool, reports: Default::default(), term: Default::default() })
    }

    /// Fence every later job move with this leadership term.
    pub fn fence(&self, term: i64) {
        self.term.store(term, std::sync::atomic::Ordering::SeqCst);
    }

    /// Inside a transaction: refuse unless this process still holds the term it writes under.
    /// The no-op update locks the leader row (PostgreSQL), so a new leader's claim waits for
    /// this transaction and a move either lands before the claim or is refused.
    async fn check_term(&self, tx: &mut sqlx::Transaction<'_, sqlx::Any>) -> Result<()> {
        let term = self.term.load(std::sync::atomic::Ordering::SeqCst);
        if term == 0 {
            return Ok(());
        }
        let same = sqlx::query("UPDATE leader SET term = term WHERE id = 1 AND term = $1").bind(term).execute(&mut **tx).await?;
        if same.rows_affected() == 1 {
            return Ok(());
        }
        let row = sqlx::query("SELECT rest_url, grpc_url FROM leader WHERE id = 1").fetch_one(&mut **tx).await?;
        Err(CoordinatorError::NotLeader { rest_url: row.try_get("rest_url")?, grpc_url: row.try_get("grpc_url")? })
    }

    /// Close every connection (a test dropping its database waits for this).
    pub async fn close(&self) {
        self.pool.close().await;
    }

    /// Next value of a counter, inside the caller's transaction.
    async fn next(tx: &mut sqlx::Transaction<'_, sqlx::Any>, counter: &str) -> Result<i64> {
        let row =
            sqlx::query("UPDATE counters SET value = value + 1 WHERE name = $1 RETURNING value").bind(counter).fetch_one(&mut **tx).await?;
        Ok(row.try_get::<i64, _>(0)?)
    }

    async fn event(
        tx: &mut sqlx::Transaction<'_, sqlx::Any>,
        job: Option<i64>,
        generation: Option<i64>,
        kind: &str,
        message: &str,
    ) -> Result<i64> {
        let seq = Self::next(tx, "event_seq").await?;
        sqlx::query("INSERT INTO events (seq, job_id, generation, kind, message, at_ms) VALUES ($1, $2, $3, $4, $5, $6)")
            .bind(seq)
            .bind(job)
            .bind(generation)
            .bind(kind)
            .bind(message)
            .bind(now_ms())
            .execute(&mut **tx)
            .await?;
        Ok(seq)
    }

    /// Record an event that is not part of another change (a lost lease, say).
    pub async fn record_event(&self, job: Option<i64>, generation: Option<i64>, kind: &str, message: &str) -> Result<i64> {
        let mut tx = self.pool.begin().await?;
        let seq = Self::event(&mut tx, job, generation, kind, message).await?;
        tx.commit().await?;
        Ok(seq)
    }

    // ---- nodes ----

    /// Register (or re-register) a node with its inventory; returns the new agent epoch,
    /// which fences every older session of the node's agent. A draining node stays draining.
    /// The epoch is incremented by the database in one statement, so two registrations at once
    /// (on PostgreSQL's several connections) always get two different epochs.
    pub async fn register_node(&self, name: &str, inventory: &str) -> Result<i64> {
        if name.trim().is_empty() {
            return Err(CoordinatorError::invalid("node.name", "must not be empty"));
        }
        let mut tx = self.pool.begin().await?;
        let row = sqlx::query(
            "INSERT INTO nodes (name, inventory, state, agent_epoch, registered_at_ms) VALUES ($1, $2, 'active', 1, $3) \
             ON CONFLICT (name) DO UPDATE SET inventory = excluded.inventory, agent_epoch = nodes.agent_epoch + 1, \
             registered_at_ms = excluded.registered_at_ms, \
             state = CASE WHEN nodes.state = 'removed' THEN 'active' ELSE nodes.state END RETURNING agent_epoch",
        )
        .bind(name)
        .bind(inventory)
        .bind(now_ms())
        .fetch_one(&mut *tx)
        .await?;
        let epoch = row.try_get::<i64, _>(0)?;
        Self::event(&mut tx, None, None, "node_registered", &format!("node {name} registered (agent epoch {epoch})")).await?;
        tx.commit().await?;
        Ok(epoch)
    }

    /// Remove a node from the inventory, unless ranks of an unfinished job's current launch, or
    /// ranks reported running, are on it (checked in the same transaction). The row stays, as
    /// `removed` (finished jobs' ranks still name it); the node is gone from every listing and
    /// lookup until an agent registers it again.
    pub async fn remove_node(&self, name: &str) -> Result<()> {
        let mut tx = self.pool.begin().await?;
        let busy = sqlx::query(
            "SELECT r.job_id FROM ranks r JOIN jobs j ON j.id = r.job_id WHERE r.node = $1 AND \
             (r.state = 'running' OR (j.state IN ('submitted', 'planning', 'launching', 'running', 'recovering') AND r.generation = j.generation)) \
             ORDER BY r.job_id LIMIT 1",
        )
        .bind(name)
        .fetch_optional(&mut *tx)
        .await?;
        if let Some(row) = busy {
            let job: i64 = row.try_get(0)?;
            return Err(CoordinatorError::Conflict(format!("node {name} has ranks of job {job}; cancel the job or wait for it to end")));
        }
        let done =
            sqlx::query("UPDATE nodes SET state = 'removed' WHERE name = $1 AND state <> 'removed'").bind(name).execute(&mut *tx).await?;
        if done.rows_affected() == 0 {
            return Err(CoordinatorError::not_found(format!("node '{name}'")));
        }
        Self::event(&mut tx, None, None, "node_removed", &format!("node {name} removed")).await?;
        tx.commit().await?;
        Ok(())
    }

    /// Refuse a report or heartbeat of an agent session older than the node's latest one.
    pub async fn check_agent(&self, name: &str, epoch: i64) -> Result<()> {
        let node = self.node(name).await?;
        if node.agent_epoch != epoch {
            return Err(CoordinatorError::StaleAgent { node: name.to_string(), given: epoch, current: node.agent_epoch });
        }
        Ok(())
    }

    pub async fn node(&self, name: &str) -> Result<NodeRecord> {
        let row =
            sqlx::query("SELECT name, inventory, state, agent_epoch, registered_at_ms FROM nodes WHERE name = $1 AND state <> 'removed'")
                .bind(name)
                .fetch_optional(&self.pool)
                .await?
                .ok_or_else(|| CoordinatorError::not_found(format!("node '{name}'")))?;
        node_of(&row)
    }

    pub async fn nodes(&self) -> Result<Vec<NodeRecord>> {
        let rows =
            sqlx::query("SELECT name, inventory, state, agent_epoch, registered_at_ms FROM nodes WHERE state <> 'removed' ORDER BY name")
                .fetch_all(&self.pool)
                .await?;
        rows.iter().map(node_of).collect()
    }

    /// Drain or undrain a node.
    pub async fn set_node_state(&self, name: &str, state: NodeState) -> Result<NodeRecord> {
        let mut tx = self.pool.begin().await?;
        let done = sqlx::query("UPDATE nodes SET state = $1 WHERE name = $2 AND state <> 'removed'")
            .bind(state.as_str())
            .bind(name)
            .execute(&mut *tx)
            .await?;
        if done.rows_affected() == 0 {
            return Err(CoordinatorError::not_found(format!("node '{name}'")));
        }
        Self::event(&mut tx, None, None, "node_state", &format!("node {name} is {}", state.as_str())).await?;
        tx.commit().await?;
        self.node(name).await
    }

    // ---- jobs ----

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
             WHERE state IN ('submitted', 'planning', 'launching', 'running', 'recovering') ORDER BY id",
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
        // A compare-and-set on what was read (state and generation) and on the term, in SQL:
        // a concurrent move, a relaunch, or a new leader between the read and this write makes
        // it match no row.
        let done = sqlx::query(
            "UPDATE jobs SET state = $1, reason = $2, updated_at_ms = $3 WHERE id = $4 AND state = $5 AND generation = $6 \
             AND ($7 = 0 OR EXISTS (SELECT 1 FROM leader WHERE id = 1 AND term = $7))",
        )
        .bind(to.as_str())
        .bind(reason.map(str::to_string).or(job.reason.clone()))
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

    /// `start_generation` of a launch whose ranks resume from checkpoint step `restore_step`
    /// (a recovery's: the agents restored it for this generation).
    pub async fn start_generation_from(&self, id: i64, plan: &str, ranks: &[RankAssignment], restore_step: Option<i64>) -> Result<i64> {
        let mut tx = self.pool.begin().await?;
        self.check_term(&mut tx).await?;
        let job = job_in(&mut tx, id).await?;
        if !job.state.can_become(JobState::Launching) {
            return Err(CoordinatorError::Conflict(format!("job {id} is {}; it cannot be launched", job.state)));
        }
        let generation = job.generation + 1;
        let now = now_ms();
        sqlx::query("INSERT INTO plans (job_id, generation, plan, created_at_ms, restore_step) VALUES ($1, $2, $3, $4, $5)")
            .bind(id)
            .bind(generation)
            .bind(plan)
            .bind(now)
            .bind(restore_step.unwrap_or(-1))
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

    pub async fn plan(&self, id: i64, generation: i64) -> Result<String> {
        let row = sqlx::query("SELECT plan FROM plans WHERE job_id = $1 AND generation = $2")
            .bind(id)
            .bind(generation)
            .fetch_optional(&self.pool)
            .await?
            .ok_or_else(|| CoordinatorError::not_found(format!("plan of job {id} generation {generation}")))?;
        Ok(row.try_get::<String, _>(0)?)
    }

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

    /// GPUs held by ranks: every rank of a launched (`launching` or `running`) job's current
    /// launch, and ranks of other launches still reported `running` (a job that is over whose
    /// ranks have not exited yet). Sorted by node, GPU.
    pub async fn held_gpus(&self) -> Result<Vec<HeldGpu>> {
        let rows = sqlx::query(
            "SELECT r.node, r.gpu, r.job_id, r.state FROM ranks r JOIN jobs j ON j.id = r.job_id \
             WHERE (j.state IN ('launching', 'running', 'recovering') AND r.generation = j.generation) \
             UNION ALL \
             SELECT r.node, r.gpu, r.job_id, r.state FROM ranks r JOIN jobs j ON j.id = r.job_id \
             WHERE r.state = 'running' AND NOT (j.state IN ('launching', 'running', 'recovering') AND r.generation = j.generation) \
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
             WHERE r.node = $1 AND r.state = 'running' AND j.state IN ('launching', 'running') ORDER BY r.job_id, r.rank",
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

    /// Events after `after` (all jobs, or one), oldest first, at most `limit`.
    pub async fn events(&self, job: Option<i64>, after: i64, limit: i64) -> Result<Vec<Event>> {
        let events =
            match job {
                Some(id) => sqlx::query_as::<_, Event>(
                    "SELECT seq, job_id, generation, kind, message, at_ms FROM events WHERE job_id = $1 AND seq > $2 ORDER BY seq LIMIT $3",
                )
                .bind(id)
                .bind(after)
                .bind(limit)
                .fetch_all(&self.pool)
                .await?,
                None => {
                    sqlx::query_as::<_, Event>(
                        "SELECT seq, job_id, generation, kind, message, at_ms FROM events WHERE seq > $1 ORDER BY seq LIMIT $2",
                    )
                    .bind(after)
                    .bind(limit)
                    .fetch_all(&self.pool)
                    .await?
                }
            };
        Ok(events)
    }
}

/// Rows per multi-row INSERT of rank assignments.
const RANK_ROWS_PER_INSERT: usize = 500;

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

/// Reports waiting for a group commit, and the lock its writer holds.
#[derive(Default)]
struct ReportQueue {
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

/// The `rank` events of a batch of reports, in order: their sequence numbers taken in one
/// counter update, the rows in one INSERT per chunk.
async fn rank_events(tx: &mut sqlx::Transaction<'_, sqlx::Any>, events: &[(i64, i64, String)]) -> Result<()> {
    if events.is_empty() {
        return Ok(());
    }
    let row = sqlx::query("UPDATE counters SET value = value + $1 WHERE name = 'event_seq' RETURNING value")
        .bind(events.len() as i64)
        .fetch_one(&mut **tx)
        .await?;
    let mut seq = row.try_get::<i64, _>(0)? - events.len() as i64;
    let at = now_ms();
    // 4 parameters a row; `at_ms` and the kind are shared.
    for chunk in events.chunks(1000) {
        let mut sql = String::from("INSERT INTO events (at_ms, seq, job_id, generation, kind, message) VALUES ");
        for i in 0..chunk.len() {
            let p = 2 + 4 * i;
            let sep = if i == 0 { "" } else { ", " };
            sql.push_str(&format!("{sep}($1, ${}, ${}, ${}, 'rank', ${})", p, p + 1, p + 2, p + 3));
        }
        // Built from placeholders only: no value is spliced into the SQL.
        let mut q = sqlx::query(sqlx::AssertSqlSafe(sql)).bind(at);
        for (job, generation, message) in chunk {
            seq += 1;
            q = q.bind(seq).bind(*job).bind(*generation).bind(message.as_str());
        }
        q.execute(&mut **tx).await?;
    }
    Ok(())
}

async fn job_in(tx: &mut sqlx::Transaction<'_, sqlx::Any>, id: i64) -> Result<JobRecord> {
    let row = sqlx::query("SELECT id, name, spec, state, generation, reason, created_at_ms, updated_at_ms FROM jobs WHERE id = $1")
        .bind(id)
        .fetch_optional(&mut **tx)
        .await?
        .ok_or_else(|| CoordinatorError::not_found(format!("job {id}")))?;
    job_of(&row)
}

fn node_of(r: &AnyRow) -> Result<NodeRecord> {
    let state: String = r.try_get("state")?;
    let name: String = r.try_get("name")?;
    let state = match state.as_str() {
        "active" => NodeState::Active,
        "draining" => NodeState::Draining,
        // Never read as active: a state a newer version wrote (cordoned, say) must not get ranks.
        other => {
            return Err(CoordinatorError::Conflict(format!(
                "node {name}: stored state '{other}' is unknown to this version (active, draining); upgrade the coordinator"
            )))
        }
    };
    Ok(NodeRecord {
        name,
        inventory: r.try_get("inventory")?,
        state,
        agent_epoch: r.try_get("agent_epoch")?,
        registered_at_ms: r.try_get("registered_at_ms")?,
    })
}

fn job_of(r: &AnyRow) -> Result<JobRecord> {
    let state: String = r.try_get("state")?;
    Ok(JobRecord {
        id: r.try_get("id")?,
        name: r.try_get("name")?,
        spec: r.try_get("spec")?,
        state: state.parse().map_err(|e: String| CoordinatorError::Conflict(format!("stored job row: {e}")))?,
        generation: r.try_get("generation")?,
        reason: r.try_get("reason")?,
        created_at_ms: r.try_get("created_at_ms")?,
        updated_at_ms: r.try_get("updated_at_ms")?,
    })
}
