//! Motley's per-node agent as a library: hardware discovery (`discover`, `nvml`), the agent's
//! configuration file (`config`), rank supervision that survives an agent restart (`ranks`,
//! `rankfiles`, each rank in its own cgroup where it can: `cgroup`), the dead-man switch that stops ranks whose agent is gone (`lease`), the rank
//! logs served over HTTP or HTTPS (`logs`, `tls`), the node's load sent with every heartbeat (`load`), whom
//! ranks run as (`users`) layer profiling on request (`profiler`) the checkpoint files it holds (`holdings`) and moves between memory, disk and the cloud (`tiers`, `cloud`). The binary `motley-agent` wires them to the coordinator.

pub mod cgroup;
pub mod cloud;
pub mod dataplane;
pub mod discover;
pub mod error;
pub mod holdings;
pub mod lease;
pub mod load;
pub mod logs;
pub mod notice;
pub mod nvml;
pub mod profiler;
pub mod rankfiles;
pub mod ranks;
#[cfg(feature = "rdma")]
pub mod rdma;
pub mod restorer;
pub mod tiers;
pub mod tls;
pub mod users;

pub use error::{AgentError, Result};
