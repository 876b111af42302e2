//! `motley node ...` / `motley job ...` against a real `motley-coordinator` process on
//! loopback (SQLite in a temporary directory).

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

struct Coordinator {
    child: Child,
    url: String,
    grpc: String,
    token: String,
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
    // Built beside `motley` by the workspace build.
    let bin = Path::new(env!("CARGO_BIN_EXE_motley")).with_file_name("motley-coordinator");
    let mut child = Command::new(bin)
        .args(["--listen", "127.0.0.1:0", "--grpc-listen", "127.0.0.1:0", "--data-dir", dir.to_str().unwrap()])
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
    Coordinator { child, url, grpc, token }
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
            .env("MOTLEY_TOKEN", &c.token)
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
    while !ok(&c, &["node", "list", "-o", "json"]).contains("\"live\": true") {
        assert!(start.elapsed() < Duration::from_secs(30), "the agent never registered");
        std::thread::sleep(Duration::from_millis(50));
    }
    // Only the node with a live agent may run it; its ranks sleep until cancelled.
    let job = std::env::temp_dir().join(format!("motley-cli-job-{}.yaml", rand_suffix()));
    std::fs::write(&job, "name: sleeper\nmodel: gpt3-1.3b\nglobal_batch: 8\nresources: {gpus: 2, nodes: [a100-2]}\nrun: sleep 600\n")
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
    assert!(ok(&c, &["job", "cancel", &id]).contains("cancelled"));
    let watched = ok(&c, &["job", "watch", &id]);
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
