//! Benchmark (bench/restore_memory.sh, BENCHMARKS.md "Restore memory"): a real `motley-agent`
//! restores one multi-GB checkpoint unit from its own disk tier, told by a fake coordinator
//! served here (the real gRPC contract). Measured: the agent's peak RSS (`VmHWM` of
//! /proc/PID/status) before and after the restore, and the gaps between the heartbeats the
//! fake saw while it ran (on time: no gap much over the interval). Prints one JSON line.
//!
//! The unit is a sparse file of `--gb` GiB with a few MiB of data at each end (quick to make,
//! and every byte still goes through the restore's copy and crc checks); its crcs are
//! computed here, one per 16 MiB chunk, as a rank's manifest piece lists them.
//!
//!     restore_memory --agent target/ci/motley-agent --dir /tmp/restore-bench --gb 3

use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use motley_proto::v1::agent_server::{Agent, AgentServer};
use motley_proto::v1::{
    instruction, Ack, AgentStatus, FetchRange, FetchSource, Instruction, RegisterReply, RegisterRequest, Restore, RestoreFile,
    RestoreResult,
};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

const JOB: i64 = 1;
const SOURCE_GEN: i64 = 1;
const STEP: u64 = 100;
const CHUNK: u64 = 16 << 20;
const FILE: &str = "layer.00000.optimizer.tp0-1.safetensors";

#[derive(Default)]
struct Seen {
    registered: bool,
    /// When each heartbeat (a message on the interval or with news) arrived.
    beats: Vec<Instant>,
    results: Vec<RestoreResult>,
    down: Option<mpsc::Sender<Result<Instruction, Status>>>,
    heartbeat_ms: u64,
}

#[derive(Clone, Default)]
struct Fake(Arc<Mutex<Seen>>);

#[tonic::async_trait]
impl Agent for Fake {
    async fn register(&self, _req: Request<RegisterRequest>) -> Result<Response<RegisterReply>, Status> {
        let mut s = self.0.lock().unwrap();
        s.registered = true;
        Ok(Response::new(RegisterReply { epoch: 1, heartbeat_ms: s.heartbeat_ms, ..Default::default() }))
    }

    type HeartbeatStream = ReceiverStream<Result<Instruction, Status>>;

    async fn heartbeat(&self, req: Request<Streaming<AgentStatus>>) -> Result<Response<Self::HeartbeatStream>, Status> {
        let (tx, rx) = mpsc::channel(64);
        self.0.lock().unwrap().down = Some(tx.clone());
        let (me, mut up) = (self.clone(), req.into_inner());
        tokio::spawn(async move {
            while let Ok(Some(status)) = up.message().await {
                {
                    let mut s = me.0.lock().unwrap();
                    s.beats.push(Instant::now());
                    s.results.extend(status.restores);
                }
                let _ = tx.send(Ok(Instruction { kind: Some(instruction::Kind::Ack(Ack { seq: status.seq })) })).await;
            }
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}

struct Args {
    agent: PathBuf,
    dir: PathBuf,
    gb: u64,
    heartbeat_ms: u64,
}

fn args() -> Args {
    let mut a =
        Args { agent: "target/ci/motley-agent".into(), dir: std::env::temp_dir().join("motley-restore-bench"), gb: 3, heartbeat_ms: 100 };
    let mut it = std::env::args().skip(1);
    while let Some(k) = it.next() {
        let v = it.next().unwrap_or_else(|| panic!("{k} needs a value"));
        match k.as_str() {
            "--agent" => a.agent = v.into(),
            "--dir" => a.dir = v.into(),
            "--gb" => a.gb = v.parse().expect("--gb: whole GiB"),
            "--heartbeat-ms" => a.heartbeat_ms = v.parse().expect("--heartbeat-ms: milliseconds"),
            _ => panic!("unknown flag {k}; flags: --agent PATH --dir DIR --gb N --heartbeat-ms MS"),
        }
    }
    a
}

/// The unit: sparse, `edge` bytes of data at each end; its chunk crcs.
fn make_unit(path: &Path, len: u64) -> Vec<u32> {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    let mut f = std::fs::File::create(path).unwrap();
    f.set_len(len).unwrap();
    let edge: Vec<u8> = (0..8u64 << 20).map(|i| (i * 31 % 251) as u8).collect();
    f.write_all(&edge).unwrap();
    f.seek(SeekFrom::Start(len - edge.len() as u64)).unwrap();
    f.write_all(&edge).unwrap();
    f.sync_all().unwrap();
    let mut f = std::fs::File::open(path).unwrap();
    let mut buf = vec![0u8; CHUNK as usize];
    let mut crcs = vec![];
    let mut left = len;
    while left > 0 {
        let n = left.min(CHUNK) as usize;
        f.read_exact(&mut buf[..n]).unwrap();
        crcs.push(crc32c::crc32c(&buf[..n]));
        left -= n as u64;
    }
    crcs
}

/// (VmHWM, VmRSS) of `pid`, in KiB.
fn memory(pid: u32) -> (u64, u64) {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let field = |name: &str| {
        text.lines().find(|l| l.starts_with(name)).and_then(|l| l.split_whitespace().nth(1)).and_then(|v| v.parse().ok()).unwrap_or(0)
    };
    (field("VmHWM:"), field("VmRSS:"))
}

struct Killed(Child);
impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn main() {
    let a = args();
    let _ = std::fs::remove_dir_all(&a.dir);
    let work = a.dir.join("work");
    let len = a.gb << 30;
    let held = work.join(format!("jobs/{JOB}/{SOURCE_GEN}/ckpt/step-{STEP:08}/{FILE}"));
    let made = Instant::now();
    let crcs = make_unit(&held, len);
    let made_s = made.elapsed().as_secs_f64();

    let rt = tokio::runtime::Runtime::new().unwrap();
    let fake = Fake(Arc::new(Mutex::new(Seen { heartbeat_ms: a.heartbeat_ms, ..Default::default() })));
    let listener = rt.block_on(tokio::net::TcpListener::bind("127.0.0.1:0")).unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    rt.spawn(
        tonic::transport::Server::builder()
            .add_service(AgentServer::new(fake.clone()))
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    let config = a.dir.join("agent.toml");
    std::fs::write(&config, "logs_listen = \"127.0.0.1:0\"\ndata_listen = \"127.0.0.1:0\"\n").unwrap();
    let inventory = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/nodes/a100.yaml");
    let log = std::fs::File::create(a.dir.join("agent.log")).unwrap();
    let agent = Killed(
        Command::new(&a.agent)
            .args(["--coordinator", &url, "--node", "bench0", "--inventory"])
            .arg(&inventory)
            .arg("--work-dir")
            .arg(&work)
            .arg("--shm-dir")
            .arg(a.dir.join("shm"))
            .env("MOTLEY_CONFIG", &config)
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("{}: {e}; build it (cargo build --profile ci -p motley-agent)", a.agent.display())),
    );
    let pid = agent.0.id();
    let until = |what: &str, f: &dyn Fn(&Seen) -> bool| {
        let t = Instant::now();
        while !f(&fake.0.lock().unwrap()) {
            assert!(t.elapsed() < Duration::from_secs(600), "timed out waiting for {what} (see {})", a.dir.join("agent.log").display());
            std::thread::sleep(Duration::from_millis(5));
        }
    };
    until("the agent's first heartbeats", &|s| s.beats.len() >= 5);
    let (idle_hwm, idle_rss) = memory(pid);

    let local = FetchSource { kind: "local".into(), tier: "disk".into(), ..Default::default() };
    let restore = Restore {
        job: JOB,
        generation: SOURCE_GEN + 1,
        step: STEP,
        files: vec![RestoreFile {
            source_generation: SOURCE_GEN,
            file: FILE.into(),
            bytes: len,
            chunk_bytes: CHUNK,
            crc32c: crcs,
            ranges: vec![FetchRange { offset: 0, bytes: len, source: Some(local.clone()), rate_mb_s: 0.0 }],
            fallbacks: vec![local],
            copies: 1,
        }],
        timeout_s: 600,
        request: 1,
        ..Default::default()
    };
    let began = Instant::now();
    let beats_before = fake.0.lock().unwrap().beats.len();
    let tx = fake.0.lock().unwrap().down.clone().unwrap();
    tx.try_send(Ok(Instruction { kind: Some(instruction::Kind::Restore(restore)) })).unwrap();
    let mut peak_rss = 0;
    loop {
        if !fake.0.lock().unwrap().results.is_empty() {
            break;
        }
        peak_rss = peak_rss.max(memory(pid).1);
        assert!(began.elapsed() < Duration::from_secs(600), "no restore result in 600 s (see {})", a.dir.join("agent.log").display());
        std::thread::sleep(Duration::from_millis(20));
    }
    let restore_s = began.elapsed().as_secs_f64();
    let (hwm, rss) = memory(pid);
    let s = fake.0.lock().unwrap();
    let result = &s.results[0];
    // Gaps between consecutive heartbeats while the restore ran (from the one before it).
    let during: Vec<f64> = s.beats[beats_before.saturating_sub(1)..]
        .windows(2)
        .filter(|w| w[0] <= began + Duration::from_secs_f64(restore_s))
        .map(|w| (w[1] - w[0]).as_secs_f64() * 1e3)
        .collect();
    let mut sorted = during.clone();
    sorted.sort_by(f64::total_cmp);
    let pct = |q: f64| sorted.get(((sorted.len() as f64 - 1.0) * q).round() as usize).copied().unwrap_or(0.0);
    let report = serde_json::json!({
        "unit_gib": a.gb,
        "source": "local disk tier",
        "made_s": made_s,
        "restore_s": restore_s,
        "restore_error": result.error,
        "local_bytes": result.local_bytes,
        "agent_vm_hwm_mib_idle": idle_hwm / 1024,
        "agent_vm_rss_mib_idle": idle_rss / 1024,
        "agent_vm_hwm_mib_after": hwm / 1024,
        "agent_vm_rss_mib_peak_sampled": peak_rss / 1024,
        "agent_vm_rss_mib_after": rss / 1024,
        "heartbeat_ms": a.heartbeat_ms,
        "heartbeats_during": during.len(),
        "gap_ms_p50": pct(0.5),
        "gap_ms_p99": pct(0.99),
        "gap_ms_max": sorted.last().copied().unwrap_or(0.0),
        "lease_ms": 3 * a.heartbeat_ms,
    });
    println!("{report}");
    drop(s);
    drop(agent);
    let _ = std::fs::remove_dir_all(&a.dir);
}
