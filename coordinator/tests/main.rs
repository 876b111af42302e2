//! The integration tests of the coordinator, one binary: a binary per file linked the whole
//! dependency tree again for each (BENCHMARKS "A fresh clone on a quiet machine": the workspace's
//! crates and tests built in 317 s as one binary per crate, 438 s as 64). Each file is a module;
//! nextest still runs every test in a process of its own.

mod agent_tls_e2e;
mod agents_e2e;
mod cluster_e2e;
mod common;
mod control_e2e;
mod curves_e2e;
mod dashboard_e2e;
mod dataplane_e2e;
mod ha_e2e;
mod job_events_e2e;
mod keep_going_e2e;
mod net_e2e;
mod otlp_e2e;
mod profiles_e2e;
mod replan_e2e;
mod reports_conformance;
mod rest_e2e;
mod store_cluster;
mod store_conformance;
