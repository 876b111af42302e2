//! Measured layer profiles (`layer_profiles`, migration 0005): one row per (GPU type, model
//! hash, tp, micro-batch, sequence length, data type, torch version); a newer measurement of
//! the same key replaces the row. Written by the leader when an agent reports a profile run.

use serde::Serialize;
use sqlx::Row;

use super::{now_ms, Store};
use crate::error::{CoordinatorError, Result};

/// A stored profile: the measurement, and its id and time.
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema, sqlx::FromRow)]
pub struct ProfileRecord {
    pub id: i64,
    #[serde(flatten)]
    #[sqlx(flatten)]
    pub profile: NewProfile,
    pub measured_at_ms: i64,
}

/// A measured profile: its key, where it was measured, and the profiles file entry.
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema, sqlx::FromRow)]
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
