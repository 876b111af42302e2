//! The coordinator as an operator runs it: the real binary as a separate process on loopback,
//! its REST API over real HTTP, on SQLite and on the PostgreSQL at 127.0.0.1:5432; kill -9 and
//! restart lose nothing committed.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use serde_json::Value;
use sqlx::Connection;

static NEXT: AtomicUsize = AtomicUsize::new(0);

fn unique(prefix: &str) -> String {
    format!("{prefix}_{}_{}", std::process::id(), NEXT.fetch_add(1, Ordering::Relaxed))
}

struct Coordinator {
    child: Child,
    addr: String,
    token: Option<String>,
}

impl Coordinator {
    fn start(data_dir: &Path, extra: &[&str]) -> Coordinator {
        let mut child = Command::new(env!("CARGO_BIN_EXE_motley-coordinator"))
            .args(["--listen", "127.0.0.1:0", "--grpc-listen", "127.0.0.1:0", "--data-dir", data_dir.to_str().unwrap()])
            .args(extra)
            .env_remove("MOTLEY_TOKEN")
            .env_remove("MOTLEY_DATABASE_URL")
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let mut line = String::new();
        let mut out = BufReader::new(child.stdout.take().unwrap());
        out.read_line(&mut line).unwrap();
        out.read_line(&mut String::new()).unwrap(); // the agents' address
        let addr = line.trim().rsplit("http://").next().expect("the listening address is printed").to_string();
        let token = std::fs::read_to_string(data_dir.join("token")).ok().map(|t| t.trim().to_string());
        Coordinator { child, addr, token }
    }

    /// One HTTP/1.1 request; returns (status, body).
    fn call(&self, method: &str, path: &str, body: &str) -> (u16, String) {
        self.call_as(self.token.as_deref(), method, path, body)
    }

    fn call_as(&self, token: Option<&str>, method: &str, path: &str, body: &str) -> (u16, String) {
        let mut s = TcpStream::connect(&self.addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        let auth = token.map_or(String::new(), |t| format!("Authorization: Bearer {t}\r\n"));
        write!(
            s,
            "{method} {path} HTTP/1.1\r\nHost: {}\r\n{auth}Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
            self.addr,
            body.len()
        )
        .unwrap();
        let mut raw = String::new();
        s.read_to_string(&mut raw).unwrap_or_else(|e| panic!("{method} {path}: {e}"));
        let status: u16 = raw.split(' ').nth(1).unwrap().parse().unwrap();
        let (head, rest) = raw.split_once("\r\n\r\n").unwrap();
        // axum answers small bodies with Content-Length; chunked only if it streams.
        let body = if head.to_ascii_lowercase().contains("transfer-encoding: chunked") { dechunk(rest) } else { rest.to_string() };
        (status, body)
    }

    fn json(&self, method: &str, path: &str, body: &str, want: u16) -> Value {
        let (status, text) = self.call(method, path, body);
        assert_eq!(status, want, "{method} {path}: {text}");
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{method} {path}: not JSON ({e}): {text}"))
    }

    fn kill9(mut self) {
        self.child.kill().unwrap(); // SIGKILL
        self.child.wait().unwrap();
    }
}

impl Drop for Coordinator {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn dechunk(s: &str) -> String {
    let mut out = String::new();
    let mut rest = s;
    while let Some((size, tail)) = rest.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
        if n == 0 {
            break;
        }
        out.push_str(&tail[..n]);
        rest = &tail[n + 2..];
    }
    out
}

fn temp_dir() -> PathBuf {
    let d = std::env::temp_dir().join(unique("motley_coord"));
    std::fs::create_dir_all(&d).unwrap();
    d
}

const NODE: &str =
    "gpu: A100-80G\ngpus: 8\nnics: [{name: mlx5_0, kind: ib, gbps: 200}, {name: eth0, kind: ethernet, gbps: 25}]\nrdma_domain: lab\n";
const JOB: &str = "name: hello\nmodel: gpt3-1.3b\nglobal_batch: 32\nrun: python -c 'print(1)'\n";

fn wait_for_state(c: &Coordinator, id: i64, states: &[&str]) -> Value {
    let start = Instant::now();
    loop {
        let j = c.json("GET", &format!("/api/v1/jobs/{id}"), "", 200);
        if states.contains(&j["state"].as_str().unwrap()) {
            return j;
        }
        assert!(start.elapsed() < Duration::from_secs(60), "job {id} stuck in {}", j["state"]);
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Declare nodes, submit a job, see it planned on the live inventory and launched as
/// generation 1, cancel it; then kill -9 the coordinator and restart it: everything is there.
fn the_operator_story(data_dir: &Path, extra: &[&str]) {
    let c = Coordinator::start(data_dir, extra);
    for n in ["a100-0", "a100-1"] {
        let v = c.json("PUT", &format!("/api/v1/nodes/{n}"), NODE, 200);
        assert_eq!(v["agent_epoch"], 1);
    }
    let nodes = c.json("GET", "/api/v1/nodes", "", 200);
    assert_eq!(nodes.as_array().unwrap().len(), 2);
    assert_eq!(nodes[0]["inventory"]["gpus"], 8);
    assert_eq!(c.json("POST", "/api/v1/nodes/a100-1/drain", "", 200)["state"], "draining");
    assert_eq!(c.json("POST", "/api/v1/nodes/a100-1/undrain", "", 200)["state"], "active");

    let job = c.json("POST", "/api/v1/jobs", JOB, 201);
    let id = job["id"].as_i64().unwrap();
    assert_eq!(job["state"], "submitted");
    // Planned and stored as generation 1; with no agent alive on its nodes the launch fails
    // with that reason (tests/agents_e2e.rs runs agents).
    let done = wait_for_state(&c, id, &["failed"]);
    assert_eq!(done["generation"], 1);
    assert!(done["reason"].as_str().unwrap().contains("has no live agent"), "{done}");
    let plan = c.json("GET", &format!("/api/v1/jobs/{id}/plan"), "", 200);
    let ranks = plan["ranks"].as_array().unwrap();
    assert_eq!(ranks.len() as u64, plan["plan"]["gpus_used"].as_u64().unwrap(), "one rank per GPU of the plan");
    assert!(ranks.iter().all(|r| ["a100-0", "a100-1"].contains(&r["assignment"]["node"].as_str().unwrap())));
    assert!(plan["plan"]["comm_groups"].is_array());

    let again = c.call("POST", &format!("/api/v1/jobs/{id}/cancel"), "");
    assert_eq!(again.0, 409, "a failed job cannot be cancelled: {}", again.1);
    let events = c.json("GET", &format!("/api/v1/jobs/{id}/events"), "", 200);
    let kinds: Vec<&str> = events.as_array().unwrap().iter().map(|e| e["kind"].as_str().unwrap()).collect();
    assert_eq!(kinds, ["submitted", "planning", "launching", "failed"]);

    // kill -9 and restart on the same state: nothing committed is lost.
    c.kill9();
    let c = Coordinator::start(data_dir, extra);
    assert_eq!(c.json("GET", "/api/v1/nodes", "", 200).as_array().unwrap().len(), 2);
    let j = c.json("GET", &format!("/api/v1/jobs/{id}"), "", 200);
    assert_eq!((j["state"].as_str(), j["generation"].as_i64()), (Some("failed"), Some(1)));
    let after = c.json("GET", &format!("/api/v1/jobs/{id}/events?after={}", events[1]["seq"]), "", 200);
    assert_eq!(after.as_array().unwrap().len(), 2);
}

#[test]
fn operator_story_on_sqlite() {
    the_operator_story(&temp_dir(), &[]);
}

#[test]
fn operator_story_on_postgres() {
    let server = std::env::var("MOTLEY_TEST_POSTGRES").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into());
    // Only digits and underscores after a fixed prefix: safe to splice into DDL.
    let db = unique("motley_e2e");
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let mut admin = rt.block_on(sqlx::PgConnection::connect(&server)).expect("PostgreSQL on 127.0.0.1:5432 must be up");
    rt.block_on(sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {db}"))).execute(&mut admin)).unwrap();
    let base = server.rsplit_once('/').unwrap().0.to_string();
    let url = format!("{base}/{db}");
    the_operator_story(&temp_dir(), &["--database-url", &url]);
    rt.block_on(sqlx::query(sqlx::AssertSqlSafe(format!("DROP DATABASE IF EXISTS {db} WITH (FORCE)"))).execute(&mut admin)).unwrap();
}

#[test]
fn tokens_bad_input_and_unplannable_jobs_get_clear_errors() {
    let dir = temp_dir();
    let c = Coordinator::start(&dir, &[]);
    assert_eq!(c.call_as(None, "GET", "/live", "").0, 200, "liveness needs no token");
    assert_eq!(c.call_as(None, "GET", "/ready", "").0, 200);
    let (status, body) = c.call_as(None, "GET", "/api/v1/jobs", "");
    assert_eq!(status, 401);
    assert!(body.contains("bearer token"), "{body}");
    assert_eq!(c.call_as(Some("wrong"), "GET", "/api/v1/jobs", "").0, 401);

    let bad_node = c.call("PUT", "/api/v1/nodes/x", "gpu: Z9000\ngpus: 8\n");
    assert_eq!(bad_node.0, 400);
    assert!(bad_node.1.contains("unknown GPU type 'Z9000'"), "{}", bad_node.1);
    let bad_job = c.call("POST", "/api/v1/jobs", &JOB.replace("global_batch: 32", "global_batch: 0"));
    assert_eq!(bad_job.0, 400);
    assert!(bad_job.1.contains("global_batch: must be at least 1"), "{}", bad_job.1);
    assert!(c.call("POST", "/api/v1/jobs", "name: [").1.contains("job file"));
    assert_eq!(c.call("GET", "/api/v1/jobs/77", "").0, 404);
    assert_eq!(c.call("GET", "/api/v1/jobs/abc", "").0, 400);
    assert_eq!(c.call("POST", "/api/v1/nodes/ghost/drain", "").0, 404);
    assert!(c.json("GET", "/api/v1/jobs", "", 200).as_array().unwrap().is_empty(), "nothing was stored");

    // No node can hold LLaMA-70B: the job fails with the planner's reason.
    c.json("PUT", "/api/v1/nodes/small", "gpu: T4\ngpus: 1\n", 200);
    let job = c.json("POST", "/api/v1/jobs", &JOB.replace("gpt3-1.3b", "llama-70b"), 201);
    let failed = wait_for_state(&c, job["id"].as_i64().unwrap(), &["failed", "launching"]);
    assert_eq!(failed["state"], "failed");
    assert!(failed["reason"].as_str().unwrap().contains("does not fit"), "{failed}");
    drop(c);

    // --insecure serves without a token; an explicit --token is honoured.
    let c = Coordinator::start(&temp_dir(), &["--insecure"]);
    assert_eq!(c.call_as(None, "GET", "/api/v1/jobs", "").0, 200);
    let c2 = Coordinator::start(&temp_dir(), &["--token", "s3cret"]);
    assert_eq!(c2.call_as(Some("s3cret"), "GET", "/api/v1/nodes", "").0, 200);
    assert_eq!(c2.call_as(None, "GET", "/api/v1/nodes", "").0, 401);
}
