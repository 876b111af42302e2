//! The data plane's shared limits under a peer that uses them up (docs/recovery.md, "Who may
//! fetch"): connections from one source address that say nothing hold at most that address's
//! share, and only for the request deadline, while fetches and a whole restore from another
//! address are served. The attacker binds its sockets to 127.0.0.2, a second loopback address;
//! the honest side connects from 127.0.0.1.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use motley_agent::checkpoints::dataplane::{ckpt_path, fetch, serve, Access, Arriving, DataKey, DirResolver, FileKey, Issued, Pacer, Root};
use motley_agent::checkpoints::restorer::{restore_dir, Restorer};
use motley_checkpoint::crc::file_entry;
use motley_proto::v1::{FetchRange, FetchSource, Restore, RestoreFile, RestoreResult};
use motley_server::capability::{self, KEY_BYTES};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpSocket, TcpStream};
use tokio::task::JoinHandle;

use crate::common;
use common::scratch;

const CLUSTER: [u8; KEY_BYTES] = [9; KEY_BYTES];
const JOB: i64 = 7;
const SOURCE_GEN: i64 = 2;
const STEP: u64 = 10;
const UNIT: &str = "layer.00003.model.tp0-2.safetensors";
const LEN: usize = (3 << 20) + 12345;
/// The attacker's source address.
const ATTACKER: IpAddr = IpAddr::V4(Ipv4Addr::new(127, 0, 0, 2));

fn key() -> FileKey {
    FileKey { job: JOB, generation: SOURCE_GEN, step: STEP, file: UNIT.into() }
}

fn contents(len: usize) -> Vec<u8> {
    (0..len).map(|i| (i * 31 + i / 251) as u8).collect()
}

/// The keys a coordinator of `CLUSTER` gives `node`, its base interval `base`.
fn issued(node: &str, base: Duration) -> DataKey {
    let key = DataKey::default();
    let (node_key, probe_key) = (capability::node_key(&CLUSTER, node).unwrap(), capability::probe_key(&CLUSTER).unwrap());
    key.set(Issued { node_key: &node_key, probe_key: &probe_key, base }).unwrap();
    key
}

/// A capability for the unit from `node`, as the coordinator mints it.
fn capability_from(node: &str) -> String {
    let files = vec![UNIT.to_string()];
    let grant = capability::Grant { job: JOB, generation: SOURCE_GEN, step: STEP, files, expires_unix_s: capability::now_unix_s() + 3600 };
    capability::mint(&capability::node_key(&CLUSTER, node).unwrap(), &grant).unwrap()
}

/// Node `node`'s data plane holding the unit in `work`, `max_connections` at once and
/// `max_per_source` from one address; its address.
async fn holder(node: &str, work: &Path, max_connections: usize, max_per_source: usize) -> SocketAddr {
    let path = ckpt_path(work, &key());
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(&path, contents(LEN)).unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let access = Access { max_connections, max_per_source, ..Access::new(issued(node, Duration::from_secs(1)), None) };
    let resolver = DirResolver::new(vec![Root { dir: work.to_path_buf(), read_pacer: None }]);
    tokio::spawn(serve(listener, Arc::new(resolver), access, Arc::new(Pacer::unlimited())));
    addr
}

/// A connection to `to` from `ATTACKER`.
async fn connect_from_attacker(to: SocketAddr) -> std::io::Result<TcpStream> {
    let socket = TcpSocket::new_v4()?;
    socket.bind(SocketAddr::new(ATTACKER, 0))?;
    socket.connect(to).await
}

/// Opens `first` connections to `to` from the attacker's address, then, in a task, one more
/// every 20 ms; sends a byte on none of them and closes none: an attacker that keeps every
/// slot it can get, as long as the task runs. Returns once the first are connected (queued
/// ahead of any connection made after).
async fn hold_idle(to: SocketAddr, first: usize) -> JoinHandle<()> {
    let mut held = vec![];
    for _ in 0..first {
        held.push(connect_from_attacker(to).await.expect("a connection from 127.0.0.2"));
    }
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(Duration::from_millis(20)).await;
            if let Ok(c) = connect_from_attacker(to).await {
                held.push(c);
            }
        }
    })
}

/// How many of `n` fresh attacker connections the server keeps open past a moment's wait.
async fn kept_open(to: SocketAddr, n: usize) -> usize {
    let mut conns = vec![];
    for _ in 0..n {
        conns.push(connect_from_attacker(to).await.unwrap());
    }
    let mut open = 0;
    for c in &mut conns {
        let mut byte = [0u8; 1];
        // Closed: the read ends at once (EOF or reset); open: it waits.
        if tokio::time::timeout(Duration::from_millis(300), c.read(&mut byte)).await.is_err() {
            open += 1;
        }
    }
    open
}

/// Many idle connections from one address take that address's share of the slots and no
/// more: a fetch from another address is served at once (before, they held every slot for
/// 10 s each, and the fetch waited in the listen queue past its timeout).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_from_one_address_leave_the_others_served() {
    let dir = scratch("idle-flood");
    let addr = holder("a", &dir.join("a"), 16, 4).await;
    let attack = hold_idle(addr, 64).await;
    let dest = std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(true).open(dir.join("dest")).unwrap();
    let cap = capability_from("a");
    for _ in 0..3 {
        let got = fetch(&addr.to_string(), Some(&cap), &key(), &[(0, LEN as u64)], &dest, &[], None, Duration::from_secs(5)).await;
        assert_eq!(got.expect("served while 127.0.0.2 holds its share"), LEN as u64);
    }
    assert_eq!(std::fs::read(dir.join("dest")).unwrap(), contents(LEN));
    attack.abort();
    // The address's share is what the server keeps of it: 4 open, the rest closed at once.
    let open = kept_open(addr, 8).await;
    assert!(open <= 4, "{open} connections from one address kept open beyond its share of 4");
}

/// A connection that brings no whole request line is closed at the request deadline (two base
/// intervals), long before the 10 s it was given before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_without_a_whole_request_line_is_closed_at_its_deadline() {
    let dir = scratch("deadline");
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    // A base interval of 500 ms: a request deadline of 1 s.
    let access = Access::new(issued("a", Duration::from_millis(500)), None);
    let resolver = DirResolver::new(vec![Root { dir, read_pacer: None }]);
    tokio::spawn(serve(listener, Arc::new(resolver), access, Arc::new(Pacer::unlimited())));
    let mut stream = TcpStream::connect(addr).await.unwrap();
    // Half a request line, then nothing: a slow peer holding its slot.
    stream.write_all(br#"{"v":1,"capability":"#).await.unwrap();
    let started = tokio::time::Instant::now();
    let mut rest = vec![];
    let closed = tokio::time::timeout(Duration::from_secs(5), stream.read_to_end(&mut rest)).await;
    assert!(closed.is_ok(), "not closed within 5 s of a 1 s deadline");
    assert!(started.elapsed() >= Duration::from_millis(900), "closed before its deadline: {:?}", started.elapsed());
    assert!(rest.is_empty(), "nothing is answered to half a line: {:?}", String::from_utf8_lossy(&rest));
}

/// A whole restore from node a while 127.0.0.2 keeps opening idle connections to a: it
/// succeeds, bit-exact. Before, the idle connections queued ahead of the restore's held the
/// slots for longer than the restorer waits on a peer, and the restore failed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restore_runs_while_another_address_holds_idle_connections() {
    let dir = scratch("idle-restore");
    let (a, dest) = (dir.join("a"), dir.join("dest"));
    let addr = holder("a", &a, 32, 8).await;
    let attack = hold_idle(addr, 200).await;

    let entry = file_entry(UNIT, &contents(LEN), 256 << 10);
    let peer = FetchSource { kind: "peer".into(), node: "a".into(), data_url: addr.to_string(), tier: "disk".into(), ..Default::default() };
    let peer = FetchSource { capability: capability_from("a"), ..peer };
    let file = RestoreFile {
        source_generation: SOURCE_GEN,
        file: UNIT.into(),
        bytes: entry.bytes,
        chunk_bytes: entry.chunk_bytes,
        crc32c: entry.crc32c,
        ranges: vec![FetchRange { offset: 0, bytes: LEN as u64, source: Some(peer.clone()), rate_mb_s: 0.0 }],
        fallbacks: vec![peer],
        copies: 0,
    };
    let arriving = Arriving::new(Duration::from_secs(10));
    let resolver = Arc::new(DirResolver::new(vec![Root { dir: dest.clone(), read_pacer: None }]).with_arriving(arriving.clone()));
    let r = Restorer::new(&dest, "dest", None, resolver, arriving, Arc::new(Pacer::unlimited()), Arc::new(Pacer::unlimited()));
    let restore = Restore { job: JOB, generation: 3, step: STEP, files: vec![file], timeout_s: 120, request: 1, ..Default::default() };
    r.start(restore);
    let res = finished(&r, 3).await;
    attack.abort();
    assert!(res.error.is_empty(), "the restore failed: {}", res.error);
    assert_eq!(res.peer_bytes, LEN as u64);
    assert_eq!(std::fs::read(restore_dir(&dest, JOB, SOURCE_GEN, STEP).join(UNIT)).unwrap(), contents(LEN));
}

/// Waits for the restore of `generation` to be reported.
async fn finished(r: &Restorer, generation: i64) -> RestoreResult {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    loop {
        if let Some(res) = r.report(u64::MAX).into_iter().find(|x| x.job == JOB && x.generation == generation) {
            return res;
        }
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        assert!(!left.is_zero(), "no result for generation {generation} within 120 s");
        let _ = tokio::time::timeout(left.min(Duration::from_millis(200)), r.changed()).await;
    }
}
