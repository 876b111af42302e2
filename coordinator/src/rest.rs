//! REST (axum) for the control operations under `/api/v1/...`, plus `/live` and `/ready`.
//! A thin edge: it translates requests and `CoordinatorError`s (one JSON body, the status
//! from `http_status`) and delegates to `control` and the store.

use axum::extract::{Path, Query, Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::{json, Value};

use crate::control;
use crate::error::CoordinatorError;
use crate::store::{NodeRecord, NodeState, Store};

#[derive(Clone)]
pub struct AppState {
    pub store: Store,
    pub fleet: std::sync::Arc<crate::agents::Fleet>,
    /// Bearer token the control API requires; None only with `--insecure`.
    pub token: Option<String>,
}

impl IntoResponse for CoordinatorError {
    fn into_response(self) -> Response {
        let status = StatusCode::from_u16(self.http_status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        (status, Json(json!({ "error": self.to_string(), "grpc_code": self.grpc_code() }))).into_response()
    }
}

type ApiResult = Result<Json<Value>, CoordinatorError>;

pub fn router(state: AppState) -> Router {
    let api = Router::new()
        .route("/nodes", get(list_nodes))
        .route("/nodes/{name}", get(get_node).put(declare_node))
        .route("/nodes/{name}/drain", post(drain))
        .route("/nodes/{name}/undrain", post(undrain))
        .route("/jobs", get(list_jobs).post(submit_job))
        .route("/jobs/{id}", get(get_job))
        .route("/jobs/{id}/cancel", post(cancel_job))
        .route("/jobs/{id}/events", get(job_events))
        .route("/jobs/{id}/plan", get(job_plan))
        .route_layer(middleware::from_fn_with_state(state.clone(), require_token));
    Router::new().route("/live", get(|| async { "ok" })).route("/ready", get(ready)).nest("/api/v1", api).with_state(state)
}

/// `Authorization: Bearer TOKEN` on every control call (never logged).
async fn require_token(State(s): State<AppState>, req: Request, next: Next) -> Response {
    if let Some(token) = &s.token {
        let given = req.headers().get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()).and_then(|v| v.strip_prefix("Bearer "));
        if given != Some(token.as_str()) {
            let body = json!({ "error": "missing or wrong bearer token; pass --token or set MOTLEY_TOKEN", "grpc_code": 16 });
            return (StatusCode::UNAUTHORIZED, Json(body)).into_response();
        }
    }
    next.run(req).await
}

async fn ready(State(s): State<AppState>) -> Response {
    match s.store.nodes().await {
        Ok(_) => (StatusCode::OK, "ready").into_response(),
        Err(e) => e.into_response(),
    }
}

fn node_json(n: &NodeRecord, fleet: &crate::agents::Fleet) -> Value {
    json!({
        "name": n.name,
        "state": n.state,
        "live": fleet.live(&n.name),
        "agent_epoch": n.agent_epoch,
        "registered_at_ms": n.registered_at_ms,
        "inventory": serde_json::from_str::<Value>(&n.inventory).unwrap_or(Value::Null),
    })
}

async fn list_nodes(State(s): State<AppState>) -> ApiResult {
    Ok(Json(Value::Array(s.store.nodes().await?.iter().map(|n| node_json(n, &s.fleet)).collect())))
}

async fn get_node(State(s): State<AppState>, Path(name): Path<String>) -> ApiResult {
    Ok(Json(node_json(&s.store.node(&name).await?, &s.fleet)))
}

async fn declare_node(State(s): State<AppState>, Path(name): Path<String>, body: String) -> ApiResult {
    let epoch = control::declare_node(&s.store, &name, &body).await?;
    Ok(Json(json!({ "name": name, "agent_epoch": epoch })))
}

async fn drain(State(s): State<AppState>, Path(name): Path<String>) -> ApiResult {
    Ok(Json(node_json(&s.store.set_node_state(&name, NodeState::Draining).await?, &s.fleet)))
}

async fn undrain(State(s): State<AppState>, Path(name): Path<String>) -> ApiResult {
    Ok(Json(node_json(&s.store.set_node_state(&name, NodeState::Active).await?, &s.fleet)))
}

fn job_json(j: &crate::store::JobRecord) -> Value {
    json!({
        "id": j.id,
        "name": j.name,
        "state": j.state,
        "generation": j.generation,
        "reason": j.reason,
        "created_at_ms": j.created_at_ms,
        "updated_at_ms": j.updated_at_ms,
        "spec": serde_json::from_str::<Value>(&j.spec).unwrap_or(Value::Null),
    })
}

async fn list_jobs(State(s): State<AppState>) -> ApiResult {
    Ok(Json(Value::Array(s.store.jobs().await?.iter().map(job_json).collect())))
}

/// The body is the job file (YAML or JSON). Planning starts in the background; watch the
/// job's events for its progress.
async fn submit_job(State(s): State<AppState>, body: String) -> Result<(StatusCode, Json<Value>), CoordinatorError> {
    let job = control::submit(&s.store, &body).await?;
    let (store, fleet) = (s.store.clone(), s.fleet.clone());
    let id = job.id;
    tokio::spawn(async move {
        let launched = match control::plan_job(&store, id).await {
            Ok(_) => crate::agents::dispatch(&store, &fleet, id).await,
            Err(e) => Err(e),
        };
        if let Err(e) = launched {
            eprintln!("motley-coordinator: job {id}: {e}");
        }
    });
    Ok((StatusCode::CREATED, Json(job_json(&job))))
}

fn parse_id(id: &str) -> Result<i64, CoordinatorError> {
    id.parse().map_err(|_| CoordinatorError::invalid("id", format!("'{id}' is not a job id (a number)")))
}

async fn get_job(State(s): State<AppState>, Path(id): Path<String>) -> ApiResult {
    Ok(Json(job_json(&s.store.job(parse_id(&id)?).await?)))
}

async fn cancel_job(State(s): State<AppState>, Path(id): Path<String>) -> ApiResult {
    let job = control::cancel(&s.store, parse_id(&id)?, "cancelled by the operator").await?;
    s.fleet.stop_job(&s.store, job.id, job.generation, "cancelled by the operator").await;
    Ok(Json(job_json(&job)))
}

#[derive(Deserialize)]
struct After {
    #[serde(default)]
    after: i64,
}

async fn job_events(State(s): State<AppState>, Path(id): Path<String>, Query(q): Query<After>) -> ApiResult {
    let id = parse_id(&id)?;
    s.store.job(id).await?;
    let events = s.store.events(Some(id), q.after, 1000).await?;
    Ok(Json(serde_json::to_value(events).expect("events serialise")))
}

async fn job_plan(State(s): State<AppState>, Path(id): Path<String>) -> ApiResult {
    let job = s.store.job(parse_id(&id)?).await?;
    if job.generation == 0 {
        return Err(CoordinatorError::not_found(format!("plan of job {} (it is {}, not launched yet)", job.id, job.state)));
    }
    let plan = s.store.plan(job.id, job.generation).await?;
    Ok(Json(json!({
        "job": job.id,
        "generation": job.generation,
        "plan": serde_json::from_str::<Value>(&plan).unwrap_or(Value::Null),
        "ranks": s.store.ranks(job.id, job.generation).await?,
    })))
}
