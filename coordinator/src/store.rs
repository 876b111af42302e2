//! The coordinator's durable state, through sqlx's Any driver: the same SQL on SQLite (the
//! embedded default, a file) and PostgreSQL. `migrations/` is applied at open. Every change
//! that must be all-or-nothing (a launch: new generation, plan, rank assignments, event) is
//! one transaction, so a crash at any point leaves either all of it or none. `docs/state.md`
//! says what is here and what is rebuilt from heartbeats.
//!
//! This file holds the handle (`Store`: open, fence, close), the record types several topics
//! share, and the helpers every topic's transactions use (counters, events, reading a job).
//! Each topic's methods are an `impl Store` in a child: `nodes`, `jobs` (jobs, their moves,
//! launches and plans), `ranks` (a launch's ranks, the GPUs they hold, their summary),
//! `reports` (agents' rank reports, group-committed), `events`, `checkpoints`, `profiles`,
//! `recovery`, `secrets` (the data-plane key), `cluster` (the cluster's identity).

use serde::{Deserialize, Serialize};
use sqlx::any::{AnyPoolOptions, AnyRow};
use sqlx::{AnyPool, Row};
use std::time::{SystemTime, UNIX_EPOCH};

use crate::error::{CoordinatorError, Result};
use crate::job::JobState;

/// `sqlx::FromRow` for a record read by column name, each field from the column of its name and
/// each `flatten` field from the same row: what sqlx's derive writes, without its proc-macro
/// (store/migrations.rs says why the build leaves sqlx's macros out).
macro_rules! impl_from_row {
    ($ty:ident { $($field:ident),* $(,)? } $(flatten { $($flat:ident),+ $(,)? })?) => {
        impl<'r> sqlx::FromRow<'r, sqlx::any::AnyRow> for $ty {
            fn from_row(row: &'r sqlx::any::AnyRow) -> std::result::Result<Self, sqlx::Error> {
                use sqlx::Row;
                Ok(Self {
                    $($field: row.try_get(stringify!($field))?,)*
                    $($($flat: sqlx::FromRow::from_row(row)?,)+)?
                })
            }
        }
    };
}

mod checkpoints;
mod cluster;
mod events;
mod jobs;
mod migrations;
mod nodes;
mod profiles;
mod ranks;
mod recovery;
mod reports;
mod secrets;
pub use checkpoints::Holding;
pub use events::Event;
pub use migrations::migrator;
pub use nodes::NodeRecord;
pub use profiles::{NewProfile, ProfileRecord, ProfileRun, RunKey, RunState};
pub use ranks::{FailedRank, HeldGpu, RankRecord, RankSummary};
pub use recovery::{RecoveryCause, Spent};
use reports::ReportQueue;
pub use reports::{RankReport, RanksReported};

pub use motley_contract::views::NodeState;

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
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
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

impl_from_row!(RankAssignment { rank, node, local_rank, gpu, replica, stage, layer_start, layer_end });

/// A handle on the database; cheap to clone.
#[derive(Clone)]
pub struct Store {
    pub(crate) pool: AnyPool,
    /// Rank reports waiting for the next group commit (`report_ranks_from`).
    reports: std::sync::Arc<ReportQueue>,
    /// The leadership term this process writes under (0: not fenced, e.g. tests); job moves
    /// check it inside their transaction, so a deposed leader's late writes are refused.
    term: std::sync::Arc<std::sync::atomic::AtomicI64>,
    /// The cluster's identity, read (made, the first time) at open: it never changes.
    cluster: std::sync::Arc<crate::job::cluster::ClusterIdentity>,
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
        // Coordinators opening one SQLite file at once (HA on one host, first start): switching
        // it to WAL and migrating take its locks, and where waiting could deadlock SQLite answers
        // the second taker "database is locked" at once instead of waiting out its busy
        // timeout. The loser starts again (every step is idempotent), for up to 5 s.
        let mut tries = 0;
        let cluster = loop {
            match Store::prepare(&pool, !postgres).await {
                Ok(c) => break c,
                Err(e) if !postgres && tries < 50 && e.to_string().contains("database is locked") => {
                    tries += 1;
                    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                }
                Err(e) => return Err(e),
            }
        };
        Ok(Store { pool, reports: Default::default(), term: Default::default(), cluster: std::sync::Arc::new(cluster) })
    }

    /// WAL (SQLite), the migrations, and the cluster's identity.
    async fn prepare(pool: &sqlx::AnyPool, sqlite: bool) -> Result<crate::job::cluster::ClusterIdentity> {
        if sqlite {
            // Write-ahead logging: a commit appends to the log (still synced: a crash loses no
            // committed state) instead of rewriting pages, and a standby coordinator on the same
            // file reads while the leader writes.
            sqlx::query("PRAGMA journal_mode=WAL").execute(pool).await?;
        }
        migrator().run(pool).await?;
        cluster::load(pool).await
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
