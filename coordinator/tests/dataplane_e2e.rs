//! The data plane's keys end to end: the real coordinator generates and stores the cluster key,
//! hands a real agent the key derived for its node at registration, and that agent's data plane
//! then serves a checkpoint file to a request with a capability minted under its node's key,
//! and refuses one without, under another node's key or under the cluster key itself.
//! docs/recovery.md, "Who may fetch". And the holdings report's per-job share: one job's ranks
//! writing a piece of nearly the whole report under a huge step number leave another job's
//! holdings in the bitmap (docs/recovery.md, "Limits").

use crate::common;

use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;

use common::{scratch, Agent, Coordinator};
use motley_server::capability::{mint, node_key, now_unix_s, probe_key, Grant, KEY_BYTES};
use sqlx::Connection;

/// The key the coordinator stored (migration 0010), from its SQLite database.
fn stored_key(data_dir: &std::path::Path) -> Vec<u8> {
    let url = format!("sqlite://{}", data_dir.join("coordinator.db").display());
    let hex: String = tokio::runtime::Runtime::new().unwrap().block_on(async {
        let mut db = sqlx::SqliteConnection::connect(&url).await.unwrap();
        sqlx::query_scalar("SELECT value FROM secrets WHERE name = 'data_plane_key'").fetch_one(&mut db).await.unwrap()
    });
    (0..hex.len()).step_by(2).map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap()).collect()
}

/// One request line to the data plane at `addr`; its reply line.
fn ask(addr: &str, capability: Option<&str>) -> serde_json::Value {
    let mut request = serde_json::json!({
        "v": 1, "job": 7, "generation": 2, "step": 10, "file": "manifest.json", "ranges": [[0, 5]], "rate_bytes_s": null, "transport": "tcp",
    });
    if let Some(c) = capability {
        request["capability"] = c.into();
    }
    let mut stream = TcpStream::connect(addr).unwrap();
    stream.write_all(format!("{request}\n").as_bytes()).unwrap();
    let mut reply = String::new();
    BufReader::new(stream).read_line(&mut reply).unwrap();
    serde_json::from_str(&reply).unwrap()
}

#[test]
fn an_agent_serves_a_file_to_a_capability_under_the_coordinators_stored_key_only() {
    let dir = scratch("dataplane_key");
    let data_dir = dir.join("coordinator");
    std::fs::create_dir_all(&data_dir).unwrap();
    let c = Coordinator::start(&data_dir, &["--insecure"]);
    let work = dir.join("agent");
    // A checkpoint file the node holds on disk (WORK_DIR/jobs/JOB/GEN/ckpt/step-S/FILE).
    let step_dir = work.join("jobs/7/2/ckpt/step-00000010");
    std::fs::create_dir_all(&step_dir).unwrap();
    std::fs::write(step_dir.join("manifest.json"), b"{}\n\n\n\n").unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let data = format!("127.0.0.1:{port}");
    let _agent = Agent::new(&c.grpc_url(), "node-0", "examples/nodes/a100.yaml", &work).args(["--data-listen", &data]).spawn();
    common::until("the agent registered", || {
        let (_, body) = c.call("GET", "/api/v1/nodes", "");
        body.contains("\"live\":true").then_some(())
    });

    let key = stored_key(&data_dir);
    assert_eq!(key.len(), KEY_BYTES);
    let grant = Grant { job: 7, generation: 2, step: 10, files: vec!["manifest.json".into()], expires_unix_s: now_unix_s() + 600 };
    // The agent may have registered a moment before its key is in place: ask until served.
    let capability = mint(&node_key(&key, "node-0").unwrap(), &grant).unwrap();
    let served = common::until("the agent took the coordinator's key", || {
        let reply = ask(&data, Some(&capability));
        (reply["ok"] == true).then_some(reply)
    });
    assert_eq!(served["bytes"], 6);
    // Another node's key (what root on that node could sign with), the cluster key the agents
    // never get, the probe key every agent has, and a key of no cluster: all refused.
    for other in [node_key(&key, "node-1").unwrap().to_vec(), key.clone(), probe_key(&key).unwrap().to_vec(), vec![0; KEY_BYTES]] {
        let refused = ask(&data, Some(&mint(&other, &grant).unwrap()));
        assert!(refused["error"].as_str().unwrap().contains("bad signature"), "{refused}");
    }
    let refused = ask(&data, None);
    assert!(refused["error"].as_str().unwrap().contains("no capability"), "{refused}");
}

/// Job 1's ranks wrote step 4 (about 60 KB of holdings); job 2's ranks write a piece listing
/// 62 empty units of 10,000 chunk crcs each (about 3.1 of the report's 3 MiB) in a step
/// directory numbered 2^62. Job 1's step stays in the bitmap: the report is shared per job, and
/// job 2 can only lose its own (before, the newest step across all jobs went first, and job 1's
/// holdings were evicted from the coordinator's rows for the node).
#[test]
fn a_huge_step_of_one_job_leaves_another_jobs_holdings_in_the_bitmap() {
    use motley_checkpoint::manifest::{piece_file_name, step_dir_name, unit_file_name};
    use motley_checkpoint::{Block, FileEntry, Manifest, Part, UnitEntry, UnitKey, FORMAT};
    let dir = scratch("holdings_share");
    let c = Coordinator::start(&dir.join("coordinator"), &["--insecure"]);
    // Two jobs no node can run (more GPUs than the cluster has): queued, their checkpoints kept.
    let spec = "name: held\nmodel: gpt3-1.3b\nglobal_batch: 32\nresources: {gpus: 64}\nrun: 'true'\n";
    let (one, two) = (
        c.json("POST", "/api/v1/jobs", spec, 201)["id"].as_i64().unwrap(),
        c.json("POST", "/api/v1/jobs", spec, 201)["id"].as_i64().unwrap(),
    );
    let work = dir.join("agent");
    let piece = |step: u64, units: u32, crcs: usize, step_dir: &std::path::Path| {
        std::fs::create_dir_all(step_dir).unwrap();
        let units = (0..units)
            .map(|i| {
                let key = UnitKey { block: Block::Layer(i), part: Part::Model, tp_rank: 0, tp_size: 1 };
                let file = unit_file_name(&key);
                std::fs::write(step_dir.join(&file), b"").unwrap();
                UnitEntry {
                    key,
                    file: FileEntry { file, bytes: 0, chunk_bytes: 16 << 20, crc32c: vec![u32::MAX; crcs] },
                    tensors: Default::default(),
                }
            })
            .collect();
        let m = Manifest { format: FORMAT.into(), step, layers: 62, world_size: 1, units, ranks: vec![], lost_ranks: vec![] };
        std::fs::write(step_dir.join(piece_file_name(0)), serde_json::to_vec(&m).unwrap()).unwrap();
    };
    piece(4, 1, 12_000, &work.join(format!("jobs/{one}/1/ckpt/{}", step_dir_name(4))));
    let huge = 1u64 << 62;
    piece(huge, 62, 10_000, &work.join(format!("jobs/{two}/1/ckpt/{}", step_dir_name(huge))));
    let _agent = Agent::new(&c.grpc_url(), "node-0", "examples/nodes/a100.yaml", &work).spawn();
    // The report reaches the bitmap: job 2's step is its own to lose, job 1's stays.
    let steps = common::until("job 1's step in the bitmap", || {
        let (status, body) = c.call("GET", &format!("/api/v1/jobs/{one}/checkpoints"), "");
        (status == 200 && body.contains("\"step\":4")).then_some(body)
    });
    assert!(steps.contains("\"files\":1"), "{steps}");
    let (_, theirs) = c.call("GET", &format!("/api/v1/jobs/{two}/checkpoints"), "");
    assert_eq!(theirs, "[]", "job 2's step is over its share of the report");
}
