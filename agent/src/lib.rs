//! Motley's per-node agent as a library, in rooms whose names say what they may touch. Arrows
//! run down the table only: a room calls the rooms below it, never one above.
//!
//! | room | holds | may call |
//! |---|---|---|
//! | `logs` | the rank logs over HTTP or HTTPS (`logs::tls`) | `safe_fs`, `workdir`, `error` |
//! | `profiler` | layer profiling on request | `workdir`, `error` |
//! | `ranks` | the supervisor (launch, watch, report, stop, adopt), rank files, process groups, the wrapper and its dead-man switch (`lease`), cgroups, users, preemption notices | `checkpoints`, `safe_fs`, `workdir`, `error` |
//! | `net` | the links the node's jobs use, measured: NIC counters (`counters`), paced probes over the data plane to the launches' peers (`probe`) | `checkpoints`, `node`, `error` |
//! | `checkpoints` | checkpoint steps held (`holdings`), their tiers (`tiers`, `cloud`), the data plane (`dataplane`, `rdma`), restores (`restorer`) | `node`, `safe_fs`, `workdir`, `error` |
//! | `node` | hardware discovery (`discover`, `nvml`), the node's load and free space (`load`) | `error` |
//! | `workdir` | the work directory's layout and how a file in it is written (whole, private) | `safe_fs`, `error` |
//! | `safe_fs` | the one rule for what the agent touches as root in a directory a rank can write (handles, no links) and the one check of a checkpoint file name | `error` |
//! | `error` | the one error type | nothing |
//!
//! The binary `motley-agent` (src/bin/motley-agent) wires them to the coordinator; it runs
//! each rank under `ranks::wrapper`.

pub mod checkpoints;
pub mod error;
pub mod logs;
pub mod net;
pub mod node;
pub mod profiler;
pub mod ranks;
pub mod safe_fs;
pub mod workdir;

/// The rule for tests that need root, shared with the integration tests (tests/common).
#[cfg(test)]
#[path = "../tests/common/root_only.rs"]
#[allow(dead_code)]
pub(crate) mod root_only;

pub use error::{AgentError, Result};
