//! The data plane's key end to end: the real coordinator generates and stores it, hands it to a
//! real agent at registration, and that agent's data plane then serves a checkpoint file to a
//! request with a capability minted under the stored key, and refuses one without (or under
//! another key). docs/recovery.md, "Who may fetch".

mod common;

use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;

use common::{scratch, Agent, Coordinator};
use motley_contract::capability::{mint, now_unix_s, Grant, KEY_BYTES};
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
    let capability = mint(&key, &grant).unwrap();
    let served = common::until("the agent took the coordinator's key", || {
        let reply = ask(&data, Some(&capability));
        (reply["ok"] == true).then_some(reply)
    });
    assert_eq!(served["bytes"], 6);
    let forged = mint(&[0; KEY_BYTES], &grant).unwrap();
    let refused = ask(&data, Some(&forged));
    assert!(refused["error"].as_str().unwrap().contains("bad signature"), "{refused}");
    let refused = ask(&data, None);
    assert!(refused["error"].as_str().unwrap().contains("no capability"), "{refused}");
}
