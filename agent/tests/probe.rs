//! Link probes over real data-plane servers on loopback: a probe measures a positive rate and
//! latency (close to the rate a paced server sends at), over TLS too; a probe without, with a
//! bad, another node's, an expired token or a file capability is refused, and so is one larger
//! than the bound; the agent's probe loop turns probes of a launch's peers into samples.

use std::collections::BTreeSet;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use motley_agent::checkpoints::dataplane::protocol::Reply;
use motley_agent::checkpoints::dataplane::{access, serve, Access, ClientTls, DataKey, DirResolver, Issued, Pacer, Probe, MAX_PROBE_BYTES};
use motley_agent::net::{probe, Meter, Pacing};
use motley_agent::AgentError;
use motley_proto::v1::PeerDataPlane;
use motley_server::capability::{mint, mint_probe, node_key, now_unix_s, probe_key, Grant, ProbeGrant, KEY_BYTES};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};

use crate::common;
use common::scratch;

const KEY: [u8; KEY_BYTES] = [42; KEY_BYTES];
const TIMEOUT: Duration = Duration::from_secs(10);

/// The keys a coordinator of cluster key `KEY` gives node `node` at registration.
fn data_key(node: &str) -> DataKey {
    let key = DataKey::default();
    let (node_key, probe_key) = (node_key(&KEY, node).unwrap(), probe_key(&KEY).unwrap());
    key.set(Issued { node_key: &node_key, probe_key: &probe_key, base: Duration::from_secs(1) }).unwrap();
    key
}

/// A data plane of node `node` holding its keys (no files), over `tls` if given, its probe
/// bytes paced by `pacer` if given.
async fn start(node: &str, tls: Option<Arc<tokio_rustls::rustls::ServerConfig>>, pacer: Option<Pacer>) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let access = Access { probe_pacer: pacer.map(Arc::new), ..Access::new(data_key(node), tls).with_node(node) };
    tokio::spawn(serve(listener, Arc::new(DirResolver::new(vec![])), access, Arc::new(Pacer::unlimited())));
    addr
}

fn token(node: &str) -> String {
    mint_probe(&probe_key(&KEY).unwrap(), &ProbeGrant { node: node.into(), expires_unix_s: now_unix_s() + 60 }).unwrap()
}

fn probe<'a>(addr: &'a str, token: Option<&'a str>) -> Probe<'a> {
    Probe { addr, token, tls: None, timeout: TIMEOUT }
}

fn refused(e: motley_agent::checkpoints::dataplane::ProbeFailed) -> String {
    assert_eq!(e.moved, 0, "a refused probe moves nothing");
    let text = e.to_string();
    assert!(matches!(e.error, AgentError::Probe { .. }), "{text}");
    text
}

#[tokio::test]
async fn a_probe_measures_a_positive_rate_and_latency_and_a_round_trip_only_a_latency() {
    let (n1, n2) = (start("n1", None, None).await, start("n2", None, None).await);
    for (addr, node) in [(&n1, "n1"), (&n2, "n2")] {
        let t = token(node);
        let m = probe(addr, Some(&t)).run(4 << 20).await.unwrap();
        assert_eq!(m.bytes, 4 << 20);
        let rate = m.rate_bytes_s.unwrap();
        eprintln!("{node}: 4 MiB probe over loopback: {:.2} GB/s, reply after {:?}", rate / 1e9, m.latency);
        // Loopback moves far more than 1 MB/s and answers within seconds.
        assert!(rate > 1e6 && rate.is_finite(), "{rate} B/s");
        assert!(m.latency > Duration::ZERO && m.latency < TIMEOUT, "{:?}", m.latency);
        assert!(m.local.is_some_and(|a| a.ip().is_loopback()), "{:?}", m.local);
        assert_eq!(motley_agent::net::local::interface_of(m.local.unwrap().ip()).as_deref(), Some("lo"));
    }
    let t = token("n1");
    let m = probe(&n1, Some(&t)).run(0).await.unwrap();
    assert_eq!((m.bytes, m.rate_bytes_s), (0, None));
    assert!(m.latency > Duration::ZERO);
}

#[tokio::test]
async fn a_probe_of_a_paced_server_measures_its_rate() {
    // The server sends probe bytes at 20 MB/s (a flow's pacer starts empty: no burst).
    let rate = 20e6;
    let addr = start("n1", None, Some(Pacer::flow(rate))).await;
    let t = token("n1");
    let m = probe(&addr, Some(&t)).run(4 << 20).await.unwrap();
    let got = m.rate_bytes_s.unwrap();
    eprintln!("a server paced at {:.1} MB/s measured at {:.2} MB/s", rate / 1e6, got / 1e6);
    // Generous: a loaded machine may only send slower; the pacer never lets it go much faster.
    assert!(got > 0.5 * rate && got < 1.25 * rate, "measured {got} B/s of a link paced at {rate}");
}

#[tokio::test]
async fn probes_without_the_right_token_or_beyond_the_bound_are_refused() {
    let addr = start("n1", None, None).await;
    let err = refused(probe(&addr, None).run(1 << 16).await.unwrap_err());
    assert!(err.contains("refused: probe refused: no probe token"), "{err}");
    let err = refused(probe(&addr, Some("v1.e30.AAAA")).run(1 << 16).await.unwrap_err());
    assert!(err.contains("bad signature"), "{err}");
    // Another key's, another node's, an expired one.
    let other = mint_probe(&[7; KEY_BYTES], &ProbeGrant { node: "n1".into(), expires_unix_s: now_unix_s() + 60 }).unwrap();
    assert!(refused(probe(&addr, Some(&other)).run(1 << 16).await.unwrap_err()).contains("bad signature"));
    let n2 = token("n2");
    let err = refused(probe(&addr, Some(&n2)).run(1 << 16).await.unwrap_err());
    assert!(err.contains("for node \"n2\", not \"n1\""), "{err}");
    let old = mint_probe(&probe_key(&KEY).unwrap(), &ProbeGrant { node: "n1".into(), expires_unix_s: now_unix_s() - 5 }).unwrap();
    // A token under the cluster key itself, or under a node's key, is not one under the probe key.
    for wrong in [KEY, node_key(&KEY, "n1").unwrap()] {
        let t = mint_probe(&wrong, &ProbeGrant { node: "n1".into(), expires_unix_s: now_unix_s() + 60 }).unwrap();
        assert!(refused(probe(&addr, Some(&t)).run(1 << 16).await.unwrap_err()).contains("bad signature"));
    }
    assert!(refused(probe(&addr, Some(&old)).run(1 << 16).await.unwrap_err()).contains("probe token expired"));
    // A file capability, under the node's key or the probe key, is no probe token.
    let grant = Grant { job: 1, generation: 1, step: 1, files: vec!["manifest.json".into()], expires_unix_s: u64::MAX };
    for k in [node_key(&KEY, "n1").unwrap(), probe_key(&KEY).unwrap()] {
        let file = mint(&k, &grant).unwrap();
        assert!(refused(probe(&addr, Some(&file)).run(1 << 16).await.unwrap_err()).contains("bad signature"));
    }
    // Nor does a probe token read a file.
    let t = token("n1");
    let line = format!(
        r#"{{"v":1,"capability":"{t}","job":1,"generation":1,"step":1,"file":"manifest.json","ranges":[[0,1]],"rate_bytes_s":null,"transport":"tcp"}}"#
    );
    assert!(raw(&addr, &line).await.error.unwrap().contains("bad signature"));
    // Larger than the bound: refused by the server before any byte, and by the client itself.
    let line = format!(r#"{{"v":1,"probe":{{"bytes":{}}},"capability":"{t}"}}"#, MAX_PROBE_BYTES + 1);
    let reply = raw(&addr, &line).await;
    assert!(!reply.ok && reply.error.as_deref().unwrap().contains("at most 8388608 bytes"), "{reply:?}");
    let line = format!(r#"{{"v":1,"probe":{{"bytes":{MAX_PROBE_BYTES}}},"capability":"{t}"}}"#);
    assert_eq!(raw(&addr, &line).await, Reply::ok(MAX_PROBE_BYTES));
    assert!(refused(probe(&addr, Some(&t)).run(MAX_PROBE_BYTES + 1).await.unwrap_err()).contains("at most 8388608"));
    // A data plane that does not know its node serves no probes.
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let anonymous = listener.local_addr().unwrap().to_string();
    tokio::spawn(serve(listener, Arc::new(DirResolver::new(vec![])), Access::new(data_key("n1"), None), Arc::new(Pacer::unlimited())));
    assert!(refused(probe(&anonymous, Some(&t)).run(1 << 16).await.unwrap_err()).contains("serves no probes"));
}

/// Writes a raw request line and returns the server's reply line (the rest unread).
async fn raw(addr: &str, request: &str) -> Reply {
    let mut stream = TcpStream::connect(addr).await.unwrap();
    stream.write_all(format!("{request}\n").as_bytes()).await.unwrap();
    let mut reply = String::new();
    BufReader::new(stream).read_line(&mut reply).await.unwrap();
    serde_json::from_str(&reply).unwrap()
}

#[tokio::test]
async fn a_probe_over_tls_measures_and_a_plain_probe_of_it_gets_nothing() {
    let dir = scratch("probe-tls");
    let (ca, cert, key_pem) = test_certificates(&dir);
    let files = motley_server::serve::TlsFiles { cert, key: key_pem };
    let hostport = start("n1", Some(access::server_config(&files.server_config().unwrap())), None).await;
    let url = format!("{}{hostport}", access::TLS_SCHEME);
    let client = ClientTls::new(Some(&std::fs::read(&ca).unwrap())).unwrap();
    let t = token("n1");
    let m = Probe { addr: &url, token: Some(&t), tls: Some(&client), timeout: TIMEOUT }.run(1 << 20).await.unwrap();
    assert!(m.bytes == 1 << 20 && m.rate_bytes_s.unwrap() > 0.0 && m.latency > Duration::ZERO, "{m:?}");
    // A refusal comes back over TLS too.
    let bad = Probe { addr: &url, token: Some("v1.e30.AAAA"), tls: Some(&client), timeout: TIMEOUT };
    assert!(refused(bad.run(1 << 16).await.unwrap_err()).contains("bad signature"));
    // A plain-TCP prober of the TLS data plane gets no reply.
    let mut plain = TcpStream::connect(&hostport).await.unwrap();
    plain.write_all(format!("{{\"v\":1,\"probe\":{{\"bytes\":65536}},\"capability\":\"{t}\"}}\n").as_bytes()).await.unwrap();
    let mut answer = Vec::new();
    let _ = tokio::time::timeout(TIMEOUT, plain.read_to_end(&mut answer)).await.expect("the server closes the connection");
    assert!(!String::from_utf8_lossy(&answer).contains("\"ok\""), "a plain prober got a reply");
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn the_agents_probe_loop_samples_its_launchs_peers_and_nothing_of_a_dead_one() {
    let (n1, n2) = (start("n1", None, None).await, start("n2", None, None).await);
    let meter = Arc::new(Meter::new("n0", Path::new("/nonexistent")));
    let dead = format!("127.0.0.1:{}", common::free_port());
    let peers = [("n0", "127.0.0.1:1"), ("n1", n1.as_str()), ("n2", n2.as_str()), ("n3", dead.as_str())]
        .map(|(node, url)| PeerDataPlane { node: node.into(), data_url: url.into() });
    meter.launched(1, 1, &peers);
    // A busy duty so that a second of real time sees several probes.
    let pacing = Pacing { duty: 0.5, target: Duration::from_millis(5) };
    let running = || BTreeSet::from([(1, 1)]);
    let _ = tokio::time::timeout(Duration::from_secs(1), probe::run(meter.clone(), pacing, data_key("n0"), None, running)).await;
    let samples = meter.take_links();
    for node in ["n1", "n2"] {
        let of: Vec<_> = samples.iter().filter(|s| s.peer == node).collect();
        assert!(!of.is_empty(), "no sample of {node}: {samples:?}");
        assert!(of.iter().all(|s| s.gb_per_s > 0.0 && s.latency_ms > 0.0 && s.nic_kind == "eth" && s.at_unix_ms > 0), "{of:?}");
    }
    assert!(samples.iter().all(|s| s.peer == "n1" || s.peer == "n2"), "this node or the dead one sampled: {samples:?}");
}

/// A test CA and a certificate it signed for 127.0.0.1: (ca, cert, key), by openssl (as the
/// data plane's TLS tests make theirs).
fn test_certificates(dir: &Path) -> (std::path::PathBuf, std::path::PathBuf, std::path::PathBuf) {
    let p = |name: &str| dir.join(name).to_str().unwrap().to_string();
    std::fs::write(dir.join("ext.cnf"), "subjectAltName=IP:127.0.0.1\nbasicConstraints=CA:FALSE\n").unwrap();
    let ec = "-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes";
    let runs = [
        format!("req -x509 {ec} -days 1 -subj /CN=motley-test-ca -keyout {} -out {}", p("ca.key"), p("ca.pem")),
        format!("req {ec} -subj /CN=127.0.0.1 -keyout {} -out {}", p("key.pem"), p("cert.csr")),
        format!(
            "x509 -req -in {} -CA {} -CAkey {} -CAcreateserial -days 1 -extfile {} -out {}",
            p("cert.csr"),
            p("ca.pem"),
            p("ca.key"),
            p("ext.cnf"),
            p("cert.pem")
        ),
    ];
    for args in runs {
        let status = std::process::Command::new("openssl")
            .args(args.split(' '))
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status()
            .unwrap();
        assert!(status.success(), "openssl {args} failed");
    }
    (dir.join("ca.pem"), dir.join("cert.pem"), dir.join("key.pem"))
}
