//! `motley net show`: the link matrix as a table and as the API's JSON (`-o json`), whose
//! `bandwidth` section reads as a `motley replan --bandwidth` file; `--node` asks the
//! coordinator for one node's part; an unknown node is an error naming it and the fix.

use std::io::{BufRead, BufReader, Read, Write};
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};

const DOC: &str = r#"{
  "links": [
    {"a": "n0", "b": "n1", "nic_kind": "ib", "gb_per_s": 10.5, "latency_ms": 0.012, "samples": 3, "updated_unix_ms": 1000,
     "declared_gb_per_s": 21.25,
     "history": [{"at_unix_ms": 500, "gb_per_s": 9.0, "latency_ms": 0.02}, {"at_unix_ms": 1000, "gb_per_s": 10.5, "latency_ms": 0.012}]},
    {"a": "n0", "b": "x9", "nic_kind": "eth", "gb_per_s": 1.1, "latency_ms": 0.2, "samples": 1, "updated_unix_ms": 1000,
     "declared_gb_per_s": null, "history": [{"at_unix_ms": 1000, "gb_per_s": 1.1, "latency_ms": 0.2}]}
  ],
  "nics": [{"node": "n0", "name": "mlx5_0:1", "kind": "ib", "tx_gb_per_s": 3.5, "rx_gb_per_s": 0.25, "at_unix_ms": 1000}],
  "bandwidth": {"pairs": [{"a": "n0", "b": "n1", "gb_per_s": 10.5}, {"a": "n0", "b": "x9", "gb_per_s": 1.1}]}
}"#;

/// A coordinator that answers each connection with the next canned (status, JSON body) and
/// sends the request lines it saw down the channel.
fn scripted_coordinator(answers: Vec<(u16, &'static str)>) -> (String, std::sync::mpsc::Receiver<String>) {
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

fn motley(url: &str, token: Option<&str>, args: &[&str]) -> Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_motley"));
    c.args(args).env("MOTLEY_COORDINATOR", url).env_remove("MOTLEY_OUTPUT").env_remove("MOTLEY_TOKEN").current_dir(std::env::temp_dir());
    if let Some(t) = token {
        c.env("MOTLEY_TOKEN", t);
    }
    c.output().unwrap()
}

/// Table rows as trimmed cells.
fn rows(out: &str) -> Vec<Vec<String>> {
    out.lines().filter(|l| l.starts_with('│')).map(|l| l.trim_matches('│').split('┆').map(|c| c.trim().to_string()).collect()).collect()
}

#[test]
fn net_show_prints_the_matrix_as_a_table_and_as_json() {
    let (url, seen) = scripted_coordinator(vec![(200, DOC), (200, DOC)]);
    let out = motley(&url, None, &["net", "show", "--node", "n0", "-o", "json"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(seen.recv().unwrap(), "GET /api/v1/net?node=n0 HTTP/1.1");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v, serde_json::from_str::<serde_json::Value>(DOC).unwrap(), "the API's document as it is");
    // Saved, the bandwidth section is a `motley replan --bandwidth` file.
    let spec: motley_solver::bandwidth::BandwidthSpec = serde_json::from_value(v["bandwidth"].clone()).unwrap();
    assert_eq!(spec.pairs.len(), 2);
    assert_eq!((spec.pairs[0].a.as_str(), spec.pairs[0].b.as_str(), spec.pairs[0].gb_per_s), ("n0", "n1", 10.5));

    let out = motley(&url, None, &["net", "show"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(seen.recv().unwrap(), "GET /api/v1/net HTTP/1.1");
    let text = String::from_utf8(out.stdout).unwrap();
    let rows = rows(&text);
    assert_eq!(rows[0], ["a", "b", "nic", "measured GB/s", "declared GB/s", "ratio", "latency ms", "samples", "age"], "{text}");
    assert_eq!(&rows[1][..8], ["n0", "n1", "ib", "10.50", "21.25", "0.49", "0.012", "3"], "{text}");
    assert_eq!(&rows[2][..6], ["n0", "x9", "eth", "1.10", "-", "-"], "no declared rate, no ratio: {text}");
    assert_eq!(rows[3], ["node", "nic", "kind", "tx GB/s", "rx GB/s", "age"], "{text}");
    assert_eq!(&rows[4][..5], ["n0", "mlx5_0:1", "ib", "3.500", "0.250"], "{text}");
}

/// A child process killed when the test ends, also when it fails.
struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn net_show_against_a_coordinator_names_an_unknown_node_and_the_fix() {
    let dir = std::env::temp_dir().join(format!(
        "motley-net-cli-{}-{}",
        std::process::id(),
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    // Built beside `motley` by the workspace build.
    let bin = Path::new(env!("CARGO_BIN_EXE_motley")).with_file_name("motley-coordinator");
    let mut child = Killed(
        Command::new(bin)
            .args(["--listen", "127.0.0.1:0", "--grpc-listen", "127.0.0.1:0", "--data-dir", dir.to_str().unwrap()])
            .env_remove("MOTLEY_TOKEN")
            .env_remove("MOTLEY_DATABASE_URL")
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("motley-coordinator is built by `cargo nextest run --workspace`"),
    );
    let mut line = String::new();
    BufReader::new(child.0.stdout.take().unwrap()).read_line(&mut line).unwrap();
    let url = line.trim().rsplit(' ').next().unwrap().to_string();
    let token = std::fs::read_to_string(dir.join("token")).unwrap().trim().to_string();

    let out = motley(&url, Some(&token), &["net", "show"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).starts_with("no link measured yet"), "{}", String::from_utf8_lossy(&out.stdout));
    let v: serde_json::Value = serde_json::from_slice(&motley(&url, Some(&token), &["net", "show", "-o", "json"]).stdout).unwrap();
    assert_eq!(v, serde_json::json!({"links": [], "nics": [], "bandwidth": {"pairs": []}}));

    let out = motley(&url, Some(&token), &["net", "show", "--node", "ghost"]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("coordinator (400)") && err.contains("'ghost'") && err.contains("motley node list"), "{err}");
}
