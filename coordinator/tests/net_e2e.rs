//! The live link matrix of a real coordinator process (docs/network.md, "The link matrix"):
//! stand-in agents report link samples and NIC rates on their heartbeats; REST
//! (`GET /api/v1/net`), gRPC (`GetNetwork`) and /metrics show them with their history, beside
//! the declared rate, and the `bandwidth` section reads as a `motley replan --bandwidth` file;
//! nonsense is dropped; `node` filters, an unknown node is refused naming it. A launch names
//! each node's peers with their data planes.

use crate::common;

use std::sync::Arc;
use std::time::Duration;

use common::{temp_dir, Coordinator};
use motley_proto::v1 as pb;
use motley_proto::v1::agent_client::AgentClient;
use motley_proto::v1::control_client::ControlClient;
use motley_proto::v1::{instruction, AgentStatus, Instruction, LinkSample, NicRate, RegisterRequest};
use serde_json::Value;
use tokio::sync::mpsc;
use tonic::Code;

/// 200 Gbit/s InfiniBand, one GPU.
const IB: &str = r#"{"gpu": "A100-80G", "gpus": 1, "nics": [{"name": "mlx5_0", "kind": "ib", "gbps": 200}], "rdma_domain": "lab"}"#;

/// A stand-in agent: registered, heartbeating (with a load, as an interval heartbeat) every
/// 300 ms; `send` adds a message of its own; what the coordinator sends down comes out of `instructions`.
struct FakeAgent {
    node: String,
    epoch: i64,
    tx: mpsc::Sender<AgentStatus>,
    instructions: mpsc::UnboundedReceiver<Instruction>,
    beats: tokio::task::JoinHandle<()>,
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
        FakeAgent { node: node.into(), epoch: reply.epoch, tx, instructions, beats }
    }

    async fn send(&self, links: Vec<LinkSample>, nics: Vec<NicRate>) {
        let status = AgentStatus { node: self.node.clone(), epoch: self.epoch, links, nics, ..Default::default() };
        self.tx.send(status).await.unwrap();
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

fn sample(peer: &str, nic_kind: &str, gb_per_s: f64, at_unix_ms: i64) -> LinkSample {
    LinkSample { peer: peer.into(), nic_kind: nic_kind.into(), gb_per_s, latency_ms: 0.25, at_unix_ms }
}

fn now_ms() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as i64
}

fn authed<T>(msg: T, token: &str) -> tonic::Request<T> {
    let mut r = tonic::Request::new(msg);
    r.metadata_mut().insert("authorization", format!("Bearer {token}").parse().unwrap());
    r
}

/// A blocking call off the async runtime.
async fn get(c: &Arc<Coordinator>, path: &str, want: u16) -> Value {
    let (c, path) = (c.clone(), path.to_string());
    tokio::task::spawn_blocking(move || c.json("GET", &path, "", want)).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn measured_links_reach_rest_grpc_and_metrics_with_their_history() {
    let c = Arc::new(Coordinator::start(&temp_dir(), &["--heartbeat-ms", "1000"]));
    let token = c.token.clone().unwrap();
    let n0 = FakeAgent::start(&c, "n0", "127.0.0.1:7100").await;
    let _n1 = FakeAgent::start(&c, "n1", "127.0.0.1:7101").await;
    let _n2 = FakeAgent::start(&c, "n2", "").await;
    // A node of the inventory whose agent never came: known, but no link to it is taken.
    tokio::task::spawn_blocking({
        let c = c.clone();
        move || c.json("PUT", "/api/v1/nodes/n3", "gpu: A100-80G\ngpus: 1\n", 200)
    })
    .await
    .unwrap();
    let t = now_ms() - 5_000;
    n0.send(
        vec![
            sample("n1", "eth", 1.25, t),
            sample("n1", "eth", 0.5, t + 1_000),
            // From the future: taken at the coordinator's clock.
            sample("n2", "ib", 20.0, t + 3_600_000),
            // Nonsense: a peer no agent registered, itself, a kind that is no token, no number.
            sample("ghost", "eth", 1.0, t),
            sample("n3", "eth", 1.0, t),
            sample("n0", "eth", 1.0, t),
            sample("n1", "e t h", 1.0, t),
            sample("n1", "eth", f64::NAN, t),
            sample("n1", "eth", -1.0, t),
        ],
        vec![
            NicRate { name: "mlx5_0:1".into(), kind: "ib".into(), tx_gb_per_s: 2.5, rx_gb_per_s: 1.5, at_unix_ms: t },
            NicRate { name: "bad\nname".into(), kind: "ib".into(), tx_gb_per_s: 1.0, rx_gb_per_s: 1.0, at_unix_ms: t },
        ],
    )
    .await;
    let start = std::time::Instant::now();
    let net = loop {
        let net = get(&c, "/api/v1/net", 200).await;
        if net["links"].as_array().unwrap().len() >= 2 && !net["nics"].as_array().unwrap().is_empty() {
            break net;
        }
        assert!(start.elapsed() < Duration::from_secs(20), "the links never arrived: {net}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let links = net["links"].as_array().unwrap();
    assert_eq!(links.len(), 2, "nonsense is dropped: {net}");
    let eth = &links[0];
    assert_eq!((eth["a"].as_str(), eth["b"].as_str(), eth["nic_kind"].as_str()), (Some("n0"), Some("n1"), Some("eth")), "{net}");
    assert_eq!((eth["gb_per_s"].as_f64(), eth["latency_ms"].as_f64(), eth["samples"].as_u64()), (Some(1.25), Some(0.25), Some(2)));
    assert_eq!(eth["updated_unix_ms"].as_i64(), Some(t + 1_000));
    let history: Vec<(i64, f64)> =
        eth["history"].as_array().unwrap().iter().map(|p| (p["at_unix_ms"].as_i64().unwrap(), p["gb_per_s"].as_f64().unwrap())).collect();
    assert_eq!(history, [(t, 1.25), (t + 1_000, 0.5)]);
    // The declared rate: 200 Gbit/s InfiniBand at the planner's 85%.
    assert_eq!(eth["declared_gb_per_s"].as_f64(), Some(200.0 / 8.0 * 0.85));
    let ib = &links[1];
    assert_eq!((ib["b"].as_str(), ib["nic_kind"].as_str(), ib["gb_per_s"].as_f64()), (Some("n2"), Some("ib"), Some(20.0)));
    let at = ib["updated_unix_ms"].as_i64().unwrap();
    assert!(at <= now_ms() && at > t, "a sample from the future is taken at the coordinator's clock: {at}");
    assert_eq!(net["nics"].as_array().unwrap().len(), 1, "{net}");
    let nic = &net["nics"][0];
    assert_eq!((nic["node"].as_str(), nic["name"].as_str(), nic["tx_gb_per_s"].as_f64()), (Some("n0"), Some("mlx5_0:1"), Some(2.5)));

    // The bandwidth section is a `motley replan --bandwidth` file: the slowest kind per pair.
    let spec: motley_solver::bandwidth::BandwidthSpec = serde_json::from_value(net["bandwidth"].clone()).unwrap();
    let pairs: Vec<(&str, &str, f64)> = spec.pairs.iter().map(|p| (p.a.as_str(), p.b.as_str(), p.gb_per_s)).collect();
    assert_eq!(pairs, [("n0", "n1", 1.25), ("n0", "n2", 20.0)]);
    let nodes: Vec<motley_solver::hardware::NodeSpec> = ["n0", "n1", "n2"]
        .iter()
        .map(|n| {
            let mut v: Value = serde_json::from_str(IB).unwrap();
            v["name"] = (*n).into();
            serde_json::from_value(v).unwrap()
        })
        .collect();
    let cluster = motley_solver::Cluster::from_spec(&motley_solver::ClusterSpec { name: "lab".into(), nodes, gpu_types: vec![] }).unwrap();
    assert_eq!(spec.resolve(&cluster).unwrap().len(), 2, "the pairs name the cluster's nodes");

    // One node's part: its links, its NICs, its pairs.
    let one = get(&c, "/api/v1/net?node=n2", 200).await;
    assert_eq!(one["links"].as_array().unwrap().len(), 1, "{one}");
    assert_eq!(one["links"][0]["b"], "n2");
    assert!(one["nics"].as_array().unwrap().is_empty(), "{one}");
    assert_eq!(one["bandwidth"]["pairs"].as_array().unwrap().len(), 1, "{one}");
    assert_eq!(get(&c, "/api/v1/net?node=n3", 200).await["links"], serde_json::json!([]));
    let bad = get(&c, "/api/v1/net?node=ghost", 400).await;
    let msg = bad["error"].as_str().unwrap();
    assert!(msg.contains("'ghost'") && msg.contains("motley node list"), "{msg}");

    // gRPC: the same document.
    grpc_serves_the_same_links(&c, &token, t, &pairs).await;

    // /metrics: a gauge per link; the OpenAPI document: the route.
    let (metrics, openapi) = tokio::task::spawn_blocking({
        let c = c.clone();
        move || (c.call_as(None, "GET", "/metrics", "").1, c.json("GET", "/api/v1/openapi.json", "", 200))
    })
    .await
    .unwrap();
    for line in
        ["motley_link_gb_per_s{a=\"n0\",b=\"n1\",nic_kind=\"eth\"} 1.25", "motley_link_latency_ms{a=\"n0\",b=\"n2\",nic_kind=\"ib\"} 0.25"]
    {
        assert!(metrics.lines().any(|l| l == line), "no '{line}' in\n{metrics}");
    }
    assert!(openapi["paths"]["/api/v1/net"]["get"].is_object(), "{}", openapi["paths"]);
}

/// What `/api/v1/net` said, through gRPC Control's `GetNetwork`.
async fn grpc_serves_the_same_links(c: &Coordinator, token: &str, t: i64, pairs: &[(&str, &str, f64)]) {
    let mut g = ControlClient::connect(c.grpc_url()).await.unwrap();
    let all = g.get_network(authed(pb::GetNetworkRequest { node: String::new() }, token)).await.unwrap().into_inner();
    assert_eq!(all.links.len(), 2);
    let l = &all.links[0];
    assert_eq!((l.a.as_str(), l.b.as_str(), l.samples, l.history.len()), ("n0", "n1", 2, 2));
    assert_eq!((l.history[1].at_unix_ms, l.history[1].gb_per_s), (t + 1_000, 0.5));
    assert_eq!(l.declared_gb_per_s, Some(200.0 / 8.0 * 0.85));
    assert_eq!(all.nics.len(), 1);
    assert_eq!(all.bandwidth.iter().map(|p| (p.a.as_str(), p.b.as_str(), p.gb_per_s)).collect::<Vec<_>>(), pairs);
    let one = g.get_network(authed(pb::GetNetworkRequest { node: "n1".into() }, token)).await.unwrap().into_inner();
    assert_eq!((one.links.len(), one.links[0].b.as_str(), one.nics.len()), (1, "n1", 0));
    let e = g.get_network(authed(pb::GetNetworkRequest { node: "ghost".into() }, token)).await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);
    assert!(e.message().contains("'ghost'") && e.message().contains("motley node list"), "{}", e.message());
    // And without the operators' token, nothing.
    let e = g.get_network(tonic::Request::new(pb::GetNetworkRequest::default())).await.unwrap_err();
    assert_eq!(e.code(), Code::Unauthenticated);
}

/// Each node's `Launch` names the other nodes of the plan with the data plane each registered;
/// a node without one is left out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_launch_names_each_nodes_peers_and_their_data_planes() {
    let c = Arc::new(Coordinator::start(&temp_dir(), &["--heartbeat-ms", "1000"]));
    let mut agents = vec![
        FakeAgent::start(&c, "p0", "127.0.0.1:7200").await,
        FakeAgent::start(&c, "p1", "tls://p1.lab:7201").await,
        FakeAgent::start(&c, "p2", "").await,
    ];
    let job = "name: peers\nmodel: gpt3-1.3b\nglobal_batch: 24\nresources: {gpus: 3}\nrun: 'true'\n";
    let id = tokio::task::spawn_blocking({
        let c = c.clone();
        move || c.json("POST", "/api/v1/jobs", job, 201)["id"].as_i64().unwrap()
    })
    .await
    .unwrap();
    let mut peers = std::collections::BTreeMap::new();
    for a in &mut agents {
        let launch = a.launch().await;
        assert_eq!(launch.job, id);
        let named: Vec<(String, String)> = launch.peers.iter().map(|p| (p.node.clone(), p.data_url.clone())).collect();
        peers.insert(a.node.clone(), named);
    }
    let p = |n: &str, u: &str| (n.to_string(), u.to_string());
    assert_eq!(peers["p0"], [p("p1", "tls://p1.lab:7201")]);
    assert_eq!(peers["p1"], [p("p0", "127.0.0.1:7200")]);
    assert_eq!(peers["p2"], [p("p0", "127.0.0.1:7200"), p("p1", "tls://p1.lab:7201")]);
}
