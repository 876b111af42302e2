//! The checkpoint data plane over real loopback TCP: agents' servers laid out like work dirs,
//! fetches of whole files and ranges, refusals, corruption in flight, placement, relays; who
//! may fetch (capabilities), TLS, and the bound on connections.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use motley_agent::checkpoints::dataplane::protocol::{FrameHeader, Reply};
use motley_agent::checkpoints::dataplane::{
    access, ckpt_path, fetch, fetch_to_path, restore_path, serve, temporary_path, Access, Arriving, ClientTls, DataKey, DirResolver,
    FileKey, Issued, Pacer, Peer, Root, Transport,
};
use motley_agent::AgentError;
use motley_server::capability::{mint, node_key, now_unix_s, probe_key, Grant, KEY_BYTES};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};

use crate::common;
use common::scratch;

/// The cluster key of the coordinator these data planes' keys come from.
const CLUSTER: [u8; KEY_BYTES] = [42; KEY_BYTES];
/// The node every server here stands for.
const HOLDER: &str = "holder";

/// The holder's own key, as the coordinator derives it and mints its capabilities with.
fn own() -> [u8; KEY_BYTES] {
    node_key(&CLUSTER, HOLDER).unwrap()
}
const TIMEOUT: Duration = Duration::from_secs(10);

fn key(file: &str) -> FileKey {
    FileKey { job: 7, generation: 2, step: 10, file: file.into() }
}

/// Bytes no two offsets of which are likely to agree, over several frames.
fn contents(len: usize) -> Vec<u8> {
    (0..len).map(|i| (i * 31 + i / 251) as u8).collect()
}

fn put(path: &Path, bytes: &[u8]) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(path, bytes).unwrap();
}

/// A capability for `files` of `key`'s job, generation and step, under `with`, expiring at `expires`.
fn grant(with: &[u8], key: &FileKey, files: &[&str], expires: u64) -> String {
    let files = files.iter().map(|f| f.to_string()).collect();
    mint(with, &Grant { job: key.job, generation: key.generation, step: key.step, files, expires_unix_s: expires }).unwrap()
}

/// The capability a coordinator would put into a Restore for `key`'s file.
fn cap(key: &FileKey) -> String {
    grant(&own(), key, &[&key.file], now_unix_s() + 3600)
}

/// The keys a coordinator of `CLUSTER` gives node `node` at registration.
fn issued(node: &str) -> DataKey {
    let key = DataKey::default();
    let (node_key, probe_key) = (node_key(&CLUSTER, node).unwrap(), probe_key(&CLUSTER).unwrap());
    key.set(Issued { node_key: &node_key, probe_key: &probe_key, base: Duration::from_secs(1) }).unwrap();
    key
}

/// The holder's server, over `tls` if given.
fn access(tls: Option<Arc<tokio_rustls::rustls::ServerConfig>>) -> Access {
    Access::new(issued(HOLDER), tls)
}

async fn start_with(resolver: DirResolver, access: Access) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    tokio::spawn(serve(listener, Arc::new(resolver), access, Arc::new(Pacer::unlimited())));
    addr
}

async fn start(resolver: DirResolver) -> String {
    start_with(resolver, access(None)).await
}

fn roots(dirs: &[&Path]) -> DirResolver {
    DirResolver::new(dirs.iter().map(|d| Root { dir: d.to_path_buf(), read_pacer: None }).collect())
}

fn dest(dir: &Path) -> std::fs::File {
    std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(true).open(dir.join("dest")).unwrap()
}

fn message(e: AgentError) -> String {
    let text = e.to_string();
    assert!(matches!(e, AgentError::DataPlane { .. }), "{text}");
    text
}

const UNIT: &str = "layer.00003.model.tp0-2.safetensors";
const LEN: usize = 3 * (1 << 20) + 12345;

#[tokio::test]
async fn whole_files_and_ranges_from_two_servers_arrive_byte_for_byte() {
    let dir = scratch("two-servers");
    let bytes = contents(LEN);
    // Node A holds the unit its rank wrote (in its memory root); node B a restored copy in its work dir.
    let (a_mem, a_work, b_work) = (dir.join("a-mem"), dir.join("a-work"), dir.join("b-work"));
    put(&ckpt_path(&a_mem, &key(UNIT)), &bytes);
    put(&restore_path(&b_work, &key(UNIT)), &bytes);
    let a = start(roots(&[&a_mem, &a_work])).await;
    let b = start(roots(&[&b_work])).await;

    let whole = dest(&dir);
    let unit = key(UNIT);
    let c = cap(&unit);
    let got = fetch(&a, Some(&c), &unit, &[(0, LEN as u64)], &whole, &[], None, TIMEOUT).await.unwrap();
    assert_eq!(got, LEN as u64);
    assert_eq!(std::fs::read(dir.join("dest")).unwrap(), bytes);

    let pieces = std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(true).open(dir.join("pieces")).unwrap();
    let split = (1 << 20) + 5;
    let nic = [Arc::new(Pacer::new(1e9))];
    let (a_ranges, b_ranges) = ([(2 << 20, LEN as u64 - (2 << 20)), (0, split)], [(split, (2 << 20) - split)]);
    let from_a = fetch(&a, Some(&c), &unit, &a_ranges, &pieces, &nic, None, TIMEOUT);
    let from_b = fetch(&b, Some(&c), &unit, &b_ranges, &pieces, &nic, Some(1e9), TIMEOUT);
    let (from_a, from_b) = tokio::join!(from_a, from_b);
    assert_eq!(from_a.unwrap() + from_b.unwrap(), LEN as u64);
    assert_eq!(std::fs::read(dir.join("pieces")).unwrap(), bytes);
}

#[tokio::test]
async fn fetches_without_a_capability_for_exactly_the_file_are_refused() {
    let dir = scratch("capability");
    put(&ckpt_path(&dir, &key(UNIT)), &contents(100));
    put(&ckpt_path(&dir, &key("manifest.json")), &contents(10));
    let addr = start(roots(&[&dir])).await;
    let later = now_unix_s() + 3600;
    let other_job = FileKey { job: 8, ..key(UNIT) };
    let cases = [
        (None, "no capability"),
        (Some("v1.e30.AAAA".to_string()), "bad signature"),
        (Some(grant(&[1; KEY_BYTES], &key(UNIT), &[UNIT], later)), "bad signature"),
        // Minted for another node's files, or under the cluster key the nodes never hold.
        (Some(grant(&node_key(&CLUSTER, "other").unwrap(), &key(UNIT), &[UNIT], later)), "bad signature"),
        (Some(grant(&CLUSTER, &key(UNIT), &[UNIT], later)), "bad signature"),
        (Some(cap(&other_job)), "the capability is for job 8, not job 7"),
        (Some(cap(&FileKey { generation: 1, ..key(UNIT) })), "generation 1, not generation 2"),
        (Some(cap(&FileKey { step: 20, ..key(UNIT) })), "step 20, not step 10"),
        (Some(grant(&own(), &key(UNIT), &[UNIT], now_unix_s() - 1)), "the capability expired"),
        (Some(cap(&key("manifest.json"))), &format!("does not list file \"{UNIT}\"")),
    ];
    for (capability, want) in cases {
        let err = message(fetch(&addr, capability.as_deref(), &key(UNIT), &[(0, 100)], &dest(&dir), &[], None, TIMEOUT).await.unwrap_err());
        assert!(err.contains(want) && err.contains(UNIT) && err.contains(&addr), "want {want:?}: {err}");
    }
    // The file the capability lists is served.
    let manifest = key("manifest.json");
    assert_eq!(fetch(&addr, Some(&cap(&manifest)), &manifest, &[(0, 10)], &dest(&dir), &[], None, TIMEOUT).await.unwrap(), 10);

    // An agent that has no key yet (not registered) refuses even a good capability.
    let keyless = start_with(roots(&[&dir]), Access::new(DataKey::default(), None)).await;
    let err = message(fetch(&keyless, Some(&cap(&key(UNIT))), &key(UNIT), &[(0, 100)], &dest(&dir), &[], None, TIMEOUT).await.unwrap_err());
    assert!(err.contains("no data-plane key yet"), "{err}");
}

#[tokio::test]
async fn a_file_not_held_is_refused_by_name() {
    let dir = scratch("not-held");
    put(&ckpt_path(&dir, &key(UNIT)), &contents(100));
    let addr = start(roots(&[&dir])).await;
    let other = FileKey { step: 11, ..key("head.model.tp0-1.safetensors") };
    let err = message(fetch(&addr, Some(&cap(&other)), &other, &[(0, 100)], &dest(&dir), &[], None, TIMEOUT).await.unwrap_err());
    assert!(err.contains("head.model.tp0-1.safetensors (job 7 generation 2 step 11): not held here"), "{err}");
}

#[tokio::test]
async fn a_range_beyond_the_file_is_refused() {
    let dir = scratch("beyond");
    put(&ckpt_path(&dir, &key(UNIT)), &contents(100));
    let addr = start(roots(&[&dir])).await;
    let err =
        message(fetch(&addr, Some(&cap(&key(UNIT))), &key(UNIT), &[(0, 50), (90, 11)], &dest(&dir), &[], None, TIMEOUT).await.unwrap_err());
    assert!(err.contains("range [90, 101) is beyond the file's length of 100 bytes"), "{err}");
}

/// Writes a raw request line and returns the server's reply line.
async fn raw_request(addr: &str, request: &str) -> Reply {
    let mut stream = TcpStream::connect(addr).await.unwrap();
    stream.write_all(format!("{request}\n").as_bytes()).await.unwrap();
    let mut reply = String::new();
    BufReader::new(stream).read_line(&mut reply).await.unwrap();
    serde_json::from_str(&reply).unwrap()
}

#[tokio::test]
async fn the_server_refuses_other_versions_rdma_and_names_outside_the_step_directory() {
    let dir = scratch("raw");
    put(&ckpt_path(&dir, &key(UNIT)), &contents(100));
    let addr = start(roots(&[&dir])).await;
    // A capability that lists names outside the step directory (as no coordinator would): the
    // server's own name check still refuses them.
    let bad_names = ["../../../agent.lock", "step-00000010/manifest.json", "layer.00003.model.tp0-2.safetensors.tmp.9"];
    let listed: Vec<&str> = [UNIT].into_iter().chain(bad_names).collect();
    let c = grant(&own(), &key(UNIT), &listed, now_unix_s() + 3600);
    let req = |v: u32, file: &str, transport: &str| {
        format!(
            r#"{{"v":{v},"capability":"{c}","job":7,"generation":2,"step":10,"file":"{file}","ranges":[[0,10]],"rate_bytes_s":null,"transport":"{transport}"}}"#
        )
    };
    let ok = raw_request(&addr, &req(1, UNIT, "tcp")).await;
    assert_eq!(ok, Reply::ok(100));
    let refused = |r: Reply| r.error.unwrap_or_default();
    assert!(refused(raw_request(&addr, &req(2, UNIT, "tcp")).await).contains("unknown protocol version 2"));
    assert_eq!(refused(raw_request(&addr, &req(1, UNIT, "rdma")).await), "this agent was built without RDMA (cargo feature rdma); use tcp");
    for name in bad_names {
        let err = refused(raw_request(&addr, &req(1, name, "tcp")).await);
        assert!(err.contains("not a checkpoint file name"), "{name}: {err}");
    }
    let long = format!("{{\"v\":1,\"pad\":\"{}\"}}", "x".repeat(70 << 10));
    assert!(refused(raw_request(&addr, &long).await).contains("longer than 65536 bytes"));

    // The client refuses RDMA itself rather than asking.
    let peer = Peer {
        addr: &addr,
        capability: Some(&c),
        tls: None,
        transport: Transport::Rdma,
        pacers: &[],
        rate_bytes_s: None,
        timeout: TIMEOUT,
    };
    let err = message(peer.fetch(&key(UNIT), &[(0, 10)], &dest(&dir)).await.unwrap_err());
    assert!(err.contains("without RDMA"), "{err}");
}

/// A peer that answers any request with `ok` for a 30-byte file and then the given bytes.
async fn fake_server(frames: Vec<u8>) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    tokio::spawn(async move {
        loop {
            let (stream, _) = listener.accept().await.unwrap();
            let mut reader = BufReader::new(stream);
            let mut request = String::new();
            reader.read_line(&mut request).await.unwrap();
            let mut stream = reader.into_inner();
            stream.write_all(b"{\"ok\":true,\"bytes\":30}\n").await.unwrap();
            stream.write_all(&frames).await.unwrap();
            let _ = stream.shutdown().await;
        }
    });
    addr
}

fn frame(offset: u64, payload: &[u8], crc: Option<u32>) -> Vec<u8> {
    let mut header = FrameHeader::for_payload(offset, payload);
    header.crc32c = crc.unwrap_or(header.crc32c);
    [&header.to_bytes()[..], payload].concat()
}

#[tokio::test]
async fn a_frame_corrupt_in_flight_is_caught_with_its_offset_and_both_crcs() {
    let dir = scratch("corrupt");
    let bytes = contents(30);
    let good = crc32c::crc32c(&bytes[10..20]);
    let mut flipped = bytes[10..20].to_vec();
    flipped[3] ^= 0x40;
    let stream = [
        frame(0, &bytes[..10], None),
        frame(10, &flipped, Some(good)),
        frame(20, &bytes[20..], None),
        FrameHeader::END.to_bytes().to_vec(),
    ]
    .concat();
    let addr = fake_server(stream).await;
    let err = message(fetch(&addr, None, &key(UNIT), &[(0, 30)], &dest(&dir), &[], None, TIMEOUT).await.unwrap_err());
    let expected = format!("bytes 10..20 arrived with crc32c {:08x}, the frame says {good:08x}", crc32c::crc32c(&flipped));
    assert!(err.contains(&expected) && err.contains(UNIT), "{err}");
}

#[tokio::test]
async fn frames_twice_out_of_order_or_short_are_refused() {
    let dir = scratch("order");
    let bytes = contents(30);
    let end = FrameHeader::END.to_bytes().to_vec();
    let cases = [
        (
            [frame(0, &bytes[..10], None), frame(0, &bytes[..10], None), end.clone()].concat(),
            "frame of bytes 0..10 where bytes from 10 up to 30 were due",
        ),
        ([frame(10, &bytes[10..20], None), end.clone()].concat(), "frame of bytes 10..20 where bytes from 0 up to 30 were due"),
        ([frame(0, &bytes[..10], None), end.clone()].concat(), "the stream ended at byte 10 of range 0..30"),
        (frame(0, &bytes[..10], None), "reading a frame"),
    ];
    for (stream, want) in cases {
        let addr = fake_server(stream).await;
        let err = message(fetch(&addr, None, &key(UNIT), &[(0, 30)], &dest(&dir), &[], None, TIMEOUT).await.unwrap_err());
        assert!(err.contains(want), "want {want:?}: {err}");
    }
}

#[tokio::test]
async fn fetch_to_path_places_only_the_manifests_copy() {
    let dir = scratch("to-path");
    let bytes = contents(LEN);
    let served = ckpt_path(&dir.join("peer"), &key(UNIT));
    put(&served, &bytes);
    let addr = start(roots(&[&dir.join("peer")])).await;
    let target = restore_path(&dir.join("me"), &key(UNIT));
    let chunk = 1 << 20;
    let c = cap(&key(UNIT));

    // The manifest describes other bytes of the same length: chunk 2 differs.
    let mut other = bytes.clone();
    other[(2 << 20) + 7] ^= 1;
    let entry = motley_checkpoint::crc::file_entry(UNIT, &other, chunk);
    let err = message(fetch_to_path(&addr, Some(&c), &key(UNIT), &entry, &target, &[], None, TIMEOUT).await.unwrap_err());
    assert!(err.contains("chunk 2 (bytes 2097152..3145728)") && err.contains("fetch the unit again"), "{err}");
    assert!(!target.exists() && !temporary_path(&target).exists());

    // A manifest of another length is refused before any byte moves.
    let short = motley_checkpoint::crc::file_entry(UNIT, &bytes[..100], chunk);
    let err = message(fetch_to_path(&addr, Some(&c), &key(UNIT), &short, &target, &[], None, TIMEOUT).await.unwrap_err());
    assert!(err.contains(&format!("the peer's copy has {LEN} bytes, the manifest says 100")), "{err}");
    assert!(!target.exists() && !temporary_path(&target).exists());

    let entry = motley_checkpoint::crc::file_entry(UNIT, &bytes, chunk);
    let got = fetch_to_path(&addr, Some(&c), &key(UNIT), &entry, &target, &[], None, TIMEOUT).await.unwrap();
    assert_eq!(got, LEN as u64);
    assert_eq!(std::fs::read(&target).unwrap(), bytes);
    assert!(!temporary_path(&target).exists());
    let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&target), 0o600);
    assert_eq!(mode(target.parent().unwrap()), 0o700);
}

#[tokio::test]
async fn a_relayed_file_is_served_once_it_has_arrived() {
    let dir = scratch("relay");
    let bytes = contents(LEN);
    let arriving = Arriving::new(TIMEOUT);
    let addr = start(roots(&[&dir]).with_arriving(arriving.clone())).await;
    let arrival = arriving.begin(key(UNIT));

    let waiting = tokio::spawn({
        let (addr, dest) = (addr.clone(), dest(&dir));
        async move { fetch(&addr, Some(&cap(&key(UNIT))), &key(UNIT), &[(0, LEN as u64)], &dest, &[], None, TIMEOUT).await }
    });
    // The peer's request is waiting at the server, not refused.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!waiting.is_finished());
    put(&restore_path(&dir, &key(UNIT)), &bytes);
    arrival.complete();
    assert_eq!(waiting.await.unwrap().unwrap(), LEN as u64);
    assert_eq!(std::fs::read(dir.join("dest")).unwrap(), bytes);
}

#[tokio::test]
async fn a_relayed_file_that_never_arrives_is_refused_after_the_wait_or_at_once_when_its_fetch_fails() {
    let dir = scratch("relay-never");
    let arriving = Arriving::new(Duration::from_millis(200));
    let addr = start(roots(&[&dir]).with_arriving(arriving.clone())).await;
    let arrival = arriving.begin(key(UNIT));
    let err = message(fetch(&addr, Some(&cap(&key(UNIT))), &key(UNIT), &[(0, 10)], &dest(&dir), &[], None, TIMEOUT).await.unwrap_err());
    assert!(err.contains("still arriving at this node after 200ms; fetch it from another holder"), "{err}");

    let slow = Arriving::new(TIMEOUT);
    let addr = start(roots(&[&dir]).with_arriving(slow.clone())).await;
    let failing = slow.begin(key(UNIT));
    let waiting = tokio::spawn({
        let (addr, dest) = (addr.clone(), dest(&dir));
        async move { fetch(&addr, Some(&cap(&key(UNIT))), &key(UNIT), &[(0, 10)], &dest, &[], None, TIMEOUT).await }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    drop(failing);
    let err = message(waiting.await.unwrap().unwrap_err());
    assert!(err.contains("this node's own fetch of it failed"), "{err}");
    drop(arrival);
}

#[tokio::test]
async fn a_peer_that_never_answers_times_out_by_name() {
    let dir = scratch("stall");
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    // Accepts and holds the connection without a word.
    tokio::spawn(async move {
        let (mut stream, _) = listener.accept().await.unwrap();
        let mut sink = Vec::new();
        let _ = stream.read_to_end(&mut sink).await;
    });
    let err = message(fetch(&addr, None, &key(UNIT), &[(0, 10)], &dest(&dir), &[], None, Duration::from_millis(200)).await.unwrap_err());
    assert!(err.contains("reading the reply: nothing for 200ms; the peer stalled"), "{err}");
}

/// A test CA and a certificate it signed for 127.0.0.1: (ca, cert, key), by openssl (as the
/// coordinator's TLS tests make theirs).
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

/// A TCP fetch from `addr` with capability `c`, over TLS with `tls` if given.
fn peer<'a>(addr: &'a str, tls: Option<&'a ClientTls>, c: &'a str) -> Peer<'a> {
    Peer { addr, capability: Some(c), tls, transport: Transport::Tcp, pacers: &[], rate_bytes_s: None, timeout: TIMEOUT }
}

#[tokio::test]
async fn over_tls_a_capability_fetches_and_plain_tcp_is_refused_both_ways() {
    let dir = scratch("tls");
    let bytes = contents(LEN);
    put(&ckpt_path(&dir, &key(UNIT)), &bytes);
    let (ca, cert, key_pem) = test_certificates(&dir);
    let files = motley_server::serve::TlsFiles { cert, key: key_pem };
    let server = access::server_config(&files.server_config().unwrap());
    let hostport = start_with(roots(&[&dir]), access(Some(server))).await;
    let tls_url = format!("{}{hostport}", access::TLS_SCHEME);
    let client = ClientTls::new(Some(&std::fs::read(&ca).unwrap())).unwrap();
    let (c, client) = (cap(&key(UNIT)), &client);
    let (tls_url, hostport, c) = (tls_url.as_str(), hostport.as_str(), c.as_str());

    // A valid capability over TLS: every byte.
    let got = peer(tls_url, Some(client), c).fetch(&key(UNIT), &[(0, LEN as u64)], &dest(&dir)).await.unwrap();
    assert_eq!(got, LEN as u64);
    assert_eq!(std::fs::read(dir.join("dest")).unwrap(), bytes);
    // A refusal comes back over TLS too.
    let err = message(peer(tls_url, Some(client), "v1.e30.AAAA").fetch(&key(UNIT), &[(0, 10)], &dest(&dir)).await.unwrap_err());
    assert!(err.contains("bad signature"), "{err}");

    // A plain-TCP client of the TLS data plane gets no reply: the handshake fails.
    let mut raw = TcpStream::connect(hostport).await.unwrap();
    let line = format!(
        r#"{{"v":1,"capability":"{c}","job":7,"generation":2,"step":10,"file":"{UNIT}","ranges":[[0,10]],"rate_bytes_s":null,"transport":"tcp"}}"#
    );
    raw.write_all(format!("{line}\n").as_bytes()).await.unwrap();
    let mut answer = Vec::new();
    let _ = tokio::time::timeout(TIMEOUT, raw.read_to_end(&mut answer)).await.expect("the server closes the connection");
    assert!(!String::from_utf8_lossy(&answer).contains("\"ok\""), "a plain client got a reply: {answer:?}");

    // This agent's client never falls back to plain TCP, nor talks TLS to a plain peer...
    let err = message(peer(hostport, Some(client), c).fetch(&key(UNIT), &[(0, 10)], &dest(&dir)).await.unwrap_err());
    assert!(err.contains("fetches over TLS only"), "{err}");
    let err = message(peer(tls_url, None, c).fetch(&key(UNIT), &[(0, 10)], &dest(&dir)).await.unwrap_err());
    assert!(err.contains("this agent has no TLS"), "{err}");
    // ...and a peer that claims TLS but speaks plain TCP fails the handshake.
    let plain = start(roots(&[&dir])).await;
    let fake_tls = format!("{}{plain}", access::TLS_SCHEME);
    let err = message(peer(&fake_tls, Some(client), c).fetch(&key(UNIT), &[(0, 10)], &dest(&dir)).await.unwrap_err());
    assert!(err.contains("TLS handshake failed"), "{err}");
}

#[tokio::test]
async fn connections_beyond_the_bound_wait_unread_until_a_slot_frees() {
    let dir = scratch("bound");
    put(&ckpt_path(&dir, &key(UNIT)), &contents(100));
    let addr = start_with(roots(&[&dir]), Access { max_connections: 1, ..access(None) }).await;
    // One connection that says nothing holds the only slot.
    let silent = TcpStream::connect(&addr).await.unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    let waiting = tokio::spawn({
        let (addr, dest) = (addr.clone(), dest(&dir));
        async move { fetch(&addr, Some(&cap(&key(UNIT))), &key(UNIT), &[(0, 100)], &dest, &[], None, TIMEOUT).await }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!waiting.is_finished(), "a second connection was served beyond the bound of 1");
    // Its slot freed, the waiting fetch is served.
    drop(silent);
    assert_eq!(waiting.await.unwrap().unwrap(), 100);
}
