//! Credentials (README, "The running system"): an agent given `--tls-cert`/`--tls-key` serves
//! rank logs over https and registers an https logs URL; the coordinator fetches them (`GET
//! /api/v1/jobs/{id}/ranks/{rank}/logs`) with the agents' token, checking the agent's
//! certificate against `--agent-ca-cert`; without that CA the fetch fails naming the flag. The
//! agent's log service refuses the operators' token and no token. Where the test runs as root
//! (CI), the job names `user: nobody` and its log shows that the rank ran as nobody: the
//! coordinator passes the job's user to the agent.

use crate::common;

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use common::{until, Agent, Coordinator, Proc};

const OPERATOR_TOKEN: &str = "operator-secret";
const AGENT_TOKEN: &str = "agent-secret";

fn scratch(name: &str) -> PathBuf {
    common::scratch(&format!("motley_agent_tls_{name}"))
}

/// A test CA and a certificate it signed for 127.0.0.1: (ca, cert, key), by openssl (as
/// cli/tests/remote_cli.rs makes the coordinator's).
fn test_certificates(dir: &Path) -> (PathBuf, PathBuf, PathBuf) {
    let p = |name: &str| dir.join(name).to_str().unwrap().to_string();
    let ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"].map(String::from);
    std::fs::write(dir.join("ext.cnf"), "subjectAltName=IP:127.0.0.1,DNS:localhost\nbasicConstraints=CA:FALSE\n").unwrap();
    let ca: Vec<String> = ["req", "-x509"]
        .map(String::from)
        .into_iter()
        .chain(ec.clone())
        .chain(["-days", "1", "-subj", "/CN=motley-test-agents-ca", "-keyout", &p("ca.key"), "-out", &p("ca.pem")].map(String::from))
        .collect();
    let csr: Vec<String> = ["req"]
        .map(String::from)
        .into_iter()
        .chain(ec)
        .chain(["-subj", "/CN=127.0.0.1", "-keyout", &p("key.pem"), "-out", &p("cert.csr")].map(String::from))
        .collect();
    let sign: Vec<String> = [
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
    .to_vec();
    for args in [ca, csr, sign] {
        let ok = Command::new("openssl").args(&args).stderr(Stdio::null()).stdout(Stdio::null()).status().unwrap().success();
        assert!(ok, "openssl {args:?} failed");
    }
    (dir.join("ca.pem"), dir.join("cert.pem"), dir.join("key.pem"))
}

/// A coordinator with separate operator and agent tokens (and `extra` flags), and one agent
/// serving its logs over TLS: (coordinator, agent, REST base URL, the agent's stderr file).
fn start(dir: &Path, extra: &[&str], cert: &Path, key: &Path) -> (Coordinator, Proc, String, PathBuf) {
    let port_base = common::master_port_base();
    let mut flags = vec!["--heartbeat-ms", "500", "--token", OPERATOR_TOKEN, "--agent-token", AGENT_TOKEN];
    flags.extend(["--master-port-base", &port_base]);
    flags.extend(extra);
    let coordinator = Coordinator::start(&dir.join("data"), &flags);
    let rest = format!("http://{}", coordinator.addr);
    let agent_log = dir.join("agent.log");
    std::fs::write(dir.join("no-agent.toml"), "").unwrap();
    let agent = Agent::new(&coordinator.grpc_url(), "node-0", "examples/nodes/a100.yaml", &dir.join("agent"))
        .args(["--token", AGENT_TOKEN])
        .arg("--tls-cert")
        .arg(cert)
        .arg("--tls-key")
        .arg(key)
        .env("MOTLEY_CONFIG", dir.join("no-agent.toml"))
        .env("RUST_LOG", "info")
        .stderr(std::fs::File::create(&agent_log).unwrap())
        .spawn();
    (coordinator, agent, rest, agent_log)
}

/// (status, body) of a GET, with `token` as a bearer token if given, checked against `ca`.
fn get(url: &str, token: Option<&str>, ca: Option<&Path>) -> (u16, String) {
    let mut tls = ureq::tls::TlsConfig::builder();
    if let Some(ca) = ca {
        let pem = std::fs::read(ca).unwrap();
        tls = tls.root_certs(ureq::tls::RootCerts::new_with_certs(&[ureq::tls::Certificate::from_pem(&pem).unwrap()]));
    }
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(10)))
        .tls_config(tls.build())
        .build()
        .into();
    let mut req = agent.get(url);
    if let Some(t) = token {
        req = req.header("Authorization", &format!("Bearer {t}"));
    }
    match req.call() {
        Ok(mut resp) => {
            let mut body = String::new();
            resp.body_mut().as_reader().read_to_string(&mut body).unwrap();
            (resp.status().as_u16(), body)
        }
        Err(e) => (0, e.to_string()),
    }
}

fn post(url: &str, body: &str) -> serde_json::Value {
    let agent: ureq::Agent = ureq::Agent::config_builder().http_status_as_error(false).build().into();
    let mut resp = agent.post(url).header("Authorization", &format!("Bearer {OPERATOR_TOKEN}")).send(body).unwrap();
    serde_json::from_str(&resp.body_mut().read_to_string().unwrap()).unwrap()
}

/// Submit a job that prints who it runs as; wait for it to succeed: its id.
fn run_job(rest: &str, user: Option<&str>) -> i64 {
    until("the agent's registration", || {
        let (_, body) = get(&format!("{rest}/api/v1/nodes"), Some(OPERATOR_TOKEN), None);
        let nodes: serde_json::Value = serde_json::from_str(&body).ok()?;
        nodes.as_array()?.iter().any(|n| n["live"] == true).then_some(())
    });
    let user = user.map(|u| format!("user: {u}\n")).unwrap_or_default();
    let job = format!("name: tls\nmodel: gpt3-1.3b\nglobal_batch: 8\nresources: {{gpus: 2}}\nrun: 'id -u; echo hello-over-tls'\n{user}");
    let reply = post(&format!("{rest}/api/v1/jobs"), &job);
    let id = reply["id"].as_i64().unwrap_or_else(|| panic!("{reply}"));
    let state = until("the job ends", || {
        let (_, body) = get(&format!("{rest}/api/v1/jobs/{id}"), Some(OPERATOR_TOKEN), None);
        let j: serde_json::Value = serde_json::from_str(&body).ok()?;
        let state = j["state"].as_str()?.to_string();
        ["succeeded", "failed", "cancelled"].contains(&state.as_str()).then_some((state, j))
    });
    assert_eq!(state.0, "succeeded", "{}", state.1);
    id
}

#[test]
fn the_coordinator_fetches_rank_logs_over_tls_with_the_agents_token() {
    let dir = scratch("ok");
    let (ca, cert, key) = test_certificates(&dir);
    let (_coordinator, _agent, rest, agent_log) = start(&dir, &["--agent-ca-cert", ca.to_str().unwrap()], &cert, &key);
    // A root agent (CI) refuses jobs naming no user: this one names nobody.
    // SAFETY: geteuid(2) only reads.
    let root = unsafe { libc::geteuid() } == 0;
    let id = run_job(&rest, root.then_some("nobody"));

    let (status, body) = get(&format!("{rest}/api/v1/jobs/{id}/ranks/0/logs"), Some(OPERATOR_TOKEN), None);
    let uid = if root { "65534".to_string() } else { String::from_utf8(Command::new("id").arg("-u").output().unwrap().stdout).unwrap() };
    assert_eq!((status, body), (200, format!("{}\nhello-over-tls\n", uid.trim())), "fetched over https with the agent CA");
    // Its tail: the last 16 bytes at most, from the start of a line (the dashboard's first read).
    let (status, body) = get(&format!("{rest}/api/v1/jobs/{id}/ranks/0/logs?tail=16"), Some(OPERATOR_TOKEN), None);
    assert_eq!((status, body.as_str()), (200, "hello-over-tls\n"), "the tail, whole lines only");
    let (status, body) = get(&format!("{rest}/api/v1/jobs/{id}/ranks/0/logs?tail=16&offset=3"), Some(OPERATOR_TOKEN), None);
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("tail or offset"), "{body}");

    // The agent's log service itself: https only, the agents' token only.
    let logs_url = until("the agent's logs URL", || {
        let text = std::fs::read_to_string(&agent_log).ok()?;
        let at = text.find("rank logs at ")? + "rank logs at ".len();
        Some(text[at..].split("/logs/").next()?.to_string())
    });
    assert!(logs_url.starts_with("https://127.0.0.1:"), "{logs_url}");
    let url = format!("{logs_url}/logs/{id}/1/0");
    assert_eq!(get(&url, Some(AGENT_TOKEN), Some(&ca)).0, 200);
    let (status, body) = get(&url, Some(OPERATOR_TOKEN), Some(&ca));
    assert_eq!(status, 401, "the operators' token is not the agents': {body}");
    assert!(body.contains("the agent token"), "{body}");
    assert_eq!(get(&url, None, Some(&ca)).0, 401, "no token");
    let (status, body) = get(&url.replacen("https://", "http://", 1), Some(AGENT_TOKEN), None);
    assert_ne!(status, 200, "no plain HTTP on the TLS port: {body}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn without_the_agents_ca_the_fetch_fails_naming_the_flag() {
    let dir = scratch("noca");
    let (_, cert, key) = test_certificates(&dir);
    let (_coordinator, _agent, rest, _) = start(&dir, &[], &cert, &key);
    // SAFETY: geteuid(2) only reads.
    let root = unsafe { libc::geteuid() } == 0;
    let id = run_job(&rest, root.then_some("nobody"));
    let (status, body) = get(&format!("{rest}/api/v1/jobs/{id}/ranks/0/logs"), Some(OPERATOR_TOKEN), None);
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("--agent-ca-cert") && body.contains("node node-0"), "{body}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn an_unreadable_agent_ca_stops_the_coordinator_naming_the_flag() {
    let dir = scratch("badca");
    std::fs::write(dir.join("empty.pem"), "no certificate here\n").unwrap();
    for (ca, says) in
        [("/nonexistent/ca.pem", "cannot read /nonexistent/ca.pem"), (dir.join("empty.pem").to_str().unwrap(), "no certificate in")]
    {
        let out = Command::new(env!("CARGO_BIN_EXE_motley-coordinator"))
            .args(["--listen", "127.0.0.1:0", "--grpc-listen", "127.0.0.1:0", "--insecure", "--agent-ca-cert", ca])
            .args(["--data-dir", dir.join("data").to_str().unwrap()])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains("--agent-ca-cert") && err.contains(says), "{err}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
