//! `/api/v1/jobs...` and `/api/v1/plan`: jobs, their events, plans, rank logs and training curves.

use axum::body::Bytes;
use axum::extract::rejection::QueryRejection;
use axum::extract::{Path, Query, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;

use super::{ApiResult, AppState};
use crate::api::{DryRunView, Job, PlanView};
use crate::error::CoordinatorError;
use crate::store::Event;
use crate::views::rank_logs::{self, LogRead};

pub use motley_contract::curves::Curves;
use motley_contract::views::JobView;

fn parse_id(what: &str, id: &str) -> Result<i64, CoordinatorError> {
    id.parse().map_err(|_| CoordinatorError::invalid(what, format!("'{id}' is not a number")))
}

/// `?after=SEQ`
#[derive(Deserialize)]
pub struct EventsQuery {
    #[serde(default)]
    after: i64,
}

/// `?offset=BYTE&generation=G`, or `?tail=BYTES&generation=G`
#[derive(Deserialize)]
pub struct LogsQuery {
    #[serde(default)]
    offset: u64,
    /// The log's last BYTES at most, from the start of a line (instead of `offset`).
    tail: Option<u64>,
    generation: Option<i64>,
}

/// The response header that says where the next read of a log starts (`?offset=`).
pub const LOG_NEXT_HEADER: &str = "x-motley-log-next";

/// A query string that does not read names the parameter (serde's message does).
pub(super) fn bad_query(r: QueryRejection) -> CoordinatorError {
    let text = r.body_text();
    CoordinatorError::invalid("query", text.trim_start_matches("Failed to deserialize query string: "))
}

#[utoipa::path(get, path = "/api/v1/jobs", tag = "jobs", responses((status = 200, body = [JobView])))]
pub async fn list(State(s): State<AppState>) -> ApiResult<Vec<Job>> {
    Ok(Json(s.ops().jobs().await?))
}

/// The body is the job file (YAML or JSON). Planning starts in the background; watch the
/// job's events for its progress.
#[utoipa::path(post, path = "/api/v1/jobs", tag = "jobs", request_body(content = String, content_type = "application/yaml"),
    responses((status = 201, body = JobView), (status = 400, body = super::ErrorBody)))]
pub async fn submit(State(s): State<AppState>, body: Bytes) -> Result<(StatusCode, Json<Job>), CoordinatorError> {
    let text = super::text(&body, "the job file must be UTF-8 text")?;
    Ok((StatusCode::CREATED, Json(s.ops().submit(text).await?)))
}

#[utoipa::path(get, path = "/api/v1/jobs/{id}", tag = "jobs",
    responses((status = 200, body = JobView), (status = 404, body = super::ErrorBody)))]
pub async fn get(State(s): State<AppState>, Path(id): Path<String>) -> ApiResult<Job> {
    Ok(Json(s.ops().job(parse_id("id", &id)?).await?))
}

#[utoipa::path(post, path = "/api/v1/jobs/{id}/cancel", tag = "jobs",
    responses((status = 200, body = JobView), (status = 409, body = super::ErrorBody)))]
pub async fn cancel(State(s): State<AppState>, Path(id): Path<String>) -> ApiResult<Job> {
    Ok(Json(s.ops().cancel(parse_id("id", &id)?).await?))
}

/// The job's events after `?after=SEQ` (default 0), oldest first, at most 1000.
#[utoipa::path(get, path = "/api/v1/jobs/{id}/events", tag = "jobs", params(("after" = Option<i64>, Query, description = "events after this sequence number")),
    responses((status = 200, body = [Event]), (status = 404, body = super::ErrorBody)))]
pub async fn events(
    State(s): State<AppState>,
    Path(id): Path<String>,
    query: Result<Query<EventsQuery>, QueryRejection>,
) -> ApiResult<Vec<Event>> {
    let id = parse_id("id", &id)?;
    let after = query.map_err(bad_query)?.after;
    Ok(Json(s.ops().events(id, after).await?))
}

#[utoipa::path(get, path = "/api/v1/jobs/{id}/plan", tag = "jobs",
    responses((status = 200, body = PlanView), (status = 404, body = super::ErrorBody)))]
pub async fn plan(State(s): State<AppState>, Path(id): Path<String>) -> ApiResult<PlanView> {
    Ok(Json(s.ops().plan(parse_id("id", &id)?).await?))
}

/// The current plan drawn (SVG, `motley_draw::svg`): a row per replica with its stages
/// coloured by GPU type, the hops and their transport, and a 1F1B timeline of one iteration.
#[utoipa::path(get, path = "/api/v1/jobs/{id}/plan.svg", tag = "jobs",
    responses((status = 200, body = String, content_type = "image/svg+xml"), (status = 404, body = super::ErrorBody)))]
pub async fn plan_svg(State(s): State<AppState>, Path(id): Path<String>) -> Result<Response, CoordinatorError> {
    let plan = s.ops().plan(parse_id("id", &id)?).await?;
    let svg = motley_draw::svg::plan_svg_json(&plan.plan_json)
        .map_err(|e| CoordinatorError::Conflict(format!("job {}'s stored plan does not read as a plan document: {e}", plan.job)))?;
    Ok(svg_response(svg))
}

/// Plan a job file (the body) on the live inventory; nothing is stored or launched.
#[utoipa::path(post, path = "/api/v1/plan", tag = "plan", request_body(content = String, content_type = "application/yaml"),
    responses((status = 200, body = DryRunView), (status = 400, body = super::ErrorBody), (status = 409, body = super::ErrorBody)))]
pub async fn dry_run(State(s): State<AppState>, body: Bytes) -> ApiResult<DryRunView> {
    let text = super::text(&body, "the job file must be UTF-8 text")?;
    Ok(Json(s.ops().dry_run(text).await?))
}

/// A rank's output from byte `?offset=N` (default 0), or its last `?tail=N` bytes at most
/// (from the start of a line; at most 4 MiB), fetched from its node's agent; `?generation=G`
/// picks an older launch (default: the current one). The header `x-motley-log-next` says the
/// offset to read on from.
#[utoipa::path(get, path = "/api/v1/jobs/{id}/ranks/{rank}/logs", tag = "jobs",
    params(("offset" = Option<i64>, Query, description = "first byte"),
        ("tail" = Option<i64>, Query, description = "the last bytes at most, from a line's start (instead of offset)"),
        ("generation" = Option<i64>, Query, description = "launch (default: current)")),
    responses((status = 200, body = String, content_type = "text/plain"), (status = 404, body = super::ErrorBody), (status = 503, body = super::ErrorBody)))]
pub async fn logs(
    State(s): State<AppState>,
    Path((id, rank)): Path<(String, String)>,
    query: Result<Query<LogsQuery>, QueryRejection>,
) -> Result<Response, CoordinatorError> {
    let (id, rank) = (parse_id("id", &id)?, parse_id("rank", &rank)?);
    let Query(q) = query.map_err(bad_query)?;
    if q.tail.is_some() && q.offset > 0 {
        return Err(CoordinatorError::invalid("query: tail", "give tail or offset, not both"));
    }
    let job = s.store.job(id).await?;
    let (generation, offset) = (q.generation.unwrap_or(job.generation), q.offset);
    let log = rank_logs::locate(&s.store, &s.fleet, &access(&s), id, generation, rank).await?;
    let (bytes, next) = tokio::task::spawn_blocking(move || match q.tail {
        Some(tail) => log.tail(tail.min(rank_logs::LOG_CHUNK)).map(|(bytes, skipped)| {
            let next = skipped + bytes.len() as u64;
            (bytes, next)
        }),
        None => log.chunk(offset).map(|(bytes, _)| {
            let next = offset + bytes.len() as u64;
            (bytes, next)
        }),
    })
    .await
    .map_err(|e| CoordinatorError::Unavailable(format!("log fetch: {e}")))??;
    Ok(([(LOG_NEXT_HEADER, next.to_string())], bytes).into_response())
}

/// How the coordinator fetches from agents: the agents' token (the agent's log service must
/// never see the operators') and the roots their certificates are checked against.
fn access(s: &AppState) -> rank_logs::AgentAccess {
    rank_logs::AgentAccess { token: s.tokens.agent.clone(), roots: s.agent_roots.clone() }
}

/// The job's training curves as points: rank 0's JSON lines (`{"step", "loss", "tokens_per_s",
/// "step_s"}`, `{"step", "eval_loss"}`) of each generation, from the last 8 MiB of its log
/// (`skipped_bytes` counts what came before), the newest 32 generations.
#[utoipa::path(get, path = "/api/v1/jobs/{id}/curves", tag = "jobs",
    responses((status = 200, body = Curves), (status = 404, body = super::ErrorBody)))]
pub async fn curves(State(s): State<AppState>, Path(id): Path<String>) -> ApiResult<Curves> {
    let (_, curves) = rank_logs::curves(&s.store, &s.fleet, &access(&s), &s.curves, parse_id("id", &id)?).await?;
    Ok(Json(curves))
}

/// The job's training curves drawn (SVG, `motley_draw::curves`): loss with eval-loss
/// markers and tokens/s on one step axis, every generation, each later one's start marked.
/// The same points as `/curves`; "no steps yet" before rank 0 prints any.
#[utoipa::path(get, path = "/api/v1/jobs/{id}/curves.svg", tag = "jobs",
    responses((status = 200, body = String, content_type = "image/svg+xml"), (status = 404, body = super::ErrorBody)))]
pub async fn curves_svg(State(s): State<AppState>, Path(id): Path<String>) -> Result<Response, CoordinatorError> {
    let (job, curves) = rank_logs::curves(&s.store, &s.fleet, &access(&s), &s.curves, parse_id("id", &id)?).await?;
    Ok(svg_response(motley_draw::curves::curves_svg(&curves, &format!("job {}: {}", job.id, job.name))))
}

/// A picture answer: not cached; opened on its own, it runs nothing and loads nothing.
fn svg_response(svg: String) -> Response {
    let headers = [
        (header::CONTENT_TYPE, "image/svg+xml; charset=utf-8"),
        (header::CACHE_CONTROL, "no-store"),
        (header::CONTENT_SECURITY_POLICY, "default-src 'none'; style-src 'unsafe-inline'"),
    ];
    (headers, svg).into_response()
}
