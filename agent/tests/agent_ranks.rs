//! The real `motley-agent` binary against a fake coordinator (the real gRPC contract, served
//! here): ranks run, their logs are served over HTTP, they survive an agent killed with -9
//! and are adopted by the next one (a rank that finishes is reported with its exit code, one
//! whose group vanished without an exit file as lost, half-written records are skipped), a
//! stop escalates from SIGTERM to SIGKILL after the grace period, a stale launch is ignored,
//! and `motley-rank-probe` ranks meet through the environment the agent gives them.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use motley_proto::v1::agent_server::{Agent, AgentServer};
use motley_proto::v1::{instruction, AgentStatus, Instruction, Launch, RankLaunch, RankStatus, RegisterReply, RegisterRequest, Stop};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

#[derive(Default)]
struct Seen {
    registrations: Vec<RegisterRequest>,
    /// Every status, with the registration count at the time it came.
    statuses: Vec<(usize, RankStatus)>,
    down: Option<mpsc::Sender<Result<Instruction, Status>>>,
}

#[derive(Clone, Default)]
struct Fake(Arc<Mutex<Seen>>);

#[tonic::async_trait]
impl Agent for Fake {
    async fn register(&self, req: Request<RegisterRequest>) -> Result<Response<RegisterReply>, Status> {
        let mut s = self.0.lock().unwrap();
        s.registrations.push(req.into_inner());
        Ok(Response::new(RegisterReply { epoch: s.registrations.len() as i64, heartbeat_ms: 50 }))
    }

    type HeartbeatStream = ReceiverStream<Result<Instruction, Status>>;

    async fn heartbeat(&self, req: Request<Streaming<AgentStatus>>) -> Result<Response<Self::HeartbeatStream>, Status> {
        let auth = req.metadata().get("authorization").and_then(|v| v.to_str().ok()).map(str::to_string);
        if auth.as_deref() != Some("Bearer s3cret") {
            return Err(Status::unauthenticated("token"));
        }
        let (tx, rx) = mpsc::channel(64);
        self.0.lock().unwrap().down = Some(tx);
        let (me, mut up) = (self.clone(), req.into_inner());
        tokio::spawn(async move {
            while let Ok(Some(status)) = up.message().await {
                let mut s = me.0.lock().unwrap();
                let n = s.registrations.len();
                s.statuses.extend(status.ranks.into_iter().map(|r| (n, r)));
            }
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}

impl Fake {
    fn until<T>(&self, what: &str, f: impl Fn(&Seen) -> Option<T>) -> T {
        let start = Instant::now();
        loop {
            if let Some(t) = f(&self.0.lock().unwrap()) {
                return t;
            }
            assert!(
                start.elapsed() < Duration::from_secs(60),
                "timed out waiting for {what}; statuses {:?}",
                self.0.lock().unwrap().statuses
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The latest state of (job, generation, rank) reported after registration `since`.
    fn state(s: &Seen, since: usize, key: (i64, i64, i64)) -> Option<(String, Option<i64>)> {
        s.statuses
            .iter()
            .rev()
            .find(|(n, r)| *n >= since && (r.job, r.generation, r.rank) == key)
            .map(|(_, r)| (r.state.clone(), r.exit_code))
    }

    fn wait_state(&self, since: usize, key: (i64, i64, i64), state: &str) -> Option<i64> {
        self.until(&format!("{key:?} {state}"), |s| Fake::state(s, since, key).filter(|(st, _)| st == state).map(|(_, c)| c))
    }

    fn send(&self, kind: instruction::Kind) {
        let tx = self.until("a heartbeat stream", |s| s.down.clone());
        tx.try_send(Ok(Instruction { kind: Some(kind) })).unwrap();
    }
}

fn launch(job: i64, generation: i64, run: &str, ranks: &[i64], port: u16) -> instruction::Kind {
    instruction::Kind::Launch(Launch {
        job,
        generation,
        run: run.into(),
        envs: HashMap::from([("HELLO".to_string(), "world".to_string())]),
        plan_json: "{\"replicas\": []}".into(),
        master_addr: "127.0.0.1".into(),
        master_port: port as u32,
        world_size: ranks.len() as i64,
        ranks: ranks
            .iter()
            .map(|&r| RankLaunch {
                rank: r,
                local_rank: r,
                local_world_size: ranks.len() as i64,
                gpu: r,
                replica: 0,
                stage: r,
                layer_start: 4 * r,
                layer_end: 4 * r + 4,
                ..Default::default()
            })
            .collect(),
    })
}

struct AgentProc(Child);
impl Drop for AgentProc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn start_agent(url: &str, work: &Path, log: &Path) -> AgentProc {
    let inventory = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/nodes/a100.yaml");
    let config = work.with_extension("toml");
    std::fs::write(&config, "logs_listen = \"127.0.0.1:0\"\n").unwrap();
    let err = std::fs::OpenOptions::new().create(true).append(true).open(log).unwrap();
    AgentProc(
        Command::new(env!("CARGO_BIN_EXE_motley-agent"))
            .args(["--coordinator", url, "--node", "n0", "--token", "s3cret", "--inventory"])
            .arg(inventory)
            .arg("--work-dir")
            .arg(work)
            .env("MOTLEY_CONFIG", &config)
            .stdout(Stdio::null())
            .stderr(err)
            .spawn()
            .unwrap(),
    )
}

/// GET a path of the logs server: (status, body).
fn http_get(base: &str, path: &str, token: Option<&str>) -> (u16, String) {
    let hostport = base.strip_prefix("http://").unwrap();
    let mut s = std::net::TcpStream::connect(hostport).unwrap();
    let auth = token.map(|t| format!("Authorization: Bearer {t}\r\n")).unwrap_or_default();
    write!(s, "GET {path} HTTP/1.1\r\nHost: {hostport}\r\n{auth}Connection: close\r\n\r\n").unwrap();
    let mut raw = String::new();
    s.read_to_string(&mut raw).unwrap();
    let status = raw[9..12].parse().unwrap();
    (status, raw.split_once("\r\n\r\n").map(|(_, b)| b.to_string()).unwrap_or_default())
}

fn pgid_of(work: &Path, job: i64, rank: i64) -> i32 {
    let rec: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(work.join(format!("jobs/{job}/1/rank-{rank}.json"))).unwrap()).unwrap();
    rec["pgid"].as_i64().unwrap() as i32
}

fn group_gone(pgid: i32) -> bool {
    !motley_agent::rankfiles::group_alive(pgid)
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

#[test]
fn ranks_survive_an_agent_restart_and_stop_escalates() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let fake = Fake::default();
    let listener = rt.block_on(tokio::net::TcpListener::bind("127.0.0.1:0")).unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let server = AgentServer::new(fake.clone());
    rt.spawn(
        tonic::transport::Server::builder()
            .add_service(server)
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );

    let dir = std::env::temp_dir().join(format!("motley-agent-ranks-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let (work, log) = (dir.join("work"), dir.join("agent.log"));
    let agent = start_agent(&url, &work, &log);
    let logs_url = fake.until("registration", |s| s.registrations.first().map(|r| r.logs_url.clone()));
    assert!(logs_url.starts_with("http://127.0.0.1:") && !logs_url.ends_with(":0"), "{logs_url}");

    // Job 1: two ranks that wait for a file, then exit with 7 + RANK.
    let run = r#"echo "started $RANK $HELLO"; while [ ! -e go-$RANK ]; do sleep 0.05; done; exit $((RANK + 7))"#;
    fake.send(launch(1, 1, run, &[0, 1], 29500));
    fake.wait_state(1, (1, 1, 0), "running");
    fake.wait_state(1, (1, 1, 1), "running");

    // Logs over HTTP: the token, an offset, a JSON 404 naming what is absent.
    let start = Instant::now();
    while http_get(&logs_url, "/logs/1/1/0", Some("s3cret")).1 != "started 0 world\n" {
        assert!(start.elapsed() < Duration::from_secs(30), "rank 0's log: {:?}", http_get(&logs_url, "/logs/1/1/0", Some("s3cret")));
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(http_get(&logs_url, "/logs/1/1/0?offset=8", Some("s3cret")), (200, "0 world\n".to_string()));
    assert_eq!(http_get(&logs_url, "/logs/1/1/0?offset=99", Some("s3cret")), (200, String::new()));
    assert_eq!(http_get(&logs_url, "/logs/1/1/0", None).0, 401);
    assert_eq!(http_get(&logs_url, "/logs/1/1/0", Some("wrong")).0, 401);
    let (code, body) = http_get(&logs_url, "/logs/1/1/9", Some("s3cret"));
    assert_eq!(code, 404);
    let err: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert!(err["error"].as_str().unwrap().contains("job 1 generation 1 rank 9"), "{body}");

    // The agent dies; its ranks do not. Rank 1's whole group is killed meanwhile (no exit
    // file: lost); a half-written record and a leftover temporary must not be adopted.
    drop(agent);
    let gen_dir = work.join("jobs/1/1");
    let (pg0, pg1) = (pgid_of(&work, 1, 0), pgid_of(&work, 1, 1));
    assert!(!group_gone(pg0), "rank 0 outlives its agent");
    unsafe { libc::kill(-pg1, libc::SIGKILL) };
    std::fs::write(gen_dir.join("rank-5.json"), "{\"job\": 1, \"generation\": 1, \"ra").unwrap();
    std::fs::write(gen_dir.join(".rank-6.json.tmp-1"), "{\"job\": 1, \"generation\": 1, \"rank\": 6, \"pgid\": 1, \"log\": \"x\"}")
        .unwrap();
    let wait_gone = |pg: i32| {
        let start = Instant::now();
        while !group_gone(pg) {
            assert!(start.elapsed() < Duration::from_secs(30), "group {pg} still there");
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    wait_gone(pg1);

    let agent = start_agent(&url, &work, &log);
    fake.until("the second registration", |s| (s.registrations.len() == 2).then_some(()));
    assert_eq!(fake.wait_state(2, (1, 1, 0), "running"), None);
    fake.wait_state(2, (1, 1, 1), "lost");
    std::fs::write(gen_dir.join("go-0"), "").unwrap();
    assert_eq!(fake.wait_state(2, (1, 1, 0), "exited"), Some(7), "the adopted rank's own exit code");
    let agent_log = std::fs::read_to_string(&log).unwrap();
    assert!(agent_log.contains("rank-5.json: not a rank record, skipped"), "{agent_log}");
    assert!(!fake.0.lock().unwrap().statuses.iter().any(|(_, r)| r.job == 1 && r.rank >= 5), "no half-written record was adopted");

    // Stop: a rank that ignores SIGTERM is killed after the grace period (137); one that does
    // not ends on SIGTERM (143); nothing of either group is left.
    fake.send(launch(2, 1, "trap '' TERM; echo up; while true; do sleep 0.05; done", &[0], 29501));
    fake.send(launch(3, 1, "echo up; sleep 600", &[0], 29502));
    fake.wait_state(2, (2, 1, 0), "running");
    fake.wait_state(2, (3, 1, 0), "running");
    let (pg2, pg3) = (pgid_of(&work, 2, 0), pgid_of(&work, 3, 0));
    fake.send(instruction::Kind::Stop(Stop { job: 2, generation: 1, reason: "test".into() }));
    fake.send(instruction::Kind::Stop(Stop { job: 3, generation: 1, reason: "test".into() }));
    assert_eq!(fake.wait_state(2, (2, 1, 0), "exited"), Some(137));
    assert_eq!(fake.wait_state(2, (3, 1, 0), "exited"), Some(143));
    wait_gone(pg2);
    wait_gone(pg3);

    // A stale launch (generation 1 after 2) is ignored; instructions are handled in order, so
    // once job 5 (two probes meeting at MASTER_ADDR) is seen, job 4 generation 1 never ran.
    fake.send(launch(4, 2, "exit 0", &[0], 29503));
    assert_eq!(fake.wait_state(2, (4, 2, 0), "exited"), Some(0));
    fake.send(launch(4, 1, "exit 0", &[0], 29504));
    let probe = format!("{} --timeout-ms 20000", env!("CARGO_BIN_EXE_motley-rank-probe"));
    fake.send(launch(5, 1, &probe, &[0, 1], free_port()));
    for r in 0..2 {
        let code = fake.wait_state(2, (5, 1, r), "exited");
        let rank_log = std::fs::read_to_string(work.join(format!("jobs/5/1/rank-{r}.log"))).unwrap_or_default();
        assert_eq!(code, Some(0), "probe rank {r}: {rank_log}");
    }
    assert!(!fake.0.lock().unwrap().statuses.iter().any(|(_, r)| r.job == 4 && r.generation == 1));
    assert!(std::fs::read_to_string(&log).unwrap().contains("ignoring a launch of job 4 generation 1"));

    // A stop whose agent dies before the grace period ends is finished by the next agent: the
    // rank that ignores SIGTERM is killed all the same.
    fake.send(launch(6, 1, "trap '' TERM; echo up; while true; do sleep 0.05; done", &[0], 29505));
    fake.wait_state(2, (6, 1, 0), "running");
    let pg6 = pgid_of(&work, 6, 0);
    fake.send(instruction::Kind::Stop(Stop { job: 6, generation: 1, reason: "test".into() }));
    fake.until("the stop's marker", |_| work.join("jobs/6/1/rank-0.stopping").exists().then_some(()));
    drop(agent);
    assert!(!group_gone(pg6), "the rank ignored SIGTERM and outlived its agent");
    let _agent = start_agent(&url, &work, &log);
    fake.until("the third registration", |s| (s.registrations.len() == 3).then_some(()));
    assert_eq!(fake.wait_state(3, (6, 1, 0), "exited"), Some(137));
    wait_gone(pg6);
    let _ = std::fs::remove_dir_all(&dir);
}
