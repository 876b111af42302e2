//! The integration tests of the `motley` CLI, one binary: a binary per file linked the whole
//! dependency tree again for each (BENCHMARKS "A fresh clone on a quiet machine": the workspace's
//! crates and tests built in 317 s as one binary per crate, 438 s as 64). Each file is a module;
//! nextest still runs every test in a process of its own.

mod common;
mod dev_cli;
mod model_cli;
mod net_cli;
mod network_cli;
mod parser_props;
mod pipeline_period_cli;
mod plan_cli;
mod precision_cli;
mod provision_cli;
mod remote_cli;
mod restore_cli;
mod seq_len_cli;
mod svg_cli;
