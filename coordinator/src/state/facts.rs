//! What agents told the leader about their nodes, their restores and their rejoined ranks, as
//! plain facts the job step (`life`) reads: each node's data plane and checkpoint rates (told at
//! registration), the result of each restore it was asked for, and what each rank of a joining
//! replica copied from its peers (docs/keep-going.md). In memory only: an agent tells its data
//! plane again when it registers with a new leader, its session's first message lists every
//! rank with what it copied, and a recovery in flight starts over there
//! (docs/recovery.md, docs/state.md). The agents' sessions (`service::agent`) write here and
//! know nothing of what reads it.

use std::collections::HashMap;
use std::sync::Mutex;

use motley_proto::v1::{RankRejoined, RestoreResult};

/// A live node as its agent told it: where its data plane listens and its rates (the restore
/// planner's view of a node).
#[derive(Debug, Clone, PartialEq)]
pub struct NodeInfo {
    pub data_url: String,
    /// The node's RDMA domain when its agent reported an RDMA device (peers in the same domain
    /// fetch from it over RDMA).
    pub rdma_domain: Option<String>,
    pub disk_read_mb_s: f64,
    pub nic_mb_s: f64,
    pub mem_copy_mb_s: f64,
}

#[derive(Default)]
pub struct Facts {
    nodes: Mutex<HashMap<String, NodeInfo>>,
    restores: Mutex<HashMap<(i64, i64, String), RestoreResult>>,
    /// By (job, generation, rank).
    rejoins: Mutex<HashMap<(i64, i64, i64), RankRejoined>>,
    changed: tokio::sync::Notify,
}

impl Facts {
    /// A registration told the node's data plane and rates.
    pub fn set_node(&self, node: &str, info: NodeInfo) {
        self.nodes.lock().expect("nodes").insert(node.to_string(), info);
    }

    /// The node's data plane and rates, as its agent last told them.
    pub fn node(&self, node: &str) -> Option<NodeInfo> {
        self.nodes.lock().expect("nodes").get(node).cloned()
    }

    /// An agent reported how a restore ended.
    pub fn restored(&self, node: &str, r: RestoreResult) {
        self.restores.lock().expect("restores").insert((r.job, r.generation, node.to_string()), r);
        self.changed.notify_waiters();
    }

    /// The node's result of restore (job, generation), if it reported one.
    pub fn restore(&self, job: i64, generation: i64, node: &str) -> Option<RestoreResult> {
        self.restores.lock().expect("restores").get(&(job, generation, node.to_string())).cloned()
    }

    /// Forget the job's restore results (a new attempt asks again).
    pub fn forget_restores(&self, job: i64) {
        self.restores.lock().expect("restores").retain(|(j, _, _), _| *j != job);
    }

    /// An agent reported that a rank of a joining replica took its state from its peers.
    pub fn rejoined(&self, job: i64, generation: i64, rank: i64, r: RankRejoined) {
        self.rejoins.lock().expect("rejoins").insert((job, generation, rank), r);
    }

    /// What rank `rank` of launch (job, generation) copied when it last rejoined, if told.
    pub fn rejoin(&self, job: i64, generation: i64, rank: i64) -> Option<RankRejoined> {
        self.rejoins.lock().expect("rejoins").get(&(job, generation, rank)).copied()
    }

    /// Forget the launch's rejoined ranks (it ended, or runs whole again).
    pub fn forget_rejoins(&self, job: i64, generation: i64) {
        self.rejoins.lock().expect("rejoins").retain(|&(j, g, _), _| (j, g) != (job, generation));
    }

    /// Resolves at the next restore result or `nudge` (register interest before looking).
    pub fn changed(&self) -> tokio::sync::futures::Notified<'_> {
        self.changed.notified()
    }

    /// Wake whoever waits on `changed` (a node left: a restore waiting on it looks again).
    pub fn nudge(&self) {
        self.changed.notify_waiters();
    }
}
