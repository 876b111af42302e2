//! The gRPC control service, the OpenAPI document and /metrics of a real coordinator process:
//! the same operations as REST, the same errors (codes, fields named), a watch stream that ends
//! when the job is over.

use crate::common;

use common::{temp_dir, Coordinator};
use motley_proto::v1 as pb;
use motley_proto::v1::control_client::ControlClient;
use serde_json::Value;
use std::time::Duration;
use tonic::transport::Channel;

use tonic::Code;

const NODE: &str = "gpu: A100-80G\ngpus: 8\nnics: [{name: mlx5_0, kind: ib, gbps: 200}]\nrdma_domain: lab\n";
const JOB: &str = "name: hello\nmodel: gpt3-1.3b\nglobal_batch: 32\nresources: {gpus: 8}\nrun: 'true'\n";

fn authed<T>(msg: T, token: &str) -> tonic::Request<T> {
    let mut r = tonic::Request::new(msg);
    r.metadata_mut().insert("authorization", format!("Bearer {token}").parse().unwrap());
    r
}

async fn client(c: &Coordinator) -> ControlClient<Channel> {
    ControlClient::connect(format!("http://{}", c.grpc)).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_control_service_does_what_rest_does() {
    let c = Coordinator::start(&temp_dir(), &[]);
    let token = c.token.clone().expect("a generated token");
    for n in ["a100-0", "a100-1"] {
        c.json("PUT", &format!("/api/v1/nodes/{n}"), NODE, 200);
    }
    let mut g = client(&c).await;

    // Nodes: list, describe, drain, undrain.
    let nodes = g.list_nodes(authed(pb::ListNodesRequest {}, &token)).await.unwrap().into_inner().nodes;
    assert_eq!(nodes.iter().map(|n| n.name.as_str()).collect::<Vec<_>>(), ["a100-0", "a100-1"]);
    assert!(!nodes[0].live, "no agent runs");
    let inv: Value = serde_json::from_str(&nodes[0].inventory_json).unwrap();
    assert_eq!(inv["gpus"], 8);
    let drained = g.drain_node(authed(pb::DrainNodeRequest { name: "a100-1".into(), deadline_s: 0 }, &token)).await.unwrap().into_inner();
    assert_eq!(drained.state, "draining");
    assert_eq!(g.describe_node(authed(pb::NodeRef { name: "a100-1".into() }, &token)).await.unwrap().into_inner().state, "draining");
    // A dry run plans on active nodes only: everything lands on a100-0.
    let dry = g.dry_run_plan(authed(pb::JobFile { text: JOB.into() }, &token)).await.unwrap().into_inner();
    assert_eq!(dry.ranks.len(), 8);
    assert!(dry.ranks.iter().all(|r| r.node == "a100-0" && r.state == "assigned"), "{:?}", dry.ranks);
    let plan: Value = serde_json::from_str(&dry.plan_json).unwrap();
    assert_eq!(plan["gpus_used"], 8);
    g.undrain_node(authed(pb::NodeRef { name: "a100-1".into() }, &token)).await.unwrap();
    // A preemption notice longer than a week is refused naming the field; the node stays active.
    let week = g.drain_node(authed(pb::DrainNodeRequest { name: "a100-1".into(), deadline_s: 8 * 86_400 }, &token)).await.unwrap_err();
    assert_eq!(week.code(), tonic::Code::InvalidArgument);
    assert!(week.message().starts_with("deadline_s: 691200 s is more than a week"), "{}", week.message());
    assert_eq!(g.describe_node(authed(pb::NodeRef { name: "a100-1".into() }, &token)).await.unwrap().into_inner().state, "active");
    // The same over REST, and a deadline that is not a number of seconds.
    let bad = c.json("POST", "/api/v1/nodes/a100-1/drain?deadline_s=2m", "", 400);
    assert!(bad["error"].as_str().unwrap().contains("deadline_s"), "{bad}");
    let week = c.json("POST", "/api/v1/nodes/a100-1/drain?deadline_s=691200", "", 400);
    assert!(week["error"].as_str().unwrap().starts_with("deadline_s:"), "{week}");
    let noticed = c.json("POST", "/api/v1/nodes/a100-1/drain?deadline_s=120", "", 200);
    assert_eq!(noticed["state"], "draining");
    g.undrain_node(authed(pb::NodeRef { name: "a100-1".into() }, &token)).await.unwrap();
    let jobs_before = g.list_jobs(authed(pb::ListJobsRequest {}, &token)).await.unwrap().into_inner().jobs;
    assert!(jobs_before.is_empty(), "a dry run stores nothing");

    // Submit and watch: the stream carries every event and ends when the job is over (no
    // agent is live, so planning finds no live node and the job fails with that reason).
    let job = g.submit_job(authed(pb::JobFile { text: JOB.into() }, &token)).await.unwrap().into_inner();
    assert_eq!(job.state, "submitted");
    let mut watch = g.watch_job(authed(pb::WatchJobRequest { id: job.id, after: 0 }, &token)).await.unwrap().into_inner();
    let mut kinds = vec![];
    while let Some(e) = watch.message().await.unwrap() {
        assert_eq!(e.job_id, Some(job.id));
        kinds.push(e.kind);
    }
    assert_eq!(kinds, ["submitted", "planning", "failed"]);
    let done = g.get_job(authed(pb::JobRef { id: job.id }, &token)).await.unwrap().into_inner();
    assert_eq!((done.state.as_str(), done.generation), ("failed", 0));
    assert!(done.reason.unwrap().contains("no live node"));
    let e = g.get_plan(authed(pb::JobRef { id: job.id }, &token)).await.unwrap_err();
    assert_eq!(e.code(), Code::NotFound, "nothing was launched: {e:?}");
    // The same job over REST, the same answer.
    let rest = c.json("GET", &format!("/api/v1/jobs/{}", job.id), "", 200);
    assert_eq!(rest["state"], "failed");

    // Errors: the same codes as REST's statuses, the field named.
    let e = g.cancel_job(authed(pb::JobRef { id: job.id }, &token)).await.unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
    assert_eq!(c.call("POST", &format!("/api/v1/jobs/{}/cancel", job.id), "").0, 409);
    let e = g.get_job(authed(pb::JobRef { id: 999 }, &token)).await.unwrap_err();
    assert_eq!(e.code(), Code::NotFound);
    let e = g
        .submit_job(authed(pb::JobFile { text: "name: x\nmodel: gpt3-1.3b\nglobal_batch: -1\nrun: 'true'\n".into() }, &token))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);
    assert!(e.message().contains("global_batch"), "{}", e.message());
    let e = g.list_nodes(authed(pb::ListNodesRequest {}, "wrong")).await.unwrap_err();
    assert_eq!(e.code(), Code::Unauthenticated);
    let e = g.list_nodes(pb::ListNodesRequest {}).await.unwrap_err();
    assert_eq!(e.code(), Code::Unauthenticated);
    assert_eq!(g.list_jobs(authed(pb::ListJobsRequest {}, &token)).await.unwrap().into_inner().jobs.len(), 1, "nothing changed");

    let leader = g.get_leader(authed(pb::LeaderRequest {}, &token)).await.unwrap().into_inner();
    assert!(leader.is_leader);
    assert_eq!(leader.grpc_url, format!("http://{}", c.grpc));

    // Layer profiles (measured ones: profiles_e2e.rs): none stored yet, over both APIs; a run
    // needs a live agent that can profile, named; a bad request names its field.
    let profiles = g.list_profiles(authed(pb::ListProfilesRequest::default(), &token)).await.unwrap().into_inner().profiles;
    assert!(profiles.is_empty());
    assert_eq!(c.json("GET", "/api/v1/profiles", "", 200), serde_json::json!([]));
    let e = g.get_profile(authed(pb::ProfileRef { id: 7 }, &token)).await.unwrap_err();
    assert_eq!(e.code(), Code::NotFound);
    assert_eq!(c.call("GET", "/api/v1/profiles/7", "").0, 404);
    let run = "{model: gpt3-1.3b, tp: 1, micro_batch: 2}";
    let e = g.run_profile(authed(pb::ProfileRunRequest { text: run.into() }, &token)).await.unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
    assert!(e.message().contains("can profile (start its agent with --python"), "{}", e.message());
    let (status, body) = c.call("POST", "/api/v1/profiles/runs", run);
    assert_eq!(status, 409, "{body}");
    let e = g
        .run_profile(authed(pb::ProfileRunRequest { text: "{model: gpt3-1.3b, tp: 3, micro_batch: 2}".into() }, &token))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);
    assert!(e.message().starts_with("tp:"), "{}", e.message());
    let (status, body) = c.call("POST", "/api/v1/profiles/runs", "{model: gpt3-1.3b, tp: 1, micro_batch: 2, colour: red}");
    assert_eq!(status, 400);
    assert!(body.contains("colour"), "{body}");
    let e = g.get_profile_run(authed(pb::ProfileRunRef { request: 1 }, &token)).await.unwrap_err();
    assert_eq!(e.code(), Code::NotFound);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_emulated_node_says_so_on_both_doors_and_a_real_one_says_nothing() {
    let c = Coordinator::start(&temp_dir(), &[]);
    let token = c.token.clone().expect("a generated token");
    c.json("PUT", "/api/v1/nodes/real", NODE, 200);
    c.json("PUT", "/api/v1/nodes/emu", &format!("{NODE}emulate: {{cpu: 0.3}}\n"), 200);
    let rest = c.json("GET", "/api/v1/nodes", "", 200);
    let rest: Vec<(&str, Option<&Value>)> =
        rest.as_array().unwrap().iter().map(|n| (n["name"].as_str().unwrap(), n.get("emulated"))).collect();
    assert_eq!(rest, [("emu", Some(&Value::Bool(true))), ("real", None)], "REST: emulated, absent when false");
    let mut g = client(&c).await;
    let nodes = g.list_nodes(authed(pb::ListNodesRequest {}, &token)).await.unwrap().into_inner().nodes;
    let grpc: Vec<(&str, bool)> = nodes.iter().map(|n| (n.name.as_str(), n.emulated)).collect();
    assert_eq!(grpc, [("emu", true), ("real", false)], "gRPC: the same");
    // A share that is no share is refused naming the field.
    let bad = c.json("PUT", "/api/v1/nodes/bad", &format!("{NODE}emulate: {{cpu: 0}}\n"), 400);
    assert!(bad.to_string().contains("emulate.cpu"), "{bad}");
}

#[test]
fn openapi_metrics_and_query_errors() {
    let c = Coordinator::start(&temp_dir(), &[]);
    // The document is public and lists every route.
    let (status, doc) = c.call_as(None, "GET", "/api/v1/openapi.json", "");
    assert_eq!(status, 200);
    let doc: Value = serde_json::from_str(&doc).unwrap();
    for path in [
        "/api/v1/nodes",
        "/api/v1/jobs",
        "/api/v1/jobs/{id}/events",
        "/api/v1/jobs/{id}/ranks/{rank}/logs",
        "/api/v1/plan",
        "/api/v1/leader",
    ] {
        assert!(doc["paths"][path].is_object(), "{path} missing from the OpenAPI document");
    }
    assert_eq!(doc["components"]["securitySchemes"]["bearer"]["scheme"], "bearer");

    c.json("PUT", "/api/v1/nodes/a100-0", NODE, 200);
    let id = c.json("POST", "/api/v1/jobs", JOB, 201)["id"].as_i64().unwrap();
    common::wait_for_state(&c, id, &["failed"]);
    let (status, text) = c.call_as(None, "GET", "/metrics", "");
    assert_eq!(status, 200);
    for line in [
        "motley_leader 1",
        "motley_nodes 1",
        "motley_jobs{state=\"failed\"} 1",
        "motley_agents_live 0",
        "motley_launch_instructions_total 0",
    ] {
        assert!(text.lines().any(|l| l == line), "no '{line}' in\n{text}");
    }

    // Bad query parameters and bodies answer in JSON naming the parameter.
    let (status, body) = c.call("GET", &format!("/api/v1/jobs/{id}/events?after=x"), "");
    assert_eq!(status, 400);
    assert!(body.contains("\"error\":\"query: after: invalid digit found in string\""), "{body}");
    let (status, body) = c.call("GET", &format!("/api/v1/jobs/{id}/ranks/0/logs?offset=-1"), "");
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("offset"), "{body}");
    let (status, body) = c.call("GET", &format!("/api/v1/jobs/{id}/ranks/0/logs"), "");
    assert_eq!(status, 404, "the job never launched, so it has no ranks: {body}");
    assert!(body.contains("rank 0 of job"), "{body}");
    // Unknown routes and wrong methods answer in the same JSON shape.
    let (status, body) = c.call("GET", "/api/v1/nope", "");
    assert_eq!(status, 404);
    assert!(body.contains("\"error\":\"route GET /api/v1/nope (the routes are in /api/v1/openapi.json) not found\""), "{body}");
    let (status, body) = c.call("DELETE", "/api/v1/nodes", "");
    assert_eq!(status, 405);
    assert!(body.contains("DELETE is not allowed on /api/v1/nodes") && body.contains("\"grpc_code\":12"), "{body}");
}

/// `insecure = true` in a config file serves without a token, and `--insecure=false` turns it
/// off again (a token is generated and required).
#[test]
fn a_flag_turns_off_the_config_files_insecure() {
    let dir = temp_dir();
    let config = dir.join("coordinator.toml");
    std::fs::write(&config, "insecure = true\n").unwrap();
    let open = Coordinator::start(&dir.join("open"), &["--config", config.to_str().unwrap()]);
    assert_eq!(open.token, None);
    assert_eq!(open.call_as(None, "GET", "/api/v1/nodes", "").0, 200);
    let closed = Coordinator::start(&dir.join("closed"), &["--config", config.to_str().unwrap(), "--insecure=false"]);
    assert!(closed.token.is_some(), "a token was generated");
    assert_eq!(closed.call_as(None, "GET", "/api/v1/nodes", "").0, 401);
    assert_eq!(closed.call("GET", "/api/v1/nodes", "").0, 200);
}

/// deploy/coordinator.toml is a valid configuration (an unknown key would stop the start) and
/// flags win over it.
#[test]
fn the_example_config_file_is_valid_and_flags_win() {
    let config = concat!(env!("CARGO_MANIFEST_DIR"), "/../deploy/coordinator.toml");
    let c = Coordinator::start(&temp_dir(), &["--config", config]);
    assert!(c.addr.starts_with("127.0.0.1:"), "--listen beats the file's 0.0.0.0:7070: {}", c.addr);
    assert_eq!(c.json("GET", "/api/v1/nodes", "", 200), serde_json::json!([]));
}

/// What an agent reports of its node's load on a heartbeat reaches the node APIs (REST and
/// gRPC) and /metrics, and goes when the lease does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_load_reaches_the_apis_and_metrics() {
    use motley_proto::v1::agent_client::AgentClient;
    use motley_proto::v1::{AgentStatus, GpuLoad, NodeLoad, RegisterRequest};
    // A 3 s lease: a stall of the loaded CI machine must not cost the stand-in agent its lease.
    let c = Coordinator::start(&temp_dir(), &["--heartbeat-ms", "1000"]);
    let (token, agent_token) = (c.token.clone().unwrap(), c.agent_token.clone().unwrap());
    let mut agents = AgentClient::connect(format!("http://{}", c.grpc)).await.unwrap();
    let reply = agents
        .register(RegisterRequest {
            node: "g0".into(),
            inventory_json: r#"{"gpu": "A100-80G", "gpus": 2}"#.into(),
            token: agent_token.clone(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let gib = 1u64 << 30;
    let load = NodeLoad {
        gpus: vec![
            GpuLoad {
                index: 0,
                utilization_percent: 87,
                memory_used_bytes: 60 * gib,
                memory_total_bytes: 80 * gib,
                temperature_c: Some(71),
            },
            GpuLoad { index: 1, utilization_percent: 0, memory_used_bytes: 0, memory_total_bytes: 80 * gib, temperature_c: None },
        ],
        work_dir_free_bytes: 500 * gib,
        load_1m: 3.5,
        mem_available_bytes: 200 * gib,
        ranks_running: 1,
    };
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    let epoch = reply.epoch;
    let beats = tokio::spawn(async move {
        loop {
            let status = AgentStatus { node: "g0".into(), epoch, ranks: vec![], load: Some(load.clone()), ..Default::default() };
            if tx.send(status).await.is_err() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    });
    let mut request = tonic::Request::new(tokio_stream::wrappers::ReceiverStream::new(rx));
    request.metadata_mut().insert("authorization", format!("Bearer {agent_token}").parse().unwrap());
    let mut inbound = agents.heartbeat(request).await.unwrap().into_inner();
    tokio::spawn(async move { while let Ok(Some(_)) = inbound.message().await {} });

    let c = std::sync::Arc::new(c);
    let rest = {
        let c = c.clone();
        tokio::task::spawn_blocking(move || {
            let start = std::time::Instant::now();
            loop {
                let node = c.json("GET", "/api/v1/nodes/g0", "", 200);
                if !node["load"].is_null() {
                    return (node, c.call_as(None, "GET", "/metrics", "").1);
                }
                assert!(start.elapsed() < Duration::from_secs(20), "no load reported: {node}");
                std::thread::sleep(Duration::from_millis(20));
            }
        })
        .await
        .unwrap()
    };
    let (node, metrics) = rest;
    let load = &node["load"];
    assert_eq!(load["gpus"][0]["utilization_percent"], 87);
    assert_eq!(load["gpus"][0]["temperature_c"], 71);
    assert_eq!(load["gpus"][1]["memory_total_bytes"], 80 * gib);
    assert_eq!((load["work_dir_free_bytes"].as_u64(), load["ranks_running"].as_u64()), (Some(500 * gib), Some(1)));
    assert!(load["age_ms"].as_u64().unwrap() < 10_000, "{load}");
    for line in [
        "motley_node_gpu_utilization_percent{node=\"g0\",gpu=\"0\"} 87".to_string(),
        format!("motley_node_gpu_memory_used_bytes{{node=\"g0\",gpu=\"0\"}} {}", 60 * gib),
        format!("motley_node_work_dir_free_bytes{{node=\"g0\"}} {}", 500 * gib),
        "motley_node_ranks_running{node=\"g0\"} 1".to_string(),
        "motley_node_load1{node=\"g0\"} 3.5".to_string(),
    ] {
        assert!(metrics.lines().any(|l| l == line), "no '{line}' in\n{metrics}");
    }
    let mut g = client(&c).await;
    let described = g.describe_node(authed(pb::NodeRef { name: "g0".into() }, &token)).await.unwrap().into_inner();
    assert_eq!(described.load.unwrap().gpus[0].utilization_percent, 87);

    // The agent goes quiet: its lease expires after 3 intervals and its load goes with it.
    beats.abort();
    let gone = tokio::task::spawn_blocking(move || {
        let start = std::time::Instant::now();
        loop {
            let node = c.json("GET", "/api/v1/nodes/g0", "", 200);
            if node["live"] == false {
                return (node, c.call_as(None, "GET", "/metrics", "").1);
            }
            assert!(start.elapsed() < Duration::from_secs(20), "the lease never expired");
            std::thread::sleep(Duration::from_millis(20));
        }
    })
    .await
    .unwrap();
    assert!(gone.0["load"].is_null(), "{}", gone.0);
    assert!(!gone.1.contains("motley_node_gpu_utilization_percent{"), "{}", gone.1);
}

/// A stored job this version cannot read (written by another version, say) fails with the
/// reason instead of holding up the queue: the job behind it is planned.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreadable_job_fails_without_blocking_the_queue() {
    let dir = temp_dir();
    let c = std::sync::Arc::new(Coordinator::start(&dir, &[]));
    // A second writer on the coordinator's SQLite file (WAL mode allows it).
    let store = motley_coordinator::Store::open(&format!("sqlite://{}", dir.join("coordinator.db").display())).await.unwrap();
    let bad = store.submit_job("old", r#"{"not": "a job spec"}"#).await.unwrap();
    store.close().await;
    let (bad, next) = tokio::task::spawn_blocking(move || {
        let id = c.json("POST", "/api/v1/jobs", JOB, 201)["id"].as_i64().unwrap();
        (common::wait_for_state(&c, bad.id, &["failed"]), common::wait_for_state(&c, id, &["failed"]))
    })
    .await
    .unwrap();
    assert!(bad["reason"].as_str().unwrap().starts_with("cannot be planned: stored job spec"), "{bad}");
    assert!(next["reason"].as_str().unwrap().contains("no live node"), "planned, not stuck behind it: {next}");
}

/// One request with extra headers (an `Origin`, as a browser sends); (status, body).
fn with_headers(addr: &str, method: &str, path: &str, headers: &str, body: &str) -> (u16, String) {
    for_host(addr, addr, method, path, headers, body)
}

/// One request to `addr` naming `host` in its `Host` header; (status, body).
fn for_host(addr: &str, host: &str, method: &str, path: &str, headers: &str, body: &str) -> (u16, String) {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    write!(s, "{method} {path} HTTP/1.1\r\nHost: {host}\r\n{headers}Content-Length: {}\r\nConnection: close\r\n\r\n{body}", body.len())
        .unwrap();
    let mut raw = String::new();
    s.read_to_string(&mut raw).unwrap();
    let status = raw.split(' ').nth(1).unwrap().parse().unwrap();
    (status, raw.split_once("\r\n\r\n").unwrap().1.to_string())
}

#[test]
fn an_insecure_coordinator_refuses_changes_from_other_sites_pages() {
    let c = Coordinator::start(&temp_dir(), &["--insecure"]);
    c.json("PUT", "/api/v1/nodes/a100-0", NODE, 200);
    // A page on another site posting a job (text/plain: no preflight) or draining a node.
    let evil = "Origin: http://evil.example\r\nContent-Type: text/plain\r\n";
    let (status, body) = with_headers(&c.addr, "POST", "/api/v1/jobs", evil, JOB);
    assert_eq!(status, 403, "{body}");
    assert!(body.contains("http://evil.example") && body.contains("(Origin)"), "{body}");
    assert_eq!(with_headers(&c.addr, "POST", "/api/v1/nodes/a100-0/drain", evil, "").0, 403);
    assert_eq!(c.json("GET", "/api/v1/jobs", "", 200), serde_json::json!([]), "nothing was submitted");
    assert_eq!(c.json("GET", "/api/v1/nodes/a100-0", "", 200)["state"], "active");
    // Reading is not a change; the coordinator's own page (its dashboard) and the CLI (no
    // Origin) change things as before.
    assert_eq!(with_headers(&c.addr, "GET", "/api/v1/nodes", evil, "").0, 200);
    let own = format!("Origin: http://{}\r\n", c.addr);
    assert_eq!(with_headers(&c.addr, "POST", "/api/v1/nodes/a100-0/drain", &own, "").0, 200);
    assert_eq!(c.call("POST", "/api/v1/nodes/a100-0/undrain", "").0, 200);
}

/// DNS rebinding: a page on a name that now resolves to the coordinator is same-origin
/// (`Origin` and `Host` agree), so only the `Host` header tells it apart from the coordinator's
/// own names.
#[test]
fn requests_for_names_the_coordinator_does_not_serve_are_refused() {
    let c = Coordinator::start(&temp_dir(), &["--insecure", "--public-url", "https://Motley.Example.com:7443/"]);
    c.json("PUT", "/api/v1/nodes/a100-0", NODE, 200);
    let port = c.addr.rsplit_once(':').unwrap().1;
    let rebound = format!("evil.example:{port}");
    let page = format!("Origin: http://{rebound}\r\nContent-Type: text/plain\r\n");
    let (status, body) = for_host(&c.addr, &rebound, "POST", "/api/v1/jobs", &page, JOB);
    assert_eq!(status, 403, "{body}");
    assert!(body.contains("evil.example") && body.contains("--public-url") && body.contains("motley.example.com"), "{body}");
    // An insecure coordinator answers no read for such a page either (a rank's log is a read).
    assert_eq!(for_host(&c.addr, &rebound, "GET", "/api/v1/nodes", "", "").0, 403);
    assert_eq!(for_host(&c.addr, &rebound, "GET", "/metrics", "", "").0, 403);
    assert_eq!(for_host(&c.addr, &rebound, "GET", "/", "", "").0, 403, "nor the dashboard");
    assert_eq!(for_host(&c.addr, &rebound, "POST", "/api/v1/nodes/a100-0/drain", &page, "").0, 403);
    assert_eq!(c.json("GET", "/api/v1/jobs", "", 200), serde_json::json!([]), "nothing was submitted");
    // The names it serves: its --public-url's, localhost, IP literals.
    for host in [format!("motley.example.com:{port}"), format!("localhost:{port}"), c.addr.clone()] {
        assert_eq!(for_host(&c.addr, &host, "POST", "/api/v1/nodes/a100-0/drain", "", "").0, 200, "{host}");
        assert_eq!(c.call("POST", "/api/v1/nodes/a100-0/undrain", "").0, 200);
    }
    let bad = std::process::Command::new(env!("CARGO_BIN_EXE_motley-coordinator"))
        .args(["--listen", "127.0.0.1:0", "--grpc-listen", "127.0.0.1:0", "--insecure", "--public-url", "motley.example.com"])
        .arg("--data-dir")
        .arg(temp_dir())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&bad.stderr);
    assert!(!bad.status.success() && err.contains("--public-url") && err.contains("https://"), "a URL without a scheme is refused: {err}");
}

/// Checkpoint files an agent reports reach the bitmap, over REST and gRPC alike: a step with
/// every unit and rank file is complete, one missing the head names it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn checkpoint_holdings_reach_the_bitmap_over_both_apis() {
    use motley_proto::v1::agent_client::AgentClient;
    use motley_proto::v1::{AgentStatus, CkptHolding, RegisterRequest};
    let c = Coordinator::start(&temp_dir(), &["--heartbeat-ms", "1000"]);
    let (token, agent_token) = (c.token.clone().unwrap(), c.agent_token.clone().unwrap());
    let job = c.json("POST", "/api/v1/jobs", JOB, 201)["id"].as_i64().unwrap();
    let mut agents = AgentClient::connect(format!("http://{}", c.grpc)).await.unwrap();
    let reply = agents
        .register(RegisterRequest {
            node: "g0".into(),
            inventory_json: r#"{"gpu": "A100-80G", "gpus": 2}"#.into(),
            token: agent_token.clone(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let unit = |step: u64, block: &str, part: &str| CkptHolding {
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
        // One chunk's crc: a copy without crcs is never restorable, so never complete.
        chunk_bytes: 16 << 20,
        crc32c: vec![0],
    };
    let mut holdings = vec![];
    for step in [4, 8] {
        for block in ["embed", "layer.0", "head"] {
            for part in ["model", "optimizer"] {
                if !(step == 8 && block == "head") {
                    holdings.push(unit(step, block, part));
                }
            }
        }
        holdings.push(CkptHolding {
            file: "rank.00000.safetensors".into(),
            rank: 0,
            block: String::new(),
            part: String::new(),
            ..unit(step, "", "")
        });
    }
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    let status =
        AgentStatus { node: "g0".into(), epoch: reply.epoch, seq: 1, full: true, holdings, holdings_sent: true, ..Default::default() };
    tx.send(status).await.unwrap();
    let mut request = tonic::Request::new(tokio_stream::wrappers::ReceiverStream::new(rx));
    request.metadata_mut().insert("authorization", format!("Bearer {agent_token}").parse().unwrap());
    let mut inbound = agents.heartbeat(request).await.unwrap().into_inner();
    // Acknowledged once committed.
    loop {
        let i = inbound.message().await.unwrap().expect("the stream stays open");
        if let Some(motley_proto::v1::instruction::Kind::Ack(a)) = i.kind {
            assert_eq!(a.seq, 1);
            break;
        }
    }
    let c = std::sync::Arc::new(c);
    let rest = {
        let c = c.clone();
        tokio::task::spawn_blocking(move || {
            (
                c.json("GET", &format!("/api/v1/jobs/{job}/checkpoints"), "", 200),
                c.json("GET", &format!("/api/v1/jobs/{job}/checkpoints/grid"), "", 200),
            )
        })
        .await
        .unwrap()
    };
    let (steps, grid) = rest;
    assert_eq!(steps[0]["step"], 8, "newest first: {steps}");
    assert_eq!(steps[0]["complete"], false);
    assert!(steps[0]["missing"].as_str().unwrap().contains("unit head model was never reported"), "{steps}");
    assert_eq!((steps[1]["step"].as_i64(), steps[1]["complete"].as_bool(), steps[1]["files"].as_u64()), (Some(4), Some(true), Some(7)));
    assert_eq!(grid["step"], 4, "the newest complete step: {grid}");
    assert_eq!(grid["rows"].as_array().unwrap().len(), 7);
    assert_eq!(grid["rows"][0]["held"]["g0"], serde_json::json!(["disk"]));

    let mut g = client(&c).await;
    let listed = g.list_checkpoints(authed(pb::JobRef { id: job }, &token)).await.unwrap().into_inner().steps;
    assert_eq!(listed.iter().map(|s| (s.step, s.complete, s.files)).collect::<Vec<_>>(), [(8, false, 5), (4, true, 7)]);
    let grid = g.get_checkpoint_grid(authed(pb::CheckpointGridRequest { job, step: Some(8) }, &token)).await.unwrap().into_inner();
    assert_eq!((grid.step.unwrap().step, grid.rows.len()), (8, 5));
    assert_eq!(grid.rows[0].held["g0"], "disk");
    let e = g.get_checkpoint_grid(authed(pb::CheckpointGridRequest { job, step: Some(5) }, &token)).await.unwrap_err();
    assert_eq!(e.code(), Code::NotFound);
    assert!(e.message().contains("held: 8, 4"), "{}", e.message());
    let e = g.list_checkpoints(authed(pb::JobRef { id: 999 }, &token)).await.unwrap_err();
    assert_eq!(e.code(), Code::NotFound);
}
