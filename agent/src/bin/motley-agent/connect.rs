//! Reaching the coordinator: a channel to one of its addresses (TLS where it is https), the
//! registration that follows a standby to the leader, and how a session ended.

use std::time::Duration;

use motley_proto::v1::agent_client::AgentClient;
use motley_proto::v1::{RegisterReply, RegisterRequest};

/// A channel to one coordinator URL; `https://` ones are checked against `ca` (PEM) or the
/// system's roots.
async fn channel(url: &str, ca: Option<&[u8]>) -> anyhow::Result<tonic::transport::Channel> {
    // Bounded connects and HTTP/2 keepalives: a coordinator host that vanished (no RST) is
    // noticed in seconds, so the agent moves on to the next address (or the new leader)
    // before its jobs' grace period ends.
    let mut endpoint = tonic::transport::Endpoint::from_shared(url.to_string())?
        .connect_timeout(Duration::from_secs(2))
        .http2_keep_alive_interval(Duration::from_secs(1))
        .keep_alive_timeout(Duration::from_secs(3))
        .keep_alive_while_idle(true);
    if url.starts_with("https://") {
        let tls = match ca {
            Some(pem) => tonic::transport::ClientTlsConfig::new().ca_certificate(tonic::transport::Certificate::from_pem(pem)),
            None => tonic::transport::ClientTlsConfig::new().with_native_roots(),
        };
        endpoint = endpoint.tls_config(tls)?;
    }
    Ok(endpoint.connect().await?)
}

/// How a session ended (never well: the agent runs until it is killed).
pub(crate) enum Ended {
    /// Connection trouble, a coordinator going away: register again after a backoff.
    Retry(anyhow::Error),
    /// The coordinator refused the heartbeats as those of a stale session (ABORTED).
    Stale(String),
    /// Refused for good: the agent exits with this error.
    Fatal(anyhow::Error),
    /// The node is held by another live agent (ALREADY_EXISTS). Fatal once it lasts longer than
    /// the coordinator could take to notice that an earlier session of this very agent is gone
    /// (a connection that dropped on this side only stays open there up to a lease).
    Held(anyhow::Error),
}

impl From<anyhow::Error> for Ended {
    fn from(e: anyhow::Error) -> Ended {
        Ended::Retry(e)
    }
}

/// A refused heartbeat stream: stale (the coordinator's ABORTED naming a stale epoch) or not.
pub(crate) fn heartbeat_refused(s: &tonic::Status) -> Ended {
    if s.code() == tonic::Code::Aborted && s.message().contains("stale") {
        Ended::Stale(s.message().to_string())
    } else {
        Ended::Retry(anyhow::anyhow!("heartbeat: {}", s.message()))
    }
}
/// Register with the leading coordinator: the addresses in order, and any leader a standby
/// names (its refusal carries the leader's address in `motley-leader-grpc`).
pub(crate) async fn register(
    list: &str,
    ca: Option<&[u8]>,
    req: RegisterRequest,
) -> Result<(AgentClient<tonic::transport::Channel>, RegisterReply), Ended> {
    let mut urls: Vec<String> = list.split(',').map(str::trim).filter(|s| !s.is_empty()).map(str::to_string).collect();
    let mut last = None;
    let mut i = 0;
    while i < urls.len() {
        let url = urls[i].clone();
        i += 1;
        let mut client = match channel(&url, ca).await {
            Ok(c) => AgentClient::new(c),
            Err(e) => {
                last = Some(format!("{url}: {e}"));
                continue;
            }
        };
        // Bounded: a frozen coordinator's kernel still accepts the connection, and an agent
        // stuck on it would miss the new leader.
        let answer = match tokio::time::timeout(Duration::from_secs(3), client.register(req.clone())).await {
            Ok(a) => a,
            Err(_) => {
                last = Some(format!("{url}: no answer to the registration within 3 s"));
                continue;
            }
        };
        match answer {
            Ok(reply) => return Ok((client, reply.into_inner())),
            Err(s) if s.code() == tonic::Code::Unavailable => {
                let leader = s.metadata().get("motley-leader-grpc").and_then(|v| v.to_str().ok()).map(str::to_string);
                if let Some(l) = leader.filter(|l| !l.is_empty() && !urls.contains(l)) {
                    urls.insert(i, l);
                }
                last = Some(format!("{url}: {}", s.message()));
            }
            // Another agent runs as this node: registering again would only evict it (and
            // then be evicted), so stop (once it lasts, see `Ended::Held`) and say what to do.
            Err(s) if s.code() == tonic::Code::AlreadyExists => {
                // The coordinator says what to do; an older one may not.
                let hint = if s.message().contains("--node") { "" } else { "; stop it or start this one with another --node" };
                return Err(Ended::Held(anyhow::anyhow!("register at {url}: {}{hint}", s.message())));
            }
            // A wrong token or a refused entry will not change by trying again.
            Err(s) if matches!(s.code(), tonic::Code::Unauthenticated | tonic::Code::PermissionDenied | tonic::Code::InvalidArgument) => {
                return Err(Ended::Fatal(anyhow::anyhow!("register at {url}: {}", s.message())));
            }
            Err(s) => return Err(anyhow::anyhow!("register at {url}: {}", s.message()).into()),
        }
    }
    Err(anyhow::anyhow!("no coordinator took the registration ({})", last.unwrap_or_else(|| "--coordinator is empty".into())).into())
}
