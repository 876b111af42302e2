//! `/metrics` in the Prometheus text format. Gauges are read at scrape time from what already
//! holds them (the fleet's leases, the store, the role), so nothing can drift; counters are
//! the fleet's own.

use std::sync::Arc;

use prometheus_client::encoding::text::encode;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use crate::job::JobState;
use crate::server::leader::Role;
use crate::state::fleet::Fleet;
use crate::store::Store;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StateLabel {
    state: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct NodeLabel {
    node: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct LinkLabel {
    a: String,
    b: String,
    nic_kind: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct GpuLabel {
    node: String,
    gpu: String,
}

/// The coordinator's metrics.
#[derive(Clone)]
pub struct Metrics {
    store: Store,
    fleet: Arc<Fleet>,
    role: Arc<Role>,
}

impl Metrics {
    pub fn new(store: Store, fleet: Arc<Fleet>, role: Arc<Role>) -> Metrics {
        Metrics { store, fleet, role }
    }

    /// The text exposition of every metric now.
    pub async fn render(&self) -> crate::Result<String> {
        let mut registry = Registry::with_prefix("motley");
        let leader = Gauge::<i64>::default();
        leader.set(i64::from(self.role.is_leader()));
        registry.register("leader", "1 if this coordinator leads", leader);
        let term = Gauge::<i64>::default();
        term.set(self.role.leader().term);
        registry.register("leader_term", "The leadership term last seen", term);
        let live = Gauge::<i64>::default();
        live.set(self.fleet.live_count() as i64);
        registry.register("agents_live", "Agents holding a lease", live);
        let beats = Counter::<u64>::default();
        beats.inc_by(self.fleet.heartbeat_count());
        registry.register("heartbeats", "Agent heartbeats received", beats);
        let launches = Counter::<u64>::default();
        launches.inc_by(self.fleet.launch_count());
        registry.register("launch_instructions", "Launch instructions sent to agents", launches);
        if self.role.is_leader() {
            let jobs = Family::<StateLabel, Gauge<i64>>::default();
            for s in JobState::ALL {
                let _ = jobs.get_or_create(&StateLabel { state: s.to_string() });
            }
            for (state, n) in self.store.job_counts().await? {
                jobs.get_or_create(&StateLabel { state }).set(n);
            }
            registry.register("jobs", "Jobs by state", jobs);
            let nodes = Gauge::<i64>::default();
            nodes.set(self.store.nodes().await?.len() as i64);
            registry.register("nodes", "Nodes in the inventory", nodes);
            self.register_loads(&mut registry);
            self.register_links(&mut registry);
        }
        let mut out = String::new();
        encode(&mut out, &registry).expect("writing to a String cannot fail");
        Ok(out)
    }

    /// The link matrix's estimates (docs/network.md), per measured link.
    fn register_links(&self, registry: &mut Registry) {
        let rate = Family::<LinkLabel, Gauge<f64, std::sync::atomic::AtomicU64>>::default();
        let latency = Family::<LinkLabel, Gauge<f64, std::sync::atomic::AtomicU64>>::default();
        for l in self.fleet.links.links(None) {
            let label = LinkLabel { a: l.key.a, b: l.key.b, nic_kind: l.key.nic_kind };
            rate.get_or_create(&label).set(l.gb_per_s);
            latency.get_or_create(&label).set(l.latency_ms);
        }
        registry.register("link_gb_per_s", "A link's measured GB/s (the best of its newest probes)", rate);
        registry.register("link_latency_ms", "A link's lowest round trip among its newest probes, ms", latency);
    }

    /// What live agents reported on their last heartbeat, per node and per GPU.
    fn register_loads(&self, registry: &mut Registry) {
        let util = Family::<GpuLabel, Gauge<i64>>::default();
        let mem_used = Family::<GpuLabel, Gauge<i64>>::default();
        let mem_total = Family::<GpuLabel, Gauge<i64>>::default();
        let disk = Family::<NodeLabel, Gauge<i64>>::default();
        let ranks = Family::<NodeLabel, Gauge<i64>>::default();
        let load = Family::<NodeLabel, Gauge<f64, std::sync::atomic::AtomicU64>>::default();
        let mem = Family::<NodeLabel, Gauge<i64>>::default();
        let bytes = |b: u64| i64::try_from(b).unwrap_or(i64::MAX);
        for (node, l) in self.fleet.loads() {
            let n = NodeLabel { node: node.clone() };
            disk.get_or_create(&n).set(bytes(l.work_dir_free_bytes));
            ranks.get_or_create(&n).set(i64::from(l.ranks_running));
            load.get_or_create(&n).set(l.load_1m);
            mem.get_or_create(&n).set(bytes(l.mem_available_bytes));
            for g in &l.gpus {
                let label = GpuLabel { node: node.clone(), gpu: g.index.to_string() };
                util.get_or_create(&label).set(i64::from(g.utilization_percent));
                mem_used.get_or_create(&label).set(bytes(g.memory_used_bytes));
                mem_total.get_or_create(&label).set(bytes(g.memory_total_bytes));
            }
        }
        registry.register("node_gpu_utilization_percent", "GPU utilisation on the node's last heartbeat", util);
        registry.register("node_gpu_memory_used_bytes", "GPU memory in use on the node's last heartbeat", mem_used);
        registry.register("node_gpu_memory_total_bytes", "GPU memory of each GPU", mem_total);
        registry.register("node_work_dir_free_bytes", "Free bytes in the agent's work directory", disk);
        registry.register("node_ranks_running", "Ranks the node's agent runs", ranks);
        registry.register("node_load1", "The node's 1-minute load average", load);
        registry.register("node_mem_available_bytes", "Memory available on the node", mem);
    }
}
