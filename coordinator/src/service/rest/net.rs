//! `/api/v1/net`: the live link matrix (docs/network.md).

use axum::extract::rejection::QueryRejection;
use axum::extract::{Query, State};
use axum::Json;
use serde::Deserialize;

use super::{ApiResult, AppState};
use crate::api::Network;
use motley_contract::net::NetworkView;

#[derive(Deserialize, utoipa::IntoParams)]
pub struct NetQuery {
    /// Only this node's links and NICs (a node of the inventory; absent: every node).
    node: Option<String>,
}

/// The links agents measured (estimate, history, the declared rate beside it), the NICs'
/// achieved rates, and the measured pairs in `motley replan --bandwidth`'s schema.
#[utoipa::path(get, path = "/api/v1/net", tag = "network", params(NetQuery),
    responses((status = 200, body = NetworkView), (status = 400, body = super::ErrorBody)))]
pub async fn show(State(s): State<AppState>, query: Result<Query<NetQuery>, QueryRejection>) -> ApiResult<Network> {
    let q = query.map_err(super::jobs::bad_query)?;
    Ok(Json(s.ops().network(q.node.as_deref()).await?))
}
