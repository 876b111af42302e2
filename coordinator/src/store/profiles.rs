//! Measured layer profiles (`layer_profiles`, migration 0005): one row per (GPU type, model
//! hash, tp, micro-batch, sequence length, data type, torch version); a newer measurement of
//! the same key replaces the row. Written by the leader when an agent reports a profile run.

use serde::Serialize;
use sqlx::Row;

use super::{now_ms, Store};
use crate::error::{CoordinatorError, Result};

/// A stored profile: the measurement, and its id and time.
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
pub struct ProfileRecord {
    pub id: i64,
    #[serde(flatten)]
    pub profile: NewProfile,
    pub measured_at_ms: i64,
}

impl_from_row!(ProfileRecord { id, measured_at_ms } flatten { profile });

/// A measured profile: its key, where it was measured, and the profiles file entry.
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
pub struct NewProfile {
    pub gpu: String,
    pub model: String,
    pub model_hash: String,
    pub tp: i64,
    pub micro_batch: i64,
    pub seq_len: i64,
    pub dtype: String,
    pub torch: String,
    pub device: String,
    pub node: String,
    /// The entry of a profiles file (`motley plan --profiles`): JSON text in the database,
    /// a JSON object in the API.
    #[serde(serialize_with = "as_json")]
    #[schema(value_type = Object)]
    pub entry: String,
}

impl_from_row!(NewProfile { gpu, model, model_hash, tp, micro_batch, seq_len, dtype, torch, device, node, entry });

fn as_json<S: serde::Serializer>(text: &str, s: S) -> std::result::Result<S::Ok, S::Error> {
    serde_json::from_str::<serde_json::Value>(text).unwrap_or(serde_json::Value::Null).serialize(s)
}

/// The columns in `ProfileRecord`'s order (a macro: sqlx takes only static query strings).
macro_rules! columns {
    () => {
        "id, gpu, model, model_hash, tp, micro_batch, seq_len, dtype, torch, device, node, entry, measured_at_ms"
    };
}

impl Store {
    /// Store a measured profile (replacing the row of the same key) with an event; its id.
    pub async fn put_profile(&self, p: &NewProfile) -> Result<i64> {
        let mut tx = self.pool.begin().await?;
        sqlx::query(
            "DELETE FROM layer_profiles WHERE gpu = $1 AND model_hash = $2 AND tp = $3 AND micro_batch = $4 AND seq_len = $5 \
             AND dtype = $6 AND torch = $7",
        )
        .bind(&p.gpu)
        .bind(&p.model_hash)
        .bind(p.tp)
        .bind(p.micro_batch)
        .bind(p.seq_len)
        .bind(&p.dtype)
        .bind(&p.torch)
        .execute(&mut *tx)
        .await?;
        let id = Self::next(&mut tx, "profile_id").await?;
        sqlx::query(concat!(
            "INSERT INTO layer_profiles (",
            columns!(),
            ") VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13)"
        ))
        .bind(id)
        .bind(&p.gpu)
        .bind(&p.model)
        .bind(&p.model_hash)
        .bind(p.tp)
        .bind(p.micro_batch)
        .bind(p.seq_len)
        .bind(&p.dtype)
        .bind(&p.torch)
        .bind(&p.device)
        .bind(&p.node)
        .bind(&p.entry)
        .bind(now_ms())
        .execute(&mut *tx)
        .await?;
        let message = format!(
            "profile {id} stored: {} tp {} micro-batch {} of {} (seq {}, {}, torch {}) measured on {}",
            p.gpu, p.tp, p.micro_batch, p.model, p.seq_len, p.dtype, p.torch, p.node
        );
        Self::event(&mut tx, None, None, "profile_stored", &message).await?;
        tx.commit().await?;
        Ok(id)
    }

    /// Every stored profile, newest first; of one model (its hash) when given.
    pub async fn profiles(&self, model_hash: Option<&str>) -> Result<Vec<ProfileRecord>> {
        let rows = match model_hash {
            Some(h) => {
                sqlx::query_as(concat!(
                    "SELECT ",
                    columns!(),
                    " FROM layer_profiles WHERE model_hash = $1 ORDER BY measured_at_ms DESC, id DESC"
                ))
                .bind(h)
                .fetch_all(&self.pool)
                .await?
            }
            None => {
                sqlx::query_as(concat!("SELECT ", columns!(), " FROM layer_profiles ORDER BY measured_at_ms DESC, id DESC"))
                    .fetch_all(&self.pool)
                    .await?
            }
        };
        Ok(rows)
    }

    pub async fn profile(&self, id: i64) -> Result<ProfileRecord> {
        sqlx::query_as(concat!("SELECT ", columns!(), " FROM layer_profiles WHERE id = $1"))
            .bind(id)
            .fetch_optional(&self.pool)
            .await?
            .ok_or_else(|| CoordinatorError::not_found(format!("profile {id} (motley profile list)")))
    }

    /// The profiles the planner uses for a model at a sequence length and data type: the newest
    /// of each (gpu, tp, micro-batch), whatever torch measured it.
    pub async fn profiles_for(&self, model_hash: &str, seq_len: i64, dtype: &str) -> Result<Vec<ProfileRecord>> {
        let rows: Vec<ProfileRecord> = sqlx::query_as(concat!(
            "SELECT ",
            columns!(),
            " FROM layer_profiles WHERE model_hash = $1 AND seq_len = $2 AND dtype = $3 ORDER BY measured_at_ms DESC, id DESC"
        ))
        .bind(model_hash)
        .bind(seq_len)
        .bind(dtype)
        .fetch_all(&self.pool)
        .await?;
        let mut seen = std::collections::HashSet::new();
        Ok(rows.into_iter().filter(|r| seen.insert((r.profile.gpu.to_ascii_lowercase(), r.profile.tp, r.profile.micro_batch))).collect())
    }

    /// How many profiles are stored (metrics).
    pub async fn profile_count(&self) -> Result<i64> {
        Ok(sqlx::query("SELECT COUNT(*) FROM layer_profiles").fetch_one(&self.pool).await?.try_get::<i64, _>(0)?)
    }
}

/// Where a profile run stands.
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case", tag = "state")]
pub enum RunState {
    Running,
    Stored { profile: i64 },
    Failed { reason: String },
}

/// One profile run sent to an agent (`profile_runs`, migration 0008): durable, so a new leader
/// knows the runs out, takes their reports, and remembers the failures.
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
pub struct ProfileRun {
    pub request: i64,
    pub gpu: String,
    pub model: String,
    pub model_hash: String,
    pub tp: u32,
    pub micro_batch: u32,
    pub seq_len: u64,
    pub dtype: String,
    pub node: String,
    pub gpus: Vec<u32>,
    #[serde(flatten)]
    pub state: RunState,
    /// Seconds since it was sent.
    pub age_s: f64,
    #[serde(skip)]
    #[schema(ignore)]
    pub started_ms: i64,
    #[serde(skip)]
    #[schema(ignore)]
    pub ended_ms: Option<i64>,
}

/// What a profile run measures: (GPU type, in any case; model hash, tp, micro-batch, sequence
/// length, data type).
pub struct RunKey<'a> {
    pub gpu: &'a str,
    pub model_hash: &'a str,
    pub tp: u32,
    pub micro_batch: u32,
    pub seq_len: u64,
    pub dtype: &'a str,
}

macro_rules! run_columns {
    () => {
        "request, gpu, model, model_hash, tp, micro_batch, seq_len, dtype, node, gpus, state, profile, reason, started_ms, ended_ms"
    };
}

fn run_of(row: &sqlx::any::AnyRow) -> Result<ProfileRun> {
    let state: String = row.try_get("state")?;
    let state = match state.as_str() {
        "running" => RunState::Running,
        "stored" => RunState::Stored { profile: row.try_get::<Option<i64>, _>("profile")?.unwrap_or(0) },
        _ => RunState::Failed { reason: row.try_get::<Option<String>, _>("reason")?.unwrap_or_default() },
    };
    let started_ms: i64 = row.try_get("started_ms")?;
    let gpus: String = row.try_get("gpus")?;
    Ok(ProfileRun {
        request: row.try_get("request")?,
        gpu: row.try_get("gpu")?,
        model: row.try_get("model")?,
        model_hash: row.try_get("model_hash")?,
        tp: row.try_get::<i64, _>("tp")? as u32,
        micro_batch: row.try_get::<i64, _>("micro_batch")? as u32,
        seq_len: row.try_get::<i64, _>("seq_len")? as u64,
        dtype: row.try_get("dtype")?,
        node: row.try_get("node")?,
        gpus: serde_json::from_str(&gpus).unwrap_or_default(),
        state,
        age_s: ((now_ms() - started_ms).max(0) as f64) / 1000.0,
        started_ms,
        ended_ms: row.try_get("ended_ms")?,
    })
}

impl Store {
    /// Record a run about to be sent: its request number (the agent's report names it).
    pub async fn start_profile_run(&self, key: &RunKey<'_>, model: &str, node: &str, gpus: &[u32]) -> Result<ProfileRun> {
        let mut tx = self.pool.begin().await?;
        self.check_term(&mut tx).await?;
        let request = Self::next(&mut tx, "profile_run").await?;
        sqlx::query(concat!(
            "INSERT INTO profile_runs (",
            run_columns!(),
            ") VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, 'running', NULL, NULL, $11, NULL)"
        ))
        .bind(request)
        .bind(key.gpu)
        .bind(model)
        .bind(key.model_hash)
        .bind(i64::from(key.tp))
        .bind(i64::from(key.micro_batch))
        .bind(key.seq_len as i64)
        .bind(key.dtype)
        .bind(node)
        .bind(serde_json::to_string(gpus).expect("a list of integers serialises"))
        .bind(now_ms())
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        self.profile_run(request).await?.ok_or_else(|| CoordinatorError::Conflict(format!("profile run {request} vanished")))
    }

    /// End a running run (stored, or failed with the reason); an ended one stays as it was.
    /// The run as it is now (None: unknown, e.g. forgotten).
    pub async fn finish_profile_run(&self, request: i64, state: &RunState) -> Result<Option<ProfileRun>> {
        let (name, profile, reason) = match state {
            RunState::Running => return self.profile_run(request).await,
            RunState::Stored { profile } => ("stored", Some(*profile), None),
            RunState::Failed { reason } => ("failed", None, Some(reason.as_str())),
        };
        sqlx::query(
            "UPDATE profile_runs SET state = $2, profile = $3, reason = $4, ended_ms = $5 WHERE request = $1 AND state = 'running'",
        )
        .bind(request)
        .bind(name)
        .bind(profile)
        .bind(reason)
        .bind(now_ms())
        .execute(&self.pool)
        .await?;
        self.profile_run(request).await
    }

    pub async fn profile_run(&self, request: i64) -> Result<Option<ProfileRun>> {
        let row = sqlx::query(concat!("SELECT ", run_columns!(), " FROM profile_runs WHERE request = $1"))
            .bind(request)
            .fetch_optional(&self.pool)
            .await?;
        row.as_ref().map(run_of).transpose()
    }

    /// Every run kept, newest first.
    pub async fn profile_runs(&self) -> Result<Vec<ProfileRun>> {
        let rows =
            sqlx::query(concat!("SELECT ", run_columns!(), " FROM profile_runs ORDER BY request DESC")).fetch_all(&self.pool).await?;
        rows.iter().map(run_of).collect()
    }

    /// The newest run of a key (GPU type names match in any case).
    pub async fn latest_profile_run(&self, key: &RunKey<'_>) -> Result<Option<ProfileRun>> {
        let row = sqlx::query(concat!(
            "SELECT ",
            run_columns!(),
            " FROM profile_runs WHERE LOWER(gpu) = LOWER($1) AND model_hash = $2 AND tp = $3 AND micro_batch = $4 \
             AND seq_len = $5 AND dtype = $6 ORDER BY request DESC LIMIT 1"
        ))
        .bind(key.gpu)
        .bind(key.model_hash)
        .bind(i64::from(key.tp))
        .bind(i64::from(key.micro_batch))
        .bind(key.seq_len as i64)
        .bind(key.dtype)
        .fetch_optional(&self.pool)
        .await?;
        row.as_ref().map(run_of).transpose()
    }

    /// The runs going on now (their GPUs take no job meanwhile; their nodes take no other run).
    pub async fn running_profile_runs(&self) -> Result<Vec<ProfileRun>> {
        let rows =
            sqlx::query(concat!("SELECT ", run_columns!(), " FROM profile_runs WHERE state = 'running'")).fetch_all(&self.pool).await?;
        rows.iter().map(run_of).collect()
    }

    /// Runs out longer than `limit_ms` fail; ended runs older than `limit_ms` are deleted (a
    /// failed key is tried again after that).
    pub async fn expire_profile_runs(&self, limit_ms: i64) -> Result<()> {
        let now = now_ms();
        let late = sqlx::query("SELECT request, node FROM profile_runs WHERE state = 'running' AND started_ms < $1")
            .bind(now - limit_ms)
            .fetch_all(&self.pool)
            .await?;
        for row in late {
            let (request, node): (i64, String) = (row.try_get("request")?, row.try_get("node")?);
            let reason = format!("no result from node {node} within {} s", limit_ms / 1000);
            self.finish_profile_run(request, &RunState::Failed { reason }).await?;
        }
        sqlx::query("DELETE FROM profile_runs WHERE state <> 'running' AND ended_ms < $1").bind(now - limit_ms).execute(&self.pool).await?;
        Ok(())
    }
}
