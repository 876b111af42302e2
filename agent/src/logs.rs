//! The ranks' logs over HTTP, for `motley job logs`:
//! `GET /logs/{job}/{generation}/{rank}?offset=N` answers the log's bytes from `offset` (at
//! most `MAX_CHUNK` of them; an offset at or past the end gives an empty body, so a follower
//! polls with offset + the length it got) and the log's size at the time in the
//! `x-motley-log-size` header. An absent log is 404 with `{"error": ...}` naming job,
//! generation and rank; with an agent token, a request without `Authorization: Bearer TOKEN`
//! is 401. Tokens are never logged.

use std::io::{Read, Seek, SeekFrom};
use std::path::PathBuf;
use std::sync::Arc;

use axum::extract::{Path, Query, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use serde::Deserialize;

use crate::rankfiles::{generation_dir, rank_file};

/// Bytes per answer at most; the client asks again from where it got to.
pub const MAX_CHUNK: u64 = 4 << 20;

struct Logs {
    work_dir: PathBuf,
    token: Option<String>,
}

#[derive(Deserialize)]
struct Offset {
    #[serde(default)]
    offset: u64,
}

fn error(status: StatusCode, message: String) -> Response {
    (status, Json(serde_json::json!({ "error": message }))).into_response()
}

async fn log(
    State(s): State<Arc<Logs>>,
    headers: HeaderMap,
    Path((job, generation, rank)): Path<(i64, i64, i64)>,
    Query(q): Query<Offset>,
) -> Response {
    if let Some(t) = &s.token {
        let given = headers.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()).and_then(|v| v.strip_prefix("Bearer "));
        if given != Some(t.as_str()) {
            return error(StatusCode::UNAUTHORIZED, "wrong or missing token; send Authorization: Bearer TOKEN (the agent token)".into());
        }
    }
    let path = rank_file(&generation_dir(&s.work_dir, job, generation), rank, "log");
    let read = tokio::task::spawn_blocking(move || -> std::io::Result<(u64, Vec<u8>)> {
        let mut f = std::fs::File::open(&path)?;
        let size = f.metadata()?.len();
        let mut buf = vec![];
        if q.offset < size {
            f.seek(SeekFrom::Start(q.offset))?;
            f.take(MAX_CHUNK).read_to_end(&mut buf)?;
        }
        Ok((size, buf))
    })
    .await;
    match read {
        Ok(Ok((size, bytes))) => (
            [(header::CONTENT_TYPE, "text/plain".to_string()), (header::HeaderName::from_static("x-motley-log-size"), size.to_string())],
            bytes,
        )
            .into_response(),
        Ok(Err(e)) if e.kind() == std::io::ErrorKind::NotFound => {
            error(StatusCode::NOT_FOUND, format!("no log for job {job} generation {generation} rank {rank} on this node"))
        }
        Ok(Err(e)) => error(StatusCode::INTERNAL_SERVER_ERROR, format!("log of job {job} generation {generation} rank {rank}: {e}")),
        Err(e) => error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
    }
}

pub fn router(work_dir: PathBuf, token: Option<String>) -> Router {
    Router::new().route("/logs/{job}/{generation}/{rank}", get(log)).with_state(Arc::new(Logs { work_dir, token }))
}

/// Serve until the process ends.
pub async fn serve(listener: tokio::net::TcpListener, work_dir: PathBuf, token: Option<String>) -> std::io::Result<()> {
    axum::serve(listener, router(work_dir, token)).await
}
