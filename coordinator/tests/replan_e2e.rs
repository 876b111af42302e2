//! Re-planning a running job whose links changed (docs/network.md, "Decide"), on a real
//! coordinator process with stand-in agents over gRPC: the planner plans on the links they
//! measured (the plan says `"source": "measured"`); a running job with a complete checkpoint
//! whose link then drops ten-fold for longer than its `replan.hold` gets one `network_changed`
//! and one `replan_considered`, with the contract's fields.

use crate::common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{temp_dir, Coordinator};
use motley_proto::v1 as pb;
use motley_proto::v1::agent_client::AgentClient;
use motley_proto::v1::{instruction, AgentStatus, CkptHolding, Instruction, LinkSample, RankStatus, RegisterRequest};
use serde_json::Value;
use tokio::sync::mpsc;

/// 200 Gbit/s InfiniBand, one GPU: a two-GPU job spans two nodes.
const IB: &str = r#"{"gpu": "A100-80G", "gpus": 1, "nics": [{"name": "mlx5_0", "kind": "ib", "gbps": 200}], "rdma_domain": "lab"}"#;

/// A stand-in agent: registered with a data plane, heartbeating every 300 ms; `send` adds a
/// message of its own; what the coordinator sends down comes out of `instructions`.
struct FakeAgent {
    node: String,
    epoch: i64,
    tx: mpsc::Sender<AgentStatus>,
    instructions: mpsc::UnboundedReceiver<Instruction>,
    beats: tokio::task::JoinHandle<()>,
    seq: u64,
}

impl FakeAgent {
    async fn start(c: &Coordinator, node: &str, data_url: &str) -> FakeAgent {
        let agent_token = c.agent_token.clone().unwrap();
        let mut agents = AgentClient::connect(c.grpc_url()).await.unwrap();
        let reply = agents
            .register(RegisterRequest {
                node: node.into(),
                inventory_json: IB.into(),
                token: agent_token.clone(),
                data_url: data_url.into(),
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        let (tx, rx) = mpsc::channel(16);
        let mut request = tonic::Request::new(tokio_stream::wrappers::ReceiverStream::new(rx));
        request.metadata_mut().insert("authorization", format!("Bearer {agent_token}").parse().unwrap());
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

    async fn send(&mut self, status: AgentStatus) {
        self.seq += 1;
        self.tx.send(AgentStatus { node: self.node.clone(), epoch: self.epoch, seq: self.seq, ..status }).await.unwrap();
    }

    /// The next `Launch` sent to this node.
    async fn launch(&mut self) -> pb::Launch {
        let wait = async {
            loop {
                if let Some(instruction::Kind::Launch(l)) = self.instructions.recv().await.expect("the stream stays open").kind {
                    return l;
                }
            }
        };
        tokio::time::timeout(Duration::from_secs(60), wait).await.expect("a launch within 60 s")
    }
}

impl Drop for FakeAgent {
    fn drop(&mut self) {
        self.beats.abort();
    }
}

fn sample(peer: &str, gb_per_s: f64) -> LinkSample {
    LinkSample { peer: peer.into(), nic_kind: "ib".into(), gb_per_s, latency_ms: 0.25, at_unix_ms: now_ms() }
}

fn now_ms() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as i64
}

/// A blocking call off the async runtime.
async fn call(c: &Arc<Coordinator>, method: &str, path: &str, body: &str, want: u16) -> Value {
    let (c, method, path, body) = (c.clone(), method.to_string(), path.to_string(), body.to_string());
    tokio::task::spawn_blocking(move || c.json(&method, &path, &body, want)).await.unwrap()
}

/// A complete checkpoint step of a one-layer, one-rank manifest (what completeness reads).
fn step_holdings(job: i64, step: u64) -> Vec<CkptHolding> {
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

/// Events of `kind` of job `id`, their messages parsed.
async fn events(c: &Arc<Coordinator>, id: i64, kind: &str) -> Vec<Value> {
    let all = call(c, "GET", &format!("/api/v1/jobs/{id}/events"), "", 200).await;
    all.as_array()
        .unwrap()
        .iter()
        .filter(|e| e["kind"] == kind)
        .map(|e| serde_json::from_str(e["message"].as_str().unwrap()).unwrap_or_else(|_| panic!("{kind} is JSON: {e}")))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_running_jobs_link_that_drops_is_reported_once_and_weighed_for_a_replan() {
    let c = Arc::new(Coordinator::start(&temp_dir(), &["--heartbeat-ms", "1000"]));
    let mut a = FakeAgent::start(&c, "n0", "127.0.0.1:7300").await;
    let mut b = FakeAgent::start(&c, "n1", "127.0.0.1:7301").await;
    let job = "name: drops\nmodel: gpt3-1.3b\nglobal_batch: 16\nresources: {gpus: 2}\nrun: 'true'\n\
               checkpoint: {every: 10}\nsteps: 1000000\nreplan: {hold: 1s, cooldown: 10m}\n";

    // Before any measurement the plan assumes the declared links.
    let dry = call(&c, "POST", "/api/v1/plan", job, 200).await;
    assert_eq!(dry["plan"]["network"]["source"], "declared", "{}", dry["plan"]["network"]);
    // Measured at 20 GB/s: a plan made now says so, per pair of its nodes.
    let start = Instant::now();
    let dry = loop {
        a.send(AgentStatus { links: vec![sample("n1", 20.0)], ..Default::default() }).await;
        let dry = call(&c, "POST", "/api/v1/plan", job, 200).await;
        if dry["plan"]["network"]["source"] == "measured" {
            break dry;
        }
        assert!(start.elapsed() < Duration::from_secs(20), "the plan never used the measurement: {}", dry["plan"]["network"]);
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let links = dry["plan"]["network"]["links"].as_array().unwrap();
    assert_eq!(links.len(), 1, "{links:?}");
    assert_eq!((links[0]["a"].as_str(), links[0]["b"].as_str()), (Some("n0"), Some("n1")));
    assert_eq!((links[0]["gb_per_s"].as_f64(), links[0]["measured"].as_bool()), (Some(20.0), Some(true)));

    // The job runs on both nodes and has a complete checkpoint.
    let id = call(&c, "POST", "/api/v1/jobs", job, 201).await["id"].as_i64().unwrap();
    for agent in [&mut a, &mut b] {
        let launch = agent.launch().await;
        assert_eq!(launch.job, id);
        let ranks = launch.ranks.iter().map(|r| RankStatus {
            job: id,
            generation: 1,
            rank: r.rank,
            state: "running".into(),
            exit_code: None,
            rejoined: None,
        });
        agent.send(AgentStatus { ranks: ranks.collect(), ..Default::default() }).await;
    }
    let plan = call(&c, "GET", &format!("/api/v1/jobs/{id}/plan"), "", 200).await;
    assert_eq!(plan["plan"]["network"]["source"], "measured", "{}", plan["plan"]["network"]);
    a.send(AgentStatus { holdings: step_holdings(id, 10), holdings_sent: true, ..Default::default() }).await;
    let start = Instant::now();
    loop {
        let j = call(&c, "GET", &format!("/api/v1/jobs/{id}"), "", 200).await;
        let steps = call(&c, "GET", &format!("/api/v1/jobs/{id}/checkpoints"), "", 200).await;
        if j["state"] == "running" && steps[0]["complete"] == true {
            break;
        }
        assert!(start.elapsed() < Duration::from_secs(30), "not running with a checkpoint: {j} {steps}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(events(&c, id, "network_changed").await.is_empty(), "nothing changed yet");

    // The link drops to 2 GB/s and stays there: past the 1 s hold it is a change.
    let start = Instant::now();
    let changed = loop {
        a.send(AgentStatus { links: vec![sample("n1", 2.0)], ..Default::default() }).await;
        let changed = events(&c, id, "network_changed").await;
        if !changed.is_empty() && !events(&c, id, "replan_considered").await.is_empty() {
            break changed;
        }
        assert!(start.elapsed() < Duration::from_secs(30), "no change seen: {changed:?}");
        tokio::time::sleep(Duration::from_millis(300)).await;
    };
    assert_eq!(changed[0]["link"], serde_json::json!({"a": "n0", "b": "n1", "nic_kind": "ib"}));
    assert_eq!((changed[0]["was"].as_f64(), changed[0]["now"].as_f64()), (Some(20.0), Some(2.0)));
    // Still down for a few more intervals: reported once, weighed once.
    for _ in 0..10 {
        a.send(AgentStatus { links: vec![sample("n1", 2.0)], ..Default::default() }).await;
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    assert_eq!(events(&c, id, "network_changed").await.len(), 1, "once per change");
    let considered = events(&c, id, "replan_considered").await;
    assert_eq!(considered.len(), 1, "{considered:?}");
    let r = &considered[0];
    assert!(r["gain_s"].as_f64().unwrap() >= 0.0 && r["cost_s"].as_f64().unwrap() > 0.0, "{r}");
    let decision = r["decision"].as_str().unwrap();
    assert!(decision == "switch" || decision == "keep", "{r}");
    assert_eq!(decision == "switch", r["gain_s"].as_f64() > r["cost_s"].as_f64(), "switch iff the gain beats the cost: {r}");
    for side in ["plan_before", "plan_after"] {
        assert!(r[side]["iteration_time_s"].as_f64().unwrap() > 0.0, "{r}");
        assert!(r[side]["shape"].as_str().unwrap().contains("A100-80G tp"), "{r}");
    }
    assert!(!r["reason"].as_str().unwrap().is_empty(), "{r}");
    // Ten-fold slower gradient rings over a million steps left: a plan for the measured link
    // pays for the switch.
    assert_eq!(decision, "switch", "{r}");
    assert_eq!(r["at_step"], 10, "{r}");
    // The switch waits for the next complete checkpoint, then goes by the recovery path.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(call(&c, "GET", &format!("/api/v1/jobs/{id}"), "", 200).await["state"], "running", "not before the next checkpoint");
    let mut both = step_holdings(id, 10);
    both.extend(step_holdings(id, 20));
    a.send(AgentStatus { holdings: both, holdings_sent: true, ..Default::default() }).await;
    let start = Instant::now();
    let recovering = loop {
        let all = call(&c, "GET", &format!("/api/v1/jobs/{id}/events"), "", 200).await;
        if let Some(e) = all.as_array().unwrap().iter().find(|e| e["kind"] == "recovering") {
            break e["message"].as_str().unwrap().to_string();
        }
        assert!(start.elapsed() < Duration::from_secs(30), "no switch: {all}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert!(recovering.contains("(re-plan)") && recovering.contains("step 20"), "{recovering}");
}

/// Every message of `kind` events of job `id`, as they are.
async fn messages(c: &Arc<Coordinator>, id: i64, kind: &str) -> Vec<String> {
    let all = call(c, "GET", &format!("/api/v1/jobs/{id}/events"), "", 200).await;
    all.as_array().unwrap().iter().filter(|e| e["kind"] == kind).map(|e| e["message"].as_str().unwrap().to_string()).collect()
}

/// A failed rank's recovery plans on what is known then: links measured far slower than
/// declared make a plan on one GPU faster, and the recovery says so in an event, pricing the
/// plan it replaces on the same inputs (it seeds the search); the job that then succeeds keeps
/// no failure as its reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_recovery_that_leaves_gpus_idle_says_why_beside_the_plan_it_replaces() {
    let c = Arc::new(Coordinator::start(&temp_dir(), &["--heartbeat-ms", "1000"]));
    let mut a = FakeAgent::start(&c, "n0", "127.0.0.1:7302").await;
    let mut b = FakeAgent::start(&c, "n1", "127.0.0.1:7303").await;
    let job = "name: flaky\nmodel: gpt3-1.3b\nglobal_batch: 16\nresources: {gpus: 2}\nrun: 'true'\n\
               checkpoint: {every: 10}\nmax_restarts: 1\nmax_preemptions: 0\n";
    let id = call(&c, "POST", "/api/v1/jobs", job, 201).await["id"].as_i64().unwrap();
    let mut ranks = vec![];
    for agent in [&mut a, &mut b] {
        let launch = agent.launch().await;
        let running = launch.ranks.iter().map(|r| RankStatus {
            job: id,
            generation: 1,
            rank: r.rank,
            state: "running".into(),
            exit_code: None,
            rejoined: None,
        });
        agent.send(AgentStatus { ranks: running.collect(), ..Default::default() }).await;
        ranks.push(launch.ranks.iter().map(|r| r.rank).collect::<Vec<_>>());
    }
    let first = call(&c, "GET", &format!("/api/v1/jobs/{id}/plan"), "", 200).await;
    assert_eq!(first["plan"]["gpus_used"], 2, "declared 200 Gbit/s: both GPUs ({})", first["plan"]);
    // The link between them measured at 1 MB/s; then n0's rank fails and n1's is stopped.
    let start = Instant::now();
    loop {
        a.send(AgentStatus { links: vec![sample("n1", 0.001)], ..Default::default() }).await;
        let net = call(&c, "GET", "/api/v1/net", "", 200).await;
        if net["links"].as_array().is_some_and(|l| l.iter().any(|l| l["gb_per_s"].as_f64() == Some(0.001))) {
            break;
        }
        assert!(start.elapsed() < Duration::from_secs(20), "the measurement never arrived: {net}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let exited =
        |rank: i64, code: i64| RankStatus { job: id, generation: 1, rank, state: "exited".into(), exit_code: Some(code), rejoined: None };
    a.send(AgentStatus { ranks: ranks[0].iter().map(|&r| exited(r, 1)).collect(), ..Default::default() }).await;
    b.send(AgentStatus { ranks: ranks[1].iter().map(|&r| exited(r, 143)).collect(), ..Default::default() }).await;
    let start = Instant::now();
    let (on_a, launch) = loop {
        let (on_a, launch) = tokio::select! { l = a.launch() => (true, l), l = b.launch() => (false, l) };
        if launch.generation == 2 {
            break (on_a, launch);
        }
        assert!(start.elapsed() < Duration::from_secs(30), "no second generation");
    };
    assert_eq!(launch.ranks.len(), 1, "one GPU is faster over a 1 MB/s link");
    let said = messages(&c, id, "plan").await;
    assert_eq!(said.len(), 1, "{said:?}");
    let said = &said[0];
    assert!(said.starts_with("the plan uses 1 of the 2 GPUs it may use (resources.gpus: 2); 1 stays idle"), "{said}");
    assert!(said.contains("the plan it replaces, on its 2 GPUs, takes"), "{said}");
    let second = call(&c, "GET", &format!("/api/v1/jobs/{id}/plan"), "", 200).await;
    assert_eq!(second["generation"], 2, "{second}");
    let new_s = second["plan"]["iteration_time_s"].as_f64().unwrap();
    assert!(said.ends_with(&format!("this one {new_s:.3e} s")), "{said} against {new_s}");
    // It runs to the end: succeeded, and no failure is its reason.
    let agent = if on_a { &mut a } else { &mut b };
    let rank = launch.ranks[0].rank;
    let status = |state: &str, exit_code| RankStatus { job: id, generation: 2, rank, state: state.into(), exit_code, rejoined: None };
    agent.send(AgentStatus { ranks: vec![status("running", None)], ..Default::default() }).await;
    agent.send(AgentStatus { ranks: vec![status("exited", Some(0))], ..Default::default() }).await;
    let start = Instant::now();
    loop {
        let j = call(&c, "GET", &format!("/api/v1/jobs/{id}"), "", 200).await;
        if j["state"] == "succeeded" {
            assert!(j["reason"].is_null(), "{j}");
            break;
        }
        assert!(start.elapsed() < Duration::from_secs(30), "not succeeded: {j}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
