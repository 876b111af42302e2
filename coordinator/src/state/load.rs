//! Node load as agents report it on every heartbeat: GPU utilisation and memory, free disk in
//! the agent's work directory, load average, available memory, running ranks. It lives in the
//! coordinator's memory only (a restart rebuilds it within one base interval; see
//! docs/state.md) and is shown by the node APIs, `motley node list` and `/metrics`.

pub use motley_contract::views::{GpuLoad, NodeLoad};

/// An agent's report as the API shows it (utilisation capped at 100, a load average that is
/// not a number shown as 0).
pub fn from_proto(l: motley_proto::v1::NodeLoad) -> NodeLoad {
    NodeLoad {
        gpus: l
            .gpus
            .into_iter()
            .map(|g| GpuLoad {
                index: g.index,
                utilization_percent: g.utilization_percent.min(100),
                memory_used_bytes: g.memory_used_bytes,
                memory_total_bytes: g.memory_total_bytes,
                temperature_c: g.temperature_c,
            })
            .collect(),
        work_dir_free_bytes: l.work_dir_free_bytes,
        load_1m: if l.load_1m.is_finite() { l.load_1m.max(0.0) } else { 0.0 },
        mem_available_bytes: l.mem_available_bytes,
        ranks_running: l.ranks_running,
        age_ms: 0,
    }
}

/// The load as the agent protocol carries it.
pub fn to_proto(l: NodeLoad) -> motley_proto::v1::NodeLoad {
    motley_proto::v1::NodeLoad {
        gpus: l
            .gpus
            .into_iter()
            .map(|g| motley_proto::v1::GpuLoad {
                index: g.index,
                utilization_percent: g.utilization_percent,
                memory_used_bytes: g.memory_used_bytes,
                memory_total_bytes: g.memory_total_bytes,
                temperature_c: g.temperature_c,
            })
            .collect(),
        work_dir_free_bytes: l.work_dir_free_bytes,
        load_1m: l.load_1m,
        mem_available_bytes: l.mem_available_bytes,
        ranks_running: l.ranks_running,
    }
}
