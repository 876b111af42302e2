//! The event log: what happened to nodes and jobs, in order (`seq`). Changes record their
//! events inside their own transactions (`Store::event`); these are the reads, and the record
//! of an event that is part of no other change.

use serde::{Deserialize, Serialize};

use super::Store;
use crate::error::Result;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Event {
    pub seq: i64,
    pub job_id: Option<i64>,
    pub generation: Option<i64>,
    pub kind: String,
    pub message: String,
    pub at_ms: i64,
}

impl_from_row!(Event { seq, job_id, generation, kind, message, at_ms });

impl Store {
    /// Record an event that is not part of another change (a lost lease, say).
    pub async fn record_event(&self, job: Option<i64>, generation: Option<i64>, kind: &str, message: &str) -> Result<i64> {
        let mut tx = self.pool.begin().await?;
        let seq = Self::event(&mut tx, job, generation, kind, message).await?;
        tx.commit().await?;
        Ok(seq)
    }

    /// The newest event of `kind` of launch (job, generation), if there is one.
    pub async fn last_event(&self, job: i64, generation: i64, kind: &str) -> Result<Option<Event>> {
        Ok(sqlx::query_as::<_, Event>(
            "SELECT seq, job_id, generation, kind, message, at_ms FROM events WHERE job_id = $1 AND generation = $2 \
             AND kind = $3 ORDER BY seq DESC LIMIT 1",
        )
        .bind(job)
        .bind(generation)
        .bind(kind)
        .fetch_optional(&self.pool)
        .await?)
    }

    /// Every event of `kind` of launch (job, generation), oldest first, at most `limit`.
    pub async fn launch_events(&self, job: i64, generation: i64, kind: &str, limit: i64) -> Result<Vec<Event>> {
        Ok(sqlx::query_as::<_, Event>(
            "SELECT seq, job_id, generation, kind, message, at_ms FROM events WHERE job_id = $1 AND generation = $2 \
             AND kind = $3 ORDER BY seq LIMIT $4",
        )
        .bind(job)
        .bind(generation)
        .bind(kind)
        .bind(limit)
        .fetch_all(&self.pool)
        .await?)
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
