//! `/api/v1/profiles...`: measured layer profiles, and profile runs on agents.

use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::Json;
use serde::Deserialize;

use super::{ApiResult, AppState};
use crate::planning::profiling::{ProfileRun, RunRequest};
use crate::store::ProfileRecord;

#[derive(Deserialize, utoipa::IntoParams)]
pub struct ListQuery {
    /// Only the profiles of this model hash.
    model_hash: Option<String>,
}

#[utoipa::path(get, path = "/api/v1/profiles", tag = "profiles", params(ListQuery), responses((status = 200, body = [ProfileRecord])))]
pub async fn list(State(s): State<AppState>, Query(q): Query<ListQuery>) -> ApiResult<Vec<ProfileRecord>> {
    Ok(Json(s.ops().profiles(q.model_hash.as_deref()).await?))
}

#[utoipa::path(get, path = "/api/v1/profiles/{id}", tag = "profiles",
    responses((status = 200, body = ProfileRecord), (status = 404, body = super::ErrorBody)))]
pub async fn get(State(s): State<AppState>, Path(id): Path<i64>) -> ApiResult<ProfileRecord> {
    Ok(Json(s.ops().profile(id).await?))
}

/// Measure one profile now on a live agent that can profile; answers the run (202), whose
/// state `GET /api/v1/profiles/runs/{request}` follows.
/// The body is JSON (or YAML) of any content type, as job files are.
#[utoipa::path(post, path = "/api/v1/profiles/runs", tag = "profiles", request_body = RunRequest,
    responses((status = 202, body = ProfileRun), (status = 400, body = super::ErrorBody), (status = 409, body = super::ErrorBody)))]
pub async fn run(State(s): State<AppState>, body: axum::body::Bytes) -> Result<(StatusCode, Json<ProfileRun>), crate::CoordinatorError> {
    let text = super::text(&body, "must be UTF-8 JSON or YAML")?;
    Ok((StatusCode::ACCEPTED, Json(s.ops().run_profile(text).await?)))
}

/// The runs sent to agents (durable: a new leader knows them; ended ones are kept for a
/// while), newest first.
#[utoipa::path(get, path = "/api/v1/profiles/runs", tag = "profiles", responses((status = 200, body = [ProfileRun])))]
pub async fn runs(State(s): State<AppState>) -> ApiResult<Vec<ProfileRun>> {
    Ok(Json(s.ops().profile_runs().await?))
}

#[utoipa::path(get, path = "/api/v1/profiles/runs/{request}", tag = "profiles",
    responses((status = 200, body = ProfileRun), (status = 404, body = super::ErrorBody)))]
pub async fn run_state(State(s): State<AppState>, Path(request): Path<i64>) -> ApiResult<ProfileRun> {
    Ok(Json(s.ops().profile_run(request).await?))
}
