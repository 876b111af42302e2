//! `motley-agent`: registers its node with the coordinator (hardware declared by
//! `--inventory FILE`, a cluster-file node entry), holds the node's lease by heartbeating on the
//! coordinator's base interval, and launches, supervises and stops the ranks it is told to.
//! Each rank is `sh -c RUN` in its own process group with the torchrun variables, the GPU and
//! Motley's own (`MOTLEY_*`), its output in `WORK_DIR/jobs/JOB/GENERATION/rank-R.log`.

mod ranks;

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use motley_proto::v1::agent_client::AgentClient;
use motley_proto::v1::{instruction, AgentStatus, RegisterRequest};
use tokio_stream::wrappers::ReceiverStream;

use ranks::Supervisor;

#[derive(Parser)]
#[command(name = "motley-agent", version, about = "Motley's per-node agent")]
struct Args {
    /// The coordinator's agent (gRPC) address(es), comma-separated, tried in order.
    #[arg(long, env = "MOTLEY_COORDINATOR_GRPC", default_value = "http://127.0.0.1:7071")]
    coordinator: String,
    /// This node's name (default: the host name).
    #[arg(long, env = "MOTLEY_NODE")]
    node: Option<String>,
    /// The node's hardware as a cluster-file node entry (YAML).
    #[arg(long, env = "MOTLEY_INVENTORY")]
    inventory: PathBuf,
    /// The shared agent token.
    #[arg(long, env = "MOTLEY_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// Where rank logs and plan files go.
    #[arg(long, env = "MOTLEY_WORK_DIR", default_value = "motley-agent")]
    work_dir: PathBuf,
    /// The address other nodes reach this one at (MASTER_ADDR when rank 0 runs here).
    #[arg(long, env = "MOTLEY_ADDRESS", default_value = "127.0.0.1")]
    address: String,
}

fn inventory_json(path: &PathBuf) -> anyhow::Result<String> {
    let text = std::fs::read_to_string(path).with_context(|| format!("--inventory: cannot read {}", path.display()))?;
    let mut v: serde_norway::Value = serde_norway::from_str(&text).with_context(|| format!("{}: not YAML", path.display()))?;
    if let Some(m) = v.as_mapping_mut() {
        // The node's name is the agent's; a cluster file's `count` does not apply to one node.
        m.remove("name");
        m.remove("count");
    }
    Ok(serde_json::to_string(&v)?)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let node = match &args.node {
        Some(n) => n.clone(),
        None => std::fs::read_to_string("/proc/sys/kernel/hostname").map(|h| h.trim().to_string()).unwrap_or_else(|_| "localhost".into()),
    };
    let inventory = inventory_json(&args.inventory)?;
    std::fs::create_dir_all(&args.work_dir).with_context(|| format!("--work-dir: cannot create {}", args.work_dir.display()))?;
    let supervisor = Supervisor::new(args.work_dir.clone(), node.clone());
    let mut backoff = Duration::from_millis(200);
    // Each pass is one session: register (a new epoch), then heartbeat until the stream
    // breaks; ranks keep running across sessions and are reported again in the next one.
    loop {
        match session(&args, &node, &inventory, &supervisor).await {
            Ok(()) => return Ok(()),
            Err(e) => {
                eprintln!("motley-agent {node}: {e:#}; reconnecting in {} ms", backoff.as_millis());
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(5));
            }
        }
    }
}

async fn connect(list: &str) -> anyhow::Result<AgentClient<tonic::transport::Channel>> {
    let mut last = None;
    for url in list.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        match AgentClient::connect(url.to_string()).await {
            Ok(c) => return Ok(c),
            Err(e) => last = Some(format!("{url}: {e}")),
        }
    }
    anyhow::bail!("no coordinator answered ({})", last.unwrap_or_else(|| "--coordinator is empty".into()))
}

async fn session(args: &Args, node: &str, inventory: &str, supervisor: &Supervisor) -> anyhow::Result<()> {
    let mut client = connect(&args.coordinator).await?;
    let token = args.token.clone().unwrap_or_default();
    let reply = client
        .register(RegisterRequest {
            node: node.to_string(),
            inventory_json: inventory.to_string(),
            token: token.clone(),
            address: args.address.clone(),
        })
        .await
        .map_err(|s| anyhow::anyhow!("register: {}", s.message()))?
        .into_inner();
    let epoch = reply.epoch;
    let interval = Duration::from_millis(reply.heartbeat_ms.max(10));
    eprintln!("motley-agent {node}: registered as epoch {epoch}, heartbeat every {} ms", interval.as_millis());
    supervisor.resend_all();
    let (tx, rx) = tokio::sync::mpsc::channel::<AgentStatus>(16);
    let mut request = tonic::Request::new(ReceiverStream::new(rx));
    request.metadata_mut().insert("authorization", format!("Bearer {token}").parse().context("token is not a valid header value")?);
    let beat = {
        let (supervisor, node) = (supervisor.clone(), node.to_string());
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(interval);
            loop {
                tick.tick().await;
                let status = AgentStatus { node: node.clone(), epoch, ranks: supervisor.changes() };
                if tx.send(status).await.is_err() {
                    return;
                }
            }
        })
    };
    let mut inbound = client.heartbeat(request).await.map_err(|s| anyhow::anyhow!("heartbeat: {}", s.message()))?.into_inner();
    let result = loop {
        match inbound.message().await {
            Ok(Some(i)) => match i.kind {
                Some(instruction::Kind::Launch(l)) => supervisor.launch(l),
                Some(instruction::Kind::Stop(s)) => supervisor.stop(s.job, s.generation),
                None => {}
            },
            Ok(None) => break Err(anyhow::anyhow!("the coordinator closed the heartbeat stream")),
            Err(s) => break Err(anyhow::anyhow!("heartbeat: {}", s.message())),
        }
    };
    beat.abort();
    result
}
