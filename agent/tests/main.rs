//! The integration tests of the agent, one binary: a binary per file linked the whole
//! dependency tree again for each (BENCHMARKS "A fresh clone on a quiet machine": the workspace's
//! crates and tests built in 317 s as one binary per crate, 438 s as 64). Each file is a module;
//! nextest still runs every test in a process of its own.

mod agent_cli;
mod agent_ranks;
mod by_path_scan;
mod common;
mod dataplane;
mod dataplane_limits;
mod emulation;
mod hostile_rank_files;
mod hostile_ranks;
mod lease;
mod net_heartbeat;
mod private_install;
mod probe;
mod rank_probe;
mod restore;
mod tiers;
