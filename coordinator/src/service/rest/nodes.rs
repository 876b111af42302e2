//! `/api/v1/nodes...`: the inventory.

use axum::extract::rejection::QueryRejection;
use axum::extract::{Path, Query, State};
use axum::Json;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::{ApiResult, AppState};
use crate::control;
use crate::store::NodeRecord;

pub use motley_contract::views::NodeView;

/// A declared node's new agent epoch.
#[derive(Serialize, utoipa::ToSchema)]
pub struct Declared {
    pub name: String,
    pub agent_epoch: i64,
}

fn view(n: NodeRecord, s: &AppState) -> NodeView {
    NodeView {
        live: s.fleet.live(&n.name),
        load: s.fleet.load(&n.name),
        inventory: serde_json::from_str(&n.inventory).unwrap_or(Value::Null),
        name: n.name,
        state: n.state,
        agent_epoch: n.agent_epoch,
        registered_at_ms: n.registered_at_ms,
    }
}

#[utoipa::path(get, path = "/api/v1/nodes", tag = "nodes", responses((status = 200, body = [NodeView])))]
pub async fn list(State(s): State<AppState>) -> ApiResult<Vec<NodeView>> {
    Ok(Json(s.store.nodes().await?.into_iter().map(|n| view(n, &s)).collect()))
}

#[utoipa::path(get, path = "/api/v1/nodes/{name}", tag = "nodes",
    responses((status = 200, body = NodeView), (status = 404, body = super::ErrorBody)))]
pub async fn get(State(s): State<AppState>, Path(name): Path<String>) -> ApiResult<NodeView> {
    Ok(Json(view(s.store.node(&name).await?, &s)))
}

/// The body is the node's cluster-file entry (YAML or JSON), as an agent's `--inventory`.
#[utoipa::path(put, path = "/api/v1/nodes/{name}", tag = "nodes", request_body(content = String, content_type = "application/yaml"),
    responses((status = 200, body = Declared), (status = 400, body = super::ErrorBody)))]
pub async fn declare(State(s): State<AppState>, Path(name): Path<String>, body: axum::body::Bytes) -> ApiResult<Declared> {
    let body = std::str::from_utf8(&body)
        .map_err(|_| crate::CoordinatorError::invalid("body", "the node entry must be UTF-8 text (YAML or JSON)"))?;
    let agent_epoch = control::declare_node(&s.store, &name, body).await?;
    Ok(Json(Declared { name, agent_epoch }))
}

/// Remove a node that has no ranks and no live agent; answers the node as it was.
#[utoipa::path(delete, path = "/api/v1/nodes/{name}", tag = "nodes",
    responses((status = 200, body = NodeView), (status = 404, body = super::ErrorBody), (status = 409, body = super::ErrorBody)))]
pub async fn remove(State(s): State<AppState>, Path(name): Path<String>) -> ApiResult<NodeView> {
    Ok(Json(view(control::remove_node(&s.store, &s.fleet, &name).await?, &s)))
}

/// `?deadline_s=SECONDS`
#[derive(Deserialize)]
pub struct DrainQuery {
    #[serde(default)]
    deadline_s: u32,
}

/// Drain a node. With `?deadline_s=S` it is a preemption notice: the node goes away in S
/// seconds, so the jobs there save a checkpoint first and recover off the node from it
/// (docs/recovery.md).
#[utoipa::path(post, path = "/api/v1/nodes/{name}/drain", tag = "nodes",
    params(("deadline_s" = Option<u32>, Query, description = "seconds until the node goes away (a preemption notice); 0 or absent: none")),
    responses((status = 200, body = NodeView), (status = 400, body = super::ErrorBody), (status = 404, body = super::ErrorBody)))]
pub async fn drain(
    State(s): State<AppState>,
    Path(name): Path<String>,
    query: Result<Query<DrainQuery>, QueryRejection>,
) -> ApiResult<NodeView> {
    let deadline = control::drain_deadline(query.map_err(super::jobs::bad_query)?.deadline_s)?;
    Ok(Json(view(control::set_draining(&s.life, &name, true, deadline).await?, &s)))
}

#[utoipa::path(post, path = "/api/v1/nodes/{name}/undrain", tag = "nodes",
    responses((status = 200, body = NodeView), (status = 404, body = super::ErrorBody)))]
pub async fn undrain(State(s): State<AppState>, Path(name): Path<String>) -> ApiResult<NodeView> {
    Ok(Json(view(control::set_draining(&s.life, &name, false, None).await?, &s)))
}
