//! The agent's sessions with the coordinator: register (a new epoch), then one heartbeat
//! stream both ways until it breaks (reports up on the interval and at once on a change,
//! instructions down), then register again; ranks keep running across sessions.

use std::path::Path;
use std::time::Duration;

use anyhow::Context;
use motley_agent::checkpoints::dataplane::access::Issued;
use motley_agent::checkpoints::holdings::Holdings;
use motley_agent::checkpoints::restorer::Restorer;
use motley_agent::checkpoints::tiers::Tierer;
use motley_agent::node::load::Latest;
use motley_agent::profiler::Profiler;
use motley_agent::ranks::Supervisor;
use motley_proto::v1::agent_client::AgentClient;
use motley_proto::v1::{instruction, AgentStatus, RegisterRequest};
use tokio_stream::wrappers::ReceiverStream;

use crate::connect::{heartbeat_refused, register, Ended};
use crate::settings::Args;

/// How many sessions in a row the coordinator may refuse as stale before the agent gives up:
/// another agent keeps registering as this node (a re-registration gives this one a new
/// epoch; if it is refused again, someone else's registration came in between).
const STALE_SESSIONS: u32 = 3;
/// Sessions, one after another, until one ends for good (the error the agent exits with).
pub(crate) async fn keep_registered(
    args: &Args,
    work_dir: &Path,
    node: &str,
    inventory: &str,
    urls: (&str, &str),
    workers: Workers<'_>,
    load: &Latest,
) -> anyhow::Result<()> {
    let supervisor = workers.supervisor;
    let mut backoff = Duration::from_millis(200);
    let mut stale = 0;
    // Since when registrations are refused as held by another agent.
    let mut held_since: Option<std::time::Instant> = None;
    // Each pass is one session: register (a new epoch), then heartbeat until the stream
    // breaks; ranks keep running across sessions and are reported again in the next one.
    loop {
        let began = std::time::Instant::now();
        let e = match session(args, work_dir, node, inventory, urls, workers, load).await {
            Ended::Fatal(e) => return Err(e),
            Ended::Held(e) => {
                let since = *held_since.get_or_insert_with(std::time::Instant::now);
                // Longer than the coordinator's lease of a session it has not yet seen close
                // (3 base intervals), and at least 10 s.
                let window = (supervisor.interval() * 4).max(Duration::from_secs(10));
                if since.elapsed() > window {
                    return Err(e);
                }
                e
            }
            Ended::Stale(message) => {
                stale += 1;
                if stale >= STALE_SESSIONS {
                    anyhow::bail!(
                        "node {node}: the coordinator refused this agent's heartbeats as stale {stale} sessions in a row ({message}): \
                         another agent is registering as node {node}; stop it, or start this one with another --node"
                    );
                }
                anyhow::anyhow!("heartbeat refused: {message}")
            }
            Ended::Retry(e) => {
                stale = 0;
                held_since = None;
                e
            }
        };
        // A session that ran a while ended by a coordinator restart or failover: find the
        // (new) leader at once rather than after an old backoff.
        if began.elapsed() > Duration::from_secs(10) {
            backoff = Duration::from_millis(200);
        }
        tracing::warn!(node = %node, "{e:#}; reconnecting in {} ms", backoff.as_millis());
        tokio::time::sleep(backoff).await;
        // Capped low: a standby takes over within a couple of base intervals and the agents
        // must find it before their jobs' grace period ends.
        backoff = (backoff * 2).min(Duration::from_secs(1));
    }
}

/// Record whether the node is draining in `WORK_DIR/draining` (present while it is), so tools
/// on the node — a maintenance script waiting to reboot, say — can see it.
fn mark_draining(work_dir: &Path, node: &str, draining: bool) {
    let flag = work_dir.join("draining");
    let done = if draining {
        motley_agent::workdir::replace(&flag, b"draining\n").map_err(|e| e.to_string())
    } else {
        std::fs::remove_file(&flag)
            .or_else(|e| if e.kind() == std::io::ErrorKind::NotFound { Ok(()) } else { Err(e) })
            .map_err(|e| e.to_string())
    };
    match done {
        Ok(()) => tracing::info!(node = %node, draining, "drain state"),
        Err(e) => tracing::warn!(node = %node, "{}: {e}", flag.display()),
    }
}
/// What runs work on the node's behalf: its ranks, and layer profiling if it can.
#[derive(Clone, Copy)]
pub(crate) struct Workers<'a> {
    pub(crate) supervisor: &'a Supervisor,
    pub(crate) profiler: Option<&'a Profiler>,
    pub(crate) holdings: &'a std::sync::Arc<Holdings>,
    pub(crate) tierer: &'a std::sync::Arc<Tierer>,
    pub(crate) restorer: &'a Restorer,
    /// The data plane's keys, from each registration (in memory only).
    pub(crate) data_key: &'a motley_agent::checkpoints::dataplane::DataKey,
    /// The links' measurements: the launches' peers in, NIC rates and probe samples out.
    pub(crate) meter: &'a std::sync::Arc<motley_agent::net::Meter>,
}

/// One session: register (a new epoch), then heartbeat until the stream breaks.
async fn session(
    args: &Args,
    work_dir: &Path,
    node: &str,
    inventory: &str,
    urls: (&str, &str),
    workers: Workers<'_>,
    load: &Latest,
) -> Ended {
    match session_inner(args, work_dir, node, inventory, urls, workers, load).await {
        Ok(never) => match never {},
        Err(e) => e,
    }
}

async fn session_inner(
    args: &Args,
    work_dir: &Path,
    node: &str,
    inventory: &str,
    (logs_url, data_url): (&str, &str),
    workers: Workers<'_>,
    load: &Latest,
) -> Result<std::convert::Infallible, Ended> {
    let Workers { supervisor, profiler, holdings, restorer, .. } = workers;
    let token = args.token.clone().unwrap_or_default();
    let request = register_request(args, node, inventory, (logs_url, data_url), &token, profiler.is_some());
    let ca = match &args.ca_cert {
        Some(p) => Some(std::fs::read(p).with_context(|| format!("--ca-cert: cannot read {}", p.display()))?),
        None => None,
    };
    let (mut client, reply) = register(&args.coordinator, ca.as_deref(), request).await?;
    let epoch = reply.epoch;
    let interval = Duration::from_millis(reply.heartbeat_ms.max(10));
    // Until the first one, the data plane refuses every request; a later one replaces it (the
    // previous keys accepted beside it for a while: `DataKey::set`).
    let issued = Issued { node_key: &reply.data_plane_key, probe_key: &reply.probe_key, base: interval };
    if let Err(e) = workers.data_key.set(issued) {
        tracing::warn!(node = %node, "{e}; peers' fetches from this node are refused");
    }
    tracing::info!(node = %node, epoch, "registered; heartbeat every {} ms", interval.as_millis());
    // A lease that ran out while this agent was cut off must not stop the ranks a launch of
    // this session starts before its first acknowledgement renews it.
    if motley_agent::ranks::lease::clear_if_lapsed(work_dir) {
        tracing::warn!(node = %node, "the node's lease had run out while the coordinator was away; cleared");
    }
    supervisor.set_interval(interval);
    supervisor.new_session();
    if let Some(p) = profiler {
        p.new_session();
    }
    holdings.new_session();
    restorer.new_session();
    let (tx, rx) = tokio::sync::mpsc::channel::<AgentStatus>(16);
    let mut request = tonic::Request::new(ReceiverStream::new(rx));
    request.metadata_mut().insert("authorization", format!("Bearer {token}").parse().context("token is not a valid header value")?);
    let beat = spawn_beat(workers, work_dir, node, load, interval, epoch, tx);
    let result = heartbeat(&mut client, request, work_dir, node, interval, workers).await;
    beat.abort();
    Err(result)
}

/// This agent's registration: what the node has and where its logs and data plane listen.
fn register_request(
    args: &Args,
    node: &str,
    inventory: &str,
    (logs_url, data_url): (&str, &str),
    token: &str,
    can_profile: bool,
) -> RegisterRequest {
    RegisterRequest {
        node: node.to_string(),
        inventory_json: inventory.to_string(),
        token: token.to_string(),
        address: args.address.clone(),
        logs_url: logs_url.to_string(),
        can_profile,
        data_url: data_url.to_string(),
        rdma_device: motley_agent::checkpoints::restorer::rdma_device().unwrap_or_default(),
        ckpt_rates: Some(motley_proto::v1::CkptRates {
            disk_read_mb_s: args.ckpt_disk_mb_s,
            nic_mb_s: args.ckpt_nic_mb_s,
            mem_copy_mb_s: 0.0,
        }),
    }
}

/// The session's sending half: a status up the heartbeat stream on the interval, and at once
/// when ranks, profiles or restores change; ends when the stream's receiver is gone.
fn spawn_beat(
    workers: Workers<'_>,
    work_dir: &Path,
    node: &str,
    load: &Latest,
    interval: Duration,
    epoch: i64,
    tx: tokio::sync::mpsc::Sender<AgentStatus>,
) -> tokio::task::JoinHandle<()> {
    let Workers { supervisor, profiler, holdings, restorer, .. } = workers;
    let (supervisor, node, load, profiler) = (supervisor.clone(), node.to_string(), load.clone(), profiler.cloned());
    let (holdings, work, restorer, meter) = (holdings.clone(), work_dir.to_path_buf(), restorer.clone(), workers.meter.clone());
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(interval);
        // Every message has its number (1, 2, ...); the first lists every rank.
        let mut seq = 0;
        loop {
            // On the interval (the lease), and at once when ranks started or ended.
            let beat = tokio::select! {
                _ = tick.tick() => true,
                _ = supervisor.changed() => false,
                _ = async { match &profiler { Some(p) => p.changed().await, None => std::future::pending().await } } => false,
                _ = restorer.changed() => false,
            };
            let full = seq == 0;
            let ranks = supervisor.report(seq + 1, full);
            let profiles = profiler.as_ref().map(|p| p.report(seq + 1)).unwrap_or_default();
            let restores = restorer.report(seq + 1);
            // Checkpoint files are looked for on the interval (and with every other message).
            let held = match beat || full || !ranks.is_empty() || !profiles.is_empty() || !restores.is_empty() {
                true => {
                    let (h, w, s) = (holdings.clone(), work.clone(), seq + 1);
                    tokio::task::spawn_blocking(move || h.report(&w, s)).await.unwrap_or(None)
                }
                false => None,
            };
            if !beat && !full && ranks.is_empty() && profiles.is_empty() && restores.is_empty() {
                continue;
            }
            let (holdings_sent, holdings_list) = match held {
                Some(list) => (true, list),
                None => (false, vec![]),
            };
            seq += 1;
            // A fresh sample only (a stalled sampler's old one would mislead).
            let fresh = interval.max(motley_agent::node::load::SAMPLE_EVERY) * 3;
            let load = match beat {
                true => load.borrow().as_ref().filter(|(_, at)| at.elapsed() <= fresh).map(|(l, _)| l.clone()),
                false => None,
            };
            // The links on the interval: probe samples since the last (each sent once), and
            // the NICs' rates over the interval (sysfs, off the async workers).
            let (links, nics) = match beat {
                true => {
                    let m = meter.clone();
                    (meter.take_links(), tokio::task::spawn_blocking(move || m.nic_rates()).await.unwrap_or_default())
                }
                false => (vec![], vec![]),
            };
            let status = AgentStatus {
                node: node.clone(),
                epoch,
                ranks,
                load,
                seq,
                full,
                profiles,
                holdings: holdings_list,
                holdings_sent,
                restores,
                links,
                nics,
            };
            if tx.send(status).await.is_err() {
                return;
            }
        }
    })
}

/// Read the coordinator's instructions until the stream breaks; how it broke.
async fn heartbeat(
    client: &mut AgentClient<tonic::transport::Channel>,
    request: tonic::Request<ReceiverStream<AgentStatus>>,
    work_dir: &Path,
    node: &str,
    interval: Duration,
    workers: Workers<'_>,
) -> Ended {
    let Workers { supervisor, profiler, holdings, tierer, restorer, meter, .. } = workers;
    let mut inbound = match client.heartbeat(request).await {
        Ok(r) => r.into_inner(),
        Err(s) => return heartbeat_refused(&s),
    };
    loop {
        match inbound.message().await {
            Ok(Some(i)) => match i.kind {
                Some(instruction::Kind::Launch(l)) => {
                    // Its checkpoint policy (keep, cloud) first: the tiers apply it to the steps its ranks write.
                    // Whether its ranks run as this agent's own uid: a file:// cloud of another user's job is
                    // used only under a --cloud-file-root (`file_roots`).
                    let as_agent = l.user.is_empty()
                        || matches!(motley_agent::ranks::users::lookup(&l.user), Ok(Some(a)) if a.uid == motley_agent::ranks::users::euid());
                    if let Err(e) = tierer.launched_as(&l, as_agent) {
                        tracing::warn!(node = %node, job = l.job, "{e}; the launch's checkpoints are kept as by default");
                    }
                    let (job, generation, peers) = (l.job, l.generation, l.peers.clone());
                    supervisor.launch(l);
                    // Its peers' links are probed while its ranks run.
                    meter.launched(job, generation, &peers);
                }
                Some(instruction::Kind::Stop(s)) => {
                    meter.stopped(s.job, s.generation);
                    supervisor.stop(s.job, s.generation)
                }
                Some(instruction::Kind::Drain(d)) => mark_draining(work_dir, node, d.draining),
                Some(instruction::Kind::Profile(p)) => match profiler {
                    Some(profiler) => profiler.start(p),
                    None => tracing::warn!(node = %node, request = p.request, "asked to profile, but this agent has no --python; ignored"),
                },
                Some(instruction::Kind::Restore(r)) => restorer.start(r),
                Some(instruction::Kind::SaveNow(s)) => match motley_agent::ranks::notice::write(work_dir, &s) {
                    Ok(file) => tracing::info!(node = %node, job = s.job, "preemption notice: the ranks save now ({})", file.display()),
                    Err(e) => tracing::warn!(node = %node, job = s.job, "{e}"),
                },
                Some(instruction::Kind::Membership(m)) => {
                    match motley_agent::ranks::membership::write(work_dir, &m) {
                        Ok(file) => {
                            tracing::info!(node = %node, job = m.job, epoch = m.epoch, "membership: the ranks move to it ({})", file.display())
                        }
                        Err(e) => tracing::warn!(node = %node, job = m.job, "{e}"),
                    }
                    if !m.stop_ranks.is_empty() {
                        supervisor.stop_ranks(m.job, m.generation, &m.stop_ranks);
                    }
                }
                Some(instruction::Kind::Ack(a)) => {
                    supervisor.ack(a.seq);
                    if let Some(p) = profiler {
                        p.ack(a.seq);
                    }
                    holdings.ack(a.seq);
                    restorer.ack(a.seq);
                    // The coordinator holds this node's lease: so do its ranks (the switch).
                    if let Err(e) = motley_agent::ranks::lease::renew(work_dir, interval) {
                        tracing::warn!(node = %node, "{e}; ranks stop when the lease file's deadline passes");
                    }
                }
                None => {}
            },
            Ok(None) => return Ended::Retry(anyhow::anyhow!("the coordinator closed the heartbeat stream")),
            Err(s) => return heartbeat_refused(&s),
        }
    }
}
