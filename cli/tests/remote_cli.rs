//! `motley node ...` / `motley job ...` against a real `motley-coordinator` process on
//! loopback (SQLite in a temporary directory).

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

/// A child process killed when the test ends, also when it fails.
struct Killed(std::process::Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

struct Coordinator {
    child: Child,
    url: String,
    grpc: String,
    token: String,
    /// What agents present (the coordinator's agent token; the operators' one where a
    /// coordinator has no separate agent token).
    agent_token: String,
}

impl Drop for Coordinator {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start() -> Coordinator {
    let dir = std::env::temp_dir().join(format!("motley-remote-cli-{}-{}", std::process::id(), rand_suffix()));
    std::fs::create_dir_all(&dir).unwrap();
    start_in(&dir)
}

/// A coordinator on the state in `dir` (a second one there stands by).
fn start_in(dir: &Path) -> Coordinator {
    start_with(dir, &[])
}

fn start_with(dir: &Path, extra: &[&str]) -> Coordinator {
    // Built beside `motley` by the workspace build.
    let bin = Path::new(env!("CARGO_BIN_EXE_motley")).with_file_name("motley-coordinator");
    let mut child = Command::new(bin)
        .args(["--listen", "127.0.0.1:0", "--grpc-listen", "127.0.0.1:0", "--data-dir", dir.to_str().unwrap()])
        .args(extra)
        .env_remove("MOTLEY_TOKEN")
        .env_remove("MOTLEY_DATABASE_URL")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("motley-coordinator is built by `cargo nextest run --workspace`");
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let (mut rest, mut grpc) = (String::new(), String::new());
    out.read_line(&mut rest).unwrap();
    out.read_line(&mut grpc).unwrap();
    let url = rest.trim().rsplit(' ').next().unwrap().to_string();
    let grpc = grpc.trim().rsplit(' ').next().unwrap().to_string();
    let token = std::fs::read_to_string(dir.join("token")).unwrap().trim().to_string();
    let agent_token = std::fs::read_to_string(dir.join("agent-token")).map(|t| t.trim().to_string()).unwrap_or_else(|_| token.clone());
    Coordinator { child, url, grpc, token, agent_token }
}

fn rand_suffix() -> u128 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos()
}

fn motley(c: &Coordinator, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_motley"))
        .args(args)
        .current_dir(repo())
        .env("MOTLEY_COORDINATOR", &c.url)
        .env("MOTLEY_TOKEN", &c.token)
        .env_remove("MOTLEY_OUTPUT")
        .output()
        .unwrap()
}

fn ok(c: &Coordinator, args: &[&str]) -> String {
    let out = motley(c, args);
    assert!(out.status.success(), "motley {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

/// A real agent for node `name`, killed on drop.
struct Agent(Child);

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn agent(c: &Coordinator, name: &str) -> Agent {
    let bin = Path::new(env!("CARGO_BIN_EXE_motley")).with_file_name("motley-agent");
    let work = std::env::temp_dir().join(format!("motley-remote-agent-{name}-{}", rand_suffix()));
    Agent(
        Command::new(bin)
            .arg("--allow-root-ranks")
            .args([
                "--coordinator",
                &c.grpc,
                "--node",
                name,
                "--inventory",
                "examples/nodes/a100.yaml",
                "--work-dir",
                work.to_str().unwrap(),
            ])
            .args(["--shm-dir", work.join("shm").to_str().unwrap()])
            .env("MOTLEY_TOKEN", &c.agent_token)
            .current_dir(repo())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    )
}

#[test]
fn operators_manage_nodes_and_jobs_from_the_cli() {
    let c = start();
    let _agent = agent(&c, "a100-2");
    for n in ["a100-0", "a100-1"] {
        assert!(ok(&c, &["node", "add", n, "examples/nodes/a100.yaml"]).contains("registered"));
    }
    let table = ok(&c, &["node", "list"]);
    assert!(table.contains("a100-1") && table.contains("8 x A100-80G") && table.contains("mlx5_0 ib 200G"), "{table}");
    let nodes: serde_json::Value = serde_json::from_str(&ok(&c, &["node", "list", "-o", "json"])).unwrap();
    assert!(nodes.as_array().unwrap().len() >= 2, "the two added (and the agent's node once it registers)");
    assert!(ok(&c, &["node", "drain", "a100-1"]).contains("draining"));
    assert!(ok(&c, &["node", "undrain", "a100-1"]).contains("active"));

    // Wait for the agent's node to hold a lease.
    let start = Instant::now();
    while !ok(&c, &["node", "list", "-o", "json"]).contains("\"work_dir_free_bytes\"") {
        assert!(start.elapsed() < Duration::from_secs(30), "the agent never registered (or never reported its load)");
        std::thread::sleep(Duration::from_millis(50));
    }
    // Its heartbeats carry the node's load: free disk in its work directory, no GPUs here.
    let node: serde_json::Value = serde_json::from_str(&ok(&c, &["node", "describe", "a100-2", "-o", "json"])).unwrap();
    assert_eq!(node["live"], true);
    assert!(node["load"]["work_dir_free_bytes"].as_u64().unwrap() > 0, "{node}");
    let row = ok(&c, &["node", "list"]).lines().find(|l| l.contains("a100-2")).unwrap().to_string();
    assert!(row.contains("yes") && row.contains("iB"), "live, with its free disk: {row}");
    // Only the node with a live agent may run it; its ranks sleep until cancelled.
    let job = std::env::temp_dir().join(format!("motley-cli-job-{}.yaml", rand_suffix()));
    let cloud = std::env::temp_dir().join(format!("motley-cli-cloud-{}", rand_suffix()));
    std::fs::write(
        &job,
        format!(
            "name: sleeper\nmodel: gpt3-1.3b\nglobal_batch: 8\nresources: {{gpus: 2, nodes: [a100-2]}}\nrun: sleep 600\n\
             checkpoint: {{every: 1000, cloud: 'file://{}'}}\n",
            cloud.display()
        ),
    )
    .unwrap();
    let submitted = ok(&c, &["job", "submit", job.to_str().unwrap(), "-o", "json"]);
    let id = serde_json::from_str::<serde_json::Value>(&submitted).unwrap()["id"].as_i64().unwrap().to_string();
    let start = Instant::now();
    loop {
        let v: serde_json::Value = serde_json::from_str(&ok(&c, &["job", "show", &id, "-o", "json"])).unwrap();
        if v["state"] == "running" {
            // resources.gpus: 2 -> at most 2 GPUs, one rank each.
            assert!(v["launch"]["ranks"].as_array().unwrap().len() <= 2);
            break;
        }
        assert_ne!(v["state"], "failed", "{v}");
        assert!(start.elapsed() < Duration::from_secs(60));
        std::thread::sleep(Duration::from_millis(50));
    }
    let shown = ok(&c, &["job", "show", &id]);
    assert!(shown.contains("running") && shown.contains("layers"), "{shown}");
    // Where its steps go: under this cluster's identity in the cloud.
    let shown_json = ok(&c, &["job", "show", &id, "-o", "json"]);
    let place = serde_json::from_str::<serde_json::Value>(&shown_json).unwrap()["checkpoint_cloud"].as_str().unwrap().to_string();
    assert!(place.starts_with(&format!("file://{}/", cloud.display())) && place.ends_with(&format!("/jobs/{id}")), "{place}");
    assert!(shown.contains(&format!("checkpoints: {place}/GENERATION/step-S")), "{shown}");
    // A node with ranks of an unfinished job cannot be removed; one without can, once.
    let out = motley(&c, &["node", "remove", "a100-2"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("coordinator (409)"), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(ok(&c, &["node", "remove", "a100-0"]).trim(), "node a100-0 removed");
    assert!(!ok(&c, &["node", "list", "-o", "json"]).contains("\"a100-0\""));
    let out = motley(&c, &["node", "remove", "a100-0"]);
    assert!(out.status.code() == Some(2) && String::from_utf8_lossy(&out.stderr).contains("coordinator (404)"));
    assert!(ok(&c, &["job", "cancel", &id]).contains("cancelled"));
    // Watching a cancelled job ends with exit code 3, not a success.
    let out = motley(&c, &["job", "watch", &id]);
    assert_eq!(out.status.code(), Some(3), "{}", String::from_utf8_lossy(&out.stderr));
    let watched = String::from_utf8_lossy(&out.stdout);
    assert!(
        watched.contains("[submitted]") && watched.contains("[running]") && watched.contains(&format!("job {id} cancelled")),
        "{watched}"
    );
    assert!(ok(&c, &["job", "list"]).contains("sleeper"));
}

#[test]
fn the_cli_reports_wrong_tokens_dead_coordinators_and_bad_files() {
    let c = start();
    let out = Command::new(env!("CARGO_BIN_EXE_motley"))
        .args(["job", "list"])
        .env("MOTLEY_COORDINATOR", &c.url)
        .env("MOTLEY_TOKEN", "wrong")
        .current_dir(std::env::temp_dir())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("bearer token"), "{}", String::from_utf8_lossy(&out.stderr));

    // A dead first address: the next one answers.
    let list = format!("http://127.0.0.1:9,{}", c.url);
    let out = Command::new(env!("CARGO_BIN_EXE_motley"))
        .args(["node", "list", "--coordinator", &list])
        .env("MOTLEY_TOKEN", &c.token)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let out = Command::new(env!("CARGO_BIN_EXE_motley")).args(["node", "list", "--coordinator", "http://127.0.0.1:9"]).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("no coordinator answered"));

    let bad = std::env::temp_dir().join(format!("motley-bad-job-{}.yaml", std::process::id()));
    std::fs::write(&bad, "name: x\nmodel: gpt3-1.3b\nglobal_batch: 8\nrun: train\nenvs: {RANK: '3'}\n").unwrap();
    let out = motley(&c, &["job", "submit", bad.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("envs.RANK: is set by the agent"), "{err}");
    assert!(motley(&c, &["job", "show", "42"]).status.code() == Some(2));
}

#[test]
fn logs_dry_runs_and_a_standby_that_sends_the_cli_to_the_leader() {
    let dir = std::env::temp_dir().join(format!("motley-remote-logs-{}-{}", std::process::id(), rand_suffix()));
    std::fs::create_dir_all(&dir).unwrap();
    let c = start_in(&dir);
    let agent_bin = Path::new(env!("CARGO_BIN_EXE_motley")).with_file_name("motley-agent");
    let _agent = Killed(
        Command::new(agent_bin)
            .arg("--allow-root-ranks")
            .args(["--coordinator", &c.grpc, "--node", "node-0", "--inventory", "examples/nodes/a100.yaml", "--logs-listen", "127.0.0.1:0"])
            .args(["--shm-dir", dir.join("agent").join("shm").to_str().unwrap()])
            .args(["--work-dir", dir.join("agent").to_str().unwrap(), "--token", &c.agent_token])
            .current_dir(repo())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let start = Instant::now();
    while !String::from_utf8_lossy(&motley(&c, &["node", "list", "-o", "json"]).stdout).contains("\"live\": true") {
        assert!(start.elapsed() < Duration::from_secs(60), "the agent never registered");
        std::thread::sleep(Duration::from_millis(50));
    }
    let job = std::env::temp_dir().join(format!("motley-logs-job-{}.yaml", std::process::id()));
    std::fs::write(&job, "name: talk\nmodel: gpt3-1.3b\nglobal_batch: 8\nresources: {gpus: 2}\nrun: 'echo \"line from $RANK\"; echo \"err from $RANK\" >&2'\n").unwrap();

    // A dry run plans on the live inventory and stores nothing.
    let out = motley(&c, &["job", "submit", job.to_str().unwrap(), "--dry-run"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && text.contains("dry run: 2 GPUs") && text.contains("node-0"), "{text}");
    assert!(String::from_utf8_lossy(&motley(&c, &["job", "list", "-o", "json"]).stdout).trim() == "[]");

    assert!(motley(&c, &["job", "submit", job.to_str().unwrap()]).status.success());
    let watched = motley(&c, &["job", "watch", "1"]);
    assert!(String::from_utf8_lossy(&watched.stdout).contains("job 1 succeeded"), "{}", String::from_utf8_lossy(&watched.stdout));
    assert_eq!(watched.status.code(), Some(0));
    let out = motley(&c, &["job", "logs", "1"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    for line in ["[rank 0] line from 0", "[rank 1] line from 1", "[rank 1] err from 1"] {
        assert!(text.lines().any(|l| l == line), "no '{line}' in\n{text}");
    }
    let one = motley(&c, &["job", "logs", "1", "--rank", "1"]);
    assert_eq!(
        String::from_utf8_lossy(&one.stdout).lines().filter(|l| l.contains("from")).collect::<Vec<_>>(),
        ["line from 1", "err from 1"]
    );
    // The plan and its ranks, and the plan drawn (as GET /jobs/1/plan.svg draws it).
    let svg = dir.join("job-1.svg");
    let out = motley(&c, &["job", "plan", "1", "--svg", svg.to_str().unwrap()]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && text.contains("exit code") && text.contains("node-0"), "{text}");
    let picture = std::fs::read_to_string(&svg).unwrap();
    assert!(picture.starts_with("<svg ") && picture.contains(r#"<g class="stage""#), "{picture}");
    assert_eq!(motley(&c, &["job", "plan", "1", "-o", "json"]).status.code(), Some(0));
    let bad = motley(&c, &["job", "logs", "1", "--rank", "7"]);
    assert!(!bad.status.success() && String::from_utf8_lossy(&bad.stderr).contains("rank 7"), "{}", String::from_utf8_lossy(&bad.stderr));

    // A job whose ranks fail: watching it exits 1 (a script must see the failure).
    let failing = std::env::temp_dir().join(format!("motley-failing-job-{}-{}.yaml", std::process::id(), rand_suffix()));
    std::fs::write(&failing, "name: failing\nmodel: gpt3-1.3b\nglobal_batch: 8\nresources: {gpus: 2}\nrun: 'exit 7'\n").unwrap();
    assert!(motley(&c, &["job", "submit", failing.to_str().unwrap()]).status.success());
    let watched = motley(&c, &["job", "watch", "2"]);
    let text = String::from_utf8_lossy(&watched.stdout);
    assert!(text.contains("job 2 failed"), "{text}");
    assert_eq!(watched.status.code(), Some(1), "{text}");

    // A standby on the same state: the CLI pointed at it is sent on to the leader.
    let standby = start_in(&dir);
    let mut via = Command::new(env!("CARGO_BIN_EXE_motley"));
    via.args(["node", "list", "-o", "json"])
        .env("MOTLEY_COORDINATOR", &standby.url)
        .env("MOTLEY_TOKEN", &c.token)
        .env_remove("MOTLEY_OUTPUT");
    let out = via.output().unwrap();
    assert!(out.status.success() && String::from_utf8_lossy(&out.stdout).contains("node-0"), "{}", String::from_utf8_lossy(&out.stderr));
}

/// A test CA and a server certificate it signed for 127.0.0.1: (ca, cert, key). openssl is on
/// every machine this runs on.
fn test_certificates(dir: &Path) -> (PathBuf, PathBuf, PathBuf) {
    let p = |name: &str| dir.join(name).to_str().unwrap().to_string();
    let ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"];
    std::fs::write(dir.join("ext.cnf"), "subjectAltName=IP:127.0.0.1,DNS:localhost\nbasicConstraints=CA:FALSE\n").unwrap();
    let steps: [Vec<String>; 3] = [
        ["req", "-x509"]
            .iter()
            .chain(&ec)
            .map(|s| s.to_string())
            .chain(["-days", "1", "-subj", "/CN=motley-test-ca", "-keyout", &p("ca.key"), "-out", &p("ca.pem")].map(String::from))
            .collect(),
        ["req"]
            .iter()
            .chain(&ec)
            .map(|s| s.to_string())
            .chain(["-subj", "/CN=127.0.0.1", "-keyout", &p("key.pem"), "-out", &p("cert.csr")].map(String::from))
            .collect(),
        [
            "x509",
            "-req",
            "-in",
            &p("cert.csr"),
            "-CA",
            &p("ca.pem"),
            "-CAkey",
            &p("ca.key"),
            "-CAcreateserial",
            "-days",
            "1",
            "-extfile",
            &p("ext.cnf"),
            "-out",
            &p("cert.pem"),
        ]
        .map(String::from)
        .to_vec(),
    ];
    for args in steps {
        let ok = Command::new("openssl").args(&args).stderr(Stdio::null()).stdout(Stdio::null()).status().unwrap().success();
        assert!(ok, "openssl {args:?} failed");
    }
    (dir.join("ca.pem"), dir.join("cert.pem"), dir.join("key.pem"))
}

#[test]
fn tls_for_the_cli_and_the_agents() {
    let dir = std::env::temp_dir().join(format!("motley-remote-tls-{}-{}", std::process::id(), rand_suffix()));
    std::fs::create_dir_all(&dir).unwrap();
    let (ca_pem, cert, key) = test_certificates(&dir);
    let c = start_with(&dir, &["--tls-cert", cert.to_str().unwrap(), "--tls-key", key.to_str().unwrap()]);
    assert!(c.url.starts_with("https://") && c.grpc.starts_with("https://"), "{} {}", c.url, c.grpc);
    let _agent = Killed(
        Command::new(Path::new(env!("CARGO_BIN_EXE_motley")).with_file_name("motley-agent"))
            .arg("--allow-root-ranks")
            .args(["--coordinator", &c.grpc, "--ca-cert", ca_pem.to_str().unwrap(), "--token", &c.agent_token])
            .args(["--node", "node-0", "--inventory", "examples/nodes/a100.yaml", "--logs-listen", "127.0.0.1:0"])
            .args(["--shm-dir", dir.join("agent").join("shm").to_str().unwrap()])
            .args(["--work-dir", dir.join("agent").to_str().unwrap()])
            .current_dir(repo())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let ca = ca_pem.to_str().unwrap();
    let start = Instant::now();
    loop {
        let out = motley(&c, &["node", "list", "-o", "json", "--ca-cert", ca]);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        if String::from_utf8_lossy(&out.stdout).contains("\"live\": true") {
            break;
        }
        assert!(start.elapsed() < Duration::from_secs(60), "the agent never registered over TLS");
        std::thread::sleep(Duration::from_millis(50));
    }
    // Without the CA the certificate is not trusted: a clear failure, not a plain-text fallback.
    let out = motley(&c, &["node", "list"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("no coordinator answered") && err.to_lowercase().contains("certificate"), "{err}");
    // A certificate without its key is refused at start-up, naming the flag.
    let bin = Path::new(env!("CARGO_BIN_EXE_motley")).with_file_name("motley-coordinator");
    let out =
        Command::new(bin).args(["--tls-cert", cert.to_str().unwrap(), "--data-dir", dir.join("other").to_str().unwrap()]).output().unwrap();
    assert!(
        !out.status.success() && String::from_utf8_lossy(&out.stderr).contains("--tls-key"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A coordinator that accepts connections and never answers (frozen: SIGSTOP, a dead disk).
/// The listener's thread holds every connection open until the test process ends.
fn frozen_coordinator() -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    std::thread::spawn(move || {
        let mut held = vec![];
        for conn in listener.incoming() {
            held.push(conn);
        }
    });
    url
}

#[test]
fn a_frozen_coordinator_times_out_with_the_url_and_the_flag() {
    let url = frozen_coordinator();
    let out = Command::new(env!("CARGO_BIN_EXE_motley"))
        .args(["node", "list", "--timeout", "1", "--coordinator", &url])
        .env_remove("MOTLEY_TIMEOUT")
        .env_remove("MOTLEY_TOKEN")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains(&url) && err.contains("no answer within 1 s (--timeout / MOTLEY_TIMEOUT)"), "{err}");
    // The variable stands in for the flag; a frozen first address does not stop the next one
    // from being tried.
    let (answering, seen) = scripted_coordinator(vec![(200, "[]")]);
    let out = Command::new(env!("CARGO_BIN_EXE_motley"))
        .args(["job", "list", "-o", "json", "--coordinator", &format!("{url},{answering}")])
        .env("MOTLEY_TIMEOUT", "0.5")
        .env_remove("MOTLEY_TOKEN")
        .current_dir(std::env::temp_dir())
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "[]");
    assert_eq!(seen.recv().unwrap(), "GET /api/v1/jobs HTTP/1.1");
    let out = Command::new(env!("CARGO_BIN_EXE_motley")).args(["node", "list", "--timeout", "0", "--coordinator", &url]).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--timeout: 0 is not a positive number of seconds"));
}

/// A coordinator that answers each connection with the next canned (status, JSON body) and
/// sends the request lines it saw down the channel.
fn scripted_coordinator(answers: Vec<(u16, &'static str)>) -> (String, std::sync::mpsc::Receiver<String>) {
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for ((status, body), conn) in answers.into_iter().zip(listener.incoming()) {
            let mut conn = conn.unwrap();
            let mut head = vec![];
            let mut byte = [0u8; 1];
            while !head.ends_with(b"\r\n\r\n") && conn.read(&mut byte).unwrap() == 1 {
                head.push(byte[0]);
            }
            let _ = tx.send(String::from_utf8_lossy(&head).lines().next().unwrap_or("").to_string());
            let _ = write!(
                conn,
                "HTTP/1.1 {status} X\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                body.len()
            );
        }
    });
    (url, rx)
}

#[test]
fn node_remove_deletes_the_node_and_reports_refusals() {
    let (url, seen) = scripted_coordinator(vec![
        (200, r#"{"name": "a100-3", "state": "active", "live": false}"#),
        (409, r#"{"error": "node a100-3 still has ranks of job 4; cancel it or wait for it to end", "grpc_code": "FAILED_PRECONDITION"}"#),
        (404, r#"{"error": "no node named ../jobs/1\u001b[2J", "grpc_code": "NOT_FOUND"}"#),
        (200, r#"{"name": "a100-3", "state": "active"}"#),
    ]);
    let run = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_motley"))
            .args(args)
            .args(["--coordinator", &url])
            .env_remove("MOTLEY_TOKEN")
            .env_remove("MOTLEY_OUTPUT")
            .current_dir(std::env::temp_dir())
            .output()
            .unwrap()
    };
    let out = run(&["node", "remove", "a100-3"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "node a100-3 removed");
    assert_eq!(seen.recv().unwrap(), "DELETE /api/v1/nodes/a100-3 HTTP/1.1");

    let out = run(&["node", "remove", "a100-3"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("coordinator (409): node a100-3 still has ranks of job 4"));
    seen.recv().unwrap();

    // A name is one path segment, whatever it holds: it never reaches another route.
    let out = run(&["node", "remove", "../jobs/1"]);
    assert_eq!(out.status.code(), Some(2));
    assert_eq!(seen.recv().unwrap(), "DELETE /api/v1/nodes/..%2Fjobs%2F1 HTTP/1.1");
    // The error quotes the coordinator, escaped: no terminal control reaches stderr either.
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("no node named ../jobs/1\\x1b[2J") && !err.contains('\u{1b}'), "{err:?}");

    let out = run(&["node", "remove", "a100-3", "-o", "json"]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["name"], "a100-3");
}
