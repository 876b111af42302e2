//! The links this node's jobs use, measured (docs/network.md, "Measure (agents)"): the NICs'
//! achieved rates from their byte counters (`counters`, passive), and short paced probes over
//! the data plane to the peers the running launches name (`probe`, active). The heartbeat
//! sends both (`AgentStatus.nics`, `links`); the coordinator keeps the live link matrix.
//!
//! `Meter` is what the rest of the agent sees: the launches' peers (from each `Launch`, for as
//! long as its ranks run), the samples not yet sent (at most `MAX_PENDING_LINKS`, the newest
//! kept: a lost sample is a lost measurement, never retried), and the counters.

pub mod counters;
pub mod local;
pub mod probe;

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use motley_proto::v1::{LinkSample, NicRate, PeerDataPlane};
use tokio::sync::Notify;

pub use counters::Counters;
pub use probe::{check_duty, Pacing, MIN_PROBE_BYTES};

/// Samples kept for the next heartbeat at most; older ones are dropped first.
pub const MAX_PENDING_LINKS: usize = 256;
/// Peers one launch may name that are kept (a plan's nodes; more are ignored).
pub const MAX_PEERS_PER_LAUNCH: usize = 1024;
/// The longest data-plane address kept (`HOST:PORT` or `tls://HOST:PORT`).
const MAX_URL: usize = 512;

/// A peer to probe: its node and its data plane as it registered it.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct PeerPlane {
    pub node: String,
    pub data_url: String,
}

/// The node's link measurements between heartbeats.
#[derive(Debug)]
pub struct Meter {
    node: String,
    sysfs: PathBuf,
    counters: Mutex<Counters>,
    links: Mutex<VecDeque<LinkSample>>,
    /// The peers of each launch (job, generation) with ranks here.
    launches: Mutex<BTreeMap<(i64, i64), Vec<PeerPlane>>>,
    changed: Notify,
}

impl Meter {
    /// The meter of node `node`, its NICs under the sysfs root `sysfs`.
    pub fn new(node: &str, sysfs: &Path) -> Meter {
        Meter {
            node: node.to_string(),
            sysfs: sysfs.to_path_buf(),
            counters: Mutex::new(Counters::new(sysfs)),
            links: Mutex::default(),
            launches: Mutex::default(),
            changed: Notify::new(),
        }
    }

    /// A launch arrived: its peers (`Launch.peers`, this node and entries without a data plane
    /// left out) are probed while its ranks run.
    pub fn launched(&self, job: i64, generation: i64, peers: &[PeerDataPlane]) {
        let mut list: Vec<PeerPlane> = peers
            .iter()
            .filter(|p| p.node != self.node && !p.node.is_empty() && !p.data_url.is_empty() && p.data_url.len() <= MAX_URL)
            .take(MAX_PEERS_PER_LAUNCH)
            .map(|p| PeerPlane { node: p.node.clone(), data_url: p.data_url.clone() })
            .collect();
        list.sort();
        list.dedup_by(|a, b| a.node == b.node);
        self.lock_launches().insert((job, generation), list);
        self.changed.notify_one();
    }

    /// A launch stopped: its peers are no longer probed for it.
    pub fn stopped(&self, job: i64, generation: i64) {
        self.lock_launches().remove(&(job, generation));
    }

    /// Forgets the launches not in `running` (those with a rank running here).
    pub fn retain_running(&self, running: &BTreeSet<(i64, i64)>) {
        self.lock_launches().retain(|k, _| running.contains(k));
    }

    /// The peers to probe: every node a remembered launch names, once (the newest data plane
    /// a launch gave for it), by node name.
    pub fn peers(&self) -> Vec<PeerPlane> {
        let mut by_node: BTreeMap<String, String> = BTreeMap::new();
        for peers in self.lock_launches().values() {
            for p in peers {
                by_node.insert(p.node.clone(), p.data_url.clone());
            }
        }
        by_node.into_iter().map(|(node, data_url)| PeerPlane { node, data_url }).collect()
    }

    /// Resolves when a launch's peers arrive.
    pub async fn peers_changed(&self) {
        self.changed.notified().await
    }

    /// Keeps a probe's sample for the next heartbeat.
    pub fn push_link(&self, sample: LinkSample) {
        let mut links = self.links.lock().unwrap_or_else(|e| e.into_inner());
        if links.len() >= MAX_PENDING_LINKS {
            links.pop_front();
        }
        links.push_back(sample);
    }

    /// The samples taken since the last call (each is sent once).
    pub fn take_links(&self) -> Vec<LinkSample> {
        self.links.lock().unwrap_or_else(|e| e.into_inner()).drain(..).collect()
    }

    /// The NICs' rates since the last call (reads sysfs: call it off the async workers).
    pub fn nic_rates(&self) -> Vec<NicRate> {
        let mut counters = self.counters.lock().unwrap_or_else(|e| e.into_inner());
        counters.sample(std::time::Instant::now(), now_unix_ms())
    }

    fn lock_launches(&self) -> std::sync::MutexGuard<'_, BTreeMap<(i64, i64), Vec<PeerPlane>>> {
        self.launches.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Milliseconds since the Unix epoch now (0 if the clock is before it).
pub fn now_unix_ms() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as i64)
}
