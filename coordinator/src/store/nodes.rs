//! Nodes: registration (each agent session's epoch, which fences the older ones), removal,
//! draining, and the reads.

use serde::{Deserialize, Serialize};
use sqlx::any::AnyRow;
use sqlx::Row;

use super::{now_ms, NodeState, Store};
use crate::error::{CoordinatorError, Result};

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

impl Store {
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
             (r.state = 'running' OR (j.state IN ('submitted', 'planning', 'launching', 'running', 'degraded', 'recovering') AND r.generation = j.generation)) \
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
