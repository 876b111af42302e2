//! Fault tests of the agent's restore path (docs/recovery.md, "A recovery, step by step", step 6):
//! holders laid out as ranks leave their work dirs, each serving its files over a real loopback
//! data plane, a file:// cloud, and a destination `Restorer` whose own work dir holds its local
//! copies. Every test ends with each restored file bit-exact against the manifest (or, for the
//! failures, nothing under a final name).

use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use motley_agent::checkpoints::cloud::Cloud;
use motley_agent::checkpoints::dataplane::protocol::{line, FrameHeader, Reply};
use motley_agent::checkpoints::dataplane::{ckpt_path, serve, Access, Arriving, DataKey, DirResolver, FileKey, Issued, Pacer, Root};
use motley_agent::checkpoints::restorer::{launch_list, restore_dir, Restorer};
use motley_checkpoint::crc::file_entry;
use motley_checkpoint::{shard_full, Block, Dtype, Layout, Part, TensorSpec, Unit, UnitKey};
use motley_proto::v1::{FetchRange, FetchSource, MakeUnit, Restore, RestoreFile, RestoreResult};
use motley_server::capability;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpListener;

use crate::common;
use common::scratch;

const JOB: i64 = 7;
/// The launch that wrote the checkpoint, and the one being restored for.
const SOURCE_GEN: i64 = 2;
const NEXT_GEN: i64 = 3;
const STEP: u64 = 10;
/// The manifest's chunk in these tests (small, so one file has several).
const CHUNK: u64 = 256 << 10;
const UNIT: &str = "layer.00003.model.tp0-2.safetensors";
const RANK: &str = "rank.00000.safetensors";
const LEN: usize = 5 * CHUNK as usize + 12345;

/// Bytes no two nearby offsets of which are likely to agree.
fn contents(len: usize, salt: usize) -> Vec<u8> {
    (0..len).map(|i| (i * 31 + i / 251 + salt * 7) as u8).collect()
}

fn key(file: &str) -> FileKey {
    FileKey { job: JOB, generation: SOURCE_GEN, step: STEP, file: file.into() }
}

/// A holder's work dir: each file where its rank left it (`WORK/jobs/J/G/ckpt/step-S/`).
fn holder(work: &Path, files: &[(&str, &[u8])]) {
    for (name, bytes) in files {
        let path = ckpt_path(work, &key(name));
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, bytes).unwrap();
    }
}

fn resolver(work: &Path) -> DirResolver {
    DirResolver::new(vec![Root { dir: work.to_path_buf(), read_pacer: None }])
}

/// A data plane serving `work`, the node named as `work`'s last component, with the keys its
/// coordinator gives that node; its address.
async fn serve_holder(work: &Path) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let node = work.file_name().unwrap().to_str().unwrap();
    let (node_key, probe_key) = (capability::node_key(&DATA_KEY, node).unwrap(), capability::probe_key(&DATA_KEY).unwrap());
    let key = DataKey::default();
    key.set(Issued { node_key: &node_key, probe_key: &probe_key, base: Duration::from_secs(1) }).unwrap();
    tokio::spawn(serve(listener, Arc::new(resolver(work)), Access::new(key, None), Arc::new(Pacer::unlimited())));
    addr
}

/// The destination node's restorer, its local copies in `work`.
fn restorer(work: &Path) -> Restorer {
    let arriving = Arriving::new(Duration::from_secs(10));
    let resolver = Arc::new(resolver(work).with_arriving(arriving.clone()));
    // An agent that lets jobs run as root, as these restores' (no launch here names a user):
    // their file:// cloud is read as given (`file_roots`).
    motley_agent::checkpoints::file_roots::configure(&[], true).unwrap();
    Restorer::new(work, "dest", None, resolver, arriving, Arc::new(Pacer::unlimited()), Arc::new(Pacer::unlimited()))
}

fn peer(node: &str, addr: &str) -> FetchSource {
    FetchSource { kind: "peer".into(), node: node.into(), data_url: addr.into(), tier: "disk".into(), ..Default::default() }
}

fn local() -> FetchSource {
    FetchSource { kind: "local".into(), tier: "disk".into(), ..Default::default() }
}

fn cloud() -> FetchSource {
    FetchSource { kind: "cloud".into(), ..Default::default() }
}

fn range(offset: u64, bytes: u64, source: FetchSource) -> FetchRange {
    FetchRange { offset, bytes, source: Some(source), rate_mb_s: 0.0 }
}

/// The cluster's data-plane key: each holder checks capabilities with its own key derived from it.
const DATA_KEY: [u8; capability::KEY_BYTES] = [5; capability::KEY_BYTES];

/// `name` as the manifest has it (its good crcs), fetched as `ranges` say, each peer source
/// with the capability a coordinator would give it (under that peer's own key).
fn file(name: &str, bytes: &[u8], ranges: Vec<FetchRange>, fallbacks: Vec<FetchSource>) -> RestoreFile {
    let (e, file) = (file_entry(name, bytes, CHUNK), name.to_string());
    let (bytes, chunk_bytes, crc32c, source_generation) = (e.bytes, e.chunk_bytes, e.crc32c, SOURCE_GEN);
    let mut f = RestoreFile { source_generation, file, bytes, chunk_bytes, crc32c, ranges, fallbacks, copies: 0 };
    let expires_unix_s = capability::now_unix_s() + 3600;
    let grant = capability::Grant { job: JOB, generation: SOURCE_GEN, step: STEP, files: vec![name.into()], expires_unix_s };
    let sources = f.ranges.iter_mut().filter_map(|r| r.source.as_mut()).chain(f.fallbacks.iter_mut()).filter(|s| s.kind == "peer");
    sources.for_each(|s| s.capability = capability::mint(&capability::node_key(&DATA_KEY, &s.node).unwrap(), &grant).unwrap());
    f
}

fn restore(generation: i64, files: Vec<RestoreFile>, make: Vec<MakeUnit>, cloud_url: &str) -> Restore {
    // Every ask is a new one (a coordinator numbers each attempt).
    static ASKS: std::sync::atomic::AtomicI64 = std::sync::atomic::AtomicI64::new(1);
    let request = ASKS.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    Restore { job: JOB, generation, step: STEP, files, make, cloud_url: cloud_url.into(), timeout_s: 60, request, cloud_share_mb_s: 0.0 }
}

/// A file:// cloud under `dir` holding `files` as the checkpoint of the source launch.
async fn cloud_with(dir: &Path, files: &[(&str, &[u8])]) -> String {
    let root = dir.join("cloud");
    std::fs::create_dir_all(&root).unwrap();
    let url = format!("file://{}", root.display());
    let c = Cloud::open(&url).unwrap();
    for (name, bytes) in files {
        let staged = dir.join(format!("staged-{name}"));
        std::fs::write(&staged, bytes).unwrap();
        c.put_file(&staged, &c.key(JOB, SOURCE_GEN, STEP, name), None).await.unwrap();
    }
    url
}

/// Waits for the restore of `generation` to be reported; every result is unsent again after.
async fn finished(r: &Restorer, generation: i64) -> RestoreResult {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let got = r.report(u64::MAX);
        r.new_session();
        if let Some(res) = got.into_iter().find(|x| x.job == JOB && x.generation == generation) {
            return res;
        }
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        assert!(!left.is_zero(), "no result for generation {generation} within 60 s");
        let _ = tokio::time::timeout(left.min(Duration::from_millis(200)), r.changed()).await;
    }
}

/// Where the restore puts `name`.
fn placed(work: &Path, name: &str) -> PathBuf {
    restore_dir(work, JOB, SOURCE_GEN, STEP).join(name)
}

fn launch(work: &Path, generation: i64) -> Vec<String> {
    serde_json::from_slice(&std::fs::read(launch_list(work, JOB, generation)).unwrap()).unwrap()
}

/// The names in the restore directory (temporary ones included).
fn listing(work: &Path) -> Vec<String> {
    let dir = restore_dir(work, JOB, SOURCE_GEN, STEP);
    let mut names: Vec<String> =
        std::fs::read_dir(&dir).into_iter().flatten().flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect();
    names.sort();
    names
}

fn assert_ok(res: &RestoreResult) {
    assert!(res.error.is_empty(), "the restore failed: {}", res.error);
}

/// An address nothing listens on.
async fn dead_addr() -> String {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    l.local_addr().unwrap().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restore_happy_path_from_two_peers_local_and_cloud_is_bit_exact() {
    let dir = scratch("happy");
    let unit = contents(LEN, 1);
    let rank = contents(7777, 2);
    let (a, b, dest) = (dir.join("a"), dir.join("b"), dir.join("dest"));
    holder(&a, &[(UNIT, &unit)]);
    holder(&b, &[(UNIT, &unit), (RANK, &rank)]);
    holder(&dest, &[(UNIT, &unit)]); // this node's own copy (a rank of it wrote the unit)
    let url = cloud_with(&dir, &[(UNIT, &unit)]).await;
    let (pa, pb) = (serve_holder(&a).await, serve_holder(&b).await);
    let len = LEN as u64;
    // Boundaries off the chunk grid: each range's bytes must land at its offset.
    let cuts = [0, 300_001, 700_003, 1_000_007, len];
    let ranges = vec![
        range(cuts[0], cuts[1] - cuts[0], peer("a", &pa)),
        range(cuts[1], cuts[2] - cuts[1], peer("b", &pb)),
        range(cuts[2], cuts[3] - cuts[2], local()),
        range(cuts[3], cuts[4] - cuts[3], cloud()),
    ];
    let files = vec![
        file(UNIT, &unit, ranges, vec![peer("b", &pb), cloud()]),
        file(RANK, &rank, vec![range(0, rank.len() as u64, peer("b", &pb))], vec![]),
    ];
    let r = restorer(&dest);
    r.start(restore(NEXT_GEN, files, vec![], &url));
    let res = finished(&r, NEXT_GEN).await;
    assert_ok(&res);
    assert_eq!((res.job, res.generation, res.step), (JOB, NEXT_GEN, STEP));
    assert_eq!(res.peer_bytes, (cuts[2] - cuts[0]) + rank.len() as u64, "{res:?}");
    assert_eq!(res.local_bytes, cuts[3] - cuts[2], "{res:?}");
    assert_eq!(res.cloud_bytes, cuts[4] - cuts[3], "{res:?}");
    assert!(res.repaired.is_empty(), "{:?}", res.repaired);
    assert_eq!(res.skipped, 0);
    assert_eq!(std::fs::read(placed(&dest, UNIT)).unwrap(), unit);
    assert_eq!(std::fs::read(placed(&dest, RANK)).unwrap(), rank);
    let mut want = vec![placed(&dest, RANK).display().to_string(), placed(&dest, UNIT).display().to_string()];
    want.sort();
    assert_eq!(launch(&dest, NEXT_GEN), want);
    assert!(want.iter().all(|p| Path::new(p).is_absolute()));
    for name in [UNIT, RANK] {
        let mode = std::fs::metadata(placed(&dest, name)).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600, "{name}");
    }
    assert_eq!(listing(&dest), vec![UNIT.to_string(), RANK.to_string()], "only the final files remain");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restore_corrupt_chunk_on_a_holder_is_refetched_from_the_next_fallback() {
    let dir = scratch("corrupt-peer");
    let unit = contents(LEN, 3);
    let (a, b, dest) = (dir.join("a"), dir.join("b"), dir.join("dest"));
    let mut bad = unit.clone();
    bad[CHUNK as usize + 77] ^= 0x40; // chunk 1, inside a's range
    holder(&a, &[(UNIT, &bad)]);
    holder(&b, &[(UNIT, &unit)]);
    let (pa, pb) = (serve_holder(&a).await, serve_holder(&b).await);
    let half = 3 * CHUNK;
    let ranges = vec![range(0, half, peer("a", &pa)), range(half, LEN as u64 - half, peer("b", &pb))];
    let r = restorer(&dest);
    r.start(restore(NEXT_GEN, vec![file(UNIT, &unit, ranges, vec![peer("a", &pa), peer("b", &pb)])], vec![], ""));
    let res = finished(&r, NEXT_GEN).await;
    assert_ok(&res);
    assert_eq!(res.repaired.len(), 1, "{:?}", res.repaired);
    let line = &res.repaired[0];
    assert!(line.contains(UNIT) && line.contains("chunk 1 ") && line.contains("peer a") && line.contains("peer b"), "{line}");
    assert_eq!(res.peer_bytes, LEN as u64 + CHUNK, "the file once and the corrupt chunk again");
    assert_eq!(std::fs::read(placed(&dest, UNIT)).unwrap(), unit);
    assert_eq!(launch(&dest, NEXT_GEN), vec![placed(&dest, UNIT).display().to_string()]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restore_corrupt_cloud_object_is_repaired_from_a_peer() {
    let dir = scratch("corrupt-cloud");
    let unit = contents(LEN, 4);
    let (a, dest) = (dir.join("a"), dir.join("dest"));
    let mut bad = unit.clone();
    bad[2 * CHUNK as usize + 5] ^= 0x01; // chunk 2
    let url = cloud_with(&dir, &[(UNIT, &bad)]).await;
    holder(&a, &[(UNIT, &unit)]);
    let pa = serve_holder(&a).await;
    let r = restorer(&dest);
    let f = file(UNIT, &unit, vec![range(0, LEN as u64, cloud())], vec![cloud(), peer("a", &pa)]);
    r.start(restore(NEXT_GEN, vec![f], vec![], &url));
    let res = finished(&r, NEXT_GEN).await;
    assert_ok(&res);
    assert_eq!(res.repaired.len(), 1, "{:?}", res.repaired);
    let line = &res.repaired[0];
    assert!(line.contains(UNIT) && line.contains("chunk 2 ") && line.contains("cloud") && line.contains("peer a"), "{line}");
    assert_eq!((res.cloud_bytes, res.peer_bytes), (LEN as u64, CHUNK));
    assert_eq!(std::fs::read(placed(&dest, UNIT)).unwrap(), unit);
}

/// A data plane that answers every request, sends the first frame of `prefix` bytes of the
/// first range, then closes the connection (a holder killed mid-transfer).
async fn dying_server(file_len: u64, bytes: Vec<u8>, prefix: usize) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else { return };
            let bytes = bytes.clone();
            tokio::spawn(async move {
                let mut reader = BufReader::new(stream);
                let mut request = String::new();
                reader.read_line(&mut request).await.unwrap();
                let v: serde_json::Value = serde_json::from_str(&request).unwrap();
                let offset = v["ranges"][0][0].as_u64().unwrap();
                let mut stream = reader.into_inner();
                stream.write_all(&line(&Reply::ok(file_len))).await.unwrap();
                let payload = &bytes[offset as usize..offset as usize + prefix];
                stream.write_all(&FrameHeader::for_payload(offset, payload).to_bytes()).await.unwrap();
                stream.write_all(payload).await.unwrap();
                // Dies: no more frames, no end frame.
                drop(stream);
            });
        }
    });
    addr
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restore_source_killed_half_way_is_replaced_by_a_fallback() {
    let dir = scratch("killed");
    let unit = contents(LEN, 5);
    let (b, dest) = (dir.join("b"), dir.join("dest"));
    holder(&b, &[(UNIT, &unit)]);
    let pb = serve_holder(&b).await;
    let dying = dying_server(LEN as u64, unit.clone(), 64 << 10).await;
    let half = 2 * CHUNK + 999;
    let ranges = vec![range(0, half, peer("b", &pb)), range(half, LEN as u64 - half, peer("a", &dying))];
    let r = restorer(&dest);
    r.start(restore(NEXT_GEN, vec![file(UNIT, &unit, ranges, vec![peer("a", &dying), peer("b", &pb)])], vec![], ""));
    let res = finished(&r, NEXT_GEN).await;
    assert_ok(&res);
    assert_eq!(res.repaired.len(), 1, "{:?}", res.repaired);
    let line = &res.repaired[0];
    assert!(line.contains(&format!("bytes {half}..{LEN}")) && line.contains("peer a") && line.contains("fetched from peer b"), "{line}");
    // The dying holder's bytes are not counted: the whole file came from b.
    assert_eq!(res.peer_bytes, LEN as u64);
    assert_eq!(std::fs::read(placed(&dest, UNIT)).unwrap(), unit);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restore_corrupt_chunk_shared_by_two_sources_is_blamed_on_its_sender() {
    let dir = scratch("corrupt-straddle");
    let unit = contents(LEN, 11);
    let (a, b, dest) = (dir.join("a"), dir.join("b"), dir.join("dest"));
    // Chunk 2 comes half from a, half from b; b's half of it is corrupt.
    let cut = 2 * CHUNK + 1000;
    let mut bad = unit.clone();
    bad[cut as usize + 4000] ^= 0x10;
    holder(&a, &[(UNIT, &unit)]);
    holder(&b, &[(UNIT, &bad)]);
    let (pa, pb) = (serve_holder(&a).await, serve_holder(&b).await);
    let ranges = vec![range(0, cut, peer("a", &pa)), range(cut, LEN as u64 - cut, peer("b", &pb))];
    let r = restorer(&dest);
    r.start(restore(NEXT_GEN, vec![file(UNIT, &unit, ranges, vec![peer("a", &pa), peer("b", &pb)])], vec![], ""));
    let res = finished(&r, NEXT_GEN).await;
    assert_ok(&res);
    assert_eq!(res.repaired.len(), 1, "{:?}", res.repaired);
    let line = &res.repaired[0];
    assert!(line.contains("chunk 2 ") && line.contains("peer b (disk)") && line.ends_with("fetched again from peer a (disk)"), "{line}");
    assert_eq!(res.peer_bytes, LEN as u64 + CHUNK);
    assert_eq!(std::fs::read(placed(&dest, UNIT)).unwrap(), unit);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restore_corrupt_fallback_after_a_dead_source_is_blamed_and_not_asked_again() {
    let dir = scratch("dead-then-corrupt");
    let unit = contents(LEN, 12);
    let (b, c, dest) = (dir.join("b"), dir.join("c"), dir.join("dest"));
    let mut bad = unit.clone();
    bad[4 * CHUNK as usize + 3] ^= 0x02; // chunk 4
    holder(&b, &[(UNIT, &bad)]);
    holder(&c, &[(UNIT, &unit)]);
    let (pb, pc) = (serve_holder(&b).await, serve_holder(&c).await);
    let dying = dying_server(LEN as u64, unit.clone(), 64 << 10).await;
    // a dies; its range comes from b, whose copy is corrupt; c's is good.
    let ranges = vec![range(0, LEN as u64, peer("a", &dying))];
    let fallbacks = vec![peer("a", &dying), peer("b", &pb), peer("c", &pc)];
    let r = restorer(&dest);
    r.start(restore(NEXT_GEN, vec![file(UNIT, &unit, ranges, fallbacks)], vec![], ""));
    let res = finished(&r, NEXT_GEN).await;
    assert_ok(&res);
    assert_eq!(res.repaired.len(), 2, "{:?}", res.repaired);
    assert!(
        res.repaired[0].contains("peer a (disk) failed") && res.repaired[0].ends_with("fetched from peer b (disk)"),
        "{:?}",
        res.repaired
    );
    assert!(
        res.repaired[1].contains("chunk 4 ")
            && res.repaired[1].contains("from peer b (disk) was corrupt")
            && res.repaired[1].ends_with("fetched again from peer c (disk)"),
        "{:?}",
        res.repaired
    );
    assert_eq!(res.peer_bytes, LEN as u64 + CHUNK, "the corrupt chunk is fetched again once, from c");
    assert_eq!(std::fs::read(placed(&dest, UNIT)).unwrap(), unit);
}

fn one_mib(_: &Path) -> Option<u64> {
    Some(1 << 20)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restore_disk_full_is_refused_before_anything_is_written() {
    let dir = scratch("disk-full");
    let unit = contents(LEN, 6);
    let (a, dest) = (dir.join("a"), dir.join("dest"));
    holder(&a, &[(UNIT, &unit)]);
    let pa = serve_holder(&a).await;
    let r = restorer(&dest).with_free_bytes(one_mib);
    r.start(restore(NEXT_GEN, vec![file(UNIT, &unit, vec![range(0, LEN as u64, peer("a", &pa))], vec![])], vec![], ""));
    let res = finished(&r, NEXT_GEN).await;
    assert!(res.error.contains("disk full"), "{}", res.error);
    // What is missing plus the 64 MiB margin, against what is free.
    let need = LEN as u64 + (64 << 20);
    assert!(res.error.contains(&format!("needs {need} bytes")) && res.error.contains(&format!("{} are free", 1u64 << 20)), "{}", res.error);
    assert_eq!(res.peer_bytes, 0);
    assert!(listing(&dest).is_empty(), "{:?}", listing(&dest));
    assert!(!launch_list(&dest, JOB, NEXT_GEN).exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restore_every_source_failing_names_the_file_and_range() {
    let dir = scratch("all-fail");
    let unit = contents(LEN, 7);
    let (a, b, dest) = (dir.join("a"), dir.join("b"), dir.join("dest"));
    holder(&a, &[(UNIT, &unit)]);
    std::fs::create_dir_all(&b).unwrap(); // b holds nothing
    let pa = serve_holder(&a).await;
    let pb = serve_holder(&b).await;
    let dead = dead_addr().await;
    let url = cloud_with(&dir, &[]).await; // the object is not in the cloud
    let half = 2 * CHUNK;
    let ranges = vec![range(0, half, peer("a", &pa)), range(half, LEN as u64 - half, peer("c", &dead))];
    let f = file(UNIT, &unit, ranges, vec![peer("c", &dead), peer("b", &pb), cloud()]);
    let r = restorer(&dest);
    r.start(restore(NEXT_GEN, vec![f], vec![], &url));
    let res = finished(&r, NEXT_GEN).await;
    assert!(res.error.contains(UNIT) && res.error.contains(&format!("bytes {half}..{LEN}")), "{}", res.error);
    assert!(!placed(&dest, UNIT).exists());
    assert!(listing(&dest).is_empty(), "no half-written file stays: {:?}", listing(&dest));
    assert!(!launch_list(&dest, JOB, NEXT_GEN).exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restore_for_a_stale_generation_is_refused() {
    let dir = scratch("stale");
    let unit = contents(LEN, 8);
    let (a, dest) = (dir.join("a"), dir.join("dest"));
    holder(&a, &[(UNIT, &unit)]);
    let pa = serve_holder(&a).await;
    let f = file(UNIT, &unit, vec![range(0, LEN as u64, peer("a", &pa))], vec![]);
    let r = restorer(&dest);
    r.start(restore(3, vec![f.clone()], vec![], ""));
    let res = finished(&r, 3).await;
    assert_ok(&res);
    r.start(restore(2, vec![f], vec![], ""));
    let old = finished(&r, 2).await;
    assert!(old.error.contains("stale"), "{}", old.error);
    assert_eq!((old.peer_bytes, old.skipped), (0, 0), "nothing fetched for it");
    assert!(!launch_list(&dest, JOB, 2).exists());
    assert_eq!(std::fs::read(placed(&dest, UNIT)).unwrap(), unit);
    // An agent restarted (every result acknowledged) still refuses the older generation.
    r.new_session();
    assert_eq!(r.report(7).len(), 2, "both results, sent in message 7");
    r.ack(7);
    let again = restorer(&dest);
    assert!(again.report(1).is_empty(), "nothing left unacknowledged on disk");
    again.start(restore(1, vec![file(UNIT, &unit, vec![range(0, LEN as u64, peer("a", &pa))], vec![])], vec![], ""));
    let older = finished(&again, 1).await;
    assert!(older.error.contains("stale") && older.error.contains("generation 3"), "{}", older.error);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restore_resumed_after_failover_skips_files_in_place() {
    let dir = scratch("resume");
    let names = ["layer.00000.model.tp0-1.safetensors", "layer.00001.model.tp0-1.safetensors", RANK];
    let data: Vec<Vec<u8>> = (0..3).map(|i| contents(LEN - i * 1000, 10 + i)).collect();
    let (a, dest) = (dir.join("a"), dir.join("dest"));
    let held: Vec<(&str, &[u8])> = names.iter().zip(&data).map(|(n, d)| (*n, d.as_slice())).collect();
    holder(&a, &held);
    let pa = serve_holder(&a).await;
    let files: Vec<RestoreFile> =
        names.iter().zip(&data).map(|(n, d)| file(n, d, vec![range(0, d.len() as u64, peer("a", &pa))], vec![])).collect();
    // The restore before the failover placed the first two; the third was left corrupt.
    for (n, d) in names.iter().zip(&data).take(2) {
        std::fs::create_dir_all(placed(&dest, n).parent().unwrap()).unwrap();
        std::fs::write(placed(&dest, n), d).unwrap();
    }
    let mut bad = data[2].clone();
    bad[10] ^= 1;
    std::fs::write(placed(&dest, names[2]), &bad).unwrap();
    let r = restorer(&dest);
    r.start(restore(NEXT_GEN, files.clone(), vec![], ""));
    let res = finished(&r, NEXT_GEN).await;
    assert_ok(&res);
    assert_eq!(res.skipped, 2);
    assert_eq!(res.peer_bytes, data[2].len() as u64, "only the one not in place is fetched");
    for (n, d) in names.iter().zip(&data) {
        assert_eq!(&std::fs::read(placed(&dest, n)).unwrap(), d, "{n}");
    }
    let mut want: Vec<String> = names.iter().map(|n| placed(&dest, n).display().to_string()).collect();
    want.sort();
    assert_eq!(launch(&dest, NEXT_GEN), want);

    // The coordinator fails over again after acknowledging: the same restore fetches nothing.
    r.report(41);
    r.ack(41);
    r.start(restore(NEXT_GEN, files, vec![], ""));
    let again = finished(&r, NEXT_GEN).await;
    assert_ok(&again);
    assert_eq!((again.skipped, again.peer_bytes, again.local_bytes, again.cloud_bytes), (3, 0, 0, 0));
    assert_eq!(launch(&dest, NEXT_GEN), want);
}

const HIDDEN: u64 = 8;
const HEADS: u64 = 4;

/// A transformer layer's tensors as the reference trainer lays them out, plus a fused QKV and
/// a vocabulary-split one (checkpoint/tests/files.rs).
fn layer_specs() -> BTreeMap<String, TensorSpec> {
    let f = |shape: &[u64], layout: Layout| TensorSpec { shape: shape.to_vec(), dtype: Dtype::F32, layout };
    let hd = HIDDEN / HEADS;
    let col = Layout::Split { axis: 0, blocks: vec![], granule: hd };
    BTreeMap::from([
        ("layers.0.ln1.weight".into(), f(&[HIDDEN], Layout::Replicated)),
        ("layers.0.attn.q.weight".into(), f(&[HIDDEN, HIDDEN], col.clone())),
        ("layers.0.attn.q.bias".into(), f(&[HIDDEN], col)),
        ("layers.0.attn.qkv.weight".into(), f(&[3 * HIDDEN, HIDDEN], Layout::Split { axis: 0, blocks: vec![HIDDEN; 3], granule: hd })),
        ("layers.0.attn.o.weight".into(), f(&[HIDDEN, HIDDEN], Layout::Split { axis: 1, blocks: vec![], granule: hd })),
        ("layers.0.mlp.lm.weight".into(), f(&[20, HIDDEN], Layout::Vocab { axis: 0, multiple: 2 })),
    ])
}

fn full_bytes(name: &str, spec: &TensorSpec) -> Vec<u8> {
    let n = spec.shape.iter().product::<u64>() as usize;
    let salt = name.bytes().map(u32::from).sum::<u32>();
    (0..n).flat_map(|i| ((i as u32 * 7 + salt) as f32).to_le_bytes()).collect()
}

/// The layer's unit for TP rank `rank` of `tp`, sharded from the full tensors directly.
fn layer_unit(tp: u32, rank: u32) -> Unit {
    Unit {
        step: STEP,
        generation: Some(SOURCE_GEN),
        key: UnitKey { block: Block::Layer(0), part: Part::Model, tp_rank: rank, tp_size: tp },
        tensors: layer_specs()
            .into_iter()
            .map(|(n, s)| {
                let shard = shard_full(&n, &s, &full_bytes(&n, &s), tp).unwrap().swap_remove(rank as usize);
                (n, (s, shard))
            })
            .collect(),
    }
}

/// Re-slice TP 2 to `tp_out` and check the unit for `rank_out`; `misnamed`: the instruction
/// names another unit than the one cut, which is refused with nothing under either name.
async fn reslice_case(name: &str, tp_out: u32, rank_out: u32, misnamed: bool) {
    let dir = scratch(name);
    let (a, b, dest) = (dir.join("a"), dir.join("b"), dir.join("dest"));
    // The two TP-2 units, each written by its rank on its own holder.
    let mut sources = vec![];
    for (r, work) in [(0u32, &a), (1, &b)] {
        let step_dir = ckpt_path(work, &key("x")).parent().unwrap().to_path_buf();
        let e = layer_unit(2, r).write(&step_dir).unwrap();
        sources.push((e.file.file.clone(), std::fs::read(step_dir.join(&e.file.file)).unwrap()));
    }
    let (pa, pb) = (serve_holder(&a).await, serve_holder(&b).await);
    let files = vec![
        file(&sources[0].0, &sources[0].1, vec![range(0, sources[0].1.len() as u64, peer("a", &pa))], vec![]),
        file(&sources[1].0, &sources[1].1, vec![range(0, sources[1].1.len() as u64, peer("b", &pb))], vec![]),
    ];
    let want = layer_unit(tp_out, rank_out);
    let made_name = motley_checkpoint::manifest::unit_file_name(&want.key);
    let named =
        if misnamed { motley_checkpoint::manifest::unit_file_name(&layer_unit(tp_out, rank_out + 1).key) } else { made_name.clone() };
    let make = MakeUnit { file: named.clone(), sources: sources.iter().map(|s| s.0.clone()).collect(), tp_size: tp_out, tp_rank: rank_out };
    let r = restorer(&dest);
    r.start(restore(NEXT_GEN, files, vec![make], ""));
    let res = finished(&r, NEXT_GEN).await;
    if misnamed {
        assert!(res.error.contains(&format!("the restore names the cut unit {named}, but it is {made_name}")), "{}", res.error);
        assert!(!placed(&dest, &made_name).exists() && !placed(&dest, &named).exists());
        return;
    }
    assert_ok(&res);
    for (n, bytes) in &sources {
        assert_eq!(&std::fs::read(placed(&dest, n)).unwrap(), bytes, "{n}");
    }
    let made = placed(&dest, &made_name);
    let list = launch(&dest, NEXT_GEN);
    assert!(list.contains(&made.display().to_string()), "{made_name} is not in the launch list {list:?}");
    let got = Unit::read(&made).unwrap_or_else(|e| panic!("{made_name}: {e}"));
    assert_eq!(got, want, "the re-sliced unit equals sharding the full tensors for tp {tp_out} directly");
    // Byte for byte what the checkpoint writer makes of it.
    let expect_dir = dir.join("expect");
    want.write(&expect_dir).unwrap();
    assert_eq!(std::fs::read(&made).unwrap(), std::fs::read(expect_dir.join(&made_name)).unwrap());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restore_reslices_tp2_units_to_tp1_rank0() {
    reslice_case("reslice-tp1", 1, 0, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restore_reslices_tp2_units_to_tp4_rank1() {
    reslice_case("reslice-tp4", 4, 1, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restore_refuses_a_cut_unit_named_other_than_it_is() {
    reslice_case("reslice-misnamed", 4, 1, true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restore_result_is_reported_until_acknowledged_and_survives_a_restart() {
    let dir = scratch("ack");
    let unit = contents(LEN, 9);
    let (a, dest) = (dir.join("a"), dir.join("dest"));
    holder(&a, &[(UNIT, &unit)]);
    let pa = serve_holder(&a).await;
    let r = restorer(&dest);
    r.start(restore(NEXT_GEN, vec![file(UNIT, &unit, vec![range(0, LEN as u64, peer("a", &pa))], vec![])], vec![], ""));
    let res = finished(&r, NEXT_GEN).await;
    assert_ok(&res);
    assert_eq!(std::fs::read(placed(&dest, UNIT)).unwrap(), unit);

    // Once per session.
    let first = r.report(1);
    assert_eq!(first, vec![res.clone()]);
    assert!(r.report(2).is_empty(), "sent once in a session");
    r.ack(2); // message 2 carried nothing: the result stands
    r.new_session();
    assert_eq!(r.report(3), vec![res.clone()], "a new session sends it again");

    // The agent restarts before the acknowledgement: the new one reports it again.
    let restarted = restorer(&dest);
    let again = restarted.report(1);
    assert_eq!(again.len(), 1, "{again:?}");
    assert_eq!((again[0].job, again[0].generation, again[0].step, again[0].peer_bytes), (JOB, NEXT_GEN, STEP, LEN as u64));
    assert!(again[0].error.is_empty());
    assert!(restarted.report(2).is_empty());
    restarted.ack(1);
    restarted.new_session();
    assert!(restarted.report(4).is_empty(), "acknowledged: gone");
    // And gone for good: the next restart does not report it.
    assert!(restorer(&dest).report(1).is_empty());
    drop(r);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restore_files_left_half_written_by_an_earlier_agent_are_swept_at_start() {
    let work = scratch("sweep");
    let dir = restore_dir(&work, JOB, SOURCE_GEN, STEP);
    std::fs::create_dir_all(&dir).unwrap();
    for name in ["layer.00001.model.tp0-1.safetensors.tmp.4242", "layer.00001.model.tp0-1.safetensors.tmp.4242.copy1"] {
        std::fs::write(dir.join(name), b"half").unwrap();
    }
    std::fs::write(dir.join("rank.00000.safetensors"), b"whole").unwrap();
    let _r = restorer(&work);
    assert_eq!(listing(&work), ["rank.00000.safetensors"], "temporaries swept, whole files kept");
}

/// A fallback to the cloud (the planned peer is dead) is held to the node's share of the
/// cloud's egress: 3 MiB at a share of 1 MB/s cannot arrive in less than about 2 s (the share's
/// bucket starts with one 1 MiB frame), where the unpaced restore would take milliseconds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restore_cloud_fallbacks_are_held_to_the_nodes_share_of_the_egress() {
    let dir = scratch("cloud-share");
    let unit = contents(3 << 20, 9);
    let url = cloud_with(&dir, &[(UNIT, &unit)]).await;
    let dest = dir.join("dest");
    let r = restorer(&dest);
    let dead = dead_addr().await;
    let f = file(UNIT, &unit, vec![range(0, unit.len() as u64, peer("gone", &dead))], vec![cloud()]);
    let mut ask = restore(NEXT_GEN, vec![f], vec![], &url);
    ask.cloud_share_mb_s = 1.0;
    let began = std::time::Instant::now();
    r.start(ask);
    let res = finished(&r, NEXT_GEN).await;
    assert_ok(&res);
    assert_eq!(res.cloud_bytes, unit.len() as u64);
    let took = began.elapsed();
    assert!(took >= Duration::from_millis(1900), "3 MiB from the cloud at a 1 MB/s share took only {took:?}");
    assert_eq!(std::fs::read(placed(&dest, UNIT)).unwrap(), unit);
}

/// Each recovery's copy goes once a newer restore of the job succeeded: the step directories
/// under `restore/JOB/` it does not read, and older generations' launch lists; its own files,
/// its launch list and the job's fence stay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restore_removes_what_earlier_restores_of_the_job_left() {
    let dir = scratch("sweep");
    let unit = contents(LEN, 21);
    let (a, dest) = (dir.join("a"), dir.join("dest"));
    holder(&a, &[(UNIT, &unit)]);
    let pa = serve_holder(&a).await;
    // What an earlier recovery (generation 2 from generation 1's step 5) left.
    let earlier = restore_dir(&dest, JOB, 1, 5);
    std::fs::create_dir_all(&earlier).unwrap();
    std::fs::write(earlier.join(UNIT), b"old copy").unwrap();
    std::fs::write(launch_list(&dest, JOB, 2), b"[]").unwrap();
    let other_step = restore_dir(&dest, JOB, SOURCE_GEN, STEP - 1);
    std::fs::create_dir_all(&other_step).unwrap();
    let r = restorer(&dest);
    r.start(restore(NEXT_GEN, vec![file(UNIT, &unit, vec![range(0, LEN as u64, peer("a", &pa))], vec![])], vec![], ""));
    assert_ok(&finished(&r, NEXT_GEN).await);
    assert!(!earlier.exists() && !dest.join(format!("restore/{JOB}/1")).exists(), "the earlier copy is gone");
    assert!(!other_step.exists(), "another step of the source generation is gone");
    assert!(!launch_list(&dest, JOB, 2).exists(), "an older generation's launch list is gone");
    assert_eq!(std::fs::read(placed(&dest, UNIT)).unwrap(), unit, "this restore's file stays");
    assert_eq!(launch(&dest, NEXT_GEN), vec![placed(&dest, UNIT).display().to_string()]);
    assert!(dest.join(format!("restore/{JOB}/newest")).exists(), "the fence stays");
}
