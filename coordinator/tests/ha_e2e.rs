//! High availability and restarts, with real processes: two coordinators on one database (one
//! leads, the standby names it and takes over within 5 s when the leader is killed), and a
//! coordinator killed mid-job and restarted: the job, its plan and its events survive and the
//! running job still finishes.

use crate::common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::{signal, temp_dir, until, wait_for_state, Agent, Coordinator, TestDb};

const NODE: &str = "gpu: A100-80G\ngpus: 8\nnics: [{name: mlx5_0, kind: ib, gbps: 200}]\nrdma_domain: lab\n";

/// Kill the leader of two coordinators and see the standby lead.
fn failover(dir_a: &Path, dir_b: &Path, extra: &[&str]) {
    let a = Coordinator::start(dir_a, extra);
    let b = Coordinator::start(dir_b, extra);
    let leader = a.json("GET", "/api/v1/leader", "", 200);
    assert_eq!(leader["is_leader"], true, "the first coordinator leads: {leader}");
    let standby = b.json("GET", "/api/v1/leader", "", 200);
    assert_eq!(standby["is_leader"], false);
    assert_eq!(standby["rest_url"], format!("http://{}", a.addr), "the standby names the leader");
    let (status, body) = b.call("GET", "/api/v1/nodes", "");
    assert_eq!(status, 503, "{body}");
    assert!(body.contains(&format!("\"leader\":\"http://{}\"", a.addr)), "{body}");
    assert_eq!(b.call("GET", "/ready", "").0, 503, "a standby is not ready");
    a.json("PUT", "/api/v1/nodes/a100-0", NODE, 200);

    a.kill9();
    let killed = Instant::now();
    loop {
        if b.json("GET", "/api/v1/leader", "", 200)["is_leader"] == true {
            break;
        }
        assert!(killed.elapsed() < Duration::from_secs(5), "the standby did not lead within 5 s");
        std::thread::sleep(Duration::from_millis(50));
    }
    let leader = b.json("GET", "/api/v1/leader", "", 200);
    assert_eq!((leader["rest_url"].as_str().unwrap(), leader["term"].as_i64()), (format!("http://{}", b.addr).as_str(), Some(2)));
    let nodes = b.json("GET", "/api/v1/nodes", "", 200);
    assert_eq!(nodes[0]["name"], "a100-0", "the new leader serves the same state");
}

#[test]
fn standby_takes_over_on_postgres() {
    let db = TestDb::create("motley_ha");
    failover(&temp_dir(), &temp_dir(), &["--insecure", "--heartbeat-ms", "500", "--database-url", &db.url]);
}

#[test]
fn standby_takes_over_on_one_sqlite_file() {
    let dir = temp_dir();
    failover(&dir, &dir, &["--insecure", "--heartbeat-ms", "500"]);
}

#[test]
fn a_coordinator_killed_mid_job_loses_nothing_and_the_job_finishes() {
    let dir = temp_dir();
    let extra = ["--insecure", "--heartbeat-ms", "500"];
    let c = Coordinator::start(&dir, &extra);
    let (rest, grpc) = (c.addr.clone(), c.grpc.clone());
    let _agent =
        Agent::new(&format!("http://{grpc}"), "node-0", "examples/nodes/a100.yaml", &dir.join("agent")).arg("--allow-root-ranks").spawn();
    until("the agent registered", || (c.json("GET", "/api/v1/nodes", "", 200)[0]["live"] == true).then_some(()));
    let job = "name: long\nmodel: gpt3-1.3b\nglobal_batch: 8\nresources: {gpus: 2}\nrun: 'sleep 4; echo done'\n";
    let id = c.json("POST", "/api/v1/jobs", job, 201)["id"].as_i64().unwrap();
    wait_for_state(&c, id, &["running"]);
    let before = c.json("GET", &format!("/api/v1/jobs/{id}/events"), "", 200);

    c.kill9();
    let c = Coordinator::start_at(&dir, &rest, &grpc, &extra);
    let events = c.json("GET", &format!("/api/v1/jobs/{id}/events"), "", 200);
    assert_eq!(events.as_array().unwrap()[..before.as_array().unwrap().len()], before.as_array().unwrap()[..], "no event lost");
    let plan = c.json("GET", &format!("/api/v1/jobs/{id}/plan"), "", 200);
    assert_eq!(plan["ranks"].as_array().unwrap().len(), 2);
    // The agent finds the restarted coordinator, reports its ranks again, and they finish.
    let done = wait_for_state(&c, id, &["succeeded", "failed"]);
    assert_eq!((done["state"].as_str(), done["generation"].as_i64()), (Some("succeeded"), Some(1)), "{done}");
}

/// A coordinator list on the agent: the standby named first sends it to the leader; when the
/// leader is killed mid-job the agent finds the new leader and the job still finishes.
#[test]
fn agents_follow_the_leader_through_a_failover() {
    let db = TestDb::create("motley_ha_agents");
    let extra = ["--insecure", "--heartbeat-ms", "500", "--database-url", &db.url];
    let a = Coordinator::start(&temp_dir(), &extra);
    let b = Coordinator::start(&temp_dir(), &extra);
    let dir = temp_dir();
    let coordinators = format!("http://{},http://{}", b.grpc, a.grpc);
    let _agent = Agent::new(&coordinators, "node-0", "examples/nodes/a100.yaml", &dir.join("agent")).arg("--allow-root-ranks").spawn();
    until("the agent reached the leader", || {
        a.json("GET", "/api/v1/nodes", "", 200).as_array().unwrap().first().is_some_and(|n| n["live"] == true).then_some(())
    });
    let job = "name: long\nmodel: gpt3-1.3b\nglobal_batch: 8\nresources: {gpus: 2}\nrun: 'sleep 3'\n";
    let id = a.json("POST", "/api/v1/jobs", job, 201)["id"].as_i64().unwrap();
    wait_for_state(&a, id, &["running"]);
    a.kill9();
    while b.json("GET", "/api/v1/leader", "", 200)["is_leader"] != true {
        std::thread::sleep(Duration::from_millis(50));
    }
    let done = wait_for_state(&b, id, &["succeeded", "failed"]);
    assert_eq!(done["state"], "succeeded", "{done}");
    assert_eq!(b.json("GET", "/api/v1/nodes", "", 200)[0]["live"], true, "the agent holds a lease with the new leader");
}

/// An agent that takes launches and never starts them: the launch fails after
/// LAUNCH_INTERVALS base intervals, naming what it waited for.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unacknowledged_launch_fails_with_the_reason() {
    use motley_proto::v1::agent_client::AgentClient;
    use motley_proto::v1::{AgentStatus, RegisterRequest};
    let c = Coordinator::start(&temp_dir(), &["--insecure", "--heartbeat-ms", "100"]);
    let mut client = AgentClient::connect(format!("http://{}", c.grpc)).await.unwrap();
    let inventory = r#"{"gpu": "A100-80G", "gpus": 8}"#;
    let reply = client
        .register(RegisterRequest { node: "mute".into(), inventory_json: inventory.into(), ..Default::default() })
        .await
        .unwrap()
        .into_inner();
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    let beats = tokio::spawn(async move {
        loop {
            if tx
                .send(AgentStatus { node: "mute".into(), epoch: reply.epoch, ranks: vec![], load: None, ..Default::default() })
                .await
                .is_err()
            {
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    });
    let mut inbound = client.heartbeat(tokio_stream::wrappers::ReceiverStream::new(rx)).await.unwrap().into_inner();
    // Drain instructions (the launch arrives and is ignored).
    tokio::spawn(async move { while let Ok(Some(_)) = inbound.message().await {} });
    // The blocking HTTP helpers off the async workers.
    let done = tokio::task::spawn_blocking(move || {
        let job = "name: mute\nmodel: gpt3-1.3b\nglobal_batch: 8\nresources: {gpus: 2}\nrun: 'true'\n";
        let id = c.json("POST", "/api/v1/jobs", job, 201)["id"].as_i64().unwrap();
        wait_for_state(&c, id, &["failed", "succeeded"])
    })
    .await
    .unwrap();
    beats.abort();
    assert_eq!(done["state"], "failed");
    let reason = done["reason"].as_str().unwrap();
    assert!(reason.contains("launch not acknowledged within 3000 ms") && reason.contains("mute (rank 0)"), "{reason}");
}

#[test]
fn a_frozen_postgres_leader_is_replaced_and_steps_down_when_it_thaws() {
    let db = TestDb::create("motley_frozen");
    let extra = ["--insecure", "--heartbeat-ms", "500", "--database-url", &db.url];
    let mut a = Coordinator::start(&temp_dir(), &extra);
    let b = Coordinator::start(&temp_dir(), &extra);
    assert_eq!(a.json("GET", "/api/v1/leader", "", 200)["is_leader"], true);
    // Frozen, not dead: its database session (and so the advisory lock) lives on.
    signal(a.child.id(), "-STOP");
    let frozen = Instant::now();
    loop {
        if b.json("GET", "/api/v1/leader", "", 200)["is_leader"] == true {
            break;
        }
        assert!(frozen.elapsed() < Duration::from_secs(15), "the standby did not take over a leader that stopped renewing");
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(b.json("GET", "/api/v1/leader", "", 200)["term"], 2);
    b.json("PUT", "/api/v1/nodes/a100-0", NODE, 200);
    // Thawed, the old leader finds its session gone and steps down (exits; systemd restarts it).
    signal(a.child.id(), "-CONT");
    let thawed = Instant::now();
    let status = loop {
        if let Some(s) = a.child.try_wait().unwrap() {
            break s;
        }
        assert!(thawed.elapsed() < Duration::from_secs(15), "the thawed leader did not step down");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(!status.success(), "stepping down is a failure exit: {status}");
    assert_eq!(b.json("GET", "/api/v1/leader", "", 200)["is_leader"], true, "the new leader keeps leading");
}
