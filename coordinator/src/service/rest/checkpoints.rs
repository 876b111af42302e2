//! `/api/v1/jobs/{id}/checkpoints...`: the checkpoint-location bitmap of a job.

use axum::extract::{Path, Query, State};
use axum::Json;
use serde::Deserialize;

use super::{ApiResult, AppState};
use crate::views::checkpoints::{StepGrid, StepView};

/// The job's checkpoint steps some node holds, newest first, each complete or not.
#[utoipa::path(get, path = "/api/v1/jobs/{id}/checkpoints", tag = "checkpoints",
    responses((status = 200, body = [StepView]), (status = 404, body = super::ErrorBody)))]
pub async fn list(State(s): State<AppState>, Path(id): Path<i64>) -> ApiResult<Vec<StepView>> {
    Ok(Json(s.ops().checkpoints(id).await?))
}

#[derive(Deserialize, utoipa::IntoParams)]
pub struct GridQuery {
    /// The step (default: the newest complete one, else the newest).
    step: Option<i64>,
}

/// One step: a row per file, the tier each node holds it in.
#[utoipa::path(get, path = "/api/v1/jobs/{id}/checkpoints/grid", tag = "checkpoints", params(GridQuery),
    responses((status = 200, body = StepGrid), (status = 404, body = super::ErrorBody)))]
pub async fn grid(State(s): State<AppState>, Path(id): Path<i64>, Query(q): Query<GridQuery>) -> ApiResult<StepGrid> {
    Ok(Json(s.ops().checkpoint_grid(id, q.step).await?))
}
