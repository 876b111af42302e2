//! `/api/v1/nodes...`: the inventory.

use axum::extract::rejection::QueryRejection;
use axum::extract::{Path, Query, State};
use axum::Json;
use serde::Deserialize;

use super::{ApiResult, AppState};
use crate::api::{Declared, Node};

use motley_contract::views::NodeView;

#[utoipa::path(get, path = "/api/v1/nodes", tag = "nodes", responses((status = 200, body = [NodeView])))]
pub async fn list(State(s): State<AppState>) -> ApiResult<Vec<Node>> {
    Ok(Json(s.ops().nodes().await?))
}

#[utoipa::path(get, path = "/api/v1/nodes/{name}", tag = "nodes",
    responses((status = 200, body = NodeView), (status = 404, body = super::ErrorBody)))]
pub async fn get(State(s): State<AppState>, Path(name): Path<String>) -> ApiResult<Node> {
    Ok(Json(s.ops().node(&name).await?))
}

/// The body is the node's cluster-file entry (YAML or JSON), as an agent's `--inventory`.
#[utoipa::path(put, path = "/api/v1/nodes/{name}", tag = "nodes", request_body(content = String, content_type = "application/yaml"),
    responses((status = 200, body = Declared), (status = 400, body = super::ErrorBody)))]
pub async fn declare(State(s): State<AppState>, Path(name): Path<String>, body: axum::body::Bytes) -> ApiResult<Declared> {
    let body = super::text(&body, "the node entry must be UTF-8 text (YAML or JSON)")?;
    Ok(Json(s.ops().declare_node(name, body).await?))
}

/// Remove a node that has no ranks and no live agent; answers the node as it was.
#[utoipa::path(delete, path = "/api/v1/nodes/{name}", tag = "nodes",
    responses((status = 200, body = NodeView), (status = 404, body = super::ErrorBody), (status = 409, body = super::ErrorBody)))]
pub async fn remove(State(s): State<AppState>, Path(name): Path<String>) -> ApiResult<Node> {
    Ok(Json(s.ops().remove_node(&name).await?))
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
) -> ApiResult<Node> {
    let deadline_s = query.map_err(super::jobs::bad_query)?.deadline_s;
    Ok(Json(s.ops().drain_node(&name, deadline_s).await?))
}

#[utoipa::path(post, path = "/api/v1/nodes/{name}/undrain", tag = "nodes",
    responses((status = 200, body = NodeView), (status = 404, body = super::ErrorBody)))]
pub async fn undrain(State(s): State<AppState>, Path(name): Path<String>) -> ApiResult<Node> {
    Ok(Json(s.ops().undrain_node(&name).await?))
}
