//! The ranks' logs over HTTP, for `motley job logs`:
//! `GET /logs/{job}/{generation}/{rank}?offset=N` answers the log's bytes from `offset` (at
//! most `MAX_CHUNK` of them; an offset at or past the end gives an empty body, so a follower
//! polls with offset + the length it got) and the log's size at the time in the
//! `x-motley-log-size` header. An absent log is 404 with `{"error": ...}` naming job,
//! generation and rank; with an agent token, a request without `Authorization: Bearer TOKEN`
//! (the scheme in any case, the token compared in constant time: `motley_server::auth`, as the coordinator checks its own) is 401: the coordinator
//! fetches with the agents' token, never the operators'. Tokens are never logged. Served over
//! TLS with `--tls-cert`/`--tls-key` (see `tls`).

pub mod tls;

use std::io::{Read, Seek, SeekFrom};
use std::path::PathBuf;
use std::sync::Arc;

use axum::extract::{Path, Query, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use serde::Deserialize;

use motley_server::auth::{bearer, same_secret};

use crate::workdir::{generation_dir, rank_file};

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
        let given = headers.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()).and_then(bearer);
        if !given.is_some_and(|g| same_secret(g, t)) {
            return error(StatusCode::UNAUTHORIZED, "wrong or missing token; send Authorization: Bearer TOKEN (the agent token)".into());
        }
    }
    let work_dir = s.work_dir.clone();
    let read = tokio::task::spawn_blocking(move || -> std::io::Result<(u64, Vec<u8>)> {
        let mut f = open_log(&work_dir, job, generation, rank)?;
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
        Ok(Err(e)) if e.kind() == std::io::ErrorKind::PermissionDenied => {
            error(StatusCode::FORBIDDEN, format!("log of job {job} generation {generation} rank {rank}: {e}"))
        }
        Ok(Err(e)) => error(StatusCode::INTERNAL_SERVER_ERROR, format!("log of job {job} generation {generation} rank {rank}: {e}")),
        Err(e) => error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
    }
}

/// The log of a rank, opened as the agent (root) in a directory the rank's user owns: through
/// the launch directory's handle, never a link (`safe_fs`: a rank that replaced its log with a
/// link to the agent's token file gets a refusal, not the token), a regular file only (a FIFO
/// would hang the reader), with no other hard link (a link to a file the rank cannot read,
/// made where the kernel allows it, is not its log).
fn open_log(work_dir: &std::path::Path, job: i64, generation: i64, rank: i64) -> std::io::Result<std::fs::File> {
    use std::os::unix::fs::MetadataExt;
    let refused = |e: crate::error::AgentError| match e {
        crate::error::AgentError::Io { err, .. } if err.kind() == std::io::ErrorKind::NotFound => err,
        e => std::io::Error::new(std::io::ErrorKind::PermissionDenied, e.to_string()),
    };
    let name = rank_file(std::path::Path::new(""), rank, "log");
    let gen = crate::safe_fs::open_under(&generation_dir(work_dir, job, generation), 3).map_err(refused)?;
    let f = gen.open_file(&name).map_err(refused)?;
    if f.metadata()?.nlink() != 1 {
        return Err(std::io::Error::new(
            std::io::ErrorKind::PermissionDenied,
            format!("{}: has another hard link; refused", gen.path().join(&name).display()),
        ));
    }
    Ok(f)
}

pub fn router(work_dir: PathBuf, token: Option<String>) -> Router {
    Router::new().route("/logs/{job}/{generation}/{rank}", get(log)).with_state(Arc::new(Logs { work_dir, token }))
}

/// Serve until the process ends: over TLS with `tls` (see `tls::TlsFiles::server_config`),
/// plain HTTP without.
pub async fn serve(
    listener: tokio::net::TcpListener,
    work_dir: PathBuf,
    token: Option<String>,
    tls: Option<Arc<tokio_rustls::rustls::ServerConfig>>,
) -> std::io::Result<()> {
    match tls {
        Some(config) => tls::serve(listener, router(work_dir, token), config).await,
        None => axum::serve(listener, router(work_dir, token)).await,
    }
}
