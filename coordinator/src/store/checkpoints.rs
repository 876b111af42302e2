//! The checkpoint-location bitmap (`ckpt_locations`, migrations 0006 and 0009): which checkpoint
//! file of which step, written by which generation, each node holds, in which tier. An agent
//! reports its whole list; it replaces the node's rows in one transaction, fenced by the
//! agent's epoch in SQL. A step saved by two generations (one lost a node mid-save, the next
//! saved it again) is two copies kept apart: a restore takes the files of one generation only.

use serde::Serialize;

use super::{now_ms, Store};
use crate::error::{CoordinatorError, Result};

/// One file one node holds.
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
pub struct Holding {
    pub job_id: i64,
    pub generation: i64,
    pub step: i64,
    pub file: String,
    pub node: String,
    pub tier: String,
    pub bytes: i64,
    /// embed | layer.N | head; empty for a rank file.
    pub block: String,
    /// model | optimizer; empty for a rank file.
    pub part: String,
    pub tp_rank: i64,
    pub tp_size: i64,
    /// A rank file's rank; -1 for a unit.
    pub rank: i64,
    pub layers: i64,
    pub world_size: i64,
    /// The chunk size and the CRC-32C of each chunk (a JSON list), as the writer's manifest
    /// piece lists them: what a restore verifies a copy against (0 and `[]`: not reported).
    pub chunk_bytes: i64,
    pub crc32c: String,
}

impl_from_row!(Holding {
    job_id,
    generation,
    step,
    file,
    node,
    tier,
    bytes,
    block,
    part,
    tp_rank,
    tp_size,
    rank,
    layers,
    world_size,
    chunk_bytes,
    crc32c
});

impl Holding {
    /// The file as the checkpoint format's manifest lists it (its crcs, when reported).
    pub fn file_entry(&self) -> motley_checkpoint::FileEntry {
        motley_checkpoint::FileEntry {
            file: self.file.clone(),
            bytes: self.bytes as u64,
            chunk_bytes: self.chunk_bytes as u64,
            crc32c: serde_json::from_str(&self.crc32c).unwrap_or_default(),
        }
    }

    /// Whether the holder reported a CRC-32C for every chunk of the file: a copy without them
    /// cannot be verified, so it is never restored from (docs/recovery.md, step 6).
    pub fn has_crcs(&self) -> bool {
        let e = self.file_entry();
        e.chunk_bytes > 0 && e.crc32c.len() as u64 == e.bytes.div_ceil(e.chunk_bytes)
    }
}

macro_rules! columns {
    () => {
        "job_id, generation, step, file, node, tier, bytes, block, part, tp_rank, tp_size, rank, layers, world_size, chunk_bytes, crc32c"
    };
}

impl Store {
    /// Replace everything `node` holds with `holdings` (their `node` is ignored), if `epoch` is
    /// still the node's agent epoch; a stale session's report is refused and changes nothing.
    pub async fn replace_holdings(&self, node: &str, epoch: i64, holdings: &[Holding]) -> Result<()> {
        let mut tx = self.pool.begin().await?;
        // Locks the node's row (PostgreSQL) so a registration in between waits for this.
        let current = sqlx::query("UPDATE nodes SET agent_epoch = agent_epoch WHERE name = $1 AND agent_epoch = $2")
            .bind(node)
            .bind(epoch)
            .execute(&mut *tx)
            .await?;
        if current.rows_affected() != 1 {
            let now: Option<i64> =
                sqlx::query_scalar("SELECT agent_epoch FROM nodes WHERE name = $1").bind(node).fetch_optional(&mut *tx).await?;
            return Err(CoordinatorError::StaleAgent { node: node.into(), given: epoch, current: now.unwrap_or(0) });
        }
        sqlx::query("DELETE FROM ckpt_locations WHERE node = $1").bind(node).execute(&mut *tx).await?;
        let at = now_ms();
        for h in holdings {
            sqlx::query(concat!(
                "INSERT INTO ckpt_locations (",
                columns!(),
                ", agent_epoch, reported_at_ms) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17, $18) \
                 ON CONFLICT (job_id, generation, step, file, node, tier) DO NOTHING"
            ))
            .bind(h.job_id)
            .bind(h.generation)
            .bind(h.step)
            .bind(&h.file)
            .bind(node)
            .bind(&h.tier)
            .bind(h.bytes)
            .bind(&h.block)
            .bind(&h.part)
            .bind(h.tp_rank)
            .bind(h.tp_size)
            .bind(h.rank)
            .bind(h.layers)
            .bind(h.world_size)
            .bind(h.chunk_bytes)
            .bind(&h.crc32c)
            .bind(epoch)
            .bind(at)
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await?;
        Ok(())
    }

    /// Every file held of a job's checkpoints, by step, generation, file and node.
    pub async fn holdings(&self, job: i64) -> Result<Vec<Holding>> {
        Ok(sqlx::query_as(concat!(
            "SELECT ",
            columns!(),
            " FROM ckpt_locations WHERE job_id = $1 ORDER BY step, generation, file, node, tier"
        ))
        .bind(job)
        .fetch_all(&self.pool)
        .await?)
    }
}
