//! The integration tests of the planner, one binary: a binary per file linked the whole
//! dependency tree again for each (BENCHMARKS "A fresh clone on a quiet machine": the workspace's
//! crates and tests built in 317 s as one binary per crate, 438 s as 64). Each file is a module;
//! nextest still runs every test in a process of its own.

mod baseline_plans;
mod common;
mod contention;
mod exactness;
mod limits;
mod micro_batch;
mod network;
mod provision;
mod restore;
mod seq_len;
