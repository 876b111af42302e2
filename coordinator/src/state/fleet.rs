//! The fleet: the live agents, in memory only (rebuilt from heartbeats after a restart, see
//! docs/state.md). Each lease holds the agent's session (node, epoch), when it was last heard
//! from, its last load, and an outbox of instructions its heartbeat stream carries down. Plain
//! Rust types: the gRPC adapter (`service::agent`) turns the outbox into a stream; nothing here
//! touches the database, and nothing here knows jobs' recoveries, notices or profiles (what
//! those need from a session arrives as facts, `facts`). The bottom of the coordinator's rooms:
//! it calls none of them but the link matrix it carries (`links`), which calls nothing.
//!
//! Leases are judged by this process's own continuity: `expire` gives every agent a fresh lease
//! when it finds that it was not running for more than `PAUSE_INTERVALS` base intervals (a
//! paused or frozen coordinator cannot have seen heartbeats, so their absence proves nothing).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use motley_proto::v1::{instruction, Drain, Instruction, Stop};
use tokio::sync::mpsc;
use tokio::time::Instant;

use crate::error::CoordinatorError;
use crate::state::load::NodeLoad;

/// A lease expires after this many base intervals without a heartbeat.
pub const LEASE_INTERVALS: u32 = 3;

/// A gap of more than this many base intervals between two looks at the leases means this
/// process was not running (paused, frozen, starved): every lease starts afresh.
pub const PAUSE_INTERVALS: u32 = 2;

/// What goes down an agent's heartbeat stream.
#[derive(Debug)]
pub enum Outbound {
    Instruction(Instruction),
    /// End the stream with this error (the agent reconnects or gives up, as the error says).
    Refuse(CoordinatorError),
}

struct Lease {
    epoch: i64,
    address: String,
    /// The agent's log service (empty: it serves none).
    logs_url: String,
    last_seen: Instant,
    /// The open heartbeat stream's outbox (None until the stream opens, and after it closes).
    outbox: Option<mpsc::UnboundedSender<Outbound>>,
    /// The load of its last interval heartbeat, and when it came.
    load: Option<(NodeLoad, Instant)>,
    /// Its agent can measure layer profiles (it registered `can_profile`).
    can_profile: bool,
    /// Its agent's checkpoint data plane (HOST:PORT or tls://HOST:PORT; empty: none), which
    /// its peers in a launch probe the link through (`Launch.peers`).
    data_url: String,
}

impl Lease {
    fn open(&self) -> bool {
        self.outbox.as_ref().is_some_and(|o| !o.is_closed())
    }
}

/// Why a heartbeat was not taken (the stream ends with it).
#[derive(Debug, PartialEq)]
pub enum Refused {
    /// The node's agent registered again since (this session is over).
    Stale { current: i64 },
    /// No lease: it expired, or this coordinator restarted.
    NoLease,
}

/// The live agents.
pub struct Fleet {
    /// The base interval: agents heartbeat on it; every timeout derives from it.
    pub base: Duration,
    /// The first MASTER_PORT (see `launch::master_port`).
    pub master_port_base: u16,
    leases: Mutex<HashMap<String, Lease>>,
    /// When `expire` last looked (the continuity of this process).
    last_look: Mutex<Option<Instant>>,
    /// When this fleet (this leader's) began: a node with no lease here lapses from then.
    started: Instant,
    /// When `expire` last found this process had not been running (monotonic, and wall ms).
    last_pause: Mutex<Option<(Instant, i64)>>,
    heartbeats: AtomicU64,
    launches: AtomicU64,
    /// How long planning one job may take.
    pub plan_deadline: Duration,
    /// The live link matrix agents measure (`links`): rebuilt from heartbeats, like leases.
    pub links: crate::state::links::Links,
}

impl Fleet {
    pub fn new(base: Duration, master_port_base: u16, plan_deadline: Duration) -> Arc<Fleet> {
        Arc::new(Fleet {
            plan_deadline,
            base,
            master_port_base,
            leases: Mutex::new(HashMap::new()),
            last_look: Mutex::new(None),
            last_pause: Mutex::new(None),
            heartbeats: AtomicU64::new(0),
            launches: AtomicU64::new(0),
            links: crate::state::links::Links::new(base),
            started: Instant::now(),
        })
    }

    fn leases(&self) -> std::sync::MutexGuard<'_, HashMap<String, Lease>> {
        self.leases.lock().expect("lease lock")
    }

    fn lease_length(&self) -> Duration {
        self.base * LEASE_INTERVALS
    }

    /// Whether another agent holds the node now: its lease is current and its stream open. A
    /// registration for such a node is refused (two agents started with one `--node` would
    /// otherwise evict each other forever). A killed agent's stream closes with its process,
    /// so its restart is never refused.
    pub fn held_by_live_agent(&self, node: &str) -> Option<String> {
        let leases = self.leases();
        let l = leases.get(node)?;
        (l.open() && l.last_seen.elapsed() <= self.lease_length()).then(|| l.address.clone())
    }

    /// A registration: the node's new session, not yet heartbeating. It replaces (and closes)
    /// any earlier session of the node.
    pub fn register(&self, node: &str, epoch: i64, address: String, logs_url: String) {
        let old = self.leases().insert(
            node.to_string(),
            Lease {
                epoch,
                address,
                logs_url,
                last_seen: Instant::now(),
                outbox: None,
                load: None,
                can_profile: false,
                data_url: String::new(),
            },
        );
        if let Some(outbox) = old.and_then(|l| l.outbox) {
            let _ = outbox.send(Outbound::Refuse(CoordinatorError::StaleAgent { node: node.to_string(), given: 0, current: epoch }));
        }
    }

    /// A heartbeat of session (node, epoch) arrived: renew its lease (on receipt, before any
    /// database work) and attach the stream's outbox. `interval`: an interval heartbeat (it
    /// carries the load), not a rank report sent between them.
    pub fn renew(
        &self,
        node: &str,
        epoch: i64,
        outbox: &mpsc::UnboundedSender<Outbound>,
        load: Option<NodeLoad>,
        interval: bool,
    ) -> Result<(), Refused> {
        let mut leases = self.leases();
        let lease = leases.get_mut(node).ok_or(Refused::NoLease)?;
        if lease.epoch != epoch {
            return Err(Refused::Stale { current: lease.epoch });
        }
        lease.last_seen = Instant::now();
        if interval {
            self.heartbeats.fetch_add(1, Ordering::Relaxed);
        }
        if !lease.outbox.as_ref().is_some_and(|o| o.same_channel(outbox)) {
            lease.outbox = Some(outbox.clone());
        }
        if let Some(load) = load {
            lease.load = Some((load, lease.last_seen));
        }
        Ok(())
    }

    /// Whether the node's current session can measure layer profiles (told at registration).
    pub fn set_can_profile(&self, node: &str, epoch: i64, can: bool) {
        if let Some(l) = self.leases().get_mut(node).filter(|l| l.epoch == epoch) {
            l.can_profile = can;
        }
    }

    /// The data plane the node's current session registered (empty: it serves none).
    pub fn set_data_url(&self, node: &str, epoch: i64, url: &str) {
        if let Some(l) = self.leases().get_mut(node).filter(|l| l.epoch == epoch) {
            l.data_url = url.to_string();
        }
    }

    /// Where the node's agent serves its data plane, if it is in the fleet and serves one.
    pub fn data_url(&self, node: &str) -> Option<String> {
        self.leases().get(node).map(|l| l.data_url.clone()).filter(|u| !u.is_empty())
    }

    /// The node's agent is live, its stream open, and it can measure layer profiles.
    pub fn can_profile(&self, node: &str) -> bool {
        self.leases().get(node).is_some_and(|l| l.can_profile && l.open() && l.last_seen.elapsed() <= self.lease_length())
    }

    /// The session's stream ended: the node cannot take instructions until it opens another.
    pub fn closed(&self, node: &str, epoch: i64) {
        if let Some(l) = self.leases().get_mut(node).filter(|l| l.epoch == epoch) {
            l.outbox = None;
        }
    }

    /// Every base interval: the nodes whose lease just expired (removed from the fleet). If
    /// this process was not running for more than `PAUSE_INTERVALS` since the last look, no
    /// lease expires and every agent gets a fresh one instead.
    pub fn expire(&self) -> Vec<String> {
        let now = Instant::now();
        let gap = self.last_look.lock().expect("look lock").replace(now).map(|t| now - t);
        let mut leases = self.leases();
        if let Some(gap) = gap.filter(|g| *g > self.base * PAUSE_INTERVALS) {
            tracing::warn!(
                gap_ms = gap.as_millis() as u64,
                "this coordinator was not running for {} ms: every agent gets a fresh lease",
                gap.as_millis()
            );
            for l in leases.values_mut() {
                l.last_seen = now;
            }
            let wall_ms = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as i64);
            *self.last_pause.lock().expect("pause lock") = Some((now, wall_ms));
            return vec![];
        }
        let dead: Vec<String> = leases.iter().filter(|(_, l)| now - l.last_seen > self.lease_length()).map(|(n, _)| n.clone()).collect();
        for n in &dead {
            leases.remove(n);
        }
        dead
    }

    /// When this process last found it had been paused (wall ms), if that was within `within`:
    /// agents are finding their way back, so their absence is no reason to fail a job yet.
    pub fn paused_within(&self, within: Duration) -> Option<i64> {
        self.last_pause.lock().expect("pause lock").filter(|(at, _)| at.elapsed() < within).map(|(_, ms)| ms)
    }

    /// Agents holding a lease now.
    pub fn live_count(&self) -> usize {
        self.leases().values().filter(|l| l.open() && l.last_seen.elapsed() <= self.lease_length()).count()
    }

    /// Heartbeats received since start.
    pub fn heartbeat_count(&self) -> u64 {
        self.heartbeats.load(Ordering::Relaxed)
    }

    /// Launch instructions sent since start.
    pub fn launch_count(&self) -> u64 {
        self.launches.load(Ordering::Relaxed)
    }

    /// The node's agent holds a lease and its heartbeat stream is open (it can take a launch).
    pub fn live(&self, node: &str) -> bool {
        self.leases().get(node).is_some_and(|l| l.open() && l.last_seen.elapsed() <= self.lease_length())
    }

    /// Whether the node's lease has lapsed: nothing heard from its agent for a lease's length
    /// (a stream that just closed, an agent restarting, is not that yet). A node this leader
    /// has never heard from lapses a lease's length after it started leading (its agents
    /// register again within a heartbeat or two of a failover).
    pub fn lapsed(&self, node: &str) -> bool {
        match self.leases().get(node) {
            Some(l) => l.last_seen.elapsed() > self.lease_length(),
            None => self.started.elapsed() > self.lease_length() * 2,
        }
    }

    /// The load the node's agent last reported, if it is live.
    pub fn load(&self, node: &str) -> Option<NodeLoad> {
        let leases = self.leases();
        let lease = leases.get(node).filter(|l| l.open() && l.last_seen.elapsed() <= self.lease_length())?;
        lease.load.as_ref().map(|(l, at)| NodeLoad { age_ms: at.elapsed().as_millis() as u64, ..l.clone() })
    }

    /// Every live node's last load, by node name.
    pub fn loads(&self) -> Vec<(String, NodeLoad)> {
        let names: Vec<String> = self.leases().keys().cloned().collect();
        let mut out: Vec<(String, NodeLoad)> = names.into_iter().filter_map(|n| self.load(&n).map(|l| (n, l))).collect();
        out.sort_by(|a, b| a.0.cmp(&b.0));
        out
    }

    /// Tell the node's agent whether it is draining (if its stream is open; it is told again
    /// when it next opens one).
    pub fn tell_drain(&self, node: &str, draining: bool) {
        self.send(node, Instruction { kind: Some(instruction::Kind::Drain(Drain { draining })) });
    }

    /// Tell the node's agent to stop the job's ranks of generations up to `generation`.
    pub fn tell_stop(&self, node: &str, job: i64, generation: i64, reason: &str) {
        self.send(node, Instruction { kind: Some(instruction::Kind::Stop(Stop { job, generation, reason: reason.to_string() })) });
    }

    /// Put a launch in the node's outbox; false if the node has no open stream.
    pub fn send_launch(&self, node: &str, launch: motley_proto::v1::Launch) -> bool {
        self.launches.fetch_add(1, Ordering::Relaxed);
        self.send(node, Instruction { kind: Some(instruction::Kind::Launch(launch)) })
    }

    /// Queue an instruction for the node's open stream (the outbox is unbounded: a busy stream
    /// delays an instruction, it never drops it); false if there is none.
    pub fn send(&self, node: &str, i: Instruction) -> bool {
        let outbox = self.leases().get(node).and_then(|l| l.outbox.clone());
        outbox.is_some_and(|o| o.send(Outbound::Instruction(i)).is_ok())
    }

    /// Where the node's agent serves rank logs, if it is live and serves them.
    pub fn logs_url(&self, node: &str) -> Option<String> {
        self.leases().get(node).map(|l| l.logs_url.clone()).filter(|u| !u.is_empty())
    }

    /// The address the node's agent registered with (MASTER_ADDR when rank 0 runs there).
    pub fn address(&self, node: &str) -> Option<String> {
        self.leases().get(node).map(|l| l.address.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fleet_with(node: &str) -> (Arc<Fleet>, mpsc::UnboundedSender<Outbound>, mpsc::UnboundedReceiver<Outbound>) {
        let fleet = Fleet::new(Duration::from_secs(1), 29500, Duration::from_secs(60));
        fleet.register(node, 1, "127.0.0.1".into(), String::new());
        let (tx, rx) = mpsc::unbounded_channel();
        fleet.renew(node, 1, &tx, None, true).unwrap();
        (fleet, tx, rx)
    }

    #[tokio::test(start_paused = true)]
    async fn a_lease_expires_after_three_silent_intervals() {
        let (fleet, _tx, _rx) = fleet_with("a");
        for _ in 0..3 {
            tokio::time::advance(Duration::from_secs(1)).await;
            assert!(fleet.expire().is_empty(), "within the lease");
            assert!(fleet.live("a"));
        }
        tokio::time::advance(Duration::from_millis(1001)).await;
        assert_eq!(fleet.expire(), vec!["a".to_string()]);
        assert!(!fleet.live("a"));
    }

    #[tokio::test(start_paused = true)]
    async fn a_pause_of_the_coordinator_gives_fresh_leases_instead_of_expiring_them() {
        let (fleet, _tx, _rx) = fleet_with("a");
        assert!(fleet.expire().is_empty());
        // The process is stopped for 4 s: nothing looked at the leases and no heartbeat was read.
        tokio::time::advance(Duration::from_secs(4)).await;
        assert!(fleet.expire().is_empty(), "a gap in this process's own continuity proves nothing about the agents");
        assert!(fleet.live("a"), "the agent got a fresh lease");
        // From there on, silence counts again.
        for _ in 0..3 {
            tokio::time::advance(Duration::from_secs(1)).await;
            assert!(fleet.expire().is_empty());
        }
        tokio::time::advance(Duration::from_millis(1001)).await;
        assert_eq!(fleet.expire(), vec!["a".to_string()]);
    }

    #[tokio::test(start_paused = true)]
    async fn a_live_agent_holds_its_node_until_its_stream_closes_or_its_lease_ends() {
        let (fleet, tx, rx) = fleet_with("a");
        assert_eq!(fleet.held_by_live_agent("a").as_deref(), Some("127.0.0.1"));
        drop(rx); // the stream went away (the agent was killed)
        assert!(fleet.held_by_live_agent("a").is_none() && !fleet.live("a"));
        let (fleet, _tx2, _rx2) = fleet_with("b");
        tokio::time::advance(Duration::from_millis(3001)).await;
        assert!(fleet.held_by_live_agent("b").is_none(), "a silent agent's lease is over");
        drop(tx);
    }

    #[tokio::test(start_paused = true)]
    async fn a_busy_stream_delays_instructions_but_never_drops_them() {
        let (fleet, _tx, mut rx) = fleet_with("a");
        for g in 0..1000 {
            assert!(fleet.send_launch("a", motley_proto::v1::Launch { job: 1, generation: g, ..Default::default() }));
        }
        assert!(fleet.live("a"), "a full outbox is not a dead agent");
        let mut n = 0;
        while let Ok(Outbound::Instruction(_)) = rx.try_recv() {
            n += 1;
        }
        assert_eq!(n, 1000);
    }

    #[tokio::test(start_paused = true)]
    async fn heartbeats_of_another_session_are_refused() {
        let (fleet, tx, mut rx) = fleet_with("a");
        fleet.register("a", 2, "127.0.0.1".into(), String::new());
        assert!(matches!(rx.try_recv(), Ok(Outbound::Refuse(_))), "the old session's stream is ended");
        assert_eq!(fleet.renew("a", 1, &tx, None, true), Err(Refused::Stale { current: 2 }));
        assert_eq!(fleet.renew("z", 1, &tx, None, true), Err(Refused::NoLease));
    }
}
