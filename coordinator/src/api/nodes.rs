//! The inventory: list, describe, declare, remove, drain, undrain.

use serde::Serialize;

use super::Operations;
use crate::api::control;
use crate::error::Result;
use crate::store::NodeRecord;

pub use motley_contract::views::NodeView;

/// A node as both doors show it: the view (its JSON, what `motley node list` reads) and the
/// cluster-file entry as stored, which gRPC carries as text.
#[derive(Debug, Clone, Serialize)]
#[serde(transparent)]
pub struct Node {
    pub view: NodeView,
    #[serde(skip)]
    pub inventory_json: String,
}

/// A declared node's new agent epoch.
#[derive(Serialize, utoipa::ToSchema)]
pub struct Declared {
    pub name: String,
    pub agent_epoch: i64,
}

impl Operations<'_> {
    /// A stored node with its liveness and its agent's last load (docs/state.md: live only in
    /// the fleet's memory).
    fn node_view(&self, n: NodeRecord) -> Node {
        let inventory: serde_json::Value = serde_json::from_str(&n.inventory).unwrap_or(serde_json::Value::Null);
        let view = NodeView {
            live: self.fleet.live(&n.name),
            load: self.fleet.load(&n.name),
            emulated: !inventory["emulate"].is_null(),
            inventory,
            name: n.name,
            state: n.state,
            agent_epoch: n.agent_epoch,
            registered_at_ms: n.registered_at_ms,
        };
        Node { view, inventory_json: n.inventory }
    }

    pub async fn nodes(&self) -> Result<Vec<Node>> {
        Ok(self.store.nodes().await?.into_iter().map(|n| self.node_view(n)).collect())
    }

    pub async fn node(&self, name: &str) -> Result<Node> {
        Ok(self.node_view(self.store.node(name).await?))
    }

    /// Declare (or update) a node from its cluster-file entry (`control::declare_node`).
    pub async fn declare_node(&self, name: String, entry: &str) -> Result<Declared> {
        let agent_epoch = control::declare_node(self.store, &name, entry).await?;
        Ok(Declared { name, agent_epoch })
    }

    /// Remove a node with no ranks and no live agent; the node as it was.
    pub async fn remove_node(&self, name: &str) -> Result<Node> {
        Ok(self.node_view(control::remove_node(self.store, self.fleet, name).await?))
    }

    /// Drain a node; `deadline_s` > 0 is a preemption notice (docs/recovery.md).
    pub async fn drain_node(&self, name: &str, deadline_s: u32) -> Result<Node> {
        let deadline = control::drain_deadline(deadline_s)?;
        Ok(self.node_view(control::set_draining(self.life, name, true, deadline).await?))
    }

    pub async fn undrain_node(&self, name: &str) -> Result<Node> {
        Ok(self.node_view(control::set_draining(self.life, name, false, None).await?))
    }
}
