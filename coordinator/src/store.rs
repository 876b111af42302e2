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

/// `sqlx::migrate!` embeds `migrations/` in the binary.
static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("../migrations");

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum NodeState {
    Active,
    /// Gets no new ranks; what runs there keeps running.
    Draining,
}

impl NodeState {
    fn as_str(self) -> &'static str {
        match self {
            NodeState::Active => "active",
            NodeState::Draining => "draining",
        }
    }
}

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
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
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

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RankRecord {
    pub assignment: RankAssignment,
    /// assigned | running | exited | lost
    pub state: String,
    pub exit_code: Option<i64>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
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
    pool: AnyPool,
}

fn now_ms() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as i64)
}

impl Store {
    /// Open (creating a SQLite file if needed) and migrate. `url`: `sqlite://PATH` or
    /// `postgres://USER@HOST:PORT/DB`.
    pub async fn open(url: &str) -> Result<Store> {
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
        let pool = AnyPoolOptions::new().max_connections(max).connect(&url).await?;
        MIGRATOR.run(&pool).await?;
        Ok(Store { pool })
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
    pub async fn register_node(&self, name: &str, inventory: &str) -> Result<i64> {
        if name.trim().is_empty() {
            return Err(CoordinatorError::invalid("node.name", "must not be empty"));
        }
        let mut tx = self.pool.begin().await?;
        let existing = sqlx::query("SELECT agent_epoch FROM nodes WHERE name = $1").bind(name).fetch_optional(&mut *tx).await?;
        let epoch = match existing {
            Some(row) => {
                let epoch = row.try_get::<i64, _>(0)? + 1;
                sqlx::query("UPDATE nodes SET inventory = $1, agent_epoch = $2, registered_at_ms = $3 WHERE name = $4")
                    .bind(inventory)
                    .bind(epoch)
                    .bind(now_ms())
                    .bind(name)
                    .execute(&mut *tx)
                    .await?;
                epoch
            }
            None => {
                sqlx::query("INSERT INTO nodes (name, inventory, state, agent_epoch, registered_at_ms) VALUES ($1, $2, $3, $4, $5)")
                    .bind(name)
                    .bind(inventory)
                    .bind(NodeState::Active.as_str())
                    .bind(1i64)
                    .bind(now_ms())
                    .execute(&mut *tx)
                    .await?;
                1
            }
        };
        Self::event(&mut tx, None, None, "node_registered", &format!("node {name} registered (agent epoch {epoch})")).await?;
        tx.commit().await?;
        Ok(epoch)
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
        let row = sqlx::query("SELECT name, inventory, state, agent_epoch, registered_at_ms FROM nodes WHERE name = $1")
            .bind(name)
            .fetch_optional(&self.pool)
            .await?
            .ok_or_else(|| CoordinatorError::not_found(format!("node '{name}'")))?;
        node_of(&row)
    }

    pub async fn nodes(&self) -> Result<Vec<NodeRecord>> {
        let rows = sqlx::query("SELECT name, inventory, state, agent_epoch, registered_at_ms FROM nodes ORDER BY name")
            .fetch_all(&self.pool)
            .await?;
        rows.iter().map(node_of).collect()
    }

    /// Drain or undrain a node.
    pub async fn set_node_state(&self, name: &str, state: NodeState) -> Result<NodeRecord> {
        let mut tx = self.pool.begin().await?;
        let done = sqlx::query("UPDATE nodes SET state = $1 WHERE name = $2").bind(state.as_str()).bind(name).execute(&mut *tx).await?;
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
        let done = sqlx::query("UPDATE jobs SET state = $1, reason = $2, updated_at_ms = $3 WHERE id = $4 AND state = $5")
            .bind(to.as_str())
            .bind(reason.map(str::to_string).or(job.reason.clone()))
            .bind(now_ms())
            .bind(id)
            .bind(job.state.as_str())
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
        let mut tx = self.pool.begin().await?;
        let job = job_in(&mut tx, id).await?;
        if !job.state.can_become(JobState::Launching) {
            return Err(CoordinatorError::Conflict(format!("job {id} is {}; it cannot be launched", job.state)));
        }
        let generation = job.generation + 1;
        let now = now_ms();
        sqlx::query("INSERT INTO plans (job_id, generation, plan, created_at_ms) VALUES ($1, $2, $3, $4)")
            .bind(id)
            .bind(generation)
            .bind(plan)
            .bind(now)
            .execute(&mut *tx)
            .await?;
        for r in ranks {
            sqlx::query(
                "INSERT INTO ranks (job_id, generation, rank, node, local_rank, gpu, replica, stage, layer_start, layer_end, state, exit_code) \
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12)",
            )
            .bind(id)
            .bind(generation)
            .bind(r.rank)
            .bind(&r.node)
            .bind(r.local_rank)
            .bind(r.gpu)
            .bind(r.replica)
            .bind(r.stage)
            .bind(r.layer_start)
            .bind(r.layer_end)
            .bind("assigned")
            .bind(None::<i64>)
            .execute(&mut *tx)
            .await?;
        }
        let done =
            sqlx::query("UPDATE jobs SET state = $1, generation = $2, updated_at_ms = $3 WHERE id = $4 AND generation = $5 AND state = $6")
                .bind(JobState::Launching.as_str())
                .bind(generation)
                .bind(now)
                .bind(id)
                .bind(job.generation)
                .bind(job.state.as_str())
                .execute(&mut *tx)
                .await?;
        // Moved (cancelled, say) since it was read: the whole launch is rolled back.
        if done.rows_affected() != 1 {
            return Err(CoordinatorError::Conflict(format!("job {id} changed state concurrently; not launched")));
        }
        let message = format!("job {id}: generation {generation} launching {} ranks", ranks.len());
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
        let rows = sqlx::query(
            "SELECT rank, node, local_rank, gpu, replica, stage, layer_start, layer_end, state, exit_code FROM ranks \
             WHERE job_id = $1 AND generation = $2 ORDER BY rank",
        )
        .bind(id)
        .bind(generation)
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(rank_of).collect()
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
        if !["running", "exited", "lost"].contains(&state) {
            return Err(CoordinatorError::invalid("state", format!("'{state}' is not running, exited or lost")));
        }
        let mut tx = self.pool.begin().await?;
        if let Some((node, epoch)) = agent {
            // A no-op update that locks the node's row (PostgreSQL) while the epoch is checked.
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
        }
        let job = job_in(&mut tx, id).await?;
        if job.generation != generation {
            return Err(CoordinatorError::StaleGeneration { job: id, given: generation, current: job.generation });
        }
        let node = agent.map(|a| a.0.to_string());
        let done = sqlx::query(
            "UPDATE ranks SET state = $1, exit_code = $2 WHERE job_id = $3 AND generation = $4 AND rank = $5 \
             AND state <> 'exited' AND ($6 IS NULL OR node = $6)",
        )
        .bind(state)
        .bind(exit_code)
        .bind(id)
        .bind(generation)
        .bind(rank)
        .bind(node)
        .execute(&mut *tx)
        .await?;
        if done.rows_affected() != 1 {
            let row = sqlx::query("SELECT node, state FROM ranks WHERE job_id = $1 AND generation = $2 AND rank = $3")
                .bind(id)
                .bind(generation)
                .bind(rank)
                .fetch_optional(&mut *tx)
                .await?;
            let Some(row) = row else {
                return Err(CoordinatorError::not_found(format!("rank {rank} of job {id} generation {generation}")));
            };
            let (on, was): (String, String) = (row.try_get("node")?, row.try_get("state")?);
            if let Some((node, _)) = agent.filter(|(n, _)| *n != on) {
                return Err(CoordinatorError::invalid("ranks.rank", format!("rank {rank} of job {id} runs on {on}, not {node}")));
            }
            // Already exited: a report sent again after a reconnect changes nothing.
            debug_assert_eq!(was, "exited");
            return Ok(());
        }
        let message = match exit_code {
            Some(c) => format!("job {id}: rank {rank} {state} (exit code {c})"),
            None => format!("job {id}: rank {rank} {state}"),
        };
        Self::event(&mut tx, Some(id), Some(generation), "rank", &message).await?;
        tx.commit().await?;
        Ok(())
    }

    /// Events after `after` (all jobs, or one), oldest first, at most `limit`.
    pub async fn events(&self, job: Option<i64>, after: i64, limit: i64) -> Result<Vec<Event>> {
        let rows =
            match job {
                Some(id) => sqlx::query(
                    "SELECT seq, job_id, generation, kind, message, at_ms FROM events WHERE job_id = $1 AND seq > $2 ORDER BY seq LIMIT $3",
                )
                .bind(id)
                .bind(after)
                .bind(limit)
                .fetch_all(&self.pool)
                .await?,
                None => {
                    sqlx::query("SELECT seq, job_id, generation, kind, message, at_ms FROM events WHERE seq > $1 ORDER BY seq LIMIT $2")
                        .bind(after)
                        .bind(limit)
                        .fetch_all(&self.pool)
                        .await?
                }
            };
        rows.iter()
            .map(|r| {
                Ok(Event {
                    seq: r.try_get("seq")?,
                    job_id: r.try_get("job_id")?,
                    generation: r.try_get("generation")?,
                    kind: r.try_get("kind")?,
                    message: r.try_get("message")?,
                    at_ms: r.try_get("at_ms")?,
                })
            })
            .collect()
    }
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
    Ok(NodeRecord {
        name: r.try_get("name")?,
        inventory: r.try_get("inventory")?,
        state: if state == "draining" { NodeState::Draining } else { NodeState::Active },
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

fn rank_of(r: &AnyRow) -> Result<RankRecord> {
    Ok(RankRecord {
        assignment: RankAssignment {
            rank: r.try_get("rank")?,
            node: r.try_get("node")?,
            local_rank: r.try_get("local_rank")?,
            gpu: r.try_get("gpu")?,
            replica: r.try_get("replica")?,
            stage: r.try_get("stage")?,
            layer_start: r.try_get("layer_start")?,
            layer_end: r.try_get("layer_end")?,
        },
        state: r.try_get("state")?,
        exit_code: r.try_get("exit_code")?,
    })
}
