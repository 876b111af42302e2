//! What a person reads of a job (`motley job watch`): on a real coordinator process with a
//! stand-in agent over gRPC, the events say why GPUs the job may use stay idle, sum up what
//! the roofline priced in one short line, come in the order things happened, and say why a
//! launch's links are not watched for re-planning; `replan:` that can never act is refused.

use crate::common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{temp_dir, Coordinator};
use motley_proto::v1 as pb;
use motley_proto::v1::agent_client::AgentClient;
use motley_proto::v1::{instruction, AgentStatus, CkptHolding, Instruction, RankStatus, RegisterRequest};
use serde_json::Value;
use tokio::sync::mpsc;

/// One node of four A100s; its agent cannot profile (no `--python`).
const NODE: &str = r#"{"gpu": "A100-80G", "gpus": 4, "nics": [{"name": "mlx5_0", "kind": "ib", "gbps": 200}]}"#;

/// A one-layer model: a checkpoint of it is three blocks.
const MODEL: &str = "{name: one, layers: 1, hidden: 64, heads: 4, seq_len: 32, vocab: 128}";

/// A stand-in agent: registered, heartbeating; `send` adds a message of its own (also
/// `keep_going_e2e`'s).
pub(crate) struct FakeAgent {
    node: String,
    epoch: i64,
    tx: mpsc::Sender<AgentStatus>,
    instructions: mpsc::UnboundedReceiver<Instruction>,
    beats: tokio::task::JoinHandle<()>,
    seq: u64,
}

impl FakeAgent {
    pub(crate) async fn start(c: &Coordinator) -> FakeAgent {
        FakeAgent::start_as(c, "n0").await
    }

    /// The agent of node `node` (one of four A100s, as `NODE`).
    pub(crate) async fn start_as(c: &Coordinator, node: &str) -> FakeAgent {
        FakeAgent::start_with(c, node, NODE).await
    }

    /// The agent of node `node` with inventory `inventory` (JSON).
    pub(crate) async fn start_with(c: &Coordinator, node: &str, inventory: &str) -> FakeAgent {
        let token = c.agent_token.clone().unwrap();
        let mut agents = AgentClient::connect(c.grpc_url()).await.unwrap();
        let reply = agents
            .register(RegisterRequest {
                node: node.into(),
                inventory_json: inventory.into(),
                token: token.clone(),
                data_url: "127.0.0.1:7400".into(),
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        let (tx, rx) = mpsc::channel(16);
        let mut request = tonic::Request::new(tokio_stream::wrappers::ReceiverStream::new(rx));
        request.metadata_mut().insert("authorization", format!("Bearer {token}").parse().unwrap());
        let beat = AgentStatus { node: node.into(), epoch: reply.epoch, load: Some(pb::NodeLoad::default()), ..Default::default() };
        tx.send(AgentStatus { seq: 1, full: true, ..beat.clone() }).await.unwrap();
        let mut inbound = agents.heartbeat(request).await.unwrap().into_inner();
        let (to_test, instructions) = mpsc::unbounded_channel();
        tokio::spawn(async move {
            while let Ok(Some(i)) = inbound.message().await {
                let _ = to_test.send(i);
            }
        });
        let beats = {
            let tx = tx.clone();
            tokio::spawn(async move {
                while tx.send(beat.clone()).await.is_ok() {
                    tokio::time::sleep(Duration::from_millis(300)).await;
                }
            })
        };
        FakeAgent { node: node.into(), epoch: reply.epoch, tx, instructions, beats, seq: 1 }
    }

    pub(crate) async fn send(&mut self, status: AgentStatus) {
        self.seq += 1;
        self.tx.send(AgentStatus { node: self.node.clone(), epoch: self.epoch, seq: self.seq, ..status }).await.unwrap();
    }

    /// The next `Launch` sent down.
    pub(crate) async fn launch(&mut self) -> pb::Launch {
        self.next(|k| if let instruction::Kind::Launch(l) = k { Some(l) } else { None }).await
    }

    /// The next instruction `pick` takes (others are passed over), within 60 s.
    pub(crate) async fn next<T>(&mut self, pick: impl Fn(instruction::Kind) -> Option<T>) -> T {
        let wait = async {
            loop {
                if let Some(t) = self.instructions.recv().await.expect("the stream stays open").kind.and_then(&pick) {
                    return t;
                }
            }
        };
        tokio::time::timeout(Duration::from_secs(60), wait).await.expect("the instruction within 60 s")
    }
}

impl Drop for FakeAgent {
    fn drop(&mut self) {
        self.beats.abort();
    }
}

/// A blocking call off the async runtime.
pub(crate) async fn call(c: &Arc<Coordinator>, method: &str, path: &str, body: &str, want: u16) -> Value {
    let (c, method, path, body) = (c.clone(), method.to_string(), path.to_string(), body.to_string());
    tokio::task::spawn_blocking(move || c.json(&method, &path, &body, want)).await.unwrap()
}

/// The job's events as (kind, message), oldest first.
pub(crate) async fn events(c: &Arc<Coordinator>, id: i64) -> Vec<(String, String)> {
    let all = call(c, "GET", &format!("/api/v1/jobs/{id}/events"), "", 200).await;
    all.as_array().unwrap().iter().map(|e| (e["kind"].as_str().unwrap().to_string(), e["message"].as_str().unwrap().to_string())).collect()
}

/// Wait (at most 30 s) until `f` holds of the job's events.
async fn until_events(c: &Arc<Coordinator>, id: i64, what: &str, f: impl Fn(&[(String, String)]) -> bool) -> Vec<(String, String)> {
    let start = Instant::now();
    loop {
        let all = events(c, id).await;
        if f(&all) {
            return all;
        }
        assert!(start.elapsed() < Duration::from_secs(30), "{what}: {all:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A complete checkpoint step of the one-layer, one-rank model.
pub(crate) fn step_holdings(job: i64, step: u64) -> Vec<CkptHolding> {
    let unit = |block: &str, part: &str| CkptHolding {
        job,
        generation: 1,
        step,
        file: format!("{block}.{part}.tp0-1.safetensors"),
        bytes: 100,
        tier: "disk".into(),
        block: block.into(),
        part: part.into(),
        tp_rank: 0,
        tp_size: 1,
        rank: -1,
        layers: 1,
        world_size: 1,
        chunk_bytes: 16 << 20,
        crc32c: vec![0],
    };
    let mut all: Vec<CkptHolding> = ["embed", "layer.0", "head"].iter().flat_map(|b| [unit(b, "model"), unit(b, "optimizer")]).collect();
    all.push(CkptHolding { file: "rank.00000.safetensors".into(), rank: 0, block: String::new(), part: String::new(), ..unit("", "") });
    all
}

pub(crate) fn ran(job: i64, rank: i64, state: &str, exit_code: Option<i64>) -> RankStatus {
    RankStatus { job, generation: 1, rank, state: state.into(), exit_code, rejoined: None }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_jobs_events_read_as_what_happened() {
    let c = Arc::new(Coordinator::start(&temp_dir(), &["--heartbeat-ms", "300"]));
    let mut agent = FakeAgent::start(&c).await;

    // `replan:` that can never act is refused naming what stops it.
    let refused = |extra: &str| format!("name: r\nmodel: {MODEL}\nglobal_batch: 1\nrun: 'true'\nreplan: {{hold: 1s}}\n{extra}");
    let e = call(&c, "POST", "/api/v1/jobs", &refused(""), 400).await;
    assert!(e["error"].as_str().unwrap().contains("replan: ") && e["error"].as_str().unwrap().contains("(checkpoint:)"), "{e}");
    let plan = "plan: {global_batch: 1, micro_batch: 1, replicas: [{micro_batches: 1, stages: [{layers: [0, 1], gpu: A100-80G, tp: 1, dp: 1, gpus: [{node: n0, index: 0}]}]}]}\n";
    let e = call(&c, "POST", "/api/v1/jobs", &refused(&format!("checkpoint: {{every: 10}}\n{plan}")), 400).await;
    assert!(e["error"].as_str().unwrap().contains("(plan:)"), "{e}");

    // A job allowed 3 GPUs with a batch of 2 sequences is told why it runs on fewer.
    let job = format!("name: few\nmodel: {MODEL}\nglobal_batch: 2\nresources: {{gpus: 3}}\nrun: 'true'\n");
    let id = call(&c, "POST", "/api/v1/jobs", &job, 201).await["id"].as_i64().unwrap();
    let all = until_events(&c, id, "a plan event", |all| all.iter().any(|(k, _)| k == "plan")).await;
    let (_, plan_said) = all.iter().find(|(k, _)| k == "plan").unwrap();
    assert!(plan_said.contains("of the 3 GPUs it may use (resources.gpus: 3)") && plan_said.contains("global_batch is 2"), "{plan_said}");
    // No profiling agent: the roofline priced it, said once in one short line.
    let profiling: Vec<&String> = all.iter().filter(|(k, _)| k == "profiling").map(|(_, m)| m).collect();
    assert_eq!(profiling.len(), 1, "{profiling:?}");
    assert!(profiling[0].starts_with("priced by the roofline, not measured (seq 32, fp32): A100-80G ("), "{}", profiling[0]);
    assert_eq!(profiling[0].matches("can profile").count(), 1, "{}", profiling[0]);
    assert!(profiling[0].len() < 300, "{} characters: {}", profiling[0].len(), profiling[0]);
    let launch = agent.launch().await;
    assert_eq!(launch.job, id);
    // Its ranks start and end between two heartbeats: `running` comes before their exits.
    let mut statuses: Vec<RankStatus> = launch.ranks.iter().map(|r| ran(id, r.rank, "running", None)).collect();
    statuses.extend(launch.ranks.iter().map(|r| ran(id, r.rank, "exited", Some(0))));
    agent.send(AgentStatus { ranks: statuses, ..Default::default() }).await;
    let all = until_events(&c, id, "succeeded", |all| all.iter().any(|(k, _)| k == "succeeded")).await;
    let kinds: Vec<&str> = all.iter().map(|(k, _)| k.as_str()).filter(|k| ["rank", "running", "succeeded"].contains(k)).collect();
    let n = launch.ranks.len();
    let mut want = vec!["rank"; n];
    want.push("running");
    want.extend(vec!["rank"; n]);
    want.push("succeeded");
    assert_eq!(kinds, want, "{all:?}");

    // A one-node job that asked for `replan:` is told its links are not watched, once.
    let job = format!("name: alone\nmodel: {MODEL}\nglobal_batch: 1\nresources: {{gpus: 1}}\nrun: 'true'\ncheckpoint: {{every: 10}}\nreplan: {{hold: 1s}}\n");
    let id = call(&c, "POST", "/api/v1/jobs", &job, 201).await["id"].as_i64().unwrap();
    let launch = agent.launch().await;
    assert_eq!((launch.job, launch.ranks.len()), (id, 1));
    agent.send(AgentStatus { ranks: vec![ran(id, 0, "running", None)], ..Default::default() }).await;
    agent.send(AgentStatus { holdings: step_holdings(id, 10), holdings_sent: true, ..Default::default() }).await;
    let all = until_events(&c, id, "a replan event", |all| all.iter().any(|(k, _)| k == "replan")).await;
    let (_, said) = all.iter().find(|(k, _)| k == "replan").unwrap();
    assert!(said.contains("not watched") && said.contains("runs on one node"), "{said}");
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(events(&c, id).await.iter().filter(|(k, _)| k == "replan").count(), 1, "said once");
}
