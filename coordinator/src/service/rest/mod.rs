//! REST (axum) for the control operations under `/api/v1/...`, plus `/live`, `/ready`,
//! `/metrics` and the OpenAPI document at `/api/v1/openapi.json`. A thin edge: it reads paths,
//! queries and bodies, calls the operation (`api`), answers its response type as JSON, and
//! turns `CoordinatorError`s into one JSON body with the status from `http_status`. The
//! dashboard (`ui`) is served at `/` and `/ui/...`.

mod checkpoints;
pub mod hosts;
mod jobs;
mod net;
mod nodes;
pub mod openapi;
mod profiles;
mod ui;

use axum::extract::{Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Serialize;

use crate::api::{LeaderView, Operations};
use crate::error::CoordinatorError;
use crate::server::metrics::Metrics;
use crate::store::Store;

#[derive(Clone)]
pub struct AppState {
    pub store: Store,
    pub fleet: std::sync::Arc<crate::state::fleet::Fleet>,
    /// The job controller (drains, queued jobs' reasons).
    pub life: std::sync::Arc<crate::life::Life>,
    /// The operators' token the control API requires (and the agents', for their log service).
    pub tokens: crate::service::Tokens,
    pub role: std::sync::Arc<crate::server::leader::Role>,
    pub metrics: Metrics,
    /// What the agents' log-service certificates are checked against when their logs URL is
    /// https (`--agent-ca-cert`, else the public web roots).
    pub agent_roots: ureq::tls::RootCerts,
    /// The names this coordinator answers to (`hosts`): a request for another is refused.
    pub hosts: std::sync::Arc<hosts::ServedHosts>,
    /// The training curves read so far, per job and generation (`rank_logs::curves`).
    pub curves: std::sync::Arc<crate::views::rank_logs::curves::CurvesCache>,
}

impl AppState {
    fn ops(&self) -> Operations<'_> {
        Operations { store: &self.store, fleet: &self.fleet, life: &self.life, role: &self.role }
    }
}

/// A request body that must be text (a job file, a node entry, a profile run); `what` says
/// what it must be when it is not UTF-8.
fn text<'b>(body: &'b [u8], what: &str) -> Result<&'b str, CoordinatorError> {
    std::str::from_utf8(body).map_err(|_| CoordinatorError::invalid("body", what))
}

/// Every error answer's body.
#[derive(Serialize, utoipa::ToSchema)]
pub struct ErrorBody {
    /// What is wrong and how to fix it; names the field when a field is wrong.
    pub error: String,
    /// The gRPC status code the same error has on the gRPC API.
    pub grpc_code: i32,
    /// A standby's answer: the leader's REST URL (retry there).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub leader: Option<String>,
    /// A standby's answer: the leader's gRPC URL.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub leader_grpc: Option<String>,
}

impl IntoResponse for CoordinatorError {
    fn into_response(self) -> Response {
        let status = StatusCode::from_u16(self.http_status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let (leader, leader_grpc) = match &self {
            CoordinatorError::NotLeader { rest_url, grpc_url } => (Some(rest_url.clone()), Some(grpc_url.clone())),
            _ => (None, None),
        };
        (status, Json(ErrorBody { error: self.to_string(), grpc_code: self.grpc_code(), leader, leader_grpc })).into_response()
    }
}

pub(crate) type ApiResult<T> = Result<Json<T>, CoordinatorError>;

pub fn router(state: AppState) -> Router {
    let api = Router::new()
        .route("/nodes", get(nodes::list))
        .route("/nodes/{name}", get(nodes::get).put(nodes::declare).delete(nodes::remove))
        .route("/nodes/{name}/drain", post(nodes::drain))
        .route("/nodes/{name}/undrain", post(nodes::undrain))
        .route("/jobs", get(jobs::list).post(jobs::submit))
        .route("/jobs/{id}", get(jobs::get))
        .route("/jobs/{id}/cancel", post(jobs::cancel))
        .route("/jobs/{id}/events", get(jobs::events))
        .route("/jobs/{id}/plan", get(jobs::plan))
        .route("/jobs/{id}/plan.svg", get(jobs::plan_svg))
        .route("/jobs/{id}/ranks/{rank}/logs", get(jobs::logs))
        .route("/jobs/{id}/curves", get(jobs::curves))
        .route("/jobs/{id}/curves.svg", get(jobs::curves_svg))
        .route("/jobs/{id}/checkpoints", get(checkpoints::list))
        .route("/jobs/{id}/checkpoints/grid", get(checkpoints::grid))
        .route("/plan", post(jobs::dry_run))
        .route("/profiles", get(profiles::list))
        .route("/profiles/runs", get(profiles::runs).post(profiles::run))
        .route("/profiles/runs/{request}", get(profiles::run_state))
        .route("/profiles/{id}", get(profiles::get))
        .route("/net", get(net::show))
        .route_layer(middleware::from_fn_with_state(state.clone(), require_leader))
        .route("/leader", get(leader))
        .route_layer(middleware::from_fn_with_state(state.clone(), require_token))
        .route_layer(middleware::from_fn(same_origin))
        // The API's description is public, like the code it is derived from.
        .route("/openapi.json", get(|| async { Json(openapi::document()) }))
        .method_not_allowed_fallback(wrong_method);
    Router::new()
        .route("/live", get(|| async { "ok" }))
        .route("/ready", get(ready))
        .route("/metrics", get(metrics))
        .nest("/api/v1", api)
        .merge(ui::routes())
        .fallback(no_route)
        // Every route, the dashboard and /metrics included: a rebound page reads none of them
        // from an insecure coordinator.
        .layer(middleware::from_fn_with_state(state.clone(), served_host))
        .layer(axum::extract::DefaultBodyLimit::max(MAX_BODY))
        .layer(middleware::map_response(errors_as_json))
        .with_state(state)
}

/// The largest request body (a job file, a node entry): far above any real one.
pub const MAX_BODY: usize = 2 << 20;

/// Every error answers in the API's JSON shape, also those axum makes itself (a body over
/// `MAX_BODY` is 413 text/plain there, a malformed header 400 text/plain).
async fn errors_as_json(res: Response) -> Response {
    let status = res.status();
    let json = res.headers().get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).is_some_and(|v| v.starts_with("application/json"));
    if !(status.is_client_error() || status.is_server_error()) || json {
        return res;
    }
    let text =
        axum::body::to_bytes(res.into_body(), 64 << 10).await.map(|b| String::from_utf8_lossy(&b).trim().to_string()).unwrap_or_default();
    let error = match status {
        StatusCode::PAYLOAD_TOO_LARGE => {
            CoordinatorError::TooLarge(format!("the request body is over {MAX_BODY} bytes; send a smaller file")).to_string()
        }
        _ if text.is_empty() => status.canonical_reason().unwrap_or("error").to_string(),
        _ => text,
    };
    let grpc_code = match status {
        StatusCode::PAYLOAD_TOO_LARGE | StatusCode::URI_TOO_LONG | StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE => 8,
        StatusCode::UNAUTHORIZED => 16,
        StatusCode::FORBIDDEN => 7,
        StatusCode::NOT_FOUND => 5,
        s if s.is_server_error() => 13,
        _ => 3,
    };
    (status, Json(ErrorBody { error, grpc_code, leader: None, leader_grpc: None })).into_response()
}

/// An unknown path answers in the API's JSON error shape, naming what was asked.
async fn no_route(req: Request) -> Response {
    let what = format!("route {} {} (the routes are in /api/v1/openapi.json)", req.method(), req.uri().path());
    CoordinatorError::not_found(what).into_response()
}

/// A known `/api/v1` path asked with a method it does not have.
async fn wrong_method(req: Request) -> Response {
    // Inside the nested API the path has lost its prefix.
    let error = format!("{} is not allowed on /api/v1{}; its methods are in /api/v1/openapi.json", req.method(), req.uri().path());
    let body = ErrorBody { error, grpc_code: 12, leader: None, leader_grpc: None };
    (StatusCode::METHOD_NOT_ALLOWED, Json(body)).into_response()
}

/// Only the leader serves the control API; a standby names the leader.
async fn require_leader(State(s): State<AppState>, req: Request, next: Next) -> Response {
    if !s.role.is_leader() {
        return s.role.not_leader().into_response();
    }
    next.run(req).await
}

/// `Authorization: Bearer TOKEN` (the operators') on every control call (never logged).
/// Browsers send any site's form posts (text/plain bodies, bodyless POSTs) cross-origin without
/// asking, with the session's network reach: on an `--insecure` coordinator a page anyone
/// visits could submit a job (which runs a shell command on every node) or drain nodes. Such a
/// request carries its page's `Origin`; a change from another origin than the coordinator's own
/// is refused. Scripts and the CLI send no `Origin`; the dashboard's is the coordinator's.
async fn same_origin(req: Request, next: Next) -> Response {
    let changes = !matches!(*req.method(), axum::http::Method::GET | axum::http::Method::HEAD | axum::http::Method::OPTIONS);
    let origin = req.headers().get(header::ORIGIN).map(|v| v.to_str().unwrap_or("?").to_string());
    if let Some(origin) = origin.filter(|_| changes) {
        let host = req.headers().get(header::HOST).and_then(|v| v.to_str().ok()).unwrap_or("");
        let origin_host = origin.split_once("://").map_or("", |(_, rest)| rest.trim_end_matches('/'));
        if host.is_empty() || !origin_host.eq_ignore_ascii_case(host) {
            return CoordinatorError::PermissionDenied(format!(
                "a {} from the web page at {} (Origin) to this coordinator ({host}); change things from the dashboard this coordinator serves, the CLI or a script",
                req.method(),
                origin.escape_default()
            ))
            .into_response();
        }
    }
    next.run(req).await
}

/// DNS rebinding (`hosts`): a change is made only for a request to a name this coordinator
/// serves; so is any request while the control API needs no token (`--insecure`), when even
/// a read (a rank's log) must not reach a page on someone else's name.
async fn served_host(State(s): State<AppState>, req: Request, next: Next) -> Response {
    let changes = !matches!(*req.method(), axum::http::Method::GET | axum::http::Method::HEAD | axum::http::Method::OPTIONS);
    if changes || s.tokens.operator.is_none() {
        let host = req.headers().get(header::HOST).and_then(|v| v.to_str().ok()).or_else(|| req.uri().authority().map(|a| a.as_str()));
        let host = host.unwrap_or("");
        if !s.hosts.serves(host) {
            return CoordinatorError::PermissionDenied(format!(
                "this coordinator does not serve the host name {:?} (Host); it answers to IP addresses, localhost{}; \
                 add the name it is reached by with --public-url (MOTLEY_PUBLIC_URL)",
                host.escape_default().to_string(),
                s.hosts.names().iter().map(|n| format!(", {n}")).collect::<String>()
            ))
            .into_response();
        }
    }
    next.run(req).await
}

async fn require_token(State(s): State<AppState>, req: Request, next: Next) -> Response {
    let given = req.headers().get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()).and_then(crate::service::bearer);
    match s.tokens.check_operator(given) {
        Ok(()) => next.run(req).await,
        Err(e) => e.into_response(),
    }
}

/// Ready to serve: leading, with the database answering (a load balancer sends traffic here).
async fn ready(State(s): State<AppState>) -> Response {
    if !s.role.is_leader() {
        return s.role.not_leader().into_response();
    }
    match s.store.leader_info().await {
        Ok(_) => (StatusCode::OK, "ready").into_response(),
        Err(e) => e.into_response(),
    }
}

async fn metrics(State(s): State<AppState>) -> Response {
    match s.metrics.render().await {
        Ok(text) => ([(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], text).into_response(),
        Err(e) => e.into_response(),
    }
}

#[utoipa::path(get, path = "/api/v1/leader", tag = "leader", responses((status = 200, body = LeaderView)))]
async fn leader(State(s): State<AppState>) -> ApiResult<LeaderView> {
    Ok(Json(s.ops().leader()))
}
