//! Ranks' logs as people read them, fetched from the agent of the node each rank ran on (the
//! agents serve them, `agent/src/logs/`, with the agents' token; an https logs URL is
//! checked against `--agent-ca-cert`): one chunk from an offset (`GET
//! /api/v1/jobs/{id}/ranks/{rank}/logs`), or a log's tail; and a job's training curves, read
//! from rank 0's log of each generation and, where the job kept going through a lost replica,
//! each new leader's (`GET /api/v1/jobs/{id}/curves[.svg]`, read by `motley_contract::curves`,
//! drawn by `motley_draw::curves`).
//!
//! Bounded: a chunk is at most [`LOG_CHUNK`] bytes; the curves read at most the last
//! [`CURVES_TAIL`] bytes of each log in each of the newest [`CURVES_GENERATIONS`]
//! generations (the bytes before are counted, `skipped_bytes`, and not drawn). What was read
//! is kept per (job, generation, rank) (`curves::CurvesCache`): a later read fetches only the bytes
//! written since, and answers what reading the tail afresh would.

pub mod curves;

use motley_contract::curves::{Curves, GenerationCurves};

use crate::error::CoordinatorError;
use crate::state::fleet::Fleet;
use crate::store::{JobRecord, Store};

/// At most this much log per chunk (the agent's own limit); a reader asks again from the new
/// offset.
pub const LOG_CHUNK: u64 = 4 << 20;

/// Bytes of rank 0's log read per generation for the curves: its tail.
pub const CURVES_TAIL: u64 = 8 << 20;

/// Generations whose curves are read: the newest.
pub const CURVES_GENERATIONS: i64 = 32;

/// Where a rank's log is: its node's agent, and how to ask it.
#[derive(Clone)]
pub struct LogSource {
    url: String,
    node: String,
    token: Option<String>,
    roots: ureq::tls::RootCerts,
}

/// How to fetch from the agents: their token (never the operators') and what their https
/// certificates are checked against.
#[derive(Clone)]
pub struct AgentAccess {
    pub token: Option<String>,
    pub roots: ureq::tls::RootCerts,
}

/// The log of rank `rank` of launch `generation` of job `id`: not found when the launch has no
/// such rank, unavailable when its node has no live agent.
pub async fn locate(
    store: &Store,
    fleet: &Fleet,
    access: &AgentAccess,
    id: i64,
    generation: i64,
    rank: i64,
) -> Result<LogSource, CoordinatorError> {
    let ranks = store.ranks(id, generation).await?;
    let Some(r) = ranks.into_iter().find(|r| r.assignment.rank == rank) else {
        return Err(CoordinatorError::not_found(format!("rank {rank} of job {id} generation {generation}")));
    };
    let node = r.assignment.node;
    let base = fleet.logs_url(&node).ok_or_else(|| CoordinatorError::Unavailable(format!("node {node} has no live agent serving logs")))?;
    let url = format!("{}/logs/{id}/{generation}/{rank}", base.trim_end_matches('/'));
    Ok(LogSource { url, node, token: access.token.clone(), roots: access.roots.clone() })
}

/// A log read in chunks from an offset, as an agent serves it (`agent/src/logs/`).
pub trait LogRead: Send + Sync {
    /// At most [`LOG_CHUNK`] bytes from `offset` (none at or past the end), and the log's size
    /// when the agent says it. Blocking (run it on a blocking thread).
    fn chunk(&self, offset: u64) -> Result<(Vec<u8>, Option<u64>), CoordinatorError>;

    /// The last `max` bytes of the log at most, from the start of a line, and how many bytes
    /// before them were not read. Blocking.
    fn tail(&self, max: u64) -> Result<(Vec<u8>, u64), CoordinatorError> {
        // An offset past the end answers nothing but the size.
        let (_, size) = self.chunk(u64::MAX)?;
        let size = size.unwrap_or(0);
        let start = size.saturating_sub(max);
        let mut bytes = vec![];
        let mut offset = start;
        while offset < size {
            let (chunk, _) = self.chunk(offset)?;
            if chunk.is_empty() {
                break;
            }
            offset += chunk.len() as u64;
            bytes.extend(chunk);
        }
        bytes.truncate((size - start) as usize);
        Ok(cut_to_line(bytes, start))
    }
}

impl LogRead for LogSource {
    fn chunk(&self, offset: u64) -> Result<(Vec<u8>, Option<u64>), CoordinatorError> {
        use std::io::Read;
        let node = &self.node;
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_global(Some(std::time::Duration::from_secs(10)))
            .tls_config(ureq::tls::TlsConfig::builder().root_certs(self.roots.clone()).build())
            .build()
            .into();
        let mut req = agent.get(&format!("{}?offset={offset}", self.url));
        if let Some(t) = &self.token {
            req = req.header("Authorization", &format!("Bearer {t}"));
        }
        let mut resp = req.call().map_err(|e| {
            // A certificate the coordinator cannot check: say which setting decides.
            let tls = matches!(e, ureq::Error::Tls(_) | ureq::Error::Rustls(_)) || e.to_string().contains("certificate");
            let hint = if tls { " (the agent's log-service certificate is checked against --agent-ca-cert)" } else { "" };
            CoordinatorError::Unavailable(format!("node {node}'s agent: {e}{hint}"))
        })?;
        let status = resp.status().as_u16();
        let size = resp.headers().get("x-motley-log-size").and_then(|v| v.to_str().ok()).and_then(|v| v.parse().ok());
        let mut bytes = vec![];
        resp.body_mut()
            .as_reader()
            .take(LOG_CHUNK)
            .read_to_end(&mut bytes)
            .map_err(|e| CoordinatorError::Unavailable(format!("node {node}'s agent: {e}")))?;
        match status {
            200 => Ok((bytes, size)),
            404 => Err(CoordinatorError::not_found(format!("log on node {node} ({})", String::from_utf8_lossy(&bytes).trim()))),
            other => Err(CoordinatorError::Unavailable(format!(
                "node {node}'s agent answered {other}: {}",
                String::from_utf8_lossy(&bytes).trim()
            ))),
        }
    }
}

/// A tail read from `start`: without the partial line it begins with (unless it is the whole
/// log), and the bytes before it.
fn cut_to_line(mut bytes: Vec<u8>, start: u64) -> (Vec<u8>, u64) {
    if start == 0 {
        return (bytes, 0);
    }
    let cut = bytes.iter().position(|b| *b == b'\n').map_or(bytes.len(), |i| i + 1);
    bytes.drain(..cut);
    (bytes, start + cut as u64)
}

/// Job `id`'s training curves: rank 0's log of each generation (the newest
/// [`CURVES_GENERATIONS`]), its last [`CURVES_TAIL`] bytes, read from the agent of the node
/// that held rank 0 in that generation's launch, only the bytes `cache` has not seen; then, in a
/// launch that kept going (docs/keep-going.md), the log of each later epoch's leader, which
/// prints the progress lines once rank 0's replica is lost. A generation whose log cannot be
/// read is there with the reason (`error`); one whose rank 0 has not written yet is there empty.
pub async fn curves(
    store: &Store,
    fleet: &Fleet,
    access: &AgentAccess,
    cache: &std::sync::Arc<curves::CurvesCache>,
    id: i64,
) -> Result<(JobRecord, Curves), CoordinatorError> {
    let job = store.job(id).await?;
    let first = (job.generation - CURVES_GENERATIONS + 1).max(1);
    let mut sources = vec![];
    for generation in first..=job.generation {
        let mut logs = vec![];
        for rank in printing_ranks(store, id, generation).await? {
            match locate(store, fleet, access, id, generation, rank).await {
                Ok(src) => logs.push((rank, Ok(src))),
                // A launch without that rank draws nothing of it.
                Err(CoordinatorError::NotFound { .. }) => {}
                Err(e) => logs.push((rank, Err(e))),
            }
        }
        if !logs.is_empty() {
            sources.push((generation, logs));
        }
    }
    let cache = cache.clone();
    let generations = tokio::task::spawn_blocking(move || {
        sources
            .into_iter()
            .map(|(generation, logs)| {
                logs.into_iter()
                    .map(|(rank, src)| match src.and_then(|s| cache.read_rank((id, generation, rank), &s, CURVES_TAIL)) {
                        Ok(read) => read,
                        // The rank has not started writing.
                        Err(CoordinatorError::NotFound { .. }) => GenerationCurves { generation, ..Default::default() },
                        Err(e) => GenerationCurves { generation, error: Some(e.to_string()), ..Default::default() },
                    })
                    .reduce(GenerationCurves::then)
                    .unwrap_or(GenerationCurves { generation, ..Default::default() })
            })
            .collect()
    })
    .await
    .map_err(|e| CoordinatorError::Unavailable(format!("log fetch: {e}")))?;
    Ok((job, Curves { generations }))
}

/// The memberships a launch may record (one per lost replica); more are not followed.
const MAX_EPOCHS: i64 = 64;

/// The ranks whose logs hold a launch's progress lines, in the order they printed them: rank 0,
/// then each later epoch's leader (the `leader` of its `membership_changed` document).
async fn printing_ranks(store: &Store, id: i64, generation: i64) -> Result<Vec<i64>, CoordinatorError> {
    #[derive(serde::Deserialize)]
    struct Leader {
        leader: i64,
    }
    let mut ranks = vec![0];
    for e in store.launch_events(id, generation, "membership_changed", MAX_EPOCHS).await? {
        // A document that does not read names no leader; its epoch's lines are not drawn.
        if let Ok(Leader { leader }) = serde_json::from_str(&e.message) {
            if !ranks.contains(&leader) {
                ranks.push(leader);
            }
        }
    }
    Ok(ranks)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tail_starts_at_a_whole_line() {
        assert_eq!(cut_to_line(b"a\nb\n".to_vec(), 0), (b"a\nb\n".to_vec(), 0), "the whole log is kept");
        assert_eq!(cut_to_line(b"tial\n{\"step\": 1}\n".to_vec(), 10), (b"{\"step\": 1}\n".to_vec(), 15));
        assert_eq!(cut_to_line(b"no newline".to_vec(), 3), (vec![], 13));
    }
}
