//! Helpers shared by the coordinator's end-to-end tests: the real `motley-coordinator` binary
//! and `motley-agent`s beside it as child processes, plain HTTP/1.1 to its REST API, polling,
//! scratch directories, fresh PostgreSQL databases.
#![allow(dead_code)] // each test file uses its own subset

use std::ffi::OsStr;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use serde_json::Value;
use sqlx::Connection;

static NEXT: AtomicUsize = AtomicUsize::new(0);

/// A child process (an agent, a rank) killed and reaped when the test lets go of it.
pub struct Proc(pub Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The workspace root (the binaries are under its `target/`).
pub fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

/// A workspace binary (`motley`, `motley-agent`, `motley-rank-probe`): built beside the
/// coordinator by the workspace build.
pub fn sibling(name: &str) -> PathBuf {
    Path::new(env!("CARGO_BIN_EXE_motley-coordinator")).with_file_name(name)
}

/// Poll `f` every 50 ms until it gives a value; fails the test after 60 s naming `what`.
pub fn until<T>(what: &str, f: impl FnMut() -> Option<T>) -> T {
    until_every(what, Duration::from_millis(50), f)
}

/// [`until`], polling every `every`.
pub fn until_every<T>(what: &str, every: Duration, mut f: impl FnMut() -> Option<T>) -> T {
    let start = Instant::now();
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(start.elapsed() < Duration::from_secs(60), "timed out waiting for: {what}");
        std::thread::sleep(every);
    }
}

/// `--master-port-base`: tests run side by side on one machine (nextest: one process each), so
/// a range of rendezvous ports per process, below the ephemeral ports (32768 and up).
pub fn master_port_base() -> String {
    (10000 + (std::process::id() % 20) * 1024).to_string()
}

pub fn unique(prefix: &str) -> String {
    format!(
        "{prefix}_{}_{}_{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed),
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() % 1_000_000_000_000
    )
}

pub struct Coordinator {
    pub child: Child,
    pub addr: String,
    pub grpc: String,
    pub token: Option<String>,
    /// The agents' token (DATA_DIR/agent-token when generated).
    pub agent_token: Option<String>,
}

impl Coordinator {
    /// On ephemeral ports, with `extra` flags (`--insecure`, `--token`, `--heartbeat-ms`,
    /// `--database-url`, ...); none of the flags' environment variables reach it.
    pub fn start(data_dir: &Path, extra: &[&str]) -> Coordinator {
        Coordinator::start_at(data_dir, "127.0.0.1:0", "127.0.0.1:0", extra)
    }

    /// On given REST and gRPC addresses (a restart where agents expect it).
    pub fn start_at(data_dir: &Path, listen: &str, grpc_listen: &str, extra: &[&str]) -> Coordinator {
        let mut child = Command::new(env!("CARGO_BIN_EXE_motley-coordinator"))
            .args(["--listen", listen, "--grpc-listen", grpc_listen, "--data-dir", data_dir.to_str().unwrap()])
            .args(extra)
            .env_remove("MOTLEY_TOKEN")
            .env_remove("MOTLEY_AGENT_TOKEN")
            .env_remove("MOTLEY_DATABASE_URL")
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let mut line = String::new();
        let mut out = BufReader::new(child.stdout.take().unwrap());
        out.read_line(&mut line).unwrap();
        let mut grpc = String::new();
        out.read_line(&mut grpc).unwrap();
        let addr = line.trim().rsplit("http://").next().expect("the listening address is printed").to_string();
        let grpc = grpc.trim().rsplit("http://").next().expect("the gRPC address is printed").to_string();
        let token = std::fs::read_to_string(data_dir.join("token")).ok().map(|t| t.trim().to_string());
        let agent_token = std::fs::read_to_string(data_dir.join("agent-token")).ok().map(|t| t.trim().to_string());
        Coordinator { child, addr, grpc, token, agent_token }
    }

    /// One HTTP/1.1 request; returns (status, body).
    pub fn call(&self, method: &str, path: &str, body: &str) -> (u16, String) {
        self.call_as(self.token.as_deref(), method, path, body)
    }

    pub fn call_as(&self, token: Option<&str>, method: &str, path: &str, body: &str) -> (u16, String) {
        call(&self.addr, token, method, path, body)
    }

    pub fn json(&self, method: &str, path: &str, body: &str, want: u16) -> Value {
        let (status, text) = self.call(method, path, body);
        assert_eq!(status, want, "{method} {path}: {text}");
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{method} {path}: not JSON ({e}): {text}"))
    }

    /// The agents' `--coordinator` URL.
    pub fn grpc_url(&self) -> String {
        format!("http://{}", self.grpc)
    }

    pub fn kill9(mut self) {
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

/// One HTTP/1.1 request to `addr`; returns (status, body).
pub fn call(addr: &str, token: Option<&str>, method: &str, path: &str, body: &str) -> (u16, String) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let auth = token.map_or(String::new(), |t| format!("Authorization: Bearer {t}\r\n"));
    write!(s, "{method} {path} HTTP/1.1\r\nHost: {addr}\r\n{auth}Content-Length: {}\r\nConnection: close\r\n\r\n{body}", body.len())
        .unwrap();
    let mut raw = String::new();
    s.read_to_string(&mut raw).unwrap_or_else(|e| panic!("{method} {path}: {e}"));
    let status: u16 = raw.split(' ').nth(1).unwrap().parse().unwrap();
    let (head, rest) = raw.split_once("\r\n\r\n").unwrap();
    // axum answers small bodies with Content-Length; chunked only if it streams.
    let body = if head.to_ascii_lowercase().contains("transfer-encoding: chunked") { dechunk(rest) } else { rest.to_string() };
    (status, body)
}

pub fn dechunk(s: &str) -> String {
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

pub fn temp_dir() -> PathBuf {
    scratch("motley_coord")
}

/// A new, empty directory under the system's temporary directory, its name starting `prefix`.
pub fn scratch(prefix: &str) -> PathBuf {
    // create_dir, not create_dir_all: a directory left by an earlier process is never reused.
    let d = std::env::temp_dir().join(unique(prefix));
    std::fs::create_dir(&d).unwrap();
    d
}

/// A `motley-agent` (the one built beside the coordinator) with the flags every test gives it:
/// `--coordinator`, `--node`, `--inventory` (relative to the repository, where it runs, or
/// absolute), `--shm-dir WORK/shm`, `--work-dir WORK` and logs on an ephemeral port; stderr
/// discarded unless [`Agent::stderr`] says otherwise. Add flags and environment, then spawn.
pub struct Agent(Command);

impl Agent {
    pub fn new(coordinator: &str, node: &str, inventory: impl AsRef<Path>, work_dir: &Path) -> Agent {
        let mut cmd = Command::new(sibling("motley-agent"));
        cmd.args(["--coordinator", coordinator, "--node", node])
            .arg("--inventory")
            .arg(inventory.as_ref())
            .arg("--shm-dir")
            .arg(work_dir.join("shm"))
            .arg("--work-dir")
            .arg(work_dir)
            .args(["--logs-listen", "127.0.0.1:0"])
            .current_dir(repo())
            .stderr(Stdio::null());
        Agent(cmd)
    }

    pub fn arg(mut self, arg: impl AsRef<OsStr>) -> Agent {
        self.0.arg(arg);
        self
    }

    pub fn args<S: AsRef<OsStr>>(mut self, args: impl IntoIterator<Item = S>) -> Agent {
        self.0.args(args);
        self
    }

    pub fn env(mut self, key: &str, value: impl AsRef<OsStr>) -> Agent {
        self.0.env(key, value);
        self
    }

    pub fn env_remove(mut self, key: &str) -> Agent {
        self.0.env_remove(key);
        self
    }

    pub fn stderr(mut self, to: impl Into<Stdio>) -> Agent {
        self.0.stderr(to);
        self
    }

    pub fn spawn(mut self) -> Proc {
        Proc(self.0.spawn().expect("motley-agent is built by `cargo nextest run --workspace`"))
    }
}

/// Send a signal to a process (SIGSTOP freezes it: its sockets stay open, nothing answers).
pub fn signal(pid: u32, sig: &str) {
    assert!(Command::new("kill").args([sig, &pid.to_string()]).status().unwrap().success());
}

pub fn wait_for_state(c: &Coordinator, id: i64, states: &[&str]) -> Value {
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

/// A fresh PostgreSQL database on the test server, dropped when this goes out of scope (also
/// when the test panics).
pub struct TestDb {
    pub url: String,
    name: String,
    server: String,
}

impl TestDb {
    pub fn create(prefix: &str) -> TestDb {
        let server = std::env::var("MOTLEY_TEST_POSTGRES").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into());
        // Only digits and underscores after a fixed prefix: safe to splice into DDL.
        let name = unique(prefix);
        admin(&server, &format!("CREATE DATABASE {name}"));
        let url = format!("{}/{name}", server.rsplit_once('/').unwrap().0);
        TestDb { url, name, server }
    }
}

impl Drop for TestDb {
    fn drop(&mut self) {
        admin(&self.server, &format!("DROP DATABASE IF EXISTS {} WITH (FORCE)", self.name));
    }
}

fn admin(server: &str, sql: &str) {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let mut c = sqlx::PgConnection::connect(server).await.expect("PostgreSQL on 127.0.0.1:5432 must be up");
        sqlx::query(sqlx::AssertSqlSafe(sql.to_string())).execute(&mut c).await.unwrap();
    });
}
