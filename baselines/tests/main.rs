//! The integration tests of the research baselines, one binary: a binary per file linked the whole
//! dependency tree again for each (BENCHMARKS "A fresh clone on a quiet machine": the workspace's
//! crates and tests built in 317 s as one binary per crate, 438 s as 64). Each file is a module;
//! nextest still runs every test in a process of its own.

mod common_espresso;
mod espresso_cli;
mod espresso_estimator;
mod espresso_input;
mod espresso_placer;
mod espresso_search;
mod metis_cli;
mod metis_parity;
mod metis_search;
