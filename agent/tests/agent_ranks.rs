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
use motley_proto::v1::{instruction, Ack, AgentStatus, Instruction, Launch, RankLaunch, RankStatus, RegisterReply, RegisterRequest, Stop};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

use crate::common;
use common::root_only::Need;
use common::{free_port, scratch, wait_exit};

#[derive(Default)]
struct Seen {
    registrations: Vec<RegisterRequest>,
    /// Every status, with the registration count at the time it came.
    statuses: Vec<(usize, RankStatus)>,
    /// Every message's (registration count, seq, full, number of ranks).
    messages: Vec<(usize, u64, bool, usize)>,
    down: Option<mpsc::Sender<Result<Instruction, Status>>>,
    /// Refuse registrations with this status (another agent holds the node).
    refuse_register: Option<Status>,
    /// Refuse heartbeat streams with this status (a stale session).
    refuse_heartbeat: Option<Status>,
    /// Acknowledge every message (as the coordinator does). Off where agents are killed and
    /// restarted: acknowledgements start the ranks' dead-man switch, whose deadline (10 of
    /// these 50 ms intervals) a restart on a loaded machine could miss.
    acks: bool,
    /// The heartbeat interval registrations are given (0: 50 ms).
    heartbeat_ms: u64,
}

#[derive(Clone, Default)]
struct Fake(Arc<Mutex<Seen>>);

#[tonic::async_trait]
impl Agent for Fake {
    async fn register(&self, req: Request<RegisterRequest>) -> Result<Response<RegisterReply>, Status> {
        let mut s = self.0.lock().unwrap();
        if let Some(status) = s.refuse_register.clone() {
            return Err(status);
        }
        s.registrations.push(req.into_inner());
        let heartbeat_ms = if s.heartbeat_ms == 0 { 50 } else { s.heartbeat_ms };
        Ok(Response::new(RegisterReply { epoch: s.registrations.len() as i64, heartbeat_ms, ..Default::default() }))
    }

    type HeartbeatStream = ReceiverStream<Result<Instruction, Status>>;

    async fn heartbeat(&self, req: Request<Streaming<AgentStatus>>) -> Result<Response<Self::HeartbeatStream>, Status> {
        let auth = req.metadata().get("authorization").and_then(|v| v.to_str().ok()).map(str::to_string);
        if auth.as_deref() != Some("Bearer s3cret") {
            return Err(Status::unauthenticated("token"));
        }
        if let Some(status) = self.0.lock().unwrap().refuse_heartbeat.clone() {
            return Err(status);
        }
        let (tx, rx) = mpsc::channel(64);
        self.0.lock().unwrap().down = Some(tx.clone());
        let (me, mut up) = (self.clone(), req.into_inner());
        tokio::spawn(async move {
            while let Ok(Some(status)) = up.message().await {
                {
                    let mut s = me.0.lock().unwrap();
                    let n = s.registrations.len();
                    s.messages.push((n, status.seq, status.full, status.ranks.len()));
                    s.statuses.extend(status.ranks.into_iter().map(|r| (n, r)));
                }
                // Held: acknowledged, as the coordinator does once it has stored a report.
                if !me.0.lock().unwrap().acks {
                    continue;
                }
                let _ = tx.send(Ok(Instruction { kind: Some(instruction::Kind::Ack(Ack { seq: status.seq })) })).await;
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
        // An open one: right after a restart the last agent's (closed) stream is still here.
        let tx = self.until("an open heartbeat stream", |s| s.down.clone().filter(|d| !d.is_closed()));
        tx.try_send(Ok(Instruction { kind: Some(kind) })).unwrap();
    }
}

fn launch(job: i64, generation: i64, run: &str, ranks: &[i64], port: u16) -> instruction::Kind {
    launch_as(job, generation, run, ranks, port, "")
}

fn launch_as(job: i64, generation: i64, run: &str, ranks: &[i64], port: u16, user: &str) -> instruction::Kind {
    instruction::Kind::Launch(Launch {
        user: user.into(),
        job,
        generation,
        run: run.into(),
        envs: HashMap::from([("HELLO".to_string(), "world".to_string())]),
        plan_json: r#"{"global_batch": 1, "micro_batch": 1, "seq_len": 8, "model": "m", "replicas": []}"#.into(),
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
        peers: vec![],
        ..Default::default()
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
    AgentProc(agent_command(url, "n0", Some(work), log).spawn().unwrap())
}

/// The agent of `node` on the fake at `url`, its stderr appended to `log`; its work directory
/// `work` (relative to its current directory, which is `log`'s) or the default.
fn agent_command(url: &str, node: &str, work: Option<&Path>, log: &Path) -> Command {
    let inventory = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/nodes/a100.yaml");
    let config = log.with_extension("toml");
    // These tests run as root (so does CI): ranks of jobs without a user need the operator's
    // allowance (`ranks_run_as_the_jobs_user` takes it back through the environment).
    std::fs::write(&config, "logs_listen = \"127.0.0.1:0\"\nallow_root_ranks = true\n").unwrap();
    let err = std::fs::OpenOptions::new().create(true).append(true).open(log).unwrap();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_motley-agent"));
    cmd.args(["--coordinator", url, "--node", node, "--token", "s3cret", "--inventory"])
        .arg(inventory)
        .current_dir(log.parent().unwrap())
        .env("MOTLEY_CONFIG", &config)
        .env_remove("MOTLEY_WORK_DIR")
        .stdout(Stdio::null())
        .stderr(err);
    if let Some(w) = work {
        // The memory tier beside the work directory (inside it would break its modes), not /dev/shm.
        cmd.arg("--work-dir").arg(w).arg("--shm-dir").arg(w.with_extension("shm"));
    }
    cmd
}

/// A fake coordinator served on a runtime of its own: (runtime, fake, its URL).
fn serve_fake() -> (tokio::runtime::Runtime, Fake, String) {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let fake = Fake::default();
    let listener = rt.block_on(tokio::net::TcpListener::bind("127.0.0.1:0")).unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    rt.spawn(
        tonic::transport::Server::builder()
            .add_service(AgentServer::new(fake.clone()))
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    (rt, fake, url)
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
    !motley_agent::ranks::group::group_alive(pgid)
}

#[test]
fn ranks_survive_an_agent_restart_and_stop_escalates() {
    let (_rt, fake, url) = serve_fake();
    let dir = scratch("ranks");
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
    assert!(!agent_log.contains("groups.json"), "a rank's groups file is not a record to read: {agent_log}");
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
    // rank that ignores SIGTERM is killed all the same. The agent is killed well within the
    // grace (5 intervals of 1 s: on a loaded machine, with 2 s, the stop's marker was once seen
    // only after the agent had already escalated).
    fake.0.lock().unwrap().heartbeat_ms = 1000;
    drop(agent);
    let agent = start_agent(&url, &work, &log);
    fake.until("the third registration", |s| (s.registrations.len() == 3).then_some(()));
    fake.send(launch(6, 1, "trap '' TERM; echo up; while true; do sleep 0.05; done", &[0], 29505));
    fake.wait_state(3, (6, 1, 0), "running");
    let pg6 = pgid_of(&work, 6, 0);
    fake.send(instruction::Kind::Stop(Stop { job: 6, generation: 1, reason: "test".into() }));
    fake.until("the stop's marker", |_| work.join("jobs/6/1/rank-0.stopping").exists().then_some(()));
    drop(agent);
    assert!(!group_gone(pg6), "the rank ignored SIGTERM and outlived its agent");
    let _agent = start_agent(&url, &work, &log);
    fake.until("the fourth registration", |s| (s.registrations.len() == 4).then_some(()));
    assert_eq!(fake.wait_state(4, (6, 1, 0), "exited"), Some(137));
    wait_gone(pg6);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A relative --work-dir is made absolute (the rank, in its
/// launch's directory, finds MOTLEY_PLAN, MOTLEY_NCCL_GROUPS and, under a relative --shm-dir,
/// MOTLEY_CKPT_DIR, and its exit file is written);
/// the default work directory is per node; a second agent on a work directory in use stops at
/// once naming --work-dir; every directory is 0700 and every file 0600; the first message of a
/// session lists every rank, and an end is marked reported once acknowledged.
#[test]
fn a_relative_work_dir_is_absolute_private_and_one_agents() {
    let (_rt, fake, url) = serve_fake();
    let dir = scratch("relative");
    let log = dir.join("agent.log");
    fake.0.lock().unwrap().acks = true;
    let _agent = AgentProc(agent_command(&url, "n0", Some(Path::new("work")), &log).spawn().unwrap());
    // The memory tier is a relative --shm-dir here too (work.shm): its paths are absolute as well.
    let run = r#"case "$MOTLEY_PLAN" in /*) ;; *) exit 3 ;; esac; case "$MOTLEY_NCCL_GROUPS" in /*) ;; *) exit 4 ;; esac
        case "$MOTLEY_CKPT_DIR" in /*) ;; *) exit 5 ;; esac; case "$MOTLEY_CKPT_NOTICE" in /*) ;; *) exit 6 ;; esac
        test -f "$MOTLEY_PLAN" && test -f "$MOTLEY_NCCL_GROUPS" && test -d "$MOTLEY_CKPT_DIR""#;
    fake.send(launch(1, 1, run, &[0], 29500));
    let gen_dir = dir.join("work/jobs/1/1");
    assert_eq!(
        fake.wait_state(1, (1, 1, 0), "exited"),
        Some(0),
        "{}",
        std::fs::read_to_string(gen_dir.join("rank-0.log")).unwrap_or_default()
    );
    assert_eq!(std::fs::read_to_string(gen_dir.join("rank-0.exit")).unwrap(), "0\n", "the wrapper wrote the exit file");
    fake.until("the reported marker (after the ack)", |_| gen_dir.join("rank-0.reported").exists().then_some(()));
    fake.until("the lease file", |_| dir.join("work/lease").exists().then_some(()));
    let record: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(gen_dir.join("rank-0.json")).unwrap()).unwrap();
    assert_eq!(record["node"], "n0");
    {
        let s = fake.0.lock().unwrap();
        assert_eq!((s.messages[0].1, s.messages[0].2), (1, true), "seq 1, full: {:?}", s.messages);
        assert!(s.messages.iter().skip(1).all(|m| !m.2), "only the first message is full");
        assert!(s.messages.windows(2).all(|w| w[1].1 == w[0].1 + 1), "seq counts up: {:?}", s.messages);
    }

    // Modes: the work directory and everything under it.
    use std::os::unix::fs::PermissionsExt;
    let mut stack = vec![dir.join("work")];
    let mut files = 0;
    while let Some(p) = stack.pop() {
        // The lease is rewritten every heartbeat through a temporary file renamed over it: one
        // seen here may be gone by the next look.
        let lease_temp = p.file_name().is_some_and(|n| n.to_string_lossy().starts_with(".lease.tmp-"));
        let Ok(meta) = std::fs::metadata(&p) else {
            assert!(lease_temp, "{} vanished while the agent ran", p.display());
            continue;
        };
        let mode = meta.permissions().mode() & 0o777;
        if lease_temp {
            // Made 0600, then given the lease's mode before it takes the lease's name.
            assert!(mode == 0o600 || mode == 0o644, "the lease's temporary file {}: {mode:o}", p.display());
            continue;
        }
        if p.is_dir() {
            assert_eq!(mode, 0o700, "{}", p.display());
            stack.extend(std::fs::read_dir(&p).unwrap().map(|e| e.unwrap().path()));
        } else if p.ends_with("lease") {
            assert_eq!(mode, 0o644, "the lease (a deadline) is read by ranks of other users");
            files += 1;
        } else {
            assert_eq!(mode, 0o600, "{}", p.display());
            files += 1;
        }
    }
    assert!(files >= 8, "agent.lock, lease, plan, record, groups, log, exit, reported: {files}");

    // A second agent on the same directory stops at once, naming the flag; one with the default
    // work directory gets its node's own.
    let mut second = agent_command(&url, "n0", Some(Path::new("work")), &log).spawn().unwrap();
    assert!(!wait_exit(&mut second, "the second agent").success());
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(text.contains("--work-dir") && text.contains("another motley-agent is running on this directory"), "{text}");
    let _default = AgentProc(agent_command(&url, "n1", None, &log).spawn().unwrap());
    fake.until("n1's registration", |s| s.registrations.iter().any(|r| r.node == "n1").then_some(()));
    assert!(dir.join("motley-agent/n1/agent.lock").exists());

    // A work directory left too open is closed again.
    std::fs::create_dir_all(dir.join("open")).unwrap();
    std::fs::set_permissions(dir.join("open"), std::fs::Permissions::from_mode(0o755)).unwrap();
    let _open = AgentProc(agent_command(&url, "n2", Some(Path::new("open")), &log).spawn().unwrap());
    fake.until("n2's registration", |s| s.registrations.iter().any(|r| r.node == "n2").then_some(()));
    assert_eq!(std::fs::metadata(dir.join("open")).unwrap().permissions().mode() & 0o777, 0o700);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A node held by another live agent (ALREADY_EXISTS, for longer than
/// 10 s), or heartbeats refused as stale session after session, end the agent with an error
/// saying what to do, instead of re-registering forever.
#[test]
fn a_refused_node_ends_the_agent_with_a_clear_error() {
    let (_rt, fake, url) = serve_fake();
    let dir = scratch("refused");
    let log = dir.join("held.log");
    fake.0.lock().unwrap().refuse_register = Some(Status::already_exists("node n0 is held by another live agent (at 10.0.0.1)"));
    let mut agent = agent_command(&url, "n0", Some(Path::new("w1")), &log).spawn().unwrap();
    assert!(!wait_exit(&mut agent, "the agent of a held node").success());
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(text.contains("node n0 is held by another live agent") && text.contains("another --node"), "{text}");
    // It tries again for a while (an earlier session of its own may still look open to the
    // coordinator), then gives up: not forever.

    let log = dir.join("stale.log");
    {
        let mut s = fake.0.lock().unwrap();
        s.refuse_register = None;
        s.refuse_heartbeat = Some(Status::aborted("this agent session is stale (node n0: agent epoch 1 is stale); register again"));
    }
    let mut agent = agent_command(&url, "n0", Some(Path::new("w2")), &log).spawn().unwrap();
    assert!(!wait_exit(&mut agent, "the agent refused as stale").success());
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(text.contains("stale 3 sessions in a row") && text.contains("another --node"), "{text}");
    assert_eq!(fake.0.lock().unwrap().registrations.len(), 3);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Whom ranks run as (README, "The running system": a job's `user`): an agent running as root runs each rank as its job's user (uid,
/// groups, HOME/USER/LOGNAME; the launch directory and the rank's files are the user's), and
/// refuses with 126 and a reason in the rank's log a job naming no user (unless the operator
/// allows root ranks), a user the node does not have, or root. With the allowance, a job with
/// no user runs as root.
#[test]
fn ranks_run_as_the_jobs_user() {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    if !common::root_only::can_run("ranks_run_as_the_jobs_user", &[Need::Root, Need::User("nobody")]) {
        return;
    }
    let nobody = motley_agent::ranks::users::lookup("nobody").unwrap().expect("the node has a user nobody");
    let (_rt, fake, url) = serve_fake();
    let dir = scratch("user");
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    let (work, log) = (dir.join("work"), dir.join("agent.log"));
    fake.0.lock().unwrap().acks = true; // the lease file, which the rank reads
                                        // The variable beats the config file's `allow_root_ranks = true` (flag > env > file).
    let _agent = AgentProc(agent_command(&url, "n0", Some(&work), &log).env("MOTLEY_ALLOW_ROOT_RANKS", "false").spawn().unwrap());
    fake.until("the lease file", |_| work.join("lease").exists().then_some(()));
    let rank_log = |job: i64| std::fs::read_to_string(work.join(format!("jobs/{job}/1/rank-0.log"))).unwrap_or_default();

    // No user: refused, and the log says what to do.
    fake.send(launch(1, 1, "echo ran", &[0], 29500));
    assert_eq!(fake.wait_state(1, (1, 1, 0), "exited"), Some(126));
    let text = rank_log(1);
    assert!(
        text.contains(
            "the agent runs as root and the job names no user; add user: NAME to the job file, or set allow_root_ranks = true in the agent config"
        ) && !text.contains("ran\n"),
        "{text}"
    );

    // As nobody: its uid, gid and home; it reads its plan, groups and the lease, writes its log
    // by name and files in its launch directory; its wrapper writes the exit code.
    let run = r#"id -u; id -g; echo "home=$HOME user=$USER logname=$LOGNAME"
        test -r "$MOTLEY_PLAN" && test -r "$MOTLEY_NCCL_GROUPS" && cat ../../../lease >/dev/null || exit 3
        echo by-name >> "rank-$RANK.log" && touch own-file"#;
    fake.send(launch_as(2, 1, run, &[0], 29501, "nobody"));
    let text = || rank_log(2);
    assert_eq!(fake.wait_state(1, (2, 1, 0), "exited"), Some(0), "{}", text());
    assert_eq!(
        text(),
        format!("{}\n{}\nhome={} user=nobody logname=nobody\nby-name\n", nobody.uid, nobody.gid, nobody.home),
        "the rank ran as nobody"
    );
    let gen_dir = work.join("jobs/2/1");
    for f in ["", "own-file", "rank-0.log", "rank-0.exit", "plan.json", "rank-0.groups.json"] {
        assert_eq!(std::fs::metadata(gen_dir.join(f)).unwrap().uid(), nobody.uid, "{f} is the user's");
    }
    assert_eq!(std::fs::metadata(&gen_dir).unwrap().permissions().mode() & 0o777, 0o700, "still private to the user");
    assert_eq!(std::fs::metadata(gen_dir.join("rank-0.json")).unwrap().uid(), 0, "the record stays the agent's");
    for d in [&work, &work.join("jobs"), &work.join("jobs/2")] {
        assert_eq!(std::fs::metadata(d).unwrap().permissions().mode() & 0o777, 0o711, "{}: passable, not listable", d.display());
    }

    // A user the node does not have, and root: refused with the reason.
    fake.send(launch_as(3, 1, "echo ran", &[0], 29502, "motley-no-such-user"));
    assert_eq!(fake.wait_state(1, (3, 1, 0), "exited"), Some(126));
    assert!(rank_log(3).contains("the job's user 'motley-no-such-user' does not exist on node n0"), "{}", rank_log(3));
    fake.send(launch_as(4, 1, "echo ran", &[0], 29503, "root"));
    assert_eq!(fake.wait_state(1, (4, 1, 0), "exited"), Some(126));
    assert!(rank_log(4).contains("'root' is root (uid 0)"), "{}", rank_log(4));

    // Allowed (the config file's setting): a job with no user runs as root.
    let (work2, log2) = (dir.join("work2"), dir.join("agent2.log"));
    let _allowed = AgentProc(agent_command(&url, "n1", Some(&work2), &log2).spawn().unwrap());
    let since = fake.until("n1's registration", |s| s.registrations.iter().position(|r| r.node == "n1").map(|i| i + 1));
    // Its session's first (full) message: instructions now go down its stream.
    fake.until("n1's heartbeat stream", |s| s.messages.iter().any(|m| m.0 >= since && m.2).then_some(()));
    fake.send(launch(5, 1, "id -u", &[0], 29504));
    assert_eq!(fake.wait_state(since, (5, 1, 0), "exited"), Some(0));
    assert_eq!(std::fs::read_to_string(work2.join("jobs/5/1/rank-0.log")).unwrap(), "0\n");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Whether a process is gone (or a zombie nobody reaped yet).
fn process_gone(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map_or(true, |s| s.rsplit_once(") ").is_some_and(|(_, rest)| rest.starts_with('Z')))
}

/// A process a rank started in a session of its own (`setsid`) has left the
/// rank's process group but not its cgroup: a stop, and a rank's own end, take it too.
#[test]
fn what_a_rank_starts_outside_its_process_group_ends_with_it() {
    // Ranks get cgroups of their own only from a root agent on a cgroup v2 host.
    let needs = [Need::Root, Need::CgroupV2, Need::User("nobody")];
    if !common::root_only::can_run("what_a_rank_starts_outside_its_process_group_ends_with_it", &needs) {
        return;
    }
    let (_rt, fake, url) = serve_fake();
    let dir = scratch("cgroup");
    // A rank of another user (nobody, below) reaches its launch directory through it.
    std::fs::set_permissions(&dir, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let (work, log) = (dir.join("work"), dir.join("agent.log"));
    let agent = start_agent(&url, &work, &log);
    fake.until("registration", |s| s.registrations.first().map(|_| ()));
    let escaped = |job: i64| -> i32 {
        let file = work.join(format!("jobs/{job}/1/escaped.pid"));
        let text = fake.until("the escaped process's pid", |_| std::fs::read_to_string(&file).ok().filter(|t| t.ends_with('\n')));
        text.trim().parse().unwrap()
    };
    let wait_gone = |pid: i32, what: &str| {
        let start = Instant::now();
        while !process_gone(pid) {
            assert!(start.elapsed() < Duration::from_secs(30), "{what}: process {pid} is still running");
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    let leave = "setsid sh -c 'echo $$ > escaped.pid.tmp && mv escaped.pid.tmp escaped.pid; exec sleep 600' </dev/null >/dev/null 2>&1 &";

    // Stopped: the rank ends on SIGTERM; what it left in another session is killed with it.
    fake.send(launch(1, 1, &format!("{leave} echo up; sleep 600"), &[0], 29510));
    fake.wait_state(1, (1, 1, 0), "running");
    let pid = escaped(1);
    assert!(!process_gone(pid));
    // The rank's own cgroup, named for it, under the agent's.
    let own = std::fs::read_to_string(format!("/proc/{}/cgroup", pgid_of(&work, 1, 0))).unwrap();
    let path = own.lines().find_map(|l| l.strip_prefix("0::")).unwrap().to_string();
    assert!(path.ends_with("/job-1-gen-1-rank-0") && path.contains("/motley-n0-"), "{path}");
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    let mount = mountinfo.lines().find(|l| l.contains(" - cgroup2 ")).unwrap().split_whitespace().nth(4).unwrap().to_string();
    let cgroup = Path::new(&mount).join(path.trim_start_matches('/'));
    assert!(cgroup.is_dir(), "{}", cgroup.display());
    fake.send(instruction::Kind::Stop(Stop { job: 1, generation: 1, reason: "test".into() }));
    assert_eq!(fake.wait_state(1, (1, 1, 0), "exited"), Some(143));
    wait_gone(pid, "after a stop");
    // Its cgroup is removed, and the agent's with it once no rank has one there.
    let start = Instant::now();
    while cgroup.parent().unwrap().exists() {
        assert!(start.elapsed() < Duration::from_secs(30), "{} is still there", cgroup.parent().unwrap().display());
        std::thread::sleep(Duration::from_millis(20));
    }

    // Ended by itself: its leftovers end too.
    fake.send(launch(2, 1, &format!("{leave} while [ ! -e escaped.pid ]; do sleep 0.05; done; exit 3"), &[0], 29511));
    assert_eq!(fake.wait_state(1, (2, 1, 0), "exited"), Some(3));
    wait_gone(escaped(2), "after the rank's own end");
    let agent_log = std::fs::read_to_string(&log).unwrap();
    assert!(!agent_log.contains("without a cgroup"), "{agent_log}");

    // The agent dies: once its lease lapses (30 intervals of 50 ms), the dead-man switch in the
    // rank's wrapper stops the rank and then kills its whole cgroup, the escaped process too.
    fake.0.lock().unwrap().acks = true;
    fake.send(launch(3, 1, &format!("{leave} echo up; sleep 600"), &[0], 29512));
    fake.wait_state(1, (3, 1, 0), "running");
    let pid = escaped(3);
    fake.until("the lease file", |_| work.join("lease").exists().then_some(()));
    let rank_cgroup = |job: i64| {
        let own = std::fs::read_to_string(format!("/proc/{}/cgroup", pgid_of(&work, job, 0))).unwrap();
        Path::new(&mount).join(own.lines().find_map(|l| l.strip_prefix("0::")).unwrap().trim_start_matches('/'))
    };
    // A rank of an unprivileged user: its wrapper runs as that user too, and its cgroup is
    // delegated to it (cgroup.procs and cgroup.kill are the user's) so that its switch can kill it.
    let nobody = motley_agent::ranks::users::lookup("nobody").unwrap().expect("the node has a user nobody");
    fake.send(launch_as(4, 1, &format!("{leave} echo up; sleep 600"), &[0], 29513, "nobody"));
    fake.wait_state(1, (4, 1, 0), "running");
    let nobody_pid = escaped(4);
    let (cgroup3, cgroup4) = (rank_cgroup(3), rank_cgroup(4));
    for file in motley_agent::ranks::cgroup::DELEGATED {
        assert_eq!(std::os::unix::fs::MetadataExt::uid(&std::fs::metadata(cgroup4.join(file)).unwrap()), nobody.uid, "{file}");
    }
    assert_eq!(std::os::unix::fs::MetadataExt::uid(&std::fs::metadata(&cgroup4).unwrap()), 0, "the directory stays root's");
    drop(agent);
    wait_gone(pid, "after the agent's lease lapsed");
    wait_gone(nobody_pid, "nobody's rank, after the agent's lease lapsed");
    for job in [3, 4] {
        let exit = std::fs::read_to_string(work.join(format!("jobs/{job}/1/rank-0.exit"))).unwrap();
        assert_eq!(exit.trim(), "143", "job {job}: the rank was stopped, then its cgroup");
    }
    // Nobody is left to remove the cgroups: the test does.
    for cgroup in [&cgroup3, &cgroup4] {
        let _ = std::fs::remove_dir(cgroup);
    }
    let _ = std::fs::remove_dir(cgroup3.parent().unwrap());
    let _ = std::fs::remove_dir_all(&dir);
}

/// The agent's cloud credentials and settings stay with it: a rank inherits only the
/// allow-list (PATH, the locale, ...) and what the operator adds with `--rank-env`, then its
/// job's `envs:`.
#[test]
fn ranks_inherit_only_the_allowed_part_of_the_agents_environment() {
    let (_rt, fake, url) = serve_fake();
    let dir = scratch("environment");
    let (work, log) = (dir.join("work"), dir.join("agent.log"));
    let secrets = [
        ("AWS_SECRET_ACCESS_KEY", "aws-secret"),
        ("GOOGLE_APPLICATION_CREDENTIALS", "/etc/motley/gcs.json"),
        ("AZURE_STORAGE_ACCESS_KEY", "azure-secret"),
        ("MOTLEY_TOKEN", "env-token"),
        ("LD_PRELOAD", ""),
    ];
    let mut cmd = agent_command(&url, "n0", Some(&work), &log);
    cmd.envs(secrets).env("SITE_SCRATCH", "/scratch").env("SITE_OTHER", "x").env("TZ", "UTC");
    let _agent = AgentProc(cmd.arg("--rank-env").arg("SITE_SCRATCH,NCCL_*").spawn().unwrap());
    fake.until("registration", |s| s.registrations.first().map(|_| ()));
    fake.send(launch(1, 1, "env > env.txt.tmp && mv env.txt.tmp env.txt", &[0], 29520));
    assert_eq!(fake.wait_state(1, (1, 1, 0), "exited"), Some(0));
    let env = std::fs::read_to_string(work.join("jobs/1/1/env.txt")).unwrap();
    let keys: Vec<&str> = env.lines().filter_map(|l| l.split_once('=').map(|(k, _)| k)).collect();
    for (k, _) in secrets {
        assert!(!keys.contains(&k), "{k} reached the rank:\n{env}");
    }
    assert!(!env.contains("s3cret") && !env.contains("secret"), "a credential reached the rank:\n{env}");
    for k in ["PATH", "TZ", "SITE_SCRATCH", "HELLO", "RANK", "MOTLEY_JOB"] {
        assert!(keys.contains(&k), "{k} is missing:\n{env}");
    }
    assert!(!keys.contains(&"SITE_OTHER"), "only the names the operator allowed pass:\n{env}");

    // An allow-list that would hand ranks the agent's own settings is refused at start.
    let out =
        agent_command(&url, "n1", Some(&dir.join("work1")), &dir.join("agent1.log")).args(["--rank-env", "MOTLEY_*"]).output().unwrap();
    assert!(!out.status.success());
    let text = std::fs::read_to_string(dir.join("agent1.log")).unwrap_or_default() + &String::from_utf8_lossy(&out.stderr);
    assert!(text.contains("rank_env: \"MOTLEY_*\""), "{text}");
    let _ = std::fs::remove_dir_all(&dir);
}
