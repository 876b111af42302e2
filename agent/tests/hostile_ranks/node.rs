//! The hostile-rank tests' node (docs/state.md): a root agent on a fake coordinator, its work
//! directory and memory tier in a scratch directory, jobs launched as `nobody`; shared by
//! `hostile_ranks.rs` and `hostile_rank_files.rs` (each uses some of it only).
#![allow(dead_code)]

use std::io::{Read, Write};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use motley_proto::v1::agent_server::{Agent, AgentServer};
use motley_proto::v1::{
    instruction, Ack, AgentStatus, CkptHolding, Instruction, Launch, RankLaunch, RankStatus, RegisterReply, RegisterRequest, RestoreResult,
};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

use crate::common;
use crate::common::scratch;

#[derive(Default)]
pub struct Seen {
    pub logs_url: String,
    pub statuses: Vec<RankStatus>,
    pub holdings: Vec<CkptHolding>,
    pub restores: Vec<RestoreResult>,
    pub down: Option<mpsc::Sender<Result<Instruction, Status>>>,
}

#[derive(Clone, Default)]
pub struct Fake(pub Arc<Mutex<Seen>>);

#[tonic::async_trait]
impl Agent for Fake {
    async fn register(&self, req: Request<RegisterRequest>) -> Result<Response<RegisterReply>, Status> {
        self.0.lock().unwrap().logs_url = req.into_inner().logs_url;
        Ok(Response::new(RegisterReply { epoch: 1, heartbeat_ms: 50, ..Default::default() }))
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
                    s.statuses.extend(status.ranks);
                    if status.holdings_sent {
                        s.holdings = status.holdings;
                    }
                    s.restores.extend(status.restores);
                }
                let _ = tx.send(Ok(Instruction { kind: Some(instruction::Kind::Ack(Ack { seq: status.seq })) })).await;
            }
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}

/// Waits for a condition, bounded only so that a broken agent fails the test instead of
/// hanging it.
pub fn until<T>(what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let start = Instant::now();
    loop {
        if let Some(t) = f() {
            return t;
        }
        assert!(start.elapsed() < Duration::from_secs(60), "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A root agent on a fake coordinator, its work directory and memory tier in a scratch directory.
pub struct Node {
    _rt: tokio::runtime::Runtime,
    pub fake: Fake,
    pub agent: Child,
    pub dir: PathBuf,
    pub work: PathBuf,
    pub log: PathBuf,
    /// What the agent was started with, to start it again (`restart`).
    url: String,
    shm: PathBuf,
    args: Vec<String>,
}

impl Drop for Node {
    fn drop(&mut self) {
        let _ = self.agent.kill();
        let _ = self.agent.wait();
        // Kept where the test failed, to look at.
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

impl Node {
    /// `None` where the test cannot run (skipped, or failed under CI as root: `root_only`):
    /// switching to `nobody` needs root and the user.
    pub fn start(name: &str, shm: Option<&Path>) -> Option<Node> {
        Node::start_with(name, shm, &[])
    }

    /// `start`, the agent given `args` more.
    pub fn start_with(name: &str, shm: Option<&Path>, args: &[&str]) -> Option<Node> {
        if !common::root_only::can_run(
            &format!("the hostile-rank test on node '{name}'"),
            &[common::root_only::Need::Root, common::root_only::Need::User("nobody")],
        ) {
            return None;
        }
        let dir = scratch(name);
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        let rt = tokio::runtime::Runtime::new().unwrap();
        let fake = Fake::default();
        let listener = rt.block_on(tokio::net::TcpListener::bind("127.0.0.1:0")).unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        rt.spawn(
            tonic::transport::Server::builder()
                .add_service(AgentServer::new(fake.clone()))
                .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
        );
        let (work, log) = (dir.join("work"), dir.join("agent.log"));
        let shm = shm.map_or_else(|| dir.join("shm"), Path::to_path_buf);
        std::fs::write(dir.join("agent.toml"), "logs_listen = \"127.0.0.1:0\"\n").unwrap();
        let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
        let agent = spawn_agent(&dir, &url, &shm, &args);
        let node = Node { _rt: rt, fake, agent, dir, work, log, url, shm, args };
        until("the agent's registration", || (!node.fake.0.lock().unwrap().logs_url.is_empty()).then_some(()));
        Some(node)
    }

    /// The agent killed (SIGKILL: no goodbye) and started again on the same work directory.
    pub fn restart(&mut self) {
        let _ = self.agent.kill();
        let _ = self.agent.wait();
        self.fake.0.lock().unwrap().logs_url.clear();
        self.agent = spawn_agent(&self.dir, &self.url, &self.shm, &self.args);
        until("the agent's registration", || (!self.fake.0.lock().unwrap().logs_url.is_empty()).then_some(()));
    }

    /// The agent's peak resident memory (VmHWM), in bytes.
    pub fn peak_rss(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.agent.id())).unwrap();
        let line = status.lines().find(|l| l.starts_with("VmHWM:")).unwrap();
        line.split_whitespace().nth(1).unwrap().parse::<u64>().unwrap() * 1024
    }

    pub fn send(&self, kind: instruction::Kind) {
        let tx = until("an open heartbeat stream", || self.fake.0.lock().unwrap().down.clone().filter(|d| !d.is_closed()));
        tx.try_send(Ok(Instruction { kind: Some(kind) })).unwrap();
    }

    /// Job `job` (generation 1, rank 0) as `nobody`, running `run` in its launch directory.
    pub fn launch(&self, job: i64, run: &str) {
        self.launch_env(job, run, &[]);
    }

    /// `launch`, with `envs`.
    pub fn launch_env(&self, job: i64, run: &str, envs: &[(&str, &str)]) {
        self.send(instruction::Kind::Launch(Launch {
            user: "nobody".into(),
            job,
            generation: 1,
            run: run.into(),
            envs: envs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
            plan_json: r#"{"global_batch": 1, "micro_batch": 1, "seq_len": 8, "model": "m", "replicas": []}"#.into(),
            master_addr: "127.0.0.1".into(),
            master_port: common::free_port() as u32,
            world_size: 1,
            ranks: vec![RankLaunch { rank: 0, local_rank: 0, local_world_size: 1, layer_end: 4, ..Default::default() }],
            peers: vec![],
            ..Default::default()
        }));
    }

    /// The exit code of job `job`'s rank 0, once it exited.
    pub fn exited(&self, job: i64) -> Option<i64> {
        until(&format!("job {job} to exit"), || {
            let s = self.fake.0.lock().unwrap();
            s.statuses.iter().rev().find(|r| r.job == job && r.rank == 0 && r.state == "exited").map(|r| r.exit_code)
        })
    }

    pub fn agent_log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// GET a rank's log from the agent's log service: (status, body).
    pub fn get_log(&self, job: i64) -> (u16, String) {
        let base = self.fake.0.lock().unwrap().logs_url.clone();
        let hostport = base.strip_prefix("http://").unwrap().to_string();
        let mut s = std::net::TcpStream::connect(&hostport).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        write!(s, "GET /logs/{job}/1/0 HTTP/1.1\r\nHost: {hostport}\r\nAuthorization: Bearer s3cret\r\nConnection: close\r\n\r\n").unwrap();
        let mut raw = String::new();
        s.read_to_string(&mut raw).unwrap();
        (raw[9..12].parse().unwrap(), raw.split_once("\r\n\r\n").map(|(_, b)| b.to_string()).unwrap_or_default())
    }

    /// The agent is live and its other jobs untouched: a fresh job runs as nobody and its log
    /// is served.
    pub fn still_serves(&self, job: i64) {
        self.launch(job, "echo still-here");
        assert_eq!(self.exited(job), Some(0), "{}", self.agent_log());
        let (status, body) = self.get_log(job);
        assert_eq!((status, body.as_str()), (200, "still-here\n"));
        assert!(self.agent.try_wait_alive(), "the agent is still running");
    }

    /// A manifest piece of rank 0 listing `files` (name, contents) with their true crcs, as
    /// JSON a rank can copy.
    pub fn piece(&self, step: u64, files: &[(&str, &[u8])]) -> PathBuf {
        use motley_checkpoint::{Manifest, RankEntry};
        let ranks = files.iter().map(|(f, b)| RankEntry { rank: 0, file: motley_checkpoint::crc::file_entry(f, b, 1 << 20) }).collect();
        let m =
            Manifest { format: motley_checkpoint::FORMAT.into(), step, layers: 4, world_size: 1, units: vec![], ranks, lost_ranks: vec![] };
        let path = self.dir.join(format!("piece-{step}-{}.json", files.len()));
        std::fs::write(&path, serde_json::to_vec(&m).unwrap()).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        path
    }
}

/// The agent as root on the fake coordinator at `url`, its log appended to `dir/agent.log`.
fn spawn_agent(dir: &Path, url: &str, shm: &Path, args: &[String]) -> Child {
    let inventory = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/nodes/a100.yaml");
    let err = std::fs::OpenOptions::new().create(true).append(true).open(dir.join("agent.log")).unwrap();
    Command::new(env!("CARGO_BIN_EXE_motley-agent"))
        .args(["--coordinator", url, "--node", "n0", "--token", "s3cret", "--inventory"])
        .arg(inventory)
        .arg("--work-dir")
        .arg(dir.join("work"))
        .arg("--shm-dir")
        .arg(shm)
        .args(args)
        .current_dir(dir)
        .env("MOTLEY_CONFIG", dir.join("agent.toml"))
        .env_remove("MOTLEY_WORK_DIR")
        .stdout(Stdio::null())
        .stderr(err)
        .spawn()
        .unwrap()
}

pub trait Alive {
    fn try_wait_alive(&self) -> bool;
}

impl Alive for Child {
    fn try_wait_alive(&self) -> bool {
        // Signal 0: whether the process is there, without reaping it.
        // SAFETY: kill with signal 0 only checks.
        unsafe { libc::kill(self.id() as i32, 0) == 0 }
    }
}

/// A directory standing in for /etc: root's, with a file of root's in it.
pub fn fake_etc(node: &Node) -> PathBuf {
    let etc = node.dir.join("etc");
    std::fs::create_dir_all(&etc).unwrap();
    std::fs::set_permissions(&etc, std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::write(etc.join("shadow"), "root:secret\n").unwrap();
    std::fs::set_permissions(etc.join("shadow"), std::fs::Permissions::from_mode(0o600)).unwrap();
    etc
}

pub fn listing(dir: &Path) -> Vec<(String, u32, u64)> {
    let mut out: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| {
            let m = e.metadata().unwrap();
            (e.file_name().to_string_lossy().into_owned(), m.uid(), m.len())
        })
        .collect();
    out.sort();
    out
}
