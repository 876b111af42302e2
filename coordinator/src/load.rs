//! Node load as agents report it on every heartbeat: GPU utilisation and memory, free disk in
//! the agent's work directory, load average, available memory, running ranks. It lives in the
//! coordinator's memory only (a restart rebuilds it within one base interval; see
//! docs/state.md) and is shown by the node APIs, `motley node list` and `/metrics`.

use serde::Serialize;

#[derive(Clone, Debug, Default, PartialEq, Serialize, utoipa::ToSchema)]
pub struct NodeLoad {
    /// One entry per GPU NVML sees on the node (none without a driver).
    pub gpus: Vec<GpuLoad>,
    /// Free bytes on the file system of the agent's work directory.
    pub work_dir_free_bytes: u64,
    /// The node's 1-minute load average.
    pub load_1m: f64,
    /// Memory available to new processes, bytes.
    pub mem_available_bytes: u64,
    /// Ranks of the node's agent running now.
    pub ranks_running: u32,
    /// How old this report is, ms.
    pub age_ms: u64,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, utoipa::ToSchema)]
pub struct GpuLoad {
    /// NVML's index (PCI order), as in plans and CUDA_VISIBLE_DEVICES.
    pub index: u32,
    pub utilization_percent: u32,
    pub memory_used_bytes: u64,
    pub memory_total_bytes: u64,
    pub temperature_c: Option<u32>,
}

impl From<motley_proto::v1::NodeLoad> for NodeLoad {
    fn from(l: motley_proto::v1::NodeLoad) -> NodeLoad {
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
}

impl From<NodeLoad> for motley_proto::v1::NodeLoad {
    fn from(l: NodeLoad) -> motley_proto::v1::NodeLoad {
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
}
