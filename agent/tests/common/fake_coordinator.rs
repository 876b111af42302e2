//! A coordinator for one real agent, served on a runtime of its own: it registers the agent
//! (50 ms heartbeats), acknowledges every report, records the ranks' states and sends the
//! instructions a test gives it. Used by the tests that start agents (`common::fake_coordinator`).

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use motley_proto::v1::agent_server::{Agent, AgentServer};
use motley_proto::v1::{instruction, Ack, AgentStatus, Instruction, RankStatus, RegisterReply, RegisterRequest};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

#[derive(Default)]
pub struct Seen {
    pub registrations: Vec<RegisterRequest>,
    pub statuses: Vec<RankStatus>,
    down: Option<mpsc::Sender<Result<Instruction, Status>>>,
}

#[derive(Clone, Default)]
struct Service(Arc<Mutex<Seen>>);

#[tonic::async_trait]
impl Agent for Service {
    async fn register(&self, req: Request<RegisterRequest>) -> Result<Response<RegisterReply>, Status> {
        let mut s = self.0.lock().unwrap();
        s.registrations.push(req.into_inner());
        Ok(Response::new(RegisterReply { epoch: s.registrations.len() as i64, heartbeat_ms: 50, ..Default::default() }))
    }

    type HeartbeatStream = ReceiverStream<Result<Instruction, Status>>;

    async fn heartbeat(&self, req: Request<Streaming<AgentStatus>>) -> Result<Response<Self::HeartbeatStream>, Status> {
        let (tx, rx) = mpsc::channel(64);
        self.0.lock().unwrap().down = Some(tx.clone());
        let (me, mut up) = (self.clone(), req.into_inner());
        tokio::spawn(async move {
            while let Ok(Some(status)) = up.message().await {
                me.0.lock().unwrap().statuses.extend(status.ranks);
                let _ = tx.send(Ok(Instruction { kind: Some(instruction::Kind::Ack(Ack { seq: status.seq })) })).await;
            }
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}

/// The fake and its runtime (dropped with it).
pub struct FakeCoordinator {
    _rt: tokio::runtime::Runtime,
    seen: Arc<Mutex<Seen>>,
    pub url: String,
}

impl FakeCoordinator {
    pub fn start() -> FakeCoordinator {
        let rt = tokio::runtime::Runtime::new().unwrap();
        let service = Service::default();
        let listener = rt.block_on(tokio::net::TcpListener::bind("127.0.0.1:0")).unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        rt.spawn(
            tonic::transport::Server::builder()
                .add_service(AgentServer::new(service.clone()))
                .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
        );
        FakeCoordinator { _rt: rt, seen: service.0, url }
    }

    /// Waits for `f` to give a value, bounded only so that a broken agent fails the test
    /// instead of hanging it.
    pub fn until<T>(&self, what: &str, f: impl Fn(&Seen) -> Option<T>) -> T {
        let start = Instant::now();
        loop {
            if let Some(t) = f(&self.seen.lock().unwrap()) {
                return t;
            }
            assert!(
                start.elapsed() < Duration::from_secs(60),
                "timed out waiting for {what}; statuses {:?}",
                self.seen.lock().unwrap().statuses
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Sends `kind` down the agent's open heartbeat stream.
    pub fn send(&self, kind: instruction::Kind) {
        let tx = self.until("an open heartbeat stream", |s| s.down.clone().filter(|d| !d.is_closed()));
        tx.try_send(Ok(Instruction { kind: Some(kind) })).unwrap();
    }

    /// The exit code of rank `rank` of job `job` (any generation), once it exited.
    pub fn exited(&self, job: i64, rank: i64) -> Option<i64> {
        self.until(&format!("job {job} rank {rank} to exit"), |s| {
            s.statuses.iter().rev().find(|r| r.job == job && r.rank == rank && r.state == "exited").map(|r| r.exit_code)
        })
    }
}
