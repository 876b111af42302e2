//! Two real `motley-agent`s against a fake coordinator: the NICs' counter rates (from a fake
//! sysfs tree) and the probes of a launch's peer arrive in the interval heartbeats, and the
//! probes end with the launch.

use std::collections::HashMap;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use motley_proto::v1::agent_server::{Agent, AgentServer};
use motley_proto::v1::{
    instruction, AgentStatus, Instruction, Launch, LinkSample, NicRate, PeerDataPlane, RankLaunch, RegisterReply, RegisterRequest, Stop,
};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

use crate::common;
use common::{free_port, scratch};

#[derive(Default)]
struct Seen {
    registrations: HashMap<String, RegisterRequest>,
    links: Vec<(String, LinkSample)>,
    nics: Vec<(String, NicRate)>,
    down: HashMap<String, mpsc::Sender<Result<Instruction, Status>>>,
}

#[derive(Clone, Default)]
struct Fake(Arc<Mutex<Seen>>);

#[tonic::async_trait]
impl Agent for Fake {
    async fn register(&self, req: Request<RegisterRequest>) -> Result<Response<RegisterReply>, Status> {
        let req = req.into_inner();
        // Each node its own key, every node the probe key, as a coordinator issues them.
        let cluster = [42; motley_server::capability::KEY_BYTES];
        let node_key = motley_server::capability::node_key(&cluster, &req.node).unwrap().to_vec();
        let probe_key = motley_server::capability::probe_key(&cluster).unwrap().to_vec();
        self.0.lock().unwrap().registrations.insert(req.node.clone(), req);
        Ok(Response::new(RegisterReply { epoch: 1, heartbeat_ms: 50, data_plane_key: node_key, probe_key }))
    }

    type HeartbeatStream = ReceiverStream<Result<Instruction, Status>>;

    async fn heartbeat(&self, req: Request<Streaming<AgentStatus>>) -> Result<Response<Self::HeartbeatStream>, Status> {
        let (tx, rx) = mpsc::channel(64);
        let (me, mut up) = (self.clone(), req.into_inner());
        tokio::spawn(async move {
            while let Ok(Some(status)) = up.message().await {
                let mut s = me.0.lock().unwrap();
                s.down.insert(status.node.clone(), tx.clone());
                let node = status.node.clone();
                s.links.extend(status.links.into_iter().map(|l| (node.clone(), l)));
                s.nics.extend(status.nics.into_iter().map(|n| (node.clone(), n)));
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
            assert!(start.elapsed() < Duration::from_secs(60), "timed out waiting for {what}");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn send(&self, node: &str, kind: instruction::Kind) {
        let tx = self.until("an open heartbeat stream", |s| s.down.get(node).cloned());
        tx.try_send(Ok(Instruction { kind: Some(kind) })).unwrap();
    }
}

struct AgentProc(Child);
impl Drop for AgentProc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn agent(url: &str, node: &str, dir: &Path, sysfs: &Path) -> AgentProc {
    let inventory = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/nodes/a100.yaml");
    let config = dir.join(format!("{node}.toml"));
    // Run as root (as CI does): ranks of a job without a user need the operator's allowance.
    std::fs::write(&config, "logs_listen = \"127.0.0.1:0\"\ndata_listen = \"127.0.0.1:0\"\nallow_root_ranks = true\n").unwrap();
    let log = std::fs::OpenOptions::new().create(true).append(true).open(dir.join(format!("{node}.log"))).unwrap();
    let work = dir.join(node);
    let child = Command::new(env!("CARGO_BIN_EXE_motley-agent"))
        .args(["--coordinator", url, "--node", node, "--token", "s3cret", "--inventory"])
        .arg(inventory)
        .args(["--probe-duty", "0.5", "--probe-target-ms", "5", "--sysfs-root"])
        .arg(sysfs)
        .arg("--work-dir")
        .arg(&work)
        .arg("--shm-dir")
        .arg(work.with_extension("shm"))
        .env("MOTLEY_CONFIG", &config)
        .env("RUST_LOG", "info,motley_agent::net=debug")
        .env_remove("MOTLEY_WORK_DIR")
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .unwrap();
    AgentProc(child)
}

fn write_counters(sysfs: &Path, tx: u64, rx: u64) {
    let stats = sysfs.join("class/net/eth9/statistics");
    std::fs::create_dir_all(&stats).unwrap();
    std::fs::write(stats.join("tx_bytes"), format!("{tx}\n")).unwrap();
    std::fs::write(stats.join("rx_bytes"), format!("{rx}\n")).unwrap();
}

#[test]
fn heartbeats_carry_nic_rates_and_the_launchs_peer_links_while_it_runs() {
    let dir = scratch("net-heartbeat");
    let rt = tokio::runtime::Runtime::new().unwrap();
    let fake = Fake::default();
    let listener = rt.block_on(tokio::net::TcpListener::bind("127.0.0.1:0")).unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    rt.spawn(
        tonic::transport::Server::builder()
            .add_service(AgentServer::new(fake.clone()))
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    let (sys0, sys1) = (dir.join("sys0"), dir.join("sys1"));
    write_counters(&sys0, 0, 0);
    std::fs::create_dir_all(&sys1).unwrap();
    let _n0 = agent(&url, "n0", &dir, &sys0);
    let _n1 = agent(&url, "n1", &dir, &sys1);
    let n1_data = fake.until("n1 to register", |s| s.registrations.get("n1").map(|r| r.data_url.clone()));

    // The NIC's counters grow; its rates come with n0's heartbeats.
    let grow = {
        let sys0 = sys0.clone();
        std::thread::spawn(move || {
            for i in 1..=100u64 {
                write_counters(&sys0, i * 1_000_000, i * 500_000);
                std::thread::sleep(Duration::from_millis(20));
            }
        })
    };
    let nic = fake.until("eth9's rate", |s| s.nics.iter().find(|(n, r)| n == "n0" && r.name == "eth9" && r.tx_gb_per_s > 0.0).cloned());
    assert_eq!(nic.1.kind, "eth");
    assert!(nic.1.rx_gb_per_s > 0.0 && nic.1.at_unix_ms > 0, "{nic:?}");
    grow.join().unwrap();
    assert!(fake.0.lock().unwrap().links.is_empty(), "no launch yet, yet links were probed");

    // A launch on n0 whose plan also holds n1: n0 probes n1 while the launch's rank runs.
    let peers = vec![
        PeerDataPlane { node: "n0".into(), data_url: "127.0.0.1:1".into() },
        PeerDataPlane { node: "n1".into(), data_url: n1_data.clone() },
    ];
    fake.send(
        "n0",
        instruction::Kind::Launch(Launch {
            job: 1,
            generation: 1,
            run: "sleep 60".into(),
            plan_json: r#"{"global_batch": 1, "micro_batch": 1, "seq_len": 8, "model": "m", "replicas": []}"#.into(),
            master_addr: "127.0.0.1".into(),
            master_port: free_port() as u32,
            world_size: 1,
            ranks: vec![RankLaunch { rank: 0, local_rank: 0, local_world_size: 1, layer_end: 4, ..Default::default() }],
            peers,
            ..Default::default()
        }),
    );
    let link = fake.until("a sample of n0's link to n1", |s| s.links.first().cloned());
    assert_eq!((link.0.as_str(), link.1.peer.as_str(), link.1.nic_kind.as_str()), ("n0", "n1", "eth"));
    assert!(link.1.gb_per_s > 0.0 && link.1.latency_ms > 0.0, "{link:?}");
    fake.until("several samples", |s| (s.links.len() >= 3).then_some(()));
    assert!(fake.0.lock().unwrap().links.iter().all(|(n, l)| n == "n0" && l.peer == "n1"));

    // Stopped: no more probes (one already under way may still report).
    fake.send("n0", instruction::Kind::Stop(Stop { job: 1, generation: 1, reason: "test".into() }));
    std::thread::sleep(Duration::from_millis(500));
    let after_stop = fake.0.lock().unwrap().links.len();
    std::thread::sleep(Duration::from_millis(1500));
    assert_eq!(fake.0.lock().unwrap().links.len(), after_stop, "n0 still probes a stopped launch's peer");
    let _ = std::fs::remove_dir_all(&dir);
}
