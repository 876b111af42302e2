//! The simulated agents of the fleet bench: each registers over real gRPC, heartbeats on the
//! interval with a busy node's load, and answers a Launch with its ranks `running` and a Stop
//! with `exited`, as `motley-agent` does; what they saw is counted in `Shared`.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{anyhow, bail, Result};
use motley_proto::v1::agent_client::AgentClient;
use motley_proto::v1::{instruction, AgentStatus, RankStatus, RegisterRequest};
use tonic::transport::Channel;

/// One cluster-file node entry (examples/clusters/lab.yaml's A100 nodes), as an agent sends it.
pub(crate) const INVENTORY: &str = r#"{"gpu":"A100-80G","gpus":8,"nics":[{"name":"mlx5_0","kind":"ib","gbps":200},{"name":"eth0","kind":"ethernet","gbps":25}],"rdma_domain":"ib-island"}"#;

/// This machine's wall clock in ms, the clock of the job events' `at_ms`.
pub(crate) fn now_ms() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0.0, |d| d.as_micros() as f64 / 1000.0)
}

#[derive(Default, Clone, Copy)]
pub(crate) struct JobSeen {
    pub(crate) launches: usize,
    pub(crate) ranks: usize,
    pub(crate) first_launch_ms: f64,
    pub(crate) last_launch_ms: f64,
    pub(crate) running_sent: usize,
    pub(crate) last_running_sent_ms: f64,
    pub(crate) stops: usize,
}

#[derive(Default)]
pub(crate) struct Shared {
    pub(crate) registered: AtomicU64,
    pub(crate) heartbeats: AtomicU64,
    pub(crate) jobs: Mutex<HashMap<i64, JobSeen>>,
    pub(crate) errors: Mutex<Vec<String>>,
    pub(crate) stopping: AtomicBool,
    /// Every agent heartbeats at the same instant (the worst case) instead of on its own phase.
    pub(crate) burst: bool,
}

impl Shared {
    pub(crate) fn fail(&self, msg: String) {
        if !self.stopping.load(Ordering::Relaxed) {
            self.errors.lock().unwrap().push(msg);
        }
    }

    pub(crate) fn check(&self) -> Result<()> {
        let e = self.errors.lock().unwrap();
        if let Some(first) = e.first() {
            bail!("{} agent(s) failed; first: {first}", e.len());
        }
        Ok(())
    }
}

/// A busy 8-GPU node's load, the size of what a real agent sends on every interval heartbeat.
fn node_load() -> motley_proto::v1::NodeLoad {
    let gib = 1u64 << 30;
    motley_proto::v1::NodeLoad {
        gpus: (0..8)
            .map(|index| motley_proto::v1::GpuLoad {
                index,
                utilization_percent: 97,
                memory_used_bytes: 71 * gib,
                memory_total_bytes: 80 * gib,
                temperature_c: Some(68),
            })
            .collect(),
        work_dir_free_bytes: 3 * 1024 * gib,
        load_1m: 12.5,
        mem_available_bytes: 900 * gib,
        ranks_running: 8,
    }
}

/// One agent: register, then one heartbeat stream; a Launch's ranks are reported `running` at
/// once (what `motley-agent` does once its processes started), a Stop's `exited`.
pub(crate) async fn agent(i: usize, channel: Channel, shared: Arc<Shared>, gate: Arc<tokio::sync::Semaphore>) {
    let node = format!("n{i:05}");
    if let Err(e) = agent_session(i, &node, channel, &shared, gate).await {
        shared.fail(format!("{node}: {e:#}"));
    }
}

/// Reports waiting to be sent, and the signal that sends them at once, as the agent does.
#[derive(Clone, Default)]
struct Outbox {
    pending: Arc<Mutex<Vec<RankStatus>>>,
    changed: Arc<tokio::sync::Notify>,
}

impl Outbox {
    fn send(&self, reports: impl IntoIterator<Item = RankStatus>) {
        self.pending.lock().unwrap().extend(reports);
        self.changed.notify_one();
    }
}

async fn agent_session(index: usize, node: &str, channel: Channel, shared: &Arc<Shared>, gate: Arc<tokio::sync::Semaphore>) -> Result<()> {
    let mut client = AgentClient::new(channel);
    let reply = {
        let _permit = gate.acquire().await?;
        client
            .register(RegisterRequest {
                node: node.to_string(),
                inventory_json: INVENTORY.into(),
                token: String::new(),
                address: "127.0.0.1".into(),
                // Fields others add to the contract keep their defaults.
                ..Default::default()
            })
            .await
            .map_err(|s| anyhow!("register refused: {:?} {}", s.code(), s.message()))?
            .into_inner()
    };
    let interval = Duration::from_millis(reply.heartbeat_ms.max(10));
    let outbox = Outbox::default();
    let (tx, rx) = tokio::sync::mpsc::channel::<AgentStatus>(16);
    let beat_task = tokio::spawn(heartbeats(index, node.to_string(), reply.epoch, interval, outbox.clone(), shared.clone(), tx));
    let mut request = tonic::Request::new(tokio_stream::wrappers::ReceiverStream::new(rx));
    request.metadata_mut().insert("authorization", "Bearer ".parse()?);
    let result: Result<()> = async {
        let mut inbound =
            client.heartbeat(request).await.map_err(|s| anyhow!("heartbeat refused: {:?} {}", s.code(), s.message()))?.into_inner();
        shared.registered.fetch_add(1, Ordering::Relaxed);
        // (job, generation, rank) this agent runs.
        let mut mine: Vec<(i64, i64, i64)> = vec![];
        loop {
            match inbound.message().await {
                Ok(Some(i)) => match i.kind {
                    Some(instruction::Kind::Launch(l)) => launched(shared, &outbox, &mut mine, &l),
                    Some(instruction::Kind::Stop(s)) => stopped(shared, &outbox, &mut mine, &s),
                    // Bench agents register without can_profile: never asked to profile.
                    Some(
                        instruction::Kind::Drain(_)
                        | instruction::Kind::Ack(_)
                        | instruction::Kind::Profile(_)
                        | instruction::Kind::Restore(_)
                        | instruction::Kind::SaveNow(_)
                        // Bench ranks never fail: no replica is lost.
                        | instruction::Kind::Membership(_),
                    )
                    | None => {}
                },
                Ok(None) => bail!("the coordinator closed the heartbeat stream"),
                Err(s) => bail!("heartbeat stream: {:?} {}", s.code(), s.message()),
            }
        }
    }
    .await;
    beat_task.abort();
    result
}

/// One agent's heartbeat stream: on a fixed phase of the wall clock, spread uniformly over the
/// interval (agents that started at random times) or all at once with --burst, and at once when
/// reports wait in the outbox.
async fn heartbeats(
    index: usize,
    node: String,
    epoch: i64,
    interval: Duration,
    outbox: Outbox,
    shared: Arc<Shared>,
    tx: tokio::sync::mpsc::Sender<AgentStatus>,
) {
    let period = interval.as_micros() as u64;
    let phase = if shared.burst { 0 } else { (index as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) % period };
    let now = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_micros() as u64);
    let wait = (phase + period - now % period) % period;
    let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + Duration::from_micros(wait), interval);
    // Numbered as `motley-agent`'s messages are: the coordinator acknowledges each.
    let mut seq = 0u64;
    loop {
        let beat = tokio::select! {
            _ = tick.tick() => true,
            _ = outbox.changed.notified() => false,
        };
        let ranks = std::mem::take(&mut *outbox.pending.lock().unwrap());
        if !beat && ranks.is_empty() {
            continue;
        }
        let mut running: HashMap<i64, usize> = HashMap::new();
        for r in ranks.iter().filter(|r| r.state == "running") {
            *running.entry(r.job).or_default() += 1;
        }
        // Every interval heartbeat carries the node's load, as `motley-agent`'s do.
        let load = beat.then(node_load);
        seq += 1;
        if tx.send(AgentStatus { node: node.clone(), epoch, ranks, load, seq, full: seq == 1, ..Default::default() }).await.is_err() {
            return;
        }
        if beat {
            shared.heartbeats.fetch_add(1, Ordering::Relaxed);
        }
        if !running.is_empty() {
            let at = now_ms();
            let mut jobs = shared.jobs.lock().unwrap();
            for (job, n) in running {
                let j = jobs.entry(job).or_default();
                j.running_sent += n;
                j.last_running_sent_ms = j.last_running_sent_ms.max(at);
            }
        }
    }
}

/// A Launch: counted, and its ranks reported `running` at once.
fn launched(shared: &Shared, outbox: &Outbox, mine: &mut Vec<(i64, i64, i64)>, l: &motley_proto::v1::Launch) {
    let at = now_ms();
    {
        let mut jobs = shared.jobs.lock().unwrap();
        let j = jobs.entry(l.job).or_default();
        if j.launches == 0 || at < j.first_launch_ms {
            j.first_launch_ms = at;
        }
        j.launches += 1;
        j.ranks += l.ranks.len();
        j.last_launch_ms = j.last_launch_ms.max(at);
    }
    mine.extend(l.ranks.iter().map(|r| (l.job, l.generation, r.rank)));
    outbox.send(l.ranks.iter().map(|r| RankStatus {
        job: l.job,
        generation: l.generation,
        rank: r.rank,
        state: "running".into(),
        exit_code: None,
        rejoined: None,
    }));
}

/// A Stop: its ranks are killed, reported exited (SIGTERM) on the next heartbeat.
fn stopped(shared: &Shared, outbox: &Outbox, mine: &mut Vec<(i64, i64, i64)>, s: &motley_proto::v1::Stop) {
    shared.jobs.lock().unwrap().entry(s.job).or_default().stops += 1;
    let mut exited = vec![];
    mine.retain(|&(job, generation, rank)| {
        let stop = job == s.job && generation <= s.generation;
        if stop {
            exited.push(RankStatus { job, generation, rank, state: "exited".into(), exit_code: Some(143), ..Default::default() });
        }
        !stop
    });
    outbox.send(exited);
}
