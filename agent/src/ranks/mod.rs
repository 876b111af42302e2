//! The ranks this node runs: the `supervisor` (launch, watch, report, stop, adopt after an
//! agent restart), the records it leaves on disk (`rankfiles`), the process groups it signals
//! (`group`), the `wrapper` each rank runs under (the agent's own executable, held open:
//! `wrapper_exe`) and its dead-man switch (`lease`), each rank's
//! cgroup (`cgroup`), what of the agent's environment it inherits (`environment`), whom it runs as (`users`) and the preemption notices it reads (`notice`).
//!
//! The room may call `checkpoints` (where ranks write checkpoints, what a launch restores),
//! `workdir` and `error`; nothing below calls into it.
//!
//! Inside, arrows run: `supervisor` -> every other file; `wrapper` -> `lease`, `cgroup`;
//! `lease` -> `group`; `rankfiles`, `notice` and `wrapper_exe` -> `users`.

pub mod cgroup;
mod cgroup_name;
pub mod confine;
pub mod cpu_share;
pub mod environment;
pub mod group;
pub mod lease;
pub mod membership;
pub mod notice;
pub mod rankfiles;
pub mod supervisor;
pub mod users;
pub mod wrapper;
pub mod wrapper_exe;

pub use supervisor::Supervisor;

/// A rank's stop grace is this many base intervals: the supervisor's SIGTERM to SIGKILL, and
/// the same grace in the lease the wrapper reads (`lease::Lease::grace_ms`).
pub const GRACE_INTERVALS: u32 = 5;
